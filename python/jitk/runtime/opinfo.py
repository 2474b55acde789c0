"""What jitk knows about each op and what its slot holds.

Each op's OpInfo (name, body, signature, written arguments, reference, tolerance, tuning
space, operator) is in one registry, `registered_ops()`. Both call paths, the eager function
and the operator's kernel (through a trampoline), call one slot, `_jitk_fn` in the eager
function's globals; OpInfo.refresh() binds it to the body, or to the reference in reference
mode (`JITK_REFERENCE=rmsnorm,...` or `all`, read when an op is defined;
`with jitk.reference_mode(...)`), wrapped by each call wrapper (`add_call_wrapper`). With
neither, the slot is the body itself: a call costs no more than before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from jitk.base import settings
from jitk.base.errors import ArgumentTypeError, JitkError, SettingError, UnknownOpError
from jitk.runtime.argkinds import describe

__all__ = ["OpInfo", "Tolerance", "add_call_wrapper", "find_op", "op_info", "reference_mode",
           "refresh_all", "register", "registered_ops", "remove_call_wrapper"]


class Tolerance(NamedTuple):
    """How far an op's results may be from its reference's, per element: |got - want| <=
    atol + rtol * |want|. None (the default) means torch.testing.assert_close's defaults for
    the result's dtype."""

    atol: float
    rtol: float


@dataclasses.dataclass(eq=False)
class OpInfo:
    """What jitk knows about one operator; `registered_ops()` lists them. `cases` gives the
    parity harness's default cases (jitk.testing); `tuning` is the TuningSpace a kernel
    module attaches (jitk.autotune), or None."""

    name: str
    fn: Callable
    signature: inspect.Signature
    mutates_args: tuple[str, ...]
    reference: Callable | None
    tolerance: Tolerance | dict[torch.dtype, Tolerance] | None
    operator: torch._ops.OpOverload
    eager: Callable
    slot: dict = dataclasses.field(repr=False)
    cases: Callable | None = None
    tuning: object = None

    @property
    def label(self) -> str:
        """The name without its namespace: 'rmsnorm' for 'jitk::rmsnorm'."""
        return self.name.split("::")[1]

    def tolerance_for(self, dtype: torch.dtype) -> Tolerance | None:
        """The declared tolerance for results of `dtype`; None: assert_close's default."""
        if isinstance(self.tolerance, dict):
            return self.tolerance.get(dtype)
        return self.tolerance

    def uses_reference(self) -> bool:
        return self.reference is not None and _reference_selects(self)

    def refresh(self) -> None:
        """Rebinds the slot both call paths use: the body or, in reference mode, the reference;
        then wrapped by each call wrapper, in the order they were added. With neither, the
        slot is the body itself, and a call costs what it did before wrappers existed."""
        fn = self.fn
        if not _blocks and (selection := _environment_selection()) \
                and selection not in _checked_environment:
            fn = _checking_first(fn)
        if self.uses_reference():
            fn = self.reference
            if _selection() not in _warned_selection:
                fn = _warning_first(fn)
        for factory in _CALL_WRAPPERS:
            fn = factory(self, fn) or fn
        self.slot["_jitk_fn"] = fn


_REGISTRY: dict[str, OpInfo] = {}
# factory(info, fn) -> a function to call instead of fn, or None to leave fn as it is.
_CALL_WRAPPERS: list[Callable[[OpInfo, Callable], Callable | None]] = []


def registered_ops() -> dict[str, OpInfo]:
    """Every operator jitk.op defined in this process, by qualified name ('jitk::rmsnorm')."""
    return dict(_REGISTRY)


def register(info: OpInfo) -> None:
    """Adds the OpInfo of a newly defined op (jitk.op does) and binds its slot."""
    _REGISTRY[info.name] = info
    info.refresh()


def find_op(name: str) -> OpInfo:
    """The OpInfo of a qualified name, or of a bare one ('rmsnorm') if one namespace has it."""
    if not isinstance(name, str):
        raise TypeError(f"find_op: name must be a str, got {describe(name)}")
    found = [info for key, info in _REGISTRY.items() if name in (key, info.label)]
    if len(found) != 1:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        problem = f"no jitk op named {name!r}" if not found else \
            f"{name!r} names {len(found)} ops; give the namespace"
        raise UnknownOpError(f"{problem} (registered: {known})")
    return found[0]


def op_info(op: object, caller: str) -> OpInfo:
    """The OpInfo of a jitk op given as its function, its OpInfo or its name."""
    if isinstance(op, OpInfo):
        return op
    if isinstance(op, str):
        return find_op(op)
    info = getattr(op, "info", None)
    if not isinstance(info, OpInfo):
        raise TypeError(f"{caller}: expected a jitk op (function, OpInfo or name), got "
                        f"{describe(op)}")
    return info


def refresh_all() -> None:
    for info in _REGISTRY.values():
        info.refresh()


