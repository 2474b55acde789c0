"""Compilers' version lines remembered in the cache (jitk/build/versions.py): a warm process
asks no compiler, a changed compiler file is asked again, and a kept line that others could
have written is not believed."""

import os
import stat
import subprocess

import pytest

from jitk.build import toolchain, versions


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """A compiler that says its version, in a cache of its own; no line known in-process."""
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()  # as a build makes it
    monkeypatch.setattr(toolchain, "_versions", {})
    monkeypatch.setattr(versions, "_PENDING", {})
    compiler = tmp_path / "fake-c++"

    def say(version):
        compiler.write_text(f"#!/bin/sh\necho 'fake c++ {version}'\n")
        compiler.chmod(0o755)
    say("1.0")
    return str(compiler), say


def asked(monkeypatch):
    """Counts the compilers run from here on."""
    runs = []
    real = subprocess.Popen

    def counting(*args, **kwargs):
        runs.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(subprocess, "Popen", counting)
    return runs


def test_a_warm_process_asks_no_compiler(fake_compiler, monkeypatch):
    compiler, _ = fake_compiler
    runs = asked(monkeypatch)
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"]
    assert len(runs) == 1
    kept = os.listdir(os.path.join(os.environ["JITK_CACHE_DIR"], versions.FOLDER))
    assert len(kept) == 1 and not kept[0].endswith(".tmp"), kept
    monkeypatch.setattr(toolchain, "_versions", {})  # as a new process
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"]
    assert len(runs) == 1


def test_a_changed_compiler_is_asked_again(fake_compiler, monkeypatch):
    compiler, say = fake_compiler
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"]
    say("2.0.1")  # another size and time: another file
    monkeypatch.setattr(toolchain, "_versions", {})
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 2.0.1"]


def test_a_line_others_could_have_written_is_not_believed(fake_compiler, monkeypatch):
    compiler, _ = fake_compiler
    toolchain.compiler_versions([compiler])
    [kept] = (versions._file(compiler).parent).iterdir()
    kept.write_text("planted 9.9\n")
    kept.chmod(kept.stat().st_mode | stat.S_IWOTH)
    monkeypatch.setattr(toolchain, "_versions", {})
    runs = asked(monkeypatch)
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"]
    assert len(runs) == 1


def test_no_cache_is_made_until_a_module_is(fake_compiler, monkeypatch, tmp_path):
    """Asked before the cache folder exists (a call refused before any build leaves none),
    a line is kept once a build or load has made the folder."""
    compiler, _ = fake_compiler
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path / "later"))
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"]
    assert not (tmp_path / "later").exists()
    (tmp_path / "later").mkdir()
    versions.keep_pending()
    monkeypatch.setattr(toolchain, "_versions", {})
    runs = asked(monkeypatch)
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"] and runs == []


def test_a_cache_that_cannot_be_written_keeps_nothing(fake_compiler, monkeypatch, tmp_path):
    """A cache where the folder cannot be made (a file of that name is there): the line is
    asked, and asked again by the next process; nothing is written or removed."""
    compiler, _ = fake_compiler
    blocker = tmp_path / "cache" / versions.FOLDER
    blocker.write_text("not a folder")
    runs = asked(monkeypatch)
    for _ in range(2):
        monkeypatch.setattr(toolchain, "_versions", {})
        assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"]
        versions.keep_pending()
    assert len(runs) == 2 and blocker.read_text() == "not a folder"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [versions.FOLDER]


def test_what_others_put_in_the_cache_outlives_remembering(fake_compiler, monkeypatch, tmp_path):
    """jitk deletes only what it made: a user's folder and files, a foreign lock and another
    process's look-alike temporary, in the cache and in .versions, survive a line being kept
    and a kept line being replaced."""
    compiler, say = fake_compiler
    cache = tmp_path / "cache"
    kept = cache / versions.FOLDER
    kept.mkdir()
    planted = [cache / "mine" / "important.txt", cache / "foreign.lock", kept / "user.txt",
               kept / "foreign.lock", kept / "mine" / "notes.txt",
               kept / f"{versions._file(compiler).name}.999999999.tmp"]
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not jitk's")
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 1.0"]
    say("2.0.1")
    monkeypatch.setattr(toolchain, "_versions", {})
    assert toolchain.compiler_versions([compiler]) == ["fake c++ 2.0.1"]
    assert all(path.read_text() == "not jitk's" for path in planted)
    lines = sorted(p.read_text() for p in kept.iterdir() if p.is_file() and p not in planted)
    assert lines == ["fake c++ 1.0\n", "fake c++ 2.0.1\n"], lines
