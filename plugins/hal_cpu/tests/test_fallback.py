"""The numpy fallback, which runs only where the compiled library cannot be loaded: still the reference results."""

from __future__ import annotations

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import gated_activation, paged_attention, quantized_gemm, rms_norm, write_kv_cache

from hal_core.ops import OPS
from hal_core.testing.inputs import (
    assert_close,
    gated_activation_inputs,
    paged_attention_inputs,
    quantized_gemm_inputs,
    rms_norm_inputs,
    write_kv_cache_inputs,
)


@pytest.fixture
def no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every op see a library that failed to load."""
    monkeypatch.setattr(_native, "try_load", lambda: None)


@pytest.mark.usefixtures("no_library")
def test_attention_fallback(rng: np.random.Generator) -> None:
    """The numpy attention matches the reference (finite inputs, NaN-poisoned unused slots)."""
    args = paged_attention_inputs(rng, seq_lens=[0, 5, 70], num_heads=8, num_kv_heads=2, head_size=32,
                                  block_size=8, dtype="fp16")
    got = paged_attention.attend(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                 args["seq_lens"], args["scale"])
    assert_close(got, OPS["paged_attention"].reference(args), kind="attention", dtype="fp16")


@pytest.mark.usefixtures("no_library")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gemm_fallback(rng: np.random.Generator, bits: int, act_order: bool) -> None:
    """The numpy GEMMs (bounded column tiles) match the reference; W8A8 gives NaN rows for NaN activations."""
    args = quantized_gemm_inputs(rng, m=3, k=128, n=300, bits=bits, group_size=32, symmetric=False, dtype="fp32",
                                 act_order=act_order)
    assert_close(quantized_gemm.gemm(args["x"], args["qweight"]), OPS["quantized_gemm"].reference(args),
                 kind="gemm", dtype="fp32")
    if bits == 8:
        args["x"][1, 0] = np.nan
        assert np.isnan(quantized_gemm.gemm(args["x"], args["qweight"])[1]).all()


@pytest.mark.usefixtures("no_library")
def test_write_kv_cache_fallback(rng: np.random.Generator) -> None:
    """The numpy scatter writes the same bits."""
    args = write_kv_cache_inputs(rng, num_tokens=9, num_blocks=4, num_kv_heads=2, block_size=8, head_size=16,
                                 dtype="bf16")
    expected_k, expected_v = OPS["write_kv_cache"].reference(args)
    write_kv_cache.scatter(args["key"], args["value"], args["key_cache"], args["value_cache"], args["slot_mapping"])
    np.testing.assert_array_equal(args["key_cache"].astype(np.float64), expected_k)
    np.testing.assert_array_equal(args["value_cache"].astype(np.float64), expected_v)


@pytest.mark.usefixtures("no_library")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rms_norm_and_gated_activation_fallback(rng: np.random.Generator, dtype: str) -> None:
    """The numpy norm (residual written back bit-exactly) and activations match the references."""
    args = rms_norm_inputs(rng, num_tokens=5, hidden_size=33, dtype=dtype, row_stride=40)
    expected, expected_residual = OPS["rms_norm"].reference({**args, "weight_offset": 1.0})
    got = rms_norm.norm(args["x"], args["weight"], args["epsilon"], residual=args["residual"], weight_offset=1.0)
    assert_close(got, expected, kind="elementwise", dtype=dtype)
    assert expected_residual is not None
    assert_close(args["residual"], expected_residual, kind="copy", dtype=dtype, what="residual")
    for activation in ("silu", "gelu", "gelu_tanh"):
        acts = gated_activation_inputs(rng, num_tokens=3, intermediate_size=50, dtype=dtype, activation=activation)
        assert_close(gated_activation.gated(acts["gate"], acts["up"], activation),
                     OPS["gated_activation"].reference(acts), kind="elementwise", dtype=dtype, what=activation)

