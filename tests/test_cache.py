"""The cache where jitk is deployed: read-only mounts, clears and prunes beside running
programs, a serving mode that never compiles, two installations sharing one cache, bounded
locks and builds that die with their process.

Anything that could hang runs in a subprocess with a timeout. The child processes here load
a small C++ module with torch blocked (tvm-ffi then skips importing it), so each one starts
in a fraction of a second."""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import jitk
from jitk.build import cache, lock, staging

KERNEL = "#include <cstdint>\nint64_t twice(int64_t x) { return 2 * x; }\n"

# argv: kernel path, module name, value. Prints the result, or the error's type and text.
LOAD = textwrap.dedent("""\
    import sys, time
    sys.modules["torch"] = None  # keeps tvm-ffi from importing torch: a faster start
    import jitk
    kernel, name, value = sys.argv[1], sys.argv[2], int(sys.argv[3])
    started = time.perf_counter()
    try:
        module = jitk.load_jit(name, cpp_files=[kernel], cpp_wrappers=[("twice", "twice")])
        print("result", module.twice(value))
    except Exception as error:
        print("error", type(error).__name__, error)
    print("seconds", time.perf_counter() - started)
""")


@pytest.fixture
def kernel(tmp_path) -> Path:
    path = tmp_path / "twice.cuh"
    path.write_text(KERNEL)
    return path


def child_env(cache_dir: Path, **extra: str) -> dict:
    return {**os.environ, "JITK_CACHE_DIR": str(cache_dir), "JITK_VERBOSE": "1", **extra}


def load_in_child(kernel: Path, cache_dir: Path, name: str = "twice", value: int = 21,
                  prefix: tuple[str, ...] = (), timeout: float = 120, **env: str):
    return subprocess.run([*prefix, sys.executable, "-c", LOAD, str(kernel), name, str(value)],
                          capture_output=True, text=True, timeout=timeout,
                          env=child_env(cache_dir, **env))


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in folder.rglob("*")}


def published(cache_dir: Path) -> list[Path]:
    return [p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]


