"""The compiled rms_norm kernel: every dtype and ISA variant, odd sizes, strided rows, threads, NaN rows."""

from __future__ import annotations

import numpy as np
import pytest
from hal_cpu import _native
from hal_cpu.ops import rms_norm

import hal_core
from hal_core import ArgumentError
from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, rms_norm_inputs

REFERENCE = OPS["rms_norm"].reference


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("hidden", [1, 5, 17, 64, 515, 1031, 4096])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-add"])
def test_norm_matches_reference(variant: str, rng: np.random.Generator, dtype: str, hidden: int,
                                residual: bool) -> None:
    """Rows of any size (tails past the vector width, blocks of 512) match the float64 reference on every variant."""
    args = rms_norm_inputs(rng, num_tokens=7, hidden_size=hidden, dtype=dtype, residual=residual,
                           row_stride=hidden + 3)
    expected, expected_residual = REFERENCE({**args, "weight_offset": 0.25})
    got = rms_norm.norm(args["x"], args["weight"], args["epsilon"], residual=args.get("residual"),
                        weight_offset=0.25, threads=2)
    assert_close(got, expected, kind="elementwise", dtype=dtype, what=f"out ({variant})")
    if residual:
        assert expected_residual is not None
        assert_close(args["residual"], expected_residual, kind="copy", dtype=dtype, what="residual")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_threads_give_the_same_bits(rng: np.random.Generator, dtype: str) -> None:
    """One thread and two give bit-identical outputs and residuals (each row is summed in one fixed order)."""
    args = rms_norm_inputs(rng, num_tokens=33, hidden_size=1000, dtype=dtype)
    r1, r2 = args["residual"].copy(), args["residual"].copy()
    one = rms_norm.norm(args["x"], args["weight"], args["epsilon"], residual=r1, threads=1)
    two = rms_norm.norm(args["x"], args["weight"], args["epsilon"], residual=r2, threads=2)
    np.testing.assert_array_equal(one.view(np.uint8), two.view(np.uint8))
    np.testing.assert_array_equal(r1.view(np.uint8), r2.view(np.uint8))


def test_strided_residual(rng: np.random.Generator) -> None:
    """A residual that is a strided view (rows of a wider buffer) is updated where it is; the gap is untouched."""
    args = rms_norm_inputs(rng, num_tokens=6, hidden_size=40, dtype="fp16")
    wide = np.full((6, 48), np.nan, np.float16)
    wide[:, :40] = args["residual"]
    args["residual"] = wide[:, :40]
    expected, expected_residual = REFERENCE(args)
    got = rms_norm.norm(args["x"], args["weight"], args["epsilon"], residual=args["residual"])
    assert_close(got, expected, kind="elementwise", dtype="fp16")
    assert expected_residual is not None
    assert_close(wide[:, :40], expected_residual, kind="copy", dtype="fp16", what="residual")
    assert np.isnan(wide[:, 40:]).all()


def test_nan_and_inf_rows(variant: str, rng: np.random.Generator) -> None:
    """A NaN makes its row NaN; an infinity gives NaN where it stands and 0 elsewhere in its row; others exact."""
    args = rms_norm_inputs(rng, num_tokens=4, hidden_size=37, dtype="fp32", residual=False)
    args["x"][0, 36] = np.nan
    args["x"][2, 5] = np.inf
    expected, _ = REFERENCE(args)
    got = rms_norm.norm(args["x"], args["weight"], args["epsilon"], threads=1)
    assert np.isnan(got[0]).all() and np.isnan(got[2, 5]) and (got[2, np.arange(37) != 5] == 0).all()
    assert_close(got, expected, kind="elementwise", dtype="fp32")


def test_zero_row_epsilon(rng: np.random.Generator) -> None:
    """A row of zeros gives zeros with epsilon > 0 and NaN with epsilon = 0 (0 * rsqrt(0)), as the reference says."""
    x = np.zeros((2, 20), np.float32)
    weight = np.ones(20, np.float32)
    assert (rms_norm.norm(x, weight, 1e-6) == 0).all()
    assert np.isnan(rms_norm.norm(x, weight, 0.0)).all()
    assert np.isnan(REFERENCE({"x": x, "weight": weight, "epsilon": 0.0})[0]).all()


def test_front_door_runs_the_kernel(rng: np.random.Generator) -> None:
    """``be.ops.rms_norm`` runs hal-cpu's kernel (no fallback), the library being loaded."""
    assert _native.try_load() is not None
    be = hal_core.get_backend("cpu")
    args = rms_norm_inputs(rng, num_tokens=2, hidden_size=64, dtype="bf16")
    call = be.ops.prepare("rms_norm", **args)
    assert be.ops.explain(call)[0] == ("cpu.rms_norm", "runs")


def test_torch_layer_norm_sequence(rng: np.random.Generator) -> None:
    """The fused add-and-norm matches transformers' LlamaRMSNorm after ``residual + hidden`` in bf16 and fp32."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    be = hal_core.get_backend("cpu")
    for dtype, torch_dtype, tol in (("bf16", torch.bfloat16, 1.6e-2), ("fp32", torch.float32, 1e-5)):
        module = llama.LlamaRMSNorm(300, eps=1e-5).to(torch_dtype)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(rng.standard_normal(300).astype(np.float32)).to(torch_dtype))
        x = torch.from_numpy(rng.standard_normal((5, 300)).astype(np.float32)).to(torch_dtype)
        residual = torch.from_numpy(rng.standard_normal((5, 300)).astype(np.float32)).to(torch_dtype)
        with torch.no_grad():
            summed = residual + x
            want = module(summed).float()
        ours = residual.clone()
        got = torch.from_dlpack(be.ops.rms_norm(x, module.weight.detach(), epsilon=1e-5, residual=ours)).float()
        assert torch.equal(ours, summed), f"{dtype}: residual differs from residual + x"
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=f"{dtype}: out")


def test_read_only_residual_refused(rng: np.random.Generator) -> None:
    """A read-only residual is refused naming it, before anything runs."""
    be = hal_core.get_backend("cpu")
    args = rms_norm_inputs(rng, num_tokens=2, hidden_size=8, dtype="fp32")
    args["residual"].flags.writeable = False
    with pytest.raises(ArgumentError, match="'residual'"):
        be.ops.rms_norm(args["x"], args["weight"], epsilon=1e-6, residual=args["residual"])


def test_weight_overlapping_residual_refused(rng: np.random.Generator) -> None:
    """A weight that is a row of the residual is refused naming both (the sum would be read as weight)."""
    be = hal_core.get_backend("cpu")
    args = rms_norm_inputs(rng, num_tokens=3, hidden_size=8, dtype="fp32")
    before = args["residual"].copy()
    with pytest.raises(ArgumentError, match="'weight' and 'residual'"):
        be.ops.rms_norm(args["x"], args["residual"][1], epsilon=1e-6, residual=args["residual"])
    np.testing.assert_array_equal(args["residual"], before)
