"""hal_core.engine serves a transformers Llama checkpoint on hal ops alone: its tokens equal transformers'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers
from torch_helpers import torch

import hal_core
from hal_core import ConfigurationError
from hal_core.engine import Engine, SamplingParams
from hal_core.torch import quantize_model, save_quantized

GROUP = 32


def checkpoint(folder: Path, seed: int, **overrides: object) -> transformers.LlamaForCausalLM:
    """A small random Llama saved as config.json + model.safetensors in ``folder``; returns the model."""
    torch.manual_seed(seed)
    fields: dict[str, object] = dict(vocab_size=160, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     initializer_range=0.2, attn_implementation="eager", tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **overrides})).eval()
    model.save_pretrained(folder)
    return model


def transformers_tokens(model: transformers.PreTrainedModel, prompts: list[list[int]], new: int,
                        bits: int, activations: str = "float") -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and step logits of ``model`` with hal's quantized projections and MoE blocks (the engine's
    codes, the lm_head int8), one prompt at a time."""
    quantize_model(model, bits=bits, group_size=GROUP, layer_bits={"lm_head": 8}, activations=activations)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            result = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                    pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            out.append((result.sequences[0, len(prompt):].tolist(), torch.stack(result.logits)[:, 0]))
    return out


#: The near-tie allowed where activations are quantised per token to int8 (W8A8: every int8 layer, and the int8
#: lm_head of every test here). The engine and transformers round in different orders (a long prompt is prefilled in
#: chunks by the engine, at once by transformers), and one activation code flipped by that rounding moves a logit by
#: up to about 1/127 of the token's largest activation times a weight: margins of 3.7e-3 of the row's largest logit
#: were seen (seed 60574, bits 8). A wrong kernel errs by the logits' own size.
INT8_ACTIVATIONS_REL = 1e-2


def assert_same_greedy(got: list[int], expected: list[int], logits: torch.Tensor,
                       rel: float = INT8_ACTIVATIONS_REL) -> None:
    """``got`` equals ``expected`` up to the first step where they differ; there the reference's logits must be
    a near-tie between the two tokens (rounding, and the int8 activation codes it may flip, may turn a tie;
    nothing else may)."""
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            row = logits[step].double()
            margin = float(row[b] - row[a])
            assert margin <= rel * float(row.abs().max()), (step, a, b, margin)
            return


@pytest.mark.parametrize("bits", [4, 8])
def test_engine_greedy_tokens_equal_transformers(cpu, tmp_path: Path, bits: int) -> None:
    """Prompts of different lengths served together (continuous batching) give transformers' greedy tokens
    (up to a near-tie that rounding may flip)."""
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    model = checkpoint(tmp_path, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 160, n).tolist() for n in (7, 19, 1, 33)]
    expected = transformers_tokens(model, prompts, 8, bits)
    with Engine(tmp_path, backend=cpu, bits=bits, group_size=GROUP, max_batch_tokens=24,
                kv_cache_tokens=512, block_size=8, activations="float") as engine:
        got = engine.generate(prompts, max_new_tokens=8, stop_token_ids=())
        assert engine.cache.usage().used_blocks == 0  # every finished request gave its blocks back
    for tokens, (want, logits) in zip(got, expected, strict=True):
        assert_same_greedy(tokens, want, logits)


def test_engine_serves_a_gptq_checkpoint_with_its_stored_codes(cpu, tmp_path: Path) -> None:
    """A model saved by save_quantized (sharded GPTQ, int8 lm_head rule) serves transformers' greedy tokens."""
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    model = checkpoint(tmp_path / "float", seed)
    prompts = [np.random.default_rng(seed).integers(1, 160, n).tolist() for n in (5, 12)]
    expected = transformers_tokens(model, prompts, 6, 4)
    save_quantized(model, tmp_path / "gptq", max_shard_size="200KB")
    assert (tmp_path / "gptq" / "model.safetensors.index.json").exists()
    with Engine(tmp_path / "gptq", backend=cpu, group_size=GROUP, activations="float") as engine:
        assert engine.weights.layers[0].qkv.bits == 4 and engine.weights.lm_head.bits == 8
        # every tensor was read and converted: no page of the shards stays resident (the embedding, still a view,
        # faults its rows back in as steps read them)
        assert resident_kb(tmp_path / "gptq") in (0, None)
        got = engine.generate(prompts, max_new_tokens=6, stop_token_ids=())
    for tokens, (want, logits) in zip(got, expected, strict=True):
        assert_same_greedy(tokens, want, logits)


def resident_kb(folder: Path) -> int | None:
    """This process's resident kB of its mappings of the files in ``folder`` (None without /proc/self/smaps)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    root, total, inside = str(folder.resolve()), 0, False
    for line in smaps.read_text().splitlines():
        parts = line.split()
        if not parts[0].endswith(":"):
            inside = len(parts) >= 6 and parts[5].startswith(root + "/")
        elif parts[0] == "Rss:" and inside:
            total += int(parts[1])
    return total


def test_engine_runs_every_step_op_on_the_backend(cpu, tmp_path: Path) -> None:
    """A generate call reaches each step op of the CPU backend's compiled implementations, no fallback."""
    checkpoint(tmp_path, 1)
    before = hal_core.stats().get("cpu", {})
    with Engine(tmp_path, backend=cpu, group_size=GROUP) as engine:
        engine.generate([[1, 2, 3]], max_new_tokens=3, stop_token_ids=())
    after = hal_core.stats()["cpu"]
    for op in ("rms_norm", "quantized_gemm", "rotary_embedding", "write_kv_cache", "paged_attention",
               "gated_activation", "sample"):
        calls = after.get(op, {}).get("calls", 0) - before.get(op, {}).get("calls", 0)
        assert calls > 0, op
        assert set(after[op]["implementations"]) == {f"cpu.{op}"} and not after[op]["fallbacks"], after[op]


