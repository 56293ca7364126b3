"""W4A8 on hal-cupy: where the int8 tensor-core GEMM is selected, what the backend declares, and the op end to end
over the kernel emulations (``kernel_emulator``), without host reads or synchronisation.

The kernels themselves are checked host-compiled in ``test_tc_int8_gemm_host.py`` and on a GPU by
``plugins/hal_cuda/tests/test_gpu_w4a8.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import kernel_emulator as emu
import numpy as np
import pytest
from hal_cupy.ops import _quantized_gemm as qg
from hal_cupy.ops import _quantized_gemm_rules as qg_rules
from kernel_emulator import NP, host, to_dev
from test_no_host_sync import gpu  # noqa: F401 (the counting GPU backend fixture)
from test_ops_emulated import backend  # noqa: F401 (the emulated H200 / MI300X backend fixture)

from hal_core.ops import OPS, OpCall, OpRegistry
from hal_core.quant import quantize


def _backend(levels: list[int]) -> Any:
    """A backend whose devices reach the warp matrix levels ``levels``, one per device."""
    devices = [SimpleNamespace(capabilities=SimpleNamespace(level=level)) for level in levels]
    platform = SimpleNamespace(warp_mma_level=lambda capabilities: capabilities.level)
    return SimpleNamespace(name="cuda", platform=platform, device=lambda i: devices[i], devices=lambda: devices)


def test_int8_activations_select_tensor_cores_at_every_dtype_and_m(monkeypatch: pytest.MonkeyPatch) -> None:
    """W4A8 and W8A8 take the int8 MMA for fp32/fp16/bf16 at any M from level 80; below it, or switched off, not."""
    tc = _backend([80])
    for dtype in ("fp32", "fp16", "bf16"):
        assert qg.uses_tensor_cores(tc, 0, dtype, 4, 1, True) and qg.uses_tensor_cores(tc, 0, dtype, 4, 4096, True)
        assert qg.uses_tensor_cores(tc, 0, dtype, 8, 4096)
    assert not qg.uses_tensor_cores(tc, 0, "fp32", 4, 1)  # W4A16 in fp32 stays off the tensor cores
    assert not qg.uses_tensor_cores(tc, 0, "fp16", 4, 0, True)
    assert not qg.uses_tensor_cores(_backend([75]), 0, "fp16", 4, 1, True)
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", "0")
    assert not qg.uses_tensor_cores(tc, 0, "fp16", 4, 1, True)


def test_w4a8_declared_only_where_every_device_has_the_int8_mma(monkeypatch: pytest.MonkeyPatch) -> None:
    """'w4a8' is in the coverage when every device reaches level 80 (tensor cores on), so 'auto' picks it there."""
    from hal_cupy.ops import register_ops

    assert qg.w4a8_everywhere(_backend([80, 90]))
    assert not qg.w4a8_everywhere(_backend([90, 75])) and not qg.w4a8_everywhere(_backend([]))
    for w4a8 in (True, False):
        registry = OpRegistry()
        register_ops(registry, "cuda", w4a8=w4a8)
        assert ("w4a8" in registry.coverage("quantized_gemm").allowed["schemes"]) == w4a8
    monkeypatch.setenv("HAL_CUDA_TENSOR_CORES", "0")
    assert not qg.w4a8_everywhere(_backend([90]))


def test_w4a8_specs_and_launch() -> None:
    """The W4A8 build: HAL_ABITS=8, every dtype, int8 x rows in shared memory, the hal_w4a8_gemm_tc entry point."""
    spec = qg_rules.quant_gemm_tc_spec("float32", 4, 2, int8_activations=True)
    assert dict(spec.defines)["HAL_ABITS"] == "8" and spec.kernels == ("hal_w4a8_gemm_tc", "hal_tc_reduce")
    assert "HAL_ABITS" not in dict(qg_rules.quant_gemm_tc_spec("float16", 4, 2).defines)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        qg_rules.quant_gemm_tc_spec("float32", 4, 1)
    assert qg_rules.quant_gemm_tc_shared_bytes(4, 4, int8_activations=True) < qg_rules.quant_gemm_tc_shared_bytes(4, 4)
    launch, _, _ = qg_rules.quant_gemm_tc_launch(4, 300, 256, 512, 64, 132, int8_activations=True)
    assert launch.kernel == "hal_w4a8_gemm_tc" and launch.grid[2] == 5  # 64-row chunks
    assert qg_rules.quant_util_launch("hal_w4a8_quantize_rows", 7, 132).grid == (7, 1, 1)


def _call(gpu_backend: Any, x: np.ndarray, qw: Any) -> OpCall:
    args = OPS["quantized_gemm"].map_arrays(dict(x=x, qweight=qw, activations="int8"), to_dev)
    OPS["quantized_gemm"].validate(args, host)
    return OpCall(spec=OPS["quantized_gemm"], args=args, backend=gpu_backend)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("m", [1, 70])
def test_w4a8_runs_on_the_int8_mma_or_falls_back(backend: Any, rng: np.random.Generator, dtype: str,  # noqa: F811
                                                 m: int) -> None:
    """H200 (level 90): the rows quantised on the device in the MMA's order, then hal_w4a8_gemm_tc, matching hal's
    W4A8 reference; MI300X (no int8 MMA): refused with the reason, so the call falls back, never a wrong answer."""
    from hal_cupy.ops import OPS as CUDA_OPS

    impl = next(o for o in CUDA_OPS if o.op == "quantized_gemm")
    qw = quantize(rng.standard_normal((512, 200)) * 0.1, bits=4, group_size=64, symmetric=False)
    x = rng.standard_normal((m, 512)).astype(NP[dtype])
    call = _call(backend, x, qw)
    verdict = impl.supports(call)
    if not backend.platform.mma_level:
        assert isinstance(verdict, str) and "W4A8" in verdict and "tensor-core" in verdict
        return
    assert verdict is True
    out = impl(call)
    assert emu.LAUNCHED[0] == "hal_w4a8_quantize_rows" and emu.LAUNCHED[1] == "hal_w4a8_gemm_tc"
    ref = OPS["quantized_gemm"].reference(dict(x=x, qweight=qw, activations="int8"))
    assert emu.rel_err(out, ref) < {"fp32": 1e-6, "fp16": 2e-3, "bf16": 1.5e-2}[dtype]
    w4a16 = OPS["quantized_gemm"].reference(dict(x=x, qweight=qw))
    assert emu.rel_err(out, w4a16) > 1e-4  # the activations really went through int8


def test_w4a8_auto_reads_nothing_back(gpu: Any, rng: np.random.Generator) -> None:  # noqa: F811
    """activations='auto' on the counting GPU (level 90, declares 'w4a8'): from 2 rows int8 on the tensor cores,
    quantised on the device -- nothing crosses to the host, nothing waits -- and the result is hal's W4A8."""
    assert "w4a8" in gpu.ops.coverage("quantized_gemm").allowed["schemes"]
    qw = quantize(rng.standard_normal((512, 128)).astype(np.float32) * 0.1, bits=4, group_size=64,
                  symmetric=False, scale_dtype=np.float16)
    x = rng.standard_normal((5, 512)).astype(np.float16)
    dev_w, dev_x = qw.map_arrays(to_dev), to_dev(x)
    gpu.ops.quantized_gemm(dev_x, dev_w, activations="auto")  # the first call packs the tensor-core layout
    emu.LAUNCHED.clear()
    with gpu.counter.window() as crossed:
        out = gpu.ops.quantized_gemm(dev_x, dev_w, activations="auto")
    assert crossed == []
    assert emu.LAUNCHED[:2] == ["hal_w4a8_quantize_rows", "hal_w4a8_gemm_tc"]
    assert gpu.ops.stats()["quantized_gemm"]["implementations"] == {"cuda.quantized_gemm": 2}
    ref = OPS["quantized_gemm"].reference(dict(x=x, qweight=qw, activations="int8"))
    assert emu.rel_err(out, ref, all_written=False) < 2e-3
