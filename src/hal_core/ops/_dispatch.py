"""The ops front door: validate, pick an implementation, fall back correctly.

A call flows: arguments checked (:class:`OpSpec.validate`) → empty work
answered without a launch → ``HAL_FORCE_CPU`` honoured → the best
implementation whose ``supports`` accepts the call → otherwise the CPU
path (logged once per op and reason; :class:`FallbackError` under
``HAL_STRICT=1``). Nothing is written to ``out`` or the caches until a
result exists.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _env
from .._errors import ArgumentError, ArgumentTypeError, FallbackError, KernelCompileError
from ..arrays import device_of
from ..quant import QuantizedWeight
from ..tuning import ordered as tuned_order
from ._registry import OpRegistry
from ._spec import OpCall, OpSpec
from .paged_attention import PagedAttention
from .quantized_gemm import QuantizedGemm
from .write_kv_cache import WriteKVCache

if TYPE_CHECKING:
    from .._backend import Backend

__all__ = ["OPS", "Ops"]

log = logging.getLogger("hal")

#: Every op hal defines, by name.
OPS: dict[str, OpSpec] = {spec.name: spec for spec in (PagedAttention(), WriteKVCache(), QuantizedGemm())}

_logged: set[tuple[str, str, str]] = set()
_logged_lock = threading.Lock()


def forget_logged_fallbacks() -> None:
    """Log each fallback again from now on (called by ``hal_core.reset``)."""
    with _logged_lock:
        _logged.clear()


def _log_once(backend: str, op: str, reason: str) -> None:
    key = (backend, op, reason)
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    log.warning("hal: %s on backend %r runs on the CPU path: %s", op, backend, reason)


class Ops:
    """The ops of one backend: ``paged_attention``, ``write_kv_cache``, ``quantized_gemm``."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.registry = OpRegistry(frozenset(OPS))
        backend.register_ops(self.registry)
        from .._discovery import extra_op_impls

        for impl in extra_op_impls(backend):
            self.registry.register(impl)

    # -- the public ops ---------------------------------------------------

    def paged_attention(
        self,
        query: Any,
        key_cache: Any,
        value_cache: Any,
        block_tables: Any,
        seq_lens: Any,
        *,
        scale: float,
        out: Any = None,
    ) -> Any:
        """Decode attention over a paged KV cache; see :mod:`hal_core.ops.paged_attention`."""
        return self._call(
            "paged_attention",
            dict(query=query, key_cache=key_cache, value_cache=value_cache,
                 block_tables=block_tables, seq_lens=seq_lens, scale=scale, out=out),
        )

    def write_kv_cache(self, key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any) -> None:
        """Scatter ``key``/``value`` into the caches; see :mod:`hal_core.ops.write_kv_cache`."""
        self._call(
            "write_kv_cache",
            dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping),
        )

    def quantized_gemm(self, x: Any, qweight: QuantizedWeight, *, out: Any = None) -> Any:
        """``x [M, K]`` times quantized weights ``[K, N]``; see :mod:`hal_core.ops.quantized_gemm`."""
        return self._call("quantized_gemm", dict(x=x, qweight=qweight, out=out))

    # -- dispatch ---------------------------------------------------------

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        from .. import interop

        spec = OPS[op]
        args, restore = interop.import_arrays(spec, args, self._backend)
        call = self._prepare(spec, args)
        if spec.is_empty(call.args):
            return restore(self._empty_result(call))
        return restore(self._execute(call))

    def _prepare(self, spec: OpSpec, args: dict[str, Any]) -> OpCall:
        backend = self._backend
        devices = {name: device_of(value) for name, value in spec.iter_arrays(args)}
        for name, (kind, _) in devices.items():
            if kind == "unknown":
                raise ArgumentTypeError(
                    f"argument {name!r}: expected an array (numpy, CuPy, torch, or any DLPack or "
                    f"__cuda_array_interface__ array), got {type(args.get(name, spec)).__name__}"
                )
        kinds = set(devices.values())
        if len(kinds) > 1:
            listing = ", ".join(f"{n} on {k}:{i}" for n, (k, i) in devices.items())
            raise ArgumentError(f"arrays from different devices: {listing}; move them to one device first")
        host = all(isinstance(v, np.ndarray) for _, v in spec.iter_arrays(args))
        if not host:
            foreign = [n for n, v in spec.iter_arrays(args) if not backend.owns(v)]
            if foreign:
                kind, index = devices[foreign[0]]
                raise ArgumentError(
                    f"argument {foreign[0]!r} lives on {kind}:{index}, which backend {backend.name!r} "
                    f"does not own; use the backend of that device or move the array with backend.asarray"
                )
        spec.validate(args, self._to_numpy)
        device_index = next(iter(kinds))[1] if kinds and not host else 0
        return OpCall(spec=spec, args=args, backend=backend, device_index=device_index,
                      host_arrays=host and not backend.owns(np.empty(0)))

    def _to_numpy(self, array: Any) -> np.ndarray:
        return array if isinstance(array, np.ndarray) else self._backend.to_numpy(array)

    def _execute(self, call: OpCall) -> Any:
        backend = self._backend
        if _env.force_cpu() and backend.name != "cpu":
            return self._run_on_cpu(call)
        reasons = []
        for impl in tuned_order(call, self.registry.implementations(call.op)):
            try:
                verdict = impl.supports(call)
            except Exception as exc:  # a plugin bug must not cost the caller a correct result
                log.debug("hal: %s supports() raised", impl.name, exc_info=exc)
                verdict = f"supports() raised {type(exc).__name__}: {exc}"
            if verdict is True:
                try:
                    return self._finish(call, impl.fn(call))
                except KernelCompileError as exc:  # compiles happen before any launch writes `out`
                    log.debug("hal: %s failed to compile", impl.name, exc_info=exc)
                    verdict = f"kernel {exc.name!r} failed to compile (see the debug log for the compiler output)"
            reasons.append(f"{impl.name}: {verdict if isinstance(verdict, str) else 'unsupported'}")
        reason = "; ".join(reasons) or "no implementation registered"
        if _env.strict():
            raise FallbackError(
                f"{call.op} on backend {backend.name!r} would fall back to the CPU path ({reason}); "
                f"unset HAL_STRICT to allow fallbacks"
            )
        _log_once(backend.name, call.op, reason)
        return self._run_on_cpu(call)

    def _finish(self, call: OpCall, result: Any) -> Any:
        out = call.out
        if out is not None and result is not None and result is not out:
            out[...] = result
            return out
        return result

    def _run_on_cpu(self, call: OpCall) -> Any:
        """Run ``call`` on the CPU backend (or the reference), copying device arrays in and out."""
        from .._selection import cpu_backend

        spec, backend = call.spec, self._backend
        cpu = cpu_backend()
        on_host = call.host_arrays or backend.owns(np.empty(0))
        host_args = dict(call.args) if on_host else spec.map_arrays(call.args, self._to_numpy)
        if "out" in host_args:
            host_args["out"] = None
        host_call = OpCall(spec=spec, args=host_args, backend=cpu or backend, host_arrays=False)
        result = None
        if cpu is not None and cpu is not backend:
            for impl in cpu.ops.registry.implementations(call.op):
                if impl.supports(host_call) is True:
                    result = impl.fn(host_call)
                    break
            else:
                result = _reference_result(host_call)
        else:
            result = _reference_result(host_call)
        if spec.inplace_args and not on_host:
            for name in spec.inplace_args:
                call.args[name][...] = backend.asarray(host_args[name], call.device_index)
        if result is None:
            return None
        if not on_host:
            result = backend.asarray(result, call.device_index)
        return self._finish(call, result)

    def _empty_result(self, call: OpCall) -> Any:
        shape = call.spec.output_shape(call.args)
        if shape is None:
            return None
        if call.out is not None:
            return call.out
        empty = np.zeros(shape, dtype=call.spec.output_dtype(call.args))
        if call.host_arrays or self._backend.owns(empty):
            return empty
        return self._backend.asarray(empty, call.device_index)


def _reference_result(call: OpCall) -> Any:
    """The float64 reference cast to the op's dtype, writing in-place outputs."""
    spec = call.spec
    result = spec.reference(call.args)
    dtype = spec.output_dtype(call.args)
    if spec.inplace_args:
        for name, value in zip(spec.inplace_args, result, strict=False):
            call.args[name][...] = value.astype(dtype)
        return None
    return result.astype(dtype)
