"""``hal tune`` as a library: time every candidate (implementation, knob value) per shape bucket, persist the
winners."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import configuration_error
from ..ops import OPS, OpCall, device_features
from ..tuning import TuneTable, forget, key_for, load_table, override, save_table
from ._inputs import build_inputs
from ._timing import TimingPolicy, measure

__all__ = ["Decision", "TuneReport", "tunables", "tune"]


@dataclass(frozen=True)
class Decision:
    """One tuned choice: ``kind`` is ``"impl"``, ``"knob"`` or ``"setting"`` (an op's ``"auto"`` setting,
    :attr:`~hal_core.ops.OpSpec.auto_settings`); ``ms`` sums the medians per candidate."""

    op: str
    bucket: str
    kind: str
    name: str
    ms: dict[str, float]
    winner: Any
    builtin: Any

    @property
    def changed(self) -> bool:
        return self.winner != self.builtin


@dataclass
class TuneReport:
    """What a tuning run decided, and where it was stored (``path`` None when nothing was persisted)."""

    backend: str
    key: dict[str, Any]
    decisions: list[Decision] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    path: Path | None = None


def tunables(backend: Any) -> dict[str, dict[str, Any]]:
    """Per op: its implementations (best first), each one's knobs with their candidates, and the op's settings
    a caller may leave ``"auto"``."""
    found: dict[str, dict[str, Any]] = {}
    for op in backend.ops.registry.ops():
        impls = backend.ops.registry.implementations(op)
        knobs = {impl.name: {k.name: list(k.candidates) for k in impl.knobs} for impl in impls if impl.knobs}
        settings = {name: list(values) for name, values in OPS[op].auto_settings.items()} if op in OPS else {}
        found[op] = {"implementations": [impl.name for impl in impls], "knobs": knobs, "settings": settings,
                     "tunable": len(impls) > 1 or bool(settings)
                     or any(len(c) > 1 for ks in knobs.values() for c in ks.values())}
    return found


def _make_call(backend: Any, case: Any, rng: np.random.Generator) -> Any:
    spec = OPS[case.op]
    host = build_inputs(case, rng)
    args = dict(spec.map_arrays(host, backend.asarray))
    spec.validate(args, lambda a: a if isinstance(a, np.ndarray) else backend.to_numpy(a))
    return OpCall(spec=spec, args=args, backend=backend, device_index=0)


def _supported(impls: Sequence[Any], call: Any) -> list[Any]:
    ok = []
    for impl in impls:
        try:
            if impl.supports(call) is True:
                ok.append(impl)
        except Exception as exc:  # a supports() that raises is "no", as the dispatcher does...
            setting = configuration_error(exc)
            if setting is not None:  # ...unless the user's setting is wrong: that is an error, as there
                raise setting from exc
            continue
    return ok


def tune(
    backend: Any,
    cases: Sequence[Any],
    policy: Any = None,
    *,
    progress: Any = None,
    clock: Callable[[], float] = time.perf_counter,
    persist: bool = True,
    seed: int = 0,
) -> TuneReport:
    """Time the candidates of ``cases`` on ``backend``'s device 0 and persist the winners per bucket.

    For each case: first every knob (with more than one candidate) of each
    implementation that supports the case, one knob after the other (the
    ones already measured at their best value, the rest at their rule);
    then, when more than one implementation supports it, each of them with
    its best knob values; then each value of an op setting the caller may
    leave ``"auto"`` (``quantized_gemm``'s ``activations``) where the call
    has a choice, decided for the bucket of the ``"auto"`` call. Medians of
    the cases of one bucket are summed per candidate; the smallest sum wins.
    ``clock`` may be replaced (tests).
    """
    policy = policy or TimingPolicy(repeat=5, warmup=1, max_seconds=0.5)
    sync = backend.device(0).synchronize
    key = key_for(backend)
    report = TuneReport(backend=backend.name, key=key)
    totals: dict[tuple[str, str, str, str], dict[Any, list[float]]] = {}
    builtin: dict[tuple[str, str, str, str], Any] = {}
    rng = np.random.default_rng(seed)
    for case in cases:
        if progress is not None:
            progress.step(case.label)
        impls = backend.ops.registry.implementations(case.op)
        if (len(impls) < 2 and not any(len(k.candidates) > 1 for i in impls for k in i.knobs)
                and not OPS[case.op].auto_settings):
            continue
        call = _make_call(backend, case, rng)
        runnable = _supported(impls, call)
        if not runnable:
            report.skipped.append(f"{case.label}: no implementation supports it")
            continue
        where = call.spec.bucket(call.args)

        def timed(fn: Callable[[Any], Any], call: Any = call) -> float:
            return measure(lambda _: fn(call), policy, sync=sync, clock=clock).median * 1e3

        best_knobs: dict[str, dict[str, Any]] = {}
        for impl in runnable:  # knobs first, each with the ones before it at their best values
            chosen: dict[str, Any] = {}
            for knob in impl.knobs:
                if len(knob.candidates) < 2:
                    continue
                slot = (case.op, where, "knob", knob.name)
                builtin.setdefault(slot, knob.rule(call))
                medians = {}
                for value in knob.candidates:
                    with override({**chosen, knob.name: value}):
                        medians[value] = timed(impl.fn)
                    totals.setdefault(slot, {}).setdefault(value, []).append(medians[value])
                chosen[knob.name] = min(medians, key=medians.__getitem__)
            best_knobs[impl.name] = chosen
        if len(runnable) > 1:  # then the implementations, each with its best knob values for this case
            slot = (case.op, where, "impl", "implementation")
            builtin.setdefault(slot, runnable[0].name)
            for impl in runnable:
                with override(best_knobs[impl.name]):
                    totals.setdefault(slot, {}).setdefault(impl.name, []).append(timed(impl.fn))
        for slot, value, variant in _setting_variants(backend, call):
            chosen_impl = next(iter(_supported(impls, variant)), None)
            if chosen_impl is not None:
                rule = call.spec.auto_rule(slot[3], {**call.args, slot[3]: "auto"},
                                           device_features(backend, call.device_index))
                builtin.setdefault(slot, rule[0])
                totals.setdefault(slot, {}).setdefault(value, []).append(timed(chosen_impl.fn, variant))
    for slot, per_candidate in totals.items():
        runs = max(len(v) for v in per_candidate.values())
        complete = {c: sum(v) for c, v in per_candidate.items() if len(v) == runs}
        winner = min(complete, key=complete.__getitem__)
        op, where, kind, name = slot
        report.decisions.append(Decision(op=op, bucket=where, kind=kind, name=name,
                                         ms={str(c): round(ms, 6) for c, ms in complete.items()},
                                         winner=winner, builtin=builtin[slot]))
    if persist and report.decisions:
        report.path = _persist(key, report.decisions)
    return report


def _setting_variants(backend: Any, call: OpCall) -> list[tuple[tuple[str, str, str, str], str, OpCall]]:
    """``(slot, value, call with the value)`` for each value of each ``"auto"`` setting open for ``call``'s shape."""
    spec, found = call.spec, []
    coverage = backend.ops.coverage(call.op)
    for name in spec.auto_settings:
        auto = {**call.args, name: "auto"}
        values, _ = spec.auto_candidates(name, auto, coverage)
        if len(values) < 2:
            continue
        slot = (call.op, spec.bucket(auto), "setting", name)
        found += [(slot, value, OpCall(spec=spec, args={**call.args, name: value}, backend=backend))
                  for value in values]
    return found


def _persist(key: dict[str, Any], decisions: Sequence[Decision]) -> Path:
    table = load_table(key) or TuneTable(key=key)
    for d in decisions:
        if d.kind == "impl":
            table.choices.setdefault(d.op, {})[d.bucket] = d.winner
        else:
            table.knobs.setdefault(d.op, {}).setdefault(d.name, {})[d.bucket] = d.winner
        label = "implementation" if d.kind == "impl" else f"{d.kind} {d.name}"
        table.measurements.setdefault(d.op, {})[f"{d.bucket} {label}"] = d.ms
    path = save_table(table)
    forget()
    return path
