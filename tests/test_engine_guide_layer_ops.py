"""The decoder-layer example of docs/engine-guide.md (rms_norm, gated_activation) runs as written, rightly."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import hal_core
from hal_core.ops import OPS

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine-guide.md"


def test_the_layer_ops_example_runs_and_matches_the_references(rng: np.random.Generator) -> None:
    """The guide's block on host arrays: the norms, the residual update and both activations are the references'."""
    blocks = re.findall(r"```python\n(h = be\.ops\.rms_norm\(x, .*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "engine-guide.md should hold one rms_norm / gated_activation example"
    inter, hidden = 48, 64
    names = {
        "be": hal_core.get_backend("cpu"), "inter": inter,
        "x": rng.standard_normal((3, hidden)).astype(np.float32),
        "attn_out": rng.standard_normal((3, hidden)).astype(np.float32),
        "res": rng.standard_normal((3, hidden)).astype(np.float32),
        "input_norm_weight": rng.standard_normal(hidden).astype(np.float32),
        "post_norm_weight": rng.standard_normal(hidden).astype(np.float32),
        "gate_up": rng.uniform(-4, 4, (3, 2 * inter)).astype(np.float32),
        "g": rng.uniform(-4, 4, (3, inter)).astype(np.float32),
        "u": rng.standard_normal((3, inter)).astype(np.float32),
    }
    before = names["res"].copy()
    exec(compile(blocks[0], str(DOC), "exec"), names)
    want_h, want_res = OPS["rms_norm"].reference({"x": names["attn_out"], "weight": names["post_norm_weight"],
                                                  "epsilon": 1e-6, "residual": before})
    np.testing.assert_allclose(names["h"], want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(names["res"], want_res)
    want_a = OPS["gated_activation"].reference({"gate": names["g"], "up": names["u"], "activation": "gelu_tanh"})
    np.testing.assert_allclose(names["a"], want_a, rtol=1e-5, atol=1e-5)


def test_the_bind_example_runs_and_matches_the_front_door(rng: np.random.Generator) -> None:
    """The guide's ``be.ops.bind`` block on a real cache and step: its projections and attention are the front
    door's, bit for bit."""
    from hal_core import AttentionOptions
    from hal_core.kvcache import CacheConfig, PagedKVCache
    from hal_core.quant import quantize

    blocks = re.findall(r"```python\n(gemm_q = be\.ops\.bind\(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "engine-guide.md should hold one be.ops.bind example"
    be = hal_core.get_backend("cpu")
    heads, kv_heads, d, hidden = 4, 2, 64, 256
    cache = PagedKVCache(be, CacheConfig(num_layers=1, num_kv_heads=kv_heads, head_size=d, block_size=16,
                                         dtype="fp32"), num_blocks=8)
    try:
        cache.add("a")
        cache.prepare_step({"a": 5})  # a context of 5 tokens, then the example's decode step
        step = cache.prepare_step({"a": 1})
        k_cache, v_cache = cache.layer(0)
        k_cache[...] = rng.standard_normal(k_cache.shape)
        v_cache[...] = rng.standard_normal(v_cache.shape)
        names = {"be": be, "w_q": quantize(rng.standard_normal((hidden, heads * d)) / 16, group_size=128),
                 "x": rng.standard_normal((1, hidden)).astype(np.float32), "k_cache": k_cache, "v_cache": v_cache,
                 "layer_options": AttentionOptions(scale=d ** -0.5, window=4), "step": step, "heads": heads, "d": d}
        exec(compile(blocks[0], str(DOC), "exec"), names)
        want_q = be.ops.quantized_gemm(names["x"], names["w_q"])
        np.testing.assert_array_equal(names["q"].reshape(1, -1), want_q)
        want = be.ops.paged_attention(want_q.reshape(1, heads, d), k_cache, v_cache, options=names["layer_options"],
                                      **step.attention_args())
        np.testing.assert_array_equal(names["out"], want)
    finally:
        cache.close()
