"""What int8 activations (W4A8) cost in accuracy against float ones (W4A16), the weights int4 either way.

The random-weight Llamas of ``benchmarks/lm_head_accuracy.py`` (its :data:`CONFIGS`, fp32, seeded), each
also with *outlier channels*: four hidden channels of every RMSNorm weight scaled by 50, so that the
projections' inputs carry a few large channels as real models' activations do (per-token int8
quantisation then spends its range on them). Each variant is the float model through
:func:`hal_core.torch.quantize_model` with ``bits=4`` and ``activations`` ``"float"`` (W4A16) or ``"int8"``
(W4A8), everything else at its default.

Against the float model on the same random token sequences (teacher forcing, every position; each
position's activations are quantised per token, as in a decode step): ``KL(float || variant)`` (mean and
max), top-1 and top-5 agreement; and greedy generation from short prompts (tokens equal to the float
model's, and W4A8's equal to W4A16's). Accuracy only: nothing is timed.

Usage: ``python benchmarks/activation_accuracy.py [--out benchmarks/results/...json]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

from hal_core.torch import quantize_model

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lm_head_accuracy", ROOT / "benchmarks" / "lm_head_accuracy.py")
assert _spec is not None and _spec.loader is not None
_lm_head = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lm_head)

#: variant -> the QuantLinear layers' ``activations``.
VARIANTS = {"int4 W4A16": "float", "int4 W4A8": "int8"}
#: How much the outlier channels' norm weights are scaled, and how many channels.
OUTLIER_SCALE, OUTLIER_CHANNELS = 50.0, 4


def build(config: dict[str, Any], seed: int, outliers: bool) -> torch.nn.Module:
    """The float model; with ``outliers``, every RMSNorm's weight scaled by OUTLIER_SCALE on a few channels."""
    model = _lm_head.build(config, seed)
    if outliers:
        channels = torch.randperm(config["hidden_size"], generator=torch.Generator().manual_seed(seed + 7))
        with torch.no_grad():
            for name, module in model.named_modules():
                if type(module).__name__.endswith("RMSNorm") and name != "model.norm":
                    module.weight[channels[:OUTLIER_CHANNELS]] *= OUTLIER_SCALE
    return model


def measure(name: str, config: dict[str, Any], outliers: bool, args: argparse.Namespace) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, config["vocab_size"], (args.batch, args.seq_len), generator=generator)
    prompts = tokens[:, :args.prompt_len]
    reference = build(config, args.seed, outliers)
    with torch.no_grad():
        float_logits = reference(tokens).logits.double()
    float_tokens = _lm_head.greedy(reference, prompts, args.new_tokens)
    rows: dict[str, Any] = {}
    generated: dict[str, torch.Tensor] = {}
    for variant, activations in VARIANTS.items():
        model = build(config, args.seed, outliers)
        quantize_model(model, bits=4, group_size=args.group_size, activations=activations)
        with torch.no_grad():
            logits = model(tokens).logits.double()
        metrics = _lm_head.logit_agreement(float_logits, logits)
        generated[variant] = _lm_head.greedy(model, prompts, args.new_tokens)
        rows[variant] = {
            "kl_mean": round(float(metrics["kl"].mean()), 6), "kl_max": round(float(metrics["kl"].max()), 6),
            "top1": round(float(metrics["top1"].mean()), 4), "top5": round(float(metrics["top5"].mean()), 4),
            "greedy_match": round(float((generated[variant] == float_tokens).double().mean()), 4)}
        print(f"{name:28} {variant:11} KL {rows[variant]['kl_mean']:.5f} (max {rows[variant]['kl_max']:.5f})  "
              f"top-1 {rows[variant]['top1']:.1%}  top-5 {rows[variant]['top5']:.1%}  "
              f"greedy {rows[variant]['greedy_match']:.1%}", flush=True)
    a16, a8 = generated["int4 W4A16"], generated["int4 W4A8"]
    return {"outliers": outliers, "variants": rows,
            "w4a8_greedy_equal_to_w4a16": round(float((a8 == a16).double().mean()), 4),
            "kl_ratio_w4a8_over_w4a16": round(rows["int4 W4A8"]["kl_mean"] / max(rows["int4 W4A16"]["kl_mean"], 1e-12),
                                              3)}


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
    models = {}
    for name, config in _lm_head.CONFIGS.items():
        for outliers in (False, True):
            label = f"{name}{' + outliers' if outliers else ''}"
            models[label] = measure(label, config, outliers, args)
    report = {"date": datetime.date.today().isoformat(), "commit": _lm_head.commit(), "machine": _lm_head.machine(),
              "torch": torch.__version__,
              "what": "benchmarks/activation_accuracy.py: " + (__doc__ or "").split("\n\n")[0],
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "models": models}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
