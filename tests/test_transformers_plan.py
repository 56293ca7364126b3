"""The forward plan and the decode path: a remembered device mask reads as the whole mask would; unpadded
decode steps (hal's in-place path on the host) in every cache dtype match float32 attention."""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import torch

pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

import transformers_helpers as th

import hal_core.torch.transformers as hal_hf
from hal_core.testing.tolerances import tolerance
from hal_core.torch._tf_plan import device_mask_read


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("remember", [False, True])
def test_new_columns_and_changed_rows_match_a_host_comparison(rng: np.random.Generator, remember: bool) -> None:
    """For random masks and random changes of the prefix, the new columns and the rows whose prefix differs
    from the positions seen are those a plain numpy comparison finds (with or without the remembered mask)."""
    for _ in range(50):
        batch, past, q_len = int(rng.integers(1, 5)), int(rng.integers(1, 12)), int(rng.integers(1, 4))
        seen = rng.random((batch, past)) < 0.7
        mask = np.concatenate([seen, rng.random((batch, q_len)) < 0.7], axis=1)
        changed = rng.random((batch, past)) < 0.1
        mask[:, :past] ^= changed
        remembered = torch.from_numpy(seen.copy()) if remember else None
        real, differs = device_mask_read(torch.from_numpy(mask), seen, remembered)
        np.testing.assert_array_equal(real, mask[:, past:])
        np.testing.assert_array_equal(differs, changed.any(axis=1))


def test_a_remembered_mask_of_another_shape_is_not_used(rng: np.random.Generator) -> None:
    """A remembered mask that does not cover the positions seen (the cache changed) is ignored: the host
    comparison decides."""
    seen = np.array([[True, True, False]])
    mask = torch.tensor([[True, False, False, True]])
    real, differs = device_mask_read(mask, seen, torch.ones(1, 2, dtype=torch.bool))
    np.testing.assert_array_equal(real, [[True]])
    np.testing.assert_array_equal(differs, [True])


def test_no_positions_seen_reads_only_the_new_columns() -> None:
    """A first forward: no prefix to compare, every column is new."""
    real, differs = device_mask_read(torch.tensor([[False, True], [True, True]]), np.zeros((2, 0), bool), None)
    np.testing.assert_array_equal(real, [[False, True], [True, True]])
    assert differs is None


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_unpadded_decode_steps_match_float32_attention(dtype: str) -> None:
    """A prompt without pads and five decode steps, each one token per row with the whole mask: every step's
    logits through hal are as close to the float32 eager model's (float64 logits of the whole sequence) as eager
    attention in the same dtype is, and the cache holds each step's tokens."""
    seed = 12
    print(f"seed={seed}")
    tdtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    model = th.llama(seed)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, th.VOCAB, (2, 11), generator=generator)  # 6 prompt tokens, 5 steps
    with torch.no_grad():
        truth = model.double()(ids).logits[:, 5:]
        model = model.to(tdtype)
        eager = model(ids).logits.double()[:, 5:]
        model.set_attn_implementation(hal_hf.ATTN_IMPLEMENTATION)
        cache = hal_hf.HalPagedCache(model.config, num_blocks=8, block_size=4, dtype=tdtype)
        mask = torch.ones(2, 6, dtype=torch.long)
        steps = [model(ids[:, :6], attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(6, 11):
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            steps.append(model(ids[:, t:t + 1], attention_mask=mask, past_key_values=cache,
                               use_cache=True).logits[:, -1])
    got = torch.stack(steps, dim=1).double()
    atol, _ = tolerance("attention", dtype)
    scale = truth.abs().max().item()
    hal_error, eager_error = (got - truth).abs().max().item(), (eager - truth).abs().max().item()
    print(f"max |logit error| vs float64: hal {hal_error:.4g}, eager {eager_error:.4g} (scale {scale:.3g})")
    assert hal_error <= max(1.5 * eager_error, atol * scale)
    assert cache.get_seq_length() == 11 and cache.paged.blocks.length(cache._seq_ids[1]) == 11
    cache.close()
