"""load_quantized: GPTQ (v1, v2) and AWQ checkpoints of small random Llamas, against the float64 model.

The checkpoints are written by tests/quant_checkpoints.py (packers independent
of hal's converters). Each loaded model's logits are compared with the float64
model of the same quantized weights; loading allocates no float copy of a
quantized layer, and its peak memory stays far below the float model's.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
pytest.importorskip("safetensors", reason="safetensors is not installed (make test installs it)")

from quant_checkpoints import llama_config, reference_model, write_checkpoint  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import hal_core  # noqa: E402
from hal_core.torch import QuantLinear, checkpoint_format, load_quantized  # noqa: E402

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}

CASES = {  # name: (quantization_config, act_order, tie_word_embeddings, attention bias)
    "gptq-v1-int4-sym": (GPTQ, False, False, False),
    "gptq-v1-int4-zp-actorder": (GPTQ | {"sym": False, "desc_act": True}, True, True, False),
    "gptq-v2-int4-zp-g64": (GPTQ | {"sym": False, "group_size": 64, "checkpoint_format": "gptq_v2"}, False, False,
                            True),
    "gptq-v1-int4-per-column": (GPTQ | {"group_size": -1}, False, False, False),
    "gptq-v1-int8-sym": (GPTQ | {"bits": 8}, False, False, False),
    "gptq-v2-int8-zp-actorder": (GPTQ | {"bits": 8, "sym": False, "desc_act": True, "format": "gptq_v2",
                                         "checkpoint_format": None}, True, False, False),
    "awq-gemm": (AWQ, False, True, False),
    "awq-gemm-g64-bias": (AWQ | {"group_size": 64, "version": "GEMM"}, False, False, True),
}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(ids).logits.to(torch.float64).numpy()


class NoFloatCopies(TorchDispatchMode):
    """Fails on any op that makes a floating-point tensor of a quantized layer's weight shape (off meta)."""

    def __init__(self, shapes: set[tuple[int, int]]) -> None:
        super().__init__()
        self.shapes = shapes
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta"
                    and tuple(t.shape) in self.shapes):
                self.seen.append(f"{func} -> {t.dtype} {tuple(t.shape)}")
        return out


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_model_matches_the_float64_model_of_its_quantized_weights(case: str, tmp_path) -> None:
    """Every quantized layer becomes a QuantLinear with the checkpoint's bits; logits match float64."""
    quant, act_order, tie, bias = CASES[case]
    quant = {k: v for k, v in quant.items() if v is not None}
    seed = 300 + list(CASES).index(case)
    print(f"seed={seed}")
    config = llama_config(tie=tie, bias=bias)
    ckpt = write_checkpoint(tmp_path / case, config, quant, seed=seed, act_order=act_order,
                            shards=2 if tie else 1)
    shapes = {(layer.codes.shape[1], layer.codes.shape[0]) for layer in ckpt.layers.values()}
    shapes |= {layer.codes.shape for layer in ckpt.layers.values()}
    steps = []
    with NoFloatCopies(shapes) as watch:
        model = load_quantized(tmp_path / case, dtype=torch.float32, activations="float",
                               progress=lambda done, total, name: steps.append((done, total, name)))
    assert watch.seen == []
    assert [s[2] for s in steps] == list(ckpt.layers) and steps[-1][:2] == (len(ckpt.layers),) * 2

    bits = quant["bits"]
    for name, layer in ckpt.layers.items():
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear) and module.bits == bits
        assert module.name == name  # errors about its input name the layer
        assert (module.g_idx is not None) == act_order
        assert (module.bias is not None) == (name in ckpt.biases)
        assert np.array_equal(module.quantized_weight().dequantize(), layer.dequantized())
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert not any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))

    ids = torch.tensor(np.random.default_rng(seed).integers(0, config.vocab_size, (2, 11)))
    expected = _logits(reference_model(ckpt, w8a8=bits == 8), ids)
    got = _logits(model, ids)
    # fp32 activations against float64 (int4); int8 adds the rare flip of an activation code at a rounding tie
    tol = 2e-4 if bits == 4 else 5e-3
    assert np.abs(got - expected).max() <= tol * np.abs(expected).max()


def test_fp16_model_and_hal_attention_generate(tmp_path) -> None:
    """dtype='auto' takes the config's fp16; attn_implementation='hal' with a HalPagedCache generates."""
    import hal_core.torch.transformers as hal_hf

    ckpt = write_checkpoint(tmp_path / "ckpt", llama_config(), GPTQ, seed=41)
    model = load_quantized(tmp_path / "ckpt", attn_implementation=hal_hf.ATTN_IMPLEMENTATION, activations="float")
    assert model.dtype == torch.float16 and model.model.embed_tokens.weight.dtype == torch.float16
    ids = torch.tensor(np.random.default_rng(41).integers(0, 128, (2, 6)))
    cache = hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8, dtype=torch.float16)
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    cache.close()
    reference = reference_model(ckpt)
    with torch.no_grad():
        expected = reference(out.sequences[:, :-1]).logits[:, ids.shape[1] - 1:]
    got = torch.stack(out.logits, dim=1).double()
    assert np.abs((got - expected).numpy()).max() <= 1e-2 * expected.abs().max().item()


# -- refused variants: the error names the config key ----------------------------------------------


