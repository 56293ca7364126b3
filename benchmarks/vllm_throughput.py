"""vLLM throughput with hal's attention against vLLM's own CPU attention: same model, same load, one run.

A random-weight Llama-shaped model is built locally (transformers config +
seeded weights in a temporary folder); ``--sliding-window N`` builds the same
shape as a Mistral model whose layers attend to the last N tokens. Each round starts one engine per
side (``HAL_VLLM=0``: vLLM's CPU backend; ``HAL_VLLM=1``: hal), warms it
up, then times ``LLM.generate`` over two loads, greedy:

- **decode-heavy**: many short prompts, many new tokens each;
- **prefill-heavy**: long prompts, a few new tokens each (chunked prefill).

Rounds alternate the sides so a burst of load on a shared machine hits
both; each figure is the best round's. Prompt tokens/s counts the prompts'
tokens over the load's wall time, generated tokens/s the new tokens; the
ratio is hal over vLLM. Both sides produce the same tokens in fp32 (checked
and reported). The report (JSON: date, commit, machine, versions, figures)
goes to ``--json``.

Quantized checkpoints: ``--quant gptq`` or ``--quant awq`` writes the
model's projections as a 4-bit checkpoint of that format (groups of
``--group-size``; the writer of hal-vllm's tests, ``vllm_engines``), fp16
or bf16 only. The ``vllm`` side is then vLLM's own int4 kernel; with
``--baseline hal-attention`` it keeps hal's attention and gives only the
linear layers back to vLLM (``VLLM_DISABLED_KERNELS=HalWNA16LinearKernel``),
so the ratio is that of the int4 GEMMs alone. ``--int4-activations`` sets the
hal side's ``HAL_VLLM_INT4_ACTIVATIONS``: ``auto`` (the plugin's default: W4A8
from two rows), ``int8`` or ``float`` (W4A16, the arithmetic of vLLM's own
kernel where it does not take its AMX W4A8 path).

Mixture of experts: ``--moe`` builds a Mixtral of the given shape with
``--experts`` experts of ``--expert-intermediate`` columns, ``--top-k`` per
token (fp16 only), written twice by hal-vllm's test writer
(``vllm_moe_models``): as a 4-bit GPTQ checkpoint (AWQ with ``--quant
awq``), which the hal side serves (its MoE layers on hal's ``fused_moe``,
its projections on hal's int4 GEMM), and as its dense fp16 twin (every
projection dequantized), which the ``vllm`` side serves with vLLM's own
kernels. vLLM 0.32's CPU build has no int4 MoE kernel on a CPU without AMX,
so its fp16 model is the peer there; the two sides' tokens are reported,
not expected equal (int4 against fp16 arithmetic).

Tensor parallelism: ``--tensor-parallel-size 2`` runs each side with two
ranks (vLLM's multi-process executor); bind each rank to its own cores with
vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` (one core list per rank, e.g.
``0-15|16-31``) and hal-cpu follows each rank's binding (its threads default
to the cores the process may run on; ``HAL_CPU_THREADS`` caps them). hal's
counters and CPUs are reported per rank.

Usage (in the environment ``make test-vllm`` builds)::

    .venv-vllm/bin/python benchmarks/vllm_throughput.py --json benchmarks/results/DATE-MACHINE-vllm.json
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --quant gptq --dtype float16 --json ...
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --moe --dtype float16 --hidden 2048 --heads 16 \
        --kv-heads 4 --head-size 128 --json ...
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --quant awq --dtype float16 --baseline hal-attention --json ...
    VLLM_CPU_OMP_THREADS_BIND='0-15|16-31' .venv-vllm/bin/python benchmarks/vllm_throughput.py \
        --tensor-parallel-size 2 --json ...
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIDES = ("vllm", "hal")


QUANT_WRITER = Path(__file__).resolve().parent.parent / "plugins" / "hal_vllm" / "tests"


def _model(path: Path, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                 head_dim=args.head_size, max_position_embeddings=args.max_model_len)
    if args.sliding_window:  # Mistral: every layer attends to the last `sliding_window` tokens
        from transformers import MistralConfig, MistralForCausalLM

        MistralForCausalLM(MistralConfig(**shape, sliding_window=args.sliding_window)).save_pretrained(path)
        return
    config = LlamaConfig(**shape)
    if args.quant == "none":
        LlamaForCausalLM(config).save_pretrained(path)
        return
    sys.path.insert(0, str(QUANT_WRITER))
    from vllm_engines import save_quantized_llama

    save_quantized_llama(path, args.quant, config, group_size=args.group_size)


def _moe_models(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The ``--quant`` Mixtral (the hal side's) and its dense fp16 twin (the vllm side's), by side."""
    sys.path.insert(0, str(QUANT_WRITER))
    from vllm_moe_models import MoeShape, save_moe_checkpoints

    shape = MoeShape(hidden=args.hidden, intermediate=args.expert_intermediate, experts=args.experts,
                     top_k=args.top_k, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                     head_size=args.head_size, vocab=args.vocab, max_model_len=args.max_model_len)
    quantized, dense = save_moe_checkpoints(root, args.quant, shape, group_size=args.group_size)
    return {"hal": quantized, "vllm": dense}


