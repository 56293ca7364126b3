"""load_quantized on hostile or broken checkpoint folders: files outside the folder, malformed JSON and safetensors.

Each case starts from a valid checkpoint written by tests/quant_checkpoints.py
and breaks one thing; the error must be a CheckpointError naming the file and
the key, raised before any tensor's data is read (a ReadCounter stands in for
safetensors' safe_open and records every read). The Hugging Face cache's own
layout (snapshots/<rev>/<file> -> ../../blobs/<sha256>) must keep loading.
Headers, values and memory: tests/test_checkpoints_hostile_tensors.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
safetensors = pytest.importorskip("safetensors", reason="safetensors is not installed (make test installs it)")

from quant_checkpoints import ReadCounter, hf_cache_layout, llama_config, write_checkpoint  # noqa: E402

import hal_core  # noqa: E402
from hal_core.torch import QuantLinear, load_quantized  # noqa: E402

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
INDEX = "model.safetensors.index.json"
SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> ReadCounter:
    """Every tensor read by load_quantized in this test, recorded (headers are not reads)."""
    import safetensors.torch  # imported first, so that it binds the real safe_open, not the counter

    counter = ReadCounter(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", counter)
    return counter


def _write(path: Path, *, shards: int = 1, seed: int = 11):
    return write_checkpoint(path, llama_config(), GPTQ, seed=seed, shards=shards)


def _refused(path: Path, reads: ReadCounter, *patterns: str) -> str:
    """Load ``path``, expect a CheckpointError matching every pattern (escaped literally), with nothing read."""
    with pytest.raises(hal_core.CheckpointError) as info:
        load_quantized(path)
    message = str(info.value)
    for pattern in patterns:
        assert re.search(re.escape(pattern), message), f"{pattern!r} not in {message!r}"
    assert reads.reads == [], f"tensors read before the refusal: {reads.reads[:4]}"
    return message


def _logits(model: torch.nn.Module) -> np.ndarray:
    ids = torch.tensor(np.random.default_rng(5).integers(0, 160, (1, 7)))
    with torch.no_grad():
        return model(ids).logits.numpy()


# -- files outside the folder --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors",
                                  "..\\outside.safetensors"], ids=["dotdot", "absolute", "nested-dotdot", "backslash"])
def test_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Path, reads: ReadCounter, name: str) -> None:
    """A weight_map entry that climbs out of the folder (or is absolute) is refused naming the index and the key.

    The file it names is a valid shard, so a loader that followed it would load a working model.
    """
    folder = tmp_path / "ckpt"
    _write(folder, shards=2)
    shutil.move(folder / SHARD, tmp_path / "outside.safetensors")
    name = str(tmp_path / "outside.safetensors") if name == "ABSOLUTE" else name
    index = json.loads((folder / INDEX).read_text())
    moved = sorted(k for k, v in index["weight_map"].items() if v == SHARD)
    index["weight_map"] |= dict.fromkeys(moved, name)
    (folder / INDEX).write_text(json.dumps(index))
    _refused(folder, reads, str(folder / INDEX), f"weight_map[{moved[0]!r}]", repr(name))


@pytest.mark.parametrize("file", ["model.safetensors", "config.json", INDEX])
def test_a_symlink_out_of_the_folder_is_refused(tmp_path: Path, reads: ReadCounter, file: str) -> None:
    """model.safetensors, config.json or the index as a symlink to a file outside the folder: refused naming it."""
    folder = tmp_path / "ckpt"
    _write(folder, shards=2 if file == INDEX else 1)
    outside = tmp_path / "elsewhere" / file
    outside.parent.mkdir()
    shutil.move(folder / file, outside)
    os.symlink(outside, folder / file)
    _refused(folder, reads, str(folder / file), "outside the checkpoint folder", str(outside))


def test_a_symlink_loop_or_a_dangling_symlink_is_refused(tmp_path: Path, reads: ReadCounter) -> None:
    """model.safetensors as a symlink to itself, or to a file that is gone: refused naming it, nothing read."""
    folder = tmp_path / "ckpt"
    _write(folder)
    (folder / "model.safetensors").unlink()
    os.symlink("model.safetensors", folder / "model.safetensors")
    _refused(folder, reads, str(folder / "model.safetensors"), "broken or looping symlink")
    (folder / "model.safetensors").unlink()
    os.symlink("gone.safetensors", folder / "model.safetensors")
    _refused(folder, reads, str(folder / "model.safetensors"), "broken or looping symlink")


def test_a_dtype_argument_hal_cannot_load_in_is_a_type_error(tmp_path: Path) -> None:
    """dtype= must be 'auto' or a float dtype a model runs in: an integer or fp8 dtype is refused naming 'dtype'."""
    _write(tmp_path / "ckpt")
    for dtype in (torch.int32, torch.float8_e4m3fn, "float16"):
        with pytest.raises(TypeError, match="argument 'dtype'"):
            load_quantized(tmp_path / "ckpt", dtype=dtype)


def test_symlinks_that_stay_inside_the_folder_load(tmp_path: Path) -> None:
    """A file that is a symlink to another file inside the folder loads, the same model as without it."""
    folder = tmp_path / "ckpt"
    _write(folder)
    expected = _logits(load_quantized(folder))
    (folder / "weights").mkdir()
    shutil.move(folder / "model.safetensors", folder / "weights" / "real.safetensors")
    os.symlink("weights/real.safetensors", folder / "model.safetensors")
    np.testing.assert_array_equal(_logits(load_quantized(folder)), expected)


@pytest.mark.parametrize("shards", [1, 2], ids=["single", "sharded"])
def test_hugging_face_cache_layout_loads(tmp_path: Path, shards: int) -> None:
    """snapshots/<rev>/<file> -> ../../blobs/<sha256> (every file a symlink out of the snapshot) loads unchanged."""
    plain = tmp_path / "plain"
    ckpt = _write(plain, shards=shards)
    snapshot = hf_cache_layout(plain, tmp_path / "hub")
    assert all((snapshot / f).is_symlink() for f in os.listdir(snapshot))
    model = load_quantized(snapshot)
    for name, layer in ckpt.layers.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear)
        np.testing.assert_array_equal(module.quantized_weight().dequantize(), layer.dequantized())
    np.testing.assert_array_equal(_logits(model), _logits(load_quantized(plain)))


def test_hugging_face_snapshot_linking_out_of_its_repository_is_refused(tmp_path: Path, reads: ReadCounter) -> None:
    """In the cache layout, a snapshot file pointing outside its models--*/ folder (another repo) is refused."""
    snapshot = hf_cache_layout(_write(tmp_path / "plain").path, tmp_path / "hub")
    other = tmp_path / "hub" / "models--other--repo" / "blobs"
    other.mkdir(parents=True)
    target = (snapshot / "model.safetensors").resolve()
    shutil.move(target, other / target.name)
    (snapshot / "model.safetensors").unlink()
    os.symlink(f"../../../models--other--repo/blobs/{target.name}", snapshot / "model.safetensors")
    _refused(snapshot, reads, str(snapshot / "model.safetensors"), "outside the checkpoint folder")


def test_a_fifo_is_refused_without_being_opened(tmp_path: Path, reads: ReadCounter) -> None:
    """A FIFO named model.safetensors (opening it would block) is refused as not a regular file."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("os.mkfifo is not available on this platform")
    folder = tmp_path / "ckpt"
    _write(folder)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    outcome: list[BaseException] = []

    def load() -> None:  # in a thread: a loader that opened the FIFO would block there, not hang the suite
        try:
            load_quantized(folder)
        except BaseException as exc:  # handed to the assertions below
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=300)  # a deadlock guard, not a measurement: the refusal needs no I/O on the FIFO
    assert outcome, "load_quantized blocked on the FIFO (or returned a model)"
    assert isinstance(outcome[0], hal_core.CheckpointError), repr(outcome[0])
    assert str(folder / "model.safetensors") in str(outcome[0]) and "not a regular file" in str(outcome[0])
    assert reads.reads == []


