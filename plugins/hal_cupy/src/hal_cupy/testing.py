"""Helpers for the offline compile checks of the GPU plugins' test suites (imported by tests only).

A compile check whose compiler is missing skips with the reason on a
developer's machine and fails in CI, where ``HAL_REQUIRE_COMPILERS=1`` (set by
``.ci/run``) says every compiler must be there.
"""

from __future__ import annotations

from typing import NoReturn

__all__ = ["REQUIRE_COMPILERS", "compilers_required", "missing_compiler"]

#: The environment variable that turns a missing compiler into a failure.
REQUIRE_COMPILERS = "HAL_REQUIRE_COMPILERS"


def compilers_required() -> bool:
    """Whether ``HAL_REQUIRE_COMPILERS`` is on (CI sets ``1``); a value that is no boolean is an error."""
    from hal_core import env

    return env.flag(REQUIRE_COMPILERS, False)


def missing_compiler(reason: str) -> NoReturn:
    """Skip the calling test with ``reason``, or fail it when compilers are required."""
    import pytest

    if compilers_required():
        pytest.fail(f"{reason} ({REQUIRE_COMPILERS}=1: every compile check must run)", pytrace=False)
    pytest.skip(reason)
