"""The ``hal`` command: ``info`` (text and JSON) and ``demo`` (checked decode steps, exit codes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from halfakes import subprocess_env

import hal_core
from hal_core.cli import main

SMALL = ["--seqs", "3", "--max-len", "40", "--heads", "4", "--kv-heads", "2", "--head-size", "32",
         "--block-size", "8", "--steps", "2", "--hidden", "64", "--group-size", "32"]

WRONG_GEMM = '''
import numpy as np
from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


def wrong_gemm(call):
    expected = call.spec.reference(call.args)
    return (expected + 1.0).astype(call.spec.output_dtype(call.args))


class WrongBackend(HostBackend):
    name = "wrong"
    priority = 5

    def register_ops(self, registry):
        registry.register("quantized_gemm", wrong_gemm, priority=10, name="off-by-one")


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [WrongBackend]
'''


def test_info_json_is_one_document_with_stable_keys(make_plugin, capsys) -> None:
    """hal info --json prints one JSON document: plugins, backends, selection, devices, environment."""
    make_plugin("extra", priority=10**6)
    make_plugin("boom", "raise RuntimeError('kaboom')\n")
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {"hal_core", "environment", "plugins", "backends", "selected", "devices",
                         "device_errors", "tuning", "warnings"}
    assert info["hal_core"]["version"] == hal_core.__version__
    plugins = {p["name"]: p for p in info["plugins"]}
    assert plugins["boom"]["status"] == "rejected" and "kaboom" in plugins["boom"]["reason"]
    assert plugins["extra"]["status"] == "loaded" and plugins["extra"]["backends"] == ["extra"]
    backend = next(b for b in info["backends"] if b["name"] == "extra")
    assert set(backend) >= {"name", "distribution", "version", "priority", "plugin", "loaded", "available",
                            "reason", "remedy", "selectable"}
    assert info["selected"] == {"backend": "extra", "error": None}
    caps = info["devices"]["extra"][0]["capabilities"]
    assert hal_core.DeviceCapabilities.model_validate(caps).name == "fake device"
    assert "HAL_BACKEND" in info["environment"]


def test_info_reports_the_selection_error(make_plugin, capsys, monkeypatch) -> None:
    """When get_backend() raises, hal info says which error instead of failing."""
    make_plugin("extra")
    monkeypatch.setenv("HAL_BACKEND", "nonexistent")
    assert main(["info", "--json"]) == 0
    selected = json.loads(capsys.readouterr().out)["selected"]
    assert selected["backend"] is None
    assert selected["error"]["type"] == "BackendNotFoundError" and "nonexistent" in selected["error"]["message"]


def test_info_text_shows_reasons(make_plugin, capsys) -> None:
    """The text form lists every entry point with its status and why."""
    make_plugin("boom", "raise RuntimeError('kaboom')\n")
    make_plugin("extra")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "boom" in out and "rejected" in out and "kaboom" in out
    assert "devices of extra" in out


def test_demo_passes_on_cpu_and_prints_seed_table_and_progress(cpu, capsys) -> None:
    """hal demo on the CPU backend: every op within tolerance, exit 0, seed and table on stdout, progress on stderr."""
    assert main(["demo", "--backend", "cpu", "--seed", "5", *SMALL]) == 0
    captured = capsys.readouterr()
    assert "seed 5" in captured.out
    for op in ("quantized_gemm", "write_kv_cache", "paged_attention"):
        assert op in captured.out
    assert "NO" not in captured.out.split()
    assert "step 1/2" in captured.err and "step 2/2" in captured.err


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_demo_dtypes_on_cpu(cpu, dtype: str, capsys) -> None:
    """The demo passes in every supported dtype."""
    assert main(["demo", "--backend", "cpu", "--seed", "11", "--dtype", dtype, "-q", *SMALL]) == 0
    assert capsys.readouterr().err == ""


def test_demo_fails_when_a_result_is_wrong(make_plugin, capsys) -> None:
    """A backend returning wrong results makes hal demo exit 1 and name the op."""
    make_plugin("wrong", WRONG_GEMM)
    assert main(["demo", "--backend", "wrong", "--seed", "3", "-q", *SMALL]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "qkv_proj" in out


def test_demo_unknown_backend_exits_2(capsys) -> None:
    """hal demo --backend nonexistent exits 2 with the error on stderr."""
    assert main(["demo", "--backend", "nonexistent", "-q"]) == 2
    assert "BackendNotFoundError" in capsys.readouterr().err


def test_demo_rejects_inconsistent_sizes(capsys) -> None:
    """Sizes that cannot work (kv heads not dividing heads) exit 2 before any work."""
    assert main(["demo", "--heads", "6", "--kv-heads", "4"]) == 2
    assert "--kv-heads" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli() -> None:
    """python -m hal_core is the hal command."""
    done = subprocess.run([sys.executable, "-m", "hal_core", "--version"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    assert done.returncode == 0 and hal_core.__version__ in done.stdout


def test_info_json_from_a_fresh_process() -> None:
    """hal info --json works as a command in a fresh interpreter and prints valid JSON."""
    done = subprocess.run([sys.executable, "-m", "hal_core", "info", "--json"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "plugins" in json.loads(done.stdout)
