"""hal_core.rope's frequency tables against transformers' own ROPE_INIT_FUNCTIONS and rotary modules."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from hal_core import ConfigurationError
from hal_core.rope import rope_config, rope_cos_sin_cache

torch = pytest.importorskip("torch", reason="torch is not installed (make test installs it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

#: Real models' rope settings (their config.json values), built as transformers configurations.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama2-default": ("LlamaConfig", dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
                                           rope_theta=10000.0)),
    "mistral-7b-v0.3": ("MistralConfig", dict(hidden_size=4096, num_attention_heads=32, head_dim=128,
                                              max_position_embeddings=32768, rope_theta=1000000.0)),
    "llama3.1-llama3": ("LlamaConfig", dict(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "qwen2.5-yarn": ("Qwen2Config", dict(
        hidden_size=3584, num_attention_heads=28, max_position_embeddings=131072, rope_theta=1000000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})),
    "yarn-mscale": ("LlamaConfig", dict(
        hidden_size=2048, num_attention_heads=16, head_dim=64, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5})),
    "yarn-no-truncate": ("LlamaConfig", dict(
        hidden_size=2048, num_attention_heads=32, max_position_embeddings=16384, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192,
                      "truncate": False, "beta_fast": 16, "beta_slow": 2})),
    "linear": ("LlamaConfig", dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=8192,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "dynamic": ("LlamaConfig", dict(hidden_size=2048, num_attention_heads=16, max_position_embeddings=2048,
                                    rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "phi2-partial": ("PhiConfig", dict(hidden_size=2560, num_attention_heads=32, max_position_embeddings=2048,
                                       partial_rotary_factor=0.4)),
}


def _config(name: str) -> Any:
    cls, fields = CONFIGS[name]
    return getattr(transformers, cls)(**fields)


def _transformers_inv_freq(config: Any, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        dim = int((getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
                  * config.rope_parameters.get("partial_rotary_factor", 1.0))
        base = config.rope_parameters["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv.numpy().astype(np.float64), 1.0
    inv, factor = rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv.numpy().astype(np.float64), float(factor)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inverse_frequencies_match_transformers(name: str) -> None:
    """Each scaling type's frequencies and attention factor equal transformers' (its float32 rounding aside)."""
    config = _config(name)
    ours = rope_config(config)
    seq_len = 3 * config.max_position_embeddings if ours.rope_type == "dynamic" else None
    want, want_factor = _transformers_inv_freq(config, seq_len)
    got, got_factor = ours.inv_freq(seq_len)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    if name.startswith(("qwen", "yarn")):
        assert got_factor != 1.0  # the attention factor this case is about is there


def test_dynamic_short_table_is_unscaled() -> None:
    """A dynamic table no longer than max_position_embeddings is the unscaled one (transformers' reset)."""
    ours = rope_config(_config("dynamic"))
    short = ours.cos_sin_cache(1024)
    plain = rope_cos_sin_cache(ours.rotary_dim, 1024, ours.theta)
    np.testing.assert_array_equal(short, plain)
    longer = ours.cos_sin_cache(4096)
    assert not np.allclose(longer[1000], plain[1000])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_table_matches_transformers_rotary_module(name: str) -> None:
    """The table's rows at sampled positions equal cos/sin of transformers' rotary module (float32 angles aside).

    transformers forms each angle in float32 (``position * inv_freq``), off by up to half an ulp of the angle;
    the table forms it in float64, so the bound grows with the position.
    """
    config = _config(name)
    ours = rope_config(config)
    length = min(config.max_position_embeddings, 8192)
    if ours.rope_type == "dynamic":
        length = 2 * config.max_position_embeddings
    table = ours.cos_sin_cache(length).astype(np.float64)
    rng = np.random.default_rng(7)
    positions = np.unique(np.concatenate([[0, 1, length - 1], rng.integers(0, length, 64)]))
    want_inv, factor = _transformers_inv_freq(config, length if ours.rope_type == "dynamic" else None)
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * torch.tensor(want_inv, dtype=torch.float32)
    emb = torch.cat([freqs, freqs], dim=-1).double()
    half = ours.rotary_dim // 2
    want_cos, want_sin = (emb.cos() * factor).numpy()[:, :half], (emb.sin() * factor).numpy()[:, :half]
    bound = factor * (float(positions.max()) * float(want_inv.max()) * 2.0**-23 + 2e-7)
    np.testing.assert_allclose(table[positions, :half], want_cos, atol=bound, rtol=0)
    np.testing.assert_allclose(table[positions, half:], want_sin, atol=bound, rtol=0)


def test_table_layout_is_cos_then_sin() -> None:
    """Row p: cos(p * inv_freq) then sin(p * inv_freq), float32, from float64 angles."""
    table = rope_cos_sin_cache(8, 5, 100.0)
    inv = 1.0 / 100.0 ** (np.arange(0, 8, 2) / 8)
    angles = np.arange(5)[:, None] * inv
    assert table.dtype == np.float32 and table.shape == (5, 8)
    np.testing.assert_array_equal(table, np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32))


