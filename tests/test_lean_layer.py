"""kernelize's lean decoder layers: a kernelized layer's eager CPU step as its hal calls gives the module-by-module
layer's outputs bit for bit (Llama, Mistral with a window, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms;
hal's paged attention and transformers' eager one; fp32 and bf16), and every call the lean path cannot serve runs
the layer's original code."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import transformers
from torch_helpers import torch
from transformers_helpers import VOCAB, llama, prompts

import hal_core.torch.transformers as hal_hf
from hal_core import ArgumentError
from hal_core.torch import kernelize, quantize_model
from hal_core.torch._lean_layer import LeanLayer

ARCHS = {
    "llama": lambda seed: llama(seed),
    "mistral-window": lambda seed: _model(transformers.MistralConfig, transformers.MistralForCausalLM, seed,
                                          sliding_window=4),
    "qwen2-bias": lambda seed: _model(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, seed),
    "qwen3-head-norms": lambda seed: _model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, seed),
}


def _model(config_cls, model_cls, seed: int, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        initializer_range=0.2, attn_implementation="eager", **overrides)
    return model_cls(config).eval()


def _seed() -> int:
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    return seed


def _pair(arch: str, seed: int, dtype: torch.dtype = torch.float32, attn: str = "eager"):
    """The same quantized, kernelized model twice: with its lean layers, and with them removed (module by
    module)."""
    model = ARCHS[arch](seed)
    quantize_model(model, bits=4, group_size=32, layer_bits=None, activations="float")
    model.to(dtype)
    model.set_attn_implementation(attn)
    lean = copy.deepcopy(model)
    report = kernelize(lean)
    assert report.layers == [f"model.layers.{i}" for i in range(2)], report
    modules = copy.deepcopy(model)
    kernelize(modules)
    for layer in modules.model.layers:
        assert isinstance(vars(layer).pop("forward"), LeanLayer)
    return lean, modules


def _cache(model: torch.nn.Module, attn: str) -> object:
    """A HalPagedCache of the model's dtype for hal's attention; None (transformers' own cache) for eager."""
    if attn != "hal":
        return None
    return hal_hf.HalPagedCache(model.config, num_blocks=32, block_size=4, dtype=model.dtype)


def _lean_calls(model: torch.nn.Module) -> int:
    return sum(layer.forward.calls for layer in model.model.layers)


def _steps(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: object, steps: int = 4):
    """A prompt forward, then greedy decode steps: every step's logits."""
    out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    logits = [out.logits]
    for _ in range(steps):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(token, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("attn", ["hal", "eager"])
def test_lean_layers_give_the_module_by_module_outputs(cpu, arch: str, dtype: torch.dtype, attn: str) -> None:
    """Prompts of different lengths (left-padded) then decode steps: every step's logits equal bit for bit, and
    every layer call took the lean path."""
    seed = _seed()
    lean, modules = _pair(arch, seed, dtype, attn)
    ids, mask = prompts(seed)
    with torch.no_grad():
        got = _steps(lean, ids, mask, _cache(lean, attn))
        want = _steps(modules, ids, mask, _cache(modules, attn))
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), (step, float((a.float() - b.float()).abs().max()))
    assert _lean_calls(lean) == 2 * len(got)
    numpy_lane = sum(layer.forward.host_calls for layer in lean.model.layers)  # every call ran as numpy calls
    assert numpy_lane == 2 * len(got)
    rows = sum(layer.forward.row_attention_calls for layer in lean.model.layers)  # hal's cache, given numpy rows
    assert rows == (numpy_lane if attn == "hal" else 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2-bias", "qwen3-head-norms"])
def test_inference_mode_gives_the_module_by_module_outputs(cpu, arch: str) -> None:
    """Under torch.inference_mode (tensors without a version counter: the rotary table and the biases' casts are
    held by identity) the lean layers give the module-by-module logits, through the numpy lane and hal's cache."""
    seed = _seed()
    lean, modules = _pair(arch, seed, torch.bfloat16, "hal")
    ids, mask = prompts(seed)
    with torch.inference_mode():
        got = _steps(lean, ids, mask, _cache(lean, "hal"))
        want = _steps(modules, ids, mask, _cache(modules, "hal"))
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), (step, float((a.float() - b.float()).abs().max()))
    rows = sum(layer.forward.row_attention_calls for layer in lean.model.layers)
    assert _lean_calls(lean) == rows == 2 * len(got)


def test_hooks_grad_training_and_hidden_states_take_the_original_path(cpu) -> None:
    """A forward hook on any module the lean path would skip, autograd, training mode: the layer's original code
    runs (the hook is called, the results equal); output_hidden_states and output_attentions (recorded by
    transformers' hooks) see the same states and weights."""
    seed = _seed()
    lean, modules = _pair("llama", seed)
    ids, mask = prompts(seed)
    with torch.no_grad():
        want = modules(ids, attention_mask=mask, output_hidden_states=True)
        got = lean(ids, attention_mask=mask, output_hidden_states=True)  # transformers records through hooks
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states, strict=True))
        assert torch.equal(lean(ids, attention_mask=mask).logits, want.logits)
        assert _lean_calls(lean) == 2
        got_attn = lean(ids, attention_mask=mask, output_attentions=True).attentions  # eager attention records them
        want_attn = modules(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(got_attn) == 2 and all(torch.equal(a, b) for a, b in zip(got_attn, want_attn, strict=True))
    assert _lean_calls(lean) == 2
    seen: list[torch.Tensor] = []
    handle = lean.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        hooked = lean(ids, attention_mask=mask).logits
    handle.remove()
    assert len(seen) == 1 and _lean_calls(lean) == 3  # layer 0 lean, layer 1 its original code
    assert torch.equal(hooked, want.logits)
    grad = lean(ids, attention_mask=mask).logits  # gradients recorded (the norms' weights require them)
    assert grad.requires_grad and _lean_calls(lean) == 3
    torch.testing.assert_close(grad.detach(), want.logits, rtol=0, atol=1e-3 * float(want.logits.abs().max()))
    lean.train()
    with torch.no_grad():
        lean(ids, attention_mask=mask)
    assert _lean_calls(lean) == 3
    lean.eval()


def test_a_dissolved_group_or_replaced_forward_runs_the_original(cpu) -> None:
    """A replaced projection buffer dissolves its fused group; a replaced MLP forward is the user's: the layer
    runs module by module from then on, with the new weight's results."""
    seed = _seed()
    lean, modules = _pair("llama", seed)
    ids, mask = prompts(seed)
    for model in (lean, modules):
        v = model.model.layers[0].self_attn.v_proj
        v.load_state_dict({k: t.clone() * (2 if k == "scales" else 1) for k, t in v.state_dict().items()},
                          assign=True)
    with torch.no_grad():
        got, want = lean(ids, attention_mask=mask).logits, modules(ids, attention_mask=mask).logits
    assert torch.equal(got, want) and _lean_calls(lean) == 1  # layer 1 only
    mlp = lean.model.layers[1].mlp
    mlp.forward = lambda x: torch.zeros_like(x)
    with torch.no_grad():
        lean(ids, attention_mask=mask)
    assert _lean_calls(lean) == 1


def test_a_restored_rotary_function_runs_the_original(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' own apply_rotary_pos_emb put back in the modeling module: the layers run their original code
    (which calls it), so the model computes what that function does."""
    from transformers.models.llama import modeling_llama

    seed = _seed()
    lean, _ = _pair("llama", seed)
    current = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", current.__hal_original__)
    ids, mask = prompts(seed)
    with torch.no_grad():
        lean(ids, attention_mask=mask)
    assert _lean_calls(lean) == 0


def test_what_has_no_lean_layer(cpu) -> None:
    """Unfused (fuse=False or float projections) models keep every layer module by module; kernelize twice
    installs nothing again."""
    seed = _seed()
    model = llama(seed)
    assert kernelize(model).layers == []  # float projections: nothing fused
    quantized = llama(seed)
    quantize_model(quantized, bits=4, group_size=32, layer_bits=None)
    assert kernelize(quantized, fuse=False).layers == []
    assert kernelize(quantized).layers == ["model.layers.0", "model.layers.1"]
    assert kernelize(quantized).layers == []


def test_the_numpy_lane_refuses_and_steps_aside_as_the_module_path(cpu) -> None:
    """A HalPagedCache of another dtype: the numpy lane (hal's attention given numpy rows) raises the module path's
    ArgumentError. A bias on o_proj and down_proj is added as their forward adds it; a norm weight of another dtype
    (which kernelize's norm hands to transformers' code) keeps that layer's calls on torch tensors: the same logits."""
    seed = _seed()
    lean, modules = _pair("llama", seed, torch.bfloat16, attn="hal")
    ids, mask = prompts(seed)
    errors = []
    for model in (lean, modules):
        cache = hal_hf.HalPagedCache(model.config, num_blocks=32, block_size=4, dtype=torch.float32)
        with torch.no_grad(), pytest.raises(ArgumentError) as info:
            model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "build the cache from this model's config, dtype and device" in errors[0]
    first, second = (layer.forward for layer in lean.model.layers)
    assert (first.host_calls, second.host_calls) == (1, 0)  # the refusal came at layer 0's attention
    generator = torch.Generator().manual_seed(seed)
    biases = {name: torch.randn(64, generator=generator) * 0.1 for name in ("o_proj", "down_proj")}
    for model in (lean, modules):
        layers = model.model.layers
        layers[0].self_attn.o_proj.bias = torch.nn.Parameter(biases["o_proj"].clone(), requires_grad=False)
        layers[0].mlp.down_proj.bias = torch.nn.Parameter(biases["down_proj"].clone(), requires_grad=False)
        norm = layers[1].post_attention_layernorm
        norm.weight = torch.nn.Parameter(norm.weight.detach().float(), requires_grad=False)
    with torch.no_grad():
        got = _steps(lean, ids, mask, _cache(lean, "hal"), steps=2)
        want = _steps(modules, ids, mask, _cache(modules, "hal"), steps=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert (first.calls, first.host_calls, first.row_attention_calls) == (4, 4, 4)  # the refused call counted
    assert (second.calls, second.host_calls) == (3, 0)
