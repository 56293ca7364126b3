"""The compiled gated_activation kernel: every activation, dtype and ISA variant, odd sizes, fused views, threads."""

from __future__ import annotations

import numpy as np
import pytest
from hal_cpu.ops import gated_activation

import hal_core
from hal_core.ops import OPS
from hal_core.ops.gated_activation import ACTIVATIONS
from hal_core.testing.inputs import assert_close, gated_activation_inputs

REFERENCE = OPS["gated_activation"].reference


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("inter", [1, 3, 17, 512, 1027])
def test_gated_matches_reference(variant: str, rng: np.random.Generator, activation: str, dtype: str,
                                 inter: int) -> None:
    """The halves of a fused gate-up projection give act(gate) * up on every variant, tails included."""
    args = gated_activation_inputs(rng, num_tokens=5, intermediate_size=inter, dtype=dtype, activation=activation)
    assert not args["gate"].flags.c_contiguous or inter == 1 or args["gate"].shape[0] == 1
    got = gated_activation.gated(args["gate"], args["up"], activation, threads=2)
    assert_close(got, REFERENCE(args), kind="elementwise", dtype=dtype, what=f"{activation} ({variant})")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_accuracy_dense_sweep(variant: str, activation: str) -> None:
    """fp32 act(g) over a dense sweep of [-20, 20] is within 2e-6 (absolute, plus relative) of the float64 value."""
    gate = np.linspace(-20.0, 20.0, 40001, dtype=np.float32)[None, :]
    up = np.ones_like(gate)
    got = gated_activation.gated(gate, up, activation, threads=1).astype(np.float64)
    want = REFERENCE({"gate": gate, "up": up, "activation": activation})
    assert np.all(np.abs(got - want) <= 2e-6 + 2e-6 * np.abs(want)), float(np.max(np.abs(got - want)))


def test_threads_give_the_same_bits(rng: np.random.Generator) -> None:
    """One thread and two give bit-identical outputs."""
    args = gated_activation_inputs(rng, num_tokens=40, intermediate_size=700, dtype="bf16")
    one = gated_activation.gated(args["gate"], args["up"], "gelu", threads=1)
    two = gated_activation.gated(args["gate"], args["up"], "gelu", threads=2)
    np.testing.assert_array_equal(one.view(np.uint16), two.view(np.uint16))


def test_front_door_runs_the_kernel(rng: np.random.Generator) -> None:
    """``be.ops.gated_activation`` runs hal-cpu's kernel for every activation (no fallback)."""
    be = hal_core.get_backend("cpu")
    for activation in (None, *ACTIVATIONS):
        args = gated_activation_inputs(rng, num_tokens=2, intermediate_size=64, dtype="fp16", activation=activation)
        assert be.ops.explain(be.ops.prepare("gated_activation", **args))[0] == ("cpu.gated_activation", "runs")


def test_torch_eager_sequences(rng: np.random.Generator) -> None:
    """hal matches ``F.silu(g) * u``, ``F.gelu(g) * u`` and ``F.gelu(g, approximate='tanh') * u`` in bf16 and fp32."""
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    eager = {"silu": lambda g: functional.silu(g), "gelu": lambda g: functional.gelu(g),
             "gelu_tanh": lambda g: functional.gelu(g, approximate="tanh")}
    be = hal_core.get_backend("cpu")
    for torch_dtype, tol in ((torch.bfloat16, 1.6e-2), (torch.float32, 1e-5)):
        gate_up = torch.from_numpy(rng.uniform(-6, 6, (4, 2 * 300)).astype(np.float32)).to(torch_dtype)
        gate, up = gate_up[:, :300], gate_up[:, 300:]
        for activation, fn in eager.items():
            want = (fn(gate) * up).float()
            got = torch.from_dlpack(be.ops.gated_activation(gate, up, activation=activation)).float()
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"{activation} {torch_dtype}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_extreme_gates_follow_the_reference(variant: str, activation: str, dtype: str) -> None:
    """Gates past the float range, infinities and NaN: NaN exactly where the float64 reference has it (SiLU at -inf
    is -inf / inf), the rest within the element-wise tolerance, in full vectors and in the tail."""
    from hal_core.arrays import BFLOAT16

    values = [-np.inf, -1e30, -200.0, -88.5, -87.0, -10.0, -1e-30, 0.0, 1e-30, 10.0, 87.0, 88.5, 200.0, 1e30,
              np.inf, np.nan]
    gate = np.array([values * 3], dtype=np.float32)  # 48: full vectors, then a tail on every variant
    up = np.full_like(gate, 1.5)
    if dtype == "bf16":
        gate, up = gate.astype(BFLOAT16), up.astype(BFLOAT16)
    got = gated_activation.gated(gate, up, activation, threads=1).astype(np.float64)
    want = REFERENCE({"gate": gate, "up": up, "activation": activation})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert_close(got[finite], want[finite], kind="elementwise", dtype=dtype, what=f"{activation} ({variant})")
