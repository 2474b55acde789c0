"""jitk removes only what it can prove it made: entries by their name and record, lock files,
private copies and trash by the names jitk gives them. A user's folder, another program's
lock and a look-alike record survive every command that removes anything; a damaged record
never crashes a command; a failed copy into the cache leaves nothing behind.

The commands run in a subprocess with a timeout."""

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitk.base.errors import JitkError, SettingError
from jitk.build import cache, names, pch, staging, toolchain
from jitk.build.builder import host_half_flags

DAY = 86400


def jitk_cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitk", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def own_entry(cache_dir: Path, name: str, key: str, days: float) -> Path:
    """An entry as jitk names and records it (no library: nothing here loads it)."""
    entry = cache_dir / f"{name}_{key}_sm90"
    entry.mkdir(parents=True)
    cache.write_meta(entry, {"module": name, "key": key, "library": f"{name}.so",
                             "sha256": "0" * 64, "archs": ["9.0"], "headers": {},
                             "built_at": time.time() - DAY * days})
    return entry


def plant_foreign(folder: Path) -> list[Path]:
    """What jitk did not make: a user's project, other programs' locks, a look-alike record."""
    project = folder / "proj"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.c").write_text("int main(void) { return 0; }\n")
    (folder / "poetry.lock").write_text("# another program's lock\n")
    (folder / "other-app.lock").write_text("")
    lookalike = folder / "notes"
    lookalike.mkdir()
    (lookalike / cache.META_FILE).write_text(json.dumps({"module": "notes", "built_at": 1}))
    return [project / "src" / "main.c", folder / "poetry.lock", folder / "other-app.lock",
            lookalike / cache.META_FILE]


@pytest.fixture(params=["locks beside the cache", "locks in JITK_LOCK_DIR"])
def planted(request, tmp_path):
    cache_dir, lock_dir = tmp_path / "cache", tmp_path / "locks"
    cache_dir.mkdir()
    lock_dir.mkdir()
    env = {"JITK_CACHE_DIR": str(cache_dir)}
    if request.param.endswith("JITK_LOCK_DIR"):
        env["JITK_LOCK_DIR"] = str(lock_dir)
    locks = lock_dir if "JITK_LOCK_DIR" in env else cache_dir
    old = own_entry(cache_dir, "twice", "0123456789abcdef", 10)
    new = own_entry(cache_dir, "twice", "fedcba9876543210", 1)
    damaged = cache_dir / "twice_00000000000000aa"  # jitk's name, a record of the wrong shape
    damaged.mkdir()
    (damaged / cache.META_FILE).write_text(json.dumps(
        {"format": cache.FORMAT, "module": "twice", "key": "aa", "library": "twice.so",
         "sha256": "0" * 64, "headers": {}, "built_at": "yesterday", "archs": 5}))
    own_locks = [locks / f"{entry.name}.lock" for entry in (old, new, damaged)]
    for path in own_locks:
        path.write_text("123 somehost\n")  # nobody holds it
    foreign = plant_foreign(cache_dir) + plant_foreign(lock_dir)
    return env, cache_dir, {"old": old, "new": new, "damaged": damaged}, own_locks, foreign


@pytest.mark.parametrize("command, gone", [
    (["cache", "clear"], {"old", "new", "damaged"}),
    (["cache", "prune", "--keep", "0"], {"old", "damaged"}),
    (["cache", "prune", "--max-size", "0"], {"old", "damaged"}),
    (["cache", "prune", "--older-than", "5"], {"old"}),
    (["cache", "prune", "--keep", "0", "--dry-run"], set()),
])
def test_commands_remove_only_what_jitk_made(planted, command, gone):
    env, cache_dir, entries, own_locks, foreign = planted
    done = jitk_cli(env, *command)
    assert done.returncode == 0, done.stderr
    assert all(path.exists() for path in foreign), done.stdout
    assert {name for name, path in entries.items() if not path.exists()} == gone
    if "--dry-run" in command:
        assert all(path.exists() for path in own_locks)
    else:
        assert not any(path.exists() for path in own_locks)
        assert "left 2 folders jitk did not make: notes, proj" in done.stdout


def test_a_damaged_record_is_listed_as_such_and_crashes_no_command(planted):
    env, cache_dir, entries, _, _ = planted
    listed = jitk_cli(env, "cache")
    assert listed.returncode == 0, listed.stderr
    assert "3 module(s) cached" in listed.stdout
    assert f"{entries['damaged'].name} (damaged: its {cache.META_FILE} field 'archs' is 5, " \
           "expected list)" in listed.stdout
    report = jitk_cli(env, "env", "--json")
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["cache"]["entries"] == 3


