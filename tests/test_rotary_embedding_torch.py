"""torch.ops.hal.rotary_embedding: in place on torch tensors (fused-QKV views included), opcheck, torch.compile,
and against transformers' own apply_rotary_pos_emb on real models' rope settings."""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import TORCH_DTYPES, cuda_or_skip, host, tensor, torch

import hal_core
import hal_core.torch as hal_torch
from hal_core.ops import OPS
from hal_core.rope import rope_config
from hal_core.testing.inputs import assert_close, rotary_embedding_inputs

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

DTYPES = ("fp32", "fp16", "bf16")
REFERENCE = OPS["rotary_embedding"].reference


@pytest.fixture(params=("cpu", "cuda"))
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda":
        cuda_or_skip()
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_operator_rotates_fused_qkv_views_in_place(device: str, dtype: str, style: str) -> None:
    """Slices of one QKV tensor are rotated where they are (same storage); the value slice is untouched."""
    seed = 3000 + 10 * DTYPES.index(dtype) + (style == "gptj")
    print(f"seed={seed}")
    args = rotary_embedding_inputs(np.random.default_rng(seed), num_tokens=7, num_heads=4, num_kv_heads=2,
                                   head_size=64, dtype=dtype, rotary_dim=48, max_position=40)
    args["style"] = style
    want_q, want_k = REFERENCE(args)
    qkv = torch.cat([tensor(args["query"], device), tensor(args["key"], device), tensor(args["key"], device)], 1)
    value = qkv[:, 6:].clone()
    query, key = qkv[:, :4], qkv[:, 4:6]
    pointer = qkv.data_ptr()
    result = hal_torch.rotary_embedding(tensor(args["positions"], device), query, tensor(args["cos_sin_cache"], device),
                                        key=key, style=style)
    assert result is None and qkv.data_ptr() == pointer
    assert_close(host(query), want_q, kind="rotary", dtype=dtype, what="query")
    assert_close(host(key), want_k, kind="rotary", dtype=dtype, what="key")
    assert torch.equal(qkv[:, 6:], value)


def test_opcheck_with_and_without_key() -> None:
    """torch.library.opcheck: schema (mutations declared), fake, autograd registration, with key and with None."""
    args = rotary_embedding_inputs(np.random.default_rng(4), num_tokens=5, num_heads=2, num_kv_heads=1,
                                   head_size=32, dtype="fp32", max_position=16, poison=False)
    t = {name: tensor(value) for name, value in args.items()}
    op = torch.ops.hal.rotary_embedding.default
    torch.library.opcheck(op, (t["positions"], t["query"], t["cos_sin_cache"], t["key"], "gptj"))
    torch.library.opcheck(op, (t["positions"], t["query"].clone(), t["cos_sin_cache"]))
    assert "Tensor(b!)? key=None" in str(op._schema)


def test_compiles_without_graph_break_and_matches_eager() -> None:
    """Under torch.compile(fullgraph=True) the operator mutates its inputs as in eager mode."""
    args = rotary_embedding_inputs(np.random.default_rng(8), num_tokens=6, num_heads=4, num_kv_heads=2,
                                   head_size=64, dtype="fp32", max_position=32, poison=False)

    def step(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        hal_torch.rotary_embedding(positions, q, table, key=k)
        return q.sum() + k.sum()

    eager = {name: tensor(value).clone() for name, value in args.items()}
    compiled = {name: tensor(value).clone() for name, value in args.items()}
    want = step(eager["positions"], eager["query"], eager["key"], eager["cos_sin_cache"])
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(
        compiled["positions"], compiled["query"], compiled["key"], compiled["cos_sin_cache"])
    assert torch.equal(eager["query"], compiled["query"]) and torch.equal(eager["key"], compiled["key"])
    assert torch.equal(want, got)


def test_bad_position_is_refused_before_writing() -> None:
    """A position past the table is an ArgumentError naming positions; nothing is written."""
    args = rotary_embedding_inputs(np.random.default_rng(2), num_tokens=3, num_heads=2, num_kv_heads=1,
                                   head_size=32, dtype="fp32", max_position=8, poison=False)
    t = {name: tensor(value) for name, value in args.items()}
    before = t["query"].clone()
    with pytest.raises(hal_core.ArgumentError, match="'positions'"):
        hal_torch.rotary_embedding(torch.tensor([0, 8, 1]), t["query"], t["cos_sin_cache"], key=t["key"])
    assert torch.equal(before, t["query"])


# -- against transformers ----------------------------------------------------------------------------------

#: Real models' rope settings: (transformers config class, its fields).
MODELS = {
    "llama3.1-8b": ("LlamaConfig", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                        max_position_embeddings=131072, rope_theta=500000.0,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192})),
    "qwen2.5-7b-yarn": ("Qwen2Config", dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                                            max_position_embeddings=131072, rope_theta=1000000.0,
                                            rope_scaling={"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32768})),
    "mistral-7b": ("MistralConfig", dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0)),
}


