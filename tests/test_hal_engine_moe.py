"""hal_core.engine serves Qwen3, Mixtral and Qwen3-MoE checkpoints on hal ops alone (each MoE block one
``fused_moe`` call): its tokens equal transformers' with hal's quantized layers and blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers
from test_hal_engine import GROUP, assert_same_greedy, assert_serves_without_torch, transformers_tokens
from torch_helpers import torch

import hal_core
from hal_core import CheckpointError, ConfigurationError
from hal_core.engine import Engine
from hal_core.torch import QuantMoE, save_quantized

_COMMON: dict[str, Any] = dict(vocab_size=160, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                               tie_word_embeddings=False)
#: name -> (config class, model class, fields): Qwen3-MoE with a dense layer and unnormalised top-k weights, with
#: normalised ones, Mixtral (its own tensor names, renormalised routing) and dense Qwen3 (per-head q/k norms).
ARCHITECTURES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                       head_dim=32, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe_renorm": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                         dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=3,
                              head_dim=32, norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(intermediate_size=256, head_dim=32)),
}


def checkpoint(folder: Path, arch: str, seed: int) -> Any:
    """A small random model of ``arch`` saved as config.json + model.safetensors in ``folder``; returns it."""
    config_class, model_class, fields = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_class(**_COMMON, **fields)
    config._attn_implementation = "eager"
    model = model_class(config).eval()
    model.save_pretrained(folder)
    return model


def _seed() -> int:
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    return seed


@pytest.mark.parametrize(("arch", "bits", "activations"), [
    ("qwen3_moe", 4, "float"), ("qwen3_moe", 8, "float"), ("qwen3_moe", 4, "int8"), ("qwen3_moe_renorm", 4, "float"),
    ("mixtral", 4, "float"), ("qwen3", 4, "float")])
def test_engine_greedy_tokens_equal_transformers(cpu, tmp_path: Path, arch: str, bits: int, activations: str) -> None:
    """Prompts of different lengths served together (continuous batching, prompts prefilled in chunks) give
    transformers' greedy tokens with the same quantized weights (up to a near-tie that rounding may flip)."""
    seed = _seed()
    model = checkpoint(tmp_path, arch, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 160, n).tolist() for n in (7, 19, 1, 33)]
    expected = transformers_tokens(model, prompts, 8, bits, activations)
    assert any(isinstance(m, QuantMoE) for m in model.modules()) == (arch != "qwen3")
    with Engine(tmp_path, backend=cpu, bits=bits, group_size=GROUP, max_batch_tokens=24, kv_cache_tokens=512,
                block_size=8, activations=activations) as engine:
        got = engine.generate(prompts, max_new_tokens=8, stop_token_ids=())
        assert engine.cache.usage().used_blocks == 0
    for tokens, (want, logits) in zip(got, expected, strict=True):
        assert_same_greedy(tokens, want, logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_engine_serves_a_gptq_moe_checkpoint_with_its_stored_codes(cpu, tmp_path: Path, arch: str) -> None:
    """A MoE model saved by save_quantized (each expert's projections as GPTQ layers under the architecture's names)
    serves transformers' greedy tokens; every MoE call is one fused_moe call on the CPU backend, no fallback."""
    seed = _seed()
    model = checkpoint(tmp_path / "float", arch, seed)
    prompts = [np.random.default_rng(seed).integers(1, 160, n).tolist() for n in (5, 12)]
    expected = transformers_tokens(model, prompts, 6, 4, "float")
    save_quantized(model, tmp_path / "gptq")
    stored = json.loads((tmp_path / "gptq" / "model.safetensors.index.json").read_text())["weight_map"] \
        if (tmp_path / "gptq" / "model.safetensors.index.json").exists() else None
    expert = "block_sparse_moe.experts.7.w2" if arch == "mixtral" else "mlp.experts.7.down_proj"
    if stored is not None:
        assert f"model.layers.0.{expert}.qweight" in stored
    before = hal_core.stats().get("cpu", {}).get("fused_moe", {}).get("calls", 0)
    with Engine(tmp_path / "gptq", backend=cpu, group_size=GROUP, activations="float") as engine:
        experts = engine.weights.layers[0].experts
        assert experts is not None and len(experts.w13) == 8 and experts.w13[0].bits == 4
        got = engine.generate(prompts, max_new_tokens=6, stop_token_ids=())
    stats = hal_core.stats()["cpu"]["fused_moe"]
    sparse = 1 if arch == "qwen3_moe" else 2  # ARCHITECTURES' qwen3_moe keeps layer 1 dense
    assert stats["calls"] - before == sparse * (1 + 5)  # one prefill step (both prompts fit) and five decode steps
    assert set(stats["implementations"]) == {"cpu.fused_moe"} and not stats["fallbacks"]
    for tokens, (want, logits) in zip(got, expected, strict=True):
        assert_same_greedy(tokens, want, logits)


def _edit(folder: Path, **fields: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("arch", "fields", "match", "error"), [
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window", ConfigurationError),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok", ConfigurationError),
    ("qwen3_moe", {"mlp_only_layers": "1"}, "mlp_only_layers", ConfigurationError),
    ("qwen3_moe", {"num_experts": 9}, r"'model.layers.0.mlp.gate.weight' has shape \[8, 128\], the config gives "
                                      r"\[9, 128\]", CheckpointError),
    ("mixtral", {"num_local_experts": 9}, "block_sparse_moe.gate.weight", CheckpointError),
    ("mixtral", {"intermediate_size": 96}, "w1", CheckpointError),
    ("qwen3", {"head_dim": 16}, "q_norm", CheckpointError),
])
def test_engine_refuses_a_config_it_cannot_run_faithfully(cpu, tmp_path: Path, arch: str, fields: dict[str, Any],
                                                          match: str, error: type[Exception]) -> None:
    """A window on some layers only, an impossible top-k, a malformed field, or tensors that disagree with the
    config are refused naming the field or tensor, before any weight is quantized."""
    checkpoint(tmp_path, arch, 3)
    _edit(tmp_path, **fields)
    with pytest.raises(error, match=match):
        Engine(tmp_path, backend=cpu, group_size=GROUP)


def test_engine_serves_a_moe_model_without_torch(cpu, tmp_path: Path) -> None:
    """Serving a Qwen3-MoE checkpoint with hal_core.engine imports no torch."""
    checkpoint(tmp_path, "qwen3_moe", 6)
    assert_serves_without_torch(tmp_path, [[1, 2], [3]])


def test_engine_names_a_missing_expert_tensor(cpu, tmp_path: Path) -> None:
    """A checkpoint missing one expert's projection is refused naming that tensor, before any weight is read."""
    from safetensors.numpy import load_file, save_file

    checkpoint(tmp_path, "mixtral", 4)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model.layers.1.block_sparse_moe.experts.5.w3.weight' is missing"):
        Engine(tmp_path, backend=cpu, group_size=GROUP)
