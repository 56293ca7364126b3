"""hal tune: a fake backend with two implementations and a knob; the store, its key, and dispatch using it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from halfakes import subprocess_env

import hal_core
from hal_core import bench, tuning
from hal_core.bench import make_case
from hal_core.cli import main
from hal_core.ops import OPS
from hal_core.tuning import Knob

#: Two write_kv_cache implementations: "heavy" (built-in first, by priority) repeats its scatter 200 times;
#: "lean" does it PASSES.value(call) times, whose built-in rule says 200. Each call appends a mark to the
#: marker file (H, or L<passes>) and adds its passes to COST, which a fake clock can read.
TUNABLE = '''
import numpy as np
from hal_core import API_VERSION, hookimpl
from hal_core.tuning import Knob
from halfakes import HostBackend, touch

COST = [0]


def _scatter(call, passes):
    COST[0] += passes
    kc, vc = call["key_cache"], call["value_cache"]
    slots = np.asarray(call["slot_mapping"]).astype(np.int64)
    keep = slots >= 0
    blocks, offsets = slots[keep] // kc.shape[2], slots[keep] % kc.shape[2]
    for _ in range(passes):
        kc[blocks, :, offsets] = call["key"][keep]
        vc[blocks, :, offsets] = call["value"][keep]


PASSES = Knob("passes", (1, 200), rule=lambda call: 200)


def lean(call):
    passes = PASSES.value(call)
    touch("{marker}", f"L{passes} ")
    _scatter(call, passes)


def heavy(call):
    touch("{marker}", "H ")
    _scatter(call, 200)


class TunableBackend(HostBackend):
    name = "tunable"
    priority = 50

    def register_ops(self, registry):
        registry.register("write_kv_cache", heavy, priority=10, name="tunable.heavy")
        registry.register("write_kv_cache", lean, priority=0, name="tunable.lean", knobs=(PASSES,))


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [TunableBackend]
'''

CASE = make_case("write_kv_cache", tokens=64, kv_heads=2, head=16, block=8, dtype="fp32")


@pytest.fixture(autouse=True)
def store(private_tune_store: Path) -> Path:
    """A private tune store for every test; no loaded table leaks between tests."""
    return private_tune_store


@pytest.fixture
def tunable(make_plugin):
    plugin = make_plugin("tunable", TUNABLE)
    return plugin, hal_core.get_backend("tunable")


def _inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    slots = rng.permutation(64 * 8)[:64]
    slots[::5] = -1
    return {"key": rng.standard_normal((64, 2, 16)).astype(np.float32),
            "value": rng.standard_normal((64, 2, 16)).astype(np.float32),
            "key_cache": np.zeros((64, 2, 8, 16), np.float32), "value_cache": np.zeros((64, 2, 8, 16), np.float32),
            "slot_mapping": slots.astype(np.int64)}


def _marks_of_one_call(plugin, backend) -> str:
    """Run one checked write_kv_cache call and return the marks it left (which implementation, which passes)."""
    if plugin.marker.exists():
        plugin.marker.unlink()
    args = _inputs(7)
    want_k, want_v = OPS["write_kv_cache"].reference(args)
    backend.ops.write_kv_cache(**args)
    np.testing.assert_array_equal(args["key_cache"], want_k)
    np.testing.assert_array_equal(args["value_cache"], want_v)
    return plugin.marker.read_text().strip()


def _fake_clock(module) -> object:
    """Seconds = passes of scatter done so far (a deterministic cost, no wall clock)."""
    return lambda: float(module.COST[0])


def test_tune_picks_the_cheaper_implementation_and_knob_value(tunable, store: Path) -> None:
    """With a clock that counts work, tune picks lean with passes=1; dispatch then runs exactly that."""
    plugin, backend = tunable
    assert _marks_of_one_call(plugin, backend) == "H"  # built-in: priority order
    module = sys.modules[plugin.module]
    report = bench.tune(backend, [CASE], clock=_fake_clock(module))
    decided = {(d.kind, d.name): d for d in report.decisions}
    assert decided["knob", "passes"].winner == 1 and decided["knob", "passes"].builtin == 200
    assert decided["impl", "implementation"].winner == "tunable.lean"
    assert decided["impl", "implementation"].builtin == "tunable.heavy"
    assert report.path is not None and report.path.parent == store
    assert _marks_of_one_call(plugin, backend) == "L1"


def test_tune_with_the_real_clock_finds_a_200x_difference(tunable) -> None:
    """Wall-clock timing tells a 200x difference in work apart (no threshold on the times themselves)."""
    plugin, backend = tunable
    report = bench.tune(backend, [CASE])
    assert {d.name: d.winner for d in report.decisions} == {"passes": 1, "implementation": "tunable.lean"}
    assert _marks_of_one_call(plugin, backend) == "L1"


def test_persisted_winners_load_in_a_new_process(tunable, store: Path) -> None:
    """A fresh interpreter reads the store file and dispatches to the tuned choice with the tuned knob."""
    plugin, backend = tunable
    bench.tune(backend, [CASE], clock=_fake_clock(sys.modules[plugin.module]))
    plugin.marker.unlink()
    code = (
        "import numpy as np, hal_core\n"
        "be = hal_core.get_backend('tunable')\n"
        "k = np.ones((64, 2, 16), np.float32)\n"
        "kc = np.zeros((64, 2, 8, 16), np.float32); vc = kc.copy()\n"
        "be.ops.write_kv_cache(k, k, kc, vc, np.arange(64, dtype=np.int64))\n"
        "assert (kc.reshape(64, 2, 8, 16).transpose(0, 2, 1, 3).reshape(-1, 2, 16)[:64] == 1).all()\n"
    )
    env = subprocess_env(plugin.site) | {"HAL_TUNE_DIR": str(store)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert plugin.marker.read_text().strip() == "L1"


def test_the_file_is_ignored_when_the_device_capabilities_differ(tunable, monkeypatch) -> None:
    """Another compute-unit count is another key: the built-in order applies again."""
    plugin, backend = tunable
    bench.tune(backend, [CASE], clock=_fake_clock(sys.modules[plugin.module]))
    import halfakes

    monkeypatch.setattr(halfakes, "FAKE_CAPS", halfakes.FAKE_CAPS.model_copy(update={"compute_units": 64}))
    tuning.forget()
    assert _marks_of_one_call(plugin, backend) == "H"


def test_the_file_is_ignored_when_the_hal_version_differs(tunable, monkeypatch) -> None:
    """A table written by another hal version does not apply."""
    plugin, backend = tunable
    bench.tune(backend, [CASE], clock=_fake_clock(sys.modules[plugin.module]))
    monkeypatch.setattr("hal_core._version.__version__", "999.0.0")
    tuning.forget()
    assert _marks_of_one_call(plugin, backend) == "H"


def test_a_foreign_file_under_the_right_name_is_ignored_with_a_warning(tunable, caplog) -> None:
    """A file whose recorded key is not this device's is logged and ignored (never trusted by its name)."""
    plugin, backend = tunable
    report = bench.tune(backend, [CASE], clock=_fake_clock(sys.modules[plugin.module]))
    data = json.loads(report.path.read_text())
    data["key"]["arch"] = "another-arch"
    report.path.write_text(json.dumps(data))
    tuning.forget()
    with caplog.at_level(logging.WARNING, logger="hal"):
        assert _marks_of_one_call(plugin, backend) == "H"
    assert "another device or hal version" in caplog.text


