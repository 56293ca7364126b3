"""The ``vllm.general_plugins`` entry point: registers hal's attention backend with vLLM when switched on.

vLLM calls :func:`register` with no arguments in each of its processes
(the front end, the engine core, every worker), so it must be idempotent;
it is a no-op unless ``HAL_VLLM`` is on, so installing the plugin changes
nothing by itself.
"""

from __future__ import annotations

from hal_core import env

from ._compat import check_vllm_version

__all__ = ["CPU_BACKEND", "GPU_BACKEND", "enabled", "register"]

#: The class vLLM's CPU attention slot (``CPU_ATTN``) resolves to once the plugin is on.
CPU_BACKEND = "hal_vllm.cpu.HalCPUAttentionBackend"
#: The class vLLM's ``CUSTOM`` attention backend resolves to on CUDA and ROCm (``--attention-backend CUSTOM``).
GPU_BACKEND = "hal_vllm.gpu.HalAttentionBackend"


def enabled() -> bool:
    """Whether ``HAL_VLLM`` switches the plugin on (off by default; a misspelt value is an error)."""
    return env.flag("HAL_VLLM", False)


def register() -> None:
    """Point vLLM's attention (and, on CPU, int4 linear and MoE layers) at hal; nothing unless ``HAL_VLLM`` is on.

    On CPU, vLLM always picks its ``CPU_ATTN`` backend, so that name is
    overridden, :class:`hal_vllm.linear.HalWNA16LinearKernel` goes first
    among the CPU's mixed-precision linear kernels, and GPTQ and AWQ
    checkpoints' MoE layers get hal's methods (:func:`hal_vllm.moe.install`).
    On CUDA and ROCm hal's backend is vLLM's ``CUSTOM`` one, chosen with
    ``--attention-backend CUSTOM``. Raises :class:`~hal_core.ConfigurationError` on a vLLM minor
    the plugin was not tested with for this platform's vLLM build
    (:data:`hal_vllm.SUPPORTED_MINORS`), and RuntimeError on another platform.
    """
    if not enabled():
        return
    import vllm
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        build = "cpu"
    elif current_platform.is_cuda_alike():
        build = "gpu"
    else:
        raise RuntimeError(
            f"HAL_VLLM is on, but hal-vllm serves vLLM's CPU, CUDA and ROCm platforms, not "
            f"{current_platform.device_name!r}; unset HAL_VLLM on this machine"
        )
    check_vllm_version(vllm.__version__, build)
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    if build == "cpu":
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        _put_linear_kernel_first()
        from .moe import install

        install(vllm.__version__)
    else:
        register_backend(AttentionBackendEnum.CUSTOM, GPU_BACKEND)


def _put_linear_kernel_first() -> None:
    """Make hal's WNA16 kernel the CPU's first choice (vLLM's registration appends; the first that fits wins)."""
    from vllm.model_executor.kernels.linear import (
        _POSSIBLE_KERNELS,
        register_linear_kernel,
    )
    from vllm.platforms import PlatformEnum

    from .linear import HalWNA16LinearKernel

    kernels = _POSSIBLE_KERNELS.get(PlatformEnum.CPU, [])
    if HalWNA16LinearKernel in kernels:
        return
    register_linear_kernel(HalWNA16LinearKernel, PlatformEnum.CPU, "mp")
    kernels = _POSSIBLE_KERNELS[PlatformEnum.CPU]
    kernels.insert(0, kernels.pop(kernels.index(HalWNA16LinearKernel)))
