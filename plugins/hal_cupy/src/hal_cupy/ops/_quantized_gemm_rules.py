"""Specialisations and pure launch rules of ``quantized_gemm``: ``quant_gemm.cu`` (small-M SIMT kernels),
``quant_util.cu`` (dequantisation, activation quantisation, casts) and ``quant_gemm_tc.cu`` (tensor cores).

Plain Python (no CuPy, no driver): the functions below turn shapes and device
numbers (compute units, SIMD width) into specialisations and launch
configurations; :mod:`hal_cupy.ops._quantized_gemm` calls them, and so do the
host-compiled kernel tests.  ``hal_cupy/kernels/README.md`` documents every
kernel parameter.
"""

from __future__ import annotations

from .._specialization import DTYPE_CODES, Launch, Specialization, dtype_code, warp_define

__all__ = [
    "QGEMM_GROUP_SIZES",
    "QGEMM_M_TILES",
    "QGEMM_SMALL_M_MAX",
    "QGEMM_TC_COLS",
    "QGEMM_TC_MAX_WORKSPACE",
    "QGEMM_TC_MIN_SM",
    "QGEMM_TC_M_FRAGS",
    "QGEMM_TC_M_MAX",
    "quant_gemm_launch",
    "quant_gemm_m_tile",
    "quant_gemm_shared_bytes",
    "quant_gemm_spec",
    "quant_gemm_tc_launch",
    "quant_gemm_tc_m_frags",
    "quant_gemm_tc_reduce_launch",
    "quant_gemm_tc_shared_bytes",
    "quant_gemm_tc_kernel",
    "quant_gemm_tc_spec",
    "quant_util_launch",
    "quant_util_spec",
    "specializations",
    "use_small_m_gemm",
]

QGEMM_M_TILES = (1, 2, 4, 8, 16)
QGEMM_GROUP_SIZES = (32, 64, 128)
QGEMM_KWARPS = 4
#: Largest M that uses the fused small-M kernel; above it, dequantise + matmul.
QGEMM_SMALL_M_MAX = 32
QUTIL_THREADS = 256

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


# --------------------------------------------------------------------------
# SIMT kernels (quant_gemm.cu, quant_util.cu)
# --------------------------------------------------------------------------


def quant_gemm_spec(dtype: str | int, bits: int, m_tile: int, warp_size: int = 32) -> Specialization:
    """``quant_gemm.cu`` for a dtype of ``x`` and ``out``, W4A16 (bits 4) or W8A8 (bits 8), ``m_tile`` rows of ``x``
    per CTA (:data:`QGEMM_M_TILES`, see :func:`quant_gemm_m_tile`), at ``warp_size`` lanes."""
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    if m_tile not in QGEMM_M_TILES:
        raise ValueError(f"m_tile must be one of {QGEMM_M_TILES}")
    kernel = "hal_w4a16_gemm" if bits == 4 else "hal_w8a8_gemm"
    return Specialization(
        "quant_gemm.cu",
        (kernel,),
        (("HAL_DTYPE", str(dtype_code(dtype))), ("HAL_QBITS", str(bits)), ("HAL_M_TILE", str(m_tile)),
         warp_define(warp_size)),
    )


