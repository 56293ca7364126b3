"""Reading a report: the table at the end of a run, the JSON file, and the ratio-against-size plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ._interference import format_interference
from ._overhead import format_overhead

__all__ = ["format_table", "plot_report", "write_report"]


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def _limits_line(limits: dict[str, Any]) -> str:
    parts = []
    copy, blas = limits.get("copy", {}), limits.get("blas", {})
    parts.append(f"copy {copy['gbps']:.1f} GB/s ({copy['method']})" if "gbps" in copy
                 else f"copy: {copy.get('error', 'not measured')}")
    parts.append(f"BLAS {blas['gflops']:.0f} GFLOP/s ({blas['method']})" if "gflops" in blas
                 else f"BLAS: {blas.get('error', 'not measured')}")
    return "limits (the better of before and after the cases): " + "; ".join(parts)


def format_table(report: dict[str, Any]) -> str:
    """The human table: one row per case, one indented row per peer."""
    backend = report["backend"]
    lines = [f"hal bench on {backend['name']} ({backend['device']['name']}), {report['date']}",
             _limits_line(report["limits"]), ""]
    head = f"{'case':<46} {'median ms':>10} {'min-max ms':>17} {'GB/s':>8} {'GFLOP/s':>8} {'xcopy':>6} {'xBLAS':>6}"
    lines += [head, "-" * len(head)]
    for case in report["cases"]:
        if "skipped" in case:
            lines.append(f"{case['label']:<46} skipped: {case['skipped']}")
            continue
        hal = case["hal"]
        if "error" in hal:
            lines.append(f"{case['label']:<46} error: {hal['error']}")
        else:
            lines.append(_row(case["label"], hal))
        for peer in case["peers"]:
            name = f"  vs {peer['name']}"
            if peer["status"] != "ok":
                lines.append(f"{name:<46} {peer['status']}: {peer['reason']}")
                continue
            speed = peer.get("hal_speedup")
            note = f"  hal {speed:.2f}x the peer's speed" if speed is not None else ""
            lines.append(_row(name, peer) + note)
    if report.get("overhead"):
        lines += ["", format_overhead(report["overhead"])]
    if report.get("interference"):
        lines += ["", format_interference(report["interference"])]
    lines.append("")
    lines.append(f"{len(report['cases'])} case(s) in {report['seconds']:.0f} s")
    lines.append("xcopy: effective bandwidth / copy bandwidth; xBLAS: FLOP/s / BLAS rate; "
                 "hal Nx the peer's speed: peer time / hal time (docs/benchmarks.md)")
    return "\n".join(lines)


def _row(label: str, m: dict[str, Any]) -> str:
    spread = f"{m['min_ms']:.3g}-{m['max_ms']:.3g}"
    gflops = m["gflops"] if m.get("ratio_blas") is not None else None
    return (f"{label:<46} {m['median_ms']:>10.4g} {spread:>17} {_num(m['gbps']):>8} {_num(gflops, 1):>8} "
            f"{_num(m['ratio_copy']):>6} {_num(m['ratio_blas']):>6}")


def write_report(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``report`` as indented JSON (parents created; written to a temporary file, then renamed)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, target)
    return target


def plot_report(report: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Draw ratio against size: effective bandwidth / copy bandwidth and hal's speed over each peer.

    Needs matplotlib (``pip install 'hal-core[bench]'``); raises ImportError saying so when it is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'hal-core[bench]'") from exc
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    series: dict[str, list[tuple[int, float]]] = {}
    peers: dict[str, list[tuple[int, float]]] = {}
    for case in report["cases"]:
        hal = case.get("hal", {})
        if "ratio_copy" not in hal:
            continue
        if hal.get("ratio_roofline") is None:
            continue
        kind = f"{case['label'].split(' ')[0]} {case['params'].get('dtype', '')}".strip()
        ratio = hal["ratio_roofline"]
        series.setdefault(kind, []).append((case["bytes"], ratio))
        for peer in case.get("peers", ()):
            if peer.get("hal_speedup"):
                peers.setdefault(peer["name"], []).append((case["bytes"], peer["hal_speedup"]))
    for axis, data, title in ((left, series, "roofline fraction: max(GB/s / copy rate, FLOP/s / BLAS rate)"),
                              (right, peers, "hal speed / peer speed (same run; > 1: hal faster)")):
        for name, points in sorted(data.items()):
            axis.scatter([p[0] for p in points], [p[1] for p in points], label=name, s=28)
        axis.set_xscale("log")
        axis.set_xlabel("bytes an ideal implementation moves")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_title(title, fontsize=10)
        if data:
            axis.legend(fontsize=7)
    right.set_yscale("log")
    backend = report["backend"]
    fig.suptitle(f"hal bench, {backend['name']} ({backend['device']['name']}), {report['date']}", fontsize=11)
    fig.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target
