"""attn_implementation="hal": Hugging Face models generate through hal's write_kv_cache and paged_attention."""

from __future__ import annotations

import logging

import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

import hal_core  # noqa: E402
import hal_core.torch.transformers as hal_hf  # noqa: E402
from hal_core.testing.tolerances import tolerance  # noqa: E402

VOCAB, NEW_TOKENS = 128, 8
PROMPT_LENS = (9, 5, 2)  # one batch, left-padded to the longest


def _model(family: str, seed: int) -> torch.nn.Module:
    """A small random model (GQA, three layers), built from a config: nothing is downloaded."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2,
                  attn_implementation="eager")
    torch.manual_seed(seed)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **common)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=1, **common)).eval()


def _prompts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENS)
    ids = torch.randint(0, VOCAB, (len(PROMPT_LENS), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPT_LENS):
        mask[row, width - n:] = 1
    return ids, mask


def _generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_generation_matches_eager(family: str) -> None:
    seed = 5 if family == "llama" else 6
    print(f"seed={seed}")
    model = _model(family, seed)
    ids, mask = _prompts(seed)
    expected = _generate(model, ids, mask)

    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=16, block_size=8, dtype=torch.float32)
    for layer in range(model.config.num_hidden_layers):  # the tensors the ops write are hal's cache memory
        assert cache.key_caches[layer].data_ptr() == cache.paged.key_caches[layer].ctypes.data
        assert cache.value_caches[layer].data_ptr() == cache.paged.value_caches[layer].ctypes.data
    got = _generate(model, ids, mask, past_key_values=cache)

    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    assert len(set(expected.sequences[:, ids.shape[1]:].flatten().tolist())) > 3  # a varied continuation
    atol, rtol = tolerance("attention", "fp32")
    for step, (g, e) in enumerate(zip(got.logits, expected.logits, strict=True)):
        torch.testing.assert_close(g, e, atol=atol * e.abs().max().item(), rtol=rtol, msg=f"logits of step {step}")
    # every real token went through hal's cache, pads never did: prompts, then one token per step but the last
    assert cache.paged.usage().tokens == sum(PROMPT_LENS) + len(PROMPT_LENS) * (NEW_TOKENS - 1)
    assert cache.paged.usage().sequences == len(PROMPT_LENS)
    cache.close()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_prefill_logits_within_tolerance(dtype: str) -> None:
    """Half-precision logits through hal are as close to the float32 model's as eager attention's are.

    Both half-precision runs round differently (eager rounds its scores and probabilities to the dtype,
    hal accumulates in fp32), so each is held against the float32 model, not against the other.
    """
    seed = 8
    print(f"seed={seed}")
    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    model = _model("llama", seed)
    ids, mask = _prompts(seed)
    real = mask.bool()
    with torch.no_grad():
        truth = model(ids, attention_mask=mask).logits.double()[real]
        model = model.to(tdtype)
        eager = model(ids, attention_mask=mask).logits.double()[real]
        model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
        cache = hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8, dtype=tdtype)
        got = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits.double()[real]
    atol, _ = tolerance("attention", dtype)
    scale = truth.abs().max().item()
    hal_error, eager_error = (got - truth).abs().max().item(), (eager - truth).abs().max().item()
    print(f"max |logit error| vs float32: hal {hal_error:.4g}, eager {eager_error:.4g} (scale {scale:.3g})")
    assert hal_error <= max(1.5 * eager_error, atol * scale)
    assert not torch.equal(got, torch.zeros_like(got))


def test_without_a_hal_cache_attention_runs_in_torch(caplog: pytest.LogCaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama", 9)
    ids, mask = _prompts(9)
    expected = _generate(model, ids, mask)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    hal_hf._warned.clear()
    with caplog.at_level(logging.WARNING, logger="hal"):
        got = _generate(model, ids, mask)  # transformers makes a DynamicCache
    assert torch.equal(got.sequences, expected.sequences)
    assert any("no HalPagedCache" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(hal_core.FallbackError, match="HalPagedCache"):
        _generate(model, ids, mask)


def test_unsupported_uses_are_refused_by_name() -> None:
    assert hal_hf.ATTN_IMPLEMENTATION in transformers.AttentionInterface().valid_keys()
    model = _model("llama", 10)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = _prompts(10)
    right_padded = mask.flip(1)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8)
    with pytest.raises(ValueError, match="left padding"), torch.no_grad():
        model(ids, attention_mask=right_padded, past_key_values=cache, use_cache=True)
    assert cache.paged.usage().sequences == 0 and cache.paged.usage().used_blocks == 0  # refused before any work
    q = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="continuous batching"):
        hal_hf.hal_attention_forward(model, q, q, q, None, cache=object())
    with pytest.raises(ValueError, match="sliding window"):
        hal_hf.hal_attention_forward(model, q, q, q, None, sliding_window=4)
    with pytest.raises(ValueError, match="softcap"):
        hal_hf.hal_attention_forward(model, q, q, q, None, softcap=50.0)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="2D padding mask"), torch.no_grad():
        model(ids, attention_mask=torch.ones(3, 1, 9, 9, dtype=torch.bool),
              past_key_values=hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8), use_cache=True)


def test_a_hal_cache_under_another_attention_implementation_is_refused() -> None:
    model = _model("llama", 12)  # eager attention would see only the new tokens
    ids, mask = _prompts(12)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8)
    with pytest.raises(RuntimeError, match="attn_implementation='hal'"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
