"""Variable-length paged attention of ``paged_attention.cu``, compiled for the CPU (host-compiled kernels).

Decode-only, prefill-only and mixed batches (``query_start_loc``), with sliding windows, softcap, sinks, ALiBi
and strided cache views, single-pass and split-KV + reduce, at warp 32 and wavefront 64.  Launches come from the
plugin's pure rules (``_paged_attention_rules``); inputs from ``hal_core``'s builder (random distinct blocks in
random order, garbage table entries past each sequence's last block, NaN in every cache slot no sequence uses),
fresh per run (seed printed); results against the float64 reference with ``hal_core.testing.tolerances``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hal_cupy.ops import _paged_attention_rules as pa_rules
from host_compiled.harness import HostKernelBuilder, HostModule

from hal_core.ops import OPS
from hal_core.ops.paged_attention import paged_attention_inputs
from hal_core.testing.inputs import assert_close

DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}
#: Compute units given to the host rules: an H100's 132, so that small grids split when a partition is short.
MANY_CUS = 132
#: Error-flag codes of hal_index_checks.cuh.
ERR_BLOCK_TABLES, ERR_SEQ_LENS, ERR_QUERY_START_LOC = 1, 2, 8


@dataclass(frozen=True)
class VarlenCase:
    dtype: str
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...] | None  # None: decode (no query_start_loc)
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    alibi: bool = False
    strided: bool = False
    partition_size: int = pa_rules.PA_PARTITION_SIZE  # below the longest length: split-KV
    warp_size: int = 32

    @property
    def mode(self) -> str:
        if self.query_lens is None:
            return "decode"
        return "prefill" if min(self.query_lens) > 1 else "mixed"

    @property
    def id(self) -> str:
        extras = [f"w{self.window}" if self.window else "", f"cap{self.softcap:g}" if self.softcap else "",
                  "sinks" if self.sinks else "", "alibi" if self.alibi else "", "strided" if self.strided else "",
                  f"part{self.partition_size}" if self.partition_size != pa_rules.PA_PARTITION_SIZE else "",
                  f"warp{self.warp_size}" if self.warp_size != 32 else ""]
        q = "" if self.query_lens is None else "-q" + "_".join(map(str, self.query_lens))
        return "-".join(x for x in (f"{self.mode}-{self.dtype}-hs{self.head_size}-h{self.num_heads}kv"
                                    f"{self.num_kv_heads}-bs{self.block_size}-len"
                                    + "_".join(map(str, self.seq_lens)) + q, *extras) if x)


BASE_CASES = [
    # prefill only: a whole prompt and a prompt chunk over earlier context
    VarlenCase("fp32", 64, 4, 4, 16, (37, 20), (37, 5)),
    VarlenCase("fp16", 256, 32, 8, 16, (20, 9), (20, 4), alibi=True),
    VarlenCase("bf16", 96, 9, 3, 16, (24, 5, 10), (24, 0, 3), sinks=True, alibi=True),  # a sequence without rows
    # mixed: decodes beside prompt chunks
    VarlenCase("fp16", 128, 8, 2, 16, (50, 33, 1, 70), (1, 33, 1, 6), window=16),
    VarlenCase("bf16", 80, 9, 3, 128, (130, 9, 200), (3, 9, 1), softcap=30.0, sinks=True, partition_size=64),
    VarlenCase("bf16", 128, 4, 4, 128, (300, 40), (2, 40), window=100, strided=True, partition_size=128),
    VarlenCase("fp32", 256, 8, 2, 128, (100, 1), (4, 1), window=7, softcap=5.0, partition_size=32),
    # decode with the variants
    VarlenCase("fp32", 96, 8, 2, 16, (0, 45, 300), None, window=50, softcap=20.0, sinks=True, alibi=True,
               partition_size=64),
    VarlenCase("fp16", 64, 32, 8, 16, (17, 90), None, strided=True),
    VarlenCase("fp16", 80, 4, 4, 128, (129, 3), None, alibi=True, strided=True),
]
CASES = [c for case in BASE_CASES for c in (case, replace(case, warp_size=64))]


def _strided(cache: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A K/V pair of views into one buffer ``[num_blocks, 2, num_kv_heads, block_size, head_size + pad]``
    (NaN in the padding and in the other half): three strides unlike a C-contiguous cache's."""
    pad = 16 // cache.itemsize
    num_blocks, nkv, bs, hs = cache.shape
    big = np.full((num_blocks, 2, nkv, bs, hs + pad), np.nan, cache.dtype)
    del rng
    return big[:, 0, :, :, :hs], big[:, 1, :, :, :hs]


