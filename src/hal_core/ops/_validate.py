"""The checks every declared argument gets: rank, dtype, layout, the sizes layouts share, host numbers.

:func:`check_declared` runs them in declaration order and returns the sizes the layouts bind
(``{"num_seqs": 8, "head_size": 128, ...}``); an op's own ``check`` then adds what a declaration
cannot say (GQA divisibility, index values). Every error names the argument, the expected and the
actual value, before any work.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ArgumentError, ArgumentTypeError
from ..arrays import DTYPE_NAMES
from ..quant import QuantizedWeight
from ._checks import check_array, fail, rows_contiguous
from ._declare import Arg, Dim, Role

if TYPE_CHECKING:
    from ._spec import OpSpec

__all__ = ["Bound", "check_declared", "check_output", "check_shapes", "host_number", "output_shape", "real"]


def real(value: Any) -> float | None:
    """``value`` as a float: a Python or numpy real scalar or a 0-d real numpy array (never a bool); else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        return float(value)
    return None


def _instance(value: Any, kind: type) -> bool:
    """``isinstance(value, kind)`` without narrowing ``value`` (a weight class only known at run time)."""
    return isinstance(value, kind)


def _integer(value: Any) -> int | None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def host_number(arg: Arg, value: Any) -> int | float | str:
    """A SCALAR or HINT argument checked and normalised (Python int / float / str), or an error naming it."""
    number: int | float | None
    if type(value) is float and arg.kind is float and arg.minimum is None and arg.role is Role.SCALAR \
            and math.isfinite(value):
        return value  # the common case (a softmax scale), decided in a few reads
    if arg.kind is str:
        if not isinstance(value, str):
            raise ArgumentTypeError(f"argument {arg.name!r}: expected one of {list(arg.choices)} (or None), "
                                    f"got {value!r}")
        if value not in arg.choices:
            raise ArgumentError(f"argument {arg.name!r}: expected one of {list(arg.choices)} (or None), "
                                f"got {value!r}")
        return value
    if arg.role is Role.HINT:
        number = _integer(value)
        if number is None or number < 1:
            raise ArgumentTypeError(f"argument {arg.name!r}: expected a positive int (or None), got {value!r}")
        return number
    if arg.kind is int:
        number = _integer(value)
        what = "an int"
    else:
        found = real(value)
        number = found if found is not None and math.isfinite(found) else None
        what = "a finite float"
    bound = "" if arg.minimum is None else f" {'>' if arg.exclusive else '>='} {arg.minimum:g}"
    optional = "" if arg.required else " (or None)"
    if number is None:
        raise ArgumentTypeError(f"argument {arg.name!r}: expected {what}{bound}{optional}, got {value!r}")
    if arg.minimum is not None and (number < arg.minimum or (arg.exclusive and number <= arg.minimum)):
        raise ArgumentError(f"argument {arg.name!r}: expected {what}{bound}{optional}, got {value!r}")
    return number


def _bind(arg: Arg, shape: Sequence[int], sizes: dict[str, int], sources: dict[str, tuple[str, int]],
          layouts: Mapping[str, str]) -> None:
    """Bind ``arg``'s dimension names to ``shape``, or raise naming the first size that disagrees."""
    for axis, dim in enumerate(arg.dims):
        size = shape[axis] - dim.offset  # no int(): a traced (symbolic) size stays symbolic
        if size < 0:
            raise fail(arg.name, f"{dim} >= {dim.offset} entries in dimension {axis}", f"shape {tuple(shape)}")
        bound = sizes.get(dim.name)
        if bound is None:
            sizes[dim.name] = size
            sources[dim.name] = (arg.name, axis)
        elif bound != size:
            raise _mismatch(arg, shape, axis, dim, bound, sources, layouts)


def _mismatch(arg: Arg, shape: Sequence[int], axis: int, dim: Dim, bound: int,
              sources: dict[str, tuple[str, int]], layouts: Mapping[str, str]) -> ArgumentError:
    source, source_axis = sources[dim.name]
    if layouts.get(source) == arg.layout:
        return fail(arg.name, f"the shape of {source}", f"shape {tuple(shape)}")
    return fail(arg.name, f"{dim}={bound + dim.offset} ({source}'s dimension {source_axis}) in dimension {axis}",
                f"shape {tuple(shape)}")


class Bound:
    """What the checks of one call learnt: sizes by dimension name, where each came from, dtypes by argument."""

    __slots__ = ("dtypes", "sizes", "sources")

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.sources: dict[str, tuple[str, int]] = {}
        self.dtypes: dict[str, str] = {}


_ARRAY, _WEIGHT, _NUMBER = 0, 1, 2
#: One argument's checks, precomputed: (kind, name, arg, required, dims as (axis, name, offset), ndim,
#: accepted dtypes, dtype_of, contiguous).
Step = tuple[int, str, Arg, bool, tuple[tuple[int, str, int], ...], int, tuple[str, ...], "str | None", Any]


