"""hal bench on tiny shapes: the report's schema, its formulas, peers missing or failing, bad shape syntax."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import hal_core
from hal_core import bench
from hal_core.bench import _inputs, _peers
from hal_core.cli import main

TINY = [
    "paged_attention:seqs=2,ctx=40,heads=4,kv_heads=2,head=32,block=8,dtype=fp32",
    "quantized_gemm:M=3,K=256,N=64,bits=4,group=64",
    "quantized_gemm:M=2,K=128,N=32,bits=8,group=32,dtype=bf16",
    "write_kv_cache:tokens=12,kv_heads=2,head=16,block=4",
]
QUICK = bench.BenchSettings(policy=bench.TimingPolicy(repeat=3, warmup=1, max_seconds=0.05), quick=True,
                            copy_bytes=1 << 20, blas_n=64)


def _cases() -> list[bench.Case]:
    return [bench.parse_shape(*text.split(":", 1)) for text in TINY]


def _expected_bytes(case: bench.Case) -> int:
    """The byte formulas of docs/benchmarks.md, written out independently of the op specs."""
    p = case.params
    item = {"fp32": 4, "fp16": 2, "bf16": 2}[p["dtype"]]
    if case.op == "paged_attention":
        kv = 2 * p["seqs"] * p["ctx"] * p["kv_heads"] * p["head"] * item
        return kv + 2 * p["seqs"] * p["heads"] * p["head"] * item  # + query and output
    if case.op == "write_kv_cache":
        return 4 * p["tokens"] * p["kv_heads"] * p["head"] * item
    weight = p["k"] * p["n"] * p["bits"] // 8 + (p["k"] // p["group"]) * p["n"] * 2  # codes + fp16 scales
    return weight + item * (p["m"] * p["k"] + p["m"] * p["n"])


def _expected_flops(case: bench.Case) -> int:
    p = case.params
    if case.op == "paged_attention":
        return p["seqs"] * p["ctx"] * p["heads"] * (4 * p["head"] + 5)
    if case.op == "quantized_gemm":
        return 2 * p["m"] * p["k"] * p["n"]
    return 0


def _check_measurement(m: dict, nbytes: int, flops: int, limits: dict) -> None:
    assert m["min_ms"] <= m["median_ms"] <= m["max_ms"]
    assert 1 <= m["samples"] <= 3
    seconds = m["median_ms"] / 1e3
    assert m["gbps"] == pytest.approx(nbytes / seconds / 1e9, rel=1e-9)
    assert m["gflops"] == pytest.approx(flops / seconds / 1e9, rel=1e-9)
    assert m["ratio_copy"] == pytest.approx(m["gbps"] / limits["copy"]["gbps"], rel=1e-9)
    if flops:
        assert m["ratio_blas"] == pytest.approx(m["gflops"] / limits["blas"]["gflops"], rel=1e-9)
    else:
        assert m["ratio_blas"] is None


def test_cli_quick_run_writes_a_report_with_the_documented_schema(cpu, tmp_path: Path, capsys) -> None:
    """hal bench --shape ... --quick --json: the table, and JSON whose figures follow from bytes and time."""
    path = tmp_path / "out" / "bench.json"
    argv = ["bench", "--quick", "--repeat", "3", "--max-time", "0.05", "--backend", "cpu", "--json", str(path), "-q"]
    for text in TINY:
        argv += ["--shape", text]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "after the cases): copy" in out and "W4A16 G64 M=3 256x64" in out and f"wrote {path}" in out
    report = json.loads(path.read_text())
    assert report["schema"] == bench.SCHEMA
    assert set(report) >= {"date", "git", "command", "machine", "backend", "versions", "settings", "limits", "cases"}
    assert report["command"][:2] == ["hal", "bench"]
    assert set(report["machine"]) >= {"cpu_model", "cores", "memory_bytes", "platform", "python"}
    assert report["machine"]["cores"] >= 1 and report["machine"]["memory_bytes"] > 0
    assert report["backend"]["name"] == "cpu" and report["backend"]["device"]["compute_units"] >= 1
    assert report["versions"]["hal-core"] == hal_core.__version__ and "numpy" in report["versions"]
    assert report["settings"]["repeat"] == 3 and report["settings"]["quick"] is True
    limits = report["limits"]
    for name, rate in (("copy", "gbps"), ("blas", "gflops")):  # the better of before and after
        measured = [limits["measured"][when][name][rate] for when in ("before", "after")]
        assert limits[name][rate] == max(measured)
        assert limits["measured"][limits[name]["when"]][name][rate] == limits[name][rate]
    assert limits["copy"]["gbps"] == pytest.approx(2 * limits["copy"]["bytes"] / (limits["copy"]["median_ms"] / 1e3)
                                                   / 1e9, rel=1e-9)
    n = limits["blas"]["n"]
    assert limits["blas"]["gflops"] == pytest.approx(2 * n**3 / (limits["blas"]["median_ms"] / 1e3) / 1e9, rel=1e-9)
    assert [c["op"] for c in report["cases"]] == ["paged_attention", "quantized_gemm", "quantized_gemm",
                                                  "write_kv_cache"]
    for entry, case in zip(report["cases"], _cases(), strict=True):
        assert entry["params"] == dict(case.params) and entry["label"] == case.label
        assert entry["bytes"] == _expected_bytes(case)
        assert entry["flops"] == _expected_flops(case)
        _check_measurement(entry["hal"], entry["bytes"], entry["flops"], limits)
        for peer in entry["peers"]:
            assert peer["status"] in ("ok", "missing", "failed")
            if peer["status"] == "ok":
                _check_measurement(peer, entry["bytes"], entry["flops"], limits)
                assert peer["hal_speedup"] == pytest.approx(peer["median_ms"] / entry["hal"]["median_ms"], rel=1e-9)
    gemm_peers = {p["name"] for p in report["cases"][1]["peers"]}
    assert "numpy fp32 BLAS (dequantised w)" in gemm_peers and "torch int4 (bf16 x)" in gemm_peers


def test_library_reports_a_missing_peer_and_keeps_going(cpu, monkeypatch) -> None:
    """With torch unimportable, torch peers are 'missing' with the reason; hal and numpy still run."""
    monkeypatch.setitem(sys.modules, "torch", None)
    report = bench.run_bench(_cases()[:2], cpu, QUICK)
    attention, gemm = report["cases"]
    (sdpa,) = attention["peers"]
    assert sdpa["status"] == "missing" and "torch is not installed" in sdpa["reason"]
    status = {p["name"]: p["status"] for p in gemm["peers"]}
    assert status == {"torch int4 (bf16 x)": "missing", "numpy fp32 BLAS (dequantised w)": "ok"}
    assert "median_ms" in attention["hal"] and "median_ms" in gemm["hal"]
    table = bench.format_table(report)
    assert "missing: torch is not installed" in table


def test_a_failing_peer_is_reported_not_raised(cpu, monkeypatch) -> None:
    def broken(inputs, xp):
        raise RuntimeError("peer exploded")

    peer = bench.Peer("broken peer", lambda case, host: True, broken)
    monkeypatch.setattr(_peers, "PEERS", (peer,))
    report = bench.run_bench(_cases()[3:], cpu, QUICK)
    (entry,) = report["cases"][0]["peers"]
    assert entry == {"name": "broken peer", "status": "failed", "reason": "RuntimeError: peer exploded"}
    assert "failed: RuntimeError: peer exploded" in bench.format_table(report)


def test_peers_none_runs_no_peer_and_budget_skips(cpu) -> None:
    settings = bench.BenchSettings(policy=QUICK.policy, quick=True, copy_bytes=1 << 20, blas_n=64, peers=(),
                                   budget_s=1e-9)
    report = bench.run_bench(_cases()[:2], cpu, settings)
    assert all("skipped" in c and "time budget" in c["skipped"] for c in report["cases"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--op", "quantized_gemm", "--shape", "M=1,K"], "argument --shape: expected KEY=VALUE"),
    (["--op", "quantized_gemm", "--shape", "M=one"], "argument --shape: M must be an integer"),
    (["--op", "quantized_gemm", "--shape", "M=1,Q=3"], "argument --shape: unknown key 'Q' for quantized_gemm"),
    (["--op", "quantized_gemm", "--shape", "bits=5"], "argument --shape: bits must be 4 or 8"),
    (["--op", "quantized_gemm", "--shape", "K=100,group=128"], "argument --shape: K=100 must be a multiple"),
    (["--op", "paged_attention", "--shape", "heads=6,kv_heads=4"], "argument --shape: kv_heads=4 must divide"),
    (["--op", "paged_attention", "--shape", "dtype=int8"], "argument --shape: dtype must be one of"),
    (["--op", "write_kv_cache", "--shape", "tokens=0"], "argument --shape: tokens must be a positive integer"),
    (["--shape", "M=1"], "argument --shape: 'M=1' needs exactly one --op"),
    (["--shape", "gemm:M=1"], "argument --op: unknown op 'gemm'"),
    (["--repeat", "0"], "argument --repeat: expected >= 1"),
], ids=["no-value", "not-int", "unknown-key", "bits", "group", "gqa", "dtype", "zero", "no-op", "bad-op", "repeat"])
def test_bad_arguments_give_a_clear_error_naming_the_flag(argv, message, capsys) -> None:
    """Bad shapes are refused before any measurement, exit status 2, the flag named."""
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert f"hal bench: error: {message}" in err


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["bench", "--quick", "--plot", str(tmp_path / "p.png"), "--op", "write_kv_cache"]) == 2
    assert "pip install 'hal-core[bench]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"hal-core\[bench\]"):
        bench.plot_report({"cases": []}, tmp_path / "p.png")


def test_plot_draws_a_file(cpu, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is the optional extra hal-core[bench]")
    report = bench.run_bench(_cases(), cpu, QUICK)
    path = bench.plot_report(report, tmp_path / "ratio.png")
    assert path.stat().st_size > 1000


def test_presets_hold_the_documented_shapes() -> None:
    """decode: GQA 32/8 d128 in fp16/bf16/fp32 at 8x512, 32x4096, 1x32k; gemm: W4A16, W4A8 and W8A8 (G128) at
    M = 1..64 in powers of two, 256 and 512 (W4A16 M = 1 and 16 in bf16 too)."""
    decode = bench.preset_cases("decode")
    for dtype in ("fp16", "bf16", "fp32"):
        for seqs, ctx in ((8, 512), (32, 4096), (1, 32768)):
            assert bench.make_case("paged_attention", seqs=seqs, ctx=ctx, dtype=dtype, heads=32, kv_heads=8,
                                   head=128) in decode
    assert any(c.op == "write_kv_cache" for c in decode)
    gemm = bench.preset_cases("gemm")
    for bits, abits in ((4, 16), (4, 8), (8, 16)):
        for k, n in ((4096, 11008), (11008, 4096)):
            for m in (1, 2, 4, 8, 16, 32, 64, 256, 512):
                assert bench.make_case("quantized_gemm", m=m, k=k, n=n, bits=bits, abits=abits, group=128) in gemm
            for m in (1, 16):
                assert (bench.make_case("quantized_gemm", m=m, k=k, n=n, bits=bits, abits=abits, group=128,
                                        dtype="bf16") in gemm) == ((bits, abits) == (4, 16))
    everything = bench.preset_cases("all")
    assert len(everything) == len(set(everything)) >= len(decode) + len(gemm)
    assert {c.op for c in bench.preset_cases("all", ["write_kv_cache"])} == {"write_kv_cache"}
    with pytest.raises(bench.BenchArgumentError, match="--preset"):
        bench.preset_cases("huge")


def test_shape_syntax_round_trips_and_accepts_k_suffix() -> None:
    case = bench.parse_shape("paged_attention", "seqs=1, ctx=32k, dtype=BF16")
    assert case.params["ctx"] == 32768 and case.params["dtype"] == "bf16"
    assert bench.parse_shape(case.op, case.shape_text) == case


def test_rotation_defeats_caches_within_bounds() -> None:
    """Inputs rotate until twice the LLC is covered; GEMM weights at least 3 deep; 1 with cached weights."""
    gemm, attention = bench.make_case("quantized_gemm"), bench.make_case("paged_attention")
    llc = 32 << 20
    assert bench.rotation(gemm, 24 << 20, llc, cached=False) == 3
    assert bench.rotation(gemm, 1 << 20, llc, cached=False) == 16
    assert bench.rotation(attention, 512 << 20, llc, cached=False) == 1
    assert bench.rotation(attention, 10 << 20, llc, cached=False) == 7
    assert bench.rotation(gemm, 24 << 20, llc, cached=True) == 1


def test_inputs_are_distinct_per_rotation_and_valid() -> None:
    """Each rotated input set is a fresh draw (distinct weights), and passes the op's validation."""
    from hal_core.ops import OPS

    rng = np.random.default_rng(3)
    case = bench.make_case("quantized_gemm", m=2, k=256, n=16)
    a, b = _inputs.build_inputs(case, rng), _inputs.build_inputs(case, rng)
    assert not np.array_equal(a["qweight"].qweight, b["qweight"].qweight)
    for c in _cases():
        args = _inputs.build_inputs(c, rng)
        OPS[c.op].validate(dict(args), np.asarray)


