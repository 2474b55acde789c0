"""The HiCache calls' value checks. Types are the operator layer's to check (jitk.op, from
the annotations); values are here and in jitk.kernels.hicache.reference (what the references
read too)."""

from __future__ import annotations

from jitk.kernels.hicache.reference import checked_int, slots_per_index

# What one index names: a slot (SGLang's meaning, whatever page_size is) or a page of
# page_size slots (jitk's page entry, asked for by name).
INDEX_GRANULARITIES = ("token", "page")
# Python's copy of the rules the C++ side (hicache_layout.cuh) holds for the template
# arguments, applied before any build; tests/test_hicache.py pins the pair.
VECTOR_BYTES = 16
MAX_ELEMENT_BYTES = 1 << 20
UNROLLS = (1, 2, 4, 8)
# Four 16-byte vectors per thread, read before any is written: 1024 threads x 4 vectors = 64
# KiB in flight per SM, more than HBM latency needs hidden, and over a few SMs about PCIe's
# bandwidth-latency product. A deeper unroll is built with fewer threads.
DEFAULT_UNROLL = 4
NOT_GIVEN = -1  # what the C++ side reads as "not given" for optional integers


def optional_int(value: int | None, name: str, least: int) -> int:
    return NOT_GIVEN if value is None else checked_int(value, name, least)


def checked_element_size(size: int, source: str) -> int:
    """A row size a module can be built for; `source` says where it came from."""
    if size <= 0 or size % VECTOR_BYTES:
        raise ValueError(f"hicache: a row of {size} bytes ({source}) cannot move as 16-byte "
                         "vectors; the element size must be a positive multiple of 16 bytes")
    if size > MAX_ELEMENT_BYTES:
        raise ValueError(f"hicache: a row of {size} bytes ({source}) is over the "
                         f"{MAX_ELEMENT_BYTES} bytes a module is built for")
    return size


def checked_unroll(unroll: object) -> int:
    if unroll is None:
        return DEFAULT_UNROLL
    value = checked_int(unroll, "unroll", 1)
    if value not in UNROLLS:
        raise ValueError(f"hicache: unroll must be one of {UNROLLS}, got {value}")
    return value


def checked_pages(page_size: object, index_granularity: object) -> tuple[int, int]:
    """(the page_size hint, the slots one index names) after checking both."""
    hint = checked_int(1 if page_size is None else page_size, "page_size", 1)
    if index_granularity not in INDEX_GRANULARITIES:
        raise ValueError(f"hicache: index_granularity must be one of {INDEX_GRANULARITIES}, "
                         f"got {index_granularity!r}")
    return hint, slots_per_index(hint, index_granularity)
