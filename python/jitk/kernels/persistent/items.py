"""A persistent worker's items (jitk.persistent): each (op, {argument: value}) pair checked
against its Op and packed into ITEM_WORDS 8-byte words (ticket, op index, dependency, then one
word per argument), alone for push() or as a Batch for push_many()."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from jitk.base.errors import ArgumentError, ArgumentTypeError
from jitk.kernels.persistent.ops import ITEM_WORDS, IntArg, Op, TensorArg, float_word, int_word

__all__ = ["Batch", "OpTable"]


@dataclass
class Batch:
    """Items checked and packed once (Worker.prepare), to push any number of times."""
    words: torch.Tensor  # int64 [n * ITEM_WORDS]; dependencies relative to the batch
    tensors: list[torch.Tensor]  # kept alive while the items may run
    count: int
    address: int = field(init=False)  # of words: what publish() takes, fetched once

    def __post_init__(self) -> None:
        self.address = self.words.data_ptr()

    @classmethod
    def of(cls, words: list[int], tensors: list[torch.Tensor]) -> Batch:
        """The batch of packed words, ITEM_WORDS per item."""
        packed = torch.frombuffer(bytearray(struct.pack(f"<{len(words)}q", *words)),
                                  dtype=torch.int64)
        return cls(packed, tensors, len(words) // ITEM_WORDS)


class OpTable:
    """A worker's ops by name, each with its index in the C++ table."""

    def __init__(self, ops: Sequence[Op]) -> None:
        self._ops = {op.name: (index, op) for index, op in enumerate(ops)}
        self._arg_names = {op.name: frozenset(a.name for a in op.args) for op in ops}
        if len(self._ops) != len(ops):
            raise ArgumentError(f"op names repeat: {[op.name for op in ops]}")

    def prepare(self, items: Iterable[tuple[str, dict]], chain: bool, capacity: int,
                device: torch.device) -> Batch:
        """Worker.prepare's batch, for a ring of `capacity` items on `device`."""
        words, tensors = [], []
        for i, item in enumerate(items):
            if not (isinstance(item, tuple | list) and len(item) == 2
                    and isinstance(item[1], dict)):
                raise ArgumentTypeError(f"item {i}: expected (op_name, {{argument: value}}), got "
                                        f"{item!r:.80}")
            words += self.pack(item[0], item[1], i - 1 if chain and i > 0 else -1, tensors,
                               device)
        if not words:
            raise ArgumentError("no items to push")
        batch = Batch.of(words, tensors)
        if batch.count > capacity:
            raise ArgumentError(f"{batch.count} items do not fit the ring of {capacity}")
        return batch

    def pack(self, op_name: str, args: dict, after: int, tensors: list,
             device: torch.device) -> list[int]:
        """One item's words; its tensors are appended to `tensors`."""
        try:
            index, op = self._ops[op_name]
        except (KeyError, TypeError):
            raise ArgumentError(f"unknown op {op_name!r}; this worker has "
                                f"{', '.join(self._ops)}") from None
        if unknown := args.keys() - self._arg_names[op_name]:
            raise ArgumentTypeError(f"{op_name}: unexpected argument(s) {sorted(unknown)}; it "
                                    f"takes {[a.name for a in op.args]}")
        sizes: dict[str, int] = {}
        words = [0, index, after]
        for arg in op.args:  # tensors first bind the shared sizes that ints may default to
            if isinstance(arg, TensorArg):
                tensors.append(_check_tensor(op_name, arg, args.get(arg.name), sizes, device))
        for arg in op.args:
            value = args.get(arg.name)
            if isinstance(arg, TensorArg):
                words.append(value.data_ptr())
            elif isinstance(arg, IntArg):
                words.append(int_word(op_name, arg.name, value, sizes.get(arg.name)))
            else:
                words.append(float_word(op_name, arg.name, value))
        return words + [0] * (ITEM_WORDS - len(words))


def _check_tensor(op: str, arg: TensorArg, value: object, sizes: dict[str, int],
                  device: torch.device) -> torch.Tensor:
    # Messages are built only on failure: this runs for every tensor of every push.
    if not isinstance(value, torch.Tensor):
        raise ArgumentTypeError(f"{op}: '{arg.name}' must be a tensor, got "
                                f"{type(value).__name__}")
    if value.dtype != arg.dtype:
        raise ArgumentTypeError(f"{op}: '{arg.name}' must be {arg.dtype}, got {value.dtype}")
    shape = value.shape
    if len(shape) != len(arg.shape):
        raise ArgumentError(f"{op}: '{arg.name}' must have {len(arg.shape)} dimension(s) "
                            f"{arg.shape}, got shape {tuple(shape)}")
    for dim, (rule, size) in enumerate(zip(arg.shape, shape)):
        expected = sizes.setdefault(rule, size) if isinstance(rule, str) else rule
        if expected is not None and size != expected:
            what = f"'{rule}' = {expected} (bound by an earlier tensor)" \
                if isinstance(rule, str) else expected
            raise ArgumentError(f"{op}: '{arg.name}' dimension {dim}: expected {what}, got "
                                f"{size}")
    if not value.is_contiguous():
        raise ArgumentError(f"{op}: '{arg.name}' must be contiguous, got strides "
                            f"{value.stride()}")
    if value.device != device:
        raise ArgumentError(f"{op}: '{arg.name}' must be on the worker's device "
                            f"{device}, got {value.device}")
    return value
