"""attn_implementation="hal": Hugging Face models generate through hal's write_kv_cache and paged_attention."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

import transformers_helpers as th  # noqa: E402

import hal_core  # noqa: E402
import hal_core.torch.transformers as hal_hf  # noqa: E402
from hal_core.testing.tolerances import tolerance  # noqa: E402

VOCAB, NEW_TOKENS = 128, 8
PROMPT_LENS = (9, 5, 2)  # one batch, left-padded to the longest


WINDOW = 4  #: shorter than the prompts plus the new tokens, so it cuts keys off
SOFTCAP = 2.0  #: small enough to bend the random model's scores


def _model(family: str, seed: int, **features: object) -> torch.nn.Module:
    """A small random model (GQA, three layers), built from a config: nothing is downloaded.

    ``mistral`` and ``qwen2-window`` have a sliding window on every layer, ``gemma2`` on alternate layers
    plus a logit softcap, ``gpt-oss`` attention sinks (and a window on alternate layers). ``features``
    override config fields (e.g. a window longer than any context, to check a feature matters).
    """
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2,
                  attn_implementation="eager")
    torch.manual_seed(seed)
    if family == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=2, **common)
    elif family == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=1, **common)
    elif family == "qwen2-window":
        config = transformers.Qwen2Config(num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=0, **common)
    elif family == "mistral":
        config = transformers.MistralConfig(num_key_value_heads=2, sliding_window=WINDOW, **common)
    elif family == "gemma2":
        config = transformers.Gemma2Config(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                                           sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP,
                                           final_logit_softcapping=None, **common)
    elif family == "gpt-oss":
        config = transformers.GptOssConfig(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                           num_local_experts=4, num_experts_per_tok=2, **common)
    else:
        raise AssertionError(family)
    for name, value in features.items():
        setattr(config, name, value)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sinks start at zero: give them values that change the softmax
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.copy_(torch.randn(param.shape) * 2)
    return model


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


FAMILIES = ["llama", "qwen2", "qwen2-window", "mistral", "gemma2", "gpt-oss"]
#: The config field each family's feature lives in, and a value that switches it off (a window longer than any
#: context): the feature must change the result.
FEATURES = {"qwen2-window": {"sliding_window": 256}, "mistral": {"sliding_window": 256},
            "gemma2": {"attn_logit_softcapping": None}, "gpt-oss": {"sliding_window": 256}}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_eager(family: str) -> None:
    """Greedy tokens through hal equal eager attention's, for prompts of different lengths longer than the
    window, with one hal attention call per layer and step (prefill included)."""
    seed = 5 + FAMILIES.index(family)
    print(f"seed={seed}")
    model = _model(family, seed)
    ids, mask = _prompts(seed)
    expected = _generate(model, ids, mask)
    if family in FEATURES:  # the feature is exercised: without it the eager logits differ
        plain = _generate(_model(family, seed, **FEATURES[family]), ids, mask)
        assert not torch.allclose(plain.logits[0], expected.logits[0], atol=1e-3), "the feature changes nothing"

    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=16, block_size=8, dtype=torch.float32)
    for layer in range(model.config.num_hidden_layers):  # the tensors the ops write are hal's cache memory
        assert cache.key_caches[layer].data_ptr() == cache.paged.key_caches[layer].ctypes.data
        assert cache.value_caches[layer].data_ptr() == cache.paged.value_caches[layer].ctypes.data
    before = hal_core.stats().get("cpu", {}).get("paged_attention", {}).get("calls", 0)
    got = _generate(model, ids, mask, past_key_values=cache)
    calls = hal_core.stats()["cpu"]["paged_attention"]["calls"] - before
    assert calls == model.config.num_hidden_layers * NEW_TOKENS  # one call per layer and forward

    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    varied = 3 if family == "gemma2" else 4  # random Gemma 2 models repeat one token per row; the logits still vary
    assert len(set(expected.sequences[:, ids.shape[1]:].flatten().tolist())) >= varied  # a non-trivial continuation
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
    """Without a HalPagedCache the "hal" attention runs SDPA with eager's tokens, logged once; HAL_STRICT raises."""
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
    """Right padding, continuous batching, SDPA-less features without a hal cache and 4D masks with one raise."""
    assert hal_hf.ATTN_IMPLEMENTATION in transformers.AttentionInterface().valid_keys()
    model = _model("llama", 10)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = _prompts(10)
    right_padded = mask.flip(1)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8)
    with pytest.raises(ValueError, match="left padding"), torch.no_grad():
        model(ids, attention_mask=right_padded, past_key_values=cache, use_cache=True)
    assert cache.paged.usage().sequences == 0 and cache.paged.usage().used_blocks == 0  # refused before any work
    assert cache.get_seq_length() == 0
    q = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="continuous batching"):
        hal_hf.hal_attention_forward(model, q, q, q, None, cache=object())
    for feature in ({"sliding_window": 4}, {"softcap": 50.0}, {"s_aux": torch.zeros(4)}):  # SDPA has none
        with pytest.raises(ValueError, match="sliding window, logit softcap or attention sinks"):
            hal_hf.hal_attention_forward(model, q, q, q, None, **feature)
    with pytest.raises(ValueError, match="2D padding mask"), torch.no_grad():
        model(ids, attention_mask=torch.ones(3, 1, 9, 9, dtype=torch.bool),
              past_key_values=hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8), use_cache=True)


