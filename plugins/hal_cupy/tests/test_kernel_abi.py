"""The kernels' parameter lists: one declaration (``hal_cupy._kernel_params``), the sources checked against it at
load, the host's argument tuples filled from it by name, and the README's parameter tables matching it."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hal_cuda import CUDA
from hal_cupy import all_specializations, kernel_source
from hal_cupy._kernel_abi import check_source, fields, signatures
from hal_cupy._kernel_params import KERNEL_PARAMS, PA_SHARED, pack
from hal_cupy._kernel_params import check_source as check_declared
from hal_cupy._kernel_sources import translation_unit
from hal_cupy._specialization import Specialization
from hal_rocm import ROCM

from hal_core import KernelCompileError

README = Path(__file__).resolve().parents[1] / "src" / "hal_cupy" / "kernels" / "README.md"


def _specs() -> list[Specialization]:
    seen: dict[str, Specialization] = {}
    for width in (32, 64):
        for spec in all_specializations(width):
            seen.setdefault(spec.id, spec)
    return list(seen.values())


def test_every_specialisation_matches_its_declaration() -> None:
    """Every entry point of every specialisation (both widths) is declared, and each of its definitions in the
    translation unit -- both builds of a kernel defined under #if -- has exactly the declared parameters."""
    launched: set[str] = set()
    for spec in _specs():
        check_declared(spec.source, translation_unit(spec.source, ""), spec.kernels)
        launched.update(spec.kernels)
    assert launched == set(KERNEL_PARAMS), "a declaration without a kernel, or a kernel without one"


def test_vendor_translation_units_are_checked_at_load() -> None:
    """kernel_source (what the runtime compiler, warm-up and compile checks load) passes with both vendors'
    preludes, and the shared attention parameters are the macro's expansion."""
    spec = next(s for s in _specs() if s.source == "paged_attention.cu")
    for platform in (CUDA, ROCM):
        code = kernel_source(spec, platform).code
        found = signatures(code)["hal_paged_attention_split"]
        assert found == [KERNEL_PARAMS["hal_paged_attention_split"]]
        assert found[0][3:3 + len(PA_SHARED)] == PA_SHARED


@pytest.mark.parametrize("edit", ["rename", "retype", "drop", "add"])
def test_a_stale_declaration_is_refused(edit: str) -> None:
    """A declaration edited away from the source (a field renamed, retyped, dropped or added) is refused at load,
    naming the kernel, the field and both layouts."""
    params = list(KERNEL_PARAMS["hal_write_kv_cache"])
    if edit == "rename":
        params[6] = ("block_tokens", "int")
    elif edit == "retype":
        params[6] = ("block_size", "hal_i64")
    elif edit == "drop":
        del params[6]
    else:
        params.append(("threads", "int"))
    stale = {**KERNEL_PARAMS, "hal_write_kv_cache": tuple(params)}
    code = translation_unit("write_kv_cache.cu", "")
    with pytest.raises(KernelCompileError) as info:
        check_source("write_kv_cache.cu", code, ("hal_write_kv_cache",), stale)
    message = str(info.value)
    assert "'hal_write_kv_cache'" in message and "write_kv_cache.cu" in message
    assert ("parameter 6" if edit != "add" else "parameter 10 'int threads' is declared") in message
    assert "declared: " in message and "source:   " in message and "int block_size" in message


def test_an_edited_source_signature_is_refused() -> None:
    """A kernel source whose signature no longer matches (an int parameter made 64-bit; the shared attention macro
    reordered) is refused with the field named, before anything is compiled."""
    code = translation_unit("write_kv_cache.cu", "")
    edited = code.replace("int row_bytes, int num_blocks", "int row_bytes, hal_i64 num_blocks")
    assert edited != code
    with pytest.raises(KernelCompileError, match=r"parameter 8: declared 'int num_blocks', the source has "
                                                 r"'hal_i64 num_blocks'"):
        check_declared("write_kv_cache.cu", edited, ("hal_write_kv_cache",))
    code = translation_unit("paged_attention.cu", "")
    edited = code.replace("float scale, float softcap,", "float softcap, float scale,")
    assert edited != code
    with pytest.raises(KernelCompileError, match=r"'hal_paged_attention'.*parameter 9: declared 'float scale'"):
        check_declared("paged_attention.cu", edited, ("hal_paged_attention",))


