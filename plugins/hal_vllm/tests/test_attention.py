"""One attention layer on hal, as vLLM drives it, against a float64 reference; and the start-up refusals.

The layer gets what vLLM's CPU model runner gives it: a per-layer cache
tensor ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, query, key
and value with padding rows after the real tokens, an int64 slot mapping
with -1 for padding, and metadata of a batch that mixes a prompt, a prompt
chunk and decodes. Unused cache slots hold NaN: any read of one would show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hal_vllm import _startup
from hal_vllm._attention import HalAttentionImpl, HalAttentionMetadata, split_kv_cache
from vllm.v1.attention.backend import AttentionType

import hal_core
from hal_core.ops import OpCoverage

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 32, 12
#: (tokens already in the cache, new tokens this step) per request: decode, prompt, prompt chunk, decode.
REQUESTS = ((40, 1), (0, 7), (33, 12), (5, 1))
PADDING_ROWS = 3


def make_impl(**overrides: object) -> HalAttentionImpl:
    args: dict[str, object] = dict(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=HEAD_SIZE ** -0.5,
                                   num_kv_heads=NUM_KV_HEADS, alibi_slopes=None, sliding_window=None,
                                   kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER)
    args.update(overrides)
    return HalAttentionImpl(**args)  # type: ignore[arg-type]


@dataclass
class Step:
    """A batch's tensors in vLLM's form, and the keys, values and queries in float64 for the reference."""

    meta: HalAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor
    keys: list[np.ndarray]  # per request [seq_len, kv_heads, head_size]
    values: list[np.ndarray]


def make_step(rng: np.random.Generator, dtype: torch.dtype) -> tuple[Step, Step]:
    """The step that fills the earlier context, and the mixed step after it (both through vLLM's slot mapping)."""
    order = rng.permutation(NUM_BLOCKS).tolist()
    tables, full = [], []
    for before, new in REQUESTS:
        blocks = -(-(before + new) // BLOCK_SIZE)
        tables.append([order.pop() for _ in range(blocks)])
        full.append((rng.standard_normal((before + new, NUM_KV_HEADS, HEAD_SIZE)),
                     rng.standard_normal((before + new, NUM_KV_HEADS, HEAD_SIZE))))
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def step(spans: list[tuple[int, int]]) -> Step:
        rows = sum(stop - start for start, stop in spans)
        query = torch.tensor(rng.standard_normal((rows + PADDING_ROWS, NUM_HEADS, HEAD_SIZE)), dtype=dtype)
        # key and value as vLLM slices them from a fused QKV projection: strided views of one buffer
        qkv = torch.tensor(rng.standard_normal((rows + PADDING_ROWS, 3, NUM_KV_HEADS, HEAD_SIZE)), dtype=dtype)
        key, value = qkv[:, 0], qkv[:, 1]
        slots, starts = [], [0]
        for r, (start, stop) in enumerate(spans):
            k, v = full[r]
            key[starts[-1]:starts[-1] + stop - start] = torch.tensor(k[start:stop], dtype=dtype)
            value[starts[-1]:starts[-1] + stop - start] = torch.tensor(v[start:stop], dtype=dtype)
            slots += [tables[r][t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(start, stop)]
            starts.append(starts[-1] + stop - start)
        meta = HalAttentionMetadata(
            num_actual_tokens=rows, max_query_len=max(stop - start for start, stop in spans),
            max_seq_len=max(stop for _, stop in spans), query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor([stop for _, stop in spans], dtype=torch.int32), block_table=block_table)
        slot_mapping = torch.tensor(slots + [-1] * PADDING_ROWS, dtype=torch.int64)
        as64 = [(k[:stop], v[:stop]) for (k, v), (_, stop) in zip(full, spans, strict=True)]
        return Step(meta, query, key, value, slot_mapping, [k for k, _ in as64], [v for _, v in as64])

    context = step([(0, before) for before, _ in REQUESTS])
    mixed = step([(before, before + new) for before, new in REQUESTS])
    return context, mixed


def reference(step: Step, *, scale: float, window: int | None = None, softcap: float | None = None,
              sinks: np.ndarray | None = None, alibi: np.ndarray | None = None) -> np.ndarray:
    """The attention contract in float64, from the keys and values themselves (not from the cache)."""
    starts = step.meta.query_start_loc.tolist()
    query = step.query.double().numpy()
    out = np.zeros((starts[-1], NUM_HEADS, HEAD_SIZE))
    group = NUM_HEADS // NUM_KV_HEADS
    for r, keys in enumerate(step.keys):
        length, q_len = len(keys), starts[r + 1] - starts[r]
        k = np.repeat(keys, group, axis=1)
        v = np.repeat(step.values[r], group, axis=1)
        for i in range(q_len):
            p = length - q_len + i
            t = np.arange(length)
            scores = np.einsum("hd,thd->ht", query[starts[r] + i], k) * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            if alibi is not None:
                scores = scores + alibi[:, None] * (t - p)[None, :]
            visible = (t <= p) & ((t > p - window) if window is not None else True)
            scores = np.where(visible[None, :], scores, -np.inf)
            top = scores.max(axis=1, keepdims=True)
            if sinks is not None:
                top = np.maximum(top, sinks[:, None])
            weights = np.exp(scores - top)
            total = weights.sum(axis=1, keepdims=True)
            if sinks is not None:
                total = total + np.exp(sinks[:, None] - top)
            out[starts[r] + i] = np.einsum("ht,thd->hd", weights / total, v)
    return out


def run_layer(impl: HalAttentionImpl, steps: tuple[Step, Step], dtype: torch.dtype) -> tuple[torch.Tensor, Step]:
    kv_cache = torch.full((NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), float("nan"), dtype=dtype)
    layer = torch.nn.Module()
    for step in steps:
        impl.do_kv_cache_update(layer, step.key, step.value, kv_cache, step.slots)
    step = steps[-1]
    output = torch.full(step.query.shape, 7.0, dtype=dtype)
    returned = impl.forward(layer, step.query, step.key, step.value, kv_cache, step.meta, output)
    assert returned is output
    return output, step


def test_split_kv_cache_views_vllms_halves() -> None:
    """K and V are the halves vLLM's own CPU backend takes, as views of the one cache tensor (no copy)."""
    kv_cache = torch.arange(3 * 2 * 32 * 16, dtype=torch.float32).reshape(3, 2, 32, 16)
    key_cache, value_cache = split_kv_cache(kv_cache)
    vllm_key, vllm_value = kv_cache.view(3, 2, 64, 8).chunk(2, dim=2)
    assert torch.equal(key_cache, vllm_key) and torch.equal(value_cache, vllm_value)
    assert key_cache.data_ptr() == kv_cache.data_ptr()
    assert value_cache.data_ptr() == kv_cache.data_ptr() + 32 * 8 * 4
    assert key_cache.stride() == value_cache.stride() == (2 * 64 * 8, 64 * 8, 8, 1)


FEATURES = {
    "plain": {},
    "window": {"sliding_window": 9},
    "softcap": {"logits_soft_cap": 3.0},
    "sinks": {"sinks": True},
    "alibi": {"alibi_slopes": True},
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_matches_float64_reference(feature: str, dtype: torch.dtype, rng: np.random.Generator) -> None:
    """A mixed batch (decodes, a prompt, a prompt chunk, padding rows) written and attended through hal."""
    options = dict(FEATURES[feature])
    sinks = alibi = None
    if options.pop("sinks", False):
        sinks = rng.standard_normal(NUM_HEADS).astype(np.float32)
        options["sinks"] = torch.tensor(sinks, dtype=dtype)
        sinks = options["sinks"].double().numpy()  # what the layer's weights hold
    if options.pop("alibi_slopes", False):
        alibi = (2.0 ** -np.arange(1, NUM_HEADS + 1)).astype(np.float32)
        options["alibi_slopes"] = alibi.tolist()
    impl = make_impl(**options)
    output, step = run_layer(impl, make_step(rng, dtype), dtype)
    n = step.meta.num_actual_tokens
    expected = reference(step, scale=HEAD_SIZE ** -0.5, window=FEATURES[feature].get("sliding_window"),
                         softcap=FEATURES[feature].get("logits_soft_cap"), sinks=sinks, alibi=alibi)
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 4e-2}[dtype]
    np.testing.assert_allclose(output[:n].double().numpy(), expected, atol=tolerance, rtol=tolerance)
    assert torch.all(output[n:] == 7.0), "padding rows of the output must stay untouched"


def test_layer_runs_on_hal_as_its_backend_declares(rng: np.random.Generator, declared: Any) -> None:
    """Both ops of a step go through hal's front door: the writes on the backend's own kernel, the attention
    there too where the backend declares a mixed batch (``prefill``), else on hal's fallback path."""
    impl = make_impl()
    backend = impl.plan.route.backend.name
    before = hal_core.stats().get(backend, {})
    run_layer(impl, make_step(rng, torch.float32), torch.float32)
    after = hal_core.stats()[backend]
    done = {op: after[op]["calls"] - before.get(op, {}).get("calls", 0) for op in ("write_kv_cache", "paged_attention")}
    assert done == {"write_kv_cache": 2, "paged_attention": 1}
    assert not after["write_kv_cache"]["fallbacks"]
    fallbacks = sum(after["paged_attention"]["fallbacks"].values())
    fallbacks -= sum(before.get("paged_attention", {}).get("fallbacks", {}).values())
    mixed = declared("fp32", HEAD_SIZE, BLOCK_SIZE, {"prefill", "strided_cache"})
    assert fallbacks == (0 if mixed else 1), after["paged_attention"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kv_cache_dtype": "fp8"}, "kv-cache dtype 'fp8'"),
    ({"attn_type": AttentionType.ENCODER_ONLY}, "attention of type 'encoder_only'"),
    ({"use_alibi_sqrt": True}, "asks for use_alibi_sqrt"),
    ({"alibi_slopes": [0.5, 0.25]}, "2 ALiBi slopes for 4 heads"),
    ({"sliding_window": 0}, "sliding window 0"),
], ids=["fp8-cache", "encoder", "unknown-feature", "alibi-count", "window-0"])
def test_refused_at_start_up(overrides: dict[str, object], message: str) -> None:
    """What hal cannot run exactly is a ValueError when the layer is built, naming it and what to do."""
    with pytest.raises(ValueError, match=rf"hal-vllm cannot run this model: .*{message}.*unset HAL_VLLM"):
        make_impl(**overrides)


def test_head_size_the_backend_does_not_declare(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A head size outside the serving backend's declaration: said once at start-up (its calls fall back),
    refused under HAL_STRICT."""
    ops_class = type(hal_core.get_backend().ops)
    monkeypatch.setattr(ops_class, "coverage", lambda self, op: OpCoverage(head_sizes={64, 128}))
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(ValueError, match=r"HAL_STRICT is on.*write_kv_cache calls of this model to hal's fallback "
                                         r"path \(head size 32 is not declared"):
        make_impl()
    make_impl(head_size=64)
    monkeypatch.delenv("HAL_STRICT")
    make_impl()
    assert "does not run every paged_attention call of this model itself (head size 32" in caplog.text


def test_hal_core_without_varlen_attention_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hal-core whose paged_attention lacks an argument vLLM needs is named at start-up."""
    monkeypatch.setattr(_startup, "_VARLEN_ARGUMENTS", (*_startup._VARLEN_ARGUMENTS, "chunk_lookback"))
    with pytest.raises(ValueError, match=r"has no variable-length paged_attention \(no chunk_lookback\)"):
        make_impl()
