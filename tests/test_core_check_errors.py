"""``hal_core.check_errors()``: asks every bound backend, raises what a device recorded, a no-op on the host."""

from __future__ import annotations

import numpy as np
import pytest

import hal_core
from hal_core.testing.inputs import paged_attention_inputs


def test_nothing_bound_is_a_no_op() -> None:
    """Before any backend is bound there is nothing to check (and no discovery is started)."""
    hal_core.reset()
    hal_core.check_errors()


def test_the_cpu_backend_checks_eagerly_so_check_errors_is_a_no_op() -> None:
    """Host backends raise before any work; their hook does nothing, even after a bad call."""
    be = hal_core.get_backend("cpu")
    args = paged_attention_inputs(np.random.default_rng(3), seq_lens=[9], num_heads=2, num_kv_heads=1,
                                  head_size=64, block_size=8, dtype="fp32")
    args["block_tables"][0, 0] = 10**6
    with pytest.raises(hal_core.ArgumentError, match="'block_tables'"):
        be.ops.paged_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                               args["seq_lens"], scale=args["scale"])
    be.check_errors()
    hal_core.check_errors()


def test_check_errors_raises_what_a_bound_backend_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public function delegates to each bound backend's hook, so a device's recorded error reaches the caller."""
    be = hal_core.get_backend("cpu")
    calls: list[str] = []

    def recorded(self: hal_core.Backend) -> None:
        calls.append(self.name)
        raise hal_core.ArgumentError("argument 'seq_lens': a length beyond max_seq_len (recorded on the device)")

    monkeypatch.setattr(type(be), "check_errors", recorded)
    with pytest.raises(hal_core.ArgumentError, match="'seq_lens'"):
        hal_core.check_errors()
    assert calls == ["cpu"]
