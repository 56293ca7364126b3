"""hal as vLLM's ``CUSTOM`` attention backend on CUDA and ROCm, through vLLM's own platform code, without a GPU.

The plugin's ``register()`` runs under vLLM's CUDA (or ROCm) platform class,
then that class's own ``get_attn_backend_cls`` (what ``--attention-backend
CUSTOM`` calls while the worker builds the model) resolves the backend and
asks its ``validate_configuration``. Only what needs a device is stood in
for: the device capability, vLLM's compiled extension that the CUDA
platform module imports first (absent from vLLM's CPU build, and built for
a CUDA torch in its GPU build), and the GPU architecture and compiled
extension (``vllm._C``: the CPU build's is for AVX-512 CPUs and stops the
process with SIGILL on others; a GPU wheel's is built for a GPU torch) the
ROCm platform module reads when imported. ``make test-vllm`` runs this file with the
installed vLLM and again over the Python code of each GPU wheel of the
tested range (``VLLM_GPU_RELEASES`` in the Makefile).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import vllm
from hal_vllm import SUPPORTED_MINORS, register
from hal_vllm._plugin import GPU_BACKEND
from hal_vllm.gpu import HalAttentionBackend
from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

import hal_core

if tuple(int(part) for part in vllm.__version__.split(".")[:2]) not in SUPPORTED_MINORS["gpu"]:
    pytest.skip(f"vLLM {vllm.__version__} is outside the GPU build's range (hal_vllm.SUPPORTED_MINORS['gpu'])",
                allow_module_level=True)

PLATFORMS = {"cuda": ("vllm.platforms.cuda", "CudaPlatform"), "rocm": ("vllm.platforms.rocm", "RocmPlatform")}


def _platform_class(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's platform class of ``name``; what its module reads from a device when imported is stood in for."""
    if name == "cuda":  # imported first thing by the CUDA platform module; built for a CUDA torch, if present
        monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    else:  # the ROCm platform module reads the GPU's architecture (MI300's here) once, when imported
        monkeypatch.setitem(sys.modules, "vllm._C", types.ModuleType("vllm._C"))
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda *args, **kwargs: types.SimpleNamespace(gcnArchName="gfx942"))
    module_name, class_name = PLATFORMS[name]
    return getattr(importlib.import_module(module_name), class_name)


@pytest.fixture(params=list(PLATFORMS))
def gpu_platform(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's CUDA or ROCm platform as the current platform (a compute-capability-9.0 device), HAL_VLLM on."""
    from vllm.platforms.interface import DeviceCapability

    platform_class = _platform_class(request.param, monkeypatch)
    monkeypatch.setattr(platform_class, "get_device_capability",
                        classmethod(lambda cls, device_id=0: DeviceCapability(9, 0)))
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "_current_platform", platform_class())
    monkeypatch.setenv("HAL_VLLM", "1")
    saved = dict(_ATTN_OVERRIDES)
    _ATTN_OVERRIDES.clear()  # start as a GPU process does: an earlier test's CPU registration is not this one's
    yield platform_class
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)


def _selector_config(**overrides: Any) -> Any:
    fields: dict[str, Any] = dict(head_size=128, dtype=torch.float16, kv_cache_dtype="auto", block_size=16)
    fields.update(overrides)
    return AttentionSelectorConfig(**fields)


def test_register_makes_hal_the_custom_backend(gpu_platform: Any) -> None:
    """Under vLLM's GPU platform, HAL_VLLM=1 registers hal as CUSTOM and leaves CPU_ATTN and the CPU kernels alone."""
    register()
    register()  # every vLLM process registers; again changes nothing
    assert AttentionBackendEnum.CUSTOM.get_path() == GPU_BACKEND
    assert AttentionBackendEnum.CUSTOM.get_class() is HalAttentionBackend
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()


def test_vllms_selector_picks_hal_for_custom(gpu_platform: Any) -> None:
    """vLLM's platform resolves ``--attention-backend CUSTOM`` to hal's class for fp16/bf16 decoder attention."""
    register()
    for config in (_selector_config(), _selector_config(dtype=torch.bfloat16, block_size=32, has_sink=True,
                                                        has_sliding_window=True)):
        path = gpu_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config)
        assert path == GPU_BACKEND


@pytest.mark.parametrize(("override", "reason"), [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype not supported"),
    ({"use_mla": True}, "MLA not supported"),
    ({"block_size": 8}, "block_size not supported"),
], ids=["fp8-cache", "mla", "block-8"])
def test_vllms_selector_refuses_what_hal_lacks(gpu_platform: Any, override: dict[str, Any], reason: str) -> None:
    """What hal's backend cannot serve stops vLLM's selection of CUSTOM, with hal's reason in vLLM's error."""
    register()
    with pytest.raises(ValueError, match=reason):
        gpu_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector_config(**override))


def test_release_outside_the_gpu_range_is_refused(gpu_platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the GPU platform the GPU build's range applies: a minor outside it registers nothing."""
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(hal_core.ConfigurationError, match=r"on GPU, found vLLM 0\.31\.0.*'vllm==0\.34"):
        register()
    assert not AttentionBackendEnum.CUSTOM.is_overridden()
