"""jitk.op: a Python function that calls a jitk module, made a PyTorch custom operator.

    @jitk.op("mylib::axpy", mutates_args=("y",))
    def axpy(alpha: float, x: torch.Tensor, y: torch.Tensor) -> None:
        _module(x.dtype).axpy(alpha, x, y)

registers `torch.ops.mylib.axpy` (its schema from the annotations, `y` declared written) and
returns a function of the same signature. That function first checks each argument's type
against its annotation (a TypeError names the parameter and what it got). Called eagerly on
plain tensors, it then calls `axpy` directly: no dispatcher, a fraction of a microsecond over
a direct call. While anything traces or transforms the call it calls the operator instead:
torch.compile, torch.export, make_fx, a FakeTensorMode or any other torch dispatch or
function mode, tensor subclasses. So the body, and the module loading or building in it,
runs only when the operator runs, never while a graph is traced.

Tracing needs the op's fake implementation: what it returns, without running the kernel.
jitk writes it for an op that returns nothing, and for one that returns tensors shaped like
its first tensor parameters (`empty_like` of each, in order). Any other op takes `fake=`, a
function of the same parameters that returns tensors of the right shape, dtype and device.

The operator is defined through torch.library's Library (define, impl, register_fake) rather
than torch.library.custom_op, whose Python layers cost a call through the dispatcher (as
torch.compile's graphs make them) 33 us against 4 on the CI machine. Its kernel is registered
for every device (CompositeExplicitAutograd): the kernels check devices themselves. It has no
autograd formula: a jitk kernel is a forward computation.

An op that returns nothing and writes no tensor argument exists for what it does outside
torch's view (a wait on a flag, a copy through raw pointers), so it is registered as having
side effects: no graph pass removes it.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch

__all__ = ["op"]

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
                        # two `is` tests cost less than one set lookup
                        "(_jitk_type({v}) is _jitk_tensor or _jitk_type({v}) is _jitk_parameter)"),
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
                 fn: Callable, operator: torch._ops.OpOverload, written: list[str]) -> None:
        self.label, self.kinds, self.fn, self.operator = label, kinds, fn, operator
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
                or not all(k.plain(v) for k, v in zip(self.kinds.values(), values))):
            return self.operator(*args, **kwargs)
        result = self.fn(*args, **kwargs)
        if self.written:
            _bump_versions([t for i in self.written for t in _tensors(values[i])])
        return result


_EAGER_PATH = """\
def _jitk_eager({parameters}):
    if (not _jitk_dynamo() and {fast}
            and not _jitk_dispatch_modes() and not _jitk_function_modes()):
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


def _eager_function(fn: Callable, signature: inspect.Signature, kinds: dict[str, _Kind],
                    call: _Call, written: list[str]) -> Callable:
    """A function with fn's parameters whose common case (no tracing, plain arguments of the
    annotated types) is a few inlined type tests and fn itself. It is generated so that
    Python binds the arguments, as it does for fn: nothing is parsed per call."""
    namespace = {**_FAST_NAMES, "_jitk_fn": fn, "_jitk_call": call,
                 "_jitk_bump": _bump_versions,
                 "_jitk_dynamo": torch.compiler.is_dynamo_compiling,
                 "_jitk_dispatch_modes": torch._C._len_torch_dispatch_stack,
                 "_jitk_function_modes": torch._C._len_torch_function_stack}
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
        bump=_written_expression(signature, written),
        values=", ".join(kinds), fast=" and ".join(
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
       tags: Sequence[torch.Tag] = ()) -> Callable[[Callable], Callable]:
    """Decorator: `fn` becomes the operator `torch.ops.<namespace>.<name>` for
    qualified_name "<namespace>::<name>", and the function returned calls it (see the module
    docstring). `mutates_args` names every tensor parameter fn writes; an op must not
    return one of its inputs (return nothing and let the caller return it). `fake` is the
    fake implementation where jitk cannot write it. `tags` are torch.Tag values for the
    operator: torch.Tag.cudagraph_unsafe keeps it out of the CUDA graphs Inductor records
    (mode="reduce-overhead"), which hand an operator copies of graph inputs, where it needs
    the caller's own memory (a flag, a pinned host cache). The operator is the `op`
    attribute."""
    if not isinstance(qualified_name, str) or not _QUALIFIED_NAME.fullmatch(qualified_name):
        raise ValueError(f"jitk.op: the name must be 'namespace::name', two identifiers "
                         f"(letters, digits, _), got {qualified_name!r}")
    given = mutates_args
    mutates_args = tuple(given) if isinstance(given, Iterable) and not isinstance(given, str) \
        else (given,)
    if not all(isinstance(name, str) for name in mutates_args) or isinstance(given, str):
        raise TypeError(f"jitk.op('{qualified_name}'): mutates_args takes parameter names, "
                        f"e.g. ('out',), or () for none, got {given!r}")
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
        library = _library(namespace)
        library.define(label + schema, tags=tuple(tags))
        library.impl(label, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(qualified_name, fake_impl, lib=library)
        operator = getattr(getattr(torch.ops, namespace), label).default
        if signature.return_annotation in (None, _NONE) and not mutates_args:
            torch.fx.node.has_side_effect(operator)
        keyword_only = [name for name, param in signature.parameters.items()
                        if param.kind is param.KEYWORD_ONLY]
        call = _Call(label, kinds, keyword_only, fn, operator, list(mutates_args))
        eager = _eager_function(fn, signature, kinds, call, list(mutates_args))
        eager.op = operator
        return eager

    return decorate
