"""GPTQ (v1, v2) and AWQ (GEMM) checkpoints of small random Llama models, written the way the tools store them.

The packers follow the public format descriptions (the module docstrings of
``hal_core.quant.gptq`` and ``hal_core.quant.awq``) and share no code with
hal's converters: every field is a slot ``j`` of ``32 / bits`` in a word,
summed in 64-bit integers (exact). The weights are drawn as codes, zero points and
scales directly, so the float64 model of the same quantized weights
(:func:`reference_model`) is exact.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of a group of 8 held by nibble i (AutoAWQ's interleave)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_slots(slots: np.ndarray, bits: int) -> np.ndarray:
    """``slots [..., 32 / bits]`` of b-bit values to int32 words: slot ``j`` at bits ``b*j .. b*j+b-1``."""
    per_word = 32 // bits
    assert slots.shape[-1] == per_word and slots.min() >= 0 and slots.max() < (1 << bits)
    weights = np.array([1 << (bits * j) for j in range(per_word)], dtype=np.uint64)
    words = (slots.astype(np.uint64) * weights).sum(axis=-1)  # exact: every word is below 2**32
    return words.astype(np.uint32).view(np.int32)


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ ``qweight``: codes ``[K, N]`` to int32 ``[K / p, N]``, row ``p*r + j`` in slot ``j`` of word ``[r, n]``."""
    k, n = codes.shape
    per_word = 32 // bits
    return pack_slots(codes.reshape(k // per_word, per_word, n).transpose(0, 2, 1), bits)


def pack_cols(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Along N: ``[R, C]`` to int32 ``[R, C / p]``, slot ``j`` of word ``[r, c]`` holding column ``p*c + order[j]``."""
    rows, cols = values.shape
    per_word = 32 // bits
    grouped = values.reshape(rows, cols // per_word, per_word)
    return pack_slots(grouped[:, :, list(order or range(per_word))], bits)


@dataclass
class Layer:
    """One quantized linear layer: codes ``[K, N]``, true zero points and scales ``[K/G, N]``, group of each row."""

    codes: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray  # float16
    g_idx: np.ndarray

    def dequantized(self) -> np.ndarray:
        """float64 ``W [K, N]`` = ``(q - z[g]) * s[g]``."""
        return (self.codes.astype(np.float64) - self.zeros[self.g_idx]) * self.scales.astype(np.float64)[self.g_idx]


def random_layer(rng: np.random.Generator, k: int, n: int, *, bits: int, group_size: int, sym: bool,
                 act_order: bool, zero_range: tuple[int, int]) -> Layer:
    g = k if group_size == -1 else group_size
    groups = k // g
    codes = rng.integers(0, 1 << bits, size=(k, n)).astype(np.uint8)
    if sym:
        zeros = np.full((groups, n), 1 << (bits - 1), dtype=np.int64)
    else:
        zeros = rng.integers(zero_range[0], zero_range[1] + 1, size=(groups, n)).astype(np.int64)
    step = 2.0 / ((1 << bits) * np.sqrt(k))  # |w| ~ 1 / sqrt(K): activations stay O(1) through the layers
    scales = (step * rng.uniform(0.5, 1.5, size=(groups, n))).astype(np.float16)
    g_idx = np.arange(k) // g
    if act_order:
        g_idx = np.empty(k, dtype=np.int64)
        g_idx[rng.permutation(k)] = np.arange(k) // g
    return Layer(codes, zeros, scales, g_idx)


def gptq_tensors(layer: Layer, *, bits: int, version: int) -> dict[str, np.ndarray]:
    """qweight / qzeros / scales / g_idx as GPTQ v1 (zero stored as z - 1) or v2 (z) writes them."""
    stored = layer.zeros - (1 if version == 1 else 0)
    stored = stored & ((1 << bits) - 1)  # v1's z = 0 wraps to all ones, as the tools store it
    return {"qweight": pack_rows(layer.codes, bits), "qzeros": pack_cols(stored, bits),
            "scales": layer.scales, "g_idx": layer.g_idx.astype(np.int32)}


def awq_tensors(layer: Layer) -> dict[str, np.ndarray]:
    """AutoAWQ GEMM: qweight ``[K, N/8]`` and qzeros ``[K/G, N/8]`` packed along N in AWQ_ORDER."""
    return {"qweight": pack_cols(layer.codes, 4, AWQ_ORDER), "qzeros": pack_cols(layer.zeros, 4, AWQ_ORDER),
            "scales": layer.scales}


@dataclass
class Checkpoint:
    """A written checkpoint: its directory, config, the quantized layers and the float tensors."""

    path: Path
    config: transformers.LlamaConfig
    layers: dict[str, Layer] = field(default_factory=dict)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)
    biases: dict[str, np.ndarray] = field(default_factory=dict)


def llama_config(*, hidden: int = 64, intermediate: int = 128, layers: int = 2, vocab: int = 160,
                 tie: bool = False, bias: bool = False) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=128, tie_word_embeddings=tie, attention_bias=bias,
                                    dtype="float16")


def write_checkpoint(path: Path, config: transformers.LlamaConfig, quantization_config: dict, *, seed: int,
                     act_order: bool = False, shards: int = 1) -> Checkpoint:
    """Draw the quantized layers and the float tensors (embeddings, norms, lm_head); write config.json, safetensors.

    ``quantization_config`` is stored as given; its ``quant_method``,
    ``bits``, ``group_size``, ``sym`` / ``zero_point`` and format keys decide
    how the layers are drawn and packed.
    """
    from safetensors.torch import save_file

    method = quantization_config["quant_method"]
    bits = quantization_config.get("bits", 4)
    group_size = quantization_config.get("group_size", 128)
    layout = quantization_config.get("checkpoint_format", quantization_config.get("format", "gptq"))
    version = 2 if layout == "gptq_v2" else 1
    sym = quantization_config.get("sym", True) if method == "gptq" else False
    zero_range = (1, 1 << bits) if (method == "gptq" and version == 1) else (0, (1 << bits) - 1)
    rng = np.random.default_rng(seed)
    with torch.device("meta"):  # shapes and names only; the float tensors are drawn below
        float_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    ckpt = Checkpoint(path, config)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in float_model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED:
            layer = random_layer(rng, module.in_features, module.out_features, bits=bits, group_size=group_size,
                                 sym=sym, act_order=act_order, zero_range=zero_range)
            ckpt.layers[name] = layer
            packed = gptq_tensors(layer, bits=bits, version=version) if method == "gptq" else awq_tensors(layer)
            tensors.update({f"{name}.{part}": torch.from_numpy(np.ascontiguousarray(t)) for part, t in packed.items()})
            if module.bias is not None:
                bias = (rng.standard_normal(module.out_features) / 8).astype(np.float16)
                ckpt.biases[name] = bias
                tensors[f"{name}.bias"] = torch.from_numpy(bias)
    for name, tensor in float_model.state_dict().items():
        if name.rsplit(".", 2)[-2] in QUANTIZED:
            continue
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # stored once, under the embedding's name
        values = rng.standard_normal(tuple(tensor.shape)) / 4
        if name.endswith("norm.weight"):
            values = 1 + values / 4
        ckpt.floats[name] = torch.from_numpy(values.astype(np.float16))
        tensors[name] = ckpt.floats[name]
    path.mkdir(parents=True, exist_ok=True)
    document = config.to_dict() | {"quantization_config": quantization_config}
    (path / "config.json").write_text(json.dumps(document, indent=1, default=str))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, str(path / file))
            weight_map |= dict.fromkeys(part, file)
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ckpt


class W8A8Linear(torch.nn.Module):
    """float64 W8A8 as docs/quantization.md defines it: per-token int8 activations (float32 scale), then x @ W."""

    def __init__(self, weight: np.ndarray, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.from_numpy(weight)  # [K, N] float64
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        amax = x32.abs().amax(dim=1)
        sx = torch.where(amax > 0, amax / torch.tensor(127.0, dtype=torch.float32), torch.ones_like(amax))
        xq = torch.clamp(torch.round(x32 / sx[:, None]), -127, 127)
        y = sx.double()[:, None] * (xq.double() @ self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def reference_model(ckpt: Checkpoint, *, w8a8: bool = False) -> torch.nn.Module:
    """The float64 model of the same quantized weights (dequantized exactly), eager attention."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(ckpt.config, dtype=torch.float64,
                                                          attn_implementation="eager").eval()
    state = {name: t.to(torch.float64) for name, t in ckpt.floats.items()}
    for name, layer in ckpt.layers.items():
        weight = layer.dequantized()
        bias = torch.from_numpy(ckpt.biases[name].astype(np.float64)) if name in ckpt.biases else None
        if w8a8:
            parent, attr = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), attr, W8A8Linear(weight, bias))
        else:
            state[f"{name}.weight"] = torch.from_numpy(weight.T.copy())
            if bias is not None:
                state[f"{name}.bias"] = bias
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    if ckpt.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(m.rsplit(".", 1)[0].rsplit(".", 1)[-1] in QUANTIZED or m == "lm_head.weight" for m in missing), missing
    return model