class _FakeClock:
    """A clock that advances ``step`` seconds per call of :meth:`fn`, which records its argument."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.calls = 0.0, step, []

    def __call__(self) -> float:
        return self.now

    def fn(self, i: int) -> None:
        self.calls.append(i)
        self.now += self.step


def test_timing_stops_at_the_time_cap_with_a_fake_clock() -> None:
    """measure() keeps min_repeat samples, then stops once max_seconds of timed runs have passed."""
    clock = _FakeClock(0.4)
    calls = clock.calls
    samples = bench.measure(clock.fn, bench.TimingPolicy(repeat=10, warmup=2, min_repeat=3, max_seconds=1.0),
                            clock=clock)
    assert samples.seconds == pytest.approx((0.4, 0.4, 0.4))
    assert calls == [0, 1, 2, 3, 4]
    assert samples.as_dict() == pytest.approx({"median_ms": 400.0, "min_ms": 400.0, "max_ms": 400.0, "samples": 3})


def test_warm_up_runs_for_warmup_seconds_before_timing() -> None:
    """Untimed calls continue past ``warmup`` until ``warmup_seconds`` have passed; a slow call needs only one."""
    clock = _FakeClock(0.4)
    calls = clock.calls
    policy = bench.TimingPolicy(repeat=2, warmup=1, min_repeat=2, max_seconds=10.0, warmup_seconds=1.0)
    samples = bench.measure(clock.fn, policy, clock=clock)
    assert calls == [0, 1, 2, 3, 4]  # three warm-up calls (0.4, 0.8, 1.2 s), then two timed ones
    assert samples.seconds == pytest.approx((0.4, 0.4))
    calls.clear()
    slow = bench.TimingPolicy(repeat=1, warmup=1, min_repeat=1, max_seconds=10.0, warmup_seconds=0.3)
    bench.measure(clock.fn, slow, clock=clock)
    assert calls == [0, 1]
    with pytest.raises(ValueError, match="--warmup-time"):
        bench.TimingPolicy(warmup_seconds=-1.0)


def test_a_very_slow_call_is_timed_fewer_times() -> None:
    """Once min_repeat * max_seconds have passed, measure() stops even below min_repeat samples."""
    clock = _FakeClock(2.0)
    samples = bench.measure(clock.fn, bench.TimingPolicy(repeat=10, warmup=1, min_repeat=3, max_seconds=1.0),
                            clock=clock)
    assert samples.seconds == pytest.approx((2.0, 2.0))


def test_unknown_backend_is_an_error_naming_the_flag(capsys) -> None:
    assert main(["bench", "--quick", "--backend", "no-such-backend", "--op", "write_kv_cache"]) == 2
    assert "hal bench: error: argument --backend:" in capsys.readouterr().err


def test_the_progress_bar_counts_every_step(cpu) -> None:
    """One step for the limits, one per case and one per peer; the bar ends full."""
    import io

    stream = io.StringIO()
    cases = _cases()
    total = bench.planned_steps(cases, True, ())
    bar = bench.Progress(total, stream=stream)
    settings = bench.BenchSettings(policy=QUICK.policy, quick=True, copy_bytes=1 << 20, blas_n=64, peers=())
    bench.run_bench(cases, cpu, settings, progress=bar)
    lines = stream.getvalue().splitlines()
    assert total == 2 + len(cases) and len(lines) == total
    assert lines[-1].startswith("[" + "#" * 24 + f"] {total}/{total}")


def test_rounds_pool_every_rounds_samples(cpu) -> None:
    """--rounds 3: each case measured three times, round-robin; its figures are from the pooled samples (the
    median of all of them), each round's median is kept, the progress bar counts every round's steps."""
    import io
    import statistics

    stream = io.StringIO()
    cases = _cases()
    total = bench.planned_steps(cases, True, (), 3)
    assert total == 2 + 3 * len(cases)
    settings = bench.BenchSettings(policy=QUICK.policy, quick=True, copy_bytes=1 << 20, blas_n=64, peers=(),
                                   rounds=3)
    report = bench.run_bench(cases, cpu, settings, progress=bench.Progress(total, stream=stream))
    assert len(stream.getvalue().splitlines()) == total and report["settings"]["rounds"] == 3
    for case in report["cases"]:
        hal = case["hal"]
        assert len(hal["round_medians_ms"]) == 3
        assert len(hal["times_ms"]) == hal["samples"] >= 3 * QUICK.policy.min_repeat
        assert hal["median_ms"] == pytest.approx(statistics.median(hal["times_ms"]))
        assert hal["gbps"] == pytest.approx(case["bytes"] / (hal["median_ms"] / 1e3) / 1e9)
    with pytest.raises(ValueError, match="--rounds"):
        bench.BenchSettings(rounds=0)


def test_rounds_pool_the_peers_too(cpu) -> None:
    """A peer measured in every round: its samples pooled and its speed ratio taken from the pooled medians."""
    case = bench.parse_shape("quantized_gemm", "M=2,K=128,N=32,bits=4,group=32")
    settings = bench.BenchSettings(policy=QUICK.policy, quick=True, copy_bytes=1 << 20, blas_n=64,
                                   peers=("numpy",), rounds=2)
    (result,) = bench.run_bench([case], cpu, settings)["cases"]
    (peer,) = result["peers"]
    assert peer["status"] == "ok" and len(peer["round_medians_ms"]) == 2
    assert peer["hal_speedup"] == pytest.approx(peer["median_ms"] / result["hal"]["median_ms"])


class _FakeDeviceArray:
    """Stands for a device array: its module, not numpy, is the backend's array library."""

    __module__ = "fake_device_xp"


