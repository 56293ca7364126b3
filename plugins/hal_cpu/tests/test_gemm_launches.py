"""GEMM launches kept per weight and signature (hal_cpu.ops._launches): the same bits as a launch built for the
call, in-place changes to the weight reach the next call, bounded per weight, freed with the weight."""

from __future__ import annotations

import gc
import threading
from dataclasses import replace

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import _launches, _rules, quantized_gemm

from hal_core.arrays import BFLOAT16
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, quantized_gemm_inputs

REFERENCE = OPS["quantized_gemm"].reference

#: (bits, activations, kernel, group_size, symmetric, act_order): what each kept launch serves.
CASES = [
    (4, "float", "registers", 32, True, False),
    (4, "float", "registers", 64, False, False),
    (4, "float", "blocked", 32, False, False),
    (4, "float", "blocked", 32, False, True),
    (8, "float", None, 64, False, False),
    (8, "float", None, 32, True, False),
    (8, "float", None, 32, False, True),
    (4, "int8", None, 64, False, False),
]


def _case(rng: np.random.Generator, case: tuple, m: int, dtype: str) -> dict:
    bits, _, _, group_size, symmetric, act_order = case
    return quantized_gemm_inputs(rng, m=m, k=4 * group_size, n=150, bits=bits, group_size=group_size,
                                 symmetric=symmetric, dtype=dtype, act_order=act_order)


def _threads(args: dict) -> int:
    """The thread count the rules give this call (passing it builds a launch for the call alone)."""
    return _rules.threads_for(args["qweight"].nbytes + args["x"].nbytes, _native.load().threads)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-{c[1]}-{c[2]}-g{c[3]}{'-sym' if c[4] else ''}"
                         f"{'-act' if c[5] else ''}")
def test_kept_launch_gives_the_bits_of_a_fresh_one(variant: str, rng: np.random.Generator, case: tuple,
                                                    dtype: str) -> None:
    """Calls of the same weight at several row counts, each twice (the second from the kept launch), against a
    launch built for the call (explicit threads) and the float64 reference."""
    _, activations, kernel, *_ = case
    weight = _case(rng, case, 1, dtype)["qweight"]
    for m in (1, 3, 1, 9):
        x = _case(rng, case, m, dtype)["x"]
        args = {"x": x, "qweight": weight}
        fresh = quantized_gemm.gemm(x, weight, kernel=kernel, activations=activations, threads=_threads(args))
        for _ in range(2):
            got = quantized_gemm.gemm(x, weight, kernel=kernel, activations=activations)
            np.testing.assert_array_equal(got, fresh, err_msg=f"{variant} {case} M={m}")
        if activations == "float":
            assert_close(got, REFERENCE(args), kind="gemm", dtype="fp32", what=f"{variant} {case} M={m}")
    derived = _launches.weight_arrays(weight)[4] or (case[0] == 8 and case[5])  # act-order's row order for W8A8
    assert _launches.launch_count(weight) == (0 if derived else 3), "one per row count, none over derived arrays"


@pytest.mark.parametrize("case", CASES[:1] + CASES[2:5] + CASES[6:], ids=lambda c: f"int{c[0]}-{c[1]}-{c[2]}"
                         f"{'-act' if c[5] else ''}")
def test_in_place_changes_reach_the_next_call(rng: np.random.Generator, case: tuple) -> None:
    """Codes, scales, zero points and act-order indices rewritten in place (a load_state_dict into a layer's
    buffers): the next call reads them, against the float64 reference of the new values."""
    _, activations, kernel, *_ = case
    args = _case(rng, case, 2, "fp32")
    weight = args["qweight"]
    quantized_gemm.gemm(args["x"], weight, kernel=kernel, activations=activations)
    other = _case(rng, case, 2, "fp32")["qweight"]
    for name in ("qweight", "scales", "zeros", "g_idx"):
        mine, theirs = getattr(weight, name), getattr(other, name)
        if mine is not None:
            mine[...] = theirs
    got = quantized_gemm.gemm(args["x"], weight, kernel=kernel, activations=activations)
    expected = quantized_gemm.gemm(args["x"], other, kernel=kernel, activations=activations)
    np.testing.assert_array_equal(got, expected)
    if activations == "float":
        assert_close(got, REFERENCE({"x": args["x"], "qweight": other}), kind="gemm", dtype="fp32",
                     what=f"{case} after an in-place change")


def test_launches_are_bounded_per_weight_and_freed_with_it(rng: np.random.Generator) -> None:
    """Each row count is a signature; at most MAX_LAUNCHES_PER_WEIGHT are kept; none outlives its weight."""
    args = quantized_gemm_inputs(rng, m=1, k=128, n=64, bits=4, group_size=32, symmetric=True, dtype="fp32")
    weight = args["qweight"]
    gc.collect()  # earlier tests' weights freed now, not while this one counts
    before = _launches.launch_count()
    for m in range(1, 2 * _launches.MAX_LAUNCHES_PER_WEIGHT + 2):
        quantized_gemm.gemm(np.asarray(rng.standard_normal((m, 128)), dtype=np.float32), weight, kernel="registers")
    assert _launches.launch_count(weight) == _launches.MAX_LAUNCHES_PER_WEIGHT
    assert _launches.launch_count() == before + _launches.MAX_LAUNCHES_PER_WEIGHT
    del weight, args
    gc.collect()
    assert _launches.launch_count() == before


