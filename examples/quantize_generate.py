"""A Hugging Face Llama quantized to int4 through hal: how far its logits move from float, and its memory.

The float model is a small random Llama built from a config (nothing is
downloaded; weights of std ``1/sqrt(hidden)`` unless ``--init-std`` says
otherwise, so a layer neither amplifies nor damps its input), or a float
checkpoint directory given with ``--model`` (what ``save_pretrained``
writes). It generates greedily in float; then
:func:`hal_core.torch.quantize_model` replaces every linear layer by a
:class:`hal_core.torch.QuantLinear` (W4A16 through
``torch.ops.hal.quantized_gemm``, ``--bits 8`` for W8A8; ``lm_head`` at
``--lm-head-bits``, 8 by default, or ``float``), and the quantized model
reads the float model's tokens (teacher forcing) and generates again. All
runs use ``attn_implementation="hal"`` with a
:class:`hal_core.torch.transformers.HalPagedCache`, so only the linear
layers differ.

    python examples/quantize_generate.py
    python examples/quantize_generate.py --layers 8 --hidden 512 --new-tokens 32 --group-size 64
    python examples/quantize_generate.py --model path/to/float-llama --dtype bf16 --lm-head-bits float

Prints the memory of each model (its tensors' bytes and the process's
resident memory after it is built), then, at each generated position, how
the quantized model's next-token distribution compares with the float
model's on the same tokens: the KL divergence ``KL(float || quantized)`` in
nats, top-1 agreement (same most likely token) and top-5 agreement (the
share of the float model's 5 most likely tokens among the quantized
model's 5), averaged over the batch; and the greedy tokens of both. A
greedy run compounds the first flipped token (everything after it has
other inputs), so token matching says little; the logit-level figures
measure every position on the same inputs. A random model's most likely
tokens are close together (near ties), so its top-1 agreement is low even
where the KL is small: a trained checkpoint (``--model``) gives the figures
that matter. hal's arithmetic itself is checked against float64
models of the same quantized weights in tests/test_torch_quantize_model.py.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hal_core.torch as hal_torch
import hal_core.torch.transformers as hal_hf

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (tied tensors once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def rss_mb() -> float:
    """The process's resident memory now (Linux), else its peak so far."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux, bytes on macOS


def _cache(model: torch.nn.Module, batch: int, tokens: int, block_size: int) -> hal_hf.HalPagedCache:
    blocks = batch * -(-tokens // block_size)
    return hal_hf.HalPagedCache(model.config, num_blocks=blocks, block_size=block_size, dtype=model.dtype)


def generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, block_size: int) -> tuple[torch.Tensor, float]:
    """Greedy tokens through hal's paged cache, and the tokens/s of the whole generate call."""
    cache = _cache(model, ids.shape[0], ids.shape[1] + new_tokens, block_size)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    cache.close()
    return out[:, ids.shape[1]:], ids.shape[0] * new_tokens / seconds


def next_token_logits(model: torch.nn.Module, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """The logits ``[batch, tokens, vocab]`` (float64) of one prefill of ``ids`` through hal's paged cache."""
    cache = _cache(model, ids.shape[0], ids.shape[1], block_size)
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True).logits
    cache.close()
    return logits.double()


