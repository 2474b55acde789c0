"""Level 10 of the call log (jitk.api_log): each logged call's tensors dumped to a folder of
JITK_DUMP_DIR, which `python -m jitk replay DUMP` runs again.

A dump is `call.json` (the op, the module that defines it, the call's number, its arguments
and each tensor's layout), `inputs.safetensors` written before the launch (a crash leaves
them) and `outputs.safetensors` after it, with what the call wrote; a call that raised has
its error in call.json. Dumps are limited in number and bytes for the whole process
(JITK_DUMP_MAX_COUNT, JITK_DUMP_MAX_GB) and filtered by op name (JITK_DUMP_INCLUDE,
JITK_DUMP_EXCLUDE). A folder is made new for each dump, never one that exists; a dump that
cannot be written is warned about once and the call runs without it."""

from __future__ import annotations

import fnmatch
import json
import math
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

DUMP_DIR_ENV = "JITK_DUMP_DIR"
DUMP_MAX_GB_ENV = "JITK_DUMP_MAX_GB"
DUMP_MAX_COUNT_ENV = "JITK_DUMP_MAX_COUNT"
DUMP_INCLUDE_ENV = "JITK_DUMP_INCLUDE"
DUMP_EXCLUDE_ENV = "JITK_DUMP_EXCLUDE"

# A dump's files (python -m jitk replay reads them).
CALL_FILE, INPUTS_FILE, OUTPUTS_FILE = "call.json", "inputs.safetensors", "outputs.safetensors"
DUMP_FORMAT = 1

FOLDER_TRIES = 1000  # names tried for one dump's folder before it gives up
failure_warned = threading.Event()  # set once a dump could not be written, and said


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def has_data(tensor: torch.Tensor) -> bool:
    """Whether the tensor has memory to read: plain tensors, not fake, functional or meta."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type != "meta"


class Dumps:
    """The dumps of one logging configuration (`config`: its dump_dir, dump_max_count,
    dump_max_bytes, include and exclude), their budget shared by every op of the process."""

    def __init__(self, config: object) -> None:
        self.config, self.count, self.bytes = config, 0, 0
        self.lock, self.refused = threading.Lock(), False

    def wanted(self, name: str) -> bool:
        matches = lambda patterns: any(fnmatch.fnmatchcase(name, p) for p in patterns)
        if self.config.include and not matches(self.config.include):
            return False
        return not matches(self.config.exclude)

    def reserve(self, size: int) -> str | None:
        """None if a dump of `size` bytes fits the limits (and counts it), else why not ("" once
        that was said)."""
        with self.lock:
            if self.count >= self.config.dump_max_count:
                why = f"{DUMP_MAX_COUNT_ENV}={self.config.dump_max_count} dumps written"
            elif self.bytes + size > self.config.dump_max_bytes:
                why = (f"{DUMP_MAX_GB_ENV}={self.config.dump_max_bytes / 2**30:g} would be "
                       "exceeded")
            else:
                self.count += 1
                self.bytes += size
                return None
            first, self.refused = not self.refused, True
            return why if first else ""

    def start(self, name: str, module: str | None, number: int, mutated: tuple[str, ...],
              values: dict, tensors: dict[str, torch.Tensor],
              say: Callable[[list[str]], None]) -> tuple[Path, dict] | None:
        """Writes call `number` of op `name` and its inputs, before the launch, if this call
        is dumped (`say` writes log lines); `finish` adds the outputs."""
        if not self.wanted(name) or not all(map(has_data, tensors.values())):
            return None
        refused = self.reserve(2 * sum(t.numel() * t.element_size() for t in tensors.values()))
        if refused is not None:
            if refused:
                say([f"  (no more dumps: {refused}; said once)"])
            return None
        call = {
            "format": DUMP_FORMAT, "op": name, "module": module, "call": number,
            "pid": os.getpid(), "mutated": list(mutated),
            "arguments": {key: _argument_record(value) for key, value in values.items()},
            "tensors": {key: {"shape": list(t.shape), "strides": list(t.stride()),
                              "dtype": dtype_name(t.dtype), "device": str(t.device)}
                        for key, t in tensors.items()},
            "outputs": None,  # None until the call returns
        }
        safe = name.replace("::", ".")
        folder = self.config.dump_dir / f"{safe}_pid{os.getpid()}_call{number:06d}"
        try:
            from safetensors.torch import save_file

            folder = _new_folder(folder)
            save_file(_contiguous_copies(tensors), str(folder / INPUTS_FILE))
            (folder / CALL_FILE).write_text(json.dumps(call, indent=2) + "\n")
        except Exception as error:  # a dump is a diagnostic: the call goes on without it
            _failed(folder, error)
            return None
        say([f"  dumping to {folder}"])
        return folder, call


def finish(dump: tuple[Path, dict], written: dict[str, torch.Tensor],
           error: BaseException | None = None) -> None:
    """Adds to a started dump what the call wrote, or the error it raised."""
    from safetensors.torch import save_file

    folder, call = dump
    call["outputs"] = sorted(written)
    if error is not None:
        call["raised"] = f"{type(error).__name__}: {error}"
    try:
        save_file(_contiguous_copies(written), str(folder / OUTPUTS_FILE))
        (folder / CALL_FILE).write_text(json.dumps(call, indent=2) + "\n")
    except Exception as failure:
        _failed(folder, failure)


def _contiguous_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def _argument_record(value: object) -> dict:
    """How call.json records an argument: a tensor (its data in the safetensors files, under
    its name), a list of tensors (name.0, name.1, ...), or a JSON value."""
    if isinstance(value, torch.Tensor):
        return {"tensor": True}
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return {"tensors": len(value)}
    return {"value": _scalar_record(value)}


def _scalar_record(value: object) -> object:
    """A non-tensor argument as JSON: dtypes and devices as tagged strings."""
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, list | tuple):
        return [_scalar_record(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    return value


def _new_folder(wanted: Path) -> Path:
    """A folder made now for this dump: `wanted`, or `wanted`_2, _3, ... where that exists
    (an earlier process's dump is never written over)."""
    wanted.parent.mkdir(parents=True, exist_ok=True)
    for suffix in range(1, FOLDER_TRIES + 1):
        folder = wanted if suffix == 1 else wanted.with_name(f"{wanted.name}_{suffix}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"{wanted} and {FOLDER_TRIES - 1} numbered variants exist")


def _failed(folder: Path, error: BaseException) -> None:
    if not failure_warned.is_set():
        failure_warned.set()
        warnings.warn(f"jitk: cannot write the level-10 dump {folder} ({type(error).__name__}: "
                      f"{error}); calls go on undumped (said once)", RuntimeWarning,
                      stacklevel=4)
