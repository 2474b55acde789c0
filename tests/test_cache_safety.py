"""The cache's file-system safety: a build_directory is jitk's only if jitk made it and is
keyed like an entry; a cache others could have written is refused; a library is loaded from
the descriptor that was checked; a cache shared by hosts stays whole while they build, load
and prune at once.

Anything that could hang runs in a subprocess with a timeout."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import jitk
from jitk.build import cache, lock, staging, trust

KERNEL = "#include <cstdint>\nint64_t get(int64_t x) {{ return x + {value}; }}\n"
# Each of these loads only once in this process under its own module name: a library that
# the process has loaded before would be answered from memory, whatever the cache holds.
LOAD = textwrap.dedent("""\
    import sys
    sys.modules["torch"] = None  # keeps tvm-ffi from importing torch: a faster start
    import jitk
    kernel, name = sys.argv[1], sys.argv[2]
    print(jitk.load_jit(name, cpp_files=[kernel], cpp_wrappers=[("get", "get")]).get(0))
""")


def write_kernel(path: Path, value: int) -> Path:
    path.write_text(KERNEL.format(value=value))
    return path


def load(kernel: Path, name: str, **options):
    return jitk.load_jit(name, cpp_files=[kernel], cpp_wrappers=[("get", "get")], **options)


def fill(kernel: Path, cache_dir: Path, name: str) -> Path:
    """Builds `name` into `cache_dir` in a child process; returns its entry."""
    result = subprocess.run([sys.executable, "-c", LOAD, str(kernel), name],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, cache.CACHE_ENV: str(cache_dir)})
    assert result.returncode == 0, result.stderr
    [entry] = cache_dir.glob(f"{name}_*/")
    return entry


# ------------------------------------------------------------------------------ build_directory
def test_a_folder_jitk_did_not_make_is_refused_and_left_as_it_was(tmp_path):
    kernel = write_kernel(tmp_path / "get.cuh", 1)
    mine = tmp_path / "work" / "mine"
    mine.mkdir(parents=True)
    (mine / "important.txt").write_text("keep me")
    with pytest.raises(ValueError, match=f"build_directory=...\\): {mine} is not empty and "
                       "holds no jitk build"):
        load(kernel, "refused", build_directory=mine)
    assert [p.name for p in mine.iterdir()] == ["important.txt"]
    assert (mine / "important.txt").read_text() == "keep me"
    assert [p.name for p in mine.parent.iterdir()] == ["mine"]  # nothing beside it

    with pytest.raises(ValueError, match=f"{tmp_path / 'get.cuh'} is a file, not a folder"):
        load(kernel, "refused", build_directory=kernel)


def test_a_build_directory_keeps_its_bookkeeping_inside_and_is_reused(tmp_path):
    kernel = write_kernel(tmp_path / "get.cuh", 1)
    build = tmp_path / "work" / "build"
    assert load(kernel, "inside", build_directory=build).get(1) == 2
    assert [p.name for p in build.parent.iterdir()] == ["build"]
    assert (build / cache.META_FILE).is_file() and (build / "inside.so").is_file()
    built = (build / "inside.so").stat().st_mtime_ns
    # A hit: nothing rebuilt, and a folder jitk built is its own to build in again.
    assert load(kernel, "inside", build_directory=build).get(2) == 3
    assert (build / "inside.so").stat().st_mtime_ns == built


def test_a_build_directory_rebuilds_when_anything_in_the_key_changes(tmp_path):
    kernel = tmp_path / "getter.cuh"
    kernel.write_text("#include <cstdint>\nint64_t get(int64_t x) { return x + VALUE; }\n")
    build = tmp_path / "build"

    def getter(*name_parts, value):
        return jitk.load_jit("getter", *name_parts, cpp_files=[kernel],
                             cpp_wrappers=[("get", "get")], build_directory=build,
                             extra_cflags=[f"-DVALUE={value}"])

    assert getter(value=1).get(10) == 11
    assert getter(value=2).get(10) == 12  # other flags
    assert getter(2, value=2).get(10) == 12  # other template arguments
    kernel.write_text("#include <cstdint>\nint64_t get(int64_t x) { return x * VALUE; }\n")
    assert getter(2, value=2).get(10) == 20  # an edited kernel file
    assert len(json.loads((build / cache.META_FILE).read_text())["key"]) == 64


# ------------------------------------------------------------------------------ trust
def test_a_world_writable_cache_is_refused_saying_how_to_fix_it(tmp_path, monkeypatch):
    kernel = write_kernel(tmp_path / "get.cuh", 1)
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv(cache.CACHE_ENV, str(root))
    with pytest.raises(jitk.JitCacheTrustError, match=f"will not use the cache {root}: anyone "
                       "on this machine can write to it. Remove that permission \\(chmod -R "
                       "o-w"):
        load(kernel, "open_to_all")
    assert list(root.iterdir()) == []  # nothing built elsewhere or here
    root.chmod(0o755)
    assert load(kernel, "open_to_all").get(1) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the cache to another user")
def test_a_cache_of_another_user_is_trusted_only_through_its_group(tmp_path, monkeypatch):
    kernel = write_kernel(tmp_path / "get.cuh", 1)
    root = tmp_path / "cache"
    entry = fill(kernel, root, "foreign")
    for path in (root, entry, *entry.iterdir()):
        os.chown(path, 54321, 54321)
    root.chmod(0o2775)  # a team's cache: group-writable, new files take its group
    monkeypatch.setenv(cache.CACHE_ENV, str(root))
    with pytest.raises(jitk.JitCacheTrustError, match=f"will not use the cache {root}: it is "
                       "owned by uid 54321, not by you \\(root\\), and its group 54321 is not "
                       "trusted. If you trust that group's members, set "
                       "JITK_CACHE_TRUSTED_GROUP=54321"):
        load(kernel, "foreign")
    monkeypatch.setenv(trust.TRUSTED_GROUP_ENV, "54321")
    assert load(kernel, "foreign").get(1) == 2
    monkeypatch.setenv(trust.TRUSTED_GROUP_ENV, "no-such-group-anywhere")
    with pytest.raises(ValueError, match="JITK_CACHE_TRUSTED_GROUP='no-such-group-anywhere' "
                       "names no group"):
        load(kernel, "foreign")


def test_a_group_writable_entry_of_an_untrusted_group_is_refused(tmp_path, monkeypatch):
    kernel = write_kernel(tmp_path / "get.cuh", 1)
    entry = fill(kernel, tmp_path / "cache", "grouped")
    group = 54321 if os.geteuid() == 0 else os.getgid()
    os.chown(entry, -1, group)
    entry.chmod(0o775)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    if trust._is_private_group(group, os.geteuid()):
        pytest.skip("the only group this user can give is its own private group")
    with pytest.raises(jitk.JitCacheTrustError, match=f"will not use the cache entry {entry}: "
                       "members of group .* can write to it"):
        load(kernel, "grouped")


@pytest.mark.parametrize("escape", ["../evil/evil.so", "absolute"])
def test_a_library_outside_its_entry_is_never_loaded(tmp_path, monkeypatch, escape):
    good = write_kernel(tmp_path / "good.cuh", 1)
    entry = fill(good, tmp_path / "cache", "escape")
    evil = fill(write_kernel(tmp_path / "evil.cuh", 666), tmp_path / "evil_cache", "evil")
    (tmp_path / "cache" / "evil").mkdir()
    shutil.copy(evil / "evil.so", tmp_path / "cache" / "evil" / "evil.so")
    meta = cache.read_meta(entry)
    meta["library"] = escape if escape != "absolute" else str(evil / "evil.so")
    meta["sha256"] = cache.digest(evil / "evil.so")
    (entry / cache.META_FILE).write_text(json.dumps(meta))
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    with jitk.disable_jit(), pytest.raises(jitk.JitCacheMissError, match="names .*, not a "
                                           "file in the entry"):
        load(good, "escape")
    assert load(good, "escape").get(0) == 1  # rebuilt


def test_the_library_loaded_is_the_one_checked(tmp_path, monkeypatch):
    """A library swapped for another between its check and its load changes nothing."""
    good = write_kernel(tmp_path / "good.cuh", 1)
    entry = fill(good, tmp_path / "cache", "swapped")
    evil = fill(write_kernel(tmp_path / "evil.cuh", 666), tmp_path / "evil_cache", "swapped")
    checked = cache.look_up

    def check_then_swap(*args, **kwargs):
        found = checked(*args, **kwargs)
        if found.library:
            shutil.copy(evil / "swapped.so", entry / "swapped.new")
            (entry / "swapped.new").replace(entry / "swapped.so")
        return found

    monkeypatch.setattr(cache, "look_up", check_then_swap)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    assert load(good, "swapped").get(0) == 1


def test_libraries_loaded_one_after_another_each_run_their_own_code(tmp_path):
    """A library is loaded as /proc/self/fd/N, and the dynamic loader knows a library by that
    name: a closed N reused for the next library would be answered with the first one."""
    cache_dir = tmp_path / "cache"
    kernels = [write_kernel(tmp_path / f"k{i}.cuh", i) for i in range(3)]
    for i, kernel in enumerate(kernels):
        fill(kernel, cache_dir, f"one_of_three_{i}")
    script = "import sys\n" + "\n".join(
        f"sys.argv[1:] = [{str(kernel)!r}, 'one_of_three_{i}']\n" + LOAD
        for i, kernel in enumerate(kernels))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, cache.CACHE_ENV: str(cache_dir)})
    assert result.stdout.split() == ["0", "1", "2"], result.stdout + result.stderr


def test_lock_files_are_not_world_writable(tmp_path):
    path = tmp_path / "locks" / "entry.lock"
    umask = os.umask(0)
    try:
        fd = lock.try_lock(path)
    finally:
        os.umask(umask)
    lock.release(fd)
    assert path.stat().st_mode & 0o777 == 0o664  # read by all, written by owner and group
    assert path.parent.stat().st_mode & 0o777 == 0o755


def test_what_jitk_builds_into_a_cache_only_its_owner_can_write(tmp_path, monkeypatch):
    kernel = write_kernel(tmp_path / "get.cuh", 1)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    umask = os.umask(0)
    try:
        load(kernel, "private_modes")
    finally:
        os.umask(umask)
    [entry] = (tmp_path / "cache").glob("private_modes_*/")
    for path in (tmp_path / "cache", entry, *entry.iterdir()):
        assert not path.stat().st_mode & 0o022, path


# ------------------------------------------------------------------------------ hosts
# argv: kernels. Loads each module in a random order, checking what each returns.
HOST_LOADER = textwrap.dedent("""\
    import json, os, random, socket, sys
    sys.modules["torch"] = None
    import jitk
    from jitk.build import jit
    failures = []
    for i in random.sample(range(len(sys.argv) - 1), len(sys.argv) - 1):
        try:
            module = jitk.load_jit(f"shared{i}", cpp_files=[sys.argv[1 + i]],
                                   cpp_wrappers=[("get", "get")])
            if module.get(0) != 100 + i:
                failures.append(f"shared{i} returned {module.get(0)}")
        except Exception as error:
            failures.append(f"shared{i}: {type(error).__name__}: {error}")
    print(json.dumps({"host": socket.gethostname(), "built": jit.build_count(),
                      "failures": failures}), flush=True)
