#!/usr/bin/env bash
# Everything that needs a GPU, in one call on the device machine: set-up, the GPU tests,
# compute-sanitizer on one small case of each kernel, the benchmarks, and a short table last.
#   bash scripts/gpu_check.sh [setup] [tests] [flashinfer] [sanitize] [bench] [quick]
# (default: all). flashinfer: FlashInfer's own RMSNorm tests against jitk
# (scripts/flashinfer_norm_tests.py), from its tests/utils/test_norm.py carried at
# .peers/flashinfer/test_norm.py (or FLASHINFER_TEST_NORM=PATH).
# The device has no network: apache-tvm-ffi travels as a wheel in .whl/ (see README).
set -uo pipefail
cd "$(dirname "$0")/.."
stages="${*:-tests flashinfer sanitize bench}"
. scripts/gpu_env.sh || exit 1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 - <<'PY'
import torch, tvm_ffi
pinned = torch.empty(4, pin_memory=True)
print(f"torch {torch.__version__}, tvm-ffi {tvm_ffi.__version__}, "
      f"dlpack exchange api: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}, "
      f"pinned tensor dlpack device: {pinned.__dlpack_device__()}")
PY

summary=()
if [[ " $stages " == *" tests "* ]]; then
  # One worker per test file: files build their modules in parallel, a file's GPU tests
  # stay in order (the wait_value tests spin on flags).
  python3 -m pytest tests -q -p no:cacheprovider -n 6 --dist loadfile 2>&1 | tee "$out/pytest.log"
  summary+=("pytest: $(tail -n 1 "$out/pytest.log")")
fi
if [[ " $stages " == *" flashinfer "* ]]; then
  fi_tests="${FLASHINFER_TEST_NORM:-.peers/flashinfer/test_norm.py}"
  if [[ -f "$fi_tests" ]]; then
    timeout 600 python3 scripts/flashinfer_norm_tests.py "$fi_tests" -n 8 > "$out/flashinfer.log" 2>&1
    summary+=("FlashInfer's norm tests on jitk: $(tail -n 1 "$out/flashinfer.log")")
  else
    summary+=("FlashInfer's norm tests: skipped, no $fi_tests (carry FlashInfer's tests/utils/test_norm.py)")
  fi
fi
if [[ " $stages " == *" sanitize "* ]]; then
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 scripts/sanitize_cases.py \
    > "$out/sanitizer.log" 2>&1
  status=$?
  tail -n 5 "$out/sanitizer.log"
  summary+=("compute-sanitizer memcheck: exit $status ($(grep -c 'ran ' "$out/sanitizer.log") cases; $(grep -m1 'ERROR SUMMARY' "$out/sanitizer.log"))")
fi
if [[ " $stages " == *" bench "* ]]; then
  quick=""; [[ " $stages " == *" quick "* ]] && quick="--quick"
  for bench in benchmarks/bench_*.py; do
    name=$(basename "$bench" .py)
    # Some benchmarks time the tests' small modules (tests/probes.py, persistent_cases.py).
    PYTHONPATH="$PWD/tests:$PYTHONPATH" python3 "$bench" $quick --json "$out/$name.json" 2>&1 |
      tee "$out/$name.log"
  done
  python3 scripts/summarize.py "$out"
fi

echo
echo "== summary =="
for line in "${summary[@]}"; do echo "$line"; done
