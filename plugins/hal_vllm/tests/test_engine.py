"""vLLM end to end on hal: the tokens of vLLM's own CPU attention, every attention call through hal.

Small random-weight models are built locally with transformers (a config
and seeded random weights saved to a temporary folder; nothing is
downloaded): Llama with grouped-query attention, and Qwen2 with one KV head
and a sliding window shorter than the prompts. Each runs a batch of prompts
of different lengths with chunked prefill in small chunks (so prompt chunks
and decodes share steps), greedy sampling, fp32, once on vLLM's own CPU
backend and once with ``HAL_VLLM=1``, each in vLLM's usual processes (front
end, engine core, worker). hal's counters are read in the worker through
:class:`hal_vllm.worker.HalWorkerExtension`. Where the host hal backend
declares every variant of the model's attention calls (mixed prompt and
decode batches, vLLM's strided cache halves, the window) the hal run is
strict (``HAL_STRICT=1``: any fallback is an error) and none may fall back;
where it does not, those calls run on hal's fallback path, and the tokens
must still be vLLM's.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

PROMPT_LENGTHS = (3, 17, 50, 90, 130)
HEAD_SIZE, BLOCK_SIZE = 32, 32  # of every model here
NEW_TOKENS = 12
VOCAB = 256
SEED = 1234


def _llama(path: Path) -> tuple[int, int | None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_SIZE, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(path)
    return config.num_hidden_layers, None


def _qwen2_window(path: Path) -> tuple[int, int | None]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=24, max_window_layers=0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return config.num_hidden_layers, config.sliding_window


MODELS = {"llama-gqa": _llama, "qwen2-window": _qwen2_window}

GPTQ_GROUP = 32


def _llama_gptq(path: Path) -> int:
    """An fp16 Llama whose projections are a GPTQ checkpoint (4-bit, symmetric, v1 zero points, groups of 32)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from hal_core.quant import quantize

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_SIZE, max_position_embeddings=512,
                         dtype="float16")
    tensors = {}
    for name, tensor in LlamaForCausalLM(config).state_dict().items():
        if not name.endswith("_proj.weight"):
            tensors[name] = tensor.to(torch.float16).contiguous()
            continue
        weight = quantize(tensor.T.double().numpy(), bits=4, group_size=GPTQ_GROUP, symmetric=True)
        k, n = weight.shape
        base = name.removesuffix(".weight")
        tensors[f"{base}.qweight"] = torch.from_numpy(weight.qweight.view(np.int32).copy())  # GPTQ's packing is hal's
        tensors[f"{base}.qzeros"] = torch.full((k // GPTQ_GROUP, n // 8), 0x77777777, dtype=torch.int32)  # z - 1
        tensors[f"{base}.scales"] = torch.from_numpy(weight.scales.astype(np.float16))
        tensors[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // GPTQ_GROUP
    save_file(tensors, str(path / "model.safetensors"))
    saved = config.to_dict()
    saved["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False,
                                    "sym": True}
    (path / "config.json").write_text(json.dumps(saved))
    return config.num_hidden_layers


def _saved(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int | None]:
    torch.manual_seed(SEED)
    path = tmp_path_factory.mktemp(name)
    return (path, *MODELS[name](path))


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int | None]:
    """A saved random-weight model (seeded), its number of layers and its sliding window."""
    return _saved(request.param, tmp_path_factory)


def _prompts() -> list[TokensPrompt]:
    rng = np.random.default_rng(SEED)
    return [TokensPrompt(prompt_token_ids=rng.integers(1, VOCAB, n).tolist()) for n in PROMPT_LENGTHS]


def _engine(path: Path, **overrides: Any) -> LLM:
    options: dict[str, Any] = dict(
        model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
        enable_chunked_prefill=True, max_num_batched_tokens=32, block_size=BLOCK_SIZE, kv_cache_memory_bytes=32 << 20,
        seed=SEED, worker_extension_cls="hal_vllm.worker.HalWorkerExtension",
    )
    options.update(overrides)
    return LLM(**options)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Generate greedily on a fresh engine, with or without hal; returns the tokens and the worker's report."""

    def generate(path: Path, *, hal: bool, strict: bool = True, **options: Any) -> tuple[list[Any], dict[str, Any]]:
        monkeypatch.setenv("HAL_VLLM", "1" if hal else "0")  # the engine's processes inherit it
        monkeypatch.setenv("HAL_STRICT", "1" if strict else "0")
        llm = _engine(path, **options)
        try:
            outputs = llm.generate(_prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                              detokenize=False, prompt_logprobs=0))
            (report,) = llm.collective_rpc("hal_stats")
        finally:
            llm.llm_engine.engine_core.shutdown()  # its processes end now, not when the object is collected
            del llm
            gc.collect()
        return outputs, report

    yield generate


def _tokens(outputs: list[Any], report: dict[str, Any]) -> tuple[list[list[int]], dict[str, Any]]:
    return [list(o.outputs[0].token_ids) for o in outputs], report


def _prompt_logprobs(outputs: list[Any]) -> np.ndarray:
    """The log-probability each run gave every prompt token after the first."""
    return np.array([next(iter(step.values())).logprob for o in outputs for step in o.prompt_logprobs[1:]])


def test_tokens_equal_vllms_own_attention_and_hal_served_every_call(model: tuple[Path, int, int | None],
                                                                   run: Any, declared: Any) -> None:
    path, num_layers, window = model
    strict = declared("fp32", HEAD_SIZE, BLOCK_SIZE, {"prefill", "strided_cache"} | ({"window"} if window else set()))
    expected, vllm_report = _tokens(*run(path, hal=False))
    tokens, hal_report = _tokens(*run(path, hal=True, strict=strict))
    print("vLLM's CPU attention:", expected)
    print("hal:                 ", tokens)
    assert all(len(t) == NEW_TOKENS for t in expected)
    assert tokens == expected

    # Opted out, no layer is hal's and hal ran no attention; opted in, every layer is and hal ran every call.
    assert [layer["impl"] for layer in vllm_report["attention"].values()] == ["CPUAttentionBackendImpl"] * num_layers
    assert "paged_attention" not in vllm_report["stats"].get("cpu", {})
    layers = list(hal_report["attention"].values())
    assert layers == [{"impl": "HalAttentionImpl", "window": window}] * num_layers
    ops = hal_report["stats"]["cpu"]
    attention, writes = ops["paged_attention"], ops["write_kv_cache"]
    print("hal counters in the worker:", ops)
    assert attention["calls"] == writes["calls"] > 0
    assert attention["calls"] % num_layers == 0
    assert writes["implementations"] == {"cpu.write_kv_cache": writes["calls"]} and not writes["fallbacks"]
    if strict:
        assert attention["implementations"] == {"cpu.paged_attention": attention["calls"]}
        assert not attention["fallbacks"]
    else:  # what the backend does not declare ran on hal's fallback path, as its declaration says
        assert attention["fallbacks"]
        assert sum(attention["fallbacks"].values()) == attention["calls"] - attention["implementations"].get(
            "cpu.paged_attention", 0)


def test_fp8_kv_cache_is_refused_at_start_up(tmp_path_factory: pytest.TempPathFactory,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    """A feature hal lacks stops the engine while it loads the model, with hal-vllm's reason in the worker's log."""
    path, _, _ = _saved("llama-gqa", tmp_path_factory)
    monkeypatch.setenv("HAL_VLLM", "1")
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        _engine(path, kv_cache_dtype="fp8")
    captured = capfd.readouterr()
    assert "hal-vllm cannot run this model: kv-cache dtype 'fp8'" in captured.out + captured.err


def test_gptq_model_runs_its_linear_layers_on_hal(tmp_path: Path, run: Any, declared: Any) -> None:
    """A GPTQ checkpoint in fp16: hal's W4A16 GEMM serves every projection, and the model scores the prompts as
    vLLM's own int4 kernel does (fp16 rounding apart: the prompts' log-probabilities within 0.01).

    fp16, not bf16: with bf16 and chunked prefill, the reference side (vLLM's own CPU kernels, which take
    their AMX paths on a CPU that reports AMX) killed vLLM's worker with SIGILL on the machines CI uses."""
    num_layers = _llama_gptq(tmp_path)
    strict = declared("fp16", HEAD_SIZE, BLOCK_SIZE, {"prefill", "strided_cache"})
    expected, _ = run(tmp_path, hal=False, dtype="float16")
    outputs, report = run(tmp_path, hal=True, strict=strict, dtype="float16")
    difference = np.abs(_prompt_logprobs(outputs) - _prompt_logprobs(expected))
    print("prompt log-probability differences: max", difference.max(), "mean", difference.mean())
    assert difference.max() < 0.01
    gemm = report["stats"]["cpu"]["quantized_gemm"]
    print("hal counters in the worker:", report["stats"]["cpu"])
    projections = 4  # per layer: fused QKV, output, fused gate/up, down
    assert gemm["calls"] > 0 and gemm["calls"] % (num_layers * projections) == 0
    assert gemm["implementations"] == {"cpu.quantized_gemm": gemm["calls"]} and not gemm["fallbacks"]
