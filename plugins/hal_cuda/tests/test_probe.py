"""Availability reasons from the driver probe, with a fake ``libcuda`` and import machinery."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest
from hal_cuda._probe import hidden_by_visible_devices, probe


class FakeDriver:
    """Stands in for ``ctypes.CDLL('libcuda.so.1')``: cuInit, cuDeviceGetCount, cuDriverGetVersion."""

    def __init__(self, init: int = 0, count: int = 1, version: int = 12040) -> None:
        self.init, self.count, self.version = init, count, version

    def cuInit(self, flags: int) -> int:
        return self.init

    def cuDeviceGetCount(self, ref: Any) -> int:
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return 0

    def cuDriverGetVersion(self, ref: Any) -> int:
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.version
        return 0


def _loader(driver: FakeDriver | None):
    def load(name: str) -> FakeDriver:
        assert name == "libcuda.so.1"
        if driver is None:
            raise OSError(f"{name}: cannot open shared object file")
        return driver
    return load


def _cupy(runtime: int):
    return lambda: SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(runtimeGetVersion=lambda: runtime)))


def _found(name: str) -> Any:
    return object()


def _missing(name: str) -> None:
    return None


def _never_import() -> Any:
    raise AssertionError("CuPy must not be imported here")


def test_driver_library_missing() -> None:
    """No libcuda: the reason names the library; CuPy is neither looked up nor imported."""
    result = probe(loader=_loader(None), find_spec=_never_import, import_cupy=_never_import, environ={})
    assert not result.ok
    assert "libcuda.so.1 was not found" in result.reason
    assert "driver" in result.remedy


def test_no_device() -> None:
    """cuInit answers CUDA_ERROR_NO_DEVICE: 'found no CUDA device'."""
    result = probe(loader=_loader(FakeDriver(init=100)), find_spec=_never_import, environ={})
    assert not result.ok and "no CUDA device" in result.reason


def test_zero_devices_counted() -> None:
    """cuInit succeeds but cuDeviceGetCount says 0."""
    result = probe(loader=_loader(FakeDriver(count=0)), find_spec=_never_import, environ={})
    assert not result.ok and "no CUDA device" in result.reason


@pytest.mark.parametrize("value", ["", " ", "-1", "-1,0", "abc", "none"], ids=repr)
def test_visible_devices_hides_all(value: str) -> None:
    """Empty, negative or invalid CUDA_VISIBLE_DEVICES is named as the reason."""
    result = probe(loader=_loader(FakeDriver(init=100)), find_spec=_never_import,
                   environ={"CUDA_VISIBLE_DEVICES": value})
    assert not result.ok
    assert "CUDA_VISIBLE_DEVICES" in result.reason and "hides every GPU" in result.reason
    assert "CUDA_VISIBLE_DEVICES" in result.remedy


@pytest.mark.parametrize("value", ["0", "1,0", "GPU-8b3f2c1e", "MIG-abc", "0,abc"], ids=repr)
def test_visible_devices_valid(value: str) -> None:
    """Indices and UUIDs do not hide everything."""
    assert hidden_by_visible_devices({"CUDA_VISIBLE_DEVICES": value}) == ""


def test_visible_devices_names_missing_gpu() -> None:
    """A valid-looking index that names no device still blames CUDA_VISIBLE_DEVICES."""
    result = probe(loader=_loader(FakeDriver(count=0)), find_spec=_never_import,
                   environ={"CUDA_VISIBLE_DEVICES": "7"})
    assert not result.ok and "CUDA_VISIBLE_DEVICES='7' names no existing GPU" in result.reason


def test_cupy_not_installed() -> None:
    """Driver and device present, CuPy missing: the reason says so and the remedy has the pip command."""
    result = probe(loader=_loader(FakeDriver()), find_spec=_missing, import_cupy=_never_import, environ={})
    assert not result.ok
    assert result.reason == "CuPy is not installed"
    assert "pip install cupy-cuda12x" in result.remedy
    assert result.device_count == 1


def test_driver_too_old_for_cupy() -> None:
    """A CUDA 12.4 driver with CuPy built for CUDA 13: 'driver too old'."""
    result = probe(loader=_loader(FakeDriver(version=12040)), find_spec=_found, import_cupy=_cupy(13000),
                   environ={})
    assert not result.ok
    assert "driver too old" in result.reason
    assert "12.4" in result.reason and "13.0" in result.reason
    assert "cupy-cuda12x" in result.remedy


def test_minor_version_compatibility_is_fine() -> None:
    """Same major version, older driver minor: CUDA's minor-version compatibility applies."""
    result = probe(loader=_loader(FakeDriver(version=12020)), find_spec=_found, import_cupy=_cupy(12080),
                   environ={})
    assert result.ok, result.reason
    assert (result.driver_version, result.runtime_version) == (12020, 12080)


def test_broken_cupy_is_a_reason() -> None:
    """An exception while importing CuPy becomes the reason, not a crash."""
    def boom() -> Any:
        raise ImportError("libcudart.so.12: cannot open shared object file")

    result = probe(loader=_loader(FakeDriver()), find_spec=_found, import_cupy=boom, environ={})
    assert not result.ok and "CuPy failed to import: ImportError" in result.reason


def test_other_init_errors() -> None:
    """Stub library and mismatched driver each get their own reason."""
    stub = probe(loader=_loader(FakeDriver(init=34)), find_spec=_never_import, environ={})
    mismatch = probe(loader=_loader(FakeDriver(init=803)), find_spec=_never_import, environ={})
    assert "stub library" in stub.reason
    assert "not usable" in mismatch.reason