def test_every_conditional_definition_is_checked() -> None:
    """A kernel defined twice under #if / #else is checked in both branches; an undeclared or undefined entry point
    is refused."""
    source = ("HAL_GLOBAL void HAL_LAUNCH_BOUNDS(128)\n#if A\nhal_k(int n, float* HAL_RESTRICT y) {}\n#else\n"
              "hal_k(int n, float *y, int extra) {}\n#endif\n")
    declared = {"hal_k": fields(("n", "int"), ("y", "float*"))}
    assert signatures(source)["hal_k"][0] == declared["hal_k"]
    with pytest.raises(KernelCompileError, match="parameter 2 'int extra' is in the source only"):
        check_source("k.cu", source, ("hal_k",), declared)
    with pytest.raises(KernelCompileError, match="'hal_other' has no declared parameter list"):
        check_source("k.cu", source, ("hal_other",), declared)
    with pytest.raises(KernelCompileError, match="'hal_j' is not defined"):
        check_source("k.cu", source, ("hal_j",), {**declared, "hal_j": declared["hal_k"]})


def test_pack_fills_by_name_in_declared_types() -> None:
    """Arguments are placed by name in the declared order, scalars converted to the declared C types, None a null
    pointer; a missing or unknown name, an out-of-range integer, a bool, a wrong element size are refused."""
    key = np.zeros((2, 1, 8), np.float16)
    flag = np.zeros(1, np.int32)
    slots = np.zeros(2, np.int64)
    values = dict(error_flag=flag, num_blocks=7, row_bytes=np.int64(16), block_size=16, num_kv_heads=1,
                  slot_mapping=slots, value_cache=key, key_cache=key, value=key, key=key)
    args = pack("hal_write_kv_cache", values)
    assert [type(a) for a in args[5:9]] == [np.int32] * 4 and args[9] is flag and args[4] is slots
    assert [int(a) for a in args[5:9]] == [1, 16, 16, 7]
    tc = pack("hal_tc_reduce", dict(out=None, ws=np.zeros(4, np.float32), count=2**40, splits=3))
    assert tc[0] is None and type(tc[2]) is np.int64 and int(tc[2]) == 2**40 and type(tc[3]) is np.int32
    norm = pack("hal_rms_norm", dict(out=key, x=key, weight=key, residual=None, x_stride=8, residual_stride=0,
                                     hidden_size=8, epsilon=1e-6, weight_offset=0))
    assert type(norm[7]) is np.float32 and type(norm[8]) is np.float32 and norm[3] is None
    with pytest.raises(TypeError, match=r"missing \['error_flag'\], unknown \['flag'\]"):
        pack("hal_write_kv_cache", {**{k: v for k, v in values.items() if k != "error_flag"}, "flag": flag})
    with pytest.raises(OverflowError, match="'num_blocks' = 2147483648 does not fit int"):
        pack("hal_write_kv_cache", {**values, "num_blocks": 2**31})
    with pytest.raises(TypeError, match="'block_size' \\(int\\) takes an integer, got bool"):
        pack("hal_write_kv_cache", {**values, "block_size": True})
    with pytest.raises(TypeError, match="'error_flag' \\(int\\*\\) takes 4-byte elements, got int64"):
        pack("hal_write_kv_cache", {**values, "error_flag": np.zeros(1, np.int64)})
    with pytest.raises(TypeError, match="'key' \\(const void\\*\\) takes an array or None, got int"):
        pack("hal_write_kv_cache", {**values, "key": 0})
    with pytest.raises(KeyError, match="'hal_nothing' has no declared parameter list"):
        pack("hal_nothing", {})


