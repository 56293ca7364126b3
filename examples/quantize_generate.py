"""A Hugging Face Llama quantized to int4 through hal, generating greedily with hal's attention and paged cache.

The float model is a small random Llama built from a config (nothing is
downloaded), or a float checkpoint directory given with ``--model`` (what
``save_pretrained`` writes). It generates greedily once in float, then
:func:`hal_core.torch.quantize_model` replaces every linear layer but
``lm_head`` by a :class:`hal_core.torch.QuantLinear` (W4A16 through
``torch.ops.hal.quantized_gemm``; ``--bits 8`` for W8A8) and it generates
again. Both runs use ``attn_implementation="hal"`` with a
:class:`hal_core.torch.transformers.HalPagedCache`, so only the linear
layers differ.

    python examples/quantize_generate.py
    python examples/quantize_generate.py --layers 8 --hidden 512 --new-tokens 32 --group-size 64
    python examples/quantize_generate.py --model path/to/float-llama --dtype bf16

Prints the model's bytes in float and int4, the process's peak memory,
tokens/s of each run and how many of the int4 model's greedy tokens match
the float model's. A random model's logits are nearly flat and its layers
amplify any perturbation, so int4's rounding (about 12% of each weight at
group size 128) flips its greedy tokens within a few steps; ``--bits 8``
keeps them longer. hal's arithmetic itself is checked against float64
models of the same quantized weights in tests/test_torch_quantize_model.py.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hal_core.torch as hal_torch
import hal_core.torch.transformers as hal_hf

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (tied tensors once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, block_size: int) -> tuple[torch.Tensor, float]:
    """Greedy tokens through hal's paged cache, and the tokens/s of the whole generate call."""
    blocks = ids.shape[0] * -(-(ids.shape[1] + new_tokens) // block_size)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=blocks, block_size=block_size, dtype=model.dtype)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    cache.close()
    return out[:, ids.shape[1]:], ids.shape[0] * new_tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a float checkpoint directory (default: a random Llama from a config)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # on a busy host, torch's OpenMP threads wait for each other
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                     attn_implementation=hal_hf.ATTN_IMPLEMENTATION)
        source = args.model
    else:
        config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=1024, initializer_range=0.1)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=hal_hf.ATTN_IMPLEMENTATION)
        source = f"a random Llama ({args.layers} layers, hidden {args.hidden}, seed {args.seed})"
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len))

    generate(model, ids[:, :2], 2, args.block_size)  # warm-up: first calls set up kernels and caches
    float_tokens, float_rate = generate(model, ids, args.new_tokens, args.block_size)
    float_bytes = model_bytes(model)
    report = hal_torch.quantize_model(model, bits=args.bits, group_size=args.group_size,
                                      progress=True)  # a progress bar on stderr
    quant_bytes = model_bytes(model)
    generate(model, ids[:, :2], 2, args.block_size)
    quant_tokens, quant_rate = generate(model, ids, args.new_tokens, args.block_size)

    same = (quant_tokens == float_tokens)
    prefix = [int(row.cumprod(0).sum()) for row in same.int()]
    print(f"{source}, {args.dtype}, batch {args.batch}, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens per row")
    print(f"quantized {len(report.quantized)} linear layers to int{args.bits} (group size {args.group_size}); "
          f"left in float: {', '.join(report.skipped) or 'none'}")
    print(f"  linear weights: {report.float_bytes / 1e6:.2f} MB float -> {report.quantized_bytes / 1e6:.2f} MB "
          f"int{args.bits} ({report.float_bytes / max(report.quantized_bytes, 1):.1f}x smaller)")
    print(f"  whole model:    {float_bytes / 1e6:.2f} MB float -> {quant_bytes / 1e6:.2f} MB; "
          f"process peak RSS {peak_rss_mb():.0f} MB")
    print(f"  tokens/s (generate, hal attention): float {float_rate:.1f}, int{args.bits} {quant_rate:.1f}")
    for row in range(args.batch):
        print(f"  row {row}: float {float_tokens[row].tolist()}")
        print(f"         int{args.bits}  {quant_tokens[row].tolist()}")
    print(f"int{args.bits} greedy tokens matching float: {int(same.sum())}/{same.numel()} "
          f"(leading run per row: {prefix})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
