"""What the declared checks of one op concluded for one signature of host arguments, kept for the next call.

The declared checks (:func:`~hal_core.ops._validate.check_declared` and
:func:`~hal_core.ops._validate.check_output`: rank, dtype, layout, the sizes layouts share) depend only
on each array's type, shape, strides and dtype, and on which arguments are given. A call whose arrays
are all numpy arrays has that *signature*; once its declared checks pass, the sizes they bound are kept
under it, and the next call of the same signature reuses them instead of checking again. Everything
that depends on values is still checked on every call: host numbers (normalised too), the op's own
:meth:`~hal_core.ops.OpSpec.check` (relations, overlap, index values under ``HAL_CHECK_INDICES``, read
then) and the writability of what the op writes. A different shape, stride, dtype or set of arguments
is another signature, checked in full. At most :data:`MAX_PLANS` signatures are kept (the oldest
dropped first); device arrays and anything else are checked in full on every call.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ArgumentTypeError
from ..quant import ExpertWeights, QuantizedWeight
from ._per_value import PerValue
from ._validate import check_declared, check_output, host_number

if TYPE_CHECKING:
    from ._spec import OpSpec

__all__ = ["MAX_PLANS", "all_numpy", "clear_plans", "host_signature", "plan_count", "signature_and_host", "validate"]

#: Signatures kept over all ops (a serving process sees a few per op: one per batch shape).
MAX_PLANS = 512

#: (spec, signature) -> the sizes the declared checks bound (read-only).
_PLANS: dict[tuple[Any, ...], Mapping[str, int]] = {}
_lock = threading.Lock()


#: Whether every array of an :class:`~hal_core.quant.ExpertWeights` is a numpy array, per value (a frozen value of
#: frozen weights: found once, weakly, not over its hundreds of arrays on every call).
_HOST_EXPERTS: PerValue[bool] = PerValue()


def _experts_on_host(experts: ExpertWeights) -> bool:
    return _HOST_EXPERTS.get(experts, lambda v: all(type(a) is np.ndarray for a in v.arrays().values()))


def host_signature(spec: OpSpec, args: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """``(spec, (shape, strides, dtype) or None per array, (type, shape) or None per weight)``; None unless
    every array given (a weight's too) is a numpy array."""
    key: list[Any] = [spec]
    for name in spec.array_names:
        value = args.get(name)
        if value is None:
            key.append(None)
        elif type(value) is np.ndarray:
            key.append((value.shape, value.strides, value.dtype))
        else:
            return None
    for name in spec.weight_names:
        value = args.get(name)
        if value is None:
            key.append(None)
            continue
        if type(value) is ExpertWeights:  # every expert's arrays are checked by check_layout, once per value
            if not _experts_on_host(value):
                return None
            key.append((ExpertWeights, value.shape, value.bits, value.group_size))
            continue
        if type(value) is not QuantizedWeight:
            return None
        for array in (value.qweight, value.scales, value.zeros, value.g_idx):
            if array is not None and type(array) is not np.ndarray:
                return None
        key.append(value.shape)  # the weight's arrays are checked by check_layout, on every call
    return tuple(key)


def all_numpy(spec: OpSpec, args: Mapping[str, Any]) -> bool:
    """Whether every array given (a weight's too) is exactly a numpy array (the host path)."""
    for name in spec.array_names:
        value = args.get(name)
        if value is not None and type(value) is not np.ndarray:
            return False
    for name in spec.weight_names:
        value = args.get(name)
        if type(value) is QuantizedWeight:
            for array in (value.qweight, value.scales, value.zeros, value.g_idx):
                if array is not None and type(array) is not np.ndarray:
                    return False
        elif value is not None and not all(type(a) is np.ndarray for _, a in spec.iter_arrays({name: value})):
            return False
    return True


def signature_and_host(spec: OpSpec, args: Mapping[str, Any]) -> tuple[tuple[Any, ...] | None, bool]:
    """:func:`host_signature` of ``args``, and whether every array given is a numpy array (:func:`all_numpy`)."""
    key = host_signature(spec, args)
    return key, key is not None or all_numpy(spec, args)


def validate(spec: OpSpec, args: dict[str, Any], key: tuple[Any, ...] | None) -> None:
    """:meth:`OpSpec.validate`: the declared checks, then the op's own, then ``out``'s; host arguments take
    the declared checks' outcome from their signature's plan when one is kept.

    Raises what the full checks raise, in the same order: a call whose signature has a plan passed every
    declared array check before, so only its numbers and the op's own checks can fail. ``key`` is
    :func:`host_signature` of ``args``.
    """
    sizes = None if key is None else _PLANS.get(key)
    if sizes is None:
        bound = check_declared(spec, args)
        spec.check_layout(args, bound.sizes)
        spec.check(args, bound.sizes)
        check_output(spec, args, bound)
        if key is not None:
            _keep(key, MappingProxyType(bound.sizes))
        return
    for arg in spec.number_args:
        value = args.get(arg.name)
        if value is None:
            if arg.required:
                raise ArgumentTypeError(f"argument {arg.name!r} is required")
            continue
        args[arg.name] = host_number(arg, value)
    spec.check_layout(args, sizes)  # a weight's arrays are not in the signature
    spec.check(args, sizes)


def _keep(key: tuple[Any, ...], sizes: Mapping[str, int]) -> None:
    with _lock:
        while len(_PLANS) >= MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]  # the oldest signature
        _PLANS[key] = sizes


def clear_plans() -> None:
    """Forget every kept plan (the next call of each signature is checked in full)."""
    with _lock:
        _PLANS.clear()


def plan_count() -> int:
    """How many signatures have a plan now."""
    return len(_PLANS)