def _rotary_module(config: object) -> torch.nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_matches_transformers_apply_rotary_pos_emb(model: str, dtype: str) -> None:
    """hal's table and op give transformers' rotated q and k (NeoX layout) for the model's rope settings.

    transformers forms each angle in float32 and rounds cos/sin to the activations' dtype; hal keeps float64
    angles and float32 cos/sin, so the bound is float32 angle rounding at these positions plus the dtype's.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cls, fields = MODELS[model]
    config = getattr(transformers, cls)(**fields)
    rope = rope_config(config)
    rng = np.random.default_rng(17)
    positions = np.sort(rng.integers(0, 4096, 24))
    heads, kv_heads, head = config.num_attention_heads, config.num_key_value_heads, rope.head_size
    q = torch.randn(24, heads, head, generator=torch.Generator().manual_seed(1)).to(TORCH_DTYPES[dtype])
    k = torch.randn(24, kv_heads, head, generator=torch.Generator().manual_seed(2)).to(TORCH_DTYPES[dtype])
    position_ids = torch.tensor(positions)[None]
    cos, sin = _rotary_module(config)(q.float()[None], position_ids)  # fp32 [1, tokens, head]
    want_q, want_k = apply_rotary_pos_emb(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], cos, sin)
    want_q, want_k = want_q[0].transpose(0, 1), want_k[0].transpose(0, 1)

    table = torch.from_numpy(rope.cos_sin_cache(4096))
    got_q, got_k = q.clone(), k.clone()
    hal_torch.rotary_embedding(torch.tensor(positions), got_q, table, key=got_k)
    atol = 4096 * 2.0**-23 * 4 + (0 if dtype == "fp32" else 2.0**-8 * 4)
    np.testing.assert_allclose(host(got_q), host(want_q), atol=atol, rtol=0 if dtype == "fp32" else 2.0**-7)
    np.testing.assert_allclose(host(got_k), host(want_k), atol=atol, rtol=0 if dtype == "fp32" else 2.0**-7)
    assert not torch.equal(got_q, q)  # it did rotate


def test_partial_rotary_matches_phi() -> None:
    """Phi's partial rotary (the first rotary_dim dimensions, NeoX halves within them) through hal's op."""
    from transformers.models.phi.modeling_phi import PhiRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.PhiConfig(hidden_size=2560, num_attention_heads=32, max_position_embeddings=2048,
                                    partial_rotary_factor=0.4)
    rope = rope_config(config)
    assert (rope.head_size, rope.rotary_dim) == (80, 32)
    positions = torch.arange(0, 2048, 97)
    q = torch.randn(positions.numel(), 32, 80, generator=torch.Generator().manual_seed(3))
    cos, sin = PhiRotaryEmbedding(config)(q[None], positions[None])
    rot = q.transpose(0, 1)[None]
    q_rot, _ = apply_rotary_pos_emb(rot[..., :32], rot[..., :32], cos, sin)
    want = torch.cat([q_rot, rot[..., 32:]], -1)[0].transpose(0, 1)
    got = q.clone()
    hal_torch.rotary_embedding(positions, got, torch.from_numpy(rope.cos_sin_cache(2048)))
    np.testing.assert_allclose(host(got), host(want), atol=2048 * 2.0**-23 * 4, rtol=0)
    assert torch.equal(got[..., 32:], q[..., 32:])


def test_gptj_style_matches_transformers_gptj() -> None:
    """style='gptj' equals transformers' GPT-J rotary (adjacent pairs, rotate_every_two) on a partial head."""
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    rotary_dim, head, max_pos = 64, 256, 2048
    sincos = create_sinusoidal_positions(max_pos, rotary_dim)  # [max_pos, rotary_dim]: sin, then cos
    positions = torch.arange(3, max_pos, 131)
    k = torch.randn(positions.numel(), 16, head, generator=torch.Generator().manual_seed(5))
    sin, cos = torch.split(sincos[positions][None], rotary_dim // 2, dim=-1)  # [1, tokens, rotary_dim / 2]
    rotated = apply_rotary_pos_emb(k[None, ..., :rotary_dim], sin, cos)[0]  # k as [batch, tokens, heads, dim]
    want = torch.cat([rotated, k[..., rotary_dim:]], -1)
    table = torch.cat([sincos[:, rotary_dim // 2:], sincos[:, : rotary_dim // 2]], -1).contiguous()  # cos, sin
    got, unused = torch.zeros(positions.numel(), 1, head), k.clone()
    hal_torch.rotary_embedding(positions, got, table, key=unused, style="gptj")
    np.testing.assert_allclose(host(unused), host(want), atol=1e-5, rtol=0)
