"""Fixtures of hal-cpu's kernel tests: the loaded library and a way to run under another ISA variant."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
from hal_cpu import _native


@pytest.fixture(scope="session")
def native() -> _native.Native:
    """The compiled kernels; the tests fail (not skip) when they did not build."""
    return _native.load()


@contextmanager
def isa(native: _native.Native, name: str) -> Iterator[None]:
    """Run the block with the ``name`` variant selected, then restore the chosen one."""
    if name not in native.available:
        pytest.skip(f"the {name} variant does not run on this CPU (available: {', '.join(native.available)})")
    assert native.lib.hal_cpu_select_isa(name.encode()) == name.encode()
    try:
        yield
    finally:
        native.lib.hal_cpu_select_isa(native.isa.encode())


@pytest.fixture(params=["best", "avx512", "avx2", "baseline"])
def variant(request: pytest.FixtureRequest, native: _native.Native) -> Iterator[str]:
    """Each test body runs with the chosen variant, AVX-512 and AVX2 (where not the chosen one) and the baseline."""
    if request.param == "best":
        yield native.isa
        return
    if request.param == native.isa:
        pytest.skip(f"{native.isa} is the chosen variant, already tested as 'best'")
    with isa(native, request.param):
        yield request.param


@pytest.fixture
def select_isa(native: _native.Native) -> Callable[[str], AbstractContextManager[None]]:
    """``with select_isa(name):`` runs a block under that variant (skips the test where it does not run)."""
    return lambda name: isa(native, name)
