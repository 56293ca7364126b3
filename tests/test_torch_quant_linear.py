"""QuantLinear: hal's packed weight as an nn.Module, against float64 references; state_dict, safetensors, compile."""

from __future__ import annotations

import re

import numpy as np
import pytest
from torch_helpers import TORCH_DTYPES, cuda_or_skip, host, torch

import hal_core
import hal_core.torch as hal_torch
from hal_core.quant import QuantizedWeight, quantize, quantize_activations
from hal_core.testing.tolerances import tolerance
from hal_core.torch import QuantLinear

K, N = 128, 48


def act_order_g_idx(rng: np.random.Generator, k: int, group_size: int) -> np.ndarray:
    """GPTQ act-order: rows taken in a random order, the i-th row taken in group i // G."""
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[rng.permutation(k)] = np.arange(k) // group_size
    return g_idx


def make_weight(rng: np.random.Generator, bits: int, group_size: int, symmetric: bool, act_order: bool,
                k: int = K, n: int = N) -> QuantizedWeight:
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    qw = quantize(w, bits=bits, group_size=group_size, symmetric=symmetric)
    if act_order:
        qw = QuantizedWeight(qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros, bits=bits,
                             group_size=group_size, shape=qw.shape, g_idx=act_order_g_idx(rng, k, group_size))
    return qw


def reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> np.ndarray:
    """float64 ``x @ W + b`` over the stored codes (W8A8: activations quantized per token first)."""
    x64 = host(x).reshape(-1, qw.shape[0])
    w = qw.dequantize(np.float64)
    if qw.bits == 8:
        xq, sx = quantize_activations(x.detach().reshape(-1, qw.shape[0]).float().numpy())
        y = sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ w)
    else:
        y = x64 @ w
    if bias is not None:
        y = y + host(bias)
    return y.reshape(*x.shape[:-1], qw.shape[1])


def assert_close_to(y: torch.Tensor, expected: np.ndarray, dtype: str) -> None:
    atol, rtol = tolerance("gemm", dtype)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(host(y), expected, atol=atol * scale, rtol=rtol)


CASES = [  # bits, group_size, symmetric, act_order
    (4, 32, True, False),
    (4, 64, False, False),
    (4, 128, True, True),
    (4, 32, False, True),
    (8, 32, True, False),
    (8, 128, False, False),
    (8, 64, True, True),
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-g{c[1]}-{'sym' if c[2] else 'zp'}"
                         f"{'-actorder' if c[3] else ''}")
def test_forward_matches_float64_over_leading_batch_dims(case: tuple, dtype: str) -> None:
    """[2, 3, K] -> [2, 3, N] in x's dtype, with bias; W4A16 and W8A8 as the op documents them."""
    bits, group_size, symmetric, act_order = case
    seed = 100 + CASES.index(case) * 2 + (dtype == "bf16")
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    qw = make_weight(rng, bits, group_size, symmetric, act_order)
    bias = torch.tensor(rng.standard_normal(N) / 4, dtype=torch.float32)
    layer = QuantLinear.from_weight(qw, bias)
    assert (layer.zeros is None) == symmetric and (layer.g_idx is not None) == act_order
    x = torch.tensor(rng.standard_normal((2, 3, K)), dtype=TORCH_DTYPES[dtype])
    y = layer(x)
    assert y.shape == (2, 3, N) and y.dtype == x.dtype
    assert_close_to(y, reference(x, qw, bias), dtype)


