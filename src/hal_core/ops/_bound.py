"""An op with some arguments fixed (:meth:`Ops.bind <hal_core.ops.Ops.bind>`): the front door for a caller that
makes the same call many times with new activations (a layer's weight, a step's options).

``bound(**rest)`` is ``ops.<op>(**fixed, **rest)``: the same checks and errors, implementation choice,
result checks, fallbacks (logged once, counted, :class:`~hal_core.FallbackError` under ``HAL_STRICT=1``),
``HAL_FORCE_CPU``, statistics and watchers. What binding saves, on a call whose arrays are all host
(numpy) arrays and whose other arguments are plain numbers, strings or None:

- the fixed arguments are imported, their numbers and choices normalised and their devices checked once,
  at :meth:`~hal_core.ops.Ops.bind`;
- the first call of each *signature* (each given array's shape, strides and dtype, each scalar argument's
  value and type, each hint's type) is checked in full; the next ones of that signature take from it the
  sizes the declared checks bound, the normalised scalars and the settings ``"auto"`` chose, normalise
  their hints, and run only the checks that read values (the op's own :meth:`~hal_core.ops.OpSpec.check`,
  the writability of what it writes; not :meth:`~hal_core.ops.OpSpec.check_layout`, which reads only
  layouts the signature and the binding fix). A hint (an upper bound that plans work, such as ``max_seq_len``)
  enters the signature by value only for an op with ``"auto"`` settings, which may read it;
- the implementation chosen for a signature is kept too where no implementation of the op has a
  ``supports`` predicate and the choice cannot depend on values (one implementation, or no tune table),
  and asked for again whenever the backend's implementations, its coverage or its tune table change;
- where that implementation has a ``plan`` (:class:`~hal_core.ops.OpImpl`), the signature's first call asks it
  for a runner, which the next calls run instead of ``fn`` (the implementation's per-call work done once),
  their results checked against the shape and dtype the first one had.

A fixed array keeps the shape, strides and dtype it had when bound (its values may change: a call reads
them). At most :data:`MAX_SIGNATURES` signatures are kept per bound op, the oldest dropped first. Anything
else (an array that is not a numpy array, a fixed argument that is not a host one) goes through the front
door unchanged. ``out`` may be given per call, and is checked and written as the front door does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _env, interop
from .._errors import ArgumentError
from ..tuning._lookup import overridden, table_for
from ._checks import check_writable
from ._declare import Role
from ._spec import OpCall, OpImpl, Runner
from ._validate import check_declared, check_output, host_number

if TYPE_CHECKING:
    from ._dispatch import Ops
    from ._spec import OpSpec

__all__ = ["MAX_SIGNATURES", "BoundOp"]

#: Signatures kept per bound op (a layer sees one or two row counts in decode, a server a few batch sizes).
MAX_SIGNATURES = 16

#: The types of non-array values a signature holds by value (anything else takes the front door).
_PLAIN = (int, float, str, bool, type(None))


@dataclass(frozen=True, slots=True)
class _Signature:
    """What the first call of one signature learnt, valid while ``impls``, ``coverage`` and ``table`` stand."""

    sizes: Mapping[str, int]
    scalars: Mapping[str, Any]  # the call's scalars and settings (hints aside), normalised and settled
    settled: str | None  # what the "auto" settings chose, and why (OpCall.settled)
    impl: OpImpl | None  # None: chosen per call
    runner: Runner | None  # impl's plan for the signature (with impl only)
    result: tuple[tuple[int, ...] | None, Any]  # the result's shape and dtype ((None, None): an in-place op)
    generation: int  # the registry's, when learnt
    table: Any


class BoundOp:
    """``ops.<op>`` with ``fixed`` arguments bound (see the module docs); made by :meth:`Ops.bind`.

    Call it with the remaining arguments as keywords; it returns what the op returns. ``fixed`` may hold
    any declared argument but ``out`` (give ``out`` per call), or the op's options group as one value.
    """

    __slots__ = ("_fast", "_fixed", "_free", "_given", "_hints", "_lock", "_ops", "_options", "_raw", "_signatures",
                 "_spec")

    def __init__(self, ops: Ops, spec: OpSpec, fixed: Mapping[str, Any]) -> None:
        given = dict(fixed)
        self._raw = dict(fixed)  # as given: the options group stays one object (implementations see it)
        options = given.pop(spec.options.name, None) if spec.options is not None else None
        self._options = options
        declared = {arg.name for arg in spec.args}
        for name in given:
            if name not in declared:
                raise TypeError(f"{spec.name}() got an unexpected keyword argument {name!r}")
        if "out" in given:
            raise ArgumentError("argument 'out': give it per call, not to bind()")
        if options is not None:
            given = spec.merge_options(given, options)
        self._ops, self._spec, self._given = ops, spec, given
        native, _ = interop.import_arrays(spec, dict(given), ops.backend)
        self._fast = all(_host_value(spec, name, value) for name, value in native.items())
        #: what a call may give and still take the host path
        self._free = frozenset(declared - given.keys())
        #: the hints a call may give, entering its signature by type (see the module docs)
        self._hints = {} if spec.auto_settings else {arg.name: arg for arg in spec.number_args
                                                     if arg.role is Role.HINT and arg.name not in given}
        if self._fast:  # numbers and choices checked now, as the front door would on the first call
            for arg in spec.number_args:
                if native.get(arg.name) is not None:
                    native[arg.name] = host_number(arg, native[arg.name])
        self._fixed = native
        self._signatures: dict[tuple[Any, ...], _Signature] = {}
        self._lock = threading.Lock()  # for keeping a signature (looking one up takes none)

    @property
    def op(self) -> str:
        """The op's name."""
        return self._spec.name

    @property
    def backend(self) -> Any:
        """The backend whose front door runs the calls."""
        return self._ops.backend

    @property
    def fixed(self) -> Mapping[str, Any]:
        """The bound arguments, as given to :meth:`Ops.bind` (the options group as its fields)."""
        return dict(self._given)

    def signature_count(self) -> int:
        """How many signatures this bound op keeps now."""
        return len(self._signatures)

    def __repr__(self) -> str:
        return f"<hal bound {self._spec.name} on {self._ops.backend.name!r}: {', '.join(sorted(self._given))}>"

    def __call__(self, **args: Any) -> Any:
        """``ops.<op>(**fixed, **args)``: returns and raises what the front door does (TypeError for an argument
        bound already)."""
        if self._fast and args.keys() <= self._free:
            key = _signature(args, self._hints)
            if key is not None:
                return self._run(key, {**self._fixed, **args})
        twice = (self._given.keys() | self._raw.keys()) & args.keys()
        if twice:
            raise TypeError(f"{self._spec.name}(): argument {sorted(twice)[0]!r} is bound already")
        return self._ops.call(self._spec.name, {**self._raw, **args})

    def signature(self, args: Mapping[str, Any]) -> tuple[Any, ...] | None:
        """The signature of a call giving ``args`` (all of them free), or None where the call takes the front door
        (an array that is not a numpy array, a value that is not a plain number, string or None)."""
        return _signature(args, self._hints) if self._fast else None

    def _run(self, key: tuple[Any, ...], args: dict[str, Any]) -> Any:
        spec, ops = self._spec, self._ops
        known = self._signatures.get(key)
        if known is None or not self._current(known):
            return self._first(key, args)
        args.update(known.scalars)
        for name, arg in self._hints.items():
            value = args.get(name)
            if value is not None:
                args[name] = host_number(arg, value)
        spec.check(args, known.sizes)
        for name in spec.inplace_args:
            _check_writable(name, args.get(name))
        out = args.pop("out", None)
        if out is not None:
            _check_writable("out", out)
        runner = known.runner
        tried: tuple[Any, Exception | None] | None = None
        if runner is not None and not _env.force_cpu():
            # the common case without the front door's tail: the runner's result, checked as the tail checks a
            # host result and counted as it counts one. Anything else (it raised, or returned another result) goes
            # to the tail with what the runner gave: a fault falls back, what the caller must fix is raised.
            try:
                result = runner(args)
            except Exception as exc:
                tried = (None, exc)
            else:
                shape, dtype = known.result
                if (result is None if shape is None else
                        type(result) is np.ndarray and result.shape == shape and result.dtype == dtype):
                    assert known.impl is not None  # a runner is kept with its implementation only
                    ops._count(spec.name, known.impl)
                    return ops._deliver(out, result)
                tried = (result, None)
        backend = ops.backend
        call = OpCall(spec=spec, args=args, backend=backend, host_arrays=not backend.is_host, settled=known.settled,
                      given_options=self._options)
        return ops._execute(call, out, known.impl, runner, known.result, tried)

    def _current(self, known: _Signature) -> bool:
        return (self._ops.registry.generation == known.generation and table_for(self._ops.backend, 0) is known.table
                and not overridden())

    def _first(self, key: tuple[Any, ...], args: dict[str, Any]) -> Any:
        """The full checks (what the front door runs on a new signature), then the call; the signature kept."""
        spec, ops = self._spec, self._ops
        registry = ops.registry
        impls, generation, table = registry.implementations(spec.name), registry.generation, table_for(ops.backend, 0)
        bound = check_declared(spec, args)
        spec.check_layout(args, bound.sizes)
        spec.check(args, bound.sizes)
        check_output(spec, args, bound)
        for name in spec.inplace_args:
            _check_writable(name, args.get(name))
        out = args.pop("out", None)
        if out is not None:
            _check_writable("out", out)
        call = ops._settled(spec, args, 0, not ops.backend.is_host, self._options)
        if spec.is_empty(args):
            return ops._empty_result(call, out)
        impl = None
        if impls and all(i.supports_every_call for i in impls) and (len(impls) == 1 or table is None):
            impl = ops.choose(call)[0]
        result = ops._execute(call, out, impl)
        if overridden():
            return result  # knobs forced for this block: what it plans holds only inside it
        runner, shape = None, spec.output_shape(call.args)
        if impl is not None and impl.plan is not None:
            runner = ops._plan(impl, replace(call, fixed=frozenset(self._fixed)))
        scalars = {arg.name: args[arg.name] for arg in spec.number_args
                   if arg.name in args and arg.name not in self._hints}
        with self._lock:
            signatures = self._signatures
            while len(signatures) >= MAX_SIGNATURES:
                del signatures[next(iter(signatures))]
            signatures[key] = _Signature(
                sizes=bound.sizes, scalars=scalars, settled=call.settled, impl=impl, runner=runner,
                result=(None, None) if shape is None else (shape, spec.output_dtype(call.args)), generation=generation,
                table=table)
        return result


def _signature(args: Mapping[str, Any], hints: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The signature of a call's arguments (see the module docs); None where one is neither a numpy array nor a
    plain value."""
    key: list[Any] = []
    for name, value in args.items():
        if type(value) is np.ndarray:
            key.append((name, value.shape, value.strides, value.dtype))
        elif type(value) not in _PLAIN:
            return None
        elif name in hints:
            key.append((name, type(value)))
        else:
            key.append((name, type(value), value))
    return tuple(key)


def _check_writable(name: str, value: Any) -> None:
    if value is not None and not value.flags.writeable:
        check_writable(name, value)


def _host_value(spec: OpSpec, name: str, value: Any) -> bool:
    """Whether a fixed argument keeps the bound op on the host path: no array but numpy ones."""
    arg = next(a for a in spec.args if a.name == name)
    if value is None or arg.role in (Role.SCALAR, Role.HINT):
        return True
    return all(type(array) is np.ndarray for _, array in spec.iter_arrays({name: value}))
