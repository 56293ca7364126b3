#!/usr/bin/env bash
# The one script for a GPU machine with no network (see docs/benchmarks.md).
#
#   bash benchmarks/gpu_check.sh            # results under $OUT, else benchmarks/results/
#
# 1. installs the carried wheels (.whl/*.whl: pydantic & co.) into /tmp/hal-site,
# 2. makes hal-core, hal-cpu and hal-cuda importable with their entry points
#    (benchmarks/offline_install.py: hand-written dist-info, no hatchling needed),
# 3. fills CuPy's kernel cache in parallel (python -m hal_cuda._warmup),
# 4. runs the hal-cuda tests (GPU correctness per specialisation), the contract
#    suite with --hal-backend=cuda, and hal-core's tests (GPU interop ones included),
# 5. runs the benchmarks, and writes one summary JSON <date>-<device>.json.
# Budget: under ~8 minutes on an H200. Each step has its own timeout; a failing
# step is recorded and the next one still runs.
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
SITE=${HAL_SITE:-/tmp/hal-site}
RESULTS=${OUT:-$ROOT/benchmarks/results}
LOG=$RESULTS/gpu_check.log  # every step's output, one after the other (at most 8 files come back)
TMP=$(mktemp -d)
mkdir -p "$RESULTS"
: >"$LOG"
export PYTHONUNBUFFERED=1

if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$ROOT"/.whl/*.whl || { echo "gpu_check: installing .whl/ failed"; exit 1; }
fi
"$PY" benchmarks/offline_install.py "$SITE" || exit 1
export PYTHONPATH="$SITE:$ROOT/src:$ROOT/plugins/hal_cpu/src:$ROOT/plugins/hal_cuda/src${PYTHONPATH:+:$PYTHONPATH}"

declare -A STATUS
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$TMP/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="$rc $((SECONDS - start))"
  { echo "===== $name (rc=$rc, $((SECONDS - start)) s): $*"; cat "$TMP/$name.log"; } >>"$LOG"
  echo "gpu_check: $name rc=$rc in $((SECONDS - start)) s"
  tail -n 3 "$TMP/$name.log"
}

step info 60 "$PY" -c "import json, hal_core; print(json.dumps([i.__dict__ for i in hal_core.list_backends()], indent=1))"
step warmup 120 "$PY" -m hal_cuda._warmup "$(nproc)"
step cuda_tests 240 "$PY" -m pytest plugins/hal_cuda/tests -q -rs -p no:cacheprovider \
  --ignore=plugins/hal_cuda/tests/test_nvrtc_compile.py --ignore=plugins/hal_cuda/tests/test_hip_compile.py \
  --junitxml="$RESULTS/cuda-tests.xml"
step contract 120 "$PY" -m pytest --pyargs hal_core.testing.suite -q -rs -p no:cacheprovider --hal-backend=cuda \
  --junitxml="$RESULTS/contract.xml"
step core_tests 120 "$PY" -m pytest tests -q -rs -p no:cacheprovider --junitxml="$RESULTS/core-tests.xml"
step bench_paged_attention 90 "$PY" benchmarks/bench_paged_attention.py --json "$RESULTS/paged_attention.json"
step bench_quantized_gemm 150 "$PY" benchmarks/bench_quantized_gemm.py --json "$RESULTS/quantized_gemm.json"

STEPS=""
for name in "${!STATUS[@]}"; do STEPS+="$name=${STATUS[$name]};"; done
"$PY" - "$RESULTS" "$STEPS" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from _gpu_bench import result_path, write_json
results, steps = Path(sys.argv[1]), sys.argv[2]
summary = {"steps": {}}
for item in filter(None, steps.split(";")):
    name, rest = item.split("=")
    rc, seconds = rest.split()
    summary["steps"][name] = {"rc": int(rc), "seconds": int(seconds)}
for part in ("paged_attention", "quantized_gemm"):
    path = results / f"{part}.json"
    if path.is_file():
        summary[part] = json.loads(path.read_text())
device = next((summary[p]["device"] for p in ("paged_attention", "quantized_gemm") if p in summary), {"name": "unknown"})
summary["device"] = device
target = write_json(result_path(results, device["name"]), summary)
print(f"gpu_check: summary {target}")
for name, st in sorted(summary["steps"].items()):
    print(f"  {name:<22} rc={st['rc']:<4} {st['seconds']:>4} s")
PYEOF
for name in cuda_tests contract core_tests; do grep -E "passed|failed|error" "$TMP/$name.log" | tail -n 1; done
grep -hE "^(copy|paged_attention|W4A16|offload)" "$TMP"/bench_*.log
rm -rf "$TMP"
