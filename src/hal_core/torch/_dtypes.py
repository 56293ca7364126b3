"""hal's dtype names and torch's dtypes: the one map between them (the torch layer and hal-vllm use it)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

__all__ = ["FLOAT_DTYPE_NAMES", "TORCH_DTYPES"]

#: torch's dtype of each hal dtype name torch has (:data:`hal_core.arrays.DTYPE_NAMES` names numpy's).
TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8,
})

#: hal's dtype name of each torch floating-point dtype hal's ops compute in (activations, KV caches); a dtype
#: not in it (float64, the integers) is one they do not take.
FLOAT_DTYPE_NAMES: Mapping[torch.dtype, str] = MappingProxyType(
    {TORCH_DTYPES[name]: name for name in ("fp32", "fp16", "bf16")})
