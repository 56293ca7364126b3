"""The static budget of the tensor-core kernels, read from their SASS (NVRTC cubin + nvdisasm; no GPU).

For every ``quant_gemm_tc.cu`` specialisation on sm_80, sm_90 and sm_120: no register spills, HMMA (W4A16) or
IMMA (W8A8, W4A8) instructions in the main loop, at least two CTAs per SM, and the int4 conversion (W4A16, W4A8)
within its instruction budget (``benchmarks/sass_budget.py`` documents the counting; docs/kernel-resources.md the
values).
Skipped, with the reason, without the NVRTC or nvdisasm wheels.
"""

from __future__ import annotations

import pytest
from sass_budgets import measure_all, sb

SPECS = sb.tensor_core_specs()
ARCHS = sb.DEFAULT_ARCHS


@pytest.fixture(scope="module")
def budgets():
    return measure_all("measure", SPECS, ARCHS, sb.KernelBudget)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_budget(budgets, spec, arch) -> None:
    b = budgets[(spec.id, arch)]
    defines = dict(spec.defines)
    bits, dtype = int(defines["HAL_QBITS"]), int(defines["HAL_DTYPE"])
    w4a8 = bits == 4 and defines.get("HAL_ABITS") == "8"
    hmma = bits == 4 and not w4a8
    assert b.spill_bytes == 0, f"{b.kernel} spills {b.spill_bytes} bytes on {arch}"
    assert b.mma_main_loop > 0, f"no {'HMMA' if hmma else 'IMMA'} in the main loop of {b.kernel} on {arch}"
    assert b.kblocks_per_iteration >= 1.0
    assert b.ctas_per_sm >= 2, f"{b.kernel}: {b.registers} registers, {b.static_shared_bytes} B shared"
    if w4a8:  # int4 codes straight into int8 bytes: no zero-point arithmetic in the loop
        assert b.conversion_per_2_weights <= sb.MAX_W4A8_CONVERSION_PER_2_WEIGHTS
        assert b.dequant_per_2_weights <= sb.MAX_W4A8_CONVERSION_PER_2_WEIGHTS
    elif bits == 4:
        assert b.conversion_per_2_weights <= sb.MAX_CONVERSION_PER_2_WEIGHTS[dtype]
        assert b.dequant_per_2_weights <= sb.MAX_DEQUANT_PER_2_WEIGHTS[dtype]


def test_parser_finds_loops_and_conversion() -> None:
    """The SASS reader on a hand-written listing: the MMA loop, not the other one, and the conversion opcodes."""
    listing = """
        .text.k:
        /*0000*/  MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/  IADD3 R2, R2, 0x1, RZ ;
        /*0020*/  @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0030*/  LOP3.LUT R5, R4, 0xf000f, R6, 0xea, !PT ;
        /*0040*/  SHF.R.U32.HI R4, RZ, 0x8, R4 ;
        /*0050*/  HADD2 R5, R5, -R7 ;
        /*0060*/  HADD2.F32 R8, -RZ, R9.H0_H0 ;
        /*0070*/  LOP3.LUT R10, R11, 0xfffffffc, RZ, 0xc0, !PT ;
        /*0080*/  HMMA.16816.F32 R12, R16, R20, R12 ;
        /*0090*/  @!P1 BRA `(.L_x_2) ;
        /*00a0*/  EXIT ;
    """
    insns, labels = sb.parse_sass(listing)["k"]
    body = sb.main_loop(insns, labels)
    assert [i.base for i in body] == ["LOP3", "SHF", "HADD2", "HADD2", "LOP3", "HMMA", "BRA"]
    assert sb.conversion_counts(body) == {"lop3": 1, "shift": 1, "half2": 1}
    assert sb.occupancy("sm_90", 64, 14848) == 8 and sb.occupancy("sm_90", 255, 0) == 2
