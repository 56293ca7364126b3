"""QuantLinear(activations='int8') and quantize_model(activations='int8'): int4 layers run as W4A8."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from torch_helpers import torch

from hal_core import ArgumentError
from hal_core.quant import quantize
from hal_core.torch import QuantLinear, quantize_model


def _w4a8_float64(x: np.ndarray, weight) -> np.ndarray:
    """sx * (xq @ w): activations quantized per token here (float32 amax/127, round half to even, clip)."""
    x32 = x.astype(np.float32)
    sx = np.abs(x32).max(axis=1) / np.float32(127.0)
    xq = np.clip(np.rint(x32 / sx[:, None]), -127, 127)
    return sx.astype(np.float64)[:, None] * (xq @ weight.dequantize(np.float64))


@pytest.mark.parametrize("m", [1, 5, 16])
def test_int8_activations_compute_w4a8_on_both_routes(m: int) -> None:
    """The eager host route and the torch operator (grad route) give the W4A8 result; 'float' stays W4A16."""
    seed = 400 + m
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    weight = quantize(rng.standard_normal((128, 48)).astype(np.float32), bits=4, group_size=32)
    x = torch.from_numpy(rng.standard_normal((m, 128)).astype(np.float32))
    layer = QuantLinear.from_weight(weight, activations="int8")
    expected = _w4a8_float64(x.numpy(), weight)
    with torch.no_grad():
        host = layer(x)
    grad_route = layer(x.clone().requires_grad_(True))
    assert grad_route.requires_grad
    scale = np.abs(expected).max()
    np.testing.assert_allclose(host.numpy(), expected, atol=2e-5 * scale, rtol=0)
    assert torch.equal(host, grad_route.detach())
    with torch.no_grad():
        w4a16 = QuantLinear.from_weight(weight)(x)
    assert not torch.equal(w4a16, host)  # the setting reaches the kernel
    assert "activations=int8" in repr(layer)


def test_quantize_model_sets_every_layer_and_refuses_a_bad_value() -> None:
    """Every layer quantize_model makes carries the setting; a bad value is refused before any change."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ArgumentError, match="argument 'activations'"):
        quantize_model(model, bits=4, group_size=32, activations="int4")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    quantize_model(model, bits=4, group_size=32, activations="int8")
    assert [m.activations for m in model if isinstance(m, QuantLinear)] == ["int8", "int8"]
    with pytest.raises(ValueError, match="argument 'activations'"):
        QuantLinear(64, 32, activations="fp8")


@pytest.fixture(params=[True, False], ids=["int8_dot", "no_int8_dot"])
def int8_dot(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """The CPU backend reporting int8 dot products or not (what 'auto' reads), whatever this CPU has."""
    import hal_cpu._device as hal_cpu_device

    from hal_core.ops._device_features import forget_device_features

    monkeypatch.setattr(hal_cpu_device, "_kernel_features", lambda: {"int8_dot"} if request.param else set())
    forget_device_features()
    yield request.param
    forget_device_features()


@pytest.mark.parametrize("m", [1, 2, 9])
def test_quantize_model_defaults_to_auto_float_for_one_row_int8_from_two(m: int, int8_dot: bool) -> None:
    """quantize_model's default 'auto': W4A16 for a decode row, W4A8 from INT8_ACTIVATIONS_FROM_M rows where the
    device has int8 dot products, W4A16 for every row count where it has none (bitwise)."""
    from hal_core.ops.quantized_gemm import INT8_ACTIVATIONS_FROM_M

    seed = 500 + m
    print(f"seed={seed}")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 48, bias=False))
    quantize_model(model, bits=4, group_size=32)
    layer = model[0]
    assert layer.activations == "auto"
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((m, 128)).astype(np.float32))
    with torch.no_grad():
        got = layer(x)
        weight = layer.quantized_weight()  # hal's weight over the layer's buffers
        want = "int8" if int8_dot and m >= INT8_ACTIVATIONS_FROM_M else "float"
        explicit = QuantLinear.from_weight(weight, activations=want)(x)
    assert torch.equal(got, explicit)
    if want == "int8":
        expected = _w4a8_float64(x.numpy(), weight)
        np.testing.assert_allclose(got.numpy(), expected, atol=2e-5 * np.abs(expected).max(), rtol=0)


def test_load_quantized_refuses_a_bad_activations_value_before_reading(tmp_path) -> None:
    """load_quantized(activations=...) is checked first, naming the argument."""
    from hal_core.torch import load_quantized

    with pytest.raises(ArgumentError, match="argument 'activations'"):
        load_quantized(tmp_path / "missing", activations="int4")


def test_changing_a_layers_activations_reaches_the_next_call() -> None:
    """``layer.activations`` set after a first call (as a benchmark or user does) is what the next call runs:
    W4A16 bits, then W4A8's, then W4A16's again."""
    seed = 707
    print(f"seed={seed}")
    torch.manual_seed(seed)
    layer = QuantLinear.from_linear(torch.nn.Linear(128, 48, bias=False), bits=4, group_size=32)
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((1, 128)).astype(np.float32))
    weight = layer.quantized_weight()
    with torch.no_grad():
        runs = []
        for activations in ("float", "int8", "float"):
            layer.activations = activations
            runs.append(layer(x))
            assert torch.equal(runs[-1], QuantLinear.from_weight(weight, activations=activations)(x))
    assert not torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
