"""Runs ninja for one jitk build so that the build ends with the process that asked for it.

jitk/build/builder.py runs this file (standard library only) with ninja's path and arguments:

    python -I ninja_guard.py BUILDER_PID TIMEOUT_SECONDS NINJA [ninja arguments...]

Ninja stops its compilers when it gets SIGTERM, SIGINT or SIGHUP (each compiler runs in its
own process group, which ninja signals). This guard makes sure it gets one: when the builder
dies, however it dies (the kernel's parent-death signal, PR_SET_PDEATHSIG, on the guard and
on ninja; it follows the thread that started the guard, which waits for it throughout);
when the guard is signalled; and when the build runs past its time limit. What the guard
itself stops, it says on stderr, in a line that starts with "jitk: "."""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
TIMEOUT_EXIT = 124
ORPHANED_EXIT = 125


def die_with_parent() -> None:
    """SIGTERM to this process when its parent exits (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (AttributeError, OSError):
        pass


def main() -> int:
    builder, timeout, ninja_path, *args = sys.argv[1:]
    die_with_parent()
    if os.getppid() != int(builder):  # the builder died before the guard could ask to be told
        print(f"jitk: the process that started this build (pid {builder}) is gone, so the "
              "build did not start", file=sys.stderr, flush=True)
        return ORPHANED_EXIT
    ninja = subprocess.Popen([ninja_path, *args], preexec_fn=die_with_parent)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda received, _: ninja.send_signal(received))
    try:
        code = ninja.wait(timeout=float(timeout))
    except subprocess.TimeoutExpired:
        print(f"jitk: the build ran longer than {float(timeout):g} s (JITK_LOCK_TIMEOUT) "
              "and was stopped", file=sys.stderr, flush=True)
        ninja.terminate()
        try:
            ninja.wait(timeout=10)
        except subprocess.TimeoutExpired:
            ninja.kill()
            ninja.wait()
        return TIMEOUT_EXIT
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