@pytest.mark.parametrize("text", ["{not json", "", '{"schema": "hal-tune/1", "key": 3}', "[1, 2]",
                                  '{"schema": "hal-tune/1", "key": {}, "choices": {"write_kv_cache": 5}}'],
                         ids=["broken", "empty", "bad-key", "list", "bad-choices"])
def test_a_corrupt_file_is_ignored_then_replaced_by_tune(tunable, caplog, text: str) -> None:
    """A corrupt file never crashes a call (warning logged); the next tune writes a good one over it."""
    plugin, backend = tunable
    path = tuning.table_path(tuning.key_for(backend))
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="hal"):
        assert _marks_of_one_call(plugin, backend) == "H"
    assert "ignoring tune file" in caplog.text
    bench.tune(backend, [CASE], clock=_fake_clock(sys.modules[plugin.module]))
    assert json.loads(path.read_text())["choices"]["write_kv_cache"]
    assert _marks_of_one_call(plugin, backend) == "L1"


def test_hal_tune_0_ignores_the_store(tunable, monkeypatch) -> None:
    plugin, backend = tunable
    bench.tune(backend, [CASE], clock=_fake_clock(sys.modules[plugin.module]))
    monkeypatch.setenv("HAL_TUNE", "0")
    tuning.forget()
    assert _marks_of_one_call(plugin, backend) == "H"


