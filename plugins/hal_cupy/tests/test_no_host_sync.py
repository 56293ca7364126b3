"""Op calls on device arrays copy nothing to the host and never synchronise; bad indices surface later.

Every op runs through the whole front door (interop, validation, dispatch, the GPU implementation, the
result check) on a stand-in GPU backend whose kernels are ``kernel_emulator``'s, under a CuPy fake that
counts every way CuPy has to move device memory to the host (``get``, ``item``, ``tolist``, ``int`` /
``float`` / ``bool`` / ``index`` of an array, ``asnumpy``), every host-to-device copy (``asarray``) and
every synchronisation (device, stream, event, runtime). The count must be zero per call, on every path
of every op. A bad block id, length or slot on device arrays gives a zeroed output (or a skipped token)
and an ``ArgumentError`` naming the argument at the next synchronisation hal controls; host arrays still
raise at the call, before any launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import fakecupy
import kernel_emulator as emu
import numpy as np
import pytest
from kernel_emulator import attention_inputs, host, to_dev

import hal_core
from hal_core.arrays import TaggedArray
from hal_core.ops import OPS, Ops
from hal_core.quant import quantize
from hal_core.testing.inputs import fused_moe_inputs

TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.5e-2}
#: DevArray methods through which CuPy copies device memory to the host.
_READS = ("get", "item", "tolist", "__int__", "__float__", "__bool__", "__index__")


class Counter:
    """What crossed between host and device, and the synchronisations, while :meth:`window` was open.

    While a stream captures (:class:`_Graph`), any of them raises, as CUDA refuses them during a capture.
    """

    def __init__(self) -> None:
        self.open = False
        self.kernel_depth = 0  # inside an emulated kernel or cuBLAS call: device work, not host reads
        self.events: list[str] = []
        self.captured: list[tuple[Any, ...]] | None = None  # the launches of the capture in progress

    def note(self, what: str) -> None:
        if self.kernel_depth:
            return
        if self.captured is not None:
            raise RuntimeError(f"{what}: operation not permitted when stream is capturing")
        if self.open:
            self.events.append(what)

    @contextmanager
    def window(self) -> Iterator[list[str]]:
        self.events, self.open = [], True
        try:
            yield self.events
        finally:
            self.open = False


def _counting(counter: Counter, what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        counter.note(what)
        return fn(*args, **kwargs)

    return wrapped


def _in_kernel(counter: Counter, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if counter.captured is not None and counter.kernel_depth == 0:
            counter.captured.append((fn, args, kwargs))  # recorded, run at each replay
            return None
        counter.kernel_depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter.kernel_depth -= 1

    return wrapped


class _Event:
    """``cupy.cuda.Event``: recording is free, waiting on it counts."""

    counter: ClassVar[Counter]

    def __init__(self, disable_timing: bool = False) -> None:
        self.done = True

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        self.counter.note("Event.synchronize")


class _Graph:
    """A captured CUDA graph: the launches recorded during the capture, rerun with the same arguments."""

    def __init__(self, counter: Counter, launches: list[tuple[Any, ...]]) -> None:
        self.counter, self.launches = counter, launches

    def launch(self, stream: Any = None) -> None:
        run = _in_kernel(self.counter, lambda fn, args, kwargs: fn(*args, **kwargs))
        for fn, args, kwargs in self.launches:
            run(fn, args, kwargs)


def _capturing_stream(counter: Counter, stream: Any) -> None:
    """Give the fake's current stream CuPy's capture API (relaxed mode: allocations allowed, host reads not)."""
    def begin_capture(mode: Any = None) -> None:
        assert counter.captured is None, "already capturing"
        counter.captured = []

    def end_capture() -> _Graph:
        launches, counter.captured = counter.captured, None
        return _Graph(counter, launches or [])

    stream.begin_capture, stream.end_capture = begin_capture, end_capture


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """A bound-like GPU backend (an H200 profile, warp matrix level 90) over the counting, emulating CuPy."""
    from hal_cupy import CupyBackend, _arrays, _cupy, _device, _index_errors, _launcher, _memory, _stream
    from hal_cupy._device import CupyDevice
    from hal_cupy._launcher import CupyLauncher
    from hal_cupy.ops import _common, _gated_activation, _paged_attention, _quantized_gemm, _rms_norm, _write_kv_cache

    counter = Counter()
    fake = emu.NumpyCupy()
    for module in (_arrays, _cupy, _device, _index_errors, _launcher, _memory, _stream, _common, _paged_attention,
                   _quantized_gemm, _write_kv_cache, _rms_norm, _gated_activation):
        monkeypatch.setattr(module, "cupy", lambda: fake)
    from hal_cupy.ops import _rotary_embedding

    monkeypatch.setattr(_rotary_embedding, "cupy", lambda: fake)
    from hal_cupy.ops import _fused_moe

    monkeypatch.setattr(_fused_moe, "cupy", lambda: fake)
    for name in _READS:
        monkeypatch.setattr(emu.DevArray, name, _counting(counter, f"DevArray.{name}", getattr(emu.DevArray, name)))
    monkeypatch.setattr(emu.Kernel, "__call__", _in_kernel(counter, emu.Kernel.__call__))
    fake.cuda.cublas.gemmEx = _in_kernel(counter, fake.cuda.cublas.gemmEx)
    monkeypatch.setattr(fake, "asarray", _counting(counter, "asarray (host to device)", fake.asarray))
    fake.asnumpy = _counting(counter, "asnumpy", lambda a: np.array(a))
    monkeypatch.setattr(fakecupy.Device, "synchronize",
                        _counting(counter, "Device.synchronize", fakecupy.Device.synchronize))
    monkeypatch.setattr(fakecupy._BaseStream, "synchronize",
                        _counting(counter, "Stream.synchronize", fakecupy._BaseStream.synchronize))
    fake.cuda.runtime.deviceSynchronize = _counting(counter, "deviceSynchronize", lambda: None)
    fake.cuda.runtime.streamSynchronize = _counting(counter, "streamSynchronize", lambda s: None)
    _Event.counter = counter
    fake.cuda.Event = _Event
    _capturing_stream(counter, fake.cuda.get_current_stream())
    fake.cuda.using_allocator = lambda allocator: contextlib.nullcontext()
    fake.int32, fake.int64, fake.float16 = np.int32, np.int64, np.float16
    monkeypatch.setattr(emu.DevArray, "set", lambda self, value: np.ndarray.__setitem__(self, Ellipsis, value),
                        raising=False)
    # an assignment between device arrays is a copy kernel in CuPy: recorded by a capture like the hal kernels
    monkeypatch.setattr(emu.DevArray, "__setitem__", _in_kernel(counter, np.ndarray.__setitem__))

    caps = hal_core.load_profile("H200")
    platform = fakecupy.FakePlatform(90)

    class EmulatedDevice(CupyDevice):
        @property
        def capabilities(self) -> hal_core.DeviceCapabilities:
            return caps

        @property
        def launcher(self) -> CupyLauncher:
            return launcher

    launcher = CupyLauncher(0, caps)

    class EmulatedGpu(CupyBackend):
        name = "cuda"
        priority = 50

        def __init__(self) -> None:
            self._devices = [EmulatedDevice(0, platform)]

        def owns(self, array: Any) -> bool:
            # DevArray subclasses ndarray, which CupyBackend.owns takes for host memory
            return isinstance(array, (emu.DevArray, TaggedArray)) or super().owns(array)

        def to_numpy(self, array: Any) -> np.ndarray:
            counter.note("to_numpy (device to host)")  # to_host would see an ndarray and not copy
            return np.array(host(array))

    EmulatedGpu.platform = platform
    backend = EmulatedGpu()
    Ops.attach(backend)  # no host fallback: anything the GPU path refuses would run the float64 reference
    _index_errors.forget_flags()
    request.addfinalizer(_index_errors.forget_flags)
    emu.LAUNCHED.clear()
    backend.counter = counter  # type: ignore[attr-defined]
    return backend


def attention(rng: np.random.Generator, dtype: str, seq_lens: list[int]) -> dict[str, Any]:
    """One table column past the longest sequence, so a length past it is in the table but not the cache."""
    return attention_inputs(rng, dtype, seq_lens, spare_blocks=1)


def rel_err(out: Any, ref: np.ndarray) -> float:
    return emu.rel_err(out, ref, all_written=False)


def _attend(gpu: Any, args: dict[str, Any], **extra: Any) -> tuple[Any, list[str]]:
    dev = {k: to_dev(v) for k, v in args.items()}
    with gpu.counter.window() as crossed:
        out = gpu.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
                                      dev["seq_lens"], scale=args["scale"], **extra)
    return out, crossed


@pytest.mark.parametrize(("dtype", "seq_lens", "tensor_cores", "kernels"), [
    ("fp32", [0, 37, 300], "1", ["hal_paged_attention"]),
    ("fp16", [1, 700, 2100], "0", ["hal_paged_attention_split", "hal_paged_attention_reduce"]),
    ("bf16", [0, 37, 300] * 40, "1", ["hal_paged_attention_tc"]),
    ("fp16", [1, 700, 2100], "1", ["hal_paged_attention_tc", "hal_paged_attention_reduce"]),
], ids=["simt-single", "simt-split", "tc-single", "tc-split"])
@pytest.mark.parametrize("max_seq_len", [None, 2100], ids=["no-bound", "bound"])
def test_paged_attention_reads_nothing_back(gpu: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                            dtype: str, seq_lens: list[int], tensor_cores: str,
                                            kernels: list[str], max_seq_len: int | None) -> None:
    """Every paged_attention path: zero device-to-host copies, zero host-to-device copies, zero synchronisations."""
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", tensor_cores)
    args = attention(rng, dtype, seq_lens)
    out, crossed = _attend(gpu, args, max_seq_len=max_seq_len)
    assert crossed == []
    assert kernels == emu.LAUNCHED
    assert rel_err(out, OPS["paged_attention"].reference(args)) < TOL[dtype]
    gpu.check_errors()  # nothing recorded


def test_rms_norm_and_gated_activation_read_nothing_back(gpu: Any, rng: np.random.Generator) -> None:
    """rms_norm (with its residual) and gated_activation on device arrays: nothing crosses, nothing waits."""
    from hal_core.testing.inputs import gated_activation_inputs, rms_norm_inputs

    norm = rms_norm_inputs(rng, num_tokens=3, hidden_size=128, dtype="bf16")
    act = gated_activation_inputs(rng, num_tokens=3, intermediate_size=256, dtype="bf16", fused=False)
    dev_norm = {k: to_dev(v) for k, v in norm.items()}
    dev_act = {k: to_dev(v) for k, v in act.items()}
    with gpu.counter.window() as crossed:
        normed = gpu.ops.rms_norm(dev_norm["x"], dev_norm["weight"], epsilon=norm["epsilon"],
                                  residual=dev_norm["residual"])
        gated = gpu.ops.gated_activation(dev_act["gate"], dev_act["up"], activation="gelu")
    assert crossed == []
    assert emu.LAUNCHED[-2:] == ["hal_rms_norm", "hal_gated_activation"]
    expected, expected_residual = OPS["rms_norm"].reference(norm)
    assert rel_err(normed, expected) < TOL["bf16"]
    np.testing.assert_array_equal(host(dev_norm["residual"]).astype(np.float64), expected_residual)
    assert rel_err(gated, OPS["gated_activation"].reference({**act, "activation": "gelu"})) < TOL["bf16"]


def test_rms_norm_fallback_writes_the_device_residual_back(gpu: Any, rng: np.random.Generator,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A call the GPU refuses runs on the host copies and copies the new residual back to the device, once."""
    from hal_cupy.ops import _rms_norm

    from hal_core.testing.inputs import rms_norm_inputs

    monkeypatch.setattr(_rms_norm.OP, "_check", lambda call: "refused for this test")
    norm = rms_norm_inputs(rng, num_tokens=3, hidden_size=40, dtype="fp16")
    dev_norm = {k: to_dev(v) for k, v in norm.items()}
    out = gpu.ops.rms_norm(dev_norm["x"], dev_norm["weight"], epsilon=norm["epsilon"], residual=dev_norm["residual"])
    assert "hal_rms_norm" not in emu.LAUNCHED
    expected, expected_residual = OPS["rms_norm"].reference(norm)
    assert rel_err(out, expected) < TOL["fp16"]
    np.testing.assert_array_equal(host(dev_norm["residual"]).astype(np.float64), expected_residual)
    plain = gpu.ops.rms_norm(dev_norm["x"], dev_norm["weight"], epsilon=norm["epsilon"])  # no residual to copy
    assert rel_err(plain, OPS["rms_norm"].reference({**norm, "residual": None})[0]) < TOL["fp16"]


