"""quantize_model on layers used at several places and weights tied to other parameters."""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import torch

from hal_core.quant import quantize
from hal_core.torch import QuantLinear, quantize_model

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")


def _dequantized64(linear: torch.nn.Linear, bits: int, group_size: int) -> torch.nn.Linear:
    """A float64 copy of ``linear`` whose weight is hal's quantization of it, dequantized (the reference)."""
    qw = quantize(linear.weight.detach().T, bits=bits, group_size=group_size)
    copy = torch.nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                           dtype=torch.float64)
    copy.weight.data = torch.from_numpy(qw.dequantize().T.copy())
    if linear.bias is not None:
        copy.bias.data = linear.bias.detach().double()
    return copy


def test_a_layer_used_twice_in_one_sequential_is_quantized_once_and_replaced_at_both_places() -> None:
    """Sequential(a, ReLU, a): both uses become one QuantLinear, reported once with its alias; output as float64."""
    torch.manual_seed(5)
    a = torch.nn.Linear(64, 64)
    model = torch.nn.Sequential(a, torch.nn.ReLU(), a)
    reference = _dequantized64(a, 4, 32)
    report = quantize_model(model, group_size=32, activations="float")
    assert isinstance(model[0], QuantLinear) and model[0] is model[2]
    assert report.quantized == ("0",) and report.aliases == (("2", "0"),) and report.bits == (4,)
    assert report.float_bytes == 4 * (64 * 64 + 64)
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = reference(torch.relu(reference(x.double())))
        got = model(x).double()
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_one_layer_under_two_parents_and_a_shared_block_are_replaced_everywhere() -> None:
    """A Linear held by two parents, and a block listed twice: every path sees the same QuantLinear."""
    torch.manual_seed(6)
    lin = torch.nn.Linear(32, 32)
    block = torch.nn.Sequential(torch.nn.Linear(32, 32))
    model = torch.nn.ModuleDict({"x": torch.nn.Sequential(lin), "y": torch.nn.ModuleDict({"z": lin}),
                                 "blocks": torch.nn.ModuleList([block, block])})
    report = quantize_model(model, group_size=32)
    assert report.quantized == ("x.0", "blocks.0.0")
    assert report.aliases == (("y.z", "x.0"), ("blocks.1.0", "blocks.0.0"))
    assert model["x"][0] is model["y"]["z"] and isinstance(model["y"]["z"], QuantLinear)
    assert model["blocks"][0][0] is model["blocks"][1][0] and isinstance(block[0], QuantLinear)
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_skip_matching_any_name_of_a_shared_layer_leaves_every_place_float() -> None:
    """A shared layer is skipped when any of its names matches: no place of it is quantized."""
    lin = torch.nn.Linear(32, 32)
    model = torch.nn.ModuleDict({"a": lin, "b": torch.nn.Sequential(lin, torch.nn.Linear(32, 32))})
    report = quantize_model(model, group_size=32, skip=["b.0"])
    assert report.skipped == ("a",) and report.quantized == ("b.1",) and report.aliases == ()
    assert model["a"] is lin and model["b"][0] is lin


def _tied_llama(seed: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.1, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_a_tied_lm_head_is_quantized_and_the_embedding_keeps_its_float_weight() -> None:
    """lm_head tied to the embedding: lm_head becomes int4, the embedding keeps the very same float parameter."""
    seed = 7
    print(f"seed={seed}")
    model = _tied_llama(seed)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding
    saved = embedding.detach().clone()
    reference = _tied_llama(seed).double()
    for name, module in list(reference.named_modules()):
        if type(module) is torch.nn.Linear:
            reference.set_submodule(name, _dequantized64(model.get_submodule(name), 4, 32))
    assert reference.model.embed_tokens.weight.dtype == torch.float64  # the float embedding, untouched

    report = quantize_model(model, group_size=32, layer_bits={"lm_head": 4}, activations="float")
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 4
    assert report.tied == (("lm_head", "model.embed_tokens.weight"),)
    assert model.model.embed_tokens.weight is embedding and torch.equal(embedding, saved)
    ids = torch.tensor(np.random.default_rng(seed).integers(0, 128, (2, 7)))
    with torch.no_grad():
        got, expected = model(ids).logits.double(), reference(ids).logits
    assert (got - expected).abs().max() <= 2e-4 * expected.abs().max()


def test_two_linears_sharing_one_weight_are_each_quantized_and_reported_tied() -> None:
    """Two Linear modules over one weight parameter (different biases): each is quantized, each names the other."""
    first, second = torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)
    second.weight = first.weight
    model = torch.nn.ModuleDict({"first": first, "second": second})
    report = quantize_model(model, group_size=32)
    assert report.tied == (("first", "second.weight"), ("second", "first.weight"))
    assert torch.equal(model["first"].qweight, model["second"].qweight)
    assert not torch.equal(model["first"].bias, model["second"].bias)
