"""Catalogue of kernel specialisations and pure host-side launch rules.

Everything here is plain Python (no CuPy, no driver): the kernel sources live
in ``hal_cupy/kernels`` and are specialised by preprocessor defines.  A
compiled module is identified by (source text hash, options, arch), where the
options are ``Specialization.options()``.  ``hal_cupy/kernels/README.md``
documents every kernel parameter; the functions below turn shapes and device
numbers (compute units, warp size, ...) into specialisations and launch
configurations.

Every specialisation names the SIMD width it is compiled for
(``HAL_WARP_SIZE``: 32 for NVIDIA warps and RDNA wave32, 64 for CDNA
wavefronts), read from the device's capabilities; the launcher refuses to
run it on a device of another width.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DTYPE_CODES",
    "PA_HEAD_SIZES",
    "PA_BLOCK_SIZES",
    "PA_GQA_TILES",
    "PA_NUM_THREADS",
    "QGEMM_M_TILES",
    "QGEMM_GROUP_SIZES",
    "QGEMM_SMALL_M_MAX",
    "SIMD_WIDTHS",
    "Launch",
    "Specialization",
    "all_specializations",
    "paged_attention_spec",
    "paged_attention_gqa_tile",
    "paged_attention_shared_bytes",
    "choose_paged_attention_variant",
    "paged_attention_partitions",
    "paged_attention_launches",
    "PA_TC_HEAD_SIZES",
    "PA_TC_MIN_GROUP",
    "PA_TC_MIN_SM",
    "paged_attention_tc_spec",
    "paged_attention_tc_chunk",
    "paged_attention_tc_shared_bytes",
    "paged_attention_tc_token_groups",
    "paged_attention_tc_ctas_per_cu",
    "paged_attention_tc_partitions",
    "paged_attention_tc_launches",
    "paged_attention_tc_reduce_slices",
    "paged_attention_uses_tensor_cores",
    "write_kv_cache_spec",
    "write_kv_cache_launch",
    "quant_gemm_spec",
    "quant_util_spec",
    "quant_gemm_m_tile",
    "use_small_m_gemm",
    "quant_gemm_launch",
    "quant_gemm_shared_bytes",
    "quant_util_launch",
    "QGEMM_TC_M_FRAGS",
    "QGEMM_TC_M_MAX",
    "QGEMM_TC_MIN_SM",
    "quant_gemm_tc_spec",
    "quant_gemm_tc_m_frags",
    "quant_gemm_tc_launch",
    "quant_gemm_tc_reduce_launch",
    "quant_gemm_tc_shared_bytes",
]

#: HAL_DTYPE codes by dtype name (x/query/out element type).
DTYPE_CODES: dict[str, int] = {"float32": 0, "float16": 1, "bfloat16": 2}
_ELEM_BYTES = {0: 4, 1: 2, 2: 2}

PA_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
#: Block sizes are runtime arguments; any positive value works, these are tested.
PA_BLOCK_SIZES = (8, 16, 32)
#: Query heads per CTA (HAL_GQA); a group of G heads uses tile min(pow2ceil(G), 8).
PA_GQA_TILES = (1, 2, 4, 8)
PA_NUM_THREADS = 128
PA_UNROLL = 4
#: Tokens per split-KV partition (runtime argument of the split kernel).
PA_PARTITION_SIZE = 512

QGEMM_M_TILES = (1, 2, 4, 8, 16)
QGEMM_GROUP_SIZES = (32, 64, 128)
QGEMM_KWARPS = 4
#: Largest M that uses the fused small-M kernel; above it, dequantise + matmul.
QGEMM_SMALL_M_MAX = 32
QUTIL_THREADS = 256
#: SIMD widths the kernels are written for (warp / wavefront lanes).
SIMD_WIDTHS = (32, 64)

#: 16-row MMA fragments per CTA of the tensor-core GEMM (HAL_M_FRAGS): CTA tiles of 16, 32 and 64 rows.
QGEMM_TC_M_FRAGS = (1, 2, 4)
#: Largest M for the tensor-core kernels; above it, bounded K-slabs are dequantised and multiplied by cuBLAS.
QGEMM_TC_M_MAX = 128
#: Level of warp matrix instructions the tensor-core GEMM needs (mma.sync m16n8k16 bf16, cp.async, ldmatrix).
QGEMM_TC_MIN_SM = 80
QGEMM_TC_THREADS = 128
QGEMM_TC_COLS = 128
QGEMM_TC_KBLOCK = 32
QGEMM_TC_STAGES = 4
#: Partial sums of a K-split tensor-core GEMM are kept below this many bytes (fewer splits otherwise).
QGEMM_TC_MAX_WORKSPACE = 64 << 20

#: Head sizes of the tensor-core decode attention (``paged_attention_tc.cu``): multiples of 64 up to 256.
PA_TC_HEAD_SIZES = (64, 128, 192, 256)
#: Smallest GQA group (query heads per KV head) that uses the tensor-core kernel.
PA_TC_MIN_GROUP = 4
#: Level of warp matrix instructions the tensor-core attention needs (mma.sync m16n8k16 bf16, cp.async, ldmatrix).
PA_TC_MIN_SM = 80
#: Query heads per CTA of the tensor-core kernel (the MMA's M), threads per CTA.
PA_TC_ROWS = 16
PA_TC_THREADS = 128
#: Block-table entries the tensor-core kernel keeps in shared memory (more are read from global memory).
PA_TC_BT = 512
#: Smallest split-KV partition of the tensor-core kernel, in tokens: below it the partial outputs
#: (head_size fp32 per head and partition) cost more than the parallelism brings.
PA_TC_MIN_PARTITION = 256
#: Largest grid z (split-KV partitions) of a launch.
_MAX_GRID_Z = 65535

@dataclass(frozen=True)
class Specialization:
    """One compile unit: a source file built with a fixed set of defines."""

    source: str
    kernels: tuple[str, ...]
    defines: tuple[tuple[str, str], ...]
    #: Lowest level of warp matrix instructions (``hal_mma.cuh``; numbered like compute capabilities,
    #: major * 10 + minor) the source needs, compared with :meth:`~hal_cupy.GpuPlatform.warp_mma_level`;
    #: 0: every target.  Non-zero marks a tensor-core source, built only where the platform provides them.
    min_sm: int = 0

    def options(self) -> tuple[str, ...]:
        """``-D`` options for the compiler (the arch and the platform's own options are not included)."""
        return tuple(f"-D{k}={v}" for k, v in self.defines)

    @property
    def id(self) -> str:
        """Short readable name, e.g. ``paged_attention[DTYPE=1,HEAD_SIZE=128,GQA=8]``."""
        stem = self.source.rsplit(".", 1)[0]
        args = ",".join(f"{k.removeprefix('HAL_')}={v}" for k, v in self.defines)
        return f"{stem}[{args}]"


@dataclass(frozen=True)
class Launch:
    """A kernel launch: grid and block as (x, y, z), dynamic shared memory bytes."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0


def _dtype_code(dtype: str | int) -> int:
    if isinstance(dtype, int):
        if dtype not in _ELEM_BYTES:
            raise ValueError(f"unknown HAL_DTYPE code {dtype}")
        return dtype
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}") from None


def _warp(warp_size: int) -> tuple[str, str]:
    if warp_size not in SIMD_WIDTHS:
        raise ValueError(f"warp_size must be one of {SIMD_WIDTHS}, got {warp_size}")
    return ("HAL_WARP_SIZE", str(warp_size))


def _pow2ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# --------------------------------------------------------------------------
# Paged attention
# --------------------------------------------------------------------------

PA_KERNELS = ("hal_paged_attention", "hal_paged_attention_split", "hal_paged_attention_reduce")


def paged_attention_gqa_tile(group_size: int) -> int:
    """HAL_GQA for ``group_size = num_heads // num_kv_heads`` query heads per KV head."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    return min(_pow2ceil(group_size), 8)


def paged_attention_spec(dtype: str | int, head_size: int, group_size: int, warp_size: int = 32) -> Specialization:
    if head_size not in PA_HEAD_SIZES:
        raise ValueError(f"unsupported head_size {head_size}")
    return Specialization(
        "paged_attention.cu",
        PA_KERNELS,
        (
            ("HAL_DTYPE", str(_dtype_code(dtype))),
            ("HAL_HEAD_SIZE", str(head_size)),
            ("HAL_GQA", str(paged_attention_gqa_tile(group_size))),
            _warp(warp_size),
        ),
    )


def _pa_layout(dtype: int, head_size: int, warp_size: int) -> dict[str, int]:
    """Mirror of the constexpr lane layout in paged_attention.cu."""
    epv = 16 // _ELEM_BYTES[dtype]
    nvec = head_size // epv
    lpt = min(_pow2ceil(nvec), warp_size)
    spw = warp_size // lpt
    slots = (PA_NUM_THREADS // warp_size) * spw
    return {"epv": epv, "nvec": nvec, "lpt": lpt, "vpl": -(-nvec // lpt), "chunk": slots * PA_UNROLL}


#: Static shared memory of the attention kernels' index check (``hal_block_table_ok``: one int).
PA_INDEX_CHECK_BYTES = 4


def paged_attention_shared_bytes(dtype: str | int, head_size: int, gqa_tile: int, warp_size: int = 32) -> int:
    """Static shared memory of the attention kernels (no dynamic shared memory is used).

    ``4 * (GQA * CHUNK + GQA * HEAD_SIZE + 3 * GQA)`` with
    ``CHUNK = (128 / warp) * (warp / LPT) * 4`` and ``LPT = min(pow2ceil(HEAD_SIZE / EPV), warp)``,
    plus the index check's one int (``hal_index_checks.cuh``).
    """
    chunk = _pa_layout(_dtype_code(dtype), head_size, warp_size)["chunk"]
    return 4 * (gqa_tile * chunk + gqa_tile * head_size + 3 * gqa_tile) + PA_INDEX_CHECK_BYTES


def choose_paged_attention_variant(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    compute_units: int,
    num_heads: int | None = None,
    partition_size: int = PA_PARTITION_SIZE,
) -> str:
    """``"single"`` or ``"split"``.

    Split when the sequence is longer than one partition and the single-pass
    grid (num_seqs * num_kv_heads * gqa_tiles CTAs) would not give every
    compute unit two CTAs, or when a sequence is very long (> 8 partitions),
    which would serialise one CTA over many tokens.
    """
    if max_seq_len <= partition_size:
        return "single"
    tiles = 1
    if num_heads is not None:
        group = num_heads // num_kv_heads
        tiles = -(-group // paged_attention_gqa_tile(group))
    ctas = num_seqs * num_kv_heads * tiles
    if ctas < 2 * compute_units or max_seq_len > 8 * partition_size:
        return "split"
    return "single"


def paged_attention_partitions(max_seq_len: int, partition_size: int = PA_PARTITION_SIZE) -> int:
    """max_partitions = ceil(max_seq_len / partition_size) (at least 1)."""
    return max(1, -(-max_seq_len // partition_size))


def paged_attention_launches(
    variant: str,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int,
    partition_size: int = PA_PARTITION_SIZE,
) -> list[Launch]:
    """Launches (in order) for one decode step.

    The split variant also needs fp32 workspaces ``tmp_out [num_seqs, num_heads,
    max_partitions, head_size]``, ``max_logits`` and ``exp_sums`` ``[num_seqs,
    num_heads, max_partitions]`` (uninitialised is fine).
    """
    group = num_heads // num_kv_heads
    tiles = -(-group // paged_attention_gqa_tile(group))
    block = (PA_NUM_THREADS, 1, 1)
    gx = num_kv_heads * tiles
    if variant == "single":
        return [Launch("hal_paged_attention", (gx, num_seqs, 1), block)]
    if variant != "split":
        raise ValueError(variant)
    parts = paged_attention_partitions(max_seq_len, partition_size)
    return [
        Launch("hal_paged_attention_split", (gx, num_seqs, parts), block),
        Launch("hal_paged_attention_reduce", (num_heads, num_seqs, 1), block),
    ]


# --------------------------------------------------------------------------
# Paged attention on tensor cores
# --------------------------------------------------------------------------


def paged_attention_uses_tensor_cores(mma_level: int, dtype: str | int, group_size: int, head_size: int) -> bool:
    """True when ``paged_attention_tc.cu`` serves a call: warp matrix instructions of level ``PA_TC_MIN_SM``
    (:meth:`~hal_cupy.GpuPlatform.warp_mma_level`), fp16/bf16, a group of >= 4, a TC head size."""
    if mma_level < PA_TC_MIN_SM:
        return False
    code = dtype if isinstance(dtype, int) else DTYPE_CODES.get(dtype, -1)
    return code in (1, 2) and group_size >= PA_TC_MIN_GROUP and head_size in PA_TC_HEAD_SIZES


def paged_attention_tc_spec(dtype: str | int, head_size: int) -> Specialization:
    """``paged_attention_tc.cu`` for fp16/bf16 caches and a head size of :data:`PA_TC_HEAD_SIZES` (32-lane warps)."""
    code = _dtype_code(dtype)
    if code not in (1, 2):
        raise ValueError("the tensor-core attention takes float16 or bfloat16 caches")
    if head_size not in PA_TC_HEAD_SIZES:
        raise ValueError(f"unsupported head_size {head_size} for the tensor-core attention ({PA_TC_HEAD_SIZES})")
    return Specialization(
        "paged_attention_tc.cu",
        ("hal_paged_attention_tc",),
        (("HAL_DTYPE", str(code)), ("HAL_HEAD_SIZE", str(head_size)), _warp(32)),
        min_sm=PA_TC_MIN_SM,
    )


def paged_attention_tc_chunk(head_size: int) -> int:
    """Tokens per K/V stage (mirror of CHUNK in paged_attention_tc.cu): 64 for d=64, 32 up to 128, else 16."""
    return 64 if head_size == 64 else 32 if head_size <= 128 else 16


def paged_attention_tc_token_groups(head_size: int) -> int:
    """Warps along the tokens of a chunk (mirror of TG in paged_attention_tc.cu): ``min(4, chunk / 8)``."""
    return min(PA_TC_THREADS // 32, paged_attention_tc_chunk(head_size) // 8)


def paged_attention_tc_shared_bytes(head_size: int) -> int:
    """Static shared memory of hal_paged_attention_tc.

    Two stages of K and V (``chunk`` rows of ``head_size + 8`` 16-bit elements each; after the loop the same
    bytes hold the token groups' fp32 outputs), the 64-bit row offsets of two chunks, per token group and row
    the max, exp-sum and merge weight, the merged max and exp-sum per row, :data:`PA_TC_BT` block-table
    entries, and the index check's one int (``hal_index_checks.cuh``).
    """
    chunk = paged_attention_tc_chunk(head_size)
    groups = paged_attention_tc_token_groups(head_size)
    stages = max(2 * 2 * chunk * (head_size + 8) * 2, groups * PA_TC_ROWS * (head_size + 4) * 4)
    shared = stages + 2 * chunk * 8 + 3 * groups * PA_TC_ROWS * 4 + 2 * PA_TC_ROWS * 4 + PA_TC_BT * 4
    return shared + PA_INDEX_CHECK_BYTES


def paged_attention_tc_ctas_per_cu(
    head_size: int,
    shared_per_cu: int = 228 << 10,
    threads_per_cu: int = 2048,
    *,
    registers_per_thread: int = 0,
    registers_per_cu: int = 65536,
) -> int:
    """Resident CTAs of hal_paged_attention_tc per compute unit: the least of what the compute unit's shared
    memory (static shared bytes + the 1 KiB per-CTA reservation), threads and, when the compiled kernel's
    ``registers_per_thread`` is known, registers (allocated per warp in units of 256) allow.

    Pass the device's ``shared_mem_per_cu``, ``max_threads_per_cu`` and ``registers_per_cu``; the defaults are an
    H100's.  The device's occupancy calculator, where the runtime has one, bounds this further.
    """
    per_cta = paged_attention_tc_shared_bytes(head_size) + 1024  # the per-CTA reservation
    fits = min(shared_per_cu // per_cta, threads_per_cu // PA_TC_THREADS)
    if registers_per_thread > 0:
        per_warp = -(-registers_per_thread * 32 // 256) * 256
        fits = min(fits, registers_per_cu // (per_warp * (PA_TC_THREADS // 32)))
    return max(1, fits)


def paged_attention_tc_partitions(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int,
    head_size: int,
    compute_units: int,
    ctas_per_cu: int,
) -> tuple[int, int]:
    """(partition_size, max_partitions) of the tensor-core kernel.

    The grid without a split has ``num_seqs * num_kv_heads * ceil(group / 16)`` CTAs. Sequences are split
    into as many partitions as it takes to give every compute unit ``ctas_per_cu`` CTAs (one full wave at
    the kernel's occupancy), but no partition is shorter than :data:`PA_TC_MIN_PARTITION` tokens of
    ``max_seq_len``; the partition size is a whole number of chunks.  ``max_partitions == 1`` means no split
    (the kernel writes the output itself, no reduce step).
    """
    if min(num_seqs, num_heads, num_kv_heads, compute_units, ctas_per_cu) < 1:
        raise ValueError("num_seqs, num_heads, num_kv_heads, compute_units and ctas_per_cu must be >= 1")
    chunk = paged_attention_tc_chunk(head_size)
    max_seq_len = max(1, max_seq_len)
    group = num_heads // num_kv_heads
    base = num_seqs * num_kv_heads * -(-group // PA_TC_ROWS)
    want = -(-(compute_units * ctas_per_cu) // base)
    parts = max(1, min(want, max_seq_len // PA_TC_MIN_PARTITION, _MAX_GRID_Z))
    size = -(-max_seq_len // parts)
    size = -(-size // chunk) * chunk
    return size, -(-max_seq_len // size)


def paged_attention_tc_reduce_slices(head_size: int, rows: int, compute_units: int) -> int:
    """Column slices per head of the reduce step (its grid z): the fewest that give ``rows`` (heads x sequences)
    CTAs at least one per compute unit, each slice keeping at least 32 columns; 1 when ``compute_units`` is 0."""
    slices = 1
    while rows * slices < compute_units and head_size % (2 * slices) == 0 and head_size // (2 * slices) >= 32:
        slices *= 2
    return slices


def paged_attention_tc_launches(num_seqs: int, num_heads: int, num_kv_heads: int, max_partitions: int,
                                head_size: int = 128, compute_units: int = 0) -> list[Launch]:
    """hal_paged_attention_tc over (num_kv_heads * ceil(group / 16), num_seqs, max_partitions), then, when
    split, hal_paged_attention_reduce of paged_attention.cu over (num_heads, num_seqs, slices), with
    :func:`paged_attention_tc_reduce_slices` column slices so that the reduce step fills ``compute_units``.

    A split needs the fp32 workspaces of :func:`paged_attention_launches` (uninitialised is fine)."""
    group = num_heads // num_kv_heads
    gx = num_kv_heads * -(-group // PA_TC_ROWS)
    plans = [Launch("hal_paged_attention_tc", (gx, num_seqs, max_partitions), (PA_TC_THREADS, 1, 1))]
    if max_partitions > 1:
        slices = paged_attention_tc_reduce_slices(head_size, num_heads * num_seqs, compute_units)
        plans.append(Launch("hal_paged_attention_reduce", (num_heads, num_seqs, slices), (PA_NUM_THREADS, 1, 1)))
    return plans


# --------------------------------------------------------------------------
# KV cache write
# --------------------------------------------------------------------------


def write_kv_cache_spec(slot_int64: bool = True, warp_size: int = 32) -> Specialization:
    return Specialization(
        "write_kv_cache.cu", ("hal_write_kv_cache",),
        (("HAL_SLOT_INT64", "1" if slot_int64 else "0"), _warp(warp_size)),
    )


def write_kv_cache_launch(num_tokens: int) -> Launch:
    """One CTA of 128 threads per token; row_bytes = head_size * element size."""
    return Launch("hal_write_kv_cache", (num_tokens, 1, 1), (128, 1, 1))


# --------------------------------------------------------------------------
# Quantised GEMM
# --------------------------------------------------------------------------


def quant_gemm_spec(dtype: str | int, bits: int, m_tile: int, warp_size: int = 32) -> Specialization:
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    if m_tile not in QGEMM_M_TILES:
        raise ValueError(f"m_tile must be one of {QGEMM_M_TILES}")
    kernel = "hal_w4a16_gemm" if bits == 4 else "hal_w8a8_gemm"
    return Specialization(
        "quant_gemm.cu",
        (kernel,),
        (("HAL_DTYPE", str(_dtype_code(dtype))), ("HAL_QBITS", str(bits)), ("HAL_M_TILE", str(m_tile)),
         _warp(warp_size)),
    )


def quant_util_spec(dtype: str | int, warp_size: int = 32) -> Specialization:
    return Specialization(
        "quant_util.cu",
        ("hal_w4a16_dequant", "hal_w8_dequant", "hal_w8a8_quantize_rows", "hal_f32_to_dtype",
         "hal_f32_splits_to_dtype"),
        (("HAL_DTYPE", str(_dtype_code(dtype))), _warp(warp_size)),
    )


def use_small_m_gemm(m: int, bits: int = 4) -> bool:
    """True: fused small-M kernel; False: dequantise to ``[K, N]`` and use a dense matmul.

    The fused kernel reads the packed weights once per 16 rows of x, while the
    dense path writes and re-reads a full fp16/bf16 weight; up to M = 32 the
    fused kernel moves fewer bytes.
    """
    del bits
    return 0 < m <= QGEMM_SMALL_M_MAX


def quant_gemm_m_tile(m: int) -> int:
    """Smallest tile >= m, capped at 16 (larger M loops over grid.z chunks)."""
    for t in QGEMM_M_TILES:
        if m <= t:
            return t
    return QGEMM_M_TILES[-1]


def quant_gemm_launch(
    bits: int, m: int, n: int, k: int, group_size: int, compute_units: int, warp_size: int = 32
) -> tuple[Launch, int, int]:
    """(launch, ksplit, groups_per_split) for hal_w4a16_gemm / hal_w8a8_gemm.

    grid = (ceil(N / (4 * warp)), ksplit, ceil(M / m_tile)), block = 4 * warp.
    ksplit spreads the K groups over CTAs until there are about 2 CTAs per
    compute unit, keeping at least ``4`` groups (one per warp) per CTA.
    When ksplit > 1 each CTA stores its split's fp32 partial to a workspace
    ``ws [ksplit, M, N]`` (every element written, no atomics) and
    ``hal_f32_splits_to_dtype`` adds the splits in order 0, 1, ... into ``out``:
    the same bits on every run for a given device and shape.
    """
    if k <= 0 or n % 4 or k % group_size or group_size not in QGEMM_GROUP_SIZES:
        raise ValueError("need K > 0, N % 4 == 0 and K % group_size == 0 with a supported group size")
    kernel_m_tile = quant_gemm_m_tile(m)
    n_tiles = -(-n // (4 * warp_size))
    m_chunks = -(-m // kernel_m_tile)
    groups = k // group_size
    ctas = n_tiles * m_chunks
    ksplit = 1
    if ctas < 2 * compute_units:
        ksplit = min(-(-2 * compute_units // ctas), max(1, groups // QGEMM_KWARPS))
    per_split = -(-groups // ksplit)
    ksplit = -(-groups // per_split)
    kernel = "hal_w4a16_gemm" if bits == 4 else "hal_w8a8_gemm"
    launch = Launch(kernel, (n_tiles, ksplit, m_chunks), (QGEMM_KWARPS * warp_size, 1, 1))
    return launch, ksplit, per_split


def quant_gemm_shared_bytes(m_tile: int, warp_size: int = 32) -> int:
    """Static shared memory of the quantised GEMM kernels: ``4 * m_tile * 4 * warp``."""
    return 4 * m_tile * 4 * warp_size


def quant_util_launch(kernel: str, items: int, compute_units: int) -> Launch:
    """Launch for a quant_util kernel.

    ``items``: (K/8)*(N/4) for hal_w4a16_dequant, K*(N/4) for hal_w8_dequant,
    M for hal_w8a8_quantize_rows (one CTA per row), element count (M * N) for
    hal_f32_to_dtype and hal_f32_splits_to_dtype.  Grid-stride kernels use at most 8 CTAs per compute unit.
    """
    block = (QUTIL_THREADS, 1, 1)
    if kernel == "hal_w8a8_quantize_rows":
        return Launch(kernel, (items, 1, 1), block)
    blocks = max(1, min(-(-items // QUTIL_THREADS), 8 * compute_units))
    return Launch(kernel, (blocks, 1, 1), block)


# --------------------------------------------------------------------------
# Quantised GEMM on tensor cores
# --------------------------------------------------------------------------


def quant_gemm_tc_spec(dtype: str | int, bits: int, m_frags: int) -> Specialization:
    """``quant_gemm_tc.cu`` for fp16/bf16 activations, W4A16 (bits 4) or W8A8 (bits 8), CTA tile 16 * m_frags rows.

    Always 32-lane warps (``mma.sync`` is a warp instruction of 32 lanes).
    """
    code = _dtype_code(dtype)
    if code not in (1, 2):
        raise ValueError("the tensor-core GEMM takes float16 or bfloat16 activations")
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    if m_frags not in QGEMM_TC_M_FRAGS:
        raise ValueError(f"m_frags must be one of {QGEMM_TC_M_FRAGS}")
    kernel = "hal_w4a16_gemm_tc" if bits == 4 else "hal_w8a8_gemm_tc"
    return Specialization(
        "quant_gemm_tc.cu",
        (kernel, "hal_tc_reduce"),
        (("HAL_DTYPE", str(code)), ("HAL_QBITS", str(bits)), ("HAL_M_FRAGS", str(m_frags)), _warp(32)),
        min_sm=QGEMM_TC_MIN_SM,
    )


def quant_gemm_tc_m_frags(m: int) -> int:
    """Smallest CTA tile (in 16-row fragments) holding ``m`` rows, capped at 4 (larger M: grid.z chunks of 64)."""
    for f in QGEMM_TC_M_FRAGS:
        if m <= 16 * f:
            return f
    return QGEMM_TC_M_FRAGS[-1]


def quant_gemm_tc_launch(
    bits: int, m: int, n: int, k: int, group_size: int, compute_units: int, ctas_per_cu: int = 2
) -> tuple[Launch, int, int]:
    """(launch, ksplit, kb_per_split) for hal_w4a16_gemm_tc / hal_w8a8_gemm_tc.

    grid = (Npad / 128, ksplit, ceil(M / (16 * m_frags))), block 128.  The K
    blocks (32 rows each) are split into ``ksplit`` contiguous stripes until the
    grid has ``ctas_per_cu`` CTAs per compute unit, each stripe keeping at least
    ``2 * stages`` k-blocks, and the fp32 partials ``ksplit * M * N * 4`` bytes
    below ``QGEMM_TC_MAX_WORKSPACE``.  ksplit > 1: partials go to ``ws`` and
    :func:`quant_gemm_tc_reduce_launch` sums them in split order (deterministic).
    """
    if m <= 0 or n <= 0 or k <= 0 or k % group_size or group_size % QGEMM_TC_KBLOCK or group_size & (group_size - 1):
        raise ValueError("need M, N, K > 0 and K % group_size == 0 with group_size a power of two >= 32")
    frags = quant_gemm_tc_m_frags(m)
    n_tiles = -(-n // QGEMM_TC_COLS)
    m_chunks = -(-m // (16 * frags))
    kblocks = k // QGEMM_TC_KBLOCK
    ctas = n_tiles * m_chunks
    ksplit = 1
    target = ctas_per_cu * compute_units
    if ctas < target:
        ksplit = min(-(-target // ctas), max(1, kblocks // (2 * QGEMM_TC_STAGES)))
        ksplit = max(1, min(ksplit, QGEMM_TC_MAX_WORKSPACE // (4 * m * n)))
    per_split = -(-kblocks // ksplit)
    ksplit = -(-kblocks // per_split)
    kernel = "hal_w4a16_gemm_tc" if bits == 4 else "hal_w8a8_gemm_tc"
    return Launch(kernel, (n_tiles, ksplit, m_chunks), (QGEMM_TC_THREADS, 1, 1)), ksplit, per_split


def quant_gemm_tc_reduce_launch(m: int, n: int, compute_units: int) -> Launch:
    """hal_tc_reduce over M * N outputs: grid-stride, at most 8 CTAs of 128 threads per compute unit."""
    blocks = max(1, min(-(-(m * n) // QGEMM_TC_THREADS), 8 * compute_units))
    return Launch("hal_tc_reduce", (blocks, 1, 1), (QGEMM_TC_THREADS, 1, 1))


def quant_gemm_tc_shared_bytes(bits: int, m_frags: int) -> int:
    """Static shared memory of quant_gemm_tc.cu: ``stages * (B + 16 m_frags * stride + 256 + 128)``."""
    b_bytes = QGEMM_TC_COLS * QGEMM_TC_KBLOCK // (2 if bits == 4 else 1)
    stride = QGEMM_TC_KBLOCK * (2 if bits == 4 else 1) + 16
    return QGEMM_TC_STAGES * (b_bytes + 16 * m_frags * stride + 2 * QGEMM_TC_COLS + QGEMM_TC_COLS)


# --------------------------------------------------------------------------
# Catalogue
# --------------------------------------------------------------------------


def all_specializations(warp_size: int = 32) -> list[Specialization]:
    """Every specialisation the op implementations may request on a device of ``warp_size`` lanes.

    Entries with ``min_sm`` > 0 (the tensor-core kernels, 32-lane warps only) build only where the platform's
    :meth:`~hal_cupy.GpuPlatform.warp_mma_level` reaches ``min_sm``.
    """
    specs: list[Specialization] = []
    for dtype in DTYPE_CODES:
        for hs in PA_HEAD_SIZES:
            for g in PA_GQA_TILES:
                specs.append(paged_attention_spec(dtype, hs, g, warp_size))
    if warp_size == 32:  # mma.sync is a 32-lane warp instruction
        for dtype in ("float16", "bfloat16"):
            for hs in PA_TC_HEAD_SIZES:
                specs.append(paged_attention_tc_spec(dtype, hs))
    specs.append(write_kv_cache_spec(True, warp_size))
    specs.append(write_kv_cache_spec(False, warp_size))
    for dtype in DTYPE_CODES:
        for bits in (4, 8):
            for mt in QGEMM_M_TILES:
                specs.append(quant_gemm_spec(dtype, bits, mt, warp_size))
        specs.append(quant_util_spec(dtype, warp_size))
    if warp_size == 32:  # mma.sync is a 32-lane warp instruction
        for dtype in ("float16", "bfloat16"):
            for bits in (4, 8):
                for mf in QGEMM_TC_M_FRAGS:
                    specs.append(quant_gemm_tc_spec(dtype, bits, mf))
    return specs