@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64], ids=["slot32", "slot64"])
def test_write_kv_cache_reads_nothing_back(gpu: Any, rng: np.random.Generator, slot_dtype: Any) -> None:
    """write_kv_cache on device arrays: nothing crosses, nothing waits; the rows land."""
    key = rng.standard_normal((5, 2, 64)).astype(np.float16)
    cache = rng.standard_normal((3, 2, 16, 64)).astype(np.float16)
    args = dict(key=key, value=key * 2, key_cache=cache, value_cache=cache.copy(),
                slot_mapping=np.array([3, -1, 40, 17, 0], slot_dtype))
    dev = {k: to_dev(v) for k, v in args.items()}
    with gpu.counter.window() as crossed:
        gpu.ops.write_kv_cache(dev["key"], dev["value"], dev["key_cache"], dev["value_cache"], dev["slot_mapping"])
    assert crossed == []
    want_k, want_v = OPS["write_kv_cache"].reference(args)
    np.testing.assert_array_equal(host(dev["key_cache"]).astype(np.float64), want_k)
    np.testing.assert_array_equal(host(dev["value_cache"]).astype(np.float64), want_v)


@pytest.mark.parametrize(("bits", "m", "tensor_cores"), [(4, 3, "1"), (8, 40, "1"), (4, 5, "0"), (8, 17, "0"),
                                                         (4, 40, "0"), (8, 40, "0")],
                         ids=["w4-tc", "w8-tc", "w4-simt", "w8-simt", "w4-slabs", "w8-slabs"])
