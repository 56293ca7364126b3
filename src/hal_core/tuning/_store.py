"""The tune store: one JSON file per (backend, device key, hal version) in a per-user cache folder.

Folder: ``HAL_TUNE_DIR``, else ``$XDG_CACHE_HOME/hal/tuning``, else
``~/.cache/hal/tuning``. A file is written to a temporary file in the same
folder and renamed over the old one (``os.replace``), so readers see the
old table or the new one, never half of one. A file that cannot be read,
is not JSON, has another schema, or belongs to another device key or
version is ignored with a logged warning. The store is bounded: at most
:data:`MAX_BUCKETS` buckets per op and knob, files over
:data:`MAX_FILE_BYTES` are ignored, and at most :data:`MAX_FILES` tables
are kept (the least recently written go first).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import env

__all__ = ["MAX_BUCKETS", "MAX_FILES", "MAX_FILE_BYTES", "SCHEMA", "TuneTable", "device_key", "has_tables",
           "list_tables", "load_table", "save_table", "table_path", "tune_dir"]

log = logging.getLogger("hal")

#: The ``schema`` field of every store file.
SCHEMA = "hal-tune/1"
MAX_BUCKETS = 256
MAX_FILES = 64
MAX_FILE_BYTES = 1 << 20


def tune_dir() -> Path:
    """The store folder (not created here)."""
    explicit = (env.text("HAL_TUNE_DIR") or "").strip()
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return base / "hal" / "tuning"


def _memory_bucket(nbytes: int) -> int:
    """Memory size rounded to a power of two of GiB (so free-memory noise never changes the key)."""
    gib = max(1, round(nbytes / 2**30))
    return 1 << (gib - 1).bit_length()


def device_key(backend: str, capabilities: Any, version: str) -> dict[str, Any]:
    """The capabilities that decide which kernel wins, plus the backend and hal version."""
    return {
        "backend": backend,
        "vendor": capabilities.vendor,
        "name": capabilities.name,
        "arch": capabilities.arch,
        "compute_units": capabilities.compute_units,
        "simd_width": capabilities.simd_width,
        "memory_gib": _memory_bucket(capabilities.memory_total),
        "hal_version": version,
    }


def _file_prefix(backend: str) -> str:
    return (re.sub(r"[^A-Za-z0-9_.-]+", "-", str(backend)) or "backend") + "-"


def table_path(key: dict[str, Any], folder: Path | None = None) -> Path:
    """``<folder>/<backend>-<hash of key>.json``."""
    import hashlib  # imported where a table is looked up, not when ops are bound

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder or tune_dir()) / f"{_file_prefix(key['backend'])}{digest}.json"


def has_tables(backend: str, folder: Path | None = None) -> bool:
    """Whether the store holds any file of ``backend`` (one directory listing: no device key, no file read).

    False lets a caller skip building the device key, which needs the
    device's capabilities; True may include another backend whose name
    starts alike, so it only means "look up the key".
    """
    prefix = _file_prefix(backend)
    try:
        with os.scandir(folder or tune_dir()) as entries:
            return any(e.name.startswith(prefix) and e.name.endswith(".json") for e in entries)
    except OSError:  # no folder (nothing tuned yet), or one that cannot be read: no table either way
        return False


@dataclass
class TuneTable:
    """Persisted winners for one device key.

    ``choices[op][bucket]`` names the implementation; ``knobs[op][knob][bucket]``
    holds a knob's value; ``measurements[op][bucket]`` keeps the medians
    (ms) per candidate that decided them, for ``hal tune --show``.
    """

    key: dict[str, Any]
    choices: dict[str, dict[str, str]] = field(default_factory=dict)
    knobs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    measurements: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    updated: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "key": self.key, "updated": self.updated, "choices": self.choices,
                "knobs": self.knobs, "measurements": self.measurements}

    def is_empty(self) -> bool:
        return not self.choices and not self.knobs


def _valid_mapping(value: Any, depth: int) -> bool:
    if not isinstance(value, dict):
        return False
    if depth == 0:
        return all(isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in value.items())
    return all(isinstance(k, str) and _valid_mapping(v, depth - 1) for k, v in value.items())


def _parse(data: Any) -> TuneTable | str:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return f"not a {SCHEMA} file"
    key = data.get("key")
    choices, knobs = data.get("choices", {}), data.get("knobs", {})
    measurements = data.get("measurements", {})
    if not isinstance(key, dict) or not _valid_mapping(choices, 1) or not _valid_mapping(knobs, 2):
        return "malformed key, choices or knobs"
    if not _valid_mapping(measurements, 2):
        measurements = {}
    return TuneTable(key=key, choices=choices, knobs=knobs, measurements=measurements,
                     updated=str(data.get("updated", "")))


def read_table(path: Path) -> TuneTable | str:
    """The table in ``path``, or a string saying why it cannot be used."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            return f"larger than {MAX_FILE_BYTES} bytes"
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"unreadable: {type(exc).__name__}: {exc}"
    return _parse(data)


def load_table(key: dict[str, Any], folder: Path | None = None) -> TuneTable | None:
    """The table for ``key``, or None (no file; a corrupt or foreign one is logged and ignored)."""
    path = table_path(key, folder)
    if not path.exists():
        return None
    table = read_table(path)
    if isinstance(table, str):
        log.warning("hal: ignoring tune file %s: %s (hal tune --clear removes it)", path, table)
        return None
    if table.key != key:
        log.warning("hal: ignoring tune file %s: it was written for another device or hal version (%s)",
                    path, table.key)
        return None
    return table


def _bounded(table: TuneTable) -> None:
    per_ops: list[dict[str, Any]] = [*table.choices.values(), *table.measurements.values(),
                                     *(knob for op in table.knobs.values() for knob in op.values())]
    for per_op in per_ops:
        while len(per_op) > MAX_BUCKETS:
            per_op.pop(next(iter(per_op)))


def save_table(table: TuneTable, folder: Path | None = None) -> Path:
    """Write ``table`` atomically (temporary file + ``os.replace``); prune the folder to :data:`MAX_FILES`."""
    target = table_path(table.key, folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    _bounded(table)
    table.updated = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(table.to_json(), handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _prune(target.parent, keep=target)
    return target


def _prune(folder: Path, keep: Path) -> None:
    files = sorted((p for p in folder.glob("*.json") if p != keep), key=lambda p: p.stat().st_mtime)
    for stale in files[: max(0, len(files) + 1 - MAX_FILES)]:
        stale.unlink(missing_ok=True)


def list_tables(folder: Path | None = None) -> list[tuple[Path, TuneTable | str]]:
    """Every ``*.json`` file of the store with its table, or why it is unusable."""
    where = folder or tune_dir()
    if not where.is_dir():
        return []
    return [(path, read_table(path)) for path in sorted(where.glob("*.json"))]
