"""Validation plans: a host signature's declared checks kept between calls, without losing a check."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, ArgumentTypeError
from hal_core.ops import OPS, _plans
from hal_core.testing.inputs import paged_attention_inputs

SEED = 20261204
SPEC = OPS["paged_attention"]


def _inputs(seed: int = SEED, *, seq_lens: tuple[int, ...] = (8,), dtype: str = "fp32") -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return paged_attention_inputs(rng, seq_lens=list(seq_lens), num_heads=4, num_kv_heads=1, head_size=64,
                                  block_size=16, dtype=dtype)


def _validate(args: dict[str, Any]) -> None:
    SPEC.validate(args, np.asarray)


def test_repeat_calls_plan_once_and_match_the_reference(cpu: hal_core.Backend) -> None:
    """Two validations of one signature keep one plan; repeated front-door calls (numpy arrays: the front door's
    bound path, which keeps its own per signature) each match the float64 reference."""
    _plans.clear_plans()
    args = _inputs()
    rng = np.random.default_rng(SEED + 1)
    for _ in range(2):
        args["query"] = rng.standard_normal(args["query"].shape).astype(np.float32)  # fresh values, same shapes
        expected = SPEC.reference(args)
        _validate(dict(args))
        assert _plans.plan_count() == 1
        result = cpu.ops.paged_attention(**args)
        np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)


def test_index_switch_read_on_every_call_of_a_kept_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """HAL_CHECK_INDICES changed between calls of one planned signature is honoured each time."""
    _plans.clear_plans()
    _validate(_inputs())  # the signature's plan is kept
    bad = _inputs()
    bad["block_tables"][0, 0] = bad["key_cache"].shape[0]  # a used entry past the last block
    with pytest.raises(ArgumentError, match="'block_tables'"):
        _validate(dict(bad))
    monkeypatch.setenv("HAL_CHECK_INDICES", "0")
    _validate(dict(bad))  # host index values are not read
    monkeypatch.setenv("HAL_CHECK_INDICES", "1")
    with pytest.raises(ArgumentError, match="'block_tables'"):
        _validate(dict(bad))
    assert _plans.plan_count() == 1


def test_another_shape_dtype_or_layout_is_checked_in_full() -> None:
    """A call differing from a planned one in a dtype, a shared size or a stride gets every declared check."""
    _plans.clear_plans()
    _validate(_inputs())
    wrong_dtype = _inputs()
    wrong_dtype["key_cache"] = wrong_dtype["key_cache"].astype(np.float16)
    with pytest.raises(ArgumentTypeError, match="'key_cache'"):
        _validate(wrong_dtype)
    wrong_size = _inputs()
    wrong_size["seq_lens"] = np.concatenate([wrong_size["seq_lens"], wrong_size["seq_lens"]])
    with pytest.raises(ArgumentError, match="'seq_lens'"):
        _validate(wrong_size)
    strided = _inputs()
    strided["query"] = np.repeat(strided["query"], 2, axis=2)[:, :, ::2]  # same shape, last dimension strided
    with pytest.raises(ArgumentError, match="'query'"):
        _validate(strided)
    assert _plans.plan_count() == 1  # failed signatures keep no plan


def test_numbers_checked_and_normalised_on_a_kept_plan() -> None:
    """A planned signature still refuses a bad scale, and still turns a numpy scalar into a float."""
    _plans.clear_plans()
    _validate(_inputs())
    nan_scale = _inputs()
    nan_scale["scale"] = float("nan")
    with pytest.raises(ArgumentTypeError, match="'scale'"):
        _validate(nan_scale)
    numpy_scale = _inputs()
    numpy_scale["scale"] = np.float32(0.125)
    _validate(numpy_scale)
    assert type(numpy_scale["scale"]) is float and numpy_scale["scale"] == 0.125


def test_plans_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond MAX_PLANS signatures the oldest plans are dropped; the newest is kept."""
    _plans.clear_plans()
    monkeypatch.setattr(_plans, "MAX_PLANS", 3)
    for n in range(1, 8):
        args = _inputs(seq_lens=(8,) * n)
        _validate(args)
        assert _plans.plan_count() <= 3
    key = _plans.host_signature(SPEC, args)
    assert key is not None and key in _plans._PLANS
    assert _plans.host_signature(SPEC, _inputs(seq_lens=(8,))) not in _plans._PLANS


def test_non_numpy_arrays_have_no_signature() -> None:
    """An array that is not exactly a numpy array (a subclass here) is checked in full on every call."""
    args = _inputs()
    args["query"] = args["query"].view(_Sub)
    assert _plans.host_signature(SPEC, args) is None
    assert _plans.host_signature(SPEC, _inputs()) is not None


class _Sub(np.ndarray):
    """A numpy subclass: validation takes it, the plans do not."""