def test_quantized_gemm_reads_nothing_back(gpu: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                           bits: int, m: int, tensor_cores: str) -> None:
    """quantized_gemm on every GPU path (tensor cores, SIMT, K-slabs on cuBLAS): nothing crosses, nothing waits."""
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", tensor_cores)
    qw = quantize(rng.standard_normal((512, 128)).astype(np.float32) * 0.1, bits=bits, group_size=64,
                  symmetric=False, scale_dtype=np.float16)
    x = rng.standard_normal((m, 512)).astype(np.float16)
    dev_w = qw.map_arrays(to_dev)
    dev_x = to_dev(x)
    gpu.ops.quantized_gemm(dev_x, dev_w)  # the first call packs the tensor-core layout (a one-time device job)
    with gpu.counter.window() as crossed:
        out = gpu.ops.quantized_gemm(dev_x, dev_w)
    assert crossed == []
    assert gpu.ops.stats()["quantized_gemm"]["implementations"] == {"cuda.quantized_gemm": 2}
    assert rel_err(out, OPS["quantized_gemm"].reference(dict(x=x, qweight=qw))) < TOL["fp16"]


def test_the_counter_sees_a_host_read(gpu: Any, rng: np.random.Generator) -> None:
    """The counting fake is not blind: the old host index check (a copy of seq_lens) and a sync are counted."""
    lens = to_dev(np.array([3, 4], np.int32))
    with gpu.counter.window() as crossed:
        gpu.to_numpy(lens)
        int(lens.max())
        gpu.device(0).synchronize()
    assert crossed == ["to_numpy (device to host)", "DevArray.__int__", "Device.synchronize"]