def test_holds_exactly_hals_packed_weight_and_no_float_copy() -> None:
    """The buffers are weight_to_tensors' tensors (same bits); the only float tensors are scales and bias."""
    rng = np.random.default_rng(7)
    qw = make_weight(rng, 4, 32, False, True)
    layer = QuantLinear.from_weight(qw, torch.zeros(N))
    expected = hal_torch.weight_to_tensors(qw)
    assert dict(layer.named_buffers()).keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(getattr(layer, name), tensor), name
    floats = {name: tuple(t.shape) for name, t in layer.state_dict().items() if t.is_floating_point()}
    assert floats == {"scales": (K // 32, N), "bias": (N,)}
    assert layer.quantized_weight() == qw


@pytest.mark.parametrize("bits", [4, 8])
def test_from_linear_quantizes_through_hal_and_leaves_the_linear(bits: int) -> None:
    """from_linear == quantize(linear.weight.T), bias copied; the output is the dequantized layer's."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(K, N)
    before = linear.weight.detach().clone()
    layer = QuantLinear.from_linear(linear, bits=bits, group_size=64, symmetric=False)
    assert torch.equal(linear.weight, before)
    qw = quantize(before.T.numpy(), bits=bits, group_size=64, symmetric=False)
    assert layer.quantized_weight() == qw
    assert torch.equal(layer.bias, linear.bias) and layer.bias.data_ptr() != linear.bias.data_ptr()
    x = torch.randn(5, K)
    assert_close_to(layer(x), reference(x, qw, linear.bias), "fp32")
    whole = QuantLinear.from_linear(linear, group_size=-1)
    assert whole.group_size == K and whole.scales.shape == (1, N)


def test_state_dict_round_trips_through_safetensors(tmp_path) -> None:
    """save_file(state_dict) -> a fresh layer of the same format (also on meta with assign=True) -> same output."""
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(11)
    qw = make_weight(rng, 4, 32, False, True)
    layer = QuantLinear.from_weight(qw, torch.tensor(rng.standard_normal(N), dtype=torch.float32))
    save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    loaded = load_file(tmp_path / "layer.safetensors")
    x = torch.tensor(rng.standard_normal((4, K)), dtype=torch.float32)
    fresh = QuantLinear(K, N, bits=4, group_size=32, symmetric=False, act_order=True)
    assert fresh.load_state_dict(loaded) is not None
    assert torch.equal(fresh(x), layer(x))
    on_meta = QuantLinear(K, N, bits=4, group_size=32, symmetric=False, act_order=True, device="meta")
    on_meta.load_state_dict(loaded, assign=True)
    assert on_meta.quantized_weight() == qw
    assert torch.equal(on_meta(x), layer(x))


def test_load_state_dict_refuses_a_different_format() -> None:
    """No silent cast of codes or scales, no missing zero points: the error names the buffer."""
    layer = QuantLinear.from_weight(make_weight(np.random.default_rng(5), 4, 32, True, False))
    state = layer.state_dict()
    with pytest.raises(RuntimeError, match=r"'scales'.*torch\.float16.*torch\.float32"):
        QuantLinear(K, N, bias=False, group_size=32, scale_dtype=torch.float32).load_state_dict(state)
    with pytest.raises(RuntimeError, match="zeros"):
        QuantLinear(K, N, bias=False, group_size=32, symmetric=False).load_state_dict(state)
    with pytest.raises(RuntimeError, match="qweight"):
        QuantLinear(K, N, bias=False, bits=8, group_size=32).load_state_dict(state)


def test_dtype_casts_reach_the_bias_not_the_scales() -> None:
    """.half() / .to(bf16) keep the scales' dtype and bits (hal's format); the output follows the input."""
    rng = np.random.default_rng(2)
    qw = make_weight(rng, 4, 32, True, False)
    layer = QuantLinear.from_weight(qw, torch.ones(N))
    scales = layer.scales.clone()
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float16 and torch.equal(layer.scales, scales)
    assert layer.bias.dtype == torch.bfloat16
    x = torch.tensor(rng.standard_normal((3, K)), dtype=torch.float32)
    assert layer(x).dtype == torch.float32
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    layer.float()
    assert layer.scales.dtype == torch.float16 and layer.bias.dtype == torch.float32


def test_compiles_fullgraph_without_breaks_and_matches_eager() -> None:
    """A small MLP of QuantLinears (W4A16 with act-order, W8A8 with zero points) under torch.compile."""
    rng = np.random.default_rng(21)
    mlp = torch.nn.Sequential(QuantLinear.from_weight(make_weight(rng, 4, 32, True, True), torch.zeros(N)),
                              torch.nn.SiLU(),
                              QuantLinear.from_weight(make_weight(rng, 8, 16, False, False, k=N, n=K))).eval()
    x = torch.tensor(rng.standard_normal((2, 5, K)), dtype=torch.float32)
    explained = torch._dynamo.explain(mlp)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
    assert targets.count("hal.quantized_gemm") == 2
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(compiled(x), mlp(x))
        x2 = torch.tensor(rng.standard_normal((7, K)), dtype=torch.float32)
        assert torch.equal(compiled(x2), mlp(x2))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"bits": 3}, "'bits'"),
    ({"group_size": 48}, "'group_size'"),
    ({"group_size": 0}, "'group_size'"),
    ({"in_features": 12, "group_size": 4}, "'in_features'"),
    ({"scale_dtype": torch.float64}, "'scale_dtype'"),
    ({"symmetric": 1}, "'symmetric'"),
])
def test_constructor_names_the_bad_argument(kwargs: dict, match: str) -> None:
    args = {"in_features": K, "out_features": N, **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        QuantLinear(**args)


def test_from_linear_and_from_weight_refuse_what_they_cannot_hold() -> None:
    with pytest.raises(TypeError, match="'linear'"):
        QuantLinear.from_linear(torch.nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match="meta"):
        QuantLinear.from_linear(torch.nn.Linear(K, N, device="meta"))
    with pytest.raises(ValueError, match="'group_size'"):
        QuantLinear.from_linear(torch.nn.Linear(K, N), group_size=100)
    with pytest.raises(ValueError, match="'bias'"):
        QuantLinear.from_weight(make_weight(np.random.default_rng(1), 4, 32, True, False), torch.zeros(N + 1))
    with pytest.raises(TypeError, match="'weight'"):
        QuantLinear.from_weight(torch.zeros(K, N))


def test_runs_on_cuda_like_on_the_host() -> None:
    """On a GPU host: the layer moved with .cuda() gives the host's result within the gemm tolerance."""
    cuda_or_skip()
    rng = np.random.default_rng(31)
    qw = make_weight(rng, 4, 128, False, False)
    layer = QuantLinear.from_weight(qw, torch.ones(N, dtype=torch.float16))
    x = torch.tensor(rng.standard_normal((3, 4, K)), dtype=torch.float16)
    expected = reference(x, qw, layer.bias)
    on_gpu = layer.to("cuda")
    assert on_gpu.qweight.is_cuda and on_gpu.scales.dtype == torch.float16
    assert_close_to(on_gpu(x.cuda()).cpu(), expected, "fp16")


def test_eager_host_calls_equal_the_torch_operator_and_follow_replaced_buffers() -> None:
    """Eager CPU calls go straight to hal's front door with the weight's views kept: the same bits as
    ``torch.ops.hal.quantized_gemm``, and a replaced buffer is seen at the next call."""
    seed = 77
    print(f"seed={seed}")
    torch.manual_seed(seed)
    layer = QuantLinear.from_linear(torch.nn.Linear(128, 48), bits=4, group_size=32)
    x = torch.randn(3, 5, 128)
    operator = torch.ops.hal.quantized_gemm(x.reshape(-1, 128), layer.qweight, layer.scales, layer.zeros,
                                            layer.g_idx, layer.bits, layer.group_size).view(3, 5, 48) + layer.bias
    assert torch.equal(layer(x), operator)
    other = QuantLinear.from_linear(torch.nn.Linear(128, 48), bits=4, group_size=32)
    layer.load_state_dict(other.state_dict(), assign=True)  # new buffer objects, not copies into the old ones
    assert torch.equal(layer(x), other(x))
    before = layer(x) - layer.bias
    layer.scales.mul_(2)  # in place: the kept views see it
    assert torch.allclose(layer(x) - layer.bias, 2 * before, rtol=1e-5, atol=1e-5)


# -- hostile inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, K + 1), (0, K + 1), (2, 0, K - 8), (K + 1,), (), (0,)],
                         ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("name", [None, "model.layers.0.mlp.up_proj"])
def test_a_wrong_input_shape_names_the_input_and_the_layer(shape: tuple, name: str | None) -> None:
    """Any batch shape (0 rows too) whose last dim is not in_features: ArgumentError naming 'x' and the layer."""
    layer = QuantLinear.from_weight(make_weight(np.random.default_rng(41), 4, 32, True, False), name=name)
    where = f"QuantLinear '{name}' (in_features={K}, out_features={N})" if name else \
        f"QuantLinear(in_features={K}, out_features={N})"
    with pytest.raises(hal_core.ArgumentError, match=rf"argument 'x' of {re.escape(where)}: expected shape "
                                                     rf"\[\.\.\., {K}\], got {re.escape(str(shape))}"):
        layer(torch.ones(shape))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool])
