"""Loading GPTQ and AWQ checkpoints, as transformers users have them, into models of :class:`QuantLinear` layers.

A checkpoint is a directory: ``config.json`` with a ``quantization_config``
and the tensors in ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``). A quantized linear layer ``<name>`` is
stored as ``<name>.qweight``, ``.qzeros``, ``.scales``, optionally
``.g_idx`` and ``.bias`` (layouts: :mod:`hal_core.quant.gptq`,
:mod:`hal_core.quant.awq`); every other tensor (embeddings, norms, an
unquantized ``lm_head``) under its usual name.

:func:`load_quantized` builds the transformers model from the config on
the ``meta`` device (no float weight is ever allocated), checks every
tensor's shape and dtype in the safetensors headers against the layer or
parameter it is for, then replaces each linear layer that has a ``.qweight``
in the checkpoint by a :class:`QuantLinear` converted with
:func:`~hal_core.quant.from_gptq` / :func:`~hal_core.quant.from_awq`
(bit-identical), and loads the other tensors as they are, reading one
tensor at a time with safetensors' ``safe_open``. Files are resolved inside
the checkpoint folder (:mod:`._checkpoint_files`); variants hal cannot run
exactly are refused before anything is read, naming the
``quantization_config`` key (:mod:`hal_core.quant._checkpoint_format`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from typing import Any

import torch

from .._errors import ArgumentError, CheckpointError
from ..quant._checkpoint_format import FLOATS, KEY, CheckpointFormat, TensorSpec, checkpoint_format
from ._checkpoint_files import Folder, Tensors
from ._layer_progress import ProgressArg, layer_progress
from ._load_moe import load_moe, plan_moe
from ._modules import QuantLinear, check_activations
from ._moe_layout import stored_name
from ._release import drop_file_pages, move_out_of_file_mappings, return_free_heap
from ._stored_layers import check_header, check_stored_layer, read_stored_layer

__all__ = ["CheckpointFormat", "checkpoint_format", "load_quantized"]

log = logging.getLogger("hal")

#: The safetensors dtype of each torch dtype an integer or bool buffer of a model may have.
_STORED_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
                  torch.int64: "I64"}
#: The float dtypes a model loads in (``dtype=``, or config.json's ``dtype`` / ``torch_dtype``).
_MODEL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64}
#: What building a model from a malformed config.json raises (in transformers or in torch).
_CONFIG_ERRORS = (ValueError, TypeError, KeyError, AttributeError, IndexError, ArithmeticError, RuntimeError)


# -- the model's layers and the checkpoint's tensors ---------------------------------


def _quantized_layers(model: torch.nn.Module, tensors: Tensors) -> dict[str, list[tuple[torch.nn.Module, str]]]:
    """Linear layers stored quantized (a ``.qweight`` in the checkpoint), with every place each one sits."""
    layers: dict[str, list[tuple[torch.nn.Module, str]]] = {}
    first: dict[int, str] = {}
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if id(child) in first:  # a layer used at several places: replaced at each
                if first[id(child)] in layers:
                    layers[first[id(child)]].append((parent, attr))
                continue
            first[id(child)] = name
            if f"{name}.qweight" not in tensors:
                continue
            if not isinstance(child, torch.nn.Linear):
                raise CheckpointError(f"the checkpoint stores {name!r} quantized, but the model's {name} is a "
                                      f"{type(child).__name__}, not a Linear layer")
            layers[name] = [(parent, attr)]
    return layers


Place = tuple[torch.nn.Module, str, bool]  # module, attribute, is a parameter


def _places(model: torch.nn.Module, replaced: set[int]) -> Iterator[tuple[list[str], list[Place], torch.Tensor]]:
    """Each parameter and persistent buffer once (outside the ``replaced`` modules): its names, places, meta tensor.

    Tied weights have several names and places (the embedding and ``lm_head``).
    """
    groups: dict[int, tuple[list[str], list[Place], torch.Tensor]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if id(module) in replaced:
            continue
        prefix = f"{module_name}." if module_name else ""
        entries = [(n, t, True) for n, t in module._parameters.items()]
        entries += [(n, t, False) for n, t in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for attr, tensor, is_param in entries:
            if tensor is None:
                continue
            names, where, _ = groups.setdefault(id(tensor), ([], [], tensor))
            if prefix + attr not in names:
                names.append(prefix + attr)
            where.append((module, attr, is_param))
    yield from groups.values()


def _load_dtype(dtype: Any, document: Mapping[str, Any], source: str) -> torch.dtype:
    """The float dtype to load in: ``dtype``, or with ``"auto"`` config.json's (``source`` names the file)."""
    for key in ("dtype", "torch_dtype"):  # checked even when not used: transformers reads them too
        found = document.get(key)
        if found is not None and (not isinstance(found, str) or found.removeprefix("torch.") not in _MODEL_DTYPES):
            raise CheckpointError(f"{source}: {key}: expected one of {sorted(_MODEL_DTYPES)}, got {found!r}")
    if dtype in _MODEL_DTYPES.values():
        return dtype
    if not isinstance(dtype, str) or dtype != "auto":
        raise TypeError(f"argument 'dtype': expected 'auto' or one of torch.{', torch.'.join(_MODEL_DTYPES)}, "
                        f"got {dtype!r}")
    found = document.get("dtype") or document.get("torch_dtype") or "float32"
    return _MODEL_DTYPES[found.removeprefix("torch.")]


