"""Tensor parallelism on CPU: ``tensor_parallel_size=2`` with hal in both ranks, the tokens of one process.

vLLM's multi-process executor starts one worker per rank; vLLM's plugin
mechanism calls hal-vllm's ``register()`` in each, so each rank's attention
layers (half the query heads, one of the two KV heads of the grouped-query
Llama here) run on hal, on that rank's own KV cache. Each rank is bound to
one core (``VLLM_CPU_OMP_THREADS_BIND``, one core list per rank, which vLLM
turns into each worker's OpenMP places) and hal-cpu runs one thread
(``HAL_CPU_THREADS=1``). hal's counters are read from every rank
(``collective_rpc`` answers once per worker). The reference is the same
model in one process (``tensor_parallel_size=1``), also on hal: the ranks'
partial projections are summed by vLLM's all-reduce in another order, so
fp32 rounding may differ in the last bits, never the greedy tokens.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from vllm_engines import BLOCK_SIZE, HEAD_SIZE, generate, prompt_logprobs, save_llama, tokens


def _one_core_per_rank() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for two ranks: the first and the last core this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}|{cores[-1]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, declared: Any) -> dict[str, Any]:
    """The Llama served on hal in one process and with two tensor-parallel ranks (one engine each)."""
    model = save_llama(tmp_path_factory.mktemp("llama-tp"))
    path = model.path
    strict = declared("fp32", HEAD_SIZE, BLOCK_SIZE, {"prefill", "strided_cache"})
    env = {"HAL_VLLM": "1", "HAL_STRICT": "1" if strict else "0", "HAL_CPU_THREADS": "1"}
    one, one_reports = generate(path, env=env)
    two, two_reports = generate(path, env={**env, "VLLM_CPU_OMP_THREADS_BIND": _one_core_per_rank()},
                                tensor_parallel_size=2, distributed_executor_backend="mp")
    return {"model": model, "strict": strict, "one": (one, one_reports), "two": (two, two_reports)}


def test_two_ranks_give_the_tokens_of_one_process(runs: dict[str, Any]) -> None:
    """TP=2 on hal generates what one process on hal generates; the prompts' log-probabilities agree to 1e-4."""
    (one, _), (two, _) = runs["one"], runs["two"]
    print("one process:", tokens(one))
    print("two ranks:  ", tokens(two))
    assert tokens(two) == tokens(one)
    difference = np.abs(prompt_logprobs(two) - prompt_logprobs(one))
    print("prompt log-probability differences: max", difference.max())
    assert difference.max() < 1e-4


def test_every_rank_runs_every_attention_call_on_hal(runs: dict[str, Any]) -> None:
    """Both ranks' layers are hal's, on half the heads each; both ranks ran the same calls (every layer of every
    step; vLLM's scheduler may cut the steps differently from the single process's, so their number is not
    compared with it), on their own cores, none falling back where hal-cpu declares the calls."""
    (_, (single,)), (_, reports) = runs["one"], runs["two"]
    model = runs["model"]
    assert list(single["attention"].values()) == [{"impl": "HalAttentionImpl", "window": None, "heads": model.heads,
                                                   "kv_heads": model.kv_heads}] * model.num_layers
    print("one process:", single["stats"]["cpu"])
    assert single["stats"]["cpu"]["paged_attention"]["calls"] > 0
    assert sorted(report["rank"] for report in reports) == [0, 1]
    assert len({report["pid"] for report in reports} | {single["pid"]}) == 3
    for report in reports:
        ops = report["stats"]["cpu"]
        print(f"rank {report['rank']} (pid {report['pid']}, cpus {report['cpus']}):", ops)
        half = {"impl": "HalAttentionImpl", "window": None, "heads": model.heads // 2, "kv_heads": model.kv_heads // 2}
        assert list(report["attention"].values()) == [half] * model.num_layers  # this rank's share of the heads
        attention, writes = ops["paged_attention"], ops["write_kv_cache"]
        assert attention["calls"] == writes["calls"] > 0 and attention["calls"] % model.num_layers == 0
        assert writes["implementations"] == {"cpu.write_kv_cache": writes["calls"]} and not writes["fallbacks"]
        if runs["strict"]:
            assert attention["implementations"] == {"cpu.paged_attention": attention["calls"]}
            assert not attention["fallbacks"]
    assert len({report["stats"]["cpu"]["paged_attention"]["calls"] for report in reports}) == 1  # the same steps
    cores = sorted(os.sched_getaffinity(0))
    assert [report["cpus"] for report in sorted(reports, key=lambda r: r["rank"])] == [[cores[0]], [cores[-1]]]
