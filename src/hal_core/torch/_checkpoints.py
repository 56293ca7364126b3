"""Loading GPTQ and AWQ checkpoints, as transformers users have them, into models of :class:`QuantLinear` layers.

A checkpoint is a directory: ``config.json`` with a ``quantization_config``
and the tensors in ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``). A quantized linear layer ``<name>`` is
stored as ``<name>.qweight``, ``.qzeros``, ``.scales``, optionally
``.g_idx`` and ``.bias`` (layouts: :mod:`hal_core.quant.gptq`,
:mod:`hal_core.quant.awq`); every other tensor (embeddings, norms, an
unquantized ``lm_head``) under its usual name.

:func:`load_quantized` builds the transformers model from the config on
the ``meta`` device (no float weight is ever allocated), replaces each
linear layer that has a ``.qweight`` in the checkpoint by a
:class:`QuantLinear` converted with :func:`~hal_core.quant.from_gptq` /
:func:`~hal_core.quant.from_awq` (bit-identical), and loads the other
tensors as they are, reading one tensor at a time with safetensors'
``safe_open``. Variants hal cannot run exactly are refused before anything
is read, naming the ``quantization_config`` key.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from ..quant import QuantizedWeight, from_awq, from_gptq
from ..quant.gptq import _OFFSETS as GPTQ_FORMATS
from ._layer_progress import ProgressArg, layer_progress
from ._modules import QuantLinear

__all__ = ["CheckpointFormat", "checkpoint_format", "load_quantized"]

log = logging.getLogger("hal")

_KEY = "quantization_config"
#: Keys that choose transformers' kernels or fusions, which hal replaces; they do not change the stored tensors.
_RUNTIME_KEYS = ("backend", "use_exllama", "exllama_config", "do_fuse", "fuse_max_seq_len",
                 "disable_exllama", "kernel_switch_threshold")


@dataclass(frozen=True)
class CheckpointFormat:
    """What ``quantization_config`` says about the stored tensors (see :func:`checkpoint_format`)."""

    method: str            #: ``"gptq"`` or ``"awq"``
    bits: int              #: 4 or 8 (AWQ: 4)
    group_size: int        #: rows per group; -1 for one group over all of K
    desc_act: bool         #: GPTQ act-order: every layer must store ``g_idx``
    layout: str            #: GPTQ ``"gptq"`` (v1) or ``"gptq_v2"``; AWQ ``"gemm"``

    def convert(self, name: str, tensors: Mapping[str, torch.Tensor]) -> QuantizedWeight:
        """One layer's tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``) in hal's format."""
        try:
            if self.method == "gptq":
                weight = from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors.get("g_idx"),
                                   bits=self.bits, checkpoint_format=self.layout)
            else:
                weight = from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"layer {name!r}: {exc}") from exc
        k = weight.shape[0]
        expected = k if self.group_size == -1 else self.group_size
        if weight.group_size != expected:
            raise CheckpointError(f"layer {name!r}: its scales hold {k // weight.group_size} groups of "
                                  f"{weight.group_size} rows, but {_KEY}.group_size is {self.group_size} "
                                  f"(K={k}); hal needs groups that divide K")
        return weight


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{_KEY}.{key}: expected an integer, got {value!r}")
    return value


def checkpoint_format(config: Mapping[str, Any]) -> CheckpointFormat:
    """Read a ``quantization_config`` dict; ``CheckpointError`` (a ``ValueError``) names the key hal cannot run.

    GPTQ (``quant_method: "gptq"``): ``bits`` 4 or 8; ``group_size`` (-1:
    one group); ``desc_act`` (act-order: each layer's ``g_idx`` is then
    required); ``sym`` either way (zero points are read from ``qzeros``);
    ``checkpoint_format`` (or ``format``) ``"gptq"`` (v1) or ``"gptq_v2"``;
    kernel-repacked formats (``marlin``, ``bitblas``, ...) are refused.
    AWQ (``quant_method: "awq"``): ``version`` (or ``format``) ``"gemm"``
    only (GEMV, GEMV-fast, Marlin and exllama layouts are refused),
    ``bits`` (``w_bit``) 4, ``zero_point`` true, ``group_size``
    (``q_group_size``). Keys that pick transformers' kernels (``backend``,
    ``use_exllama``, ``exllama_config``, ``do_fuse``, ...) have no meaning
    here: hal's kernels run the layers.
    """
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{_KEY}: expected a JSON object, got {type(config).__name__}")
    method = str(config.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise CheckpointError(f"{_KEY}.quant_method: hal loads 'gptq' and 'awq' checkpoints, "
                              f"got {config.get('quant_method')!r}")
    ignored = sorted(k for k in _RUNTIME_KEYS if config.get(k) not in (None, False))
    if ignored:
        log.info("hal: %s.%s choose transformers' kernels; hal's kernels run the layers instead",
                 _KEY, "/".join(ignored))
    bits = _as_int(_get(config, "bits", "w_bit", default=4), "bits")
    group_size = _as_int(_get(config, "group_size", "q_group_size", default=128), "group_size")
    if group_size != -1 and group_size <= 0:
        raise CheckpointError(f"{_KEY}.group_size: expected a positive size or -1, got {group_size}")
    if method == "gptq":
        if bits not in (4, 8):
            raise CheckpointError(f"{_KEY}.bits: hal runs 4- and 8-bit GPTQ weights, got {bits}")
        layout = str(_get(config, "checkpoint_format", "format", default="gptq")).lower()
        if layout not in GPTQ_FORMATS:
            raise CheckpointError(f"{_KEY}.checkpoint_format: hal reads the GPTQ layouts {sorted(GPTQ_FORMATS)}, "
                                  f"got {layout!r} (a kernel-specific repacking; convert the checkpoint back to "
                                  f"'gptq' with the tool that made it)")
        desc_act = config.get("desc_act", False)
        if not isinstance(desc_act, bool):
            raise CheckpointError(f"{_KEY}.desc_act: expected true or false, got {desc_act!r}")
        return CheckpointFormat("gptq", bits, group_size, desc_act, layout)
    layout = str(_get(config, "version", "format", default="gemm")).lower()
    if layout != "gemm":
        raise CheckpointError(f"{_KEY}.version: hal reads AWQ's 'gemm' layout, got {layout!r} (GEMV, GEMV-fast, "
                              f"Marlin and exllama layouts pack the words differently)")
    if bits != 4:
        raise CheckpointError(f"{_KEY}.bits: AWQ checkpoints hal reads are 4-bit, got {bits}")
    if config.get("zero_point", True) is not True:
        raise CheckpointError(f"{_KEY}.zero_point: AWQ's gemm layout stores zero points (zero_point=true), "
                              f"got {config.get('zero_point')!r}")
    return CheckpointFormat("awq", 4, group_size, False, "gemm")


# -- the tensors ----------------------------------------------------------------


class _Tensors:
    """Every tensor name of the checkpoint, and which open file holds it; read one tensor at a time."""

    def __init__(self, directory: Path, stack: ExitStack) -> None:
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({directory / f for f in weight_map.values()})
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"argument 'path': no *.safetensors file in {directory}")
        self.where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle is not a mapping
                self.where[key] = handle
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def read(self, key: str) -> torch.Tensor:
        self.used.add(key)
        return self.where[key].get_tensor(key)


def _quantized_layers(model: torch.nn.Module, tensors: _Tensors) -> dict[str, list[tuple[torch.nn.Module, str]]]:
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


def _places(model: torch.nn.Module, replaced: set[int]) -> Iterator[tuple[list[str], list[Place], torch.Size]]:
    """Each parameter and persistent buffer once (outside the ``replaced`` modules): its names, places and shape.

    Tied weights have several names and places (the embedding and ``lm_head``).
    """
    groups: dict[int, tuple[list[str], list[Place], torch.Size]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if id(module) in replaced:
            continue
        prefix = f"{module_name}." if module_name else ""
        entries = [(n, t, True) for n, t in module._parameters.items()]
        entries += [(n, t, False) for n, t in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for attr, tensor, is_param in entries:
            if tensor is None:
                continue
            names, where, _ = groups.setdefault(id(tensor), ([], [], tensor.shape))
            if prefix + attr not in names:
                names.append(prefix + attr)
            where.append((module, attr, is_param))
    yield from groups.values()


def _load_dtype(dtype: Any, config: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        raise TypeError(f"argument 'dtype': expected a torch.dtype or 'auto', got {dtype!r}")
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if found is None:
        return torch.float32
    return found if isinstance(found, torch.dtype) else getattr(torch, str(found).removeprefix("torch."))


def load_quantized(path: str | os.PathLike[str], *, dtype: torch.dtype | str = "auto",
                   device: torch.device | str = "cpu", attn_implementation: str | None = None,
                   model_class: Any = None, progress: ProgressArg = None) -> torch.nn.Module:
    """The transformers model of a GPTQ or AWQ checkpoint directory, its quantized layers :class:`QuantLinear`.

    ``dtype``: the model's float dtype (activations, embeddings, norms,
    biases); ``"auto"`` takes the config's (float32 when it has none). The
    scales keep the checkpoint's dtype. ``device``: where every tensor goes
    as it is read. ``attn_implementation``: as for ``from_pretrained``
    (``"hal"`` registers and uses hal's paged attention).
    ``model_class``: the transformers auto class or model class whose
    ``from_config`` builds the model (default ``AutoModelForCausalLM``).
    ``progress``: None, True (a bar on stderr) or ``progress(done, total,
    name)`` after each quantized layer.

    Which layers are quantized is read from the tensors (a ``.qweight``),
    not from ``modules_to_not_convert``; every other float tensor is cast to
    ``dtype``.

    Raises :class:`hal_core.CheckpointError` (a ``ValueError``) for an unsupported
    ``quantization_config`` (naming the key), a quantized layer without its
    ``qzeros``/``scales`` (or ``g_idx`` under ``desc_act``), or a model
    tensor the checkpoint lacks, before reading any tensor. Checkpoint
    tensors the model does not use are logged as a warning on the ``hal``
    logger. Returns the model in ``eval()`` mode.
    """
    import transformers

    directory = Path(path)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        raise CheckpointError(f"argument 'path': expected a directory holding config.json and *.safetensors, "
                              f"got {str(path)!r}")
    config = transformers.AutoConfig.from_pretrained(str(directory))
    quant = getattr(config, _KEY, None)
    if quant is None:
        raise CheckpointError(f"argument 'path': {directory / 'config.json'} has no {_KEY}; a float checkpoint "
                              f"loads with from_pretrained (then hal_core.torch.quantize_model)")
    fmt = checkpoint_format(quant if isinstance(quant, Mapping) else quant.to_dict())
    torch_dtype = _load_dtype(dtype, config)
    device = torch.device(device)
    if attn_implementation == "hal":
        from . import transformers as _registers_hal_attention  # noqa: F401
    builder = model_class if model_class is not None else transformers.AutoModelForCausalLM
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with torch.device("meta"):
        model = builder.from_config(config, dtype=torch_dtype, **kwargs)

    with ExitStack() as stack:
        tensors = _Tensors(directory, stack)
        layers = _quantized_layers(model, tensors)
        _check_present(fmt, layers, tensors)
        plan = _plan_others(model, tensors, {id(getattr(*places[0])) for places in layers.values()})
        with layer_progress(progress, len(layers), "loading") as step:
            for name in list(layers):
                _load_layer(fmt, name, layers.pop(name), tensors, torch_dtype, device)
                step(name)
        _load_others(plan, tensors, torch_dtype, device)
        unused = sorted(set(tensors.where) - tensors.used)
    if unused:
        log.warning("hal: %d checkpoint tensors are not used by the model: %s", len(unused),
                    ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else ""))
    _materialise_derived_buffers(model, device)
    return model.eval()


def _check_present(fmt: CheckpointFormat, layers: Mapping[str, Any], tensors: _Tensors) -> None:
    for name in layers:
        for part in ("qzeros", "scales"):
            if f"{name}.{part}" not in tensors:
                raise CheckpointError(f"layer {name!r}: the checkpoint has {name}.qweight but no {name}.{part}")
        if fmt.desc_act and f"{name}.g_idx" not in tensors:
            raise CheckpointError(f"{_KEY}.desc_act is true (act-order), but layer {name!r} has no {name}.g_idx: "
                                  f"its rows' groups are unknown")


def _load_layer(fmt: CheckpointFormat, name: str, places: list[tuple[torch.nn.Module, str]], tensors: _Tensors,
                dtype: torch.dtype, device: torch.device) -> None:
    parts = {part: tensors.read(f"{name}.{part}") for part in ("qweight", "qzeros", "scales", "g_idx")
             if f"{name}.{part}" in tensors}
    weight = fmt.convert(name, parts)
    del parts
    linear = getattr(*places[0])
    k, n = weight.shape
    if (k, n) != (linear.in_features, linear.out_features):
        raise CheckpointError(f"layer {name!r}: the checkpoint holds a {k} -> {n} layer, the model "
                              f"{linear.in_features} -> {linear.out_features}")
    bias = tensors.read(f"{name}.bias").to(dtype) if f"{name}.bias" in tensors else None
    layer = QuantLinear.from_weight(weight, bias, device=device)
    for parent, attr in places:
        setattr(parent, attr, layer)


def _plan_others(model: torch.nn.Module, tensors: _Tensors,
                 replaced: set[int]) -> list[tuple[str, list[Place], torch.Size]]:
    """The checkpoint name each float parameter and persistent buffer is read from; CheckpointError if one has none."""
    plan = []
    for names, where, shape in _places(model, replaced):
        key = next((n for n in names if n in tensors), None)
        if key is None:
            raise CheckpointError(f"the checkpoint has no tensor for {' / '.join(names)}")
        plan.append((key, where, shape))
    return plan


def _load_others(plan: list[tuple[str, list[Place], torch.Size]], tensors: _Tensors, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Read each planned tensor (floats cast to ``dtype``) and put it at every place it belongs."""
    for key, where, shape in plan:
        tensor = tensors.read(key)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"{key}: the checkpoint holds shape {tuple(tensor.shape)}, the model "
                                  f"{tuple(shape)}")
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
