"""What every GPU op implementation shares: compiled kernels, the host-offload rule, launching.

Host (numpy) inputs given to a GPU backend run on the GPU only when the
call's FLOP count reaches ``HAL_<BACKEND>_OFFLOAD_MIN_FLOPS`` (e.g.
``HAL_CUDA_OFFLOAD_MIN_FLOPS``); then they are copied in, computed, and
copied back. Below it ``supports`` says why and the dispatcher runs the CPU
path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from hal_core import LaunchConfig
from hal_core.ops import OpCall, OpImpl

from .. import _env
from .._arrays import aligned, as_storage, to_device, to_host
from .._cupy import cupy
from .._kernel_params import pack
from .._kernel_sources import kernel_source
from .._platform import GpuPlatform
from .._specialization import Launch, Specialization

__all__ = ["GpuOp", "forget_kernels", "kernels_for", "launch", "storage_device", "tensor_cores_available"]

_loaded: dict[tuple[Any, Specialization, bool], dict[str, Any]] = {}
_loaded_lock = threading.Lock()


def forget_kernels() -> None:
    """Drop the looked-up kernels (a backend reset; the launchers' own caches go with their devices)."""
    with _loaded_lock:
        _loaded.clear()


def kernels_for(call: OpCall, device_index: int, spec: Specialization) -> dict[str, Any]:
    """Compiled kernels of ``spec`` on a device (compiled on first use, then looked up without hashing)."""
    device = call.backend.device(device_index)
    launcher = device.launcher
    key = (launcher, spec, _env.fmad(call.backend.name))
    found = _loaded.get(key)
    if found is None:
        platform: GpuPlatform = cast(Any, device).platform  # a CupyDevice (the plugin contract's handle has none)
        found = launcher.load(kernel_source(spec, platform))
        with _loaded_lock:
            _loaded[key] = found
    return found


def launch(call: OpCall, device_index: int, kernels: dict[str, Any], plan: Launch, args: Mapping[str, Any]) -> None:
    """Validate and enqueue one launch planned by an op's launch rules on the current stream.

    ``args`` maps each of the kernel's parameter names (:mod:`hal_cupy._kernel_params`) to its value; the
    argument tuple is built from the kernel's declaration (:func:`hal_cupy._kernel_params.pack`).
    """
    launcher = call.backend.device(device_index).launcher
    config = LaunchConfig(grid=plan.grid, block=plan.block, shared_mem=plan.shared_mem)
    launcher.launch(kernels[plan.kernel], config, pack(plan.kernel, args))


def storage_device(array: Any) -> int:
    """The device index of a device array."""
    return int(as_storage(array).device.id)


def misaligned(call: OpCall, names: Sequence[str], alignment: int = 16) -> str:
    """Empty when every named device array argument is ``alignment``-byte aligned, else which is not."""
    if call.host_arrays:
        return ""  # copied into fresh (aligned) allocations
    for name in names:
        value = call.args.get(name)
        if value is not None and not aligned(value, alignment):
            return f"argument {name!r} is not {alignment}-byte aligned (a sliced view?); pass a fresh array"
    return ""


class GpuOp:
    """One op implementation: a device function, its ``supports`` rule, the host-offload wrapper, and the kernel
    specialisations it may compile.

    ``check(call)`` returns "" when the kernels can run the call, else the
    reason. ``run(call)`` computes on device arrays. ``specializations(warp_size)``
    lists every specialisation ``run`` may request on a device of that SIMD
    width (the op's rules module builds it; warm-up, compile checks and SASS
    budgets read it through :func:`hal_cupy.all_specializations`). The same
    object serves every GPU backend; :meth:`impl` names it after the backend
    registering it.
    """

    def __init__(self, op: str, check: Callable[[OpCall], str], run: Callable[[OpCall], Any], *,
                 specializations: Callable[[int], Sequence[Specialization]], priority: int = 100) -> None:
        self.op, self.priority = op, priority
        self._check, self._run = check, run
        self.specializations = specializations

    def supports(self, call: OpCall) -> bool | str:
        if call.host_arrays:
            variable = _env.variable(call.backend.name, "OFFLOAD_MIN_FLOPS")
            threshold = _env.offload_min_flops(call.backend.name)
            if call.flops < threshold:
                return (f"host (numpy) inputs with {call.flops} FLOPs, below {variable}="
                        f"{threshold}: copying to the GPU would not pay; pass CuPy arrays to run on the GPU")
        reason = self._check(call)
        return reason or True

    def __call__(self, call: OpCall) -> Any:
        if call.host_arrays:
            return self._offload(call)
        return self._run(call)

    def _offload(self, call: OpCall) -> Any:
        """Copy host inputs to the current device, compute there, copy the results back."""
        backend = call.backend
        device_index = int(cupy().cuda.runtime.getDevice())
        with cupy().cuda.Device(device_index):
            return call.spec.run_elsewhere(
                call.args, lambda a: to_device(a, device_index),
                lambda device_args: self._run(OpCall(spec=call.spec, args=device_args, backend=backend,
                                                     device_index=device_index)),
                to_host)

    def impl(self, backend: str) -> OpImpl:
        """The registry entry, named ``<backend>.<op>``."""
        return OpImpl(op=self.op, fn=self, name=f"{backend}.{self.op}", priority=self.priority,
                      supports=self.supports)


def tensor_cores_available(backend: Any, device_index: int, min_level: int) -> bool:
    """Whether ``backend``'s device has the warp matrix instructions of ``min_level`` and they are not switched off.

    ``HAL_<BACKEND>_TENSOR_CORES=0`` switches them off; the level comes from the platform
    (:meth:`hal_cupy.GpuPlatform.warp_mma_level`), never from a vendor name.
    """
    if not _env.tensor_cores(backend.name):
        return False
    caps = backend.device(device_index).capabilities
    return bool(backend.platform.warp_mma_level(caps) >= min_level)
