"""The built-in choices of the CPU kernels' tunables, as pure functions of the shapes and the host.

Every op wrapper takes its knobs as explicit keyword arguments (``threads``,
``partition_tokens``, ``kernel``, ``n_tile``, ``tile_bytes``) and asks these
functions only for those left as None, so a persisted per-device choice can
replace any rule without touching the kernels. Each function depends only
on its arguments (no global state, no measurement).
"""

from __future__ import annotations

__all__ = [
    "BLOCKED_ISAS",
    "DEQUANT_TILE_BYTES",
    "GEMM_ROW_BLOCK",
    "GEMM_ROW_BLOCK_HALF_DOT",
    "HALF_DOT_M_MAX",
    "K_PARTS",
    "K_PARTS_M_MAX_W4",
    "K_PART_ROW_BYTES",
    "SERIAL_BYTES",
    "SMALL_M_MAX",
    "SWEEP_M_MAX",
    "SWEEP_PARTIAL_BYTES",
    "ATTENTION_TILE_ROWS",
    "attention_partition_tokens",
    "attention_query_tile",
    "dequant_tile_columns",
    "gemm_row_block",
    "row_spans",
    "gemm_kernel",
    "gemv_column_tile",
    "gemv_k_parts",
    "sweep_column_tile",
    "threads_for",
]

#: Work (bytes moved) below which an op runs on the calling thread: waking the pool costs more.
SERIAL_BYTES = 256 * 1024
#: W4A16 with float32 activations (or on a CPU without AVX512_BF16): the largest M served by the in-register
#: kernel (its float32 sweep, every row tile over the same long runs of packed rows); above it, the blocked kernel.
#: One thread's CPU time here: 4096x11008 M = 3 9.6 ms against 37.8, M = 8 25.6 against 34.7, M = 16 50.2
#: against 44.7; 11008x4096 M = 8 20.6 against 35.6, M = 12 33.8 against 42.9, M = 16 41.4 against 44.8; AVX2
#: with fp16 activations M = 16 41.3 against 61.9.
SMALL_M_MAX = 12
#: W4A16: the largest M the in-register kernel serves by a sweep of one wide column range per thread
#: (csrc/w4a16.inl, ``kW4SweepMaxM``).
SWEEP_M_MAX = 2
#: W4A16's float32 sweep at any M (csrc/w4a16.inl, ``w4_sweep``): bytes of one task's partial sums (``M x columns``
#: floats) that stay in L2 beside the weight stream; a task's columns are bounded by it, so larger M runs more,
#: narrower column ranges.
SWEEP_PARTIAL_BYTES = 256 * 1024
#: Small-M GEMVs (M <= SWEEP_M_MAX) of weights whose packed rows are shorter than this cut K into
#: :data:`K_PARTS` parts (csrc/parts.inl), so that a task reads whole rows instead of a short run of each.
K_PART_ROW_BYTES = 32 * 1024
#: The parts of K then: a multiple of small thread counts, and few enough that adding the parts up (one
#: [M, N] float32 buffer each) stays negligible beside the weight.
K_PARTS = 8
#: W4A16 cuts K only at M up to this (W8A8 up to :data:`SWEEP_M_MAX`).
K_PARTS_M_MAX_W4 = 1
#: W4A16 with fp16/bf16 activations where the in-register kernel uses bf16 dot products: the largest M it serves
#: (measured faster than the blocked kernel at M=64, level at M=256).
HALF_DOT_M_MAX = 128
#: W4A16: instruction sets whose blocked kernel has a hand-sized register tile; elsewhere (the portable
#: baseline) dequantised tiles fed to numpy's BLAS are faster for large M.
BLOCKED_ISAS = ("avx512vnni", "avx512", "avx2")
#: W4A16 ``'tiles'``: bytes of one dequantised float32 tile ``[K, columns]`` (bounded; large enough that few BLAS
#: calls amortise their threading overhead, small enough to keep peak memory within 64 MiB of the weights).
DEQUANT_TILE_BYTES = 16 * 1024 * 1024
#: quantized_gemm: rows per block of a large call. A call of at least twice this many rows runs as blocks of this
#: many rows (the last one taking the remainder), each block's float32 result rounded into the output before the
#: next block runs: the float32 result is one block, not the whole call, and each block's activations, integer
#: panels and results stay in cache. Measured (2-core Zen 4, M = 4096, G = 128, one call against its blocks in
#: one process, quiet): W4A8 with bf16 activations 1.48-1.74x faster (2048 x 5632, 5632 x 2048, 2048 x 2048),
#: with fp32 1.46x, W8A8 bf16 1.59x, the same bits; at M = 512 (two blocks) level; W4A16 on the blocked kernel
#: with a float32 output 0.87-0.92x (no blocks there, :func:`gemm_row_block`).
GEMM_ROW_BLOCK = 256
#: The same for W4A16 where the in-register kernel multiplies fp16/bf16 activations with bf16 dot products: blocks
#: of 64 rows run that kernel (:data:`HALF_DOT_M_MAX`), 1.85x faster than the blocked kernel over all 4096 rows.
GEMM_ROW_BLOCK_HALF_DOT = 64
#: paged_attention: tasks (sequences or partitions of one) wanted per thread before sequences are split.
TASKS_PER_THREAD = 4
#: paged_attention: the shortest partition worth a task (its merge costs one row per head).
MIN_PARTITION_TOKENS = 256
#: paged_attention prefill: query rows (tokens x GQA heads) per task. Each key tile's K/V rows are fetched and
#: widened once for all of them, so more rows amortise that better, while the float32 output rows (64 KiB at head
#: size 128) stay in L2 beside the tiles. 128 measured 0.84 of the one-core BLAS rate against 0.60-0.63 at 64
#: (fp32, 4096-token prompt, GQA 32/8, interleaved runs); bf16 on AMX gained too.
ATTENTION_TILE_ROWS = 128


