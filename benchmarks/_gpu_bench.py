"""Helpers shared by the GPU benchmarks: byte formulas, ratio math, CUDA-event timing, result files.

The pure functions (formulas, statistics, verdicts) are tested without a GPU
in ``plugins/hal_cuda/tests/test_benchmark_helpers.py``; the timing helpers
take the ``cupy`` module as an argument and run only on a GPU machine.
See docs/benchmarks.md for the formulas.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "capture_graph",
    "capture_private",
    "copy_bandwidth_gbps",
    "device_summary",
    "gemm_target",
    "l2_flusher",
    "measure_copy_bandwidth",
    "median_ms",
    "paged_attention_kv_bytes",
    "ratio",
    "result_path",
    "time_ms",
    "verdict",
    "write_json",
]


def paged_attention_kv_bytes(seq_lens: Sequence[int], num_kv_heads: int, head_size: int, itemsize: int) -> int:
    """Bytes of K and V an ideal decode step reads: ``2 * sum(seq_lens) * num_kv_heads * head_size * itemsize``.

    Each KV row is read once for all the query heads of its group (GQA), so
    query heads do not multiply it.
    """
    return 2 * int(sum(int(n) for n in seq_lens)) * num_kv_heads * head_size * itemsize


def copy_bandwidth_gbps(nbytes: int, ms: float) -> float:
    """Device-to-device copy bandwidth counting bytes read plus bytes written: ``2 * nbytes / t``."""
    return 2 * nbytes / (ms * 1e-3) / 1e9


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` (0 when the denominator is not positive)."""
    return numerator / denominator if denominator > 0 else 0.0


def median_ms(samples: Sequence[float]) -> float:
    if not samples:
        raise ValueError("no timing samples")
    return float(statistics.median(samples))


def gemm_target(m: int, large_shape: bool) -> float | None:
    """The speed-up over an fp16 matmul that quantized_gemm W4A16 should reach (None: no target).

    >= 3x at M <= 16 on the large shapes, >= 2x at M = 64, >= 1/1.1 at M >= 1024.
    """
    if m <= 16:
        return 3.0 if large_shape else None
    if m == 64:
        return 2.0
    if m >= 1024:
        return 1 / 1.1
    return None


def verdict(value: float, target: float | None) -> str:
    """``'pass'``, ``'miss'`` or ``'-'`` (no target)."""
    if target is None:
        return "-"
    return "pass" if value >= target else "miss"


def l2_flusher(cp: Any, l2_bytes: int) -> Callable[[], None]:
    """A function that evicts L2 by writing a buffer twice its size (at least 64 MiB)."""
    size = max(2 * int(l2_bytes), 64 << 20)
    scratch = cp.empty(size // 4, dtype=cp.float32)

    def flush() -> None:
        scratch.fill(1.0)

    return flush


def time_ms(cp: Any, fn: Callable[[], Any], *, warmup: int = 5, repeat: int = 20,
            before: Callable[[], None] | None = None) -> list[float]:
    """Milliseconds of ``fn`` per run, timed with CUDA events on the current stream.

    ``before`` (e.g. an L2 flush) runs ahead of each timed run, outside the events.
    """
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    cp.cuda.get_current_stream().synchronize()
    samples = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(repeat):
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(float(cp.cuda.get_elapsed_time(start, end)))
    return samples


def capture_graph(cp: Any, fn: Callable[[], Any], warmup: int = 3) -> tuple[Callable[[], None] | None, str]:
    """``fn`` captured in a CUDA graph on the current (non-default) stream: ``(replay, '')``, or ``(None, why)``.

    Replaying the graph runs the same kernels without the Python dispatch in
    front of them, so timing it measures the device work alone. ``fn`` is run
    ``warmup`` times on the stream first, so that its kernels are compiled and
    CuPy's pool holds blocks for its temporaries (no cudaMalloc while capturing).
    """
    stream = cp.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    return _capture(stream, fn)  # refused (a sync, an allocation): the caller times the plain calls instead


def _capture(stream: Any, fn: Callable[[], Any]) -> tuple[Callable[[], None] | None, str]:
    """``fn`` captured on ``stream``: ``(replay, '')``, or ``(None, why)`` where the capture is refused."""
    try:
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"

    def replay() -> None:
        graph.launch(stream)

    return replay, ""


def capture_private(cp: Any, fn: Callable[[], Any]) -> tuple[Callable[[], None] | None, str, Any]:
    """``fn`` run once, then captured in a CUDA graph with its own memory pool: ``(replay, why_not, pool)``.

    The eager run compiles the kernels and makes hal's device error flag
    (neither may happen during a capture). Every temporary ``fn`` allocates
    comes from ``pool``, a CuPy ``MemoryPool`` used by nothing else, so the
    workspaces the graph writes at each replay are never handed to another
    array; keep ``pool`` alive as long as the graph. The capture uses CuPy's
    default (relaxed) mode on the current stream, which must not be the legacy
    default stream; replays are ``graph.launch(stream)`` on that stream.
    """
    stream = cp.cuda.get_current_stream()
    pool = cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc):
        fn()
        stream.synchronize()
        # refused: a host read, a synchronisation, an allocation outside the pool
        replay, why = _capture(stream, fn)
    return replay, why, pool


def measure_copy_bandwidth(cp: Any, nbytes: int = 2 << 30, repeat: int = 20) -> dict[str, float]:
    """Device-to-device copy of a large buffer: median time and bandwidth (read + write)."""
    src = cp.ones(nbytes // 4, dtype=cp.float32)
    dst = cp.empty_like(src)

    def copy() -> None:
        cp.copyto(dst, src)

    ms = median_ms(time_ms(cp, copy, warmup=3, repeat=repeat))
    return {"bytes": nbytes, "ms": ms, "gbps": copy_bandwidth_gbps(nbytes, ms)}


def device_summary(cp: Any) -> dict[str, Any]:
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {
        "name": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sms": props["multiProcessorCount"],
        "l2_bytes": props["l2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
        "driver": cp.cuda.runtime.driverGetVersion(),
        "runtime": cp.cuda.runtime.runtimeGetVersion(),
        "cupy": cp.__version__,
        "python": platform.python_version(),
    }


def result_path(directory: str | os.PathLike[str], device_name: str, date: _dt.date | None = None) -> Path:
    """``<directory>/<YYYY-MM-DD>-<device>.json`` with the device name made file-safe."""
    day = (date or _dt.date.today()).isoformat()
    safe = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "device"
    return Path(directory) / f"{day}-{safe}.json"


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return target
