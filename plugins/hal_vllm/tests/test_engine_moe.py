"""GPTQ and AWQ mixture-of-experts models through vLLM on CPU: every MoE layer on hal's ``fused_moe``.

vLLM 0.32's CPU build has no int4 MoE kernel on a CPU without AMX (its
``CPUExpertsInt4`` needs AMX, its zentorch one needs zentorch): loading a
GPTQ or AWQ MoE checkpoint stops with "No WNA16 MoE backend supports the
deployment configuration". With ``HAL_VLLM=1`` hal's methods serve those layers.

The reference is vLLM's own path on the dense twin of the checkpoint (each
projection dequantized: the model the GPTQ words describe, rounded to fp16;
:mod:`vllm_moe_models`), served with hal's attention too, so the two runs
differ only in the projections' and experts' kernels: hal's W4A16 int4
ones (``HAL_VLLM_INT4_ACTIVATIONS=float``) against vLLM's fp16 ones. fp16, as
in :mod:`test_engine_quantized`. A GPTQ Mixtral and an AWQ one, and a GPTQ
Qwen3-MoE (another routing), are compared so; the GPTQ Mixtral is also
served compiled (vLLM's default, ``torch.compile``), where hal's layers are
the operator ``torch.ops.hal_vllm.fused_moe``, and with two tensor-parallel
ranks.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm_engines import BLOCK_SIZE, HEAD_SIZE, first_divergence, generate, prompt_logprobs, tokens
from vllm_moe_models import LAYERS, save_moe_checkpoints

#: hal's method for each checkpoint format's MoE layers.
METHODS = {"gptq": "HalGPTQMoEMethod", "awq": "HalAWQMoEMethod"}
#: (architecture, format) of the models served: Mixtral routes softmax, top-k, renormalised (vLLM's
#: RenormalizeNaive), Qwen3-MoE with norm_topk_prob=False without the renormalisation (vLLM's Default).
MODELS = (("mixtral", "gptq"), ("mixtral", "awq"), ("qwen3_moe", "gptq"))


def _env(declared: Any, **more: str) -> dict[str, str]:
    strict = declared("fp16", HEAD_SIZE, BLOCK_SIZE, {"prefill", "strided_cache"})
    return {"HAL_VLLM": "1", "HAL_STRICT": "1" if strict else "0", "HAL_VLLM_INT4_ACTIVATIONS": "float", **more}


@pytest.fixture(scope="module", params=MODELS, ids=["-".join(m) for m in MODELS])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, declared: Any) -> dict[str, Any]:
    """The architecture's int4 model in the format, served with hal's MoE method, and its dense twin served with
    vLLM's own MoE."""
    arch, method = request.param
    quantized, dense = save_moe_checkpoints(tmp_path_factory.mktemp("moe"), method, arch=arch)
    runs: dict[str, Any] = {"method": METHODS[method]}
    for side, path in (("hal", quantized), ("dense", dense)):
        outputs, (report,) = generate(path, env=_env(declared), dtype="float16", logprobs=2)
        runs[side] = {"outputs": outputs, "report": report}
    return runs


def test_every_moe_layer_runs_on_hal(served: dict[str, Any]) -> None:
    """Each of the quantized model's MoE layers has hal's method and hal's ``fused_moe`` ran all their calls on its
    kernel; the dense model's layers are vLLM's and hal ran none of them."""
    hal, dense = served["hal"]["report"], served["dense"]["report"]
    print("MoE methods: quantized model", hal["moe"], "dense model", dense["moe"])
    assert list(hal["moe"].values()) == [served["method"]] * LAYERS
    assert len(dense["moe"]) == LAYERS and not any(m.startswith("Hal") for m in dense["moe"].values())
    moe = hal["stats"]["cpu"]["fused_moe"]
    print("hal counters in the worker:", hal["stats"]["cpu"])
    assert moe["calls"] > 0 and moe["calls"] % LAYERS == 0
    assert moe["implementations"] == {"cpu.fused_moe": moe["calls"]} and not moe["fallbacks"]
    assert "fused_moe" not in dense["stats"].get("cpu", {})