def test_row_stride_and_scale_dtype_are_part_of_the_signature(rng: np.random.Generator) -> None:
    """Rows of a wider array (a stride other than K) and a converted-scale weight (float64 scales, never kept)."""
    args = quantized_gemm_inputs(rng, m=4, k=128, n=96, bits=4, group_size=32, symmetric=False, dtype="fp32")
    weight, x = args["qweight"], args["x"]
    wide = np.zeros((4, 200), np.float32)
    wide[:, 30:158] = x
    dense = quantized_gemm.gemm(x, weight, kernel="registers")
    np.testing.assert_array_equal(quantized_gemm.gemm(wide[:, 30:158], weight, kernel="registers"), dense)
    assert _launches.launch_count(weight) == 2
    wide64 = replace(weight, scales=np.asarray(weight.scales, dtype=np.float64))
    got = quantized_gemm.gemm(x, wide64, kernel="registers")
    assert _launches.launch_count(wide64) == 0, "a launch over converted scales is built for its call alone"
    assert_close(got, REFERENCE({"x": x, "qweight": wide64}), kind="gemm", dtype="fp32", what="float64 scales")


def test_concurrent_calls_on_one_launch(rng: np.random.Generator) -> None:
    """Threads calling the same weight and signature with different rows each get their own result."""
    args = quantized_gemm_inputs(rng, m=2, k=256, n=128, bits=4, group_size=64, symmetric=False, dtype="fp32")
    weight = args["qweight"]
    inputs = [np.asarray(rng.standard_normal((2, 256)), dtype=np.float32) for _ in range(4)]
    expected = [quantized_gemm.gemm(x, weight, kernel="registers", threads=1) for x in inputs]
    failures: list[str] = []

    def worker(i: int) -> None:
        for _ in range(200):
            got = quantized_gemm.gemm(inputs[i], weight, kernel="registers")
            if not np.array_equal(got, expected[i]):
                failures.append(f"thread {i}")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32),
    lambda: np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1:4],
    lambda: np.arange(6, dtype=np.float32)[::-1],
    lambda: np.zeros(0, dtype=np.int32),
    lambda: np.arange(8, dtype=np.float32).astype(BFLOAT16),
    lambda: np.arange(24, dtype=np.float32).astype(BFLOAT16).reshape(4, 6)[:, 1:4],
    lambda: np.arange(8, dtype=np.float32).astype(BFLOAT16)[2:],
    lambda: np.frombuffer(bytes(16), dtype=np.uint8),
    lambda: np.frombuffer(bytes(16), dtype=np.uint16).view(BFLOAT16),
], ids=["contiguous", "strided", "reversed", "empty", "bfloat16", "bfloat16-strided", "bfloat16-offset", "read-only",
        "bfloat16-read-only"])
def test_pointer_is_the_first_elements_address(make: object) -> None:
    """Every kind of array gives the address numpy reports for its first element."""
    array = make()  # type: ignore[operator]
    assert _native.pointer(array) == array.__array_interface__["data"][0]
    assert _native.pointer(None) is None


def test_a_weight_freed_while_launches_are_kept_does_not_block(rng: np.random.Generator,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight freed by the cyclic collector while a thread holds the launches' lock (as inside kept(), when an
    allocation there runs the collector): its callback, in that thread, drops its entry instead of waiting on the
    lock its own thread holds."""
    args = quantized_gemm_inputs(rng, m=1, k=64, n=32, bits=4, group_size=32, symmetric=True, dtype="fp32")
    cyclic = replace(args["qweight"])
    holder: list[object] = [cyclic]
    holder.append(holder)  # a cycle: only the collector frees it
    quantized_gemm.gemm(args["x"], cyclic, kernel="registers")
    key = id(cyclic)
    assert _launches.launch_count(cyclic) == 1
    del cyclic, holder
    done = threading.Event()

    def collect() -> None:
        with _launches._KEPT.lock:
            gc.collect()
            done.set()

    worker = threading.Thread(target=collect, daemon=True)
    worker.start()
    worker.join(20)
    if not done.is_set():  # the worker is stuck holding the lock: give the module a new one for the later tests
        monkeypatch.setattr(_launches._KEPT, "lock", threading.RLock())
    assert done.is_set(), "the freed weight's callback waited on the lock its own thread held"
    entry = _launches._KEPT.entries.get(key)
    assert entry is None or entry[0]() is not None, "the freed weight's launches are dropped"
