"""Group-wise weight quantisation: formats, packing, and (de)quantisation.

See :class:`QuantizedWeight` for the storage layout.
"""

from __future__ import annotations

from ._quantize import quantize, quantize_activations
from ._weight import QuantizedWeight, pack_int4, unpack_int4

__all__ = ["QuantizedWeight", "pack_int4", "quantize", "quantize_activations", "unpack_int4"]