def _readme_tables() -> dict[str, list[tuple[list[int], list[str]]]]:
    """``{kernel: [(indices, names), ...]}`` from the README's ``| # | parameter |`` tables (the shared attention
    parameters' table under ``PA_SHARED``); ranges such as ``17-19`` (an en dash in the file) list their names in
    order."""
    tables: dict[str, list[tuple[list[int], list[str]]]] = {}
    kernel = None
    in_table = False
    for line in README.read_text().splitlines():
        heading = re.match(r"#{2,3} `?(\w+)", line)
        if heading:
            kernel = heading.group(1) if line.startswith("### `") else None
        if line.startswith("Shared parameters (`P`"):
            kernel = "PA_SHARED"
        if line.startswith("| # | parameter |"):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        span = re.fullmatch(r"(\d+)(?:[\u2013-](\d+))?", cells[0])
        if in_table and kernel is not None and span:
            first, last = int(span.group(1)), int(span.group(2) or span.group(1))
            names = re.findall(r"`(\w+)`", cells[1])
            tables.setdefault(kernel, []).append((list(range(first, last + 1)), names))
    return tables


def test_readme_parameter_tables_match_the_declarations() -> None:
    """Every numbered parameter row of kernels/README.md names the declared parameter at that position (a row of
    a range names each of them), and a kernel's table lists every parameter once."""
    tables = _readme_tables()
    declared = {**KERNEL_PARAMS, "PA_SHARED": PA_SHARED}
    assert {"PA_SHARED", "hal_write_kv_cache", "hal_paged_attention_tc", "hal_sample"} <= set(tables)
    for kernel, rows in tables.items():
        params = declared[kernel]
        assert sorted(i for indices, _ in rows for i in indices) == list(range(len(params))), f"{kernel}: rows"
        for indices, names in rows:
            if names == ["P"]:  # the shared parameters, at their place
                assert [n for n, _ in params[indices[0]:indices[-1] + 1]] == [n for n, _ in PA_SHARED], kernel
                continue
            assert names == [params[i][0] for i in indices], f"{kernel}: row {indices} names {names}"


def _readme_prose_lists() -> dict[str, list[str]]:
    """``{kernel: names}`` from the README's ``Parameters: `a`, `b`, ...`` paragraphs (a backticked word in
    order; ``P`` stands for the shared attention parameters; ``Parameters as `kernel``` names that kernel)."""
    lists: dict[str, list[str]] = {}
    kernel = None
    for paragraph in README.read_text().split("\n\n"):
        heading = re.match(r"#{2,3} `?(\w+)", paragraph)
        if heading:
            kernel = heading.group(1) if paragraph.startswith("### `") else None
        found = re.search(r"Parameters(?::| as) (.*)", paragraph, re.S)
        if kernel is not None and found and not paragraph.startswith("|"):
            lists[kernel] = re.findall(r"`(\w+)`", found.group(1))
    return lists


def test_readme_parameter_paragraphs_match_the_declarations() -> None:
    """The kernels the README describes in a ``Parameters:`` paragraph list the declared names in order (the
    shared attention parameters as ``P``); a ``Parameters as `other``` kernel has the other's names."""
    lists = _readme_prose_lists()
    assert {"hal_paged_attention", "hal_paged_attention_split", "hal_w8a8_gemm_tc", "hal_w8_dequant"} <= set(lists)
    shared = [n for n, _ in PA_SHARED]
    for kernel, names in lists.items():
        declared = [n for n, _ in KERNEL_PARAMS[kernel]]
        if names and names[0] in KERNEL_PARAMS:  # "Parameters as `other` ..."
            assert declared == [n for n, _ in KERNEL_PARAMS[names[0]]], kernel
            continue
        expanded = [x for n in names for x in (shared if n == "P" else [n])]
        assert expanded == declared, f"{kernel}: the README lists {expanded}"
