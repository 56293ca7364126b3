"""MoE models in GPTQ checkpoints: save_quantized writes QuantMoE experts as MoE checkpoints store them (one layer per
expert and projection), and load_quantized reads such checkpoints back into QuantMoE blocks.

Tiny random Qwen3-MoE and Mixtral models (fp32, 2 layers, 8 experts top-2, hidden 64), as in test_torch_moe.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors comes with transformers")

from test_torch_moe import EXPERTS, GROUP, HIDDEN, INTER, MODELS, _blocks, _dequantized_copy, _model  # noqa: E402

from hal_core import CheckpointError  # noqa: E402
from hal_core.quant import QuantizedWeight, quantize, to_gptq  # noqa: E402
from hal_core.quant._weight import pack_int4  # noqa: E402
from hal_core.testing.inputs import assert_close  # noqa: E402
from hal_core.torch import QuantMoE, load_quantized, quantize_model, save_quantized  # noqa: E402

#: model_type -> (the block's stored name, its projections' names: gate, up, down)
STORED = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def _keys(folder: Path) -> set[str]:
    return set(safetensors_torch.load_file(str(folder / "model.safetensors")))


@pytest.mark.parametrize(("kind", "norm"), MODELS)
def test_saved_moe_model_loads_back_bit_for_bit(hal_rng: np.random.Generator, kind: str, norm: bool,
                                                tmp_path: Path) -> None:
    """quantize_model -> save_quantized -> load_quantized: the same buffers and the same logits, QuantMoE blocks
    with the same routing; the file names each expert's projections as the architecture's MoE checkpoints do."""
    model = _model(kind, hal_rng, norm)
    quantize_model(model, bits=4, group_size=GROUP)
    save_quantized(model, tmp_path / "ck")
    block, projections = STORED[kind]
    keys = _keys(tmp_path / "ck")
    for layer in range(2):
        prefix = f"model.layers.{layer}.{block}"
        expected = {f"{prefix}.experts.{e}.{p}.{part}" for e in range(EXPERTS) for p in projections
                    for part in ("qweight", "qzeros", "scales", "g_idx")} | {f"{prefix}.gate.weight"}
        assert {k for k in keys if k.startswith(prefix + ".")} == expected
    assert not any("gate_up_proj" in k or "w13" in k for k in keys)
    loaded = load_quantized(tmp_path / "ck", attn_implementation="eager")
    assert [type(layer.mlp) for layer in loaded.model.layers] == [QuantMoE, QuantMoE]
    assert [(b.routing, b.top_k, b.activation, b.bits, b.group_size) for b in _blocks(loaded)] == [
        (b.routing, b.top_k, b.activation, b.bits, b.group_size) for b in _blocks(model)]
    saved, back = model.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys()
    assert all(torch.equal(saved[k], back[k]) and saved[k].dtype == back[k].dtype for k in saved)
    ids = torch.from_numpy(hal_rng.integers(0, 128, (2, 7)))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def _act_order(weight: np.ndarray, order: np.ndarray) -> QuantizedWeight:
    """``weight [K, N]`` in symmetric int4, row ``order[i]`` in group ``i // GROUP`` (GPTQ act-order: g_idx [K])."""
    grouped = quantize(weight[order], bits=4, group_size=GROUP, symmetric=True, scale_dtype=np.float16)
    codes = np.empty_like(grouped.codes())
    codes[order] = grouped.codes()
    g_idx = np.empty(weight.shape[0], dtype=np.int32)
    g_idx[order] = np.arange(weight.shape[0]) // GROUP
    return QuantizedWeight(qweight=pack_int4(codes), scales=grouped.scales, zeros=None, bits=4, group_size=GROUP,
                           shape=weight.shape, g_idx=g_idx)


