"""save_quantized and to_gptq: a quantized model written as a GPTQ checkpoint and read back bit for bit.

The GPTQ tensors are checked against the independent packers of
tests/quant_checkpoints.py and against codes unpacked here with plain shifts;
whole models go through quantize_model -> save_quantized -> load_quantized
and must give back the same buffers, logits and greedy tokens. What GPTQ
cannot hold is refused before anything is written.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
safetensors = pytest.importorskip("safetensors", reason="safetensors is not installed (make test installs it)")

from quant_checkpoints import gptq_tensors, llama_config, random_layer, write_checkpoint  # noqa: E402
from test_torch_checkpoints import NoFloatCopies  # noqa: E402

from hal_core import CheckpointError  # noqa: E402
from hal_core.quant import QuantizedWeight, from_gptq, quantize, to_gptq  # noqa: E402
from hal_core.torch import QuantLinear, load_quantized, quantize_model, save_quantized  # noqa: E402

FORMATS = {1: "gptq", 2: "gptq_v2"}


def _llama(seed: int, *, hidden: int = 64, intermediate: int = 128, layers: int = 2, bias: bool = False,
           tie: bool = False) -> torch.nn.Module:
    """A random float32 Llama (seeded)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=160, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, attention_bias=bias, tie_word_embeddings=tie)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         attn_implementation="eager").eval()


