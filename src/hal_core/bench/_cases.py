"""Benchmark cases: one op at one shape, the ``--shape`` syntax, and the preset grids.

A case is an op name plus a few named integers and a dtype, e.g.
``quantized_gemm M=1,K=4096,N=11008,bits=4,group=128``. Keys are
case-insensitive; keys left out take the defaults the op declares (:func:`bench_params`); a
value ending in ``k`` is multiplied by 1024 (``ctx=32k``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..ops import OPS, BenchCases

__all__ = ["BenchArgumentError", "Case", "bench_params", "make_case", "parse_shape", "preset_cases", "preset_names"]


class BenchArgumentError(ValueError):
    """A bad benchmark argument; the message names the command-line flag (``--shape``, ``--op``, ...)."""


_DTYPES = ("fp32", "fp16", "bf16")


def _declared(op: str) -> BenchCases | None:
    spec = OPS.get(op)
    return None if spec is None else spec.bench


def bench_params() -> dict[str, Mapping[str, int | str]]:
    """Per op with benchmark cases: every parameter with its default (ints, or a dtype name for ``dtype``)."""
    return {op: spec.bench.params for op, spec in OPS.items() if spec.bench is not None}


@dataclass(frozen=True)
class Case:
    """One op at one shape. ``params`` holds every parameter the op declares (:func:`bench_params`)."""

    op: str
    params: Mapping[str, int | str] = field(hash=False)

    @property
    def key(self) -> tuple[str, tuple[tuple[str, int | str], ...]]:
        return self.op, tuple(sorted(self.params.items()))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Case) and self.key == other.key

    @property
    def label(self) -> str:
        """A short human name, e.g. ``paged_attention fp16 32x4096 h32/8 d128``."""
        bench = _declared(self.op)
        return bench.label(self.params) if bench is not None else f"{self.op} {self.shape_text}"

    @property
    def shape_text(self) -> str:
        """The ``--shape`` text that gives this case back."""
        return ",".join(f"{k}={v}" for k, v in self.params.items())


def make_case(op: str, flag: str = "--op", **values: int | str) -> Case:
    """A :class:`Case` with defaults filled in and every value checked (errors name ``flag``)."""
    bench = _declared(op)
    if bench is None:
        raise BenchArgumentError(f"argument --op: unknown op {op!r}; known: {', '.join(bench_params())}")
    params: dict[str, int | str] = dict(bench.params)
    for raw_key, value in values.items():
        key = bench.aliases.get(raw_key.lower(), raw_key.lower())
        if key not in params:
            raise BenchArgumentError(
                f"argument {flag}: unknown key {raw_key!r} for {op}; known: {', '.join(bench.params)}")
        params[key] = value
    _check(bench, params, flag)
    return Case(op, params)


def _check(bench: BenchCases, p: dict[str, int | str], flag: str) -> None:
    if "dtype" in p and p["dtype"] not in _DTYPES:
        raise BenchArgumentError(f"argument {flag}: dtype must be one of {', '.join(_DTYPES)}, got {p['dtype']!r}")
    for key, value in p.items():
        if key == "dtype":
            continue
        floor = 0 if key in bench.may_be_zero else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < floor:
            raise BenchArgumentError(f"argument {flag}: {key} must be a {'non-negative' if floor == 0 else 'positive'}"
                                     f" integer, got {value!r}")
    problem = bench.check(p)
    if problem:
        raise BenchArgumentError(f"argument {flag}: {problem}")


def parse_shape(op: str, text: str) -> Case:
    """Parse ``--shape`` text such as ``M=1,K=4096,N=11008,bits=4,group=128`` for ``op``.

    Raises :class:`BenchArgumentError` naming ``--shape`` (or ``--op``) on any bad part.
    """
    values: dict[str, int | str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise BenchArgumentError(f"argument --shape: expected KEY=VALUE pairs separated by commas, got {part!r}"
                                     f" in {text!r}")
        if key.lower() == "dtype":
            values[key] = value.lower()
            continue
        try:
            number = int(value[:-1]) * 1024 if value.lower().endswith("k") else int(value)
        except ValueError:
            raise BenchArgumentError(f"argument --shape: {key} must be an integer, got {value!r}") from None
        values[key] = number
    if not values:
        raise BenchArgumentError(f"argument --shape: no KEY=VALUE pair in {text!r}")
    return make_case(op, "--shape", **values)


def _presets() -> dict[str, list[tuple[str, Mapping[str, Any]]]]:
    """Preset name → (op, parameters) of its cases, gathered from every op's declaration in catalogue order."""
    found: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for op, spec in OPS.items():
        if spec.bench is None:
            continue
        for preset, build in spec.bench.presets.items():
            found.setdefault(preset, []).extend((op, params) for params in build())
    return found


def preset_names() -> tuple[str, ...]:
    """The preset names ``--preset`` accepts: every op's, then ``all``."""
    return (*_presets(), "all")


def preset_cases(name: str, ops: Iterable[str] | None = None) -> list[Case]:
    """The cases of preset ``name`` (``all`` = every preset, duplicates dropped), optionally only ``ops``."""
    presets = _presets()
    if name not in presets and name != "all":
        raise BenchArgumentError(f"argument --preset: unknown preset {name!r}; known: {', '.join(preset_names())}")
    names = list(presets) if name == "all" else [name]
    wanted = set(ops) if ops else None
    seen: dict[Case, None] = {}
    for preset in names:
        for op, params in presets[preset]:
            if wanted is None or op in wanted:
                seen.setdefault(make_case(op, **params), None)
    return list(seen)


def case_summary(case: Case) -> dict[str, Any]:
    """JSON-ready description of ``case``."""
    return {"op": case.op, "label": case.label, "params": dict(case.params), "shape": case.shape_text}
