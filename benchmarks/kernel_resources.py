"""Registers and spills of every kernel specialisation, per CUDA arch.

Compiles the shared specialisation catalogue (``hal_cupy``, warp 32) offline with NVRTC (no GPU
needed) and writes ``benchmarks/kernel_resources.json`` and the table in
``docs/kernel-resources.md``.

    python benchmarks/kernel_resources.py [--arch sm_80 --arch sm_90 ...] [--jobs N]

Requires ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` (CUDA 13).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from hal_cuda import _nvrtc as N  # importing hal_cuda imports no CuPy
from hal_cupy import all_specializations

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_120")




def _compile(job):
    spec, arch = job
    res = N.compile_specialization(spec, arch)
    kernels = {
        k: {
            "registers": r.registers,
            "spill_stores": r.spill_stores,
            "spill_loads": r.spill_loads,
            "stack_frame": r.stack_frame,
            "static_shared_bytes": r.shared_bytes,
        }
        for k, r in sorted(res.kernels.items())
    }
    return spec.id, arch, res.seconds, kernels


def _markdown(data: dict, archs: tuple[str, ...]) -> str:
    head = "| specialisation | kernel | " + " | ".join(f"{a} regs / spill B" for a in archs) + " |"
    lines = [
        "# Kernel resources",
        "",
        "Registers per thread and spill bytes (stores + loads) of every kernel",
        "specialisation, from ptxas via NVRTC "
        f"{data['nvrtc_version']}. Regenerate with `python benchmarks/kernel_resources.py`",
        "(raw numbers, including stack frame and static shared memory, are in",
        "`benchmarks/kernel_resources.json`).",
        "",
        "Small spills (at most a few dozen bytes, on some archs only) come from",
        "ptxas trading a handful of loop-invariant values for a lower register count",
        "and higher occupancy under `__launch_bounds__(threads)`; they stay in L1.",
        "",
        head,
        "|" + "---|" * (2 + len(archs)),
    ]
    specs = data["specializations"]
    for sid in specs:
        kernels = sorted(next(iter(specs[sid].values())).keys())
        for k in kernels:
            cells = []
            for a in archs:
                r = specs[sid][a][k]
                cells.append(f"{r['registers']} / {r['spill_stores'] + r['spill_loads']}")
            lines.append(f"| `{sid}` | `{k}` | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="CUDA arch (repeatable)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "kernel_resources.json")
    ap.add_argument("--markdown", type=Path, default=ROOT / "docs" / "kernel-resources.md")
    args = ap.parse_args()
    archs = tuple(args.arch or DEFAULT_ARCHS)

    specs = all_specializations()
    jobs = [(s, a) for s in specs for a in archs]
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(_compile, jobs, chunksize=4))
    wall = time.perf_counter() - start

    major, minor = N.nvrtc_version()
    data = {
        "nvrtc_version": f"{major}.{minor}",
        "archs": list(archs),
        "specializations": {s.id: {} for s in specs},
    }
    for sid, arch, _, kernels in results:
        data["specializations"][sid][arch] = kernels
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    # Keep the tensor-core sections benchmarks/sass_budget.py maintains in the same file.
    old = args.markdown.read_text() if args.markdown.exists() else ""
    kept = ""
    for name in ("sass-budget", "sass-budget-attention"):
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin in old and end in old:
            kept += "\n" + old[old.index(begin): old.index(end) + len(end)] + "\n"
    args.markdown.write_text(_markdown(data, archs) + kept)

    spills = [
        (sid, a, k)
        for sid, per_arch in data["specializations"].items()
        for a, ks in per_arch.items()
        for k, r in ks.items()
        if r["spill_stores"] or r["spill_loads"]
    ]
    total = sum(r[2] for r in results)
    print(f"{len(jobs)} compiles in {wall:.1f}s wall ({total:.1f}s NVRTC time, {args.jobs} jobs)")
    print(f"kernels with spills: {len(spills)}")
    for s in spills:
        print("  spill:", *s)


if __name__ == "__main__":
    main()
