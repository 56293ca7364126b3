"""Zero-copy conversions between hal's native arrays and torch tensors.

hal's backends return numpy arrays (host) or CuPy arrays (device, bf16 as a
``TaggedArray``); engines want torch tensors. Every conversion here is a
view of the same memory: DLPack for what DLPack carries, and 16-bit integer
storage viewed as ``torch.bfloat16`` for bf16, which neither numpy nor CuPy
can export.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..arrays import BFLOAT16, TaggedArray

__all__ = ["to_tensor"]


def to_tensor(array: Any) -> torch.Tensor:
    """``array`` (numpy, CuPy, a bf16 ``TaggedArray`` or any DLPack producer) as a torch tensor view."""
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, TaggedArray):
        storage = to_tensor(array.storage)
        return storage.view(torch.bfloat16) if array.hal_dtype == "bf16" else storage
    if isinstance(array, np.ndarray):
        if array.dtype == BFLOAT16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    return torch.from_dlpack(array)
