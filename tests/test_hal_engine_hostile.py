"""hal_core.engine refuses bad checkpoints, configs and arguments by name before any weight is loaded (NaN: as read)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers
from torch_helpers import torch

from hal_core import ArgumentError, CheckpointError, ConfigurationError
from hal_core.engine import Engine
from hal_core.torch import quantize_model, save_quantized

GROUP = 32
VOCAB = 96
NORM = "model.layers.0.post_attention_layernorm.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (one layer) saved as config.json + model.safetensors, shared by the module."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    quantize_model(model, bits=4, group_size=GROUP)
    save_quantized(model, folder / "gptq")
    return folder


@pytest.fixture
def folder(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the pristine checkpoint, to damage."""
    target = tmp_path / "model"
    shutil.copytree(pristine, target)
    return target


def header_of(path: Path) -> tuple[dict[str, Any], bytes]:
    """A safetensors file's header and data section."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def edit_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite ``path``'s header through ``edit``, its data section unchanged."""
    header, data = header_of(path)
    edit(header)
    write_raw(path, json.dumps(header).encode(), data)


def edit_config(folder: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def refused(folder: Path, error: type[Exception], match: str, **kwargs: Any) -> None:
    """Engine(folder) raises ``error`` matching ``match`` before any layer is loaded."""
    loaded: list[str] = []
    with pytest.raises(error, match=match):
        Engine(folder, backend=kwargs.pop("backend"), group_size=kwargs.pop("group_size", GROUP),
               progress=loaded.append, **kwargs)
    assert loaded == [], "the error came after weights were loaded"


def shard(folder: Path, name: str = "model-00001-of-00001.safetensors") -> Path:
    """Turn the single file into a one-shard index; returns the index's path."""
    (folder / "model.safetensors").rename(folder / name)
    header, _ = header_of(folder / name)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": dict.fromkeys(header, name)}))
    return index


# -- the safetensors file ---------------------------------------------------------------------------------


def test_truncated_file_is_refused_naming_file_and_tensor(cpu, folder: Path) -> None:
    """A file cut short: a tensor past its end is named (and a file shorter than 8 bytes is no safetensors)."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) - 100])
    refused(folder, CheckpointError, r"model\.safetensors: tensor '.+': data_offsets .* outside", backend=cpu)
    path.write_bytes(raw[:5])
    refused(folder, CheckpointError, r"model\.safetensors: not a safetensors file \(5 bytes\)", backend=cpu)


def test_header_length_beyond_the_file_is_refused(cpu, folder: Path) -> None:
    """A header length larger than the file is refused naming the file."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes((len(raw) + 1).to_bytes(8, "little") + raw[8:])
    refused(folder, CheckpointError, r"model\.safetensors: header length \d+ exceeds", backend=cpu)


@pytest.mark.parametrize(("header", "match"), [(b"{not json", "unreadable header"),
                                               (b"\xff\xfe", "unreadable header"),
                                               (b"[1, 2]", "the header is not a JSON object"),
                                               (b'{"__metadata__": [1]}', "__metadata__ is not")],
                         ids=["not-json", "not-utf8", "list", "metadata"])
def test_header_not_a_json_object_is_refused(cpu, folder: Path, header: bytes, match: str) -> None:
    """A header that is not JSON, or not an object, is refused naming the file."""
    path = folder / "model.safetensors"
    write_raw(path, header, header_of(path)[1])
    refused(folder, CheckpointError, rf"model\.safetensors: {match}", backend=cpu)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("dtype", "F8_E9M9", "unknown dtype 'F8_E9M9'"),
    ("dtype", None, "unknown dtype None"),
    ("shape", [-64], r"shape \[-64\] is not a list of integers >= 0"),
    ("shape", [32.0, 2], r"shape \[32.0, 2\] is not a list"),
    ("shape", [32], r"F32 \[32\] needs 128 bytes, its data_offsets span 256"),
    ("data_offsets", [0, 10**9], r"data_offsets \[0, 1000000000\] lie outside"),
    ("data_offsets", [-4, 252], r"data_offsets \[-4, 252\] lie outside"),
    ("data_offsets", [8, 4], r"data_offsets \[8, 4\] lie outside"),
    ("data_offsets", [0], r"data_offsets \[0\] lie outside"),
    (None, None, "malformed entry"),
])
def test_bad_header_entry_is_refused_naming_the_tensor(cpu, folder: Path, field: str | None, value: Any,
                                                       match: str) -> None:
    """An entry with an unknown dtype, a negative or non-integer shape, offsets outside the data or a span that
    does not hold its shape is refused naming file and tensor."""
    def edit(header: dict[str, Any]) -> None:
        if field is None:
            header[NORM] = "a string"
        else:
            header[NORM][field] = value
    edit_header(folder / "model.safetensors", edit)
    refused(folder, CheckpointError, rf"model\.safetensors: tensor '{NORM}': {match}", backend=cpu)


