"""The translation units the runtime hands to CuPy: assembled from hal-cupy's package data, and compilable.

The compile check uses NVRTC without a GPU (cuda-bindings + nvidia-cuda-nvrtc)
with the options CuPy adds itself (``-ftz=true``, ``-std=c++17``,
``--device-as-default-execution-space``), one representative specialisation
per source and dtype for sm_90; ``test_nvrtc_compile.py`` covers the whole
catalogue on three architectures.
"""

from __future__ import annotations

import pytest
from hal_cuda import CUDA
from hal_cupy import GpuPlatform, Specialization, all_specializations, kernel_source
from hal_cupy._kernel_sources import assemble
from hal_cupy._specialization import DTYPE_CODES
from hal_cupy.ops import _fused_moe_rules as moe_rules
from hal_cupy.ops import _gated_activation_rules as ga_rules
from hal_cupy.ops import _paged_attention_rules as pa_rules
from hal_cupy.ops import _quantized_gemm_rules as qg_rules
from hal_cupy.ops import _rms_norm_rules as rn_rules
from hal_cupy.ops import _rotary_embedding_rules as rot_rules
from hal_cupy.ops import _write_kv_cache_rules as kv_rules
from hal_cupy.testing import missing_compiler
from hal_rocm import ROCM

CUPY_OPTIONS = ("-ftz=true", "-std=c++17", "--device-as-default-execution-space")

REPRESENTATIVE = [
    *(pa_rules.paged_attention_spec(dt, hs, g) for dt, hs, g in
      [("float16", 128, 4), ("bfloat16", 64, 1), ("float32", 256, 8), ("float16", 80, 2)]),
    kv_rules.write_kv_cache_spec(True), kv_rules.write_kv_cache_spec(False),
    *(qg_rules.quant_gemm_spec(dt, bits, mt) for dt, bits, mt in [("float16", 4, 1), ("bfloat16", 4, 16),
                                                                  ("float32", 8, 4)]),
    *(qg_rules.quant_util_spec(dt) for dt in DTYPE_CODES),
    qg_rules.quant_gemm_tc_spec("float16", 4, 1), qg_rules.quant_gemm_tc_spec("bfloat16", 8, 4),
    qg_rules.quant_gemm_tc_spec("float32", 4, 2, int8_activations=True),
    *(rn_rules.rms_norm_spec(dt) for dt in DTYPE_CODES),
    *(ga_rules.gated_activation_spec(dt) for dt in DTYPE_CODES),
    *(rot_rules.rotary_embedding_spec(dt, i64) for dt, i64 in [("float32", True), ("float16", False),
                                                               ("bfloat16", True)]),
    *(moe_rules.moe_spec(dt, bits) for dt, bits in [("float32", 4), ("float16", 8), ("bfloat16", 4),
                                                    ("bfloat16", 8)]),
]


def test_assemble_inlines_common_header_with_line_directives() -> None:
    """The include becomes the header's text between #line markers; '#pragma once' disappears."""
    body = 'line one\n#include "hal_common.cuh"\nline three'
    code = assemble(body, "x.cu", "#pragma once\nPRELUDE", {"hal_common.cuh": "#pragma once\nCOMMON"})
    assert "#include" not in code and "#pragma once" not in code
    assert code.split("\n") == ["", "PRELUDE", '#line 1 "x.cu"', "line one", '#line 1 "hal_common.cuh"', "",
                                "COMMON", '#line 3 "x.cu"', "line three"]


@pytest.mark.parametrize("spec", REPRESENTATIVE, ids=[s.id for s in REPRESENTATIVE])
def test_kernel_source_is_self_contained(spec: Specialization) -> None:
    """Every byte compiled is in the source text, so the digest (and CuPy's disk cache key) covers it."""
    source = kernel_source(spec, CUDA)
    assert '#include "' not in source.code
    assert "HAL_PRELUDE" in source.code and "hal_warp_sum" in source.code
    assert source.entry_points == spec.kernels and source.options == spec.options()
    assert kernel_source(spec, CUDA) is source  # cached


@pytest.mark.parametrize("platform", [CUDA, ROCM], ids=["cuda", "rocm"])
def test_every_translation_unit_is_self_contained(platform: GpuPlatform) -> None:
    """No specialisation of the catalogue, at either SIMD width, leaves an include of a kernel header behind:
    every header a kernel file includes is inlined (the compilers get no include path)."""
    for width in (32, 64):
        for spec in all_specializations(width):
            code = kernel_source(spec, platform).code
            assert '#include "' not in code, spec.id
            assert code.count(f'#line 1 "{spec.source}"') == 1, spec.id


@pytest.fixture(scope="module")
def nvrtc():
    from hal_cuda import _nvrtc

    try:
        _nvrtc.nvrtc_version()
    except _nvrtc.NvrtcUnavailable as exc:
        missing_compiler(f"NVRTC Python packages not installed (cuda-bindings, nvidia-cuda-nvrtc): {exc}")
    return _nvrtc


@pytest.mark.parametrize("spec", REPRESENTATIVE, ids=[s.id for s in REPRESENTATIVE])
def test_assembled_source_compiles(nvrtc, spec: Specialization) -> None:
    """The exact text the launcher compiles builds for sm_90 with CuPy's options, every entry point present."""
    source = kernel_source(spec, CUDA)
    result = nvrtc.compile_source(source.code, source.name, source.options + CUPY_OPTIONS, "sm_90")
    assert set(spec.kernels) <= set(result.kernels), result.log
    for name, res in result.kernels.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, f"{name} spills registers:\n{result.log}"
        assert res.shared_bytes <= 48 * 1024


def test_compile_errors_point_at_the_kernel_file(nvrtc) -> None:
    """#line directives make NVRTC name the original file and line."""
    source = kernel_source(kv_rules.write_kv_cache_spec(True), CUDA)
    lines = source.code.split("\n")
    target = next(i for i, line in enumerate(lines) if "const hal_i64 token = blockIdx.x;" in line)
    lines[target] += " undefined_identifier;"
    with pytest.raises(nvrtc.NvrtcError) as info:
        nvrtc.compile_source("\n".join(lines), source.name, source.options, "sm_90", resources=False)
    from importlib import resources

    text = resources.files("hal_cupy.kernels").joinpath("write_kv_cache.cu").read_text().split("\n")
    line_no = next(i for i, line in enumerate(text, 1) if "const hal_i64 token = blockIdx.x;" in line)
    assert f"write_kv_cache.cu({line_no})" in info.value.log
