"""Serve a Llama, Mistral, Qwen3, Mixtral or Qwen3-MoE checkpoint with hal_core.engine: every op on hal, no torch.

    python examples/engine_generate.py                         # a random 4-layer model written to a temp folder
    python examples/engine_generate.py --model DIR --bits 4    # a Hugging Face folder: config.json + safetensors
    python examples/engine_generate.py --temperature 0.8 --top-p 0.9 --seed 3

Prompts are random token ids (the engine takes ids; tokenize with your
tokenizer). Requests arrive together and are served with continuous
batching; it prints each request's new tokens, the decode rate and the
weights' bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import hal_core
from hal_core.arrays import BFLOAT16
from hal_core.engine import Engine, SamplingParams


def write_random_llama(folder: Path, *, layers: int, hidden: int, vocab: int, seed: int) -> None:
    """A random Llama checkpoint (bf16 safetensors + config.json) written with numpy alone."""
    rng = np.random.default_rng(seed)
    heads, kv_heads, inter = hidden // 64, max(1, hidden // 256), 2 * hidden + hidden // 2
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 64,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": False}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for n in range(layers):
        p = f"model.layers.{n}"
        shapes.update({f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,),
                       f"{p}.self_attn.q_proj.weight": (heads * 64, hidden),
                       f"{p}.self_attn.k_proj.weight": (kv_heads * 64, hidden),
                       f"{p}.self_attn.v_proj.weight": (kv_heads * 64, hidden),
                       f"{p}.self_attn.o_proj.weight": (hidden, heads * 64),
                       f"{p}.mlp.gate_proj.weight": (inter, hidden), f"{p}.mlp.up_proj.weight": (inter, hidden),
                       f"{p}.mlp.down_proj.weight": (hidden, inter)})
    header, blobs, offset = {}, [], 0
    for name, shape in shapes.items():
        if len(shape) == 1:
            value = 1 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * (0.5 if "embed" in name else 1 / np.sqrt(shape[1]))
        blob = value.astype(BFLOAT16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        for blob in blobs:
            handle.write(blob)
    (folder / "config.json").write_text(json.dumps(config, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: a random model)")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="hal-engine-") as scratch:
        folder = args.model
        if folder is None:
            folder = Path(scratch)
            write_random_llama(folder, layers=4, hidden=512, vocab=4096, seed=args.seed)
            print(f"a random Llama (4 layers, hidden 512, vocab 4096) in {folder}")
        backend = hal_core.get_backend()
        started = time.perf_counter()
        engine = Engine(folder, backend=backend, bits=args.bits, dtype=args.dtype,
                        progress=lambda line: print(f"  loading {line}", end="\r"))
        moe = engine.config.moe
        what = ("read per step" if moe is None else
                f"(every expert: a token reads {moe.top_k} of the {moe.num_experts} of each MoE layer)")
        print(f"\nloaded on {backend.name} in {time.perf_counter() - started:.1f} s: "
              f"{engine.weights.nbytes() / 2**20:.1f} MiB of weights {what}")
        rng = np.random.default_rng(args.seed + 1)
        prompts = [rng.integers(0, engine.config.vocab_size, args.prompt_len + 3 * i).tolist()
                   for i in range(args.requests)]
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        with engine:
            engine.generate(prompts[:1], max_new_tokens=2, sampling=sampling, stop_token_ids=())  # warm-up
            started = time.perf_counter()
            outs = engine.generate(prompts, max_new_tokens=args.new_tokens, sampling=sampling, stop_token_ids=())
            elapsed = time.perf_counter() - started
        for n, out in enumerate(outs):
            print(f"  request {n}: prompt {len(prompts[n])} tokens -> {out}")
        new = sum(len(o) for o in outs)
        print(f"{new} new tokens for {len(outs)} requests in {elapsed:.2f} s ({new / elapsed:.1f} tokens/s, "
              "prefill included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
