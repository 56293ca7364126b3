"""Eager CPU calls straight to hal's front door: torch tensors in, numpy views to the op, a tensor view out.

``torch.ops.hal.*`` costs a dispatcher pass and tensor assembly on every call,
more than a decode-sized norm or activation takes. On CPU tensors outside a
trace and without autograd recording, :func:`host_call` hands numpy views of
the tensors to the backend's front door (the same validation, selection and
kernels as the operator) and returns hal's result as a tensor view (no copy).
:func:`eager_host` says when that route applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..interop import host_view
from ._convert import to_tensor
from ._routing import backend_for

__all__ = ["eager_host", "host_call"]


def eager_host(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` may take the host route: all on the CPU, no trace, no autograd recording."""
    if torch.compiler.is_compiling():
        return False
    recording = torch.is_grad_enabled()
    return all(t.device.type == "cpu" and not (recording and t.requires_grad) for t in tensors)


def host_call(op: str, args: Mapping[str, Any]) -> torch.Tensor | None:
    """Run ``op`` on the backend addressing the first tensor of ``args``; tensors become numpy views (mutated
    in place where the op mutates them), other values pass unchanged. Returns the result as a tensor, if any."""
    lead = next(value for value in args.values() if isinstance(value, torch.Tensor))
    hal_args = {name: host_view(value, name) if isinstance(value, torch.Tensor) else value
                for name, value in args.items()}
    result = backend_for(lead).ops.call(op, hal_args)
    return None if result is None else to_tensor(result)
