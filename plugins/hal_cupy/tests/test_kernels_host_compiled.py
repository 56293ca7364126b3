"""Numerics of the real kernel sources, compiled for the CPU (host-compiled kernels).

The ``.cu`` files of ``hal_cupy.kernels`` are built with g++ through
``host_compiled/prelude_host.cuh`` (the translation unit every compiler gets,
with the host prelude) and launched with the grid, block and runtime
arguments that the plugin's pure host rules (``hal_cupy/ops/_<op>_rules.py``)
compute, on fresh random inputs (seed printed), against the float64 references
of ``hal_core.ops`` and ``hal_core.quant``, with the tolerances of
``hal_core.testing.tolerances``.  Every kernel runs at warp 32 (CUDA, RDNA
wave32) and at wavefront 64 (CDNA), the widths the specialisations take from a
device's capabilities.  No GPU is needed; without a usable g++ the tests skip
with the reason (and fail where ``HAL_REQUIRE_COMPILERS=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hal_cupy._specialization import SIMD_WIDTHS, Launch
from hal_cupy.ops import _paged_attention_rules as pa_rules
from hal_cupy.ops import _quantized_gemm_rules as qg_rules
from hal_cupy.ops import _write_kv_cache_rules as kv_rules
from host_compiled.harness import HostKernelBuilder, HostLaunchError, HostModule

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.quant import QuantizedWeight, quantize, quantize_activations
from hal_core.testing.inputs import assert_close
from hal_core.testing.tolerances import tolerance

DTYPES = ("fp32", "fp16", "bf16")
NUMPY_DTYPES: dict[str, Any] = {"fp32": np.float32, "fp16": np.float16, "bf16": BFLOAT16}
DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}
#: Compute units given to the host rules: an H100's 132 (small grids, so split-K / split-KV) or 1 (no split).
MANY_CUS, ONE_CU = 132, 1


# --------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------




def _build(builder: HostKernelBuilder, spec: Any, rng: np.random.Generator, **extra: int) -> HostModule:
    """Build a plugin :class:`Specialization` (plus extra defines) and seed its thread interleaving."""
    module = builder.build(spec.source, {**dict(spec.defines), **extra})
    module.seed(int(rng.integers(1, 2**63)))
    return module


def _at_every_width(cases: list[Any], widen: Any = None) -> list[Any]:
    """Each case at warp 32 (CUDA, RDNA) and wavefront 64 (CDNA); a case written for one width keeps only it.

    ``widen(case)`` makes the 64-lane twin when more than the width changes with it.
    """
    out = []
    for case in cases:
        out.append(case)
        if case.warp_size == 32:
            out.append(widen(case) if widen is not None else replace(case, warp_size=64))
    return out


def element_strides(cache: np.ndarray) -> tuple[int, int, int]:
    """Element strides (block, KV head, token) of a cache array, as the kernels take them."""
    return tuple(int(x) // cache.itemsize for x in cache.strides[:3])  # type: ignore[return-value]


def _assert_close(actual: np.ndarray, expected: np.ndarray, kind: str, dtype: str, what: str) -> None:
    atol, rtol = tolerance(kind, dtype)
    np.testing.assert_allclose(actual.astype(np.float64), expected, atol=atol, rtol=rtol, err_msg=what)


# --------------------------------------------------------------------------
# Host runtime self-check
# --------------------------------------------------------------------------


@pytest.mark.parametrize("warp_size", [32, 64])
def test_host_runtime_shuffle_and_deadlock(host_builder: HostKernelBuilder, warp_size: int) -> None:
    """The host prelude exchanges lanes within a warp and reports a barrier not every thread reaches."""
    probe = host_builder.build_probe(warp_size)
    out = np.full(2 * warp_size, np.nan, np.float32)
    assert probe.probe_shuffle(out.ctypes.data) == 0
    np.testing.assert_array_equal(out, np.arange(2 * warp_size) ^ 1)
    assert probe.probe_deadlock() == -2


# --------------------------------------------------------------------------
# paged_attention
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    variant: str  # "single" or "split"
    dtype: str
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    seq_lens: tuple[int, ...]
    partition_size: int = pa_rules.PA_PARTITION_SIZE
    warp_size: int = 32

    @property
    def id(self) -> str:
        lens = "_".join(map(str, self.seq_lens))
        warp = f"-warp{self.warp_size}" if self.warp_size != 32 else ""
        part = f"-part{self.partition_size}" if self.variant == "split" else ""
        return (f"{self.variant}-{self.dtype}-hs{self.head_size}-h{self.num_heads}kv{self.num_kv_heads}"
                f"-bs{self.block_size}-len{lens}{part}{warp}")


ATTENTION_CASES = _at_every_width([
    # MHA (tile 1) with a zero-length and a length-1 sequence.
    AttentionCase("single", "fp32", 64, 4, 4, 16, (0, 1, 37)),
    AttentionCase("split", "fp32", 256, 16, 2, 32, (129, 5), partition_size=64),
    # group 6 -> tile 8 with two masked heads.
    AttentionCase("single", "fp16", 80, 12, 2, 8, (1, 70)),
    # group 12 -> two tiles of 8 per KV head, one partly masked.
    AttentionCase("split", "fp16", 128, 12, 1, 16, (200, 0, 33), partition_size=64),
    AttentionCase("single", "bf16", 128, 8, 2, 32, (100, 0)),
    AttentionCase("split", "bf16", 80, 4, 4, 8, (150, 1), partition_size=32),
    AttentionCase("single", "bf16", 256, 4, 2, 16, (45,)),
    AttentionCase("single", "fp32", 96, 4, 2, 8, (61,)),  # tile 2
    # group 3 -> tile 4 with one masked head.
    AttentionCase("split", "bf16", 112, 6, 2, 32, (300, 2), partition_size=128),
    AttentionCase("single", "fp16", 192, 8, 1, 16, (33,)),
    AttentionCase("split", "fp16", 64, 8, 1, 16, (0, 97), partition_size=32),
    # wave64 (HIP on CDNA): 64-lane shuffles and lane layout.
    AttentionCase("single", "fp16", 128, 8, 2, 16, (130, 0, 9), warp_size=64),
    AttentionCase("split", "fp16", 128, 8, 2, 16, (130, 0, 9), partition_size=64, warp_size=64),
])


def _paged_inputs(case: AttentionCase, rng: np.random.Generator) -> dict[str, Any]:
    """Query, caches and block tables; every cache slot no sequence uses is NaN (the kernels must not read it)."""
    dt = NUMPY_DTYPES[case.dtype]
    bs, hs, nkv = case.block_size, case.head_size, case.num_kv_heads
    num_seqs = len(case.seq_lens)
    used = [-(-n // bs) for n in case.seq_lens]
    max_blocks = max(1, max(used)) + 1  # one table column beyond the longest sequence
    spare = 2  # blocks owned by nobody: table entries past a sequence's end point there
    num_blocks = sum(used) + spare
    shape = (num_blocks, nkv, bs, hs)
    key_cache = rng.standard_normal(shape).astype(dt)
    value_cache = rng.standard_normal(shape).astype(dt)
    perm = rng.permutation(num_blocks).astype(np.int32)
    block_tables = np.empty((num_seqs, max_blocks), np.int32)
    nxt = 0
    for s, (n, nb) in enumerate(zip(case.seq_lens, used, strict=True)):
        block_tables[s, :nb] = perm[nxt:nxt + nb]
        nxt += nb
        block_tables[s, nb:] = perm[num_blocks - spare:][(np.arange(max_blocks - nb) % spare)]
        if n % bs:  # the tail of the last block
            key_cache[block_tables[s, nb - 1], :, n % bs:] = np.nan
            value_cache[block_tables[s, nb - 1], :, n % bs:] = np.nan
    key_cache[perm[num_blocks - spare:]] = np.nan
    value_cache[perm[num_blocks - spare:]] = np.nan
    return {
        "query": rng.standard_normal((num_seqs, case.num_heads, hs)).astype(dt),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "seq_lens": np.array(case.seq_lens, np.int32),
        "scale": float(hs) ** -0.5,
    }


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.id)
def test_paged_attention(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: AttentionCase) -> None:
    """Single-pass or split+reduce paged attention matches the float64 reference; NaN slots past the end are ignored."""
    group = case.num_heads // case.num_kv_heads
    code = DTYPE_CODES[case.dtype]
    spec = pa_rules.paged_attention_spec(code, case.head_size, group, case.warp_size)
    module = _build(host_builder, spec, host_rng)
    assert module.warp_size() == case.warp_size
    gqa = pa_rules.paged_attention_gqa_tile(group)
    assert module.static_shared_bytes() == pa_rules.paged_attention_shared_bytes(
        code, case.head_size, gqa, case.warp_size)

    num_seqs, max_len = len(case.seq_lens), max(case.seq_lens)
    assert pa_rules.choose_paged_attention_variant(
        num_seqs, case.num_kv_heads, max_len, MANY_CUS, case.num_heads, case.partition_size) == case.variant
    launches = pa_rules.paged_attention_launches(
        case.variant, num_seqs, case.num_heads, case.num_kv_heads, max_len, case.partition_size)

    args = _paged_inputs(case, host_rng)
    out, flag = _run_attention(module, case, launches, args, max_len)
    expected = OPS["paged_attention"].reference(args)
    _assert_close(out, expected, "attention", case.dtype, case.id)
    assert not out[args["seq_lens"] == 0].astype(np.float64).any(), "a zero-length sequence must give zeros"
    assert flag[0] == 0, "valid indices must not raise the error flag"


def _run_attention(module: HostModule, case: AttentionCase, launches: list[Any], args: dict[str, Any],
                   max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Run the single or split+reduce launches; the output and the device error flag (one int32)."""
    q, kc, vc, bt, sl = (args[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))
    num_seqs = q.shape[0]
    common = (q, kc, vc, bt, sl, None, None, None, args["scale"], 0.0, case.num_heads, case.num_kv_heads,
              case.block_size, bt.shape[1], 0, num_seqs, 1, *element_strides(kc), *element_strides(vc))
    flag = np.zeros(1, np.int32)
    checks = (kc.shape[0], max_seq_len, flag)
    out = np.full(q.shape, np.nan, q.dtype)
    if len(launches) == 1:
        (single,) = launches
        module.launch(single, out, *common, *checks)
        return out, flag
    split, reduce = launches
    parts = pa_rules.paged_attention_partitions(max_seq_len, case.partition_size)
    assert split.grid[2] == parts
    # Workspaces need no initialisation: NaN-filled, so a read of an unwritten partition shows.
    tmp_out = np.full((num_seqs, case.num_heads, parts, case.head_size), np.nan, np.float32)
    max_logits = np.full((num_seqs, case.num_heads, parts), np.nan, np.float32)
    exp_sums = np.full_like(max_logits, np.nan)
    module.launch(split, tmp_out, max_logits, exp_sums, *common, case.partition_size, parts, *checks)
    module.launch(reduce, out, tmp_out, max_logits, exp_sums, sl, None, None, case.num_heads, num_seqs, 1,
                  case.partition_size, parts)
    return out, flag


