"""``hal bench --model`` on a MoE model: a tiny random Qwen3-MoE end to end through the CLI (its experts quantized
and run by QuantMoE), the decode limit's active-expert bytes against an independent count, refused combinations."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

from hal_core.bench import BenchArgumentError  # noqa: E402
from hal_core.bench._model_spec import BUILTIN_MODELS, active_experts, resolve_model  # noqa: E402
from hal_core.cli import main  # noqa: E402

PROMPT, NEW, BATCHES = 16, 4, (1, 3)
CONTENDERS = ("sdpa-fp32", "hal-fp32", "hal-int4", "engine-int4")


def _meta_model() -> Any:
    config = dict(BUILTIN_MODELS["tiny-moe"])
    config.pop("model_type")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**config))


def _step_bytes(model: Any, bits: int | None, size: int, batch: int, context: int) -> float:
    """One decode step's reads counted from the model's own modules: every linear layer (but the experts) in the
    contender's format (lm_head int8 when quantized), norms and routers in its dtype, the expected routed experts,
    the KV."""
    c = model.config
    total = 0.0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            k, n = module.in_features, module.out_features
            layer_bits = 8 if bits is not None and name == "lm_head" else bits  # quantize_model's int8 lm_head
            total += (k * n * layer_bits // 8 + (k // 128) * n * 2) if layer_bits else k * n * size
        elif type(module).__name__.endswith(("RMSNorm", "Router")):  # norms (q/k per head too) and routers
            total += module.weight.numel() * size
        elif type(module).__name__.endswith("Experts"):
            e, k, n = module.gate_up_proj.shape[0], c.hidden_size, c.moe_intermediate_size
            one = sum((a * b * bits // 8 + (a // 128) * b * 2) if bits else a * b * size
                      for a, b in ((k, n), (k, n), (n, k)))
            hit = 1 - math.comb(e - 1, c.num_experts_per_tok) / math.comb(e, c.num_experts_per_tok)
            total += round(e * (1 - (1 - hit) ** batch) * one)
    kv = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * size * context
    return total + batch * (c.hidden_size * size + kv)


def test_tiny_moe_model_end_to_end(tmp_path: Path, rng: np.random.Generator,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The contenders run; hal-int4 holds QuantMoE blocks and the engine (no torch) serves the same GPTQ model; fp32
    through hal equals transformers' sdpa; each decode limit is the bytes counted from the model over the measured
    copy bandwidth."""
    seed = int(rng.integers(0, 2**31))
    print(f"model seed {seed}")
    out = tmp_path / "model.json"
    code = main(["bench", "--model", "tiny-moe", "--contenders", ",".join(CONTENDERS), "--prompt-len", str(PROMPT),
                 "--new-tokens", str(NEW), "--batches", ",".join(map(str, BATCHES)), "--seed", str(seed),
                 "--threads", "2", "--quick", "--json", str(out), "-q"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["model"]["experts"] == 8 and report["model"]["experts_per_token"] == 2
    by_name = {c["name"]: c for c in report["contenders"]}
    assert list(by_name) == list(CONTENDERS) and not any("error" in c for c in by_name.values())
    assert (by_name["hal-int4"]["moe_blocks"], by_name["hal-int4"]["quantized_layers"]) == (2, 9)  # 2 x qkvo + lm_head
    assert by_name["hal-fp32"]["moe_blocks"] == 0
    assert by_name["engine-int4"]["quantized_layers"] == 2 * (2 + 2 * 8) + 1  # qkv, o, each expert's two; lm_head
    model, copy = _meta_model(), report["limits"]["copy"]["gbps"] * 1e9
    for name, c in by_name.items():
        bits, size = (4, 2) if name.endswith("int4") else (None, 4)
        for batch in BATCHES:
            seconds = sum(_step_bytes(model, bits, size, batch, PROMPT + i) for i in range(1, NEW + 1)) / copy
            assert c["decode"][str(batch)]["limit_tokens_per_s"] == pytest.approx(batch * NEW / seconds, rel=1e-9)
    for batch in BATCHES:
        assert by_name["hal-fp32"]["tokens"][str(batch)] == by_name["sdpa-fp32"]["tokens"][str(batch)]


@pytest.mark.parametrize("batch", [1, 2, 8, 64])
def test_active_experts_is_the_expected_number_of_distinct_experts_hit(batch: int) -> None:
    """E * (1 - (1 - k/E)^b) against the exact expectation over all routings of b tokens (k of E each)."""
    spec = resolve_model("tiny-moe")
    e, k = spec.experts, spec.top_k
    miss_one = math.comb(e - 1, k) / math.comb(e, k)  # one token misses a given expert
    assert active_experts(spec, batch) == pytest.approx(e * (1 - miss_one ** batch), rel=1e-12)
    assert active_experts(spec, 1) == pytest.approx(k)


def test_a_moe_config_with_dense_layers_is_refused(tmp_path: Path) -> None:
    """A Qwen3-MoE config with dense layers (mlp_only_layers) is refused naming --model."""
    config = dict(BUILTIN_MODELS["tiny-moe"], mlp_only_layers=[1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BenchArgumentError, match=r"argument --model: .*every layer a MoE block"):
        resolve_model(str(tmp_path))
