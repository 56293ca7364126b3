"""Benchmark cases: one op at one shape, the ``--shape`` syntax, and the preset grids.

A case is an op name plus a few named integers and a dtype, e.g.
``quantized_gemm M=1,K=4096,N=11008,bits=4,group=128``. Keys are
case-insensitive; keys left out take the defaults of :data:`PARAMS`; a
value ending in ``k`` is multiplied by 1024 (``ctx=32k``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PARAMS", "PRESETS", "BenchArgumentError", "Case", "parse_shape", "preset_cases"]


class BenchArgumentError(ValueError):
    """A bad benchmark argument; the message names the command-line flag (``--shape``, ``--op``, ...)."""


_DTYPES = ("fp32", "fp16", "bf16")

#: Per op: every parameter with its default (ints, or a dtype name for ``dtype``).
PARAMS: dict[str, dict[str, int | str]] = {
    "paged_attention": {"seqs": 1, "ctx": 512, "heads": 32, "kv_heads": 8, "head": 128, "block": 16,
                        "dtype": "fp16"},
    "write_kv_cache": {"tokens": 32, "kv_heads": 8, "head": 128, "block": 16, "blocks": 0, "dtype": "fp16"},
    "quantized_gemm": {"m": 1, "k": 4096, "n": 11008, "bits": 4, "group": 128, "dtype": "fp16"},
}

_ALIASES = {"head_size": "head", "block_size": "block", "group_size": "group", "num_seqs": "seqs",
            "batch": "seqs", "context": "ctx", "seq_len": "ctx", "num_tokens": "tokens"}


@dataclass(frozen=True)
class Case:
    """One op at one shape. ``params`` holds every key of :data:`PARAMS` for ``op``."""

    op: str
    params: Mapping[str, int | str] = field(hash=False)

    @property
    def key(self) -> tuple[str, tuple[tuple[str, int | str], ...]]:
        return self.op, tuple(sorted(self.params.items()))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Case) and self.key == other.key

    @property
    def label(self) -> str:
        """A short human name, e.g. ``paged_attention fp16 32x4096 h32/8 d128``."""
        p = self.params
        if self.op == "paged_attention":
            return f"paged_attention {p['dtype']} {p['seqs']}x{p['ctx']} h{p['heads']}/{p['kv_heads']} d{p['head']}"
        if self.op == "write_kv_cache":
            return f"write_kv_cache {p['dtype']} {p['tokens']} tok h{p['kv_heads']} d{p['head']}"
        kind = "W4A16" if p["bits"] == 4 else "W8A8"
        return f"{kind} G{p['group']} M={p['m']} {p['k']}x{p['n']} {p['dtype']}"

    @property
    def shape_text(self) -> str:
        """The ``--shape`` text that gives this case back."""
        return ",".join(f"{k}={v}" for k, v in self.params.items())


def make_case(op: str, flag: str = "--op", **values: int | str) -> Case:
    """A :class:`Case` with defaults filled in and every value checked (errors name ``flag``)."""
    if op not in PARAMS:
        raise BenchArgumentError(f"argument --op: unknown op {op!r}; known: {', '.join(PARAMS)}")
    params: dict[str, int | str] = dict(PARAMS[op])
    for raw_key, value in values.items():
        key = _ALIASES.get(raw_key.lower(), raw_key.lower())
        if key not in params:
            raise BenchArgumentError(
                f"argument {flag}: unknown key {raw_key!r} for {op}; known: {', '.join(PARAMS[op])}")
        params[key] = value
    _check(op, params, flag)
    return Case(op, params)


def _check(op: str, p: dict[str, int | str], flag: str) -> None:
    if p["dtype"] not in _DTYPES:
        raise BenchArgumentError(f"argument {flag}: dtype must be one of {', '.join(_DTYPES)}, got {p['dtype']!r}")
    n: dict[str, int] = {}
    for key, value in p.items():
        if key == "dtype":
            continue
        if not isinstance(value, int) or value < (0 if key == "blocks" else 1):
            raise BenchArgumentError(f"argument {flag}: {key} must be a positive integer, got {value!r}")
        n[key] = value
    if op == "paged_attention" and n["heads"] % n["kv_heads"]:
        raise BenchArgumentError(f"argument {flag}: kv_heads={p['kv_heads']} must divide heads={p['heads']}")
    if op == "write_kv_cache" and n["blocks"] and n["blocks"] * n["block"] < n["tokens"]:
        raise BenchArgumentError(f"argument {flag}: blocks*block must hold tokens={p['tokens']}")
    if op == "quantized_gemm":
        if p["bits"] not in (4, 8):
            raise BenchArgumentError(f"argument {flag}: bits must be 4 or 8, got {p['bits']}")
        if n["k"] % n["group"] or (n["bits"] == 4 and n["k"] % 8):
            raise BenchArgumentError(
                f"argument {flag}: K={p['k']} must be a multiple of group={p['group']} (and of 8 for bits=4)")


def parse_shape(op: str, text: str) -> Case:
    """Parse ``--shape`` text such as ``M=1,K=4096,N=11008,bits=4,group=128`` for ``op``.

    Raises :class:`BenchArgumentError` naming ``--shape`` (or ``--op``) on any bad part.
    """
    values: dict[str, int | str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise BenchArgumentError(f"argument --shape: expected KEY=VALUE pairs separated by commas, got {part!r}"
                                     f" in {text!r}")
        if key.lower() == "dtype":
            values[key] = value.lower()
            continue
        try:
            number = int(value[:-1]) * 1024 if value.lower().endswith("k") else int(value)
        except ValueError:
            raise BenchArgumentError(f"argument --shape: {key} must be an integer, got {value!r}") from None
        values[key] = number
    if not values:
        raise BenchArgumentError(f"argument --shape: no KEY=VALUE pair in {text!r}")
    return make_case(op, "--shape", **values)


def _attention(seqs: int, ctx: int, dtype: str) -> Case:
    return make_case("paged_attention", seqs=seqs, ctx=ctx, dtype=dtype)


def _gemm(m: int, k: int, n: int, bits: int, dtype: str = "fp16") -> Case:
    return make_case("quantized_gemm", m=m, k=k, n=n, bits=bits, group=128, dtype=dtype)


def _decode() -> list[Case]:
    cases = [_attention(s, c, dt) for dt in _DTYPES for s, c in ((8, 512), (32, 4096), (1, 32768))]
    cases += [_attention(s, c, "fp16") for s, c in ((1, 512), (64, 1024), (4, 8192))]
    cases += [make_case("write_kv_cache", tokens=t, dtype=dt) for t in (8, 64) for dt in ("fp16", "fp32")]
    return cases


def _prefill() -> list[Case]:
    cases = [make_case("write_kv_cache", tokens=t, dtype="fp16") for t in (512, 4096)]
    cases += [_gemm(m, 4096, 4096, bits) for bits in (4, 8) for m in (512,)]
    return cases


def _gemms() -> list[Case]:
    shapes = ((4096, 11008), (11008, 4096))
    cases = [_gemm(m, k, n, bits) for bits in (4, 8) for k, n in shapes for m in (1, 16, 256)]
    # W4A16 small M also with bf16 activations, the dtype torch's int4 peer runs: the like-for-like comparison.
    cases += [_gemm(m, k, n, 4, "bf16") for k, n in shapes for m in (1, 16)]
    return cases


_BUILDERS = {"decode": _decode, "prefill": _prefill, "gemm": _gemms}

#: Preset names accepted by ``--preset``.
PRESETS = (*_BUILDERS, "all")


def preset_cases(name: str, ops: Iterable[str] | None = None) -> list[Case]:
    """The cases of preset ``name`` (``all`` = every preset, duplicates dropped), optionally only ``ops``."""
    if name not in PRESETS:
        raise BenchArgumentError(f"argument --preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    names = list(_BUILDERS) if name == "all" else [name]
    wanted = set(ops) if ops else None
    seen: dict[Case, None] = {}
    for preset in names:
        for case in _BUILDERS[preset]():
            if wanted is None or case.op in wanted:
                seen.setdefault(case, None)
    return list(seen)


def case_summary(case: Case) -> dict[str, Any]:
    """JSON-ready description of ``case``."""
    return {"op": case.op, "label": case.label, "params": dict(case.params), "shape": case.shape_text}
