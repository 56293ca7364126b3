"""Kernel choice by measurement: knobs, shape buckets, the per-device tune store, and the tuner.

A backend declares what is tunable when it registers an implementation::

    PARTITION = Knob("partition_size", (256, 512, 1024), rule=lambda call: 512)
    registry.register("paged_attention", fn, name="mine.paged_attention", knobs=(PARTITION,))

and reads the value inside ``fn`` with ``PARTITION.value(call)``. Several
implementations of one op that all support a call are tunable too: the
dispatcher asks :func:`ordered` for the order to try them in. ``hal tune``
(:func:`tune`) measures the candidates per shape bucket (:func:`bucket`) and
writes the winners to the store (:func:`tune_dir`); with no persisted
winner the built-in rule applies. See docs/tuning.md.
"""

from __future__ import annotations

from typing import Any

from ._buckets import bucket, pow2
from ._knobs import Knob
from ._lookup import enabled, forget, key_for, knob_value, ordered, override, source, table_for
from ._store import SCHEMA, TuneTable, device_key, list_tables, load_table, save_table, table_path, tune_dir

__all__ = [
    "SCHEMA", "Knob", "TuneTable",
    "bucket", "clear", "device_key", "enabled", "forget", "key_for", "knob_value", "list_tables", "load_table",
    "ordered", "override", "pow2", "save_table", "source", "table_for", "table_path", "tunables", "tune",
    "tune_dir",
]


def tune(*args: Any, **kwargs: Any) -> Any:
    """Measure and persist the winners; see :func:`hal_core.tuning._tuner.tune` (imported on first use)."""
    from ._tuner import tune as run

    return run(*args, **kwargs)


def tunables(backend: Any) -> dict[str, dict[str, Any]]:
    """Per op of ``backend``: implementations, knobs, and whether anything is tunable."""
    from ._tuner import tunables as find

    return find(backend)


def clear(backend: Any | None = None) -> list[Any]:
    """Remove the store files of ``backend`` (all when None); see :func:`hal_core.tuning._tuner.clear`."""
    from ._tuner import clear as remove

    return remove(backend)
