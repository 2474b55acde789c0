"""The parity harness: an op against its reference.

    report = jitk.testing.check_op("rmsnorm")               # the op's own cases
    report = jitk.testing.check_op("mylib::axpy", cases=[Case("n=17", make)])

A Case builds one call's arguments: `make(device)` returns (args, kwargs), or (args, kwargs,
watched) where `watched` names further tensors to compare (memory an op writes through
pointers). Each case is built twice from one seed, once for the op and once for its
reference, with fresh random data; the tensors named in `outputs` (written, never read) are
poisoned (NaN, or all ones bits for integers) before either runs, so a result the op never
writes shows. Then every written argument, every watched tensor and the result are compared:
max abs and rel error and ULPs of the result's dtype per case, failing beyond the op's
tolerance (jitk.op(tolerance=...), else torch.testing's default for the dtype).

On a GPU, the cases run on it; a case that raises is reported as failed. The schema checks
run on the CPU (`device="cpu"`, also on a GPU machine; on the GPU, opcheck's copies of pinned
host tensors would be pageable): the cases are built there and opcheck runs the operator in
reference mode: the schema (what it writes, what aliases), the fake implementation's shapes
against the reference's results, and tracing. The kernels are not run there, unless
`kernels=True` says they run on the CPU (a host-only module's op).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable

import torch

from jitk.base.errors import JitkError
from jitk.runtime.op import OpInfo, op_info, reference_mode

__all__ = ["Case", "CaseReport", "ParityError", "check_op", "compare_with_reference"]


class ParityError(JitkError, AssertionError):
    """An op's results differ from its reference's beyond its tolerance."""


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    make: Callable[[torch.device], tuple]
    outputs: tuple[str, ...] = ()


@dataclasses.dataclass
class CaseReport:
    op: str
    case: str
    tensor: str
    dtype: str
    max_abs: float
    max_rel: float
    max_ulps: float
    ok: bool
    note: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        if self.tensor == "opcheck":
            return f"{mark} {self.op} [{self.case}] opcheck: {self.note}"
        return (f"{mark} {self.op} [{self.case}] {self.tensor} {self.dtype}: abs "
                f"{self.max_abs:.3g} rel {self.max_rel:.3g} ulps {self.max_ulps:.3g}"
                f"{' ' + self.note if self.note else ''}")


def _built(case: Case, device: torch.device, seed: int) -> tuple[tuple, dict, dict]:
    torch.manual_seed(seed)
    made = case.make(device)
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TypeError(f"case {case.label!r}: make(device) must return (args, kwargs) or "
                        f"(args, kwargs, watched), got {type(made).__name__}")
    args, kwargs, watched = (*made, {}) if len(made) == 2 else made
    return tuple(args), dict(kwargs), dict(watched)


def _poison(tensor: torch.Tensor) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(-1)


def _named(info: OpInfo, args: tuple, kwargs: dict) -> dict[str, object]:
    return dict(info.signature.bind(*args, **kwargs).arguments)


def _compared(info: OpInfo, named: dict, watched: dict, result: object) -> dict:
    """The tensors a call's effect is judged by: written arguments, watched ones, results."""
    tensors = {name: named[name] for name in info.mutates_args}
    tensors.update(watched)
    results = result if isinstance(result, tuple) else (result,)
    tensors.update({f"result[{i}]": r for i, r in enumerate(results)
                    if isinstance(r, torch.Tensor)})
    return tensors


