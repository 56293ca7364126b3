"""torch and DLPack arrays through every op: zero-copy in, torch out, errors instead of copies."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hal_core import ArgumentError, ArgumentTypeError
from hal_core.arrays import BFLOAT16, TaggedArray
from hal_core.interop import import_arrays, is_torch_tensor, to_native
from hal_core.ops import OPS
from hal_core.quant import quantize

torch = pytest.importorskip("torch", reason="torch is a test-only dependency (pip install torch)")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "fp16": 3e-3, "bf16": 2e-2}


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(params=["cpu", "reference"])
def backend(request: pytest.FixtureRequest):
    """The real CPU backend, and a host backend without kernels (the float64 reference path)."""
    if request.param == "cpu":
        return request.getfixturevalue("cpu")
    from halfakes import HostBackend

    from hal_core.ops import Ops

    return Ops.attach(HostBackend()).backend


def ptr(array) -> int:
    """The data address of a numpy array, TaggedArray or torch tensor."""
    if isinstance(array, TaggedArray):
        array = array.storage
    return array.data_ptr() if is_torch_tensor(array) else array.__array_interface__["data"][0]


def host64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


def paged_inputs(gen: torch.Generator, dtype: torch.dtype):
    q = torch.randn(3, 8, 64, generator=gen).to(dtype)
    kc = torch.randn(6, 2, 16, 64, generator=gen).to(dtype)
    vc = torch.randn(6, 2, 16, 64, generator=gen).to(dtype)
    bt = torch.tensor([[0, 1], [2, 3], [5, 4]], dtype=torch.int32)
    sl = torch.tensor([20, 32, 3], dtype=torch.int32)
    return q, kc, vc, bt, sl


@pytest.mark.parametrize("name", list(DTYPES))
def test_torch_cpu_tensors_become_numpy_views(backend, gen: torch.Generator, name: str) -> None:
    """import_arrays turns torch CPU tensors (bf16 included) into numpy views of the same memory."""
    q, kc, vc, bt, sl = paged_inputs(gen, DTYPES[name])
    args = dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl, scale=0.1, out=None)
    native, restore = import_arrays(OPS["paged_attention"], args, backend)
    for key in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"):
        assert isinstance(native[key], np.ndarray), key
        assert ptr(native[key]) == ptr(args[key]), f"{key} was copied"
    assert native["query"].dtype == (BFLOAT16 if name == "bf16" else np.dtype(name.replace("fp", "float")))
    assert native["scale"] == 0.1 and native["out"] is None
    assert is_torch_tensor(restore(np.zeros(2, np.float32)))


@pytest.mark.parametrize("name", list(DTYPES))
def test_paged_attention_with_torch(backend, gen: torch.Generator, name: str) -> None:
    """paged_attention on torch tensors returns a torch tensor matching float64; out= is written in place."""
    dtype = DTYPES[name]
    q, kc, vc, bt, sl = paged_inputs(gen, dtype)
    got = backend.ops.paged_attention(q, kc, vc, bt, sl, scale=0.125)
    assert is_torch_tensor(got) and got.dtype == dtype and tuple(got.shape) == tuple(q.shape)
    ref = OPS["paged_attention"].reference(dict(query=host64(q), key_cache=host64(kc), value_cache=host64(vc),
                                                block_tables=bt.numpy(), seq_lens=sl.numpy(), scale=0.125))
    np.testing.assert_allclose(host64(got), ref, atol=TOL[name], rtol=TOL[name])
    out = torch.full_like(q, float("nan"))
    address = out.data_ptr()
    result = backend.ops.paged_attention(q, kc, vc, bt, sl, scale=0.125, out=out)
    assert result is out and out.data_ptr() == address
    assert torch.equal(out, got)


@pytest.mark.parametrize("name", list(DTYPES))
def test_write_kv_cache_writes_torch_caches_in_place(backend, gen: torch.Generator, name: str) -> None:
    """write_kv_cache scatters into the caller's torch caches (same memory, nothing returned)."""
    dtype = DTYPES[name]
    kc, vc = torch.zeros(4, 2, 8, 64, dtype=dtype), torch.zeros(4, 2, 8, 64, dtype=dtype)
    k, v = torch.randn(3, 2, 64, generator=gen).to(dtype), torch.randn(3, 2, 64, generator=gen).to(dtype)
    slots = torch.tensor([9, 0, 31], dtype=torch.int64)
    addresses = (kc.data_ptr(), vc.data_ptr())
    assert backend.ops.write_kv_cache(k, v, kc, vc, slots) is None
    assert (kc.data_ptr(), vc.data_ptr()) == addresses
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(kc[slot // 8, :, slot % 8], k[i]) and torch.equal(vc[slot // 8, :, slot % 8], v[i])
    assert int((kc != 0).any(dim=-1).sum()) == 3 * 2


@pytest.mark.parametrize("name", list(DTYPES))
def test_quantized_gemm_with_torch(backend, gen: torch.Generator, name: str) -> None:
    """quantized_gemm takes torch activations and a QuantizedWeight holding torch arrays; returns torch."""
    dtype = DTYPES[name]
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    qw = quantize(rng.standard_normal((128, 48)), group_size=32, symmetric=False)
    torch_qw = qw.map_arrays(lambda a: torch.from_numpy(a.view(np.int32) if a.dtype == np.uint32 else a))
    x = torch.randn(4, 128, generator=gen).to(dtype)
    want = host64(x) @ qw.dequantize()
    got = backend.ops.quantized_gemm(x, qw)
    assert is_torch_tensor(got) and got.dtype == dtype
    np.testing.assert_allclose(host64(got), want, rtol=TOL[name], atol=TOL[name] * np.abs(want).max())
    with pytest.raises(ArgumentTypeError, match=r"qweight\.qweight"):  # int32 words are not hal's uint32
        backend.ops.quantized_gemm(x, torch_qw)
    torch_qw = qw.map_arrays(lambda a: torch.from_numpy(a) if a.dtype != np.uint32 else a)
    out = torch.empty(4, 48, dtype=dtype)
    assert backend.ops.quantized_gemm(x, torch_qw, out=out) is out
    assert torch.equal(out, got)


def test_non_contiguous_torch_tensor_is_refused_not_copied(backend, gen: torch.Generator) -> None:
    """A strided torch view keeps its strides and fails validation naming the argument."""
    _, kc, vc, bt, sl = paged_inputs(gen, torch.bfloat16)
    wide = torch.randn(3, 8, 128, generator=gen).to(torch.bfloat16)
    with pytest.raises(ArgumentError, match="'query': expected a contiguous last dimension"):
        backend.ops.paged_attention(wide[..., ::2], kc, vc, bt, sl, scale=0.1)
    view = to_native(kc.transpose(1, 2), backend, "key_cache")
    assert not view.flags.c_contiguous and ptr(view) == kc.data_ptr()


def test_grad_tensors_mixed_with_numpy(backend, gen: torch.Generator) -> None:
    """Tensors requiring grad are used detached; torch mixed with numpy arrays still returns torch."""
    q, kc, vc, bt, sl = paged_inputs(gen, torch.float32)
    q.requires_grad_(True)
    got = backend.ops.paged_attention(q, kc.numpy(), vc, bt.numpy(), sl, scale=0.1)
    assert is_torch_tensor(got) and not got.requires_grad


class HostDLPack:
    """A foreign array exchanging through DLPack only (like a JAX or CuPy array would)."""

    def __init__(self, array: np.ndarray, device: tuple[int, int] = (1, 0)) -> None:
        self._array, self._device = array, device
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def test_plain_dlpack_arrays_come_in_without_a_copy(backend) -> None:
    """Any DLPack producer in host memory becomes a numpy view; results stay native."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    native, restore = import_arrays(OPS["quantized_gemm"], dict(x=HostDLPack(x), qweight=None, out=None), backend)
    assert isinstance(native["x"], np.ndarray) and ptr(native["x"]) == ptr(x)
    result = np.ones(1)
    assert restore(result) is result


class CopyingDLPack(HostDLPack):
    """A producer that can only export a copy: it refuses copy=False, as DLPack 1.0 asks."""

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy is False:
            raise BufferError("this producer can only export a copy")
        return self._array.copy().__dlpack__()


class LegacyDLPack(HostDLPack):
    """A producer older than DLPack 1.0: ``__dlpack__(stream=None)`` only."""

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.1.0", reason="numpy < 2.1 cannot ask for copy=False")
def test_dlpack_producer_that_would_copy_is_refused(backend) -> None:
    """A host DLPack producer is asked for a view (copy=False); one that could only copy is an error."""
    x = CopyingDLPack(np.ones((2, 64), np.float32))
    with pytest.raises(ArgumentTypeError, match=r"'x': cannot view .* without a copy"):
        backend.ops.quantized_gemm(x, quantize(np.ones((64, 8)), group_size=32))


def test_legacy_dlpack_producer_comes_in_without_a_copy(backend) -> None:
    """A producer that takes no copy keyword (DLPack before 1.0) is still viewed, not copied."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    native, _ = import_arrays(OPS["quantized_gemm"], dict(x=LegacyDLPack(x), qweight=None, out=None), backend)
    assert ptr(native["x"]) == ptr(x)


def test_device_memory_on_a_host_backend_is_an_error(backend) -> None:
    """Device memory (DLPack device type 2) on a host backend names the argument and DLPack's device type;
    an object with only a device array interface is no array hal can import, and the error names it too."""
    fake_cuda = HostDLPack(np.zeros((2, 64), np.float32), device=(2, 0))
    qw = quantize(np.ones((64, 8)), group_size=32)
    with pytest.raises(ArgumentError, match=r"'x' lives on kDLCUDA:0, but backend .* works on host memory"):
        backend.ops.quantized_gemm(fake_cuda, qw)

    class CAI:
        shape, dtype = (2, 64), np.dtype(np.float32)

        @property
        def __cuda_array_interface__(self) -> dict:
            return {"shape": (2, 64), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

    with pytest.raises(ArgumentTypeError, match="'x': expected an array"):
        backend.ops.quantized_gemm(CAI(), qw)
    meta = torch.empty(2, 64, device="meta")
    with pytest.raises(ArgumentError, match="'x' is a torch tensor on meta"):
        backend.ops.quantized_gemm(meta, qw)


def test_hal_core_never_imports_torch_for_numpy_calls() -> None:
    """Importing hal_core and running ops on numpy arrays leaves torch unimported."""
    code = (
        "import sys, numpy as np, hal_core\n"
        "from hal_core.quant import quantize\n"
        "be = hal_core.get_backend()\n"
        "be.ops.quantized_gemm(np.ones((2, 64), np.float32), quantize(np.ones((64, 8)), group_size=32))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torch_cuda_bf16_becomes_a_tagged_cupy_view() -> None:
    """On a GPU, a torch CUDA bf16 tensor becomes TaggedArray(uint16 CuPy view, 'bf16') of the same memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with torch CUDA and CuPy (checked on the GPU machine)")
    pytest.importorskip("cupy")
    import hal_core

    be = hal_core.get_backend("cuda")
    t = torch.randn(4, 64, device="cuda").to(torch.bfloat16)
    native = to_native(t, be, "x")
    assert isinstance(native, TaggedArray) and native.hal_dtype == "bf16"
    assert native.storage.data.ptr == t.data_ptr()
    qw = quantize(np.random.default_rng(0).standard_normal((64, 16)), group_size=32).map_arrays(be.asarray)
    got = be.ops.quantized_gemm(t, qw)
    assert is_torch_tensor(got) and got.dtype == torch.bfloat16 and got.is_cuda
