"""``hal bench --model``: a tiny random Llama end to end through the CLI (each contender in its own process), the
decode-limit arithmetic against an independent count, the GPTQ export of the quantized checkpoints, bad options."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

from hal_core.bench import BenchArgumentError  # noqa: E402
from hal_core.bench._machine import allocator  # noqa: E402
from hal_core.bench._model_spec import BUILTIN_MODELS, resolve_contenders, resolve_model  # noqa: E402
from hal_core.bench._model_worker import _gptq_tensors  # noqa: E402
from hal_core.bench._worker_common import prompt_array  # noqa: E402
from hal_core.cli import main  # noqa: E402
from hal_core.quant import from_gptq, quantize, unpack_int4  # noqa: E402

PROMPT, NEW, BATCHES = 24, 5, (1, 3)
CONTENDERS = ("sdpa-fp32", "hal-fp32", "hal-int4", "hal-int4-k", "engine-int4", "engine-int4-a8")
INT4 = ("hal-int4", "hal-int4-k", "engine-int4", "engine-int4-a8")


def _reference_tokens(seed: int, ids: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the tiny model in float64, every step a full forward over the whole sequence (no cache)."""
    config = dict(BUILTIN_MODELS["tiny"])
    config.pop("model_type")
    torch.manual_seed(seed)  # the model the fp32 contenders build: transformers' own init after this seed
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config), dtype=torch.float32,
                                                          attn_implementation="eager").double().eval()
    tokens = ids.clone()
    with torch.no_grad():
        for _ in range(new_tokens + 1):
            nxt = model(input_ids=tokens).logits[:, -1].argmax(-1)
            tokens = torch.cat([tokens, nxt[:, None]], 1)
    return tokens[:, ids.shape[1]:].tolist()


