"""The op declarations of a persistent worker (jitk.persistent): an `Op` names its C++ struct
and the words of its `Args`, each a `TensorArg`, `IntArg` or `FloatArg`; `int_word` and
`float_word` turn an argument's value into its word."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from jitk.base.errors import ArgumentError, ArgumentTypeError

# An item's 8-byte words (persistent.cuh's Item), and how many of them hold arguments.
ITEM_WORDS, ARG_WORDS = 16, 12
INT64 = (-(2**63), 2**63 - 1)
# Names push() and push_many() take as their own: an op argument so named could not be passed.
RESERVED_NAMES = frozenset({"self", "op", "items", "after", "chain", "timeout"})


@dataclass(frozen=True)
class TensorArg:
    name: str
    dtype: torch.dtype
    shape: tuple[int | str | None, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise ArgumentTypeError(f"TensorArg '{self.name}': dtype must be a torch.dtype "
                                    f"(e.g. torch.bfloat16), got {self.dtype!r}")


@dataclass(frozen=True)
class IntArg:
    name: str


@dataclass(frozen=True)
class FloatArg:
    name: str


@dataclass(frozen=True)
class Op:
    """One op of a worker's table: `name` in push(), the C++ struct `cpp`, its `Args` words."""
    name: str
    cpp: str
    args: tuple[TensorArg | IntArg | FloatArg, ...]

    def __post_init__(self) -> None:
        names = [a.name for a in self.args]
        if reserved := sorted(RESERVED_NAMES.intersection(names)):
            raise ArgumentError(f"Op '{self.name}': argument '{reserved[0]}' has a name push() "
                                f"takes as its own ({', '.join(sorted(RESERVED_NAMES))}); "
                                "rename it")
        if len(names) != len(set(names)):
            raise ArgumentError(f"Op '{self.name}': argument names repeat: {names}")
        if len(self.args) > ARG_WORDS:
            raise ArgumentError(f"Op '{self.name}' has {len(self.args)} arguments; an item holds "
                                f"{ARG_WORDS} words")


_BF16 = torch.bfloat16
# The ops of persistent_chain.cuh (rows of n bf16 elements).
CHAIN_OPS = (
    Op("rmsnorm", "jitk::persistent::chain::RMSNorm",
       (TensorArg("x", _BF16, ("n",)), TensorArg("w", _BF16, ("n",)),
        TensorArg("y", _BF16, ("n",)), IntArg("n"), FloatArg("eps"))),
    Op("scale", "jitk::persistent::chain::Scale",
       (TensorArg("x", _BF16, ("n",)), TensorArg("y", _BF16, ("n",)), IntArg("n"),
        FloatArg("factor"))),
    Op("add", "jitk::persistent::chain::Add",
       (TensorArg("x", _BF16, ("n",)), TensorArg("b", _BF16, ("n",)),
        TensorArg("y", _BF16, ("n",)), IntArg("n"))),
)


def int_word(op: str, name: str, value: object, bound: int | None) -> int:
    if value is None and bound is not None:
        return bound
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{op}: '{name}' must be an int, got {type(value).__name__}")
    if bound is not None and value != bound:
        raise ArgumentError(f"{op}: '{name}' = {value} but the tensors' '{name}' is {bound}")
    if not INT64[0] <= value <= INT64[1]:
        raise ArgumentError(f"{op}: '{name}' = {value} does not fit an int64")
    return value


def float_word(op: str, name: str, value: object) -> int:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ArgumentTypeError(f"{op}: '{name}' must be a float, got {type(value).__name__}")
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]
