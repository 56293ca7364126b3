"""Shared pieces of the transformers tests: a small random Llama, left-padded prompts, and eager-versus-hal runs."""

from __future__ import annotations

import transformers
from torch_helpers import torch

import hal_core
import hal_core.torch.transformers as hal_hf
from hal_core.testing.tolerances import tolerance

VOCAB, NEW_TOKENS = 96, 6
PROMPT_LENS = (9, 5, 2)


def llama(seed: int, **overrides: object) -> torch.nn.Module:
    """A small random Llama (GQA, two layers unless ``overrides`` say otherwise) in eager attention."""
    torch.manual_seed(seed)
    fields: dict[str, object] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     initializer_range=0.2, attn_implementation="eager")
    config = transformers.LlamaConfig(**{**fields, **overrides})
    return transformers.LlamaForCausalLM(config).eval()


def prompts(seed: int, lens: tuple[int, ...] = PROMPT_LENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded to the longest, and their mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(1, VOCAB, (len(lens), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lens):
        mask[row, width - n:] = 1
    return ids, mask


def hal_calls() -> int:
    """How many paged-attention calls hal's CPU backend has served so far."""
    return hal_core.stats().get("cpu", {}).get("paged_attention", {}).get("calls", 0)


def hal_cache(model: torch.nn.Module, num_blocks: int = 32) -> hal_hf.HalPagedCache:
    """A float32 HalPagedCache for ``model`` in blocks of 4 tokens."""
    return hal_hf.HalPagedCache(model.config, num_blocks=num_blocks, block_size=4, dtype=torch.float32)


def generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, cache: object, **kwargs):
    """Greedy ``generate`` of NEW_TOKENS with the step logits returned; ``kwargs`` override the options."""
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
                   pad_token_id=0)
    options.update(kwargs)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, past_key_values=cache, **options)


def both(model: torch.nn.Module, run):
    """``run(cache)`` under eager with a DynamicCache, then under hal with a HalPagedCache (hal must serve it)."""
    model.set_attn_implementation("eager")
    eager_cache = transformers.DynamicCache(config=model.config)
    expected = run(eager_cache)
    model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
    cache = hal_cache(model)
    before = hal_calls()
    got = run(cache)
    assert hal_calls() > before, "hal's paged attention served no call"
    return expected, got, cache


def assert_same(expected, got) -> None:
    """Identical tokens, every step's logits within the fp32 attention tolerance (relative to the largest)."""
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    atol, rtol = tolerance("attention", "fp32")
    for step, (g, e) in enumerate(zip(got.logits, expected.logits, strict=True)):
        torch.testing.assert_close(g, e, atol=atol * e.abs().max().item(), rtol=rtol, msg=f"logits of step {step}")
