"""torch.ops.hal.rms_norm and gated_activation: opcheck, the residual mutation, torch.compile, float64 references."""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import TORCH_DTYPES, cuda_or_skip, host, tensor, torch

import hal_core.torch as hal_torch
from hal_core import ArgumentError
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, gated_activation_inputs, rms_norm_inputs

DTYPES = ("fp32", "fp16", "bf16")


@pytest.fixture(params=("cpu", "cuda"))
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda":
        cuda_or_skip()
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_operator(device: str, rng: np.random.Generator, dtype: str) -> None:
    """The functional and ``_out`` operators match the reference; ``residual`` receives the rounded sum."""
    args = rms_norm_inputs(rng, num_tokens=5, hidden_size=97, dtype=dtype)
    expected, expected_residual = OPS["rms_norm"].reference({**args, "weight_offset": 1.0})
    x, weight = tensor(args["x"], device), tensor(args["weight"], device)
    residual = tensor(args["residual"], device)
    got = hal_torch.rms_norm(x, weight, args["epsilon"], residual=residual, weight_offset=1.0)
    assert got.dtype == TORCH_DTYPES[dtype] and got.device.type == device
    assert_close(host(got), expected, kind="elementwise", dtype=dtype)
    assert expected_residual is not None
    assert_close(host(residual), expected_residual, kind="copy", dtype=dtype, what="residual")
    out = torch.empty_like(x)
    plain, _ = OPS["rms_norm"].reference({**args, "residual": None})
    assert hal_torch.rms_norm(x, weight, args["epsilon"], out=out) is out
    assert_close(host(out), plain, kind="elementwise", dtype=dtype, what="out")


def test_rms_norm_opcheck(rng: np.random.Generator) -> None:
    """torch.library.opcheck passes for both operators, with and without the mutated residual."""
    args = rms_norm_inputs(rng, num_tokens=3, hidden_size=40, dtype="fp32")
    x, weight, residual = tensor(args["x"]), tensor(args["weight"]), tensor(args["residual"])
    torch.library.opcheck(torch.ops.hal.rms_norm.default, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.hal.rms_norm.default, (x, weight, 1e-6, residual))
    torch.library.opcheck(torch.ops.hal.rms_norm_out.default, (x, weight, 1e-6, torch.empty_like(x), residual, 1.0))


def test_rms_norm_compiled_decoder_step(rng: np.random.Generator) -> None:
    """Under torch.compile (no graph break) the fused add-and-norm gives eager's result and mutates the residual."""
    args = rms_norm_inputs(rng, num_tokens=4, hidden_size=64, dtype="bf16")
    x, weight = tensor(args["x"]), tensor(args["weight"])

    def step(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.hal.rms_norm(h, weight, 1e-6, residual=residual) * 2

    before = tensor(args["residual"]).clone()  # tensor() shares the numpy array's memory: one copy per run
    eager_residual, compiled_residual = before.clone(), before.clone()
    want = step(x, eager_residual)
    got = torch.compile(step, fullgraph=True)(x, compiled_residual)
    assert torch.equal(got, want)
    assert torch.equal(compiled_residual, eager_residual)
    assert torch.equal(compiled_residual, x + before)


def test_calls_without_the_optional_mutated_arguments_compile_with_inductor(rng: np.random.Generator) -> None:
    """rms_norm without a residual (functional and ``out=``) and rotary_embedding without a key compile with
    inductor (the Python functions call the ``no_residual`` / ``no_key`` overloads, which inductor lowers) and
    give eager's results."""
    args = rms_norm_inputs(rng, num_tokens=4, hidden_size=64, dtype="fp32")
    x, weight = tensor(args["x"]), tensor(args["weight"])
    assert "Tensor(a!)" not in str(torch.ops.hal.rms_norm.no_residual._schema)
    want = hal_torch.rms_norm(x, weight, 1e-6)
    assert torch.equal(torch.compile(lambda h: hal_torch.rms_norm(h, weight, 1e-6) * 2, backend="inductor")(x),
                       want * 2)
    out = torch.empty_like(x)
    torch.compile(lambda h, o: hal_torch.rms_norm(h, weight, 1e-6, out=o), backend="inductor")(x, out)
    assert torch.equal(out, want)
    positions = torch.from_numpy(rng.integers(0, 32, 4))
    query = torch.from_numpy(rng.standard_normal((4, 2, 16)).astype(np.float32))
    table = torch.from_numpy(rng.standard_normal((32, 16)).astype(np.float32))
    eager, compiled = query.clone(), query.clone()
    hal_torch.rotary_embedding(positions, eager, table)
    torch.compile(lambda p, q: hal_torch.rotary_embedding(p, q, table), backend="inductor")(positions, compiled)
    assert torch.equal(compiled, eager) and not torch.equal(eager, query)


@pytest.mark.parametrize("activation", ("silu", "gelu", "gelu_tanh"))
def test_gated_activation_operator(device: str, rng: np.random.Generator, activation: str) -> None:
    """Views of a fused gate-up tensor go in without a copy; the result matches the reference; opcheck passes."""
    args = gated_activation_inputs(rng, num_tokens=3, intermediate_size=50, dtype="bf16", fused=False)
    gate_up = torch.cat([tensor(args["gate"], device), tensor(args["up"], device)], dim=1)
    gate, up = gate_up[:, :50], gate_up[:, 50:]
    got = hal_torch.gated_activation(gate, up, activation=activation)
    assert_close(host(got), OPS["gated_activation"].reference({**args, "activation": activation}),
                 kind="elementwise", dtype="bf16")
    if device == "cpu":
        torch.library.opcheck(torch.ops.hal.gated_activation.default, (gate, up, activation))
        torch.library.opcheck(torch.ops.hal.gated_activation_out.default, (gate, up, torch.empty_like(gate)))


def test_bad_activation_named() -> None:
    """An unknown activation is refused naming the argument (the fake checks what a trace can; the real op the rest)."""
    gate = torch.zeros(2, 8)
    with pytest.raises(ArgumentError, match="'activation'"):
        torch.ops.hal.gated_activation(gate, gate.clone(), "relu")
