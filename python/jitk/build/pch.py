"""The host halves' precompiled header: jitk/host_prelude.h (jitk's host headers, tvm-ffi's,
the CUDA runtime's and the standard ones that every host half reads first) compiled once per
host compiler, flags and header set, and given to every host half with -include, so that no
build parses those headers again. A compiler that cannot use the precompiled file reads the
prelude as text instead: the same code, the old speed. Beside it, jitk's host runtime
(JITK_RUNTIME in jitk/utils.h: the argument checks and NVRTC loading that every module would
otherwise compile anew) is compiled once into an object that every library built with the
prelude links, so no build generates that code again. The first build that wants a prelude
does not wait for it: it starts the prelude's build beside its own, on a thread, and goes
without; the builds after it use it (a process that ends first finishes that build).

A prelude lives in the cache at .pch/<key>/ (a dot folder, which the entry listing, prune and
clear never take for an entry), and is used only where nobody but the user (and whom they
trust, jitk/build/trust.py) could have written it. The key covers the compiler's version line,
the flags, the tvm-ffi version and the bytes of every header jitk ships and of the CUDA
runtime's version header, so a folder, once there, never changes: it is built in a private
folder under a lock and renamed into place. The headers its build read (its dependency file)
join the record of every entry built with it (builder.package_headers), so a header edit still
rebuilds exactly the entries that read it. Of what is in .pch, jitk removes only its own
private folders whose builder is gone (jitk/build/names.py); nothing removes a prelude."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import tvm_ffi

from jitk.base import settings
from jitk.build import cache, toolchain, trust
from jitk.build.lock import JitLockError, build_lock, lock_path, lock_timeout
from jitk.build.names import abandoned, is_private_copy_of, private_name

logger = logging.getLogger("jitk")

FOLDER = ".pch"
HEADER = "prelude.h"
RUNTIME = "runtime.o"
GOLD = "links-with-gold"  # there when _links_with_gold found that gold links
# Only a host half built with the prelude declares the runtime without defining it, so the
# two are made and used together.
_LINKED = "#define JITK_RUNTIME_LINKED 1\n#include <jitk/host_prelude.h>\n"
_BUILT = (f"{HEADER}.gch", RUNTIME)  # a prelude is there once both are
INCLUDE = Path(__file__).resolve().parents[1] / "include"  # the package's headers


def unit_preamble(first: bool) -> str:
    """The first lines of one of a host half's several units (load_jit's host_units): where
    no prelude was read first, the first unit defines the runtime, as the prelude's object
    would, and the others only declare it, so that the library holds one copy."""
    define = "#define JITK_RUNTIME_DEFINE 1\n" if first else ""
    return f"#ifndef JITK_RUNTIME_LINKED\n{define}{_LINKED}#endif\n"


@dataclass(frozen=True)
class Prelude:
    folder: Path

    @property
    def depfile(self) -> Path:  # the headers the precompiled build read, make-style
        return self.folder / "prelude.d"

    def flags(self) -> list[str]:
        """The host half's: -include names the header; its .gch sits beside it."""
        return ["-include", str(self.folder / HEADER)]

    def link_inputs(self) -> list[str]:
        """The link's: the runtime object that the host half only declares, and gold where
        the prelude's build found that it links with this compiler (_links_with_gold)."""
        gold = ["-fuse-ld=gold"] if (self.folder / GOLD).is_file() else []
        return [*gold, str(self.folder / RUNTIME)]


def _built(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _BUILT)


def _folder(compiler: str, flags: list[str]) -> Path:
    """Where the prelude for `compiler` and `flags` is: .pch/<key> in the cache."""
    digest = hashlib.sha256()
    runtime = toolchain.cuda_home() / "include" / "cuda_runtime_api.h"
    # The path too: two installs of one version may differ (its libraries, gold or not).
    material = {"compiler": [compiler, *toolchain.compiler_versions([compiler])],
                "flags": flags, "tvm_ffi": tvm_ffi.__version__, "cuda": cache.digest(runtime)}
    digest.update(json.dumps(material, sort_keys=True).encode())
    for path in sorted(p for p in INCLUDE.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(INCLUDE)).encode())
        digest.update(path.read_bytes())
    return cache.cache_root() / FOLDER / digest.hexdigest()


_started: set[Path] = set()  # the preludes this process has begun to build
_started_lock = threading.Lock()