# -- hostile and unusual folders --------------------------------------------------------------------


def replace_tensors(file: Path, changes: dict[str, torch.Tensor | None]) -> None:
    """Rewrite the safetensors ``file`` with the tensors of ``changes`` put in (None: taken out).

    Read from bytes, not through ``safe_open``, which a test may have replaced by a :class:`ReadCounter`.
    """
    from safetensors.torch import load, save_file

    tensors = load(file.read_bytes())
    for key, value in changes.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, str(file))


def hf_cache_layout(source: Path, hub: Path, repo: str = "models--org--tiny", revision: str = "0123abcd") -> Path:
    """Lay out the files of ``source`` as the Hugging Face cache does; return the snapshot folder.

    ``hub/<repo>/blobs/<sha256>`` holds each file, ``hub/<repo>/snapshots/<revision>/<name>`` is a relative
    symlink ``../../blobs/<sha256>`` to it, ``hub/<repo>/refs/main`` names the revision.
    """
    root = hub / repo
    snapshot = root / "snapshots" / revision
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (root / "blobs" / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snapshot / file.name)
    return snapshot


class ReadCounter:
    """Stands in for ``safetensors.safe_open``: records every tensor whose data is read.

    Headers (``keys``, ``get_slice(key).get_shape()`` / ``get_dtype()``) pass
    through; ``get_tensor`` and slicing append the key to :attr:`reads`.
    ``fail`` maps a key to an exception its read raises instead.
    """

    def __init__(self, real: Any, fail: dict[str, BaseException] | None = None) -> None:
        self.real = real
        self.reads: list[str] = []
        self.fail = fail or {}

    def __call__(self, *args: Any, **kwargs: Any) -> _CountedFile:
        return _CountedFile(self, self.real(*args, **kwargs))


class _CountedFile:
    def __init__(self, counter: ReadCounter, inner: Any) -> None:
        self.counter = counter
        self.inner = inner

    def __enter__(self) -> _CountedFile:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def get_slice(self, key: str) -> _CountedSlice:
        return _CountedSlice(self.counter, key, self.inner.get_slice(key))

    def get_tensor(self, key: str) -> torch.Tensor:
        self.counter.reads.append(key)
        if key in self.counter.fail:
            raise self.counter.fail[key]
        return self.inner.get_tensor(key)


class _CountedSlice:
    def __init__(self, counter: ReadCounter, key: str, inner: Any) -> None:
        self.counter, self.key, self.inner = counter, key, inner

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def get_dtype(self) -> str:
        return self.inner.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.counter.reads.append(self.key)
        return self.inner[index]
