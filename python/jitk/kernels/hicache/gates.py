"""SGLang's gates: its pools ask these before they pick the JIT path, and get False (with a
warning logged) where a module cannot be built or loaded, never an exception."""

from __future__ import annotations

import logging
from collections.abc import Callable

from jitk.kernels.hicache import modules
from jitk.kernels.hicache.checks import checked_element_size, checked_unroll, optional_int
from jitk.kernels.hicache.reference import checked_int


def can_use_hicache_jit_kernel(*, element_size: int, unroll: int | None = None,
                               block_quota: int | None = None,
                               page_size: int | None = None) -> bool:
    """Whether transfers of rows of `element_size` bytes can run (page_size: any hint)."""
    return _can_build(lambda: (
        modules.kernel_module(checked_element_size(element_size, "element_size"),
                              checked_unroll(unroll)),
        optional_int(block_quota, "block_quota", 1),
        checked_int(1 if page_size is None else page_size, "page_size", 1),
        modules.copy_module()), element_size)


def can_use_write_back_jit_kernel(*, element_size: int, unroll: int | None = None,
                                  block_quota: int | None = None) -> bool:
    """Whether the staged write-back can run for rows of `element_size` bytes."""
    return _can_build(lambda: (checked_element_size(element_size, "element_size"),
                               checked_unroll(unroll),
                               optional_int(block_quota, "block_quota", 1),
                               modules.staged_module()), element_size)


def _can_build(build: Callable[[], object], element_size: object) -> bool:
    try:
        build()
    except Exception as error:  # noqa: BLE001 - a gate answers, whatever the build raised
        logging.getLogger(__package__).warning(
            "hicache: no JIT kernel for element_size=%r: %s", element_size, error)
        return False
    return True
