"""``sample`` through the GPU implementation on emulated kernels: the launch, the arguments, no host reads.

The op runs end to end on a stand-in GPU backend (``test_ops_emulated``'s H200 and MI300X, and
``test_no_host_sync``'s counting one) whose ``hal_sample`` is ``kernel_emulator``'s; its tokens are compared with
the float64 reference, device parameter values out of range surface as an ``ArgumentError`` at the next
synchronisation, and nothing is copied to the host or waited for during a call.
"""

from __future__ import annotations

from typing import Any

import kernel_emulator as emu
import numpy as np
import pytest
from kernel_emulator import host, to_dev
from test_no_host_sync import gpu  # noqa: F401 - the counting backend fixture
from test_ops_emulated import backend, run  # noqa: F401 - the emulated backend fixture

import hal_core
from hal_core.ops import OPS
from hal_core.testing.inputs import sample_inputs
from hal_core.testing.sampling import assert_same_tokens


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the sample op module at the fake CuPy the backend fixture installed."""
    from hal_cupy import _cupy
    from hal_cupy.ops import _sample

    monkeypatch.setattr(_sample, "cupy", _cupy.cupy)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_sample_on_the_emulated_gpu(backend: Any, patched: None, rng: np.random.Generator, dtype: str,  # noqa: F811
                                    strided: bool) -> None:
    """One hal_sample launch of one CTA per row, the right specialisation, the reference's tokens as int64."""
    args = sample_inputs(rng, num_seqs=5, vocab_size=300, dtype=dtype, strided=strided)
    got, _ = run("sample", backend, args)
    assert emu.LAUNCHED == ["hal_sample"]
    tokens = host(got)
    assert tokens.dtype == np.int64
    assert_same_tokens(tokens, args)


def test_sample_optional_parameters_as_null(backend: Any, patched: None, rng: np.random.Generator) -> None:  # noqa: F811
    """No top_k / top_p / min_p: null pointers, and the reference's tokens with those filters off."""
    args = sample_inputs(rng, num_seqs=4, vocab_size=64, dtype="fp32", top_k=False, top_p=False, min_p=False)
    got, _ = run("sample", backend, args)
    np.testing.assert_array_equal(host(got), OPS["sample"].reference(args))


def test_sample_reads_nothing_back(gpu: Any, patched: None, rng: np.random.Generator) -> None:  # noqa: F811
    """sample on device arrays: nothing crosses to the host, nothing waits; the tokens are the reference's."""
    args = sample_inputs(rng, num_seqs=6, vocab_size=500, dtype="bf16")
    dev = {k: to_dev(v) for k, v in args.items()}
    with gpu.counter.window() as crossed:
        got = gpu.ops.sample(dev["logits"], dev["temperature"], dev["seeds"], top_k=dev["top_k"], top_p=dev["top_p"],
                             min_p=dev["min_p"])
    assert crossed == []
    assert_same_tokens(host(got), args)
    gpu.check_errors()


def test_sample_bad_device_value_surfaces_at_synchronisation(gpu: Any, patched: None,  # noqa: F811
                                                             rng: np.random.Generator) -> None:
    """A device temperature below 0: that row is -1 and the next check names 'temperature'."""
    args = sample_inputs(rng, num_seqs=3, vocab_size=50, dtype="fp32")
    args["temperature"][2] = -1.0
    dev = {k: to_dev(v) for k, v in args.items()}
    got = gpu.ops.sample(dev["logits"], dev["temperature"], dev["seeds"])
    assert host(got)[2] == -1
    with pytest.raises(hal_core.ArgumentError, match="'temperature'"):
        gpu.check_errors()