def _independent_checkpoint(kind: str, float_model: Any, folder: Path, rng: np.random.Generator) -> None:
    """A GPTQ MoE checkpoint written without save_quantized: each expert's gate, up and down projections quantized
    on their own (symmetric int4; gate and up in act-order, one random row order per expert), the other tensors
    float under the stored names."""
    block, projections = STORED[kind]
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in float_model.state_dict().items():
        if ".experts." in name:
            continue
        tensors[name.replace(".mlp.", f".{block}.")] = tensor.contiguous()
    for n, layer in enumerate(float_model.model.layers):
        gate_up, down = layer.mlp.experts.gate_up_proj.detach(), layer.mlp.experts.down_proj.detach()
        for e in range(EXPERTS):
            weights = (gate_up[e, :INTER].T, gate_up[e, INTER:].T, down[e].T)  # [K, N] each
            order = rng.permutation(HIDDEN)
            for projection, weight in zip(projections, weights, strict=True):
                w = weight.double().numpy()
                q = quantize(w, bits=4, group_size=GROUP, symmetric=True, scale_dtype=np.float16) \
                    if projection == projections[2] else _act_order(w, order)
                for part, array in to_gptq(q).items():
                    tensors[f"model.layers.{n}.{block}.experts.{e}.{projection}.{part}"] = torch.from_numpy(
                        np.ascontiguousarray(array))
    folder.mkdir()
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"))
    document = float_model.config.to_dict()
    document["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
                                       "sym": True, "checkpoint_format": "gptq"}
    (folder / "config.json").write_text(json.dumps(document))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_an_independently_written_moe_checkpoint_matches_eager_on_its_dequantized_experts(
        hal_rng: np.random.Generator, kind: str, tmp_path: Path) -> None:
    """A checkpoint written expert by expert (gate and up in act-order) loads as QuantMoE blocks whose greedy
    tokens and logits equal eager fp32 transformers holding the dequantized experts."""
    float_model = _model(kind, hal_rng)
    _independent_checkpoint(kind, float_model, tmp_path / "ck", hal_rng)
    loaded = load_quantized(tmp_path / "ck", activations="float")
    blocks = _blocks(loaded)
    assert len(blocks) == 2 and all(hasattr(b, "w13_g_idx") and not hasattr(b, "w2_g_idx") for b in blocks)
    reference = _dequantized_copy(copy.deepcopy(float_model), loaded)
    ids = torch.from_numpy(hal_rng.integers(0, 128, (2, 5)))
    with torch.no_grad():
        got = loaded.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        expected = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        logits, expected_logits = loaded(got).logits, reference(got).logits
    assert torch.equal(got, expected), (got, expected)
    assert_close(logits.numpy(), expected_logits.double().numpy(), kind="gemm", dtype="fp32", what="logits")


def _edited(folder: Path, edit: Any) -> Path:
    tensors = safetensors_torch.load_file(str(folder / "model.safetensors"))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(("edit", "match"), [
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.scales"),
     r"layer 'model\.layers\.1\.mlp\.experts\.3\.up_proj': the checkpoint has .*qweight but no .*\.scales"),
    (lambda t: t.pop("model.layers.0.mlp.experts.7.down_proj.qweight"),
     r"layer 'model\.layers\.0\.mlp\.experts\.7\.down_proj': the checkpoint has no .*qweight"),
    (lambda t: t.update({"model.layers.0.mlp.experts.2.gate_proj.qweight": torch.zeros(8, 16, dtype=torch.int32)}),
     r"layer 'model\.layers\.0\.mlp\.experts\.2\.gate_proj': 'model\.layers\.0\.mlp\.experts\.2\.gate_proj\.qweight' "
     r"in .* has shape \(8, 16\), expected \(8, 32\)"),
    (lambda t: t.update({"model.layers.0.mlp.experts.1.up_proj.g_idx":
                         t["model.layers.0.mlp.experts.1.up_proj.g_idx"].flip(0).contiguous()}),
     r"MoE block 'model\.layers\.0\.mlp', expert 1: the gate and up projections order their rows differently"),
])
def test_a_broken_moe_checkpoint_is_refused_naming_the_expert_layer(hal_rng: np.random.Generator, tmp_path: Path,
                                                                    edit: Any, match: str) -> None:
    """A missing, misshapen or inconsistent expert tensor: CheckpointError naming the expert's layer or block."""
    model = _model("qwen3_moe", hal_rng)
    quantize_model(model, bits=4, group_size=GROUP)
    folder = _edited(save_quantized(model, tmp_path / "ck"), edit)
    with pytest.raises(CheckpointError, match=match):
        load_quantized(folder)


def test_a_moe_model_of_an_unknown_layout_is_refused_before_writing(hal_rng: np.random.Generator,
                                                                    tmp_path: Path) -> None:
    """save_quantized on a QuantMoE in a model type without a known MoE checkpoint layout: CheckpointError naming
    the block, and no file written."""
    model = _model("qwen3_moe", hal_rng)
    quantize_model(model, bits=4, group_size=GROUP)
    model.config.model_type = "olmoe"
    with pytest.raises(CheckpointError, match=r"MoE block 'model\.layers\.0\.mlp': hal knows how qwen3_moe, mixtral "
                                              r"checkpoints store their experts, not 'olmoe' ones"):
        save_quantized(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_int8_experts_round_trip(hal_rng: np.random.Generator, tmp_path: Path) -> None:
    """int8 experts (W8A8) save and load back bit for bit."""
    model = _model("mixtral", hal_rng)
    quantize_model(model, bits=8, group_size=GROUP)
    loaded = load_quantized(save_quantized(model, tmp_path / "ck"))
    assert [b.bits for b in _blocks(loaded)] == [8, 8]
    saved, back = model.state_dict(), loaded.state_dict()
    assert all(torch.equal(saved[k], back[k]) for k in saved)
    assert HIDDEN % 4 == 0 and INTER % 4 == 0  # int8 GPTQ packs four rows a word
