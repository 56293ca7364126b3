"""What a result file records about where it was measured: date, commit, machine, versions."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["allocator", "git_commit", "machine_info", "versions"]

#: Allocator libraries recognised in the process's mappings (a preloaded one replaces the C library's malloc).
_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
#: Environment variables that change the C library's allocator (glibc's ``MALLOC_*_`` and its tunables).
_MALLOC_ENV = re.compile(r"^(MALLOC_[A-Z_]+_|GLIBC_TUNABLES|LD_PRELOAD)$")

#: Distributions recorded by name; every installed ``hal-*`` distribution and what each requires are added.
_DISTRIBUTIONS = ("numpy", "ml_dtypes", "pydantic", "torch", "matplotlib")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def allocator() -> dict[str, Any]:
    """The C allocator of this process (a benchmark's peak memory depends on it: docs/cpu.md, "The C heap after a
    prompt"): ``{"name": "jemalloc" | "tcmalloc" | "mimalloc" | "libc", "env": {...}}``, ``env`` the variables that
    change it (``LD_PRELOAD``, glibc's ``MALLOC_*_`` and ``GLIBC_TUNABLES``); child processes inherit both."""
    name = "libc"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    for candidate in _ALLOCATORS:
        if f"lib{candidate}" in maps:
            name = candidate
            break
    return {"name": name, "env": {key: value for key, value in sorted(os.environ.items()) if _MALLOC_ENV.match(key)}}


def machine_info() -> dict[str, Any]:
    """CPU model, logical cores, memory, OS, Python and the C allocator."""
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "allocator": allocator(),
    }


def versions() -> dict[str, str]:
    """Installed versions of hal's distributions and the libraries a benchmark touches (metadata only)."""
    found = {}
    for name in _DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if not name.lower().startswith("hal-"):
            continue
        found.setdefault(name, dist.version)
        for requirement in dist.requires or ():  # a backend's array library, for one
            required = re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0]
            try:
                found.setdefault(required, metadata.version(required))
            except (metadata.PackageNotFoundError, ValueError):
                continue
    return dict(sorted(found.items()))


def git_commit(where: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` of the checkout holding hal-core (or ``where``), else None."""
    folder = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                                capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": sha, "dirty": bool(status.strip())} if sha else None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
