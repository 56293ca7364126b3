"""gated_activation against the float64 reference: every activation, fused gate-up views, in place, NaN, errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS
from hal_core.ops.gated_activation import ACTIVATIONS
from hal_core.testing.inputs import assert_close, gated_activation_inputs, to_backend
from hal_core.testing.suite._strategies import DTYPES, OP_SETTINGS, seeds

REFERENCE = OPS["gated_activation"].reference


def _run(backend: Any, args: dict[str, Any], **extra: Any) -> np.ndarray:
    dev = to_backend(backend, "gated_activation", args)
    return backend.to_numpy(backend.ops.gated_activation(dev["gate"], dev["up"], activation=args.get("activation"),
                                                         **extra))


@OP_SETTINGS
@given(
    seed=seeds,
    dtype=st.sampled_from(DTYPES),
    num_tokens=st.integers(1, 9),
    intermediate_size=st.sampled_from((1, 5, 16, 67, 300, 1030)),
    fused=st.booleans(),
    activation=st.sampled_from((None, *ACTIVATIONS)),
)
def test_gated_activation_matches_reference(hal_backend: Any, seed: int, dtype: str, num_tokens: int,
                                            intermediate_size: int, fused: bool, activation: str | None) -> None:
    """``act(gate) * up`` for every activation (None is silu), on the halves of a fused projection or two arrays."""
    rng = np.random.default_rng(seed)
    args = gated_activation_inputs(rng, num_tokens=num_tokens, intermediate_size=intermediate_size, dtype=dtype,
                                   fused=fused, activation=activation)
    assert_close(_run(hal_backend, args), REFERENCE(args), kind="elementwise", dtype=dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_activation_special_values(hal_backend: Any, activation: str) -> None:
    """NaN gives NaN; +inf gives inf * up; -inf gives NaN; large negative gates give (about) 0; zero gives 0."""
    gate = np.array([[np.nan, np.inf, -np.inf, -200.0, 0.0, 3.0, -3.0, 1e-3]], dtype=np.float32)
    up = np.array([[1.0, 2.0, 1.0, 1.0, 1.0, np.nan, 0.5, 1.0]], dtype=np.float32)
    args = {"gate": gate, "up": up, "activation": activation}
    expected = REFERENCE(args)
    assert np.isnan(expected[0, [0, 2, 5]]).all() and expected[0, 1] == np.inf and abs(expected[0, 3]) < 1e-30
    assert_close(_run(hal_backend, args), expected, kind="elementwise", dtype="fp32")


def test_gated_activation_out_is_gate(hal_backend: Any, hal_rng: np.random.Generator) -> None:
    """``out=gate`` writes the result over the gate."""
    args = gated_activation_inputs(hal_rng, num_tokens=3, intermediate_size=70, dtype="bf16", fused=False)
    expected = REFERENCE(args)
    dev = to_backend(hal_backend, "gated_activation", args)
    result = hal_backend.ops.gated_activation(dev["gate"], dev["up"], out=dev["gate"])
    assert result is dev["gate"]
    assert_close(hal_backend.to_numpy(dev["gate"]), expected, kind="elementwise", dtype="bf16")


BAD_INPUTS = [
    ("gate-rank", ArgumentError, "gate"),
    ("up-shape", ArgumentError, "up"),
    ("up-dtype", ArgumentTypeError, "up"),
    ("gate-dtype", ArgumentTypeError, "gate"),
    ("activation-name", ArgumentError, "activation"),
    ("activation-type", ArgumentTypeError, "activation"),
    ("out-dtype", ArgumentTypeError, "out"),
    ("gate-columns-strided", ArgumentError, "gate"),
]


@pytest.mark.parametrize(("case", "error", "argument"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_gated_activation_bad_input(hal_backend: Any, hal_rng: np.random.Generator, case: str,
                                    error: type[Exception], argument: str) -> None:
    """Bad input raises the right error naming the argument, before ``out`` is written."""
    args: dict[str, Any] = gated_activation_inputs(hal_rng, num_tokens=4, intermediate_size=32, dtype="fp32",
                                                   fused=False)
    out = np.zeros((4, 32), np.float32)
    if case == "gate-rank":
        args["gate"] = args["gate"][0]
    elif case == "up-shape":
        args["up"] = args["up"][:, :31].copy()
    elif case == "up-dtype":
        args["up"] = args["up"].astype(np.float16)
    elif case == "gate-dtype":
        args["gate"], args["up"] = args["gate"].astype(np.float64), args["up"].astype(np.float64)
    elif case == "activation-name":
        args["activation"] = "relu"
    elif case == "activation-type":
        args["activation"] = 1
    elif case == "out-dtype":
        out = np.zeros((4, 32), np.float16)
    elif case == "gate-columns-strided":
        args["gate"] = np.repeat(args["gate"], 2, axis=1)[:, ::2]
    dev = to_backend(hal_backend, "gated_activation", args)
    dev_out = hal_backend.asarray(out)
    with pytest.raises(error) as info:
        hal_backend.ops.gated_activation(dev["gate"], dev["up"], activation=args.get("activation"), out=dev_out)
    assert repr(argument) in str(info.value), f"message does not name {argument!r}: {info.value}"
    np.testing.assert_array_equal(hal_backend.to_numpy(dev_out), out)
