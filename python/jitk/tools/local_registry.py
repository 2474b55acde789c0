"""A throw-away OCI registry on loopback, for the remote cache's tests, benchmark and GPU
acceptance: the CNCF Distribution registry (Debian's docker-registry) from PATH, else
unpacked (dpkg -x) from a carried `docker-registry_*.deb`, serving a free 127.0.0.1 port
with its own storage, all under a folder the caller owns.

    with local_registry.running(work, deb_dirs=[Path(".debs")]) as registry:
        os.environ["JITK_REMOTE_CACHE"] = registry.url + "/jitk"

    python -m jitk.tools.local_registry --work DIR [--deb-dir D ...]
        prints oci://127.0.0.1:PORT on one line, serves until SIGTERM or SIGINT (or until
        its parent exits), then stops the registry.

Inside `work` it writes registry.yml, registry.log, storage/ and (from a .deb) deb/; it
deletes nothing: `work` and what is in it stay the caller's to remove."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from jitk.base.errors import ArgumentError, JitkError

START_SECONDS = 20.0  # the registry's first answer
STOP_SECONDS = 10.0  # after SIGTERM, before SIGKILL; again after SIGKILL
UNPACK_SECONDS = 120.0  # dpkg -x of the .deb
LOG_TAIL = 2000  # characters of the registry's log in an error


class LocalRegistryError(JitkError, RuntimeError):
    """The local registry could not be found, unpacked or started: the message says what
    was looked for or waited for, and ends with the tail of the registry's log."""


@dataclass(frozen=True)
class LocalRegistry:
    url: str  # oci://127.0.0.1:PORT; a remote cache adds its repository: url + "/jitk"
    log: Path  # the registry's output, one line a request
    pid: int


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def find_binary(work: Path, deb_dirs: Sequence[Path] = ()) -> str:
    """docker-registry on PATH, else the one in the first docker-registry_*.deb of
    `deb_dirs`, unpacked into work/deb."""
    found = shutil.which("docker-registry")
    if found:
        return found
    debs = [deb for folder in deb_dirs
            for deb in sorted(Path(folder).glob("docker-registry_*.deb"))]
    if not debs:
        where = ", ".join(str(folder) for folder in deb_dirs) or "no folder given"
        raise LocalRegistryError(
            f"no docker-registry on PATH and no docker-registry_*.deb in {where} "
            "(apt-get install docker-registry, or apt-get download docker-registry there)")
    work.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["dpkg", "-x", str(debs[0]), str(work / "deb")],
                              capture_output=True, text=True, timeout=UNPACK_SECONDS,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LocalRegistryError(f"dpkg -x {debs[0]} failed: {error}") from error
    if done.returncode != 0:
        raise LocalRegistryError(f"dpkg -x {debs[0]} failed (exit {done.returncode}): "
                                 f"{done.stderr[-LOG_TAIL:]}")
    return str(work / "deb" / "usr" / "bin" / "docker-registry")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-LOG_TAIL:]
    except OSError as error:
        return f"(no log: {error})"


def _wait_for_answer(process: subprocess.Popen, port: int, log: Path, seconds: float) -> None:
    name = process.args[0]
    probe = f"http://127.0.0.1:{port}/v2/"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: direct
    deadline = time.monotonic() + seconds
    while True:
        try:
            opener.open(probe, timeout=1).close()
            return
        except OSError as error:
            if process.poll() is not None:
                raise LocalRegistryError(
                    f"{name} exited (code {process.returncode}) before answering "
                    f"{probe}; its log ends:\n{_tail(log)}") from error
            if time.monotonic() > deadline:
                raise LocalRegistryError(
                    f"{name} did not answer {probe} in {seconds:g} s ({error}); "
                    f"its log ends:\n{_tail(log)}") from error
        time.sleep(0.1)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_SECONDS)


@contextmanager
def running(work: Path, *, deb_dirs: Sequence[Path] = (), binary: str | None = None,
            start_seconds: float = START_SECONDS) -> Iterator[LocalRegistry]:
    """A registry serving while the block runs, with its files in `work` (made if missing);
    stopped (SIGTERM, then SIGKILL, each wait bounded) when the block ends."""
    if not (isinstance(start_seconds, (int, float)) and start_seconds > 0):
        raise ArgumentError(f"local_registry.running: start_seconds must be a number > 0, "
                            f"got {start_seconds!r}")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    command = binary or find_binary(work, deb_dirs)
    port = _free_port()
    config = work / "registry.yml"
    config.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: "
                      f"{work / 'storage'}\nhttp:\n  addr: 127.0.0.1:{port}\n")
    log = work / "registry.log"
    with open(log, "w") as out:
        try:
            process = subprocess.Popen([command, "serve", str(config)], stdout=out,
                                       stderr=subprocess.STDOUT)
        except OSError as error:
            raise LocalRegistryError(f"could not start {command}: {error}") from error
    try:
        _wait_for_answer(process, port, log, start_seconds)
        yield LocalRegistry(f"oci://127.0.0.1:{port}", log, process.pid)
    finally:
        _stop(process)


class _Stopped(Exception):
    """SIGTERM or SIGINT came: leaving the block stops the registry."""


def _on_signal(number: int, frame: object) -> None:
    for each in (signal.SIGTERM, signal.SIGINT):  # a second one must not cut the stop short
        signal.signal(each, signal.SIG_IGN)
    raise _Stopped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jitk.tools.local_registry",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True,
                        help="folder for the registry's config, log and storage (yours)")
    parser.add_argument("--deb-dir", type=Path, action="append", default=[],
                        help="where to look for docker-registry_*.deb (repeatable)")
    parser.add_argument("--start-seconds", type=float, default=START_SECONDS,
                        help="bound on the registry's first answer")
    args = parser.parse_args(argv)
    parent = os.getppid()
    for number in (signal.SIGTERM, signal.SIGINT):  # from here on, also while starting
        signal.signal(number, _on_signal)
    try:
        with running(args.work, deb_dirs=args.deb_dir,
                     start_seconds=args.start_seconds) as registry:
            print(registry.url, flush=True)
            while os.getppid() == parent:  # serves until a signal, or until the parent is gone
                time.sleep(0.2)
    except _Stopped:
        return 0
    except JitkError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
