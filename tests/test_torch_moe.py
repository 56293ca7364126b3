"""quantize_model on mixture-of-experts models: sparse MoE blocks become QuantMoE, run by hal's fused_moe.

Tiny random Qwen3-MoE and Mixtral models (fp32, 2 layers, 8 experts top-2, hidden 64) are compared with
float64 computations on the dequantized experts and with eager transformers holding those experts.
"""

from __future__ import annotations

import copy
import gc
import types
import weakref
from typing import Any

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

import hal_core  # noqa: E402
from hal_core import ArgumentError, ArgumentTypeError, ConfigurationError, FallbackError  # noqa: E402
from hal_core.interop import host_view  # noqa: E402
from hal_core.ops import OPS  # noqa: E402
from hal_core.testing.inputs import assert_close  # noqa: E402
from hal_core.torch import QuantLinear, QuantMoE, quantize_model  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, GROUP = 64, 32, 8, 2, 32
MODELS = [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)]


def _model(kind: str, rng: np.random.Generator, norm_topk_prob: bool = True, layers: int = 2) -> Any:
    """A random fp32 model (2 layers by default), every MLP a sparse MoE block (router, experts ~ N(0, 1/K))."""
    seed = int(rng.integers(2**31))
    print(f"torch seed={seed}")
    torch.manual_seed(seed)
    common = {"vocab_size": 128, "hidden_size": HIDDEN, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_experts_per_tok": TOP_K, "hidden_act": "silu",
              "max_position_embeddings": 128}
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=INTER, moe_intermediate_size=INTER,
                                             num_experts=EXPERTS, norm_topk_prob=norm_topk_prob)
    else:
        config = transformers.MixtralConfig(**common, intermediate_size=INTER, num_local_experts=EXPERTS)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, HIDDEN ** -0.5)
            layer.mlp.experts.gate_up_proj.normal_(0.0, HIDDEN ** -0.5)
            layer.mlp.experts.down_proj.normal_(0.0, INTER ** -0.5)
    return model


def _routing(kind: str, norm_topk_prob: bool) -> str:
    """What the architecture computes: Mixtral and Qwen3-MoE with norm_topk_prob renormalise the top-k weights."""
    return "softmax_topk" if kind == "qwen3_moe" and not norm_topk_prob else "softmax_topk_renorm"


def _blocks(model: Any) -> list[QuantMoE]:
    return [m for m in model.modules() if isinstance(m, QuantMoE)]


def _host_experts(module: QuantMoE) -> Any:
    return module.expert_weights().map_arrays(host_view)


def _dequantized_copy(float_model: Any, quantized: Any) -> Any:
    """``float_model`` copied with every linear weight and expert the quantized model's, dequantized (eager fp32)."""
    reference = copy.deepcopy(float_model)
    layers = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in reference.named_modules():
            held = layers.get(name)
            if isinstance(held, QuantLinear):
                module.weight.copy_(torch.from_numpy(held.quantized_weight().map_arrays(host_view).dequantize().T))
            elif isinstance(held, QuantMoE):
                experts = _host_experts(held)
                for e in range(EXPERTS):
                    module.experts.gate_up_proj[e] = torch.from_numpy(experts.w13[e].dequantize().T.copy())
                    module.experts.down_proj[e] = torch.from_numpy(experts.w2[e].dequantize().T.copy())
    return reference


@pytest.mark.parametrize(("kind", "norm"), MODELS)
def test_quantize_model_replaces_each_moe_block_and_reports_it(hal_rng: np.random.Generator, kind: str,
                                                               norm: bool) -> None:
    """Each sparse MoE block becomes a QuantMoE with the config's routing; no float expert weight is left."""
    model = _model(kind, hal_rng, norm)
    router = model.model.layers[0].mlp.gate
    float_experts = weakref.ref(model.model.layers[0].mlp.experts)
    report = quantize_model(model, bits=4, group_size=GROUP)
    gc.collect()
    assert float_experts() is None, "the float experts are still referenced"
    assert report.moe_blocks == ("model.layers.0.mlp", "model.layers.1.mlp")
    assert report.moe_bits == (4, 4) and report.moe_skipped == ()
    assert report.moe_float_bytes == 2 * EXPERTS * 3 * INTER * HIDDEN * 4
    blocks = _blocks(model)
    assert len(blocks) == 2 and blocks[0] is model.model.layers[0].mlp and blocks[0].gate is router
    assert report.moe_quantized_bytes == sum(t.numel() * t.element_size() for b in blocks for t in b.buffers())
    assert {(b.routing, b.top_k, b.activation, b.bits, b.group_size) for b in blocks} == {
        (_routing(kind, norm), TOP_K, "silu", 4, GROUP)}
    assert not any(p.dim() >= 3 for p in model.parameters())
    assert not any("gate_up_proj" in key or "experts.down_proj" in key for key in model.state_dict())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("kind", "norm"), MODELS)
