"""jitk.tools.local_registry: a real docker-registry starts, answers and is gone afterwards
(through the context manager and through `python -m jitk.tools.local_registry`); one that
exits at once or never answers is an error naming it, within the bound; the binary is found
on PATH or unpacked from a .deb. Every step that could hang runs in a subprocess with a
timeout."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import PYTHON_PATH

from jitk.tools import local_registry

SECONDS = 60  # one child: import jitk, start a registry, probe it, stop it
needs_registry = pytest.mark.skipif(
    shutil.which("docker-registry") is None,
    reason="no docker-registry binary (apt-get install -y docker-registry)")

# Prints what it saw inside the block; the test looks again after the child has ended.
INSIDE = """
import json, sys, time, urllib.request
from pathlib import Path
from jitk.tools import local_registry
work, binary, seconds = Path(sys.argv[1]), sys.argv[2] or None, float(sys.argv[3])
started = time.monotonic()
try:
    with local_registry.running(work, binary=binary, start_seconds=seconds) as registry:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        probe = registry.url.replace("oci://", "http://") + "/v2/"
        with opener.open(probe, timeout=5) as answer:
            status = answer.status
        command = Path(f"/proc/{registry.pid}/cmdline").read_bytes().split(b"\\0")
    print(json.dumps({"url": registry.url, "status": status,
                      "command": [part.decode() for part in command if part]}))
except local_registry.LocalRegistryError as error:
    assert isinstance(error, RuntimeError)
    print(json.dumps({"error": str(error), "seconds": time.monotonic() - started}))
"""


def _inside(work: Path, binary: str = "", seconds: float = 20) -> dict:
    env = {**os.environ, "PYTHONPATH": PYTHON_PATH}
    done = subprocess.run([sys.executable, "-c", INSIDE, str(work), binary, str(seconds)],
                          env=env, capture_output=True, text=True, timeout=SECONDS,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _serving(config: Path) -> list[int]:
    """Processes whose command line names this config file, stopped here if any are left."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(config).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    for pid in found:  # a failing test leaves nothing behind
        os.kill(pid, signal.SIGKILL)
    return found


@needs_registry
def test_a_registry_answers_and_is_gone_after_the_block(tmp_path):
    seen = _inside(tmp_path)
    assert seen["status"] == 200, seen
    assert seen["command"][1:] == ["serve", str(tmp_path / "registry.yml")], seen
    port = int(seen["url"].rsplit(":", 1)[1])
    assert seen["url"] == f"oci://127.0.0.1:{port}"
    left = _serving(tmp_path / "registry.yml")
    assert not _port_open(port) and left == []
    assert f"rootdirectory: {tmp_path / 'storage'}\n" in (tmp_path / "registry.yml").read_text()


def test_a_binary_that_exits_at_once_is_an_error_before_the_bound(tmp_path):
    seen = _inside(tmp_path, "/bin/false", 30)
    assert "/bin/false exited (code 1) before answering http://127.0.0.1:" in seen["error"]
    assert seen["seconds"] < 15, seen


def _silent(path: Path) -> Path:
    """A stand-in registry that writes to its log and never answers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport time\nprint('listening soon', flush=True)\n"
                    "time.sleep(300)\n")
    path.chmod(0o755)
    return path


def test_a_registry_that_never_answers_is_stopped_after_the_bound(tmp_path):
    silent = _silent(tmp_path / "silent")
    seen = _inside(tmp_path / "work", str(silent), 1)
    assert f"{silent} did not answer http://127.0.0.1:" in seen["error"]
    assert " in 1 s " in seen["error"] and "listening soon" in seen["error"]  # the log's tail
    assert 1 <= seen["seconds"] < 15, seen
    assert _serving(tmp_path / "work" / "registry.yml") == []


@needs_registry
def test_the_command_prints_the_url_and_stops_on_sigterm(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHON_PATH}
    command = [sys.executable, "-m", "jitk.tools.local_registry", "--work", str(tmp_path)]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert select.select([server.stdout], [], [], SECONDS)[0], "no URL printed"
            url = server.stdout.readline().strip()
            port = int(url.rsplit(":", 1)[1])
            assert url == f"oci://127.0.0.1:{port}" and _port_open(port)
            server.send_signal(signal.SIGTERM)
            assert server.wait(SECONDS) == 0
        finally:
            server.kill()
            left = _serving(tmp_path / "registry.yml")
    assert not _port_open(port) and left == []


@pytest.mark.skipif(not (shutil.which("dpkg") and shutil.which("dpkg-deb")),
                    reason="no dpkg and dpkg-deb (Debian's) to make and unpack a .deb")
def test_the_binary_comes_from_a_deb_when_none_is_on_path(tmp_path, monkeypatch):
    package = tmp_path / "package"
    (package / "DEBIAN").mkdir(parents=True)
    (package / "DEBIAN" / "control").write_text(
        "Package: docker-registry\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: jitk tests <tests@jitk.invalid>\nDescription: a stand-in\n")
    (package / "usr" / "bin").mkdir(parents=True)
    (package / "usr" / "bin" / "docker-registry").write_text("#!/bin/sh\n")
    debs = tmp_path / "debs"
    debs.mkdir()
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(package),
                    str(debs / "docker-registry_1.0_all.deb")],
                   check=True, capture_output=True, timeout=SECONDS)
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "docker-registry"
                        else which(name))
    found = local_registry.find_binary(tmp_path / "work", [tmp_path / "none", debs])
    assert found == str(tmp_path / "work" / "deb" / "usr" / "bin" / "docker-registry")
    assert Path(found).read_text() == "#!/bin/sh\n"


def test_no_binary_and_no_deb_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(local_registry.LocalRegistryError, match=r"no docker-registry on PATH "
                       r"and no docker-registry_\*\.deb in .*/debs"):
        local_registry.find_binary(tmp_path, [tmp_path / "debs"])
    for wrong in (0, float("nan"), "20"):
        with pytest.raises(ValueError, match=f"start_seconds must be a number > 0, got {wrong!r}"):
            with local_registry.running(tmp_path, start_seconds=wrong):
                pass


def test_sigterm_while_starting_stops_the_registry_too(tmp_path):
    silent = _silent(tmp_path / "bin" / "docker-registry")
    env = {**os.environ, "PYTHONPATH": PYTHON_PATH,
           "PATH": f"{silent.parent}{os.pathsep}{os.environ['PATH']}"}
    work = tmp_path / "work"
    command = [sys.executable, "-m", "jitk.tools.local_registry", "--work", str(work),
               "--start-seconds", "300"]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as server:
        try:
            deadline = time.monotonic() + SECONDS
            while "listening soon" not in _log(work) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "listening soon" in _log(work), "the stand-in never started"
            server.send_signal(signal.SIGTERM)
            assert server.wait(SECONDS) == 0
            assert server.stdout.read() == ""  # no URL: it never answered
        finally:
            server.kill()
            left = _serving(work / "registry.yml")
    assert left == []


def _log(work: Path) -> str:
    try:
        return (work / "registry.log").read_text()
    except FileNotFoundError:
        return ""
