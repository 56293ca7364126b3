"""The compiled library: loaded lazily, an ISA variant chosen at load time, forcing one by HAL_CPU_ISA."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hal_cpu import _abi, _native
from hal_cpu.ops import paged_attention

from hal_core.testing.inputs import paged_attention_inputs


def _python(code: str, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env}, check=True)
    return result.stdout.strip()


def test_a_variant_is_chosen(native: _native.Native) -> None:
    """The chosen variant is one this CPU runs, the best of them, and the baseline is always there."""
    assert native.isa in native.available
    assert native.available[0] == native.isa
    assert "baseline" in native.available
    assert native.threads >= 1


def test_import_loads_no_library() -> None:
    """Importing hal_core, hal_cpu and its ops loads no compiled library; the first op does."""
    code = ("import sys, hal_core, hal_cpu, hal_cpu.ops\n"
            "maps = lambda: open('/proc/self/maps').read()\n"
            "print('_kernels.so' in maps())\n"
            "from hal_cpu import _native; _native.load(); print('_kernels.so' in maps())")
    assert _python(code).split() == ["False", "True"]


def test_forcing_the_baseline_by_environment() -> None:
    """HAL_CPU_ISA=baseline selects the portable variant; a name no build has is an error naming the variable."""
    code = "from hal_cpu import _native; print(_native.load().isa)"
    assert _python(code, HAL_CPU_ISA="baseline") == "baseline"
    assert _python(code, HAL_CPU_ISA=" Baseline ") == "baseline"  # case and surrounding blanks ignored
    refused = ("from hal_core import EnvironmentVariableError\nfrom hal_cpu import _native\n"
               "try:\n    _native.load()\nexcept EnvironmentVariableError as exc:\n    print('refused', exc)\n")
    for typo in ("no-such-isa", "avx-512", "avx512f"):
        out = _python(refused, HAL_CPU_ISA=typo)
        assert out.startswith("refused") and "HAL_CPU_ISA" in out and typo in out, out


def test_a_known_variant_this_cpu_cannot_run_falls_back_to_the_best() -> None:
    """A variant name every build knows but this CPU lacks is logged and the best variant runs (not an error)."""
    code = "from hal_cpu import _native; n = _native.load(); print(n.isa, ','.join(n.available))"
    best, available = _python(code).split()
    missing = [name for name in _native.ISA_NAMES if name not in available.split(",")]
    if not missing:
        pytest.skip(f"this CPU runs every variant ({available}): none to force that it cannot run")
    assert _python(code, HAL_CPU_ISA=missing[0]).split()[0] == best


def test_every_variant_gives_the_same_attention(native: _native.Native, rng: np.random.Generator) -> None:
    """Every variant that runs here agrees with the others to float32 rounding (different FMA contraction)."""
    args = paged_attention_inputs(rng, seq_lens=[50, 3, 200], num_heads=8, num_kv_heads=2, head_size=128,
                                  block_size=16, dtype="fp16")
    results = {}
    try:
        for name in native.available:
            assert native.lib.hal_cpu_select_isa(name.encode()) == name.encode()
            results[name] = paged_attention.attend(args["query"], args["key_cache"], args["value_cache"],
                                                   args["block_tables"], args["seq_lens"], args["scale"],
                                                   out_dtype=np.float32)
    finally:
        native.lib.hal_cpu_select_isa(native.isa.encode())
    for name, got in results.items():
        np.testing.assert_allclose(got, results["baseline"], rtol=1e-5, atol=1e-6, err_msg=name)


def test_every_runnable_variant_can_be_forced(native: _native.Native) -> None:
    """HAL_CPU_ISA accepts each variant this CPU runs (avx512vnni included where the CPU has AVX512_VNNI)."""
    code = "from hal_cpu import _native; print(_native.load().isa)"
    for name in native.available:
        assert _python(code, HAL_CPU_ISA=name) == name


def test_vnni_variant_ranks_first_where_it_runs(native: _native.Native) -> None:
    """The byte-dot-product variant is preferred over plain AVX-512 whenever this CPU runs both."""
    if "avx512vnni" not in native.available:
        pytest.skip(f"this CPU or build has no avx512vnni variant (available: {', '.join(native.available)})")
    assert native.available.index("avx512vnni") < native.available.index("avx512")
    assert native.isa == "avx512vnni"


def _mirror(name: str, fields: list[tuple[str, Any]]) -> type[ctypes.Structure]:
    return type(f"Wrong_{name}", (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize("name", sorted(_abi.STRUCTS))
def test_every_struct_mirror_matches_and_a_wrong_one_is_refused(native: _native.Native, name: str) -> None:
    """Each kernel's argument struct: the real mirror matches the library's layout; a mirror missing a field, or
    with a field of another width, is refused with the rebuild message naming the struct and the field."""
    struct = _abi.STRUCTS[name]
    _native.check_abi(native.lib, {name: struct})
    fields = list(struct._fields_)
    dropped = fields[-2][0]
    widened = max(i for i, (_, kind) in enumerate(fields) if kind is ctypes.c_int32)
    wrong = {
        dropped: _mirror(name, [*fields[:-2], fields[-1]]),
        fields[widened][0]: _mirror(name, [*fields[:widened], (fields[widened][0], ctypes.c_int64),
                                           *fields[widened + 1:]]),
    }
    compiled = native.lib.hal_cpu_abi(name.encode()).decode()
    for field, mirror in wrong.items():
        with pytest.raises(_native.NativeUnavailable, match=rf"struct '{name}' differs.*rebuild with `pip install"):
            _native.check_abi(native.lib, {name: mirror})
        assert field in (_abi.mismatch(name, mirror, compiled) or ""), field


def test_every_kernel_takes_a_mirrored_struct() -> None:
    """Every kernel entry point taking a pointer takes a pointer to one of the mirrored structs, and every mirror
    is some kernel's argument; the library describes no struct it does not know."""
    pointers = {argtypes[0]._type_ for _, argtypes in _native._SIGNATURES.values()
                if len(argtypes) == 1 and issubclass(argtypes[0], ctypes._Pointer)}
    assert pointers == set(_abi.STRUCTS.values())
    assert _native.load().lib.hal_cpu_abi(b"no_such_struct") is None
