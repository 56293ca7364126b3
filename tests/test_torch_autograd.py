"""Gradients through torch.ops.hal.quantized_gemm and QuantLinear, against float64 references.

hal's quantized_gemm takes fp16, bf16 and fp32 activations only (no float64), so
``torch.autograd.gradcheck`` cannot run the operator in float64. Instead every backward is
compared with the float64 gradient of ``x @ dequantize(W)``, ``dL/dx = dL/dy @ W^T``, with the
gemm tolerances of each dtype; the chunked dequantization the backward uses is compared bit for bit
with hal's own float64 ``QuantizedWeight.dequantize`` and gradchecked in float64 through torch's
matmul. W8A8's per-token activation quantization is taken as the identity in the backward
(straight-through), so its reference gradient is the same.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import TORCH_DTYPES, cuda_or_skip, host, torch

import hal_core
import hal_core.torch as hal_torch
from hal_core.quant import QuantizedWeight, quantize
from hal_core.testing.tolerances import tolerance
from hal_core.torch import QuantLinear, _autograd

K, N = 128, 40

CASES = [  # bits, group_size, symmetric, act_order
    (4, 32, True, False),
    (4, 64, False, True),
    (8, 32, False, False),
    (8, 128, True, True),
]
CASE_IDS = [f"int{b}-g{g}-{'sym' if s else 'zp'}{'-actorder' if a else ''}" for b, g, s, a in CASES]


def make_weight(rng: np.random.Generator, bits: int, group_size: int, symmetric: bool, act_order: bool,
                k: int = K, n: int = N) -> QuantizedWeight:
    qw = quantize(rng.standard_normal((k, n)) / np.sqrt(k), bits=bits, group_size=group_size, symmetric=symmetric)
    if not act_order:
        return qw
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[rng.permutation(k)] = np.arange(k) // group_size
    return QuantizedWeight(qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros, bits=bits, group_size=group_size,
                           shape=qw.shape, g_idx=g_idx)


def op_args(qw: QuantizedWeight) -> tuple:
    t = hal_torch.weight_to_tensors(qw)
    return t["qweight"], t["scales"], t.get("zeros"), t.get("g_idx"), qw.bits, qw.group_size


def assert_grad_close(grad: torch.Tensor, expected: np.ndarray, dtype: str) -> None:
    atol, rtol = tolerance("gemm", dtype)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(host(grad), expected, atol=atol * scale, rtol=rtol)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_operator_gradient_is_grad_times_dequantized_weight_transposed(case: tuple, dtype: str) -> None:
    """x.grad of torch.ops.hal.quantized_gemm == float64 dL/dy @ W^T; the output has a grad_fn."""
    seed = 500 + CASES.index(case) * 3 + ["fp32", "fp16", "bf16"].index(dtype)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    qw = make_weight(rng, *case)
    x = torch.tensor(rng.standard_normal((5, K)), dtype=TORCH_DTYPES[dtype], requires_grad=True)
    y = torch.ops.hal.quantized_gemm(x, *op_args(qw))
    assert y.requires_grad and y.grad_fn is not None
    upstream = torch.tensor(rng.standard_normal((5, N)), dtype=TORCH_DTYPES[dtype])
    y.backward(upstream)
    assert x.grad is not None and x.grad.dtype == x.dtype and x.grad.shape == x.shape
    assert_grad_close(x.grad, host(upstream) @ qw.dequantize(np.float64).T, dtype)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_chunked_dequantization_equals_hals_float64_dequantize(case: tuple) -> None:
    """Each block of rows the backward dequantizes is exactly hal's float64 dequantize of those rows."""
    rng = np.random.default_rng(40 + CASES.index(case))
    qw = make_weight(rng, *case)
    expected = qw.dequantize(np.float64)
    qweight, scales, zeros, g_idx, bits, group_size = op_args(qw)
    for start, stop in ((0, K), (0, 8), (40, 96), (K - 16, K)):
        block = _autograd.dequantize_rows(qweight, scales, zeros, g_idx, bits, group_size, start, stop, torch.float64)
        np.testing.assert_array_equal(block.numpy(), expected[start:stop])


