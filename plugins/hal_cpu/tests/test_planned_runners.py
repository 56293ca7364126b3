"""The CPU implementations' runners (OpImpl.plan): a bound op called as an engine's decoder step calls it (weights
and caches bound; activations, lengths and tables new each call, often views of a fused projection) gives the
wrapper's bits on every call (the op's Python wrapper run on the front door's validated call), through the runner
(the wrapper is not run again), and falls back to the wrapper where the plan no longer holds (another thread
count). The front door's own calls with numpy arrays take the same bound path (tests/test_core_bound_plans.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import hal_cpu
import numpy as np
import pytest
from hal_cpu.ops import gated_activation, paged_attention, quantized_gemm, rms_norm, rotary_embedding, write_kv_cache
from hal_cpu.ops import sample as sample_op

import hal_core
from hal_core.arrays import BFLOAT16, numpy_dtype
from hal_core.quant import quantize
from hal_core.testing.inputs import paged_attention_inputs, write_kv_cache_inputs


@pytest.fixture
def cpu() -> hal_core.Backend:
    return hal_core.get_backend("cpu")


@pytest.fixture
def wrapper_calls(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], list[int]]:
    """``wrapper_calls(module, name)``: counts the calls of a wrapper function the unplanned path runs."""
    def count(module: Any, name: str) -> list[int]:
        calls: list[int] = []
        original = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        return calls
    return count


def _door(cpu: hal_core.Backend, op: str, **args: Any) -> Any:
    """The op's wrapper on the front door's validated call (hal-cpu's registered ``fn``, never a runner): the bits
    every runner must give."""
    impl = next(i for i in cpu.ops.registry.implementations(op) if i.name == f"cpu.{op}")
    return impl.fn(cpu.ops.prepare(op, **args))


def _same(got: Any, want: Any) -> None:
    if want is None:
        assert got is None
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def _rows(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, wider: int = 0) -> np.ndarray:
    """Random values in ``dtype``, as a view of rows ``wider`` elements longer than ``shape``'s last (strided)."""
    full = rng.standard_normal((*shape[:-1], shape[-1] + wider)).astype(numpy_dtype(dtype))
    return full[..., :shape[-1]]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-add"])
def test_rms_norm(cpu: hal_core.Backend, hal_rng: np.random.Generator, hal_seed: int, dtype: str, residual: bool,
                  wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    print(f"seed={hal_seed}")
    hidden = 520
    weight = hal_rng.standard_normal(hidden).astype(numpy_dtype(dtype))
    bound = cpu.ops.bind("rms_norm", weight=weight, epsilon=1e-5)
    calls = wrapper_calls(rms_norm, "norm")
    for _ in range(4):
        x = _rows(hal_rng, (3, hidden), dtype, wider=8)
        res = _rows(hal_rng, (3, hidden), dtype, wider=8) if residual else None
        door_res = None if res is None else res.copy()
        want = _door(cpu, "rms_norm", x=x, weight=weight, epsilon=1e-5, residual=door_res)
        got = bound(x=x, residual=res) if residual else bound(x=x)
        _same(got, want)
        if residual:
            _same(res, door_res)
    weight[:] = weight * 2  # a bound array's new values are read
    x = _rows(hal_rng, (3, hidden), dtype, wider=8)
    _same(bound(x=x), _door(cpu, "rms_norm", x=x, weight=weight, epsilon=1e-5))
    assert len(calls) == 5 + (2 if residual else 1)  # the door's, each signature's first (the last has no residual)


def test_gated_activation_on_a_fused_projections_halves(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                        wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    bound = cpu.ops.bind("gated_activation", activation="silu")
    calls = wrapper_calls(gated_activation, "gated")
    for _ in range(4):
        gate_up = hal_rng.uniform(-6, 6, (2, 2 * 300)).astype(BFLOAT16)
        gate, up = gate_up[:, :300], gate_up[:, 300:]
        _same(bound(gate=gate, up=up), _door(cpu, "gated_activation", gate=gate, up=up, activation="silu"))
    assert len(calls) == 4 + 1


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotary_embedding_on_views_of_a_qkv_row(cpu: hal_core.Backend, hal_rng: np.random.Generator, style: str,
                                                wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    from hal_core.rope import rope_cos_sin_cache

    heads, kv_heads, head_size = 4, 2, 64
    table = rope_cos_sin_cache(head_size, 512)
    bound = cpu.ops.bind("rotary_embedding", cos_sin_cache=table, style=style)
    calls = wrapper_calls(rotary_embedding, "rotate")
    for step in range(4):
        qkv = hal_rng.uniform(-1, 1, (2, (heads + 2 * kv_heads) * head_size)).astype(np.float32)
        door = qkv.copy()
        positions = np.array([step * 100, step * 100 + 7], np.int64)

        def views(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return (rows[:, :heads * head_size].reshape(2, heads, head_size),
                    rows[:, heads * head_size:(heads + kv_heads) * head_size].reshape(2, kv_heads, head_size))

        q, k = views(door)
        _door(cpu, "rotary_embedding", positions=positions, query=q, key=k, cos_sin_cache=table, style=style)
        q, k = views(qkv)
        assert bound(positions=positions, query=q, key=k) is None
        _same(qkv, door)
    assert len(calls) == 4 + 1


def test_write_kv_cache_with_new_slots_each_step(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                 wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    args = write_kv_cache_inputs(hal_rng, num_tokens=3, num_blocks=8, num_kv_heads=2, block_size=16, head_size=64,
                                 dtype="bf16")
    key_cache, value_cache = args["key_cache"], args["value_cache"]
    door_k, door_v = key_cache.copy(), value_cache.copy()
    bound = cpu.ops.bind("write_kv_cache", key_cache=key_cache, value_cache=value_cache)
    calls = wrapper_calls(write_kv_cache, "scatter")
    for step in range(4):
        kv = hal_rng.standard_normal((3, 2, 2, 64)).astype(BFLOAT16)  # [tokens, k|v, heads, head_size]
        slots = np.array([step, 40 + step, -1], np.int64)
        _door(cpu, "write_kv_cache", key=kv[:, 0], value=kv[:, 1], key_cache=door_k, value_cache=door_v,
                               slot_mapping=slots)
        assert bound(key=kv[:, 0], value=kv[:, 1], slot_mapping=slots) is None
        _same(key_cache, door_k)
        _same(value_cache, door_v)
    assert len(calls) == 4 + 1


@pytest.mark.parametrize("window", [None, 48])
def test_paged_attention_as_a_decode_loop(cpu: hal_core.Backend, hal_rng: np.random.Generator, hal_seed: int,
                                          window: int | None,
                                          wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    """Decode steps whose contexts grow past the split-KV partition's threshold (the threads and partitions the
    lengths decide change between calls of one signature), with and without the hints, then a prompt chunk:
    the front door's bits each time."""
    print(f"seed={hal_seed}")
    args = paged_attention_inputs(hal_rng, seq_lens=[2200], num_heads=4, num_kv_heads=2, head_size=64,
                                  block_size=16, dtype="bf16")
    caches = {"key_cache": args["key_cache"], "value_cache": args["value_cache"]}
    options = {"scale": 0.125, **({} if window is None else {"window": window})}
    bound = cpu.ops.bind("paged_attention", **caches, **options)
    calls = wrapper_calls(paged_attention, "attend")
    table = args["block_tables"]
    for length in (5, 17, 300, 2200, 40):
        for hints in ({}, {"max_query_len": 1, "max_seq_len": 2200}):
            query = hal_rng.standard_normal((1, 4, 64)).astype(BFLOAT16)
            call = {"query": query, "block_tables": table, "seq_lens": np.array([length], np.int32),
                    "query_start_loc": np.array([0, 1], np.int32), **hints}
            want = _door(cpu, "paged_attention", **call, **caches, **options)
            _same(bound(**call), want)
    prompt = hal_rng.standard_normal((6, 4, 64)).astype(BFLOAT16)
    call = {"query": prompt, "block_tables": table, "seq_lens": np.array([70], np.int32),
            "query_start_loc": np.array([0, 6], np.int32), "max_query_len": 6}
    _same(bound(**call), _door(cpu, "paged_attention", **call, **caches, **options))
    assert len(calls) == 11 + 3  # the door's; the first of each signature: decode with hints, without, the prompt


@pytest.mark.parametrize("case", ["w4a16-fp32", "w4a16-bf16", "w4a8-bf16", "w8a8-fp32"])
def test_quantized_gemm_with_a_bound_weight(cpu: hal_core.Backend, hal_rng: np.random.Generator, hal_seed: int,
                                            case: str, wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    """Decode rows through a bound weight: the front door's bits; NaN rows as the door gives them; a change to the
    weight's scales in place reaches the next call."""
    print(f"seed={hal_seed}")
    fmt, dtype = case.split("-")
    w = quantize(hal_rng.standard_normal((256, 96)).astype(np.float32), bits=8 if fmt == "w8a8" else 4,
                 group_size=64)
    options = {"activations": "int8"} if fmt == "w4a8" else {}
    bound = cpu.ops.bind("quantized_gemm", qweight=w, **options)
    calls = wrapper_calls(quantized_gemm, "gemm")
    for step in range(4):
        x = _rows(hal_rng, (1, 256), dtype)
        if step == 2:
            x[0, 5] = np.nan
        _same(bound(x=x), _door(cpu, "quantized_gemm", x=x, qweight=w, **options))
    np.asarray(w.scales)[...] *= 2
    x = _rows(hal_rng, (1, 256), dtype)
    _same(bound(x=x), _door(cpu, "quantized_gemm", x=x, qweight=w, **options))
    assert len(calls) == 5 + 1


@pytest.mark.parametrize("filters", [False, True], ids=["temperature", "top-k-p-min-p"])
def test_sample_with_new_logits_and_seeds_each_step(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                    hal_seed: int, filters: bool,
                                                    wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    """``sample`` as a decode loop calls it (fresh logits and seeds, greedy and sampled rows): the wrapper's tokens
    through the runner; rows of strided logits and a row of NaN (-1) included."""
    print(f"seed={hal_seed}")
    bound = cpu.ops.bind("sample")
    calls = wrapper_calls(sample_op, "draw_tokens")
    per_row = {"temperature": np.array([0.0, 0.7, 1.3], np.float32)}
    if filters:
        per_row |= {"top_k": np.array([0, 5, 40], np.int32), "top_p": np.array([1.0, 0.9, 0.5], np.float32),
                    "min_p": np.array([0.0, 0.05, 0.1], np.float32)}
    for step in range(4):
        logits = _rows(hal_rng, (3, 1000), "bf16", wider=24)
        if step == 2:
            logits[1, 7] = np.nan
        seeds = hal_rng.integers(0, 2**62, 3, dtype=np.int64)
        got = bound(logits=logits, seeds=seeds, **per_row)
        _same(got, _door(cpu, "sample", logits=logits, seeds=seeds, **per_row))
        if step == 2:
            assert got[1] == -1
    assert len(calls) == 4 + 1  # the door's, and the signature's first


def test_another_thread_count_runs_the_wrapper(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                               wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    """A plan holds for the thread count it was made with: after set_threads the wrapper serves the same
    signature (same bits: the kernels' results do not depend on threads), and the plan again after it is undone."""
    w = quantize(hal_rng.standard_normal((2048, 64)).astype(np.float32), bits=4, group_size=128)
    weight = hal_rng.standard_normal(4096).astype(np.float32)
    gemm, norm = cpu.ops.bind("quantized_gemm", qweight=w), cpu.ops.bind("rms_norm", weight=weight, epsilon=1e-6)
    x, h = _rows(hal_rng, (1, 2048), "fp32"), _rows(hal_rng, (64, 4096), "fp32")
    want_gemm, want_norm = gemm(x=x), norm(x=h)
    gemm_calls, norm_calls = wrapper_calls(quantized_gemm, "gemm"), wrapper_calls(rms_norm, "norm")
    previous = hal_cpu.set_threads(1)
    try:
        _same(gemm(x=x), want_gemm)
        _same(norm(x=h), want_norm)
        assert len(gemm_calls) == 1 and len(norm_calls) == 1
    finally:
        hal_cpu.set_threads(previous)
    _same(gemm(x=x), want_gemm)
    _same(norm(x=h), want_norm)
    assert len(gemm_calls) == 1 and len(norm_calls) == 1


Case = tuple[str, Any, dict[str, Any], Callable[[], dict[str, Any]]]


def _planned_cases(rng: np.random.Generator) -> dict[str, Case]:
    """``case -> (op, (wrapper module, name), bound arguments, a function making one call's own arrays)``: every
    CPU runner, at sizes where the wrapper's plan is made (W4A8 at a prompt's rows too)."""
    from hal_core.rope import rope_cos_sin_cache

    w4 = quantize(rng.standard_normal((256, 96)).astype(np.float32), bits=4, group_size=64)
    w8 = quantize(rng.standard_normal((256, 96)).astype(np.float32), bits=8, group_size=64)
    attention = paged_attention_inputs(rng, seq_lens=[40], num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                                       dtype="bf16")
    kv = write_kv_cache_inputs(rng, num_tokens=3, num_blocks=8, num_kv_heads=2, block_size=16, head_size=64,
                               dtype="bf16")
    return {
        "w4a16-decode": ("quantized_gemm", (quantized_gemm, "gemm"), {"qweight": w4},
                         lambda: {"x": _rows(rng, (1, 256), "bf16")}),
        "w4a8-prompt": ("quantized_gemm", (quantized_gemm, "gemm"), {"qweight": w4, "activations": "int8"},
                        lambda: {"x": _rows(rng, (64, 256), "bf16")}),
        "w8a8-prompt": ("quantized_gemm", (quantized_gemm, "gemm"), {"qweight": w8},
                        lambda: {"x": _rows(rng, (64, 256), "fp32")}),
        "rms_norm": ("rms_norm", (rms_norm, "norm"), {"weight": rng.standard_normal(520).astype(np.float32),
                                                      "epsilon": 1e-5},
                     lambda: {"x": _rows(rng, (3, 520), "fp32"), "residual": _rows(rng, (3, 520), "fp32")}),
        "gated_activation": ("gated_activation", (gated_activation, "gated"), {"activation": "silu"},
                             lambda: {"gate": _rows(rng, (2, 300), "bf16"), "up": _rows(rng, (2, 300), "bf16")}),
        "rotary_embedding": ("rotary_embedding", (rotary_embedding, "rotate"),
                             {"cos_sin_cache": rope_cos_sin_cache(64, 512), "style": "neox"},
                             lambda: {"positions": np.array([3, 9], np.int64),
                                      "query": _rows(rng, (2, 4, 64), "fp32"), "key": _rows(rng, (2, 2, 64), "fp32")}),
        "write_kv_cache": ("write_kv_cache", (write_kv_cache, "scatter"),
                           {"key_cache": kv["key_cache"], "value_cache": kv["value_cache"]},
                           lambda: {"key": _rows(rng, (3, 2, 64), "bf16"), "value": _rows(rng, (3, 2, 64), "bf16"),
                                    "slot_mapping": np.array([1, 20, -1], np.int64)}),
        "sample": ("sample", (sample_op, "draw_tokens"), {},
                   lambda: {"logits": _rows(rng, (2, 500), "fp32"), "temperature": np.array([0.0, 0.8], np.float32),
                            "seeds": np.array([5, 6], np.int64)}),
        "paged_attention": ("paged_attention", (paged_attention, "attend"),
                            {"key_cache": attention["key_cache"], "value_cache": attention["value_cache"],
                             "scale": 0.125},
                            lambda: {"query": _rows(rng, (1, 4, 64), "bf16"),
                                     "block_tables": attention["block_tables"].copy(),
                                     "seq_lens": np.array([40], np.int32),
                                     "query_start_loc": np.array([0, 1], np.int32)}),
    }


@pytest.mark.parametrize("case", ["w4a16-decode", "w4a8-prompt", "w8a8-prompt", "rms_norm", "gated_activation",
                                  "rotary_embedding", "write_kv_cache", "sample", "paged_attention"])
def test_a_runner_keeps_none_of_its_first_calls_arrays(cpu: hal_core.Backend, hal_rng: np.random.Generator,
                                                       hal_seed: int, case: str,
                                                       wrapper_calls: Callable[[Any, str], list[int]]) -> None:
    """The call a signature's plan is made from is a caller's like any other: once the caller drops its arrays
    (a prompt's activations: tens of MB a layer), they are freed, while the runner serves the signature. A plan
    that kept its first call would keep one prompt's activations per layer alive as long as the bound op."""
    print(f"seed={hal_seed}")
    op, (module, wrapper), fixed, own = _planned_cases(hal_rng)[case]
    bound = cpu.ops.bind(op, **fixed)
    calls = wrapper_calls(module, wrapper)
    first = own()
    freed = [weakref.ref(a if a.base is None else a.base) for a in first.values() if isinstance(a, np.ndarray)]
    bound(**first)
    del first
    gc.collect()
    assert [ref() is None for ref in freed] == [True] * len(freed)
    later = own()
    want = _door(cpu, op, **fixed, **{k: v.copy() for k, v in later.items()})
    got = bound(**later)
    assert len(calls) == 2  # the first call and the door's: the later call ran the runner
    _same(got, want)
