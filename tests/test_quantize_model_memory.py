"""After quantize_model no page of the float checkpoint stays in the process: mapped tensors are copied out of it;
after load_quantized none of the GPTQ checkpoint's either.

Memory accounting only (resident pages and bytes from /proc), no timing. Linux only: the mappings are read from
/proc/self/maps and /proc/self/smaps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch_helpers import torch

from hal_core.torch import QuantLinear, quantize_model

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")

#: Saves two float Llamas with save_pretrained: a small one to warm the measuring process up, and the measured one.
SAVE = """
import sys, torch, transformers
def save(path, vocab, hidden, layers, seed):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
save(sys.argv[1], 512, 128, 1, 0)
save(sys.argv[2], 16384, 512, 4, 1)
"""

#: Loads the saved model with from_pretrained, quantizes it, and reports RSS and the checkpoint's resident pages.
MEASURE = """
import gc, json, sys, torch, transformers
import hal_core.torch as hal_torch

def status_kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

def mapped(path):
    '''(mappings of path, their resident kB) from /proc/self/smaps.'''
    count = rss = 0
    current = None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if not parts[0].endswith(":"):
            current = parts[5] if len(parts) >= 6 else ""
            count += current == path
        elif parts[0] == "Rss:" and current == path:
            rss += int(parts[1])
    return count, rss

torch.set_num_threads(1)
warm, target = sys.argv[1], sys.argv[2]
model = transformers.AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32)  # imports, caches, first calls
hal_torch.quantize_model(model)
del model
gc.collect()
base = status_kb("VmRSS")
model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
loaded = mapped(target + "/model.safetensors")
report = hal_torch.quantize_model(model)
gc.collect()
tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
floats = {id(t): t for m in model.modules() if not isinstance(m, hal_torch.QuantLinear)
          for t in m._parameters.values() if t is not None}