def test_a_hal_cache_under_another_attention_implementation_is_refused() -> None:
    """A HalPagedCache under eager attention raises instead of attending to the new tokens only."""
    model = _model("llama", 12)  # eager attention would see only the new tokens
    ids, mask = _prompts(12)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=8)
    with pytest.raises(RuntimeError, match="attn_implementation='hal'"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("family", ["qwen2-window", "gemma2", "gpt-oss"])
def test_a_second_turn_with_windows_softcaps_and_sinks_matches_eager(family: str) -> None:
    """A chat's next turn on the same cache (whole conversation, whole mask) past the window: eager's tokens and
    logits, with the model's window, softcap or sinks applied to the continued sequences."""
    seed = 40 + FAMILIES.index(family)
    print(f"seed={seed}")
    model = _model(family, seed)
    ids, mask = _prompts(seed)
    follow = torch.randint(1, VOCAB, (len(PROMPT_LENS), 3), generator=torch.Generator().manual_seed(seed + 1))

    def two_turns(cache: object) -> tuple:
        first = _generate(model, ids, mask, past_key_values=cache)
        turn = torch.cat([first.sequences, follow], dim=1)
        turn_mask = torch.cat([mask, torch.ones(len(PROMPT_LENS), NEW_TOKENS + 3, dtype=mask.dtype)], dim=1)
        return first, _generate(model, turn, turn_mask, past_key_values=cache)

    expected = two_turns(transformers.DynamicCache(config=model.config))
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=24, block_size=8, dtype=torch.float32)
    before = hal_core.stats().get("cpu", {}).get("paged_attention", {}).get("calls", 0)
    got = two_turns(cache)
    calls = hal_core.stats()["cpu"]["paged_attention"]["calls"] - before
    assert calls == model.config.num_hidden_layers * NEW_TOKENS * 2  # the second turn's new tokens are one prefill
    atol, rtol = tolerance("attention", "fp32")
    for turn, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(g.sequences, e.sequences), (turn, g.sequences, e.sequences)
        for step, (gl, el) in enumerate(zip(g.logits, e.logits, strict=True)):
            torch.testing.assert_close(gl, el, atol=atol * el.abs().max().item(), rtol=rtol,
                                       msg=f"turn {turn}, step {step}")
    cache.close()


def test_output_attentions_is_refused_by_name() -> None:
    """output_attentions=True (argument or config), with or without a hal cache, raises instead of returning ();
    the refused cache then serves eager's tokens."""
    model = th.llama(32)
    ids, mask = th.prompts(32)
    expected = th.generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = th.hal_cache(model)
    with pytest.raises(hal_core.ArgumentError, match=r"output_attentions.*attn_implementation='eager'"):
        th.generate(model, ids, mask, cache, output_attentions=True)
    assert cache.get_seq_length() == 0 and cache.paged.usage().used_blocks == 0
    th.assert_same(expected, th.generate(model, ids, mask, cache))
    with pytest.raises(hal_core.ArgumentError, match="output_attentions"), torch.no_grad():
        model(ids, attention_mask=mask, output_attentions=True)
    model.set_attn_implementation("eager")
    model.config.output_attentions = True  # set under eager (transformers refuses it under "hal"), then switched
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    with pytest.raises(hal_core.ArgumentError, match="output_attentions"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=th.hal_cache(model), use_cache=True)


