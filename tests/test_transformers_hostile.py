"""Every way transformers uses a cache, through attn_implementation="hal": eager's tokens, or a clear error.

Each comparison runs the same small random Llama (fp32) twice: eager attention
with a ``DynamicCache``, and hal with a ``HalPagedCache``; the hal run must be
served by hal's paged attention (counted in ``hal_core.stats()``), so a silent
fallback cannot pass.
"""

from __future__ import annotations

import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

from transformers_helpers import (  # noqa: E402
    NEW_TOKENS,
    PROMPT_LENS,
    VOCAB,
    assert_same,
    both,
    generate,
    hal_cache,
    hal_calls,
    llama,
    prompts,
)

import hal_core  # noqa: E402
import hal_core.torch.transformers as hal_hf  # noqa: E402
from hal_core.testing.tolerances import tolerance  # noqa: E402


def test_a_second_chat_turn_continues_the_cache_like_eager() -> None:
    """The next turn (whole conversation, whole mask) continues the cache: eager's tokens, only new tokens fed."""
    seed = 21
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    follow = torch.randint(1, VOCAB, (len(PROMPT_LENS), 3), generator=torch.Generator().manual_seed(seed + 1))

    def run(cache):
        first = generate(model, ids, mask, cache)
        turn = torch.cat([first.sequences, follow], dim=1)
        turn_mask = torch.cat([mask, torch.ones(len(PROMPT_LENS), NEW_TOKENS + follow.shape[1], dtype=mask.dtype)], 1)
        return first, generate(model, turn, turn_mask, cache)

    (first_e, second_e), (first_g, second_g), cache = both(model, run)
    assert_same(first_e, first_g)
    assert_same(second_e, second_g)
    # every real token of both turns is in the cache; the last generated token of each turn is never fed
    assert cache.paged.usage().tokens == sum(PROMPT_LENS) + len(PROMPT_LENS) * (2 * NEW_TOKENS + 3 - 1)


def test_a_reused_cache_without_padding_continues_like_a_dynamic_cache() -> None:
    """generate() twice on one prompt and one cache: the second call continues the cache exactly as eager's does."""
    seed = 22
    print(f"seed={seed}")
    model = llama(seed)
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(seed))

    def run(cache):
        return generate(model, ids, None, cache), generate(model, ids, None, cache)

    (a_e, b_e), (a_g, b_g), _ = both(model, run)
    assert_same(a_e, a_g)
    assert_same(b_e, b_g)
    assert not torch.equal(b_e.sequences, a_e.sequences)  # the second call really continued the cache


def test_a_reused_cache_with_a_mask_that_does_not_cover_it_is_refused() -> None:
    """The same padded prompt again on a full cache: a clear error (eager would mask its own new keys), cache kept."""
    model = llama(23)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = prompts(23)
    cache = hal_cache(model)
    generate(model, ids, mask, cache)
    usage, length = cache.paged.usage(), cache.get_seq_length()
    with pytest.raises(hal_core.ArgumentError, match=r"has 9 positions, but the cache has seen .* cache\.reset\(\)"):
        generate(model, ids, mask, cache)
    assert cache.paged.usage() == usage and cache.get_seq_length() == length


