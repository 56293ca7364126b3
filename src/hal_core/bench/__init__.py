"""``hal bench`` and ``hal tune`` as a library: every op over preset or given shapes, against measured limits
and peers; the tuner that measures candidates and persists the winners (:func:`tune`).

>>> from hal_core import bench, get_backend
>>> report = bench.run_bench(bench.preset_cases("decode"), get_backend())   # doctest: +SKIP
>>> print(bench.format_table(report))                                      # doctest: +SKIP

A whole model (``hal bench --model``; torch and transformers needed only by its child processes):

>>> settings = bench.ModelBenchSettings(bench.resolve_model("1b"), bench.resolve_contenders("all"))  # doctest: +SKIP
>>> print(bench.format_model_table(bench.run_model_bench(settings)))                                # doctest: +SKIP

Formulas, presets and the report's keys: docs/benchmarks.md.
"""

from __future__ import annotations

from ._cases import BenchArgumentError, Case, bench_params, make_case, parse_shape, preset_cases, preset_names
from ._limits import array_module, last_level_cache_bytes, measure_blas, measure_copy
from ._model import MODEL_SCHEMA, ModelBenchSettings, format_model_table, run_model_bench
from ._model_spec import BUILTIN_MODELS, CONTENDERS, Contender, ModelSpec, resolve_contenders, resolve_model
from ._peers import PEERS, Peer, PeerUnavailable, peers_for
from ._progress import Progress
from ._report import format_table, plot_report, write_report
from ._runner import SCHEMA, BenchSettings, planned_steps, rotation, run_bench
from ._timing import Samples, TimingPolicy, measure
from ._tuner import Decision, TuneReport, tunables, tune

__all__ = [
    "BUILTIN_MODELS", "CONTENDERS", "MODEL_SCHEMA", "PEERS", "SCHEMA",
    "BenchArgumentError", "BenchSettings", "Case", "Contender", "Decision", "ModelBenchSettings", "ModelSpec", "Peer",
    "PeerUnavailable", "Progress", "Samples", "TimingPolicy", "TuneReport",
    "array_module", "bench_params", "format_model_table", "format_table", "last_level_cache_bytes", "make_case",
    "measure", "measure_blas", "measure_copy", "parse_shape", "peers_for", "planned_steps", "plot_report",
    "preset_cases", "preset_names", "resolve_contenders", "resolve_model", "rotation", "run_bench", "run_model_bench",
    "tunables", "tune", "write_report",
]
