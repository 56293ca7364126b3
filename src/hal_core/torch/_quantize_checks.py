"""Everything that would stop :func:`hal_core.quant.quantize` on a layer, checked before any layer is touched.

:func:`layer_problem` reads the weight in blocks of rows where it lives
(no float copy of a whole layer is kept; one block's group extremes are the
transient) and computes the scales exactly as ``quantize`` does: float64
group extremes divided by ``2**(bits-1) - 1`` (symmetric) or ``2**bits - 1``
(zero points), a zero scale made 1, rounded to the scale dtype. A layer
passes when ``quantize`` would accept it.
"""

from __future__ import annotations

import numpy as np
import torch

from ._modules import _SCALE_DTYPES, resolve_group_size

__all__ = ["layer_problem"]

#: Weight dtypes ``quantize`` reads from a torch tensor.
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Elements of one block of rows read at a time.
_BLOCK = 1 << 22


def layer_problem(linear: torch.nn.Linear, *, bits: int, group_size: int, symmetric: bool,
                  scale_dtype: torch.dtype) -> str | None:
    """Why ``linear`` cannot be quantized with these settings, in words, or None when it can."""
    weight, k, n = linear.weight, linear.in_features, linear.out_features
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (n, k):
        return f"its weight has shape {tuple(getattr(weight, 'shape', ()))}, not (out_features, in_features)"
    if weight.dtype not in _WEIGHT_DTYPES:
        return f"its weight is {weight.dtype} (quantize reads float16, bfloat16, float32 or float64)"
    bias = linear.bias
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_floating_point()):
        return f"its bias is {bias.dtype} {tuple(bias.shape)}, not a float vector of out_features"
    if weight.device.type == "meta":
        return "its weight is on the meta device (no values to quantize)"
    try:
        group_size = resolve_group_size(group_size, k)
    except ValueError as exc:
        return str(exc)
    if bits == 4 and k % 8:
        return f"int4 packs 8 input rows per word; in_features={k}"
    return _value_problem(weight.detach(), bits, group_size, symmetric, scale_dtype)


def _value_problem(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                   scale_dtype: torch.dtype) -> str | None:
    n, k = weight.shape
    rows = max(1, _BLOCK // k)
    for start in range(0, n, rows):
        block = weight[start:start + rows].reshape(-1, k // group_size, group_size)  # [rows, groups, G]
        if symmetric:
            amax = block.abs().amax(dim=-1).double().cpu().numpy()
            finite = np.isfinite(amax)
            scale = amax / ((1 << (bits - 1)) - 1)
        else:
            lo = np.minimum(block.amin(dim=-1).double().cpu().numpy(), 0.0)
            hi = np.maximum(block.amax(dim=-1).double().cpu().numpy(), 0.0)
            finite = np.isfinite(lo) & np.isfinite(hi)
            scale = (hi - lo) / ((1 << bits) - 1)
        if not finite.all():
            row, group = np.argwhere(~finite)[0]
            return (f"its weight holds NaN or infinity (output row {start + row}, input rows "
                    f"{group * group_size}..{(group + 1) * group_size - 1})")
        with np.errstate(over="ignore", under="ignore"):
            rounded = np.where(scale > 0, scale, 1.0).astype(_SCALE_DTYPES[scale_dtype]).astype(np.float64)
        bad = ~np.isfinite(rounded) | (rounded == 0)
        if bad.any():
            row, group = np.argwhere(bad)[0]
            what = "overflows" if not np.isfinite(rounded[row, group]) else "rounds to zero in"
            return (f"the scale {scale[row, group]:.6g} of output row {start + row}, input rows "
                    f"{group * group_size}..{(group + 1) * group_size - 1} {what} {scale_dtype} "
                    f"(use scale_dtype=torch.float32)")
    return None
