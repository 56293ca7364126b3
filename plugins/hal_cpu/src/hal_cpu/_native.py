"""The compiled kernels: loads ``_kernels.so`` (built by setup.py) with ctypes, once, on first use.

Nothing here runs on ``import hal_cpu``: :func:`load` is called when an op
first runs. The library holds every instruction-set variant of the kernels
built for this architecture and picks the best one the CPU supports;
``HAL_CPU_ISA=baseline|avx2|avx512|avx512vnni`` forces one (for testing and diagnosis
only; an unknown or unsupported name is logged and ignored). When the
library cannot be loaded (a source checkout whose build failed), the ops
fall back to their numpy paths and say so once in the log.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hal_core import env

from . import _abi, _threads

__all__ = ["Native", "NativeUnavailable", "check_abi", "load", "pointer", "try_load"]

_log = logging.getLogger("hal")
_LIBRARY = Path(__file__).with_name("_kernels.so")
#: Environment variable forcing an instruction-set variant (testing and diagnosis only).
ISA_ENV = "HAL_CPU_ISA"
#: Every kernel variant name a build of hal-cpu can have (``setup.py``); which of them run here varies.
ISA_NAMES = ("avx512vnni", "avx512", "avx2", "baseline")
#: Environment variable: microseconds a pool worker polls for the next job before it blocks.
SPIN_ENV = "HAL_CPU_SPIN_US"
#: Its default: long enough to bridge the Python between back-to-back op calls (waking a blocked
#: worker costs 20-50 us on a virtual machine), short enough to leave idle cores to other runtimes.
DEFAULT_SPIN_US = 100
#: Environment variable: whether bf16/fp16 attention and many-row W4A8/W8A8 may use AMX tiles where the CPU and the
#: OS allow it (default on; off runs the vector paths, which give the same W4A8/W8A8 bits, for testing and diagnosis).
AMX_ENV = "HAL_CPU_AMX"
#: Environment variable: whether parallel jobs may run on an OpenMP runtime the process loaded (default on;
#: :mod:`hal_cpu._pool` says which pool runs them).
HOST_POOL_ENV = "HAL_CPU_HOST_POOL"

_i64 = ctypes.c_int64
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "hal_cpu_select_isa": (ctypes.c_char_p, [ctypes.c_char_p]),
    "hal_cpu_isa": (ctypes.c_char_p, []),
    "hal_cpu_available_isas": (ctypes.c_char_p, []),
    "hal_cpu_default_threads": (ctypes.c_int, []),
    "hal_cpu_set_spin_us": (_i64, [_i64]),
    "hal_cpu_pool_stats": (None, [ctypes.POINTER(_i64), ctypes.c_int32]),
    "hal_cpu_host_runtime": (ctypes.c_char_p, []),
    "hal_cpu_set_host_pool": (ctypes.c_int, [ctypes.c_int]),
    "hal_cpu_pool_note_starved": (None, [ctypes.c_int]),
    "hal_cpu_abi": (ctypes.c_char_p, [ctypes.c_char_p]),
    "hal_cpu_paged_attention": (ctypes.c_int, [ctypes.POINTER(_abi.AttentionArgs)]),
    "hal_cpu_attention_amx": (ctypes.c_int, []),
    "hal_cpu_set_attention_amx": (ctypes.c_int, [ctypes.c_int]),
    "hal_cpu_gemm_amx": (ctypes.c_int, []),
    "hal_cpu_write_kv_cache": (ctypes.c_int, [ctypes.POINTER(_abi.WriteKvCacheArgs)]),
    "hal_cpu_to_float32": (ctypes.c_int, [ctypes.POINTER(_abi.ToFloat32Args)]),
    "hal_cpu_w4a16_gemv": (ctypes.c_int, [ctypes.POINTER(_abi.W4a16GemvArgs)]),
    "hal_cpu_dequant_tile": (ctypes.c_int, [ctypes.POINTER(_abi.DequantTileArgs)]),
    "hal_cpu_w8a8_gemm": (ctypes.c_int, [ctypes.POINTER(_abi.W8a8GemmArgs)]),
    "hal_cpu_w4a16_blocked": (ctypes.c_int, [ctypes.POINTER(_abi.W4a16BlockedArgs)]),
    "hal_cpu_w4a16_half_dot": (ctypes.c_int, []),
    "hal_cpu_w4a8_gemm": (ctypes.c_int, [ctypes.POINTER(_abi.W4a8GemmArgs)]),
    "hal_cpu_sample": (ctypes.c_int, [ctypes.POINTER(_abi.SampleArgs)]),
    "hal_cpu_rms_norm": (ctypes.c_int, [ctypes.POINTER(_abi.RmsNormArgs)]),
    "hal_cpu_gated_activation": (ctypes.c_int, [ctypes.POINTER(_abi.GatedActivationArgs)]),
    "hal_cpu_rotary_embedding": (ctypes.c_int, [ctypes.POINTER(_abi.RotaryEmbeddingArgs)]),
    "hal_cpu_from_float32": (ctypes.c_int, [ctypes.POINTER(_abi.FromFloat32Args)]),
    "hal_cpu_expert_mlps": (ctypes.c_int, [ctypes.POINTER(_abi.ExpertMlpsArgs)]),
    "hal_cpu_moe_experts": (ctypes.c_int, [ctypes.POINTER(_abi.MoeExpertsArgs)]),
}


class NativeUnavailable(RuntimeError):
    """The compiled kernels could not be loaded; the message says why and how to rebuild."""


@dataclass(frozen=True)
class Native:
    """The loaded library: its ctypes functions, the chosen variant and the thread count the kernels use."""

    lib: ctypes.CDLL
    isa: str
    available: tuple[str, ...]

    @property
    def threads(self) -> int:
        """The kernels' thread count now (``HAL_CPU_THREADS``, :func:`hal_cpu.set_threads`, else every core)."""
        return _threads.current()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, f"hal_cpu_{name}")


