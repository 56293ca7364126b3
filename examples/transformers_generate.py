"""A Hugging Face Llama generating through hal: ``attn_implementation="hal"`` and a hal paged KV cache.

The model is a small random Llama built from a config (nothing is
downloaded): grouped-query attention, a few layers. A batch of prompts of
different lengths (left-padded) is generated greedily twice: once with
transformers' ``eager`` attention, once with ``"hal"``, where every layer
writes its keys and values into a :class:`hal_core.torch.transformers.HalPagedCache`
through ``hal::write_kv_cache`` and attends with ``hal::paged_attention``.

    python examples/transformers_generate.py
    python examples/transformers_generate.py --layers 4 --new-tokens 16 --seed 3 --block-size 8

Prints each prompt's tokens from both runs and the cache's usage; exits 1
when hal's tokens differ from eager's.

``--prefill N`` instead times the prefill of one N-token prompt (a larger
model: 8 heads / 2 KV heads of 64, hidden 512) through hal's variable-length
attention, one call per layer, against the same model with transformers'
``sdpa`` attention: the fastest of ``--repeat`` interleaved runs each, the
ratio, and the largest logit difference (exits 1 beyond the attention
tolerance).

    python examples/transformers_generate.py --prefill 2048 --layers 4
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hal_core.torch.transformers as hal_hf
from hal_core.testing.tolerances import tolerance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=10)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[12, 7, 3])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill", type=int, metavar="N", help="time an N-token prefill: hal against sdpa")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side with --prefill (the fastest counts)")
    args = parser.parse_args(argv)
    if args.prefill is not None:
        return prefill(args)

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=hal_hf.ATTN_IMPLEMENTATION).eval()

    width = max(args.prompt_lens)
    ids = torch.randint(0, config.vocab_size, (len(args.prompt_lens), width))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(args.prompt_lens):
        mask[row, width - n:] = 1  # left padding: the pads are never written to hal's cache

    longest = width + args.new_tokens
    blocks = len(args.prompt_lens) * -(-longest // args.block_size)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=blocks, block_size=args.block_size, dtype=model.dtype)
    settings = dict(attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hal_tokens = model.generate(ids, past_key_values=cache, **settings)[:, width:]
        usage = cache.paged.usage()
        cache.close()
        model.set_attn_implementation("eager")
        eager_tokens = model.generate(ids, **settings)[:, width:]

    print(f"Llama, {args.layers} layers, 4 heads / 2 KV heads, random weights (seed {args.seed}); "
          f"hal cache: {usage.tokens} tokens in {usage.used_blocks}/{usage.total_blocks} blocks of {args.block_size}")
    for row, n in enumerate(args.prompt_lens):
        same = "same" if torch.equal(hal_tokens[row], eager_tokens[row]) else "DIFFERENT"
        print(f"  prompt {row} ({n} tokens): {same}")
        print(f"    hal:   {hal_tokens[row].tolist()}")
        print(f"    eager: {eager_tokens[row].tolist()}")
    if not torch.equal(hal_tokens, eager_tokens):
        print("hal's tokens differ from eager's", file=sys.stderr)
        return 1
    print("hal's greedy tokens match eager's")
    return 0


def prefill(args: argparse.Namespace) -> int:
    """Time one ``args.prefill``-token prompt through hal and through ``sdpa`` on the same model."""
    if args.prefill < 1 or args.repeat < 1:
        print("--prefill and --repeat must be at least 1", file=sys.stderr)
        return 2
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=args.prefill + 16, initializer_range=0.05)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, config.vocab_size, (1, args.prefill))
    blocks = -(-args.prefill // args.block_size)
    times: dict[str, float] = {"hal": float("inf"), "sdpa": float("inf")}
    logits: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for _ in range(args.repeat):
            for side in ("sdpa", "hal"):
                model.set_attn_implementation(side if side == "sdpa" else hal_hf.ATTN_IMPLEMENTATION)
                cache = (hal_hf.HalPagedCache(model.config, num_blocks=blocks, block_size=args.block_size,
                                              dtype=model.dtype) if side == "hal" else None)
                start = time.perf_counter()
                result = model(ids, past_key_values=cache, use_cache=True)
                times[side] = min(times[side], time.perf_counter() - start)
                logits[side] = result.logits
                if cache is not None:
                    cache.close()
    diff = (logits["hal"] - logits["sdpa"]).abs().max().item()
    scale = logits["sdpa"].abs().max().item()
    print(f"Llama, {args.layers} layers, 8 heads / 2 KV heads of 64, hidden 512, random weights (seed {args.seed}); "
          f"one {args.prefill}-token prompt, {torch.get_num_threads()} torch threads, fastest of {args.repeat}")
    for side in ("sdpa", "hal"):
        print(f"  {side:5s} prefill {times[side] * 1e3:9.1f} ms  {args.prefill / times[side]:9.0f} tokens/s")
    print(f"  hal is {times['sdpa'] / times['hal']:.2f}x sdpa's prefill speed; largest logit difference {diff:.2e} "
          f"(logits up to {scale:.2f})")
    atol, rtol = tolerance("attention", "fp32")
    if diff > atol * scale + rtol * scale:
        print("hal's logits differ from sdpa's beyond the attention tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
