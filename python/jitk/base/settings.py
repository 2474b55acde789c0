"""Every JITK_* environment variable, declared once: its kind, its default and what it does.

Code reads a setting through `get(NAME)` (or `flag`, for on/off ones), which parses it by its
kind each time it is asked, so a test or a long-running process that changes the environment
is heard. A value the kind refuses raises SettingError naming the variable, the value and the
rule; an unset or empty variable is its default. `python -m jitk env` prints the table."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from jitk.base.errors import SettingError

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # flag | seconds | count | size_gb | text | path | names | choice
    default: object
    doc: str
    choices: tuple[str, ...] = ()


def _declare(*settings: Setting) -> dict[str, Setting]:
    return {setting.name: setting for setting in settings}


SETTINGS = _declare(
    # build: where modules are built, cached and locked
    Setting("JITK_CACHE_DIR", "path", "~/.cache/jitk", "the module cache's folder"),
    Setting("JITK_STAGING_DIR", "path", None,
            "where builds are staged before their one rename into the cache (default: the "
            "system's temporary folder)"),
    Setting("JITK_LOCK_DIR", "path", None,
            "where build locks are kept (default: the cache folder); host-local where the "
            "cache is on a network file system"),
    Setting("JITK_LOCK_TIMEOUT", "seconds", 300.0,
            "the longest jitk waits for a build, another process's or its own"),
    Setting("JITK_CACHE_TRUSTED_GROUP", "text", None,
            "a group whose members may write the cache too (default: only the user)"),
    Setting("JITK_NVCC", "path", None, "the nvcc to build with (default: found; see README)"),
    Setting("JITK_CUDA_ARCH", "text", None,
            "the architectures to build for, e.g. '9.0' or '8.0;9.0' (default: the GPU's)"),
    Setting("JITK_CUDA_COMPILER", "choice", "auto",
            "what builds files written in two halves when load_jit is given "
            "cuda_compiler='auto' (the shipped kernels): auto (NVRTC where it can build, and "
            "a cached NVRTC build wherever libnvrtc is installed), nvrtc or nvcc",
            ("auto", "nvrtc", "nvcc")),
    Setting("JITK_HOST_PRELUDE", "flag", True,
            "precompile jitk's host headers, and compile its host runtime, once (the cache's "
            ".pch folder) for the host halves built after; off: every build parses them"),
    Setting("JITK_DEVICE_PRELUDE", "flag", True,
            "have NVRTC precompile jitk's device headers once a process for each target and "
            "set of options (a private temporary folder, removed at exit) for the device "
            "halves built after; off: every build parses them"),
    Setting("JITK_DISABLE_JIT", "flag", False,
            "never compile: a module missing from the cache raises JitCacheMissError"),
    Setting("JITK_PRECOMPILE_MODULES", "names", (),
            "more kernel modules for `python -m jitk precompile`, comma-separated"),
    # build: the remote cache (jitk/build/remote.py)
    Setting("JITK_REMOTE_CACHE", "text", None,
            "an OCI registry entries are fetched from before compiling: oci://host:port/repo "
            "(default: off)"),
    Setting("JITK_REMOTE_CACHE_KEY", "path", None,
            "the ed25519 private key (PEM) entries are signed with when pushed"),
    Setting("JITK_REMOTE_CACHE_TRUST", "names", (),
            "public key files (PEM), comma-separated, whose signatures a pull accepts; "
            "without one nothing is pulled"),
    Setting("JITK_REMOTE_CACHE_TIMEOUT", "seconds", 10.0,
            "the longest one call to the remote cache may take"),
    Setting("JITK_REMOTE_CACHE_RETRIES", "count", 1,
            "how often a failed call to the remote cache is tried again"),
    Setting("JITK_REMOTE_CACHE_HTTP_HOSTS", "names", (),
            "registry hosts spoken to in plain HTTP besides loopback ones (default: TLS)"),
    Setting("JITK_REMOTE_CACHE_PUSH", "flag", False,
            "push every entry this process builds to the remote cache (needs the key)"),
    # runtime and tools
    Setting("JITK_VERBOSE", "flag", False, "log builds and cache decisions to stderr"),
    Setting("JITK_REFERENCE", "names", (),
            "ops that run their references instead of their kernels ('all' for every op)"),
    Setting("JITK_TUNED_FOR", "text", None,
            "the GPU whose shipped tuning tables apply in a process that sees none, as "
            "'NAME,SMS' (e.g. 'NVIDIA H200,132'): precompile's workers, image builds"),
    Setting("JITK_AUTOTUNE", "flag", False,
            "tune an op's bucket on its first call where the tuning file has no entry"),
    Setting("JITK_LOGLEVEL", "choice", "0",
            "call logging: 0 off, 1 names, 3 arguments, 5 statistics, 10 dumps",
            ("0", "1", "3", "5", "10")),
    Setting("JITK_LOGDEST", "text", "stdout", "where call logs go: stdout, stderr or a file"),
    Setting("JITK_DUMP_DIR", "path", "jitk_dumps", "where level-10 dumps are written"),
    Setting("JITK_DUMP_MAX_GB", "size_gb", 20.0, "the most level-10 dumps may take"),
    Setting("JITK_DUMP_MAX_COUNT", "count", 1000, "the most calls level 10 dumps"),
    Setting("JITK_DUMP_INCLUDE", "names", (), "op-name patterns to dump (default: all)"),
    Setting("JITK_DUMP_EXCLUDE", "names", (), "op-name patterns never to dump"),
    # kernels
    Setting("JITK_WAIT_VALUE_SPIN", "flag", False,
            "stream_wait_value spins in a kernel rather than using the driver's wait"),
    Setting("JITK_RMSNORM_FAST_UNSTABLE", "flag", False,
            "let RMSNorm's tuner pick choices that add a row in another order: a row's bits "
            "may then depend on the batch (gives up batch invariance)"),
)


def _rule(setting: Setting) -> str:
    return {
        "flag": f"one of {'/'.join(ON)} (on) or {'/'.join(OFF)} (off)",
        "seconds": "a positive number of seconds",
        "count": "a whole number >= 0",
        "size_gb": "a number of GiB >= 0",
        "names": "a comma-separated list of names without empty items",
        "choice": f"one of {', '.join(setting.choices)}",
    }.get(setting.kind, "any text")


def _parse(setting: Setting, text: str) -> object:
    kind = setting.kind
    if kind == "flag":
        word = text.lower()
        if word in ON or word in OFF:
            return word in ON
    elif kind in ("seconds", "size_gb", "count"):
        try:
            value = int(text) if kind == "count" else float(text)
        except ValueError:
            value = -1
        least_ok = value > 0 if kind == "seconds" else value >= 0
        if least_ok and value < math.inf:
            return value
    elif kind == "names":
        names = tuple(part.strip() for part in text.split(","))
        if all(names):
            return names
    elif kind == "choice":
        if text in setting.choices:
            return text
    else:
        return text
    raise SettingError(f"{setting.name}={text!r}: expected {_rule(setting)} "
                       f"({setting.doc}; unset: {_default_text(setting)})")


def _default_text(setting: Setting) -> str:
    if setting.default in (None, ()):
        return "see above" if setting.default is None else "none"
    if setting.kind == "flag":
        return "on" if setting.default else "off"
    return str(setting.default)


def get(name: str, environ: Mapping[str, str] | None = None) -> object:
    """The setting's value, parsed by its kind; its default where unset or empty."""
    setting = SETTINGS[name]
    text = (os.environ if environ is None else environ).get(name, "").strip()
    return _parse(setting, text) if text else setting.default


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    assert SETTINGS[name].kind == "flag", name
    return bool(get(name, environ))


def is_set(name: str) -> bool:
    return bool(os.environ.get(name, "").strip())


def table() -> list[tuple[Setting, str | None, str]]:
    """Each setting, its value in this environment (None: unset) and what it means now:
    the parsed value, the default, or the error a bad value gives."""
    rows = []
    for setting in SETTINGS.values():
        text = os.environ.get(setting.name)
        try:
            meaning = f"default ({_default_text(setting)})" if not (text or "").strip() \
                else repr(get(setting.name))
        except SettingError as error:
            meaning = f"error: {error}"
        rows.append((setting, text, meaning))
    return rows


def unknown() -> list[str]:
    """JITK_* variables of the environment that no setting declares (a typo, say)."""
    return sorted(name for name in os.environ
                  if name.startswith("JITK_") and name not in SETTINGS)


def apply_verbose() -> None:
    """JITK_VERBOSE: jitk's log lines to stderr."""
    if flag("JITK_VERBOSE"):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("jitk").addHandler(handler)
        logging.getLogger("jitk").setLevel(logging.INFO)
