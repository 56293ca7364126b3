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


def _run_suite(site: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "hal_core.testing", "--pyargs", "hal_core.testing.suite",
         "--hal-backend=tiny", "-q", "-p", "no:cacheprovider", "--hal-seed=1", *extra],
        cwd=tmp_path, env=subprocess_env(site), capture_output=True, text=True, timeout=600,
    )


def test_contract_suite_fails_the_example_until_it_implements_its_ops(tiny, site, tmp_path) -> None:
    """The example implements one op: the suite fails every test whose calls fell back, naming the op."""
    pytest.importorskip("hal_core.testing.suite", reason="the contract suite is not installed")
    done = _run_suite(site, tmp_path)
    assert done.returncode == 1, done.stdout[-4000:] + done.stderr[-2000:]
    failed = re.findall(r"^FAILED \S+::(\w+)", done.stdout, flags=re.M)
    assert any(name.startswith("test_paged_attention") for name in failed), done.stdout[-4000:]
    assert any(name.startswith("test_write_kv_cache") for name in failed), done.stdout[-4000:]
    assert "fell back although backend 'tiny' declares these arguments supported" in done.stdout
    assert not any(name.startswith("test_stream") for name in failed)  # the device contracts hold


DECLARED = '''
    def register_ops(self, registry: OpRegistry) -> None:
        from hal_core.ops import OpCoverage

        registry.register("quantized_gemm", gemm_w4a16, priority=10, supports=supports_w4a16,
                          name="tiny-w4a16")
        registry.declare("quantized_gemm", OpCoverage(dtypes={"fp16", "fp32"}, bits={4}))
        registry.declare("paged_attention", OpCoverage.none())
        registry.declare("write_kv_cache", OpCoverage.none())
        registry.declare("sample", OpCoverage.none())
        registry.declare("rms_norm", OpCoverage.none())
        registry.declare("gated_activation", OpCoverage.none())
        registry.declare("rotary_embedding", OpCoverage.none())
        registry.declare("fused_moe", OpCoverage.none())
'''


def test_contract_suite_passes_the_example_once_it_declares_what_it_leaves_to_the_fallback(
        make_plugin, cpu, site, tmp_path) -> None:
    """Declaring bf16, int8 and the two attention ops unsupported (OpCoverage) makes the suite pass."""
    pytest.importorskip("hal_core.testing.suite", reason="the contract suite is not installed")
    source = _block("hal_tiny.py")
    start = source.index("    def register_ops")
    end = source.index("    def owns")
    make_plugin("tiny", source[:start] + DECLARED.lstrip("\n") + "\n" + source[end:], module="hal_tiny",
                distribution="hal-tiny")
    assert hal_core.get_backend("tiny").ops.coverage("paged_attention").covers({}) is not True
    done = _run_suite(site, tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


def test_allow_fallback_option_lets_the_example_pass(tiny, site, tmp_path) -> None:
    """--hal-allow-fallback turns the fallback check off: the example's results are still correct."""
    pytest.importorskip("hal_core.testing.suite", reason="the contract suite is not installed")
    done = _run_suite(site, tmp_path, "--hal-allow-fallback")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
