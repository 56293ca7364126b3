"""pytest plugin registered by hal-core: adds ``--hal-backend``."""

from __future__ import annotations


def pytest_addoption(parser) -> None:
    group = parser.getgroup("hal")
    group.addoption("--hal-backend", action="store", default=None,
                    help="run hal's contract suite against this backend (default: cpu)")
