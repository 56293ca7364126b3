"""Tensor-core decode attention (``paged_attention_tc.cu``), host-compiled, against the float64 reference.

The kernel source runs on the CPU through the host prelude, whose ``mma.sync`` / ``ldmatrix`` / ``cp.async``
emulation follows the PTX fragment layouts (tested in ``test_tc_emulation.py``); cp.async copies land only at
the wait that retires them, so a missing wait or barrier reads stale shared memory.  Split-KV partials are
merged by ``hal_paged_attention_reduce`` of ``paged_attention.cu``.  Every cache slot no sequence uses (the
tail of a last block, blocks past a sequence's end) is NaN.  Inputs are fresh each run (seed printed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hal_cupy import all_specializations
from hal_cupy.ops import _paged_attention_rules as pa_rules
from host_compiled.harness import HostKernelBuilder, HostModule

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.testing.tolerances import tolerance

NUMPY_DTYPES: dict[str, Any] = {"fp16": np.float16, "bf16": BFLOAT16}
DTYPE_CODES = {"fp16": 1, "bf16": 2}
#: Compute units given to the partition rule: an H100's 132 (small grids split) or 1 (no split).
MANY_CUS, ONE_CU = 132, 1


def _module(host_builder: HostKernelBuilder, spec: Any, host_rng: np.random.Generator, ftz: bool = False) -> HostModule:
    module = host_builder.build(spec.source, {**dict(spec.defines), **({"HAL_HOST_FTZ": 1} if ftz else {})})
    module.seed(int(host_rng.integers(1, 2**63)))
    return module


@dataclass(frozen=True)
class Case:
    dtype: str
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    seq_lens: tuple[int, ...]
    #: None: the plugin's partition rule with MANY_CUS; 0: the rule with one compute unit (no split);
    #: otherwise this partition size (partitions crossing blocks and chunks).
    partition: int | None = None
    nonfinite: bool = False  # NaN in one query head, +inf in one used key, NaN in one used value element
    ftz: bool = False  # run with float32 subnormals flushed to zero, as CuPy's -ftz=true build does
    #: Compute units the reduce step is sized for (its column slices); 0: one slice per head.
    reduce_cus: int = MANY_CUS

    @property
    def id(self) -> str:
        lens = "_".join(map(str, self.seq_lens))
        part = "rule" if self.partition is None else "nosplit" if self.partition == 0 else f"part{self.partition}"
        nf = ("-nonfinite" if self.nonfinite else "") + ("-ftz" if self.ftz else "")
        return (f"{self.dtype}-hs{self.head_size}-h{self.num_heads}kv{self.num_kv_heads}-bs{self.block_size}"
                f"-len{lens}-{part}{nf}")


CASES = [
    # GQA 32/8 (group 4, 12 padded rows), d=128: no split, then partitions crossing blocks and chunks.
    Case("fp16", 128, 32, 8, 16, (1, 77, 300), partition=0),
    Case("bf16", 128, 32, 8, 16, (1, 77, 300), partition=40),
    # group 8, d=64 (64-token chunks), block sizes 8 and 32.
    Case("fp16", 64, 16, 2, 8, (130, 1, 0, 65), partition=64),
    Case("bf16", 64, 8, 1, 32, (257, 3), partition=0),
    # group 16 (one full tile), d=256 (16-token chunks, head dimension split over two warps).
    Case("fp16", 256, 16, 1, 32, (100, 33), partition=48),
    Case("bf16", 256, 32, 2, 8, (19, 1), partition=0),
    # d=192; group 6 (padded tile); group 32 (two tiles per KV head).
    Case("bf16", 192, 12, 2, 16, (90, 5), partition=32),
    Case("fp16", 128, 32, 1, 8, (70,), partition=0),
    Case("bf16", 128, 64, 2, 32, (45, 200), partition=96, reduce_cus=0),
    # The plugin's partition rule: split across 132 compute units, lengths crossing 256-token partitions.
    Case("fp16", 128, 8, 2, 16, (700, 1, 513), partition=None),
    Case("bf16", 64, 16, 4, 32, (600,), partition=None),
    # Non-finite inputs propagate as the float64 reference says, split and not.
    Case("fp16", 128, 8, 2, 16, (50, 90), partition=0, nonfinite=True),
    Case("bf16", 64, 8, 1, 8, (50, 90), partition=32, nonfinite=True),
    Case("fp16", 128, 32, 8, 16, (3, 200), partition=64, nonfinite=True, ftz=True),
]


def _inputs(case: Case, host_rng: np.random.Generator) -> dict[str, Any]:
    """Query, caches and block tables; every cache slot no sequence uses is NaN (the kernel must not read it)."""
    dt = NUMPY_DTYPES[case.dtype]
    bs, hs, nkv = case.block_size, case.head_size, case.num_kv_heads
    num_seqs = len(case.seq_lens)
    used = [-(-n // bs) for n in case.seq_lens]
    max_blocks = max(1, max(used)) + 2  # table columns beyond the longest sequence
    spare = 2  # blocks owned by nobody: table entries past a sequence's end point there
    num_blocks = sum(used) + spare
    shape = (num_blocks, nkv, bs, hs)
    key_cache = host_rng.standard_normal(shape).astype(dt)
    value_cache = host_rng.standard_normal(shape).astype(dt)
    perm = host_rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.empty((num_seqs, max_blocks), np.int32)
    nxt = 0
    for s, (n, nb) in enumerate(zip(case.seq_lens, used, strict=True)):
        block_tables[s, :nb] = perm[nxt:nxt + nb]
        nxt += nb
        block_tables[s, nb:] = perm[num_blocks - spare:][np.arange(max_blocks - nb) % spare]
        if s == 0:
            block_tables[s, nb + 1:] = np.int32(2**31 - 1)  # out of range: must never be dereferenced
        if n % bs:  # the tail of the last block
            key_cache[block_tables[s, nb - 1], :, n % bs:] = np.nan
            value_cache[block_tables[s, nb - 1], :, n % bs:] = np.nan
    key_cache[perm[num_blocks - spare:]] = np.nan
    value_cache[perm[num_blocks - spare:]] = np.nan
    query = host_rng.standard_normal((num_seqs, case.num_heads, hs)).astype(dt)
    if case.nonfinite:
        t = case.seq_lens[1] // 2
        query[0, 1, 3] = np.nan
        key_cache[block_tables[1, t // bs], 0, t % bs, 5] = np.inf
        t = case.seq_lens[0] - 1
        value_cache[block_tables[0, t // bs], nkv - 1, t % bs, 7] = np.nan
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "seq_lens": np.array(case.seq_lens, np.int32),
        "scale": float(hs) ** -0.5,
    }


def _run(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: Case,
         args: dict[str, Any], *, flag: np.ndarray | None = None) -> np.ndarray:
    """The kernel's output, sized for ``max(case.seq_lens)``; ``flag`` receives the device error flag (else it
    must stay 0)."""
    code = DTYPE_CODES[case.dtype]
    q, kc, vc, bt, sl = (args[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))
    num_seqs, max_len = len(case.seq_lens), max(case.seq_lens)
    tc = _module(host_builder, pa_rules.paged_attention_tc_spec(code, case.head_size), host_rng, case.ftz)
    assert tc.static_shared_bytes() == pa_rules.paged_attention_tc_shared_bytes(case.head_size)
    assert tc.static_shared_bytes() <= 48 << 10  # static shared memory needs no opt-in
    if case.partition is None or case.partition == 0:
        cus = MANY_CUS if case.partition is None else ONE_CU
        size, parts = pa_rules.paged_attention_tc_partitions(
            num_seqs, case.num_heads, case.num_kv_heads, max_len, case.head_size, cus,
            pa_rules.paged_attention_tc_ctas_per_cu(case.head_size))
        assert (parts > 1) == (case.partition is None), (size, parts)
    else:
        size, parts = case.partition, -(-max_len // case.partition)
    launches = pa_rules.paged_attention_tc_launches(num_seqs, case.num_heads, case.num_kv_heads, parts, case.head_size,
                                                    case.reduce_cus)
    strides = tuple(int(x) // kc.itemsize for x in kc.strides[:3])
    common = (q, kc, vc, bt, sl, None, None, None, args["scale"], 0.0, case.num_heads, case.num_kv_heads,
              case.block_size, bt.shape[1], 0, num_seqs, 1, *strides, *strides)
    own_flag = flag is None
    flag = np.zeros(1, np.int32) if flag is None else flag
    checks = (kc.shape[0], max_len, flag)
    out = np.full(q.shape, np.nan, q.dtype)
    if parts == 1:
        (single,) = launches
        tc.launch(single, out, None, None, None, *common, size, 1, *checks)
    else:
        split, reduce = launches
        # Workspaces need no initialisation: NaN-filled, so a read of an unwritten partition shows.
        tmp_out = np.full((num_seqs, case.num_heads, parts, case.head_size), np.nan, np.float32)
        max_logits = np.full((num_seqs, case.num_heads, parts), np.nan, np.float32)
        exp_sums = np.full_like(max_logits, np.nan)
        tc.launch(split, None, tmp_out, max_logits, exp_sums, *common, size, parts, *checks)
        simt = _module(host_builder,
                       pa_rules.paged_attention_spec(code, case.head_size, case.num_heads // case.num_kv_heads),
                       host_rng, case.ftz)
        simt.launch(reduce, out, tmp_out, max_logits, exp_sums, sl, None, None, case.num_heads, q.shape[0], 1, size,
                    parts)
    if own_flag:
        assert flag[0] == 0, "valid indices must not raise the error flag"
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_tc_attention_matches_reference(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                        case: Case) -> None:
    """Tensor-core attention equals the float64 reference (NaN where it has NaN); unused NaN slots never leak."""
    args = _inputs(case, host_rng)
    out = _run(host_builder, host_rng, case, args)
    expected = OPS["paged_attention"].reference(args)
    atol, rtol = tolerance("attention", case.dtype)
    got = out.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=f"NaN pattern differs: {case.id}")
    np.testing.assert_allclose(got, expected, atol=atol, rtol=rtol, err_msg=case.id)
    if case.nonfinite:
        assert np.isnan(expected).any() and not np.isnan(expected).all()
    sl = args["seq_lens"]
    assert not got[sl == 0].any(), "a zero-length sequence must give zeros"


def test_tc_attention_every_logit_minus_inf_gives_nan(host_builder: HostKernelBuilder,
                                                      host_rng: np.random.Generator) -> None:
    """A query row whose logits are all -inf (an infinite query against finite keys) is NaN, as in float64."""
    case = Case("fp16", 64, 4, 1, 16, (40, 20), partition=0)
    args = _inputs(case, host_rng)
    q = args["query"]
    q[0, 2, :] = 0
    q[0, 2, 0] = -np.inf
    args["key_cache"][..., 0] = np.abs(args["key_cache"][..., 0]) + np.float16(0.5)  # finite keys, k[0] > 0
    expected = OPS["paged_attention"].reference(args)
    assert np.isnan(expected[0, 2]).all()
    out = _run(host_builder, host_rng, case, args).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    atol, rtol = tolerance("attention", "fp16")
    np.testing.assert_allclose(out, expected, atol=atol, rtol=rtol)


#: Error-flag codes of hal_index_checks.cuh.
ERR_BLOCK_TABLES, ERR_SEQ_LENS = 1, 2


@pytest.mark.parametrize("bad", ["block-high", "block-negative", "length-negative", "length-beyond-max"])
@pytest.mark.parametrize("case", [Case("fp16", 128, 32, 8, 16, (77, 300, 9), partition=0),
                                  Case("bf16", 64, 16, 2, 8, (130, 65, 1), partition=64)], ids=lambda c: c.id)
def test_tc_attention_bad_index_zeroes_its_sequence(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                                    case: Case, bad: str) -> None:
    """A bad block id or length is never dereferenced: sequence 1's output is zeros (single pass, or through the
    reduce step when split), the flag names the argument, the other sequences match the float64 reference."""
    args = _inputs(case, host_rng)
    good = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    n = case.seq_lens[1]
    if bad == "block-high":
        args["block_tables"][1, (n - 1) // case.block_size] = args["key_cache"].shape[0]
    elif bad == "block-negative":
        args["block_tables"][1, 0] = -1
    elif bad == "length-negative":
        args["seq_lens"][1] = -5
    else:
        args["seq_lens"][1] = max(case.seq_lens) + 1  # beyond the max_seq_len the launch is sized for
    flag = np.zeros(1, np.int32)
    out = _run(host_builder, host_rng, case, args, flag=flag).astype(np.float64)
    assert flag[0] == (ERR_BLOCK_TABLES if bad.startswith("block") else ERR_SEQ_LENS)
    assert not out[1].any(), "the sequence with a bad index must give zeros"
    expected = OPS["paged_attention"].reference(good)
    atol, rtol = tolerance("attention", case.dtype)
    keep = [0, 2]
    np.testing.assert_allclose(out[keep], expected[keep], atol=atol, rtol=rtol, err_msg=f"{case.id} {bad}")


# --------------------------------------------------------------------------
# Host rules
# --------------------------------------------------------------------------


def test_selection_by_capability() -> None:
    """Tensor cores: warp matrix instructions of level 80+, fp16/bf16, group >= 4, a PA_TC_HEAD_SIZES head size."""
    use = pa_rules.paged_attention_uses_tensor_cores
    assert use(80, "float16", 4, 128) and use(90, "bfloat16", 16, 256)
    assert use(120, 1, 8, 64)
    assert not use(75, "float16", 8, 128)  # no bf16 MMA / cp.async below level 80
    assert not use(90, "float32", 8, 128)  # fp32 caches keep the SIMT path
    assert not use(90, "float16", 2, 128)  # small decode groups
    assert use(90, "float16", 1, 128, prefill=True) and use(80, "bfloat16", 2, 64, prefill=True)  # rows: tokens
    assert not use(90, "float32", 1, 128, prefill=True) and not use(90, "float16", 8, 96, prefill=True)
    assert not use(90, "float16", 8, 80)  # head size not a multiple of 64
    assert not use(0, "float16", 8, 128)  # a platform without the instructions keeps the SIMT kernels
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        pa_rules.paged_attention_tc_spec("float32", 128)
    with pytest.raises(ValueError, match="head_size"):
        pa_rules.paged_attention_tc_spec("float16", 96)


@pytest.mark.parametrize("head_size", pa_rules.PA_TC_HEAD_SIZES)
def test_partition_rule(head_size: int) -> None:
    """Partitions fill compute units x occupancy, are whole chunks, never shorter than the minimum, cover max_len."""
    chunk = pa_rules.paged_attention_tc_chunk(head_size)
    occ = pa_rules.paged_attention_tc_ctas_per_cu(head_size)
    assert occ >= 1
    for num_seqs, nh, nkv, max_len, cus in [(1, 32, 8, 32768, 132), (32, 32, 8, 4096, 132), (1, 32, 8, 8192, 132),
                                           (64, 32, 8, 4096, 132), (1, 8, 1, 100, 132), (3, 16, 4, 1000, 1),
                                           (33, 32, 8, 4096, 132)]:
        size, parts = pa_rules.paged_attention_tc_partitions(num_seqs, nh, nkv, max_len, head_size, cus, occ)
        assert size % chunk == 0 and size * parts >= max_len > size * (parts - 1)
        base = num_seqs * nkv * -(-(nh // nkv) // 16)
        if parts > 1:
            assert size >= pa_rules.PA_TC_MIN_PARTITION - chunk
            assert base * (parts - 1) < cus * occ  # no more partitions than one wave needs
        elif max_len >= 2 * pa_rules.PA_TC_MIN_PARTITION:
            assert base >= cus * occ  # not split: the grid already fills the device
    with pytest.raises(ValueError):
        pa_rules.paged_attention_tc_partitions(1, 8, 2, 100, head_size, 0, 1)


def test_occupancy_from_registers_and_shared_memory() -> None:
    """CTAs per compute unit: the least of shared memory, threads and registers (256-register warp units)."""
    smem = pa_rules.paged_attention_tc_shared_bytes(128) + 1024
    assert pa_rules.paged_attention_tc_ctas_per_cu(128, 228 << 10, 2048) == (228 << 10) // smem
    assert pa_rules.paged_attention_tc_ctas_per_cu(128, 100 << 10, 1536) == (100 << 10) // smem
    # 168 registers: 5376 per warp, 21504 per CTA -> 3 in 64 Ki registers; 177 rounds up to 5888 per warp -> 2.
    assert pa_rules.paged_attention_tc_ctas_per_cu(128, 228 << 10, 2048, registers_per_thread=168) == 3
    assert pa_rules.paged_attention_tc_ctas_per_cu(128, 228 << 10, 2048, registers_per_thread=177) == 2
    assert pa_rules.paged_attention_tc_ctas_per_cu(128, 1024, 2048, registers_per_thread=255) == 1  # never 0


def test_reduce_slices_fill_the_device() -> None:
    """The reduce step's column slices: the fewest giving one CTA per compute unit, at least 32 columns each."""
    slices = pa_rules.paged_attention_tc_reduce_slices
    assert slices(128, 32, 132) == 4  # 1 x 32k, 32 heads: 128 CTAs
    assert slices(128, 32 * 64, 132) == 1  # enough heads x sequences already
    assert slices(64, 8, 132) == 2  # no slice narrower than 32 columns
    assert slices(256, 16, 132) == 8
    assert slices(128, 4, 0) == 1
    split = pa_rules.paged_attention_tc_launches(1, 32, 8, 40, 128, 132)
    assert split[1].grid == (32, 1, 4)
    assert pa_rules.paged_attention_tc_launches(1, 32, 8, 40)[1].grid == (32, 1, 1)


def test_catalogue_lists_tc_specialisations() -> None:
    """Every TC specialisation is in the catalogue (compiled by test_nvrtc_compile) and marked CUDA-only."""
    tc = [s for s in all_specializations() if s.source == "paged_attention_tc.cu"]
    assert len(tc) == 2 * 2 * len(pa_rules.PA_TC_HEAD_SIZES)  # dtypes x (decode, HAL_VARLEN) x head sizes
    assert {dict(s.defines)["HAL_VARLEN"] for s in tc} == {"0", "1"}
    assert all(s.min_sm == pa_rules.PA_TC_MIN_SM for s in tc)