def _weight_bytes(model: torch.nn.Module, bits: int | None, size: int, group: int) -> int:
    """Bytes of every weight but the embedding, counted from the model's own modules."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            k, n = module.in_features, module.out_features
            layer_bits = 8 if bits is not None and name == "lm_head" else bits  # quantize_model's int8 lm_head
            total += (k * n * layer_bits // 8 + (k // group) * n * 2) if layer_bits else k * n * size
        elif hasattr(module, "weight") and "norm" in type(module).__name__.lower():
            total += module.weight.numel() * size
    return total


def _limit(report: dict[str, Any], bits: int | None, size: int, batch: int) -> float:
    """Decode tokens/s at the copy bandwidth: the weights once per step, plus per sequence its embedding row and
    keys and values over prompt + i positions at step i."""
    config = dict(BUILTIN_MODELS["tiny"])
    config.pop("model_type")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config))
    weights = _weight_bytes(model, bits, size, 128)
    c = model.config
    per_position = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * size
    total = sum(weights + batch * (c.hidden_size * size + per_position * (PROMPT + i)) for i in range(1, NEW + 1))
    return batch * NEW / (total / (report["limits"]["copy"]["gbps"] * 1e9))


def test_tiny_model_end_to_end(tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]) -> None:
    seed = int(rng.integers(0, 2**31))
    print(f"model seed {seed}")
    out = tmp_path / "model.json"
    code = main(["bench", "--model", "tiny", "--contenders", ",".join(CONTENDERS), "--prompt-len", str(PROMPT),
                 "--new-tokens", str(NEW), "--batches", ",".join(map(str, BATCHES)), "--seed", str(seed),
                 "--threads", "2", "--quick", "--json", str(out), "-q"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["schema"] == "hal-bench-model/1"
    assert report["model"]["name"] == "tiny" and report["model"]["config"]["hidden_size"] == 256
    assert report["settings"] == {"prompt_len": PROMPT, "new_tokens": NEW, "batches": list(BATCHES), "repeat": 1,
                                  "threads": 2, "seed": seed, "group_size": 128, "copy_bytes": 32 << 20}
    by_name = {c["name"]: c for c in report["contenders"]}
    assert list(by_name) == list(CONTENDERS)
    for name, c in by_name.items():
        assert "error" not in c, c
        assert c["threads"] == 2
        assert c["prefill"]["tokens_per_s"] == pytest.approx(PROMPT / float(np.median(c["prefill"]["seconds"])))
        assert c["ttft_s"] >= min(c["prefill"]["seconds"])
        # Linux syncs each thread's resident-page counts into the process's lazily (64 page faults at a
        # time): two readings taken apart may disagree by a few pages, so every order allows 1 MiB
        slack = 1 << 20
        memory = c["memory"]
        assert 0 < memory["peak_anon_bytes"] <= memory["peak_rss_bytes"] + slack
        marks = [memory["load_peak_rss_bytes"],
                 *(memory["peak_after_batch"][str(b)]["peak_rss_bytes"] for b in BATCHES), memory["peak_rss_bytes"]]
        assert all(a <= b + slack for a, b in itertools.pairwise(marks))
        # 2 layers x 7 linear layers and the int8 lm_head; the engine joins q/k/v and gate/up: 2 x 4 + 1
        layers = {"hal-int4": 15, "hal-int4-k": 15, "engine-int4": 9, "engine-int4-a8": 9}
        assert c["quantized_layers"] == layers.get(name, 0)
        for batch in BATCHES:
            d = c["decode"][str(batch)]
            assert d["tokens_per_s"] == pytest.approx(batch * NEW / float(np.median(d["seconds"])))
            bits, size = (4, 2) if name in INT4 else (None, 4)
            assert d["limit_tokens_per_s"] == pytest.approx(_limit(report, bits, size, batch), rel=1e-12)
            assert d["ratio_limit"] == pytest.approx(d["tokens_per_s"] / d["limit_tokens_per_s"])
            tokens = np.array(c["tokens"][str(batch)])
            assert tokens.shape == (batch, NEW + 1) and tokens.min() >= 0 and tokens.max() < 512
    # greedy fp32 through hal's attention and paged cache = through transformers' sdpa = float64 without a cache
    prompts = torch.from_numpy(prompt_array(512, max(BATCHES), PROMPT, seed + 1))
    for batch in BATCHES:
        expected = _reference_tokens(seed, prompts[:batch], NEW)
        assert by_name["sdpa-fp32"]["tokens"][str(batch)] == expected
        assert by_name["hal-fp32"]["tokens"][str(batch)] == expected
    targets = {t["ratio"]: t for t in report["targets"]}
    scaling = targets["int4 decode batch 3 / int4 decode batch 1"]
    int4 = by_name["hal-int4"]["decode"]
    assert scaling["value"] == pytest.approx(int4["3"]["tokens_per_s"] / int4["1"]["tokens_per_s"])
    assert scaling["met"] == (scaling["value"] >= 3.0)
    assert targets["int4 prefill / sdpa bf16 prefill"]["met"] is None  # sdpa-bf16 did not run
    memory = targets["sdpa fp32 peak memory / int4 peak memory (target: int4 <= 0.3x fp32)"]
    assert memory["value"] == pytest.approx(by_name["sdpa-fp32"]["memory"]["peak_rss_bytes"]
                                            / by_name["hal-int4"]["memory"]["peak_rss_bytes"])
    for name in CONTENDERS:
        assert name in printed
    assert "decode limit" in printed and "targets" in printed
    assert report["machine"]["allocator"]["name"] in ("libc", "jemalloc", "tcmalloc", "mimalloc")
    assert f"C allocator {report['machine']['allocator']['name']}" in printed


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_export_reads_back(bits: int, rng: np.random.Generator) -> None:
    k, n, group = 256, 48, 64
    weight = quantize(rng.standard_normal((k, n)).astype(np.float32), bits=bits, group_size=group, symmetric=True,
                      scale_dtype=np.float16)
    stored = {name: t.numpy() for name, t in _gptq_tensors(weight).items()}
    per_word = 32 // bits
    mask = (1 << bits) - 1
    words = stored["qweight"].view(np.uint32)
    assert words.shape == (k // per_word, n)
    codes = np.stack([(words >> (bits * j)) & mask for j in range(per_word)], axis=1).reshape(k, n)
    zero_words = stored["qzeros"].view(np.uint32)
    assert zero_words.shape == (k // group, n // per_word)
    zeros = np.stack([(zero_words >> (bits * j)) & mask for j in range(per_word)], axis=2).reshape(k // group, n)
    original = unpack_int4(np.asarray(weight.qweight)) if bits == 4 else np.asarray(weight.qweight)
    np.testing.assert_array_equal(codes, original)
    np.testing.assert_array_equal(zeros + 1, 1 << (bits - 1))  # v1 stores the zero point minus one
    np.testing.assert_array_equal(stored["g_idx"], np.arange(k) // group)
    back = from_gptq(stored["qweight"], stored["qzeros"], stored["scales"], stored["g_idx"], bits=bits)
    assert back.zeros is None and back.g_idx is None and back.group_size == group
    np.testing.assert_array_equal(np.asarray(back.qweight), np.asarray(weight.qweight))
    np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(weight.scales))


def test_model_from_a_config_path(tmp_path: Path) -> None:
    config = {**BUILTIN_MODELS["1b"], "num_hidden_layers": 3, "quantization_config": {"quant_method": "gptq"},
              "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for given in (tmp_path, tmp_path / "config.json"):
        spec = resolve_model(str(given))
        assert spec.layers == 3 and spec.head_size == 128 and spec.kv_heads == 4
        assert "quantization_config" not in spec.config and "architectures" not in spec.config
    # the 1b size: 16 layers of hidden 2048, MLP 5632, GQA 16/4, vocabulary 32000, untied
    layer = 2048 * 2048 * 2 + 2 * 2048 * 512 + 3 * 2048 * 5632 + 2 * 2048
    assert resolve_model("1b").parameters() == 16 * layer + 2048 + 2 * 32000 * 2048


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "nope"], "argument --model: 'nope' is neither a built-in size"),
    (["--model", "tiny", "--contenders", "sdpa-fp32,vllm"], "argument --contenders: unknown 'vllm'"),
    (["--model", "tiny", "--batches", "1,x"], "argument --batches"),
    (["--model", "tiny", "--prompt-len", "0"], "argument --prompt-len: expected >= 1, got 0"),
    (["--model", "tiny", "--prompt-len", "2040", "--new-tokens", "64"], "max_position_embeddings=2048"),
    (["--model", "tiny", "--group-size", "96"], "argument --group-size"),
    (["--model", "tiny", "--op", "quantized_gemm"], "--op, --shape and --preset"),
])
def test_bad_options_are_refused_before_any_run(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *argv, "-q"]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_not_a_llama_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    with pytest.raises(BenchArgumentError, match=r"argument --model: .*model_type 'gpt2' is not a Llama"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(BenchArgumentError, match="missing or not a positive integer: vocab_size"):
        resolve_model(str(tmp_path))
    assert [c.name for c in resolve_contenders("hal-int4,sdpa-bf16")] == ["sdpa-bf16", "hal-int4"]


def test_missing_transformers_is_named(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name))
    assert main(["bench", "--model", "tiny", "-q"]) == 2
    assert "pip install 'hal-core[torch]' transformers" in capsys.readouterr().err


def test_targets_are_ratios_of_the_results(rng: np.random.Generator) -> None:
    from hal_core.bench._model import model_targets

    a, b, c, d, e, f, g = (float(x) for x in rng.uniform(0.5, 5.0, size=7))
    results = {"hal-int4": {"decode": {"1": {"tokens_per_s": a, "ratio_limit": b}, "8": {"tokens_per_s": c}},
                            "prefill": {"tokens_per_s": d}, "memory": {"peak_rss_bytes": e}},
               "sdpa-bf16": {"decode": {"1": {"tokens_per_s": f}}, "prefill": {"tokens_per_s": g}}}
    got = {t["ratio"]: t for t in model_targets(results, [1, 8])}
    expected = {"int4 decode batch 1 / its decode limit": (b, 0.6),
                "int4 decode batch 1 / sdpa bf16 decode batch 1": (a / f, 2.5),
                "int4 decode batch 8 / int4 decode batch 1": (c / a, 3.0),
                "int4 prefill / sdpa bf16 prefill": (d / g, 1.0)}
    for label, (value, target) in expected.items():
        assert got[label]["value"] == pytest.approx(value) and got[label]["target"] == target
        assert got[label]["met"] == (value >= target)
    memory = next(t for t in got.values() if "memory" in t["ratio"])
    assert memory["value"] is None and memory["met"] is None  # sdpa-fp32 did not run
    only_one = {t["ratio"]: t for t in model_targets(results, [1])}
    assert only_one["int4 decode batch 1 / int4 decode batch 1"]["value"] is None


def test_the_w4a8_contender_loads_the_int4_checkpoint_with_int8_activations(tmp_path) -> None:
    """hal-int4 runs the int4 checkpoint as load_quantized gives it (activations='auto'), hal-int4-a8 with every
    QuantLinear's activations='int8', hal-int4-a16 with 'float'."""
    import dataclasses

    from hal_core.bench._model_spec import CONTENDERS as ALL
    from hal_core.bench._model_worker import _load
    from hal_core.torch import QuantLinear, quantize_model, save_quantized

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    quantize_model(model, bits=4, group_size=32, skip="lm_head")
    save_quantized(model, tmp_path / "int4")
    for name, expected in (("hal-int4-a8", "int8"), ("hal-int4", "auto"), ("hal-int4-a16", "float")):
        loaded = _load({"contender": dataclasses.asdict(ALL[name]), "checkpoint": str(tmp_path / "int4")})
        layers = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 7 and {m.activations for m in layers} == {expected}


