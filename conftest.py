"""The repository's own test sessions load the conformance kit's pytest plugin (it is opt-in elsewhere)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

pytest_plugins = ["hal_core.testing"]


@pytest.fixture
def rng(hal_rng: np.random.Generator) -> Iterator[np.random.Generator]:
    """The repository's tests' generator: the kit's ``hal_rng`` (seeded per run and test, printed)."""
    yield hal_rng