#: Error-flag codes of hal_index_checks.cuh.
ERR_BLOCK_TABLES, ERR_SEQ_LENS, ERR_SLOT_MAPPING = 1, 2, 4

INDEX_ERROR_CASES = [
    AttentionCase("single", "fp32", 64, 8, 2, 16, (37, 90, 5)),
    AttentionCase("split", "fp16", 64, 8, 2, 16, (37, 300, 5), partition_size=64),
    AttentionCase("split", "bf16", 128, 8, 2, 16, (130, 0, 9), partition_size=64, warp_size=64),
]


def _corrupt(args: dict[str, Any], bad: str, case: AttentionCase) -> int:
    """Put one bad index into sequence 1 (or 0 when 1 is empty); the sequence spoilt."""
    s = 1 if case.seq_lens[1] > 0 else 0
    n = case.seq_lens[s]
    num_blocks = args["key_cache"].shape[0]
    if bad == "block-high":
        args["block_tables"][s, (n - 1) // case.block_size] = num_blocks  # the last used block: past the cache
    elif bad == "block-negative":
        args["block_tables"][s, 0] = -3
    elif bad == "length-negative":
        args["seq_lens"][s] = -1
    else:  # "length-beyond-max": one token more than the max_seq_len the launch is sized for
        args["seq_lens"][s] = max(case.seq_lens) + 1
    return s


@pytest.mark.parametrize("bad", ["block-high", "block-negative", "length-negative", "length-beyond-max"])
@pytest.mark.parametrize("case", INDEX_ERROR_CASES, ids=lambda c: c.id)
def test_paged_attention_bad_index_zeroes_its_sequence(host_builder: HostKernelBuilder,
                                                       host_rng: np.random.Generator, case: AttentionCase,
                                                       bad: str) -> None:
    """A bad block id or length on the device is never dereferenced: that sequence's output is zeros, the error
    flag names the argument, and every other sequence still matches the float64 reference."""
    group = case.num_heads // case.num_kv_heads
    module = _build(host_builder, pa_rules.paged_attention_spec(DTYPE_CODES[case.dtype], case.head_size, group,
                                                                case.warp_size), host_rng)
    num_seqs, max_len = len(case.seq_lens), max(case.seq_lens)
    launches = pa_rules.paged_attention_launches(
        case.variant, num_seqs, case.num_heads, case.num_kv_heads, max_len, case.partition_size)
    args = _paged_inputs(case, host_rng)
    good = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    s = _corrupt(args, bad, case)
    out, flag = _run_attention(module, case, launches, args, max_len)  # sized for max_len, as a caller's bound
    want = ERR_BLOCK_TABLES if bad.startswith("block") else ERR_SEQ_LENS
    assert flag[0] == want, f"error flag {flag[0]}, expected {want}"
    assert not out[s].astype(np.float64).any(), "the sequence with a bad index must give zeros"
    others = np.arange(num_seqs) != s
    expected = OPS["paged_attention"].reference(good)
    _assert_close(out[others], expected[others], "attention", case.dtype, f"{case.id} {bad}")


NON_FINITE_CASES = [
    AttentionCase("single", "fp32", 64, 8, 2, 16, (37, 90, 5)),
    AttentionCase("split", "fp16", 64, 8, 2, 16, (37, 300, 5), partition_size=64),
    AttentionCase("split", "bf16", 64, 8, 2, 16, (37, 300, 5), partition_size=64),
]


@pytest.mark.parametrize("poison", ["query-nan", "query-inf", "key-nan", "key-inf", "value-nan", "value-inf"])
@pytest.mark.parametrize("case", NON_FINITE_CASES, ids=lambda c: c.id)
def test_paged_attention_non_finite(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                    case: AttentionCase, poison: str) -> None:
    """NaN/inf in the query or a used key/value give exactly the reference's NaN/inf pattern (single and split)."""
    group = case.num_heads // case.num_kv_heads
    module = _build(host_builder, pa_rules.paged_attention_spec(DTYPE_CODES[case.dtype], case.head_size, group),
                    host_rng)
    num_seqs, max_len = len(case.seq_lens), max(case.seq_lens)
    launches = pa_rules.paged_attention_launches(
        case.variant, num_seqs, case.num_heads, case.num_kv_heads, max_len, case.partition_size)
    args = _paged_inputs(case, host_rng)
    q, kc, vc, bt = (args[k] for k in ("query", "key_cache", "value_cache", "block_tables"))

    def slot(s: int, t: int) -> tuple[int, int]:
        return int(bt[s, t // case.block_size]), t % case.block_size

    late = max_len - 20  # a token of the longest sequence, in its last partition when split
    target = {"query-nan": None, "query-inf": None, "key-nan": (1, late, 1, 4), "key-inf": (0, 10, 0, 0),
              "value-nan": (0, 3, 0, 7), "value-inf": (1, 20, 1, 9)}[poison]
    bad = np.nan if poison.endswith("nan") else np.inf
    if target is None:
        q[0 if poison == "query-nan" else 1, 3, 10] = bad
    else:
        s, t, head, d = target
        block, offset = slot(s, t)
        (kc if poison.startswith("key") else vc)[block, head, offset, d] = bad
    out, flag = _run_attention(module, case, launches, args, max_len)
    assert flag[0] == 0
    expected = OPS["paged_attention"].reference(args)
    if poison != "key-inf":  # +inf in a key gives a +inf (row NaN) or -inf (token dropped) score, by q's sign
        assert not np.isfinite(expected).all()
    assert_close(out, expected, kind="attention", dtype=case.dtype, what=f"{case.id} {poison}")


# --------------------------------------------------------------------------
# write_kv_cache
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class KVWriteCase:
    dtype: str
    slot_dtype: str
    num_kv_heads: int
    head_size: int
    block_size: int
    num_tokens: int
    misaligned: bool = False  # key starts 2 bytes (one fp16 element) past a 16-byte boundary

    @property
    def id(self) -> str:
        row = self.head_size * np.dtype(NUMPY_DTYPES[self.dtype]).itemsize
        tail = "-misaligned" if self.misaligned else ""
        return f"{self.dtype}-{self.slot_dtype}-kv{self.num_kv_heads}-hs{self.head_size}-row{row}B{tail}"


KV_WRITE_CASES = [
    KVWriteCase("fp16", "int64", 2, 128, 16, 9),  # 16-byte copies
    KVWriteCase("bf16", "int32", 3, 36, 8, 7),  # 72-byte rows: 8-byte copies
    KVWriteCase("fp32", "int64", 2, 3, 8, 5),  # 12-byte rows: 4-byte copies
    KVWriteCase("fp16", "int32", 1, 5, 32, 6),  # 10-byte rows: 2-byte copies
    KVWriteCase("fp16", "int64", 2, 64, 16, 5, misaligned=True),  # 128-byte rows, key 2 bytes off: 2-byte copies
]


def _misaligned_copy(a: np.ndarray) -> np.ndarray:
    """``a`` copied to an address one element (2 bytes for fp16) past a 16-byte boundary, as a sliced view."""
    buf = np.empty(a.nbytes + 32, np.uint8)
    start = (-buf.ctypes.data) % 16 + a.itemsize
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("case", KV_WRITE_CASES, ids=lambda c: c.id)
def test_write_kv_cache(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: KVWriteCase,
                        warp_size: int) -> None:
    """Rows land bit-exactly in their slots; a negative slot is skipped and other slots are untouched."""
    rng = host_rng
    dt = NUMPY_DTYPES[case.dtype]
    spec = kv_rules.write_kv_cache_spec(slot_int64=case.slot_dtype == "int64", warp_size=warp_size)
    module = _build(host_builder, spec, rng)
    num_blocks = 4
    rows = (case.num_tokens, case.num_kv_heads, case.head_size)
    key = rng.standard_normal(rows).astype(dt)
    value = rng.standard_normal(rows).astype(dt)
    if case.misaligned:
        key = _misaligned_copy(key)
    cache_shape = (num_blocks, case.num_kv_heads, case.block_size, case.head_size)
    key_cache = rng.standard_normal(cache_shape).astype(dt)
    value_cache = rng.standard_normal(cache_shape).astype(dt)
    slots = rng.choice(num_blocks * case.block_size, case.num_tokens, replace=False).astype(case.slot_dtype)
    slots[rng.integers(case.num_tokens)] = -1
    args = {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache, "slot_mapping": slots}
    expected_k, expected_v = OPS["write_kv_cache"].reference(args)

    row_bytes = case.head_size * key.itemsize
    flag = np.zeros(1, np.int32)
    module.launch(kv_rules.write_kv_cache_launch(case.num_tokens), key, value, key_cache, value_cache, slots,
                  case.num_kv_heads, case.block_size, row_bytes, num_blocks, flag)
    assert flag[0] == 0
    _assert_close(key_cache, expected_k, "copy", case.dtype, f"{case.id}: key_cache")
    _assert_close(value_cache, expected_v, "copy", case.dtype, f"{case.id}: value_cache")


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("slot_dtype", ["int32", "int64"])
def test_write_kv_cache_bad_slot_is_skipped(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                            slot_dtype: str, warp_size: int) -> None:
    """A slot past the cache is never written: its token is skipped, slot_mapping is flagged, the rest land."""
    rng = host_rng
    module = _build(host_builder, kv_rules.write_kv_cache_spec(slot_int64=slot_dtype == "int64", warp_size=warp_size),
                    rng)
    num_blocks, nkv, bs, hs, tokens = 3, 2, 16, 64, 6
    key = rng.standard_normal((tokens, nkv, hs)).astype(np.float16)
    value = rng.standard_normal((tokens, nkv, hs)).astype(np.float16)
    key_cache = rng.standard_normal((num_blocks, nkv, bs, hs)).astype(np.float16)
    value_cache = rng.standard_normal((num_blocks, nkv, bs, hs)).astype(np.float16)
    slots = rng.choice(num_blocks * bs, tokens, replace=False).astype(slot_dtype)
    bad_token = int(rng.integers(tokens))
    slots[bad_token] = num_blocks * bs + int(rng.integers(0, 1000))  # past the cache
    keep = np.arange(tokens) != bad_token
    expected_k, expected_v = OPS["write_kv_cache"].reference(
        {"key": key[keep], "value": value[keep], "key_cache": key_cache, "value_cache": value_cache,
         "slot_mapping": slots[keep]})
    flag = np.zeros(1, np.int32)
    module.launch(kv_rules.write_kv_cache_launch(tokens), key, value, key_cache, value_cache, slots, nkv, bs,
                  hs * key.itemsize, num_blocks, flag)
    assert flag[0] == ERR_SLOT_MAPPING
    _assert_close(key_cache, expected_k, "copy", "fp16", "key_cache")
    _assert_close(value_cache, expected_v, "copy", "fp16", "value_cache")


# --------------------------------------------------------------------------
# quantized_gemm (small M), activation quantiser, dequantisation
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmCase:
    bits: int
    dtype: str
    m: int
    n: int
    k: int
    group_size: int
    symmetric: bool
    compute_units: int
    split_k: bool  # what the host rule must choose for this shape
    warp_size: int = 32

    @property
    def id(self) -> str:
        kind = "W4A16" if self.bits == 4 else "W8A8"
        zeros = "sym" if self.symmetric else "zeros"
        split = "splitK" if self.split_k else "noSplit"
        warp = f"-warp{self.warp_size}" if self.warp_size != 32 else ""
        return f"{kind}-{self.dtype}-M{self.m}-N{self.n}-K{self.k}-G{self.group_size}-{zeros}-{split}{warp}"


def _gemm_at_64(case: GemmCase) -> GemmCase:
    """The 64-lane twin: a block covers twice the columns, so fewer CTAs may call for a K split."""
    _, ksplit, _ = qg_rules.quant_gemm_launch(case.bits, case.m, case.n, case.k, case.group_size,
                                              case.compute_units, 64)
    return replace(case, warp_size=64, split_k=ksplit > 1)


GEMM_CASES = _at_every_width([
    GemmCase(4, "fp16", 1, 256, 1024, 128, False, MANY_CUS, True),
    GemmCase(4, "bf16", 3, 132, 512, 32, True, MANY_CUS, True),  # N not a multiple of the 128-column tile
    GemmCase(4, "fp32", 20, 128, 256, 32, False, ONE_CU, False),  # M > 16: two M chunks
    GemmCase(4, "fp16", 1, 128, 256, 128, True, ONE_CU, False),
    GemmCase(8, "fp16", 1, 256, 512, 64, True, MANY_CUS, True),
    GemmCase(8, "bf16", 5, 132, 256, 32, False, ONE_CU, False),
    GemmCase(8, "fp32", 17, 128, 512, 128, False, MANY_CUS, False),  # two M chunks; 4 groups: no split
    GemmCase(4, "bf16", 2, 256, 512, 64, False, MANY_CUS, True, warp_size=64),
    GemmCase(8, "fp16", 4, 260, 256, 32, True, MANY_CUS, True, warp_size=64),
], widen=_gemm_at_64)


def _random_weight(rng: np.random.Generator, k: int, n: int, bits: int, group_size: int,
                   symmetric: bool) -> QuantizedWeight:
    """Weights scaled so that ``x @ w`` is O(1) for standard normal ``x``."""
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    return quantize(w, bits=bits, group_size=group_size, symmetric=symmetric)


@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: c.id)
def test_quantized_gemm(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: GemmCase) -> None:
    """The small-M GEMM (with the W8A8 activation quantiser and the split-K cast) matches the reference."""
    _check_gemm(host_builder, host_rng, case, non_finite=False)


@pytest.mark.parametrize("case", [c for c in GEMM_CASES if c.m >= 3], ids=lambda c: c.id)
def test_quantized_gemm_non_finite_rows(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                        case: GemmCase) -> None:
    """Rows of x holding NaN, +inf or -inf give the reference's result (W8A8: NaN rows), split-K or not."""
    _check_gemm(host_builder, host_rng, case, non_finite=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_split_k_gemm_is_bit_reproducible(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                          bits: int) -> None:
    """A K split gives the same bits whatever order its CTAs run in and however their threads interleave."""
    m, n, k, g = 3, 256, 2048, 32
    launch, ksplit, per_split = qg_rules.quant_gemm_launch(bits, m, n, k, g, MANY_CUS)
    assert ksplit >= 3  # two partials would add up the same in either order
    qw = _random_weight(host_rng, k, n, bits, g, symmetric=False)
    x = host_rng.standard_normal((m, k)).astype(np.float16)
    spec = qg_rules.quant_gemm_spec(1, bits, qg_rules.quant_gemm_m_tile(m))
    util = _build(host_builder, qg_rules.quant_util_spec(1), host_rng)
    xq = np.zeros((m, k), np.int8)
    sx = np.zeros(m, np.float32)
    util.launch(qg_rules.quant_util_launch("hal_w8a8_quantize_rows", m, MANY_CUS), xq, sx, x, k)
    acts = (x,) if bits == 4 else (xq, sx)
    runs = []
    for _ in range(3):
        gemm = _build(host_builder, spec, host_rng)  # a fresh seed: another CTA order and thread interleaving
        gemm.shuffle_ctas(True)
        try:
            out = np.full((m, n), np.nan, np.float16)
            ws = np.full((ksplit, m, n), np.nan, np.float32)
            gemm.launch(launch, out, ws, *acts, qw.qweight, qw.scales, qw.zeros, m, n, k, g, per_split)
        finally:
            gemm.shuffle_ctas(False)
        util.launch(qg_rules.quant_util_launch("hal_f32_splits_to_dtype", m * n, MANY_CUS), out, ws, m * n, ksplit)
        runs.append(out.view(np.uint16).copy())
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0], other)
    expected = OPS["quantized_gemm"].reference({"x": x, "qweight": qw})
    _assert_close(runs[0].view(np.float16), expected, "gemm", "fp16", f"W{bits} split-K vs the float64 reference")


def _check_gemm(host_builder: HostKernelBuilder, rng: np.random.Generator, case: GemmCase, *,
                non_finite: bool) -> None:
    code, dt = DTYPE_CODES[case.dtype], NUMPY_DTYPES[case.dtype]
    m, n, k, g = case.m, case.n, case.k, case.group_size
    assert qg_rules.use_small_m_gemm(m, case.bits)
    launch, ksplit, per_split = qg_rules.quant_gemm_launch(case.bits, m, n, k, g, case.compute_units, case.warp_size)
    assert (ksplit > 1) == case.split_k
    m_tile = qg_rules.quant_gemm_m_tile(m)
    gemm = _build(host_builder, qg_rules.quant_gemm_spec(code, case.bits, m_tile, case.warp_size), rng)
    util = _build(host_builder, qg_rules.quant_util_spec(code, case.warp_size), rng)
    assert gemm.static_shared_bytes() == qg_rules.quant_gemm_shared_bytes(m_tile, case.warp_size)

    qw = _random_weight(rng, k, n, case.bits, g, case.symmetric)
    x = rng.standard_normal((m, k))
    if case.bits == 8:  # row 0 holds the quantiser's rounding tie (see the quantize_rows test)
        x[0] = np.clip(x[0], -3.0, 3.0)
        x[0, :2] = (3.25, 1.625)
    x = x.astype(dt)
    if non_finite:  # rows 0 and the rest stay finite
        x[1, 5], x[2, [7, k - 1]] = np.nan, (np.inf, -np.inf) if case.bits == 8 else (np.inf, np.inf)
    out = np.full((m, n), np.nan, dt)
    ws = np.full((ksplit, m, n), np.nan, np.float32) if ksplit > 1 else None  # every partial must be written
    tail = (m, n, k, g, per_split)
    if case.bits == 4:
        gemm.launch(launch, out, ws, x, qw.qweight, qw.scales, qw.zeros, *tail)
    else:
        xq = np.zeros((m, k), np.int8)
        sx = np.full(m, np.nan, np.float32)
        util.launch(qg_rules.quant_util_launch("hal_w8a8_quantize_rows", m, case.compute_units), xq, sx, x, k)
        gemm.launch(launch, out, ws, xq, sx, qw.qweight, qw.scales, qw.zeros, *tail)
    if ws is not None:
        assert np.isnan(out.astype(np.float32)).all(), "with split-K the GEMM must leave out to the reduction"
        util.launch(qg_rules.quant_util_launch("hal_f32_splits_to_dtype", m * n, case.compute_units), out, ws, m * n,
                    ksplit)
    if case.bits == 8:  # the GEMM alone, on the activations the kernel quantised
        own = sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ qw.dequantize(np.float64))
        _assert_close(out, own, "gemm", case.dtype, f"{case.id}: GEMM of the kernel-quantised activations")

    expected = OPS["quantized_gemm"].reference({"x": x, "qweight": qw})
    if non_finite:
        assert np.isnan(expected[1]).all() and not np.isfinite(expected[2]).all()
        assert_close(out, expected, kind="gemm", dtype=case.dtype, what=f"{case.id}: non-finite rows")
    else:
        _assert_close(out, expected, "gemm", case.dtype, f"{case.id}: vs the float64 reference")


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_quantize_rows_matches_quantize_activations(
    host_builder: HostKernelBuilder, host_rng: np.random.Generator, dtype: str, warp_size: int
) -> None:
    """The activation quantiser gives exactly ``hal_core.quant.quantize_activations``'s codes and scales."""
    rng = host_rng
    m, k = 5, 384  # K > 256 threads: each thread quantises several elements
    x = np.clip(rng.standard_normal((m, k)), -3.0, 3.0)
    x[1] = 0.0  # an all-zero row
    # A rounding tie for one formula only: 1.625 * (127 / 3.25) = 63.5 in float32,
    # 1.625 / (3.25 / 127) = 63.499996.  The codes must agree here too.
    x[3, :2] = (3.25, 1.625)
    x = x.astype(NUMPY_DTYPES[dtype])
    x[4] = 0  # a row holding only the dtype's smallest subnormal: its scale must not underflow to 0
    x[4, 0] = np.array(1, np.uint16 if dtype != "fp32" else np.uint32).view(NUMPY_DTYPES[dtype])[()]
    x = np.concatenate([x, x[:3].copy()])  # rows 5..7 non-finite: sx NaN (their codes do not matter)
    x[5, 300], x[6, 7], x[7, [0, 383]] = np.nan, -np.inf, (np.inf, np.nan)
    m = x.shape[0]
    util = _build(host_builder, qg_rules.quant_util_spec(DTYPE_CODES[dtype], warp_size), rng)
    xq = np.full((m, k), 99, np.int8)
    sx = np.full(m, 7.0, np.float32)  # not NaN: the NaN scales must be written
    util.launch(qg_rules.quant_util_launch("hal_w8a8_quantize_rows", m, ONE_CU), xq, sx, x, k)

    ref_xq, ref_sx = quantize_activations(x)
    np.testing.assert_array_equal(sx, ref_sx)  # the zero row included: sx = 1, xq = 0; NaN where non-finite
    assert np.isnan(sx[5:]).all()
    mismatch = np.argwhere(xq[:5] != ref_xq[:5])
    detail = "; ".join(
        f"x[{i},{j}]={float(x[i, j])!r} amax={float(np.abs(x[i].astype(np.float32)).max())!r}: "
        f"kernel {int(xq[i, j])}, reference {int(ref_xq[i, j])}"
        for i, j in mismatch[:5]
    )
    assert len(mismatch) == 0, f"{len(mismatch)} codes differ from quantize_activations: {detail}"


