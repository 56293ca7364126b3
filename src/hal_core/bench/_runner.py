"""Run benchmark cases on one backend: the limits first, then every case with its peers, into one report."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ops import OPS
from ._cases import Case, case_summary
from ._inputs import build_inputs
from ._interference import measure_interference
from ._limits import array_module, last_level_cache_bytes, measure_blas, measure_copy
from ._machine import git_commit, machine_info, utc_now, versions
from ._overhead import measure_overhead
from ._peers import PeerUnavailable, peers_for
from ._progress import Progress
from ._timing import Samples, TimingPolicy, measure

__all__ = ["SCHEMA", "BenchSettings", "planned_steps", "rotation", "run_bench"]

#: The ``schema`` field of every report (docs/benchmarks.md describes its keys).
SCHEMA = "hal-bench/1"

#: At most this many bytes of rotated inputs per case.
_ROTATION_BUDGET = 1 << 30


@dataclass(frozen=True)
class BenchSettings:
    """Everything a run depends on besides the cases and the backend.

    ``peers``: None for every peer that applies, ``()`` for none, or names
    (substrings, case-insensitive). ``cached_weights``: time one input set
    over and over instead of rotating distinct ones. ``budget_s``: cases
    not started within it are reported as skipped. ``copy_bytes`` and
    ``blas_n`` override the sizes of the limit measurements (defaults in
    docs/benchmarks.md). ``rounds``: every case is measured that many
    times, round-robin over the cases (fresh inputs each round), and its
    figures come from all rounds' samples pooled, so that a burst of
    interference on a shared machine reaches one round of a case, not all
    of its samples.
    """

    policy: TimingPolicy = field(default_factory=TimingPolicy)
    quick: bool = False
    cached_weights: bool = False
    peers: Sequence[str] | None = None
    budget_s: float | None = None
    seed: int = 0
    copy_bytes: int | None = None
    blas_n: int | None = None
    rounds: int = 1
    #: Also measure what a call costs above its kernel (front door, torch.ops.hal) and beside torch's ops
    #: (the interference rows); host backends only.
    overhead: bool = False

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"argument --rounds: expected >= 1, got {self.rounds}")


def rotation(case: Case, nbytes: int, llc_bytes: int, cached: bool) -> int:
    """How many distinct input sets the timed calls cycle through.

    Enough that the sets together are twice the last-level cache (so no call
    finds its operands in cache), at least 3 for an op taking a quantized
    weight (so a per-weight cache in an implementation cannot serve a call), at most 16
    and at most 1 GiB in all; 1 with ``cached``.
    """
    if cached:
        return 1
    count = math.ceil(2 * llc_bytes / max(nbytes, 1))
    if any(arg.is_weight for arg in OPS[case.op].args):
        count = max(count, 3)
    count = min(count, 16, max(1, _ROTATION_BUDGET // max(nbytes, 1)))
    return max(count, 1)


def _metrics(samples: Samples, nbytes: int, flops: int) -> dict[str, Any]:
    t = samples.median
    return {**samples.as_dict(), "gbps": nbytes / t / 1e9, "gflops": flops / t / 1e9,
            "times_ms": [round(x * 1e3, 6) for x in samples.seconds]}


def _pool(measurements: list[dict[str, Any]], nbytes: int, flops: int) -> dict[str, Any]:
    """One measurement from its rounds: the times pooled, the figures recomputed, each round's median kept."""
    timed = [m for m in measurements if "times_ms" in m]
    if not timed:
        return measurements[0]
    pooled = _metrics(Samples(tuple(x / 1e3 for m in timed for x in m["times_ms"])), nbytes, flops)
    extra = {k: v for k, v in timed[0].items() if k not in pooled and k != "hal_speedup"}
    return {**extra, **pooled, "round_medians_ms": [m["median_ms"] for m in timed]}


def _merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's result from its rounds (see ``BenchSettings.rounds``); skipped rounds are left out."""
    measured = [r for r in rounds if "hal" in r] or rounds[:1]
    if len(measured) == 1:
        return measured[0]
    first = measured[0]
    nbytes, flops = first["bytes"], first["flops"]
    merged = {**first, "seconds": round(sum(r.get("seconds", 0.0) for r in measured), 3)}
    merged["hal"] = _pool([r["hal"] for r in measured], nbytes, flops)
    peers = []
    for i, peer in enumerate(first.get("peers", [])):
        same = [r["peers"][i] for r in measured
                if i < len(r.get("peers", [])) and r["peers"][i]["name"] == peer["name"]]
        entry = _pool(same, nbytes, flops)
        if "median_ms" in entry and "median_ms" in merged["hal"]:
            entry["hal_speedup"] = entry["median_ms"] / merged["hal"]["median_ms"]
        peers.append(entry)
    merged["peers"] = peers
    return merged