# ------------------------------------------------------------------------------ read-only
def read_only_mount_works(folder: Path) -> list[str] | None:
    """The command prefix that runs a command with `folder` mounted read-only in a private
    mount namespace, or None where this machine does not allow it."""
    remount = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} {folder}"
    for unshare in (["unshare", "-m"], ["unshare", "-rm"]):
        if shutil.which("unshare") is None:
            return None
        probe = subprocess.run([*unshare, "sh", "-c", f"{remount} && ! touch {folder}/probe"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [*unshare, "sh", "-c", f'{remount} && exec "$@"', "sh"]
    return None


def test_read_only_cache_loads_what_it_holds_and_refuses_builds_at_once(kernel, tmp_path):
    cache_dir = tmp_path / "cache"
    assert "result 42" in load_in_child(kernel, cache_dir).stdout
    prefix = read_only_mount_works(cache_dir)
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -m); the next test covers it")
    before = snapshot(cache_dir)
    hit = load_in_child(kernel, cache_dir, prefix=tuple(prefix), timeout=60)
    assert hit.returncode == 0 and "result 42" in hit.stdout, hit.stdout + hit.stderr
    other = kernel.with_name("other.cuh")
    other.write_text(KERNEL)
    miss = load_in_child(other, cache_dir, "other", prefix=tuple(prefix), timeout=60)
    assert "error JitLockError jitk: cannot create the build lock" in miss.stdout, miss.stdout
    assert "Read-only file system" in miss.stdout and str(cache_dir) in miss.stdout
    assert float(miss.stdout.split("seconds ")[1]) < 5
    assert snapshot(cache_dir) == before


def test_loading_takes_no_lock_and_writes_nothing(kernel, tmp_path):
    cache_dir = tmp_path / "cache"
    assert "result 42" in load_in_child(kernel, cache_dir).stdout
    [entry] = published(cache_dir)
    lock.lock_path(entry).unlink()
    lock.lock_path(entry).mkdir()  # no lock can be taken there
    before = snapshot(cache_dir)
    hit = load_in_child(kernel, cache_dir, timeout=60)
    assert "result 42" in hit.stdout, hit.stdout + hit.stderr
    assert snapshot(cache_dir) == before


def test_a_lock_that_cannot_be_created_fails_at_once_naming_path_and_reason(kernel, tmp_path):
    entry = tmp_path / "mine"
    cache.build_lock_path(entry, in_place=True).mkdir(parents=True)
    started = time.perf_counter()
    with pytest.raises(jitk.JitLockError, match=f"cannot create the build lock "
                       f"{cache.build_lock_path(entry, in_place=True)}: Is a directory"):
        jitk.load_jit("twice", cpp_files=[kernel], cpp_wrappers=[("twice", "twice")],
                      build_directory=entry)
    assert time.perf_counter() - started < 5
    assert not (entry / cache.META_FILE).exists()


# ------------------------------------------------------------------------------ locks
HOLD = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from jitk.build import lock
    fd = lock.try_lock(Path(sys.argv[1]))
    print("held" if fd is not None else "busy", flush=True)
    time.sleep(60)
""")


def hold_lock(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                              text=True, env=os.environ)
    assert holder.stdout.readline().strip() == "held"
    return holder


WAIT_FOR_LOCK = textwrap.dedent("""\
    import sys, time
    import jitk
    started = time.perf_counter()
    try:
        jitk.load_jit("twice", cpp_files=[sys.argv[1]], cpp_wrappers=[("twice", "twice")],
                      build_directory=sys.argv[2])
    except jitk.JitLockError as error:
        print("error", error)
    print("seconds", time.perf_counter() - started)
""")


def test_a_lock_held_too_long_fails_naming_its_holder(kernel, tmp_path):
    entry = tmp_path / "mine"
    holder = hold_lock(cache.build_lock_path(entry, in_place=True))
    try:
        # The waiter runs in its own process, under a timeout: a regression hangs no test.
        waiter = subprocess.run([sys.executable, "-c", WAIT_FOR_LOCK, str(kernel), str(entry)],
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, lock.TIMEOUT_ENV: "0.5"})
    finally:
        holder.kill()
        holder.wait()
    assert re.search(f"waited 0.5 s for the build lock .*held by pid {holder.pid} on .* "
                     "\\(this machine\\)", waiter.stdout), waiter.stdout + waiter.stderr
    # Far under the 300 s default; the rest is the call's start (compiler version queries),
    # which took 5.5 s on the GPU machine while six test workers were building.
    assert float(waiter.stdout.split("seconds")[-1]) < 30
    # The holder was killed: its lock died with it, and the build goes ahead.
    module = jitk.load_jit("twice", cpp_files=[kernel], cpp_wrappers=[("twice", "twice")],
                           build_directory=entry)
    assert module.twice(4) == 8


def test_lock_timeout_setting_is_checked(monkeypatch):
    for setting in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv(lock.TIMEOUT_ENV, setting)
        with pytest.raises(ValueError, match=f"JITK_LOCK_TIMEOUT='{setting}': expected a "
                           "positive number of seconds"):
            lock.lock_timeout()
    monkeypatch.setenv(lock.TIMEOUT_ENV, "2.5")
    assert lock.lock_timeout() == 2.5


def test_bad_settings_fail_every_load_and_command_with_the_rule(kernel, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("JITK_CACHE_DIR", str(cache_dir))
    fill(cache_dir, kernel, ["twice"])
    monkeypatch.setenv(lock.TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match="JITK_LOCK_TIMEOUT='0'"):  # a hit checks it too
        jitk.load_jit("twice", cpp_files=[kernel], cpp_wrappers=[("twice", "twice")])
    monkeypatch.delenv(lock.TIMEOUT_ENV)
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("")
    monkeypatch.setenv("JITK_CACHE_DIR", str(a_file))
    with pytest.raises(ValueError, match=f"JITK_CACHE_DIR='{a_file}' is a file; it must name "
                       "a folder"):
        jitk.load_jit("twice", cpp_files=[kernel], cpp_wrappers=[("twice", "twice")])
    for command in (["cache"], ["cache", "prune", "--keep", "1"]):
        result = subprocess.run([sys.executable, "-m", "jitk", *command], capture_output=True,
                                text=True, timeout=120, env=child_env(a_file))
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "is a file; it must name a folder" in result.stderr


def compilers_under(folder: Path) -> list[str]:
    """Command lines of the processes working in `folder` (a build's compilers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            in_folder = str(folder) in os.readlink(proc / "cwd")
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if in_folder or str(folder) in command:
            found.append(command)
    return found


def assert_no_compilers_soon(folder: Path) -> None:
    deadline = time.monotonic() + 10
    while left := compilers_under(folder):
        assert time.monotonic() < deadline, f"still running after the build stopped: {left}"
        time.sleep(0.1)


def write_heavy_kernel(folder: Path) -> Path:
    """A kernel that takes a second or more to compile, to stop its build in the middle."""
    heavy = folder / "heavy.cuh"
    heavy.write_text("#include <cstdint>\n#include <jitk/tensor.h>\n#include <jitk/utils.h>\n"
                     "#include <map>\n#include <regex>\n#include <vector>\n"
                     "int64_t twice(int64_t x) { std::regex r(\"a+\"); return 2 * x; }\n")
    return heavy


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux /proc")
def test_a_build_past_the_time_limit_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(staging.STAGING_ENV, str(tmp_path / "staging"))
    monkeypatch.setenv(lock.TIMEOUT_ENV, "0.2")
    with pytest.raises(jitk.JitCompileError) as info:
        jitk.load_jit("heavy", cpp_files=[write_heavy_kernel(tmp_path)],
                      cpp_wrappers=[("twice", "twice")])
    assert info.value.errors == ["jitk: the build ran longer than 0.2 s (JITK_LOCK_TIMEOUT) "
                                 "and was stopped"]
    assert_no_compilers_soon(tmp_path / "staging")
    assert not published(tmp_path / "cache")


@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux /proc")
def test_a_killed_build_leaves_no_compiler_running(tmp_path):
    cache_dir, staging = tmp_path / "cache", tmp_path / "staging"
    heavy = write_heavy_kernel(tmp_path)
    builder = subprocess.Popen([sys.executable, "-c", LOAD, str(heavy), "heavy", "1"],
                               env=child_env(cache_dir, JITK_STAGING_DIR=str(staging)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any("cc1plus" in c for c in compilers_under(staging)):
        assert time.monotonic() < deadline and builder.poll() is None, "no compiler started"
        time.sleep(0.02)
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    assert_no_compilers_soon(staging)
    assert not published(cache_dir)


# ------------------------------------------------------------------------------ clear, prune
CLEAR_LOOP = textwrap.dedent("""\
    import sys
    from pathlib import Path
    from jitk.build import cache
    stop, ready, rounds, failures = Path(sys.argv[1]), Path(sys.argv[2]), 0, []
    while not stop.exists():
        failures += cache.clear()[1]
        rounds += 1
        ready.touch()
    print("rounds", rounds, "failures", failures)
""")


def test_clear_in_a_loop_beside_30_loads(kernel, tmp_path):
    cache_dir, stop, ready = tmp_path / "cache", tmp_path / "stop", tmp_path / "ready"
    clearer = subprocess.Popen([sys.executable, "-c", CLEAR_LOOP, str(stop), str(ready)],
                               stdout=subprocess.PIPE, text=True, env=child_env(cache_dir))
    results, started = {}, time.perf_counter()
    # The loads start once the clearer is clearing (a loaded machine starts it late: a run
    # with six test workers beside it once saw every load done before its first round).
    while not ready.exists():
        assert clearer.poll() is None and time.perf_counter() - started < 60, \
            "the clearing loop did not start within 60 s"
        time.sleep(0.01)

    def load(value: int) -> None:
        results[value] = load_in_child(kernel, cache_dir, value=value, timeout=120)

    try:
        for first in range(0, 30, 6):  # six at a time
            threads = [threading.Thread(target=load, args=(v,)) for v in range(first, first + 6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        stop.touch()
        out, _ = clearer.communicate(timeout=60)
    assert len(results) == 30
    for value, result in results.items():
        assert result.returncode == 0 and f"result {2 * value}" in result.stdout, \
            result.stdout + result.stderr
    rounds = int(out.split()[1])
    assert rounds > 1 and out.endswith("failures []\n"), out  # rounds ran beside the loads
    assert time.perf_counter() - started < 240


def fill(cache_dir: Path, kernel: Path, names: list[str]) -> None:
    for name in names:
        assert "result 42" in load_in_child(kernel, cache_dir, name).stdout


def age(entry: Path, days: float) -> None:
    meta = cache.read_meta(entry)
    meta["built_at"] -= days * 86400
    cache.write_meta(entry, {k: v for k, v in meta.items() if k != "format"})


def jitk_cli(cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitk", *args], capture_output=True, text=True,
                          timeout=120, env=child_env(cache_dir))


def test_prune_by_age_count_and_size_with_dry_run(kernel, tmp_path):
    cache_dir = tmp_path / "cache"
    fill(cache_dir, kernel, ["twice", "twice_b"])
    kernel.write_text(KERNEL + "// another version: another entry of module twice\n")
    fill(cache_dir, kernel, ["twice"])
    entries = cache.list_entries(cache_dir)
    assert [e.module for e in entries].count("twice") == 2
    for entry, days in zip(entries, (0, 5, 10)):  # newest first
        age(entry.path, days)

    dry = jitk_cli(cache_dir, "cache", "prune", "--older-than", "3", "--dry-run")
    assert dry.returncode == 0, dry.stderr  # twice_b is old, but the only one of its kind
    assert "would remove 1 cache entry" in dry.stdout and "nothing removed" in dry.stdout
    dry = jitk_cli(cache_dir, "cache", "prune", "--older-than", "3", "--arch", "host",
                   "--dry-run")
    assert "would remove 2 cache entries" in dry.stdout and "nothing removed" in dry.stdout
    assert len(cache.list_entries(cache_dir)) == 3

    kept = jitk_cli(cache_dir, "cache", "prune", "--keep", "1")
    assert kept.returncode == 0, kept.stderr
    assert "removed 1 cache entry" in kept.stdout
    assert sorted(e.module for e in cache.list_entries(cache_dir)) == ["twice", "twice_b"]

    newest = cache.list_entries(cache_dir)[0]
    sized = jitk_cli(cache_dir, "cache", "prune", "--max-size", str(newest.size_bytes),
                     "--arch", "host")
    assert sized.returncode == 0, sized.stderr
    assert [e.path for e in cache.list_entries(cache_dir)] == [newest.path]
    assert not list(cache_dir.glob("*.lock")) and not cache.staging_folders(cache_dir)

    usage = jitk_cli(cache_dir, "cache", "prune")
    assert usage.returncode == 2 and "needs --older-than, --keep or --max-size" in usage.stderr


def recorded_entry(cache_dir: Path, name: str, archs: list[str], days: float) -> Path:
    """An entry as list_entries and prune see it (its record), without a build."""
    key = f"{abs(hash((name, tuple(archs), days))):016x}"[:16]
    entry = cache_dir / f"{name}_{key}_sm{'-'.join(a.replace('.', '') for a in archs)}"
    entry.mkdir(parents=True)
    cache.write_meta(entry, {"module": name, "key": key, "library": f"{name}.so",
                             "sha256": "0" * 64, "archs": archs, "headers": {},
                             "built_at": time.time() - 86400 * days})
    return entry


def test_prune_counts_versions_per_architecture_and_keeps_each_last_one(tmp_path):
    cache_dir = tmp_path / "cache"
    # An image filled with --arch 9.0 --arch 10.0, then rebuilt for 9.0 with a newer jitk.
    old_90 = recorded_entry(cache_dir, "rmsnorm_4096_bf16_t", ["9.0"], 20)
    only_100 = recorded_entry(cache_dir, "rmsnorm_4096_bf16_t", ["10.0"], 19)
    new_90 = recorded_entry(cache_dir, "rmsnorm_4096_bf16_t", ["9.0"], 1)
    other_size = recorded_entry(cache_dir, "rmsnorm_8192_bf16_t", ["9.0"], 30)

    def left() -> set[Path]:
        return {e.path for e in cache.list_entries(cache_dir)}

    kept = jitk_cli(cache_dir, "cache", "prune", "--keep", "1")
    assert kept.returncode == 0, kept.stderr
    assert left() == {only_100, new_90, other_size}  # one version of each, per architecture
    aged = jitk_cli(cache_dir, "cache", "prune", "--older-than", "7", "--max-size", "0")
    assert aged.returncode == 0, aged.stderr
    assert left() == {only_100, new_90, other_size}  # each is the last of its kind
    asked = jitk_cli(cache_dir, "cache", "prune", "--older-than", "7", "--arch", "10.0")
    assert asked.returncode == 0, asked.stderr
    assert left() == {new_90, other_size}
    assert old_90.name not in asked.stdout
    everything = jitk_cli(cache_dir, "cache", "prune", "--keep", "0", "--arch", "9.0")
    assert everything.returncode == 0 and left() == set(), everything.stderr


# argv: entry. Holds the entry's lock and publishes nothing: a build between its copy onto
# the cache's file system and the rename that publishes it.
PUBLISHING = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from jitk.build import cache, lock, staging
    entry = Path(sys.argv[1])
    fd = lock.try_lock(lock.lock_path(entry))
    print(cache.copy_in(staging.new_staging(entry), entry), flush=True)
    time.sleep(60)
""")


def test_clear_leaves_a_running_build_alone(kernel, tmp_path):
    cache_dir = tmp_path / "cache"
    fill(cache_dir, kernel, ["twice"])
    building = cache_dir / "building_0123456789abcdef"  # an entry name: jitk made it
    holder = subprocess.Popen([sys.executable, "-c", PUBLISHING, str(building)],
                              stdout=subprocess.PIPE, text=True,
                              env=child_env(cache_dir, JITK_STAGING_DIR=str(tmp_path)))
    try:
        private = Path(holder.stdout.readline().strip())
        cleared = jitk_cli(cache_dir, "cache", "clear")
    finally:
        holder.kill()
        holder.wait()
    assert cleared.returncode == 0 and "removed 1 cache entry" in cleared.stdout
    assert private.parent == cache_dir / cache.STAGING_DIR
    assert private.is_dir() and lock.lock_path(building).exists()
    again = jitk_cli(cache_dir, "cache", "clear")  # its builder is gone now
    assert again.returncode == 0 and not private.exists()
    assert not lock.lock_path(building).exists()


def test_clear_of_a_read_only_cache_exits_1_naming_what_stayed(kernel, tmp_path):
    cache_dir = tmp_path / "cache"
    fill(cache_dir, kernel, ["twice"])
    prefix = read_only_mount_works(cache_dir)
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -m)")
    result = subprocess.run([*prefix, sys.executable, "-m", "jitk", "cache", "clear"],
                            capture_output=True, text=True, timeout=60, env=child_env(cache_dir))
    assert result.returncode == 1
    assert "removed 0 cache entries" in result.stdout
    assert "could not be removed" in result.stderr and "Read-only file system" in result.stderr


def test_cache_command_does_not_import_torch(tmp_path):
    blocker = tmp_path / "blocker" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('python -m jitk cache imported torch')")
    env = {**child_env(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(blocker.parent), os.environ.get("PYTHONPATH", "")])}
    for args in (["cache"], ["cache", "clear"], ["cache", "prune", "--keep", "1"]):
        result = subprocess.run([sys.executable, "-m", "jitk", *args], capture_output=True,
                                text=True, timeout=60, env=env)
        assert result.returncode == 0, result.stderr
