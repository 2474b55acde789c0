"""NVRTC's share of a build: the kernels a host half launches (jitk/nvrtc.cuh), compiled in
the process for each target, written beside the library and handed to it at its load.

The names come from the built host half, so NVRTC waits for the host compiler. Where an entry
of the same module was built before (the kernel file or a header it reads edited since, or
another set of targets), NVRTC starts at once, beside the host compiler, on the kernels that
entry launched: an edit rarely changes which kernels a host half launches. Its programs are
used only where the host half launches exactly those kernels, in the same order; otherwise
NVRTC compiles again for the kernels it does launch. A wrong guess costs CPU time, never a
wrong entry."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

from jitk.base.daemon import run_on_daemon
from jitk.build import device_prelude, names, nvrtc, toolchain, trust
from jitk.build.build_errors import JitCompileError, decisive_lines
from jitk.build.cpus import spare_cpus
from jitk.build.lock import lock_timeout
from jitk.build.spec import BuildSpec

__all__ = ["DEVICE_HEADERS", "MAX_NVRTC_PARTS", "Early", "build", "nvrtc_parts", "options",
           "start_early"]

logger = logging.getLogger("jitk")

DEVICE_HEADERS = "device_half.headers"  # the files NVRTC read, one a line
# NVRTC programs of one module side by side: on 16 cores, with the device prelude loaded,
# four or eight ran little faster than two (NVVM's own threads, -split-compile, do the rest;
# debugging_and_performance.md).
MAX_NVRTC_PARTS = 2
# The CPUs a machine needs for a build to start NVRTC beside its host compiler: with one, a
# guess would only take turns with the host compiler. Not the spare CPUs (cpus.spare_cpus):
# the load average they subtract still holds the build that an edit follows, and the two
# overlap well even on two CPUs (debugging_and_performance.md).
EARLY_MIN_CPUS = 2
_MAX_GUESS_BYTES = 1 << 20  # a kernels list larger than any jitk writes is no guess


class Compiled(NamedTuple):
    parts: list[list[str]]  # the name expressions of each program
    jobs: list[tuple[str, int]]  # (target, part) of each program
    programs: list[nvrtc.Program]
    preludes: dict[str, device_prelude.Prelude | None]  # target -> the prelude it loaded


class Early(NamedTuple):
    expressions: list[str]  # the guess
    compiled: concurrent.futures.Future[Compiled]


def options(spec: BuildSpec) -> dict[str, list[str]]:
    """NVRTC's options for each target of a module whose kernels it builds (none for others):
    libcu++'s standard headers (include/nvrtc_std), the kernel's folders, the toolkit's."""
    if not spec.device_halves:
        return {}
    cuda_include = toolchain.cuda_home() / "include"
    includes = [f"-I{path}" for path in (Path(spec.flags["include_dirs"][0]) / "nvrtc_std",
                                         *spec.flags["include_dirs"], cuda_include,
                                         cuda_include / "cccl")]
    return {arch: [f"-arch={toolchain.sm_name(arch)}", *nvrtc.OPTIONS, *includes]
            for arch in spec.archs}


def nvrtc_parts(kernels: int) -> int:
    """How many NVRTC programs build a module's kernels: at most one a kernel and a spare CPU
    (a precompile or tuning worker: its share, as for the host half's units)."""
    return max(1, min(kernels, spare_cpus(), MAX_NVRTC_PARTS))


def _compile(spec: BuildSpec, target_options: dict[str, list[str]], expressions: list[str],
             folder: Path | None) -> Compiled:
    """The kernels `expressions` names, in parts side by side (a program each, on a daemon
    thread of its own: ctypes lets the threads run at once, and NVRTC's call has no time
    limit), each program reading the device prelude first, precompiled for its target
    (device_prelude.py); waited for no longer than JITK_LOCK_TIMEOUT in all. `folder`: where
    NVRTC's time traces go while it runs."""
    timeout = lock_timeout()
    deadline = time.monotonic() + timeout
    count = nvrtc_parts(len(expressions))
    parts = [expressions[i::count] for i in range(count)]
    source = nvrtc.PRELUDE + "".join(f'#include "{path}"\n' for path in spec.device_halves)
    preludes = {arch: device_prelude.get(target_options[arch], timeout)
                for arch in target_options}
    jobs = [(arch, index) for arch in spec.archs for index in range(len(parts))]
    compiling = [run_on_daemon(lambda arch=arch, index=index: nvrtc.compile_cubin(
        source, f"{spec.name}.cu", parts[index], target_options[arch],
        preludes[arch].file if preludes[arch] else None, folder), "jitk-nvrtc")
        for arch, index in jobs]
    try:
        programs = [program.result(timeout=max(0.0, deadline - time.monotonic()))
                    for program in compiling]
    except concurrent.futures.TimeoutError:
        raise nvrtc.NvrtcError(f"NVRTC did not finish compiling the kernels of {spec.name} "
                               f"within {timeout:g} s (JITK_LOCK_TIMEOUT)") from None
    return Compiled(parts, jobs, programs, preludes)