def _ulp(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` around each value of want (float64)."""
    info = torch.finfo(dtype)
    magnitude = want.abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude))) * info.eps


def measure(op: str, case: str, name: str, got: torch.Tensor, want: torch.Tensor,
            tolerance: tuple[float, float] | None) -> CaseReport:
    """The differences of one tensor, and whether they are within tolerance."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return CaseReport(op, case, name, str(got.dtype), math.inf, math.inf, math.inf, False,
                          f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} "
                          f"{want.dtype}")
    dtype = str(got.dtype).removeprefix("torch.")
    if not got.dtype.is_floating_point:
        wrong = int((got != want.to(got.device)).sum())
        return CaseReport(op, case, name, dtype, float(wrong > 0), float(wrong > 0),
                          float(wrong > 0), wrong == 0, f"{wrong} differ" if wrong else "")
    # float64 where the tensors are (a GPU's results are not copied to the host)
    g, w = got.detach().double(), want.detach().double().to(got.device)
    nan_mismatch = int((g.isnan() != w.isnan()).sum())
    g, w = torch.nan_to_num(g, nan=0.0), torch.nan_to_num(w, nan=0.0)
    diff = (g - w).abs()
    atol, rtol = tolerance if tolerance is not None else \
        torch.testing._comparison.default_tolerances(got.dtype)[::-1]
    ok = nan_mismatch == 0 and bool((diff <= atol + rtol * w.abs()).all())
    empty = diff.numel() == 0
    return CaseReport(
        op, case, name, dtype, 0.0 if empty else float(diff.max()),
        0.0 if empty else float((diff / w.abs().clamp_min(1e-30)).where(diff > 0, 0).max()),
        0.0 if empty else float((diff / _ulp(w, got.dtype)).max()), ok,
        f"{nan_mismatch} NaN where the reference has none (or the reverse)"
        if nan_mismatch else "")


def _storage(value: object) -> int | None:
    return value.untyped_storage().data_ptr() if isinstance(value, torch.Tensor) else None


def _poison_outputs(outputs: Iterable[str], named: dict, watched: dict) -> None:
    """Poisons each output, unless it shares memory with another argument (an in-place call
    passes one tensor as input and output)."""
    for name in outputs:
        tensor = watched[name] if name in watched else named[name]
        others = {_storage(v) for k, v in named.items() if k != name}
        if _storage(tensor) not in others:
            _poison(tensor)


def _run_pair(info: OpInfo, fn: Callable, case: Case, device: torch.device,
              seed: int) -> list[CaseReport]:
    reports = []
    sides = []
    for run in (info.reference, fn):
        args, kwargs, watched = _built(case, device, seed)
        named = _named(info, args, kwargs)
        _poison_outputs(case.outputs, named, watched)
        result = run(*args, **kwargs)
        if device.type == "cuda":  # what the stream writes to host memory lands first
            torch.cuda.synchronize()
        sides.append(_compared(info, named, watched, result))
    want, got = sides
    if not want:  # an op with only effects outside torch's view: it ran, and returned
        return [CaseReport(info.name, case.label, "-", "-", 0.0, 0.0, 0.0, True,
                           "nothing written to compare")]
    for name in want:
        tolerance = info.tolerance_for(want[name].dtype)
        reports.append(measure(info.name, case.label, name, got[name], want[name], tolerance))
    return reports


def copied_arguments(value: object, memo: dict | None = None) -> object:
    """`value` with each tensor cloned (one clone per tensor, so aliases stay aliases; a
    pinned one stays pinned, as a kernel reading host memory needs)."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            clone = value.clone()
            memo[id(value)] = clone.pin_memory() if value.is_pinned() else clone
        return memo[id(value)]
    if isinstance(value, tuple | list):
        return type(value)(copied_arguments(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: copied_arguments(v, memo) for k, v in value.items()}
    return value


def compare_with_reference(info: OpInfo, fn: Callable, args: tuple, kwargs: dict,
                           outputs: tuple[str, ...] = ()) -> str | None:
    """Why fn(*args, **kwargs) differs from the reference on copies of these arguments
    (`outputs` poisoned), or None: the autotuner's check of a candidate."""
    case = Case("tuning", lambda device: copied_arguments((args, kwargs)), outputs)
    failed = [r for r in _run_pair(info, fn, case, torch.device("cuda"), 0) if not r.ok]
    return "; ".join(r.line() for r in failed) or None


def _cases(info: OpInfo, cases: Iterable[Case] | None) -> list[Case]:
    cases = info.cases if cases is None else cases
    if cases is None:
        raise ValueError(f"check_op: {info.name} has no cases; pass cases=[jitk.testing.Case"
                         "(label, make), ...] or declare them with jitk.op(cases=...)")
    cases = list(cases() if callable(cases) else cases)
    if not all(isinstance(case, Case) for case in cases):
        raise TypeError("check_op: cases must be jitk.testing.Case values")
    return cases


def check_op(op: object, cases: Iterable[Case] | None = None, *, device: str | None = None,
             kernels: bool | None = None, seed: int = 0,
             raise_on_failure: bool = True) -> list[CaseReport]:
    """Runs `op` against its reference over `cases` (default: the op's own) on `device`
    (default: the GPU if there is one, else "cpu"). `kernels` (default: whether the device is
    a GPU) runs the op itself and compares; without, opcheck runs the operator in reference
    mode (see the module docstring). Returns a report per compared tensor and case; raises
    ParityError if any fails (unless told not to)."""
    info = op_info(op, "check_op")
    if info.reference is None:
        raise ValueError(f"check_op: {info.name} has no reference; declare one with "
                         "jitk.op(reference=...)")
    cases = _cases(info, cases)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not (target.type == "cuda" if kernels is None else kernels):
        return _finish(info, _check_on_cpu(info, cases, seed), raise_on_failure)
    reports: list[CaseReport] = []
    for index, case in enumerate(cases):
        try:
            reports += _run_pair(info, info.fn, case, target, seed + index)
        except Exception as error:  # noqa: BLE001 - reported as the case's failure
            reports.append(CaseReport(info.name, case.label, "-", "-", math.inf, math.inf,
                                      math.inf, False, f"raised {type(error).__name__}: "
                                      f"{str(error).splitlines()[0][:300]}"))
    return _finish(info, reports, raise_on_failure)


def _structure(args: tuple, kwargs: dict) -> tuple:
    """What opcheck's schema and tracing checks depend on: each tensor's rank,
    contiguity, and which arguments share memory."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    storages = [_storage(t) for t in tensors]
    return tuple((t.dim(), t.is_contiguous(), storages.index(_storage(t)))
                 for t in tensors)


def _check_on_cpu(info: OpInfo, cases: list[Case], seed: int) -> list[CaseReport]:
    """Every case's fake-tensor check; the full opcheck (schema, tracing) once per argument
    structure, on its smallest case: the schema check costs seconds a call."""
    # Each case's watched tensors stay alive with it: pointer tables may point into them.
    built = [(case, *_built(case, torch.device("cpu"), seed + i))
             for i, case in enumerate(cases)]
    full = {}
    for case, args, kwargs, _ in built:
        size = sum(v.numel() for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        key = _structure(args, kwargs)
        if key not in full or size < full[key][0]:
            full[key] = (size, case.label)
    chosen = {label for _, label in full.values()}
    reports = []
    with reference_mode([info.name]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "jitk reference mode")
        for case, args, kwargs, _ in built:
            full_check = case.label in chosen
            try:
                torch.library.opcheck(info.operator, args, kwargs, test_utils=_OPCHECK_ALL
                                      if full_check else ("test_faketensor",))
                ok, note = True, ("schema, fake tensors, tracing" if full_check
                                  else "fake tensors")
            except Exception as error:  # noqa: BLE001 - reported as the case's failure
                ok, note = False, f"opcheck: {str(error).splitlines()[0][:300]}"
            reports.append(CaseReport(info.name, case.label, "opcheck", "-", 0.0, 0.0, 0.0,
                                      ok, note))
    return reports


_OPCHECK_ALL = ("test_schema", "test_autograd_registration", "test_faketensor",
                "test_aot_dispatch_dynamic")


def _finish(info: OpInfo, reports: list[CaseReport], raise_on_failure: bool) -> list:
    failed = [r for r in reports if not r.ok]
    if failed and raise_on_failure:
        raise ParityError(f"{info.name}: {len(failed)} of {len(reports)} comparisons beyond "
                          "tolerance:\n" + "\n".join(r.line() for r in failed))
    return reports
