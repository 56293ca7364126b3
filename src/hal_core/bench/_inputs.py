"""Host (numpy) inputs of a benchmark case, from the case's op declaration (fast: no float64, no quantiser).

Values are random but realistic in layout: attention block tables hand out
distinct blocks in random order, quantized weights hold random codes and
positive scales. Inputs are not checked against a reference here; the
contract suite does that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import OPS
from ._cases import Case

__all__ = ["build_inputs"]


def build_inputs(case: Case, rng: np.random.Generator) -> dict[str, Any]:
    """One set of host arguments for ``case`` (its op's :attr:`~hal_core.ops.BenchCases.inputs`)."""
    bench = OPS[case.op].bench
    if bench is None:
        raise ValueError(f"op {case.op!r} declares no benchmark cases")
    return bench.inputs(rng, dict(case.params))
