"""rms_norm.cu and gated_activation.cu compiled for the host, launched as the plugin's launch rules say.

The real kernel sources (host prelude, g++; see test_kernels_host_compiled.py) at warp 32 and wavefront 64,
on fresh random inputs (seed printed) against hal_core's float64 references: every dtype, 16-byte and
element-wise paths (odd sizes, strided rows, a misaligned row), the fused residual add, NaN rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from hal_cupy._specialization import SIMD_WIDTHS
from hal_cupy.ops import _gated_activation_rules as ga_rules
from hal_cupy.ops import _rms_norm_rules as rn_rules
from host_compiled.harness import HostKernelBuilder, HostModule

from hal_core.ops import OPS
from hal_core.ops.gated_activation import ACTIVATIONS
from hal_core.testing.inputs import assert_close, gated_activation_inputs, rms_norm_inputs

DTYPES = ("fp32", "fp16", "bf16")
KERNEL_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _build(builder: HostKernelBuilder, spec: object, rng: np.random.Generator) -> HostModule:
    module = builder.build(spec.source, dict(spec.defines))  # type: ignore[attr-defined]
    module.seed(int(rng.integers(1, 2**63)))
    return module


def _stride(array: np.ndarray) -> int:
    return array.strides[0] // array.itemsize


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hidden", "gap", "residual"), [(4096, 0, True), (2048, 8, False), (131, 5, True),
                                                         (1, 0, True), (600, 0, False)],
                         ids=["h4096-fused", "h2048-strided", "h131-odd", "h1", "h600-plain"])
def test_rms_norm_kernel(host_builder: HostKernelBuilder, host_rng: np.random.Generator, warp_size: int,
                         dtype: str, hidden: int, gap: int, residual: bool) -> None:
    """Rows normalised and weighted (16-byte and element paths); the residual holds the rounded sum bit-exactly."""
    args = rms_norm_inputs(host_rng, num_tokens=3, hidden_size=hidden, dtype=dtype, residual=residual,
                           row_stride=hidden + gap)
    args["weight_offset"] = 0.5
    expected, expected_residual = OPS["rms_norm"].reference(args)
    module = _build(host_builder, rn_rules.rms_norm_spec(KERNEL_DTYPES[dtype], warp_size), host_rng)
    out = np.full((3, hidden), np.nan, dtype=args["x"].dtype)
    res = args.get("residual")
    module.launch(rn_rules.rms_norm_launch(3), out, args["x"], args["weight"], res, _stride(args["x"]),
                  0 if res is None else _stride(res), hidden, args["epsilon"], 0.5)
    assert_close(out, expected, kind="elementwise", dtype=dtype, what="out")
    if residual:
        assert expected_residual is not None
        assert_close(res, expected_residual, kind="copy", dtype=dtype, what="residual")


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
def test_rms_norm_kernel_nan_row(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                 warp_size: int) -> None:
    """A NaN in one row of the residual makes that row NaN; the other rows are right."""
    args = rms_norm_inputs(host_rng, num_tokens=3, hidden_size=64, dtype="bf16")
    args["residual"][1, 7] = np.nan
    expected, _ = OPS["rms_norm"].reference(args)
    module = _build(host_builder, rn_rules.rms_norm_spec("bfloat16", warp_size), host_rng)
    out = np.zeros((3, 64), dtype=args["x"].dtype)
    module.launch(rn_rules.rms_norm_launch(3), out, args["x"], args["weight"], args["residual"], 64, 64, 64,
                  args["epsilon"], 0.0)
    assert np.isnan(out[1].astype(np.float32)).all()
    assert_close(out, expected, kind="elementwise", dtype="bf16")


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(("inter", "fused"), [(5632, True), (1000, False), (77, True)],
                         ids=["i5632-fused", "i1000", "i77-fused"])
def test_gated_activation_kernel(host_builder: HostKernelBuilder, host_rng: np.random.Generator, warp_size: int,
                                 dtype: str, activation: str, inter: int, fused: bool) -> None:
    """act(gate) * up over the launch rule's column blocks, halves of a fused projection included."""
    args = gated_activation_inputs(host_rng, num_tokens=2, intermediate_size=inter, dtype=dtype, fused=fused,
                                   activation=activation)
    module = _build(host_builder, ga_rules.gated_activation_spec(KERNEL_DTYPES[dtype], warp_size), host_rng)
    out = np.full((2, inter), np.nan, dtype=args["gate"].dtype)
    module.launch(ga_rules.gated_activation_launch(2, inter, KERNEL_DTYPES[dtype]), out, args["gate"], args["up"],
                  _stride(args["gate"]), _stride(args["up"]), inter, ga_rules.ACTIVATION_CODES[activation])
    assert_close(out, OPS["gated_activation"].reference(args), kind="elementwise", dtype=dtype)
