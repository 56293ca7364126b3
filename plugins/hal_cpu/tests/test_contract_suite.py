"""hal's contract suite, run against the CPU backend (the default of --hal-backend)."""

from __future__ import annotations

from hal_core.testing.suite import *  # noqa: F403 - collects every contract test here
