"""What a failed build says: the compiler's lines that tell why, the command to run again,
and the whole log, as one JitCompileError."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from jitk.base.errors import JitkError

__all__ = ["JitCompileError", "compile_error", "decisive_lines"]

# The lines of a build log that say why it failed: compiler errors (gcc's file:line:col and
# nvcc's file(line)), fatal errors (nvcc fatal), the linker's, the loader's and ninja's own.
_DECISIVE = re.compile(r"\bfatal\b|\berror\b|undefined (reference|symbol)|multiple definition"
                       r"|^jitk: ", re.IGNORECASE)
_NOT_DECISIVE = re.compile(r"^(ninja: build stopped|FAILED:|\[\d+/\d+\])"
                           r"|^\d+ errors? detected")


class JitCompileError(JitkError, RuntimeError):
    """The compiler rejected a module. `errors` holds the lines that say why (compiler
    errors with file:line, nvcc's fatal lines, the linker's), `command` the failing command
    line and `log` the whole build output."""

    def __init__(self, module: str, command: str, errors: list[str], log: str) -> None:
        self.module, self.command, self.errors, self.log = module, command, errors, log
        shown = "\n".join(errors) if errors else log.strip()[-4000:]
        super().__init__(
            f"jitk: failed to compile module '{module}':\n{shown}\n\ncommand: {command}"
        )


def decisive_lines(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if _DECISIVE.search(line) and not _NOT_DECISIVE.search(line)]


def compile_error(module: str, log: str, folder: Path, ninja: list[str]) -> JitCompileError:
    """The error of a build that failed in `folder`: the failing compiler command, or
    ninja's when no compiler failed (a missing input fails before any compiler runs), as a
    command to run again; the decisive lines, else the log's last line."""
    lines = log.splitlines()
    failed = shlex.join(ninja)
    for i, line in enumerate(lines):
        if line.startswith("FAILED:") and i + 1 < len(lines):
            failed = lines[i + 1].strip()
            break
    errors = [line for line in decisive_lines(log) if line.strip() != failed]
    if not errors:
        errors = [line for line in lines if line.strip()][-1:] or ["the build printed nothing"]
    return JitCompileError(module, f"cd {shlex.quote(str(folder))} && {failed}", errors, log)