def test_an_activation_dtype_hal_cannot_take_names_the_input(dtype: torch.dtype) -> None:
    """int / float64 / bool activations: ArgumentTypeError naming 'x', the layer and the dtype (no silent cast)."""
    layer = QuantLinear.from_weight(make_weight(np.random.default_rng(42), 8, 32, True, False), name="proj")
    with pytest.raises(hal_core.ArgumentTypeError, match=rf"argument 'x' of QuantLinear 'proj'.*{dtype}"):
        layer(torch.ones(2, K, dtype=dtype))
    with pytest.raises(hal_core.ArgumentTypeError, match=r"argument 'x'.*list"):
        layer([[0.0] * K])


def test_an_input_on_another_device_names_the_input() -> None:
    """An input on meta for a host layer: ArgumentError naming 'x' and both devices, before any work."""
    layer = QuantLinear.from_weight(make_weight(np.random.default_rng(43), 4, 32, True, False))
    with pytest.raises(hal_core.ArgumentError, match=r"argument 'x' of QuantLinear\(.*meta.*cpu"):
        layer(torch.ones(2, K, device="meta"))


def test_one_dimensional_and_non_contiguous_inputs_match_the_reference() -> None:
    """[K] -> [N] as nn.Linear does; a transposed (non-contiguous) input gives the contiguous one's result."""
    rng = np.random.default_rng(44)
    qw = make_weight(rng, 4, 64, False, False)
    bias = torch.tensor(rng.standard_normal(N), dtype=torch.float32)
    layer = QuantLinear.from_weight(qw, bias)
    single = torch.tensor(rng.standard_normal(K), dtype=torch.float32)
    y = layer(single)
    assert y.shape == (N,)
    assert_close_to(y, reference(single[None], qw, bias)[0], "fp32")
    strided = torch.tensor(rng.standard_normal((K, 6)), dtype=torch.float32).T
    assert not strided.is_contiguous()
    assert torch.equal(layer(strided), layer(strided.contiguous()))