def _add_ratios(results: list[dict[str, Any]], limits: dict[str, Any]) -> None:
    """``ratio_copy`` and ``ratio_blas`` of every measurement, against the run's limits."""
    copy = limits.get("copy", {}).get("gbps", 0.0)
    blas = limits.get("blas", {}).get("gflops", 0.0)
    for case in results:
        for m in [case.get("hal", {}), *case.get("peers", ())]:
            if "gbps" in m:
                m["ratio_copy"] = m["gbps"] / copy if copy else None
                m["ratio_blas"] = m["gflops"] / blas if blas and case.get("flops") else None
                bounds = [r for r in (m["ratio_copy"], m["ratio_blas"]) if r is not None]
                # the roofline's time is the larger of bytes / copy rate and FLOPs / BLAS rate
                m["ratio_roofline"] = max(bounds) if bounds else None


def _best_limits(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per limit the higher of the two measurements (the machine's best in this run), both kept."""
    chosen: dict[str, Any] = {"llc_bytes": before["llc_bytes"]}
    for key in before.keys() - {"llc_bytes"}:
        a, b = before.get(key, {}), after.get(key, {})
        rate = "gbps" if key == "copy" else "gflops"
        pick = max((m for m in (a, b) if rate in m), key=lambda m: m[rate], default=a)
        chosen[key] = {**pick, "when": "before" if pick is a else "after"}
    chosen["measured"] = {"before": before, "after": after}
    return chosen


def _hal_runner(backend: Any, case: Case, sets: list[dict[str, Any]]) -> Callable[[int], object]:
    """``be.ops.<op>(**sets[i % len(sets)])``: the front door included, as users call it."""
    op = getattr(backend.ops, case.op)
    return lambda i: op(**sets[i % len(sets)])


def _limits(backend: Any, settings: BenchSettings, sync: Callable[[], None], llc: int,
            host: bool) -> dict[str, Any]:
    policy = TimingPolicy(repeat=settings.policy.repeat, warmup=1, min_repeat=3, max_seconds=1.0,
                          warmup_seconds=settings.policy.warmup_seconds)
    copy_bytes = settings.copy_bytes or (32 << 20 if settings.quick else max(256 << 20, 8 * llc))
    blas_n = settings.blas_n or (256 if settings.quick else (2048 if host else 8192))
    limits: dict[str, Any] = {"llc_bytes": llc}
    for key, measure_fn in (("copy", lambda: measure_copy(backend, copy_bytes, policy, sync)),
                            ("blas", lambda: measure_blas(backend, blas_n, policy, sync, "fp32")),
                            ("blas_fp16", lambda: measure_blas(backend, blas_n, policy, sync, "fp16"))):
        if key == "blas_fp16" and host:
            continue  # numpy has no fp16 BLAS; the CPU's BLAS rate is the fp32 one
        try:
            limits[key] = measure_fn()
        except Exception as exc:  # a limit we cannot measure leaves its ratios empty, not the run dead
            limits[key] = {"error": f"{type(exc).__name__}: {exc}"}
    if not host and "gflops" in limits.get("blas_fp16", {}):
        limits["blas_fp32"] = limits["blas"]
        limits["blas"] = limits["blas_fp16"]  # device ratios are against the fp16 (tensor-core) rate
    return limits


def _run_case(backend: Any, case: Case, settings: BenchSettings, llc: int, sync: Callable[[], None],
              host: bool, rng: np.random.Generator, step: Callable[[str], None]) -> dict[str, Any]:
    spec = OPS[case.op]
    started = time.monotonic()
    first = build_inputs(case, rng)
    nbytes, flops = spec.nbytes(first), spec.flops(first)
    count = rotation(case, nbytes, llc, settings.cached_weights)
    host_sets = [first] + [build_inputs(case, rng) for _ in range(count - 1)]
    result: dict[str, Any] = {**case_summary(case), "bytes": nbytes, "flops": flops, "rotation": count}
    step(case.label)
    try:
        sets = host_sets if host else [spec.map_arrays(s, backend.asarray) for s in host_sets]
        samples = measure(_hal_runner(backend, case, sets), settings.policy, sync=sync)
        result["hal"] = _metrics(samples, nbytes, flops)
        del sets
    except Exception as exc:
        result["hal"] = {"error": f"{type(exc).__name__}: {exc}"}
    peers = []
    wanted = None if settings.peers is None else list(settings.peers)
    for peer in [] if wanted == [] else peers_for(case, host, wanted):
        step(f"{case.label} vs {peer.name}")
        entry: dict[str, Any] = {"name": peer.name}
        runner: Callable[[int], object] | None = None
        try:
            runner = peer.build(host_sets, np if host else array_module(backend))
            samples = measure(runner, settings.policy, sync=sync)
            entry.update(status="ok", **_metrics(samples, nbytes, flops))
            if "median_ms" in result["hal"]:
                entry["hal_speedup"] = entry["median_ms"] / result["hal"]["median_ms"]
        except PeerUnavailable as exc:
            entry.update(status="missing", reason=str(exc))
        except Exception as exc:  # a peer's failure is reported, never fatal
            entry.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
        peers.append(entry)
        runner = None
        gc.collect()
    result["peers"] = peers
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def planned_steps(cases: Sequence[Case], host: bool, peers: Sequence[str] | None, rounds: int = 1) -> int:
    """Progress steps of a run: the limits, each case and each of its peers (every round), the limits again."""
    wanted = None if peers is None else list(peers)
    return 2 + rounds * sum(1 + (0 if wanted == [] else len(peers_for(c, host, wanted))) for c in cases)


def run_bench(
    cases: Sequence[Case],
    backend: Any,
    settings: BenchSettings | None = None,
    *,
    progress: Progress | None = None,
    argv: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Measure the limits, then every case (hal and its peers) on ``backend``; the JSON-ready report."""
    settings = settings or BenchSettings()
    device = backend.device(0)
    sync = device.synchronize
    caps = device.capabilities
    host = array_module(backend) is np
    llc = last_level_cache_bytes(caps)
    bar = progress or Progress(planned_steps(cases, host, settings.peers, settings.rounds), enabled=False)
    started = time.monotonic()
    date, commit = utc_now(), git_commit()  # of the code that runs, taken before it runs
    bar.step("machine limits (copy bandwidth, BLAS)")
    before = _limits(backend, settings, sync, llc, host)
    rng = np.random.default_rng(settings.seed)
    rounds: list[list[dict[str, Any]]] = [[] for _ in cases]
    for _ in range(settings.rounds):
        for case, done in zip(cases, rounds, strict=True):
            if settings.budget_s is not None and time.monotonic() - started > settings.budget_s:
                done.append({**case_summary(case), "skipped": f"time budget of {settings.budget_s:g} s spent"})
                continue
            try:
                done.append(_run_case(backend, case, settings, llc, sync, host, rng, bar.step))
            except Exception as exc:  # e.g. no memory for its inputs: reported, and the next case runs
                done.append({**case_summary(case), "hal": {"error": f"{type(exc).__name__}: {exc}"}, "peers": []})
            gc.collect()
    results = [_merge_rounds(done) for done in rounds]
    overhead = measure_overhead(backend) if settings.overhead and host else None
    interference = measure_interference(backend) if settings.overhead and host else None
    bar.step("machine limits again")
    limits = _best_limits(before, _limits(backend, settings, sync, llc, host))
    _add_ratios(results, limits)
    bar.close()
    return {
        "schema": SCHEMA,
        "date": date,
        "git": commit,
        "command": list(argv) if argv is not None else None,
        "machine": machine_info(),
        "backend": {"name": backend.name, "host_arrays": host,
                    "device": caps.model_dump(mode="json") | {"dtypes": sorted(caps.dtypes),
                                                              "features": sorted(caps.features)}},
        "versions": versions(),
        "settings": {"repeat": settings.policy.repeat, "warmup": settings.policy.warmup,
                     "warmup_seconds": settings.policy.warmup_seconds,
                     "min_repeat": settings.policy.min_repeat, "max_seconds": settings.policy.max_seconds,
                     "quick": settings.quick, "cached_weights": settings.cached_weights,
                     "peers": None if settings.peers is None else list(settings.peers),
                     "budget_s": settings.budget_s, "seed": settings.seed, "rounds": settings.rounds,
                     "overhead": settings.overhead},
        "limits": limits,
        "overhead": overhead,
        "interference": interference,
        "seconds": time.monotonic() - started,
        "cases": results,
    }
