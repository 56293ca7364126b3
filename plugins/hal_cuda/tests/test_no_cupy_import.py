"""On a host with no GPU, discovering hal-cuda imports no CuPy and the CPU backend is chosen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    import hal_core
    infos = {i.name: i for i in hal_core.list_backends()}
    after_list = "cupy" in sys.modules
    chosen = hal_core.get_backend().name if "cpu" in infos else None
    cuda = infos.get("cuda")
    print(json.dumps({
        "cupy_after_list": after_list,
        "cupy_after_get": "cupy" in sys.modules,
        "chosen": chosen,
        "cuda": None if cuda is None else {"available": cuda.available, "reason": cuda.reason,
                                           "remedy": cuda.remedy, "distribution": cuda.distribution},
    }))
""")


@pytest.fixture(scope="module")
def report(cuda_probe) -> dict:
    if cuda_probe.ok:
        pytest.skip("a CUDA device is usable here; this test is about hosts without one")
    env_clear = {"HAL_BACKEND": "", "HAL_DISABLE_PLUGINS": "", "HAL_FORCE_CPU": "", "HAL_STRICT": ""}
    env = {**os.environ, **env_clear}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_list_backends_imports_no_cupy(report: dict) -> None:
    """list_backends() probes the driver with ctypes only: 'cupy' stays out of sys.modules."""
    assert report["cupy_after_list"] is False
    assert report["cupy_after_get"] is False


def test_cuda_listed_unavailable_with_reason(report: dict) -> None:
    """hal-cuda is installed, unavailable, and says why (and what to do)."""
    cuda = report["cuda"]
    assert cuda is not None, "hal-cuda's entry point was not found; pip install -e plugins/hal_cuda"
    assert cuda["distribution"] == "hal-cuda"
    assert cuda["available"] is False
    assert cuda["reason"] and cuda["remedy"]


def test_cpu_is_chosen(report: dict) -> None:
    """Automatic selection falls back to the CPU backend."""
    if report["chosen"] is None:
        pytest.skip("hal-cpu is not installed in this environment")
    assert report["chosen"] == "cpu"