# -- shards and tensors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink", "subfolder", "missing"])
def test_shard_outside_the_folder_or_missing_is_refused(cpu, folder: Path, where: str) -> None:
    """An index naming a file outside the folder (``../x``, an absolute path, a symlink leading out, a
    subfolder) or a shard that is not there is refused naming the index, tensor and file."""
    index = shard(folder)
    outside = folder.parent / "outside.safetensors"
    shutil.copy(folder / "model-00001-of-00001.safetensors", outside)
    name = {"parent": "../outside.safetensors", "absolute": str(outside), "symlink": "link.safetensors",
            "subfolder": "sub/x.safetensors", "missing": "model-00002-of-00002.safetensors"}[where]
    if where == "symlink":
        os.symlink(outside, folder / name)
    content = json.loads(index.read_text())
    content["weight_map"][NORM] = name
    index.write_text(json.dumps(content))
    why = {"missing": "which is missing", "symlink": "which leads out"}.get(where, "must be a file name|leads out")
    refused(folder, CheckpointError, rf"index\.json: tensor '{NORM}' names '.*{name.split('/')[-1]}'.*({why})",
            backend=cpu)


@pytest.mark.parametrize("content", ["{", "[]", '{"weight_map": [1]}', '{"other": 1}'])
def test_unreadable_index_is_refused(cpu, folder: Path, content: str) -> None:
    """An index that is not JSON, has no weight_map or a weight_map that is no object is refused naming it."""
    shard(folder).write_text(content)
    refused(folder, CheckpointError, r"model\.safetensors\.index\.json: (no readable )?weight_map", backend=cpu)


def test_a_symlink_inside_the_folder_is_read(cpu, folder: Path) -> None:
    """A shard that is a symlink to another file of the folder loads (only leaving the folder is refused)."""
    index = shard(folder)
    os.symlink("model-00001-of-00001.safetensors", folder / "alias.safetensors")
    content = json.loads(index.read_text())
    content["weight_map"][NORM] = "alias.safetensors"
    index.write_text(json.dumps(content))
    with Engine(folder, backend=cpu, group_size=GROUP) as engine:
        assert len(engine.generate([[1, 2]], max_new_tokens=2, stop_token_ids=())[0]) == 2


def test_missing_tensor_is_refused_naming_it(cpu, folder: Path) -> None:
    """A tensor the config calls for and the file lacks is refused naming it."""
    edit_header(folder / "model.safetensors", lambda header: header.pop(NORM))
    refused(folder, CheckpointError, rf"tensor '{NORM}' is missing", backend=cpu)


def test_norm_of_an_integer_dtype_is_refused(cpu, folder: Path) -> None:
    """A norm stored as int32 (same bytes as float32) is refused naming the tensor and the dtypes allowed."""
    edit_header(folder / "model.safetensors", lambda header: header[NORM].update(dtype="I32"))
    refused(folder, CheckpointError, rf"tensor '{NORM}' is I32, expected one of BF16, F16, F32", backend=cpu)


def test_stored_projection_bias_is_refused(cpu, folder: Path) -> None:
    """A projection bias in the file (the engine runs none) is refused naming it, never ignored."""
    def edit(header: dict[str, Any]) -> None:
        header["model.layers.0.self_attn.q_proj.bias"] = dict(header[NORM])
    edit_header(folder / "model.safetensors", edit)
    refused(folder, CheckpointError, r"'model\.layers\.0\.self_attn\.q_proj\.bias': biased projections", backend=cpu)


@pytest.mark.parametrize("tensor", [NORM, "model.layers.0.mlp.down_proj.weight", "lm_head.weight"])
def test_non_finite_weight_is_refused_naming_it(cpu, folder: Path, tensor: str) -> None:
    """A NaN in a norm or a projection quantized at load is refused naming the tensor, never served."""
    path = folder / "model.safetensors"
    header, _ = header_of(path)
    assert header[tensor]["dtype"] == "F32"
    raw = bytearray(path.read_bytes())
    at = 8 + int.from_bytes(raw[:8], "little") + header[tensor]["data_offsets"][0] + 4 * 5
    raw[at:at + 4] = np.float32(np.nan).tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"tensor '{tensor}' holds NaN or infinity"):
        Engine(folder, backend=cpu, group_size=GROUP)


# -- config.json ----------------------------------------------------------------------------------------------


