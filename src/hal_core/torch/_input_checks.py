"""The input check hal's torch modules share: one activation tensor against the module that takes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._errors import ArgumentError, ArgumentTypeError
from ._dtypes import FLOAT_DTYPE_NAMES

__all__ = ["check_activation"]

#: The activation dtypes hal's kernels take.
ACTIVATION_DTYPES = tuple(FLOAT_DTYPE_NAMES)


def check_activation(x: Any, name: str, owner: Callable[[], str], size: int, weights: torch.Tensor,
                     holder: str) -> None:
    """``ArgumentError`` / ``ArgumentTypeError`` naming argument ``name`` of ``owner()`` (how errors name the
    module; called only to word an error) unless ``x`` is a float tensor ``[..., size]`` on the device of
    ``weights`` (``holder``: what they are)."""
    if (isinstance(x, torch.Tensor) and x.dim() and x.shape[-1] == size and x.dtype in ACTIVATION_DTYPES
            and x.device == weights.device):
        return
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"argument {name!r} of {owner()}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != size:
        raise ArgumentError(f"argument {name!r} of {owner()}: expected shape [..., {size}], got {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ArgumentTypeError(f"argument {name!r} of {owner()}: expected dtype torch.float16, torch.bfloat16 or "
                                f"torch.float32, got {x.dtype} (hal's kernels have no such path; cast it, e.g. "
                                f"x.float())")
    raise ArgumentError(f"argument {name!r} of {owner()}: is on {x.device}, {holder} on {weights.device}; move "
                        f"one of them with .to()")
