"""jitk.op: a Python function that calls a jitk module, made a PyTorch custom operator.

    @jitk.op("mylib::axpy", mutates_args=("y",))
    def axpy(alpha: float, x: torch.Tensor, y: torch.Tensor) -> None:
        _module(x.dtype).axpy(alpha, x, y)

registers `torch.ops.mylib.axpy` (its schema from the annotations, `y` declared written) and
returns a function of the same signature. That function first checks each argument's type
against its annotation (a TypeError names the parameter and what it got; a meta tensor, with
no data for a kernel, an ArgumentError naming it). Called eagerly on
plain tensors, it then calls `axpy` directly: no dispatcher, a fraction of a microsecond over
a direct call. While anything traces or transforms the call it calls the operator instead:
torch.compile, torch.export, make_fx, a FakeTensorMode or any other torch dispatch or
function mode, tensor subclasses; and where grad mode is on and a tensor argument requires
grad, so that autograd hears, as from any op without a formula, that it has none. So the
body, and the module loading or building in it, runs only when the operator runs, never
while a graph is traced.

Tracing needs the op's fake implementation: what it returns, without running the kernel.
jitk writes it for an op that returns nothing, and for one that returns tensors shaped like
its first tensor parameters (`empty_like` of each, in order). Any other op takes `fake=`, a
function of the same parameters that returns tensors of the right shape, dtype and device.

The operator is defined through torch.library's Library (define, impl, register_fake) rather
than torch.library.custom_op, whose Python layers multiply the host time of a call through the
dispatcher (as torch.compile's graphs make them; figures in docs/developer_guide/
debugging_and_performance.md, "Operators"). Its kernel is registered
for every device (CompositeExplicitAutograd): the kernels check devices themselves. It has no
autograd formula: a jitk kernel is a forward computation.

An op that returns nothing and writes no tensor argument exists for what it does outside
torch's view (a wait on a flag, a copy through raw pointers), so it is registered as having
side effects: no graph pass removes it.
Each op's OpInfo (name, body, signature, written arguments, reference, tolerance, tuning
space, operator) is in one registry, `registered_ops()`. Both call paths, the eager function
and the operator's kernel (through a trampoline), call one slot, `_jitk_fn` in the eager
function's globals; OpInfo.refresh() binds it to the body, or to the reference in reference
mode (`JITK_REFERENCE=rmsnorm,...` or `all`, read when an op is defined;
`with jitk.reference_mode(...)`), wrapped by each call wrapper (`add_call_wrapper`). With
neither, the slot is the body itself: a call costs no more than before.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import inspect
import re
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch

from jitk.base import settings
from jitk.base.errors import (
    ArgumentError,
    ArgumentTypeError,
    JitkError,
    SettingError,
    UnknownOpError,
)

__all__ = ["OpInfo", "Tolerance", "add_call_wrapper", "find_op", "op", "op_info", "reference_mode",
           "registered_ops", "remove_call_wrapper"]

_NONE = type(None)
_QUALIFIED_NAME = re.compile(r"[A-Za-z_]\w*::[A-Za-z_]\w*", re.ASCII)
_SEQUENCES = (list, collections.abc.Sequence)


class _Kind(NamedTuple):
    """How arguments of one annotation are checked. `fast` is a Python expression over {v},
    true for the common plain values; it is inlined in the eager path, so it names only
    _FAST_NAMES. `accepts` is the full test. `plain` says whether a kernel may take the
    value as it is (only tensors of other types may not)."""

    expected: str
    accepts: Callable[[object], bool]
    plain: Callable[[object], bool]
    fast: str


# Tensors a kernel takes as they are. Other tensor types (FakeTensor, FunctionalTensor,
# DTensor, ...) behave through the dispatcher, so a call with one goes there.
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
# Under aliases: a parameter may be called `int` or `type`.
_FAST_NAMES = {"_jitk_type": type, "_jitk_tensor": torch.Tensor,
               "_jitk_parameter": torch.nn.Parameter, "_jitk_int": int, "_jitk_float": float,
               "_jitk_bool": bool, "_jitk_str": str}


def _always(value: object) -> bool:
    return True


def _instance_of(accepted: tuple[type, ...], refused: tuple[type, ...] = ()):
    return lambda value: isinstance(value, accepted) and not isinstance(value, refused)


def _scalar(expected: str, accepted: tuple[type, ...], fast: str,
            refused: tuple[type, ...] = ()) -> _Kind:
    return _Kind(expected, _instance_of(accepted, refused), _always, fast)


_SCALARS: dict[object, _Kind] = {
    torch.Tensor: _Kind("a torch.Tensor", _instance_of((torch.Tensor,)),
                        lambda value: type(value) in _PLAIN_TENSORS,
                        # two `is` tests cost less than one set lookup; meta tensors go
                        # through _Call, which refuses them
                        "((_jitk_type({v}) is _jitk_tensor or _jitk_type({v}) is _jitk_parameter)"
                        " and not {v}.is_meta)"),
    # bool is an int to Python but never to a kernel: True where a size goes is a bug.
    int: _scalar("an int", (int, torch.SymInt), "_jitk_type({v}) is _jitk_int", (bool,)),
    float: _scalar("a float", (float, int, torch.SymFloat, torch.SymInt),
                   "_jitk_type({v}) is _jitk_float", (bool,)),
    bool: _scalar("a bool", (bool, torch.SymBool), "_jitk_type({v}) is _jitk_bool"),
    str: _scalar("a str", (str,), "_jitk_type({v}) is _jitk_str"),
    torch.dtype: _scalar("a torch.dtype", (torch.dtype,), "False"),
    torch.device: _scalar("a torch.device", (torch.device,), "False"),
}


def _kind(annotation: object, where: str) -> _Kind:
    if annotation is inspect.Parameter.empty:
        raise TypeError(f"{where} has no type annotation; jitk.op reads the schema from them")
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and _NONE in args:
        inner = _kind(args[0] if args[1] is _NONE else args[1], where)
        return _Kind(f"{inner.expected} or None",
                     lambda value: value is None or inner.accepts(value),
                     lambda value: value is None or inner.plain(value),
                     f"({{v}} is None or {inner.fast})")
    if origin in _SEQUENCES and len(args) == 1:
        item = _kind(args[0], where)
        return _Kind(f"a list of {item.expected.split(' ', 1)[1]}",
                     lambda value: isinstance(value, list | tuple)
                     and all(item.accepts(v) for v in value),
                     lambda value: all(item.plain(v) for v in value),
                     "False")  # lists take the checked path
    raise TypeError(f"{where} is annotated {annotation!r}; jitk.op checks torch.Tensor, int, "
                    "float, bool, str, torch.dtype, torch.device, lists of these, and any of "
                    "them or None")


def _describe(value: object) -> str:
    """What a wrong argument was: 'None', "str '4'", 'bool True', 'numpy.ndarray'."""
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
    return f"{name} {value!r}" if isinstance(value, bool | int | float | str) else name


# Marks tensors as written in place, as aten's in-place ops do, so that autograd refuses a
# backward that would read a saved tensor a kernel overwrote. One call for all of them.
_bump_versions = torch._C._increment_version


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of an argument: itself, those of a list, none for None."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if v is not None] if isinstance(value, list | tuple) else []


class _Call:
    """The checked half of a call: every argument's type, then the operator, or the function
    itself where nothing traces and every tensor is plain."""

    def __init__(self, label: str, kinds: dict[str, _Kind], keyword_only: list[str],
                 slot: dict, operator: torch._ops.OpOverload, written: list[str]) -> None:
        self.label, self.kinds, self.slot, self.operator = label, kinds, slot, operator
        self.keyword_only = keyword_only
        self.positional = len(kinds) - len(keyword_only)
        self.written = [list(kinds).index(name) for name in written]

    def __call__(self, values: tuple) -> object:
        for (name, kind), value in zip(self.kinds.items(), values):
            if not kind.accepts(value):
                raise TypeError(f"{self.label}(): '{name}' must be {kind.expected}, "
                                f"got {_describe(value)}")
        args = values[:self.positional]
        kwargs = dict(zip(self.keyword_only, values[self.positional:]))
        if (torch.compiler.is_dynamo_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._len_torch_function_stack()
                or not all(k.plain(v) for k, v in zip(self.kinds.values(), values))
                or (torch.is_grad_enabled() and any(
                    isinstance(t, torch.Tensor) and t.requires_grad
                    for value in values for t in _tensors(value)))):
            return self.operator(*args, **kwargs)
        for name, value in zip(self.kinds, values):
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in _tensors(value)):
                raise ArgumentError(f"{self.label}(): '{name}' is on device meta, expected cuda: "
                                    "a kernel needs the tensor's data (traced shapes come from "
                                    "FakeTensorMode or torch.compile)")
        result = self.slot["_jitk_fn"](*args, **kwargs)
        if self.written:
            _bump_versions([t for i in self.written for t in _tensors(values[i])])
        return result


_EAGER_PATH = """\
def _jitk_eager({parameters}):
    if (not _jitk_dynamo() and {fast}
            and not _jitk_dispatch_modes() and not _jitk_function_modes(){no_grad}):
        _jitk_result = _jitk_fn({arguments})
        {bump}
        return _jitk_result
    return _jitk_call(({values},))