def test_writes_are_atomic_and_leave_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    """A failing rename leaves the old file whole and removes the temporary file."""
    key = {"backend": "x", "hal_version": "1"}
    table = tuning.TuneTable(key=key, choices={"quantized_gemm": {"w4:m1": "a"}})
    path = tuning.save_table(table, tmp_path)
    before = path.read_text()
    table.choices["quantized_gemm"]["w4:m1"] = "b"

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        tuning.save_table(table, tmp_path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_the_store_is_bounded(tmp_path: Path) -> None:
    """At most MAX_BUCKETS buckets per op are kept, and at most MAX_FILES files in the folder."""
    from hal_core.tuning import _store

    for i in range(_store.MAX_FILES + 5):
        (tmp_path / f"old-{i}.json").write_text("{}")
    many = {f"w4:m{i}": "a" for i in range(_store.MAX_BUCKETS + 40)}
    path = tuning.save_table(tuning.TuneTable(key={"backend": "x"}, choices={"quantized_gemm": many}), tmp_path)
    assert len(json.loads(path.read_text())["choices"]["quantized_gemm"]) == _store.MAX_BUCKETS
    assert len(list(tmp_path.glob("*.json"))) == _store.MAX_FILES
    assert path.exists()


def test_store_folder_defaults(monkeypatch, tmp_path: Path) -> None:
    """HAL_TUNE_DIR, else $XDG_CACHE_HOME/hal/tuning, else ~/.cache/hal/tuning."""
    monkeypatch.setenv("HAL_TUNE_DIR", str(tmp_path / "explicit"))
    assert tuning.tune_dir() == tmp_path / "explicit"
    monkeypatch.delenv("HAL_TUNE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.tune_dir() == tmp_path / "xdg" / "hal" / "tuning"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.tune_dir() == tmp_path / "home" / ".cache" / "hal" / "tuning"


def test_buckets() -> None:
    """Powers of two of M (GEMM), of batch and context (attention), of tokens (write_kv_cache)."""
    from hal_core.quant import quantize

    assert [tuning.pow2(n) for n in (0, 1, 2, 3, 16, 17, 4096)] == [1, 1, 2, 4, 16, 32, 4096]
    qw = quantize(np.ones((64, 8)), bits=4, group_size=32)
    assert OPS["quantized_gemm"].bucket({"x": np.zeros((12, 64)), "qweight": qw}) == "w4:m16"
    args = {"query": np.zeros((3, 4, 8), np.float16), "key_cache": np.zeros((9, 2, 16, 8), np.float16),
            "block_tables": np.zeros((3, 40), np.int32), "seq_lens": np.array([100, 300, 7], np.int32)}
    assert OPS["paged_attention"].bucket(args) == "fp16:b4:ctx512"
    assert OPS["write_kv_cache"].bucket({"key": np.zeros((33, 2, 8), np.float32)}) == "fp32:t64"


def test_knob_declarations_are_checked() -> None:
    with pytest.raises(ValueError, match="candidates must not be empty"):
        Knob("size", (), rule=lambda call: 1)
    with pytest.raises(ValueError, match="distinct"):
        Knob("size", (1, 1), rule=lambda call: 1)
    with pytest.raises(ValueError, match="identifier"):
        Knob("no spaces", (1, 2), rule=lambda call: 1)
    registry = hal_core.ops.OpRegistry()
    knob = Knob("size", (1, 2), rule=lambda call: 1)
    with pytest.raises(ValueError, match="knob names must be distinct"):
        registry.register("quantized_gemm", lambda call: None, knobs=(knob, knob))


def test_cli_tune_show_clear_and_info(tunable, store: Path, capsys) -> None:
    """hal tune persists and prints; --show lists the file; hal info says tuned; --clear removes it."""
    del tunable  # installed and bound; the commands find it by name
    assert main(["tune", "--backend", "tunable", "--shape", CASE.shape_text, "--op", "write_kv_cache",
                 "--quick", "-q"]) == 0
    out = capsys.readouterr().out
    assert "implementation = tunable.lean" in out and "passes = 1" in out and str(store) in out
    assert main(["tune", "--show", "--backend", "tunable"]) == 0
    shown = capsys.readouterr().out
    assert "(this device)" in shown and "passes = 1" in shown
    info = hal_core.cli.collect_info()
    assert info["tuning"]["store"] == str(store)
    assert info["tuning"]["backends"]["tunable"]["write_kv_cache"]["decided_by"] == "tuned"
    assert main(["info"]) == 0
    assert "write_kv_cache" in capsys.readouterr().out
    assert main(["tune", "--clear", "--backend", "tunable"]) == 0
    assert "removed 1 tune file" in capsys.readouterr().out
    assert list(store.glob("*.json")) == []
    assert hal_core.cli.collect_info()["tuning"]["backends"]["tunable"]["write_kv_cache"]["decided_by"] == "built-in"


def test_cli_tune_on_a_backend_with_nothing_tunable(make_plugin, capsys) -> None:
    """A backend with one implementation per op and no knobs: tune says so and writes nothing."""
    make_plugin("plain")
    assert main(["tune", "--backend", "plain", "--quick", "-q"]) == 0
    assert "nothing to tune" in capsys.readouterr().out
    assert tuning.list_tables() == []


def test_a_backend_that_is_neither_hashable_nor_weakly_referable_still_gets_its_table(store: Path) -> None:
    """The loaded tables are keyed by identity: __eq__ without __hash__, or __slots__, are fine."""
    from halfakes import FAKE_CAPS

    class Device:
        capabilities = FAKE_CAPS

    class Odd:
        __slots__ = ()
        name = "odd"

        def __eq__(self, other: object) -> bool:
            return True

        def device(self, index: int = 0) -> Device:
            return Device()

    backend = Odd()
    key = tuning.key_for(backend)
    tuning.save_table(tuning.TuneTable(key=key, choices={"quantized_gemm": {"w4:m1": "x"}}))
    table = tuning.table_for(backend)
    assert table is not None and table.choices == {"quantized_gemm": {"w4:m1": "x"}}
    assert tuning.table_for(backend) is table  # from memory the second time
    assert tuning.source(backend, "quantized_gemm") == {"tuned": True, "choices": 1, "knobs": {}}


def test_without_a_file_of_the_backend_the_device_key_is_never_built(store: Path) -> None:
    """No file of this backend in the store: no table, and the capabilities (maybe a driver query) stay unasked.

    A file of another backend does not count; once one of this backend is written, it is found.
    """
    from halfakes import FAKE_CAPS

    asked: list[int] = []

    class Device:
        @property
        def capabilities(self) -> object:
            asked.append(1)
            return FAKE_CAPS

    class Lazy:
        name = "lazy"

        def device(self, index: int = 0) -> Device:
            return Device()

    backend = Lazy()
    assert tuning.table_for(backend) is None and asked == []  # no store folder at all
    other = dict(tuning.key_for(backend), backend="other")
    tuning.save_table(tuning.TuneTable(key=other, choices={"quantized_gemm": {"w4:m1": "x"}}))
    asked.clear()
    tuning.forget()
    assert tuning.table_for(backend) is None and asked == []  # only another backend's file
    tuning.save_table(tuning.TuneTable(key=tuning.key_for(backend), choices={"quantized_gemm": {"w4:m1": "y"}}))
    tuning.forget()
    table = tuning.table_for(backend)
    assert table is not None and table.choices == {"quantized_gemm": {"w4:m1": "y"}}


def test_tune_raises_a_configuration_error_from_supports_instead_of_skipping_the_candidate() -> None:
    """A supports() that reads a malformed HAL_* setting stops hal tune with that error; other raises mean "no"."""
    from types import SimpleNamespace

    from hal_core import EnvironmentVariableError
    from hal_core.bench._tuner import _supported

    def bad_setting(call: object) -> bool:
        raise EnvironmentVariableError("HAL_EXAMPLE", "abc", "an integer")

    def bug(call: object) -> bool:
        raise RuntimeError("a plugin bug")

    fine = SimpleNamespace(supports=lambda call: True)
    assert _supported([SimpleNamespace(supports=bug), fine], call=None) == [fine]
    with pytest.raises(EnvironmentVariableError, match="HAL_EXAMPLE"):
        _supported([fine, SimpleNamespace(supports=bad_setting)], call=None)