def prelude(compiler: str, flags: list[str]) -> Prelude | None:
    """The precompiled prelude for host halves built by `compiler` with `flags` if it is
    built; else None, and its build starts on a thread (once a process) for later builds.
    None under JITK_HOST_PRELUDE=0."""
    if not settings.flag("JITK_HOST_PRELUDE"):
        return None
    folder = _folder(compiler, flags)
    if _built(folder):
        # The compiler and linker read it as code: only one that others could not have written.
        for path in (folder.parent, folder, folder / HEADER, *(folder / n for n in _BUILT)):
            try:
                reason = trust.problem(os.stat(path))
            except OSError as error:
                reason = str(error)
            if reason:
                logger.warning("jitk: not using the host prelude %s: %s", path, reason)
                return None
        return Prelude(folder)
    with _started_lock:
        if folder in _started:
            return None
        _started.add(folder)
    # Not a daemon: a process that ends sooner finishes it first (a compile that the lock's
    # timeout bounds), or a run of short processes would never leave one behind.
    threading.Thread(target=_build_or_none, args=(compiler, flags, folder),
                     name="jitk-prelude").start()
    return None


def build(compiler: str, flags: list[str]) -> Prelude | None:
    """The prelude for `compiler` and `flags`, built now if it is not there; None when it
    cannot be built (a read-only cache, a compiler without precompiled headers): builds
    then go on without it. None under JITK_HOST_PRELUDE=0."""
    if not settings.flag("JITK_HOST_PRELUDE"):
        return None
    return _build_or_none(compiler, flags, _folder(compiler, flags))


def _build_or_none(compiler: str, flags: list[str], folder: Path) -> Prelude | None:
    try:
        return _build(compiler, flags, folder)
    except (OSError, JitLockError) as error:
        logger.info("jitk: no host prelude (%s); building without it", error)
        return None


def _build(compiler: str, flags: list[str], folder: Path) -> Prelude | None:
    found = Prelude(folder)
    if _built(folder):
        return found
    cache.make_folder(folder.parent)
    with build_lock(lock_path(folder), folder):
        if _built(folder):  # another process built it meanwhile
            return found
        for stale in folder.parent.iterdir():  # jitk's, by name, whose builder has ended
            if is_private_copy_of(stale.name, folder) and abandoned(stale):
                shutil.rmtree(stale, ignore_errors=True)
        private = folder.parent / private_name(folder)
        private.mkdir(mode=trust.folder_mode())
        if not _compile(compiler, flags, private):
            shutil.rmtree(private, ignore_errors=True)
            return None
        os.rename(private, folder)
    return found


def _compile(compiler: str, flags: list[str], folder: Path) -> bool:
    """The precompiled header and the runtime object, compiled side by side in `folder`."""
    (folder / HEADER).write_text(_LINKED)
    (folder / "runtime.cpp").write_text("#define JITK_RUNTIME_DEFINE 1\n" + _LINKED)
    commands = [[compiler, *flags, "-x", "c++-header", HEADER, "-o", f"{HEADER}.gch", "-MMD",
                 "-MF", "prelude.d"],
                [compiler, *flags, "-c", "runtime.cpp", "-o", RUNTIME]]
    running, failed = [], None
    for command in commands:
        try:
            running.append(subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True, errors="replace"))
        except OSError as error:
            failed = f"cannot run {compiler}: {error.strerror}"
            break
    deadline = time.monotonic() + lock_timeout()
    for command, process in zip(commands, running):  # every started compile is reaped
        try:
            _, err = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            failed = failed or f"it took over {lock_timeout():g} s"
            continue
        if process.returncode != 0:
            failed = failed or f"{' '.join(command[-4:])} failed:\n{err[-2000:]}"
    if failed:
        logger.info("jitk: no host prelude (%s): %s; building without it", compiler, failed)
    elif _links_with_gold(compiler, folder):
        (folder / GOLD).write_text("-fuse-ld=gold\n")
    return failed is None


def _links_with_gold(compiler: str, folder: Path) -> bool:
    """Whether `compiler` links the runtime into a shared library with gold, which links a
    module's library in a fraction of GNU ld's time. Installed is not enough: gold finds
    only the libraries GNU ld would where the compiler is the system's (a compiler under
    /opt may hand it a library folder it cannot read). It links the same code either way,
    so the choice is not in any key."""
    if not shutil.which("ld.gold"):
        return False
    probe = folder / "gold_probe.so"
    try:
        done = subprocess.run([compiler, "-shared", "-fuse-ld=gold", RUNTIME, "-o", probe.name],
                              cwd=folder, capture_output=True, timeout=lock_timeout(),
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        probe.unlink(missing_ok=True)  # made here, in the prelude's private folder
    return done.returncode == 0