def add_call_wrapper(factory: Callable[[OpInfo, Callable], Callable | None]) -> None:
    """Wraps every op's calls, present and future: factory(info, fn) returns what to call in
    fn's place (it must call fn), or None to leave that op alone. Eager calls and calls
    through the operator both go through it."""
    if not callable(factory):
        raise TypeError(f"add_call_wrapper: factory must be callable, got {describe(factory)}")
    if factory not in _CALL_WRAPPERS:
        _CALL_WRAPPERS.append(factory)
    refresh_all()


def remove_call_wrapper(factory: Callable) -> None:
    """Undoes add_call_wrapper(factory); a factory never added raises ValueError."""
    _CALL_WRAPPERS.remove(factory)
    refresh_all()


# ---------------------------------------------------------------------------------------
# Reference mode: named ops run their references instead of their kernels, process-wide
# (the slot is one per op), to bisect a wrong answer or run where a kernel cannot build.

REFERENCE_ENV = "JITK_REFERENCE"
# reference_mode's open blocks, (token, selection), innermost last. Each block removes its own
# token, so blocks that overlap (in threads) or nest each restore exactly what they replaced.
_blocks: list[tuple[object, frozenset[str]]] = []
_warned_selection: set[frozenset[str]] = set()
_checked_environment: set[frozenset[str]] = set()


def _parse_selection(names: object, where: str) -> frozenset[str]:
    if isinstance(names, str):
        names = names.split(",")
    if not isinstance(names, Iterable):
        raise ArgumentTypeError(f"{where}: ops must be 'all', a comma-separated str or a list "
                                f"of op names, got {describe(names)}")
    names = list(names)
    if not all(isinstance(name, str) for name in names):
        raise ArgumentTypeError(f"{where}: every op name must be a str")
    return frozenset(name.strip() for name in names) - {""}


def _environment_selection() -> frozenset[str]:
    return frozenset(settings.get(REFERENCE_ENV))


def _check_selection(selection: frozenset[str], where: str,
                     error: type[JitkError] = UnknownOpError) -> None:
    """Every name of `selection` ('all' aside) names a registered op that has a reference."""
    with_reference = [info for info in _REGISTRY.values() if info.reference is not None]
    bad = sorted(name for name in selection if name != "all"
                 and not any(_selected(info, frozenset({name})) for info in with_reference))
    if bad:
        raise error(
            f"{where}: {', '.join(bad)} names no registered jitk op with a reference (ops "
            f"with one: {', '.join(sorted(i.name for i in with_reference)) or 'none'}; "
            f"registered: {', '.join(sorted(_REGISTRY)) or 'none'})")


def _selected(info: OpInfo, selection: frozenset[str]) -> bool:
    return bool(selection & {"all", info.name, info.label})


def _selection() -> frozenset[str]:
    return _blocks[-1][1] if _blocks else _environment_selection()


def _reference_selects(info: OpInfo) -> bool:
    return _selected(info, _selection())


def _checking_first(fn: Callable) -> Callable:
    """fn, preceded by a check of JITK_REFERENCE's names against the ops registered by then
    (families register as they are imported, so not earlier); once it passes, the slots drop
    the check."""
    def first_call(*args: object, **kwargs: object) -> object:
        selection = _environment_selection()
        if selection not in _checked_environment:
            _check_selection(selection, f"{REFERENCE_ENV}={','.join(sorted(selection))}",
                             SettingError)
            _checked_environment.add(selection)
            refresh_all()
        return fn(*args, **kwargs)

    return first_call


def _warning_first(fn: Callable) -> Callable:
    """fn, preceded on the first call by the one warning of this selection, which names every
    op it switched; the slots then hold the references themselves."""
    def first_call(*args: object, **kwargs: object) -> object:
        selection = _selection()
        if selection not in _warned_selection:
            _warned_selection.add(selection)
            switched = sorted(info.name for info in _REGISTRY.values() if info.uses_reference())
            warnings.warn(f"jitk reference mode ({', '.join(sorted(selection))}): these ops run "
                          f"their plain-torch references, not their kernels: "
                          f"{', '.join(switched)}", stacklevel=3)
            refresh_all()
        return fn(*args, **kwargs)

    return first_call


@contextlib.contextmanager
def reference_mode(ops: object = "all"):
    """Within the block, the named ops ('all', 'rmsnorm,fused_add_rmsnorm', or a list; bare
    or qualified names) run their references; the others run their kernels, whatever
    JITK_REFERENCE says. A name of no registered op with a reference raises UnknownOpError
    at once. Process-wide, not per thread (each op has one slot): every thread's calls
    switch, and the innermost open block, whichever thread opened it, decides. Each block on
    leaving removes its own selection, not the last one opened."""
    selection = _parse_selection(ops, "reference_mode")
    _check_selection(selection, f"reference_mode({ops!r})")
    token = object()
    _blocks.append((token, selection))
    refresh_all()
    try:
        yield
    finally:
        _blocks[:] = [block for block in _blocks if block[0] is not token]
        refresh_all()
