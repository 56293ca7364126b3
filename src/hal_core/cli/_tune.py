"""``hal tune``: measure the candidate implementations and knob values per shape bucket; persist the winners.

The winners go to the tune store (``HAL_TUNE_DIR``, default
``~/.cache/hal/tuning``), one file per backend, device and hal version;
dispatch uses them from then on. ``--show`` lists the store, ``--clear``
removes the selected backend's files. See docs/tuning.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ._cases_args import add_case_options, add_timing_options, cases_from, policy_from

__all__ = ["add_tune_parser"]

_REPEAT, _MAX_TIME = 5, 0.5


def add_tune_parser(commands: argparse._SubParsersAction) -> None:
    tune = commands.add_parser("tune", help="pick kernels and knob values by measurement on this device",
                               description=__doc__.replace("``", ""))
    add_case_options(tune, "all")
    add_timing_options(tune, _REPEAT, _MAX_TIME)
    action = tune.add_mutually_exclusive_group()
    action.add_argument("--show", action="store_true", help="list the tune store and what each file decides")
    action.add_argument("--clear", action="store_true", help="remove the selected backend's tune files")
    tune.add_argument("--dry-run", action="store_true", help="measure and print, but persist nothing")
    tune.set_defaults(func=_cmd_tune)


def _fail(message: str) -> int:
    print(f"hal tune: error: {message}", file=sys.stderr)
    return 2


def _show(current: dict[str, Any] | None) -> int:
    from hal_core import tuning

    folder = tuning.tune_dir()
    tables = tuning.list_tables()
    print(f"tune store: {folder}" + ("" if tables else " (empty)"))
    for path, table in tables:
        if isinstance(table, str):
            print(f"\n{path.name}: ignored: {table}")
            continue
        here = " (this device)" if current is not None and table.key == current else ""
        k = table.key
        print(f"\n{path.name}{here}: {k.get('backend')} on {k.get('name')} ({k.get('arch')}, "
              f"{k.get('compute_units')} units), hal {k.get('hal_version')}, updated {table.updated}")
        for op, per_bucket in sorted(table.choices.items()):
            for where, impl in sorted(per_bucket.items()):
                print(f"  {op:<16} {where:<26} implementation = {impl}")
        for op, knobs in sorted(table.knobs.items()):
            for name, per_bucket in sorted(knobs.items()):
                for where, value in sorted(per_bucket.items()):
                    print(f"  {op:<16} {where:<26} {name} = {value}")
    return 0


def _print_report(report: Any) -> None:
    if not report.decisions:
        print(f"nothing to tune on backend {report.backend!r}: every op has one implementation and no knob "
              "with several candidates (hal info lists them)")
    for d in report.decisions:
        times = ", ".join(f"{c}: {ms:.3g} ms" for c, ms in sorted(d.ms.items(), key=lambda kv: kv[1]))
        what = "implementation" if d.kind == "impl" else d.name
        note = "" if not d.changed else f"  (built-in rule: {d.builtin})"
        print(f"  {d.op:<16} {d.bucket:<26} {what} = {d.winner}{note}    [{times}]")
    for line in report.skipped:
        print(f"  skipped: {line}")
    if report.path is not None:
        print(f"\nwrote {report.path}")


def _cmd_tune(args: argparse.Namespace) -> int:
    import hal_core
    from hal_core import HalError, bench, tuning

    try:
        backend = hal_core.get_backend(args.backend)
    except HalError as exc:
        if args.show:
            return _show(None)
        return _fail(f"argument --backend: {exc}")
    if args.show:
        return _show(tuning.key_for(backend))
    if args.clear:
        removed = tuning.clear(backend)
        print(f"removed {len(removed)} tune file(s) of backend {backend.name!r} from {tuning.tune_dir()}")
        for path in removed:
            print(f"  {path}")
        return 0
    try:
        policy = policy_from(args, _REPEAT, _MAX_TIME)
        cases = cases_from(args, "all")
    except bench.BenchArgumentError as exc:
        return _fail(str(exc))
    wanted = {op for op, info in bench.tunables(backend).items() if info["tunable"]}
    cases = [c for c in cases if c.op in wanted]
    print(f"tuning backend {backend.name!r}: {len(cases)} case(s) over ops {sorted(wanted) or 'none'}; "
          f"store {tuning.tune_dir()}")
    progress = bench.Progress(len(cases), enabled=not args.quiet)
    report = bench.tune(backend, cases, policy, progress=progress, persist=not args.dry_run)
    progress.close()
    _print_report(report)
    return 0
