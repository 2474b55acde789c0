"""The tuning file: the launch choices `jitk.autotune` made, kept beside the build cache.

The file, $JITK_CACHE_DIR/autotune.json, holds entries keyed by op, bucket, and environment:
GPU name and SM count, driver, and the jitk, apache-tvm-ffi and torch versions. Entries for
another environment are left in the file and ignored (one warning says how many); a file
that cannot be read is ignored with one warning. Writes merge with what is there, under a
lock held at most $JITK_LOCK_TIMEOUT seconds, and replace the file atomically.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import tvm_ffi

from jitk.base import __version__, settings
from jitk.base.errors import SettingError
from jitk.build.cache import cache_root
from jitk.build.lock import build_lock, lock_path

FILE_NAME = "autotune.json"
FORMAT = 1
TUNED_FOR_ENV = "JITK_TUNED_FOR"


def tuning_file() -> Path:
    return cache_root() / FILE_NAME


def _driver_version() -> str:
    try:
        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except (OSError, AttributeError):
        return "none"


_ENVIRONMENT: dict | None = None


def environment() -> dict:
    """What a tuned choice holds for: this process's current GPU and versions."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            gpu, sms = props.name, props.multi_processor_count
        else:
            gpu, sms = "none", 0
        _ENVIRONMENT = {"gpu": gpu, "sms": sms, "driver": _driver_version(),
                        # the package's own version, equal to its metadata's, without a
                        # scan of sys.path on a first call's path
                        "jitk": __version__, "tvm_ffi": tvm_ffi.__version__,
                        "torch": torch.__version__}
    return _ENVIRONMENT


def key(op: str, bucket: Sequence) -> str:
    return f"{op} {json.dumps(list(bucket))}"


def read(path: Path) -> tuple[list[dict], str | None]:
    """The file's entries, and why it was ignored (None when it was read)."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return [], None
    except (OSError, ValueError) as error:
        return [], f"cannot be read ({error})"
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return [], f"is not a jitk tuning file of format {FORMAT}"
    entries = document.get("entries")
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and {"op", "bucket", "environment", "config"} <= e.keys()
            for e in entries):
        return [], "has malformed entries"
    return entries, None


def _identity(entry: dict) -> str:
    return json.dumps([entry["op"], entry["bucket"], entry["environment"]], sort_keys=True)


def record(entries: Iterable[dict], path: Path | None = None) -> None:
    """Merges `entries` into the file: under its lock, over what other processes wrote
    (an entry of the same op, bucket and environment is replaced), then an atomic rename."""
    path = path or tuning_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(lock_path(path), path):
        merged = {_identity(e): e for e in read(path)[0]}
        merged.update({_identity(e): e for e in entries})
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staging.write_text(json.dumps({"format": FORMAT, "entries": list(merged.values())},
                                      indent=1, sort_keys=True))
        os.replace(staging, path)
    STORE.clear()  # read again on the next lookup


class Store:
    """The file's entries for this environment, read once: {key: config}."""

    def __init__(self) -> None:
        self._configs: dict[str, dict] | None = None

    def clear(self) -> None:
        self._configs = None

    def config(self, op: str, bucket: Sequence) -> dict | None:
        if self._configs is None:
            self._configs = self._load(tuning_file())
        return self._configs.get(key(op, bucket))

    @staticmethod
    def _load(path: Path) -> dict[str, dict]:
        entries, problem = read(path)
        if problem:
            warnings.warn(f"jitk.autotune: the tuning file {path} {problem}; it is ignored "
                          "and today's defaults apply (`python -m jitk tune` writes it anew)",
                          stacklevel=4)
            return {}
        here = environment()
        mine = [e for e in entries if e["environment"] == here]
        if len(mine) < len(entries):
            others = {json.dumps(e["environment"], sort_keys=True) for e in entries} - {
                json.dumps(here, sort_keys=True)}
            warnings.warn(f"jitk.autotune: {len(entries) - len(mine)} of {len(entries)} entries "
                          f"in {path} were tuned for another GPU or other versions "
                          f"({'; '.join(sorted(others))[:300]}), not this one ({here}); they "
                          "are ignored", stacklevel=4)
        return {key(e["op"], e["bucket"]): e["config"] for e in mine}