def test_block_output_matches_float64_on_the_dequantized_experts(hal_rng: np.random.Generator, kind: str,
                                                                 norm: bool, bits: int) -> None:
    """A QuantMoE's output matches fused_moe's float64 reference on its dequantized experts and float64 logits, with
    the activations quantize_model's default ("auto") settles on for the call."""
    model = _model(kind, hal_rng, norm)
    quantize_model(model, bits=bits, group_size=GROUP)
    block = model.model.layers[1].mlp
    assert block.activations == "auto"
    x = torch.from_numpy(hal_rng.uniform(-1.0, 1.0, (3, 7, HIDDEN)).astype(np.float32))
    with torch.no_grad():
        got = block(x)
    assert got.shape == x.shape and got.dtype == torch.float32
    rows = x.reshape(-1, HIDDEN).numpy()
    logits = rows.astype(np.float64) @ block.gate.weight.detach().double().numpy().T
    args = {"hidden_states": rows, "router_logits": logits.astype(np.float32), "experts": _host_experts(block),
            "top_k": TOP_K, "routing": _routing(kind, norm), "activation": "silu"}
    settled = hal_core.get_backend("cpu").ops.prepare("fused_moe", **args, activations="auto").args["activations"]
    print(f"activations settled on {settled!r}")
    expected = OPS["fused_moe"].reference({**args, "router_logits": logits, "activations": settled})
    int8 = bits == 8 or settled == "int8"
    assert_close(got.reshape(-1, HIDDEN).numpy(), expected, kind="moe_w8a8" if int8 else "gemm", dtype="fp32",
                 what=f"{kind} int{bits} block ({settled} activations)")


@pytest.mark.parametrize("activations", [None, "int8"])
def test_quantize_models_activations_reach_the_blocks_and_a_change_the_next_call(
        hal_rng: np.random.Generator, activations: str | None) -> None:
    """quantize_model's activations become each QuantMoE's; a block's setting changed after a call is what the next
    call runs (its bound op is made again): each call's bits equal a fresh block's with that setting."""
    model = _model("qwen3_moe", hal_rng, True)
    quantize_model(model, bits=4, group_size=GROUP, activations=activations)
    block = model.model.layers[0].mlp
    assert {b.activations for b in _blocks(model)} == {activations}
    assert f"activations={activations}" in repr(block) if activations else "activations=" not in repr(block)
    x = torch.from_numpy(hal_rng.uniform(-1.0, 1.0, (6, HIDDEN)).astype(np.float32))
    routed = block.gate(x)
    logits = (routed[0] if isinstance(routed, tuple) else routed).detach().numpy()
    args = {"hidden_states": x.numpy(), "router_logits": logits, "experts": _host_experts(block), "top_k": TOP_K,
            "routing": block.routing}
    cpu = hal_core.get_backend("cpu")
    with torch.no_grad():
        for setting in (activations, "int8" if activations is None else None, activations):
            block.activations = setting
            got = block(x).numpy()
            want = cpu.ops.fused_moe(**args, **({"activations": setting} if setting else {}))
            np.testing.assert_array_equal(got, want, err_msg=f"activations={setting}")


@pytest.mark.parametrize(("kind", "norm"), MODELS)
def test_quantized_experts_hold_the_blocks_weights_in_hals_layout(hal_rng: np.random.Generator, kind: str,
                                                                  norm: bool) -> None:
    """w13[e] is gate_up_proj[e].T (gate columns first) and w2[e] down_proj[e].T, each within half a step; the
    block stays within int4's error of the float block (a swapped gate/up or transposed expert is off by ~100%)."""
    model = _model(kind, hal_rng, norm)
    original = copy.deepcopy(model.model.layers[0].mlp)
    quantize_model(model, bits=4, group_size=GROUP)
    experts = _host_experts(model.model.layers[0].mlp)
    for e in range(EXPERTS):
        for weight, source in ((experts.w13[e], original.experts.gate_up_proj[e]),
                               (experts.w2[e], original.experts.down_proj[e])):
            step = np.repeat(weight.scales.astype(np.float64), GROUP, axis=0)
            error = np.abs(weight.dequantize() - source.detach().double().numpy().T)
            assert (error <= 0.5 * step + 1e-6).all(), f"expert {e}: {error.max()}"
    x = torch.from_numpy(hal_rng.uniform(-1.0, 1.0, (1, 16, HIDDEN)).astype(np.float32))
    with torch.no_grad():
        got, expected = model.model.layers[0].mlp(x), original(x)
    error = torch.linalg.norm(got - expected) / torch.linalg.norm(expected)
    assert error < 0.3, error  # int4 (G = 32) on random weights: up to 0.20 over 70 run seeds; a layout error ~1


