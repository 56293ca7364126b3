"""``sample``: one token per sequence from a batch of logits, without sorting the vocabulary.

Arguments: ``logits [num_seqs, vocab_size]`` (fp32/fp16/bf16; rows may be strided, the last dimension
contiguous) and per-sequence parameters, each ``[num_seqs]``: ``temperature`` (fp32, finite, >= 0),
optional ``top_k`` (int32; <= 0 or >= vocab_size: off), ``top_p`` (fp32 in (0, 1]; 1: off), ``min_p``
(fp32 in [0, 1]; 0: off) and ``seeds`` (int64). Returns the token ids ``[num_seqs]`` as int64.

Per row, with ``x`` the row's logits in float and ``m`` its maximum, the rules of transformers' logits
warpers, applied in the order its generation applies them (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``):

- ``temperature == 0``: greedy, the first (lowest) index of the maximum; the other parameters are
  ignored.
- Otherwise each token weighs ``w = exp((x - m) / temperature)`` (the temperature-scaled softmax before
  normalisation). -inf tokens are never drawn.
- top-k keeps the tokens ``>=`` the k-th largest logit: ties with it are all kept (as transformers).
- top-p keeps a token when the mass of the tokens (kept by top-k) whose value is strictly above its own is
  below ``top_p`` times the kept mass: the smallest set of the most probable tokens reaching ``top_p``,
  a token tied with the last one kept being kept too (transformers breaks such a tie by its sort order).
- min-p keeps a token when ``w >= min_p`` (its probability is at least ``min_p`` times the top token's).
- The draw: ``u`` = the top 53 bits of ``splitmix64(seed)`` over 2**53, a function of the row's seed alone
  (no generator state); the token is the first kept one, in index order, whose running sum of kept
  weights exceeds ``u`` times the kept mass (the inverse CDF, walked without sorting). The float64
  reference, the CPU kernels and the GPU kernels draw the same token for the same seed, unless ``u`` lies
  within rounding of a CDF boundary (or a weight within rounding of a threshold). An engine passes a new
  seed for every step (e.g. a per-request seed plus the step number), or it draws the same ``u`` again.

Special rows: a row holding NaN, or only -inf, yields token -1 (also when greedy). A row whose maximum is
+inf draws among its +inf tokens with equal weight (the limit of the softmax; transformers' softmax gives
NaN there). Parameter values out of range are refused on the host before any work, naming the argument
(a device call's values are checked by the kernel, which writes -1 for that row and reports the argument
through the device error flag, :func:`hal_core.check_errors`).

Kernels find the thresholds by selection, never a sort: the row's maximum (one pass); top-k by a radix
select over the order-preserving integer keys of the float bits (four 8-bit histogram passes); top-p by
the same radix descent over histograms of mass (one pass for the kept mass, four histogram passes);
min-p from the maximum; then one pass for the kept mass and a walk of at most one pass for the draw.
Greedy rows take one pass. So a row costs 1 + 4 + 5 + 2 passes at most. (The GPU kernel sums masses as
integers, each weight times 2**40 truncated, so its sums do not depend on the order threads add in.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..arrays import dtype_name, numpy_dtype
from ..tuning._buckets import pow2
from ._catalog import register_op
from ._checks import SMALL_INDEX_ARRAY, fail
from ._declare import Arg, BenchCases, Feature, Output
from ._sampling import sample_rows
from ._spec import OpSpec

__all__ = ["Sample", "sample_inputs", "sample_logits_dtypes"]

#: dtypes of the logits.
sample_logits_dtypes = ("fp32", "fp16", "bf16")

_ROWS = "[num_seqs]"


class Sample(OpSpec):
    """Draw one token per sequence (temperature, top-k, top-p, min-p; greedy at temperature 0), seeded per row."""

    name = "sample"
    args = (
        Arg.array("logits", "[num_seqs, vocab_size]", dtypes=sample_logits_dtypes, contiguous="last"),
        Arg.array("temperature", _ROWS, dtypes=("fp32",), doc="finite, >= 0; 0: greedy (argmax)"),
        Arg.index("seeds", _ROWS, dtypes=("int64",), doc="one per row; the draw is a function of it alone"),
        Arg.index("top_k", _ROWS, dtypes=("int32",), required=False, doc="<= 0 or >= vocab_size: off"),
        Arg.array("top_p", _ROWS, dtypes=("fp32",), required=False, doc="in (0, 1]; 1: off"),
        Arg.array("min_p", _ROWS, dtypes=("fp32",), required=False, doc="in [0, 1]; 0: off"),
        Arg.out(),
    )
    output = Output(_ROWS, dtype="int64")
    features = (
        Feature("dtype", "dtypes", lambda args: dtype_name(args["logits"])),
    )

    def check(self, args: dict[str, Any], sizes: Mapping[str, int]) -> None:
        if sizes["num_seqs"] and all(type(args[n]) is np.ndarray for n in _PARAMETERS if args.get(n) is not None):
            self.check_index_values(args)

    def check_index_values(self, args: Mapping[str, Any]) -> None:
        """The parameter values: temperature finite and >= 0, top_p in (0, 1], min_p in [0, 1]."""
        for name, lo, lo_open, why in _RANGES:
            value = args.get(name)
            if value is None:
                continue
            high = _HIGH[name]
            if value.size <= SMALL_INDEX_ARRAY:  # a decode step's few rows: Python floats beat three ufuncs
                listed = value.tolist()
                if all(lo < v <= high and v != math.inf if lo_open else lo <= v <= high and v != math.inf
                       for v in listed):  # NaN fails every comparison
                    continue
            values = np.asarray(value, dtype=np.float64)
            bad = ~(np.isfinite(values) & ((values > lo) if lo_open else (values >= lo)) & (values <= high))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise fail(name, why, f"{name}[{i}] = {float(values[i])!r}")

    def is_empty(self, args: Mapping[str, Any]) -> bool:
        return args["logits"].shape[0] == 0

    def bucket(self, args: Mapping[str, Any]) -> str:
        """``dtype:s<pow2 sequences>:v<pow2 vocabulary>``."""
        rows, vocab = args["logits"].shape
        return f"{dtype_name(args['logits'])}:s{pow2(rows)}:v{pow2(vocab)}"

    def flops(self, args: Mapping[str, Any]) -> int:
        return 0

    def nbytes(self, args: Mapping[str, Any]) -> int:
        """The logits read once (the kernels read them up to 12 times, from cache where they fit)."""
        logits = args["logits"]
        return int(logits.shape[0]) * (int(logits.shape[1]) * logits.dtype.itemsize + 32)

    def reference(self, args: Mapping[str, Any]) -> np.ndarray:
        def host(name: str) -> np.ndarray | None:
            value = args.get(name)
            return None if value is None else np.asarray(value)

        logits = np.asarray(args["logits"]).astype(np.float64)
        temperature, seeds = host("temperature"), host("seeds")
        assert temperature is not None and seeds is not None
        return sample_rows(logits, temperature, host("top_k"), host("top_p"), host("min_p"), seeds)


_PARAMETERS = ("temperature", "top_p", "min_p")
#: (argument, lower bound, whether it is excluded, what is expected); the upper bounds are in _HIGH.
_RANGES = (
    ("temperature", 0.0, False, "finite values >= 0 (0: greedy)"),
    ("top_p", 0.0, True, "values in (0, 1] (1: off)"),
    ("min_p", 0.0, False, "values in [0, 1] (0: off)"),
)
_HIGH = {"temperature": math.inf, "top_p": 1.0, "min_p": 1.0}


def sample_inputs(rng: np.random.Generator, *, num_seqs: int, vocab_size: int, dtype: str, greedy: bool = False,
                  top_k: bool = True, top_p: bool = True, min_p: bool = True, scale: float = 3.0,
                  strided: bool = False) -> dict[str, Any]:
    """Host arguments: normal logits times ``scale``, per-row parameters drawn over their ranges (some off).

    ``greedy``: every temperature 0; else temperatures in [0.3, 1.5) with one row in four greedy. ``strided``:
    the logits are a view of every other row of a wider array.
    """
    width = vocab_size + (3 if strided else 0)
    full = (rng.standard_normal((num_seqs * (2 if strided else 1), width)) * scale).astype(numpy_dtype(dtype))
    logits = full[::2, :vocab_size] if strided else full
    temperature = np.zeros(num_seqs, np.float32) if greedy else rng.uniform(0.3, 1.5, num_seqs).astype(np.float32)
    if not greedy:
        temperature[rng.random(num_seqs) < 0.25] = 0.0
    args: dict[str, Any] = {"logits": logits, "temperature": temperature,
                            "seeds": rng.integers(-2**63, 2**63 - 1, num_seqs, dtype=np.int64, endpoint=True)}
    if top_k:
        args["top_k"] = np.where(rng.random(num_seqs) < 0.3, 0, rng.integers(1, max(2, vocab_size // 2) + 1,
                                                                                num_seqs)).astype(np.int32)
    if top_p:
        args["top_p"] = np.where(rng.random(num_seqs) < 0.3, 1.0, rng.uniform(0.3, 0.95, num_seqs)).astype(np.float32)
    if min_p:
        args["min_p"] = np.where(rng.random(num_seqs) < 0.3, 0.0, rng.uniform(0.0, 0.2, num_seqs)).astype(np.float32)
    return args


def _bench_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    rows, vocab = p["seqs"], p["vocab"]
    args: dict[str, Any] = {
        "logits": (rng.standard_normal((rows, vocab), dtype=np.float32) * 3).astype(numpy_dtype(p["dtype"])),
        "temperature": np.full(rows, 0.0 if p["greedy"] else 0.8, np.float32),
        "seeds": np.arange(rows, dtype=np.int64),
    }
    if not p["greedy"]:
        args.update(top_k=np.full(rows, 50, np.int32), top_p=np.full(rows, 0.9, np.float32),
                    min_p=np.full(rows, 0.05, np.float32))
    return args


def _test_inputs(rng: np.random.Generator, p: Mapping[str, Any]) -> dict[str, Any]:
    return sample_inputs(rng, num_seqs=p["seqs"], vocab_size=p["vocab"], dtype=p["dtype"], greedy=bool(p["greedy"]))


Sample.bench = BenchCases(
    params={"seqs": 8, "vocab": 32000, "greedy": 0, "dtype": "fp32"},
    aliases={"num_seqs": "seqs", "vocab_size": "vocab"},
    may_be_zero=frozenset({"greedy"}),
    label=lambda p: f"sample {p['dtype']} {p['seqs']} seq v{p['vocab']} {'greedy' if p['greedy'] else 'sampling'}",
    check=lambda p: None if p["greedy"] in (0, 1) else "greedy must be 0 or 1",
    inputs=_bench_inputs,
    presets={
        "decode": lambda: [{"seqs": s, "vocab": v, "greedy": g, "dtype": "fp32"}
                           for s in (1, 8) for v in (32000, 128256) for g in (0, 1)],
        "prefill": lambda: [{"seqs": s, "vocab": 128256, "greedy": 0, "dtype": "fp32"} for s in (64, 256)],
        "step": lambda: [{"seqs": s, "vocab": v, "greedy": g, "dtype": dt}
                         for s in (1, 8) for v in (32000, 128256) for g in (0, 1) for dt in ("fp32", "bf16")],
    },
    explain=({"seqs": 8, "vocab": 32000, "greedy": 0, "dtype": "fp32"},
             {"seqs": 1, "vocab": 151936, "greedy": 1, "dtype": "bf16"}),
    test_inputs=_test_inputs,
    tiny={"seqs": 1, "vocab": 1024, "greedy": 0, "dtype": "fp32"},
)

register_op(Sample())
