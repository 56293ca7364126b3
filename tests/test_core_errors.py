"""The error hierarchy: builtin bases, carried data, pickling, messages that say what to do."""

from __future__ import annotations

import pickle

import pytest

import hal_core
from hal_core import _errors

HIERARCHY = [
    ("BackendNotFoundError", LookupError),
    ("BackendUnavailableError", RuntimeError),
    ("BackendConflictError", RuntimeError),
    ("ImplementationError", RuntimeError),
    ("ArgumentError", ValueError),
    ("ArgumentTypeError", TypeError),
    ("LaunchConfigError", ValueError),
    ("ConfigurationError", ValueError),
    ("EnvironmentVariableError", ValueError),
    ("CheckpointError", ValueError),
    ("KernelCompileError", RuntimeError),
    ("FallbackError", RuntimeError),
    ("DeviceOutOfMemoryError", MemoryError),
    ("OutOfBlocksError", MemoryError),
]


@pytest.mark.parametrize(("name", "builtin"), HIERARCHY, ids=[name for name, _ in HIERARCHY])
def test_each_error_derives_from_hal_error_and_its_builtin(name: str, builtin: type) -> None:
    """Every hal error is a HalError and the builtin a caller would naturally catch."""
    cls = getattr(hal_core, name)
    assert issubclass(cls, hal_core.HalError)
    assert issubclass(cls, builtin)


def test_every_error_is_listed() -> None:
    """The table above covers every public error class."""
    assert {name for name, _ in HIERARCHY} | {"HalError"} == set(_errors.__all__)


EXAMPLES = [
    hal_core.BackendNotFoundError("rocm", ["cpu", "cuda"]),
    hal_core.BackendUnavailableError("cuda", "no GPU found", "install the NVIDIA driver"),
    hal_core.KernelCompileError("paged_attention.cu", "error: expected ';'", ("-arch=sm_90",)),
    hal_core.DeviceOutOfMemoryError(1 << 30, free=1 << 20, total=80 << 30, device="cuda:0"),
    hal_core.OutOfBlocksError(needed=4, free=1),
    hal_core.ArgumentError("argument 'x': expected 2 dimensions"),
    hal_core.EnvironmentVariableError("HAL_STRICT", "2", "1, true, yes, on (on) or 0, false, no, off (off)"),
]


@pytest.mark.parametrize("error", EXAMPLES, ids=[type(e).__name__ for e in EXAMPLES])
def test_errors_pickle_with_their_data(error: Exception) -> None:
    """Errors survive pickling (e.g. across worker processes) with message and fields intact."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_out_of_memory_carries_byte_counts() -> None:
    """DeviceOutOfMemoryError carries requested, free and total bytes and says what to do."""
    error = hal_core.DeviceOutOfMemoryError(1 << 30, free=1 << 20, total=80 << 30, device="cuda:0")
    assert (error.requested, error.free, error.total) == (1 << 30, 1 << 20, 80 << 30)
    assert str(1 << 30) in str(error) and "cuda:0" in str(error)
    assert "smaller batches" in str(error)
    unknown = hal_core.DeviceOutOfMemoryError(512)
    assert (unknown.free, unknown.total) == (-1, -1)


def test_not_found_lists_installed_backends() -> None:
    """BackendNotFoundError names the request, the installed backends, and how to install one."""
    message = str(hal_core.BackendNotFoundError("rocm", ["cuda", "cpu"]))
    assert "'rocm'" in message and "cpu, cuda" in message and "pip install hal-rocm" in message
