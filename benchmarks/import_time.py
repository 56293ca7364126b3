"""Start-up cost: ``import hal_core; hal_core.get_backend()`` against ``import numpy``, in fresh interpreters.

Each command runs in a new Python process, alternating, ``--runs`` times,
after one warm-up run of each; the figure is the median CPU time (user +
system, from ``getrusage``: microsecond resolution) of the child, which a
loaded machine disturbs less than wall time. The ratio is what matters.

Both sides import from cached bytecode, as every run after the first does
on a user's machine (pip compiles wheels' modules at install; an editable
install writes ``__pycache__`` on first import): the children get a
private ``PYTHONPYCACHEPREFIX`` that the warm-up fills, and
``PYTHONDONTWRITEBYTECODE`` is dropped for them. Without that, an
environment that forbids writing bytecode would make hal's editable sources
compile on every start while numpy's precompiled wheel would not, which
measures the compiler, not the import. ``--as-is`` keeps the caller's
environment instead.

Usage: ``python benchmarks/import_time.py [--runs N] [--as-is]``
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile

COMMANDS = {
    "python -c pass": "pass",
    "import numpy": "import numpy",
    "import hal_core; hal_core.get_backend()": "import hal_core; hal_core.get_backend()",
}


def _cpu_seconds(code: str, env: dict[str, str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(runs: int = 15, *, as_is: bool = False) -> dict[str, float]:
    """Median child CPU seconds per command (bytecode cached for both sides unless ``as_is``)."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="hal-import-time-") as cache:
        if not as_is:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = cache
        for code in COMMANDS.values():  # warm-up: fills the bytecode cache and the OS file cache
            _cpu_seconds(code, env)
        samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for _ in range(runs):
            for name, code in COMMANDS.items():
                samples[name].append(_cpu_seconds(code, env))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--as-is", action="store_true",
                        help="keep the caller's environment (e.g. PYTHONDONTWRITEBYTECODE) instead of cached bytecode")
    args = parser.parse_args()
    figures = measure(args.runs, as_is=args.as_is)
    base = figures["import numpy"]
    for name, seconds in figures.items():
        print(f"{name:<42} {seconds * 1e3:7.1f} ms CPU  ({seconds / base:4.2f}x import numpy)")


if __name__ == "__main__":
    main()