def test_device_backends_measure_limits_and_peers_through_their_array_library(monkeypatch) -> None:
    """A non-numpy array library: copy via its copyto, fp32 and fp16 matmul (ratios use fp16), its matmul peer."""
    import types

    calls: list[str] = []

    def traced(name, fn):
        def run(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return run

    xp = types.ModuleType("fake_device_xp")
    for name in ("ones", "empty_like", "copyto", "asarray", "empty", "matmul"):
        setattr(xp, name, traced(name, getattr(np, name)))
    xp.float32 = np.float32
    monkeypatch.setitem(sys.modules, "fake_device_xp", xp)

    class Device:
        capabilities = hal_core.DeviceCapabilities(
            vendor="test", name="fake gpu", arch="fake", compute_units=4, simd_width=32, max_threads_per_block=1024,
            max_threads_per_cu=2048, max_block_dims=(1024, 1024, 64), max_grid_dims=(2**31 - 1, 65535, 65535),
            shared_mem_per_block=49152, shared_mem_per_block_optin=0, shared_mem_per_cu=65536,
            registers_per_block=65536, registers_per_cu=65536, l2_bytes=4 << 20, memory_total=2**30,
            dtypes=frozenset({"fp32", "fp16"}))

        def synchronize(self) -> None:
            calls.append("synchronize")

    class Backend:
        name = "fakegpu"

        def asarray(self, array, device=None):
            return _FakeDeviceArray()

    backend = Backend()
    assert bench.array_module(backend) is xp
    assert bench.last_level_cache_bytes(Device.capabilities) == 4 << 20
    from hal_core.bench import _runner

    limits = _runner._limits(backend, QUICK, Device().synchronize, 4 << 20, host=False)
    assert limits["copy"]["method"] == "fake_device_xp.copyto on the device"
    assert limits["blas"]["dtype"] == "fp16" and limits["blas_fp32"]["dtype"] == "fp32"
    assert {"copyto", "matmul", "synchronize"} <= set(calls)
    case = bench.parse_shape("quantized_gemm", "M=2,K=128,N=32,group=32")
    names = [p.name for p in bench.peers_for(case, host=False)]
    assert names == ["device matmul fp16 (unquantised w)", "device matmul bf16 (unquantised w)"]
    inputs = [_inputs.build_inputs(case, np.random.default_rng(5))]
    runner = bench.peers_for(case, host=False)[0].build(inputs, xp)
    result = runner(0)
    from hal_core.bench._peers import dequantize_float32

    expected = inputs[0]["x"].astype(np.float16) @ dequantize_float32(inputs[0]["qweight"]).astype(np.float16)
    np.testing.assert_array_equal(result, expected)


def test_the_float32_dequantisation_of_the_blas_peer_matches_the_reference() -> None:
    """The peer's weight equals QuantizedWeight.dequantize (float64) rounded to float32, zeros or not."""
    from hal_core.bench._peers import dequantize_float32
    from hal_core.quant import quantize

    rng = np.random.default_rng(11)
    print("seed 11")
    for bits in (4, 8):
        for symmetric in (True, False):
            qw = quantize(rng.standard_normal((128, 24)), bits=bits, group_size=32, symmetric=symmetric)
            np.testing.assert_allclose(dequantize_float32(qw), qw.dequantize(np.float64), rtol=1e-6, atol=1e-7)


def test_import_hal_core_and_an_op_call_import_no_bench_and_no_torch() -> None:
    """The bench library and torch stay out of an engine's process until hal bench is asked for."""
    import subprocess

    code = ("import sys, numpy as np, hal_core\n"
            "be = hal_core.get_backend('cpu')\n"
            "k = np.ones((4, 2, 8), np.float32); kc = np.zeros((4, 2, 4, 8), np.float32)\n"
            "be.ops.write_kv_cache(k, k, kc, kc.copy(), np.arange(4))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('hal_core.bench', 'torch', 'matplotlib'))))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_case_whose_inputs_cannot_be_built_is_reported(cpu, monkeypatch) -> None:
    """An exception outside the timed calls (here: building the inputs) marks that case, the others run."""
    from hal_core.bench import _runner

    real = _runner.build_inputs

    def build(case, rng):
        if case.op == "write_kv_cache":
            raise MemoryError("no room for the caches")
        return real(case, rng)

    monkeypatch.setattr(_runner, "build_inputs", build)
    report = bench.run_bench(_cases()[2:], cpu, bench.BenchSettings(policy=QUICK.policy, quick=True, peers=(),
                                                                    copy_bytes=1 << 20, blas_n=64))
    gemm, write = report["cases"]
    assert "median_ms" in gemm["hal"] and write["hal"] == {"error": "MemoryError: no room for the caches"}
    assert "error: MemoryError: no room for the caches" in bench.format_table(report)


def test_overhead_rows_time_the_door_the_bound_op_and_torch(cpu) -> None:
    """Every op with a tiny case gets a row: the kernel, the front door, the bound op and (with torch) the torch
    operator, each overhead the figure less the kernel; the table prints a bound column."""
    from hal_core.bench._overhead import format_overhead, measure_overhead
    from hal_core.ops import OPS

    rows = measure_overhead(cpu, batches=1, inner=2)
    assert {row["op"] for row in rows} == {op for op, spec in OPS.items() if spec.bench and spec.bench.tiny}
    for row in rows:
        assert row["kernel_us"] > 0 and row["front_door_us"] > 0 and row["bound_us"] > 0, row
        assert row["bound_overhead_us"] == pytest.approx(row["bound_us"] - row["kernel_us"])
        assert row["front_door_overhead_us"] == pytest.approx(row["front_door_us"] - row["kernel_us"])
    table = format_overhead(rows)
    assert "bound" in table.splitlines()[0] and all(row["op"] in table for row in rows)
