"""The HAL_* parser: documented spellings only, errors naming the variable, value and what it accepts."""

from __future__ import annotations

import numpy as np
import pytest

import hal_core
from hal_core import EnvironmentVariableError, env
from hal_core.testing.inputs import paged_attention_inputs

BOOLEANS = [("HAL_FORCE_CPU", False), ("HAL_STRICT", False), ("HAL_CHECK_INDICES", True)]
READERS = {
    "HAL_FORCE_CPU": "force_cpu",
    "HAL_STRICT": "strict",
    "HAL_CHECK_INDICES": "check_indices",
}


def _read(name: str) -> bool:
    from hal_core import _env

    return getattr(_env, READERS[name])()


@pytest.mark.parametrize(("name", "default"), BOOLEANS, ids=[b[0] for b in BOOLEANS])
@pytest.mark.parametrize("spelling", ["1", "true", "YES", " On ", "True"])
def test_on_spellings(monkeypatch: pytest.MonkeyPatch, name: str, default: bool, spelling: str) -> None:
    """Every on-spelling, in any case and with surrounding blanks, reads as on."""
    monkeypatch.setenv(name, spelling)
    assert _read(name) is True


@pytest.mark.parametrize(("name", "default"), BOOLEANS, ids=[b[0] for b in BOOLEANS])
@pytest.mark.parametrize("spelling", ["0", "false", "NO", " off "])
def test_off_spellings(monkeypatch: pytest.MonkeyPatch, name: str, default: bool, spelling: str) -> None:
    """Every off-spelling reads as off, whatever the default."""
    monkeypatch.setenv(name, spelling)
    assert _read(name) is False


@pytest.mark.parametrize(("name", "default"), BOOLEANS, ids=[b[0] for b in BOOLEANS])
@pytest.mark.parametrize("value", [None, "", "   "], ids=["unset", "empty", "blank"])
def test_unset_or_empty_is_the_default(monkeypatch: pytest.MonkeyPatch, name: str, default: bool,
                                       value: str | None) -> None:
    """Unset, empty and blank all mean the documented default (an empty safety switch stays on)."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    assert _read(name) is default


@pytest.mark.parametrize(("name", "default"), BOOLEANS, ids=[b[0] for b in BOOLEANS])
@pytest.mark.parametrize("value", ["2", "y", "enabled", "-1", "onn"])
def test_unknown_spelling_is_an_error_naming_everything(monkeypatch: pytest.MonkeyPatch, name: str,
                                                        default: bool, value: str) -> None:
    """Any other value raises, naming the variable, the value and the accepted spellings."""
    monkeypatch.setenv(name, value)
    with pytest.raises(EnvironmentVariableError) as info:
        _read(name)
    message = str(info.value)
    assert name in message and repr(value) in message
    for spelling in (*env.ON_SPELLINGS, *env.OFF_SPELLINGS):
        assert spelling in message
    assert isinstance(info.value, ValueError)
    assert (info.value.name, info.value.value) == (name, value)


def test_a_misspelt_check_indices_fails_closed_at_the_first_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """HAL_CHECK_INDICES=2 used to turn the index checks off silently; now the first op call raises."""
    rng = np.random.default_rng(0)
    args = paged_attention_inputs(rng, seq_lens=[9], num_heads=2, num_kv_heads=1, head_size=64,
                                  block_size=8, dtype="fp32")
    args["block_tables"][0, 0] = 10**6  # out of range: must never be read
    monkeypatch.setenv("HAL_CHECK_INDICES", "2")
    be = hal_core.get_backend("cpu")
    with pytest.raises(EnvironmentVariableError, match="HAL_CHECK_INDICES"):
        be.ops.paged_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                               args["seq_lens"], scale=args["scale"])


def test_integer_accepts_integral_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Integers: decimal, with underscores, or an integral float such as 1e6; the default when unset."""
    for raw, expected in [("4096", 4096), (" 1_000 ", 1000), ("1e6", 1_000_000), ("-3", -3)]:
        monkeypatch.setenv("HAL_TEST_INT", raw)
        assert env.integer("HAL_TEST_INT", 7) == expected
    monkeypatch.delenv("HAL_TEST_INT")
    assert env.integer("HAL_TEST_INT", 7) == 7


