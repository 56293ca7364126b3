"""Specialisations and pure launch rules of ``paged_attention``: ``paged_attention.cu`` (SIMT) and
``paged_attention_tc.cu`` (tensor cores).

Plain Python (no CuPy, no driver): the functions below turn shapes and device
numbers (compute units, SIMD width, shared memory, ...) into specialisations
and launch configurations; :mod:`hal_cupy.ops._paged_attention` calls them,
and so do the host-compiled kernel tests.  ``hal_cupy/kernels/README.md``
documents every kernel parameter.
"""

from __future__ import annotations

from .._specialization import DTYPE_CODES, ELEM_BYTES, Launch, Specialization, dtype_code, pow2ceil, warp_define

__all__ = [
    "PA_BLOCK_SIZES",
    "PA_GQA_TILES",
    "PA_HEAD_SIZES",
    "PA_INDEX_CHECK_BYTES",
    "PA_KERNELS",
    "PA_NUM_THREADS",
    "PA_PARTITION_SIZE",
    "PA_TC_HEAD_SIZES",
    "PA_TC_MIN_GROUP",
    "PA_TC_MIN_PARTITION",
    "PA_TC_MIN_SM",
    "PA_PREFILL_ROWS",
    "PA_SPLIT_WORKSPACE_BYTES",
    "choose_paged_attention_variant",
    "paged_attention_gqa_tile",
    "paged_attention_rows",
    "paged_attention_tiles",
    "paged_attention_launches",
    "paged_attention_partitions",
    "paged_attention_shared_bytes",
    "paged_attention_spec",
    "paged_attention_tc_chunk",
    "paged_attention_tc_ctas_per_cu",
    "paged_attention_tc_launches",
    "paged_attention_tc_partitions",
    "paged_attention_tc_reduce_slices",
    "paged_attention_tc_shared_bytes",
    "paged_attention_tc_spec",
    "paged_attention_tc_token_groups",
    "paged_attention_uses_tensor_cores",
    "specializations",
]

PA_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
#: Block sizes are runtime arguments; any positive value works, these are tested.
PA_BLOCK_SIZES = (8, 16, 32, 64, 128)
#: Query heads per CTA (HAL_GQA); a group of G heads uses tile min(pow2ceil(G), 8).
PA_GQA_TILES = (1, 2, 4, 8)
PA_NUM_THREADS = 128
PA_UNROLL = 4
#: Tokens per split-KV partition (runtime argument of the split kernel).
PA_PARTITION_SIZE = 512
#: Rows ((new token, query head) pairs of one KV head) per CTA of a call with prefill rows: HAL_GQA = 8.
PA_PREFILL_ROWS = 8
#: Largest fp32 workspace (partial outputs and statistics) a split-KV launch may take; a call needing more runs
#: single-pass (a prefill of many tokens has enough CTAs without a split).
PA_SPLIT_WORKSPACE_BYTES = 64 << 20
#: Largest grid y (sequences; query rows of the reduce step) of a launch.
_MAX_GRID_Y = 65535

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


# --------------------------------------------------------------------------
# SIMT kernels (paged_attention.cu)
# --------------------------------------------------------------------------

PA_KERNELS = ("hal_paged_attention", "hal_paged_attention_split", "hal_paged_attention_reduce")


def paged_attention_gqa_tile(group_size: int) -> int:
    """HAL_GQA for ``group_size = num_heads // num_kv_heads`` query heads per KV head."""
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    return min(pow2ceil(group_size), 8)


def paged_attention_rows(group_size: int, max_query_len: int = 1) -> int:
    """Rows per CTA (HAL_GQA) of ``paged_attention.cu``: the GQA tile of the group for decode
    (``max_query_len == 1``), else :data:`PA_PREFILL_ROWS` (new tokens x query heads of one KV head, token-major)."""
    if max_query_len < 1:
        raise ValueError("max_query_len must be >= 1")
    return paged_attention_gqa_tile(group_size) if max_query_len == 1 else PA_PREFILL_ROWS


