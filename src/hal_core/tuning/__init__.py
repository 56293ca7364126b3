"""Kernel choice by measurement, the part dispatch uses: knobs, the per-device tune store and its lookup.

A backend declares what is tunable when it registers an implementation::

    PARTITION = Knob("partition_size", (256, 512, 1024), rule=lambda call: 512)
    registry.register("paged_attention", fn, name="mine.paged_attention", knobs=(PARTITION,))

and reads the value inside ``fn`` with ``PARTITION.value(call)``. Several
implementations of one op that all support a call are tunable too: the
dispatcher asks :func:`ordered` for the order to try them in. ``hal tune``
(:func:`hal_core.bench.tune`, which measures) times the candidates per shape
bucket (each op's :meth:`~hal_core.ops.OpSpec.bucket`) and writes the winners
to the store (:func:`tune_dir`); with no persisted winner the built-in rule
applies. See docs/tuning.md.
"""

from __future__ import annotations

from ._buckets import pow2
from ._knobs import Knob
from ._lookup import clear, enabled, forget, key_for, knob_value, ordered, override, setting_value, source, table_for
from ._store import SCHEMA, TuneTable, device_key, list_tables, load_table, save_table, table_path, tune_dir

__all__ = [
    "SCHEMA", "Knob", "TuneTable",
    "clear", "device_key", "enabled", "forget", "key_for", "knob_value", "list_tables", "load_table",
    "ordered", "override", "pow2", "save_table", "setting_value", "source", "table_for", "table_path",
    "tune_dir",
]
