"""The specialisation catalogue and the translation units it compiles, pinned in ``kernel_catalogue.json``.

Every specialisation's id (its source and defines), entry points and ``min_sm``, at both SIMD widths and in
catalogue order; and a SHA-256 of the exact text and options each compiler gets, with hal-cuda's prelude for
32-lane warps and hal-rocm's for every width HIP builds. A change to how specialisations or sources are put
together shows up here as a changed kernel. After an intended change to a kernel or the catalogue, rewrite the
file with ``.venv/bin/python plugins/hal_cupy/tests/test_kernel_catalogue.py`` and review its diff.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from hal_cuda import CUDA
from hal_cupy import GpuPlatform, Specialization, all_specializations, kernel_source
from hal_rocm import ROCM

PINNED = Path(__file__).resolve().parent / "kernel_catalogue.json"
WIDTHS = (32, 64)


def _digest(spec: Specialization, platform: GpuPlatform) -> str:
    """The first 16 hex digits of a SHA-256 of what the compiler gets: the source text, then the options."""
    source = kernel_source(spec, platform)
    return hashlib.sha256("\0".join((source.code, *source.options)).encode()).hexdigest()[:16]


def current() -> dict[str, Any]:
    """The catalogue and the digests of its translation units, as the code builds them now."""
    catalogue = {str(w): [f"{s.id}: {' '.join(s.kernels)}; min_sm {s.min_sm}" for s in all_specializations(w)]
                 for w in WIDTHS}
    sources = {
        "cuda": {s.id: _digest(s, CUDA) for s in all_specializations(32)},
        "rocm": {s.id: _digest(s, ROCM)
                 for w in WIDTHS for s in all_specializations(w) if s.min_sm == 0},
    }
    return {"specializations": catalogue, "sources": sources}


def test_catalogue_is_pinned() -> None:
    """Same specialisations (ids, entry points, min_sm, order) at every SIMD width as the pinned file."""
    pinned, now = json.loads(PINNED.read_text())["specializations"], current()["specializations"]
    for width in map(str, WIDTHS):
        assert now[width] == pinned[width], f"warp {width}: the catalogue differs"


def test_translation_units_are_pinned() -> None:
    """Every translation unit is byte for byte the pinned one, for CUDA and for ROCm."""
    pinned, now = json.loads(PINNED.read_text())["sources"], current()["sources"]
    for vendor in ("cuda", "rocm"):
        assert now[vendor].keys() == pinned[vendor].keys()
        changed = sorted(k for k in now[vendor] if now[vendor][k] != pinned[vendor][k])
        assert not changed, f"{vendor}: {len(changed)} translation units changed, e.g. {changed[:3]}"


if __name__ == "__main__":
    PINNED.write_text(json.dumps(current(), indent=1) + "\n")
    print(f"wrote {PINNED}")