@pytest.mark.parametrize("max_query_len", [None, 40], ids=["no-hint", "hint"])
@pytest.mark.parametrize(("seq_lens", "query_lens", "tensor_cores", "kernels"), [
    ([40, 9, 300], [40, 1, 6], "0", ["hal_paged_attention"]),
    ([1, 700, 2100], [1, 3, 1], "0", ["hal_paged_attention_split", "hal_paged_attention_reduce"]),
    ([40, 9, 300], [40, 1, 6], "1", ["hal_paged_attention_tc"]),
    ([1, 700, 2100], [1, 3, 1], "1", ["hal_paged_attention_tc", "hal_paged_attention_reduce"]),
], ids=["simt-single", "simt-split", "tc-single", "tc-split"])
def test_varlen_attention_reads_nothing_back(gpu: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                             seq_lens: list[int], query_lens: list[int], tensor_cores: str,
                                             kernels: list[str], max_query_len: int | None) -> None:
    """Prefill rows with a window and sinks: zero host reads, copies and synchronisations (the grid comes from the
    host hints, else num_tokens), and the float64 reference's result."""
    from hal_core.ops.paged_attention import paged_attention_inputs

    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", tensor_cores)
    args = paged_attention_inputs(rng, seq_lens=seq_lens, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                                  dtype="fp16", query_lens=query_lens)
    args["sinks"] = rng.uniform(-1, 2, 8).astype(np.float32)
    args.pop("max_query_len")
    dev = {k: to_dev(v) for k, v in args.items()}
    with gpu.counter.window() as crossed:
        out = gpu.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
                                      dev["seq_lens"], scale=args["scale"], query_start_loc=dev["query_start_loc"],
                                      max_query_len=max_query_len, window=64, sinks=dev["sinks"])
    assert crossed == []
    assert kernels == emu.LAUNCHED
    assert rel_err(out, OPS["paged_attention"].reference({**args, "window": 64})) < TOL["fp16"]
    gpu.check_errors()


