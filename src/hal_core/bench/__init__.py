"""``hal bench`` and ``hal tune`` as a library: every op over preset or given shapes, against measured limits
and peers; the tuner that measures candidates and persists the winners (:func:`tune`).

>>> from hal_core import bench, get_backend
>>> report = bench.run_bench(bench.preset_cases("decode"), get_backend())   # doctest: +SKIP
>>> print(bench.format_table(report))                                      # doctest: +SKIP

Formulas, presets and the report's keys: docs/benchmarks.md.
"""

from __future__ import annotations

from ._cases import BenchArgumentError, Case, bench_params, make_case, parse_shape, preset_cases, preset_names
from ._limits import array_module, last_level_cache_bytes, measure_blas, measure_copy
from ._peers import PEERS, Peer, PeerUnavailable, peers_for
from ._progress import Progress
from ._report import format_table, plot_report, write_report
from ._runner import SCHEMA, BenchSettings, planned_steps, rotation, run_bench
from ._timing import Samples, TimingPolicy, measure
from ._tuner import Decision, TuneReport, tunables, tune

__all__ = [
    "PEERS", "SCHEMA",
    "BenchArgumentError", "BenchSettings", "Case", "Decision", "Peer", "PeerUnavailable", "Progress", "Samples",
    "TimingPolicy", "TuneReport",
    "array_module", "bench_params", "format_table", "last_level_cache_bytes", "make_case", "measure",
    "measure_blas", "measure_copy", "parse_shape", "peers_for", "planned_steps", "plot_report", "preset_cases",
    "preset_names", "rotation", "run_bench", "tunables", "tune", "write_report",
]