def _guessed_names(spec: BuildSpec) -> list[str] | None:
    """The kernels the newest entry of the module launched (its <module>.kernels): another
    key's (the kernel file edited), or this one's, stale (a header it read edited). Read only
    where the user alone could have written it (trust.problem); None where there is none."""
    found = []
    try:
        folders = os.listdir(spec.entry.parent)
    except OSError:
        return None
    for folder in folders:
        match = names.ENTRY_NAME.fullmatch(folder)
        if not match or match["module"] != spec.name:  # this entry's own, when stale, too
            continue
        try:
            fd = os.open(spec.entry.parent / folder / f"{spec.name}.kernels",
                         os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as file:
            status = os.fstat(file.fileno())
            if trust.problem(status) is None and status.st_size <= _MAX_GUESS_BYTES:
                found.append((status.st_mtime_ns, file.read()))
    if not found:
        return None
    lines = max(found)[1].decode(errors="replace").splitlines()
    expressions = [line.split("\t")[0] for line in lines]
    return expressions if expressions and all(expressions) else None


def start_early(spec: BuildSpec, target_options: dict[str, list[str]]) -> Early | None:
    """NVRTC begun now, beside the host compiler, on the kernels the module's newest entry
    launched (_guessed_names); None where it has none, or the machine too few CPUs."""
    if not target_options or (os.cpu_count() or 1) < EARLY_MIN_CPUS:
        return None
    guess = _guessed_names(spec)
    if guess is None:
        return None
    # Its time traces go to a folder of its own: one it no longer needs may still be running
    # when the build removes its staging folder.
    return Early(guess, run_on_daemon(lambda: _compile(spec, target_options, guess, None),
                                      "jitk-nvrtc-early"))


def _early_programs(spec: BuildSpec, early: Early | None, expressions: list[str]
                    ) -> Compiled | None:
    """The early compile's programs where it guessed `expressions` and succeeded in time."""
    if early is None:
        return None
    if early.expressions != expressions:
        logger.info("jitk: %s launches other kernels than its last entry; NVRTC compiles "
                    "again", spec.name)
        return None
    try:  # its own wait is bounded (_compile); this one too, for a thread that never ran
        return early.compiled.result(timeout=lock_timeout())
    except concurrent.futures.TimeoutError:
        reason = f"not done within {lock_timeout():g} s (JITK_LOCK_TIMEOUT)"
    except Exception as error:  # NVRTC refused it: compiled again, which reports an error
        # in the kernels as a build without a guess does
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    logger.info("jitk: NVRTC's early compile of %s did not serve (%s); compiling again",
                spec.name, reason)
    return None


def build(spec: BuildSpec, staging: Path, target_options: dict[str, list[str]],
          early: Early | None = None) -> dict[str, bytes]:
    """NVRTC builds the kernels the host half launches (the names it registered) for each
    target, with `target_options` (`options`): <name>.<part>.sm_XX.cubin (and .compute_XX.ptx,
    as ptx_arch says), and <name>.kernels, a line "expression<TAB>lowered<TAB>part" a kernel;
    or takes them from `early` (start_early) where it guessed those kernels. Written into
    `staging` and returned (file name -> bytes), for the library to be handed at its load
    (loader.load_from_fd; jitk/nvrtc.cuh reads them at the first launch). The headers NVRTC
    read, the prelude's among them, are listed in DEVICE_HEADERS for the entry's record."""
    try:
        expressions = nvrtc.kernel_names(staging / f"{spec.name}.so")
        if not expressions:  # host code only: nothing for NVRTC to build or a launch to find
            return {}
        compiled = (_early_programs(spec, early, expressions)
                    or _compile(spec, target_options, expressions, staging))
    except nvrtc.NvrtcError as error:
        raise JitCompileError(spec.name, "NVRTC (in the process)", decisive_lines(str(error))
                              or [str(error)], str(error)) from None
    parts, jobs, programs, preludes = compiled
    read = {path for program in programs for path in program.headers}
    for arch, prelude in preludes.items():
        if prelude and not all(p.used_pch for (a, _), p in zip(jobs, programs) if a == arch):
            logger.info("jitk: NVRTC parsed the device prelude for %s instead of loading %s",
                        spec.name, prelude.file)
        read.update(prelude.headers if prelude else ())
    (staging / DEVICE_HEADERS).write_text("".join(f"{path}\n" for path in sorted(read)))
    code = {f"{spec.name}.{index}.{toolchain.sm_name(arch)}.cubin": program.cubin
            for (arch, index), program in zip(jobs, programs)}
    # As nvcc's fat builds (gencode_flags): the newest generic target's PTX too, which the
    # driver compiles for a GPU newer than every target.
    ptx_arch = toolchain.ptx_arch(spec.archs)
    code.update({f"{spec.name}.{index}.{toolchain.sm_name(arch).replace('sm', 'compute')}.ptx":
                 program.ptx for (arch, index), program in zip(jobs, programs)
                 if arch == ptx_arch})
    table = {expression: f"{program.lowered[expression]}\t{index}"
             for (_, index), program in zip(jobs, programs) for expression in parts[index]}
    code[f"{spec.name}.kernels"] = "".join(f"{e}\t{table[e]}\n" for e in expressions).encode()
    for name, data in code.items():
        (staging / name).write_bytes(data)
    return code
