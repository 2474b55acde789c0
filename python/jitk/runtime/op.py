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

Here: the decorator, the library and the fake. How annotations are read: argkinds.py;
the call paths: eager.py; the registry, call wrappers and reference mode: opinfo.py.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Sequence

import torch

from jitk.runtime.argkinds import describe, kind_of
from jitk.runtime.eager import CheckedCall, eager_function
from jitk.runtime.opinfo import (
    OpInfo,
    Tolerance,
    add_call_wrapper,
    find_op,
    op_info,
    reference_mode,
    refresh_all,
    register,
    registered_ops,
    remove_call_wrapper,
)

__all__ = ["OpInfo", "Tolerance", "add_call_wrapper", "find_op", "op", "op_info", "reference_mode",
           "refresh_all", "registered_ops", "remove_call_wrapper"]

_QUALIFIED_NAME = re.compile(r"[A-Za-z_]\w*::[A-Za-z_]\w*", re.ASCII)


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
    if returns in (None, types.NoneType):
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
                        f"{describe(reference)}")
    if cases is not None and not callable(cases):
        raise TypeError(f"jitk.op('{qualified_name}'): cases must be a function returning "
                        f"jitk.testing.Case values, got {describe(cases)}")
    tolerances = tolerance.values() if isinstance(tolerance, dict) else (tolerance,)
    if tolerance is not None and not all(isinstance(t, Tolerance) for t in tolerances):
        raise TypeError(f"jitk.op('{qualified_name}'): tolerance must be a jitk.Tolerance or a "
                        f"dict of them by dtype, got {describe(tolerance)}")
    if qualified_name in registered_ops():
        raise ValueError(f"jitk.op: '{qualified_name}' is defined already")
    namespace, label = qualified_name.split("::")

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)
        for name in signature.parameters:
            if name.startswith("_jitk_"):  # the eager path's own names
                raise TypeError(f"jitk.op('{qualified_name}'): parameter name '{name}' is "
                                "reserved")
        kinds = {name: kind_of(param.annotation, f"jitk.op('{qualified_name}'): '{name}'")
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
        if signature.return_annotation in (None, types.NoneType) and not mutates_args:
            torch.fx.node.has_side_effect(operator)
        keyword_only = [name for name, param in signature.parameters.items()
                        if param.kind is param.KEYWORD_ONLY]
        slot["_jitk_call"] = CheckedCall(label, kinds, keyword_only, slot, operator,
                                         list(mutates_args))
        eager = eager_function(fn, signature, kinds, slot, list(mutates_args))
        info = OpInfo(qualified_name, fn, signature, mutates_args, reference, tolerance,
                      operator, eager, slot, cases)
        eager.op, eager.info = operator, info
        register(info)
        return eager

    return decorate
