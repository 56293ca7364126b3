"""On a host with no AMD GPU, discovering hal-rocm imports no CuPy and the CPU backend is chosen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hal_rocm._probe import probe

SCRIPT = textwrap.dedent("""
    import json, sys
    import hal_core
    infos = {i.name: i for i in hal_core.list_backends()}
    after_list = "cupy" in sys.modules
    chosen = hal_core.get_backend().name
    rocm = infos.get("rocm")
    print(json.dumps({
        "cupy_after_list": after_list,
        "cupy_after_get": "cupy" in sys.modules,
        "chosen": chosen,
        "rocm": None if rocm is None else {"available": rocm.available, "reason": rocm.reason,
                                           "remedy": rocm.remedy, "distribution": rocm.distribution,
                                           "priority": rocm.priority},
        "cuda_priority": infos["cuda"].priority if "cuda" in infos else None,
    }))
""")


@pytest.fixture(scope="module")
def report() -> dict:
    if probe().ok:
        pytest.skip("an AMD GPU is usable here; this test is about hosts without one")
    env = {**os.environ, "HAL_BACKEND": "", "HAL_DISABLE_PLUGINS": "", "HAL_FORCE_CPU": "", "HAL_STRICT": ""}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_discovery_imports_no_cupy(report: dict) -> None:
    """list_backends() and get_backend() probe HIP with ctypes only: 'cupy' stays out of sys.modules."""
    assert report["cupy_after_list"] is False and report["cupy_after_get"] is False


def test_rocm_listed_unavailable_with_reason(report: dict) -> None:
    """hal-rocm is installed, unavailable, says why and what to do, and ranks just below CUDA."""
    rocm = report["rocm"]
    assert rocm is not None, "hal-rocm's entry point was not found; pip install -e plugins/hal_rocm"
    assert rocm["distribution"] == "hal-rocm" and rocm["available"] is False
    assert rocm["reason"] and rocm["remedy"]
    if report["cuda_priority"] is not None:
        assert rocm["priority"] < report["cuda_priority"]


def test_cpu_is_chosen(report: dict) -> None:
    assert report["chosen"] == "cpu"


def test_hal_info_json_lists_rocm() -> None:
    """``hal info --json`` shows the rocm backend as unavailable with the probe's reason."""
    if probe().ok:
        pytest.skip("an AMD GPU is usable here")
    done = subprocess.run([sys.executable, "-m", "hal_core", "info", "--json"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HAL_BACKEND": "", "HAL_DISABLE_PLUGINS": ""})
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    (rocm,) = [b for b in info["backends"] if b["name"] == "rocm"]
    assert rocm["available"] is False and rocm["reason"] == probe().reason
