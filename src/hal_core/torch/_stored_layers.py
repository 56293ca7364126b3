"""One quantized linear layer of a checkpoint: its stored tensors checked from their headers, then converted.

:func:`~hal_core.torch.load_quantized` checks every layer it will load
(:func:`check_stored_layer`) before it reads any tensor, then converts them
one layer at a time (:func:`read_stored_layer`): the model's linear layers
and the experts of its MoE blocks alike.
"""

from __future__ import annotations

from .._errors import CheckpointError
from ..quant import QuantizedWeight
from ..quant._checkpoint_format import KEY, CheckpointFormat, TensorSpec
from ._checkpoint_files import Tensors

__all__ = ["check_header", "check_stored_layer", "read_stored_layer"]


def check_header(tensors: Tensors, key: str, spec: TensorSpec, prefix: str = "") -> None:
    """Refuse ``key`` if its stored shape or dtype is not ``spec``'s, from its header alone."""
    shape, dtype = tensors.header(key)
    if shape != spec.shape:
        raise CheckpointError(f"{prefix}{tensors.show(key)} has shape {shape}, expected {spec.shape} "
                              f"({spec.layout})")
    if dtype not in spec.dtypes:
        raise CheckpointError(f"{prefix}{tensors.show(key)} has dtype {dtype}, expected "
                              f"{' or '.join(sorted(spec.dtypes))} ({spec.layout})")


def check_stored_layer(base: CheckpointFormat, name: str, k: int, n: int, tensors: Tensors, *,
                       bias: bool = False) -> None:
    """Layer ``name`` (``k`` inputs, ``n`` outputs) has every stored tensor it needs, each of the right shape and
    dtype (a ``.bias`` too when ``bias``); CheckpointError naming the layer and the tensor otherwise."""
    fmt = base.for_layer(name)
    if f"{name}.qweight" not in tensors:
        raise CheckpointError(f"layer {name!r}: the checkpoint has no {name}.qweight")
    for part in ("qzeros", "scales"):
        if f"{name}.{part}" not in tensors:
            raise CheckpointError(f"layer {name!r}: the checkpoint has {name}.qweight but no {name}.{part}")
    if fmt.desc_act and f"{name}.g_idx" not in tensors:
        raise CheckpointError(f"{KEY}.desc_act is true (act-order), but layer {name!r} has no {name}.g_idx: "
                              f"its rows' groups are unknown")
    if bias and f"{name}.bias" not in tensors:
        raise CheckpointError(f"layer {name!r}: the model's layer has a bias, the checkpoint no {name}.bias")
    specs = fmt.layer_specs(name, k, n)
    for part in (*fmt.parts, "bias") if bias else fmt.parts:
        if f"{name}.{part}" in tensors:
            check_header(tensors, f"{name}.{part}", specs[part], f"layer {name!r}: ")


def read_stored_layer(base: CheckpointFormat, name: str, tensors: Tensors) -> QuantizedWeight:
    """Layer ``name``'s tensors read and converted to hal's format (host arrays, bit-identical)."""
    fmt = base.for_layer(name)
    parts = {part: tensors.read(f"{name}.{part}") for part in fmt.parts if f"{name}.{part}" in tensors}
    return fmt.convert(name, parts)
