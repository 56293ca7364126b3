"""quantize_model's bits per layer: lm_head in int8 (W8A8) by default, layer_bits patterns, their errors."""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import torch

import hal_core
from hal_core.quant import quantize, quantize_activations
from hal_core.torch import DEFAULT_LAYER_BITS, QuantLinear, quantize_model

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")


def _llama(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.1)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_lm_head_is_w8a8_by_default_and_computes_what_the_format_says() -> None:
    """Default: decoder layers int4, lm_head int8; lm_head(h) equals sx * (xq @ dequantized W) in float64."""
    seed = 21
    print(f"seed={seed}")
    model = _llama(seed)
    weight = model.lm_head.weight.detach().clone()
    report = quantize_model(model, group_size=32)
    assert dict(DEFAULT_LAYER_BITS) == {"lm_head": 8}
    assert dict(zip(report.quantized, report.bits, strict=True)) == {
        n: 8 if n == "lm_head" else 4 for n, m in _llama(seed).named_modules() if type(m) is torch.nn.Linear}
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8 and report.skipped == ()
    assert model.lm_head.qweight.dtype == torch.uint8 and tuple(model.lm_head.qweight.shape) == (64, 96)

    h = torch.from_numpy(np.random.default_rng(seed).standard_normal((5, 64)).astype(np.float32))
    xq, sx = quantize_activations(h.numpy())
    w = quantize(weight.T, bits=8, group_size=32).dequantize()  # float64 [K, N]
    expected = sx.astype(np.float64)[:, None] * (xq.astype(np.float64) @ w)
    with torch.no_grad():
        got = model.lm_head(h).double().numpy()
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


def test_layer_bits_patterns_first_match_wins_and_none_gives_every_layer_bits() -> None:
    """{"*.mlp.*": 8, "*": 4} with bits=8: MLP int8, the rest int4; layer_bits=None: lm_head gets bits too."""
    model = _llama(22)
    report = quantize_model(model, bits=8, group_size=32, layer_bits={"*.mlp.*": 8, "*": 4})
    got = dict(zip(report.quantized, report.bits, strict=True))
    assert got and all(bits == (8 if ".mlp." in name else 4) for name, bits in got.items())
    assert model.lm_head.bits == 4
    model = _llama(22)
    report = quantize_model(model, bits=4, group_size=32, layer_bits=None)
    assert set(report.bits) == {4} and model.lm_head.bits == 4
    model = _llama(22)
    report = quantize_model(model, group_size=32, skip=["lm_head"])  # skip wins over layer_bits
    assert report.skipped == ("lm_head",) and type(model.lm_head) is torch.nn.Linear and set(report.bits) == {4}


def test_bad_layer_bits_are_refused_naming_the_argument_before_any_change() -> None:
    """Bits other than 4/8, non-string patterns and a non-mapping are refused; the model stays float."""
    model = _llama(23)
    with pytest.raises(hal_core.ArgumentError, match=r"argument 'layer_bits': expected 4 or 8 for 'lm_head', got 3"):
        quantize_model(model, layer_bits={"lm_head": 3})
    with pytest.raises(TypeError, match="'layer_bits'"):
        quantize_model(model, layer_bits={1: 8})
    with pytest.raises(TypeError, match="'layer_bits'"):
        quantize_model(model, layer_bits=["lm_head"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'layer_bits'"):
        quantize_model(model, layer_bits={"lm_head": True})
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