def _inputs(case: VarlenCase, rng: np.random.Generator) -> dict[str, Any]:
    args = paged_attention_inputs(rng, seq_lens=case.seq_lens, num_heads=case.num_heads,
                                  num_kv_heads=case.num_kv_heads, head_size=case.head_size,
                                  block_size=case.block_size, dtype=case.dtype, query_lens=case.query_lens)
    if case.strided:
        key, value = _strided(args["key_cache"], rng)
        key[...], value[...] = args["key_cache"], args["value_cache"]
        args["key_cache"], args["value_cache"] = key, value
    if case.window:
        args["window"] = case.window
    if case.softcap:
        args["softcap"] = case.softcap
    if case.sinks:
        args["sinks"] = rng.uniform(-2.0, 3.0, case.num_heads).astype(np.float32)
    if case.alibi:
        args["alibi_slopes"] = (2.0 ** -rng.uniform(0.5, 8.0, case.num_heads)).astype(np.float32)
    return args


def _strides(cache: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x) // cache.itemsize for x in cache.strides[:3])


def _plan(case: VarlenCase, args: dict[str, Any]) -> tuple[str, list[Any], int, int]:
    """(variant, launches, max_query_len, max_seq_len) from the plugin's rules."""
    num_seqs, num_tokens = len(case.seq_lens), args["query"].shape[0]
    max_query_len = 1 if case.query_lens is None else max(1, max(case.query_lens))
    max_len = max(case.seq_lens)
    variant = pa_rules.choose_paged_attention_variant(
        num_seqs, case.num_kv_heads, max_len, MANY_CUS, case.num_heads, case.partition_size,
        max_query_len=max_query_len, num_tokens=num_tokens, head_size=case.head_size)
    launches = pa_rules.paged_attention_launches(variant, num_seqs, case.num_heads, case.num_kv_heads, max_len,
                                                 case.partition_size, max_query_len=max_query_len,
                                                 num_tokens=num_tokens)
    return variant, launches, max_query_len, max_len


def _kernel_args(case: VarlenCase, args: dict[str, Any], qsl: np.ndarray | None, max_query_len: int) -> tuple[Any, ...]:
    """The attention kernels' arguments after ``out`` (and the tensor-core split's workspaces), in their order."""
    q, kc, vc, bt, sl = (args[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))
    return (q, kc, vc, bt, sl, qsl, args.get("sinks"), args.get("alibi_slopes"), args["scale"],
            args.get("softcap") or 0.0, case.num_heads, case.num_kv_heads, case.block_size, bt.shape[1],
            args.get("window") or 0, q.shape[0], max_query_len, *_strides(kc), *_strides(vc))


