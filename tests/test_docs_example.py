"""The example plugin of docs/writing-a-backend.md, installed as a real distribution, works as described."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from halfakes import subprocess_env

import hal_core
from hal_core.ops import OPS
from hal_core.quant import quantize

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-a-backend.md"


def _block(filename: str) -> str:
    """The fenced code block of the doc whose first line is ``# file: <filename>``."""
    for match in re.finditer(r"```\w+\n(.*?)```", DOC.read_text(), flags=re.S):
        body = match.group(1)
        if body.startswith(f"# file: {filename}\n"):
            return body
    raise AssertionError(f"{DOC.name} has no code block for {filename}")


@pytest.fixture
def tiny(make_plugin, cpu):
    """hal-tiny from the doc, installed with the entry point its pyproject declares."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    project = tomllib.loads(_block("pyproject.toml"))
    (name, module), = project["project"]["entry-points"]["hal"].items()
    make_plugin(name, _block(f"{module}.py"), module=module, distribution=project["project"]["name"],
                version=project["project"]["version"])
    return hal_core.get_backend(name)


def test_example_plugin_loads_and_is_selectable(tiny) -> None:
    """The example's entry point loads and its backend binds, with hal-tiny's name and version."""
    record = next(p for p in hal_core.list_plugins() if p.name == "tiny")
    assert (record.status, record.distribution, record.version) == ("loaded", "hal-tiny", "0.1.0")
    assert tiny.name == "tiny" and tiny.device(0).capabilities.compute_units >= 1


def test_example_gemm_runs_its_own_implementation(tiny) -> None:
    """The example's quantized_gemm is registered and matches the reference."""
    assert [impl.name for impl in tiny.ops.registry.implementations("quantized_gemm")] == ["tiny-w4a16"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    qw = quantize(rng.standard_normal((64, 8)) / 8, group_size=32)
    out = np.empty((4, 8), np.float32)
    result = tiny.ops.quantized_gemm(x, qw, out=out)
    assert result is out
    np.testing.assert_allclose(out, OPS["quantized_gemm"].reference({"x": x, "qweight": qw}), rtol=1e-5, atol=1e-5)


def test_example_unsupported_calls_fall_back_correctly(tiny, caplog, monkeypatch) -> None:
    """bf16 activations and the ops it does not implement run on the CPU path; HAL_STRICT makes that an error."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 64)).astype(hal_core.arrays.BFLOAT16)
    qw = quantize(rng.standard_normal((64, 8)) / 8, group_size=32)
    with caplog.at_level(logging.WARNING, logger="hal"):
        y = tiny.ops.quantized_gemm(x, qw)
    expected = OPS["quantized_gemm"].reference({"x": x, "qweight": qw})
    np.testing.assert_allclose(y.astype(np.float64), expected, rtol=2e-2, atol=2e-2)
    assert any("not handled" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("HAL_STRICT", "1")
    with pytest.raises(hal_core.FallbackError):
        tiny.ops.quantized_gemm(x, qw)


def test_contract_suite_passes_for_the_example(tiny, site, tmp_path) -> None:
    """`pytest --pyargs hal_core.testing.suite --hal-backend=tiny` passes for the example plugin, as the doc says."""
    pytest.importorskip("hal_core.testing.suite", reason="the contract suite is not installed")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--pyargs", "hal_core.testing.suite", "--hal-backend=tiny", "-q",
         "-p", "no:cacheprovider", "--hal-seed=1"],
        cwd=tmp_path, env=subprocess_env(site), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