def test_backward_formula_passes_gradcheck_in_float64() -> None:
    """grad_input is the exact VJP of x -> x @ W in float64 (gradcheck and gradgradcheck of the formula)."""
    rng = np.random.default_rng(8)
    qw = make_weight(rng, 4, 32, False, True, k=32, n=8)
    weight = op_args(qw)
    w = torch.tensor(qw.dequantize(np.float64))

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            return x @ w

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return _autograd.grad_input(grad, *weight)

    x = torch.tensor(rng.standard_normal((3, 32)), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(Linear.apply, (x,))
    assert torch.autograd.gradgradcheck(Linear.apply, (x,))


def test_operator_backward_is_itself_differentiable_in_the_upstream_gradient() -> None:
    """create_graph=True: x.grad is linear in dL/dy, and its derivative in dL/dy is W (double backward)."""
    rng = np.random.default_rng(10)
    qw = make_weight(rng, 8, 32, False, False)
    x = torch.tensor(rng.standard_normal((3, K)), dtype=torch.float32, requires_grad=True)
    upstream = torch.tensor(rng.standard_normal((3, N)), dtype=torch.float32, requires_grad=True)
    (grad_x,) = torch.autograd.grad(torch.ops.hal.quantized_gemm(x, *op_args(qw)), x, upstream, create_graph=True)
    assert grad_x.requires_grad
    (second,) = torch.autograd.grad(grad_x.sum(), upstream)
    assert_grad_close(second, np.ones((3, K)) @ qw.dequantize(np.float64), "fp32")


def test_backward_dequantizes_in_bounded_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a small block budget the backward dequantizes many blocks, none larger, and the gradient is unchanged."""
    rng = np.random.default_rng(9)
    qw = make_weight(rng, 4, 32, False, True)
    x = torch.tensor(rng.standard_normal((4, K)), dtype=torch.float32, requires_grad=True)
    upstream = torch.tensor(rng.standard_normal((4, N)), dtype=torch.float32)
    blocks: list[tuple[int, ...]] = []
    real = _autograd.dequantize_rows

    def spy(*args: object) -> torch.Tensor:
        block = real(*args)  # type: ignore[arg-type]
        blocks.append(tuple(block.shape))
        return block

    monkeypatch.setattr(_autograd, "CHUNK_ELEMENTS", 16 * N)
    monkeypatch.setattr(_autograd, "dequantize_rows", spy)
    torch.ops.hal.quantized_gemm(x, *op_args(qw)).backward(upstream)
    assert len(blocks) == K // 16 and all(rows * n <= 16 * N for rows, n in blocks)
    assert_grad_close(x.grad, host(upstream) @ qw.dequantize(np.float64).T, "fp32")


def test_a_weight_tensor_that_requires_grad_is_refused() -> None:
    """The quantized weight is frozen: scales requiring grad is an ArgumentError naming it, not a silent None."""
    qweight, scales, zeros, g_idx, bits, group_size = op_args(make_weight(np.random.default_rng(3), 4, 32, True,
                                                                           False))
    x = torch.ones(2, K, requires_grad=True)
    with pytest.raises(hal_core.ArgumentError, match="'scales' requires grad"):
        torch.ops.hal.quantized_gemm(x, qweight, scales.float().requires_grad_(), zeros, g_idx, bits, group_size)


def test_out_operator_refuses_an_input_that_requires_grad() -> None:
    """quantized_gemm_out records no gradient: with grad enabled it names 'x'; under no_grad it writes out."""
    qw = make_weight(np.random.default_rng(4), 4, 32, True, False)
    x = torch.ones(2, K, requires_grad=True)
    out = torch.full((2, N), 7.0)
    with pytest.raises(hal_core.ArgumentError, match="'x' requires grad"):
        torch.ops.hal.quantized_gemm_out(x, *op_args(qw), out)
    assert torch.all(out == 7.0)
    with torch.no_grad():
        torch.ops.hal.quantized_gemm_out(x, *op_args(qw), out)
    np.testing.assert_allclose(out.numpy(), np.ones((2, K)) @ qw.dequantize(np.float64), atol=1e-4, rtol=1e-4)


# -- QuantLinear ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_quant_linear_gradients_reach_the_input_through_a_residual(case: tuple) -> None:
    """out = x + layer(x) over [2, 3, K]: x.grad = g + g @ W^T (the layer is not silently left out)."""
    seed = 600 + CASES.index(case)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    bits, group_size, symmetric, act_order = case
    qw = make_weight(rng, bits, group_size, symmetric, act_order, k=K, n=K)
    layer = QuantLinear.from_weight(qw, torch.tensor(rng.standard_normal(K), dtype=torch.float32))
    x = torch.tensor(rng.standard_normal((2, 3, K)), dtype=torch.float32, requires_grad=True)
    y = x + layer(x)
    assert y.requires_grad
    upstream = torch.tensor(rng.standard_normal((2, 3, K)), dtype=torch.float32)
    y.backward(upstream)
    g = host(upstream)
    assert_grad_close(x.grad, g + g @ qw.dequantize(np.float64).T, "fp32")
    assert layer.bias.grad is None and all(b.grad is None for b in layer.buffers())


def test_quant_linear_bias_gets_its_gradient_when_it_requires_grad() -> None:
    """A bias parameter set to require grad gets dL/dy summed over rows; x, not requiring grad, gets none."""
    rng = np.random.default_rng(12)
    layer = QuantLinear.from_weight(make_weight(rng, 4, 32, False, False), torch.zeros(N, dtype=torch.float16))
    layer.bias.requires_grad_(True)
    x = torch.tensor(rng.standard_normal((2, 5, K)), dtype=torch.float32)
    upstream = torch.tensor(rng.standard_normal((2, 5, N)), dtype=torch.float32)
    layer(x).backward(upstream)
    assert layer.bias.grad.dtype == torch.float16
    np.testing.assert_allclose(host(layer.bias.grad), host(upstream).sum(axis=(0, 1)), atol=2e-2, rtol=2e-3)
    assert x.grad is None


def test_quant_linear_gradient_of_a_non_contiguous_and_a_1d_input() -> None:
    """A transposed input and a 1-D input get gradients of their own shapes, equal to the reference."""
    rng = np.random.default_rng(13)
    qw = make_weight(rng, 8, 64, True, False)
    layer = QuantLinear.from_weight(qw)
    w = qw.dequantize(np.float64)
    base = torch.tensor(rng.standard_normal((K, 3)), dtype=torch.float32, requires_grad=True)
    layer(base.T).sum().backward()
    assert_grad_close(base.grad, (np.ones((3, N)) @ w.T).T, "fp32")
    single = torch.tensor(rng.standard_normal(K), dtype=torch.float32, requires_grad=True)
    y = layer(single)
    assert y.shape == (N,)
    y.sum().backward()
    assert_grad_close(single.grad, w.sum(axis=1), "fp32")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_input_grad"])
def test_quant_linear_without_grad_keeps_the_direct_host_path(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No grad wanted: the eager CPU call goes straight to hal (not the operator) and the output needs no grad."""
    rng = np.random.default_rng(14)
    layer = QuantLinear.from_weight(make_weight(rng, 4, 32, True, False))
    calls: list[int] = []
    real = QuantLinear._host_gemm
    monkeypatch.setattr(QuantLinear, "_host_gemm", lambda self, rows: calls.append(1) or real(self, rows))
    x = torch.tensor(rng.standard_normal((2, K)), dtype=torch.float32, requires_grad=mode != "no_input_grad")
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "no_input_grad": torch.enable_grad}[mode]
    with context():
        y = layer(x)
    assert calls == [1] and not y.requires_grad
    calls.clear()
    layer(x.detach().requires_grad_())
    assert calls == []


