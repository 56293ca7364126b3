"""A decode step through torch.ops.hal under torch.compile (no graph break, equal to eager) and CUDA graphs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from torch_helpers import TinyDecoder, cuda_or_skip, tensor, torch

import hal_core
from hal_core.kvcache import CacheConfig, PagedKVCache
from hal_core.testing.tolerances import tolerance

HEADS, KV_HEADS, HEAD_SIZE, HIDDEN, LAYERS, BLOCK = 4, 2, 64, 128, 2, 8


def _steps(device: str, dtype: str, seed: int) -> tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]:
    """A prefill step (two prompts of different lengths, batched) then two decode steps, from a hal PagedKVCache."""
    rng = np.random.default_rng(seed)
    config = CacheConfig(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK,
                         dtype=dtype)
    cache = PagedKVCache(hal_core.get_backend("cpu"), config, num_blocks=12)
    cache.add("a")
    cache.add("b")
    steps = []
    for new_tokens in ({"a": 11, "b": 3}, {"a": 1, "b": 1}, {"a": 1, "b": 1}):
        step = cache.prepare_step(new_tokens, max_blocks=4)  # a fixed table width: one compiled shape per row count
        x = rng.standard_normal((step.num_tokens, HIDDEN)) / 4
        steps.append({name: tensor(getattr(step, name), device)
                      for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")}
                     | {"x": x, "max_query_len": step.max_query_len})
    keys = [tensor(k, device) for k in cache.key_caches]
    values = [tensor(v, device) for v in cache.value_caches]
    return steps, keys, values


def _indices(step: dict) -> tuple:
    return (step["slot_mapping"], step["block_tables"], step["seq_lens"], step["query_start_loc"],
            step["max_query_len"])


def _run(step_fn, steps: list[dict], keys: list, values: list, dtype: torch.dtype, device: str) -> list:
    outs = []
    for s in steps:
        x = torch.as_tensor(s["x"], dtype=dtype, device=device)
        outs.append(step_fn(x, keys, values, *_indices(s)))
    return outs


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_step_compiles_without_graph_breaks_and_matches_eager(dtype: str) -> None:
    seed = 41 + len(dtype)
    print(f"seed={seed}")
    tdtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = TinyDecoder(np.random.default_rng(seed), layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                        kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=tdtype)
    steps, keys, values = _steps("cpu", dtype, seed)
    first = steps[0]
    x0 = torch.as_tensor(first["x"], dtype=tdtype)

    explained = torch._dynamo.explain(model)(x0, copy.deepcopy(keys), copy.deepcopy(values), *_indices(first))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    hal_ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes
               if node.op == "call_function" and "hal." in str(node.target)}
    assert hal_ops == {"hal.quantized_gemm", "hal.write_kv_cache", "hal.paged_attention"}

    eager_keys, eager_values = copy.deepcopy(keys), copy.deepcopy(values)
    eager = _run(model, steps, eager_keys, eager_values, tdtype, "cpu")
    torch._dynamo.reset()
    compiled_model = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled = _run(compiled_model, steps, keys, values, tdtype, "cpu")
    for step, (e, c) in enumerate(zip(eager, compiled, strict=True)):
        assert torch.equal(e, c), f"step {step}: compiled output differs from eager"
    for layer in range(LAYERS):  # the caches the compiled graph wrote in place
        assert torch.equal(eager_keys[layer], keys[layer]) and torch.equal(eager_values[layer], values[layer])
    assert (eager[0] != 0).any()


def test_decode_step_under_inductor_matches_eager() -> None:
    """One run through inductor (C++ codegen for the torch ops around the opaque hal ops)."""
    seed = 77
    print(f"seed={seed}")
    model = TinyDecoder(np.random.default_rng(seed), layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                        kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    steps, keys, values = _steps("cpu", "fp32", seed)
    steps = steps[:2]
    eager_keys, eager_values = copy.deepcopy(keys), copy.deepcopy(values)
    eager = _run(model, steps, eager_keys, eager_values, torch.float32, "cpu")
    torch._dynamo.reset()
    compiled = _run(torch.compile(model, fullgraph=True), steps, keys, values, torch.float32, "cpu")
    atol, rtol = tolerance("gemm", "fp32")
    for e, c in zip(eager, compiled, strict=True):
        torch.testing.assert_close(c, e, atol=atol, rtol=rtol)
    for layer in range(LAYERS):
        torch.testing.assert_close(keys[layer], eager_keys[layer], atol=0, rtol=0)


def test_decode_step_replays_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the index checks at their default: device ops read nothing back, so the step captures."""
    cuda_or_skip()
    monkeypatch.delenv("HAL_CHECK_INDICES", raising=False)
    seed = 91
    print(f"seed={seed}")
    dtype = torch.float16
    model = TinyDecoder(np.random.default_rng(seed), layers=LAYERS, hidden=HIDDEN, heads=HEADS,
                        kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=dtype).cuda()
    steps, keys, values = _steps("cuda", "fp16", seed)
    prefill, decode = steps[0], steps[1]
    _run(model, [prefill], keys, values, dtype, "cuda")  # fill the caches
    eager_keys, eager_values = copy.deepcopy(keys), copy.deepcopy(values)
    x = torch.as_tensor(decode["x"], dtype=dtype, device="cuda")
    expected = model(x, eager_keys, eager_values, *_indices(decode))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles kernels) outside the capture, on caches thrown away
        model(x, copy.deepcopy(keys), copy.deepcopy(values), *_indices(decode))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(x, keys, values, *_indices(decode))
    graph.replay()
    torch.cuda.synchronize()
    hal_core.check_errors()  # the kernels' index checks found nothing
    atol, rtol = tolerance("gemm", "fp16")
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    for layer in range(LAYERS):
        torch.testing.assert_close(keys[layer], eager_keys[layer], atol=0, rtol=0)
