"""What the SASS budget tests share: ``benchmarks/sass_budget.py`` loaded as a module, and every (specialisation,
architecture) pair compiled and measured in parallel, skipped with the reason when NVRTC or nvdisasm is missing."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("_sass_budget", BENCH / "sass_budget.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


sb = _load()


def _measure(job: tuple[str, Any, str, str]) -> list[dict]:
    measure, spec, arch, tool = job
    return [dataclasses.asdict(b) for b in getattr(sb, measure)(spec, arch, tool)]


def measure_all(measure: str, specs: Sequence[Any], archs: Sequence[str], budget: type) -> dict[tuple[str, str], Any]:
    """``{(spec.id, arch): budget}`` of the first kernel of each specialisation, measured by ``sb.<measure>``."""
    from hal_cuda import _nvrtc

    try:
        _nvrtc.nvrtc_version()
    except _nvrtc.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC Python packages not installed (cuda-bindings, nvidia-cuda-nvrtc): {exc}")
    tool = sb.nvdisasm_path()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    jobs = [(measure, s, a, tool) for s in specs for a in archs]
    with ProcessPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(_measure, jobs))
    return {(s.id, a): budget(**r[0]) for (_, s, a, _), r in zip(jobs, results, strict=True)}