def plan(args: Sequence[Arg]) -> tuple[Step, ...]:
    """The checks of ``args`` (in the order given) as tuples the hot loop unpacks without attribute reads."""
    steps = []
    for arg in args:
        kind = _WEIGHT if arg.is_weight else _NUMBER if arg.role in (Role.SCALAR, Role.HINT) else _ARRAY
        dims = tuple((axis, d.name, d.offset) for axis, d in enumerate(arg.dims))
        steps.append((kind, arg.name, arg, arg.required, dims, len(dims), arg.dtypes, arg.dtype_of, arg.contiguous))
    return tuple(steps)


def check_declared(spec: OpSpec, args: dict[str, Any]) -> Bound:
    """Check every declared argument of ``spec`` in ``args`` but ``out`` (normalising host numbers in place).

    Optional arguments that are None are skipped. ``out`` is checked by :func:`check_output`, after the
    op's own checks, so a wrong ``out`` is never blamed for what another argument got wrong.
    """
    bound = Bound()
    _run(spec, spec.input_plan, args, bound)
    return bound


def check_output(spec: OpSpec, args: dict[str, Any], bound: Bound) -> None:
    """Check ``out`` (when given) against the sizes and dtypes the other arguments bound."""
    _run(spec, spec.output_check, args, bound)


def _run(spec: OpSpec, steps: tuple[Step, ...], args: dict[str, Any], bound: Bound) -> None:
    sizes, sources, dtypes = bound.sizes, bound.sources, bound.dtypes
    for kind, name, arg, required, dims, ndim, allowed, dtype_of, contiguous in steps:
        value = args.get(name)
        if value is None:
            if required:
                raise ArgumentTypeError(f"argument {name!r} is required")
            continue
        if kind == _NUMBER:
            args[name] = host_number(arg, value)
            continue
        if kind == _WEIGHT:
            if not _instance(value, arg.kind):
                made = " (from hal_core.quant.quantize)" if arg.kind is QuantizedWeight else ""
                raise ArgumentTypeError(f"argument {name!r}: expected a {arg.kind.__module__}.{arg.kind.__name__}"
                                        f"{made}, got {type(value).__name__}")
        else:
            want = allowed if dtype_of is None else (dtypes[dtype_of],)
            found = DTYPE_NAMES.get(value.dtype) if type(value) is np.ndarray else None
            if found is not None and found in want and value.ndim == ndim and (
                    contiguous is False or value.flags.c_contiguous
                    or (contiguous == "last" and rows_contiguous(value))):
                dtypes[name] = found  # the hot path: a valid numpy array, answered in a few attribute reads
            else:
                why = "" if dtype_of is None else f" (the {dtype_of}'s)"
                dtypes[name] = check_array(name, value, layout=arg.layout, ndim=ndim, dtypes=want,
                                           contiguous=contiguous, dtype_why=why)
        shape = value.shape
        for axis, dim, offset in dims:
            size = shape[axis] - offset  # no int(): a traced (symbolic) size stays symbolic
            held = sizes.get(dim)
            if held is None:
                if size < 0:
                    raise fail(name, f"{dim} + {offset} >= {offset} entries in dimension {axis}",
                               f"shape {tuple(shape)}")
                sizes[dim] = size
                sources[dim] = (name, axis)
            elif held != size:
                raise _mismatch(arg, shape, axis, arg.dims[axis], held, sources, spec.layouts)


def check_shapes(spec: OpSpec, args: Mapping[str, Any]) -> dict[str, int]:
    """What a trace can check without data: ranks, the sizes layouts share, and dtypes that must match.

    ``args`` hold the array arguments given (any array type with ``shape``/``dtype``, a weight as
    anything with ``shape``); used by ``torch.ops.hal``'s fake implementations.
    """
    sizes: dict[str, int] = {}
    sources: dict[str, tuple[str, int]] = {}
    for arg in spec.check_order:
        value = args.get(arg.name)
        if value is None or not (arg.is_array or arg.is_weight):
            continue
        shape = tuple(value.shape)
        if arg.is_array and len(shape) != len(arg.dims):
            raise fail(arg.name, f"{len(arg.dims)} dimensions {arg.layout}", f"shape {shape}")
        other = args.get(arg.dtype_of) if arg.dtype_of else None
        if other is not None and value.dtype != other.dtype:
            raise ArgumentTypeError(f"argument {arg.name!r}: expected dtype {other.dtype} (the {arg.dtype_of}'s), "
                                    f"got {value.dtype}")
        _bind(arg, shape, sizes, sources, spec.layouts)
    return sizes


def output_shape(spec: OpSpec, args: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The declared output's shape, read from the arguments that name its dimensions (None: no output)."""
    if spec.output is None:
        return None
    return tuple([args[name].shape[axis] + delta for name, axis, delta in spec.output_plan])
