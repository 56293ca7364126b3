"""rotary_embedding.cu compiled for the CPU (host-compiled kernels): fused-QKV views rotated in place at both SIMD
widths, every dtype, int32 and int64 positions, NeoX and GPT-J pairs, against the float64 reference; a bad position
skipped and flagged."""

from __future__ import annotations

import numpy as np
import pytest
from hal_cupy._specialization import SIMD_WIDTHS
from hal_cupy.ops import _rotary_embedding_rules as rot_rules
from host_compiled.harness import HostKernelBuilder, HostModule

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, rotary_embedding_inputs

DTYPES = ("fp32", "fp16", "bf16")
KERNEL_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _build(builder: HostKernelBuilder, spec: object, rng: np.random.Generator) -> HostModule:
    """Build a plugin specialisation and seed its thread interleaving."""
    module = builder.build(spec.source, dict(spec.defines))  # type: ignore[attr-defined]
    module.seed(int(rng.integers(1, 2**63)))
    return module


ERR_POSITIONS = 128


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
@pytest.mark.parametrize("gptj", [0, 1], ids=["neox", "gptj"])
@pytest.mark.parametrize("pos_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(host_builder: HostKernelBuilder, host_rng: np.random.Generator, dtype: str,
                          pos_dtype: str, gptj: int, warp_size: int) -> None:
    """Fused-QKV views rotated in place (more (head, pair) items than threads, partial rotary); values untouched."""
    rng = host_rng
    module = _build(host_builder, rot_rules.rotary_embedding_spec(
        KERNEL_DTYPES[dtype], pos_dtype == "int64", warp_size), rng)
    args = rotary_embedding_inputs(rng, num_tokens=6, num_heads=5, num_kv_heads=3, head_size=96, dtype=dtype,
                                   rotary_dim=80, max_position=50)
    args["positions"] = args["positions"].astype(pos_dtype)
    args["style"] = "gptj" if gptj else "neox"
    want_q, want_k = OPS["rotary_embedding"].reference(args)
    qkv = np.concatenate([args["query"], args["key"], args["key"]], axis=1)
    values = qkv[:, 8:].copy()
    query, key = qkv[:, :5], qkv[:, 5:8]
    item = qkv.itemsize
    flag = np.zeros(1, np.int32)
    module.launch(rot_rules.rotary_embedding_launch(6), args["positions"], query, key, args["cos_sin_cache"],
                  query.strides[0] // item, query.strides[1] // item, key.strides[0] // item, key.strides[1] // item,
                  5, 3, 80, gptj, 50, flag)
    assert flag[0] == 0
    assert_close(query, want_q, kind="rotary", dtype=dtype, what="query")
    assert_close(key, want_k, kind="rotary", dtype=dtype, what="key")
    np.testing.assert_array_equal(qkv[:, 8:].view(np.uint8), values.view(np.uint8))


@pytest.mark.parametrize("warp_size", SIMD_WIDTHS, ids=lambda w: f"warp{w}")
def test_rotary_embedding_bad_position_is_skipped(host_builder: HostKernelBuilder, host_rng: np.random.Generator,
                                                  warp_size: int) -> None:
    """A position past the table (or negative) leaves its token as it is and flags positions; a null key is
    never touched."""
    rng = host_rng
    module = _build(host_builder, rot_rules.rotary_embedding_spec("float32", True, warp_size), rng)
    args = rotary_embedding_inputs(rng, num_tokens=4, num_heads=2, num_kv_heads=1, head_size=32, dtype="fp32",
                                   max_position=10, with_key=False, poison=False)
    positions = args["positions"].astype(np.int64)
    positions[1], positions[3] = 10, -1
    query = args["query"].copy()
    keep = np.array([True, False, True, False])
    (want,) = OPS["rotary_embedding"].reference(dict(args, positions=positions[keep], query=query[keep]))
    flag = np.zeros(1, np.int32)
    module.launch(rot_rules.rotary_embedding_launch(4), positions, query, None, args["cos_sin_cache"], 64, 32, 0, 0,
                  2, 0, 32, 0, 10, flag)
    assert flag[0] == ERR_POSITIONS
    assert_close(query[keep], want, kind="rotary", dtype="fp32", what="query")
    np.testing.assert_array_equal(query[~keep], args["query"][~keep])
