"""What hal-vllm's end-to-end tests share: small random-weight checkpoints, the prompts, and one vLLM engine run.

Models are built locally with transformers (a config and seeded random
weights saved to a folder; nothing is downloaded). The quantized ones are
written here in each format's own layout: GPTQ (symmetric, 4-bit, v1 zero
points stored as ``z - 1``, words packed along K) and AWQ (4-bit with zero
points, words packed along N in AWQ's nibble order), from the same codes
and scales, so both describe one dense model. An engine run generates
greedily in vLLM's usual processes (front end, engine core, workers) and
reads hal's counters in every worker through
:class:`hal_vllm.worker.HalWorkerExtension`.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROMPT_LENGTHS = (3, 17, 50, 90, 130)
HEAD_SIZE, BLOCK_SIZE = 32, 32  # of every model here
NEW_TOKENS = 12
VOCAB = 256
SEED = 1234
QUANT_GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8c + AWQ_ORDER[j]
PROJECTIONS = 4  # quantized linear layers per Llama layer in vLLM: fused QKV, output, fused gate/up, down


def llama_config(**overrides: Any) -> Any:
    """The small grouped-query Llama every Llama test uses (4 query heads, 2 KV heads, 2 layers)."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_SIZE,
                                  max_position_embeddings=512)
    fields.update(overrides)
    return LlamaConfig(**fields)


@dataclass(frozen=True)
class SavedModel:
    """A model saved to ``path``: its layers, sliding window (None: none), query heads and KV heads."""

    path: Path
    num_layers: int
    window: int | None
    heads: int
    kv_heads: int


def _saved(path: Path, config: Any, window: int | None = None) -> SavedModel:
    return SavedModel(path, config.num_hidden_layers, window, config.num_attention_heads, config.num_key_value_heads)


def save_llama(path: Path) -> SavedModel:
    """A seeded fp32 Llama saved to ``path``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    config = llama_config()
    LlamaForCausalLM(config).save_pretrained(path)
    return _saved(path, config)


def save_qwen2_window(path: Path) -> SavedModel:
    """A seeded fp32 Qwen2 with one KV head and a 24-token sliding window on every layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                         use_sliding_window=True, sliding_window=24, max_window_layers=0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return _saved(path, config, config.sliding_window)


def pack_along_n(codes: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 words ``[rows, N/8]``: nibble j of word [r, c] holds ``codes[r, 8c + order[j]]``."""
    rows, n = codes.shape
    grouped = codes.reshape(rows, n // 8, 8)[:, :, list(order)].astype(np.uint32)
    return (grouped << (4 * np.arange(8, dtype=np.uint32))).sum(axis=2, dtype=np.uint32).view(np.int32)


def save_quantized_llama(path: Path, method: str, config: Any = None, group_size: int = QUANT_GROUP) -> int:
    """An fp16 Llama whose projections are a ``method`` ("gptq" or "awq") checkpoint; returns its layer count.

    The model is ``config`` (a transformers ``LlamaConfig``; default
    :func:`llama_config`) with seeded random weights. Each projection
    ``W [K, N]`` is quantized to 4 bits in groups of ``group_size`` along K
    (symmetric for GPTQ, with zero points for AWQ) and written in the
    format's own tensors; everything else is fp16.
    """
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from hal_core.quant import quantize

    if method not in ("gptq", "awq"):
        raise ValueError(f"method must be 'gptq' or 'awq', got {method!r}")
    torch.manual_seed(SEED)
    config = llama_config() if config is None else config
    config.dtype = "float16"
    tensors = {}
    for name, tensor in LlamaForCausalLM(config).state_dict().items():
        if not name.endswith("_proj.weight"):
            tensors[name] = tensor.to(torch.float16).contiguous()
            continue
        weight = quantize(tensor.T.double().numpy(), bits=4, group_size=group_size, symmetric=method == "gptq")
        k, n = weight.shape
        base = name.removesuffix(".weight")
        tensors[f"{base}.scales"] = torch.from_numpy(weight.scales.astype(np.float16))
        if method == "gptq":
            tensors[f"{base}.qweight"] = torch.from_numpy(weight.qweight.view(np.int32).copy())  # hal's packing
            tensors[f"{base}.qzeros"] = torch.full((k // group_size, n // 8), 0x77777777, dtype=torch.int32)
            tensors[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // group_size
        else:
            codes = weight.codes().astype(np.int64)
            tensors[f"{base}.qweight"] = torch.from_numpy(pack_along_n(codes, AWQ_ORDER))
            tensors[f"{base}.qzeros"] = torch.from_numpy(pack_along_n(weight.zeros.astype(np.int64), AWQ_ORDER))
    save_file(tensors, str(path / "model.safetensors"))
    saved = config.to_dict()
    saved["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True}
        if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"})
    (path / "config.json").write_text(json.dumps(saved))
    return config.num_hidden_layers


def vllm_has_cpu_int4_kernel() -> bool:
    """Whether vLLM's CPU build has its own int4 GEMM on this CPU (``cpu_gemm_wna16``, what its
    ``CPUWNA16LinearKernel`` calls): the build vLLM loads for a CPU without AVX-512 (``vllm._C_AVX2``) has none."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # what each vLLM worker does first: this CPU's build of vLLM's kernels
    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def prompts() -> list[Any]:
    """Five token prompts of :data:`PROMPT_LENGTHS`, seeded."""
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(SEED)
    return [TokensPrompt(prompt_token_ids=rng.integers(1, VOCAB, n).tolist()) for n in PROMPT_LENGTHS]