""")

# argv: cache, stop file. Prunes every entry, again and again, until the stop file exists.
PRUNER = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from jitk.build import cache, pruning
    root, stop = Path(sys.argv[1]), Path(sys.argv[2])
    removed, failures = 0, []
    (root.parent / "pruner-ready").touch()  # importing jitk (and torch) takes seconds
    while not stop.exists():
        entries = cache.list_entries(root)  # every architecture's last entry goes too
        everything = pruning.select_for_pruning(entries, older_than_days=0,
                                                targets=[e.archs for e in entries])
        gone, failed = cache.prune(everything, root)
        removed, failures = removed + gone, failures + failed
        time.sleep(0.5)
    print("removed", removed, "failures", failures)
""")

# argv: cache, stop file. Reads every published entry, again and again: one seen at its
# published place without its record or with a library other than the recorded one is
# incomplete (a folder moved to the trash is being deleted: not counted).
WATCHER = textwrap.dedent("""\
    import hashlib, json, os, sys
    from pathlib import Path
    root, stop = Path(sys.argv[1]), Path(sys.argv[2])
    seen, incomplete = 0, []

    def read(folder, name):
        with open(os.open(name, os.O_RDONLY, dir_fd=folder), "rb") as file:
            return file.read()

    while not stop.exists():
        for entry in root.iterdir() if root.is_dir() else ():
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            try:
                folder = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue  # removed meanwhile
            try:
                try:
                    meta = json.loads(read(folder, "jitk-meta.json"))
                    library = read(folder, meta["library"])
                    whole = hashlib.sha256(library).hexdigest() == meta["sha256"]
                except (OSError, ValueError, KeyError) as error:
                    whole, library = False, repr(error)
                try:
                    still_published = os.stat(entry).st_ino == os.fstat(folder).st_ino
                except OSError:
                    still_published = False
                if still_published:
                    seen += 1
                    if not whole:
                        incomplete.append(f"{entry.name}: {library[:80]}")
            finally:
                os.close(folder)
    print("seen", seen, "incomplete", incomplete)
""")


