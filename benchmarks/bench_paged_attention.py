"""paged_attention on the CUDA backend: effective K/V bandwidth over the measured copy bandwidth.

Cases (fp16, 32 query heads, 8 KV heads, head size 128, block size 16):

- batch 32 x 4096 tokens (target ratio >= 0.8),
- batch 1 x 32768 tokens (split-KV, target ratio >= 0.7).

``ratio = (KV bytes / t_attention) / (2 * N / t_copy)``, both measured in this
run (see docs/benchmarks.md). ``t_attention`` is the device time of the op's
kernels, replayed from a CUDA graph captured around one call; the time of
plain Python calls (dispatch included) is reported beside it. The index
checks stay at their default: on device arrays the kernels do them, with no
host read.

``graph_decode`` (in the JSON): one decode step -- ``write_kv_cache`` of the
new tokens, then ``paged_attention`` -- captured once in a CUDA graph and
replayed for the following steps with the index arrays updated in place,
each replay checked against the float64 reference; then one replay with a
bad block id, which must zero that sequence and raise ``ArgumentError``
naming ``block_tables`` at :func:`hal_core.check_errors`.

Usage: ``python benchmarks/bench_paged_attention.py [--json PATH] [--repeat N]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_bench import (
    capture_graph,
    capture_private,
    device_summary,
    l2_flusher,
    measure_copy_bandwidth,
    median_ms,
    paged_attention_kv_bytes,
    ratio,
    time_ms,
    verdict,
    write_json,
)

CASES = (
    {"name": "batch32x4096", "num_seqs": 32, "seq_len": 4096, "target": 0.8},
    {"name": "batch1x32768", "num_seqs": 1, "seq_len": 32768, "target": 0.7},
)
HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16


def run_case(cp: Any, be: Any, case: dict[str, Any], copy_gbps: float, repeat: int, flush: Any) -> dict[str, Any]:
    from hal_cupy.ops import _paged_attention_rules as rules

    from hal_core.ops import OPS

    rng = np.random.default_rng(1234)
    num_seqs, seq_len = case["num_seqs"], case["seq_len"]
    blocks_per_seq = -(-seq_len // BLOCK)
    num_blocks = num_seqs * blocks_per_seq
    table = rng.permutation(num_blocks).astype(np.int32).reshape(num_seqs, blocks_per_seq)
    q = cp.asarray(rng.standard_normal((num_seqs, HEADS, HEAD_SIZE)).astype(np.float16))
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_SIZE)
    k_cache = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    v_cache = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    tables, lens = cp.asarray(table), cp.full((num_seqs,), seq_len, dtype=cp.int32)
    out = cp.empty_like(q)
    scale = HEAD_SIZE ** -0.5

    def step() -> None:
        be.ops.paged_attention(q, k_cache, v_cache, tables, lens, scale=scale, out=out)

    # Correctness spot check on one sequence against the float64 reference.
    step()
    s = 0
    used = table[s]
    ref = OPS["paged_attention"].reference(dict(
        query=q[s:s + 1].get(), key_cache=k_cache[cp.asarray(used)].get(), value_cache=v_cache[cp.asarray(used)].get(),
        block_tables=np.arange(blocks_per_seq, dtype=np.int32)[None, :], seq_lens=np.array([seq_len], np.int32),
        scale=scale))
    err = float(np.linalg.norm(out[s:s + 1].get().astype(np.float64) - ref) / np.linalg.norm(ref))

    call_ms = median_ms(time_ms(cp, step, warmup=5, repeat=repeat, before=flush))
    replay, graph_error = capture_graph(cp, step)
    samples = time_ms(cp, replay or step, warmup=2, repeat=repeat, before=flush)
    ms = median_ms(samples)
    kv_bytes = paged_attention_kv_bytes([seq_len] * num_seqs, KV_HEADS, HEAD_SIZE, 2)
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    value = ratio(gbps, copy_gbps)
    variant = rules.choose_paged_attention_variant(num_seqs, KV_HEADS, seq_len,
                                                   be.device(0).capabilities.compute_units, num_heads=HEADS)
    return {**case, "variant": variant, "kv_bytes": kv_bytes, "ms": ms, "ms_samples": samples,
            "timed": "graph replay" if replay else "python calls", "graph_error": graph_error,
            "call_ms": call_ms, "call_ratio": ratio(kv_bytes / (call_ms * 1e-3) / 1e9, copy_gbps),
            "effective_gbps": gbps, "ratio": value, "verdict": verdict(value, case["target"]),
            "rel_error": err, "correct": err < 2e-3}


def graph_decode(cp: Any, be: Any, steps: int = 4) -> dict[str, Any]:
    """Capture one decode step (write the new K/V, attend) in a CUDA graph; replay it for ``steps`` steps."""
    import hal_core
    from hal_core.ops import OPS

    rng = np.random.default_rng(99)
    num_seqs, heads, kv_heads, head_size, block = 8, 32, 8, 128, 16
    lens = rng.integers(100, 400, num_seqs).astype(np.int32)
    max_seq_len = int(lens.max()) + steps
    per_seq = -(-max_seq_len // block)
    num_blocks = num_seqs * per_seq + 3
    table = rng.permutation(num_blocks)[: num_seqs * per_seq].astype(np.int32).reshape(num_seqs, per_seq)
    shape = (num_blocks, kv_heads, block, head_size)
    k_host = rng.standard_normal(shape).astype(np.float16)
    v_host = rng.standard_normal(shape).astype(np.float16)
    scale = head_size ** -0.5
    dev = {"k_cache": cp.asarray(k_host), "v_cache": cp.asarray(v_host), "tables": cp.asarray(table),
           "lens": cp.empty((num_seqs,), cp.int32), "slots": cp.empty((num_seqs,), cp.int64),
           "q": cp.empty((num_seqs, heads, head_size), cp.float16),
           "k": cp.empty((num_seqs, kv_heads, head_size), cp.float16),
           "v": cp.empty((num_seqs, kv_heads, head_size), cp.float16),
           "out": cp.empty((num_seqs, heads, head_size), cp.float16)}

    def step() -> None:
        be.ops.write_kv_cache(dev["k"], dev["v"], dev["k_cache"], dev["v_cache"], dev["slots"])
        be.ops.paged_attention(dev["q"], dev["k_cache"], dev["v_cache"], dev["tables"], dev["lens"], scale=scale,
                               out=dev["out"], max_seq_len=max_seq_len)

    def next_inputs() -> dict[str, np.ndarray]:
        """The next token of every sequence, written into the captured buffers in place (no new allocation)."""
        lens[:] += 1
        pos = lens - 1
        host = {"lens": lens.copy(), "slots": (table[np.arange(num_seqs), pos // block].astype(np.int64) * block
                                               + pos % block),
                "q": rng.standard_normal((num_seqs, heads, head_size)).astype(np.float16),
                "k": rng.standard_normal((num_seqs, kv_heads, head_size)).astype(np.float16),
                "v": rng.standard_normal((num_seqs, kv_heads, head_size)).astype(np.float16)}
        for name, value in host.items():
            dev[name].set(value)
        k_host[table[np.arange(num_seqs), pos // block], :, pos % block] = host["k"]
        v_host[table[np.arange(num_seqs), pos // block], :, pos % block] = host["v"]
        return host

    def reference(host: dict[str, np.ndarray]) -> np.ndarray:
        return OPS["paged_attention"].reference(dict(query=host["q"], key_cache=k_host, value_cache=v_host,
                                                     block_tables=table, seq_lens=host["lens"], scale=scale))

    stream = cp.cuda.get_current_stream()
    host = next_inputs()
    replay, why, pool = capture_private(cp, step)  # runs the step eagerly first (kernels compiled, flag made)
    result: dict[str, Any] = {"captured": replay is not None, "graph_error": why, "steps": 0, "rel_errors": []}
    if replay is None:
        return result
    errors = []
    for i in range(steps):
        if i:
            host = next_inputs()
        replay()
        stream.synchronize()
        hal_core.check_errors()  # the kernels' index checks found nothing
        want = reference(host)
        errors.append(float(np.linalg.norm(dev["out"].get().astype(np.float64) - want) / np.linalg.norm(want)))
    result.update(steps=steps, rel_errors=errors, correct=max(errors) < 2e-3)
    # A bad block id in sequence 1, written into the captured table: zeros there, ArgumentError at check_errors.
    saved = int(table[1, 0])
    dev["tables"][1, 0] = num_blocks + 5
    replay()
    stream.synchronize()
    try:
        hal_core.check_errors()
        reported = ""
    except hal_core.ArgumentError as exc:
        reported = str(exc)
    dev["tables"][1, 0] = saved
    result.update(bad_index_reported="'block_tables'" in reported, bad_index_message=reported,
                  bad_sequence_zero=not dev["out"][1].get().any(), pool_bytes=int(pool.total_bytes()))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args(argv)
    import cupy as cp

    import hal_core

    be = hal_core.get_backend("cuda")
    with cp.cuda.Stream(non_blocking=True):  # graphs cannot be captured on the legacy default stream
        flush = l2_flusher(cp, be.device(0).capabilities.l2_bytes)
        copy = measure_copy_bandwidth(cp)
        results = [run_case(cp, be, case, copy["gbps"], args.repeat, flush) for case in CASES]
        decode = graph_decode(cp, be)
    payload = {"benchmark": "paged_attention", "device": device_summary(cp), "copy": copy, "cases": results,
               "graph_decode": decode}
    if args.json:
        write_json(args.json, payload)
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s (read + write)")
    for r in results:
        print(f"paged_attention {r['name']:>14} {r['variant']:>6}: {r['ms']:.3f} ms  {r['effective_gbps']:.0f} GB/s  "
              f"ratio {r['ratio']:.2f} (target {r['target']}) {r['verdict']}  [{r['timed']}; python calls "
              f"{r['call_ms']:.3f} ms, ratio {r['call_ratio']:.2f}]  err {r['rel_error']:.1e}")
    print(f"graph decode step: captured {decode['captured']} {decode['graph_error']}; {decode['steps']} replays, "
          f"errors {[f'{e:.1e}' for e in decode['rel_errors']]}; bad block id reported "
          f"{decode.get('bad_index_reported')}, its sequence zero {decode.get('bad_sequence_zero')}")
    return payload


if __name__ == "__main__":
    main()
