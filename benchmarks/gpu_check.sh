#!/usr/bin/env bash
# The one script for a GPU machine with no network (see docs/benchmarks.md for how to launch it).
#
#   bash benchmarks/gpu_check.sh            # results under $OUT, else benchmarks/results/
#
# 1. installs the carried wheels (.whl/*.whl: pydantic & co.) into /tmp/hal-site and
#    stops at once, saying so, when pydantic, ml_dtypes, pluggy or cupy cannot be imported,
# 2. makes hal-core, hal-cpu and hal-cuda importable with their entry points
#    (benchmarks/offline_install.py: hand-written dist-info, no hatchling needed),
# 3. fills CuPy's kernel cache in parallel (python -m hal_cupy._warmup),
# 4. runs the hal-cuda tests (GPU correctness per specialisation), the contract
#    suite with --hal-backend=cuda, and hal-core's tests (GPU interop ones included),
# 5. runs the benchmarks: the GPU-specific ones (CUDA graphs, L2 flushes, targets; bench_paged_attention also
#    captures one decode step -- write_kv_cache + paged_attention -- in a CUDA graph, replays it with the index
#    arrays updated in place against the float64 reference, and replays a bad block id, which must come back as
#    ArgumentError('block_tables') from hal_core.check_errors()) and `hal bench`
#    (the hal_core.bench library: every op against the measured copy bandwidth, cuBLAS rate and
#    the cuBLAS fp16/bf16 peer), whose report goes into the summary under "hal_bench",
# 6. runs the variable-length attention on the GPU: the contract suite's prefill/mixed tests (every variant,
#    against the float64 reference) and `hal bench --preset prefill` and `--preset mixed`, whose reports go
#    into the summary under "hal_bench_varlen".
# The summary JSON <date>-<device>.json is rewritten after every step, so a run
# killed part-way still leaves the steps done so far.
#
# Budget: every step has its own time limit, clipped to what is left of
# HAL_GPU_CHECK_BUDGET_S (default 510 s, the limits' sum), so the whole run stays
# under 9 minutes, inside one 600 s device command. A failing or timed-out step
# (rc 124) is recorded and the next one still runs; one with no time left is
# recorded as skipped. At most 7 files are written to the results folder.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
SITE=${HAL_SITE:-/tmp/hal-site}
RESULTS=${OUT:-$ROOT/benchmarks/results}
BUDGET=${HAL_GPU_CHECK_BUDGET_S:-510}
LOG=$RESULTS/gpu_check.log  # every step's output, one after the other
TMP=$(mktemp -d)
mkdir -p "$RESULTS"
: >"$LOG"
: >"$TMP/steps"
export PYTHONUNBUFFERED=1
START=$SECONDS

