"""Each vLLM attention layer builds its hal AttentionOptions once and passes that value on every call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_attention import HEAD_SIZE, NUM_HEADS, make_impl, make_step, reference, run_layer

import hal_core


def test_a_layer_passes_one_options_value_on_every_call(rng: np.random.Generator,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's scale, window, softcap and ALiBi slopes (its config) and sinks (its weight) reach hal as one
    AttentionOptions, the same object on every call; reloading the weights builds it again with the new sinks."""
    from hal_cpu.ops import _knobs

    real = _knobs.partition_tokens
    seen: list[hal_core.AttentionOptions] = []

    def spy(call: hal_core.ops.OpCall) -> int:  # read by every call, planned or not: the options it runs with
        seen.append(call.options)
        return real(call)

    alibi = (2.0 ** -np.arange(1, NUM_HEADS + 1)).astype(np.float32)
    sinks = torch.tensor(rng.standard_normal(NUM_HEADS), dtype=torch.float32)
    impl = make_impl(sliding_window=16, logits_soft_cap=30.0, alibi_slopes=alibi.tolist(), sinks=sinks)
    monkeypatch.setattr(_knobs, "partition_tokens", spy)
    steps = make_step(rng, torch.float32)
    first, step = run_layer(impl, steps, torch.float32)
    again, _ = run_layer(impl, steps, torch.float32)
    assert len(seen) == 2 and seen[0] is seen[1]
    options = seen[0]
    assert (options.scale, options.window, options.softcap) == (HEAD_SIZE ** -0.5, 16, 30.0)
    np.testing.assert_array_equal(options.alibi_slopes, alibi)
    np.testing.assert_array_equal(options.sinks, sinks.numpy())
    n = step.meta.num_actual_tokens
    expected = reference(step, scale=HEAD_SIZE ** -0.5, window=16, softcap=30.0, sinks=sinks.double().numpy(),
                         alibi=alibi)
    np.testing.assert_allclose(first[:n].double().numpy(), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(again, first)
    impl.sinks = sinks * 2
    impl.process_weights_after_loading(torch.float32)
    run_layer(impl, steps, torch.float32)
    assert seen[2] is not options and seen[2].alibi_slopes is options.alibi_slopes
    np.testing.assert_array_equal(seen[2].sinks, (sinks * 2).numpy())
