"""The request object implementations receive (:class:`OpCall`), and one implementation (:class:`OpImpl`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._backend import Backend
    from .._capabilities import DeviceCapabilities
    from ..tuning import Knob
    from ._spec import OpSpec

__all__ = ["OpCall", "OpImpl", "Runner"]

#: What :attr:`OpImpl.plan` returns: a function of one call's validated arguments (by name) returning what the
#: implementation's ``fn`` returns for them.
Runner = Callable[[Mapping[str, Any]], Any]

#: The argument values :meth:`OpCall.signature_only` keeps besides the bound ones.
_PLAIN = (int, float, str, bool, type(None))


@dataclass(frozen=True)
class OpCall:
    """One validated call of an op, as implementations receive it.

    ``args`` maps argument names to values. Implementations never receive
    the caller's ``out``: they return a new array of the declared shape,
    dtype and device, which hal checks and then writes into ``out``, so a
    failing implementation leaves ``out`` untouched. In-place arguments
    (the caches of ``write_kv_cache``) are given as they are, already
    checked to be writable.
    """

    spec: OpSpec
    args: Mapping[str, Any]
    backend: Backend
    device_index: int = 0
    #: True when the arrays are host (numpy) arrays given to a device backend.
    host_arrays: bool = False
    #: What :meth:`OpSpec.settle` chose for the settings the caller left ``"auto"``, and why (None: none).
    settled: str | None = None
    #: The :attr:`OpSpec.options` value the caller passed (None: the fields came as flat keywords).
    given_options: Any = None
    #: The arguments bound to the caller (:meth:`Ops.bind <hal_core.ops.Ops.bind>`): each the same object in every
    #: call of a signature, so a :attr:`OpImpl.plan` may read an array's address once.
    fixed: frozenset[str] = frozenset()

    @property
    def op(self) -> str:
        return self.spec.name

    @cached_property
    def flops(self) -> int:
        return self.spec.flops(self.args)

    @cached_property
    def nbytes(self) -> int:
        return self.spec.nbytes(self.args)

    @property
    def capabilities(self) -> DeviceCapabilities:
        """The capabilities of the device the call runs on."""
        return self.backend.device(self.device_index).capabilities

    def __getitem__(self, name: str) -> Any:
        return self.args[name]

    def signature_only(self) -> OpCall:
        """This call without the arguments that are its own: those not :attr:`fixed` other than plain numbers,
        strings and None (the options object a bound op was given stays: it is the same in every call). What a
        :attr:`OpImpl.plan` keeps for later calls of the signature (``kept.with_args(args)`` is such a call): a
        plan that kept the call itself would keep its first call's activations, as large as a prompt, alive as
        long as the signature."""
        kept = {name: value for name, value in self.args.items() if name in self.fixed or type(value) in _PLAIN}
        return replace(self, args=kept)

    def with_args(self, args: Mapping[str, Any]) -> OpCall:
        """This call with ``args`` as its arguments and none bound: ``replace(self, args=args, fixed=frozenset())``
        at a third of its cost (a plan's runner makes one per call). Only the fields are copied: what a call
        caches (:attr:`flops`, :attr:`options`, an implementation's per-call values) is computed anew."""
        call = object.__new__(OpCall)
        state, own = call.__dict__, self.__dict__
        for name in _FIELDS:
            state[name] = own[name]  # a frozen dataclass: set as its own __init__ does
        state["args"] = args
        state["fixed"] = frozenset()
        return call

    @cached_property
    def options(self) -> Any:
        """The op's :attr:`~OpSpec.options` group as one value (``paged_attention``: an
        :class:`~hal_core.ops.AttentionOptions`): the caller's own object when its fields reached the call
        unchanged, else one made from the validated arguments (given flat, or arrays moved to another memory).
        ``args`` holds the same fields by name."""
        group = self.spec.options
        if group is None:
            raise AttributeError(f"op {self.op!r} declares no options group")
        return group.value_of(self.args, self.given_options)


def _always(call: OpCall) -> bool:
    return True


#: OpCall's dataclass fields, the state :meth:`OpCall.with_args` copies.
_FIELDS = tuple(f.name for f in fields(OpCall))


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op.

    ``supports(call)`` returns True when it can run the call, else False or
    a string saying why not (logged with the fallback). Among those that
    support a call, the highest ``priority`` runs, unless ``hal tune``
    persisted another choice for the call's shape bucket on this device.
    ``knobs`` are the implementation's tunable parameters
    (:class:`hal_core.tuning.Knob`); ``fn`` reads each with ``knob.value(call)``.

    ``plan`` (optional) serves a caller that repeats one call signature, a bound op
    (:meth:`Ops.bind <hal_core.ops.Ops.bind>`): ``plan(call)`` returns a :data:`Runner` for every later call
    of ``call``'s *signature*, or None to keep ``fn``. A signature fixes each array's shape, strides and
    dtype, each scalar's and setting's value, the tune table, and the objects bound to the caller
    (:attr:`OpCall.fixed` names them: an array there keeps its address). It leaves to each call the values
    of every array, the addresses of the others, and the hints (``max_seq_len``: an upper bound, given per
    call or not at all). ``runner(args)`` gets arguments that passed the op's checks, returns what
    ``fn(OpCall(args=args, ...))`` would and keeps none of them; nor may the plan keep ``call``'s own arrays
    (keep :meth:`OpCall.signature_only` where a runner needs a call). It does per call only what varies
    (typically: the addresses of the call's arrays and a new output) and calls ``fn`` itself for anything its
    plan does not cover (a setting changed since, such as the thread count). hal checks the planned result's
    shape and dtype on every call and treats a runner's exception as ``fn``'s (the call falls back).
    """

    op: str
    fn: Callable[[OpCall], Any]
    name: str = ""
    priority: int = 0
    supports: Callable[[OpCall], bool | str] = field(default=_always)
    knobs: tuple[Knob, ...] = ()
    plan: Callable[[OpCall], Runner | None] | None = None

    @property
    def supports_every_call(self) -> bool:
        """Whether ``supports`` is the default (every valid call): no predicate can turn this implementation down."""
        return self.supports is _always

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__qualname__", repr(self.fn)))
