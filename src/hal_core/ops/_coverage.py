"""What a backend declares it runs itself, per op: the values of the op's declared features it handles.

A backend declares, in :meth:`Backend.register_ops`, the argument
features each op's own implementations handle::

    registry.declare("paged_attention", OpCoverage(dtypes={"fp16", "bf16"}, head_sizes={64, 128},
                                                   variants={"prefill", "window"}))

The keywords are the op's declared features (:attr:`OpSpec.features`: ``dtypes``,
``head_sizes``, ``block_sizes`` and ``variants`` for the attention ops, ``group_sizes`` and
``bits`` for ``quantized_gemm``, ...). A call outside the declaration may fall back (to the host
backend) as designed; a call inside it must not, and the contract suite fails a test in which one
did. An op with no declaration is claimed whole: every valid call must run on the backend's own
implementations. ``OpCoverage.none()`` declares an op the backend leaves to the fallback. A feature
value marked opt-in (:attr:`Feature.opt_in`) is the exception: a call using one reaches a backend's
implementations only where its declaration names the value, else it falls back.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._catalog import OPS

if TYPE_CHECKING:
    from ._spec import OpSpec

__all__ = ["OpCoverage", "call_features"]


@dataclass(frozen=True, init=False)
class OpCoverage:
    """The feature values an op's own implementations handle; a feature left out means any value.

    Keywords are the op's declared feature fields (see the module docs); ``enabled=False``
    (:meth:`none`) declares that the op is left to the fallback entirely. A set-valued feature
    (``variants``) is covered when every value the call uses is declared.
    """

    allowed: Mapping[str, frozenset[Hashable]]
    enabled: bool

    def __init__(self, *, enabled: bool = True, **allowed: Iterable[Hashable] | None) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"OpCoverage(enabled=...): expected a bool, got {enabled!r}")
        values: dict[str, frozenset[Hashable]] = {}
        for name, given in allowed.items():
            if given is None:
                continue
            if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
                raise TypeError(f"OpCoverage({name}=...): expected a collection of values, got {given!r}")
            found = frozenset(given)
            if any(isinstance(v, bool) for v in found):
                raise TypeError(f"OpCoverage({name}=...): expected values, not booleans, got {sorted(found, key=repr)}")
            values[name] = found
        object.__setattr__(self, "allowed", values)
        object.__setattr__(self, "enabled", enabled)

    def __getattr__(self, name: str) -> frozenset[Hashable] | None:
        """``coverage.head_sizes``: the declared values of a feature (None: any)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return self.__dict__["allowed"].get(name)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.allowed.items(), key=lambda kv: kv[0])), self.enabled))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpCoverage) and (self.allowed, self.enabled) == (other.allowed, other.enabled)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={sorted(v, key=repr)}" for k, v in sorted(self.allowed.items()))
        return f"OpCoverage({fields}{', ' if fields else ''}enabled={self.enabled})"

    @classmethod
    def none(cls) -> OpCoverage:
        """The op is not run by this backend at all: every call goes to the fallback."""
        return cls(enabled=False)

    def check_fields(self, spec: OpSpec) -> None:
        """Raise ``ValueError`` when a keyword is not one of ``spec``'s declared features."""
        known = {feature.field for feature in spec.features}
        unknown = sorted(set(self.allowed) - known)
        if unknown:
            raise ValueError(f"OpCoverage for {spec.name}: unknown feature(s) {unknown}; "
                             f"{spec.name} declares {sorted(known)}")

    def undeclared_opt_in(self, spec: OpSpec, args: Mapping[str, Any]) -> str | None:
        """Why a validated call stays off this backend's implementations, or None: it uses an opt-in value
        (:attr:`Feature.opt_in`, a setting older implementations would silently ignore) not declared here."""
        for feature in spec.features:
            if feature.opt_in:
                value = feature.get(args)
                if value in feature.opt_in and value not in self.allowed.get(feature.field, ()):
                    return (f"{feature.name.replace('_', ' ')} {value!r} is not declared "
                            f"({feature.field}=... in the OpCoverage)")
        return None

    def covers_call(self, spec: OpSpec, args: Mapping[str, Any]) -> bool | str:
        """True when a validated call of ``spec`` is declared, else why not."""
        return self.covers(spec.features_of(args), spec)

    def covers(self, features: Mapping[str, Any], spec: OpSpec | None = None) -> bool | str:
        """True when a call with these features (:func:`call_features`) is declared, else why not."""
        if not self.enabled:
            return "the backend declares this op unsupported"
        by_name = {} if spec is None else {f.name: f for f in spec.features}
        for name, value in features.items():
            feature = by_name.get(name)
            field = feature.field if feature is not None else _plural(name)
            allowed = self.allowed.get(field)
            if allowed is None:
                continue
            many = feature.many if feature is not None else isinstance(value, (set, frozenset))
            missing = sorted(set(value) - allowed, key=repr) if many else ([] if value in allowed else [value])
            if missing:
                shown = missing if many else repr(missing[0])
                return (f"{name.replace('_', ' ')} {shown} is not declared "
                        f"(declared: {sorted(allowed, key=repr)})")
        return True


def _plural(name: str) -> str:
    return name if name.endswith("s") else f"{name}s"


def call_features(op: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """The features of a validated call that :class:`OpCoverage` speaks of (``dtype``, ``head_size``, ...)."""
    return OPS[op].features_of(args)
