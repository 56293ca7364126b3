"""The contract suite: run it with ``pytest --pyargs hal_core.testing.suite --hal-backend=NAME``.

A plugin's own tests can collect it too: ``from hal_core.testing.suite import *``
in one of its test modules brings in every test function (names start with
``test_``); the fixtures come from hal-core's pytest plugin.
"""

from __future__ import annotations

from . import (
    test_contracts,
    test_fused_moe,
    test_gated_activation,
    test_kv_layouts,
    test_numerics,
    test_paged_attention,
    test_quantized_gemm,
    test_rms_norm,
    test_rotary_embedding,
    test_sample,
    test_write_kv_cache,
)

__all__: list[str] = []
_MODULES = (test_contracts, test_kv_layouts, test_numerics, test_paged_attention, test_quantized_gemm,
            test_write_kv_cache, test_sample, test_rms_norm, test_gated_activation, test_rotary_embedding,
            test_fused_moe)
for _module in _MODULES:
    for _name in dir(_module):
        if _name.startswith("test_"):
            globals()[_name] = getattr(_module, _name)
            __all__.append(_name)
