"""What every op definition provides (the request object implementations receive is in :mod:`._call`)."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._errors import ArgumentTypeError
from ..arrays import dtype_name, numpy_dtype
from ..tuning._lookup import setting_value
from ._call import OpCall, OpImpl, Runner
from ._declare import Arg, BenchCases, Feature, Output, Role
from ._device_features import device_features
from ._groups import ArgGroup
from ._plans import host_signature
from ._plans import validate as validate_planned
from ._validate import Step, output_shape, plan

if TYPE_CHECKING:
    from .._backend import Backend
    from ._coverage import OpCoverage

__all__ = ["OpCall", "OpImpl", "OpSpec", "Runner"]


class OpSpec(ABC):
    """One op, declared once for every backend.

    A subclass declares the op's facts as class attributes — ``name``, ``args``
    (:class:`~hal_core.ops.Arg` in signature order), ``output``
    (:class:`~hal_core.ops.Output` or None for ops that only write in place),
    ``features`` (what an :class:`~hal_core.ops.OpCoverage` may constrain) and
    ``bench`` (:class:`~hal_core.ops.BenchCases`) — and implements what only
    it knows: ``flops``, ``nbytes``, the float64 ``reference``, and optionally
    ``check`` (relations a layout cannot express), ``check_index_values`` and
    ``bucket``. Everything else (the front door method, argument checks,
    output shape and dtype, device handling, the torch schema and fake,
    coverage, bench and explain cases) is derived from the declaration.
    Register an instance with :func:`hal_core.ops.register_op`.
    """

    name: ClassVar[str]
    args: ClassVar[tuple[Arg, ...]]
    output: ClassVar[Output | None] = None
    features: ClassVar[tuple[Feature, ...]] = ()
    bench: ClassVar[BenchCases | None] = None
    #: Settings a caller may leave to the backend (``"auto"``), by argument name: the concrete values
    #: :meth:`settle` chooses between and ``hal tune`` times. Empty for most ops.
    auto_settings: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})
    #: Arguments passed and received as one value (:class:`~hal_core.ops._groups.ArgGroup`: ``paged_attention``'s
    #: :class:`~hal_core.ops.AttentionOptions`), appended to :attr:`args`; None for most ops.
    options: ClassVar[ArgGroup | None] = None

    # Derived from the declaration when the class is created:
    #: Names of the array arguments (converted, device-checked and offloaded together).
    array_args: ClassVar[tuple[str, ...]]
    #: Array arguments the op writes in place (besides ``out``).
    inplace_args: ClassVar[tuple[str, ...]]
    #: Layouts of the array arguments by name.
    layouts: ClassVar[Mapping[str, str]]
    #: How the output shape is read: ``(argument, axis, offset)`` per output dimension.
    output_plan: ClassVar[tuple[tuple[str, int, int], ...]]
    #: The argument whose shape the output has, when it has exactly one's (else None).
    output_like: ClassVar[str | None]
    #: The order arguments are checked in: quantized weights first, then the arguments whose dtype others
    #: take (the references a mismatching argument is blamed against), then the others in signature order.
    check_order: ClassVar[tuple[Arg, ...]]
    #: The same checks, precomputed for the hot path (:func:`~hal_core.ops._validate.plan`).
    input_plan: ClassVar[tuple[Step, ...]]
    output_check: ClassVar[tuple[Step, ...]]
    #: Names of the array arguments, and of the quantized-weight arguments.
    array_names: ClassVar[tuple[str, ...]]
    weight_names: ClassVar[tuple[str, ...]]
    #: The host-number arguments (scalars and hints), in check order.
    number_args: ClassVar[tuple[Arg, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "args" not in cls.__dict__:
            return  # an intermediate base, or a subclass that only overrides behaviour
        grouped = () if cls.options is None else cls.options.args
        args = tuple(cls._complete_out(arg) for arg in (*cls.args, *grouped))
        names = [a.name for a in args]
        if len(set(names)) != len(names):
            raise TypeError(f"op {cls.name!r}: argument names must be distinct, got {names}")
        referenced = {arg.dtype_of for arg in args if arg.dtype_of}
        for arg in args:
            source = next((a for a in args if a.name == arg.dtype_of), None) if arg.dtype_of else None
            if arg.dtype_of and (source is None or not source.is_array or source.dtype_of or not source.required):
                raise TypeError(f"op {cls.name!r}: argument {arg.name!r} takes the dtype of {arg.dtype_of!r}, "
                                f"which must be a required array argument declaring its own dtypes")
        cls.args = args
        cls.array_args = tuple(a.name for a in args if a.is_array)
        cls.inplace_args = tuple(a.name for a in args if a.mutated)
        cls.layouts = {a.name: a.layout for a in args if a.layout}
        cls.output_plan = cls._plan_output(args)
        sources = {name for name, _, _ in cls.output_plan}
        cls.output_like = next(iter(sources)) if len(sources) == 1 and all(
            axis == i and delta == 0 for i, (_, axis, delta) in enumerate(cls.output_plan)) and len(
            cls.arg_dims(next(iter(sources)))) == len(cls.output_plan) else None
        cls.check_order = tuple(sorted(args, key=lambda a: (not a.is_weight, a.name not in referenced)))
        cls.input_plan = plan([a for a in cls.check_order if a.role is not Role.OUTPUT])
        cls.output_check = plan([a for a in cls.check_order if a.role is Role.OUTPUT])
        cls.array_names = tuple(a.name for a in args if a.is_array)
        cls.weight_names = tuple(a.name for a in args if a.is_weight)
        cls.number_args = tuple(a for a in cls.check_order if a.role in (Role.SCALAR, Role.HINT))

    @classmethod
    def _complete_out(cls, arg: Arg) -> Arg:
        if arg.role is not Role.OUTPUT:
            return arg
        if cls.output is None:
            raise TypeError(f"op {cls.name!r}: an 'out' argument needs an output declaration")
        fixed = (cls.output.dtype,) if cls.output.dtype else ()
        return Arg(arg.name, Role.OUTPUT, cls.output.layout, fixed, cls.output.dtype_of or None, True, False, True,
                   doc=arg.doc)

    @classmethod
    def arg_named(cls, name: str) -> Arg:
        """The declaration of argument ``name`` (KeyError when the op has none)."""
        for arg in cls.args:
            if arg.name == name:
                return arg
        raise KeyError(f"op {cls.name!r} has no argument {name!r}")

    @classmethod
    def arg_dims(cls, name: str) -> tuple[Any, ...]:
        """The layout dimensions of argument ``name``."""
        return cls.arg_named(name).dims

    @classmethod
    def _plan_output(cls, args: tuple[Arg, ...]) -> tuple[tuple[str, int, int], ...]:
        if cls.output is None:
            return ()
        plan = []
        for dim in cls.output.dims:
            for arg in args:
                if arg.role is Role.OUTPUT or not arg.required:
                    continue
                axes = [axis for axis, d in enumerate(arg.dims) if d.name == dim.name]
                if axes:
                    plan.append((arg.name, axes[0], dim.offset - arg.dims[axes[0]].offset))
                    break
            else:
                raise TypeError(f"op {cls.name!r}: no required argument's layout names output dimension {dim.name!r}")
        return tuple(plan)

    # -- derived behaviour ------------------------------------------------------------------------

    def validate(self, args: dict[str, Any], to_numpy: Callable[[Any], np.ndarray]) -> None:
        """Raise ``ArgumentError``/``ArgumentTypeError`` naming the bad argument (host numbers normalised in place).

        The declared checks run first (:func:`~hal_core.ops._validate.check_declared`), then :meth:`check`,
        then the ``out`` argument's. Host (numpy) arguments whose signature passed the declared checks
        before reuse what they bound (:mod:`hal_core.ops._plans`); their numbers and :meth:`check` still
        run on every call.
        ``to_numpy`` copies small index arrays to the host for value checks.
        """
        validate_planned(self, args, host_signature(self, args))

    def check_layout(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        """What the declaration cannot say about types, dtypes and layouts only (a weight's arrays); ``sizes`` as
        bound. Runs before :meth:`check` wherever the declared checks run, and once per signature on a
        :class:`~hal_core.ops.BoundOp` (whose fixed arrays keep their layout and whose other arrays are in the
        signature), so it must read no value. The default checks nothing.
        """
        return None

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        """What the declaration cannot say (relations between sizes, index values); ``sizes`` as bound.

        Runs on every call, a bound op's included. The default checks nothing.
        """
        return None

    def output_shape(self, args: Mapping[str, Any]) -> tuple[int, ...] | None:
        """Shape of the returned array, or None for ops that only write in place."""
        if self.output_like is not None:  # the output has one argument's shape (the common case)
            return tuple(args[self.output_like].shape)
        return output_shape(self, args)

    def output_dtype(self, args: Mapping[str, Any]) -> np.dtype:
        """numpy dtype of the returned array (bf16 as ml_dtypes' bfloat16); for in-place ops, what they write."""
        if self.output is not None and self.output.dtype:
            return numpy_dtype(self.output.dtype)
        source = args[self.output.dtype_of if self.output is not None else self.inplace_args[0]]
        if type(source) is np.ndarray:
            return source.dtype
        return numpy_dtype(dtype_name(source))

    def is_empty(self, args: Mapping[str, Any]) -> bool:
        """True when there is no work at all (an implementation need not be called)."""
        shape = self.output_shape(args)
        return shape is not None and 0 in shape

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Raise ``ArgumentError`` naming an index argument whose values are out of range (host arrays).

        :meth:`check` calls it for host index arrays under
        ``HAL_CHECK_INDICES``; the fallback path calls it after copying a
        device call's arrays to the host. Device kernels check the values
        they use themselves. The default checks nothing (ops without indices).
        """
        return None

    def settle(self, args: dict[str, Any], backend: Backend, device_index: int, coverage: OpCoverage) -> str | None:
        """Replace each ``"auto"`` of :attr:`auto_settings` in the validated ``args`` by a concrete value.

        Called by the front door after validation and before an implementation is chosen, so
        implementations, references, coverage and stats only ever see concrete values. A setting
        with one possible value (:meth:`auto_candidates`) takes it; else the value ``hal tune``
        persisted for the call's bucket on this device, else :meth:`auto_rule`'s for the device's
        feature flags (:func:`~hal_core.ops._device_features.device_features`). ``coverage`` is
        the backend's declaration for the op (``"auto"`` never picks a value it leaves to the
        fallback). Returns what was chosen and why (``hal info --explain`` shows it), or None when
        nothing was left open. Only ops declaring :attr:`auto_settings` are called.
        """
        notes = []
        for name in self.auto_settings:
            if args.get(name) != "auto":
                continue
            values, why = self.auto_candidates(name, args, coverage)
            if len(values) > 1:
                bucket = self.bucket(args)
                tuned = setting_value(backend, device_index, self.name, name, bucket)
                if tuned in values:
                    choice, why = tuned, f"hal tune's choice for bucket {bucket!r} on this device"
                else:
                    choice, why = self.auto_rule(name, args, device_features(backend, device_index))
            else:
                choice = values[0]
            args[name] = choice
            notes.append(f"{name} 'auto' -> {choice!r}: {why}")
        return "; ".join(notes) or None

    def auto_candidates(self, name: str, args: Mapping[str, Any], coverage: OpCoverage) -> tuple[tuple[str, ...], str]:
        """The values ``"auto"`` may choose for setting ``name`` of this call on a backend declaring ``coverage``,
        and why when there is only one. The default: every value of :attr:`auto_settings`."""
        return self.auto_settings[name], ""

    def auto_rule(self, name: str, args: Mapping[str, Any], features: frozenset[str]) -> tuple[str, str]:
        """The built-in choice for setting ``name`` left ``"auto"`` (when ``hal tune`` persisted none) on a device
        with the feature flags ``features`` (``DeviceCapabilities.features``), and why."""
        return self.auto_settings[name][0], "the first value (no rule declared)"

    def bucket(self, args: Mapping[str, Any]) -> str:
        """The tuning bucket of a validated call: a short string from shapes only (never device data)."""
        return "all"

    def features_of(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """The call's values of the declared :attr:`features` (``{"dtype": "fp16", "head_size": 128, ...}``)."""
        return {feature.name: feature.get(args) for feature in self.features}

    def iter_arrays(self, args: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """``(name, array)`` for every array argument given (None ones skipped), a weight's as ``name.field``."""
        for name in self.array_names:
            value = args.get(name)
            if value is not None:
                yield name, value
        for name in self.weight_names:
            value = args.get(name)
            if value is not None and hasattr(value, "arrays"):
                for field_name, array in value.arrays().items():
                    yield f"{name}.{field_name}", array

    def map_arrays(self, args: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
        """A copy of ``args`` with ``fn`` applied to every array argument (a weight's arrays included)."""
        mapped = dict(args)
        for arg in self.args:
            value = args.get(arg.name)
            if value is None:
                continue
            if arg.role is Role.WEIGHT:
                mapped[arg.name] = value.map_arrays(fn)
            elif arg.is_array:
                mapped[arg.name] = fn(value)
        return mapped

    def run_elsewhere(self, args: Mapping[str, Any], there: Callable[[Any], Any],
                      run: Callable[[dict[str, Any]], Any], back: Callable[[Any], Any]) -> Any:
        """Run the op on copies of ``args`` in another memory domain, and bring the effects back.

        Every array is moved with ``there``; ``run(moved_args)`` computes; each in-place argument is
        written back from its moved copy through ``back``, and the result (if any) is returned through
        ``back``. The one host↔device round trip: a device call falling back to the host, and host
        arrays offloaded to a device, both use it.
        """
        moved = self.map_arrays(args, there)
        result = run(moved)
        for name in self.inplace_args:
            if args.get(name) is not None:  # an optional in-place argument may be absent
                args[name][...] = back(moved[name])
        return None if result is None else back(result)

    def run_reference(self, args: Mapping[str, Any]) -> Any:
        """The float64 reference on host ``args``, cast to the op's dtype; in-place arguments given are written
        (from the reference's results after the output, when the op has both). What a call with no host backend
        to fall back to returns."""
        result = self.reference(args)
        if self.inplace_args:
            written, result = (result, None) if self.output is None else (result[1:], result[0])
            for name, value in zip(self.inplace_args, written, strict=False):
                if value is not None and args.get(name) is not None:
                    args[name][...] = value.astype(args[name].dtype)
        return None if result is None else result.astype(self.output_dtype(args))

    def signature(self) -> inspect.Signature:
        """The front door's signature: required arguments positional, the others keyword-only; an :attr:`options`
        group's fields default to None (the group's value may give them) and its value is keyword ``options``."""
        params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        grouped = self.group_names()
        for arg in self.args:
            kind = inspect.Parameter.KEYWORD_ONLY if arg.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
            default = inspect.Parameter.empty if arg.required and arg.name not in grouped else arg.default
            params.append(inspect.Parameter(arg.name, kind, default=default))
        if self.options is not None:
            params.append(inspect.Parameter(self.options.name, inspect.Parameter.KEYWORD_ONLY, default=None))
        return inspect.Signature(params)

    def merge_options(self, args: dict[str, Any], options: Any) -> dict[str, Any]:
        """``args`` with the fields of the :attr:`options` value ``options`` filled in (None: ``args`` as given);
        ``ArgumentError`` naming the fields also given flat."""
        if options is None:
            return args
        if self.options is None:
            raise ArgumentTypeError(f"op {self.name!r} takes no 'options' argument")
        return self.options.merge(args, options)

    def group_names(self) -> frozenset[str]:
        """Names of the arguments of the :attr:`options` group (empty without one)."""
        return frozenset(() if self.options is None else self.options.names)

    # -- what only the op knows ---------------------------------------------------------------------

    @abstractmethod
    def flops(self, args: Mapping[str, Any]) -> int:
        """Floating-point (or integer multiply-add) operations, FMA counted as 2."""
        raise NotImplementedError("The 'flops' method must be implemented.")

    @abstractmethod
    def nbytes(self, args: Mapping[str, Any]) -> int:
        """Bytes an ideal implementation moves to and from memory."""
        raise NotImplementedError("The 'nbytes' method must be implemented.")

    @abstractmethod
    def reference(self, args: Mapping[str, Any]) -> Any:
        """The float64 numpy result for numpy ``args`` (inputs are not modified).

        Ops that write in place return the new values of their in-place
        arguments, in :attr:`inplace_args` order; an op with an output as
        well returns ``(output, *those values)``, None for an optional
        in-place argument not given (``rms_norm``'s ``residual``).
        """
        raise NotImplementedError("The 'reference' method must be implemented.")