def test_reset_serves_a_new_prompt_like_a_fresh_cache() -> None:
    """After cache.reset() the same cache generates a new batch exactly as a new cache does, every block back."""
    seed = 24
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    other_ids, other_mask = prompts(seed + 1, (4, 6))
    expected = generate(model, other_ids, other_mask, transformers.DynamicCache(config=model.config))
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = hal_cache(model)
    generate(model, ids, mask, cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.paged.usage().used_blocks == 0
    assert_same(expected, generate(model, other_ids, other_mask, cache))


def test_a_mask_that_disagrees_with_the_cached_padding_is_refused() -> None:
    """A mask whose past columns differ from the padding the cache holds, or none on a padded cache, raises."""
    model = llama(25)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = prompts(25)
    cache = hal_cache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        usage = cache.paged.usage()
        step = torch.ones(3, 1, dtype=ids.dtype)
        with pytest.raises(hal_core.ArgumentError, match="row 1 marks other positions"):
            model(step, attention_mask=torch.cat([torch.ones_like(mask), step], 1), past_key_values=cache)
        with pytest.raises(hal_core.ArgumentError, match="no attention_mask"):
            model(step, past_key_values=cache)
        with pytest.raises(hal_core.ArgumentError, match="batch 1"):
            model(step[:1], attention_mask=torch.cat([mask, step], 1)[:1], past_key_values=cache)
    assert cache.paged.usage() == usage and cache.get_seq_length() == ids.shape[1]


@pytest.mark.parametrize("num_return_sequences", [1, 2])
def test_beam_search_matches_eager(num_return_sequences: int) -> None:
    """Beam search (reorder_cache every step) on left-padded prompts: eager's beams, through forked hal sequences."""
    seed = 26
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    expected, got, cache = both(model, lambda cache: generate(
        model, ids, mask, cache, num_beams=3, num_return_sequences=num_return_sequences, output_logits=False,
        output_scores=True))
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    torch.testing.assert_close(got.sequences_scores, expected.sequences_scores, atol=1e-4, rtol=1e-4)
    assert cache.paged.usage().sequences == len(PROMPT_LENS) * 3
    cache.paged.blocks.check()


def test_sampling_several_sequences_per_prompt_matches_eager() -> None:
    """num_return_sequences=3 with sampling (rows expanded before the prefill): eager's samples for one seed."""
    seed = 27
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)

    def run(cache):
        torch.manual_seed(seed)
        return generate(model, ids, mask, cache, do_sample=True, num_return_sequences=3, top_k=0)

    expected, got, _ = both(model, run)
    assert_same(expected, got)
    assert len({tuple(row) for row in expected.sequences[:, ids.shape[1]:].tolist()}) > 3  # the samples differ


def test_prompt_lookup_decoding_crops_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt-lookup (assisted) decoding drafts several tokens per forward and crops the rejected ones."""
    seed = 28
    print(f"seed={seed}")
    model = llama(seed)
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed)).repeat(1, 3)
    crops: list[int] = []
    real_crop = hal_hf.HalPagedCache.crop
    monkeypatch.setattr(hal_hf.HalPagedCache, "crop", lambda self, n: (crops.append(int(n)), real_crop(self, n))[1])
    expected, got, cache = both(model, lambda cache: generate(model, ids, None, cache, prompt_lookup_num_tokens=3,
                                                                max_new_tokens=12, output_logits=False))
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    assert any(n < 0 for n in crops), f"no draft was rejected: crops {crops}"
    assert cache.paged.usage().tokens == got.sequences.shape[1] - 1


def test_chunked_prefill_matches_eager() -> None:
    """prefill_chunk_size splits left-padded prompts over several forwards (a chunk may be all pads for a row)."""
    seed = 29
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    expected, got, _ = both(model, lambda cache: generate(model, ids, mask, cache, prefill_chunk_size=3))
    assert_same(expected, got)


def _row_ops(model: torch.nn.Module, cache: object, ids: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Prefill, then repeat, select, reorder and crop the rows, decoding a token after each: the logits."""
    out = []
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        steps = [("repeat", 2), ("select", torch.tensor([0, 3, 5, 4])),
                 ("select", torch.tensor([1, 0, 1, 1], dtype=torch.bool)), ("reorder", torch.tensor([2, 0, 0])),
                 ("crop", -2), ("crop", 0)]
        for op, arg in steps:
            if op == "repeat":
                cache.batch_repeat_interleave(arg)
                mask = mask.repeat_interleave(arg, 0)
            elif op == "select":
                cache.batch_select_indices(arg)
                mask = mask[arg]
            elif op == "reorder":
                cache.reorder_cache(arg)
                mask = mask[arg]
            else:
                cache.crop(arg)
                mask = mask[:, :mask.shape[1] + arg] if arg else mask
            token = torch.arange(1, mask.shape[0] + 1)[:, None] * 7 % VOCAB
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out.append(model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits)
    return out