def paged_attention_tiles(num_heads: int, num_kv_heads: int, max_query_len: int = 1) -> int:
    """CTAs per (sequence, KV head): ``ceil(max_query_len * group / rows)`` with ``rows =``
    :func:`paged_attention_rows`; grid x is ``num_kv_heads`` times this."""
    group = num_heads // num_kv_heads
    return -(-max_query_len * group // paged_attention_rows(group, max_query_len))


def paged_attention_spec(dtype: str | int, head_size: int, group_size: int, warp_size: int = 32) -> Specialization:
    """``paged_attention.cu`` for a dtype, a head size of :data:`PA_HEAD_SIZES` and a GQA group of ``group_size``
    query heads per KV head (built with the tile :func:`paged_attention_gqa_tile`), at ``warp_size`` lanes."""
    if head_size not in PA_HEAD_SIZES:
        raise ValueError(f"unsupported head_size {head_size}")
    return Specialization(
        "paged_attention.cu",
        PA_KERNELS,
        (
            ("HAL_DTYPE", str(dtype_code(dtype))),
            ("HAL_HEAD_SIZE", str(head_size)),
            ("HAL_GQA", str(paged_attention_gqa_tile(group_size))),
            warp_define(warp_size),
        ),
    )


def _pa_layout(dtype: int, head_size: int, warp_size: int) -> dict[str, int]:
    """Mirror of the constexpr lane layout in paged_attention.cu."""
    epv = 16 // ELEM_BYTES[dtype]
    nvec = head_size // epv
    lpt = min(pow2ceil(nvec), warp_size)
    spw = warp_size // lpt
    slots = (PA_NUM_THREADS // warp_size) * spw
    return {"epv": epv, "nvec": nvec, "lpt": lpt, "vpl": -(-nvec // lpt), "chunk": slots * PA_UNROLL}


#: Static shared memory of the attention kernels' index check (``hal_block_table_ok``: one int).
PA_INDEX_CHECK_BYTES = 4


def paged_attention_shared_bytes(dtype: str | int, head_size: int, gqa_tile: int, warp_size: int = 32) -> int:
    """Static shared memory of the attention kernels (no dynamic shared memory is used).

    ``4 * (GQA * CHUNK + GQA * HEAD_SIZE + 3 * GQA)`` with
    ``CHUNK = (128 / warp) * (warp / LPT) * 4`` and ``LPT = min(pow2ceil(HEAD_SIZE / EPV), warp)``,
    plus the index checks' two ints (``hal_index_checks.cuh``: the block table's and query_start_loc's).
    """
    chunk = _pa_layout(dtype_code(dtype), head_size, warp_size)["chunk"]
    return 4 * (gqa_tile * chunk + gqa_tile * head_size + 3 * gqa_tile) + 2 * PA_INDEX_CHECK_BYTES


def choose_paged_attention_variant(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    compute_units: int,
    num_heads: int | None = None,
    partition_size: int = PA_PARTITION_SIZE,
    *,
    max_query_len: int = 1,
    num_tokens: int | None = None,
    head_size: int = 256,
) -> str:
    """``"single"`` or ``"split"``.

    Split when the sequence is longer than one partition and the single-pass
    grid (num_seqs * num_kv_heads * :func:`paged_attention_tiles` CTAs) would not
    give every compute unit two CTAs, or when a sequence is very long (> 8
    partitions), which would serialise one CTA over many tokens -- unless the
    split's workspace for ``num_tokens`` query rows (default ``num_seqs``) of
    ``head_size`` would pass :data:`PA_SPLIT_WORKSPACE_BYTES` or its reduce step
    the grid's y limit (a prefill of many tokens: enough CTAs without it).
    """
    if max_seq_len <= partition_size:
        return "single"
    rows = num_seqs if num_tokens is None else num_tokens
    heads = num_kv_heads if num_heads is None else num_heads
    workspace = 4 * rows * heads * paged_attention_partitions(max_seq_len, partition_size) * (head_size + 2)
    if workspace > PA_SPLIT_WORKSPACE_BYTES or rows > _MAX_GRID_Y:
        return "single"
    tiles = 1
    if num_heads is not None:
        tiles = paged_attention_tiles(num_heads, num_kv_heads, max_query_len)
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
    *,
    max_query_len: int = 1,
    num_tokens: int | None = None,
) -> list[Launch]:
    """Launches (in order) for one call: ``num_tokens`` query rows (default ``num_seqs``, decode), at most
    ``max_query_len`` per sequence.

    The split variant also needs fp32 workspaces ``tmp_out [num_tokens, num_heads,
    max_partitions, head_size]``, ``max_logits`` and ``exp_sums`` ``[num_tokens,
    num_heads, max_partitions]`` (uninitialised is fine); its reduce step has one
    CTA per (query head, query row).
    """
    tiles = paged_attention_tiles(num_heads, num_kv_heads, max_query_len)
    block = (PA_NUM_THREADS, 1, 1)
    gx = num_kv_heads * tiles
    if variant == "single":
        return [Launch("hal_paged_attention", (gx, num_seqs, 1), block)]
    if variant != "split":
        raise ValueError(variant)
    parts = paged_attention_partitions(max_seq_len, partition_size)
    rows = num_seqs if num_tokens is None else num_tokens
    return [
        Launch("hal_paged_attention_split", (gx, num_seqs, parts), block),
        Launch("hal_paged_attention_reduce", (num_heads, rows, 1), block),
    ]


# --------------------------------------------------------------------------
# Tensor-core kernel (paged_attention_tc.cu)
# --------------------------------------------------------------------------


def paged_attention_uses_tensor_cores(mma_level: int, dtype: str | int, group_size: int, head_size: int,
                                      prefill: bool = False) -> bool:
    """True when ``paged_attention_tc.cu`` serves a call: warp matrix instructions of level ``PA_TC_MIN_SM``
    (:meth:`~hal_cupy.GpuPlatform.warp_mma_level`), fp16/bf16, a TC head size, and prefill rows (``prefill``:
    new tokens fill the 16 rows whatever the group) or a group of >= 4 (decode)."""
    if mma_level < PA_TC_MIN_SM:
        return False
    code = dtype if isinstance(dtype, int) else DTYPE_CODES.get(dtype, -1)
    return code in (1, 2) and (prefill or group_size >= PA_TC_MIN_GROUP) and head_size in PA_TC_HEAD_SIZES


def paged_attention_tc_spec(dtype: str | int, head_size: int, varlen: bool = False) -> Specialization:
    """``paged_attention_tc.cu`` for fp16/bf16 caches and a head size of :data:`PA_TC_HEAD_SIZES` (32-lane warps):
    the decode build (``HAL_VARLEN=0``: C-contiguous caches, every row sees every key of its partition), or with
    ``varlen`` the build that masks each row to its own keys, applies softcap and ALiBi and takes the caches'
    strides (prefill rows, a window, softcap, ALiBi, strided caches)."""
    code = dtype_code(dtype)
    if code not in (1, 2):
        raise ValueError("the tensor-core attention takes float16 or bfloat16 caches")
    if head_size not in PA_TC_HEAD_SIZES:
        raise ValueError(f"unsupported head_size {head_size} for the tensor-core attention ({PA_TC_HEAD_SIZES})")
    return Specialization(
        "paged_attention_tc.cu",
        ("hal_paged_attention_tc",),
        (("HAL_DTYPE", str(code)), ("HAL_HEAD_SIZE", str(head_size)), ("HAL_VARLEN", str(int(varlen))),
         warp_define(32)),
        min_sm=PA_TC_MIN_SM,
    )


def paged_attention_tc_chunk(head_size: int) -> int:
    """Tokens per K/V stage (mirror of CHUNK in paged_attention_tc.cu): 64 for d=64, 32 up to 128, else 16."""
    return 64 if head_size == 64 else 32 if head_size <= 128 else 16


def paged_attention_tc_token_groups(head_size: int) -> int:
    """Warps along the tokens of a chunk (mirror of TG in paged_attention_tc.cu): ``min(4, chunk / 8)``."""
    return min(PA_TC_THREADS // 32, paged_attention_tc_chunk(head_size) // 8)


def paged_attention_tc_shared_bytes(head_size: int, varlen: bool = False) -> int:
    """Static shared memory of hal_paged_attention_tc.

    Two stages of K and V (``chunk`` rows of ``head_size + 8`` 16-bit elements each; after the loop the same
    bytes hold the token groups' fp32 outputs), the 64-bit row offsets of two chunks, per token group and row
    the max, exp-sum and merge weight, the merged max and exp-sum per row, :data:`PA_TC_BT` block-table
    entries and the index checks' ints (``hal_index_checks.cuh``: the block table's; with ``varlen``, the
    ``HAL_VARLEN`` build, query_start_loc's too).
    """
    chunk = paged_attention_tc_chunk(head_size)
    groups = paged_attention_tc_token_groups(head_size)
    stages = max(2 * 2 * chunk * (head_size + 8) * 2, groups * PA_TC_ROWS * (head_size + 4) * 4)
    shared = stages + 2 * chunk * 8 + 3 * groups * PA_TC_ROWS * 4 + 2 * PA_TC_ROWS * 4 + PA_TC_BT * 4
    return shared + (2 if varlen else 1) * PA_INDEX_CHECK_BYTES


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
    *,
    max_query_len: int = 1,
    num_tokens: int | None = None,
) -> tuple[int, int]:
    """(partition_size, max_partitions) of the tensor-core kernel.

    The grid without a split has ``num_seqs * num_kv_heads * ceil(max_query_len * group / 16)`` CTAs. Sequences
    are split into as many partitions as it takes to give every compute unit ``ctas_per_cu`` CTAs (one full wave
    at the kernel's occupancy), but no partition is shorter than :data:`PA_TC_MIN_PARTITION` tokens of
    ``max_seq_len`` and the fp32 workspaces for ``num_tokens`` query rows (default ``num_seqs``) stay within
    :data:`PA_SPLIT_WORKSPACE_BYTES`; the partition size is a whole number of chunks.  ``max_partitions == 1``
    means no split (the kernel writes the output itself, no reduce step).
    """
    if min(num_seqs, num_heads, num_kv_heads, compute_units, ctas_per_cu) < 1:
        raise ValueError("num_seqs, num_heads, num_kv_heads, compute_units and ctas_per_cu must be >= 1")
    chunk = paged_attention_tc_chunk(head_size)
    max_seq_len = max(1, max_seq_len)
    group = num_heads // num_kv_heads
    base = num_seqs * num_kv_heads * -(-max_query_len * group // PA_TC_ROWS)
    want = -(-(compute_units * ctas_per_cu) // base)
    rows = num_seqs if num_tokens is None else num_tokens
    fits = PA_SPLIT_WORKSPACE_BYTES // max(1, 4 * rows * num_heads * (head_size + 2))
    parts = max(1, min(want, max_seq_len // PA_TC_MIN_PARTITION, _MAX_GRID_Z, fits))
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
                                head_size: int = 128, compute_units: int = 0, *, max_query_len: int = 1,
                                num_tokens: int | None = None) -> list[Launch]:
    """hal_paged_attention_tc over (num_kv_heads * ceil(max_query_len * group / 16), num_seqs, max_partitions),
    then, when split, hal_paged_attention_reduce of paged_attention.cu over (num_heads, num_tokens, slices)
    (``num_tokens`` query rows, default ``num_seqs``), with :func:`paged_attention_tc_reduce_slices` column slices
    so that the reduce step fills ``compute_units``.

    A split needs the fp32 workspaces of :func:`paged_attention_launches` (uninitialised is fine)."""
    group = num_heads // num_kv_heads
    gx = num_kv_heads * -(-max_query_len * group // PA_TC_ROWS)
    rows = num_seqs if num_tokens is None else num_tokens
    plans = [Launch("hal_paged_attention_tc", (gx, num_seqs, max_partitions), (PA_TC_THREADS, 1, 1))]
    if max_partitions > 1:
        slices = paged_attention_tc_reduce_slices(head_size, num_heads * rows, compute_units)
        plans.append(Launch("hal_paged_attention_reduce", (num_heads, rows, slices), (PA_NUM_THREADS, 1, 1)))
    return plans


# --------------------------------------------------------------------------
# Catalogue
# --------------------------------------------------------------------------


def specializations(warp_size: int) -> list[Specialization]:
    """Every specialisation ``paged_attention`` may request on a device of ``warp_size`` lanes: the SIMT kernels for
    every dtype, head size and GQA tile, then (32-lane warps) the tensor-core kernel for fp16/bf16 and its head
    sizes (``min_sm = PA_TC_MIN_SM``)."""
    specs = [paged_attention_spec(dtype, hs, g, warp_size)
             for dtype in DTYPE_CODES for hs in PA_HEAD_SIZES for g in PA_GQA_TILES]
    if warp_size == 32:  # mma.sync is a 32-lane warp instruction
        specs += [paged_attention_tc_spec(dtype, hs, varlen) for varlen in (False, True)
                  for dtype in ("float16", "bfloat16") for hs in PA_TC_HEAD_SIZES]
    return specs
