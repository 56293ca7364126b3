"""What a backend declares it runs itself, per op: dtypes, head sizes, block sizes, group sizes, bits.

A backend declares, in :meth:`Backend.register_ops`, the argument
features each op's own implementations handle::

    registry.declare("paged_attention", OpCoverage(dtypes={"fp16", "bf16"}, head_sizes={64, 128}))

A call outside the declaration may fall back (to the host backend) as
designed; a call inside it must not, and the contract suite fails a test
in which one did. An op with no declaration is claimed whole: every valid
call must run on the backend's own implementations. ``OpCoverage.none()``
declares an op the backend leaves to the fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..arrays import dtype_name

__all__ = ["OpCoverage", "call_features"]


#: OpCoverage field → the call feature it constrains.
_FIELD_FEATURE = {"dtypes": "dtype", "head_sizes": "head_size", "block_sizes": "block_size",
                  "group_sizes": "group_size", "bits": "bits"}


def _frozen(values: Iterable[Any] | None) -> frozenset[Any] | None:
    return None if values is None else frozenset(values)


@dataclass(frozen=True, init=False)
class OpCoverage:
    """The argument features an op's own implementations handle; None in a field means any.

    ``dtypes`` are hal dtype names (the query's, the key's or ``x``'s);
    ``head_sizes`` and ``block_sizes`` apply to the attention ops;
    ``group_sizes`` and ``bits`` to ``quantized_gemm``. ``enabled=False``
    (:meth:`none`) declares that the op is left to the fallback entirely.
    """

    dtypes: frozenset[str] | None
    head_sizes: frozenset[int] | None
    block_sizes: frozenset[int] | None
    group_sizes: frozenset[int] | None
    bits: frozenset[int] | None
    enabled: bool

    def __init__(self, *, dtypes: Iterable[str] | None = None, head_sizes: Iterable[int] | None = None,
                 block_sizes: Iterable[int] | None = None, group_sizes: Iterable[int] | None = None,
                 bits: Iterable[int] | None = None, enabled: bool = True) -> None:
        values = {"dtypes": _frozen(dtypes), "head_sizes": _frozen(head_sizes), "block_sizes": _frozen(block_sizes),
                  "group_sizes": _frozen(group_sizes), "bits": _frozen(bits)}
        for name, value in values.items():
            kind = str if name == "dtypes" else int
            if value is not None and not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
                raise TypeError(f"OpCoverage({name}=...): expected {kind.__name__} values, "
                                f"got {sorted(value, key=repr)}")
            object.__setattr__(self, name, value)
        if not isinstance(enabled, bool):
            raise TypeError(f"OpCoverage(enabled=...): expected a bool, got {enabled!r}")
        object.__setattr__(self, "enabled", enabled)

    @classmethod
    def none(cls) -> OpCoverage:
        """The op is not run by this backend at all: every call goes to the fallback."""
        return cls(enabled=False)

    def covers(self, features: Mapping[str, Any]) -> bool | str:
        """True when a call with these features (:func:`call_features`) is declared, else why not."""
        if not self.enabled:
            return "the backend declares this op unsupported"
        for field_name, feature in _FIELD_FEATURE.items():
            allowed = getattr(self, field_name)
            if allowed is None or feature not in features:
                continue
            value = features[feature]
            if value not in allowed:
                return f"{feature.replace('_', ' ')} {value!r} is not declared (declared: {sorted(allowed)})"
        return True


def _attention_features(args: Mapping[str, Any]) -> dict[str, Any]:
    cache = args["key_cache"]
    return {"dtype": dtype_name(cache), "head_size": int(cache.shape[3]), "block_size": int(cache.shape[2])}


def _gemm_features(args: Mapping[str, Any]) -> dict[str, Any]:
    qweight = args["qweight"]
    return {"dtype": dtype_name(args["x"]), "group_size": int(qweight.group_size), "bits": int(qweight.bits)}


_FEATURES: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "paged_attention": _attention_features,
    "write_kv_cache": _attention_features,
    "quantized_gemm": _gemm_features,
}


def call_features(op: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The features of a validated call that :class:`OpCoverage` speaks of (``dtype``, ``head_size``, ...)."""
    return _FEATURES[op](args)