def test_row_operations_and_crop_match_a_dynamic_cache() -> None:
    """batch_repeat_interleave, batch_select_indices (indices and boolean), reorder_cache and crop, then a decode
    step after each: the logits of a DynamicCache under eager."""
    seed = 30
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    expected, got, cache = both(model, lambda cache: _row_ops(model, cache, ids, mask))
    atol, rtol = tolerance("attention", "fp32")
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, e, atol=atol * e.abs().max().item(), rtol=rtol, msg=f"after operation {step}")
    cache.paged.blocks.check()
    assert cache.paged.usage().sequences == 3


def test_a_fork_that_runs_out_of_blocks_changes_nothing() -> None:
    """reorder_cache needing more blocks than are free raises OutOfBlocksError with the cache unchanged."""
    model = llama(31)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = prompts(31, (6, 6, 6))
    cache = hal_cache(model, num_blocks=7)  # 2 blocks per row, one free; every fork copies a partial block
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    usage = cache.paged.usage()
    with pytest.raises(hal_core.OutOfBlocksError):
        cache.reorder_cache(torch.tensor([0, 0, 0]))
    assert cache.paged.usage() == usage
    cache.paged.blocks.check()


def test_layer_level_row_operations_point_to_the_cache() -> None:
    """A layer's own reorder/crop/reset would touch one layer of a shared cache: it raises and names the cache."""
    model = llama(36)
    cache = hal_cache(model)
    for call in (lambda layer: layer.reorder_cache(torch.tensor([0])), lambda layer: layer.crop(-1),
                 lambda layer: layer.batch_repeat_interleave(2), lambda layer: layer.reset()):
        with pytest.raises(NotImplementedError, match="call it on the cache"):
            call(cache.layers[0])
    with pytest.raises(NotImplementedError, match="does not offload"):
        cache.layers[0].offload()
    with pytest.raises(hal_core.ArgumentError, match="tokens_to_remove"):
        cache.crop(2)


def test_crop_into_a_shared_block_copies_it_or_changes_nothing() -> None:
    """Shortening into a block another sequence shares copies it (a freed block may serve); with none free,
    OutOfBlocksError and nothing changed (the bookkeeping under HalPagedCache.crop)."""
    from hal_core.kvcache import BlockTable

    table = BlockTable(num_blocks=3, block_size=4)
    table.add("a", 4)
    table.fork("a", "b")  # b shares a's full block
    table.add("c", 8)  # every block in use
    before = {s: table.blocks(s) for s in "abc"}
    with pytest.raises(hal_core.OutOfBlocksError):
        table.truncate_many({"a": 3})  # a's last block would turn partial while b shares it
    assert {s: table.blocks(s) for s in "abc"} == before and table.length("a") == 4
    table.check()
    copies = table.truncate_many({"c": 4, "a": 3})  # c's second block is freed first, then serves a's copy
    assert copies == [(before["a"][0], before["c"][1])]
    assert table.blocks("a") == [before["c"][1]] and table.length("a") == 3 and table.refcount(before["a"][0]) == 1
    table.check()


def test_a_first_forward_out_of_blocks_leaves_the_cache_empty() -> None:
    """A prompt batch that does not fit raises OutOfBlocksError; the cache holds nothing and serves a smaller one."""
    model = llama(37)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = prompts(37)
    cache = hal_cache(model, num_blocks=3)  # the prompts need 3 + 2 + 1 blocks of 4
    with pytest.raises(hal_core.OutOfBlocksError), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.paged.usage().sequences == 0
    with torch.no_grad():
        model(ids[2:], attention_mask=mask[2:], past_key_values=cache, use_cache=True)
    assert cache.paged.usage().tokens == PROMPT_LENS[2]


def test_a_row_without_real_tokens_follows_sdpa() -> None:
    """An empty prompt in a batch (a row of pads only): its attention output is zero, as with "sdpa" (eager averages
    the pads' values instead, so transformers' own implementations disagree there); the other rows are eager's."""
    seed = 38
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed, (5, 3, 0))
    eager = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    model.set_attn_implementation("sdpa")
    sdpa = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    before = hal_calls()
    got = generate(model, ids, mask, hal_cache(model))
    assert hal_calls() > before
    assert_same(sdpa, got)
    assert torch.equal(got.sequences[:2], eager.sequences[:2])
    assert not torch.allclose(eager.logits[0][2], sdpa.logits[0][2], atol=1e-2)  # the row where they disagree