def test_load_state_dict_with_a_wrong_shape_names_the_key_and_loads_nothing_of_the_layer() -> None:
    """A wrong-shaped buffer inside a model: the error names its full key; the layer's other buffers are kept."""
    rng = np.random.default_rng(45)
    model = torch.nn.Sequential(QuantLinear.from_weight(make_weight(rng, 4, 32, False, False), torch.zeros(N)))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    other = QuantLinear.from_weight(make_weight(rng, 4, 32, False, False), torch.ones(N)).state_dict()
    state = {f"0.{name}": t for name, t in other.items()}
    state["0.qweight"] = torch.zeros(K // 8 - 1, N, dtype=torch.int32)
    for assign in (False, True):
        with pytest.raises(RuntimeError, match=rf"'0\.qweight': the checkpoint holds shape \({K // 8 - 1}, {N}\)"):
            model.load_state_dict(state, assign=assign)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, before[name]), name


def test_load_state_dict_with_zero_points_the_layer_lacks_is_refused_even_when_not_strict() -> None:
    """strict=False does not drop a checkpoint's zero points or g_idx silently: the key is named."""
    rng = np.random.default_rng(46)
    state = QuantLinear.from_weight(make_weight(rng, 4, 32, False, True)).state_dict()
    for kwargs, key in (({"act_order": True}, "'zeros'"), ({"symmetric": False}, "'g_idx'")):
        layer = QuantLinear(K, N, bias=False, group_size=32, **kwargs)
        with pytest.raises(RuntimeError, match=key):
            layer.load_state_dict(state, strict=False)
    with pytest.raises(RuntimeError, match=r"'zeros'.*has zeros but the checkpoint does not"):
        QuantLinear(K, N, bias=False, group_size=32, symmetric=False, act_order=True).load_state_dict(
            {k: v for k, v in state.items() if k != "zeros"}, strict=False)


def test_name_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="'name'"):
        QuantLinear(K, N, name=3)  # type: ignore[arg-type]


def test_the_torch_operator_binds_each_host_weight_once_and_follows_new_ones() -> None:
    """torch.ops.hal.quantized_gemm on CPU tensors runs an op bound to the weight and its options, one per
    (weight tensors, activations): repeated calls reuse it, another activations or a new set of tensors gets
    its own, and every result matches float64."""
    from hal_core.torch import _ops

    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    original = make_weight(rng, 4, 32, True, False)
    layer = QuantLinear.from_weight(original)
    x = torch.from_numpy(rng.standard_normal((3, K)).astype(np.float32))

    def call(activations: str | None = None) -> torch.Tensor:
        return torch.ops.hal.quantized_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.bits,
                                            layer.group_size, activations)

    _ops._HOST_BOUND.clear()
    with torch.no_grad():
        first = call()
        bound = dict(_ops._HOST_BOUND)
        assert len(bound) == 1
        again = call()
        assert bound == _ops._HOST_BOUND and torch.equal(first, again)
        int8 = call("int8")
        assert len(_ops._HOST_BOUND) == 2
        assert torch.equal(int8, QuantLinear.from_weight(layer.quantized_weight(), activations="int8")(x))
        fresh = make_weight(rng, 4, 32, True, False)
        layer.load_state_dict(QuantLinear.from_weight(fresh).state_dict(), assign=True)
        replaced = call()
    assert_close_to(first, reference(x, original, None), "fp32")
    assert_close_to(replaced, reference(x, fresh, None), "fp32")
