// Index checks done by the kernels themselves (vendor-neutral).
//
// A kernel that reads block tables, lengths or slots from device memory checks
// each value before using it.  A bad value is never dereferenced: the kernel
// zeroes the output it affects (or skips the write) and ORs the code of the
// argument into `error_flag`, one int32 per device that the host reads at its
// next synchronisation point (hal_cupy._index_errors maps the codes back to
// argument names).  No host copy, no synchronisation: the launch stays
// capturable in a CUDA graph.
#pragma once

#define HAL_ERR_BLOCK_TABLES 1
#define HAL_ERR_SEQ_LENS 2
#define HAL_ERR_SLOT_MAPPING 4
#define HAL_ERR_QUERY_START_LOC 8

// Records `code` in the device error flag (a null flag records nothing).
HAL_DEVICE void hal_report_index_error(int* error_flag, int code) {
    if (error_flag == 0) return;
#ifdef HAL_HOST
    *error_flag |= code;  // host threads are fibers that switch only at barriers and shuffles
#else
    atomicOr(error_flag, code);
#endif
}

// True when entries [b0, b1) of one block-table row all lie in [0, num_blocks).  Cooperative: every one of the
// CTA's `nthreads` threads calls it (it has two barriers) and gets the same answer.
HAL_DEVICE bool hal_block_table_ok(const int* HAL_RESTRICT row, int b0, int b1, int num_blocks, int nthreads) {
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    hal_barrier();
    for (int j = b0 + (int)threadIdx.x; j < b1; j += nthreads) {
        const int b = row[j];
        if (b < 0 || b >= num_blocks) bad = 1;  // every writer stores the same value
    }
    hal_barrier();
    return bad == 0;
}

// True when query_start_loc [num_seqs + 1] starts at 0, never decreases and ends at num_tokens.  Cooperative like
// hal_block_table_ok (two barriers; every thread gets the same answer).
HAL_DEVICE bool hal_query_starts_ok(const int* HAL_RESTRICT starts, int num_seqs, int num_tokens, int nthreads) {
    __shared__ int bad_starts;
    if (threadIdx.x == 0) bad_starts = starts[0] != 0 || starts[num_seqs] != num_tokens;
    hal_barrier();
    for (int j = (int)threadIdx.x; j < num_seqs; j += nthreads)
        if (starts[j + 1] < starts[j]) bad_starts = 1;  // every writer stores the same value
    hal_barrier();
    return bad_starts == 0;
}
