"""quantize_model: every nn.Linear of a model becomes a QuantLinear, in place; the float weights go when it returns.

Validation before any change: tests/test_quantize_model_checks.py; shared and tied layers:
tests/test_quantize_model_sharing.py; lm_head's bits: tests/test_quantize_model_lm_head.py; the mapped
checkpoint's pages: tests/test_quantize_model_memory.py.
"""

from __future__ import annotations

import gc
import io
import weakref

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

from hal_core.quant import quantize  # noqa: E402
from hal_core.torch import QuantLinear, quantize_model  # noqa: E402


def _llama(seed: int, layers: int = 2) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.1)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}


@pytest.mark.parametrize(("bits", "symmetric"), [(4, True), (4, False), (8, True)])
def test_quantized_model_matches_the_float64_model_of_hals_quantization(bits: int, symmetric: bool) -> None:
    """Logits against a float64 copy whose weights are quantize(W.T) dequantized; lm_head stays float."""
    seed = 60 + bits + symmetric
    print(f"seed={seed}")
    model = _llama(seed)
    reference = _llama(seed).double()
    names = [n for n in _linears(model) if n != "lm_head"]
    for name in names:
        linear = reference.get_submodule(name)
        qw = quantize(linear.weight.detach().T.float(), bits=bits, group_size=32, symmetric=symmetric)
        linear.weight.data = torch.from_numpy(qw.dequantize().T.copy())
    report = quantize_model(model, bits=bits, group_size=32, symmetric=symmetric, skip="lm_head", activations="float")
    assert report.quantized == tuple(names) and report.skipped == ("lm_head",)
    assert report.bits == (bits,) * len(names) and report.aliases == report.tied == ()
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in names)
    assert type(model.lm_head) is torch.nn.Linear
    assert not _linears(model).keys() - {"lm_head"}
    expected_bytes = sum(model.get_submodule(n).qweight.nbytes + model.get_submodule(n).scales.nbytes
                         + (0 if symmetric else model.get_submodule(n).zeros.nbytes) for n in names)
    assert report.quantized_bytes == expected_bytes
    assert report.float_bytes == 4 * sum(reference.get_submodule(n).weight.numel() for n in names)

    ids = torch.tensor(np.random.default_rng(seed).integers(0, 128, (2, 9)))
    with torch.no_grad():
        got = model(ids).logits.double()
        if bits == 8:  # W8A8 quantizes activations: compare with the float model only loosely
            expected = reference(ids).logits
            assert (got - expected).abs().max() <= 0.05 * expected.abs().max()
        else:
            expected = reference(ids).logits
            assert (got - expected).abs().max() <= 2e-4 * expected.abs().max()


def test_no_layer_is_replaced_before_all_are_quantized_and_the_float_weights_go_on_return() -> None:
    """While layers are being quantized the model is untouched; once it returns every float weight is freed."""
    model = _llama(1, layers=3)
    refs = {n: weakref.ref(m.weight) for n, m in _linears(model).items()}
    steps: list[str] = []

    def progress(done: int, total: int, name: str) -> None:
        assert total == len(refs) and done == len(steps) + 1
        assert all(type(m) is torch.nn.Linear for m in _linears(model).values()) and len(_linears(model)) == total
        steps.append(name)

    report = quantize_model(model, group_size=32, progress=progress)
    assert steps == list(refs) == list(report.quantized)
    assert [n for n, r in refs.items() if r() is not None] == []  # freed by reference counting, no gc needed
    gc.collect()
    assert not _linears(model)


def test_skip_patterns_predicates_and_none() -> None:
    """skip= takes fnmatch patterns on the name or its tail, a predicate, or None; anything else is a TypeError."""
    model = _llama(2)
    report = quantize_model(model, group_size=32, skip=["*.mlp.*", "lm_head"])
    assert all("mlp" not in n for n in report.quantized) and len(report.quantized) == 8
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in report.skipped)
    model = _llama(2)
    report = quantize_model(model, group_size=32, skip=lambda name, linear: linear.out_features == 32)
    assert {n.rsplit(".", 1)[-1] for n in report.skipped} == {"k_proj", "v_proj"}
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
    model = _llama(2)
    assert "lm_head" in quantize_model(model, group_size=32, skip=None).quantized
    with pytest.raises(TypeError, match="'skip'"):
        quantize_model(_llama(2), skip=[3])


def test_a_layer_that_cannot_be_quantized_is_named_before_anything_changes() -> None:
    """A group size that does not divide a layer's in_features is refused naming the layer; nothing changes."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 12), torch.nn.Linear(12, 64))
    with pytest.raises(ValueError, match=r"skip=.*layer '2' \(12 -> 64, int4\).*group_size"):
        quantize_model(model, group_size=32)
    assert all(type(m) is torch.nn.Linear for m in model)
    with pytest.raises(ValueError, match="'bits'"):
        quantize_model(model, bits=3)
    report = quantize_model(model, group_size=32, skip=["2"])
    assert report.quantized == ("0", "1") and report.skipped == ("2",)


def test_shared_layers_subclasses_and_progress_bar(capsys: pytest.CaptureFixture) -> None:
    """A layer at two places is quantized once; Linear subclasses (MultiheadAttention's out_proj) stay float."""
    shared = torch.nn.Linear(32, 32)
    model = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Sequential(shared),
                                 "attn": torch.nn.MultiheadAttention(32, 2)})
    report = quantize_model(model, group_size=32, progress=True)
    assert report.quantized == ("a",) and report.skipped == ("attn.out_proj",) and report.aliases == (("b.0", "a"),)
    assert model["a"] is model["b"][0] and isinstance(model["a"], QuantLinear)
    assert "[########################] 1/1" in capsys.readouterr().err
    with pytest.raises(TypeError, match="'progress'"):
        quantize_model(torch.nn.Linear(32, 32), progress="yes")
    with pytest.raises(TypeError, match="'model'"):
        quantize_model(io.BytesIO())


def test_quantized_layers_are_named_in_their_input_errors() -> None:
    """Each QuantLinear quantize_model builds knows its qualified name, and a wrong input shape names it."""
    from hal_core import ArgumentError

    model = _llama(5, layers=1)
    quantize_model(model, bits=4, group_size=32)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            assert module.name == name
    proj = model.get_submodule("model.layers.0.mlp.down_proj")
    with pytest.raises(ArgumentError, match=r"model\.layers\.0\.mlp\.down_proj"):
        proj(torch.zeros(3, proj.in_features + 1))