def quant_util_spec(dtype: str | int, warp_size: int = 32) -> Specialization:
    """``quant_util.cu`` (dequantisation, row quantisation, fp32 casts) for a dtype, at ``warp_size`` lanes."""
    return Specialization(
        "quant_util.cu",
        ("hal_w4a16_dequant", "hal_w8_dequant", "hal_w8a8_quantize_rows", "hal_f32_to_dtype",
         "hal_f32_splits_to_dtype", "hal_w4a8_quantize_rows"),
        (("HAL_DTYPE", str(dtype_code(dtype))), warp_define(warp_size)),
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
    M for hal_w8a8_quantize_rows and hal_w4a8_quantize_rows (one CTA per row), element count (M * N) for
    hal_f32_to_dtype and hal_f32_splits_to_dtype.  Grid-stride kernels use at most 8 CTAs per compute unit.
    """
    block = (QUTIL_THREADS, 1, 1)
    if kernel in ("hal_w8a8_quantize_rows", "hal_w4a8_quantize_rows"):
        return Launch(kernel, (items, 1, 1), block)
    blocks = max(1, min(-(-items // QUTIL_THREADS), 8 * compute_units))
    return Launch(kernel, (blocks, 1, 1), block)


# --------------------------------------------------------------------------
# Tensor-core kernels (quant_gemm_tc.cu)
# --------------------------------------------------------------------------


def quant_gemm_tc_kernel(bits: int, int8_activations: bool = False) -> str:
    """The tensor-core GEMM entry point: ``hal_w4a16_gemm_tc``, ``hal_w4a8_gemm_tc`` (int4 weights,
    ``int8_activations``) or ``hal_w8a8_gemm_tc`` (bits 8, whose activations are always int8)."""
    if bits not in (4, 8):
        raise ValueError("bits must be 4 or 8")
    if bits == 8:
        return "hal_w8a8_gemm_tc"
    return "hal_w4a8_gemm_tc" if int8_activations else "hal_w4a16_gemm_tc"


def quant_gemm_tc_spec(dtype: str | int, bits: int, m_frags: int, int8_activations: bool = False) -> Specialization:
    """``quant_gemm_tc.cu`` for W4A16 (bits 4, fp16/bf16 activations), W4A8 (bits 4, ``int8_activations``) or W8A8
    (bits 8), CTA tile 16 * m_frags rows; the int8-activation GEMMs take every dtype (fp32 too: they read ``xq``).

    Always 32-lane warps (``mma.sync`` is a warp instruction of 32 lanes).  W4A8 adds ``HAL_ABITS=8``.
    """
    code = dtype_code(dtype)
    kernel = quant_gemm_tc_kernel(bits, int8_activations)
    if kernel == "hal_w4a16_gemm_tc" and code not in (1, 2):
        raise ValueError("the W4A16 tensor-core GEMM takes float16 or bfloat16 activations")
    if m_frags not in QGEMM_TC_M_FRAGS:
        raise ValueError(f"m_frags must be one of {QGEMM_TC_M_FRAGS}")
    abits = (("HAL_ABITS", "8"),) if kernel == "hal_w4a8_gemm_tc" else ()
    return Specialization(
        "quant_gemm_tc.cu",
        (kernel, "hal_tc_reduce"),
        (("HAL_DTYPE", str(code)), ("HAL_QBITS", str(bits)), *abits, ("HAL_M_FRAGS", str(m_frags)),
         warp_define(32)),
        min_sm=QGEMM_TC_MIN_SM,
    )


def quant_gemm_tc_m_frags(m: int) -> int:
    """Smallest CTA tile (in 16-row fragments) holding ``m`` rows, capped at 4 (larger M: grid.z chunks of 64)."""
    for f in QGEMM_TC_M_FRAGS:
        if m <= 16 * f:
            return f
    return QGEMM_TC_M_FRAGS[-1]


def quant_gemm_tc_launch(
    bits: int, m: int, n: int, k: int, group_size: int, compute_units: int, ctas_per_cu: int = 2,
    int8_activations: bool = False,
) -> tuple[Launch, int, int]:
    """(launch, ksplit, kb_per_split) for hal_w4a16_gemm_tc / hal_w4a8_gemm_tc (``int8_activations``) /
    hal_w8a8_gemm_tc.

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
    kernel = quant_gemm_tc_kernel(bits, int8_activations)
    return Launch(kernel, (n_tiles, ksplit, m_chunks), (QGEMM_TC_THREADS, 1, 1)), ksplit, per_split


def quant_gemm_tc_reduce_launch(m: int, n: int, compute_units: int) -> Launch:
    """hal_tc_reduce over M * N outputs: grid-stride, at most 8 CTAs of 128 threads per compute unit."""
    blocks = max(1, min(-(-(m * n) // QGEMM_TC_THREADS), 8 * compute_units))
    return Launch("hal_tc_reduce", (blocks, 1, 1), (QGEMM_TC_THREADS, 1, 1))


def quant_gemm_tc_shared_bytes(bits: int, m_frags: int, int8_activations: bool = False) -> int:
    """Static shared memory of quant_gemm_tc.cu: ``stages * (B + 16 m_frags * stride + 256 + 128)`` (x rows of
    2-byte elements in W4A16, of int8 in W4A8 and W8A8)."""
    b_bytes = QGEMM_TC_COLS * QGEMM_TC_KBLOCK // (2 if bits == 4 else 1)
    stride = QGEMM_TC_KBLOCK * (2 if bits == 4 and not int8_activations else 1) + 16
    return QGEMM_TC_STAGES * (b_bytes + 16 * m_frags * stride + 2 * QGEMM_TC_COLS + QGEMM_TC_COLS)


# --------------------------------------------------------------------------
# Catalogue
# --------------------------------------------------------------------------


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``quantized_gemm`` may request on a device of ``warp_size`` lanes: per dtype the SIMT
    GEMMs (W4A16 and W8A8, every M tile) and the utility kernels, then (32-lane warps) the tensor-core GEMMs
    (``min_sm = QGEMM_TC_MIN_SM``): W4A16 and W8A8 for fp16/bf16, then W4A8 for every dtype and W8A8 for fp32."""
    specs: list[Specialization] = []
    for dtype in DTYPE_CODES:
        specs += [quant_gemm_spec(dtype, bits, mt, warp_size) for bits in (4, 8) for mt in QGEMM_M_TILES]
        specs.append(quant_util_spec(dtype, warp_size))
    if warp_size == 32:  # mma.sync is a 32-lane warp instruction
        specs += [quant_gemm_tc_spec(dtype, bits, mf)
                  for dtype in ("float16", "bfloat16") for bits in (4, 8) for mf in QGEMM_TC_M_FRAGS]
        specs += [quant_gemm_tc_spec(dtype, 4, mf, int8_activations=True)
                  for dtype in DTYPE_CODES for mf in QGEMM_TC_M_FRAGS]
        specs += [quant_gemm_tc_spec("float32", 8, mf) for mf in QGEMM_TC_M_FRAGS]
    return specs
