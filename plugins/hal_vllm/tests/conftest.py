"""hal-vllm's tests need vLLM (``make test-vllm`` installs it in its own virtualenv); elsewhere they skip."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these tests in .venv-vllm")


@pytest.fixture
def cpu_attn_restored() -> Iterator[None]:
    """Leave vLLM's backend registry as the test found it (the plugin's overrides are process-wide)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    saved = dict(_ATTN_OVERRIDES)
    yield
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)
