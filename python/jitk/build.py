"""One build: tvm-ffi's ninja build in a private staging folder, published as a cache entry.

The caller holds the entry's build lock (jitk/lock.py). The build never touches the
published entry: it happens in a staging folder of its own (jitk/cache.py), is loaded from
there, and only then becomes the entry, in one rename. So a reader never sees half a build,
a `cache clear` cannot pull a library from under the process that built it, and tvm-ffi's
own lock, taken inside the build folder, is never contended. ninja runs under
jitk/ninja_guard.py, which stops the compilers when the builder dies or the build runs past
JITK_LOCK_TIMEOUT."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import tvm_ffi
import tvm_ffi.cpp
from tvm_ffi.libinfo import find_dlpack_include_path, find_include_path

from . import cache, toolchain
from .lock import lock_timeout

logger = logging.getLogger("jitk")

GUARD = Path(__file__).resolve().parent / "ninja_guard.py"
GUARD_DIR = ".jitk-bin"  # inside the staging folder; removed before publication
# Builds change process-wide environment variables that tvm-ffi reads; one at a time.
_env_lock = threading.Lock()
# The lines of a build log that say why it failed: compiler errors (gcc's file:line:col and
# nvcc's file(line)), fatal errors (nvcc fatal), the linker's and the loader's.
_DECISIVE = re.compile(r"\bfatal\b|\berror\b|undefined (reference|symbol)|multiple definition"
                       r"|^jitk: ", re.IGNORECASE)
_NOT_DECISIVE = re.compile(r"^(ninja|FAILED:|\[\d+/\d+\]|stdout:|stderr:)|^\d+ errors? detected")


class JitCompileError(RuntimeError):
    """The compiler rejected a module. `errors` holds the lines that say why (compiler
    errors with file:line, nvcc's fatal lines, the linker's), `command` the failing command
    line and `log` the whole build output."""

    def __init__(self, module: str, command: str, errors: list[str], log: str) -> None:
        self.module, self.command, self.errors, self.log = module, command, errors, log
        shown = "\n".join(errors) if errors else log.strip()[-4000:]
        super().__init__(
            f"jitk failed to compile module '{module}':\n{shown}\n\ncommand: {command}"
        )


def decisive_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if _DECISIVE.search(line) and not _NOT_DECISIVE.search(line)]


def compile_error(module: str, log: str) -> JitCompileError:
    lines = log.splitlines()
    command = ""
    for i, line in enumerate(lines):
        if line.startswith("FAILED:") and i + 1 < len(lines):
            command = lines[i + 1].strip()
            break
    errors = [line for line in decisive_lines(log) if line.strip() != command]
    return JitCompileError(module, command, errors, log)


@dataclass(frozen=True)
class BuildSpec:
    name: str
    entry: Path  # the published folder
    archs: tuple[str, ...]
    sources: dict[str, str]  # generated file name -> text
    kernel_files: tuple[Path, ...]  # hashed into the key
    include_dir: Path  # jitk's headers, hashed into the key
    build_kwargs: dict


def _write_guard(staging: Path) -> Path:
    """A `ninja` first on PATH that runs the real one under jitk/ninja_guard.py."""
    real = shutil.which("ninja")
    if real is None:
        raise toolchain.ToolchainError("jitk builds with ninja, which is not on PATH "
                                       "(pip install ninja)")
    folder = staging / GUARD_DIR
    folder.mkdir()
    command = [sys.executable or "python3", "-I", str(GUARD), str(os.getpid()),
               str(lock_timeout()), real]
    script = folder / "ninja"
    script.write_text(f'#!/bin/sh\nexec {shlex.join(command)} "$@"\n')
    script.chmod(0o755)
    return folder


@contextlib.contextmanager
def _build_env(archs: tuple[str, ...], guard: Path) -> Iterator[None]:
    """tvm-ffi takes the CUDA root and target architectures from the environment, and
    runs the `ninja` it finds on PATH; the linker finds libcudart on LIBRARY_PATH too."""
    with _env_lock:
        settings = {"PATH": f"{guard}{os.pathsep}{os.environ.get('PATH', '')}"}
        if archs:
            settings["CUDA_HOME"] = str(toolchain.cuda_home())
            settings["TVM_FFI_CUDA_ARCH_LIST"] = " ".join(archs)
            toolchain.link_cudart(guard)  # a wheel-installed toolkit's libcudart
            library_path = [str(guard), os.environ.get("LIBRARY_PATH")]
            settings["LIBRARY_PATH"] = os.pathsep.join(filter(None, library_path))
        saved = {key: os.environ.get(key) for key in settings}
        os.environ.update(settings)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _covered_by_key(spec: BuildSpec, staging: Path) -> tuple[str, ...]:
    """Folders whose headers the cache key already covers: by content (jitk's headers),
    or by a version in the key (tvm-ffi's, the CUDA toolkit's, the host compiler's), as
    path prefixes, both as given and with links resolved."""
    roots = [staging, spec.include_dir, Path(find_include_path()),
             Path(find_dlpack_include_path()), *toolchain.host_system_include_dirs()]
    if spec.archs:
        roots.append(toolchain.cuda_home())
    spellings = {os.path.normpath(p) for root in roots for p in (root, os.path.realpath(root))}
    return tuple(spelling.rstrip(os.sep) + os.sep for spelling in spellings)


def _own_headers(spec: BuildSpec, staging: Path) -> dict[str, str]:
    """Digests of the headers the build read that nothing in the key covers: the kernel's
    own includes, checked on every load so that editing one rebuilds."""
    out = subprocess.run([shutil.which("ninja") or "ninja", "-t", "deps"], cwd=staging,
                         capture_output=True, text=True, timeout=60, check=True)
    covered = _covered_by_key(spec, staging)
    listed = {os.path.realpath(path) for path in spec.kernel_files}
    headers = {}
    for line in out.stdout.splitlines():
        path = os.path.normpath(line.strip())
        if not line.startswith("    ") or path.startswith(covered):
            continue
        if os.path.realpath(path) not in listed:
            headers[cache.portable(path)] = cache.digest(Path(path))
    return dict(sorted(headers.items()))


def build_and_publish(spec: BuildSpec) -> tvm_ffi.Module:
    """Builds `spec` in a fresh staging folder, loads it, publishes it as `spec.entry` and
    returns the loaded module. A failed build raises JitCompileError and leaves its folder
    for inspection until the next build of the same entry."""
    for stale in cache.staging_folders(spec.entry.parent):
        if cache.entry_of(stale) == spec.entry.name:  # we hold the lock: its builder is gone
            shutil.rmtree(stale, ignore_errors=True)
    staging = cache.new_staging(spec.entry)
    for file_name, text in spec.sources.items():
        (staging / file_name).write_text(text)
    guard = _write_guard(staging)
    started = time.perf_counter()
    try:
        with _build_env(spec.archs, guard):
            tvm_ffi.cpp.build(spec.name, build_directory=str(staging),
                              sources=[str(staging / f) for f in spec.sources],
                              **spec.build_kwargs)
    except RuntimeError as error:
        raise compile_error(spec.name, str(error)) from None
    seconds = time.perf_counter() - started
    library = staging / f"{spec.name}.so"
    try:
        module = tvm_ffi.load_module(str(library))  # before publication: it cannot vanish
    except Exception as error:
        raise JitCompileError(spec.name, f"dlopen {library}", [str(error)], str(error)) from None
    shutil.rmtree(guard)
    cache.write_meta(staging, {
        "module": spec.name, "library": library.name, "archs": list(spec.archs),
        "build_seconds": round(seconds, 3), "built_at": time.time(),
        "sha256": cache.digest(library), "headers": _own_headers(spec, staging)})
    cache.publish(staging, spec.entry)
    logger.info("jitk: built %s for %s in %.2f s (%s)", spec.name,
                ", ".join(toolchain.sm_name(a) for a in spec.archs) or "host only", seconds,
                spec.entry)
    return module
