"""kernelize's fused sibling projections: q/k/v (and gate/up) QuantLinears of one input as one GEMM, against float64
references, with the members' buffers as views of one weight and every way out of the group correct."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
from test_torch_quant_linear import assert_close_to, make_weight, reference
from torch_helpers import TORCH_DTYPES, torch

import hal_core
from hal_core.torch import QuantLinear, kernelize
from hal_core.torch._fused_projections import ProjectionGroup, fuse_siblings, fusion_problem

K = 256
SIZES = {"q_proj": 128, "k_proj": 32, "v_proj": 48}


class Attention(torch.nn.Module):
    """q/k/v projections of one hidden size, as a transformers attention layer holds them."""

    def __init__(self, rng: np.random.Generator, bits: int = 4, group_size: int = 64, symmetric: bool = True,
                 bias: bool = False) -> None:
        super().__init__()
        self.weights = {}
        for name, n in SIZES.items():
            qw = make_weight(rng, bits, group_size, symmetric, False, k=K, n=n)
            b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if bias else None
            setattr(self, name, QuantLinear.from_weight(qw, b, name=name))
            self.weights[name] = (qw, b)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [getattr(self, name)(x) for name in SIZES]


def _seed() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def _gemm_calls() -> int:
    return hal_core.stats().get("cpu", {}).get("quantized_gemm", {}).get("calls", 0)


def _check(module: Attention, x: torch.Tensor, outs: list[torch.Tensor], dtype: str) -> None:
    for name, y in zip(SIZES, outs, strict=True):
        qw, b = module.weights[name]
        assert y.shape == (*x.shape[:-1], SIZES[name]) and y.dtype == x.dtype
        assert_close_to(y, reference(x, qw, b), dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", [(4, 64, True, False), (4, 32, False, True), (8, 64, True, True)],
                         ids=["int4-sym", "int4-zp-bias", "int8-bias"])
def test_fused_projections_match_the_reference_in_one_gemm(cpu, dtype: str, case: tuple) -> None:
    """One GEMM serves the three calls on one input; each member's columns (and bias) match float64."""
    bits, group, symmetric, bias = case
    rng = _seed()
    module = Attention(rng, bits, group, symmetric, bias)
    old = weakref.ref(module.q_proj.qweight)
    assert fuse_siblings(module) == (["q_proj", "k_proj", "v_proj"], None)
    group_ = module.q_proj._hal_group
    assert isinstance(group_, ProjectionGroup)
    fused = group_.fused["qweight"]
    assert fused is not None and fused.shape[1] == sum(SIZES.values())
    for member in group_.members:  # views of one weight: no copy kept, the old tensors released
        for key in ("qweight", "scales", "zeros"):
            t = member._buffers.get(key)
            if t is not None:
                assert t.untyped_storage().data_ptr() == group_.fused[key].untyped_storage().data_ptr()
    assert old() is None
    x = torch.from_numpy(rng.standard_normal((3, 5, K)).astype(np.float32)).to(TORCH_DTYPES[dtype])
    with torch.no_grad():
        before = _gemm_calls()
        outs = module(x)
        assert _gemm_calls() == before + 1
    _check(module, x, outs, dtype)


def test_every_order_and_lone_calls_are_correct(cpu) -> None:
    """Siblings called in any order, one twice, or each with its own input: each result is its own input's."""
    rng = _seed()
    module = Attention(rng)
    fuse_siblings(module)
    x = torch.from_numpy(rng.standard_normal((4, K)).astype(np.float32))
    other = torch.from_numpy(rng.standard_normal((2, K)).astype(np.float32))
    with torch.no_grad():
        v, q, k = module.v_proj(x), module.q_proj(x), module.k_proj(x)
        _check(module, x, [q, k, v], "fp32")
        before = _gemm_calls()
        q_again = module.q_proj(x)  # taken once already: a new GEMM
        k_other = module.k_proj(other)  # another input: its own GEMM
        assert _gemm_calls() == before + 2
        assert_close_to(q_again, reference(x, *module.weights["q_proj"]), "fp32")
        assert_close_to(k_other, reference(other, *module.weights["k_proj"]), "fp32")


