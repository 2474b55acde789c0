"""The two halves of a jitk.op call: the generated eager function, whose common case is a few
inlined type tests and a call of the op's slot, and the checked call it falls back to, which
names a wrong argument or hands the call to the operator."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable

import torch

from jitk.base.errors import ArgumentError
from jitk.runtime.argkinds import FAST_NAMES, SEQUENCES, Kind, bump_versions, describe, tensors

__all__ = ["CheckedCall", "eager_function"]


class CheckedCall:
    """The checked half of a call: every argument's type, then the operator, or the function
    itself where nothing traces and every tensor is plain."""

    def __init__(self, label: str, kinds: dict[str, Kind], keyword_only: list[str],
                 slot: dict, operator: torch._ops.OpOverload, written: list[str]) -> None:
        self.label, self.kinds, self.slot, self.operator = label, kinds, slot, operator
        self.keyword_only = keyword_only
        self.positional = len(kinds) - len(keyword_only)
        self.written = [list(kinds).index(name) for name in written]

    def __call__(self, values: tuple) -> object:
        for (name, kind), value in zip(self.kinds.items(), values):
            if not kind.accepts(value):
                raise TypeError(f"{self.label}(): '{name}' must be {kind.expected}, "
                                f"got {describe(value)}")
        args = values[:self.positional]
        kwargs = dict(zip(self.keyword_only, values[self.positional:]))
        if (torch.compiler.is_dynamo_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._len_torch_function_stack()
                or not all(k.plain(v) for k, v in zip(self.kinds.values(), values))
                or (torch.is_grad_enabled() and any(
                    isinstance(t, torch.Tensor) and t.requires_grad
                    for value in values for t in tensors(value)))):
            return self.operator(*args, **kwargs)
        for name, value in zip(self.kinds, values):
            if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors(value)):
                raise ArgumentError(f"{self.label}(): '{name}' is on device meta, expected cuda: "
                                    "a kernel needs the tensor's data (traced shapes come from "
                                    "FakeTensorMode or torch.compile)")
        result = self.slot["_jitk_fn"](*args, **kwargs)
        if self.written:
            bump_versions([t for i in self.written for t in tensors(values[i])])
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
    takes tensors and None only: lists go through CheckedCall."""
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
             and typing.get_origin(param.annotation) not in SEQUENCES]
    return f"\n            and (not _jitk_grad() or not ({' or '.join(tests)}))" if tests else ""


def eager_function(fn: Callable, signature: inspect.Signature, kinds: dict[str, Kind],
                   namespace: dict, written: list[str]) -> Callable:
    """A function with fn's parameters whose common case (no tracing, plain arguments of the
    annotated types) is a few inlined type tests and a call of the slot `_jitk_fn` in
    `namespace` (its globals). It is generated so that Python binds the arguments, as it does
    for fn: nothing is parsed per call."""
    namespace.update(FAST_NAMES, _jitk_bump=bump_versions,
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
