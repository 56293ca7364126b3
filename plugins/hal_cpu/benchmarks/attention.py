"""Variable-length paged attention against the machine's limits and torch, as ratios measured in one run.

Usage: ``python plugins/hal_cpu/benchmarks/attention.py [--quick] [--repeat N] [--json PATH]``

- prefill: one causal prompt (32 query / 8 KV heads, head 128, block 16) in
  GFLOP/s (4 * head_size per visible (query, key) pair and head), against
  numpy's fp32 matmul and ``torch.nn.functional.scaled_dot_product_attention(
  is_causal=True)`` on the same sizes in contiguous tensors;
- mixed: one engine step, 4 prompt chunks of 512 tokens after 0, 1k, 2k and
  3k tokens of context plus 60 decoding sequences at 2k, against the roofline
  bound max(bytes / copy bandwidth, FLOPs / BLAS rate);
- window: a 1024-token sliding window on an 8192-token prompt against the
  same prompt fully causal;
- decode: one token per sequence (32 x 4096, 1 x 32768) against the copy
  bandwidth.

``--quick`` shrinks the prompts (2048 tokens, window 512 on 4096) for a smoke
run. Timings on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from hal_cpu import _native
from hal_cpu.ops import paged_attention

sys.path.insert(0, str(Path(__file__).parent))
from measure import DTYPES, blas_rate, copy_bandwidth, timed  # the sibling script's helpers

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16


def _batch(rng: np.random.Generator, steps: list[tuple[int, int]], dtype: str) -> dict[str, Any]:
    """A paged cache and query rows for sequences of (new tokens, context length incl. them), blocks shuffled."""
    dt = DTYPES[dtype]
    blocks = [-(-length // BLOCK) for _, length in steps]
    total = sum(blocks)
    order = rng.permutation(total).astype(np.int32)
    table = np.zeros((len(steps), max(blocks)), dtype=np.int32)
    first = 0
    for s, n in enumerate(blocks):
        table[s, :n] = order[first:first + n]
        first += n
    shape = (total, KV_HEADS, BLOCK, HEAD_SIZE)
    q_lens = [n for n, _ in steps]
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return {"query": rng.standard_normal((int(starts[-1]), HEADS, HEAD_SIZE), dtype=np.float32).astype(dt),
            "key_cache": rng.standard_normal(shape, dtype=np.float32).astype(dt),
            "value_cache": rng.standard_normal(shape, dtype=np.float32).astype(dt),
            "block_tables": table, "seq_lens": np.array([n for _, n in steps], dtype=np.int32),
            "query_start_loc": starts, "max_query_len": max(q_lens)}


def _run(batch: dict[str, Any], **options: Any) -> Any:
    keys = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
    return paged_attention.attend(*(batch[k] for k in keys), HEAD_SIZE ** -0.5,
                                  query_start_loc=batch["query_start_loc"], max_query_len=batch["max_query_len"],
                                  **options)


def _pairs(steps: list[tuple[int, int]], window: int | None = None) -> int:
    """Visible (query, key) pairs of one head."""
    total = 0
    for n, length in steps:
        pos = np.arange(length - n, length, dtype=np.int64)
        total += int((np.minimum(pos + 1, window) if window else pos + 1).sum())
    return total


def _kv_bytes(steps: list[tuple[int, int]], itemsize: int) -> int:
    return sum(2 * length * KV_HEADS * HEAD_SIZE * itemsize for _, length in steps)


def _torch_causal(torch: Any, dtype: str, length: int, repeat: int) -> float:
    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    q = torch.randn(1, HEADS, length, HEAD_SIZE, dtype=tdtype)
    k = torch.randn(1, KV_HEADS, length, HEAD_SIZE, dtype=tdtype)
    v = torch.randn(1, KV_HEADS, length, HEAD_SIZE, dtype=tdtype)
    fn = torch.nn.functional.scaled_dot_product_attention
    with torch.inference_mode():
        return timed(lambda: fn(q, k, v, is_causal=True, enable_gqa=True), repeat)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    native = _native.load()
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    blas, copy_bw = blas_rate(args.repeat), copy_bandwidth(native.threads, args.repeat)
    amx = bool(native.lib.hal_cpu_attention_amx())
    print(f"isa {native.isa}, AMX {'on' if amx else 'off'}, threads {native.threads}: fp32 BLAS {blas / 1e9:.1f} "
          f"GFLOP/s, copy {copy_bw / 1e9:.1f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []

    def report(row: dict[str, Any]) -> None:
        rows.append(row)
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    prompt = 2048 if args.quick else 4096
    for dtype in ("fp32", "bf16", "fp16"):
        steps = [(prompt, prompt)]
        batch = _batch(rng, steps, dtype)
        t = timed(lambda batch=batch: _run(batch), args.repeat)
        flops = 4 * HEAD_SIZE * HEADS * _pairs(steps)
        row: dict[str, Any] = {"case": "prefill", "dtype": dtype, "tokens": prompt, "ms": t * 1e3,
                               "GFLOP/s": flops / t / 1e9, "of_blas": flops / t / blas}
        del batch
        if torch is not None:
            row["vs_torch"] = _torch_causal(torch, dtype, prompt, args.repeat) / t
        report(row)

    mixed = [(512, 512 + 1024 * c) for c in range(4)] + [(1, 2048)] * 60
    for dtype in ("fp32", "bf16"):
        batch = _batch(rng, mixed, dtype)
        t = timed(lambda batch=batch: _run(batch), args.repeat)
        flops = 4 * HEAD_SIZE * HEADS * _pairs(mixed)
        nbytes = _kv_bytes(mixed, batch["key_cache"].itemsize)
        bound = max(nbytes / copy_bw, flops / blas)
        report({"case": "mixed", "dtype": dtype, "ms": t * 1e3, "GB/s": nbytes / t / 1e9, "GFLOP/s": flops / t / 1e9,
                "of_roofline": bound / t})
        del batch

    long, window = (4096, 512) if args.quick else (8192, 1024)
    batch = _batch(rng, [(long, long)], "bf16")
    full = timed(lambda batch=batch: _run(batch), max(1, args.repeat - 1))
    slid = timed(lambda batch=batch: _run(batch, window=window), args.repeat)
    report({"case": "window", "dtype": "bf16", "tokens": long, "window": window, "full_ms": full * 1e3,
            "window_ms": slid * 1e3, "speedup": full / slid,
            "pair_ratio": _pairs([(long, long)]) / _pairs([(long, long)], window)})
    del batch

    for seqs, length in [(32, 4096), (1, 32768)]:
        for dtype in ("fp16", "bf16", "fp32"):
            steps = [(1, length)] * seqs
            batch = _batch(rng, steps, dtype)
            t = timed(lambda batch=batch: _run(batch), args.repeat)
            nbytes = _kv_bytes(steps, batch["key_cache"].itemsize)
            report({"case": "decode", "dtype": dtype, "shape": f"{seqs}x{length}", "ms": t * 1e3,
                    "GB/s": nbytes / t / 1e9, "of_copy_bw": nbytes / t / copy_bw})
            del batch
    if args.json:
        args.json.write_text(json.dumps({"isa": native.isa, "amx": amx, "blas_flops": blas, "copy_bw": copy_bw,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