print(json.dumps({"base_kb": base, "after_kb": status_kb("VmRSS"), "loaded": loaded,
                  "after": mapped(target + "/model.safetensors"), "unmapped_bytes": report.unmapped_bytes,
                  "quantized_bytes": report.quantized_bytes,
                  "model_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                  "float_parameter_bytes": sum(t.numel() * t.element_size() for t in floats.values())}))
"""


#: Writes a quantized Llama as a GPTQ checkpoint (save_quantized), with an int8 lm_head and the embedding in float.
SAVE_GPTQ = """
import sys, torch, transformers
import hal_core.torch as hal_torch
config = transformers.LlamaConfig(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4)
torch.manual_seed(2)
model = transformers.AutoModelForCausalLM.from_config(config)
hal_torch.quantize_model(model, layer_bits={"lm_head": 8})
hal_torch.save_quantized(model, sys.argv[1])
"""

#: Loads that checkpoint twice (the first warms the process up) and reports what stays mapped and resident.
MEASURE_LOAD = MEASURE.split("torch.set_num_threads(1)")[0] + """
torch.set_num_threads(1)
path = sys.argv[1]
hal_torch.load_quantized(path, dtype=torch.float32)
gc.collect()
base, peak_before = status_kb("VmRSS"), status_kb("VmHWM")
model = hal_torch.load_quantized(path, dtype=torch.float32)
gc.collect()
tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
print(json.dumps({"base_kb": base, "after_kb": status_kb("VmRSS"), "after": mapped(path + "/model.safetensors"),
                  "model_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}))
"""


def test_no_page_of_a_gptq_checkpoint_stays_mapped_after_load_quantized(tmp_path: Path) -> None:
    """load_quantized reads with safetensors, which gives the scales, the embedding and the norms as views of its
    mapping of the file: they are copied out, so no mapping of the file outlives the call and RSS grows by the
    model's bytes only (not by the file's pages beside the converted codes)."""
    pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
    target = tmp_path / "gptq"
    subprocess.run([sys.executable, "-c", SAVE_GPTQ, str(target)], check=True, capture_output=True, timeout=300)
    file_bytes = (target / "model.safetensors").stat().st_size
    proc = subprocess.run([sys.executable, "-c", MEASURE_LOAD, str(target)], capture_output=True, text=True,
                          timeout=600)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["after"] == [0, 0]  # no mapping of the checkpoint remains, so no page of it is resident
    kept = got["model_bytes"]
    grown = (got["after_kb"] - got["base_kb"]) * 1024
    print(f"checkpoint {file_bytes / 2**20:.1f} MiB; model {kept / 2**20:.1f} MiB; RSS grew by "
          f"{grown / 2**20:.1f} MiB")
    assert kept > file_bytes / 2
    assert grown <= 1.15 * kept


def test_no_page_of_a_from_pretrained_checkpoint_stays_resident_after_quantize_model(tmp_path: Path) -> None:
    """An fp32 safetensors model from from_pretrained, quantized: the file is unmapped, RSS grows by the model."""
    pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
    warm, target = tmp_path / "warm", tmp_path / "model"
    subprocess.run([sys.executable, "-c", SAVE, str(warm), str(target)], check=True, capture_output=True,
                   timeout=300)
    file_bytes = (target / "model.safetensors").stat().st_size
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(warm), str(target)], capture_output=True, text=True,
                          timeout=600)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["loaded"][0] >= 1  # from_pretrained mapped the file: the model's tensors are views of it
    assert got["after"] == [0, 0]  # no mapping of it remains, so no page of it is resident
    # the embedding and the norms were in the mapping and are now copies of their own: exactly those bytes
    assert got["unmapped_bytes"] == got["float_parameter_bytes"] > 0
    kept = got["model_bytes"]  # the quantized layers, the float parameters, the rotary frequencies
    assert got["quantized_bytes"] + got["float_parameter_bytes"] <= kept < file_bytes / 2
    grown = (got["after_kb"] - got["base_kb"]) * 1024
    print(f"checkpoint {file_bytes / 2**20:.1f} MiB; model after quantize_model {kept / 2**20:.1f} MiB; "
          f"RSS grew by {grown / 2**20:.1f} MiB")
    assert grown <= 1.15 * kept


def _mapped_paths() -> set[str]:
    return {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(maxsplit=5)) == 6}


def test_tensors_in_a_file_mapping_are_copied_out_keeping_ties_views_and_values(tmp_path: Path) -> None:
    """Parameters and buffers viewing one memory-mapped file: copied out, one storage still shared, ties kept."""
    path = tmp_path / "weights.bin"
    rng = np.random.default_rng(8)
    values = rng.standard_normal(3 * 64 * 32 + 32).astype(np.float32)
    values.tofile(path)
    mapping = np.memmap(path, dtype=np.float32, mode="r+")
    flat = torch.from_numpy(mapping)  # the file mapping, as from_pretrained's tensors are
    emb = torch.nn.Embedding(64, 32)
    emb.weight = torch.nn.Parameter(flat[:64 * 32].view(64, 32))
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = emb.weight  # tied
    norm = torch.nn.Module()
    norm.register_buffer("scale", flat[-32:])
    body = torch.nn.Linear(32, 64, bias=False)
    body.weight = torch.nn.Parameter(flat[64 * 32:2 * 64 * 32].view(64, 32))
    model = torch.nn.ModuleDict({"emb": emb, "norm": norm, "body": body, "head": head})
    del mapping, flat, body  # the model holds the only references
    assert str(path) in _mapped_paths()

    report = quantize_model(model, group_size=32, skip="head")
    assert report.quantized == ("body",) and isinstance(model["body"], QuantLinear)
    assert report.unmapped_bytes == (64 * 32 + 2 * 64 * 32 + 32) * 4  # the span the two kept tensors cover
    assert str(path) not in _mapped_paths()  # nothing in the model views the file any more
    assert model["head"].weight is model["emb"].weight  # the tie is the same Parameter still
    assert model["emb"].weight.untyped_storage().data_ptr() == model["norm"].scale.untyped_storage().data_ptr()
    assert np.array_equal(model["emb"].weight.detach().numpy().ravel(), values[:64 * 32])
    assert np.array_equal(model["norm"].scale.numpy(), values[-32:])

    plain = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32))
    assert quantize_model(plain, group_size=32).unmapped_bytes == 0  # nothing mapped: nothing copied


def test_a_checkpoint_deleted_since_it_was_mapped_is_released_too(tmp_path: Path) -> None:
    """The file is gone from the directory but its mapping (listed as deleted) still holds pages: copied out too."""
    path = tmp_path / "gone.bin"
    values = np.random.default_rng(9).standard_normal(32 * 32).astype(np.float32)
    values.tofile(path)
    norm = torch.nn.LayerNorm(32)
    norm.weight = torch.nn.Parameter(torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+"))[:32])
    path.unlink()
    assert f"{path} (deleted)" in _mapped_paths()
    report = quantize_model(torch.nn.Sequential(norm, torch.nn.Linear(32, 32)), group_size=32)
    assert report.unmapped_bytes == 32 * 4 and f"{path} (deleted)" not in _mapped_paths()
    assert np.array_equal(norm.weight.detach().numpy(), values[:32])


def _resident_kb(path: Path) -> int:
    """This process's resident kB of its mappings of ``path`` (/proc/self/smaps)."""
    rss, current = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if not parts[0].endswith(":"):
            current = parts[5] if len(parts) >= 6 else ""
        elif parts[0] == "Rss:" and current == str(path):
            rss += int(parts[1])
    return rss


def test_dropped_pages_of_a_mapped_file_leave_it_readable(tmp_path: Path) -> None:
    """drop_file_pages: the pages read are no longer resident, and reading the mapping again gives the same bytes."""
    from hal_core.torch._release import drop_file_pages

    path = (tmp_path / "read.bin").resolve()
    values = np.random.default_rng(10).standard_normal(1 << 20).astype(np.float32)
    values.tofile(path)
    mapping = np.memmap(path, dtype=np.float32, mode="r")
    assert float(mapping.sum(dtype=np.float64)) == float(values.sum(dtype=np.float64))  # every page read
    assert _resident_kb(path) >= 3 * 1024
    assert drop_file_pages({str(path)}) >= values.nbytes
    assert _resident_kb(path) == 0
    assert np.array_equal(mapping, values)
    assert drop_file_pages({str(tmp_path / "other.bin")}) == 0  # not mapped: nothing advised
