"""Gradients of ``torch.ops.hal.quantized_gemm``: with respect to ``x`` only, the quantized weight frozen.

``y = x @ W`` gives ``dL/dx = dL/dy @ W^T`` with ``W = dequantize(qweight, scales, zeros, g_idx)``
``[K, N]``. The backward computes it with torch's own matmul, one block of ``W``'s rows at a time
(:data:`CHUNK_ELEMENTS` weights at most), so the only float copy of the weight is one block, alive
only while the backward runs. It runs in float32 (float64 for a float64 gradient) and returns ``x``'s
dtype.

The weight tensors have no gradient: they are hal's frozen quantized format (integer codes and their
scales), and a weight tensor that requires grad is refused rather than silently given none. For
W8A8 (``bits=8``) and W4A8 (``activations="int8"``) the per-token quantization of the activations is
treated as the identity in the backward (the straight-through estimator): its rounding has zero derivative
almost everywhere.

The ``_out`` operator records no gradient (torch does not differentiate ``out=`` variants);
:func:`refuse_grad_into_out` makes it an error instead of a silent detach.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import ArgumentError

__all__ = ["CHUNK_ELEMENTS", "dequantize_rows", "grad_input", "refuse_grad_into_out", "register_autograd"]

#: The most weight elements one backward dequantizes at once (16 MiB of float32).
CHUNK_ELEMENTS = 1 << 22

_WEIGHT_TENSORS = ("qweight", "scales", "zeros", "g_idx")


def dequantize_rows(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    g_idx: torch.Tensor | None, bits: int, group_size: int, start: int, stop: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows ``start:stop`` of the dequantized weight, ``[stop - start, N]`` in ``dtype`` (int4: multiples of 8).

    ``w[k, n] = (q[k, n] - z[g, n]) * s[g, n]`` with ``g = g_idx[k]`` (or ``k // group_size``), as
    :meth:`hal_core.quant.QuantizedWeight.dequantize` computes it.
    """
    if bits == 4:
        words = qweight[start // 8:stop // 8]
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
        codes = ((words.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(stop - start, qweight.shape[1])
    else:
        codes = qweight[start:stop]
    if g_idx is None:
        groups = torch.div(torch.arange(start, stop, device=qweight.device), group_size, rounding_mode="floor")
    else:
        groups = g_idx[start:stop].long()
    zero = scales.new_tensor(1 << (bits - 1), dtype=dtype) if zeros is None else zeros[groups].to(dtype)
    return (codes.to(dtype) - zero) * scales[groups].to(dtype)


def grad_input(grad: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               g_idx: torch.Tensor | None, bits: int, group_size: int) -> torch.Tensor:
    """``grad [M, N] @ W^T`` as ``[M, K]`` in ``grad``'s dtype, ``W`` dequantized a block of rows at a time."""
    rows, n = qweight.shape
    k = rows * 8 if bits == 4 else rows
    compute = torch.float64 if grad.dtype == torch.float64 else torch.float32
    wide = grad.to(compute)
    out = grad.new_empty((grad.shape[0], k))
    step = max(8, CHUNK_ELEMENTS // max(n, 1) // 8 * 8)
    for start in range(0, k, step):
        stop = min(k, start + step)
        block = dequantize_rows(qweight, scales, zeros, g_idx, bits, group_size, start, stop, compute)
        out[:, start:stop] = (wide @ block.T).to(out.dtype)
        del block
    return out


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    _, qweight, scales, zeros, g_idx, bits, group_size, *settings = inputs  # settings: activations
    for name, tensor in zip(_WEIGHT_TENSORS, (qweight, scales, zeros, g_idx), strict=True):
        if tensor is not None and tensor.requires_grad:
            raise ArgumentError(f"argument {name!r} requires grad: hal's quantized weight is frozen, "
                                f"quantized_gemm gives gradients for 'x' only; pass {name}.detach()")
    ctx.save_for_backward(qweight, scales, zeros, g_idx)
    ctx.bits, ctx.group_size, ctx.settings = bits, group_size, len(settings)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    qweight, scales, zeros, g_idx = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = grad_input(grad, qweight, scales, zeros, g_idx, ctx.bits, ctx.group_size)
    return (grad_x, None, None, None, None, None, None) + (None,) * ctx.settings


#: The ops with a gradient formula: op name -> (backward, setup_context).
_FORMULAS = {"quantized_gemm": (_backward, _setup_context)}


def register_autograd(op_name: str, library: torch.library.Library) -> None:
    """Register the gradient formula of ``torch.ops.hal.<op_name>`` where hal has one."""
    formula = _FORMULAS.get(op_name)
    if formula is not None:
        backward, setup_context = formula
        torch.library.register_autograd(f"hal::{op_name}", backward, setup_context=setup_context, lib=library)


def refuse_grad_into_out(op_name: str, values: dict[str, Any]) -> None:
    """ArgumentError when a differentiable op's ``_out`` operator is given an input that requires grad."""
    if op_name not in _FORMULAS or not torch.is_grad_enabled():
        return
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise ArgumentError(f"argument {name!r} requires grad, but torch.ops.hal.{op_name}_out writes 'out' "
                                f"and records no gradient; call torch.ops.hal.{op_name} (differentiable in 'x') "
                                f"or run under torch.no_grad()")
