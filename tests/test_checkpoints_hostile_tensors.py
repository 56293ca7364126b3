"""load_quantized on checkpoints whose tensors do not fit the model: shapes and dtypes from the headers, then values.

Every stored tensor's shape and dtype is checked against the layer or
parameter it is for before any tensor's data is read (a ReadCounter stands in
for safetensors' safe_open and records every read); an oversized ``qweight``
is refused without its data ever being read, which a fresh process's peak RSS
confirms. Bad values (a NaN scale, a ``g_idx`` out of range) and failed reads
are refused naming the layer or key, and no model is returned.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
safetensors = pytest.importorskip("safetensors", reason="safetensors is not installed (make test installs it)")

from quant_checkpoints import ReadCounter, llama_config, replace_tensors, write_checkpoint  # noqa: E402

import hal_core  # noqa: E402
from hal_core.torch import load_quantized  # noqa: E402

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
LAST = "model.layers.1.mlp.down_proj"  # the last quantized layer loaded: K=128 -> N=64
FIRST = "model.layers.0.self_attn.q_proj"  # K=64 -> N=64, with a bias under llama_config(bias=True)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> ReadCounter:
    """Every tensor read by load_quantized in this test, recorded (headers are not reads)."""
    import safetensors.torch  # imported first, so that it binds the real safe_open, not the counter

    counter = ReadCounter(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", counter)
    return counter


def _refused(folder: Path, *patterns: str, progress: list | None = None) -> str:
    """Load ``folder``, expect a CheckpointError whose message holds every pattern (literally)."""
    steps = [] if progress is None else progress
    with pytest.raises(hal_core.CheckpointError) as info:
        load_quantized(folder, progress=lambda done, total, name: steps.append(name))
    message = str(info.value)
    for pattern in patterns:
        assert re.search(re.escape(pattern), message), f"{pattern!r} not in {message!r}"
    return message


@pytest.mark.parametrize(("quant", "shape"), [(GPTQ, (16, 64)), (AWQ, (128, 8))], ids=["gptq", "awq"])
def test_an_oversized_qweight_is_refused_before_any_tensor_is_read(tmp_path: Path, reads: ReadCounter, quant: dict,
                                                                   shape: tuple[int, int]) -> None:
    """A 16 MiB qweight for the last 128 -> 64 layer: refused from its header, naming layer, key, file and shapes."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, llama_config(), quant, seed=21)
    replace_tensors(folder / "model.safetensors", {f"{LAST}.qweight": torch.zeros(65536, 64, dtype=torch.int32)})
    steps: list[str] = []
    _refused(folder, f"layer {LAST!r}", f"'{LAST}.qweight' in {folder / 'model.safetensors'}",
             f"has shape (65536, 64), expected {shape}", progress=steps)
    assert reads.reads == [] and steps == []


HEADER_CASES = {  # name: (tensor key, stored tensor, words the message holds)
    "qweight-float": (f"{LAST}.qweight", torch.zeros(16, 64), "has dtype F32, expected I32 or U32"),
    "qweight-3d": (f"{LAST}.qweight", torch.zeros(16, 64, 1, dtype=torch.int32), "has shape (16, 64, 1)"),
    "qzeros-groups": (f"{LAST}.qzeros", torch.zeros(2, 8, dtype=torch.int32), "has shape (2, 8), expected (4, 8)"),
    "qzeros-int64": (f"{LAST}.qzeros", torch.zeros(4, 8, dtype=torch.int64), "has dtype I64"),
    "scales-int": (f"{LAST}.scales", torch.zeros(4, 64, dtype=torch.int32),
                   "has dtype I32, expected BF16 or F16 or F32"),
    "scales-transposed": (f"{LAST}.scales", torch.zeros(64, 4, dtype=torch.float16), "expected (4, 64)"),
    "g_idx-short": (f"{LAST}.g_idx", torch.zeros(64, dtype=torch.int32), "has shape (64,), expected (128,)"),
    "g_idx-float": (f"{LAST}.g_idx", torch.zeros(128), "has dtype F32"),
    "bias-shape": (f"{FIRST}.bias", torch.zeros(65, dtype=torch.float16), "has shape (65,), expected (64,)"),
    "bias-int": (f"{FIRST}.bias", torch.zeros(64, dtype=torch.int32), "has dtype I32"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_a_layer_tensor_of_the_wrong_shape_or_dtype_is_refused_naming_the_layer(tmp_path: Path, reads: ReadCounter,
                                                                                case: str) -> None:
    """qweight, qzeros, scales, g_idx and bias are checked against the model's layer from their headers alone."""
    key, value, expected = HEADER_CASES[case]
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, llama_config(bias=True), GPTQ, seed=22)
    replace_tensors(folder / "model.safetensors", {key: value})
    layer = key.rsplit(".", 1)[0]
    _refused(folder, f"layer {layer!r}", f"{key!r} in {folder / 'model.safetensors'}", expected)
    assert reads.reads == []


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("model.norm.weight", torch.zeros(65, dtype=torch.float16), "has shape (65,), expected (64,)"),
    ("model.embed_tokens.weight", torch.zeros(160, 64, dtype=torch.int32), "has dtype I32, expected"),
    ("lm_head.weight", torch.zeros(64, 160, dtype=torch.float16), "has shape (64, 160), expected (160, 64)"),
], ids=["norm-shape", "embedding-int", "lm_head-transposed"])
def test_a_plain_tensor_of_the_wrong_shape_or_dtype_is_refused(tmp_path: Path, reads: ReadCounter, key: str,
                                                              value: torch.Tensor, expected: str) -> None:
    """Embeddings, norms and an unquantized lm_head are checked against the meta model's parameters first."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, llama_config(), GPTQ, seed=23)
    replace_tensors(folder / "model.safetensors", {key: value})
    _refused(folder, f"{key!r} in {folder / 'model.safetensors'}", expected, f"the model's {key}")
    assert reads.reads == []


def test_a_bias_the_model_has_but_the_checkpoint_lacks_is_refused(tmp_path: Path, reads: ReadCounter) -> None:
    """A layer whose model has a bias and whose checkpoint has none would silently drop it: refused naming it."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, llama_config(bias=True), GPTQ, seed=24)
    replace_tensors(folder / "model.safetensors", {f"{FIRST}.bias": None})
    _refused(folder, f"layer {FIRST!r}", "has a bias", f"no {FIRST}.bias")
    assert reads.reads == []