def _quant_layers(model: torch.nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# -- to_gptq ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("version", [1, 2])
def test_to_gptq_gives_back_the_tensors_from_gptq_read(bits: int, sym: bool, act_order: bool, version: int) -> None:
    """to_gptq(from_gptq(t)) equals t exactly, t packed by the independent packers (v1 and v2, act-order or not)."""
    seed = 11 + 8 * bits + 4 * sym + 2 * act_order + version
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    top = (1 << bits) - 1
    zero_range = (1, min(top + 1, 255)) if version == 1 else (0, top)  # hal's uint8 zeros hold at most 255
    layer = random_layer(rng, 64, 32, bits=bits, group_size=16, sym=sym, act_order=act_order, zero_range=zero_range)
    stored = gptq_tensors(layer, bits=bits, version=version)
    weight = from_gptq(stored["qweight"], stored["qzeros"], stored["scales"], stored["g_idx"], bits=bits,
                       checkpoint_format=FORMATS[version])
    out = to_gptq(weight, checkpoint_format=FORMATS[version])
    assert sorted(out) == sorted(stored)
    for part, expected in stored.items():
        assert out[part].dtype == expected.dtype and np.array_equal(out[part], expected), part
    if bits == 4:  # hal's int4 words are GPTQ's: a view, not a copy
        assert np.shares_memory(out["qweight"], weight.qweight)


def test_to_gptq_refuses_what_gptq_cannot_hold() -> None:
    """Zero points outside the format's range, K or N off the word size, inexact scales, uneven groups."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 16))
    asym = quantize(w, bits=4, group_size=16, symmetric=False)
    zeros = asym.zeros.copy()
    zeros[2, 3] = 0
    with pytest.raises(ValueError, match=r"zero point 0 \(group 2, column 3\).*'gptq_v2'"):
        to_gptq(QuantizedWeight(asym.qweight, asym.scales, zeros, 4, 16, (64, 16)))
    zeros[2, 3] = 16  # what a v1 checkpoint's nibble 15 reads back as: v1 holds it, v2 does not
    weight = QuantizedWeight(asym.qweight, asym.scales, zeros, 4, 16, (64, 16))
    assert int(to_gptq(weight)["qzeros"].view(np.uint32)[2, 0] >> 12 & 0xF) == 15
    with pytest.raises(ValueError, match=r"zero point 16 .*'gptq' \(v1\)"):
        to_gptq(weight, checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match="multiples of 4"):
        to_gptq(quantize(rng.standard_normal((6, 8)), bits=8, group_size=6))
    with pytest.raises(ValueError, match="multiples of 8"):
        to_gptq(quantize(rng.standard_normal((64, 12)), bits=4, group_size=16))
    with pytest.raises(ValueError, match=r"float32 scale .* not exact in float16"):
        to_gptq(quantize(w, bits=4, group_size=16, scale_dtype=np.float32))
    sym = quantize(w, bits=4, group_size=16)
    exact = QuantizedWeight(sym.qweight, sym.scales.astype(np.float32), None, 4, 16, (64, 16))
    assert to_gptq(exact)["scales"].dtype == np.float16 and np.array_equal(to_gptq(exact)["scales"], sym.scales)
    uneven = np.arange(64, dtype=np.int32) // 16
    uneven[0] = 1
    with pytest.raises(ValueError, match="puts 15 rows in group 0"):
        to_gptq(QuantizedWeight(sym.qweight, sym.scales, None, 4, 16, (64, 16), g_idx=uneven))
    with pytest.raises(ValueError, match="checkpoint_format"):
        to_gptq(sym, checkpoint_format="marlin")
    with pytest.raises(TypeError, match="QuantizedWeight"):
        to_gptq(w)


# -- whole models -------------------------------------------------------------------------------------

MODELS = {  # name: (bits, symmetric, group_size, checkpoint_format, attention bias, tied embeddings)
    "int4-sym-g32": (4, True, 32, "gptq", False, False),
    "int4-zp-v1-bias": (4, False, 32, "gptq", True, False),
    "int4-zp-v2-g64-tied": (4, False, 64, "gptq_v2", False, True),
    "int4-one-group": (4, True, -1, "gptq", False, False),
    "int8-sym": (8, True, 32, "gptq", True, False),
    "int8-zp-v2": (8, False, 32, "gptq_v2", False, False),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_saved_model_loads_back_bit_for_bit(case: str, tmp_path) -> None:
    """quantize_model -> save_quantized -> load_quantized: equal buffers, identical fp32 logits and greedy tokens."""
    bits, symmetric, group_size, fmt, bias, tie = MODELS[case]
    seed = 70 + list(MODELS).index(case)
    print(f"seed={seed}")
    model = _llama(seed, bias=bias, tie=tie)
    quantize_model(model, bits=bits, group_size=group_size, symmetric=symmetric, skip="lm_head")
    assert save_quantized(model, tmp_path / "ckpt", checkpoint_format=fmt) == tmp_path / "ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]

    quant = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False,
                     "sym": symmetric, "checkpoint_format": fmt, "lm_head": False,
                     "modules_to_not_convert": ["lm_head"]}
    loaded = load_quantized(tmp_path / "ckpt", attn_implementation="eager")
    assert loaded.dtype == torch.float32
    original, back = _quant_layers(model), _quant_layers(loaded)
    assert list(back) == list(original)
    for name, layer in original.items():
        for part in ("qweight", "scales", "zeros", "g_idx", "bias"):
            mine, theirs = getattr(layer, part), getattr(back[name], part)
            assert (mine is None) == (theirs is None), (name, part)
            assert mine is None or (mine.dtype == theirs.dtype and torch.equal(mine, theirs)), (name, part)
    assert type(loaded.lm_head) is torch.nn.Linear and torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie

    ids = torch.tensor(np.random.default_rng(seed).integers(0, 160, (2, 9)))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(loaded.generate(ids, **kwargs), model.generate(ids, **kwargs))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_mixed_bits_are_saved_as_dynamic_rules_and_load_back_bit_for_bit(tie: bool, tmp_path) -> None:
    """quantize_model's default (int4 layers, an 8-bit lm_head) saves the lm_head as a GPTQ dynamic rule."""
    seed = 90 + tie
    print(f"seed={seed}")
    model = _llama(seed, tie=tie)
    report = quantize_model(model, bits=4, group_size=32)
    assert "lm_head" in report.quantized and isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
    save_quantized(model, tmp_path / "ckpt")
    quant = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert quant["bits"] == 4 and quant["group_size"] == 32 and quant["lm_head"] is True
    assert quant["dynamic"] == {"+:^lm_head$": {"bits": 8, "group_size": 32}}
    loaded = load_quantized(tmp_path / "ckpt", attn_implementation="eager")
    original, back = _quant_layers(model), _quant_layers(loaded)
    assert list(back) == list(original) and back["lm_head"].bits == 8
    for name, layer in original.items():
        for part in ("qweight", "scales", "zeros", "g_idx"):
            mine, theirs = getattr(layer, part), getattr(back[name], part)
            assert (mine is None) == (theirs is None), (name, part)
            assert mine is None or torch.equal(mine, theirs), (name, part)
    ids = torch.tensor(np.random.default_rng(seed).integers(0, 160, (2, 9)))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("skip", ["inner-layers-float", "lm-head-quantized"])
def test_which_layers_stayed_float_is_in_the_config(skip: str, tmp_path) -> None:
    """The config names the float layers (modules_to_not_convert, modules_in_block_to_quantize, lm_head)."""
    model = _llama(9)
    patterns = ("lm_head", "*.mlp.down_proj") if skip == "inner-layers-float" else None
    report = quantize_model(model, bits=4, group_size=32, skip=patterns)
    save_quantized(model, tmp_path / "ckpt")
    quant = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    if skip == "inner-layers-float":
        assert quant["lm_head"] is False
        assert sorted(quant["modules_to_not_convert"]) == ["lm_head", "model.layers.0.mlp.down_proj",
                                                           "model.layers.1.mlp.down_proj"]
        assert [sorted(names) for names in quant["modules_in_block_to_quantize"]] == [sorted(report.quantized)]
    else:
        assert quant["lm_head"] is True and "lm_head" in report.quantized
        assert "modules_to_not_convert" not in quant and "modules_in_block_to_quantize" not in quant
    loaded = load_quantized(tmp_path / "ckpt", attn_implementation="eager")
    assert sorted(_quant_layers(loaded)) == sorted(report.quantized)
    ids = torch.tensor(np.random.default_rng(9).integers(0, 160, (2, 6)))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_exact_bfloat16_scales_are_saved_as_float16(tmp_path) -> None:
    """bfloat16 scales exact in float16 come back float16 with the same values; the config says the model's dtype."""
    model = _llama(10).to(torch.bfloat16)
    quantize_model(model, bits=4, group_size=32, scale_dtype=torch.bfloat16)
    save_quantized(model, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_quantized(tmp_path / "ckpt", attn_implementation="eager")
    assert loaded.dtype == torch.bfloat16
    for name, layer in _quant_layers(model).items():
        scales = _quant_layers(loaded)[name].scales
        assert scales.dtype == torch.float16 and torch.equal(scales.double(), layer.scales.double())
        assert torch.equal(_quant_layers(loaded)[name].qweight, layer.qweight)


def test_the_file_holds_gptqs_layout(tmp_path) -> None:
    """Names, dtypes and shapes readers allocate; codes and zero points unpacked here give hal's weights."""
    model = _llama(3)
    quantize_model(model, bits=4, group_size=32, symmetric=False, skip="lm_head")
    save_quantized(model, tmp_path / "ckpt")
    with safetensors.safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        for name, layer in _quant_layers(model).items():
            k, n, groups = layer.in_features, layer.out_features, layer.in_features // 32
            assert f"{name}.weight" not in names
            qweight, qzeros = f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.qzeros")
            scales, g_idx = f.get_tensor(f"{name}.scales"), f.get_tensor(f"{name}.g_idx")
            assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (k // 8, n))
            assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (groups, n // 8))
            assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (groups, n))
            assert g_idx.dtype == torch.int32 and torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // 32)
            words = qweight.numpy().view(np.uint32).astype(np.int64)
            codes = np.stack([(words >> (4 * j)) & 15 for j in range(8)], axis=1).reshape(k, n)
            zwords = qzeros.numpy().view(np.uint32).astype(np.int64)
            zeros = np.stack([(zwords >> (4 * j)) & 15 for j in range(8)], axis=2).reshape(groups, n) + 1
            rows = np.arange(k) // 32
            dequantized = (codes - zeros[rows]) * scales.numpy().astype(np.float64)[rows]
            assert np.array_equal(dequantized, layer.quantized_weight().dequantize())
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "ckpt"))
    gptq = transformers.GPTQConfig.from_dict(dict(config.quantization_config))
    assert (gptq.bits, gptq.group_size, gptq.sym, gptq.desc_act, gptq.format) == (4, 32, False, False, "gptq")
    assert config.architectures == ["LlamaForCausalLM"]


def test_checkpoints_loaded_from_gptq_and_awq_save_back(tmp_path) -> None:
    """An act-order GPTQ checkpoint saves back to the same tensors; AWQ's zero points of 0 need gptq_v2."""
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
            "checkpoint_format": "gptq"}
    write_checkpoint(tmp_path / "gptq", llama_config(), gptq, seed=91, act_order=True)
    model = load_quantized(tmp_path / "gptq", dtype=torch.float32)
    save_quantized(model, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]["desc_act"] is True
    with safetensors.safe_open(str(tmp_path / "gptq" / "model.safetensors"), framework="pt") as before, \
            safetensors.safe_open(str(tmp_path / "again" / "model.safetensors"), framework="pt") as after:
        for key in before.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
            expected = before.get_tensor(key)
            got = after.get_tensor(key)
            if expected.is_floating_point() and not key.endswith(".scales"):
                expected = expected.to(torch.float32)  # the float tensors were loaded as float32
            assert got.dtype == expected.dtype and torch.equal(got, expected), key

    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    write_checkpoint(tmp_path / "awq", llama_config(), awq, seed=92)
    model = load_quantized(tmp_path / "awq", dtype=torch.float32, attn_implementation="eager")
    with pytest.raises(CheckpointError, match=r"layer 'model\.layers\.0\.self_attn\.q_proj': zero point 0 .*gptq_v2"):
        save_quantized(model, tmp_path / "awq-as-gptq")
    assert not (tmp_path / "awq-as-gptq").exists()
    save_quantized(model, tmp_path / "awq-as-gptq", checkpoint_format="gptq_v2")
    loaded = load_quantized(tmp_path / "awq-as-gptq", attn_implementation="eager")
    ids = torch.tensor(np.random.default_rng(92).integers(0, 160, (2, 7)))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_shards_index_and_tokenizer(tmp_path) -> None:
    """Above max_shard_size the tensors go to shards with an index; the tokenizer's files are saved alongside."""
    model = _llama(4)
    quantize_model(model, bits=4, group_size=32)

    class Tokenizer:
        def save_pretrained(self, folder: str) -> None:
            (tmp_path / "seen").write_text(folder)
            with open(f"{folder}/tokenizer.json", "w") as f:
                f.write("{}")

    limit = 40_000
    save_quantized(model, tmp_path / "ckpt", max_shard_size=f"{limit}B", tokenizer=Tokenizer())
    folder = tmp_path / "ckpt"
    assert (folder / "tokenizer.json").read_text() == "{}" and (tmp_path / "seen").read_text() != str(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in folder.glob("*.safetensors")) == files
    total = 0
    for file in files:
        with safetensors.safe_open(str(folder / file), framework="pt") as f:
            sizes = [f.get_tensor(key).nbytes for key in f.keys()]  # noqa: SIM118
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == file)
        assert sum(sizes) <= limit or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    loaded = load_quantized(folder, attn_implementation="eager")
    ids = torch.tensor(np.random.default_rng(4).integers(0, 160, (1, 8)))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# -- refusals -----------------------------------------------------------------------------------------


