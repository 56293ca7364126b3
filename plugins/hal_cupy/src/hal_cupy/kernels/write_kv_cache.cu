// Scatter of new key/value rows into the paged KV cache.
//
// The copy is dtype-agnostic (rows are moved in units of 16, 8, 4 or 2
// bytes; elements are at least 2 bytes).  Defines:
// HAL_SLOT_INT64 (1: slot_mapping is int64, 0: int32; default 1),
// optional HAL_NUM_THREADS (default 128).  See README.md.
//
// Index check (hal_index_checks.cuh): a slot at or past num_blocks *
// block_size is never written; the token is skipped and slot_mapping is
// reported in error_flag.  Negative slots skip their token by definition.
#include "hal_common.cuh"
#include "hal_index_checks.cuh"

#ifndef HAL_SLOT_INT64
#define HAL_SLOT_INT64 1
#endif
#ifndef HAL_NUM_THREADS
#define HAL_NUM_THREADS 128
#endif

#if HAL_SLOT_INT64
typedef hal_i64 hal_slot_t;
#else
typedef int hal_slot_t;
#endif

namespace kvw {

// Copies num_kv_heads rows of row_bytes bytes, unit by unit (T is the unit).
template <typename T>
HAL_DEVICE void copy_rows(const char* HAL_RESTRICT key, const char* HAL_RESTRICT value,
                          char* HAL_RESTRICT key_cache, char* HAL_RESTRICT value_cache,
                          hal_i64 token, hal_i64 block, hal_i64 offset, int num_kv_heads,
                          int block_size, hal_i64 row_bytes) {
    const int units = (int)(row_bytes / (hal_i64)sizeof(T));
    const int total = num_kv_heads * units;
    const hal_i64 src0 = token * num_kv_heads * row_bytes;
    for (int i = threadIdx.x; i < total; i += HAL_NUM_THREADS) {
        const int head = i / units;
        const int u = i - head * units;
        const hal_i64 src = src0 + head * row_bytes + (hal_i64)u * sizeof(T);
        const hal_i64 dst = ((block * num_kv_heads + head) * block_size + offset) * row_bytes +
                            (hal_i64)u * sizeof(T);
        *reinterpret_cast<T*>(key_cache + dst) = *reinterpret_cast<const T*>(key + src);
        *reinterpret_cast<T*>(value_cache + dst) = *reinterpret_cast<const T*>(value + src);
    }
}

}  // namespace kvw

// One CTA per token.  row_bytes = head_size * element size.
HAL_GLOBAL void HAL_LAUNCH_BOUNDS(HAL_NUM_THREADS)
hal_write_kv_cache(const void* HAL_RESTRICT key, const void* HAL_RESTRICT value,
                   void* HAL_RESTRICT key_cache, void* HAL_RESTRICT value_cache,
                   const hal_slot_t* HAL_RESTRICT slot_mapping, int num_kv_heads, int block_size,
                   int row_bytes, int num_blocks, int* HAL_RESTRICT error_flag) {
    const hal_i64 token = blockIdx.x;
    const hal_i64 slot = slot_mapping[token];
    if (slot < 0) return;
    if (slot >= (hal_i64)num_blocks * block_size) {
        if (threadIdx.x == 0) hal_report_index_error(error_flag, HAL_ERR_SLOT_MAPPING);
        return;
    }
    const hal_i64 block = slot / block_size;
    const hal_i64 offset = slot - block * block_size;
    const char* k = static_cast<const char*>(key);
    const char* v = static_cast<const char*>(value);
    char* kc = static_cast<char*>(key_cache);
    char* vc = static_cast<char*>(value_cache);
    // Widest unit that divides the row and all four base addresses.  Every
    // dtype is at least 2 bytes and the host passes element-aligned arrays
    // (it checks), so 2 bytes always divides them.
    const unsigned long long align =
        (unsigned long long)row_bytes | (unsigned long long)k | (unsigned long long)v |
        (unsigned long long)kc | (unsigned long long)vc;
    if ((align & 15) == 0)
        kvw::copy_rows<hal_vec16>(k, v, kc, vc, token, block, offset, num_kv_heads, block_size, row_bytes);
    else if ((align & 7) == 0)
        kvw::copy_rows<hal_vec8>(k, v, kc, vc, token, block, offset, num_kv_heads, block_size, row_bytes);
    else if ((align & 3) == 0)
        kvw::copy_rows<hal_u32>(k, v, kc, vc, token, block, offset, num_kv_heads, block_size, row_bytes);
    else
        kvw::copy_rows<hal_u16>(k, v, kc, vc, token, block, offset, num_kv_heads, block_size, row_bytes);
}