def test_mask_patterns_hal_cannot_run_are_refused() -> None:
    """Non-causal attention, chunked and packed-sequence masks raise instead of running plain causal attention."""
    from transformers import masking_utils

    with pytest.raises(hal_core.ArgumentError, match=r"and_masks\(chunked_overlay, causal_mask_function\)"):
        hal_hf.hal_attention_mask(1, 4, 4, mask_function=masking_utils.chunked_causal_mask_function(
            2, torch.zeros(1, dtype=torch.long)))
    with pytest.raises(hal_core.ArgumentError, match=r"or_masks\(causal_mask_function, bidirectional_mask_function"):
        hal_hf.hal_attention_mask(1, 4, 4, mask_function=masking_utils.or_masks(
            masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function))
    for accepted in (masking_utils.causal_mask_function, masking_utils.sliding_window_causal_mask_function(4)):
        assert hal_hf.hal_attention_mask(1, 4, 4, mask_function=accepted) is None
    model = th.llama(34, is_causal=False)  # a decoder run bidirectionally (embedding models)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = th.prompts(34)
    with pytest.raises(hal_core.ArgumentError, match="pattern"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=th.hal_cache(model), use_cache=True)
    model = th.llama(35)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])  # two sequences packed in one row, no cache
    with pytest.raises(hal_core.ArgumentError, match="pattern"), torch.no_grad():
        model(torch.ones(1, 7, dtype=torch.long), position_ids=packed, use_cache=False)
    torch.manual_seed(36)  # Llama 4's chunked attention (a chunk of 4 tokens) through generate
    config = transformers.Llama4TextConfig(vocab_size=th.VOCAB, hidden_size=64, intermediate_size=128,
                                           intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, attention_chunk_size=4,
                                           num_local_experts=2, max_position_embeddings=256)
    chunked = transformers.AutoModelForCausalLM.from_config(config).eval()
    chunked.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = th.hal_cache(chunked)
    with pytest.raises(hal_core.ArgumentError, match="chunked_overlay"):
        th.generate(chunked, ids, mask, cache)
    assert cache.get_seq_length() == 0 and cache.paged.usage().used_blocks == 0


def test_attention_options_hal_would_ignore_are_refused() -> None:
    """is_causal=False, a position bias and dropout in training raise in the attention function itself."""
    model = th.llama(44)
    layer = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 16)
    kv = torch.zeros(1, 2, 3, 16)
    with pytest.raises(hal_core.ArgumentError, match="is_causal=False"):
        hal_hf.hal_attention_forward(layer, q, kv, kv, None, is_causal=False)
    with pytest.raises(hal_core.ArgumentError, match="position_bias"):
        hal_hf.hal_attention_forward(layer, q, kv, kv, None, position_bias=torch.zeros(1, 4, 3, 3))
    model.train()
    with pytest.raises(hal_core.ArgumentError, match="dropout"):
        hal_hf.hal_attention_forward(layer, q, kv, kv, None, dropout=0.1)


def test_a_custom_4d_mask_without_a_hal_cache_matches_eager_and_sdpa() -> None:
    """A custom 4D mask (float: additive, like eager; boolean: like sdpa) through the SDPA fallback is honoured."""
    seed = 33
    print(f"seed={seed}")
    model = th.llama(seed)
    ids = torch.randint(1, th.VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))
    allowed = torch.ones(7, 7).tril().bool()
    allowed[4:, 1:3] = False  # a pattern no 2D mask gives: late queries skip two early keys
    allowed = allowed[None, None].expand(2, 1, 7, 7)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        eager = model(ids, attention_mask=additive).logits
        causal = model(ids).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(ids, attention_mask=allowed).logits
        model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
        got_float = model(ids, attention_mask=additive).logits
        got_bool = model(ids, attention_mask=allowed).logits
    assert not torch.allclose(eager[:, 4:], causal[:, 4:], atol=1e-3)  # the mask matters
    torch.testing.assert_close(got_float, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_bool, sdpa, atol=1e-4, rtol=1e-4)
    with pytest.raises(hal_core.ArgumentError, match="4D mask must have shape"), torch.no_grad():
        model(ids, attention_mask=additive[:, :, :5])


@pytest.mark.parametrize("family", ["gemma2", "gpt-oss"])
def test_each_layer_passes_one_options_value_built_from_its_config(family: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call of a layer hands hal's kernel the same AttentionOptions object, holding the layer's scale,
    window, softcap and sinks as the config and weights give them."""
    from hal_cpu.ops import _knobs

    seen: list[hal_core.AttentionOptions] = []
    real = _knobs.partition_tokens

    def spy(call: hal_core.ops.OpCall) -> int:  # read by every call, planned or not: the options it runs with
        seen.append(call.options)
        return real(call)

    monkeypatch.setattr(_knobs, "partition_tokens", spy)
    seed = 60 + FAMILIES.index(family)
    print(f"seed={seed}")
    model = _model(family, seed)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = _prompts(seed)
    cache = hal_hf.HalPagedCache(model.config, num_blocks=24, block_size=8, dtype=torch.float32)
    _generate(model, ids, mask, past_key_values=cache)
    cache.close()
    config, layers = model.config, model.config.num_hidden_layers
    assert len(seen) == layers * NEW_TOKENS
    for index in range(layers):
        calls = seen[index::layers]
        assert all(options is calls[0] for options in calls), f"layer {index}: a new options value per call"
        options, attention = calls[0], model.model.layers[index].self_attn
        assert options.scale == pytest.approx(attention.scaling)
        sliding = config.layer_types[index] == "sliding_attention"
        assert options.window == (config.sliding_window if sliding else None)
        assert options.softcap == getattr(config, "attn_logit_softcapping", None)
        if family == "gpt-oss":
            np.testing.assert_array_equal(options.sinks, attention.sinks.detach().float().numpy())
        else:
            assert options.sinks is None
    assert len({id(seen[index]) for index in range(layers)}) == layers