def _side_env(side: str, args: argparse.Namespace) -> dict[str, str]:
    """The environment of one side's engine (its processes inherit it)."""
    if side == "hal":
        return {"HAL_VLLM": "1", "VLLM_DISABLED_KERNELS": "", "HAL_VLLM_INT4_ACTIVATIONS": args.int4_activations}
    if args.baseline == "hal-attention":
        return {"HAL_VLLM": "1", "VLLM_DISABLED_KERNELS": "HalWNA16LinearKernel"}
    return {"HAL_VLLM": "0", "VLLM_DISABLED_KERNELS": ""}


def _loads(args: argparse.Namespace) -> dict[str, tuple[list[list[int]], int]]:
    import numpy as np

    rng = np.random.default_rng(0)

    def prompts(count: int, length: int) -> list[list[int]]:
        return [rng.integers(1, args.vocab, length).tolist() for _ in range(count)]

    return {
        "decode-heavy": (prompts(args.decode_seqs, args.decode_prompt), args.decode_tokens),
        "prefill-heavy": (prompts(args.prefill_seqs, args.prefill_prompt), args.prefill_tokens),
    }


def _measure(side: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One engine of ``side``: a warm-up, then each load timed once."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ.update(_side_env(side, args))  # the engine's processes inherit it
    parallel: dict[str, Any] = {}
    if args.tensor_parallel_size > 1:
        parallel = {"tensor_parallel_size": args.tensor_parallel_size, "distributed_executor_backend": "mp"}
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=args.dtype, max_model_len=args.max_model_len,
              enable_chunked_prefill=True, max_num_batched_tokens=args.batched_tokens, block_size=args.block_size,
              kv_cache_memory_bytes=args.kv_cache_mib << 20, seed=0, enforce_eager=args.eager,
              worker_extension_cls="hal_vllm.worker.HalWorkerExtension", **parallel)
    results: dict[str, Any] = {}
    try:
        warm = [TokensPrompt(prompt_token_ids=list(range(1, 65)))] * 4
        llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, detokenize=False), use_tqdm=False)
        for name, (prompts, new_tokens) in _loads(args).items():
            params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, detokenize=False)
            start = time.perf_counter()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            generated = sum(len(o.outputs[0].token_ids) for o in outputs)
            results[name] = {"seconds": seconds, "prompt_tokens": sum(map(len, prompts)), "generated_tokens": generated,
                             "prompt_tok_s": sum(map(len, prompts)) / seconds, "generated_tok_s": generated / seconds,
                             "tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        reports = llm.collective_rpc("hal_stats")  # one per rank
        results["hal_stats"] = [report["stats"] for report in reports]
        results["worker_cpus"] = [report["cpus"] for report in reports]  # both sides' workers must be bound alike
        results["linear_kernels"] = sorted({kernel for report in reports for kernel in report["linear"].values()})
        results["moe_methods"] = sorted({method for report in reports for method in report["moe"].values()})
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return results


def _git(*argv: str) -> str:
    try:
        return subprocess.run(["git", *argv], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _machine() -> dict[str, Any]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(),
            "load_average_at_start": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batched-tokens", type=int, default=512, help="vLLM's max_num_batched_tokens")
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--decode-seqs", type=int, default=16)
    parser.add_argument("--decode-prompt", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-prompt", type=int, default=1024)
    parser.add_argument("--prefill-tokens", type=int, default=4)
    parser.add_argument("--sliding-window", type=int, default=0,
                        help="a Mistral model whose layers attend to this many tokens (0: the Llama model)")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile) on both sides")
    parser.add_argument("--quant", default="none", choices=("none", "gptq", "awq"),
                        help="write the projections as a 4-bit checkpoint of this format (fp16/bf16)")
    parser.add_argument("--group-size", type=int, default=128, help="the quantized checkpoint's group size")
    parser.add_argument("--int4-activations", default="auto", choices=("float", "auto", "int8"),
                        help="the hal side's HAL_VLLM_INT4_ACTIVATIONS (its int4 layers' activation precision)")
    parser.add_argument("--baseline", default="vllm", choices=("vllm", "hal-attention"),
                        help="the vllm side: vLLM's own kernels, or hal's attention with vLLM's int4 linear layers")
    parser.add_argument("--moe", action="store_true",
                        help="a Mixtral: GPTQ (--quant awq: AWQ) int4 on the hal side, its dense fp16 twin on vLLM's")
    parser.add_argument("--experts", type=int, default=64, help="--moe: experts per layer")
    parser.add_argument("--top-k", type=int, default=8, help="--moe: experts per token")
    parser.add_argument("--expert-intermediate", type=int, default=768, help="--moe: each expert's columns")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per side (vLLM's mp executor)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--note", default="", help="what the report should say about this run (kept in the JSON)")
    args = parser.parse_args()
    if args.moe and args.quant == "none":
        args.quant = "gptq"  # the MoE model's format
    if args.quant != "none" and args.dtype == "float32":
        parser.error(f"--quant {args.quant} needs --dtype float16 or bfloat16 (vLLM's int4 layers take no fp32)")
    if args.baseline == "hal-attention" and args.quant == "none":
        parser.error("--baseline hal-attention compares int4 linear layers: give --quant gptq or awq")
    if args.sliding_window and args.quant != "none":
        parser.error("--sliding-window builds a float Mistral model: leave --quant at none")
    if args.sliding_window < 0:
        parser.error(f"--sliding-window must be 0 (none) or positive, got {args.sliding_window}")
    if args.moe and (args.sliding_window or args.dtype != "float16" or args.baseline != "vllm"):
        parser.error("--moe compares a quantized and a dense fp16 model: give --dtype float16, no window or baseline")
    if args.tensor_parallel_size < 1:
        parser.error(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")

    import vllm

    import hal_core

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        if args.moe:
            paths = _moe_models(path, args)
        else:
            _model(path, args)
            paths = {side: path for side in SIDES}
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            rounds.append({side: _measure(side, paths[side], args) for side in order})
    summary: dict[str, Any] = {}
    for load in ("decode-heavy", "prefill-heavy"):
        best = {side: {key: max(rnd[side][load][key] for rnd in rounds) for key in ("prompt_tok_s", "generated_tok_s")}
                for side in SIDES}
        summary[load] = {
            **{f"{side}_{key}": value for side in SIDES for key, value in best[side].items()},
            "ratio_prompt_tok_s": best["hal"]["prompt_tok_s"] / best["vllm"]["prompt_tok_s"],
            "ratio_generated_tok_s": best["hal"]["generated_tok_s"] / best["vllm"]["generated_tok_s"],
            "same_tokens": all(rnd["hal"][load]["tokens"] == rnd["vllm"][load]["tokens"] for rnd in rounds),
        }
    for rnd in rounds:
        for side in SIDES:
            for load in ("decode-heavy", "prefill-heavy"):
                del rnd[side][load]["tokens"]
    report = {
        "date": datetime.date.today().isoformat(), "commit": _git("rev-parse", "HEAD"),
        "commit_subject": _git("log", "-1", "--format=%s"), "machine": _machine(),
        "versions": {"vllm": vllm.__version__, "hal_core": hal_core.__version__},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "note"},
        "note": args.note, "summary": summary, "rounds": rounds,
    }
    print(f"{'load':15} {'side':5} {'prompt tok/s':>13} {'generated tok/s':>16}")
    for load, row in summary.items():
        for side in SIDES:
            print(f"{load:15} {side:5} {row[f'{side}_prompt_tok_s']:13.1f} {row[f'{side}_generated_tok_s']:16.1f}")
        print(f"{load:15} {'hal/vLLM':5} {row['ratio_prompt_tok_s']:12.2f}x {row['ratio_generated_tok_s']:15.2f}x"
              f"   same tokens: {row['same_tokens']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
