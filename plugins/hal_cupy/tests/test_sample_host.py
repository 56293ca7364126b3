"""``sample.cu`` compiled for the CPU (host-compiled kernels): the reference's tokens, greedy, special rows and
the device parameter checks, at warp 32 and wavefront 64.

Launches come from the plugin's pure rules (``_sample_rules``); inputs are fresh per run (seed printed); tokens
are compared with the float64 reference of ``hal_core.ops.sample`` (a token differing only where the reference's
``u`` lies within rounding of a CDF boundary is accepted).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hal_cupy._specialization import SIMD_WIDTHS
from hal_cupy.ops import _sample_rules as rules
from host_compiled.harness import HostKernelBuilder, HostModule

from hal_core.testing.inputs import sample_inputs
from hal_core.testing.sampling import assert_same_tokens

DTYPE_CODES = {"fp32": 0, "fp16": 1, "bf16": 2}
#: The parameter codes sample.cu reports in the error flag.
ERR_TEMPERATURE, ERR_TOP_P, ERR_MIN_P = 16, 32, 64


def _build(builder: HostKernelBuilder, dtype: str, warp_size: int, rng: np.random.Generator) -> HostModule:
    spec = rules.sample_spec(DTYPE_CODES[dtype], warp_size)
    module = builder.build(spec.source, dict(spec.defines))
    module.seed(int(rng.integers(1, 2**63)))
    return module


def _launch(module: HostModule, args: dict[str, Any]) -> tuple[np.ndarray, int]:
    logits = args["logits"]
    rows, vocab = logits.shape
    out = np.full(rows, 12345, np.int64)
    flag = np.zeros(1, np.int32)
    module.launch(rules.sample_launch(rows), logits, logits.strides[0] // logits.itemsize, vocab,
                  args["temperature"], args.get("top_k"), args.get("top_p"), args.get("min_p"), args["seeds"],
                  out, flag)
    return out, int(flag[0])


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("vocab", [1, 7, 300, 32000])
def test_sample_kernel(host_builder: HostKernelBuilder, host_rng: np.random.Generator, dtype: str, vocab: int,
                       warp_size: int) -> None:
    """Mixed greedy and filtered rows, strided: each row's token is the reference's for its seed."""
    module = _build(host_builder, dtype, warp_size, host_rng)
    args = sample_inputs(host_rng, num_seqs=5, vocab_size=vocab, dtype=dtype, strided=True)
    got, flag = _launch(module, args)
    assert flag == 0
    assert_same_tokens(got, args)


def test_sample_kernel_large_vocabulary(host_builder: HostKernelBuilder, host_rng: np.random.Generator) -> None:
    """A 151936-token bf16 vocabulary with every filter on: the reference's tokens."""
    module = _build(host_builder, "bf16", 32, host_rng)
    args = sample_inputs(host_rng, num_seqs=3, vocab_size=151936, dtype="bf16")
    args["temperature"][:] = 0.8
    got, flag = _launch(module, args)
    assert flag == 0
    assert_same_tokens(got, args)


def test_sample_kernel_ties_and_many_seeds(host_builder: HostKernelBuilder, host_rng: np.random.Generator) -> None:
    """A ties-heavy row drawn with 96 seeds under top-k, top-p and min-p: each draw is the reference's."""
    module = _build(host_builder, "fp32", 32, host_rng)
    rows = 96
    row = (np.round(host_rng.standard_normal(500) * 3) / 2).astype(np.float32)
    args = {"logits": np.tile(row, (rows, 1)), "temperature": np.full(rows, 0.7, np.float32),
            "seeds": host_rng.integers(-2**63, 2**62, rows, dtype=np.int64),
            "top_k": np.tile(np.array([0, 1, 37, 200], np.int32), rows // 4),
            "top_p": np.tile(np.array([0.5, 1.0, 0.9, 0.2], np.float32), rows // 4),
            "min_p": np.tile(np.array([0.0, 0.3, 0.05, 1.0], np.float32), rows // 4)}
    got, flag = _launch(module, args)
    assert flag == 0
    assert_same_tokens(got, args)


def test_sample_kernel_special_rows(host_builder: HostKernelBuilder, host_rng: np.random.Generator) -> None:
    """NaN or only -inf: -1; -inf tokens never drawn; a +inf maximum draws among the +inf tokens; greedy ties."""
    module = _build(host_builder, "fp16", 64, host_rng)
    rows, vocab = 6, 40
    logits = np.tile(np.arange(vocab, dtype=np.float16), (rows, 1))
    logits[:, ::2] = -np.inf
    logits[0, 7] = np.nan
    logits[1] = -np.inf
    logits[2, [5, 33]] = np.inf
    logits[4, [3, 39]] = 60.0
    temperature = np.array([1, 1, 1, 1, 0, 0], np.float32)
    logits[5, 9] = np.nan
    args = {"logits": logits, "temperature": temperature, "seeds": np.arange(rows, dtype=np.int64)}
    got, flag = _launch(module, args)
    assert flag == 0
    assert got.tolist()[:2] == [-1, -1] and got[2] in (5, 33) and got[3] % 2 == 1 and got[4] == 3 and got[5] == -1
    assert_same_tokens(got, args)


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
def test_sample_kernel_reports_bad_parameters(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                              warp_size: int) -> None:
    """Device parameters out of range: their rows get -1, the flag names each argument, other rows are drawn."""
    module = _build(host_builder, "fp32", warp_size, host_rng)
    args = sample_inputs(host_rng, num_seqs=6, vocab_size=100, dtype="fp32")
    args["temperature"][1] = -1.0
    args["top_p"][3] = 0.0
    args["min_p"][4] = np.nan
    got, flag = _launch(module, args)
    assert flag == ERR_TEMPERATURE | ERR_TOP_P | ERR_MIN_P
    assert got[[1, 3, 4]].tolist() == [-1, -1, -1]
    good = np.array([0, 2, 5])
    assert_same_tokens(got[good], {k: v[good] for k, v in args.items()})