def test_varlen_bad_query_start_loc_raises_at_check_errors(gpu: Any, rng: np.random.Generator) -> None:
    """A sequence with more new tokens than its length: its rows are zeros, the others match, and check_errors()
    names query_start_loc."""
    from hal_core.ops.paged_attention import paged_attention_inputs

    args = paged_attention_inputs(rng, seq_lens=[40, 9, 300], num_heads=8, num_kv_heads=2, head_size=64,
                                  block_size=16, dtype="fp16", query_lens=[40, 3, 6])
    good = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    args["seq_lens"][1] = 2  # 3 new tokens
    dev = {k: to_dev(v) for k, v in args.items()}
    with gpu.counter.window() as crossed:
        out = gpu.ops.paged_attention(dev["query"], dev["key_cache"], dev["value_cache"], dev["block_tables"],
                                      dev["seq_lens"], scale=args["scale"], query_start_loc=dev["query_start_loc"],
                                      max_query_len=40)
    assert crossed == []
    result = host(out).astype(np.float64)
    assert not result[40:43].any()
    expected = OPS["paged_attention"].reference(good)
    keep = np.r_[0:40, 43:49]
    assert rel_err(result[keep], expected[keep]) < TOL["fp16"]
    with pytest.raises(hal_core.ArgumentError, match="argument 'query_start_loc'"):
        gpu.check_errors()


# -- bad indices on device arrays -------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor_cores", ["0", "1"], ids=["simt", "tc"])
@pytest.mark.parametrize(("bad", "argument"), [("block", "block_tables"), ("negative-length", "seq_lens"),
                                               ("beyond-max", "seq_lens")])
