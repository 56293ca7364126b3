"""The child process of ``hal bench --model``: one contender's run, or the preparation of the quantized checkpoints.

Run as ``python -m hal_core.bench._model_worker '<json task>'``; it writes JSON
lines on stdout: ``{"event": "phase", "text": ...}`` as it goes, then one
``{"event": "result", ...}``. Each contender runs in its own process so that
its peak memory (the child's high-water mark, and its anonymous memory
sampled as it runs) is its own, and one contender's allocator arenas and
threads never weigh on the next.

Tasks (the parent, :mod:`._model`, writes them):

- ``prepare``: build the seeded random fp32 model from the config, quantize
  every decoder linear layer with :func:`hal_core.quant.quantize` (symmetric,
  group-wise, float16 scales) and ``lm_head`` to int8 (what
  :func:`hal_core.torch.quantize_model` does by default; an untied one), and
  write each requested width as a GPTQ checkpoint directory (``config.json``
  with its ``quantization_config``, the int8 ``lm_head`` as a ``dynamic``
  rule; ``model.safetensors``, embeddings and norms in bf16); a MoE model is
  quantized by :func:`hal_core.torch.quantize_model` (its experts too) and
  written by :func:`hal_core.torch.save_quantized` (one layer per expert and
  projection);
- ``run``: build the contender's model (a float one from the config with the
  same seed, or :func:`hal_core.torch.load_quantized` of a checkpoint), warm
  it up, then time prefill, the first token and greedy decoding
  (:func:`greedy`). A compiled contender's forward goes under
  ``torch.compile`` and its warm-up is one untimed round of the timed
  shapes (every graph compiled there, its time reported as ``compile_s``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._worker_common import AnonSampler, emit, peak_rss_bytes, phase, prompt_array, timed_rounds

__all__ = ["build_float_model", "greedy", "main", "prompt_ids"]

_BLOCK_SIZE = 16
_WARMUP_PROMPT = 16
#: Progress lines per quantized width while preparing (the parent counts on it: :func:`._model.model_steps`).
_QUARTERS = 4


# -- models --------------------------------------------------------------------------


def _config(config: dict[str, Any], dtype: torch.dtype | None = None) -> Any:
    import transformers

    fields = dict(config)
    kind = fields.pop("model_type")
    made = transformers.AutoConfig.for_model(kind, **fields)
    if dtype is not None:
        made.dtype = dtype
    return made


def build_float_model(config: dict[str, Any], dtype: torch.dtype, seed: int,
                      attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The random model of ``config`` in ``dtype``: transformers' own initialisation after ``torch.manual_seed``."""
    import transformers

    if attn_implementation == "hal":
        from ..torch import transformers as _registers_hal  # noqa: F401
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(config), dtype=dtype,
                                                          attn_implementation=attn_implementation)
    return model.eval()