def test_an_input_changed_in_place_is_computed_again(cpu) -> None:
    """A sibling never takes columns computed from an input that changed since (the tensor's version)."""
    rng = _seed()
    module = Attention(rng)
    fuse_siblings(module)
    x = torch.from_numpy(rng.standard_normal((2, K)).astype(np.float32))
    with torch.no_grad():
        module.q_proj(x)
        x.mul_(-2.0)
        k = module.k_proj(x)
    assert_close_to(k, reference(x, *module.weights["k_proj"]), "fp32")


def test_inference_tensors_are_computed_by_each_member(cpu) -> None:
    """Under torch.inference_mode an input has no version counter: each member computes the fused GEMM (nothing is
    kept between siblings), and an input changed in place between two calls gives the changed input's result."""
    rng = _seed()
    module = Attention(rng)
    fuse_siblings(module)
    with torch.inference_mode():
        x = torch.from_numpy(rng.standard_normal((2, 3, K)).astype(np.float32))
        before = _gemm_calls()
        outs = module(x)
        assert _gemm_calls() == before + 3
        _check(module, x, outs, "fp32")
        module.q_proj(x)
        x.mul_(-2.0)
        k = module.k_proj(x)
    assert_close_to(k, reference(x, *module.weights["k_proj"]), "fp32")


def test_a_replaced_weight_dissolves_the_group(cpu) -> None:
    """load_state_dict(assign=True) on one member: the group gives every member its own contiguous columns back
    and the new weight is the one used."""
    rng = _seed()
    module = Attention(rng)
    fuse_siblings(module)
    group_ = module.q_proj._hal_group
    fresh = make_weight(rng, 4, 64, True, False, k=K, n=SIZES["k_proj"])
    module.k_proj.load_state_dict(QuantLinear.from_weight(fresh).state_dict(), assign=True)
    module.weights["k_proj"] = (fresh, None)
    x = torch.from_numpy(rng.standard_normal((3, K)).astype(np.float32))
    with torch.no_grad():
        outs = module(x)
    _check(module, x, outs, "fp32")
    assert not group_.members
    for name in SIZES:
        member = getattr(module, name)
        assert "forward" not in member.__dict__ and getattr(member, "_hal_group", None) is None
        assert member.qweight.is_contiguous() and member.scales.is_contiguous()


def test_activations_follow_the_members(cpu) -> None:
    """A common new activations is bound again (W4A8 serves all three); members that differ are dissolved."""
    rng = _seed()
    module = Attention(rng)
    fuse_siblings(module)
    x = torch.from_numpy(rng.standard_normal((6, K)).astype(np.float32))
    with torch.no_grad():
        float_outs = module(x)
        for name in SIZES:
            getattr(module, name).activations = "int8"
        int8_outs = module(x)
        assert getattr(module.q_proj, "_hal_group", None) is not None
        module.v_proj.activations = None
        mixed = module(x)
    assert getattr(module.q_proj, "_hal_group", None) is None
    for name, a, b, c in zip(SIZES, float_outs, int8_outs, mixed, strict=True):
        unfused = QuantLinear.from_weight(module.weights[name][0])
        with torch.no_grad():
            assert torch.equal(b, _as(unfused, "int8")(x)), name
            assert torch.equal(c, _as(unfused, None if name == "v_proj" else "int8")(x)), name
        assert not torch.equal(a, b)


def _as(layer: QuantLinear, activations: str | None) -> QuantLinear:
    layer.activations = activations
    return layer


