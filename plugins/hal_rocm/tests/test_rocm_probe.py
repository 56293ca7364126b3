"""Availability reasons from the HIP probe, with a fake ``libamdhip64`` and import machinery."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest
from hal_rocm._probe import PIP_INSTALL, hidden_by_visible_devices, probe

ROCM7 = 70_051_831  # HIP_VERSION of ROCm 7.0
ROCM6 = 60_432_830


class FakeHip:
    """Stands in for ``ctypes.CDLL('libamdhip64.so')``: hipInit, hipGetDeviceCount, hipRuntimeGetVersion."""

    def __init__(self, init: int = 0, count: int = 1, version: int = ROCM7, count_rc: int = 0) -> None:
        self.init, self.count, self.version, self.count_rc = init, count, version, count_rc
        self.calls: list[str] = []

    def hipInit(self, flags: int) -> int:
        self.calls.append("hipInit")
        return self.init

    def hipGetDeviceCount(self, ref: Any) -> int:
        self.calls.append("hipGetDeviceCount")
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return self.count_rc

    def hipRuntimeGetVersion(self, ref: Any) -> int:
        ctypes.cast(ref, ctypes.POINTER(ctypes.c_int))[0] = self.version
        return 0


def _loader(hip: FakeHip | None, only: str = "libamdhip64.so"):
    seen: list[str] = []

    def load(name: str) -> FakeHip:
        seen.append(name)
        if hip is None or name != only:
            raise OSError(f"{name}: cannot open shared object file")
        return hip
    load.seen = seen  # type: ignore[attr-defined]
    return load


def _cupy(is_hip: bool = True, runtime: int = ROCM7):
    rt = SimpleNamespace(is_hip=is_hip, runtimeGetVersion=lambda: runtime)
    return lambda: SimpleNamespace(cuda=SimpleNamespace(runtime=rt))


def _found(name: str) -> Any:
    return object()


def _missing(name: str) -> None:
    return None


def _never(*args: Any) -> Any:
    raise AssertionError("CuPy must not be looked up or imported here")


def _dists(*names: str):
    return lambda: list(names)


def test_hip_runtime_missing() -> None:
    """No libamdhip64 anywhere: the reason names it; CuPy is neither looked up nor imported."""
    load = _loader(None)
    result = probe(loader=load, find_spec=_never, distributions=_never, import_cupy=_never, environ={})
    assert not result.ok
    assert "HIP runtime (libamdhip64.so) was not found" in result.reason and "install ROCm" in result.remedy
    assert "/opt/rocm/lib/libamdhip64.so" in load.seen  # type: ignore[attr-defined]


def test_rocm_path_is_searched() -> None:
    """$ROCM_PATH/lib is tried when the loader's search path has no HIP runtime."""
    hip = FakeHip()
    result = probe(loader=_loader(hip, only="/site/rocm/lib/libamdhip64.so.7"), find_spec=_found,
                   distributions=_dists("cupy-rocm-7-0"), import_cupy=_cupy(), environ={"ROCM_PATH": "/site/rocm"})
    assert result.ok and result.library == "/site/rocm/lib/libamdhip64.so.7"


@pytest.mark.parametrize("init", [100, 101])
def test_no_device(init: int) -> None:
    """hipInit reports no device: a reason, and CuPy untouched."""
    result = probe(loader=_loader(FakeHip(init=init)), find_spec=_never, distributions=_never,
                   import_cupy=_never, environ={})
    assert not result.ok and "found no AMD GPU" in result.reason and f"hipError {init}" in result.reason


def test_zero_devices_counted() -> None:
    hip = FakeHip(count=0, count_rc=100)
    result = probe(loader=_loader(hip), find_spec=_never, distributions=_never, import_cupy=_never, environ={})
    assert not result.ok and result.reason == "the HIP runtime reports no AMD GPU"
    assert hip.calls == ["hipInit", "hipGetDeviceCount"]


@pytest.mark.parametrize(("variable", "value", "words"), [
    ("HIP_VISIBLE_DEVICES", "", "set but empty"),
    ("ROCR_VISIBLE_DEVICES", "-1", "negative index"),
    ("HIP_VISIBLE_DEVICES", "none", "invalid entry 'none'"),
], ids=["hip-empty", "rocr-negative", "hip-invalid"])
def test_visible_devices_hiding_every_gpu(variable: str, value: str, words: str) -> None:
    """A visibility variable that hides every GPU is the reason, named, with how to undo it."""
    env = {variable: value}
    for hip in (FakeHip(init=100), FakeHip(count=0)):
        result = probe(loader=_loader(hip), find_spec=_never, distributions=_never, import_cupy=_never, environ=env)
        assert not result.ok and variable in result.reason and words in result.reason
        assert f"unset {variable}" in result.remedy


