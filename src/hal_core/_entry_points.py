"""The entry points of one group, read from the installed distributions without importing ``importlib.metadata``.

Discovery needs three facts per distribution: its entry points in hal's
group, its name and its version. ``importlib.metadata`` answers them, but
importing it (email, zipfile, csv, importlib.resources) costs about a
quarter of ``import numpy``, on every start. This module reads the same
files the way its path finder does for folders:

- every ``sys.path`` entry in order (``''`` is the current folder); in each,
  every ``*.dist-info`` and ``*.egg-info`` folder. A distribution whose
  normalised name was already seen earlier on the path is skipped, as
  ``importlib.metadata.entry_points()`` skips it;
- ``entry_points.txt`` holds ``[group]`` sections of ``name = value`` lines
  (``#`` starts a comment);
- the name and version are the ``Name:`` and ``Version:`` headers of
  ``METADATA`` (``PKG-INFO`` for egg-info).

What it cannot read as folders is left to ``importlib.metadata`` itself,
imported only then: a zip archive on ``sys.path``, or an import finder
other than the standard path finder that provides distributions. So no
environment loses a plugin to the shortcut.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["FoundEntryPoint", "entry_points"]

# importlib.metadata's EntryPoint.pattern: "module[:attr.attr][ [extras]]"
_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


@dataclass(frozen=True)
class FoundEntryPoint:
    """One entry point of the group, with the distribution that declares it."""

    name: str
    value: str
    distribution: str
    version: str

    def load(self) -> Any:
        """Import the module named by ``value`` and return the attribute it names (the module without one)."""
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(f"entry point {self.name!r}: {self.value!r} is not 'module' or 'module:attribute'")
        found: Any = importlib.import_module(match.group("module"))
        for part in filter(None, (match.group("attr") or "").split(".")):
            found = getattr(found, part)
        return found


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def _group_lines(text: str, group: str) -> list[tuple[str, str]]:
    """``(name, value)`` pairs of ``[group]`` in an ``entry_points.txt``."""
    pairs, section = [], None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1].strip()
        elif section == group and "=" in line:
            name, value = line.split("=", 1)
            pairs.append((name.strip(), value.strip()))
    return pairs


def _name_and_version(info: str) -> tuple[str, str]:
    """The ``Name`` and ``Version`` headers of a distribution's metadata file ("?" where missing)."""
    text = _read(os.path.join(info, "METADATA")) or _read(os.path.join(info, "PKG-INFO")) or ""
    headers: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the headers end at the first blank line; the description follows
        key, sep, value = line.partition(":")
        if sep and not line[0].isspace():
            headers.setdefault(key.strip().lower(), value.strip())
    return headers.get("name") or "?", headers.get("version") or "?"


def _from_metadata(group: str, path: list[str] | None, seen: set[str]) -> list[FoundEntryPoint]:
    """The group's entry points of the distributions ``importlib.metadata`` finds (on ``path``, or everywhere)."""
    from importlib import metadata

    found = []
    for dist in (metadata.distributions() if path is None else metadata.distributions(path=path)):
        name = dist.metadata["Name"] or "?"
        if _normalise(name) in seen:
            continue
        seen.add(_normalise(name))
        found += [FoundEntryPoint(ep.name, ep.value, name, dist.version or "?")
                  for ep in dist.entry_points if ep.group == group]
    return found


def _folder_only() -> bool:
    """True when the standard path finder is the only finder that provides distributions."""
    return all(not hasattr(finder, "find_distributions") or finder is importlib.machinery.PathFinder
               for finder in sys.meta_path)


def entry_points(group: str) -> list[FoundEntryPoint]:
    """The entry points of ``group`` of every distribution visible on ``sys.path``, in path order."""
    seen: set[str] = set()
    if not _folder_only():
        return _from_metadata(group, None, seen)
    found: list[FoundEntryPoint] = []
    for entry in sys.path:
        root = entry or "."
        try:
            children = os.listdir(root)
        except NotADirectoryError:  # a zip archive
            found += _from_metadata(group, [entry], seen)
            continue
        except OSError:  # missing or unreadable: nothing installed there
            continue
        for child in children:
            low = child.lower()
            if not low.endswith((".dist-info", ".egg-info")):
                continue
            key = _normalise(low.rpartition(".")[0].partition("-")[0])
            if key in seen:
                continue
            seen.add(key)
            info = os.path.join(root, child)
            text = _read(os.path.join(info, "entry_points.txt"))
            pairs = _group_lines(text, group) if text else []
            if pairs:
                name, version = _name_and_version(info)
                found += [FoundEntryPoint(n, v, name, version) for n, v in pairs]
    return found
