"""``write_kv_cache`` on the host: one fancy-index scatter per cache."""

from __future__ import annotations

import numpy as np

from hal_core.ops import OpCall

__all__ = ["write_kv_cache"]


def write_kv_cache(call: OpCall) -> None:
    """Scatter ``key``/``value`` rows to their slots; negative slots are skipped."""
    key, value = np.asarray(call["key"]), np.asarray(call["value"])
    key_cache, value_cache = call["key_cache"], call["value_cache"]
    slots = np.asarray(call["slot_mapping"]).astype(np.int64)
    keep = np.flatnonzero(slots >= 0)
    block_size = key_cache.shape[2]
    blocks, offsets = np.divmod(slots[keep], block_size)
    new_keys, new_values = key[keep], value[keep]  # gathered first: nothing is written if this fails
    key_cache[blocks, :, offsets] = new_keys
    value_cache[blocks, :, offsets] = new_values
    return None
