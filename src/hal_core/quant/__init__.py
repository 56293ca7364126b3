"""Group-wise weight quantisation: formats, packing, and (de)quantisation.

See :class:`QuantizedWeight` for the storage layout; :func:`from_gptq` and
:func:`from_awq` import checkpoint tensors.
"""

from __future__ import annotations

from ._experts import ExpertWeights, quantize_experts
from ._gptq_export import to_gptq
from ._quantize import quantize, quantize_activations
from ._weight import QuantizedWeight, pack_int4, unpack_int4
from .awq import from_awq
from .gptq import from_gptq

__all__ = [
    "ExpertWeights",
    "QuantizedWeight",
    "from_awq",
    "from_gptq",
    "pack_int4",
    "quantize",
    "quantize_activations",
    "quantize_experts",
    "to_gptq",
    "unpack_int4",
]

for _name in __all__:  # public names report the public module they are documented in
    if getattr(globals()[_name], "__module__", "").startswith("hal_core.quant."):
        globals()[_name].__module__ = __name__
