"""From jitk's call logs to FlashInfer-Bench Workloads: a program run once with
JITK_LOGLEVEL=3 (or 10, with dumps) yields the dataset to benchmark jitk's Solutions on.

    python -m jitk fib workloads LOGS... OUT_DIR

Each logged call of jitk.rmsnorm or jitk.fused_add_rmsnorm becomes a Workload of the
Definition of its hidden size, dtype and eps (fib_norm's names: the dataset's where they are
the dataset's), batch_size the call's row count. Its inputs are random, one Workload per
shape; a call that was dumped (level 10, "dumping to FOLDER" in the log, the folder still
there) gets its own Workload whose inputs are the dumped tensors, copied under
OUT_DIR/blob/workloads/. OUT_DIR gets the Definitions and jitk's Solutions as well, so it
is a TraceSet folder FlashInfer-Bench loads and benchmarks as it is.
"""

from __future__ import annotations

import ast
import json
import math
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from jitk.base.errors import ArgumentError
from jitk.integrations import fib_norm
from jitk.integrations.fib_base import require_fib, write_model
from jitk.tools.call_dumps import INPUTS_FILE

__all__ = ["parse_log", "workloads"]

_HEADER = re.compile(r"^\[jitk pid \d+ [\d:]+\] (\S+) call \d+$")
_ARGUMENT = re.compile(r"^  (\w+): (.*)$")
_TENSOR = re.compile(r"^Tensor\(shape=\(([\d, ]*)\), dtype=(\w+),")
_DUMPED = re.compile(r"^  dumping to (.+)$")
# jitk op -> (fib_norm op, {Definition input: the op's parameter})
_OPS = {"jitk::rmsnorm": ("rmsnorm", {"hidden_states": "input", "weight": "weight"}),
        "jitk::fused_add_rmsnorm": ("fused_add_rmsnorm", {
            "hidden_states": "input", "residual": "residual", "weight": "weight"})}


def _value(text: str) -> object:
    """A logged argument: (shape, dtype name) for a tensor, else the scalar."""
    tensor = _TENSOR.match(text)
    if tensor:
        return tuple(int(d) for d in tensor[1].split(",") if d.strip()), tensor[2]
    kind, _, literal = text.partition(" ")
    try:
        return ast.literal_eval(literal) if kind in ("float", "int", "bool") else text
    except (ValueError, SyntaxError):
        return float(literal) if kind == "float" else text  # nan, inf


def parse_log(text: str) -> Iterator[tuple[str, dict, Path | None]]:
    """(op name, {argument: value}, dump folder or None) of each call a log records at
    JITK_LOGLEVEL>=3; other lines (the program's own output) are passed over."""
    call: tuple[str, dict, Path | None] | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header or not line.startswith("  "):
            if call is not None and call[1]:
                yield call
            call = (header[1], {}, None) if header else None
            continue
        if call is None:
            continue
        dumped = _DUMPED.match(line)
        if dumped:
            call = (call[0], call[1], Path(dumped[1]))
        elif (argument := _ARGUMENT.match(line)) and argument[1] != "note":
            call[1][argument[1]] = _value(argument[2])
    if call is not None and call[1]:
        yield call


def _workload_of(op: str, arguments: dict) -> tuple[str, int, torch.dtype, float, int] | None:
    """(fib_norm op, hidden, dtype, eps, rows) of a logged RMSNorm call, None for other ops."""
    if op not in _OPS:
        return None
    name, _ = _OPS[op]
    shape, dtype = arguments["input"]
    eps = arguments.get("eps", 1e-6)
    if not shape or not isinstance(eps, float) or not math.isfinite(eps):
        return None
    return name, shape[-1], getattr(torch, dtype), eps, math.prod(shape[:-1])


def workloads(logs: Iterable[Path | str], out_dir: Path | str) -> dict[str, int]:
    """Writes OUT_DIR/workloads/rmsnorm/<definition>.jsonl from the logs (see the module
    docstring), with the Definitions and jitk's Solutions; returns the Workload count of each
    Definition. A log that does not exist raises ArgumentError."""
    fib = require_fib()
    out_dir = Path(out_dir)
    paths = [Path(p) for p in logs]
    for path in paths:
        if not path.is_file():
            raise ArgumentError(f"jitk.fib.workloads: log {str(path)!r} is not a file")
    made: dict[str, list] = {}
    seen: set[tuple] = set()
    sizes: dict[str, tuple] = {}
    for path in paths:
        for op, arguments, dump in parse_log(path.read_text(errors="replace")):
            found = _workload_of(op, arguments)
            if found is None:
                continue
            name, hidden, dtype, eps, rows = found
            definition = fib_norm.definition_name(name, hidden, dtype, eps)
            sizes[definition] = (name, hidden, dtype, eps)
            names = _OPS[op][1]
            key = (definition, rows, str(dump) if dump and (dump / INPUTS_FILE).is_file()
                   else None)
            if key in seen:
                continue
            seen.add(key)
            workload_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "jitk:" + repr(key)))
            if key[2] is None:
                inputs = {kept: fib.data.RandomInput() for kept in names}
            else:
                blob = Path("blob", "workloads", "rmsnorm", definition,
                            f"{workload_id}.safetensors")
                (out_dir / blob).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(dump / INPUTS_FILE, out_dir / blob)
                inputs = {kept: fib.data.SafetensorsInput(path=str(blob), tensor_key=logged)
                          for kept, logged in names.items()}
            workload = fib.data.Workload(axes={"batch_size": rows}, inputs=inputs,
                                         uuid=workload_id)
            made.setdefault(definition, []).append(
                fib.data.Trace(definition=definition, workload=workload))
    for definition, traces in made.items():
        model = fib_norm.definition(*sizes[definition])
        write_model(out_dir, "definitions", model)
        write_model(out_dir, "solutions", fib_norm.solution(model))
        path = out_dir / "workloads" / model.op_type / f"{definition}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(t.model_dump(mode="json", exclude_none=True)) + "\n"
                                for t in traces))
    return {definition: len(traces) for definition, traces in made.items()}
