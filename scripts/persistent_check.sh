#!/usr/bin/env bash
# The persistent worker on a GPU, in one call: its GPU tests, compute-sanitizer (memcheck,
# racecheck, synccheck) on small cases, and its benchmark; logs in $OUT, a summary last.
#   bash scripts/persistent_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader

summary=()
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_persistent.py \
  > "$out/persistent_pytest.log" 2>&1
summary+=("pytest tests/test_persistent.py: $(tail -n 1 "$out/persistent_pytest.log")")
grep -E "^(FAILED|ERROR)|Error|assert" "$out/persistent_pytest.log" | head -n 20

# tool:case pairs; PERSISTENT_SANITIZE replaces the list ("" skips the sanitizer).
runs=${PERSISTENT_SANITIZE-memcheck:chain memcheck:exactly_once memcheck:device_push \
racecheck:chain synccheck:chain}
for run in $runs; do
  tool=${run%%:*} case=${run#*:}
  log="$out/sanitize_${tool}_${case}.log"
  timeout 60 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    python3 tests/persistent_cases.py "$case" --small > "$log" 2>&1
  status=$?
  summary+=("compute-sanitizer $tool $case: exit $status, $(grep -m1 'SUMMARY' "$log" ||
    echo 'no summary')")
  [[ $status -ne 0 ]] && tail -n 8 "$log"
done

PYTHONPATH="$PWD/tests:$PYTHONPATH" timeout 120 python3 benchmarks/bench_persistent.py "$@" \
  --json "$out/bench_persistent.json" 2>&1 | tee "$out/bench_persistent.log"
echo; echo "== summary =="
for line in "${summary[@]}"; do echo "$line"; done
