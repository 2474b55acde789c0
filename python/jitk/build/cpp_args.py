"""make_cpp_args: Python values to C++ template arguments."""

from __future__ import annotations

import math

# The aliases jitk/utils.cuh and <cstdint> define, so generated code reads like hand-written.
_DTYPE_NAMES = {
    "float16": "fp16_t",
    "bfloat16": "bf16_t",
    "float32": "fp32_t",
    "float64": "double",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "bool": "bool",
}


class CppArgs(tuple):
    """A tuple of C++ template argument strings; str() joins them with ', '."""

    def __str__(self) -> str:
        return ", ".join(self)


def _dtype_name(value: object) -> str | None:
    import torch

    if not isinstance(value, torch.dtype):
        return None
    name = str(value).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise TypeError(f"make_cpp_args: {value} has no C++ type in jitk "
                        f"(supported: {', '.join(sorted(_DTYPE_NAMES))})")
    return _DTYPE_NAMES[name]


def to_cpp_arg(value: object, position: int = 0) -> str:
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"make_cpp_args: argument {position} is {value}, which has no "
                             "C++ literal")
        return repr(value)
    dtype = _dtype_name(value)
    if dtype is None:
        raise TypeError(f"make_cpp_args: argument {position} has type {type(value).__name__}; "
                        "expected int, float, bool or torch.dtype")
    return dtype


def make_cpp_args(*values: object) -> CppArgs:
    """make_cpp_args(128, True, torch.bfloat16) -> ('128', 'true', 'bf16_t'), which
    str() renders as '128, true, bf16_t'."""
    return CppArgs(to_cpp_arg(v, i) for i, v in enumerate(values))
