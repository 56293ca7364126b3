"""The GPU backends' HAL_<BACKEND>_* variables go through hal_core.env: hal-core's spellings, polarity, errors."""

from __future__ import annotations

import pytest
from hal_cupy import _env

from hal_core import EnvironmentVariableError


@pytest.mark.parametrize(("raw", "expected"), [(None, True), ("", True), ("1", True), ("ON", True),
                                               ("0", False), ("false", False), ("Off", False), ("no", False)])
def test_fmad_is_an_ordinary_flag_defaulting_on(monkeypatch: pytest.MonkeyPatch, raw: str | None,
                                                expected: bool) -> None:
    """HAL_CUDA_FMAD: on-spellings keep fused multiply-add, off-spellings turn it off, unset means on."""
    if raw is None:
        monkeypatch.delenv("HAL_CUDA_FMAD", raising=False)
    else:
        monkeypatch.setenv("HAL_CUDA_FMAD", raw)
    assert _env.fmad("cuda") is expected


@pytest.mark.parametrize("raw", ["2", "disable", "n"])
def test_fmad_unknown_spelling_is_an_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """An unknown HAL_CUDA_FMAD value (read as on before) is an error naming the variable and value."""
    monkeypatch.setenv("HAL_CUDA_FMAD", raw)
    with pytest.raises(EnvironmentVariableError, match=rf"HAL_CUDA_FMAD='{raw}'.*1, true, yes, on"):
        _env.fmad("cuda")


@pytest.mark.parametrize("name", ["HAL_CUDA_OFFLOAD_MIN_FLOPS", "HAL_CUDA_SMALL_M_MAX"])
@pytest.mark.parametrize("raw", ["many", "-5", "2.5"])
def test_numeric_variables_name_themselves(monkeypatch: pytest.MonkeyPatch, name: str, raw: str) -> None:
    """A bad numeric value raises naming the variable (not a bare int() error)."""
    monkeypatch.setenv(name, raw)
    if name == "HAL_CUDA_OFFLOAD_MIN_FLOPS":
        def reader() -> int:
            return _env.offload_min_flops("cuda")
    else:
        def reader() -> int:
            return _env.small_m_max("cuda", 8)
    with pytest.raises(EnvironmentVariableError, match=rf"{name}='{raw}': expected an integer >= 0"):
        reader()


def test_numeric_variables_read_integral_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Integral spellings (1e6) keep working; unset gives the default."""
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "1e6")
    assert _env.offload_min_flops("cuda") == 1_000_000
    monkeypatch.delenv("HAL_CUDA_OFFLOAD_MIN_FLOPS")
    assert _env.offload_min_flops("cuda") == _env.DEFAULT_OFFLOAD_MIN_FLOPS


def test_allocator_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """HAL_CUDA_ALLOCATOR takes a policy name in any case and names the choices otherwise."""
    monkeypatch.setenv("HAL_CUDA_ALLOCATOR", "Managed")
    assert _env.allocator_policy("cuda") == "managed"
    monkeypatch.setenv("HAL_CUDA_ALLOCATOR", "pool")
    with pytest.raises(EnvironmentVariableError, match=r"HAL_CUDA_ALLOCATOR='pool'.*caching, async, managed"):
        _env.allocator_policy("cuda")


def test_require_compilers_reads_a_boolean_and_refuses_a_misspelling(monkeypatch) -> None:
    """HAL_REQUIRE_COMPILERS: 1/true/on turn the requirement on, 0/off/unset off, anything else is an error."""
    from hal_cupy.testing import compilers_required

    for value, expected in (("1", True), ("true", True), ("ON", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("HAL_REQUIRE_COMPILERS", value)
        assert compilers_required() is expected
    monkeypatch.delenv("HAL_REQUIRE_COMPILERS")
    assert compilers_required() is False
    monkeypatch.setenv("HAL_REQUIRE_COMPILERS", "yes please")
    with pytest.raises(EnvironmentVariableError, match="HAL_REQUIRE_COMPILERS"):
        compilers_required()
