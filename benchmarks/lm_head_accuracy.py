"""How much quantizing ``lm_head`` costs in accuracy: float vs int8 (W8A8) vs int4 (W4A16), rest of the model int4.

Random-weight Llamas built from ``hal bench``'s model specs
(:data:`hal_core.bench.BUILTIN_MODELS`: ``tiny``, and ``tiny`` with a
16x wider vocabulary and twice the hidden size, so ``lm_head`` is the
largest layer as in real small models), fp32, seeded. Each variant is the
float model with :func:`hal_core.torch.quantize_model` applied:

- ``int4 + lm_head float``: every decoder layer int4, ``lm_head`` left float;
- ``int4 + lm_head int8`` / ``int4 + lm_head int4``: the same, ``lm_head`` quantized too;
- ``lm_head int8 only`` / ``lm_head int4 only``: only ``lm_head`` quantized (its own share of the error).

Against the float model, on the same random token sequences (teacher
forcing, every position): ``KL(float || variant)`` in nats (mean and max),
top-1 agreement and top-5 agreement (the share of the float model's 5 most
likely tokens among the variant's 5; ``examples/quantize_generate.py``'s
``logit_agreement``); and greedy generation from short prompts (tokens equal
to the float model's, and the leading run). Accuracy only: nothing is timed.

Usage: ``python benchmarks/lm_head_accuracy.py [--out benchmarks/results/...json]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hal_core.bench import BUILTIN_MODELS
from hal_core.torch import QuantLinear, quantize_model

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("quantize_generate", ROOT / "examples" / "quantize_generate.py")
assert _spec is not None and _spec.loader is not None
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)
logit_agreement = _example.logit_agreement

#: The models: ``tiny`` as ``hal bench`` builds it, and a variant whose lm_head dominates the weights.
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(BUILTIN_MODELS["tiny"]),
    "tiny-wide-vocab": {**BUILTIN_MODELS["tiny"], "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1024,
                        "num_attention_heads": 4, "num_key_value_heads": 2},
}
#: The same at the ``1b`` spec's initializer range (0.02, transformers' default): layers that damp, not amplify.
CONFIGS["tiny-wide-vocab-init-0.02"] = {**CONFIGS["tiny-wide-vocab"], "initializer_range": 0.02}

#: variant -> (bits of the decoder layers or None for float, lm_head's bits or None for float).
VARIANTS: dict[str, tuple[int | None, int | None]] = {
    "int4 + lm_head float": (4, None),
    "int4 + lm_head int8": (4, 8),
    "int4 + lm_head int4": (4, 4),
    "lm_head int8 only": (None, 8),
    "lm_head int4 only": (None, 4),
}


def build(config: dict[str, Any], seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.float32,
                                            attn_implementation="eager").eval()


def quantized(config: dict[str, Any], seed: int, body: int | None, head: int | None,
              group_size: int) -> torch.nn.Module:
    """The float model with its decoder layers at ``body`` bits and ``lm_head`` at ``head`` (None: float)."""
    model = build(config, seed)
    linears = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    expected = ({"lm_head"} if head is not None else set()) | (linears - {"lm_head"} if body is not None else set())
    if body is None:  # only lm_head
        quantize_model(model, bits=head or 4, group_size=group_size, layer_bits=None,
                       skip=lambda name, linear: name != "lm_head")
    else:
        quantize_model(model, bits=body, group_size=group_size, layer_bits=None if head is None else {"lm_head": head},
                       skip=["lm_head"] if head is None else None)
    got = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert got == expected, got ^ expected
    return model


def greedy(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:]


def measure(name: str, config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq_len), generator=generator)
    prompts = tokens[:, :args.prompt_len]
    reference = build(config, args.seed)
    with torch.no_grad():
        float_logits = reference(tokens).logits.double()
    float_tokens = greedy(reference, prompts, args.new_tokens)
    float_probs = torch.softmax(float_logits, -1)
    rows: dict[str, Any] = {}
    for variant, (body, head) in VARIANTS.items():
        model = quantized(config, args.seed, body, head, args.group_size)
        with torch.no_grad():
            logits = model(tokens).logits.double()
        metrics = logit_agreement(float_logits, logits)
        tokens_q = greedy(model, prompts, args.new_tokens)
        same = tokens_q == float_tokens
        head_bytes = sum(t.numel() * t.element_size() for t in (*model.lm_head.parameters(),
                                                                  *model.lm_head.buffers()))
        rows[variant] = {
            "kl_mean": round(float(metrics["kl"].mean()), 6), "kl_max": round(float(metrics["kl"].max()), 6),
            "top1": round(float(metrics["top1"].mean()), 4), "top5": round(float(metrics["top5"].mean()), 4),
            "greedy_match": round(float(same.double().mean()), 4),
            "greedy_leading_run": [int(r.cumprod(0).sum()) for r in same.int()], "lm_head_bytes": head_bytes}
        print(f"{name:16} {variant:22} KL {rows[variant]['kl_mean']:.5f} (max {rows[variant]['kl_max']:.5f})  "
              f"top-1 {rows[variant]['top1']:.1%}  top-5 {rows[variant]['top5']:.1%}  "
              f"greedy {rows[variant]['greedy_match']:.1%}  lm_head {head_bytes / 1e6:.2f} MB", flush=True)
    return {"config": {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "initializer_range")},
            "float_top1_probability": round(float(float_probs.max(-1).values.mean()), 4),
            "float_lm_head_bytes": config["vocab_size"] * config["hidden_size"] * 4, "variants": rows}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence for the logit metrics")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = {"date": datetime.date.today().isoformat(), "commit": commit(), "machine": machine(),
              "torch": torch.__version__, "what": "benchmarks/lm_head_accuracy.py: " + (__doc__ or "").split("\n\n")[0],
              "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "metrics": {"kl": "KL(float || variant) in nats per position, over batch x seq_len teacher-forced "
                                "positions", "top1": "share of positions whose most likely token is the float one",
                          "top5": "mean share of the float model's top 5 tokens among the variant's top 5",
                          "greedy_match": "share of greedy tokens equal to the float model's (prompt_len-token "
                                          "prompts, new_tokens generated)"},
              "models": {name: measure(name, config, args) for name, config in CONFIGS.items()}}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