@pytest.mark.parametrize(("kind", "norm"), MODELS)
def test_greedy_tokens_match_eager_transformers_on_the_dequantized_weights(hal_rng: np.random.Generator, kind: str,
                                                                           norm: bool) -> None:
    """int4 everywhere (lm_head too, W4A16): greedy tokens equal eager fp32 transformers on the dequantized weights."""
    model = _model(kind, hal_rng, norm)
    float_model = copy.deepcopy(model)
    quantize_model(model, bits=4, group_size=GROUP, layer_bits=None, activations="float")
    reference = _dequantized_copy(float_model, model)
    ids = torch.from_numpy(hal_rng.integers(0, 128, (2, 5)))
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        logits, expected_logits = model(got).logits, reference(got).logits
    assert torch.equal(got, expected), (got, expected)
    assert_close(logits.numpy(), expected_logits.double().numpy(), kind="gemm", dtype="fp32", what="logits")


def test_int8_model_stays_within_w8a8_error_of_the_dequantized_model(hal_rng: np.random.Generator) -> None:
    """One int8 MoE layer (W8A8: activations quantized per token) keeps the logits within 5% (L2) of eager
    transformers on the dequantized experts, the linear layers left in float; a mis-laid expert is off by far more.
    (One layer: with two, the first block's W8A8 error may flip a near-tie of the second block's router.)"""
    model = _model("qwen3_moe", hal_rng, True, layers=1)
    float_model = copy.deepcopy(model)
    report = quantize_model(model, bits=8, group_size=GROUP, skip=("*_proj", "lm_head"))
    assert report.quantized == () and report.moe_bits == (8,)
    reference = _dequantized_copy(float_model, model)
    ids = torch.from_numpy(hal_rng.integers(0, 128, (2, 9)))
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    error = torch.linalg.norm(got - expected, dim=-1) / torch.linalg.norm(expected, dim=-1)
    print(f"max relative error {error.max():.4f}")
    assert error.max() < 0.05, error


def test_fused_moe_is_served_by_hal_cpu_without_fallback(hal_rng: np.random.Generator) -> None:
    """A no-grad forward on CPU runs every MoE block as one fused_moe call on hal-cpu, with no fallback anywhere."""
    model = _model("mixtral", hal_rng)
    quantize_model(model, bits=4, group_size=GROUP)
    hal_core.reset()
    with torch.no_grad():
        model(torch.from_numpy(hal_rng.integers(0, 128, (1, 6))))
    stats = hal_core.stats()["cpu"]["fused_moe"]
    assert stats["calls"] == 2 and stats["implementations"] == {"cpu.fused_moe": 2}, stats
    assert stats["fallbacks"] == {}
    assert all(block.fallbacks == {} for block in _blocks(model))


def test_autograd_call_falls_back_counted_with_the_same_output_and_eager_gradients(
        hal_rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """With autograd recording the block runs quantized_gemm per expert (counted once per call, by reason): the
    output equals fused_moe's, and x's gradient the eager block's on the dequantized experts; HAL_STRICT raises."""
    model = _model("qwen3_moe", hal_rng, True)
    float_model = copy.deepcopy(model)
    quantize_model(model, bits=4, group_size=GROUP, activations=None)
    block = model.model.layers[0].mlp
    eager = _dequantized_copy(float_model, model).model.layers[0].mlp
    x = torch.from_numpy(hal_rng.uniform(-1.0, 1.0, (1, 9, HIDDEN)).astype(np.float32))
    with torch.no_grad():
        fused = block(x)
    leaf = x.clone().requires_grad_()
    composed = block(leaf)
    (reason, calls), = block.fallbacks.items()
    assert calls == 1 and "autograd" in reason
    assert_close(composed.detach().numpy(), fused.double().numpy(), kind="gemm", dtype="fp32", what="fallback")
    composed.square().sum().backward()
    eager_leaf = x.clone().requires_grad_()
    eager(eager_leaf).square().sum().backward()
    assert leaf.grad is not None and eager_leaf.grad is not None
    assert_close(leaf.grad.numpy(), eager_leaf.grad.double().numpy(), kind="gemm", dtype="fp32", what="grad")
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(FallbackError, match="autograd"):
        block(x.clone().requires_grad_())


def test_config_without_num_experts_per_tok_is_refused_naming_it(hal_rng: np.random.Generator) -> None:
    """A config missing num_experts_per_tok: ConfigurationError naming the field and the block; nothing changed."""
    model = _model("qwen3_moe", hal_rng)
    fields = {k: v for k, v in model.config.to_dict().items() if k != "num_experts_per_tok"}
    model.config = types.SimpleNamespace(**fields)
    with pytest.raises(ConfigurationError, match=r"'model.layers.0.mlp'.*'num_experts_per_tok' is missing"):
        quantize_model(model, bits=4, group_size=GROUP)
    assert not _blocks(model)
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith("q_proj"))