def test_rope_config_reads_dicts_and_transformers_5_parameters() -> None:
    """A plain dict with rope_parameters (transformers 5) and one with rope_scaling + rope_theta read alike."""
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    new = rope_config({"hidden_size": 2048, "num_attention_heads": 32, "max_position_embeddings": 131072,
                       "rope_parameters": params})
    old = rope_config({"hidden_size": 2048, "num_attention_heads": 32, "max_position_embeddings": 131072,
                       "rope_theta": 500000.0, "rope_scaling": {k: v for k, v in params.items() if k != "rope_theta"}})
    assert new == old
    assert (new.head_size, new.rotary_dim, new.theta, new.rope_type) == (64, 64, 500000.0, "llama3")
    partial = rope_config({"head_dim": 128, "partial_rotary_factor": 0.25, "max_position_embeddings": 64})
    assert (partial.head_size, partial.rotary_dim, partial.rope_type) == (128, 32, "default")


@pytest.mark.parametrize(("config", "key"), [
    ({"head_dim": 64, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"head_dim": 64, "rope_parameters": {"rope_type": "su"}}, "'su'"),
    ({"head_dim": 64, "rope_scaling": {"type": "linear"}}, "'factor'"),
    ({"head_dim": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'low_freq_factor'"),
    ({"head_dim": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "max_position_embeddings"),
    ({"head_dim": 64, "rope_theta": -1.0}, "rope_theta"),
    ({"head_dim": 64, "partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ({"num_attention_heads": 8}, "head_dim"),
    ({"head_dim": 64, "rope_parameters": {"full_attention": {"rope_type": "default"},
                                          "sliding_attention": {"rope_type": "default"}}}, "per-layer"),
])
def test_rope_config_refuses_what_it_cannot_compute(config: dict[str, Any], key: str) -> None:
    """An unknown scaling type, a missing parameter or a bad value is a ConfigurationError naming it."""
    with pytest.raises(ConfigurationError, match=key.replace("(", r"\(")):
        rope_config(config)


def test_rope_cos_sin_cache_refuses_bad_sizes() -> None:
    """An odd rotary_dim or a non-positive length is refused naming it."""
    with pytest.raises(ConfigurationError, match="rotary_dim"):
        rope_cos_sin_cache(7, 16)
    with pytest.raises(ConfigurationError, match="max_position"):
        rope_cos_sin_cache(8, 0)
    with pytest.raises(ConfigurationError, match="'yarn'"):
        rope_cos_sin_cache(8, 4, 10000.0, "yarn", {"factor": 2.0})
    assert math.isfinite(float(rope_cos_sin_cache(8, 4, 10000.0, "yarn", {"factor": 2.0,
                                                  "original_max_position_embeddings": 16})[3, 0]))


def test_importing_rope_leaves_torch_unimported() -> None:
    """hal_core.rope imports numpy only."""
    import subprocess
    import sys

    code = "import sys, hal_core.rope; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