def test_engine_sampling_is_reproducible_and_greedy_at_zero_temperature(cpu, tmp_path: Path) -> None:
    """The same seed gives the same tokens; temperature 0 gives the greedy tokens whatever the seed."""
    checkpoint(tmp_path, 2)
    with Engine(tmp_path, backend=cpu, group_size=GROUP) as engine:
        hot = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=5)
        a = engine.generate([[3, 4, 5]], max_new_tokens=6, sampling=hot, stop_token_ids=())
        b = engine.generate([[3, 4, 5]], max_new_tokens=6, sampling=hot, stop_token_ids=())
        greedy = engine.generate([[3, 4, 5]], max_new_tokens=6, stop_token_ids=())
        cold = engine.generate([[3, 4, 5]], max_new_tokens=6, sampling=SamplingParams(seed=9), stop_token_ids=())
    assert a == b
    assert cold == greedy


def test_engine_stops_at_the_stop_token(cpu, tmp_path: Path) -> None:
    """Generation ends at a stop token (included), before max_new_tokens."""
    checkpoint(tmp_path, 3)
    with Engine(tmp_path, backend=cpu, group_size=GROUP) as engine:
        free = engine.generate([[5, 6]], max_new_tokens=6, stop_token_ids=())[0]
        stopped = engine.generate([[5, 6]], max_new_tokens=6, stop_token_ids=[free[2]])[0]
    assert stopped == free[:free.index(free[2]) + 1]


@pytest.mark.parametrize(("field", "value"), [("attention_bias", True), ("hidden_act", "relu"),
                                              ("model_type", "gpt2")])
def test_engine_refuses_what_it_does_not_run(cpu, tmp_path: Path, field: str, value: object) -> None:
    """A config feature the engine does not run is refused naming the field, never ignored."""
    checkpoint(tmp_path, 4)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigurationError, match=field):
        Engine(tmp_path, backend=cpu)


def test_engine_refuses_a_tensor_of_the_wrong_shape(cpu, tmp_path: Path) -> None:
    """A checkpoint whose tensor disagrees with config.json is refused naming the tensor."""
    checkpoint(tmp_path, 5)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 192
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(hal_core.CheckpointError, match="gate_proj"):
        Engine(tmp_path, backend=cpu)


def assert_serves_without_torch(folder: Path, prompts: list[list[int]]) -> None:
    """A fresh interpreter serves ``prompts`` from ``folder`` with hal_core.engine, and no torch is imported."""
    code = ("import sys, hal_core\nfrom hal_core.engine import Engine\n"
            f"e = Engine({str(folder)!r}, backend=hal_core.get_backend('cpu'), group_size={GROUP})\n"
            f"print(e.generate({prompts!r}, max_new_tokens=2, stop_token_ids=()))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_engine_never_imports_torch(cpu, tmp_path: Path) -> None:
    """Serving a checkpoint with hal_core.engine imports no torch."""
    checkpoint(tmp_path, 6)
    assert_serves_without_torch(tmp_path, [[1, 2]])


def test_engine_serves_a_hugging_face_cache_snapshot(cpu, tmp_path: Path) -> None:
    """A snapshot folder of the Hugging Face cache (every file a symlink to ../../blobs/<hash>) loads; a snapshot
    linking outside its repository's blobs is refused."""
    source = tmp_path / "saved"
    checkpoint(source, 7)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for n, file in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{n}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    with Engine(source, backend=cpu, group_size=GROUP) as plain:
        want = plain.generate([[1, 2, 3]], max_new_tokens=4, stop_token_ids=())
    with Engine(snapshot, backend=cpu, group_size=GROUP) as cached:
        assert cached.generate([[1, 2, 3]], max_new_tokens=4, stop_token_ids=()) == want
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(source / "model.safetensors")
    with pytest.raises(hal_core.CheckpointError, match="leads out"):
        Engine(snapshot, backend=cpu, group_size=GROUP)


def test_quantizing_in_slices_gives_the_whole_weight_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize_rows joins slices of output columns into exactly the codes and scales of one quantize call."""
    import hal_core.engine._weights as weights_module
    from hal_core.quant import quantize

    rows = np.random.default_rng(11).standard_normal((100, 64)).astype(np.float32)  # [N, K], a checkpoint's rows
    monkeypatch.setattr(weights_module, "QUANTIZE_ROWS", 24)  # 5 slices, the last one short
    for bits in (4, 8):
        whole = quantize(rows.T, bits=bits, group_size=32)
        sliced = weights_module.quantize_rows(rows, "rows", bits=bits, group_size=32)
        assert sliced.shape == whole.shape
        assert np.array_equal(sliced.qweight, whole.qweight) and np.array_equal(sliced.scales, whole.scales)