# -- malformed safetensors files --------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "header-only"])
def test_broken_safetensors_files_are_refused_naming_them(tmp_path: Path, reads: ReadCounter, damage: str) -> None:
    """A truncated, empty or garbage safetensors file is a CheckpointError naming the file (not a SafetensorError)."""
    folder = tmp_path / "ckpt"
    _write(folder, shards=2)
    file = folder / SHARD
    data = file.read_bytes()
    file.write_bytes({"truncated": data[:-100], "empty": b"", "garbage": os.urandom(256),
                      "header-only": data[:8 + int.from_bytes(data[:8], "little")]}[damage])
    _refused(folder, reads, str(file), "not a readable safetensors file")


def test_a_tensor_stored_twice_is_refused(tmp_path: Path, reads: ReadCounter) -> None:
    """Two files holding the same tensor (no index to choose) is ambiguous: refused naming the key and both files."""
    from safetensors.torch import save_file

    folder = tmp_path / "ckpt"
    ckpt = _write(folder)
    save_file({"model.norm.weight": ckpt.floats["model.norm.weight"]}, str(folder / "extra.safetensors"))
    _refused(folder, reads, "'model.norm.weight' is stored twice", str(folder / "extra.safetensors"),
             str(folder / "model.safetensors"))


# -- malformed index ---------------------------------------------------------------------------------------


