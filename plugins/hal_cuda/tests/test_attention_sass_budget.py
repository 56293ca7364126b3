"""The static budget of the tensor-core decode attention, read from its SASS (NVRTC cubin + nvdisasm; no GPU).

For every ``paged_attention_tc.cu`` specialisation on sm_80, sm_90 and sm_120: no register spills, HMMA in the
main loop, one chunk of K/V per iteration, at most ``MAX_ATTENTION_INSTR_PER_BYTE`` warp-instructions per byte of
K/V, and at least two CTAs per SM (``benchmarks/sass_budget.py`` documents the counting; docs/kernel-resources.md
the values).  Skipped, with the reason, without the NVRTC or nvdisasm wheels.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("_sass_budget_attention", BENCH / "sass_budget.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sb = _load()
SPECS = sb.attention_specs()
ARCHS = sb.DEFAULT_ARCHS


def _measure(job):
    spec, arch, tool = job
    return [dataclasses.asdict(b) for b in sb.measure_attention(spec, arch, tool)]


@pytest.fixture(scope="module")
def budgets():
    from hal_cuda import _nvrtc

    try:
        _nvrtc.nvrtc_version()
    except _nvrtc.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC Python packages not installed (cuda-bindings, nvidia-cuda-nvrtc): {exc}")
    tool = sb.nvdisasm_path()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    jobs = [(s, a, tool) for s in SPECS for a in ARCHS]
    with ProcessPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(_measure, jobs))
    return {(s.id, a): sb.AttentionBudget(**r[0]) for (s, a, _), r in zip(jobs, results, strict=True)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_attention_budget(budgets, spec, arch) -> None:
    """No spill, HMMA in a main loop of one chunk, <= 0.1 instructions per byte of K/V, >= 2 CTAs per SM."""
    b = budgets[(spec.id, arch)]
    assert b.spill_bytes == 0, f"{b.kernel} spills {b.spill_bytes} bytes on {arch}"
    assert b.mma_main_loop > 0, f"no HMMA in the main loop of {b.kernel} on {arch}"
    assert b.chunks_per_iteration == 1.0, f"main loop has {b.mma_main_loop} HMMA, not one chunk's"
    assert b.instructions_per_byte <= sb.MAX_ATTENTION_INSTR_PER_BYTE, (
        f"{b.main_loop_instructions} instructions per {b.kv_bytes_per_warp} bytes on {arch}")
    assert b.ctas_per_sm >= 2, f"{b.kernel}: {b.registers} registers, {b.static_shared_bytes} B shared"


def test_mma_count_per_chunk_follows_the_layout() -> None:
    """The per-chunk HMMA count the budget divides by: 8-token warps (k8 P V) and 16-token warps (k16)."""
    assert sb.attention_mma_per_chunk(128) == 8 + 16 + 1  # 8 tokens x 8 k-steps; 16 column tiles; exp-sum
    assert sb.attention_mma_per_chunk(64) == 2 * 4 + 8 + 1  # 16 tokens: 2 tiles x 4 k-steps; one k16 step
    assert sb.attention_mma_per_chunk(256) == 16 + 16 + 1  # 2 column groups of 128