def test_generation_from_embeddings_and_a_closed_cache() -> None:
    """generate(inputs_embeds=...) through hal gives eager's tokens; a closed cache raises when used again."""
    seed = 39
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    embeds = model.get_input_embeddings()(ids).detach()

    def run(cache):
        with torch.no_grad():
            return model.generate(inputs_embeds=embeds, attention_mask=mask, past_key_values=cache,
                                  max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)

    expected, got, cache = both(model, run)
    assert_same(expected, got)
    cache.close()
    with pytest.raises(hal_core.ArgumentError, match="closed"):
        run(cache)


def test_a_cache_built_for_another_model_is_refused_before_any_change() -> None:
    """States of another dtype or head count than the cache's raise at the first layer, the cache untouched."""
    model = llama(40)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    ids, mask = prompts(40)
    cache = hal_cache(model)
    with pytest.raises(hal_core.ArgumentError, match=r"layer 0: the model's key states .* torch\.bfloat16"), \
            torch.no_grad():
        model.to(torch.bfloat16)(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.paged.usage().used_blocks == 0
    other = llama(40, head_dim=32)
    other.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    with pytest.raises(hal_core.ArgumentError, match="32"), torch.no_grad():
        other(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.paged.usage().used_blocks == 0
    deeper = llama(40, num_hidden_layers=3)
    deeper.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    with pytest.raises(hal_core.ArgumentError, match="2 layers, the model 3"), torch.no_grad():
        deeper(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0 and cache.paged.usage().used_blocks == 0


def test_a_forward_that_broke_off_poisons_the_cache_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward interrupted after hal counted its tokens (here: layer 1's attention raises) leaves layers unwritten:
    the next use raises until reset(), after which the cache serves eager's tokens again."""
    seed = 41
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    expected = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = hal_cache(model)
    real = hal_hf._host_ops

    def failing(cache_, layer, *args, **kwargs):
        if layer == 1:
            raise KeyboardInterrupt
        return real(cache_, layer, *args, **kwargs)

    monkeypatch.setattr(hal_hf, "_host_ops", failing)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    monkeypatch.setattr(hal_hf, "_host_ops", real)
    step = torch.ones(3, 1, dtype=ids.dtype)
    with pytest.raises(hal_core.ArgumentError, match=r"broke off at layer 1.*reset"), torch.no_grad():
        model(step, attention_mask=torch.cat([mask, step], 1), past_key_values=cache, use_cache=True)
    cache.reset()
    assert_same(expected, generate(model, ids, mask, cache))


def test_assisted_decoding_with_an_assistant_model_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """An assistant model drafts tokens; the hal model verifies several per forward and crops the rejected ones."""
    seed = 42
    print(f"seed={seed}")
    model, assistant = llama(seed), llama(seed + 1)
    crops: list[int] = []
    real_crop = hal_hf.HalPagedCache.crop
    monkeypatch.setattr(hal_hf.HalPagedCache, "crop", lambda self, n: (crops.append(int(n)), real_crop(self, n))[1])
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(seed))
    expected, got, cache = both(model, lambda cache: generate(model, ids, None, cache, assistant_model=assistant,
                                                                max_new_tokens=10, output_logits=False))
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    assert any(n < 0 for n in crops), f"no draft was rejected: crops {crops}"
    assert cache.paged.usage().tokens == got.sequences.shape[1] - 1


@pytest.mark.parametrize("lens", [(9,), PROMPT_LENS], ids=["unpadded", "left-padded"])
def test_a_static_cache_in_the_sdpa_fallback_matches_eager(lens: tuple[int, ...]) -> None:
    """cache_implementation="static" (keys longer than the positions seen, empty slots included) without a
    HalPagedCache: the fallback places its queries at the positions seen, as eager does."""
    seed = 43
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed, lens)
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
                   pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, **options)
        model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
        got = model.generate(ids, attention_mask=mask, **options)
    assert_same(expected, got)