def test_a_bias_the_model_does_not_have_is_left_out_and_logged(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A stored bias for a layer built without one is not loaded (the config decides), and is logged as unused."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, llama_config(), GPTQ, seed=25)
    replace_tensors(folder / "model.safetensors", {f"{FIRST}.bias": torch.ones(64, dtype=torch.float16)})
    with caplog.at_level(logging.WARNING, logger="hal"):
        model = load_quantized(folder)
    assert model.get_submodule(FIRST).bias is None
    assert f"{FIRST}.bias" in caplog.text


def test_a_group_size_that_does_not_divide_a_layer_is_refused(tmp_path: Path, reads: ReadCounter) -> None:
    """quantization_config.group_size 48 cannot divide K=64: refused naming the key and the first layer."""
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, llama_config(), GPTQ, seed=26)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    _refused(folder, f"layer {FIRST!r}", "quantization_config.group_size is 48", "K=64")
    assert reads.reads == []


# -- values, and failures late in the load -------------------------------------------------------------------


@pytest.mark.parametrize(("part", "expected"), [("scales", "'scales': expected finite values"),
                                                ("g_idx", "'g_idx': groups must lie in [0, 4)")])
def test_a_bad_value_in_the_last_layer_is_refused_and_no_model_is_returned(tmp_path: Path, part: str,
                                                                           expected: str) -> None:
    """A NaN scale or an out-of-range g_idx in the last layer: CheckpointError naming it, after the others loaded."""
    folder = tmp_path / "ckpt"
    ckpt = write_checkpoint(folder, llama_config(), GPTQ | {"desc_act": True, "sym": False}, seed=27, act_order=True)
    from safetensors.torch import load

    value = load((folder / "model.safetensors").read_bytes())[f"{LAST}.{part}"].clone()
    value.view(-1)[5] = float("nan") if part == "scales" else 4
    replace_tensors(folder / "model.safetensors", {f"{LAST}.{part}": value})
    steps: list[str] = []
    _refused(folder, f"layer {LAST!r}", expected, progress=steps)
    assert steps == [name for name in ckpt.layers if name != LAST]


def test_a_failed_read_of_the_last_tensor_names_the_key_and_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error reading the final norm (after every layer is converted) is a CheckpointError naming it."""
    folder = tmp_path / "ckpt"
    ckpt = write_checkpoint(folder, llama_config(), AWQ, seed=28)
    import safetensors.torch  # imported first, so that it binds the real safe_open, not the counter

    monkeypatch.setattr(safetensors, "safe_open",
                        ReadCounter(safetensors.safe_open, fail={"model.norm.weight": OSError(5, "I/O error")}))
    steps: list[str] = []
    _refused(folder, f"'model.norm.weight' in {folder / 'model.safetensors'}", "cannot be read", "I/O error",
             progress=steps)
    assert steps == list(ckpt.layers)


# -- memory ------------------------------------------------------------------------------------------------

MEASURE = textwrap.dedent("""
    import json, sys
    import hal_core
    from hal_core.torch import load_quantized

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    load_quantized(sys.argv[2])  # warm: the model's modules, hal's kernels library, lazy imports
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    try:
        load_quantized(sys.argv[1])
        error = None
    except hal_core.CheckpointError as exc:
        error = str(exc)
    print(json.dumps({"growth": status("VmHWM:") - before, "error": error}))
""")


def test_an_oversized_qweight_does_not_grow_the_process(tmp_path: Path) -> None:
    """In a fresh process, refusing a 64 MiB qweight for a 64 -> 64 layer grows the peak RSS by under 16 MiB.

    A loader that read (let alone unpacked) the tensor before checking its shape would touch all 64 MiB.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here (/proc/self/clear_refs: {exc}); Linux only")
    write_checkpoint(tmp_path / "good", llama_config(), GPTQ, seed=29)
    write_checkpoint(tmp_path / "bad", llama_config(), GPTQ, seed=29)
    qweight = torch.from_numpy(np.random.default_rng(29).integers(-2**31, 2**31, (262144, 64), dtype=np.int32))
    replace_tensors(tmp_path / "bad" / "model.safetensors", {f"{FIRST}.qweight": qweight})
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "bad"), str(tmp_path / "good")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"peak RSS growth refusing a {qweight.numel() * 4 / 2**20:.0f} MiB qweight: "
          f"{result['growth'] / 2**20:.1f} MiB")
    assert result["error"] is not None and f"{FIRST}.qweight" in result["error"]
    assert result["growth"] < 16 * 2**20
