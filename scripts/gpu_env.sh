# Sourced by the GPU scripts (run from the repository root, or from a worktree under .wt/):
# $out for logs, the build cache, apache-tvm-ffi from the carried wheels (the device has no
# network; .whl/ here or at the checkout's root), jitk's python/ first on PYTHONPATH, and
# $peers: SGLang 0.5.23's kernels (../shared/peers/README.md), $PEERS or .peers/sgl523.
out="${OUT:-/tmp/jitk-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 JITK_CACHE_DIR="${JITK_CACHE_DIR:-/tmp/jitk-cache}" \
  SGLANG_JIT_CACHE_DIR="${SGLANG_JIT_CACHE_DIR:-/tmp/sglang-jit}"
if ! python3 -c "import tvm_ffi" 2>/dev/null; then
  wheels=$(ls .whl/*.whl ../../.whl/*.whl 2>/dev/null)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels ||
    { echo "no apache-tvm-ffi wheel in .whl/ (carry it)"; return 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
peers="${PEERS:-$(ls -d .peers/sgl523 ../../.peers/sgl523 2>/dev/null | head -n 1)}"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