@dataclass(frozen=True)
class DequantCase:
    bits: int
    dtype: str
    k: int
    n: int
    group_size: int
    symmetric: bool

    @property
    def id(self) -> str:
        zeros = "sym" if self.symmetric else "zeros"
        return f"W{self.bits}-{self.dtype}-K{self.k}-N{self.n}-G{self.group_size}-{zeros}"


DEQUANT_CASES = [
    DequantCase(4, "fp16", 512, 256, 128, False),
    DequantCase(4, "bf16", 256, 132, 32, True),
    DequantCase(4, "fp32", 256, 128, 64, False),
    DequantCase(8, "fp16", 256, 256, 64, True),
    DequantCase(8, "bf16", 128, 132, 32, False),
    DequantCase(8, "fp32", 256, 128, 128, True),
]


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_dequant(host_builder: HostKernelBuilder, host_rng: np.random.Generator, case: DequantCase,
                 warp_size: int) -> None:
    """The dequantisation kernels equal ``QuantizedWeight.dequantize()`` rounded once to the dtype."""
    rng = host_rng
    qw = _random_weight(rng, case.k, case.n, case.bits, case.group_size, case.symmetric)
    util = _build(host_builder, qg_rules.quant_util_spec(DTYPE_CODES[case.dtype], warp_size), rng)
    dt = NUMPY_DTYPES[case.dtype]
    kernel = "hal_w4a16_dequant" if case.bits == 4 else "hal_w8_dequant"
    items = (case.k // 8) * (case.n // 4) if case.bits == 4 else case.k * (case.n // 4)
    launch = qg_rules.quant_util_launch(kernel, items, ONE_CU)  # at most 8 CTAs: the grid-stride loop repeats
    w = np.full((case.k, case.n), np.nan, dt)
    util.launch(launch, w, qw.qweight, qw.scales, qw.zeros, case.k, case.n, case.group_size)
    # (q - z) * s is exact in float32 (an integer below 256 times an fp16 scale), so the only
    # rounding is the final one to the dtype: the result must be bit-exact, stricter than any tolerance.
    np.testing.assert_array_equal(w, qw.dequantize(np.float64).astype(dt), err_msg=case.id)


def test_launch_errors_are_reported(host_builder: HostKernelBuilder, host_rng: np.random.Generator) -> None:
    """An empty grid is refused, as the host never launches for empty work."""
    util = _build(host_builder, qg_rules.quant_util_spec(0), host_rng)
    empty = Launch("hal_f32_to_dtype", (0, 1, 1), (256, 1, 1))
    with pytest.raises(HostLaunchError, match="empty grid"):
        util.launch(empty, np.zeros(1, np.float32), np.zeros(1, np.float32), 0)