def logit_agreement(reference: torch.Tensor, other: torch.Tensor, k: int = 5) -> dict[str, torch.Tensor]:
    """Per position ``[batch, positions]``: ``KL(reference || other)`` (nats), top-1 and top-``k`` agreement.

    Top-``k`` agreement is the share of ``reference``'s ``k`` most likely
    tokens that are among ``other``'s ``k`` most likely.
    """
    log_p, log_q = torch.log_softmax(reference.double(), -1), torch.log_softmax(other.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top1 = (reference.argmax(-1) == other.argmax(-1)).double()
    ref_k, other_k = reference.topk(k, -1).indices, other.topk(k, -1).indices
    topk = (ref_k.unsqueeze(-1) == other_k.unsqueeze(-2)).any(-1).double().mean(-1)
    return {"kl": kl, "top1": top1, f"top{k}": topk}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", help="a float checkpoint directory (default: a random Llama from a config)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--init-std", type=float, help="the random model's weight std (default 1/sqrt(hidden): "
                        "each layer keeps its input's scale)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--lm-head-bits", choices=("4", "8", "float"), default="8",
                        help="lm_head's format (default 8: W8A8, quantize_model's default)")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, help="torch's intra-op threads (default: torch's choice)")
    args = parser.parse_args(argv)

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)  # on a busy host, torch's OpenMP threads wait for each other
    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                     attn_implementation=hal_hf.ATTN_IMPLEMENTATION)
        source = args.model
    else:
        config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=1024, initializer_range=args.init_std or args.hidden ** -0.5)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=hal_hf.ATTN_IMPLEMENTATION)
        source = f"a random Llama ({args.layers} layers, hidden {args.hidden}, seed {args.seed})"
    model.eval()
    float_rss = rss_mb()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len))

    generate(model, ids[:, :2], 2, args.block_size)  # warm-up: first calls set up kernels and caches
    float_tokens, float_rate = generate(model, ids, args.new_tokens, args.block_size)
    text = torch.cat([ids, float_tokens], dim=1)[:, :-1]  # the float model's tokens; each position predicts the next
    float_logits = next_token_logits(model, text, args.block_size)[:, args.prompt_len - 1:]
    float_bytes = model_bytes(model)

    lm_head = "float" if args.lm_head_bits == "float" else f"int{args.lm_head_bits}"
    skip, layer_bits = (["lm_head"], None) if lm_head == "float" else ((), {"lm_head": int(args.lm_head_bits)})
    report = hal_torch.quantize_model(model, bits=args.bits, group_size=args.group_size, layer_bits=layer_bits,
                                      skip=skip, progress=True)  # a progress bar on stderr
    quant_bytes, quant_rss = model_bytes(model), rss_mb()
    quant_logits = next_token_logits(model, text, args.block_size)[:, args.prompt_len - 1:]
    generate(model, ids[:, :2], 2, args.block_size)
    quant_tokens, quant_rate = generate(model, ids, args.new_tokens, args.block_size)

    name = f"int{args.bits}"
    print(f"{source}, {args.dtype}, batch {args.batch}, prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens per row")
    print(f"quantized {len(report.quantized)} linear layers to {name}, lm_head {lm_head} "
          f"(group size {args.group_size}); left in float: {', '.join(report.skipped) or 'none'}")
    print(f"  linear weights: {report.float_bytes / 1e6:.2f} MB float -> {report.quantized_bytes / 1e6:.2f} MB "
          f"quantized ({report.float_bytes / max(report.quantized_bytes, 1):.1f}x smaller)")
    print(f"  whole model:    {float_bytes / 1e6:.2f} MB float -> {quant_bytes / 1e6:.2f} MB quantized; "
          f"process RSS {float_rss:.0f} MB with the float model, {quant_rss:.0f} MB once quantized")
    print(f"  tokens/s (generate, hal attention): float {float_rate:.1f}, {name} {quant_rate:.1f}")

    metrics = logit_agreement(float_logits, quant_logits)
    print(f"{name} against float, on the float model's tokens (mean over {args.batch} rows):")
    print("  position   KL (nats)   top-1   top-5")
    for pos in range(args.new_tokens):
        print(f"  {pos:>8}   {float(metrics['kl'][:, pos].mean()):9.5f}   {float(metrics['top1'][:, pos].mean()):5.0%}"
              f"   {float(metrics['top5'][:, pos].mean()):5.0%}")
    print(f"  all        {float(metrics['kl'].mean()):9.5f}   {float(metrics['top1'].mean()):5.0%}   "
          f"{float(metrics['top5'].mean()):5.0%}   (max KL {float(metrics['kl'].max()):.5f})")

    same = quant_tokens == float_tokens
    prefix = [int(row.cumprod(0).sum()) for row in same.int()]
    for row in range(args.batch):
        print(f"  row {row}: float {float_tokens[row].tolist()}")
        print(f"         {name}  {quant_tokens[row].tolist()}")
    print(f"{name} greedy tokens matching float: {int(same.sum())}/{same.numel()} "
          f"(leading run per row: {prefix}; after the first flip the inputs differ)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
