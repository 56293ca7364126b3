"""``hal info``: plugins, backends, the selected backend and device capabilities."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings
from dataclasses import asdict
from typing import Any

import hal_core
from hal_core import HalError

#: HAL_* variables hal-core reads (plugins may read more; every set HAL_* variable is shown).
CORE_VARIABLES = ("HAL_BACKEND", "HAL_FORCE_CPU", "HAL_STRICT", "HAL_DISABLE_PLUGINS", "HAL_CHECK_INDICES",
                  "HAL_TUNE", "HAL_TUNE_DIR", "HAL_ALLOW_OVERRIDE", "HAL_PROBE_TIMEOUT_S")


def collect_tuning(backends: dict[str, Any]) -> dict[str, Any]:
    """Where the tune store lives and, per bound backend and op, whether a tuned choice or the built-in rule applies."""
    from hal_core import bench, tuning

    found: dict[str, dict[str, Any]] = {}
    for name, backend in backends.items():
        per_op = {}
        for op, info in bench.tunables(backend).items():
            src = tuning.source(backend, op)
            per_op[op] = {"decided_by": "tuned" if src["tuned"] else "built-in", "tunable": info["tunable"],
                          "implementations": info["implementations"], "knobs": info["knobs"],
                          "tuned_buckets": {"implementation": src["choices"], **src["knobs"]}}
        found[name] = per_op
    return {"store": str(tuning.tune_dir()), "enabled": tuning.enabled(), "backends": found}


def collect_info() -> dict[str, Any]:
    """Everything ``hal info`` reports, as JSON-ready data (the ``--json`` document)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hal_core.list_plugins()  # discovery first: a wrong HAL_DISABLE_PLUGINS raises before anything else
        try:
            chosen = hal_core.get_backend()
            selected: dict[str, Any] = {"backend": chosen.name, "error": None}
        except HalError as exc:
            selected = {"backend": None, "error": {"type": type(exc).__name__, "message": str(exc)}}
        devices: dict[str, list[dict[str, Any]]] = {}
        device_errors: dict[str, str] = {}
        bound: dict[str, Any] = {}
        for info in hal_core.list_backends():
            if not (info.available and info.selectable):
                continue
            try:
                backend = hal_core.get_backend(info.name)
                bound[info.name] = backend
                devices[info.name] = [
                    {"index": d.index, "capabilities": d.capabilities.model_dump(mode="json")}
                    for d in backend.devices()
                ]
            except HalError as exc:
                device_errors[info.name] = str(exc)
        backends = [asdict(info) for info in hal_core.list_backends()]
        plugins = [asdict(record) for record in hal_core.list_plugins()]  # after the probes, which may reject one
        tuned = collect_tuning(bound)
    for caps in (c["capabilities"] for ds in devices.values() for c in ds):
        for key in ("dtypes", "features"):
            caps[key] = sorted(caps[key])
    env_names = sorted(set(CORE_VARIABLES) | {k for k in os.environ if k.startswith("HAL_")})
    return {
        "hal_core": {
            "version": hal_core.__version__,
            "api_version": list(hal_core.API_VERSION),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "environment": {name: os.environ.get(name) for name in env_names},
        "plugins": plugins,
        "backends": backends,
        "selected": selected,
        "devices": devices,
        "device_errors": device_errors,
        "tuning": tuned,
        "warnings": [str(w.message) for w in caught],
    }


def _print_info(info: dict[str, Any]) -> None:
    core = info["hal_core"]
    print(f"hal-core {core['version']} (HAL API {'.'.join(map(str, core['api_version']))}), "
          f"Python {core['python']} on {core['platform']}")
    set_vars = {k: v for k, v in info["environment"].items() if v is not None}
    print("environment: " + (", ".join(f"{k}={v}" for k, v in set_vars.items()) or "no HAL_* variable set"))

    print("\nplugins (entry-point group 'hal'):")
    if not info["plugins"]:
        print("  none found; install one, e.g. `pip install hal-cpu`")
    for p in info["plugins"]:
        line = f"  {p['name']:<12} {p['status']:<9} {p['distribution']} {p['version']}  ({p['value']})"
        if p["backends"]:
            line += f"  backends: {', '.join(p['backends'])}"
        print(line)
        if p["reason"]:
            print(f"  {'':<12} why: {p['reason']}")
        for refusal in p.get("refused", ()):
            print(f"  {'':<12} refused: {refusal}")

    print("\nbackends (highest priority first):")
    if not info["backends"]:
        print("  none")
    for b in info["backends"]:
        state = "available" if b["available"] else "unavailable"
        if b["loaded"]:
            state += ", loaded"
        if b.get("fallback"):
            state += ", fallback"
        print(f"  {b['name']:<12} priority {b['priority']:<5} {state:<22} {b['distribution']} {b['version']}")
        if b["reason"]:
            print(f"  {'':<12} why: {b['reason']}")
        if b["remedy"]:
            print(f"  {'':<12} fix: {b['remedy']}")

    selected = info["selected"]
    if selected["backend"]:
        print(f"\nselected: {selected['backend']}  (what hal_core.get_backend() returns here)")
    else:
        print(f"\nselected: none; get_backend() raises {selected['error']['type']}: {selected['error']['message']}")

    for name, devices in info["devices"].items():
        tag = " (selected)" if name == selected["backend"] else ""
        print(f"\ndevices of {name}{tag}:")
        for device in devices:
            caps = device["capabilities"]
            print(f"  [{device['index']}] {caps['name']} ({caps['vendor']}, {caps['arch']})")
            for key, value in caps.items():
                if key in ("name", "vendor", "arch") or value is None:
                    continue
                shown = ", ".join(value) if isinstance(value, list) and value and isinstance(value[0], str) else value
                print(f"      {key:<28} {shown}")
    _print_tuning(info["tuning"], selected["backend"])
    for name, error in info["device_errors"].items():
        print(f"\ndevices of {name}: could not bind: {error}")
    for message in info["warnings"]:
        print(f"\nwarning: {message}")


def _print_tuning(tuned: dict[str, Any], selected: str | None) -> None:
    state = "" if tuned["enabled"] else " (ignored: HAL_TUNE=0)"
    print(f"\nkernel choices (tune store {tuned['store']}{state}; `hal tune` measures, `hal tune --show` lists):")
    for name, per_op in tuned["backends"].items():
        tag = " (selected)" if name == selected else ""
        for op, entry in per_op.items():
            impls = ", ".join(entry["implementations"])
            knobs = sorted({k for ks in entry["knobs"].values() for k in ks})
            what = f"{impls}" + (f"; knobs {', '.join(knobs)}" if knobs else "")
            if entry["decided_by"] == "tuned":
                counts = ", ".join(f"{k} {n}" for k, n in entry["tuned_buckets"].items() if n)
                rule = f"tuned ({counts} bucket(s)), built-in rule elsewhere"
            else:
                rule = "built-in rule" + ("" if entry["tunable"] else " (nothing tunable)")
            print(f"  {name + tag:<16} {op:<16} {rule:<44} {what}")


def _cmd_info(args: argparse.Namespace) -> int:
    from ._explain import explain, parse_shape, print_explain, print_stats, stats_report

    try:
        info = collect_info()
    except hal_core.ConfigurationError as exc:  # e.g. HAL_DISABLE_PLUGINS that is no list of names
        print(f"hal info: {exc}", file=sys.stderr)
        return 2
    backend = None
    if args.explain or args.shape:
        try:
            cases = [parse_shape(text) for text in args.shape] or None
        except ValueError as exc:
            print(f"hal info: {exc}", file=sys.stderr)
            return 2
        try:
            backend = hal_core.get_backend(args.backend)
        except HalError as exc:
            print(f"hal info: cannot explain: {exc}", file=sys.stderr)
            return 1
        info["explain"] = {"backend": backend.name, "cases": explain(backend, cases)}
    if args.stats:
        info["stats"] = stats_report()
    if args.json:
        json.dump(info, sys.stdout, indent=2, sort_keys=False)
        print()
        return 0
    _print_info(info)
    if backend is not None:
        print_explain(backend, info["explain"]["cases"])
    if args.stats:
        print_stats(info["stats"])
    return 0
