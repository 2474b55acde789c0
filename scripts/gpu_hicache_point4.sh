#!/usr/bin/env bash
# Issue #17 on the device machine, in one call: jitk's staged write-back against SGLang
# 0.5.23's own (point 2: "as fast as SGLang's"), then small pages beside a GEMM (point 4,
# experiments/exp_hicache_pipeline.py). Run from the worktree; SGLang's kernels come from
# .peers/sgl523 at the repository root (or $PEERS), see ../shared/peers/README.md. That
# extraction lacks SGLang's staged write-back; add it from the wheel before carrying:
#   unzip -n .peers/wheel/sglang-0.5.23-*.whl 'sglang/kernels/jit/csrc/kvcacheio/staged_write_back.cuh' \
#     'sglang/kernels/jit/csrc/kvcacheio/relayout.cuh' -d .peers/sgl523
#   bash scripts/gpu_hicache_point4.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh || exit 1
export PYTHONPATH="$peers:$PWD/benchmarks:$PWD/tests:$PYTHONPATH"  # the experiments import the benchmarks' helpers
nproc; lscpu | grep -E "Model name|NUMA node\(s\)|Socket" ; free -g | head -2

# Every module this run uses, built at once.
python3 experiments/exp_hicache_pipeline.py --build-only > "$out/build_exp.log" 2>&1 &
python3 - > "$out/build_sglang.log" 2>&1 <<'PY' &
import sgl523  # noqa: F401
from sglang.kernels.ops.kvcache import hicache as h
for size in (1024, 1152):
    h._jit_hicache_staged_module(element_size=size, unroll=h._default_unroll(size),
                                 block_quota=h.DEFAULT_BLOCK_QUOTA)
PY
python3 -c "from jitk.kernels.hicache import modules as m; m.staged_module(); m.copy_module()" \
  > "$out/build_jitk.log" 2>&1
wait
tail -n 3 "$out"/build_*.log

echo "== staged write-back: jitk vs SGLang 0.5.23 =="
[ -f "$peers/sglang/kernels/jit/csrc/kvcacheio/staged_write_back.cuh" ] ||
  echo "no staged_write_back.cuh under $peers: the SGLang comparison will fail (see the header)"
timeout 80 python3 benchmarks/bench_hicache.py --staged --peers --skip-overlap --skip-solo \
  --json "$out/staged.json" > "$out/staged.log" 2>&1
echo "exit $?"
grep -A 12 "jitk vs SGLang" "$out/staged.log" || tail -n 20 "$out/staged.log"
grep -A 5 "staged write-back, 64 MiB" "$out/staged.log"

echo "== point 4: small pages beside the GEMM =="
timeout 220 python3 experiments/exp_hicache_pipeline.py --json "$out/point4.json" \
  > "$out/point4.log" 2>&1
echo "exit $?"
grep -E "CHECK|checked|GEMM alone|Error|error" "$out/point4.log" | head -n 5
sed -n '/^host ceilings$/,$p' "$out/point4.log" | grep -v "^$" || tail -n 30 "$out/point4.log"

echo "== point 4 on a split GPU: the kernel on 8 SMs of its own, the GEMMs on the rest =="
timeout 200 python3 experiments/exp_hicache_split.py --json "$out/point4_split.json" \
  > "$out/point4_split.log" 2>&1
echo "exit $?"
sed -n '/^HiCache kernel beside/,$p' "$out/point4_split.log" || tail -n 25 "$out/point4_split.log"