def run_varlen(module: HostModule, case: VarlenCase, args: dict[str, Any], launches: list[Any],
               max_query_len: int, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Run the single or split+reduce launches as the op does; the output (NaN where no CTA wrote) and the flag."""
    q, kc, sl = args["query"], args["key_cache"], args["seq_lens"]
    qsl = args.get("query_start_loc") if case.query_lens is not None else None
    num_tokens, num_seqs = q.shape[0], sl.shape[0]
    common = _kernel_args(case, args, qsl, max_query_len)
    flag = np.zeros(1, np.int32)
    checks = (kc.shape[0], max_seq_len, flag)
    out = np.full(q.shape, np.nan, q.dtype)
    if len(launches) == 1:
        module.launch(launches[0], out, *common, *checks)
        return out, flag
    split, reduce = launches
    parts = pa_rules.paged_attention_partitions(max_seq_len, case.partition_size)
    assert split.grid[2] == parts and reduce.grid[1] == num_tokens
    # Workspaces need no initialisation: NaN-filled, so a read of an unwritten partition shows.
    tmp_out = np.full((num_tokens, case.num_heads, parts, case.head_size), np.nan, np.float32)
    max_logits = np.full((num_tokens, case.num_heads, parts), np.nan, np.float32)
    exp_sums = np.full_like(max_logits, np.nan)
    module.launch(split, tmp_out, max_logits, exp_sums, *common, case.partition_size, parts, *checks)
    module.launch(reduce, out, tmp_out, max_logits, exp_sums, sl, qsl, args.get("sinks"), case.num_heads, num_seqs,
                  max_query_len, case.partition_size, parts)
    return out, flag


def _module(builder: HostKernelBuilder, case: VarlenCase, max_query_len: int,
            rng: np.random.Generator) -> HostModule:
    rows = pa_rules.paged_attention_rows(case.num_heads // case.num_kv_heads, max_query_len)
    spec = pa_rules.paged_attention_spec(DTYPE_CODES[case.dtype], case.head_size, rows, case.warp_size)
    module = builder.build(spec.source, dict(spec.defines))
    module.seed(int(rng.integers(1, 2**63)))
    assert module.warp_size() == case.warp_size
    assert module.static_shared_bytes() == pa_rules.paged_attention_shared_bytes(
        DTYPE_CODES[case.dtype], case.head_size, rows, case.warp_size)
    return module


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_varlen_attention(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: VarlenCase) -> None:
    """Every query row matches the float64 reference; NaN cache slots no sequence uses are never read."""
    args = _inputs(case, host_rng)
    variant, launches, max_query_len, max_len = _plan(case, args)
    assert variant == ("split" if max_len > case.partition_size else "single")
    module = _module(host_builder, case, max_query_len, host_rng)
    out, flag = run_varlen(module, case, args, launches, max_query_len, max_len)
    assert flag[0] == 0, "valid indices must not raise the error flag"
    expected = OPS["paged_attention"].reference(args)
    assert np.isfinite(expected).all()
    assert_close(out, expected, kind="attention", dtype=case.dtype, what=case.id)


def test_varlen_window_reads_only_the_window(host_builder: HostKernelBuilder, host_rng: np.random.Generator) -> None:
    """Keys before every row's window are never loaded: NaN there leaves the result equal to the reference's on
    the unpoisoned cache."""
    case = VarlenCase("fp16", 64, 8, 2, 16, (200, 90), (3, 1), window=20)
    args = _inputs(case, host_rng)
    expected = OPS["paged_attention"].reference(args)
    kc, vc, bt = args["key_cache"], args["value_cache"], args["block_tables"]
    for s, (n, q_len) in enumerate(zip(case.seq_lens, case.query_lens or (), strict=True)):
        first = n - q_len - case.window + 1  # the first key the earliest new token sees
        for t in range(first // case.block_size * case.block_size):  # whole blocks before it
            kc[bt[s, t // case.block_size], :, t % case.block_size] = np.nan
            vc[bt[s, t // case.block_size], :, t % case.block_size] = np.nan
    variant, launches, mql, max_len = _plan(case, args)
    out, flag = run_varlen(_module(host_builder, case, mql, host_rng), case, args, launches, mql, max_len)
    assert flag[0] == 0
    assert np.isnan(kc).sum() > np.isnan(expected).sum() == 0  # the poison is there, the reference is finite
    assert_close(out, expected, kind="attention", dtype="fp16", what=variant)


BAD_CASES = [
    VarlenCase("fp32", 64, 8, 2, 16, (37, 60, 5), (4, 7, 1)),
    VarlenCase("fp16", 64, 8, 2, 16, (37, 300, 5), (4, 7, 1), partition_size=64),
]


@pytest.mark.parametrize("bad", ["q_len-beyond-seq_len", "q_len-beyond-max", "starts-decrease", "block-high",
                                 "length-beyond-max"])
@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.id)
def test_varlen_bad_index(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: VarlenCase,
                          bad: str) -> None:
    """A bad device index is never dereferenced: the flag names the argument, the spoilt sequence's rows are zeros
    (all rows, when query_start_loc itself is unusable) and every other row matches the reference."""
    args = _inputs(case, host_rng)
    good = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    variant, launches, mql, max_len = _plan(case, args)
    qsl, sl, bt = args["query_start_loc"], args["seq_lens"], args["block_tables"]
    spoilt = 1
    want = ERR_QUERY_START_LOC
    if bad == "q_len-beyond-seq_len":
        sl[1] = 6  # 7 new tokens
    elif bad == "q_len-beyond-max":
        mql = 6  # the launch is sized for at most 6 new tokens: sequence 1 has 7
        variant, launches, _, _ = _plan(case, args)
        launches = pa_rules.paged_attention_launches(variant, 3, case.num_heads, case.num_kv_heads, max_len,
                                                     case.partition_size, max_query_len=mql,
                                                     num_tokens=args["query"].shape[0])
    elif bad == "starts-decrease":
        qsl[2] = qsl[1] - 1
        spoilt = -1  # every row
    elif bad == "block-high":
        bt[1, (sl[1] - 1) // case.block_size] = args["key_cache"].shape[0]
        want = ERR_BLOCK_TABLES
    else:
        sl[1] = max_len + 1
        want = ERR_SEQ_LENS
    module = _module(host_builder, case, mql, host_rng)
    out, flag = run_varlen(module, case, args, launches, mql, max_len)
    assert flag[0] & want, f"error flag {flag[0]}, expected bit {want}"
    starts = good["query_start_loc"]
    rows = np.zeros(out.shape[0], bool)
    if spoilt < 0:
        rows[:] = True
    else:
        rows[starts[spoilt]:starts[spoilt + 1]] = True
    if variant == "single":  # the op allocates the output zeroed for prefill rows: rows no CTA could place
        out[np.isnan(out).all(axis=(1, 2)) & rows] = 0
    assert not out[rows].astype(np.float64).any(), "the spoilt rows must be zeros"
    expected = OPS["paged_attention"].reference(good)
    assert_close(out[~rows], expected[~rows], kind="attention", dtype=case.dtype, what=f"{case.id} {bad}")


# --------------------------------------------------------------------------
# Tensor cores (paged_attention_tc.cu): 16 rows per CTA, the same rows and variants
# --------------------------------------------------------------------------

#: (case, partition): None: the plugin's partition rule over MANY_CUS; 0: the rule over one compute unit (no
#: split); else this partition size (whole chunks).
TC_CASES = [
    (VarlenCase("fp16", 128, 8, 2, 16, (37, 20), (37, 5)), 0),
    (VarlenCase("bf16", 64, 4, 4, 16, (50, 33, 1, 70), (1, 33, 1, 6), window=16, sinks=True), 64),
    (VarlenCase("fp16", 256, 32, 8, 128, (20, 9), (20, 4), softcap=25.0, alibi=True), 0),
    (VarlenCase("bf16", 192, 9, 3, 16, (130, 9, 600), (3, 9, 1), softcap=30.0, sinks=True, strided=True), None),
    (VarlenCase("fp16", 128, 8, 2, 16, (0, 45, 300), None, window=50, softcap=20.0, sinks=True, alibi=True,
                strided=True), 64),
    (VarlenCase("bf16", 128, 4, 4, 32, (24, 5, 10), (24, 0, 3), window=7, alibi=True), 0),
]


def run_tc(builder: HostKernelBuilder, rng: np.random.Generator, case: VarlenCase, args: dict[str, Any],
           partition: int | None, max_query_len: int,
           max_seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """hal_paged_attention_tc (and, when split, the SIMT reduce) as the op launches them; (out, flag, parts)."""
    code = DTYPE_CODES[case.dtype]
    varlen = case.query_lens is not None or bool(case.window or case.softcap or case.alibi)
    spec = pa_rules.paged_attention_tc_spec(code, case.head_size, varlen)
    tc = builder.build(spec.source, dict(spec.defines))
    tc.seed(int(rng.integers(1, 2**63)))
    assert tc.static_shared_bytes() == pa_rules.paged_attention_tc_shared_bytes(case.head_size, varlen)
    q, kc, sl = args["query"], args["key_cache"], args["seq_lens"]
    qsl = args.get("query_start_loc") if case.query_lens is not None else None
    num_tokens, num_seqs = q.shape[0], sl.shape[0]
    if partition is None or partition == 0:
        size, parts = pa_rules.paged_attention_tc_partitions(
            num_seqs, case.num_heads, case.num_kv_heads, max_seq_len, case.head_size,
            MANY_CUS if partition is None else 1, pa_rules.paged_attention_tc_ctas_per_cu(case.head_size),
            max_query_len=max_query_len, num_tokens=num_tokens)
    else:
        size, parts = partition, -(-max_seq_len // partition)
    launches = pa_rules.paged_attention_tc_launches(num_seqs, case.num_heads, case.num_kv_heads, parts,
                                                    case.head_size, MANY_CUS, max_query_len=max_query_len,
                                                    num_tokens=num_tokens)
    common = _kernel_args(case, args, qsl, max_query_len)
    flag = np.zeros(1, np.int32)
    checks = (kc.shape[0], max_seq_len, flag)
    out = np.full(q.shape, np.nan, q.dtype)
    if parts == 1:
        tc.launch(launches[0], out, None, None, None, *common, size, 1, *checks)
        return out, flag, parts
    split, reduce = launches
    tmp_out = np.full((num_tokens, case.num_heads, parts, case.head_size), np.nan, np.float32)
    max_logits = np.full((num_tokens, case.num_heads, parts), np.nan, np.float32)
    exp_sums = np.full_like(max_logits, np.nan)
    tc.launch(split, None, tmp_out, max_logits, exp_sums, *common, size, parts, *checks)
    simt_spec = pa_rules.paged_attention_spec(code, case.head_size, case.num_heads // case.num_kv_heads)
    simt = builder.build(simt_spec.source, dict(simt_spec.defines))
    simt.launch(reduce, out, tmp_out, max_logits, exp_sums, sl, qsl, args.get("sinks"), case.num_heads, num_seqs,
                max_query_len, size, parts)
    return out, flag, parts


@pytest.mark.parametrize(("case", "partition"), TC_CASES, ids=[f"{c.id}-p{p}" for c, p in TC_CASES])
def test_tc_varlen_attention(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: VarlenCase,
                             partition: int | None) -> None:
    """The tensor-core kernel on decode, prefill and mixed batches with the variants (Q K^T and P V on the
    emulated m16n8k16, P rounded to the cache dtype) matches the float64 reference; unused NaN slots never leak."""
    args = _inputs(case, host_rng)
    max_query_len = 1 if case.query_lens is None else max(1, max(case.query_lens))
    group = case.num_heads // case.num_kv_heads
    assert pa_rules.paged_attention_uses_tensor_cores(80, DTYPE_CODES[case.dtype], group, case.head_size,
                                                      prefill=case.query_lens is not None)
    out, flag, parts = run_tc(host_builder, host_rng, case, args, partition, max_query_len, max(case.seq_lens))
    assert flag[0] == 0, "valid indices must not raise the error flag"
    assert (parts > 1) == (partition != 0)
    expected = OPS["paged_attention"].reference(args)
    assert_close(out, expected, kind="attention", dtype=case.dtype, what=f"{case.id} parts={parts}")


@pytest.mark.parametrize("bad", ["q_len-beyond-seq_len", "starts-decrease", "block-high"])
@pytest.mark.parametrize("partition", [0, 64])
def test_tc_varlen_bad_index(host_builder: HostKernelBuilder, host_rng: np.random.Generator, bad: str,
                             partition: int) -> None:
    """The tensor-core kernel's index checks: flag, zeros for the spoilt rows, the rest as the reference."""
    case = VarlenCase("fp16", 64, 8, 2, 16, (37, 300, 5), (4, 7, 1))
    args = _inputs(case, host_rng)
    good = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    qsl, sl, bt = args["query_start_loc"], args["seq_lens"], args["block_tables"]
    rows = np.zeros(args["query"].shape[0], bool)
    if bad == "q_len-beyond-seq_len":
        sl[1], want = 6, ERR_QUERY_START_LOC
        rows[qsl[1]:qsl[2]] = True
    elif bad == "starts-decrease":
        qsl[2], want = qsl[1] - 1, ERR_QUERY_START_LOC
        rows[:] = True
    else:
        bt[1, (sl[1] - 1) // case.block_size], want = args["key_cache"].shape[0], ERR_BLOCK_TABLES
        rows[qsl[1]:qsl[2]] = True
    out, flag, parts = run_tc(host_builder, host_rng, case, args, partition, 7, 300)
    assert flag[0] & want
    if parts == 1:  # the op allocates the output zeroed for prefill rows: rows no CTA could place
        out[np.isnan(out).all(axis=(1, 2)) & rows] = 0
    assert not out[rows].astype(np.float64).any(), "the spoilt rows must be zeros"
    expected = OPS["paged_attention"].reference(good)
    assert_close(out[~rows], expected[~rows], kind="attention", dtype="fp16", what=bad)
