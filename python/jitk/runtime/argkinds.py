"""How jitk.op reads a parameter's annotation: the kind of argument it accepts, the fast test
the eager path inlines, and whether a kernel may take the value as it is."""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["FAST_NAMES", "Kind", "SEQUENCES", "bump_versions", "describe", "kind_of", "tensors"]

SEQUENCES = (list, collections.abc.Sequence)


class Kind(NamedTuple):
    """How arguments of one annotation are checked. `fast` is a Python expression over {v},
    true for the common plain values; it is inlined in the eager path, so it names only
    FAST_NAMES. `accepts` is the full test. `plain` says whether a kernel may take the
    value as it is (only tensors of other types may not)."""

    expected: str
    accepts: Callable[[object], bool]
    plain: Callable[[object], bool]
    fast: str


# Tensors a kernel takes as they are. Other tensor types (FakeTensor, FunctionalTensor,
# DTensor, ...) behave through the dispatcher, so a call with one goes there.
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
# Under aliases: a parameter may be called `int` or `type`.
FAST_NAMES = {"_jitk_type": type, "_jitk_tensor": torch.Tensor,
              "_jitk_parameter": torch.nn.Parameter, "_jitk_int": int, "_jitk_float": float,
              "_jitk_bool": bool, "_jitk_str": str}


def _always(value: object) -> bool:
    return True


def _instance_of(accepted: tuple[type, ...], refused: tuple[type, ...] = ()):
    return lambda value: isinstance(value, accepted) and not isinstance(value, refused)


def _scalar(expected: str, accepted: tuple[type, ...], fast: str,
            refused: tuple[type, ...] = ()) -> Kind:
    return Kind(expected, _instance_of(accepted, refused), _always, fast)


_SCALARS: dict[object, Kind] = {
    torch.Tensor: Kind("a torch.Tensor", _instance_of((torch.Tensor,)),
                       lambda value: type(value) in _PLAIN_TENSORS,
                       # two `is` tests cost less than one set lookup; meta tensors go
                       # through CheckedCall, which refuses them
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


def kind_of(annotation: object, where: str) -> Kind:
    if annotation is inspect.Parameter.empty:
        raise TypeError(f"{where} has no type annotation; jitk.op reads the schema from them")
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and types.NoneType in args:
        inner = kind_of(args[0] if args[1] is types.NoneType else args[1], where)
        return Kind(f"{inner.expected} or None",
                    lambda value: value is None or inner.accepts(value),
                    lambda value: value is None or inner.plain(value),
                    f"({{v}} is None or {inner.fast})")
    if origin in SEQUENCES and len(args) == 1:
        item = kind_of(args[0], where)
        return Kind(f"a list of {item.expected.split(' ', 1)[1]}",
                    lambda value: isinstance(value, list | tuple)
                    and all(item.accepts(v) for v in value),
                    lambda value: all(item.plain(v) for v in value),
                    "False")  # lists take the checked path
    raise TypeError(f"{where} is annotated {annotation!r}; jitk.op checks torch.Tensor, int, "
                    "float, bool, str, torch.dtype, torch.device, lists of these, and any of "
                    "them or None")


def describe(value: object) -> str:
    """What a wrong argument was: 'None', "str '4'", 'bool True', 'numpy.ndarray'."""
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
    return f"{name} {value!r}" if isinstance(value, bool | int | float | str) else name


# Marks tensors as written in place, as aten's in-place ops do, so that autograd refuses a
# backward that would read a saved tensor a kernel overwrote. One call for all of them.
bump_versions = torch._C._increment_version


def tensors(value: object) -> list[torch.Tensor]:
    """The tensors of an argument: itself, those of a list, none for None."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if v is not None] if isinstance(value, list | tuple) else []