def test_state_dict_and_autograd_see_each_member(cpu) -> None:
    """state_dict holds each member's own tensors (loading them into an unfused copy gives its results), and with
    autograd recording each member's output still has x's gradient."""
    rng = _seed()
    module = Attention(rng, bias=True)
    expected = {key: t.clone() for key, t in module.state_dict().items()}
    fuse_siblings(module)
    state = module.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[key], t) for key, t in expected.items())
    x = torch.from_numpy(rng.standard_normal((2, K)).astype(np.float32)).requires_grad_()
    outs = module(x)
    sum(y.sum() for y in outs).backward()
    grad = sum(qw.dequantize(np.float64).sum(axis=1) for qw, _ in module.weights.values())
    np.testing.assert_allclose(x.grad.numpy(), np.broadcast_to(grad, x.shape), rtol=1e-4, atol=1e-4)
    _check(module, x.detach(), [y.detach() for y in outs], "fp32")


def test_what_is_not_fused_says_why(cpu) -> None:
    rng = _seed()
    module = Attention(rng)
    module.k_proj = torch.nn.Linear(K, SIZES["k_proj"])
    assert "Linear is not a QuantLinear" in (fusion_problem([module.q_proj, module.k_proj]) or "")
    assert fuse_siblings(module)[0] == []
    other = Attention(rng, group_size=32)
    other.v_proj = Attention(rng, group_size=64).v_proj
    assert "differ in format" in (fuse_siblings(other)[1] or "")
    act_order = QuantLinear.from_weight(make_weight(rng, 4, 64, True, True, k=K, n=32))
    assert "act-order" in (fusion_problem([act_order]) or "")


def test_kernelize_fuses_a_quantized_llama(cpu) -> None:
    """kernelize on a quantize_model'd Llama: every attention's q/k/v and every MLP's gate/up fused (reported),
    half the GEMM calls per layer gone, the logits those of the unfused model within the gemm tolerance."""
    from transformers_helpers import llama, prompts

    from hal_core.torch import quantize_model

    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    model = llama(seed)
    # float activations and an int4 lm_head: fused and unfused differ by float rounding alone (int8 activations
    # would turn a rounding difference into a quantization step now and then)
    quantize_model(model, bits=4, group_size=32, layer_bits=None, activations="float")
    ids, mask = prompts(seed)
    with torch.no_grad():
        before = _gemm_calls()
        want = model(ids, attention_mask=mask).logits
        unfused_calls = _gemm_calls() - before
        report = kernelize(model)
        assert sorted(report.fused) == sorted([f"model.layers.{i}.self_attn" for i in range(2)]
                                              + [f"model.layers.{i}.mlp" for i in range(2)])
        assert report.fused["model.layers.0.mlp"] == ["gate_proj", "up_proj"]
        assert kernelize(model).fused == {}  # idempotent
        before = _gemm_calls()
        got = model(ids, attention_mask=mask).logits
        assert _gemm_calls() - before == unfused_calls - 3 * 2
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-3 * scale
    off = kernelize(llama(seed), fuse=False)
    assert off.fused == {}
    with pytest.raises(TypeError, match="'fuse'"):
        kernelize(model, fuse="yes")  # type: ignore[arg-type]


def test_a_fused_model_saves_and_loads_back_unfused(cpu, tmp_path) -> None:
    """save_quantized after kernelize writes every member's own tensors (the views made contiguous); the loaded
    model's logits equal the fused one's within the gemm tolerance, and kernelize fuses it again."""
    from transformers_helpers import llama, prompts

    from hal_core.torch import load_quantized, quantize_model, save_quantized

    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    model = llama(seed)
    quantize_model(model, bits=4, group_size=32, layer_bits=None, activations="float")  # as in the test above
    kernelize(model)
    ids, mask = prompts(seed)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    folder = save_quantized(model, tmp_path / "fused")
    loaded = load_quantized(folder, dtype=torch.float32, attn_implementation="eager")
    for layer in loaded.modules():
        if isinstance(layer, QuantLinear):
            layer.activations = "float"
    q = loaded.model.layers[0].self_attn.q_proj
    assert q.qweight.is_contiguous() and getattr(q, "_hal_group", None) is None
    with torch.no_grad():
        got = loaded(ids, attention_mask=mask).logits
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
        assert len(kernelize(loaded).fused) == 4