def test_quant_linear_gradient_under_torch_compile_equals_eager() -> None:
    """torch.compile(fullgraph=True) with an input requiring grad: the compiled backward gives eager's gradient."""
    rng = np.random.default_rng(15)
    layer = QuantLinear.from_weight(make_weight(rng, 4, 32, False, True))
    x = torch.tensor(rng.standard_normal((3, K)), dtype=torch.float32, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(x).square().sum().backward()
    from_compiled, x.grad = x.grad, None
    layer(x).square().sum().backward()
    assert torch.equal(from_compiled, x.grad)


def test_quant_linear_gradient_on_cuda_equals_the_reference() -> None:
    """On a GPU host: the backward runs on the weight's device and gives the float64 reference gradient."""
    cuda_or_skip()
    rng = np.random.default_rng(16)
    qw = make_weight(rng, 4, 32, False, True)
    layer = QuantLinear.from_weight(qw, torch.zeros(N, dtype=torch.float16)).to("cuda")
    x = torch.tensor(rng.standard_normal((2, 3, K)), dtype=torch.float16, device="cuda", requires_grad=True)
    upstream = torch.tensor(rng.standard_normal((2, 3, N)), dtype=torch.float16, device="cuda")
    layer(x).backward(upstream)
    assert x.grad.is_cuda and x.grad.dtype == torch.float16
    assert_grad_close(x.grad, host(upstream) @ qw.dequantize(np.float64).T, "fp16")


def test_a_weight_changed_in_place_before_backward_is_an_error_not_a_stale_gradient() -> None:
    """The backward reads the buffers it saved: scales scaled in place after forward make backward raise."""
    layer = QuantLinear.from_weight(make_weight(np.random.default_rng(17), 4, 32, True, False))
    x = torch.ones(2, K, requires_grad=True)
    y = layer(x)
    layer.scales.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