def test_private_copies_and_trash_go_only_by_jitk_names(tmp_path):
    cache_dir = tmp_path / "cache"
    dead = cache_dir / cache.STAGING_DIR / "twice_0123456789abcdef.otherhost-1-2"
    strangers = [cache_dir / cache.STAGING_DIR / "notes", cache_dir / cache.TRASH_DIR / "notes"]
    trashed = cache_dir / cache.TRASH_DIR / "twice_0123456789abcdef.otherhost-1-3"
    for folder in (dead, trashed, *strangers):
        folder.mkdir(parents=True)
        (folder / "file").write_text("x")
    old = time.time() - 2 * names.FOREIGN_COPY_SECONDS
    os.utime(dead, (old, old))
    os.utime(strangers[0], (old, old))
    assert cache.clear(cache_dir) == (0, [])
    assert not dead.exists() and not trashed.exists()
    assert all((folder / "file").exists() for folder in strangers)


def test_a_failed_copy_into_the_cache_is_removed_and_named(tmp_path, monkeypatch):
    staging, entry = tmp_path / "build", tmp_path / "cache" / "twice_0123456789abcdef"
    staging.mkdir()
    for name in ("twice.so", cache.META_FILE):
        (staging / name).write_bytes(b"x" * 4096)

    def fill_the_disk(source, target):
        Path(target).write_bytes(Path(source).read_bytes()[:100])  # a partial copy
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache.shutil, "copyfile", fill_the_disk)
    with pytest.raises(cache.CacheWriteError) as info:
        cache.copy_in(staging, entry)
    assert isinstance(info.value, JitkError) and isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOSPC
    assert f"the build of {entry.name}" in str(info.value) and "ENOSPC" in str(info.value)
    assert list((entry.parent / cache.STAGING_DIR).iterdir()) == []


@pytest.mark.parametrize("variable, call", [
    ("JITK_STAGING_DIR", lambda: staging.new_staging(Path("/nowhere/twice_0123456789abcdef"))),
    ("JITK_CACHE_DIR", cache.cache_root),
])
def test_a_folder_setting_that_names_a_file_is_a_setting_error(tmp_path, monkeypatch,
                                                                variable, call):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv(variable, str(a_file))
    with pytest.raises(SettingError, match=f"{variable}='{a_file}' is a file"):
        call()


def test_a_damaged_neighbour_entry_is_passed_over_by_the_covering_lookup(tmp_path):
    """load_jit reads the records of entries built for other architectures when its exact
    entry is missing; a record with a field of the wrong type there is skipped, not a
    TypeError in the caller's load."""
    import json
    from types import SimpleNamespace

    from jitk.build import entries as lookup

    key = "a" * 64
    prefix = lookup.folder_name("mod", key, ())
    damaged = tmp_path / f"{prefix}_sm80"
    damaged.mkdir()
    (damaged / "jitk-meta.json").write_text(json.dumps({"archs": 5, "built_at": "yesterday"}))
    spec = SimpleNamespace(name="mod", entry=tmp_path / f"{prefix}_sm90", archs=("9.0",))
    assert lookup.covering_entries(spec, key) == []


def test_the_host_prelude_removes_only_its_own_abandoned_folders(tmp_path, monkeypatch):
    """Building a host prelude (jitk/build/pch.py) clears .pch of its own private folders
    whose builder has ended, and nothing else: a user's folder, another program's lock, a
    look-alike name, and a private folder of a builder still alive all stay."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JITK_HOST_PRELUDE", "1")
    flags = host_half_flags(("9.0",), [str(pch.INCLUDE)])  # a host half's, as builds use
    built = pch.build(toolchain.host_compiler(), flags)
    assert built is not None
    folder = built.folder
    kept = built.depfile.read_text()
    gone_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    host = names.host()
    dead = folder.parent / f"{folder.name}.{host}-{gone_pid}-1"  # a killed builder's
    alive = folder.parent / f"{folder.name}.{host}-{os.getpid()}-2"  # this process's
    lookalike = folder.parent / f"{folder.name}-{host}-{gone_pid}-3"  # not a name jitk gives
    for made in (dead, alive, lookalike):
        made.mkdir()
        (made / "prelude.h").write_text("// half a build\n")
    foreign = plant_foreign(folder.parent)
    for path in folder.iterdir():  # the prelude itself, so that the next call builds again
        path.unlink()
    folder.rmdir()
    again = pch.build(toolchain.host_compiler(), flags)
    assert again == built and again.depfile.read_text() == kept
    assert not dead.exists()
    assert alive.is_dir() and lookalike.is_dir()
    assert all(path.exists() for path in foreign)