def _refused(model: torch.nn.Module, folder, match: str, **kwargs) -> None:
    with pytest.raises(CheckpointError, match=match):
        save_quantized(model, folder / "ckpt", **kwargs)
    assert not (folder / "ckpt").exists() and _leftovers(folder) == []


@pytest.mark.parametrize(("bits", "group_size"), [(8, 32), (4, 64), (8, 16)])
def test_a_layer_of_other_bits_or_group_size_gets_a_dynamic_rule(bits: int, group_size: int, tmp_path) -> None:
    """One layer unlike the others is saved under an exact-name dynamic rule and loads back bit for bit."""
    model = _llama(6, layers=1)
    quantize_model(model, bits=4, group_size=32, skip=("lm_head", "*.down_proj"))
    float_down = model.model.layers[0].mlp.down_proj
    odd = QuantLinear.from_linear(float_down, bits=bits, group_size=group_size)
    model.model.layers[0].mlp.down_proj = odd
    save_quantized(model, tmp_path / "ckpt")
    quant = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert (quant["bits"], quant["group_size"]) == (4, 32)
    assert quant["dynamic"] == {r"+:^model\.layers\.0\.mlp\.down_proj$": {"bits": bits, "group_size": group_size}}
    back = load_quantized(tmp_path / "ckpt", attn_implementation="eager").model.layers[0].mlp.down_proj
    assert (back.bits, back.group_size) == (odd.bits, odd.group_size)
    assert torch.equal(back.qweight, odd.qweight) and torch.equal(back.scales, odd.scales)