def host_command(local: Path, host: str) -> list[str] | None:
    """The command prefix that runs a command as on another host: its own mount and UTS
    namespaces, its own hostname and a private file system at `local` (its temporary
    folder), with `local`'s staging and lock folders made; None where unshare is refused."""
    script = (f'mount -t tmpfs tmpfs "{local}" && hostname {host} && '
              f'mkdir "{local}/staging" "{local}/locks" && exec "$@"')
    for unshare in (["unshare", "-m", "-u"], ["unshare", "-r", "-m", "-u"]):
        if shutil.which("unshare") is None:
            return None
        probe = subprocess.run([*unshare, "sh", "-c", script, "sh", "hostname"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode == 0 and probe.stdout.strip() == host:
            return [*unshare, "sh", "-c", script, "sh"]
    return None


def test_two_hosts_share_a_cache_while_a_third_prunes(tmp_path):
    """Two simulated hosts (separate mount and UTS namespaces: hostnames hostA and hostB,
    each with its own staging and lock folders on a private tmpfs) share one cache
    directory; each runs 4 processes that build and load the same 3 modules, while a third
    process prunes every entry every 0.5 s and a fourth checks every entry it sees.
    Where unshare is refused, the hosts are simulated by their own staging and lock
    folders alone (same hostname)."""
    root, stop = tmp_path / "cache", tmp_path / "stop"
    kernels = [str(write_kernel(tmp_path / f"shared{i}.cuh", 100 + i)) for i in range(3)]
    env = {**os.environ, cache.CACHE_ENV: str(root), "JITK_VERBOSE": "1"}
    hosts = []
    for host in ("hostA", "hostB"):
        local = tmp_path / host
        local.mkdir()
        prefix = host_command(local, host)
        if prefix is None:  # no namespaces here: folders of its own, on the same machine
            (local / "staging").mkdir()
            (local / "locks").mkdir()
            prefix = []
        hosts.append((prefix, {**env, staging.STAGING_ENV: str(local / "staging"),
                               lock.LOCK_DIR_ENV: str(local / "locks")}))
    started = time.monotonic()
    helpers = [subprocess.Popen([sys.executable, "-c", script, str(root), str(stop)],
                                stdout=subprocess.PIPE, text=True, env=env)
               for script in (PRUNER, WATCHER)]
    ready = root.parent / "pruner-ready"
    while not ready.exists() and time.monotonic() - started < 120:
        time.sleep(0.1)
    assert ready.exists(), "the pruner did not start within 120 s"
    loaders = [subprocess.Popen([*prefix, sys.executable, "-c", HOST_LOADER, *kernels],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=host_env)
               for prefix, host_env in hosts for _ in range(4)]
    try:
        outputs = [loader.communicate(timeout=240) for loader in loaders]
    finally:
        stop.touch()
        for process in loaders:
            process.kill()
        pruned, watched = (helper.communicate(timeout=60)[0] for helper in helpers)
    reports = [json.loads(out.splitlines()[-1]) for out, _ in outputs if out.strip()]
    assert len(reports) == 8, outputs
    assert all(report["failures"] == [] for report in reports), reports
    namespaces = all(prefix for prefix, _ in hosts)
    assert sorted({r["host"] for r in reports}) == (["hostA", "hostB"] if namespaces
                                                    else [os.uname().nodename])
    assert pruned.startswith("removed ") and pruned.rstrip().endswith("failures []"), pruned
    assert int(pruned.split()[1]) > 0, pruned  # entries really went while hosts loaded
    seen = int(watched.split()[1])
    assert seen > 0 and watched.rstrip().endswith("incomplete []"), watched
    # Locks stayed on the hosts; every private copy was published or discarded.
    assert not list(root.glob("*.lock")) and not cache.staging_folders(root)
    assert time.monotonic() - started < 240