@pytest.mark.parametrize("seq_lens", [[50, 90, 5], [1, 700, 2100]], ids=["single", "split"])
def test_bad_index_zeroes_its_sequence_and_raises_at_check_errors(
        gpu: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, tensor_cores: str, bad: str,
        argument: str, seq_lens: list[int]) -> None:
    """Sequence 1 holds a bad block id or length: the call returns without a host read, that sequence's rows are
    zeros, the others match the float64 reference, and check_errors() raises ArgumentError naming the argument
    (once: the flag is cleared)."""
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", tensor_cores)
    args = attention(rng, "fp16", seq_lens)
    good = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    bound = max(seq_lens)
    if bad == "block":
        args["block_tables"][1, (seq_lens[1] - 1) // 16] = args["key_cache"].shape[0] + 7
    elif bad == "negative-length":
        args["seq_lens"][1] = -4
    else:
        args["seq_lens"][1] = bound + 1  # within the table, beyond the caller's max_seq_len
    out, crossed = _attend(gpu, args, max_seq_len=bound)
    assert crossed == []
    result = host(out).astype(np.float64)
    assert not result[1].any(), "the sequence with a bad index must give zeros"
    expected = OPS["paged_attention"].reference(good)
    keep = [0, 2]
    assert rel_err(result[keep], expected[keep]) < TOL["fp16"]
    with pytest.raises(hal_core.ArgumentError, match=f"argument '{argument}'"):
        gpu.check_errors()
    gpu.check_errors()  # reported once, then cleared


def test_bad_slot_is_skipped_and_raised_at_stream_synchronize(gpu: Any, rng: np.random.Generator) -> None:
    """A slot past the cache: that token is not written, the others are, and hal's Stream.synchronize raises."""
    key = rng.standard_normal((4, 2, 64)).astype(np.float16)
    cache = rng.standard_normal((2, 2, 16, 64)).astype(np.float16)
    slots = np.array([3, 32 + 5, 20, 1], np.int64)  # 32 slots: token 1 is out of range
    args = dict(key=key, value=-key, key_cache=cache, value_cache=cache.copy(), slot_mapping=slots)
    dev = {k: to_dev(v) for k, v in args.items()}
    with gpu.counter.window() as crossed:
        gpu.ops.write_kv_cache(dev["key"], dev["value"], dev["key_cache"], dev["value_cache"], dev["slot_mapping"])
    assert crossed == []
    keep = np.array([True, False, True, True])
    want_k, want_v = OPS["write_kv_cache"].reference(
        dict(args, key=key[keep], value=-key[keep], slot_mapping=slots[keep]))
    np.testing.assert_array_equal(host(dev["key_cache"]).astype(np.float64), want_k)
    np.testing.assert_array_equal(host(dev["value_cache"]).astype(np.float64), want_v)
    with pytest.raises(hal_core.ArgumentError, match="argument 'slot_mapping'"):
        gpu.device(0).current_stream().synchronize()
    gpu.device(0).create_event().synchronize()  # cleared: the next synchronisation is quiet


def test_errors_of_two_ops_are_named_together_at_event_synchronize(gpu: Any, rng: np.random.Generator) -> None:
    """Both arguments are named when a bad table and a bad slot were queued before the synchronisation."""
    args = attention(rng, "fp32", [20, 9])
    args["block_tables"][0, 0] = -1
    _attend(gpu, args)
    key = np.zeros((1, 2, 64), np.float32)
    kc = to_dev(np.zeros((1, 2, 16, 64), np.float32))
    gpu.ops.write_kv_cache(to_dev(key), to_dev(key), kc, to_dev(np.zeros((1, 2, 16, 64), np.float32)),
                           to_dev(np.array([16], np.int32)))
    event = gpu.device(0).create_event()
    with pytest.raises(hal_core.ArgumentError, match=r"'block_tables'.*'slot_mapping'"):
        event.synchronize()


# -- host arrays keep the eager checks ------------------------------------------------------------------------


@pytest.mark.parametrize(("bad", "argument"), [("block", "block_tables"), ("length", "seq_lens"),
                                               ("beyond-max", "seq_lens")])
def test_host_inputs_still_raise_at_the_call(gpu: Any, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch,
                                             bad: str, argument: str) -> None:
    """Numpy arrays given to the GPU backend are checked on the host before any launch, naming the entry."""
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "0")  # host arrays would be offloaded to the GPU
    args = attention(rng, "fp16", [50, 90])
    if bad == "block":
        args["block_tables"][1, 2] = 10**6
    elif bad == "length":
        args["seq_lens"][0] = -1
    with pytest.raises(hal_core.ArgumentError, match=f"argument '{argument}'"):
        gpu.ops.paged_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                                args["seq_lens"], scale=0.125, max_seq_len=80 if bad == "beyond-max" else None)
    assert emu.LAUNCHED == []


