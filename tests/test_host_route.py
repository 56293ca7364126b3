"""hal_core.torch's one public route from torch tensors to a hal backend's ops (HostRoute / route_for)."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
from torch_helpers import torch

import hal_core
import hal_core.torch as hal_torch
from hal_core.ops import OPS
from hal_core.quant import quantize
from hal_core.torch import HostRoute, QuantLinear, route_for

SEED = 20261206


def test_route_for_a_cpu_tensor_is_the_host_backends_one_route() -> None:
    """route_for gives one HostRoute per backend: its front door as ops, numpy views (no copy) as native arrays."""
    tensor = torch.arange(6, dtype=torch.float32)
    route = route_for(tensor)
    assert route is route_for(torch.zeros(2)) and route.backend is hal_torch.backend_for(tensor)
    assert route.ops is route.backend.ops and route.backend.is_host
    view = route.native(tensor, "x")
    assert isinstance(view, np.ndarray) and view.ctypes.data == tensor.data_ptr()
    bf16 = route.native(torch.ones(3, dtype=torch.bfloat16), "x")
    assert hal_core.arrays.dtype_name(bf16) == "bf16"


def test_a_device_route_goes_through_the_torch_operators() -> None:
    """On a device backend, ops is hal_core.torch (torch.ops.hal) and tensors pass as they are."""
    route = HostRoute(types.SimpleNamespace(name="cuda", is_host=False))  # type: ignore[arg-type]
    tensor = torch.zeros(3)
    assert route.ops is hal_torch and route.native(tensor, "x") is tensor
    assert not route.eager(tensor)


def test_the_fast_path_matches_the_operator_and_the_reference() -> None:
    """call() on eager CPU tensors returns what torch.ops.hal returns, within the float64 reference's tolerance."""
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    x = torch.from_numpy(rng.standard_normal((5, 48)).astype(np.float32))
    weight = torch.from_numpy(rng.standard_normal(48).astype(np.float32))
    route = route_for(x)
    assert route.eager(x, weight)
    got = route.call("rms_norm", {"x": x, "weight": weight, "epsilon": 1e-6})
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, hal_torch.rms_norm(x, weight, 1e-6))
    expected = OPS["rms_norm"].reference({"x": x.numpy(), "weight": weight.numpy(), "epsilon": 1e-6})
    np.testing.assert_allclose(got.numpy(), expected[0], rtol=1e-5, atol=1e-6)  # (output, residual)


def test_autograd_and_traces_leave_the_fast_path() -> None:
    """A tensor that records autograd is not eager: the caller takes the operator (which records it)."""
    x = torch.zeros(2, 4, requires_grad=True)
    route = route_for(x)
    assert not route.eager(x)
    with torch.no_grad():
        assert route.eager(x)


def test_quant_linear_and_the_attention_cache_use_the_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """QuantLinear's eager CPU forward runs through an op bound once on its route (HostRoute.bind: the weight's
    views made once), each call counted by the front door; a HalPagedCache's layers call through the route of
    its device."""
    transformers = pytest.importorskip("transformers")
    import hal_core.torch.transformers as hal_hf

    binds: list[tuple[str, Any]] = []
    real = HostRoute.bind

    def spy(self: HostRoute, op: str, **fixed: Any) -> Any:
        binds.append((op, fixed.get("qweight")))
        return real(self, op, **fixed)

    monkeypatch.setattr(HostRoute, "bind", spy)
    torch.manual_seed(SEED)
    linear = torch.nn.Linear(64, 32)
    layer = QuantLinear.from_linear(linear, bits=4, group_size=32)
    weight = quantize(linear.weight.detach().T.numpy(), bits=4, group_size=32, symmetric=True)
    x = torch.randn(3, 64)
    ops = route_for(x).backend.ops
    before = ops.stats().get("quantized_gemm", {}).get("calls", 0)
    with torch.no_grad():
        first, second = layer(x), layer(x)
    assert [op for op, _ in binds] == ["quantized_gemm"], "the layer's weight views are bound once"
    assert ops.stats()["quantized_gemm"]["calls"] == before + 2
    torch.testing.assert_close(first, second)
    expected = x.double() @ torch.from_numpy(weight.dequantize(np.float64)) + linear.bias.detach().double()
    torch.testing.assert_close(first.double(), expected, rtol=1e-4, atol=1e-4)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    cache = hal_hf.HalPagedCache(config, num_blocks=4, block_size=4)
    assert cache.route is route_for(torch.zeros(1))
    cache.close()
