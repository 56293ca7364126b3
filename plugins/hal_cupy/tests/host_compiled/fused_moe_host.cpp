// Host entry points for fused_moe.cu (grid and block as 3-element arrays, then the kernel's parameters in order):
// routing, alignment, scatter, the grouped GEMMs of the HAL_QBITS / HAL_ABITS build and the combine.
// Compiled after the translation unit of fused_moe.cu (harness.py hands it to g++ with -include).

extern "C" int launch_hal_moe_route(const unsigned* grid, const unsigned* block, int* topk_ids, float* topk_weights,
                                    int* counts, const float* logits, int num_tokens, int num_experts, int top_k,
                                    int routing) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_route(topk_ids, topk_weights, counts, logits, num_tokens, num_experts, top_k, routing);
    });
}

extern "C" int launch_hal_moe_align(const unsigned* grid, const unsigned* block, int* offsets, int* tile_expert,
                                    int* sorted_pairs, int* cursor, const int* counts, int num_experts,
                                    int max_tiles) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_align(offsets, tile_expert, sorted_pairs, cursor, counts, num_experts, max_tiles);
    });
}

extern "C" int launch_hal_moe_scatter(const unsigned* grid, const unsigned* block, int* sorted_pairs, int* cursor,
                                      const int* topk_ids, const int* offsets, int num_pairs) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_scatter(sorted_pairs, cursor, topk_ids, offsets, num_pairs);
    });
}

#if !HAL_MOE_INT8_ACTIVATIONS
extern "C" int launch_hal_moe_w4_gate_up(const unsigned* grid, const unsigned* block, float* act, const void* x,
                                         const int* sorted_pairs, const int* tile_expert, const int* offsets,
                                         const long long* w13, int hidden, int inter, int group_size, int top_k,
                                         int num_experts, int activation) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_w4_gate_up(act, (const hal_t*)x, sorted_pairs, tile_expert, offsets, w13, hidden, inter, group_size,
                           top_k, num_experts, activation);
    });
}

extern "C" int launch_hal_moe_w4_down(const unsigned* grid, const unsigned* block, float* y, const float* act,
                                      const int* sorted_pairs, const int* tile_expert, const int* offsets,
                                      const long long* w2, int hidden, int inter, int group_size, int num_experts) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_w4_down(y, act, sorted_pairs, tile_expert, offsets, w2, hidden, inter, group_size, num_experts);
    });
}
#elif HAL_QBITS == 8
extern "C" int launch_hal_moe_w8_gate_up(const unsigned* grid, const unsigned* block, float* act, const void* xq,
                                         const float* sx, const int* sorted_pairs, const int* tile_expert,
                                         const int* offsets, const long long* w13, int hidden, int inter,
                                         int group_size, int top_k, int num_experts, int activation) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_w8_gate_up(act, (const hal_i8*)xq, sx, sorted_pairs, tile_expert, offsets, w13, hidden, inter,
                           group_size, top_k, num_experts, activation);
    });
}

extern "C" int launch_hal_moe_w8_down(const unsigned* grid, const unsigned* block, float* y, const void* aq,
                                      const float* sa, const int* sorted_pairs, const int* tile_expert,
                                      const int* offsets, const long long* w2, int hidden, int inter, int group_size,
                                      int num_experts) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_w8_down(y, (const hal_i8*)aq, sa, sorted_pairs, tile_expert, offsets, w2, hidden, inter, group_size,
                        num_experts);
    });
}
#else
extern "C" int launch_hal_moe_w4a8_gate_up(const unsigned* grid, const unsigned* block, float* act, const void* xq,
                                           const float* sx, const int* sorted_pairs, const int* tile_expert,
                                           const int* offsets, const long long* w13, int hidden, int inter,
                                           int group_size, int top_k, int num_experts, int activation) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_w4a8_gate_up(act, (const hal_i8*)xq, sx, sorted_pairs, tile_expert, offsets, w13, hidden, inter,
                             group_size, top_k, num_experts, activation);
    });
}

extern "C" int launch_hal_moe_w4a8_down(const unsigned* grid, const unsigned* block, float* y, const void* aq,
                                        const float* sa, const int* sorted_pairs, const int* tile_expert,
                                        const int* offsets, const long long* w2, int hidden, int inter,
                                        int group_size, int num_experts) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_w4a8_down(y, (const hal_i8*)aq, sa, sorted_pairs, tile_expert, offsets, w2, hidden, inter,
                          group_size, num_experts);
    });
}
#endif

extern "C" int launch_hal_moe_combine(const unsigned* grid, const unsigned* block, void* out, const float* y,
                                      const float* topk_weights, int hidden, int top_k) {
    return hal_host::launch_lambda(grid, block, [=] {
        hal_moe_combine((hal_t*)out, y, topk_weights, hidden, top_k);
    });
}
