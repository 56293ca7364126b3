"""Saving a model of :class:`QuantLinear` layers as a GPTQ checkpoint directory, the one :func:`load_quantized` reads.

The directory is what GPTQ tools write and transformers (optimum /
gptqmodel) and vLLM read: ``config.json`` (the model's config with a
``quantization_config``), the tensors in ``model.safetensors`` or in shards
listed by ``model.safetensors.index.json``, ``generation_config.json`` when
the model generates, and the tokenizer's files when one is given. Each
quantized layer ``<name>`` is stored as ``<name>.qweight``, ``.qzeros``,
``.scales``, ``.g_idx`` (and ``.bias``), converted by
:func:`~hal_core.quant.to_gptq`, the exact inverse of the importer; every
other parameter and persistent buffer under its usual name (a tied weight
once, under its first name), in its own dtype. A :class:`QuantMoE` block's
experts are stored as one GPTQ layer per expert and projection, under the
names MoE checkpoints use (:mod:`._moe_layout`).

Everything GPTQ cannot express is refused with :class:`~hal_core.CheckpointError`,
naming the layer, before anything is written; the files are written into a
fresh folder next to the target and renamed into place at the end, so an
error never leaves a half-written checkpoint. Tensors are written one at a
time (:mod:`._safetensors_write`): no float copy of a quantized weight is
ever made, and the only new arrays are one layer's ``qzeros`` and ``g_idx``
(and, for int8, its ``qweight`` repacked four codes to a word).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointError
from ..quant import to_gptq
from ..quant._gptq_export import check_gptq
from ._modules import QuantLinear
from ._moe import QuantMoE
from ._moe_layout import moe_export_layers, moe_layout, stored_name
from ._safetensors_write import ENTRY_DTYPES, Entry, write_safetensors
from ._save_layers import ExportLayer, linear_export

__all__ = ["save_quantized"]

#: Group sizes GPTQ kernels accept (besides -1, one group over all of K); others are refused.
GPTQ_GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
_FORMATS = {"gptq": "gptq", "gptq_v1": "gptq", "gptq_v2": "gptq_v2"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def save_quantized(model: torch.nn.Module, path: str | os.PathLike[str], *, checkpoint_format: str = "gptq",
                   max_shard_size: int | str = "5GB", tokenizer: Any = None, overwrite: bool = False) -> Path:
    """Write ``model`` (its linear layers :class:`QuantLinear`, its MoE blocks :class:`QuantMoE`) as a GPTQ
    checkpoint directory ``path``; return it.

    ``model``: a transformers model, as :func:`quantize_model` or
    :func:`load_quantized` leave it (its ``config`` becomes ``config.json``).
    ``checkpoint_format``: ``"gptq"`` (v1, what every GPTQ reader takes; it
    cannot hold a zero point of 0) or ``"gptq_v2"`` (holds 0, not 2**bits;
    gptqmodel and vLLM read it). ``max_shard_size``: bytes (an int, or a
    string such as ``"5GB"``, ``"500MB"``, ``"2GiB"``) above which the
    tensors go to several files and an index. ``tokenizer``: saved
    alongside with its ``save_pretrained`` when given. ``overwrite``: replace
    a non-empty existing directory (refused otherwise).

    :func:`load_quantized` gives back every quantized layer's buffers and
    the model's outputs bit for bit (docs/quantization.md, "Saving a
    quantized model", says which forms change). Raises
    :class:`~hal_core.CheckpointError` (a ``ValueError``), naming the layer
    or tensor, for what GPTQ cannot hold, all before writing anything:
    layers of different ``bits``; group sizes that differ between layers or
    that GPTQ kernels do not take; a zero point the chosen format cannot
    store; scales not exact in float16; int8 layers whose ``in_features``
    is not a multiple of 4; a model without :class:`QuantLinear` layers or
    with tensors on the meta device; a :class:`QuantMoE` in a model whose
    ``model_type`` has no known MoE layout (``qwen3_moe``, ``mixtral``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"argument 'model': expected a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        raise TypeError(f"argument 'model': a {type(model).__name__} has no transformers config (model.config), "
                        f"which config.json is written from")
    if not isinstance(checkpoint_format, str) or checkpoint_format not in _FORMATS:
        raise ValueError(f"argument 'checkpoint_format': expected 'gptq' (v1) or 'gptq_v2', got {checkpoint_format!r}")
    fmt = _FORMATS[checkpoint_format]
    limit = _shard_limit(max_shard_size)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"argument 'tokenizer': expected a tokenizer with save_pretrained, "
                        f"got {type(tokenizer).__name__}")
    target = Path(path)
    _check_target(target, overwrite)

    linears, float_linears = _linear_layers(model)
    layers = {name: linear_export(layer) for name, layer in linears.items()}
    renames: dict[str, str] = {}  # a MoE block's name in the model -> its stored name, where they differ
    blocks = {id(module): (name, module) for name, module in model.named_modules() if isinstance(module, QuantMoE)}
    for name, block in blocks.values():
        layout = moe_layout(config, name)
        if layout.stored_prefix(name) != name:
            renames[name] = layout.stored_prefix(name)
        layers.update(moe_export_layers(name, block, layout))
    if not layers:
        raise CheckpointError("argument 'model': it has no QuantLinear layers; quantize it first "
                              "(hal_core.torch.quantize_model)")
    for name, layer in layers.items():
        try:
            check_gptq(layer.weight(False), fmt)
        except ValueError as exc:
            raise CheckpointError(f"layer {name!r}: {exc}") from None
    document = config.to_dict()
    document["quantization_config"] = _quantization_config(model, layers, float_linears, fmt)
    if hasattr(type(model), "config_class"):  # a transformers model: what save_pretrained records
        document["architectures"] = [type(model).__name__]
    skip = {id(layer) for layer in linears.values()} | set(blocks)
    entries = _layer_entries(layers, fmt) + _other_entries(model, skip, renames)
    dtype = next((e.dtype for e in entries if e.dtype.is_floating_point and e.name.endswith(".weight")), None)
    if dtype is not None:
        document["dtype"] = str(dtype).removeprefix("torch.")
    config_json = json.dumps(document, indent=2, sort_keys=True) + "\n"
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and not (callable(can_generate) and can_generate()):
        generation = None

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.partial"
    staging.mkdir()
    try:
        (staging / "config.json").write_text(config_json)
        _write_tensors(staging, entries, limit)
        if generation is not None:
            generation.save_pretrained(str(staging))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(staging))
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


