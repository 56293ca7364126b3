"""A paged KV cache for engines: block bookkeeping plus the caches on one device.

:class:`BlockTable` does the bookkeeping alone (no arrays): sequences own
lists of fixed-size blocks handed out from a free list, forks share full
blocks by reference count. :class:`PagedKVCache` owns the key and value
caches of every layer on one device, in the layout the ops use
(``[num_blocks, num_kv_heads, block_size, head_size]``), and turns a step's
work into the ``slot_mapping``, ``block_tables`` and ``seq_lens`` arrays
:func:`write_kv_cache` and :func:`paged_attention` take. See
docs/engine-guide.md.
"""

from __future__ import annotations

from ._blocks import BlockTable, BlockUsage, ForkCopy
from ._cache import CacheConfig, KVCacheUsage, PagedKVCache, StepInputs

__all__ = ["BlockTable", "BlockUsage", "CacheConfig", "ForkCopy", "KVCacheUsage", "PagedKVCache", "StepInputs"]

for _name in __all__:  # public names report the public module they are documented in
    globals()[_name].__module__ = __name__
