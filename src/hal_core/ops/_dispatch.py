"""The ops front door: validate, pick an implementation, check its result, fall back correctly.

A call flows: foreign arrays imported without a copy (:mod:`hal_core.interop`)
→ devices checked → arguments checked (:meth:`OpSpec.validate`), ``out``
and in-place arguments refused when read-only → empty work answered
without a launch → ``HAL_FORCE_CPU`` honoured → :meth:`Ops.choose` picks
the implementation to run → its result checked (shape, dtype, device) →
``out`` written from that complete result. Where no implementation
supports the call, or the chosen one fails or returns a bad result, the
call runs on the fallback path (logged once per op and reason;
:class:`FallbackError` under ``HAL_STRICT=1``). What the caller must fix
never falls back: bad arguments, ``MemoryError`` and a
:class:`~hal_core.ConfigurationError` (a ``HAL_*`` value an implementation
or its ``supports()`` refused) are raised.

A call of numpy arrays and plain values (no options group, no weight)
enters that flow through the op bound with nothing fixed
(:class:`~hal_core.ops.BoundOp`): the first call of each signature is
checked as above, the next ones skip what the signature fixes and may run
the implementation's planned runner, with the same value checks, choice,
result check, fallbacks and counts.

An :class:`Ops` is built when its backend is bound, with what it needs
injected: the fallback backend (a host backend, chosen by the runtime)
and the extra implementations other plugins may add. This module imports
neither discovery nor selection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MethodType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _env, interop
from .._errors import (
    ArgumentError,
    ArgumentTypeError,
    FallbackError,
    ImplementationError,
    KernelCompileError,
    configuration_error,
)
from ..arrays import device_of, dtype_name
from ..tuning import ordered as tuned_order
from ._bound import BoundOp
from ._catalog import OPS
from ._checks import check_writable
from ._coverage import OpCoverage
from ._dispatch_events import DispatchEvent, OpStats
from ._front_door import method_for
from ._plans import signature_and_host, validate
from ._registry import OpRegistry
from ._spec import OpCall, OpImpl, OpSpec, Runner

if TYPE_CHECKING:
    from .._backend import Backend

__all__ = ["BoundOp", "DispatchEvent", "OpStats", "Ops"]

#: A call's declared result, where known beforehand: (shape, dtype), ``(None, None)`` for an in-place op.
_Expected = tuple[tuple[int, ...] | None, Any] | None
#: What a kept signature's runner gave when a bound op ran it itself: (its result, None) or (None, what it raised).
_Tried = tuple[Any, Exception | None] | None

log = logging.getLogger("hal")


class Ops:
    """The ops of one backend: one method per op of :data:`~hal_core.ops.OPS`, named like it.

    ``ops.paged_attention(...)``, ``ops.write_kv_cache(...)``, ``ops.quantized_gemm(...)`` and any op
    registered later: each method's signature is its op's declaration (required arguments positional,
    the others keyword-only; ``help(ops.paged_attention)`` shows it). ``fallback`` is the host backend that
    answers what this backend cannot (None: the float64 reference does); ``extra_impls`` are
    implementations other plugins add to this backend.
    """

    def __init__(self, backend: Backend, *, fallback: Backend | None = None,
                 extra_impls: Iterable[OpImpl] = ()) -> None:
        self._backend = backend
        self._fallback = fallback if fallback is not backend else None
        self.registry = OpRegistry()
        backend.register_ops(self.registry)
        for impl in extra_impls:
            self.registry.register(impl)
        self._stats: dict[str, OpStats] = {}
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()
        self._watchers: list[list[DispatchEvent]] = []
        #: per op, the op bound with nothing fixed: the front door's path for host arrays (see :meth:`_call`)
        self._unbound: dict[str, BoundOp] = {}

    @classmethod
    def attach(cls, backend: Backend, *, fallback: Backend | None = None,
               extra_impls: Iterable[OpImpl] = ()) -> Ops:
        """Build the front door of ``backend`` and make it ``backend.ops`` (what binding does)."""
        ops = cls(backend, fallback=fallback, extra_impls=extra_impls)
        backend.bind_ops(ops)
        return ops

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """The front door method of op ``name``, made from its declaration (once per registered spec)."""
        spec = OPS.get(name) if not name.startswith("_") else None
        if spec is None:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r} (ops: {sorted(OPS)})")
        return MethodType(method_for(spec), self)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *OPS})

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def fallback(self) -> Backend | None:
        """The host backend that runs what this one cannot (None: the float64 reference)."""
        return self._fallback

    # -- what the backend declares, and what it did -------------------------

    def coverage(self, op: str) -> OpCoverage:
        """What this backend declares it runs itself for ``op`` (queryable before any call)."""
        return self.registry.coverage(op)

    def prepare(self, op: str, **args: Any) -> OpCall:
        """The validated :class:`OpCall` for these arguments, without running anything."""
        spec = OPS[op]
        options = args.pop("options", None)
        native, _ = interop.import_arrays(spec, spec.merge_options(dict(args), options), self._backend)
        return self._prepare(spec, native, options)[0]

    def explain(self, call: OpCall) -> list[tuple[str, str]]:
        """``(implementation, verdict)`` for every candidate of ``call``, in the order tried: ``'runs'`` for the one
        :meth:`choose` picks, else why it was passed over; first ``("auto", what was chosen and why)`` when the
        caller left a setting ``"auto"``."""
        chosen, reasons = self.choose(call)
        rows = [("auto", call.settled)] if call.settled else []
        for impl in self.registry.implementations(call.op):
            if impl is chosen:
                rows.append((impl.name, "runs"))
            elif impl.name in reasons:
                rows.append((impl.name, reasons[impl.name]))
            else:
                rows.append((impl.name, f"not tried: {chosen.name if chosen else '?'} has higher priority"))
        if chosen is None:
            where = f"backend {self._fallback.name!r}" if self._fallback is not None else "the float64 reference"
            rows.append(("fallback", f"runs on {where}"))
        return rows

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per op: calls, the implementations that answered, fallbacks with reasons, fallback time."""
        with self._lock:
            return {op: s.as_dict() for op, s in self._stats.items() if s.calls}

    def _op_stats(self, op: str) -> OpStats:
        found = self._stats.get(op)
        if found is None:
            with self._lock:
                found = self._stats.setdefault(op, OpStats())
        return found

    @contextmanager
    def watch(self) -> Iterator[list[DispatchEvent]]:
        """Record every fallback and fault of this front door while the block runs."""
        events: list[DispatchEvent] = []
        with self._lock:
            self._watchers.append(events)
        try:
            yield events
        finally:
            with self._lock:
                self._watchers.remove(events)

    # -- dispatch ---------------------------------------------------------

    def bind(self, op: str, /, **fixed: Any) -> BoundOp:
        """``op`` with the ``fixed`` arguments bound: ``ops.bind("quantized_gemm", qweight=w)(x=x)`` is
        ``ops.quantized_gemm(x, w)``, cheaper when made many times with host arrays (see :class:`BoundOp`).

        The fixed arguments are checked as far as they can be alone (their names, numbers and choices) now, the
        rest on the first call; raises :class:`ArgumentError` naming ``op`` when no op of that name is catalogued.
        """
        spec = OPS.get(op)
        if spec is None:
            raise ArgumentError(f"argument 'op': no op named {op!r} (ops: {', '.join(sorted(OPS))})")
        return BoundOp(self, spec, fixed)

    def call(self, op: str, args: Mapping[str, Any]) -> Any:
        """``ops.<op>(**args)`` for an op named at run time (the torch operators use it); ``args`` is left unchanged.

        Raises :class:`ArgumentError` naming ``op`` when no op of that name is catalogued, and, as the op's
        method does, ``TypeError`` naming an argument the op does not declare or a required one left out.
        """
        spec = OPS.get(op)
        if spec is None:
            raise ArgumentError(f"argument 'op': no op named {op!r} (ops: {', '.join(sorted(OPS))})")
        return method_for(spec)(self, **args)

    def _call(self, op: str, args: dict[str, Any], options: Any = None) -> Any:
        spec = OPS[op]
        if options is None and not spec.weight_names:  # numpy arrays and plain values: the bound path (it keeps
            # what a signature fixes); a weight is a value no signature holds, so a weight op takes the full path
            bound = self._unbound.get(op)
            if bound is None or bound._spec is not spec:
                bound = self._unbound[op] = BoundOp(self, spec, {})
            key = bound.signature(args)
            if key is not None:
                return bound._run(key, args)
        if options is not None:  # the op's group (spec.options) given as one value: its fields become arguments
            args = spec.merge_options(args, options)
        args, restore = interop.import_arrays(spec, args, self._backend)
        call, out = self._prepare(spec, args, options)
        if spec.is_empty(call.args):
            return restore(self._empty_result(call, out))
        return restore(self._execute(call, out))

    def _prepare(self, spec: OpSpec, args: dict[str, Any], options: Any = None) -> tuple[OpCall, Any]:
        """The validated call (without ``out``, which implementations never see) and the caller's ``out``."""
        backend = self._backend
        signature, host = signature_and_host(spec, args)
        device = ("cpu", 0)
        if not host:
            arrays = list(spec.iter_arrays(args))
            devices = {name: device_of(value) for name, value in arrays}
            for name, (kind, _) in devices.items():
                if kind == "unknown":
                    raise ArgumentTypeError(
                        f"argument {name!r}: expected an array (numpy, torch, or any DLPack array of the "
                        f"backend's device), got {type(args.get(name, spec)).__name__}"
                    )
            kinds = set(devices.values())
            if len(kinds) > 1:
                listing = ", ".join(f"{n} on {k}:{i}" for n, (k, i) in devices.items())
                raise ArgumentError(f"arrays from different devices: {listing}; move them to one device first")
            foreign = [n for n, v in arrays if not backend.owns(v)]
            if foreign:
                kind, index = devices[foreign[0]]
                raise ArgumentError(
                    f"argument {foreign[0]!r} lives on {kind}:{index}, which backend {backend.name!r} "
                    f"does not own; use the backend of that device or move the array with backend.asarray"
                )
            device = next(iter(kinds)) if kinds else device
        validate(spec, args, signature)  # what OpSpec.validate does, the signature taken once
        for name in spec.inplace_args:
            _check_writable(name, args.get(name))
        out = args.pop("out", None)
        _check_writable("out", out)
        index = device[1] if not host else 0
        return self._settled(spec, args, index, host and not backend.is_host, options), out

    def _settled(self, spec: OpSpec, args: dict[str, Any], index: int, host_arrays: bool,
                 options: Any = None) -> OpCall:
        """The call of validated ``args``, with the settings left ``"auto"`` chosen (:meth:`OpSpec.settle`)."""
        backend = self._backend
        settled = spec.settle(args, backend, index, self.registry.coverage(spec.name)) if spec.auto_settings else None
        return OpCall(spec=spec, args=args, backend=backend, device_index=index, host_arrays=host_arrays,
                      settled=settled, given_options=options)


    def choose(self, call: OpCall) -> tuple[OpImpl | None, dict[str, str]]:
        """The implementation to run for ``call`` (None: the fallback path) and why others were passed over: the
        highest-priority one whose ``supports(call)`` is True, none for an opt-in value the backend's coverage does
        not name (:meth:`OpCoverage.undeclared_opt_in`). The one place that decides; what reorders candidates goes here.
        """
        if (undeclared := self.registry.coverage(call.op).undeclared_opt_in(call.spec, call.args)) is not None:
            return None, {"coverage": f"{undeclared} by backend {self._backend.name!r}"}
        reasons: dict[str, str] = {}
        setting = None
        for impl in tuned_order(call, self.registry.implementations(call.op)):
            try:
                verdict = impl.supports(call)
            except Exception as exc:  # a plugin bug must not cost the caller a correct result
                setting = configuration_error(exc)
                if setting is None:
                    log.debug("hal: %s supports() raised", impl.name, exc_info=exc)
                    verdict = f"supports() raised {type(exc).__name__}: {exc}"
            if setting is not None:
                raise setting  # the user's setting is wrong: no other implementation would make it right
            if verdict is True:
                return impl, reasons
            reasons[impl.name] = verdict if isinstance(verdict, str) and verdict else "unsupported"
        return None, reasons

    def _execute(self, call: OpCall, out: Any = None, chosen: OpImpl | None = None, runner: Runner | None = None,
                 expected: _Expected = None, tried: _Tried = None) -> Any:
        """Run ``call`` on the implementation :meth:`choose` picks (``chosen``: picked already for its signature,
        by a :class:`BoundOp`, with ``runner``, its plan for the signature, ``expected``, the result's shape
        and dtype, and ``tried``, what the runner gave when the bound op ran it already), else on the fallback
        path; count it."""
        stats = self._op_stats(call.op)
        if _env.force_cpu() and self._fallback is not None:  # read on every backend: a misspelt value fails closed
            return self._fall_back(call, out, "HAL_FORCE_CPU is set", stats, log_it=False)
        impl, reasons = (chosen, {}) if chosen is not None else self.choose(call)
        if impl is not None:
            result, fault = self._run(impl, call, runner, expected, tried)
            if fault is None:
                self._count(call.op, impl, stats)
                return self._deliver(out, result)
            self._fault(call, impl, fault)
            reasons[impl.name] = fault
        reason = "; ".join(f"{name}: {why}" for name, why in reasons.items()) or "no implementation registered"
        if _env.strict():
            raise FallbackError(f"{call.op} on backend {self._backend.name!r} would fall back ({reason}); "
                                "unset HAL_STRICT to allow fallbacks")
        return self._fall_back(call, out, reason, stats)

    def _count(self, op: str, impl: OpImpl, stats: OpStats | None = None) -> None:
        """Count a call of ``op`` that ``impl`` served."""
        stats = self._op_stats(op) if stats is None else stats
        with self._lock:
            stats.calls += 1
            stats.implementations[impl.name] = stats.implementations.get(impl.name, 0) + 1

    def _plan(self, impl: OpImpl, call: OpCall) -> Runner | None:
        """``impl``'s runner for ``call``'s signature (see :class:`OpImpl`), or None (none, or its plan raised:
        logged at debug level, ``fn`` serves the signature)."""
        assert impl.plan is not None
        try:
            return impl.plan(call)
        except Exception as exc:
            if _env.strict():
                raise ImplementationError(f"implementation {impl.name!r} of {call.op}: plan() raised "
                                          f"{type(exc).__name__}: {exc}") from exc
            log.debug("hal: %s's plan() raised; its fn serves the call's signature", impl.name, exc_info=exc)
            return None

    def _run(self, impl: OpImpl, call: OpCall, runner: Runner | None = None, expected: _Expected = None,
             tried: _Tried = None) -> tuple[Any, str | None]:
        """Run ``impl`` (``runner``: its plan for the call's signature; it never sees the caller's ``out``);
        return (result, fault or None). ``tried``: what the runner already gave for this call (its result, or the
        exception it raised), judged as if it had run here."""
        try:
            if tried is None:
                result = impl.fn(call) if runner is None else runner(call.args)
            elif tried[1] is not None:
                raise tried[1]
            else:
                result = tried[0]
        except KernelCompileError as exc:
            log.debug("hal: %s failed to compile", impl.name, exc_info=exc)
            return None, f"kernel {exc.name!r} failed to compile (see the debug log for the compiler output)"
        except (ArgumentError, ArgumentTypeError, MemoryError):
            raise  # the caller's input or the device's memory: falling back would not help
        except Exception as exc:
            setting = configuration_error(exc)
            if setting is None:
                if _env.strict():
                    raise ImplementationError(f"implementation {impl.name!r} of {call.op} raised "
                                              f"{type(exc).__name__}: {exc}") from exc
                log.debug("hal: %s raised", impl.name, exc_info=exc)
                return None, f"raised {type(exc).__name__}: {exc}"
        else:
            problem = self._check_result(call, result, expected)
            if problem and _env.strict():
                raise ImplementationError(f"implementation {impl.name!r} of {call.op} {problem}")
            return result, problem
        raise setting  # the user's setting is wrong: a fallback would only hide it behind a slower path

    def _check_result(self, call: OpCall, result: Any, expected: _Expected = None) -> str | None:
        """Why ``result`` is not the op's declared result for ``call`` (shape, dtype, device), or None
        (``expected``: the declared shape and dtype, known already for the call's signature)."""
        spec = call.spec
        shape = spec.output_shape(call.args) if expected is None else expected[0]
        if shape is None:
            return None if result is None else f"returned {type(result).__name__}, expected None (an in-place op)"
        if type(result) is np.ndarray and result.shape == shape and (self._backend.is_host or call.host_arrays) \
                and result.dtype == (spec.output_dtype(call.args) if expected is None else expected[1]):
            return None  # the common host case, decided without names
        if result is None or not hasattr(result, "shape"):
            return f"returned {type(result).__name__}, expected an array of shape {shape}"
        if tuple(result.shape) != shape:
            return f"returned shape {tuple(result.shape)}, expected {shape}"
        declared = dtype_name(spec.output_dtype(call.args))
        if dtype_name(result) != declared:
            return f"returned dtype {dtype_name(result)}, expected {declared}"
        on_host = self._backend.is_host or call.host_arrays
        if on_host:
            if type(result) is not np.ndarray:
                return f"returned a {type(result).__name__}, expected a numpy array"
        elif not self._backend.owns(result) or device_of(result)[1] != call.device_index:
            return f"returned an array on {device_of(result)}, expected device {call.device_index}"
        return None

    def _deliver(self, out: Any, result: Any) -> Any:
        """``result`` to the caller: written into ``out`` when one was given."""
        if out is not None and result is not None and result is not out:
            out[...] = result
            return out
        return result

    def _fault(self, call: OpCall, impl: OpImpl, problem: str) -> None:
        """Record a fault (the fallback that follows logs it once, with the implementation's name)."""
        self._notify("fault", call, f"{impl.name}: {problem}")

    def _notify(self, kind: str, call: OpCall, reason: str) -> None:
        if not self._watchers:
            return
        event = DispatchEvent(kind, self._backend.name, call.op, reason, call)
        with self._lock:
            for events in self._watchers:
                events.append(event)

    def _log_once(self, kind: str, op: str, message: str) -> None:
        key = (op, message)
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.warning("hal: %s on backend %r: %s", op, self._backend.name, message)

    def _fall_back(self, call: OpCall, out: Any, reason: str, stats: OpStats, *, log_it: bool = True) -> Any:
        """Run ``call`` on the fallback backend (or the reference), copying device arrays in and out."""
        start = time.perf_counter()
        self._notify("fallback", call, reason)
        if log_it:
            where = self._fallback.name if self._fallback is not None else "the float64 reference"
            self._log_once("fallback", call.op, f"runs on {where}: {reason}")
        try:
            result, answered_by = self._run_fallback(call, out)
        finally:
            with self._lock:
                stats.calls += 1
                stats.fallbacks[reason] = stats.fallbacks.get(reason, 0) + 1
                stats.fallback_seconds += time.perf_counter() - start
        with self._lock:
            stats.implementations[answered_by] = stats.implementations.get(answered_by, 0) + 1
        return result

    def _run_fallback(self, call: OpCall, out: Any) -> tuple[Any, str]:
        spec, backend, fallback = call.spec, self._backend, self._fallback
        answered_by = f"fallback:{fallback.name}" if fallback is not None else "reference"

        def run(host_args: dict[str, Any]) -> Any:
            if fallback is not None:
                return fallback.ops._execute(OpCall(spec, host_args, fallback, given_options=call.given_options))
            return spec.run_reference(host_args)

        if backend.is_host or call.host_arrays:
            result = run(dict(call.args))
        else:
            def checked(host_args: dict[str, Any]) -> Any:
                if _env.check_indices():  # device indices, now on the host: checked before the host reads them
                    spec.check_index_values(host_args)
                return run(host_args)

            result = spec.run_elsewhere(call.args, lambda a: a if type(a) is np.ndarray else backend.to_numpy(a),
                                        checked, lambda array: backend.asarray(array, call.device_index))
        return (None if result is None else self._deliver(out, result)), answered_by

    def _empty_result(self, call: OpCall, out: Any) -> Any:
        shape = call.spec.output_shape(call.args)
        if shape is None:
            return None
        if out is not None:
            return out
        empty = np.zeros(shape, dtype=call.spec.output_dtype(call.args))
        if call.host_arrays or self._backend.is_host:
            return empty
        return self._backend.asarray(empty, call.device_index)


def _check_writable(name: str, value: Any) -> None:
    """Refuse a read-only ``value`` the op would write (None: not given; a writable numpy array: at once)."""
    if value is not None and (type(value) is not np.ndarray or not value.flags.writeable):
        check_writable(name, value)