def test_tokens_follow_vllms_own_kernels_on_the_dense_model(served: dict[str, Any]) -> None:
    """hal's int4 experts score the prompts as vLLM's fp16 kernels do on the dequantized weights (within 0.01),
    and generate their tokens: where a sequence parts, both tokens are the other run's top two (a near tie that
    the two kernels' rounding breaks differently), never an unlikely token."""
    expected, outputs = served["dense"]["outputs"], served["hal"]["outputs"]
    print("vLLM, dense:", tokens(expected))
    print("hal:        ", tokens(outputs))
    difference = np.abs(prompt_logprobs(outputs) - prompt_logprobs(expected))
    print("prompt log-probability differences: max", difference.max(), "mean", difference.mean())
    assert difference.max() < 0.01
    parted = first_divergence(expected, outputs)
    print("first divergence per prompt (position, rank of each token in the other's top two):", parted)
    assert all(p is None or p[1] <= 1 for p in parted)
    assert sum(p is None for p in parted) >= len(parted) - 1  # at most one sequence meets such a tie


def _layer(**changes: Any) -> Any:
    """A stand-in for vLLM's ``RoutedExperts`` with the attributes :func:`hal_vllm.moe.refusal` reads."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType

    moe = SimpleNamespace(routing_method=changes.pop("routing", RoutingMethodType.RenormalizeNaive),
                          activation=changes.pop("activation", MoEActivation.SILU), has_bias=changes.pop("bias", False),
                          moe_parallel_config=SimpleNamespace(use_ep=changes.pop("ep", False)))
    fields = dict(moe_config=moe, custom_routing_function=None, use_grouped_topk=False, e_score_correction_bias=None,
                  routed_scaling_factor=1.0, apply_router_weight_on_input=False)
    fields.update(changes)
    return SimpleNamespace(**fields)


GPTQ = SimpleNamespace(weight_bits=4, is_sym=True, desc_act=False)


def test_refusal_names_what_hal_does_not_serve() -> None:
    """Layers hal's method cannot run as asked stay vLLM's, and the reason says which part of the layer."""
    from hal_vllm.moe import ROUTINGS, refusal
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import RoutingMethodType

    for routing in ROUTINGS:
        assert refusal(_layer(routing=RoutingMethodType[routing]), GPTQ) is None
        assert refusal(_layer(routing=RoutingMethodType[routing]), SimpleNamespace(weight_bits=4), "awq") is None
    cases = {
        "routing is SigmoidRenorm": (_layer(routing=RoutingMethodType.SigmoidRenorm), GPTQ),
        "activation is 'relu2'": (_layer(activation=MoEActivation.RELU2), GPTQ),
        "biases": (_layer(bias=True), GPTQ),
        "expert parallelism": (_layer(ep=True), GPTQ),
        "custom routing function": (_layer(custom_routing_function=len), GPTQ),
        "groups of experts": (_layer(use_grouped_topk=True), GPTQ),
        "score-correction bias": (_layer(e_score_correction_bias=np.zeros(8)), GPTQ),
        "scales the routed output by 2.5": (_layer(routed_scaling_factor=2.5), GPTQ),
        "on the input": (_layer(apply_router_weight_on_input=True), GPTQ),
        "8-bit": (_layer(), SimpleNamespace(weight_bits=8, is_sym=True, desc_act=False)),
        "3-bit": (_layer(), SimpleNamespace(weight_bits=3)),  # an AWQ config: no sym / desc_act read
        "sym=False": (_layer(), SimpleNamespace(weight_bits=4, is_sym=False, desc_act=False)),
        "desc_act=True": (_layer(), SimpleNamespace(weight_bits=4, is_sym=True, desc_act=True)),
    }
    for words, (layer, config) in cases.items():
        reason = refusal(layer, config, "awq" if words == "3-bit" else "gptq")
        print(words, "->", reason)
        assert reason is not None and words in reason


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory, declared: Any) -> dict[str, Any]:
    """The GPTQ Mixtral on hal in one process (eager, then compiled by vLLM) and with two tensor-parallel ranks
    (one core each)."""
    quantized, _ = save_moe_checkpoints(tmp_path_factory.mktemp("moe-tp"), "gptq")
    env = _env(declared, HAL_CPU_THREADS="1")
    cores = sorted(os.sched_getaffinity(0))
    one, _ = generate(quantized, env=env, dtype="float16", logprobs=2)
    compiled, (report,) = generate(quantized, env=env, dtype="float16", logprobs=2, enforce_eager=False)
    two, reports = generate(quantized, env={**env, "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[-1]}"},
                            dtype="float16", logprobs=2, tensor_parallel_size=2, distributed_executor_backend="mp")
    return {"one": one, "compiled": (compiled, report), "two": two, "reports": reports}


def test_compiled_model_runs_hal_and_generates_the_eager_tokens(parallel: dict[str, Any]) -> None:
    """Compiled by vLLM (its default), the MoE layers are the operator ``torch.ops.hal_vllm.fused_moe`` and still
    run on hal's kernel, with the eager run's tokens."""
    compiled, report = parallel["compiled"]
    moe = report["stats"]["cpu"]["fused_moe"]
    print("compiled:", tokens(compiled), moe)
    assert list(report["moe"].values()) == ["HalGPTQMoEMethod"] * LAYERS
    assert moe["calls"] > 0 and moe["implementations"] == {"cpu.fused_moe": moe["calls"]} and not moe["fallbacks"]
    assert tokens(compiled) == tokens(parallel["one"])


def test_two_ranks_run_their_share_of_the_experts_on_hal(parallel: dict[str, Any]) -> None:
    """With ``tensor_parallel_size=2`` each rank's MoE layers are hal's (each holds half of every expert's
    columns; vLLM all-reduces the partial outputs) and the model follows one process: prompts within 0.01, the
    tokens equal but for a near tie."""
    for report in parallel["reports"]:
        moe = report["stats"]["cpu"]["fused_moe"]
        print("rank", report["rank"], report["moe"], moe)
        assert list(report["moe"].values()) == ["HalGPTQMoEMethod"] * LAYERS
        assert moe["calls"] > 0 and moe["implementations"] == {"cpu.fused_moe": moe["calls"]} and not moe["fallbacks"]
    assert sorted(report["rank"] for report in parallel["reports"]) == [0, 1]
    one, two = parallel["one"], parallel["two"]
    print("one process:", tokens(one))
    print("two ranks:  ", tokens(two))
    difference = np.abs(prompt_logprobs(two) - prompt_logprobs(one))
    print("prompt log-probability differences: max", difference.max())
    assert difference.max() < 0.01
    parted = first_divergence(one, two)
    print("first divergence per prompt:", parted)
    assert all(p is None or p[1] <= 1 for p in parted) and sum(p is None for p in parted) >= len(parted) - 1


def test_install_wraps_vllms_methods_once_and_only_on_the_minors_it_was_built_for() -> None:
    """On another vLLM minor the MoE layers stay vLLM's (nothing is wrapped); on 0.32 the GPTQ and AWQ configs'
    ``get_quant_method`` are wrapped once, however often vLLM calls the plugin's ``register()``."""
    from hal_vllm.moe import install
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    before = (AutoGPTQConfig.get_quant_method, AutoAWQConfig.get_quant_method)
    installed = getattr(before[0], "_hal", False)
    assert install("0.31.0") is False and install("0.33.1") is False
    assert (AutoGPTQConfig.get_quant_method, AutoAWQConfig.get_quant_method) == before
    assert install("0.32.0") is True
    wrapped = (AutoGPTQConfig.get_quant_method, AutoAWQConfig.get_quant_method)
    assert all(getattr(method, "_hal", False) for method in wrapped)
    assert (wrapped == before) == installed  # wrapped now, unless an earlier install in this process had
    assert install("0.32.3") is True
    assert (AutoGPTQConfig.get_quant_method, AutoAWQConfig.get_quant_method) == wrapped