def test_what_gptq_cannot_express_is_refused_before_writing(tmp_path) -> None:
    """Sizes kernels reject, a v1 zero of 0, inexact scales: named, nothing written."""
    model = _llama(6, layers=1)
    quantize_model(model, bits=4, group_size=8)
    _refused(model, tmp_path, r"group_size 8; GPTQ kernels take -1 \(one group\) or 16")

    model = _llama(6, layers=1)
    quantize_model(model, bits=4, group_size=32, symmetric=False)
    model.model.layers[0].mlp.up_proj.zeros[1, 5] = 0
    _refused(model, tmp_path, r"layer 'model\.layers\.0\.mlp\.up_proj': zero point 0 \(group 1, column 5\)")

    model = _llama(6, layers=1)
    quantize_model(model, bits=4, group_size=32, scale_dtype=torch.float32, skip="lm_head")
    _refused(model, tmp_path, r"layer 'model\.layers\.0\.self_attn\.q_proj': GPTQ stores float16 scales")

    _refused(_llama(6, layers=1), tmp_path, "no QuantLinear layers")


def test_existing_targets_failures_and_bad_arguments(tmp_path) -> None:
    """A non-empty target needs overwrite=True; a failure mid-write leaves the old folder as it was."""
    model = _llama(7, layers=1)
    quantize_model(model, bits=4, group_size=32)
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(CheckpointError, match="is not empty; pass overwrite=True"):
        save_quantized(model, target)

    class Failing:
        def save_pretrained(self, folder: str) -> None:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_quantized(model, target, tokenizer=Failing(), overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"] and _leftovers(tmp_path) == []
    save_quantized(model, target, overwrite=True)
    assert not (target / "old.txt").exists() and (target / "model.safetensors").is_file()
    assert _leftovers(tmp_path) == []
    (tmp_path / "empty").mkdir()
    save_quantized(model, tmp_path / "empty")  # an empty folder is filled without overwrite
    assert (tmp_path / "empty" / "config.json").is_file()

    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not a directory"):
        save_quantized(model, tmp_path / "file")
    with pytest.raises(ValueError, match="argument 'checkpoint_format'"):
        save_quantized(model, tmp_path / "a", checkpoint_format="marlin")
    for size in ("lots", 0, -5, 1.5):
        with pytest.raises(ValueError, match="argument 'max_shard_size'"):
            save_quantized(model, tmp_path / "a", max_shard_size=size)
    with pytest.raises(TypeError, match="argument 'tokenizer'"):
        save_quantized(model, tmp_path / "a", tokenizer=object())
    with pytest.raises(TypeError, match=r"argument 'model'.*no transformers config"):
        save_quantized(torch.nn.Linear(4, 4), tmp_path / "a")
    with pytest.raises(TypeError, match="argument 'overwrite'"):
        save_quantized(model, tmp_path / "a", overwrite="yes")
    assert not (tmp_path / "a").exists()


# -- memory -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_saving_makes_no_float_copy_of_a_quantized_weight(bits: int, tmp_path, monkeypatch) -> None:
    """No dequantization, no float tensor of a layer's shape; host allocations stay below one fp32 layer."""
    model = _llama(8, hidden=256, intermediate=512, layers=1)
    # lm_head stays float: the embedding, saved as it is, has its [vocab, hidden] shape
    quantize_model(model, bits=bits, group_size=32, skip="lm_head")
    save_quantized(model, tmp_path / "warm")  # first-call imports are not the point

    def refuse(*args, **kwargs):
        raise AssertionError("save_quantized dequantized a weight")

    monkeypatch.setattr(QuantizedWeight, "dequantize", refuse)
    layers = _quant_layers(model).values()
    shapes = {(m.in_features, m.out_features) for m in layers} | {(m.out_features, m.in_features) for m in layers}
    tracemalloc.start()
    try:
        with NoFloatCopies(shapes) as watch:
            save_quantized(model, tmp_path / "ckpt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert watch.seen == []
    one_float_layer = 4 * max(m.in_features * m.out_features for m in layers)
    print(f"peak host allocation {peak} bytes; one fp32 layer {one_float_layer}")
    assert peak < one_float_layer
