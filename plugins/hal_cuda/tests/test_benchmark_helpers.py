"""The GPU benchmarks' pure parts (formulas, ratio math, verdicts, file names) and that every script compiles."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gb():
    return _load("_gpu_bench")


@pytest.mark.parametrize("script", ["_gpu_bench.py", "bench_paged_attention.py", "bench_quantized_gemm.py",
                                    "offline_install.py"])
def test_scripts_compile(script: str) -> None:
    py_compile.compile(str(BENCH / script), doraise=True)


def test_gpu_check_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu_check.sh")], capture_output=True).returncode == 0


def test_kv_bytes_formula(gb) -> None:
    """Batch 32 x 4096 tokens, 8 KV heads, head 128, fp16: 2 x 131072 x 8 x 128 x 2 bytes = 512 MiB."""
    assert gb.paged_attention_kv_bytes([4096] * 32, 8, 128, 2) == 2 * 32 * 4096 * 8 * 128 * 2 == 512 << 20
    assert gb.paged_attention_kv_bytes([32768], 8, 128, 2) == 128 << 20


def test_copy_bandwidth_counts_read_and_write(gb) -> None:
    """2 GiB copied in 1 ms is 4.29 TB/s of traffic (read + write)."""
    assert gb.copy_bandwidth_gbps(2 << 30, 1.0) == pytest.approx(4294.97, rel=1e-4)


def test_ratio_and_verdicts(gb) -> None:
    assert gb.ratio(3.0, 4.0) == 0.75 and gb.ratio(1.0, 0.0) == 0.0
    assert gb.verdict(0.81, 0.8) == "pass" and gb.verdict(0.79, 0.8) == "miss" and gb.verdict(5, None) == "-"
    assert gb.median_ms([3.0, 1.0, 2.0, 10.0]) == 2.5
    with pytest.raises(ValueError):
        gb.median_ms([])


@pytest.mark.parametrize(("m", "large", "target"), [
    (1, True, 3.0), (16, True, 3.0), (1, False, None), (64, False, 2.0), (64, True, 2.0),
    (1024, True, 1 / 1.1), (4096, False, 1 / 1.1), (200, True, None),
])
def test_gemm_targets(gb, m: int, large: bool, target: float | None) -> None:
    assert gb.gemm_target(m, large) == target


def test_result_path(gb, tmp_path: Path) -> None:
    """benchmarks/results/<date>-<device>.json with a file-safe device name."""
    path = gb.result_path(tmp_path, "NVIDIA H200", dt.date(2026, 12, 1))
    assert path == tmp_path / "2026-12-01-nvidia-h200.json"
    written = gb.write_json(path, {"b": 1, "a": [1.5]})
    assert json.loads(written.read_text()) == {"a": [1.5], "b": 1}


def test_offline_install_writes_entry_points(tmp_path: Path) -> None:
    """Hand-written dist-info makes the three distributions and their entry points discoverable."""
    done = subprocess.run([sys.executable, str(BENCH / "offline_install.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cuda = (tmp_path / "hal_cuda-0.1.0.dist-info" / "entry_points.txt").read_text()
    core = (tmp_path / "hal_core-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[hal]\ncuda = hal_cuda._plugin" in cuda
    assert "pytest11" not in core  # the conformance kit's pytest plugin is opt-in
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps(sorted(e.name for e in m.distribution('hal-cuda').entry_points)))")
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == ["cuda"]


class _Graph:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def launch(self, stream: object) -> None:
        self.log.append(f"launch on {stream}")


class _CaptureStream:
    """A CuPy stream as the capture helper uses it; ``refuse`` makes end_capture fail as an invalidated capture."""

    def __init__(self, log: list[str], refuse: bool = False) -> None:
        self.log, self.refuse = log, refuse

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def begin_capture(self) -> None:
        self.log.append("begin_capture")

    def end_capture(self) -> _Graph:
        self.log.append("end_capture")
        if self.refuse:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _Graph(self.log)

    def __str__(self) -> str:
        return "stream"


class _Pool:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def malloc(self, size: int) -> None:
        return None


def _fake_cupy(log: list[str], stream: _CaptureStream) -> object:
    from contextlib import contextmanager
    from types import SimpleNamespace

    @contextmanager
    def using_allocator(allocator: object):
        log.append("private pool on")
        yield
        log.append("private pool off")

    return SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: stream, MemoryPool=lambda: _Pool(log),
                                                using_allocator=using_allocator))


@pytest.mark.parametrize("refuse", [False, True], ids=["captured", "refused"])
def test_capture_private_runs_once_then_captures_in_its_own_pool(gb, refuse: bool) -> None:
    """The step runs eagerly once (kernels compiled, error flag made), then is captured with the private pool as
    allocator; replay launches the graph on the capturing stream; a refused capture says why."""
    log: list[str] = []
    stream = _CaptureStream(log, refuse)
    replay, why, pool = gb.capture_private(_fake_cupy(log, stream), lambda: log.append("step"))
    assert log == ["private pool on", "step", "synchronize", "begin_capture", "step", "end_capture",
                   "private pool off"]
    assert isinstance(pool, _Pool)
    if refuse:
        assert replay is None and "not permitted" in why
        return
    assert why == ""
    replay()
    assert log[-1] == "launch on stream"
