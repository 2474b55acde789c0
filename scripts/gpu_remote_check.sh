#!/usr/bin/env bash
# Issue #41's GPU acceptance on the device machine, which has no network and no registry
# installed: Debian's docker-registry travels as its .deb (apt-get download docker-registry
# into .debs/, carried like .whl/); jitk.tools.local_registry unpacks it with dpkg -x into a
# temp folder and runs it from there on a free loopback port with its own storage; nothing
# is installed.
#   host A (its own cache): precompile every shipped configuration for this GPU, run the
#          norm, hicache and wait_value GPU tests once (they also load test-only variants),
#          then `cache push` all of it, signed;
#   host B (an empty cache, JITK_DISABLE_JIT=1, only the public key): `cache pull`, then the
#          same GPU tests: a module missing from the pulled cache is a JitCacheMissError, and
#          the entry count before and after the tests shows that nothing was built.
#   bash scripts/gpu_remote_check.sh [precompile options, e.g. --module wait_value]
# Every step runs under `timeout`; the registry is stopped on exit.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/gpu_env.sh || exit 1

STEP_SECONDS=1800      # one step: precompile, the tests, push or pull
START_SECONDS=20       # the registry's first answer
URL_SECONDS=300        # jitk.tools.local_registry's URL: importing jitk, the .deb, the start
TESTS=(tests/test_rmsnorm.py tests/test_hicache.py tests/test_wait_value.py)

work=$(mktemp -d /tmp/jitk-remote-check.XXXXXX)
registry_pid=""
stop_registry() {
  if [[ -n "$registry_pid" ]]; then  # jitk.tools.local_registry stops the registry on SIGTERM
    kill "$registry_pid" 2>/dev/null
    for _ in $(seq 150); do kill -0 "$registry_pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$registry_pid" 2>/dev/null
    registry_pid=""
  fi
  cp "$work/registry/registry.log" "$out/registry.log" 2>/dev/null
  rm -rf "$work"  # made by mktemp above: the registry's files and storage, hosts A and B
}
trap stop_registry EXIT

python3 -m jitk.tools.local_registry --work "$work/registry" --deb-dir .debs \
  --deb-dir ../../.debs --start-seconds "$START_SECONDS" > "$work/registry.url" \
  2> "$out/local_registry.log" &
registry_pid=$!
url=""
for _ in $(seq $((URL_SECONDS * 5))); do
  url=$(head -n 1 "$work/registry.url")
  [[ -n "$url" ]] && break
  kill -0 "$registry_pid" 2>/dev/null || break  # it exited: its error is in the log
  sleep 0.2
done
if [[ -z "$url" ]]; then
  echo "the local registry gave no URL (it exited, or $URL_SECONDS s passed):"
  tail -n 20 "$out/local_registry.log" "$work/registry/registry.log" 2>/dev/null
  exit 1
fi
echo "registry: $url"

remote="$url/jitk"
timeout "$STEP_SECONDS" python3 -m jitk cache keygen "$work/keys" || exit 1
entries() { find "$1" -mindepth 1 -maxdepth 1 -type d ! -name '.*' 2>/dev/null | wc -l; }
summary=()
status=0
step() {  # step NAME LOG COMMAND...: runs it bounded, logs it, notes a failure
  local name=$1 log=$2
  shift 2
  echo "== $name"
  timeout "$STEP_SECONDS" "$@" 2>&1 | tee "$out/$log"
  local code=${PIPESTATUS[0]}
  (( code == 124 )) && echo "$name: did not finish in $STEP_SECONDS s" | tee -a "$out/$log"
  (( code == 0 )) || { status=1; summary+=("$name: FAILED (exit $code, $out/$log)"); }
  return "$code"
}

host_a=(env "JITK_CACHE_DIR=$work/a/cache" "JITK_STAGING_DIR=$work/a/staging")
step "host A: precompile" remote_precompile.log "${host_a[@]}" python3 -m jitk precompile "$@"
step "host A: GPU tests" remote_tests_a.log "${host_a[@]}" \
  python3 -m pytest -q -p no:cacheprovider -m gpu "${TESTS[@]}"
step "host A: push" remote_push.log "${host_a[@]}" "JITK_REMOTE_CACHE=$remote" \
  "JITK_REMOTE_CACHE_KEY=$work/keys/jitk-remote.key" python3 -m jitk cache push
built=$(entries "$work/a/cache")

host_b=(env "JITK_CACHE_DIR=$work/b/cache" "JITK_STAGING_DIR=$work/b/staging"
        "JITK_REMOTE_CACHE=$remote" "JITK_REMOTE_CACHE_TRUST=$work/keys/jitk-remote.pub"
        JITK_DISABLE_JIT=1)
step "host B: pull" remote_pull.log "${host_b[@]}" python3 -m jitk cache pull
pulled=$(entries "$work/b/cache")
step "host B: GPU tests, JIT disabled" remote_tests_b.log "${host_b[@]}" \
  python3 -m pytest -q -p no:cacheprovider -m gpu "${TESTS[@]}"
after=$(entries "$work/b/cache")
misses=$(grep -c "JitCacheMissError" "$out/remote_tests_b.log")

echo
echo "== summary =="
for line in "${summary[@]}"; do echo "$line"; done
echo "host A: $built entries built and pushed ($(grep -m1 'configuration(s) in' \
  "$out/remote_precompile.log")); tests: $(tail -n 1 "$out/remote_tests_a.log")"
echo "host B: $(tail -n 1 "$out/remote_pull.log")"
echo "host B: tests with JITK_DISABLE_JIT=1: $(tail -n 1 "$out/remote_tests_b.log")"
# Entries host A built for other architectures only (a test's) are not pulled: counts may
# differ between the hosts, never on host B across its tests.
echo "host B: entries $pulled after the pull, $after after the tests; $misses cache miss(es)"
if (( pulled == 0 || after != pulled || misses != 0 )); then
  echo "FAILED: host B did not run on exactly the pushed entries"
  status=1
fi
exit "$status"
