"""The HiCache family's JIT modules: the transfer kernel (one per row size and unroll), the
copy engines' entry points and the staged write-back, each loaded once. Callers look the
loaders up through this module (`modules.kernel_module(...)`), so a test can stand in for
one in one place."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from jitk.build.cpp_args import make_cpp_args
from jitk.build.jit import load_jit

# Each module's files, every header it includes among them, so that an edit of any changes the
# module's cache key (load_jit hashes the files it is given).
KERNEL_FILES = ("hicache_layout.cuh", "hicache.cuh")
COPY_FILES = ("hicache_layout.cuh", "hicache_copy_list.cuh", "hicache_copy.cuh")
STAGED_FILES = (*COPY_FILES, "hicache_staged.cuh")
MODULE_FILES = (KERNEL_FILES, COPY_FILES, STAGED_FILES)
ENTRY_POINTS = ("one_layer", "one_layer_mla", "all_layer", "all_layer_mla")
# Each entry point's host code is a unit of its own, compiled side by side: the four share
# little, and one unit holding all of them took the host compiler most of the build
# (docs/developer_guide/debugging_and_performance.md, "a host half in several units"). The
# headers hold only inline and template definitions, as load_jit(host_units=...) asks.
HOST_UNITS = len(ENTRY_POINTS)


class Entries(NamedTuple):
    one_layer: Callable
    one_layer_mla: Callable
    all_layer: Callable
    all_layer_mla: Callable


@functools.cache
def kernel_module(element_size: int, unroll: int) -> Entries:
    """The kernel for rows of element_size bytes; both checked by the caller."""
    args = make_cpp_args(element_size, unroll)
    entry = f"jitk::hicache::HiCache<{args}>"
    module = load_jit("hicache", *args, cuda_files=list(KERNEL_FILES), cuda_compiler="auto",
                      cuda_wrappers=[(name, f"{entry}::{name}") for name in ENTRY_POINTS],
                      host_units=HOST_UNITS)
    # Fetched once: a module attribute lookup goes through the FFI each time.
    return Entries(*(getattr(module, name) for name in ENTRY_POINTS))


@functools.cache
def copy_module():
    """The copy-engine entry points: one module for every element size."""
    names = (*ENTRY_POINTS, "vector_bytes", "element_size_supported", "unroll_supported",
             "pointer_device")
    return load_jit("hicache_copy", cuda_files=list(COPY_FILES), cuda_compiler="auto",
                    cuda_wrappers=[(name, f"jitk::hicache::CopyEngine::{name}")
                                   for name in names], host_units=HOST_UNITS)


@functools.cache
def staged_module():
    """The staged write-back (a gather kernel and the copy engines): every element size."""
    return load_jit("hicache_staged", cuda_files=list(STAGED_FILES), cuda_compiler="auto",
                    cuda_wrappers=[(name, f"jitk::hicache::StagedWriteBack::{name}")
                                   for name in ("lf_pf", "lf_pf_mla")], host_units=2)


@functools.cache
def copy_entries() -> Entries:
    module = copy_module()
    return Entries(*(getattr(module, name) for name in ENTRY_POINTS))