def load_quantized(path: str | os.PathLike[str], *, dtype: torch.dtype | str = "auto",
                   device: torch.device | str = "cpu", attn_implementation: str | None = None,
                   model_class: Any = None, progress: ProgressArg = None,
                   activations: str | None = "auto") -> torch.nn.Module:
    """The transformers model of a GPTQ or AWQ checkpoint directory, its quantized layers :class:`QuantLinear`.

    ``dtype``: the model's float dtype (activations, embeddings, norms,
    biases): float16, bfloat16, float32 or float64; ``"auto"`` takes the
    config's (float32 when it has none). The
    scales keep the checkpoint's dtype. ``device``: where every tensor goes
    as it is read. ``attn_implementation``: as for ``from_pretrained``
    (``"hal"`` registers and uses hal's paged attention).
    ``model_class``: the transformers auto class or model class whose
    ``from_config`` builds the model (default ``AutoModelForCausalLM``).
    ``progress``: None, True (a bar on stderr) or ``progress(done, total,
    name)`` after each quantized layer. ``activations``: every quantized
    layer's and MoE block's activation precision, as for :func:`quantize_model` (``"auto"``:
    W4A16 for one row, W4A8 from two rows up where the backend runs it).

    Which layers are quantized is read from the tensors (a ``.qweight``),
    not from ``modules_to_not_convert``; every other float tensor is cast to
    ``dtype``. A sparse MoE block (Qwen3-MoE, Mixtral) whose experts are
    stored quantized, one layer per expert and projection as MoE checkpoints
    hold them (:mod:`hal_core.torch._moe_layout`), becomes a
    :class:`QuantMoE` run by ``fused_moe``. A layer's ``.bias`` is loaded when the model's layer has one.

    Raises :class:`hal_core.CheckpointError` (a ``ValueError``), naming the
    file and the key or layer, for: a file that resolves outside the
    checkpoint folder, a malformed ``config.json``, index or safetensors
    file, an unsupported ``quantization_config``, a missing tensor, and a
    tensor whose stored shape or dtype does not fit its layer or parameter
    -- all found from the files' headers before any tensor is read. A
    malformed tensor value (a NaN scale, a ``g_idx`` out of range) is
    refused as its layer is converted. Nothing is returned after an error.
    Checkpoint tensors the model does not use are logged as a warning on
    the ``hal`` logger. Returns the model in ``eval()`` mode, holding no view of the checkpoint's files (the
    tensors safetensors reads as views of its file mapping are copied out), so the process keeps the checkpoint's
    bytes once, not its mapped pages beside them.
    """
    import transformers

    try:
        activations = check_activations(activations)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    folder = Folder(path)
    config_json = folder.show("config.json")
    if not folder.has("config.json"):
        raise CheckpointError(f"argument 'path': expected a directory holding config.json and *.safetensors, "
                              f"{config_json} does not exist")
    document = folder.read_json("config.json")
    torch_dtype = _load_dtype(dtype, document, config_json)
    quant = document.get(KEY)
    if quant is None:
        raise CheckpointError(f"argument 'path': {config_json} has no {KEY}; a float checkpoint loads with "
                              f"from_pretrained (then hal_core.torch.quantize_model)")
    try:
        fmt = checkpoint_format(quant)
    except CheckpointError as exc:
        raise CheckpointError(f"{config_json}: {exc}") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder.root))
    except (OSError, *_CONFIG_ERRORS) as exc:
        raise CheckpointError(f"{config_json}: transformers cannot read the model config "
                              f"({type(exc).__name__}: {exc})") from exc
    device = torch.device(device)
    if attn_implementation == "hal":
        from . import transformers as _registers_hal_attention  # noqa: F401
    builder = model_class if model_class is not None else transformers.AutoModelForCausalLM
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        with torch.device("meta"):
            model = builder.from_config(config, dtype=torch_dtype, **kwargs)
    except _CONFIG_ERRORS as exc:
        raise CheckpointError(f"{config_json}: {getattr(builder, '__name__', builder)!s} cannot build a model "
                              f"from it ({type(exc).__name__}: {exc})") from exc

    with ExitStack() as stack:
        tensors = Tensors(folder, stack)
        layers = _quantized_layers(model, tensors)
        _check_layers(fmt, layers, tensors)
        blocks = plan_moe(model, tensors, fmt, config)
        replaced = {id(getattr(*places[0])) for places in layers.values()} | {id(b.block.experts) for b in blocks}
        renames = {b.name: b.prefix for b in blocks if b.prefix != b.name}
        plan = _plan_others(model, tensors, replaced, renames)
        with layer_progress(progress, len(layers) + len(blocks), "loading") as step:  # now only values can fail
            for name in list(layers):
                _load_layer(fmt, name, layers.pop(name), tensors, torch_dtype, device, activations)
                drop_file_pages(tensors.paths)  # what was read is converted: its pages need not stay resident
                step(name)
            for block in blocks:
                block.replace(model, load_moe(block, fmt, tensors, device, activations))
                drop_file_pages(tensors.paths)
                step(block.name)
        _load_others(plan, tensors, torch_dtype, device)
        unused = sorted(set(tensors.where) - tensors.used)
    if unused:
        log.warning("hal: %d checkpoint tensors are not used by the model: %s", len(unused),
                    ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else ""))
    _materialise_derived_buffers(model, device)
    # safetensors gives some tensors (scales, embeddings, norms) as views of its mapping of the file; while one
    # lives, the whole mapping does, every page read resident beside the copies made of the codes.
    move_out_of_file_mappings(model)
    return_free_heap()
    return model.eval()