def test_config_that_disagrees_with_the_router_is_refused_naming_it(hal_rng: np.random.Generator) -> None:
    """num_experts_per_tok other than the router's top_k: ConfigurationError naming the field and both values."""
    model = _model("qwen3_moe", hal_rng)
    model.config.num_experts_per_tok = 3
    with pytest.raises(ConfigurationError, match="'num_experts_per_tok' is 3, but the block's router takes top_k=2"):
        quantize_model(model, bits=4, group_size=GROUP)
    assert not _blocks(model)


def test_config_norm_topk_prob_that_disagrees_with_the_router_is_refused(hal_rng: np.random.Generator) -> None:
    """norm_topk_prob other than the router's: ConfigurationError naming the field (the routing would differ)."""
    model = _model("qwen3_moe", hal_rng, norm_topk_prob=True)
    model.config.norm_topk_prob = False
    with pytest.raises(ConfigurationError, match="'norm_topk_prob' is False, but the block's router has "
                                                 "norm_topk_prob=True"):
        quantize_model(model, bits=4, group_size=GROUP)
    assert not _blocks(model)


def test_quant_moe_refuses_bad_settings_naming_them(hal_rng: np.random.Generator) -> None:
    """QuantMoE's top_k outside [1, num_experts], an unknown routing or activation: ArgumentError naming each."""
    model = _model("mixtral", hal_rng)
    quantize_model(model, bits=4, group_size=GROUP)
    block = model.model.layers[0].mlp
    experts = block.expert_weights()
    for kwargs, name in (({"top_k": 9}, "top_k"), ({"top_k": 0}, "top_k"), ({"top_k": 2, "routing": "sigmoid"},
                          "routing"), ({"top_k": 2, "activation": "relu"}, "activation")):
        with pytest.raises(ArgumentError, match=f"argument '{name}'"):
            QuantMoE(block.gate, experts, **kwargs)
    with pytest.raises(ArgumentTypeError, match="argument 'experts'"):
        QuantMoE(block.gate, [experts], top_k=2)


def test_unsupported_hidden_act_is_refused_naming_it(hal_rng: np.random.Generator) -> None:
    """A hidden_act hal has no gated activation for: ConfigurationError naming 'hidden_act'."""
    model = _model("mixtral", hal_rng)
    model.config.hidden_act = "relu"
    with pytest.raises(ConfigurationError, match="'hidden_act': 'relu'"):
        quantize_model(model, bits=4, group_size=GROUP)
    assert not _blocks(model)


def test_from_block_refuses_a_block_type_it_does_not_run(hal_rng: np.random.Generator) -> None:
    """QuantMoE.from_block on another module: ArgumentTypeError naming 'block', its class and the types hal runs;
    bits other than 4 or 8: ArgumentError naming 'bits'."""
    model = _model("qwen3_moe", hal_rng)
    with pytest.raises(ArgumentError, match="argument 'bits': expected 4 or 8, got 3"):
        QuantMoE.from_block(model.model.layers[0].mlp, model.config, bits=3, group_size=GROUP)
    with pytest.raises(ArgumentTypeError, match=r"argument 'block' \('x'\): Qwen3MoeMLP is not a sparse MoE "
                                                r"block hal runs \(it runs Qwen3MoeSparseMoeBlock"):
        QuantMoE.from_block(transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeMLP(model.config),
                            model.config, name="x")


