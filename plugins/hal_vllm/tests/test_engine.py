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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vllm import LLM
from vllm_engines import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NEW_TOKENS,
    SavedModel,
    engine_options,
    generate,
    save_llama,
    save_qwen2_window,
    tokens,
)

MODELS: dict[str, Callable[[Path], SavedModel]] = {"llama-gqa": save_llama, "qwen2-window": save_qwen2_window}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    """A saved random-weight model (seeded)."""
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


def _run(path: Path, *, hal: bool, strict: bool = True) -> tuple[list[list[int]], dict[str, Any]]:
    """Generate on a fresh one-worker engine, with or without hal; the tokens and the worker's report."""
    outputs, (report,) = generate(path, env={"HAL_VLLM": "1" if hal else "0", "HAL_STRICT": "1" if strict else "0"})
    return tokens(outputs), report


def test_tokens_equal_vllms_own_attention_and_hal_served_every_call(model: SavedModel, declared: Any) -> None:
    """hal's attention gives vLLM's tokens, every layer is hal's, and hal ran every call (strict where declared)."""
    path, num_layers, window = model.path, model.num_layers, model.window
    strict = declared("fp32", HEAD_SIZE, BLOCK_SIZE, {"prefill", "strided_cache"} | ({"window"} if window else set()))
    expected, vllm_report = _run(path, hal=False)
    generated, hal_report = _run(path, hal=True, strict=strict)
    print("vLLM's CPU attention:", expected)
    print("hal:                 ", generated)
    assert all(len(t) == NEW_TOKENS for t in expected)
    assert generated == expected

    # Opted out, no layer is hal's and hal ran no attention; opted in, every layer is and hal ran every call.
    assert [layer["impl"] for layer in vllm_report["attention"].values()] == ["CPUAttentionBackendImpl"] * num_layers
    assert "paged_attention" not in vllm_report["stats"].get("cpu", {})
    layers = list(hal_report["attention"].values())
    assert layers == [{"impl": "HalAttentionImpl", "window": window, "heads": model.heads,
                       "kv_heads": model.kv_heads}] * num_layers
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
    path = save_llama(tmp_path_factory.mktemp("llama-gqa")).path
    monkeypatch.setenv("HAL_VLLM", "1")
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        LLM(**engine_options(path, kv_cache_dtype="fp8"))
    captured = capfd.readouterr()
    assert "hal-vllm cannot run this model: kv-cache dtype 'fp8'" in captured.out + captured.err
