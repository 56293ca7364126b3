"""hal info --stats and --explain: what ran in this process, and which implementation would run and why."""

from __future__ import annotations

import json

import numpy as np

import hal_core
from hal_core.cli import main
from hal_core.quant import quantize

PICKY = '''
import numpy as np

from hal_core import API_VERSION, hookimpl
from halfakes import HostBackend


def gemm(call):
    x, qweight = call["x"], call["qweight"]
    return (x.astype(np.float32) @ qweight.dequantize(np.float32)).astype(x.dtype)


def only_small(call):
    return True if call["x"].shape[0] <= 4 else "M above 4 is not handled"


def only_fp32(call):
    return True if call["x"].dtype == np.float32 else f"dtype {call['x'].dtype} is not handled"


class PickyBackend(HostBackend):
    name = "picky"
    priority = 6

    def register_ops(self, registry):
        registry.register("quantized_gemm", gemm, name="picky.small", priority=2, supports=only_small)
        registry.register("quantized_gemm", gemm, name="picky.fp32", priority=1, supports=only_fp32)


@hookimpl
def hal_api_version():
    return API_VERSION


@hookimpl
def hal_backends():
    return [PickyBackend]
'''


def test_info_stats_reports_what_ran_in_this_process(make_plugin, only_cpu_real, cpu, capsys) -> None:
    """After calls in this process, `hal info --stats` lists calls, implementations and fallback reasons."""
    make_plugin("picky", PICKY)
    only_cpu_real()
    backend = hal_core.get_backend("picky")
    rng = np.random.default_rng(11)
    qw = quantize(rng.standard_normal((64, 8)) / 8, group_size=32)
    backend.ops.quantized_gemm(rng.standard_normal((2, 64)).astype(np.float16), qw)  # picky.small
    backend.ops.quantized_gemm(rng.standard_normal((8, 64)).astype(np.float16), qw)  # falls back
    assert main(["info", "--stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]["picky"]["quantized_gemm"]
    assert stats["calls"] == 2
    assert stats["implementations"] == {"picky.small": 1, "fallback:cpu": 1}
    (reason,) = stats["fallbacks"]
    assert "picky.small: M above 4 is not handled" in reason and "picky.fp32: dtype float16" in reason
    assert main(["info", "--stats"]) == 0
    text = capsys.readouterr().out
    assert "picky.quantized_gemm: 2 calls" in text and "M above 4 is not handled" in text


def test_info_explain_names_the_implementation_and_why_others_were_passed_over(make_plugin, only_cpu_real, cpu,
                                                                                capsys) -> None:
    """`hal info --explain --shape ...`: each candidate's verdict for the given case, nothing launched."""
    make_plugin("picky", PICKY)
    only_cpu_real()
    code = main(["info", "--json", "--backend", "picky",
                 "--shape", "quantized_gemm:m=8,k=128,n=16,bits=4,group_size=32,dtype=fp32",
                 "--shape", "quantized_gemm:m=2,k=128,n=16,bits=4,group_size=32,dtype=fp16",
                 "--shape", "quantized_gemm:m=8,k=128,n=16,bits=4,group_size=32,dtype=fp16"])
    assert code == 0
    cases = json.loads(capsys.readouterr().out)["explain"]["cases"]
    verdicts = [{c["implementation"]: c["verdict"] for c in case["candidates"]} for case in cases]
    assert verdicts[0] == {"picky.small": "M above 4 is not handled", "picky.fp32": "runs"}
    assert verdicts[1]["picky.small"] == "runs" and verdicts[1]["picky.fp32"].startswith("not tried")
    assert verdicts[2]["fallback"] == "runs on backend 'cpu'"
    assert hal_core.stats() == {}, "explaining ran an op"


def test_info_explain_default_cases_cover_every_op(capsys, cpu) -> None:
    """Without --shape, every op is explained on its representative cases."""
    from hal_core.ops import OPS

    assert main(["info", "--explain", "--json"]) == 0
    cases = json.loads(capsys.readouterr().out)["explain"]["cases"]
    assert {case["op"] for case in cases} == set(OPS)
    assert all("error" not in case for case in cases)


def test_info_explain_refuses_a_malformed_shape(capsys) -> None:
    """A bad --shape exits 2 naming the key."""
    assert main(["info", "--shape", "quantized_gemm:m=x"]) == 2
    assert "m must be an integer" in capsys.readouterr().err