_lock = threading.Lock()
_native: Native | None = None
_failure: NativeUnavailable | None = None


def _open() -> Native:
    if not _LIBRARY.exists():
        raise NativeUnavailable(f"{_LIBRARY} is missing; rebuild with `pip install -e plugins/hal_cpu` "
                                "(needs a C++17 compiler)")
    try:
        lib = ctypes.CDLL(str(_LIBRARY))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {_LIBRARY}: {exc}") from exc
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:
            raise NativeUnavailable(f"{_LIBRARY} lacks {name} (a stale build); rebuild with "
                                    "`pip install -e plugins/hal_cpu`") from exc
        fn.restype, fn.argtypes = restype, argtypes
    check_abi(lib)
    available = tuple(lib.hal_cpu_available_isas().decode().split(","))
    forced = env.choice(ISA_ENV, "", ISA_NAMES)  # a name no build has is a typo: an error, not the default
    chosen = lib.hal_cpu_select_isa(forced.encode()) if forced else None
    if forced and chosen is None:
        _log.warning("hal-cpu: %s=%r is not one of the variants this CPU runs (%s); using the best one",
                     ISA_ENV, forced, ", ".join(available))
    if chosen is None:
        chosen = lib.hal_cpu_select_isa(b"")
    lib.hal_cpu_set_spin_us(env.integer(SPIN_ENV, DEFAULT_SPIN_US, minimum=0, maximum=1_000_000))
    lib.hal_cpu_set_attention_amx(int(env.flag(AMX_ENV, True)))
    lib.hal_cpu_set_host_pool(int(env.flag(HOST_POOL_ENV, True)))
    _threads.current()  # a bad HAL_CPU_THREADS is reported when the library loads
    return Native(lib=lib, isa=chosen.decode(), available=available)


def check_abi(lib: Any, structs: dict[str, type[ctypes.Structure]] | None = None) -> None:
    """Raise :class:`NativeUnavailable` unless every mirrored struct matches the library's layout."""
    for name, struct in (_abi.STRUCTS if structs is None else structs).items():
        raw = lib.hal_cpu_abi(name.encode())
        why = _abi.mismatch(name, struct, None if raw is None else raw.decode())
        if why is not None:
            raise NativeUnavailable(f"{_LIBRARY} does not match hal_cpu's argument structs ({why}); rebuild with "
                                    "`pip install -e plugins/hal_cpu`")


def load() -> Native:
    """The compiled kernels (loaded on the first call); raises :class:`NativeUnavailable` when they cannot be."""
    global _native, _failure
    if _native is not None:
        return _native
    with _lock:
        if _native is None:
            if _failure is not None:
                raise _failure
            try:
                _native = _open()
            except NativeUnavailable as exc:
                _failure = exc
                raise
    return _native


_warned = False


def try_load() -> Native | None:
    """:func:`load`, or None after logging once why the numpy fallback runs instead."""
    global _warned
    if _native is not None:
        return _native
    try:
        return load()
    except NativeUnavailable as exc:
        if not _warned:
            _warned = True
            _log.warning("hal-cpu: compiled kernels unavailable (%s); running the slower numpy fallback", exc)
        return None


def pointer(array: np.ndarray | None) -> int | None:
    """The address of ``array``'s first element (None for None), for a ctypes ``c_void_p`` argument.

    A writable, C-contiguous, non-empty array gives its address through the buffer protocol: about 0.5 µs for
    a numpy dtype, 0.8 µs for one without a buffer format (bfloat16, a dtype of ml_dtypes: viewed as the
    unsigned integers of its size first); any other array from ``__array_interface__`` (about 1.6 µs: a dict
    built per call). A call passes several.
    """
    if array is None:
        return None
    flags = array.flags
    if flags.writeable and flags.c_contiguous and array.size:
        dtype = array.dtype
        if dtype.isbuiltin == 1:
            return _addressof(_char_over(array))  # type: ignore[arg-type]  # numpy's stubs lack __buffer__
        same_size = _UINT_OF_SIZE.get(dtype.itemsize)
        if same_size is not None and not dtype.hasobject:
            return _addressof(_char_over(array.view(same_size)))  # type: ignore[arg-type]
    return array.__array_interface__["data"][0]


#: Unsigned integer dtypes by item size: a view of an array with no buffer format that has one.
_UINT_OF_SIZE: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
                                           8: np.dtype(np.uint64)}


_addressof = ctypes.addressof
_char_over = ctypes.c_char.from_buffer