def threads_for(nbytes: int, host_threads: int) -> int:
    """Threads for an op moving ``nbytes``: 1 below :data:`SERIAL_BYTES`, else every core of the host."""
    return 1 if nbytes < SERIAL_BYTES else max(1, host_threads)


def gemm_row_block(int8_activations: bool, half_dot_registers: bool, float32_output: bool) -> int:
    """Rows per block of a large ``quantized_gemm`` call (:data:`GEMM_ROW_BLOCK`), 0 for none: int8 activations
    (W4A8, W8A8) 256; W4A16 where the in-register kernel takes fp16/bf16 activations with bf16 dot products
    (``half_dot_registers``) 64; W4A16 on the blocked or tiles kernels 256 for an fp16/bf16 output (its float32
    result is then not held whole), none for a float32 output (that kernel blocks its rows itself and its result is
    the output: blocks measured 0.87-0.92x there)."""
    if int8_activations:
        return GEMM_ROW_BLOCK
    if half_dot_registers:
        return GEMM_ROW_BLOCK_HALF_DOT
    return 0 if float32_output else GEMM_ROW_BLOCK


def row_spans(m: int, block: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``m`` rows in blocks of ``block`` rows, the last block taking the
    remainder (``block`` to ``2 * block - 1`` rows); one span of all rows where ``m < 2 * block`` or ``block`` is 0."""
    if block <= 0 or m < 2 * block:
        return [(0, m)]
    stops = [block * (i + 1) for i in range(m // block)]
    stops[-1] = m
    return list(zip([0, *stops[:-1]], stops, strict=True))


def attention_partition_tokens(num_seqs: int, num_kv_heads: int, max_len: int, block_size: int,
                               threads: int) -> int:
    """Tokens per split-KV partition of decode rows, 0 for no split.

    ``num_seqs`` counts the sequences with one new token (decode rows); prompt
    tiles are tasks of their own and are not split. A sequence is one task
    (it covers every KV head, so each block's heads are read as one
    contiguous run; ``num_kv_heads`` does not change the count);
    when there are fewer than :data:`TASKS_PER_THREAD` sequences per thread
    (small batches, long contexts), each sequence is cut into partitions of at
    least :data:`MIN_PARTITION_TOKENS` tokens (a multiple of ``block_size``) so
    every core has work; the partitions are merged by log-sum-exp.
    """
    del num_kv_heads  # part of the rule's signature; a task spans all KV heads
    seqs = max(1, num_seqs)
    wanted = TASKS_PER_THREAD * max(1, threads)
    if threads <= 1 or seqs >= wanted or max_len <= MIN_PARTITION_TOKENS:
        return 0
    parts = -(-wanted // seqs)
    tokens = max(MIN_PARTITION_TOKENS, -(-max_len // parts))
    tokens = -(-tokens // block_size) * block_size
    return 0 if tokens >= max_len else tokens


def attention_query_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per prefill task, at least 1: a task's rows are its tokens times the
    ``num_heads // num_kv_heads`` query heads of its KV head, about :data:`ATTENTION_TILE_ROWS`."""
    group = max(1, num_heads // max(1, num_kv_heads))
    return max(1, ATTENTION_TILE_ROWS // group)


def gemm_kernel(m: int, bits: int, group_size: int, act_order: bool, isa: str = "avx512",
                half_dot: bool = False) -> str:
    """The W4A16 kernel: ``'registers'`` (codes unpacked in registers, bound by the packed bytes),
    ``'blocked'`` (cache-blocked GEMM on dequantised L2-sized panels) or ``'tiles'`` (dequantised tiles fed
    to BLAS); W8A8 always runs ``'registers'`` (exact integer sums per group).

    The in-register int4 kernel needs groups made of whole packed words
    (``group_size % 8 == 0``) without act-order; it wins while M is small
    (:data:`SMALL_M_MAX`, or :data:`HALF_DOT_M_MAX` when ``half_dot``: fp16/bf16
    activations it multiplies with bf16 dot products); the blocked kernel
    serves the rest on the instruction sets of :data:`BLOCKED_ISAS`, BLAS
    tiles on the others.
    """
    if bits == 8:
        return "registers"
    if not act_order and group_size % 8 == 0 and m <= (HALF_DOT_M_MAX if half_dot else SMALL_M_MAX):
        return "registers"
    return "blocked" if isa in BLOCKED_ISAS else "tiles"


def gemv_k_parts(n: int, bits: int, m: int) -> int:
    """Parts of K a small-M GEMV is cut into (1: none), from the shape alone, never the host.

    The packed weight is ``[K rows, N]`` row-major; a task owning a column range reads one run of its
    width per row. When a row is short (4096 int4 columns: 16 KiB, 8 KiB a thread on two) the runs are
    too, and the prefetchers restart at every one: 11008x4096 M=1 streamed at 16-20 GB/s against 19-25
    with K in 8 parts, where each task reads whole rows (interleaved A/B). The parts are summed in
    order, so the result depends on this count; it is fixed by ``n``, ``bits`` and ``m`` so that it
    does not change with the thread count or the column tiles.
    """
    row_bytes = 4 * n if bits == 4 else n  # a packed row: N int32 words of 8 codes, or N bytes
    # W4A16 at M = 2 measured 10 % slower in parts (each task's two rows of partial sums no longer fit L1
    # beside the pass); W8A8 (int32 sums in a workspace either way) 7 % faster.
    m_max = K_PARTS_M_MAX_W4 if bits == 4 else SWEEP_M_MAX
    return K_PARTS if m <= m_max and row_bytes < K_PART_ROW_BYTES else 1


def _tasks_per_part(threads: int, k_parts: int) -> int:
    return max(1, -(-max(1, threads) // max(1, k_parts)))


def gemv_column_tile(n: int, threads: int, m: int = SWEEP_M_MAX + 1, k_parts: int = 1) -> int:
    """Columns per task of the in-register W4A16 kernels, a multiple of 64.

    Up to :data:`SWEEP_M_MAX` rows the kernel sweeps each task's columns as
    long sequential runs, so a task is one contiguous range per thread (more,
    shorter ranges measured 1.2-2x slower), or, with K in ``k_parts`` parts,
    one range per thread of a part (the whole width when there are as many
    parts as threads); above it, about 8 tasks per thread balance the
    compute-bound tiles.
    """
    tasks = _tasks_per_part(threads, k_parts) if m <= SWEEP_M_MAX else max(1, threads) * 8
    per_task = -(-n // tasks)
    return max(64, -(-per_task // 64) * 64)


def sweep_column_tile(n: int, threads: int, m: int = 1, k_parts: int = 1) -> int:
    """Columns per task of W4A16's float32 sweep at any M, a multiple of 64: one range per thread (of a part of
    K), as :func:`gemv_column_tile` up to :data:`SWEEP_M_MAX`, but never wider than the columns whose ``m`` rows
    of partial sums fit :data:`SWEEP_PARTIAL_BYTES` (then more, narrower ranges, a multiple of the tasks per part
    in number)."""
    per_part = _tasks_per_part(threads, k_parts)
    widest = max(64, SWEEP_PARTIAL_BYTES // (4 * max(1, m)) // 64 * 64)
    tasks = per_part * -(-n // (widest * per_part))
    per_task = -(-n // tasks)
    return max(64, -(-per_task // 64) * 64)


def dequant_tile_columns(k: int, n: int, tile_bytes: int = DEQUANT_TILE_BYTES) -> int:
    """Columns of one dequantised float32 tile ``[K, columns]`` within ``tile_bytes`` (a multiple of 16, >= 16)."""
    columns = max(16, (tile_bytes // max(1, 4 * k)) // 16 * 16)
    return min(columns, max(16, n))
