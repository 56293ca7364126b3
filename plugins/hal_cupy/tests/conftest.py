"""Fixtures of the hal-cupy tests: a seeded generator and the fake CuPy.

Nothing here touches a device, imports CuPy, or needs a vendor plugin.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fakecupy, kernel_emulator, gpu_profiles, host_compiled


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator with an explicit seed derived from the test id (reproducible, distinct per test)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Replace the lazily imported CuPy with :class:`fakecupy.FakeCupy` in every hal-cupy module."""
    import fakecupy
    from hal_cupy import _cupy, _launcher, _memory, _stream

    fake = fakecupy.FakeCupy()
    for module in (_cupy, _launcher, _memory, _stream):
        monkeypatch.setattr(module, "cupy", lambda: fake)
    return fake