"""


def _written_expression(signature: inspect.Signature, written: list[str]) -> str:
    """The list of tensors that a fast-path call wrote, as Python source. The fast path
    takes tensors and None only: lists go through _Call."""
    items = [name if signature.parameters[name].annotation is torch.Tensor
             else f"*(() if {name} is None else ({name},))" for name in written]
    return f"_jitk_bump([{', '.join(items)}])" if items else "pass"


def _no_grad_expression(signature: inspect.Signature) -> str:
    """The fast path's last test, as Python source: grad mode is off (one call: serving runs
    under no_grad or inference_mode), or no tensor argument asks for a gradient. An op has
    no autograd formula, so such a call goes to the operator, which tells autograd so (torch
    warns, as for any op without one) rather than returning a result cut off from the graph.
    Lists take the checked path."""
    tests = [f"{name}.requires_grad" if param.annotation is torch.Tensor
             else f"({name} is not None and {name}.requires_grad)"
             for name, param in signature.parameters.items()
             if param.annotation is torch.Tensor
             or torch.Tensor in typing.get_args(param.annotation)
             and typing.get_origin(param.annotation) not in _SEQUENCES]
    return f"\n            and (not _jitk_grad() or not ({' or '.join(tests)}))" if tests else ""


def _eager_function(fn: Callable, signature: inspect.Signature, kinds: dict[str, _Kind],
                    namespace: dict, written: list[str]) -> Callable:
    """A function with fn's parameters whose common case (no tracing, plain arguments of the
    annotated types) is a few inlined type tests and a call of the slot `_jitk_fn` in
    `namespace` (its globals). It is generated so that Python binds the arguments, as it does
    for fn: nothing is parsed per call."""
    namespace.update(_FAST_NAMES, _jitk_bump=_bump_versions,
                     _jitk_dynamo=torch.compiler.is_dynamo_compiling,
                     _jitk_grad=torch.is_grad_enabled,
                     _jitk_dispatch_modes=torch._C._len_torch_dispatch_stack,
                     _jitk_function_modes=torch._C._len_torch_function_stack)
    parameters, arguments = [], []
    for param in signature.parameters.values():
        if param.kind is param.KEYWORD_ONLY and "*" not in parameters:
            parameters.append("*")
        text = param.name
        if param.default is not param.empty:
            namespace[f"_jitk_default_{param.name}"] = param.default
            text += f"=_jitk_default_{param.name}"
        parameters.append(text)
        arguments.append(param.name if param.kind is param.POSITIONAL_OR_KEYWORD
                         else f"{param.name}={param.name}")
    source = _EAGER_PATH.format(
        parameters=", ".join(parameters), arguments=", ".join(arguments),
        no_grad=_no_grad_expression(signature),
        values=", ".join(kinds), bump=_written_expression(signature, written), fast=" and ".join(
            kind.fast.format(v=name) for name, kind in kinds.items()) or "True")
    exec(compile(source, f"<jitk.op {fn.__qualname__}>", "exec"), namespace)  # noqa: S102
    return functools.update_wrapper(namespace["_jitk_eager"], fn)


# One torch.library fragment per namespace, alive as long as the process: an operator
# lives as long as the Library object that defined it.
_LIBRARIES: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBRARIES[namespace]


def _returns_nothing(*args: object, **kwargs: object) -> None:
    return None


def _automatic_fake(label: str, signature: inspect.Signature) -> Callable:
    """The fake implementation jitk can write: nothing for an op that returns nothing;
    tensors like the first tensor parameters, in order, for one that returns tensors."""
    returns = signature.return_annotation
    if returns is inspect.Signature.empty:
        raise TypeError(f"jitk.op('{label}'): no return annotation; write -> None for an "
                        "operator that returns nothing")
    if returns in (None, _NONE):
        return _returns_nothing
    outputs = typing.get_args(returns) if typing.get_origin(returns) is tuple else (returns,)
    likes = [name for name, param in signature.parameters.items()
             if param.annotation is torch.Tensor][:len(outputs)]
    if not all(output is torch.Tensor for output in outputs) or len(likes) < len(outputs):
        raise TypeError(f"jitk.op('{label}'): returns {returns!r}, not tensors shaped like "
                        "its tensor parameters, so its fake implementation must be given: "
                        "fake=f, where f takes the same parameters and returns tensors of the "
                        "right shape, dtype and device (torch.empty(...) will do)")

    def fake(*args: object, **kwargs: object) -> object:
        arguments = signature.bind(*args, **kwargs).arguments
        made = tuple(torch.empty_like(arguments[name]) for name in likes)
        return made if typing.get_origin(returns) is tuple else made[0]

    return fake


def op(qualified_name: str, *, mutates_args: Iterable[str], fake: Callable | None = None,
       tags: Sequence[torch.Tag] = (), reference: Callable | None = None,
       tolerance: Tolerance | dict[torch.dtype, Tolerance] | None = None,
       cases: Callable[[], Iterable] | None = None) -> Callable[[Callable], Callable]:
    """Decorator: `fn` becomes the operator `torch.ops.<namespace>.<name>` for
    qualified_name "<namespace>::<name>", and the function returned calls it (see the module
    docstring). `mutates_args` names every tensor parameter fn writes; an op must not
    return one of its inputs (return nothing and let the caller return it). `fake` is the
    fake implementation where jitk cannot write it. `tags` are torch.Tag values for the
    operator: torch.Tag.cudagraph_unsafe keeps it out of the CUDA graphs Inductor records
    (mode="reduce-overhead"), which hand an operator copies of graph inputs, where it needs
    the caller's own memory (a flag, a pinned host cache). `reference` is a plain-torch
    function of the same parameters and semantics (in-place writes included): what the parity
    harness (jitk.testing.check_op) compares with, and what reference mode runs instead.
    `tolerance` is the largest difference from it the op allows (a Tolerance, or one per
    result dtype; see Tolerance). `cases` is a function returning the parity harness's
    default cases (jitk.testing.Case values). The operator
    is the `op` attribute, the OpInfo the `info` attribute."""
    if not isinstance(qualified_name, str) or not _QUALIFIED_NAME.fullmatch(qualified_name):
        raise ValueError(f"jitk.op: the name must be 'namespace::name', two identifiers "
                         f"(letters, digits, _), got {qualified_name!r}")
    given = mutates_args
    mutates_args = tuple(given) if isinstance(given, Iterable) and not isinstance(given, str) \
        else (given,)
    if not all(isinstance(name, str) for name in mutates_args) or isinstance(given, str):
        raise TypeError(f"jitk.op('{qualified_name}'): mutates_args takes parameter names, "
                        f"e.g. ('out',), or () for none, got {given!r}")
    if reference is not None and not callable(reference):
        raise TypeError(f"jitk.op('{qualified_name}'): reference must be a function, got "
                        f"{_describe(reference)}")
    if cases is not None and not callable(cases):
        raise TypeError(f"jitk.op('{qualified_name}'): cases must be a function returning "
                        f"jitk.testing.Case values, got {_describe(cases)}")
    tolerances = tolerance.values() if isinstance(tolerance, dict) else (tolerance,)
    if tolerance is not None and not all(isinstance(t, Tolerance) for t in tolerances):
        raise TypeError(f"jitk.op('{qualified_name}'): tolerance must be a jitk.Tolerance or a "
                        f"dict of them by dtype, got {_describe(tolerance)}")
    if qualified_name in _REGISTRY:
        raise ValueError(f"jitk.op: '{qualified_name}' is defined already")
    namespace, label = qualified_name.split("::")

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)
        for name in signature.parameters:
            if name.startswith("_jitk_"):  # the eager path's own names
                raise TypeError(f"jitk.op('{qualified_name}'): parameter name '{name}' is "
                                "reserved")
        kinds = {name: _kind(param.annotation, f"jitk.op('{qualified_name}'): '{name}'")
                 for name, param in signature.parameters.items()}
        if unknown := [name for name in mutates_args if name not in kinds]:
            raise ValueError(f"jitk.op('{qualified_name}'): mutates_args names "
                             f"{', '.join(map(repr, unknown))}, not a parameter of "
                             f"{fn.__qualname__}")
        fake_impl = fake or _automatic_fake(qualified_name, signature)

        # infer_schema reads annotations through __signature__: these are evaluated already,
        # whatever the defining module's `from __future__ import annotations`.
        def prototype() -> None: ...
        prototype.__signature__ = signature
        schema = torch.library.infer_schema(prototype, mutates_args=mutates_args)
        # The slot both paths call: the eager function's globals, and the operator's kernel
        # through a trampoline. OpInfo.refresh() rebinds it.
        slot = {"_jitk_fn": fn}

        def through_slot(*args: object, **kwargs: object) -> object:
            return slot["_jitk_fn"](*args, **kwargs)

        library = _library(namespace)
        library.define(label + schema, tags=tuple(tags))
        library.impl(label, through_slot, "CompositeExplicitAutograd")
        torch.library.register_fake(qualified_name, fake_impl, lib=library)
        operator = getattr(getattr(torch.ops, namespace), label).default
        if signature.return_annotation in (None, _NONE) and not mutates_args:
            torch.fx.node.has_side_effect(operator)
        keyword_only = [name for name, param in signature.parameters.items()
                        if param.kind is param.KEYWORD_ONLY]
        slot["_jitk_call"] = _Call(label, kinds, keyword_only, slot, operator,
                                   list(mutates_args))
        eager = _eager_function(fn, signature, kinds, slot, list(mutates_args))
        info = OpInfo(qualified_name, fn, signature, mutates_args, reference, tolerance,
                      operator, eager, slot, cases)
        eager.op, eager.info = operator, info
        _REGISTRY[qualified_name] = info
        info.refresh()
        return eager

    return decorate


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


def find_op(name: str) -> OpInfo:
    """The OpInfo of a qualified name, or of a bare one ('rmsnorm') if one namespace has it."""
    if not isinstance(name, str):
        raise TypeError(f"find_op: name must be a str, got {_describe(name)}")
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
                        f"{_describe(op)}")
    return info


def refresh_all() -> None:
    for info in _REGISTRY.values():
        info.refresh()


def add_call_wrapper(factory: Callable[[OpInfo, Callable], Callable | None]) -> None:
    """Wraps every op's calls, present and future: factory(info, fn) returns what to call in
    fn's place (it must call fn), or None to leave that op alone. Eager calls and calls
    through the operator both go through it."""
    if not callable(factory):
        raise TypeError(f"add_call_wrapper: factory must be callable, got {_describe(factory)}")
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
                                f"of op names, got {_describe(names)}")
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
