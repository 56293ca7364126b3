"""Start-up cost: ``import hal_core; hal_core.get_backend()`` against ``import numpy``, in fresh interpreters.

Each command runs in a new Python process, alternating, ``--runs`` times;
the figure is the median CPU time (user + system) of the child, which a
loaded machine disturbs less than wall time. The ratio is what matters.

Usage: ``python benchmarks/import_time.py [--runs N]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

COMMANDS = {
    "python -c pass": "pass",
    "import numpy": "import numpy",
    "import hal_core; hal_core.get_backend()": "import hal_core; hal_core.get_backend()",
}


def _cpu_seconds(code: str) -> float:
    before = os.times()
    subprocess.run([sys.executable, "-c", code], check=True)
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def measure(runs: int = 15) -> dict[str, float]:
    """Median child CPU seconds per command."""
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(runs):
        for name, code in COMMANDS.items():
            samples[name].append(_cpu_seconds(code))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    figures = measure(parser.parse_args().runs)
    base = figures["import numpy"]
    for name, seconds in figures.items():
        print(f"{name:<42} {seconds * 1e3:7.1f} ms CPU  ({seconds / base:4.2f}x import numpy)")


if __name__ == "__main__":
    main()
