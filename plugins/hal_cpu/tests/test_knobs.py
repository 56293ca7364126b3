"""hal-cpu's tunables are declared to hal tune, and every candidate a stored choice may pick gives the reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hal_cpu.ops import _knobs, paged_attention

import hal_core
from hal_core.ops import OPS
from hal_core.quant import quantize
from hal_core.testing.inputs import assert_close
from hal_core.tuning import forget, override

SEED = 20261201


@pytest.fixture
def cpu() -> hal_core.Backend:
    return hal_core.get_backend("cpu")


def test_knobs_are_registered(cpu: hal_core.Backend) -> None:
    """paged_attention declares partition_tokens and quantized_gemm declares kernel, as hal info lists them."""
    names = {impl.op: [k.name for k in impl.knobs] for op in ("paged_attention", "quantized_gemm")
             for impl in cpu.ops.registry.implementations(op)}
    assert names == {"paged_attention": ["partition_tokens"], "quantized_gemm": ["kernel"]}


@pytest.mark.parametrize("tokens", _knobs.PARTITION_TOKENS.candidates)
def test_every_partition_size_matches_the_reference(cpu: hal_core.Backend, tokens: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever partition size a stored choice names reaches the kernel, and the result is the reference's."""
    seen: list[int] = []
    original = paged_attention.attend

    def spy(*args: Any, **kwargs: Any) -> np.ndarray:
        seen.append(kwargs["partition_tokens"])
        return original(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "attend", spy)
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    seqs, heads, kv_heads, d, block = 3, 8, 2, 64, 16
    lens = np.array([1, 700, 1500], np.int32)
    blocks = -(-int(lens.max()) // block)
    table = rng.permutation(seqs * blocks).reshape(seqs, blocks).astype(np.int32)
    kc = rng.standard_normal((seqs * blocks, kv_heads, block, d)).astype(np.float16)
    vc = rng.standard_normal(kc.shape).astype(np.float16)
    q = rng.standard_normal((seqs, heads, d)).astype(np.float16)
    args = dict(query=q, key_cache=kc, value_cache=vc, block_tables=table, seq_lens=lens, scale=0.125)
    with override({"partition_tokens": tokens}):
        got = cpu.ops.paged_attention(**args)
    assert seen == [tokens]
    assert_close(got, OPS["paged_attention"].reference(args), kind="attention", dtype="fp16",
                 what=f"partition_tokens={tokens}")


@pytest.mark.parametrize("group", [128, 36])  # 36: groups that split a packed word, which 'registers' cannot serve
@pytest.mark.parametrize("kernel", _knobs.GEMM_KERNEL.candidates)
def test_every_gemm_kernel_matches_the_reference(cpu: hal_core.Backend, kernel: str, group: int) -> None:
    """Every W4A16 kernel gives the reference; a choice the weight cannot use falls back to one it can."""
    rng = np.random.default_rng(SEED + group)
    print(f"seed={SEED + group}")
    k = 4 * group if group % 8 == 0 else 8 * group
    qw = quantize(rng.standard_normal((k, 96)).astype(np.float32), bits=4, group_size=group)
    x = rng.standard_normal((5, k)).astype(np.float32)
    with override({"kernel": kernel}):
        got = cpu.ops.quantized_gemm(x, qw)
    assert_close(got, OPS["quantized_gemm"].reference({"x": x, "qweight": qw}), kind="gemm", dtype="fp32",
                 what=f"kernel={kernel}, group={group}")


def test_the_knob_rule_sizes_partitions_for_the_threads_the_kernel_runs_on(cpu: hal_core.Backend,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode row beside a long prompt, with little K/V: the registered call (the knob's rule) and attend's own
    default reach the kernel with the same threads (2: the prompt's FLOPs) and partition size (256: one 1024-token
    decode row cut into 4 x 2 tasks, at the 256-token minimum), and with the same result, the reference's."""
    import hal_cpu
    from hal_cpu import _abi, _threads

    if _threads.available() < 2:
        pytest.skip("needs two cores: on one, no call is split")
    seen: list[tuple[int, int]] = []

    class Spy(_abi.AttentionArgs):  # type: ignore[misc, valid-type]
        def __init__(self, **fields: Any) -> None:
            seen.append((fields["threads"], fields["partition_tokens"]))
            super().__init__(**fields)

    monkeypatch.setattr(_abi, "AttentionArgs", Spy)
    rng = np.random.default_rng(SEED + 7)
    print(f"seed={SEED + 7}")
    heads, kv_heads, d, block = 4, 1, 16, 16
    lens, starts = np.array([1024, 512], np.int32), np.array([0, 1, 513], np.int32)
    table = rng.permutation(2 * 64).reshape(2, 64).astype(np.int32)
    kc = rng.standard_normal((128, kv_heads, block, d)).astype(np.float32)
    vc = rng.standard_normal(kc.shape).astype(np.float32)
    q = rng.standard_normal((513, heads, d)).astype(np.float32)
    args = dict(query=q, key_cache=kc, value_cache=vc, block_tables=table, seq_lens=lens, scale=0.25,
                query_start_loc=starts, max_query_len=512)
    monkeypatch.setenv("HAL_TUNE", "0")  # no stored winner: the knob's rule
    forget()
    hal_cpu.set_threads(2)
    try:
        impl = next(i for i in cpu.ops.registry.implementations("paged_attention") if i.name == "cpu.paged_attention")
        registered = impl.fn(cpu.ops.prepare("paged_attention", **args))  # the wrapper (a runner fills its own)
        direct = paged_attention.attend(q, kc, vc, table, lens, 0.25, query_start_loc=starts, max_query_len=512)
    finally:
        hal_cpu.set_threads(None)
        forget()
    assert seen == [(2, 256), (2, 256)]
    np.testing.assert_array_equal(registered, direct)
    assert_close(registered, OPS["paged_attention"].reference(args), kind="attention", dtype="fp32",
                 what="a decode row beside a prompt")


@pytest.mark.parametrize("num_seqs", [0, 1, 5, _knobs.SMALL_BATCH, _knobs.SMALL_BATCH + 1, 300])
@pytest.mark.parametrize("varlen", [False, True])
def test_attention_lengths_match_numpy(rng: np.random.Generator, num_seqs: int, varlen: bool) -> None:
    """The lengths the threads and partitions are sized by, as Python ints (small batches) or by numpy (large),
    against the same sums written out in numpy; decode rows counted among mixed prompt and decode sequences."""
    q_lens = rng.choice([1, 1, 2, 7], size=num_seqs) if varlen else np.ones(num_seqs, dtype=np.int64)
    seq_lens = (q_lens + rng.integers(0, 3000, size=num_seqs)).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32) if varlen else None
    got = _knobs.attention_lengths(seq_lens, starts)
    assert got.total == int(seq_lens.astype(np.int64).sum())
    assert got.longest == int(seq_lens.max(initial=0))
    assert got.decode_rows == int((q_lens == 1).sum())
    assert got.pairs == (int((q_lens * seq_lens.astype(np.int64)).sum()) if varlen else 0)
    assert got.longest_query == (int(q_lens.max(initial=0)) if varlen else (1 if num_seqs else 0))
    assert all(type(value) is int for value in vars(got).values())
