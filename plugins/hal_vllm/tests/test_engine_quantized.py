"""GPTQ and AWQ checkpoints through vLLM on CPU: every int4 linear layer on hal, the tokens of vLLM's own kernel.

Each checkpoint (a small fp16 Llama, random weights quantized to 4 bits in
groups of 32 and written in the format's own tensors by
:func:`vllm_engines.save_quantized_llama`) is served twice with hal's
attention (``HAL_VLLM=1``): once with vLLM's own CPU int4 kernel
(``VLLM_DISABLED_KERNELS=HalWNA16LinearKernel``, which takes hal's kernel out
of vLLM's list; vLLM then picks its ``CPUWNA16LinearKernel``, fp16 being
W4A16 there) and once with hal's ``HalWNA16LinearKernel``. Both runs read
the same words, so they compute one model; they differ only in rounding
(fp16 activations, each kernel's accumulation order).

fp16, not bf16: with bf16 and chunked prefill, vLLM's own CPU kernels (which
take their AMX paths on a CPU that reports AMX) killed vLLM's worker with
SIGILL on the machines CI uses.

vLLM's CPU build for a CPU without AVX-512 has no int4 kernel of its own
(:func:`vllm_engines.vllm_has_cpu_int4_kernel`): there only hal's side is
served and checked, and the token comparison is skipped, saying so.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from vllm_engines import (
    BLOCK_SIZE,
    HEAD_SIZE,
    PROJECTIONS,
    generate,
    prompt_logprobs,
    save_quantized_llama,
    tokens,
    vllm_has_cpu_int4_kernel,
)

#: Why the vLLM side is not served on this CPU, or None.
NO_VLLM_KERNEL = (None if vllm_has_cpu_int4_kernel() else
                  "vLLM's CPU build has no int4 kernel on this CPU (no cpu_gemm_wna16 in the build it loads without "
                  "AVX-512): there is no vLLM int4 path to compare with")

METHODS = ("gptq", "awq")


@pytest.fixture(scope="module", params=METHODS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           declared: Any) -> dict[str, Any]:
    """One checkpoint of the format, served with vLLM's int4 kernel (where vLLM has one here) and with hal's (one
    engine each)."""
    path = tmp_path_factory.mktemp(request.param)
    num_layers = save_quantized_llama(path, request.param)
    strict = declared("fp16", HEAD_SIZE, BLOCK_SIZE, {"prefill", "strided_cache"})
    # hal's int4 layers in W4A16, the arithmetic of vLLM's fp16 kernel (its default "auto" would take W4A8)
    env = {"HAL_VLLM": "1", "HAL_STRICT": "1" if strict else "0", "HAL_VLLM_INT4_ACTIVATIONS": "float"}
    runs: dict[str, Any] = {"vllm": None}
    sides = (("vllm", "HalWNA16LinearKernel"), ("hal", "")) if NO_VLLM_KERNEL is None else (("hal", ""),)
    for side, disabled in sides:
        outputs, (report,) = generate(path, env={**env, "VLLM_DISABLED_KERNELS": disabled}, dtype="float16")
        runs[side] = {"outputs": outputs, "report": report}
    return {"method": request.param, "num_layers": num_layers, **runs}


def test_every_int4_layer_runs_on_hal(served: dict[str, Any]) -> None:
    """With hal's kernel every quantized projection is hal's and hal's GEMM ran all of their calls; without it,
    every one is vLLM's CPU kernel and hal ran none (where vLLM has that kernel on this CPU)."""
    expected_layers = served["num_layers"] * PROJECTIONS
    hal = served["hal"]["report"]
    print(served["method"], "kernels: hal run", set(hal["linear"].values()))
    assert list(hal["linear"].values()) == ["HalWNA16LinearKernel"] * expected_layers
    if served["vllm"] is not None:
        vllm = served["vllm"]["report"]
        print(served["method"], "kernels: vLLM run", set(vllm["linear"].values()))
        assert list(vllm["linear"].values()) == ["CPUWNA16LinearKernel"] * expected_layers
        assert "quantized_gemm" not in vllm["stats"].get("cpu", {})
    else:
        print(NO_VLLM_KERNEL)
    gemm = hal["stats"]["cpu"]["quantized_gemm"]
    print("hal counters in the worker:", hal["stats"]["cpu"])
    assert gemm["calls"] > 0 and gemm["calls"] % expected_layers == 0
    assert gemm["implementations"] == {"cpu.quantized_gemm": gemm["calls"]} and not gemm["fallbacks"]


def test_tokens_equal_vllms_own_int4_kernel(served: dict[str, Any]) -> None:
    """hal's int4 GEMM generates vLLM's tokens and scores the prompts as vLLM's kernel does (within 0.01)."""
    if served["vllm"] is None:
        pytest.skip(NO_VLLM_KERNEL)
    expected, outputs = served["vllm"]["outputs"], served["hal"]["outputs"]
    print(served["method"], "vLLM's int4 kernel:", tokens(expected))
    print(served["method"], "hal:               ", tokens(outputs))
    assert tokens(outputs) == tokens(expected)
    difference = np.abs(prompt_logprobs(outputs) - prompt_logprobs(expected))
    print("prompt log-probability differences: max", difference.max(), "mean", difference.mean())
    assert difference.max() < 0.01
