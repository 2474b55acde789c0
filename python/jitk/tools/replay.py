"""`python -m jitk replay DUMP`: one call dumped at JITK_LOGLEVEL=10, run again.

The op is found by name (its module, recorded in the dump, is imported first); its tensors
are rebuilt from inputs.safetensors with their recorded shapes, strides and dtypes, on their
recorded device or on `device`. The op runs on them, and what it wrote and returned is
compared with the dump's outputs; then the op's reference (if it has one) runs on fresh
copies of the same inputs and is compared with them too. The tolerance is the op's own
(jitk.op(tolerance=...)), else torch.testing.assert_close's default for the dtype."""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from jitk.base.errors import JitkError
from jitk.runtime.op import OpInfo, find_op
from jitk.tools import api_log, call_dumps

__all__ = ["Comparison", "DumpError", "load_call", "replay"]


class DumpError(JitkError, ValueError):
    """The folder is not a readable jitk dump."""


@dataclasses.dataclass
class Comparison:
    """One run (the op's, or its reference's) against the dumped outputs."""

    what: str
    failures: list[str]  # one line per output that differs, or the error the run raised
    compared: int

    @property
    def passed(self) -> bool:
        return not self.failures


def load_call(folder: Path) -> dict:
    """The dump's call.json, checked."""
    path = Path(folder) / call_dumps.CALL_FILE
    if not Path(folder).is_dir():
        raise DumpError(f"{folder} is not a folder (a dump is a folder written at "
                        f"{api_log.LEVEL_ENV}=10, with {call_dumps.CALL_FILE} in it)")
    try:
        call = json.loads(path.read_text())
    except FileNotFoundError:
        raise DumpError(f"{folder} has no {call_dumps.CALL_FILE}: not a jitk dump") from None
    except json.JSONDecodeError as error:
        raise DumpError(f"{path} is not valid JSON: {error}") from None
    if call.get("format") != call_dumps.DUMP_FORMAT:
        raise DumpError(f"{path} has format {call.get('format')!r}; this jitk reads format "
                        f"{call_dumps.DUMP_FORMAT}")
    return call


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise DumpError(f"{path} is missing")
    return load_file(str(path))


def _find(call: dict) -> OpInfo:
    if call.get("module"):
        try:
            importlib.import_module(call["module"])
        except ImportError as error:
            raise DumpError(f"the dump's op {call['op']} is defined in module "
                            f"{call['module']}, which cannot be imported here: {error}") from None
    try:
        return find_op(call["op"])
    except KeyError as error:
        raise DumpError(str(error.args[0])) from None


def _value(record: object) -> object:
    """A JSON value of call.json back as the argument it was (call_dumps records it)."""
    if isinstance(record, list):
        return [_value(item) for item in record]
    if isinstance(record, dict):
        if "dtype" in record:
            return getattr(torch, record["dtype"])
        if "device" in record:
            return torch.device(record["device"])
        if "float" in record:
            return float(record["float"])
    return record


def _arguments(call: dict, inputs: dict[str, torch.Tensor], device: str | None) -> dict:
    """Fresh arguments: each tensor in its recorded strides, on its device (or `device`)."""
    def rebuilt(key: str) -> torch.Tensor:
        layout = call["tensors"][key]
        tensor = torch.empty_strided(layout["shape"], layout["strides"],
                                     dtype=inputs[key].dtype,
                                     device=device or layout["device"])
        return tensor.copy_(inputs[key])

    arguments = {}
    for name, record in call["arguments"].items():
        if "tensor" in record:
            arguments[name] = rebuilt(name)
        elif "tensors" in record:
            arguments[name] = [rebuilt(f"{name}.{i}") for i in range(record["tensors"])]
        else:
            arguments[name] = _value(record["value"])
    return arguments


def _written(call: dict, arguments: dict, result: object) -> dict[str, torch.Tensor]:
    tensors = api_log.tensors_of(arguments)
    return {**{k: t for k, t in tensors.items() if k.split(".")[0] in call["mutated"]},
            **api_log.returned_tensors(result)}


def _compare(what: str, info: OpInfo, run: Callable[[dict], object], call: dict,
             inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor] | None,
             device: str | None) -> Comparison:
    try:
        arguments = _arguments(call, inputs, device)
    except (RuntimeError, AssertionError) as error:  # a device this machine lacks
        return Comparison(what, [f"cannot rebuild the inputs here ({error}); --device cpu "
                                 "runs an op whose body runs on the CPU"], 0)
    try:
        result = run(arguments)
    except Exception as error:  # the report names it; replay goes on to the next run
        return Comparison(what, [f"raised {type(error).__name__}: {error}"], 0)
    got = _written(call, arguments, result)
    if outputs is None:
        return Comparison(what, [], 0)
    failures = [f"{key}: not produced" for key in outputs if key not in got]
    for key, want in outputs.items():
        if key not in got:
            continue
        actual = got[key].detach().cpu()
        tolerance = info.tolerance_for(want.dtype)
        try:
            torch.testing.assert_close(
                actual, want, equal_nan=True,
                **({"atol": tolerance.atol, "rtol": tolerance.rtol} if tolerance else {}))
        except AssertionError as error:
            failures.append(f"{key}: " + " ".join(str(error).split("\n")[:3]))
    return Comparison(what, failures, len(outputs))


def replay(folder: Path | str, device: str | None = None) -> tuple[dict, list[Comparison]]:
    """The dump's call and the comparisons of the op's run and of its reference's (if it
    has one) with the dumped outputs. Raises DumpError for a folder it cannot use."""
    folder = Path(folder)
    call = load_call(folder)
    info = _find(call)
    inputs = _load_tensors(folder / call_dumps.INPUTS_FILE)
    outputs = None if call.get("outputs") is None else \
        _load_tensors(folder / call_dumps.OUTPUTS_FILE)
    missing = [key for key in call["tensors"] if key not in inputs]
    if missing:
        raise DumpError(f"{folder / call_dumps.INPUTS_FILE} lacks tensor(s) {', '.join(missing)}")
    runs = [_compare("op", info, lambda arguments: info.eager(**arguments), call, inputs,
                     outputs, device)]
    if info.reference is not None:
        runs.append(_compare("reference", info, lambda arguments: info.reference(**arguments),
                             call, inputs, outputs, device))
    return call, runs