def test_host_slot_mapping_still_raises_at_the_call(gpu: Any, rng: np.random.Generator,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HAL_CUDA_OFFLOAD_MIN_FLOPS", "0")
    key = np.zeros((2, 1, 64), np.float16)
    cache = np.zeros((1, 1, 16, 64), np.float16)
    with pytest.raises(hal_core.ArgumentError, match="argument 'slot_mapping'"):
        gpu.ops.write_kv_cache(key, key, cache, cache.copy(), np.array([3, 16], np.int64))
    assert emu.LAUNCHED == [] and not cache.any()


def test_device_act_order_weights_are_checked_once_on_the_host(gpu: Any, rng: np.random.Generator) -> None:
    """No GPU kernel reads g_idx: device act-order weights take the fallback path, which copies them to the host
    and checks them there before the host reads them."""
    g_idx = (rng.permutation(256) % 4).astype(np.int32)
    g_idx[5] = 4  # K / group_size = 4 groups: out of range
    qw = dataclasses.replace(quantize(rng.standard_normal((256, 64)).astype(np.float32), bits=4, group_size=64),
                             g_idx=g_idx)
    x = to_dev(rng.standard_normal((2, 256)).astype(np.float16))
    with pytest.raises(hal_core.ArgumentError, match=r"argument 'qweight\.g_idx'"):
        gpu.ops.quantized_gemm(x, qw.map_arrays(to_dev))


# -- a decode step captured in a CUDA graph ---------------------------------------------------------------------


def test_benchmark_decode_step_replays_from_a_captured_graph(gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_check's decode step (write_kv_cache + paged_attention, captured once, replayed with the index arrays
    updated in place), run on the emulator: the capture admits no host read or synchronisation, each replay of
    the recorded launches alone matches the float64 reference, and a bad block id written into the captured
    table comes back as ArgumentError('block_tables') with that sequence zeroed."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_paged_attention.py"
    spec = importlib.util.spec_from_file_location("_bench_paged_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(hal_core, "check_errors", gpu.check_errors)  # the stand-in backend is not bound
    from hal_cupy.ops import _common

    result = bench.graph_decode(_common.cupy(), gpu, steps=3)
    assert result["captured"], result["graph_error"]
    assert result["steps"] == 3 and result["correct"], result["rel_errors"]
    assert result["bad_index_reported"] and result["bad_sequence_zero"], result["bad_index_message"]


def test_rotary_embedding_reads_nothing_back_and_skips_a_bad_position(gpu: Any, rng: np.random.Generator) -> None:
    """rotary_embedding on device arrays: nothing crosses, nothing waits; a position past the table leaves its
    token as it is, the others rotate, and the next synchronisation names positions."""
    from hal_core.testing.inputs import assert_close, rotary_embedding_inputs

    args = rotary_embedding_inputs(rng, num_tokens=4, num_heads=2, num_kv_heads=1, head_size=64, dtype="fp16",
                                   max_position=16, poison=False)
    dev = {k: to_dev(v) for k, v in args.items()}
    with gpu.counter.window() as crossed:
        gpu.ops.rotary_embedding(dev["positions"], dev["query"], dev["cos_sin_cache"], key=dev["key"])
    assert crossed == []
    gpu.check_errors()  # nothing recorded
    want_q, want_k = OPS["rotary_embedding"].reference(args)
    assert_close(host(dev["query"]), want_q, kind="rotary", dtype="fp16", what="query")
    assert_close(host(dev["key"]), want_k, kind="rotary", dtype="fp16", what="key")

    before_q = host(dev["query"]).copy()
    bad = to_dev(np.array([5, 16, 3, 1], args["positions"].dtype))  # position 0 would rotate nothing
    with gpu.counter.window() as crossed:
        gpu.ops.rotary_embedding(bad, dev["query"], dev["cos_sin_cache"], key=dev["key"])
    assert crossed == []
    np.testing.assert_array_equal(host(dev["query"])[1], before_q[1])
    assert not np.array_equal(host(dev["query"])[0], before_q[0])
    with pytest.raises(hal_core.ArgumentError, match="argument 'positions'"):
        gpu.device(0).current_stream().synchronize()


@pytest.mark.parametrize(("bits", "routing"), [(4, "softmax_topk"), (8, "softmax_topk_renorm"), (4, "topk_softmax")])
def test_fused_moe_reads_nothing_back(gpu: Any, rng: np.random.Generator, bits: int, routing: str) -> None:
    """fused_moe on device arrays (routing, grouping, grouped GEMMs, combine; int8: the row quantisations):
    once the experts' address tables exist, nothing crosses and nothing waits; the result is the reference's."""
    args = fused_moe_inputs(rng, num_tokens=9, num_experts=6, top_k=2, hidden=64, intermediate=32, bits=bits,
                            group_size=32, dtype="bf16", routing=routing, activation="gelu")
    x, logits = to_dev(args["hidden_states"]), to_dev(args["router_logits"])
    experts = args["experts"].map_arrays(to_dev)

    def call() -> Any:
        return gpu.ops.fused_moe(x, logits, experts, top_k=2, routing=routing, activation="gelu")

    call()  # the first call copies the experts' address tables to the device (once per set of expert arrays)
    with gpu.counter.window() as crossed:
        out = call()
    assert crossed == []
    assert gpu.ops.stats()["fused_moe"]["implementations"] == {"cuda.fused_moe": 2}
    assert {"hal_moe_route", "hal_moe_align", "hal_moe_scatter", f"hal_moe_w{bits}_gate_up", f"hal_moe_w{bits}_down",
            "hal_moe_combine"} <= set(emu.LAUNCHED)
    assert rel_err(out, OPS["fused_moe"].reference(args)) < 2 * TOL["bf16"]
