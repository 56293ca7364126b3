"""The static budget of the tensor-core decode attention, read from its SASS (NVRTC cubin + nvdisasm; no GPU).

For every ``paged_attention_tc.cu`` specialisation on sm_80, sm_90 and sm_120: no register spills, HMMA in the
main loop, one chunk of K/V per iteration, at most ``MAX_ATTENTION_INSTR_PER_BYTE`` (the ``HAL_VARLEN`` builds:
``MAX_ATTENTION_VARLEN_INSTR_PER_BYTE``) warp-instructions per byte of
K/V, and at least two CTAs per SM (``benchmarks/sass_budget.py`` documents the counting; docs/kernel-resources.md
the values).  Skipped, with the reason, without the NVRTC or nvdisasm wheels.
"""

from __future__ import annotations

import pytest
from sass_budgets import measure_all, sb

SPECS = sb.attention_specs()
ARCHS = sb.DEFAULT_ARCHS


@pytest.fixture(scope="module")
def budgets():
    return measure_all("measure_attention", SPECS, ARCHS, sb.AttentionBudget)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_attention_budget(budgets, spec, arch) -> None:
    """No spill, HMMA in a main loop of one chunk, <= 0.1 instructions per byte of K/V (0.15 for the HAL_VARLEN
    build), >= 2 CTAs per SM."""
    b = budgets[(spec.id, arch)]
    assert b.spill_bytes == 0, f"{b.kernel} spills {b.spill_bytes} bytes on {arch}"
    assert b.mma_main_loop > 0, f"no HMMA in the main loop of {b.kernel} on {arch}"
    assert b.chunks_per_iteration == 1.0, f"main loop has {b.mma_main_loop} HMMA, not one chunk's"
    assert b.instructions_per_byte <= sb.attention_instr_per_byte_budget(spec), (
        f"{b.main_loop_instructions} instructions per {b.kv_bytes_per_warp} bytes on {arch}")
    assert b.ctas_per_sm >= 2, f"{b.kernel}: {b.registers} registers, {b.static_shared_bytes} B shared"


def test_mma_count_per_chunk_follows_the_layout() -> None:
    """The per-chunk HMMA count the budget divides by: 8-token warps (k8 P V) and 16-token warps (k16)."""
    assert sb.attention_mma_per_chunk(128) == 8 + 16 + 1  # 8 tokens x 8 k-steps; 16 column tiles; exp-sum
    assert sb.attention_mma_per_chunk(64) == 2 * 4 + 8 + 1  # 16 tokens: 2 tiles x 4 k-steps; one k16 step
    assert sb.attention_mma_per_chunk(256) == 16 + 16 + 1  # 2 column groups of 128