@pytest.mark.parametrize("raw", ["abc", "1.5", "inf", "nan", "12k", "-1"])
def test_integer_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """A non-integer or out-of-range value raises naming the variable, the value and the bound."""
    monkeypatch.setenv("HAL_TEST_INT", raw)
    with pytest.raises(EnvironmentVariableError, match=r"HAL_TEST_INT=.*expected an integer >= 0"):
        env.integer("HAL_TEST_INT", 7, minimum=0)


def test_number_and_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reals must be finite and in range; choices are case-insensitive and listed in the error."""
    monkeypatch.setenv("HAL_TEST_REAL", "2.5")
    assert env.number("HAL_TEST_REAL", 1.0, minimum=0.0) == 2.5
    for raw in ("nan", "inf", "-1", "x"):
        monkeypatch.setenv("HAL_TEST_REAL", raw)
        with pytest.raises(EnvironmentVariableError, match="HAL_TEST_REAL"):
            env.number("HAL_TEST_REAL", 1.0, minimum=0.0)
    monkeypatch.setenv("HAL_TEST_CHOICE", "Async")
    assert env.choice("HAL_TEST_CHOICE", "caching", ("caching", "async")) == "async"
    monkeypatch.setenv("HAL_TEST_CHOICE", "pool")
    with pytest.raises(EnvironmentVariableError, match="one of caching, async"):
        env.choice("HAL_TEST_CHOICE", "caching", ("caching", "async"))


def test_name_list_and_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Comma lists drop blanks; text is stripped and None when empty."""
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", " cuda, ,rocm ")
    assert env.name_list("HAL_DISABLE_PLUGINS") == {"cuda", "rocm"}
    monkeypatch.setenv("HAL_ALLOW_OVERRIDE", "hal-my_cpu.x,")
    assert env.name_list("HAL_ALLOW_OVERRIDE") == {"hal-my_cpu.x"}
    monkeypatch.setenv("HAL_ALLOW_OVERRIDE", "")
    assert env.name_list("HAL_ALLOW_OVERRIDE") == frozenset()
    monkeypatch.setenv("HAL_BACKEND", "  ")
    assert env.text("HAL_BACKEND") is None


@pytest.mark.parametrize("raw", ["cuda;rocm", "cuda rocm", "cuda/rocm", "hal-x[gpu]", "cpu,cüda"])
def test_name_list_with_another_separator_is_an_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """A list that is not comma-separated names (it would match no plugin and disable nothing) raises."""
    monkeypatch.setenv("HAL_DISABLE_PLUGINS", raw)
    with pytest.raises(EnvironmentVariableError) as info:
        env.name_list("HAL_DISABLE_PLUGINS")
    assert (info.value.name, info.value.value) == ("HAL_DISABLE_PLUGINS", raw)
    assert "comma-separated list of names" in str(info.value) and env.NAME_CHARACTERS in str(info.value)


@pytest.mark.parametrize("raw", ["0", "-1", "inf", "nan", "soon"])
def test_probe_timeout_must_be_positive_and_finite(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """HAL_PROBE_TIMEOUT_S is a number of seconds > 0; anything else names the variable."""
    from hal_core import _env

    monkeypatch.setenv("HAL_PROBE_TIMEOUT_S", raw)
    with pytest.raises(EnvironmentVariableError, match=r"HAL_PROBE_TIMEOUT_S=.*expected a finite number > 0"):
        _env.probe_timeout_s()
    monkeypatch.setenv("HAL_PROBE_TIMEOUT_S", "0.25")
    assert _env.probe_timeout_s() == 0.25
    monkeypatch.delenv("HAL_PROBE_TIMEOUT_S")
    assert _env.probe_timeout_s() == _env.PROBE_TIMEOUT_DEFAULT_S


def test_text_follows_every_write_and_a_replaced_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """env.text sees each set and unset through os.environ, and reads a mapping put in place of os.environ."""
    import os

    assert env.text("HAL_STRICT") is None
    monkeypatch.setenv("HAL_STRICT", "  on ")
    assert env.text("HAL_STRICT") == "on"
    os.environ["HAL_STRICT"] = "off"
    assert env.text("HAL_STRICT") == "off"
    del os.environ["HAL_STRICT"]
    assert env.text("HAL_STRICT") is None
    monkeypatch.setattr(os, "environ", {"HAL_STRICT": "yes"})
    assert env.text("HAL_STRICT") == "yes" and env.flag("HAL_STRICT", default=False) is True
