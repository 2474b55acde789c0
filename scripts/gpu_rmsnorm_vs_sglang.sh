#!/usr/bin/env bash
# RMSNorm's acceptance run on one GPU, in one call: tune both ops in both 16-bit dtypes (timed;
# every candidate's time in tune.log), then jitk against SGLang 0.5.23 over issue 18's grid (a
# second process reading the tuning file; the summary here, the grids in grids1.log; QUICK=1
# for fewer rounds, MODES="graph single" for fewer timings, SETS=N for N sets of tensors a
# shape, PEERS_RUNS=N for N processes and their pooled verdict), 32768x8192 against a copy
# of the same bytes, then the GPU tests of RMSNorm and the parity harness. Full logs are left
# in $OUT (default /tmp/jitk-gpu-out).
#   bash scripts/gpu_rmsnorm_vs_sglang.sh [tune|tune-beside] [peers] [large] [tests]
# (default: tune peers large tests; tune-beside tunes with `jitk tune --beside` instead)
# SGLang's kernels are looked for at .peers/sgl523 (or PEERS=DIR); a stage run alone reuses
# the tuning file of an earlier one in JITK_CACHE_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
stages=" ${*:-tune peers large tests} "
. scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

for stage in tune tune-beside; do  # tune-beside: each call timed after a GEMM, PDL tried off
  [[ $stages == *" $stage "* ]] || continue
  start=$SECONDS
  timeout 300 python3 -m jitk tune rmsnorm fused_add_rmsnorm --dtype bfloat16 float16 -v \
    $([[ $stage == tune-beside ]] && echo --beside) > "$out/$stage.log" 2>&1
  grep -E "^(built|tuned)|failed|rror" "$out/$stage.log" | tail -n 5
  echo "$stage: $((SECONDS - start)) s"
done
if [[ $stages == *" peers "* ]]; then
  # Each run a process of its own (RUN_FROM numbers them, so that a later call can add runs
  # beside an earlier call's files); with several runs here, their pooled verdict too.
  # PEERS_DEADLINE: seconds into this script after which no run starts or goes on (a run
  # starts only if the last one's time fits before it).
  # Pooled: runs 1 to the last this call made, so a file an older call left with a higher
  # number, or one of a run that did not finish this time, is never taken for a new one.
  first=${RUN_FROM:-1} last=0 runs=()
  for ((run = 1; run < first; run++)); do runs+=("$out/peers$run.json"); done
  for ((run = first; run < first + ${PEERS_RUNS:-1}; run++)); do
    start=$SECONDS left=$((${PEERS_DEADLINE:-1000000} - SECONDS))
    ((last < left)) || { echo "peers: no time for run $run"; break; }
    limit=${PEERS_TIMEOUT:-240}
    ((left < limit)) && limit=$left
    rm -f "$out/peers$run.json"
    PYTHONPATH="$peers:$PYTHONPATH" timeout "$limit" python3 \
      benchmarks/bench_rmsnorm_peers.py ${QUICK:+--quick} ${MODES:+--modes $MODES} \
      ${SETS:+--sets $SETS} --json "$out/peers$run.json" --grids "$out/grids$run.log" \
      > "$out/peers$run.log" 2>&1
    last=$((SECONDS - start))
    echo "peers run $run: $last s"
    grep -E "^  .*(<=|: .* / )" "$out/peers$run.log"
    runs+=("$out/peers$run.json")
  done
  runs=($(ls "${runs[@]}" 2>/dev/null))
  if ((${#runs[@]} > 1)); then
    python3 benchmarks/bench_rmsnorm_peers.py --pool "${runs[@]}" --json "$out/pooled.json" \
      --grids "$out/pooled-grids.log" > "$out/pooled.log" 2>&1
    grep -E "pooled|^  .*(<=|: .* / )" "$out/pooled.log"
  fi
fi
[[ $stages == *" large "* ]] && PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" timeout 60 python3 - \
  <<'PY' 2>&1 | tee "$out/large.log"
import bench_rmsnorm as b, common
row = b.measure("rmsnorm", b.BF16, 32768, 8192, "rows", common.device_copy_gbps())
print(f"32768x8192 bf16: jitk {row['jitk graph us']:.1f} us, same-size copy "
      f"{row['same-size copy us']:.1f} us: {row['vs same-size copy']:.3f} of the copy")
PY
[[ $stages == *" tests "* ]] && timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q \
  -p no:cacheprovider -n 8 tests/test_rmsnorm.py tests/test_parity.py 2>&1 | tail -n 4 | tee "$out/pytest.log"