@pytest.mark.parametrize(("quant", "match"), [
    ({"quant_method": "exl2", "bits": 4}, r"quantization_config\.quant_method.*'exl2'"),
    (GPTQ | {"bits": 3}, r"quantization_config\.bits.*3"),
    (GPTQ | {"bits": 2}, r"quantization_config\.bits"),
    (GPTQ | {"checkpoint_format": "marlin"}, r"quantization_config\.checkpoint_format.*'marlin'"),
    (GPTQ | {"checkpoint_format": None, "format": "bitblas"}, r"quantization_config\.checkpoint_format.*bitblas"),
    (GPTQ | {"group_size": 0}, r"quantization_config\.group_size"),
    (GPTQ | {"bits": "4"}, r"quantization_config\.bits"),
    (GPTQ | {"desc_act": "yes"}, r"quantization_config\.desc_act"),
    (AWQ | {"version": "gemv"}, r"quantization_config\.version.*'gemv'"),
    (AWQ | {"version": "gemv_fast"}, r"quantization_config\.version"),
    (AWQ | {"version": "exllama"}, r"quantization_config\.version"),
    (AWQ | {"bits": 8}, r"quantization_config\.bits"),
    (AWQ | {"zero_point": False}, r"quantization_config\.zero_point"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_variants_are_refused_naming_the_key(quant: dict, match: str) -> None:
    with pytest.raises(hal_core.CheckpointError, match=match):
        checkpoint_format({k: v for k, v in quant.items() if v is not None})


def test_act_order_without_g_idx_is_refused_before_reading(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path / "c", llama_config(), GPTQ | {"desc_act": True, "sym": False}, seed=3,
                     act_order=True)
    tensors = {k: v for k, v in load_file(tmp_path / "c" / "model.safetensors").items()
               if not k.endswith("layers.1.mlp.up_proj.g_idx")}
    save_file(tensors, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(hal_core.CheckpointError, match=r"desc_act.*model\.layers\.1\.mlp\.up_proj.*g_idx"):
        load_quantized(tmp_path / "c")


@pytest.mark.parametrize(("drop", "match"), [
    ("model.layers.0.self_attn.k_proj.scales", r"k_proj.*no model\.layers\.0\.self_attn\.k_proj\.scales"),
    ("model.norm.weight", r"no tensor for model\.norm\.weight"),
])
def test_missing_tensors_are_named(tmp_path, drop: str, match: str) -> None:
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path / "c", llama_config(), GPTQ, seed=4)
    file = tmp_path / "c" / "model.safetensors"
    save_file({k: v for k, v in load_file(file).items() if k != drop}, str(file))
    with pytest.raises(hal_core.CheckpointError, match=match):
        load_quantized(tmp_path / "c")


def test_group_size_that_does_not_match_the_tensors_is_refused(tmp_path) -> None:
    write_checkpoint(tmp_path / "c", llama_config(), GPTQ, seed=5)
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    with pytest.raises(hal_core.CheckpointError, match=r"quantization_config\.group_size is 64"):
        load_quantized(tmp_path / "c")


def test_path_without_a_quantized_config_is_refused(tmp_path) -> None:
    with pytest.raises(hal_core.CheckpointError, match="'path'"):
        load_quantized(tmp_path)
    config = llama_config()
    config.save_pretrained(tmp_path)
    with pytest.raises(hal_core.CheckpointError, match="no quantization_config"):
        load_quantized(tmp_path)


def test_unused_checkpoint_tensors_are_logged(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path / "c", llama_config(), AWQ, seed=6)
    file = tmp_path / "c" / "model.safetensors"
    save_file(load_file(file) | {"model.extra.weight": torch.zeros(3)}, str(file))
    with caplog.at_level(logging.WARNING, logger="hal"):
        load_quantized(tmp_path / "c")
    assert "model.extra.weight" in caplog.text


# -- peak memory ---------------------------------------------------------------------------------------

MEASURE = textwrap.dedent("""
    import json, sys, torch, transformers
    import hal_core.torch
    from hal_core.torch import load_quantized

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    config = transformers.AutoConfig.from_pretrained(sys.argv[1])
    with torch.device("meta"):  # import the model's modules before measuring
        transformers.AutoModelForCausalLM.from_config(config)
    load_quantized(sys.argv[2], dtype=torch.float32)  # warm: hal's kernels library, lazy imports
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    model = load_quantized(sys.argv[1], dtype=torch.float32)
    print(json.dumps({"growth": status("VmHWM:") - before,
                      "held": sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))}))
""")


def test_loading_peak_memory_stays_far_below_the_float_model(tmp_path) -> None:
    """Peak RSS growth while loading (a fresh process) is under half the float weights of the quantized layers.

    It is the packed weights held, the checkpoint's mapped pages (both about 1/8 of the fp32 weights) and one
    layer's conversion; a loader that made the float weights, even one at a time into the model, would exceed it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here (/proc/self/clear_refs: {exc}); Linux only")
    config = llama_config(hidden=256, intermediate=768, layers=8, vocab=256)
    ckpt = write_checkpoint(tmp_path / "big", config, GPTQ | {"group_size": 128}, seed=8)
    write_checkpoint(tmp_path / "small", llama_config(), GPTQ, seed=9)
    float_bytes = 4 * sum(layer.codes.size for layer in ckpt.layers.values())  # fp32, the dtype it loads in
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "big"), str(tmp_path / "small")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"float weights of the quantized layers {float_bytes / 1e6:.1f} MB; loaded model holds "
          f"{result['held'] / 1e6:.1f} MB; peak RSS growth while loading {result['growth'] / 1e6:.1f} MB")
    assert result["held"] < float_bytes / 4
    assert result["growth"] < float_bytes / 2

