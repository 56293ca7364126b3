"""The decoder-layer example of docs/engine-guide.md (rms_norm, gated_activation) runs as written, rightly."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import hal_core
from hal_core.ops import OPS

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine-guide.md"


def test_the_layer_ops_example_runs_and_matches_the_references(rng: np.random.Generator) -> None:
    """The guide's block on host arrays: the norms, the residual update and both activations are the references'."""
    blocks = re.findall(r"```python\n(h = be\.ops\.rms_norm\(x, .*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "engine-guide.md should hold one rms_norm / gated_activation example"
    inter, hidden = 48, 64
    names = {
        "be": hal_core.get_backend("cpu"), "inter": inter,
        "x": rng.standard_normal((3, hidden)).astype(np.float32),
        "attn_out": rng.standard_normal((3, hidden)).astype(np.float32),
        "res": rng.standard_normal((3, hidden)).astype(np.float32),
        "input_norm_weight": rng.standard_normal(hidden).astype(np.float32),
        "post_norm_weight": rng.standard_normal(hidden).astype(np.float32),
        "gate_up": rng.uniform(-4, 4, (3, 2 * inter)).astype(np.float32),
        "g": rng.uniform(-4, 4, (3, inter)).astype(np.float32),
        "u": rng.standard_normal((3, inter)).astype(np.float32),
    }
    before = names["res"].copy()
    exec(compile(blocks[0], str(DOC), "exec"), names)
    want_h, want_res = OPS["rms_norm"].reference({"x": names["attn_out"], "weight": names["post_norm_weight"],
                                                  "epsilon": 1e-6, "residual": before})
    np.testing.assert_allclose(names["h"], want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(names["res"], want_res)
    want_a = OPS["gated_activation"].reference({"gate": names["g"], "up": names["u"], "activation": "gelu_tanh"})
    np.testing.assert_allclose(names["a"], want_a, rtol=1e-5, atol=1e-5)