def test_the_compiled_contender_compiles_before_the_timed_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """hal-int4-c (its backend set to aot_eager here: inductor takes too long for a test) decodes hal-int4's tokens
    at every batch, reports its untimed compiling round, and compiles nothing in the timed rounds."""
    import dataclasses

    from hal_core.bench._model_spec import CONTENDERS as ALL

    monkeypatch.setitem(ALL, "hal-int4-c", dataclasses.replace(ALL["hal-int4-c"], compile="aot_eager"))
    out = tmp_path / "model.json"
    code = main(["bench", "--model", "tiny", "--contenders", "hal-int4,hal-int4-c", "--prompt-len", "20",
                 "--new-tokens", "4", "--batches", "1,3", "--seed", "5", "--threads", "2", "--quick", "--json",
                 str(out), "-q"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    by_name = {c["name"]: c for c in report["contenders"]}
    eager, compiled = by_name["hal-int4"], by_name["hal-int4-c"]
    assert "error" not in compiled, compiled
    assert compiled["tokens"] == eager["tokens"]
    assert compiled["compile"] == "aot_eager" and compiled["compile_s"] > 0
    assert compiled["compiled_graphs"] > 0 and compiled["compiled_graphs_timed"] == 0
    assert eager["compile"] is None and "compile_s" not in eager
    target = next(t for t in report["targets"] if t["ratio"] == "int4 compiled decode batch 1 / int4 decode batch 1")
    assert target["value"] == pytest.approx(compiled["decode"]["1"]["tokens_per_s"]
                                            / eager["decode"]["1"]["tokens_per_s"])
    line = f"hal-int4-c  aot_eager: {compiled['compile_s']:.1f} s, {compiled['compiled_graphs']} graph(s); 0 compiled"
    assert line in printed


def test_the_record_names_the_c_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak memory depends on the C allocator (docs/cpu.md): the record names it and the variables that change
    it; a preloaded jemalloc is recognised in a child process."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_UNRELATED", "1")
    found = allocator()
    assert found["env"]["MALLOC_MMAP_THRESHOLD_"] == "131072" and "MALLOC_UNRELATED" not in found["env"]
    assert found["name"] in ("libc", "jemalloc", "tcmalloc", "mimalloc")
    library = next((p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/"
                                "libjemalloc.so.2") if Path(p).exists()), None)
    if library is None:
        pytest.skip("no libjemalloc.so.2 on this machine to preload (Debian: libjemalloc2)")
    out = subprocess.run([sys.executable, "-c", "import json; from hal_core.bench._machine import allocator; "
                          "print(json.dumps(allocator()))"], env={**os.environ, "LD_PRELOAD": library},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    child = json.loads(out)
    assert child["name"] == "jemalloc" and child["env"]["LD_PRELOAD"] == library