STORE = Store()


# ---------------------------------------------------------------------------- shipped tables
def table_name(gpu: str) -> str:
    """The file of a GPU's shipped table: its name in lower case, other characters as '-'
    ("NVIDIA H100 80GB HBM3" -> nvidia-h100-80gb-hbm3.json)."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") + ".json"


# (folder/table, gpu) -> the table's entries ({"op", "bucket", "config"}) and {key: config}.
TABLES_READ: dict[tuple[Path, tuple[str, int]], tuple[list[dict], dict[str, dict]]] = {}


def table_gpu() -> tuple[str, int] | None:
    """Whose shipped tables apply: this process's GPU (name, SM count), else the one
    JITK_TUNED_FOR names (a process that builds for a GPU it cannot see), else None."""
    here = environment()
    if here["gpu"] != "none":
        return here["gpu"], here["sms"]
    text = settings.get(TUNED_FOR_ENV)
    if not text:
        return None
    name, _, sms = text.rpartition(",")
    if not name.strip() or not sms.strip().isdigit():
        raise SettingError(f"{TUNED_FOR_ENV}={text!r}: expected 'NAME,SMS', e.g. "
                           "'NVIDIA H200,132'")
    return name.strip(), int(sms)


def table_entries(folder: Path) -> list[dict]:
    """The shipped table's entries ({"op", "bucket", "config"}) for table_gpu() (name and SM
    count), read once; [] when none ships for it or it cannot be read (with a warning: a
    packaging fault)."""
    return _table(folder)[0]


def table_configs(folder: Path) -> dict[str, dict]:
    """The same table as {key: config}, for a lookup by bucket."""
    return _table(folder)[1]


def _table(folder: Path) -> tuple[list[dict], dict[str, dict]]:
    gpu = table_gpu()
    if gpu is None:
        return [], {}
    path = folder / table_name(gpu[0])
    if (path, gpu) not in TABLES_READ:
        entries = []
        if path.is_file():
            try:
                document = json.loads(path.read_text())
                if document.get("format") != FORMAT:
                    raise ValueError(f"not a jitk tuning table of format {FORMAT}")
                if (document["gpu"], document["sms"]) == gpu:
                    entries = [{"op": e["op"], "bucket": e["bucket"], "config": e["config"]}
                               for e in document["entries"]]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                warnings.warn(f"jitk.autotune: the shipped tuning table {path} cannot be used "
                              f"({error}); the defaults apply where the tuning file has no "
                              "entry", stacklevel=6)
        TABLES_READ[(path, gpu)] = entries, {key(e["op"], e["bucket"]): e["config"]
                                            for e in entries}
    return TABLES_READ[(path, gpu)]


def export_table(ops: Iterable[str], path: Path) -> int:
    """Writes the tuning file's entries for `ops` on this GPU and these versions as a table
    to ship (`TuningSpace.tables`); returns how many it holds."""
    here = environment()
    names = set(ops)
    entries = [{"op": e["op"], "bucket": e["bucket"], "config": e["config"]}
               for e in read(tuning_file())[0]
               if e["op"] in names and e["environment"] == here]
    entries.sort(key=lambda e: key(e["op"], e["bucket"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": FORMAT, "gpu": here["gpu"], "sms": here["sms"],
                                "tuned_with": here, "entries": entries}, indent=1,
                               sort_keys=True) + "\n")
    return len(entries)


def reread() -> None:
    """Forgets what was read of the tuning file and the shipped tables (tests, and after
    `python -m jitk tune` rewrote the file)."""
    STORE.clear()
    TABLES_READ.clear()