def test_visible_devices_naming_no_existing_gpu() -> None:
    """A valid-looking index beyond the devices: the reason names the variable."""
    result = probe(loader=_loader(FakeHip(count=0)), find_spec=_never, distributions=_never, import_cupy=_never,
                   environ={"HIP_VISIBLE_DEVICES": "7"})
    assert not result.ok and "HIP_VISIBLE_DEVICES='7' names no existing GPU" in result.reason


def test_hidden_by_visible_devices_accepts_uuids_and_indices() -> None:
    assert hidden_by_visible_devices({"ROCR_VISIBLE_DEVICES": "GPU-4b2c1d,1"}) == ""
    assert hidden_by_visible_devices({"HIP_VISIBLE_DEVICES": "0,1"}) == ""
    assert hidden_by_visible_devices({}) == ""
    assert "CUDA_VISIBLE_DEVICES" in hidden_by_visible_devices({"CUDA_VISIBLE_DEVICES": ""})


def test_cupy_missing_names_the_extra() -> None:
    """A device but no CuPy: the remedy is the pip command for the ROCm extra."""
    result = probe(loader=_loader(FakeHip(count=2)), find_spec=_missing, distributions=_never, import_cupy=_never,
                   environ={})
    assert not result.ok and result.reason == "CuPy for ROCm is not installed"
    assert result.remedy == PIP_INSTALL and "pip install hal-rocm[cupy]" in result.remedy
    assert result.device_count == 2


def test_cupy_for_another_rocm_major() -> None:
    """cupy-rocm-6-x on a ROCm 7 runtime is refused before CuPy is imported."""
    result = probe(loader=_loader(FakeHip()), find_spec=_found, distributions=_dists("cupy-rocm-6-4"),
                   import_cupy=_never, environ={})
    assert not result.ok and "another ROCm major" in result.reason
    assert "cupy-rocm-6-4 (ROCm 6)" in result.reason and "ROCm 7" in result.reason
    assert "pip install hal-rocm[cupy]" in result.remedy


def test_cupy_for_rocm7_on_a_rocm6_runtime() -> None:
    result = probe(loader=_loader(FakeHip(version=ROCM6)), find_spec=_found, distributions=_dists("cupy-rocm-7-0"),
                   import_cupy=_never, environ={})
    assert not result.ok and "ROCm 6" in result.reason and "cupy-rocm-6-0" in result.remedy


def test_cuda_build_of_cupy() -> None:
    """cupy-cuda12x on an AMD machine: the reason says it is the CUDA build."""
    result = probe(loader=_loader(FakeHip()), find_spec=_found, distributions=_dists("cupy-cuda12x"),
                   import_cupy=_never, environ={})
    assert not result.ok and "built for CUDA, not ROCm" in result.reason and "cupy-cuda12x" in result.remedy


def test_source_build_is_checked_after_import() -> None:
    """A plain ``cupy`` distribution (source build) is imported and asked whether it is a HIP build."""
    bad = probe(loader=_loader(FakeHip()), find_spec=_found, distributions=_dists("cupy"),
                import_cupy=_cupy(is_hip=False), environ={})
    assert not bad.ok and bad.reason == "the installed CuPy is built for CUDA, not ROCm"
    good = probe(loader=_loader(FakeHip()), find_spec=_found, distributions=_dists("cupy"), import_cupy=_cupy(),
                 environ={})
    assert good.ok and good.runtime_version == ROCM7


def test_broken_cupy_is_a_reason() -> None:
    def explode() -> Any:
        raise ImportError("libamdhip64.so.7: cannot open shared object file")

    result = probe(loader=_loader(FakeHip()), find_spec=_found, distributions=_dists("cupy-rocm-7-0"),
                   import_cupy=explode, environ={})
    assert not result.ok and "CuPy failed to import: ImportError" in result.reason


def test_usable() -> None:
    """A device, CuPy for the same ROCm major, a HIP build: available."""
    result = probe(loader=_loader(FakeHip(count=8)), find_spec=_found, distributions=_dists("cupy-rocm-7-0"),
                   import_cupy=_cupy(), environ={"HIP_VISIBLE_DEVICES": "0,1"})
    assert result.ok and result.reason == "" and result.device_count == 8