# The summary's name is fixed now (the device from nvidia-smi), so each rewrite replaces one file.
DEVICE_NAME=$(timeout 10 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
SUMMARY=$("$PY" -c 'import sys; sys.path.insert(0, "benchmarks"); from _gpu_bench import result_path
print(result_path(sys.argv[1], sys.argv[2] or "unknown"))' "$RESULTS" "${DEVICE_NAME:-}") || exit 1

summarize() {  # summarize FINISHED(0|1): (re)write the summary from the steps so far and the benchmark JSONs
  "$PY" - "$RESULTS" "$SUMMARY" "$TMP/steps" "$1" "$BUDGET" "$TMP/hal-bench.json" "$TMP" <<'PYEOF' || echo "gpu_check: writing the summary failed"
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from _gpu_bench import write_json
results, target, steps_file, finished, budget = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
hal_bench = Path(sys.argv[6])
summary = {"finished": finished == "1", "budget_s": int(budget), "steps": {}}
for line in Path(steps_file).read_text().splitlines():
    name, rc, seconds = line.split()
    summary["steps"][name] = ({"skipped": "no time left"} if rc == "skipped"
                              else {"rc": int(rc), "seconds": int(seconds)})
for part in ("paged_attention", "quantized_gemm"):
    path = results / f"{part}.json"
    if path.is_file():
        try:
            summary[part] = json.loads(path.read_text())
        except ValueError:
            summary[part] = {"error": f"{path.name} is not valid JSON (its step was cut short?)"}
if hal_bench.is_file():
    try:
        summary["hal_bench"] = json.loads(hal_bench.read_text())
    except ValueError:
        summary["hal_bench"] = {"error": "the hal bench report is not valid JSON (its step was cut short?)"}
for preset in ("prefill", "mixed"):
    report = Path(sys.argv[7]) / f"hal-bench-{preset}.json"
    if report.is_file():
        try:
            summary.setdefault("hal_bench_varlen", {})[preset] = json.loads(report.read_text())
        except ValueError:
            summary.setdefault("hal_bench_varlen", {})[preset] = {"error": "not valid JSON (cut short?)"}
summary["device"] = next((summary[p]["device"] for p in ("paged_attention", "quantized_gemm")
                          if isinstance(summary.get(p), dict) and "device" in summary[p]), {"name": "unknown"})
write_json(target, summary)
PYEOF
}
on_exit() {
  local rc=$?
  summarize 1
  echo "gpu_check: summary $SUMMARY"
  rm -rf "$TMP"
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 143' TERM INT

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log, record, refresh the summary; returns rc
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if ((left < 5)); then
    echo "$name skipped 0" >>"$TMP/steps"
    echo "gpu_check: $name skipped (no time left of the ${BUDGET} s budget)" | tee -a "$LOG"
    summarize 0
    return 124
  fi
  ((limit > left)) && limit=$left
  local start=$SECONDS
  echo "===== $name (limit $limit s): $*" >>"$LOG"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$TMP/$name.log" >>"$LOG"
  local rc=${PIPESTATUS[0]}
  echo "===== $name: rc=$rc in $((SECONDS - start)) s" >>"$LOG"
  echo "$name $rc $((SECONDS - start))" >>"$TMP/steps"
  echo "gpu_check: $name rc=$rc in $((SECONDS - start)) s"
  tail -n 3 "$TMP/$name.log"
  summarize 0
  return "$rc"
}

if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  step install 20 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$ROOT"/.whl/*.whl
fi
step offline_install 10 "$PY" benchmarks/offline_install.py "$SITE" || exit 1
export PYTHONPATH="$SITE:$ROOT/src:$ROOT/plugins/hal_cpu/src:$ROOT/plugins/hal_cupy/src:$ROOT/plugins/hal_cuda/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pydantic, ml_dtypes, pluggy, cupy" >>"$LOG" 2>&1; then
  echo "deps 2 0" >>"$TMP/steps"
  echo "gpu_check: cannot import pydantic, ml_dtypes, pluggy or cupy (see $LOG)." \
    "carry .whl: run benchmarks/fetch_wheels.sh here and name .whl in carry" | tee -a "$LOG"
  exit 2
fi

step info 15 "$PY" -c "import json, hal_core; print(json.dumps([i.__dict__ for i in hal_core.list_backends()], indent=1))"
step warmup 60 "$PY" -m hal_cupy._warmup cuda "$(nproc)"
step cuda_tests 105 "$PY" -m pytest plugins/hal_cuda/tests plugins/hal_cupy/tests -q -rs -p no:cacheprovider \
  --ignore=plugins/hal_cuda/tests/test_nvrtc_compile.py --ignore=plugins/hal_cupy/tests/test_kernels_host_compiled.py \
  --ignore=plugins/hal_cupy/tests/test_tc_emulation.py --ignore=plugins/hal_cupy/tests/test_tc_quant_gemm_host.py \
  --ignore=plugins/hal_cupy/tests/test_tc_numerics_host.py --ignore=plugins/hal_cuda/tests/test_tc_sass_budget.py \
  --ignore=plugins/hal_cupy/tests/test_varlen_attention_host.py --ignore=plugins/hal_cupy/tests/test_tc_attention_host.py \
  --junitxml="$RESULTS/cuda-tests.xml"
step contract 45 "$PY" -m pytest -p hal_core.testing --pyargs hal_core.testing.suite -q -rs -p no:cacheprovider --hal-backend=cuda \
  --junitxml="$RESULTS/contract.xml"
step core_tests 45 "$PY" -m pytest tests -q -rs -p no:cacheprovider --junitxml="$RESULTS/core-tests.xml"
step bench_paged_attention 50 "$PY" benchmarks/bench_paged_attention.py --json "$RESULTS/paged_attention.json"
step bench_quantized_gemm 65 "$PY" benchmarks/bench_quantized_gemm.py --json "$RESULTS/quantized_gemm.json"
# hal bench starts no case after 25 s (the rest are reported as skipped), so it ends well inside its 40 s.
step hal_bench 40 "$PY" -m hal_core bench --backend cuda --preset all --budget 25 \
  --repeat 5 --max-time 0.3 --warmup-time 0.05 -q --json "$TMP/hal-bench.json"

# Variable-length attention on the GPU: prefill, chunked prefill and mixed batches with every variant against
# float64 (the contract suite's tests), then the prefill and mixed presets of hal bench.
step varlen 30 "$PY" -m pytest -p hal_core.testing --pyargs hal_core.testing.suite.test_paged_attention_varlen -q -rs \
  -p no:cacheprovider --hal-backend=cuda
step hal_bench_varlen 25 sh -c '"$0" -m hal_core bench --backend cuda --op paged_attention --preset prefill --budget 8 \
  --repeat 5 --max-time 0.3 --warmup-time 0.05 -q --json "$1/hal-bench-prefill.json" && "$0" -m hal_core bench \
  --backend cuda --op paged_attention --preset mixed --budget 8 --repeat 5 --max-time 0.3 --warmup-time 0.05 -q \
  --json "$1/hal-bench-mixed.json"' "$PY" "$TMP"

echo "gpu_check: done in $((SECONDS - START)) s"
while read -r name rc seconds; do printf '  %-22s rc=%-8s %4s s\n' "$name" "$rc" "$seconds"; done <"$TMP/steps"
for name in cuda_tests contract core_tests varlen; do
  [[ -f $TMP/$name.log ]] && grep -E "passed|failed|error" "$TMP/$name.log" | tail -n 1
done
grep -hE "^(copy|paged_attention|graph decode|W4A16|offload)" "$TMP"/bench_*.log 2>/dev/null
[[ -f $TMP/hal_bench.log ]] && grep -E "^(limits|paged_attention|W4A16|W8A8|write_kv_cache|  vs)" "$TMP/hal_bench.log" | head -n 40
[[ -f $TMP/hal_bench_varlen.log ]] && grep -E "^(paged_attention|  vs)" "$TMP/hal_bench_varlen.log" | head -n 20
# exit status: 0 when every step passed, else 1 (the summary says which)
awk '$2 != "0" { bad = 1 } END { exit bad }' "$TMP/steps"