def prompt_ids(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """The prompts (:func:`._worker_common.prompt_array`) as a tensor."""
    return torch.from_numpy(prompt_array(vocab, batch, length, seed))


def _gptq_tensors(weight: Any) -> dict[str, torch.Tensor]:
    """A symmetric hal :class:`~hal_core.quant.QuantizedWeight` as GPTQ v1 stores it (qweight, qzeros, scales,
    g_idx; layouts in :mod:`hal_core.quant.gptq`)."""
    k, n = weight.shape
    bits, group = weight.bits, weight.group_size
    if weight.zeros is not None or weight.g_idx is not None:
        raise ValueError("expected a symmetric weight without act-order")
    per_word = 32 // bits
    if bits == 4:  # hal's int4 words are GPTQ's: row 8r + j at bits 4j of word [r, n]
        qweight = np.ascontiguousarray(weight.qweight).view(np.int32)
    else:  # row 4r + j at bits 8j of word [r, n]: the four bytes of a little-endian word
        codes = np.ascontiguousarray(np.asarray(weight.qweight).reshape(k // 4, 4, n).transpose(0, 2, 1))
        qweight = codes.view("<u4").reshape(k // 4, n).astype(np.uint32).view(np.int32)
    stored = (1 << (bits - 1)) - 1  # v1 stores the zero point minus one
    word = sum(stored << (bits * j) for j in range(per_word))
    qzeros = np.full((k // group, n // per_word), word, dtype=np.uint32).view(np.int32)
    return {"qweight": torch.from_numpy(np.ascontiguousarray(qweight)), "qzeros": torch.from_numpy(qzeros),
            "scales": torch.from_numpy(np.ascontiguousarray(weight.scales)),
            "g_idx": torch.from_numpy((np.arange(k) // group).astype(np.int32))}


class _Quarters:
    """A ``progress(done, total, name)`` for :func:`~hal_core.torch.quantize_model` giving :data:`_QUARTERS` phases."""

    def __init__(self, text: str) -> None:
        self.text, self.shown = text, 0

    def __call__(self, done: int, total: int, name: str) -> None:
        while self.shown < _QUARTERS and done * _QUARTERS >= (self.shown + 1) * total:
            self.shown += 1
            phase(f"{self.text}: {done}/{total} layers")

    def finish(self) -> None:
        """The phases not shown yet (every one counts in the parent's progress)."""
        for _ in range(_QUARTERS - self.shown):
            phase(self.text)
        self.shown = _QUARTERS


def _prepare_moe(task: dict[str, Any]) -> dict[str, Any]:
    """:func:`prepare` for a MoE model: the model quantized whole, experts included, then saved."""
    from ..torch import quantize_model, save_quantized

    phase("building the fp32 model to quantize")
    written = {}
    for bits in task["bits"]:
        model = build_float_model(task["config"], torch.float32, task["seed"], "eager")
        quarters = _Quarters(f"quantizing to int{bits}")
        quantize_model(model, bits=bits, group_size=task["group_size"], progress=quarters)
        quarters.finish()
        phase(f"writing the int{bits} checkpoint")
        written[str(bits)] = str(save_quantized(model, Path(task["out"]) / f"int{bits}", overwrite=True))
        del model
    return {"checkpoints": written}


def prepare(task: dict[str, Any]) -> dict[str, Any]:
    """Write one GPTQ checkpoint per entry of ``task["bits"]`` under ``task["out"]``; their paths by width."""
    from safetensors.torch import save_file

    from ..quant import quantize
    from ._model_spec import MOE_TYPES

    if task["config"]["model_type"] in MOE_TYPES:
        return _prepare_moe(task)
    phase("building the fp32 model to quantize")
    model = build_float_model(task["config"], torch.float32, task["seed"])
    tied = bool(task["config"].get("tie_word_embeddings"))
    linears = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and not (tied and name == "lm_head")]
    floats = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
              if name.rsplit(".", 1)[0] not in dict(linears)}
    written = {}
    for bits in task["bits"]:
        tensors = dict(floats)
        for i, (name, linear) in enumerate(linears):
            if i * _QUARTERS // len(linears) != (i - 1) * _QUARTERS // len(linears):  # _QUARTERS phases
                phase(f"quantizing to int{bits}: {i}/{len(linears)} layers")
            weight = quantize(linear.weight.detach().T, bits=8 if name == "lm_head" else bits,
                              group_size=task["group_size"], symmetric=True, scale_dtype=np.float16)
            tensors.update({f"{name}.{part}": t for part, t in _gptq_tensors(weight).items()})
        folder = Path(task["out"]) / f"int{bits}"
        folder.mkdir(parents=True, exist_ok=True)
        document = _config(task["config"], torch.bfloat16).to_dict()
        document["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": task["group_size"],
                                           "desc_act": False, "sym": True, "checkpoint_format": "gptq",
                                           "lm_head": not tied}
        if bits != 8 and not tied:
            document["quantization_config"]["dynamic"] = {
                "+:^lm_head$": {"bits": 8, "group_size": task["group_size"]}}
        (folder / "config.json").write_text(json.dumps(document, indent=1, default=str))
        phase(f"writing the int{bits} checkpoint")
        save_file(tensors, str(folder / "model.safetensors"))
        written[str(bits)] = str(folder)
        del tensors
    return {"checkpoints": written}


# -- timing -------------------------------------------------------------------------


def _new_cache(model: Any, attention: str, batch: int, length: int) -> Any:
    if attention != "hal":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from ..torch.transformers import HalPagedCache

    blocks = batch * -(-length // _BLOCK_SIZE)
    return HalPagedCache(model.config, num_blocks=blocks, block_size=_BLOCK_SIZE, dtype=model.dtype)


def greedy(model: torch.nn.Module, attention: str, ids: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Prefill ``ids [batch, length]`` (one forward, last logits only), then ``new_tokens`` greedy decode steps.

    Returns ``prefill_s`` (the prefill forward), ``first_s`` (it and the
    first token's argmax: the time to first token), ``step_s`` (each decode step: one forward of
    one token per sequence and its argmax) and ``tokens`` (per sequence: the
    first token, then one per step).
    """
    batch, length = ids.shape
    cache = _new_cache(model, attention, batch, length + new_tokens + 1)
    steps = []
    try:
        with torch.no_grad():
            start = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            prefill = time.perf_counter() - start
            token = out.logits[:, -1].argmax(-1)
            first = time.perf_counter() - start
            tokens = [token]
            cache = out.past_key_values
            for _ in range(new_tokens):
                start = time.perf_counter()
                out = model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1)
                steps.append(time.perf_counter() - start)
                tokens.append(token)
    finally:
        if hasattr(cache, "close"):
            cache.close()
    return {"prefill_s": prefill, "first_s": first, "step_s": steps, "tokens": torch.stack(tokens, 1).tolist()}


def _load(task: dict[str, Any]) -> torch.nn.Module:
    contender = task["contender"]
    from ..torch._dtypes import TORCH_DTYPES

    dtype = TORCH_DTYPES[contender["dtype"]]
    if contender["bits"] is None:
        return build_float_model(task["config"], dtype, task["seed"], contender["attention"])
    from ..torch import QuantLinear, load_quantized

    model = load_quantized(task["checkpoint"], dtype=dtype, attn_implementation=contender["attention"])
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.activations = contender.get("activations")
    if contender.get("kernelize"):
        from ..torch import kernelize

        kernelize(model)
    return model


def _compile(model: torch.nn.Module, backend: str) -> list[int]:
    """Put ``model.forward`` under ``torch.compile`` with ``backend``; the list returned grows by one for each graph
    compiled."""
    graphs: list[int] = []
    inner = torch._dynamo.lookup_backend(backend)

    def counting(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(len(graph.graph.nodes))
        return inner(graph, example_inputs)

    model.forward = torch.compile(model.forward, backend=counting)
    return graphs


def _model_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run(task: dict[str, Any]) -> dict[str, Any]:
    """One contender: load, warm up, then ``repeat`` rounds of prefill + decode at every batch size."""
    from ..torch import QuantLinear, QuantMoE

    contender = task["contender"]
    attention, name = contender["attention"], contender["name"]
    prompt_len, new_tokens, batches = task["prompt_len"], task["new_tokens"], task["batches"]
    torch.set_num_threads(task["threads"])
    prompts = prompt_ids(task["config"]["vocab_size"], max(batches), prompt_len, task["seed"] + 1)
    with AnonSampler() as sampler:
        phase(f"{name}: loading")
        start = time.perf_counter()
        model = _load(task)
        load_s = time.perf_counter() - start
        loaded = {"load_peak_rss_bytes": peak_rss_bytes(), "load_peak_anon_bytes": sampler.peak,
                  "after_load_anon_bytes": sampler.sample()}
        graphs = _compile(model, contender["compile"]) if contender.get("compile") else None
        phase(f"{name}: warming up" if graphs is None else f"{name}: compiling (an untimed round)")
        start = time.perf_counter()
        for batch in sorted(set(batches) | {1}):
            if graphs is None:  # a short prompt: a prefill costs as much as the decode steps
                greedy(model, attention, prompts[:batch, :_WARMUP_PROMPT], 2)
            else:  # every shape the timed rounds meet, so that they compile nothing
                greedy(model, attention, prompts[:batch], new_tokens)
        warmup_s = time.perf_counter() - start
        warm_graphs = len(graphs or ())
        timed = timed_rounds(task, name, sampler, lambda b: greedy(model, attention, prompts[:b], new_tokens))
    memory = {"peak_rss_bytes": peak_rss_bytes(), "peak_anon_bytes": sampler.peak, **loaded,
              "peak_after_batch": timed.pop("peak_after_batch")}
    return {
        "contender": name, "threads": torch.get_num_threads(), "load_s": load_s,
        "model_bytes": _model_bytes(model),
        "quantized_layers": sum(isinstance(m, QuantLinear) for m in model.modules()),
        "moe_blocks": sum(isinstance(m, QuantMoE) for m in model.modules()),
        **timed, "memory": memory,
        **({} if graphs is None else {"compile_s": warmup_s, "compiled_graphs": warm_graphs,
                                      "compiled_graphs_timed": len(graphs) - warm_graphs}),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the JSON task given as the one argument; exit status 0 with a ``result`` line, 1 on failure."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hal_core.bench._model_worker '<json task>'", file=sys.stderr)
        return 2
    task = json.loads(args[0])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = prepare(task) if task["task"] == "prepare" else run(task)
    emit("result", **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