def engine_options(path: Path, **overrides: Any) -> dict[str, Any]:
    """``LLM(...)`` arguments: fp32, eager, chunked prefill in 32-token steps, a 32 MiB cache, hal's extension."""
    options: dict[str, Any] = dict(
        model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
        enable_chunked_prefill=True, max_num_batched_tokens=32, block_size=BLOCK_SIZE, kv_cache_memory_bytes=32 << 20,
        seed=SEED, worker_extension_cls="hal_vllm.worker.HalWorkerExtension",
    )
    options.update(overrides)
    return options


def generate(path: Path, *, env: dict[str, str], logprobs: int | None = None,
             **options: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    """Greedy generation of :func:`prompts` on a fresh engine with ``env`` set (its processes inherit it).

    Returns vLLM's outputs (with the prompts' log-probabilities, and the
    ``logprobs`` most likely tokens of each generated position where given) and one
    :meth:`~hal_vllm.worker.HalWorkerExtension.hal_stats` report per worker.
    ``env`` is restored afterwards; the engine's processes end before this returns.
    """
    from vllm import LLM, SamplingParams

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        llm = LLM(**engine_options(path, **options))
        try:
            outputs = llm.generate(prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                             detokenize=False, prompt_logprobs=0,
                                                             logprobs=logprobs))
            reports = llm.collective_rpc("hal_stats")
        finally:
            llm.llm_engine.engine_core.shutdown()  # its processes end now, not when the object is collected
            del llm
            gc.collect()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return outputs, reports


def tokens(outputs: list[Any]) -> list[list[int]]:
    """The generated token ids of each prompt."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def first_divergence(expected: list[Any], outputs: list[Any]) -> list[tuple[int, int] | None]:
    """Per prompt, where two greedy runs first chose different tokens (``(position, rank)``: the rank of each
    run's token among the other run's top log-probabilities, the larger), or None where they agree throughout.

    Two kernels that round differently may break a near tie the other way; from there the sequences differ.
    Where a run's token is missing from the other's top list, the rank is the list's length.
    """
    found: list[tuple[int, int] | None] = []
    for mine, theirs in zip(outputs, expected, strict=True):
        a, b = mine.outputs[0], theirs.outputs[0]
        position = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), None)
        if position is None:
            found.append(None)
            continue
        ranks = []
        pairs = ((a.token_ids[position], b.logprobs[position]), (b.token_ids[position], a.logprobs[position]))
        for token, top in pairs:
            ordered = sorted(top, key=lambda t: -top[t].logprob)
            ranks.append(ordered.index(token) if token in ordered else len(ordered))
        found.append((position, max(ranks)))
    return found


def prompt_logprobs(outputs: list[Any]) -> np.ndarray:
    """The log-probability each run gave every prompt token after the first."""
    return np.array([next(iter(step.values())).logprob for o in outputs for step in o.prompt_logprobs[1:]])