INDEX_CASES = {  # name: (index file text, or a change to its weight_map; what the message names)
    "invalid-json": ('{"weight_map": {', "not valid JSON"),
    "list": ("[1, 2]", "expected a JSON object, got list"),
    "number": ("3", "expected a JSON object, got int"),
    "not-utf8": (b"\xff\xfe{}", "not valid JSON"),
    "deeply-nested": ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    "no-weight-map": ('{"metadata": {}}', "weight_map: expected a JSON object"),
    "weight-map-list": ('{"weight_map": ["model.safetensors"]}', "weight_map: expected a JSON object"),
    "weight-map-empty": ('{"weight_map": {}}', "weight_map lists no tensor"),
    "empty-file-name": ("", "weight_map['model.norm.weight']: expected a file name, got ''"),
    "number-file-name": (7, "weight_map['model.norm.weight']: expected a file name, got 7"),
    "null-file-name": (None, "weight_map['model.norm.weight']: expected a file name, got None"),
    "missing-file": ("model-00009-of-00009.safetensors", "no such file in the checkpoint folder"),
    "wrong-file": ("OTHER", "does not hold 'model.norm.weight'"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_malformed_index_is_refused_naming_the_file_and_key(tmp_path: Path, reads: ReadCounter, case: str) -> None:
    """Invalid JSON, a list or number, no or a bad weight_map, a bad or wrong file name: CheckpointError naming it."""
    folder = tmp_path / "ckpt"
    _write(folder, shards=2)
    text, expected = INDEX_CASES[case]
    index = json.loads((folder / INDEX).read_text())
    if case in ("empty-file-name", "number-file-name", "null-file-name", "missing-file", "wrong-file"):
        held = index["weight_map"]["model.norm.weight"]
        other = next(v for v in index["weight_map"].values() if v != held)
        index["weight_map"]["model.norm.weight"] = other if text == "OTHER" else text
        text = json.dumps(index)
    (folder / INDEX).write_bytes(text if isinstance(text, bytes) else text.encode())
    _refused(folder, reads, str(folder / INDEX), expected)


# -- malformed config.json ------------------------------------------------------------------------------


CONFIG_CASES = {  # name: (change to config.json, or its whole text; what the message names)
    "invalid-json": ('{"model_type": "llama",', "not valid JSON"),
    "list": ("[]", "expected a JSON object, got list"),
    "quant-string": ({"quantization_config": "gptq"}, "quantization_config: expected a JSON object, got str"),
    "quant-list": ({"quantization_config": [GPTQ]}, "quantization_config: expected a JSON object, got list"),
    "quant-number": ({"quantization_config": 4}, "quantization_config: expected a JSON object, got int"),
    "quant-method-list": ({"quantization_config": GPTQ | {"quant_method": ["gptq"]}},
                          "quantization_config.quant_method"),
    "format-list": ({"quantization_config": GPTQ | {"checkpoint_format": ["gptq"]}},
                    "quantization_config.checkpoint_format: expected a string"),
    "unknown-model-type": ({"model_type": "no-such-model"}, "transformers cannot read the model config"),
    "dtype-garbage": ({"dtype": "float99", "torch_dtype": "float99"}, "dtype: expected one of ['bfloat16', "),
    "dtype-integer": ({"dtype": "int32"}, "dtype: expected one of ['bfloat16', 'float16', 'float32', 'float64'], "
                                          "got 'int32'"),
    "dtype-fp8": ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype: expected one of"),
    "no-kv-heads": ({"num_key_value_heads": 0}, "cannot build a model from it"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_malformed_config_is_refused_naming_the_file_and_key(tmp_path: Path, reads: ReadCounter, case: str) -> None:
    """Invalid JSON, a quantization_config that is not an object, a config transformers cannot build: named."""
    folder = tmp_path / "ckpt"
    _write(folder)
    change, expected = CONFIG_CASES[case]
    text = change if isinstance(change, str) else json.dumps(json.loads((folder / "config.json").read_text())
                                                             | change)
    (folder / "config.json").write_text(text)
    _refused(folder, reads, str(folder / "config.json"), expected)


def test_missing_or_odd_config_json_is_refused(tmp_path: Path, reads: ReadCounter) -> None:
    """No config.json names argument 'path'; a config.json that is a folder is not a regular file."""
    folder = tmp_path / "ckpt"
    _write(folder)
    (folder / "config.json").unlink()
    _refused(folder, reads, "argument 'path'", str(folder / "config.json"), "does not exist")
    (folder / "config.json").mkdir()
    _refused(folder, reads, str(folder / "config.json"), "not a regular file")
    _refused(folder / "model.safetensors", reads, "argument 'path'", "not a directory")
