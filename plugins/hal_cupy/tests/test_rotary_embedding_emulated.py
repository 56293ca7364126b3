"""rotary_embedding through the GPU op implementation on the emulated device (``kernel_emulator``): one launch,
query and key rotated in place (fused-QKV views included), a null key, host arrays offloaded, bad strides refused."""

from __future__ import annotations

from typing import Any

import kernel_emulator as emu
import numpy as np
import pytest
import test_ops_emulated as emulated
from kernel_emulator import NP, host, to_dev

from hal_core.ops import OPS, OpCall
from hal_core.testing.inputs import assert_close, rotary_embedding_inputs

#: The emulated GPU backend (an H200 and an MI300X stand-in) of test_ops_emulated, and its call helper.
backend = emulated.backend
run = emulated.run


@pytest.mark.parametrize("style", [None, "gptj"])
@pytest.mark.parametrize("pos_dtype", [np.int32, np.int64], ids=["pos32", "pos64"])
@pytest.mark.parametrize("dtype", list(NP))
def test_rotary_embedding(backend: Any, rng: np.random.Generator, dtype: str, pos_dtype: Any,
                          style: str | None) -> None:
    """One launch per call, query and key rotated in place as the reference says (partial rotary)."""
    args = rotary_embedding_inputs(rng, num_tokens=7, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
                                   rotary_dim=48, max_position=30)
    args["positions"], args["style"] = args["positions"].astype(pos_dtype), style
    want_q, want_k = OPS["rotary_embedding"].reference(args)
    result, dev = run("rotary_embedding", backend, args)
    assert result is None and emu.LAUNCHED == ["hal_rotary_embedding"]
    assert_close(host(dev["query"]), want_q, kind="rotary", dtype=dtype, what="query")
    assert_close(host(dev["key"]), want_k, kind="rotary", dtype=dtype, what="key")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_rotary_embedding_fused_views_in_place(backend: Any, rng: np.random.Generator, dtype: str) -> None:
    """Query and key as slices of one device QKV array are rotated where they are; the value slice is untouched."""
    args = rotary_embedding_inputs(rng, num_tokens=5, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype)
    qkv = np.concatenate([args["query"], args["key"], args["key"]], axis=1)
    dev_qkv = to_dev(qkv)
    dev_args = OPS["rotary_embedding"].map_arrays(dict(args, query=None, key=None), to_dev)
    dev_args.update(query=dev_qkv[:, :4], key=dev_qkv[:, 4:6])
    OPS["rotary_embedding"].validate(dev_args, host)
    call = OpCall(spec=OPS["rotary_embedding"], args=dev_args, backend=backend, host_arrays=False)
    from hal_cupy.ops import OPS as CUDA_OPS

    impl = next(o for o in CUDA_OPS if o.op == "rotary_embedding")
    assert impl.supports(call) is True
    impl(call)
    want_q, want_k = OPS["rotary_embedding"].reference(args)
    after = host(dev_qkv)
    assert_close(after[:, :4], want_q, kind="rotary", dtype=dtype, what="query")
    assert_close(after[:, 4:6], want_k, kind="rotary", dtype=dtype, what="key")
    np.testing.assert_array_equal(after[:, 6:].view(np.uint16), qkv[:, 6:].view(np.uint16))


def test_rotary_embedding_query_alone_and_host_offload(backend: Any, rng: np.random.Generator,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """key=None passes a null key; host arrays (threshold 0) are rotated on the device and written back."""
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "0")
    args = rotary_embedding_inputs(rng, num_tokens=3, num_heads=2, num_kv_heads=1, head_size=32, dtype="fp32",
                                   with_key=False)
    (want_q,) = OPS["rotary_embedding"].reference(args)
    run("rotary_embedding", backend, args, host_arrays=True)
    assert emu.LAUNCHED == ["hal_rotary_embedding"]
    assert_close(args["query"], want_q, kind="rotary", dtype="fp32", what="query")


def test_rotary_embedding_refuses_strides_of_partial_elements(backend: Any, rng: np.random.Generator) -> None:
    """A query view whose strides are not whole elements is left to the CPU path, with the reason."""
    args = rotary_embedding_inputs(rng, num_tokens=3, num_heads=2, num_kv_heads=1, head_size=8, dtype="fp16")
    dev_args = OPS["rotary_embedding"].map_arrays(args, to_dev)
    odd = np.ndarray.__new__(emu.DevArray, (3, 2, 8), np.float16, buffer=np.zeros(200, np.uint8), offset=0,
                             strides=(33, 16, 2))  # a token stride of 33 bytes: half an element
    dev_args["query"] = odd
    call = OpCall(spec=OPS["rotary_embedding"], args=dev_args, backend=backend, host_arrays=False)
    from hal_cupy.ops import OPS as CUDA_OPS

    reason = next(o for o in CUDA_OPS if o.op == "rotary_embedding").supports(call)
    assert isinstance(reason, str) and "'query'" in reason and "whole elements" in reason
