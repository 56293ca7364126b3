"""Dispatch never hands back a wrong result: implementations' results are checked, out is written whole."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, ImplementationError
from hal_core.ops import OPS
from hal_core.quant import quantize
from hal_core.testing.inputs import write_kv_cache_inputs

FAULTY = '''
import numpy as np

from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend

MODE = "ok"
CALLS = []


def gemm(call):
    CALLS.append(call)
    x, qweight = call["x"], call["qweight"]
    good = (x.astype(np.float64) @ qweight.dequantize(np.float64)).astype(x.dtype)
    assert "out" not in call.args  # implementations never see the caller's out
    if MODE == "ok":
        return good
    if MODE == "shape":
        return good[:, :1]
    if MODE == "dtype":
        return good.astype(np.float64)
    if MODE == "device":
        return good.tolist()
    if MODE == "none":
        return None
    if MODE == "raise":
        raise RuntimeError("kernel exploded half way")
    raise AssertionError(MODE)


def write(call):
    CALLS.append(call)
    raise AssertionError("never reached: a read-only cache is refused first")


class FaultyBackend(HostBackend):
    name = "faulty"
    priority = 8

    def register_ops(self, registry):
        registry.register("quantized_gemm", gemm, name="faulty.gemm", priority=1)
        registry.register("write_kv_cache", write, name="faulty.write", priority=1)


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [FaultyBackend]
'''


@pytest.fixture
def faulty(make_plugin, only_cpu_real, cpu):
    """A host backend whose gemm misbehaves as ``module.MODE`` says; its fallback is hal-cpu."""
    plugin = make_plugin("faulty", FAULTY)
    only_cpu_real()
    backend = hal_core.get_backend("faulty")
    assert backend.ops.fallback is not None and backend.ops.fallback.name == "cpu"
    return backend, sys.modules[plugin.module]


def _case(seed: int = 3):
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    qw = quantize(rng.standard_normal((64, 16)) / 8, group_size=32)
    return x, qw, OPS["quantized_gemm"].reference({"x": x, "qweight": qw})


@pytest.mark.parametrize("mode", ["shape", "dtype", "device", "none", "raise"])
def test_bad_result_falls_back_with_a_correct_answer_and_logs_once(faulty, mode: str, caplog) -> None:
    """A wrong shape, dtype, kind of array, None, or an exception: the caller still gets the correct result."""
    backend, module = faulty
    module.MODE = mode
    x, qw, expected = _case()
    with caplog.at_level(logging.WARNING, logger="hal"):
        for _ in range(3):
            got = backend.ops.quantized_gemm(x, qw)
            assert got.shape == expected.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    faults = [r for r in caplog.records if "faulty.gemm" in r.getMessage()]
    assert len(faults) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("mode", ["shape", "dtype", "device", "none", "raise"])
def test_bad_result_under_strict_is_an_error_naming_the_implementation(faulty, mode: str, monkeypatch) -> None:
    """HAL_STRICT=1: the fault raises ImplementationError naming the implementation instead of falling back."""
    backend, module = faulty
    module.MODE = mode
    monkeypatch.setenv("HAL_STRICT", "1")
    x, qw, _ = _case()
    with pytest.raises(ImplementationError, match=r"faulty\.gemm"):
        backend.ops.quantized_gemm(x, qw)


@pytest.mark.parametrize("mode", ["ok", "shape", "raise"])
def test_out_is_written_only_from_a_complete_checked_result(faulty, mode: str, monkeypatch) -> None:
    """The implementation never sees the caller's out: a failing one leaves it untouched; a good one fills it."""
    backend, module = faulty
    module.MODE = mode
    x, qw, expected = _case()
    out = np.full(expected.shape, 7.0, np.float32)
    result = backend.ops.quantized_gemm(x, qw, out=out)
    assert result is out
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    if mode != "ok":
        monkeypatch.setenv("HAL_STRICT", "1")
        out[...] = 7.0
        with pytest.raises(ImplementationError):
            backend.ops.quantized_gemm(x, qw, out=out)
        assert (out == 7.0).all(), "a failed call modified out"


def test_read_only_out_is_refused_before_any_work(faulty) -> None:
    """A read-only out raises ArgumentError naming 'out' and no implementation runs."""
    backend, module = faulty
    x, qw, expected = _case()
    out = np.zeros(expected.shape, np.float32)
    out.flags.writeable = False
    module.CALLS.clear()
    with pytest.raises(ArgumentError, match="'out' is read-only"):
        backend.ops.quantized_gemm(x, qw, out=out)
    assert module.CALLS == []


@pytest.mark.parametrize("frozen", ["key_cache", "value_cache"])
def test_read_only_cache_is_refused_before_any_write(faulty, frozen: str, cpu) -> None:
    """write_kv_cache with one read-only cache names it and writes neither cache (here and on hal-cpu)."""
    backend, module = faulty
    for target in (backend, cpu):
        args = write_kv_cache_inputs(np.random.default_rng(5), num_tokens=4, num_blocks=2, num_kv_heads=2,
                                     block_size=8, head_size=64, dtype="fp32")
        before = {name: args[name].copy() for name in ("key_cache", "value_cache")}
        args[frozen].flags.writeable = False
        module.CALLS.clear()
        with pytest.raises(ArgumentError, match=f"'{frozen}' is read-only"):
            target.ops.write_kv_cache(args["key"], args["value"], args["key_cache"], args["value_cache"],
                                      args["slot_mapping"])
        assert module.CALLS == []
        for name, value in before.items():
            np.testing.assert_array_equal(args[name], value, err_msg=f"{name} was written")


def test_stats_count_calls_implementations_and_fallbacks(faulty) -> None:
    """hal_core.stats(): per backend and op, calls, the implementation that ran, fallbacks and their time."""
    backend, module = faulty
    x, qw, _ = _case()
    module.MODE = "ok"
    backend.ops.quantized_gemm(x, qw)
    backend.ops.quantized_gemm(x, qw)
    module.MODE = "shape"
    backend.ops.quantized_gemm(x, qw)
    report = hal_core.stats()["faulty"]["quantized_gemm"]
    assert report["calls"] == 3
    assert report["implementations"] == {"faulty.gemm": 2, "fallback:cpu": 1}
    (reason, count), = report["fallbacks"].items()
    assert count == 1 and "faulty.gemm" in reason and "returned shape (4, 1)" in reason
    assert report["fallback_seconds"] > 0
    assert hal_core.stats()["cpu"]["quantized_gemm"]["calls"] == 1  # the fallback ran it
    hal_core.reset()
    assert hal_core.stats() == {}


def test_explain_names_the_implementation_that_would_run_and_why_others_did_not(faulty) -> None:
    """Ops.explain(call): the chosen implementation runs, the rest carry the reason they were passed over."""
    backend, _ = faulty
    x, qw, _ = _case()
    call = backend.ops.prepare("quantized_gemm", x=x, qweight=qw, out=None)
    assert backend.ops.explain(call) == [("faulty.gemm", "runs")]
    call = backend.ops.prepare("paged_attention", **_attention_args())
    rows = backend.ops.explain(call)
    assert rows == [("fallback", "runs on backend 'cpu'")]


def _attention_args():
    from hal_core.testing.inputs import paged_attention_inputs

    args = paged_attention_inputs(np.random.default_rng(2), seq_lens=[5, 9], num_heads=4, num_kv_heads=2,
                                  head_size=64, block_size=8, dtype="fp32")
    return {**args, "out": None}