# -- checks ------------------------------------------------------------------------------------------


def _shard_limit(value: Any) -> int:
    """``max_shard_size`` in bytes: a positive int, or a number with a unit (B, KB, MB, GB, KiB, MiB, GiB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (found := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*", value.lower())):
        size = int(float(found.group(1)) * _UNITS[found.group(2) or ""])
    else:
        raise ValueError(f"argument 'max_shard_size': expected bytes as an int or a string such as '5GB', "
                         f"got {value!r}")
    if size <= 0:
        raise ValueError(f"argument 'max_shard_size': expected a positive size, got {value!r}")
    return size


def _check_target(target: Path, overwrite: Any) -> None:
    if not isinstance(overwrite, bool):
        raise TypeError(f"argument 'overwrite': expected True or False, got {overwrite!r}")
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"argument 'path': {str(target)!r} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise CheckpointError(f"argument 'path': {str(target)!r} is not empty; pass overwrite=True to replace it")


def _linear_layers(model: torch.nn.Module) -> tuple[dict[str, QuantLinear], list[str]]:
    """The distinct QuantLinear layers by first name, and the names of the float ``nn.Linear`` layers.

    The first name is the one :func:`load_quantized` looks a layer up by: a
    parent's children are named before anything below them.
    """
    layers: dict[str, QuantLinear] = {}
    floats: list[str] = []
    seen: set[int] = set()
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent.named_children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, QuantLinear):
                layers[name] = child
            elif isinstance(child, torch.nn.Linear):
                floats.append(name)
    return layers, floats


def _layer_group_size(name: str, layer: ExportLayer) -> int:
    """The group size GPTQ stores for one layer: its own when GPTQ kernels take it, else -1 (one group over K)."""
    if layer.group_size in GPTQ_GROUP_SIZES:
        return layer.group_size
    if layer.group_size == layer.in_features:
        return -1
    raise CheckpointError(f"layer {name!r} has group_size {layer.group_size}; GPTQ kernels take -1 (one "
                          f"group) or {', '.join(map(str, GPTQ_GROUP_SIZES))}")


def _fits(layer: ExportLayer, bits: int, group_size: int) -> bool:
    return layer.bits == bits and (layer.group_size == group_size
                                   or (group_size == -1 and layer.group_size == layer.in_features))


def _bits_and_groups(layers: dict[str, ExportLayer]) -> tuple[tuple[int, int], dict[str, dict[str, int]]]:
    """The config's ``bits`` and ``group_size`` (the most common pair), and ``dynamic`` rules for the others.

    ``group_size`` is -1 when every layer holds one group over its K. A
    layer whose bits or group size differ from the base (e.g. an 8-bit
    ``lm_head`` in an int4 model) gets a positive rule of GPTQ's ``dynamic``
    key matching exactly its name (``"+:^<name>$": {"bits": 8, ...}``),
    which vLLM, gptqmodel and :func:`load_quantized` read as a per-module
    override.
    """
    pairs = {name: (layer.bits, _layer_group_size(name, layer)) for name, layer in layers.items()}
    counts: dict[tuple[int, int], int] = {}
    for pair in pairs.values():
        counts[pair] = counts.get(pair, 0) + 1
    base = max(counts, key=lambda pair: counts[pair])  # ties: the first layer's pair (dicts keep order)
    if all(layer.group_size == layer.in_features for layer in layers.values()):
        base = (base[0], -1)
    dynamic = {f"+:^{re.escape(name)}$": {"bits": bits, "group_size": group}
               for (name, (bits, group)) in pairs.items() if not _fits(layers[name], *base)}
    return base, dynamic


def _quantization_config(model: torch.nn.Module, layers: dict[str, ExportLayer], float_linears: list[str],
                         fmt: str) -> dict[str, Any]:
    (bits, group_size), dynamic = _bits_and_groups(layers)
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    config: dict[str, Any] = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size,
        "desc_act": any(layer.has_g_idx for layer in layers.values()),
        "sym": not any(layer.has_zeros for layer in layers.values()),
        "checkpoint_format": fmt, "lm_head": isinstance(output, QuantLinear),
    }
    if dynamic:
        config["dynamic"] = dynamic
    if float_linears:
        config["modules_to_not_convert"] = list(float_linears)
    if any(model.get_submodule(name) is not output for name in float_linears):
        # readers that otherwise quantize every linear layer of the decoder blocks (optimum, vLLM)
        config["modules_in_block_to_quantize"] = [list(layers)]
    return config


# -- the tensors -------------------------------------------------------------------------------------


class _LayerExport:
    """The GPTQ tensors of one layer at a time: converted when its first tensor is written, dropped at the next."""

    def __init__(self, layers: dict[str, ExportLayer], fmt: str) -> None:
        self.layers, self.fmt = layers, fmt
        self.name: str | None = None
        self.tensors: dict[str, np.ndarray] = {}

    def reader(self, name: str, part: str) -> Callable[[], np.ndarray]:
        def read() -> np.ndarray:
            if self.name != name:
                self.tensors = {}  # the previous layer's arrays go before this one's are made
                self.tensors = to_gptq(self.layers[name].weight(True), checkpoint_format=self.fmt)
                self.name = name
            return self.tensors[part]
        return read


def _layer_entries(layers: dict[str, ExportLayer], fmt: str) -> list[Entry]:
    export = _LayerExport(layers, fmt)
    entries = []
    for name, layer in layers.items():
        k, n, groups, per_word = layer.in_features, layer.out_features, layer.in_features // layer.group_size, \
            32 // layer.bits
        shapes = {"qweight": (k // per_word, n), "qzeros": (groups, n // per_word), "scales": (groups, n),
                  "g_idx": (k,)}
        for part, shape in shapes.items():
            dtype = torch.float16 if part == "scales" else torch.int32
            entries.append(Entry(f"{name}.{part}", dtype, shape, export.reader(name, part)))
        if layer.bias is not None:
            entries.append(_tensor_entry(f"{name}.bias", layer.bias))
    return entries


def _tensor_entry(name: str, tensor: torch.Tensor) -> Entry:
    if tensor.device.type == "meta":
        raise CheckpointError(f"{name}: the tensor is on the meta device (it holds no values to save)")
    if tensor.dtype not in ENTRY_DTYPES:
        raise CheckpointError(f"{name}: safetensors cannot store {tensor.dtype}")
    return Entry(name, tensor.dtype, tuple(tensor.shape), lambda: tensor)


def _other_entries(model: torch.nn.Module, skip: set[int], renames: dict[str, str]) -> list[Entry]:
    """Every parameter and persistent buffer outside the ``skip`` modules (the quantized layers, the MoE blocks'
    own expert buffers), once each, under its first name as stored (``renames``: :func:`stored_name`)."""
    seen: set[int] = set()
    entries = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        if id(module) in skip:
            continue
        prefix = f"{module_name}." if module_name else ""
        tensors = [*module._parameters.items(),
                   *((n, t) for n, t in module._buffers.items() if n not in module._non_persistent_buffers_set)]
        for attr, tensor in tensors:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            entries.append(_tensor_entry(stored_name(prefix + attr, renames), tensor))
    return entries


def _shards(entries: list[Entry], limit: int) -> Iterator[list[Entry]]:
    """Consecutive runs of entries of at most ``limit`` bytes (a larger tensor alone in its run)."""
    run: list[Entry] = []
    size = 0
    for entry in entries:
        if run and size + entry.nbytes > limit:
            yield run
            run, size = [], 0
        run.append(entry)
        size += entry.nbytes
    if run:
        yield run


def _write_tensors(folder: Path, entries: list[Entry], limit: int) -> None:
    shards = list(_shards(entries, limit))
    metadata = {"format": "pt"}
    if len(shards) == 1:
        write_safetensors(folder / "model.safetensors", shards[0], metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, shard, metadata)
        weight_map.update(dict.fromkeys((entry.name for entry in shard), file))
    index = {"metadata": {"total_size": sum(entry.nbytes for entry in entries)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished folder to ``target``; an existing one is moved aside first and deleted after."""
    if not target.exists():
        staging.rename(target)
        return
    aside = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.old"
    target.rename(aside)
    try:
        staging.rename(target)
    except BaseException:
        aside.rename(target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