def test_group_size_that_does_not_divide_the_experts_is_refused_before_any_change(
        hal_rng: np.random.Generator) -> None:
    """group_size 64 does not divide intermediate 32: ArgumentError naming each block; no layer was replaced."""
    model = _model("mixtral", hal_rng)
    with pytest.raises(ArgumentError, match=r"MoE block 'model.layers.0.mlp' \(MixtralSparseMoeBlock, 8 experts, "
                                            r"int4\): argument 'group_size'"):
        quantize_model(model, bits=4, group_size=64)
    assert not _blocks(model)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_other_moe_blocks_and_skipped_ones_stay_float_and_are_reported(hal_rng: np.random.Generator) -> None:
    """A MoE block type hal does not run (Qwen2-MoE) and blocks matched by skip stay float, each with its reason."""
    torch.manual_seed(int(hal_rng.integers(2**31)))
    config = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTER,
                                         moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    other = transformers.AutoModelForCausalLM.from_config(config).eval()
    report = quantize_model(other, bits=4, group_size=GROUP)
    (name, why), = report.moe_skipped
    assert name == "model.layers.0.mlp" and "Qwen2MoeSparseMoeBlock is not a sparse MoE block hal runs" in why
    assert report.moe_blocks == () and other.model.layers[0].mlp.experts.gate_up_proj.dim() == 3
    model = _model("qwen3_moe", hal_rng)
    report = quantize_model(model, bits=4, group_size=GROUP, skip=("model.layers.1.mlp",))
    assert report.moe_blocks == ("model.layers.0.mlp",)
    assert report.moe_skipped == (("model.layers.1.mlp", "skipped by 'skip'"),)


def test_forward_refuses_hidden_states_of_the_wrong_size(hal_rng: np.random.Generator) -> None:
    """hidden_states whose last dimension is not hidden: ArgumentError naming 'hidden_states' and the block."""
    model = _model("mixtral", hal_rng)
    quantize_model(model, bits=4, group_size=GROUP)
    with pytest.raises(ArgumentError, match=r"argument 'hidden_states' of QuantMoE 'model.layers.0.mlp': expected "
                                            r"shape \[..., 64\], got \(2, 32\)"):
        model.model.layers[0].mlp(torch.zeros(2, 32))


def test_bf16_model_block_matches_float64_on_its_router_logits(hal_rng: np.random.Generator) -> None:
    """After .to(bfloat16) the experts keep their scales' dtype, and the block's bf16 output matches float64 on the
    router's own bf16 logits and the dequantized experts."""
    model = _model("qwen3_moe", hal_rng, True)
    quantize_model(model, bits=4, group_size=GROUP)
    block = model.model.layers[0].mlp
    scales = block.w13_scales.clone()
    model.to(torch.bfloat16)
    assert block.gate.weight.dtype == torch.bfloat16 and torch.equal(block.w13_scales, scales)
    x = torch.from_numpy(hal_rng.uniform(-1.0, 1.0, (2, 9, HIDDEN)).astype(np.float32)).to(torch.bfloat16)
    with torch.no_grad():
        got = block(x)
        logits = block.gate(x.reshape(-1, HIDDEN))[0]
    assert got.dtype == torch.bfloat16
    rows = host_view(x.reshape(-1, HIDDEN))
    expected = OPS["fused_moe"].reference({"hidden_states": rows, "router_logits": logits.double().numpy(),
                                           "experts": _host_experts(block), "top_k": TOP_K,
                                           "routing": "softmax_topk_renorm", "activation": "silu"})
    assert_close(got.reshape(-1, HIDDEN).double().numpy(), expected, kind="gemm", dtype="bf16", what="bf16 block")


@pytest.mark.parametrize("activations", [None, "int8"])
def test_compiled_block_runs_the_composition_with_the_same_output(hal_rng: np.random.Generator,
                                                                  activations: str | None) -> None:
    """Under torch.compile the block runs quantized_gemm per expert (fused_moe has no operator) with the block's
    explicit activations: the same output (W4A8: within one int8 code of the intermediate)."""
    model = _model("mixtral", hal_rng)
    quantize_model(model, bits=4, group_size=GROUP, activations=activations)
    block = model.model.layers[0].mlp
    x = torch.from_numpy(hal_rng.uniform(-1.0, 1.0, (1, 5, HIDDEN)).astype(np.float32))
    with torch.no_grad():
        fused = block(x)
        compiled = torch.compile(block, backend="eager")(x)
    assert_close(compiled.numpy(), fused.double().numpy(), kind="moe_w8a8" if activations else "gemm", dtype="fp32",
                 what=f"compiled block, activations={activations}")
    assert any("torch.compile" in reason for reason in block.fallbacks), block.fallbacks