def test_config_missing_or_not_json_is_refused(cpu, folder: Path) -> None:
    """No config.json, one that is not JSON, or not an object: refused naming the file."""
    config = folder / "config.json"
    config.write_text("{")
    refused(folder, ConfigurationError, r"config\.json: not JSON", backend=cpu)
    config.write_bytes(b"\xff\xfe")
    refused(folder, ConfigurationError, r"config\.json: not JSON", backend=cpu)
    config.write_text("[1]")
    refused(folder, ConfigurationError, r"config\.json: config: expected a JSON object", backend=cpu)
    config.unlink()
    refused(folder, ConfigurationError, r"config\.json: no config\.json", backend=cpu)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("intermediate_size", None, "missing"), ("vocab_size", None, "missing"),
    ("hidden_size", "wide", "expected an integer >= 1, got 'wide'"),
    ("hidden_size", 64.5, "expected an integer >= 1, got 64.5"),
    ("num_attention_heads", 0, "expected an integer >= 1, got 0"),
    ("num_hidden_layers", True, "expected an integer >= 1, got True"),
    ("num_key_value_heads", 3, "3 does not divide num_attention_heads=4"),
    ("max_position_embeddings", -1, "expected an integer >= 1"),
    ("rms_norm_eps", "tiny", "expected a finite number > 0"), ("rms_norm_eps", 0, "expected a finite number > 0"),
    ("model_type", "gpt2", "'gpt2' is not run"), ("model_type", None, "None is not run"),
    ("eos_token_id", "</s>", "expected a token id or a list of them"),
    ("eos_token_id", [2, 1.5], r"expected a token id or a list of them, got \[2, 1.5\]"),
    ("hidden_act", "relu", "'relu' is not one of"), ("hidden_act", ["silu"], r"\['silu'\] is not one of"),
    ("attention_bias", True, "biased projections"), ("mlp_bias", True, "biased projections"),
])
def test_bad_config_field_is_refused_naming_it(cpu, folder: Path, field: str, value: Any, match: str) -> None:
    """A missing, non-integer or out-of-range size, or a feature the engine does not run, is refused naming the
    field of config.json before any weight is read."""
    edit_config(folder, lambda c: c.pop(field) if value is None and field != "model_type" else c.update({field: value}))
    refused(folder, ConfigurationError, rf"config\.json: config field '{field}': {match}", backend=cpu)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_scaling_is_refused_before_loading(cpu, folder: Path, key: str) -> None:
    """A rope scaling type hal_core.rope does not compute is refused naming the key, before weights load."""
    def edit(config: dict[str, Any]) -> None:
        config.pop("rope_parameters", None)
        config[key] = {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0}
    edit_config(folder, edit)
    refused(folder, ConfigurationError, rf"config field {key}\['rope_type'\] = 'longrope'", backend=cpu)


def test_act_order_and_awq_checkpoints_are_refused(cpu, folder: Path) -> None:
    """A GPTQ checkpoint with desc_act true, an AWQ one and an unknown method are refused naming the key."""
    gptq = folder / "gptq"
    edit_config(gptq, lambda c: c["quantization_config"].update(desc_act=True))
    refused(gptq, ConfigurationError, r"quantization_config\.desc_act: act-order", backend=cpu)
    awq = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
    edit_config(gptq, lambda c: c.update(quantization_config=awq))
    refused(gptq, ConfigurationError, r"quantization_config\.quant_method: 'awq' checkpoints are not run",
            backend=cpu)
    edit_config(gptq, lambda c: c["quantization_config"].update(quant_method="bitsandbytes"))
    refused(gptq, CheckpointError, r"quantization_config\.quant_method", backend=cpu)


# -- Engine(...) arguments -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argument", "value", "match"), [
    ("bits", 3, "expected 4 or 8, got 3"), ("bits", "4", "expected 4 or 8"), ("bits", True, "expected 4 or 8"),
    ("lm_head_bits", 16, "expected 4 or 8"),
    ("group_size", 0, "expected a positive integer"), ("group_size", -1, "expected a positive integer"),
    ("group_size", 48, "48 does not divide the 64 inputs of "),
    ("dtype", "fp64", "expected 'fp32', 'fp16' or 'bf16'"), ("dtype", "int8", "expected 'fp32'"),
    ("activations", "int4", "expected None or one of float, int8"),
    ("kv_cache_tokens", 0, "positive integer"), ("kv_cache_tokens", 1.5, "positive integer"),
    ("kv_cache_tokens", True, "positive integer"), ("max_batch_tokens", 0, "positive integer"),
    ("max_batch_tokens", -3, "positive integer"), ("block_size", 0, "positive integer"),
    ("backend", "cpu", "expected a hal_core Backend, got str"), ("progress", 3, "expected a callable, got int"),
])
def test_bad_engine_argument_is_refused_before_loading(cpu, folder: Path, argument: str, value: Any,
                                                       match: str) -> None:
    """An Engine argument out of range is an ArgumentError naming it, raised before any weight is loaded."""
    kwargs = {"backend": cpu, "group_size": GROUP, argument: value}
    with pytest.raises(ArgumentError, match=rf"argument '{argument}': .*{match}"):
        Engine(folder, **{"progress": (lambda line: pytest.fail(f"loaded {line}")), **kwargs})