def _check_layers(base: CheckpointFormat, layers: Mapping[str, list[tuple[torch.nn.Module, str]]],
                  tensors: Tensors) -> None:
    """Each quantized layer's stored tensors are all there, each of the shape and dtype its layer needs."""
    for name, places in layers.items():
        linear = getattr(*places[0])
        check_stored_layer(base, name, linear.in_features, linear.out_features, tensors, bias=linear.bias is not None)


def _load_layer(fmt: CheckpointFormat, name: str, places: list[tuple[torch.nn.Module, str]], tensors: Tensors,
                dtype: torch.dtype, device: torch.device, activations: str | None) -> None:
    linear = getattr(*places[0])
    weight = read_stored_layer(fmt, name, tensors)
    bias = tensors.read(f"{name}.bias").to(dtype) if linear.bias is not None else None
    layer = QuantLinear.from_weight(weight, bias, device=device, name=name, activations=activations)
    for parent, attr in places:
        setattr(parent, attr, layer)


def _plan_others(model: torch.nn.Module, tensors: Tensors, replaced: set[int],
                 renames: dict[str, str]) -> list[tuple[str, list[Place]]]:
    """The checkpoint name each float parameter and persistent buffer is read from, its header checked.

    A tensor under a MoE block stored under another name (``renames``: the block's name in the model -> in the
    checkpoint, :func:`~._moe_layout.stored_name`) is looked up under both.

    CheckpointError if one has none, or one of another shape (or a dtype of
    another kind: a float for a float, the same integer type for an integer).
    """
    plan = []
    for names, where, meta in _places(model, replaced):
        key = next((n for n in (*names, *(stored_name(n, renames) for n in names)) if n in tensors), None)
        if key is None:
            raise CheckpointError(f"the checkpoint has no tensor for {' / '.join(names)}")
        dtypes = FLOATS if meta.is_floating_point() else frozenset({_STORED_DTYPES.get(meta.dtype, str(meta.dtype))})
        check_header(tensors, key, TensorSpec(tuple(meta.shape), dtypes, f"the model's {' / '.join(names)}"))
        plan.append((key, where))
    return plan


def _load_others(plan: list[tuple[str, list[Place]]], tensors: Tensors, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Read each planned tensor (floats cast to ``dtype``) and put it at every place it belongs."""
    for key, where in plan:
        tensor = tensors.read(key)
        tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        value = torch.nn.Parameter(tensor, requires_grad=False)
        for module, attr, is_param in where:
            if is_param:
                module._parameters[attr] = value
            else:
                module._buffers[attr] = tensor


def _materialise_derived_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) are computed, not stored: the model's ``_init_weights`` fills them.

    This is what ``from_pretrained`` does for them. Float buffers start as NaN,
    so one that ``_init_weights`` leaves unfilled is an error, not garbage.
    """
    for module, init in _modules_with_owner(model):
        meta = {name: buf for name, buf in module._buffers.items()
                if name in module._non_persistent_buffers_set and buf is not None and buf.device.type == "meta"}
        if not meta:
            continue
        if init is None:
            raise CheckpointError(f"{type(module).__name__} holds computed buffers {sorted(meta)}, and no "
                                  f"transformers model above it can initialise them")
        for name, buf in meta.items():
            fill = float("nan") if buf.is_floating_point() else 0
            module._buffers[name] = torch.full(buf.shape, fill, dtype=buf.dtype, device=device)
        init(module)
        unfilled = [name for name in meta if _holds_nan(module._buffers[name])]
        if unfilled:
            raise CheckpointError(f"{type(module).__name__}'s computed buffers {unfilled} were not initialised by "
                                  f"the model's _init_weights")


def _holds_nan(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_floating_point() and bool(tensor.isnan().any())


def _modules_with_owner(model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, Any]]:
    """Each module with the ``_init_weights`` of the nearest transformers model above (or at) it."""
    from transformers import PreTrainedModel

    def walk(module: torch.nn.Module, init: Any) -> Iterator[tuple[torch.nn.Module, Any]]:
        if isinstance(module, PreTrainedModel):
            init = module._init_weights
        yield module, init
        for child in module.children():
            yield from walk(child, init)

    yield from walk(model, None)
