"""hal-vllm's tests need vLLM (``make test-vllm`` installs it in its own virtualenv); elsewhere they skip."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

import hal_core

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm")


def pytest_report_header() -> str:
    """Which vLLM the run tests (``make test-vllm`` runs the files over several releases)."""
    return f"vLLM {vllm.__version__} from {vllm.__file__}"


def pytest_sessionstart(session: pytest.Session) -> None:
    """With ``HAL_VLLM_TEST_RELEASE`` set (``make test-vllm`` sets it), any other vLLM release stops the run."""
    expected = os.environ.get("HAL_VLLM_TEST_RELEASE")
    if expected is not None and vllm.__version__ != expected:
        raise pytest.UsageError(f"HAL_VLLM_TEST_RELEASE={expected}, but vLLM {vllm.__version__} is imported "
                                f"from {vllm.__file__}")


@pytest.fixture
def cpu_attn_restored() -> Iterator[None]:
    """Leave vLLM's backend registry as the test found it (the plugin's overrides are process-wide)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    saved = dict(_ATTN_OVERRIDES)
    yield
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)


@pytest.fixture(scope="session")
def declared() -> Callable[[str, int, int, set[str]], bool]:
    """Whether the host hal backend declares it runs ``paged_attention`` of given features itself.

    Called as ``declared(dtype, head_size, block_size, variants)``. What a
    backend declares must not fall back (hal's contract suite holds every
    backend to that); what it does not runs on hal's fallback path. The
    tests expect exactly that: no fallback where declared.
    """

    def covers(dtype: str, head_size: int, block_size: int, variants: set[str]) -> bool:
        coverage = hal_core.get_backend().ops.coverage("paged_attention")
        return coverage.covers({"dtype": dtype, "head_size": head_size, "block_size": block_size,
                                "variant": frozenset(variants)}) is True

    return covers
