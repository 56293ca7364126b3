"""vLLM's GPTQ and AWQ linear layers on hal's W4A16 GEMM, built by vLLM's own linear methods.

Each layer is created by vLLM's ``AutoGPTQLinearMethod`` / ``AutoAWQMarlinLinearMethod``
(which pick their kernel from vLLM's CPU list, where the plugin put hal's
first), loaded with checkpoint tensors in the format's own packing, made
ready by vLLM's ``process_weights_after_loading``, and applied; the result
is compared with a float64 ``x @ ((q - z) * s)`` computed from the codes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hal_vllm import register
from hal_vllm.linear import HalWNA16LinearKernel
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMarlinLinearMethod
from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig, AutoGPTQLinearMethod

import hal_core
from hal_core.quant import quantize

K, N, GROUP = 256, 96, 64
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8c + AWQ_ORDER[j]
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # relative to the largest output


@pytest.fixture(scope="module", autouse=True)
def vllm_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank vLLM process group (vLLM's parameters ask for their tensor-parallel rank), hal's kernel first."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("HAL_VLLM", "1")
    monkeypatch.setenv("HAL_VLLM_INT4_ACTIVATIONS", "float")  # W4A16, held to the float64 weight's tolerance
    register()
    init_file = Path(tmp_path_factory.mktemp("dist")) / "init"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{init_file}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()
    monkeypatch.undo()


def _pack_along_n(codes: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 words ``[rows, N/8]``: nibble j of word [r, c] holds ``codes[r, 8c + order[j]]``."""
    rows, n = codes.shape
    grouped = codes.reshape(rows, n // 8, 8)[:, :, list(order)].astype(np.uint32)
    return (grouped << (4 * np.arange(8, dtype=np.uint32))).sum(axis=2, dtype=np.uint32).view(np.int32)


def _weights(rng: np.random.Generator, *, symmetric: bool, dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray,
                                                                                         np.ndarray, np.ndarray]:
    """Codes ``[K, N]``, zero points ``[K/G, N]``, scales ``[K/G, N]`` (exact in ``dtype``), float64 weight."""
    weight = quantize(rng.standard_normal((K, N)) / 8, bits=4, group_size=GROUP, symmetric=symmetric,
                      scale_dtype=np.float32)
    scales = torch.tensor(weight.scales).to(dtype).double().numpy()
    zeros = np.full(scales.shape, 8) if weight.zeros is None else weight.zeros.astype(np.int64)
    codes = weight.codes().astype(np.int64)
    dense = (codes - np.repeat(zeros, GROUP, axis=0)) * np.repeat(scales, GROUP, axis=0)
    return codes, zeros, scales, dense


def _check(method: object, layer: torch.nn.Module, dense: np.ndarray, dtype: torch.dtype,
           rng: np.random.Generator) -> None:
    assert isinstance(method.kernel, HalWNA16LinearKernel)  # type: ignore[attr-defined]
    before = hal_core.stats().get("cpu", {}).get("quantized_gemm", {}).get("calls", 0)
    for shape in ((1, K), (7, K), (2, 3, K)):
        x = torch.tensor(rng.standard_normal(shape), dtype=dtype)
        y = method.apply(layer, x)  # type: ignore[attr-defined]
        expected = x.double().numpy() @ dense
        assert y.shape == (*shape[:-1], N) and y.dtype == dtype
        error = np.abs(y.double().numpy() - expected).max() / np.abs(expected).max()
        assert error < TOLERANCE[dtype], (shape, error)
    stats = hal_core.stats()["cpu"]["quantized_gemm"]
    assert stats["calls"] - before == 3 and not stats["fallbacks"]
    # As vLLM runs it by default, compiled: one graph (hal's operator), the eager layer's bits.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: method.apply(layer, x), backend="inductor", fullgraph=True)  # type: ignore[attr-defined]
    for shape in ((3, K), (2, 4, K)):
        x = torch.tensor(rng.standard_normal(shape), dtype=dtype)
        torch.testing.assert_close(compiled(x), method.apply(layer, x), rtol=0, atol=0)  # type: ignore[attr-defined]


def _gptq_layer(rng: np.random.Generator, dtype: torch.dtype) -> tuple[object, torch.nn.Module, np.ndarray]:
    """A GPTQ layer made by vLLM's linear method from symmetric checkpoint tensors, loaded (its kernel chosen and
    ready): ``(method, layer, the float64 weight)``."""
    codes, _, scales, dense = _weights(rng, symmetric=True, dtype=dtype)
    config = AutoGPTQConfig(weight_bits=4, group_size=GROUP, desc_act=False, is_sym=True, lm_head_quantized=False,
                            dynamic={}, full_config={})
    method = AutoGPTQLinearMethod(config)
    layer = torch.nn.Module()
    method.create_weights(layer, K, [N], K, N, dtype)
    layer.qweight.data.copy_(torch.from_numpy(_pack_along_n(codes.T).T.copy()))  # packed along K: GPTQ's words
    layer.scales.data.copy_(torch.tensor(scales, dtype=dtype))
    layer.qzeros.data.copy_(torch.from_numpy(_pack_along_n(np.full((K // GROUP, N), 7))))  # v1: stored z - 1
    method.process_weights_after_loading(layer)
    return method, layer, dense


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gptq_layer(dtype: torch.dtype, rng: np.random.Generator) -> None:
    """GPTQ (symmetric, codes biased by 8): the checkpoint's words reach hal as they are."""
    method, layer, dense = _gptq_layer(rng, dtype)
    _check(method, layer, dense, dtype, rng)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_awq_layer(dtype: torch.dtype, rng: np.random.Generator) -> None:
    """AWQ (zero points, AWQ's nibble order): vLLM repacks it, hal takes the zero points unpacked."""
    codes, zeros, scales, dense = _weights(rng, symmetric=False, dtype=dtype)
    method = AutoAWQMarlinLinearMethod(AutoAWQConfig(weight_bits=4, group_size=GROUP, zero_point=True,
                                                     lm_head_quantized=False))
    layer = torch.nn.Module()
    method.create_weights(layer, K, [N], K, N, dtype)
    layer.qweight.data.copy_(torch.from_numpy(_pack_along_n(codes, AWQ_ORDER)))
    layer.qzeros.data.copy_(torch.from_numpy(_pack_along_n(zeros, AWQ_ORDER)))
    layer.scales.data.copy_(torch.tensor(scales, dtype=dtype))
    method.process_weights_after_loading(layer)
    _check(method, layer, dense, dtype, rng)


def test_kernel_goes_first_once() -> None:
    """Registering again (every vLLM process does) leaves one hal kernel, at the head of the CPU list."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS
    from vllm.platforms import PlatformEnum

    register()
    kernels = _POSSIBLE_KERNELS[PlatformEnum.CPU]
    assert kernels[0] is HalWNA16LinearKernel and kernels.count(HalWNA16LinearKernel) == 1


def test_kernel_declines_what_it_cannot_run() -> None:
    """8-bit weights and a K that the group size does not divide are left to vLLM's other kernels, with a reason."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    def config(**overrides: object) -> MPLinearLayerConfig:
        fields: dict[str, object] = dict(full_weight_shape=(K, N), partition_weight_shape=(K, N),
                                         weight_type=scalar_types.uint4b8, act_type=torch.bfloat16,
                                         group_size=GROUP, zero_points=False)
        fields.update(overrides)
        return MPLinearLayerConfig(**fields)  # type: ignore[arg-type]

    assert HalWNA16LinearKernel.can_implement(config()) == (True, None)
    ok, why = HalWNA16LinearKernel.can_implement(config(weight_type=scalar_types.uint8b128))
    assert not ok and "int4" in why
    ok, why = HalWNA16LinearKernel.can_implement(config(partition_weight_shape=(K + 32, N)))
    assert not ok and "group size" in why


@pytest.mark.parametrize("setting", ["int8", "auto", "float", None])
def test_int4_activations_setting(setting: str | None, rng: np.random.Generator,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``HAL_VLLM_INT4_ACTIVATIONS`` (unset: ``auto``) reaches every call, eager and compiled: the layer gives
    hal's own ``quantized_gemm`` with that setting bit for bit, within W4A8's error of the float64 weight; a
    misspelt value stops the layer's loading, naming it."""
    if setting is None:  # unset: hal's "auto"
        monkeypatch.delenv("HAL_VLLM_INT4_ACTIVATIONS")
    else:
        monkeypatch.setenv("HAL_VLLM_INT4_ACTIVATIONS", setting)
    method, layer, dense = _gptq_layer(rng, torch.bfloat16)
    kernel = method.kernel  # type: ignore[attr-defined]
    ops = hal_core.get_backend("cpu").ops
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: method.apply(layer, x), backend="inductor", fullgraph=True)  # type: ignore[attr-defined]
    for rows in (1, 6):
        x = torch.tensor(rng.standard_normal((rows, K)), dtype=torch.bfloat16)
        y = method.apply(layer, x)  # type: ignore[attr-defined]
        want = ops.quantized_gemm(x=x.view(torch.int16).numpy().view(kernel._weight.scales.dtype),
                                  qweight=kernel._weight, activations=setting or "auto")
        np.testing.assert_array_equal(y.view(torch.int16).numpy(), want.view(np.int16))
        torch.testing.assert_close(compiled(x), y, rtol=0, atol=0)
        expected = x.double().numpy() @ dense
        assert np.abs(y.double().numpy() - expected).max() / np.abs(expected).max() < 3e-2
    monkeypatch.setenv("HAL_VLLM_INT4_ACTIVATIONS", "int4")
    with pytest.raises(hal_core.EnvironmentVariableError, match="HAL_VLLM_INT4_ACTIVATIONS"):
        method.process_weights_after_loading(layer)
