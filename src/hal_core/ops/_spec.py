"""What every op definition provides, and the request object implementations receive."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    from .._backend import Backend
    from .._capabilities import DeviceCapabilities
    from ..tuning import Knob

__all__ = ["OpCall", "OpImpl", "OpSpec"]


class OpSpec(ABC):
    """One op, defined once for every backend.

    ``validate`` runs before any implementation; ``flops`` and ``nbytes``
    feed offload thresholds and rooflines; ``reference`` is the float64
    numpy truth tests compare against.
    """

    name: ClassVar[str]
    #: Names of the array arguments (converted, device-checked and offloaded together).
    array_args: ClassVar[tuple[str, ...]]
    #: Array arguments the op writes in place (besides ``out``).
    inplace_args: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def validate(self, args: dict[str, Any], to_numpy: Callable[[Any], np.ndarray]) -> None:
        """Raise ``ArgumentError``/``ArgumentTypeError`` naming the bad argument.

        ``to_numpy`` copies small index arrays to the host for value checks.
        """
        raise NotImplementedError("The 'validate' method must be implemented.")

    @abstractmethod
    def output_shape(self, args: Mapping[str, Any]) -> tuple[int, ...] | None:
        """Shape of the returned array, or None for ops that only write in place."""
        raise NotImplementedError("The 'output_shape' method must be implemented.")

    @abstractmethod
    def output_dtype(self, args: Mapping[str, Any]) -> np.dtype:
        """numpy dtype of the returned array (bf16 as ml_dtypes' bfloat16)."""
        raise NotImplementedError("The 'output_dtype' method must be implemented.")

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
        """The float64 numpy result for numpy ``args`` (inputs are not modified)."""
        raise NotImplementedError("The 'reference' method must be implemented.")

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """Raise ``ArgumentError`` naming an index argument whose values are out of range (host arrays).

        :meth:`validate` calls it for host index arrays under
        ``HAL_CHECK_INDICES``; the fallback path calls it after copying a
        device call's arrays to the host. Device kernels check the values
        they use themselves. The default checks nothing (ops without indices).
        """
        return None

    def iter_arrays(self, args: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """``(name, array)`` for every array argument given (None ones skipped)."""
        for name in self.array_args:
            value = args.get(name)
            if value is not None:
                yield name, value

    def map_arrays(self, args: Mapping[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
        """A copy of ``args`` with ``fn`` applied to every array argument."""
        mapped = dict(args)
        for name, value in self.iter_arrays(args):
            mapped[name] = fn(value)
        return mapped

    def is_empty(self, args: Mapping[str, Any]) -> bool:
        """True when there is no work at all (an implementation need not be called)."""
        shape = self.output_shape(args)
        return shape is not None and 0 in shape


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

    @property
    def op(self) -> str:
        return self.spec.name

    @property
    def out(self) -> Any:
        """Always None: implementations return a new array and hal writes the caller's ``out``."""
        return self.args.get("out")

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


def _always(call: OpCall) -> bool:
    return True


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op.

    ``supports(call)`` returns True when it can run the call, else False or
    a string saying why not (logged with the fallback). Among those that
    support a call, the highest ``priority`` runs, unless ``hal tune``
    persisted another choice for the call's shape bucket on this device.
    ``knobs`` are the implementation's tunable parameters
    (:class:`hal_core.tuning.Knob`); ``fn`` reads each with ``knob.value(call)``.
    """

    op: str
    fn: Callable[[OpCall], Any]
    name: str = ""
    priority: int = 0
    supports: Callable[[OpCall], bool | str] = field(default=_always)
    knobs: tuple[Knob, ...] = ()

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__qualname__", repr(self.fn)))
