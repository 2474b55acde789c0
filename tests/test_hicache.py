"""HiCache KV transfers (jitk/kernels/hicache/*.cuh through jitk.kernels.hicache).

CPU part: the modules build for sm_90; SGLang's call forms reach the C++ checks; every entry
point refuses bad arguments with a message naming the argument and the rule, and refuses
template arguments in Python before any build. GPU part: every method, layout, direction and
page size against a byte-exact reference computed with torch on the CPU, destinations
poisoned beforehand (padding and other layers included in the comparison)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import mmap
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from errors import expect_error

from jitk.kernels import hicache
from jitk.kernels.hicache import checks, methods, modules, ops, tuning

POISON = 0x7F

# The one kernel module the CPU tests build: rows of 128 float16 = 256 bytes.
ROW = 128
ROW_BYTES = 256


def cpu_rows(rows=16, width=ROW, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(rows, width).to(dtype)


def one_layer_args(**changes) -> dict:
    args = {"k_cache_dst": cpu_rows(), "v_cache_dst": cpu_rows(),
            "indices_dst": torch.arange(4), "k_cache_src": cpu_rows(20),
            "v_cache_src": cpu_rows(20), "indices_src": torch.arange(4)}
    return {**args, **changes}


def one_layer(**changes):
    return lambda: hicache.transfer_hicache_one_layer(**one_layer_args(**changes))


# ------------------------------------------------------------------------------ CPU / CI
def test_modules_build_for_sm90():
    kernels = modules.kernel_module(ROW_BYTES, hicache.DEFAULT_UNROLL)
    assert all(callable(f) for f in kernels)
    assert modules.kernel_module(ROW_BYTES, hicache.DEFAULT_UNROLL) is kernels  # cached
    assert all(callable(f) for f in modules.copy_entries())


def test_python_rules_for_template_arguments_match_the_cpp_ones():
    module = modules.copy_module()
    assert module.vector_bytes() == hicache.VECTOR_BYTES
    for unroll in range(17):
        assert module.unroll_supported(unroll) == (unroll in hicache.UNROLLS), unroll
    for size in (0, 8, 16, 40, 48, 4096, hicache.MAX_ELEMENT_BYTES,
                 hicache.MAX_ELEMENT_BYTES + 16, 2**40):
        fits = size > 0 and size % hicache.VECTOR_BYTES == 0 and size <= hicache.MAX_ELEMENT_BYTES
        assert module.element_size_supported(size) == fits, size


def test_every_tuned_unroll_is_one_the_cpp_builds():
    """The tuner's unroll values (and the default) pass hicache.cuh's static_assert: none
    fails to build mid-tuning."""
    module = modules.copy_module()
    assert hicache.DEFAULT_UNROLL in tuning.LAUNCH_KNOBS["unroll"]
    for unroll in tuning.LAUNCH_KNOBS["unroll"]:
        assert module.unroll_supported(unroll), unroll


def cache_entries() -> set[str]:
    return set(os.listdir(os.environ["JITK_CACHE_DIR"]))


def test_impossible_template_arguments_are_refused_before_any_build():
    before = cache_entries()
    expect_error(one_layer(element_dim=2**62, method="kernel"), "element_dim", "a row of",
                 "over the", kind=ValueError)
    expect_error(one_layer(element_dim=True), "'element_dim' must be an int or None, got bool",
                 kind=TypeError)
    expect_error(one_layer(unroll="4", method="kernel"), "'unroll' must be an int or None, "
                 "got str", kind=TypeError)
    expect_error(one_layer(block_quota="4"), "'block_quota' must be an int or None, got str",
                 kind=TypeError)
    expect_error(all_layer(element_size=2**31), "a row of 2147483648 bytes (element_size)",
                 kind=ValueError)
    expect_error(all_layer(kv_cache_src_stride_bytes=2**40, kv_cache_dst_stride_bytes=2**40),
                 "kv_cache_src_stride_bytes", "over the", kind=ValueError)
    assert cache_entries() == before


class Recorder:
    """Stands in for the kernel and copy-engine modules: records each entry point's call."""

    def __init__(self, monkeypatch):
        self.calls = []
        # "kernel" or "copy_engine", one per call, and one when a bucket's kernel launch is
        # first chosen (tuning.Launch loads its kernel).
        self.modules = []
        monkeypatch.setattr(modules, "kernel_module", self.entries)
        monkeypatch.setattr(modules, "copy_entries", self.entries)

    def entries(self, *module_args):
        self.modules.append("kernel" if module_args else "copy_engine")
        return modules.Entries(*(functools.partial(self.record, name)
                                  for name in modules.ENTRY_POINTS))

    def record(self, name, *args):
        self.calls.append((name, args))


def test_element_dim_defaults_to_the_last_dimension_as_in_sglang(monkeypatch):
    calls = Recorder(monkeypatch).calls
    heads = torch.randn(16, 4, 32).half()
    hicache.transfer_hicache_one_layer(**one_layer_args(k_cache_dst=heads, v_cache_dst=heads))
    hicache.transfer_hicache_one_layer_mla(heads, torch.arange(4), heads, torch.arange(4),
                                           element_dim=128)
    (_, kv_args), (_, mla_args) = calls
    assert (kv_args[6], mla_args[4]) == (32, 128)  # element_dim as the entries receive it


def expand(indices: list[int], page_size: int, granularity: str) -> list[int]:
    """The slots an index list names: each index one slot (SGLang's meaning, whatever
    page_size is), or, by jitk's page granularity, page_size slots from each page's first."""
    if granularity == "token":
        return list(indices)
    return [indices[k] + j for k in range(0, len(indices), page_size) for j in range(page_size)]


def slots_the_entry_moves(indices: list[int], slots_per_index: int) -> list[int]:
    """What the C++ entry points do with the page count Python passes them (hicache_layout.cuh:
    the first index of each run of slots_per_index names that many slots)."""
    return expand(indices, slots_per_index, "page" if slots_per_index > 1 else "token")


# SGLang's HiSparse coordinator (DeepSeek V3.2) calls with page_size=64 and a top-k of
# token indices: any length, any order.
@pytest.mark.parametrize("count", [5, 100, 128, 165])
@pytest.mark.parametrize("page_size", [None, 1, 16, 64, 128])
@pytest.mark.parametrize("method", ["kernel", "copy_engine"])
def test_page_size_never_changes_which_rows_move(monkeypatch, method, page_size, count):
    calls = Recorder(monkeypatch).calls
    cache = torch.randn(1024, ROW).half()
    indices = torch.randperm(1024)[:count]
    hicache.transfer_hicache_one_layer_mla(cache, indices, cache, indices, page_size=page_size,
                                           method=method)
    table = torch.zeros(2, dtype=torch.int64)
    hicache.transfer_hicache_all_layer_mla(table, indices, table, indices, page_size=page_size,
                                           cache_src_stride_bytes=ROW_BYTES,
                                           cache_dst_stride_bytes=ROW_BYTES, method=method)
    (_, one), (_, every) = calls
    for slots_per_index in (one[5], every[7]):
        moved = slots_the_entry_moves(indices.tolist(), slots_per_index)
        assert moved == expand(indices.tolist(), page_size or 1, "token") == indices.tolist()
    assert every[8] == (page_size or 1)  # the cache's pages, for the page strides


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_granularity_is_asked_for_by_name(monkeypatch, page_size):
    calls = Recorder(monkeypatch).calls
    cache = torch.randn(1024, ROW).half()
    firsts = (torch.randperm(1024 // page_size)[:4] * page_size).tolist()
    indices = torch.tensor([f + j for f in firsts for j in range(page_size)])
    hicache.transfer_hicache_one_layer_mla(cache, indices, cache, indices, page_size=page_size,
                                           index_granularity="page", method="copy_engine")
    slots_per_index = calls[0][1][5]
    assert slots_the_entry_moves(indices.tolist(), slots_per_index) == expand(
        indices.tolist(), page_size, "page")
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(
        cache, indices, cache, indices, index_granularity="pages"),
        "index_granularity must be one of ('token', 'page'), got 'pages'", kind=ValueError)


def test_methods_are_named():
    expect_error(one_layer(method="dma"), "method must be one of ('auto', 'kernel', "
                 "'copy_engine'), got 'dma'", kind=ValueError)


def test_cpu_pageable_indices_are_refused_by_the_kernel_naming_them():
    expect_error(one_layer(method="kernel"), "'indices_dst' is in pageable host memory",
                 "method='copy_engine'", "hicache.cuh:")
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(
        cpu_rows(), torch.arange(3), cpu_rows(), torch.arange(3), method="kernel"),
        "'indices_dst' is in pageable host memory")


def test_index_lists_must_agree_in_length_and_dtype():
    expect_error(one_layer(indices_src=torch.arange(5)), "'indices_src'",
                 "Size mismatch for shape#0('indices length'): expected 4 but got 5")
    expect_error(one_layer(indices_dst=torch.arange(4).float()), "'indices_dst'",
                 "DType mismatch: expected one of [int32, int64] but got float32")
    expect_error(one_layer(indices_src=torch.arange(4, dtype=torch.int32)), "'indices_src'",
                 "expected int64 (as an earlier tensor) but got int32")
    expect_error(one_layer(indices_dst=torch.arange(8)[::2]), "'indices_dst'",
                 "Stride mismatch")
    expect_error(one_layer(indices_dst=torch.arange(4).view(2, 2)), "'indices_dst'",
                 "Dimension mismatch: expected 1 dims but got 2")
    expect_error(one_layer(indices_dst=[0, 1]), "'indices_dst' must be a torch.Tensor, got list",
                 kind=TypeError)


def test_k_and_v_must_agree_in_shape_and_all_caches_in_dtype():
    expect_error(one_layer(v_cache_dst=cpu_rows(17)), "'v_cache_dst'",
                 "Size mismatch for shape#0('dst tokens'): expected 16 but got 17",
                 ".cuh:")
    expect_error(one_layer(v_cache_src=cpu_rows(21)), "'v_cache_src'",
                 "Size mismatch for shape#0('src tokens'): expected 20 but got 21")
    expect_error(one_layer(v_cache_src=cpu_rows(20, dtype=torch.bfloat16)),
                 "'v_cache_src' has dtype bfloat16 but 'k_cache_dst' has float16")
    # Same bytes per row, different split into elements: the element dim differs.
    expect_error(one_layer(k_cache_src=cpu_rows(20, ROW // 2, torch.float32)),
                 "'k_cache_src' has dtype float32 but 'k_cache_dst' has float16")


def test_element_size_must_be_a_multiple_of_16_bytes():
    expect_error(one_layer(k_cache_dst=cpu_rows(16, 20)), "a row of 40 bytes",
                 "multiple of 16 bytes", kind=ValueError)
    expect_error(one_layer(element_dim=100), "a row of 200 bytes", kind=ValueError)


def test_rows_must_be_contiguous_and_at_most_two_strides_apart():
    expect_error(one_layer(k_cache_src=cpu_rows(20, 2 * ROW)[:, ::2]), "'k_cache_src'",
                 "must be contiguous", "dimension 1 has stride 2")
    padded = torch.randn(16, 256).half()[:, :240].unflatten(1, (3, 80))
    expect_error(one_layer(k_cache_dst=padded, element_dim=ROW), "'k_cache_dst'",
                 "must be contiguous", "dimension 0 has stride 256 where 240 was needed")
    three_strides = torch.randn(2, 3, 10, ROW).half()[:, :2, :8]
    expect_error(one_layer(k_cache_dst=three_strides, element_dim=ROW), "'k_cache_dst'",
                 "under at most two strides (a row stride and a page stride)",
                 "dimension 0 has stride 3840 where 2560 was needed")
    expect_error(one_layer(k_cache_dst=cpu_rows(1, ROW).expand(16, ROW)), "'k_cache_dst'",
                 "overlap")


def test_leading_dimensions_flatten_into_rows_under_one_or_two_strides():
    # [2, 8, 128] with element_dim 128 is 16 rows, as are rows split out of one contiguous
    # run and pages of 8 rows with a gap between them (a page stride): each passes every
    # cache check and stops only at the pageable memory.
    pageable = "is in pageable host memory"
    expect_error(one_layer(k_cache_dst=torch.randn(2, 8, ROW).half(), element_dim=ROW),
                 pageable)
    expect_error(one_layer(v_cache_dst=torch.randn(8, 2 * ROW).half(), element_dim=ROW),
                 pageable)
    gappy = torch.randn(2, 10, ROW).half()[:, :8]
    expect_error(one_layer(v_cache_dst=gappy, element_dim=ROW), pageable)
    expect_error(one_layer(v_cache_dst=torch.randn(8, 2 * ROW).half(), element_dim=ROW,
                           k_cache_dst=cpu_rows(15)),
                 "'v_cache_dst'", "expected 15 but got 16")


def test_rows_must_be_16_byte_aligned():
    shifted = torch.randn(16 * ROW + 4).half()[4:].view(16, ROW)
    expect_error(one_layer(k_cache_src=shifted), "'k_cache_src' starts at 0x",
                 "not 16-byte aligned")
    expect_error(one_layer(v_cache_dst=torch.randn(16, ROW + 4).half()[:, :ROW]),
                 "'v_cache_dst' has a row stride of 264 bytes, not a multiple of 16")
    odd_pages = torch.randn(2, 8 * ROW + 4).half()[:, :8 * ROW].unflatten(1, (8, ROW))
    expect_error(one_layer(v_cache_dst=odd_pages),
                 "'v_cache_dst' has a page stride of 2056 bytes, not a multiple of 16")


def test_launch_options_are_checked():
    expect_error(one_layer(unroll=3), "unroll must be one of (1, 2, 4, 8), got 3",
                 kind=ValueError)
    expect_error(one_layer(block_quota=0), "block_quota must be at least 1, got 0",
                 kind=ValueError)
    expect_error(one_layer(page_size=0), "page_size must be at least 1, got 0",
                 kind=ValueError)


def test_page_size_checks_name_the_tensor_and_the_rule():
    page = {"index_granularity": "page"}
    expect_error(one_layer(page_size=3, **page), "'indices_dst' and 'indices_src' hold 4 "
                 "indices, not a whole number of pages of page_size 3", ".cuh:")
    pages_of_4 = torch.randn(4, 4, ROW).half()
    expect_error(one_layer(k_cache_dst=pages_of_4[:, :, :], v_cache_dst=pages_of_4,
                           element_dim=ROW, page_size=2, **page), "pageable")  # 2 divides 4
    paged = torch.randn(4, 6, ROW).half()[:, :4]  # pages of 4 slots, 6 apart
    expect_error(one_layer(k_cache_dst=paged, v_cache_dst=paged, element_dim=ROW,
                           indices_dst=torch.arange(8), indices_src=torch.arange(8),
                           page_size=8, **page),
                 "'k_cache_dst'", "has pages of 4 slots, which page_size 8 does not divide",
                 "must not straddle two pages of the cache")


def test_copy_engine_reads_indices_on_the_host_and_refuses_what_it_cannot_move():
    # Checked on the host before any copy: all-layer, so no cache needs to be pinned.
    expect_error(all_layer(indices_src=torch.tensor([0, 1, 2, 300]), num_tokens_src=300,
                           method="copy_engine"),
                 "'indices_src'[3] = 300: a page of 1 slots from there is outside (the source "
                 "layers, num_tokens_src) (300 slots)", "hicache_copy_list.cuh:")
    expect_error(all_layer(indices_dst=torch.tensor([0, -1, 4, 5]), method="copy_engine"),
                 "'indices_dst'[1] = -1")
    expect_error(all_layer(indices_src=torch.tensor([0, 1, 3, 4]), page_size=2,
                           kv_cache_src_page_stride_bytes=4 * ROW_BYTES, method="copy_engine",
                           index_granularity="page"),
                 "'indices_src'[2] = 3: a page of 2 slots from there straddles two pages of "
                 "(the source layers")


def test_page_size_never_overflows_a_page_stride_check_even_with_no_indices():
    empty = {"indices_dst": torch.arange(0), "indices_src": torch.arange(0)}
    expect_error(all_layer(page_size=2**40, kv_cache_src_page_stride_bytes=4096, **empty),
                 "page_size must be between 1 and 2147483647, got 1099511627776")
    expect_error(all_layer(page_size=2**30, kv_cache_src_stride_bytes=2**40,
                           kv_cache_src_page_stride_bytes=2**41, element_size=ROW_BYTES,
                           **empty),
                 "page_size * kv_cache_src_stride_bytes (1073741824 * 1099511627776) "
                 "overflows 64 bits")


def test_copy_engine_refuses_moves_chained_inside_one_cache():
    # Host pointer tables name the same memory on both sides: rows 0-1 move to rows 1-2, so
    # row 1 is written and read by the same call. Refused before any copy is issued.
    base = 1 << 20
    expect_error(all_layer(k_ptr_dst=torch.tensor([base]), v_ptr_dst=torch.tensor([2 * base]),
                           k_ptr_src=torch.tensor([base]), v_ptr_src=torch.tensor([3 * base]),
                           indices_dst=torch.tensor([1, 2]), indices_src=torch.tensor([0, 1]),
                           method="copy_engine"),
                 "a destination row of this call is also one of its source rows",
                 "hicache_copy.cuh:")


def all_layer_args(**changes) -> dict:
    table = torch.zeros(4, dtype=torch.int64)
    args = {"k_ptr_dst": table, "v_ptr_dst": table, "indices_dst": torch.arange(4),
            "k_ptr_src": table, "v_ptr_src": table, "indices_src": torch.arange(4),
            "kv_cache_src_stride_bytes": ROW_BYTES, "kv_cache_dst_stride_bytes": ROW_BYTES}
    return {**args, **changes}


def all_layer(**changes):
    return lambda: hicache.transfer_hicache_all_layer(**all_layer_args(**changes))


def test_all_layer_checks_pointer_tables_strides_and_indices():
    expect_error(all_layer(method="kernel"),
                 "the pointer tables and the indices are in host memory", "hicache.cuh:")
    expect_error(all_layer(v_ptr_src=torch.zeros(5, dtype=torch.int64)), "'v_ptr_src'",
                 "Size mismatch for shape#0('num layers'): expected 4 but got 5")
    expect_error(all_layer(k_ptr_dst=torch.zeros(4, dtype=torch.int32)), "'k_ptr_dst'",
                 "DType mismatch: expected one of [uint64, int64] but got int32")
    expect_error(all_layer(indices_src=torch.arange(3)), "'indices_src'", "indices length")
    expect_error(all_layer(kv_cache_dst_stride_bytes=2 * ROW_BYTES),
                 "element_size is required", kind=ValueError)
    expect_error(all_layer(kv_cache_src_stride_bytes=264, kv_cache_dst_stride_bytes=512,
                           element_size=ROW_BYTES),
                 "kv_cache_src_stride_bytes must be a multiple of 16", "got 264")
    expect_error(all_layer(kv_cache_src_stride_bytes=512, kv_cache_dst_stride_bytes=128,
                           element_size=ROW_BYTES),
                 "kv_cache_dst_stride_bytes", "at least the element size (256 bytes)")
    expect_error(all_layer(num_tokens_src=-2), "num_tokens_src must be at least 0",
                 kind=ValueError)
    expect_error(all_layer(element_size=40, kv_cache_src_stride_bytes=48,
                           kv_cache_dst_stride_bytes=48), "a row of 40 bytes", kind=ValueError)
    expect_error(all_layer(page_size=2, kv_cache_dst_page_stride_bytes=ROW_BYTES),
                 "kv_cache_dst_page_stride_bytes must be a multiple of 16 and at least "
                 "page_size * kv_cache_dst_stride_bytes (512 bytes), got 256")


def test_all_layer_mla_checks_pointer_tables():
    table = torch.zeros(4, dtype=torch.int64)
    strides = {"cache_src_stride_bytes": ROW_BYTES, "cache_dst_stride_bytes": ROW_BYTES}
    expect_error(lambda: hicache.transfer_hicache_all_layer_mla(
        table, torch.arange(2), table[:3], torch.arange(2), **strides),
        "'ptr_src'", "'num layers'")
    expect_error(lambda: hicache.transfer_hicache_all_layer_mla(
        table, torch.arange(2), table, torch.arange(2), method="kernel", **strides),
        "the pointer tables and the indices are in host memory")
    expect_error(lambda: hicache.transfer_hicache_all_layer_mla(
        table, torch.arange(2), table, torch.arange(2), cache_src_page_stride_bytes=8, **strides,
        page_size=2), "cache_src_page_stride_bytes must be a multiple of 16")


# SGLang 0.5.23's call forms, each with indices of different lengths so that the call stops
# in the C++ checks: it must get there (a RuntimeError from a .cuh), never a TypeError.
# `extra` adds jitk's method= to the form; "auto" runs SGLang's form unchanged.
def sglang_forms():
    cache, table = cpu_rows(), torch.zeros(3, dtype=torch.int64)
    idx3, idx4 = torch.arange(3), torch.arange(4)
    knobs = {"unroll": None, "block_quota": None, "page_size": None}
    one = hicache.transfer_hicache_one_layer
    one_mla = hicache.transfer_hicache_one_layer_mla
    all_kv = hicache.transfer_hicache_all_layer
    all_mla = hicache.transfer_hicache_all_layer_mla
    kv_strides = {"kv_cache_src_stride_bytes": ROW_BYTES, "kv_cache_dst_stride_bytes": ROW_BYTES}
    mla_strides = {"cache_src_stride_bytes": ROW_BYTES, "cache_dst_stride_bytes": ROW_BYTES}
    return {
        "one positional": lambda **extra: one(cache, cache, idx3, cache, cache, idx4, **extra),
        "one keywords": lambda **extra: one(
            k_cache_dst=cache, v_cache_dst=cache, indices_dst=idx3, k_cache_src=cache,
            v_cache_src=cache, indices_src=idx4, element_dim=ROW, **knobs, **extra),
        "one_mla positional": lambda **extra: one_mla(cache, idx3, cache, idx4, **extra),
        "one_mla keywords": lambda **extra: one_mla(
            cache_dst=cache, indices_dst=idx3, cache_src=cache, indices_src=idx4,
            element_dim=ROW, **knobs, **extra),
        "all positional": lambda **extra: all_kv(table, table, idx3, table, table, idx4,
                                                 **kv_strides, **extra),
        "all keywords": lambda **extra: all_kv(
            k_ptr_dst=table, v_ptr_dst=table, indices_dst=idx3, k_ptr_src=table,
            v_ptr_src=table, indices_src=idx4, element_size=ROW_BYTES, **kv_strides, **knobs,
            **extra),
        "all_mla positional": lambda **extra: all_mla(table, idx3, table, idx4, **mla_strides,
                                                      **extra),
        "all_mla keywords": lambda **extra: all_mla(
            ptr_dst=table, indices_dst=idx3, ptr_src=table, indices_src=idx4,
            element_size=ROW_BYTES, **mla_strides, **knobs, **extra),
    }


@pytest.mark.parametrize("form", sglang_forms())
@pytest.mark.parametrize("method", ["auto", "kernel", "copy_engine"])
def test_sglang_call_forms_reach_the_cpp_checks(form, method):
    extra = {} if method == "auto" else {"method": method}
    message = expect_error(lambda: sglang_forms()[form](**extra),
                           "Size mismatch for shape#0('indices length')")
    assert ".cuh:" in message


# "auto"'s decision table for host indices (pinned or not: read during the call either way),
# from the H100 measurements in jitk.kernels.hicache's docstring: (bytes one copy-engine copy moves,
# whether the kernel can run) -> method. Never a path below half of the best: the kernel
# (44-50 GB/s) below 64 KiB copies, where the copy engines give 1-34.
AUTO_TABLE = [
    (1 << 10, True, hicache.KERNEL_ON_COPIED_INDICES),    # page 1 x 1 KiB: 1.1 vs 47 GB/s
    (16 << 10, True, hicache.KERNEL_ON_COPIED_INDICES),   # page 16 x 1 KiB: 6-34 vs 47
    (32 << 10, True, hicache.KERNEL_ON_COPIED_INDICES),
    (64 << 10, True, "copy_engine"),                      # page 64 x 1 KiB: 53 vs 48
    (1 << 20, True, "copy_engine"),
    (1 << 10, False, "copy_engine"),                      # no GPU for the kernel: the only one
    (64 << 10, False, "copy_engine"),
]


@pytest.mark.parametrize("copy_bytes, kernel_runs, chosen", AUTO_TABLE)
def test_auto_decision_table_for_host_indices(copy_bytes, kernel_runs, chosen):
    assert methods.auto_choice(copy_bytes, kernel_runs) == chosen
    assert methods.choose("auto", torch.arange(4), lambda: copy_bytes,
                           0 if kernel_runs else None) == chosen


def test_explicit_methods_are_kept_and_gpu_indices_take_the_kernel():
    cpu = torch.arange(4)
    for method in ("kernel", "copy_engine"):
        assert methods.choose(method, cpu, lambda: 0, None) == method
    with torch._subclasses.FakeTensorMode():
        gpu = torch.empty(4, dtype=torch.int64, device="cuda")
        assert methods.choose("auto", gpu, lambda: 1 << 30, 0) == "kernel"


@pytest.mark.parametrize("page_size, runs, chosen", [
    (None, True, "kernel"), (16, True, "kernel"), (256, True, "copy_engine"),  # 256 B rows
    (256, False, "kernel")])  # page_size=256 over token indices (HiSparse): no runs
def test_auto_takes_the_copy_size_from_the_page_size_hint(monkeypatch, page_size, runs,
                                                          chosen):
    recorder = Recorder(monkeypatch)
    monkeypatch.setattr(methods, "gpu_of", lambda *_: 0)  # as if a cache were on cuda:0
    copied = []
    monkeypatch.setattr(methods, "on_gpu",
                        lambda tensors, positions, gpu: copied.append(positions) or tensors)
    pool = torch.randn(1024, ROW).half()
    indices = torch.arange(256, 512) if runs else torch.randperm(1024)[:256]
    hicache.transfer_hicache_one_layer(**one_layer_args(
        k_cache_dst=pool, v_cache_dst=pool, k_cache_src=pool, v_cache_src=pool,
        indices_dst=indices, indices_src=indices.clone(), page_size=page_size))
    assert set(recorder.modules) == {chosen}
    assert copied == ([(2, 5)] if chosen == "kernel" else [])  # both index lists


def test_a_page_is_one_copy_only_where_its_rows_are_packed():
    width = 64
    assert methods.packed(torch.empty(100, width), width)
    assert not methods.packed(torch.empty(100, width + 8)[:, :width], width)  # padded rows
    assert not methods.packed(torch.empty(100, 3, width)[:, 1], width)  # page_first layer
    assert methods.packed(torch.empty(4, 3, 16, width)[:, 1], width)  # page_first_direct
    assert methods.packed(torch.empty(100, 2 * width), width)  # rows split one run
    assert methods.packed(torch.empty(100, 1, width), width)


# SGLang 0.5.23's signatures of the names its pools import (sglang/kernels/ops/kvcache/
# hicache.py): (name, kind, default) of each parameter.
P, K, REQUIRED = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, \
    inspect.Parameter.empty
SGLANG_SIGNATURES = {
    "can_use_hicache_jit_kernel": [("element_size", K, REQUIRED), ("unroll", K, None),
                                   ("block_quota", K, None), ("page_size", K, None)],
    "can_use_write_back_jit_kernel": [("element_size", K, REQUIRED), ("unroll", K, None),
                                      ("block_quota", K, None)],
    "transfer_hicache_all_layer_staged_lf_pf": [
        *((name, P, REQUIRED) for name in ("k_ptr_src", "v_ptr_src", "src_indices",
                                           "dst_indices", "staging_k", "staging_v", "dst_k",
                                           "dst_v")),
        ("page_size", K, REQUIRED), ("element_size", K, None), ("unroll", K, None),
        ("block_quota", K, None)],
    "transfer_hicache_all_layer_mla_staged_lf_pf": [
        *((name, P, REQUIRED) for name in ("ptr_src", "src_indices", "dst_indices", "staging",
                                           "dst")),
        ("page_size", K, REQUIRED), ("element_size", K, None), ("unroll", K, None),
        ("block_quota", K, None)],
}


@pytest.mark.parametrize("name", SGLANG_SIGNATURES)
def test_sglang_imports_exist_with_its_signatures(name):
    assert name in hicache.__all__
    params = inspect.signature(getattr(hicache, name)).parameters.values()
    assert [(p.name, p.kind, p.default) for p in params] == SGLANG_SIGNATURES[name]


def test_gates_answer_false_never_raise(monkeypatch, caplog):
    assert hicache.can_use_hicache_jit_kernel(element_size=ROW_BYTES, page_size=64)
    assert hicache.can_use_write_back_jit_kernel(element_size=1152)
    for size in (40, 0, 2**40, "256"):
        assert not hicache.can_use_hicache_jit_kernel(element_size=size)
        assert not hicache.can_use_write_back_jit_kernel(element_size=size)
    assert not hicache.can_use_hicache_jit_kernel(element_size=ROW_BYTES, unroll=3)

    def broken(*_args):
        raise RuntimeError("nvcc failed")

    monkeypatch.setattr(modules, "kernel_module", broken)
    monkeypatch.setattr(modules, "staged_module", broken)
    assert not hicache.can_use_hicache_jit_kernel(element_size=ROW_BYTES)
    assert not hicache.can_use_write_back_jit_kernel(element_size=ROW_BYTES)
    assert "nvcc failed" in caplog.text


def staged_model(src_layers, src_indices, dst_indices, dst, page_size):
    """SGLang's staged write-back on the CPU: page p's tokens of every layer, from the slots
    that follow src_indices[p * page_size], land at the host tokens that follow
    dst_indices[p * page_size] of a [tokens, layers, row] pool."""
    for p in range(0, len(src_indices), page_size):
        for j in range(page_size):
            for layer, cache in enumerate(src_layers):
                dst[dst_indices[p] + j, layer] = cache[src_indices[p] + j]


def test_staged_model_moves_whole_pages_in_page_first_order():
    layers = [torch.arange(8 * 2).view(8, 2) + 100 * (layer + 1) for layer in range(3)]
    dst = torch.zeros(6, 3, 2, dtype=torch.int64)
    staged_model(layers, [4, 99, 0, 99], [2, -1, 0, -1], dst, 2)  # only pages' firsts read
    assert dst[2, 1].tolist() == [208, 209] and dst[3, 2].tolist() == [310, 311]
    assert dst[1, 0].tolist() == layers[0][1].tolist() and dst[4:].eq(0).all()


def staged_args(**changes) -> dict:
    table = torch.zeros(3, dtype=torch.int64)
    staging = torch.zeros(8, 3, 4, 32).half()
    host = torch.zeros(16, 3, 4, 32).half()
    args = {"k_ptr_src": table, "v_ptr_src": table, "src_indices": torch.arange(4),
            "dst_indices": torch.arange(4), "staging_k": staging, "staging_v": staging,
            "dst_k": host, "dst_v": host, "page_size": 2}
    return {**args, **changes}


def test_staged_write_back_checks_its_arguments():
    def staged(**changes):
        return lambda: hicache.transfer_hicache_all_layer_staged_lf_pf(**staged_args(**changes))

    expect_error(staged(), "'staging_k'", "Device mismatch", "hicache_staged.cuh:")
    expect_error(staged(page_size=0), "page_size must be at least 1, got 0", kind=ValueError)
    expect_error(staged(element_size=40), "a row of 40 bytes (element_size)", kind=ValueError)
    expect_error(staged(staging_k=torch.zeros(8)), "the staging buffers and host pools are "
                 "[tokens, layers, ...]; got a tensor of shape (8,)", kind=ValueError)
    expect_error(lambda: hicache.transfer_hicache_all_layer_mla_staged_lf_pf(
        torch.zeros(3, dtype=torch.int64), torch.arange(4), torch.arange(4),
        torch.zeros(8, 3, 576).bfloat16(), torch.zeros(16, 3, 576).bfloat16(), page_size=2,
        block_quota=0), "block_quota must be at least 1, got 0", kind=ValueError)


def test_precompile_configs_are_a_few_labelled_thunks(tuning_file):
    configs = hicache.precompile_configs()
    assert 1 <= len(configs) <= 6  # with nothing tuned (the fixture's cache has no file)
    labels = [label for label, _ in configs]
    assert len(set(labels)) == len(labels)
    assert all(callable(thunk) for _, thunk in configs)


# ---------------------------------------------------------------------------- tuning
@pytest.fixture
def tuning_file(tmp_path, monkeypatch):
    from jitk import autotune
    from jitk.tools import tuning_store

    def forget():
        tuning_store.STORE.clear()
        for space in ops.LAUNCH_SPACES.values():
            space.forget()

    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    forget()
    yield autotune
    forget()


@pytest.mark.parametrize("caches", [2, 1])
def test_the_launch_bucket_is_row_bytes_direction_and_rows(caches):
    space = ops.LAUNCH_SPACES[caches]
    args, kwargs = space.sample((100, 1024, 1), torch.bfloat16, torch.device("cpu"))
    assert len(args) == 2 * caches + 2 and args[caches].numel() == 100
    assert space.bucket(*args, **kwargs) == (1024, "host->host", 128)  # no GPU here
    paged = space.bucket(*args, page_size=4, index_granularity="page")
    assert paged == (1024, "host->host", 512)  # an index names 4 rows
    for shape in ((100, 1024), (100, 1024, 4), (100, 1023, 1)):
        expect_error(lambda shape=shape: space.sample(shape, torch.bfloat16, torch.device("cpu")),
                     "INDICESxROW_BYTESxDIRECTION", kind=ValueError)


def test_a_tuned_launch_runs_the_kernel_with_its_knobs(tuning_file, monkeypatch):
    space = ops.LAUNCH_SPACES[2]
    bucket = (1024, "host->gpu", 4096)
    assert space.config(bucket) == {"unroll": hicache.DEFAULT_UNROLL, "block_quota": "default"}
    tuning_file.record([{"op": space.op, "bucket": list(bucket), "config": {
        "unroll": 1, "block_quota": 16}, "environment": tuning_file.environment()}])
    assert space.config(bucket) == {"unroll": 1, "block_quota": 16}
    calls, loaded = [], []
    monkeypatch.setattr(modules, "kernel_module", lambda *args: loaded.append(args))
    launch = space.build(bucket, space.config(bucket))
    assert loaded == [(1024, 1)]  # made, a choice loads its kernel: tune's prebuild builds it
    assert launch.run is ops._one_layer
    launch.run = lambda *args: calls.append(args)
    launch("k", "v", "i", "ks", "vs", "is", page_size=2)
    assert calls == [(2, ("k", "v", "i", "ks", "vs", "is"), None, 1, 16, 2, "kernel", "token")]
    # Quotas share a module: tune builds it once.
    keys = {space.job_key(bucket, {"unroll": 1, "block_quota": q}) for q in (8, 16, "default")}
    assert len(keys) == 1 and keys != {space.job_key(bucket, {"unroll": 4, "block_quota": 8})}
    labels = [label for label, _ in hicache.precompile_configs()]
    assert "element_size=1024 unroll=1" in labels  # a serving image builds what was tuned


def test_a_call_naming_no_knob_runs_the_tuned_launch(tuning_file, monkeypatch):
    recorder = Recorder(monkeypatch)
    loaded = []
    monkeypatch.setattr(modules, "kernel_module",
                        lambda *args: loaded.append(args) or recorder.entries(*args))
    monkeypatch.setattr(methods, "gpu_of", lambda *_: 0)  # as if a cache were on cuda:0
    space = ops.LAUNCH_SPACES[2]
    tuning_file.record([{"op": space.op, "bucket": [ROW_BYTES, "host->host", 4], "config": {
        "unroll": 1, "block_quota": 16}, "environment": tuning_file.environment()}])
    hicache.transfer_hicache_one_layer(**one_layer_args(method="kernel"))
    assert set(loaded) == {(ROW_BYTES, 1)} and recorder.calls[-1][1][-1] == 16  # the quota
    hicache.transfer_hicache_one_layer(**one_layer_args(method="kernel", unroll=4))
    assert loaded[-1] == (ROW_BYTES, 4)  # a call that names a knob runs what it names
    assert recorder.calls[-1][1][-1] == checks.NOT_GIVEN


def test_every_kernel_source_is_hashed_into_the_module_key():
    # hicache.cuh includes hicache_layout.cuh: a module lists both, so an edit of either
    # rebuilds it. Every header of the family is some module's.
    kernel_dir = Path(hicache.__file__).parent
    assert {name for files in modules.MODULE_FILES for name in files} == \
        {p.name for p in kernel_dir.glob("*.cuh")}
    for files in modules.MODULE_FILES:
        for name in files:
            included = [line.split('"')[1]
                        for line in (kernel_dir / name).read_text().splitlines()
                        if line.startswith('#include "')]
            assert set(included) <= set(files), (files, name, included)


# ------------------------------------------------------------------------------------ GPU
class Cache(NamedTuple):
    """A cache as a transfer sees it (`view`), the whole allocation behind it (`base`:
    padding, other layers and other pages included, compared byte for byte) and where each
    slot's row starts in the base's bytes."""
    base: torch.Tensor
    view: torch.Tensor
    slot_bytes: torch.Tensor  # CPU int64, one per slot
    row_bytes: int

    @property
    def slots(self) -> int:
        return self.slot_bytes.numel()


def place(t: torch.Tensor, where: str) -> torch.Tensor:
    return t.cuda() if where == "gpu" else t.pin_memory()


def make_cache(base_shape, dtype, where, to_view, element_dim, *, poison=False) -> Cache:
    """A base of random data (never zeros), or every byte POISON for a destination, and the
    view `to_view` cuts from it; slot positions are found by cutting the same view from a
    tensor of element numbers."""
    numel = int(torch.Size(base_shape).numel())
    if poison:
        base = torch.full((numel * dtype.itemsize,), POISON, dtype=torch.uint8).view(dtype)
        base = base.view(base_shape)
    else:
        base = (torch.randn(base_shape) * 3).to(dtype)
    base = place(base, where)
    return cut_cache(base, to_view, element_dim)


def cut_cache(base: torch.Tensor, to_view, element_dim: int) -> Cache:
    """The cache `to_view` cuts from `base`."""
    numbers = torch.arange(base.numel()).view(base.shape)
    positions = to_view(numbers).reshape(-1, element_dim)[:, 0]
    itemsize = base.element_size()
    return Cache(base, to_view(base), positions * itemsize, element_dim * itemsize)


LAYERS = 3  # layers of the host layouts that interleave them


def layout_cache(layout, slots, row_shape, dtype, where, *, pad=0, page_rows=64,
                 poison=False) -> Cache:
    """One layer of a cache in one of SGLang's layouts: "flat" (rows of a [slots, row] pool,
    padded by `pad` elements), "page_first" (layer 1 of [slots, layers, row]: strided rows) or
    "page_first_direct" (layer 1 of [pages, layers, page_rows, row]: pages)."""
    width = int(torch.Size(row_shape).numel())
    shapes = {"flat": (slots, width + pad), "page_first": (slots, LAYERS, width),
              "page_first_direct": (slots // page_rows, LAYERS, page_rows, width)}

    def to_view(base: torch.Tensor) -> torch.Tensor:
        cut = base[:, :width] if layout == "flat" else base[:, 1]
        return cut.unflatten(-1, tuple(row_shape))

    return make_cache(shapes[layout], dtype, where, to_view, width, poison=poison)


def page_firsts(pages: int, slots: int, page_size: int) -> list[int]:
    """Distinct page-aligned first slots."""
    return (torch.randperm(slots // page_size)[:pages] * page_size).tolist()


def token_indices(firsts: list[int], page_size: int) -> list[int]:
    return [first + j for first in firsts for j in range(page_size)]


def page_fits(first: int, page_size: int, cache: Cache, page_rows: int | None) -> bool:
    inside = 0 <= first <= cache.slots - page_size
    return inside and (page_rows is None or first % page_rows + page_size <= page_rows)


def slot_pairs(idx_dst, idx_src, page_size, dst: Cache, src: Cache, dst_pages=None,
               src_pages=None):
    """(dst slot, src slot) of every token the transfer moves: pages whose runs fit."""
    pairs = []
    for k in range(0, len(idx_dst), page_size):
        d, s = idx_dst[k], idx_src[k]
        if page_fits(d, page_size, dst, dst_pages) and page_fits(s, page_size, src, src_pages):
            pairs += [(d + j, s + j) for j in range(page_size)]
    return pairs


class Expected:
    """The bytes every destination allocation must hold: its poisoned bytes, with the moved
    rows copied in on the CPU."""

    def __init__(self):
        self.bytes = {}  # base address -> (base, expected bytes)

    def move(self, dst: Cache, src: Cache, pairs) -> None:
        key = dst.base.data_ptr()
        if key not in self.bytes:
            self.bytes[key] = (dst.base, dst.base.cpu().view(torch.uint8).flatten().clone())
        expected = self.bytes[key][1]
        if pairs:
            d, s = (torch.tensor(list(side)) for side in zip(*pairs))
            cols = torch.arange(dst.row_bytes)
            to = (dst.slot_bytes[d][:, None] + cols).flatten()
            source = src.base.cpu().view(torch.uint8).flatten()
            expected[to] = source[(src.slot_bytes[s][:, None] + cols).flatten()]

    def check(self) -> None:
        torch.cuda.synchronize()
        for base, expected in self.bytes.values():
            got = base.cpu().view(torch.uint8).flatten()
            wrong = (got != expected).nonzero().flatten().tolist()
            assert not wrong, f"{len(wrong)} bytes differ, first at byte {wrong[:8]}"


def index_tensor(values, dtype, method) -> torch.Tensor:
    """Indices where the method reads them: the GPU for the kernel, the host for the copy
    engines ("kernel-pinned": pinned host memory, read by the kernel; "auto-host": pinned
    host memory, the method left to "auto")."""
    t = torch.tensor(values, dtype=dtype)
    if method == "kernel":
        return t.cuda()
    return t.pin_memory() if method in ("kernel-pinned", "auto-host") else t


def unit(page_size: int, granularity: str) -> int:
    """Slots one index names: SGLang's meaning (one, whatever page_size) or jitk's pages."""
    return page_size if granularity == "page" else 1


def method_arg(method: str) -> str:
    return {"kernel-pinned": "kernel", "auto-host": "auto"}.get(method, method)


DIRECTIONS = {"d2h": ("gpu", "host"), "h2d": ("host", "gpu"), "d2d": ("gpu", "gpu"),
              "h2h": ("host", "host")}
METHODS = ["kernel", "copy_engine"]
INDEX_DTYPES = [torch.int32, torch.int64]


def run_one_layer(method, direction, *, layout="flat", page_size=1, row_shape=(8, 16),
                  dtype=torch.float16, pad=0, index_dtype=torch.int64, src_slots=512,
                  dst_slots=384, pages=None, idx_dst=None, idx_src=None, mla=False,
                  side_stream=True, granularity="token", **options):
    src_at, dst_at = DIRECTIONS[direction]
    page_rows = 64 if layout == "page_first_direct" else None
    caches = 1 if mla else 2
    # Each cache its own padding: K and V, source and destination all differ.
    srcs = [layout_cache(layout, src_slots, row_shape, dtype, src_at, pad=pad * (c + 1))
            for c in range(caches)]
    dsts = [layout_cache(layout, dst_slots, row_shape, dtype, dst_at, pad=pad * (c + 3),
                         poison=True) for c in range(caches)]
    if idx_dst is None:
        count = pages or min(dst_slots, src_slots) // page_size // 2
        idx_dst = token_indices(page_firsts(count, dst_slots, page_size), page_size)
        idx_src = token_indices(page_firsts(count, src_slots, page_size), page_size)
    expected = Expected()
    for d, s in zip(dsts, srcs):
        expected.move(d, s, slot_pairs(idx_dst, idx_src, unit(page_size, granularity), d, s,
                                       page_rows, page_rows))
    index_dst = index_tensor(idx_dst, index_dtype, method)
    index_src = index_tensor(idx_src, index_dtype, method)
    options.update(element_dim=srcs[0].row_bytes // dtype.itemsize, page_size=page_size,
                   method=method_arg(method), index_granularity=granularity)
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        if mla:
            hicache.transfer_hicache_one_layer_mla(dsts[0].view, index_dst, srcs[0].view,
                                                   index_src, **options)
        else:
            hicache.transfer_hicache_one_layer(dsts[0].view, dsts[1].view, index_dst,
                                               srcs[0].view, srcs[1].view, index_src, **options)
    expected.check()


LAYOUTS = ["flat", "page_first", "page_first_direct"]
PAGE_SIZES = [1, 16, 64]
GRANULARITIES = ["token", "page"]


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("method", METHODS)
def test_one_layer_layouts_and_pages(method, direction, layout, page_size, granularity):
    run_one_layer(method, direction, layout=layout, page_size=page_size,
                  granularity=granularity)


# (dtype, row shape, padding): 2048-byte rows from [heads, head_dim], 48-byte rows (three
# vectors), 256-byte fp8 rows; padding makes the row strides differ from the row size.
ROW_CASES = {
    "fp16-8x128": (torch.float16, (8, 128), 0),
    "bf16-24": (torch.bfloat16, (24,), 8),
    "fp8-256": (torch.float8_e4m3fn, (256,), 48),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", ROW_CASES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("method", METHODS)
def test_one_layer_row_shapes_and_index_types(method, direction, index_dtype, case):
    dtype, row_shape, pad = ROW_CASES[case]
    run_one_layer(method, direction, row_shape=row_shape, dtype=dtype, pad=pad,
                  index_dtype=index_dtype, src_slots=301, dst_slots=517)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", METHODS)
def test_on_the_legacy_default_stream(method, layout):
    # The copy engines' batch submission refuses the legacy stream: copies go one by one.
    run_one_layer(method, "h2d", layout=layout, page_size=16, side_stream=False)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("method", [*METHODS, "kernel-pinned", "auto-host"])
def test_one_layer_mla(method, direction, page_size):
    run_one_layer(method, direction, layout="page_first_direct", page_size=page_size,
                  row_shape=(576,), dtype=torch.bfloat16, mla=True)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_consecutive_pages_merge_and_stay_exact(method):
    # Runs of pages that follow each other on both sides, some across the pages of a paged
    # cache (which must not merge there).
    idx_dst = list(range(64, 64 + 256)) + list(range(32))
    idx_src = list(range(128, 128 + 256)) + list(range(448, 480))
    for layout in ("flat", "page_first_direct"):
        run_one_layer(method, "d2h", layout=layout, page_size=16, idx_dst=idx_dst,
                      idx_src=idx_src)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_only_the_first_index_of_a_page_is_read(method):
    firsts_dst, firsts_src = page_firsts(4, 384, 16), page_firsts(4, 512, 16)
    idx_dst = [v if j == 0 else -7 for v in firsts_dst for j in range(16)]
    idx_src = [v if j == 0 else 10**9 for v in firsts_src for j in range(16)]
    run_one_layer(method, "h2d", page_size=16, idx_dst=idx_dst, idx_src=idx_src,
                  granularity="page")


@pytest.mark.gpu
@pytest.mark.parametrize("block_quota", [None, 1, 3])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_many_tokens_and_block_quota(direction, block_quota):
    # 5000 tokens of 2 KiB: several grid-stride rounds, thousands with one block.
    run_one_layer("kernel", direction, row_shape=(1024,), dtype=torch.bfloat16,
                  src_slots=6000, dst_slots=5500, pages=5000, block_quota=block_quota)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_deeper_unroll_with_fewer_threads(direction):
    run_one_layer("kernel", direction, row_shape=(128,), pad=16, index_dtype=torch.int32,
                  unroll=8)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_empty_indices_change_nothing(method, direction):
    run_one_layer(method, direction, idx_dst=[], idx_src=[])


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_kernel_skips_pages_out_of_range_or_straddling(direction, index_dtype):
    top = torch.iinfo(index_dtype).max
    idx_dst = [0, 5, -1, 7, 9, 384, 11, 13, top, 383, 20, -384]
    idx_src = [3, -1, 2, 512, 8, 1, -(2**31), 511, 4, 6, top, 10]
    run_one_layer("kernel", direction, index_dtype=index_dtype, idx_dst=idx_dst,
                  idx_src=idx_src)
    # Pages of 16 from slots 56 (dst) and 120 (src) straddle the cache's pages of 64 slots:
    # skipped; one from slot 8 does not.
    firsts_dst, firsts_src = [0, 24, 64, 56, 100], [128, 64, 8, 256, 120]
    run_one_layer("kernel", direction, layout="page_first_direct", page_size=16,
                  index_dtype=index_dtype, idx_dst=token_indices(firsts_dst, 16),
                  idx_src=token_indices(firsts_src, 16), granularity="page")


@pytest.mark.gpu
def test_copy_engine_refuses_indices_it_cannot_move_and_gpu_indices():
    gpu = torch.randn(64, 128, device="cuda").half()
    host = torch.randn(64, 128).half().pin_memory()
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(
        gpu, torch.tensor([1, 64]), host, torch.tensor([0, 1]), method="copy_engine"),
        "'indices_dst'[1] = 64", "is outside 'cache_dst' (64 slots)")
    idx = torch.arange(4, device="cuda")
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(
        gpu, idx, host, idx, method="copy_engine"),
        "'indices_dst' is on cuda:0, but the copy engine reads it on the host")


@pytest.mark.gpu
@pytest.mark.parametrize("legacy", [False, True], ids=["side_stream", "legacy_stream"])
@pytest.mark.parametrize("all_layer", [False, True])
def test_copy_engine_copies_join_the_current_stream(all_layer, legacy):
    # On the stream: a long sleep, then new source rows, then the copies. Copies issued on
    # any other stream would run at once and move the old rows. On the legacy default stream
    # the batches run on a stream of jitk's own, which must wait for the legacy stream.
    old, new = (torch.randn(64, 128).half() for _ in range(2))
    src, new_gpu = old.cuda(), new.cuda()
    dst = torch.full((64 * 256,), POISON, dtype=torch.uint8).view(torch.float16)
    dst = dst.view(64, 128).pin_memory()
    idx_dst, idx_src = torch.randperm(64)[:32], torch.randperm(64)[:32]
    stream = torch.cuda.default_stream() if legacy else torch.cuda.Stream()
    assert not legacy or stream.cuda_stream == 0
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds
        src.copy_(new_gpu)
        if all_layer:
            hicache.transfer_hicache_all_layer_mla(
                torch.tensor([dst.data_ptr()]), idx_dst, torch.tensor([src.data_ptr()]),
                idx_src, cache_src_stride_bytes=256, cache_dst_stride_bytes=256,
                method="copy_engine")
        else:
            hicache.transfer_hicache_one_layer_mla(dst, idx_dst, src, idx_src,
                                                   method="copy_engine")
    torch.cuda.synchronize()
    assert torch.equal(dst[idx_dst], new[idx_src])


@pytest.mark.gpu
def test_element_dim_splits_rows():
    # [rows, 2, 128] seen as rows of 128: twice the slots, half the width.
    src = make_cache((50, 256), torch.float16, "gpu", lambda b: b.view(50, 2, 128), 128)
    dst = make_cache((40, 256), torch.float16, "host", lambda b: b.view(40, 2, 128), 128,
                     poison=True)
    idx_dst, idx_src = page_firsts(30, 80, 1), page_firsts(30, 100, 1)
    expected = Expected()
    expected.move(dst, src, list(zip(idx_dst, idx_src)))
    hicache.transfer_hicache_one_layer_mla(
        dst.view, index_tensor(idx_dst, torch.int64, "kernel"), src.view,
        index_tensor(idx_src, torch.int64, "kernel"), element_dim=128)
    expected.check()


@pytest.mark.gpu
def test_pageable_host_memory_is_refused():
    gpu = torch.randn(32, 128, device="cuda").half()
    pageable = torch.randn(32, 128).half()
    assert not pageable.is_pinned()
    idx = torch.arange(8, device="cuda")
    expect_error(lambda: hicache.transfer_hicache_one_layer(pageable, pageable, idx, gpu, gpu,
                                                            idx),
                 "'k_cache_dst' is in pageable host memory", "pin_memory=True")
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(gpu, idx, pageable, idx),
                 "'cache_src' is in pageable host memory")
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(
        gpu, idx.cpu(), pageable, idx.cpu(), method="copy_engine"),
        "'cache_src' is in pageable host memory")


def make_layered(num_layers, slots, width, dtype, where, layout, page_size, *, poison=False):
    """Per-layer caches and the byte strides an all-layer call describes them by: one GPU
    tensor per layer ("flat"), or one host buffer interleaving the layers per token
    ("page_first") or per page ("page_first_direct", pages of page_size slots)."""
    itemsize = dtype.itemsize
    if layout == "flat":
        layers = [make_cache((slots, width), dtype, where, lambda b: b, width, poison=poison)
                  for _ in range(num_layers)]
        return layers, width * itemsize, None
    if layout == "page_first":
        shape, stride, page_stride = (slots, num_layers, width), num_layers * width, None
    else:
        shape = (slots // page_size, num_layers, page_size, width)
        stride, page_stride = width, num_layers * page_size * width * itemsize
    whole = make_cache(shape, dtype, where, lambda b: b, shape[-1], poison=poison)
    layers = [cut_cache(whole.base, lambda b, i=i: b[:, i], width) for i in range(num_layers)]
    return layers, stride * itemsize, page_stride


def table(layers: list[Cache], on: str) -> torch.Tensor:
    pointers = torch.tensor([c.view.data_ptr() for c in layers], dtype=torch.int64)
    return pointers.cuda() if on == "kernel" else pointers


def run_all_layer(method, direction, *, host_layout="flat", page_size=1, num_layers=4,
                  width=128, dtype=torch.float16, mla=False, src_slots=512, dst_slots=384,
                  idx_dst=None, idx_src=None, bounds=False, granularity="token", **options):
    src_at, dst_at = DIRECTIONS[direction]
    caches = 1 if mla else 2
    src_layout, dst_layout = (host_layout if at == "host" else "flat" for at in (src_at, dst_at))
    srcs = [make_layered(num_layers, src_slots, width, dtype, src_at, src_layout, page_size)
            for _ in range(caches)]
    dsts = [make_layered(num_layers, dst_slots, width, dtype, dst_at, dst_layout, page_size,
                         poison=True) for _ in range(caches)]
    if idx_dst is None:
        count = min(src_slots, dst_slots) // page_size // 2
        idx_dst = token_indices(page_firsts(count, dst_slots, page_size), page_size)
        idx_src = token_indices(page_firsts(count, src_slots, page_size), page_size)
    expected = Expected()
    for (d_layers, _, _), (s_layers, _, _) in zip(dsts, srcs):
        for d, s in zip(d_layers, s_layers):
            # Without row bounds the kernel trusts the upper bound: only in-range ones then.
            expected.move(d, s, slot_pairs(idx_dst, idx_src, unit(page_size, granularity), d,
                                           s))
    prefix = "cache_" if mla else "kv_cache_"
    kwargs = {f"{prefix}src_stride_bytes": srcs[0][1], f"{prefix}dst_stride_bytes": dsts[0][1],
              f"{prefix}src_page_stride_bytes": srcs[0][2],
              f"{prefix}dst_page_stride_bytes": dsts[0][2],
              "element_size": width * dtype.itemsize, "page_size": page_size,
              "method": method, "index_granularity": granularity, **options}
    if bounds:
        kwargs.update(num_tokens_src=src_slots, num_tokens_dst=dst_slots)
    index_dst = index_tensor(idx_dst, torch.int64, method)
    index_src = index_tensor(idx_src, torch.int64, method)
    tables = [(table(d[0], method), table(s[0], method)) for d, s in zip(dsts, srcs)]
    with torch.cuda.stream(torch.cuda.Stream()):
        if mla:
            hicache.transfer_hicache_all_layer_mla(tables[0][0], index_dst, tables[0][1],
                                                   index_src, **kwargs)
        else:
            (k_dst, k_src), (v_dst, v_src) = tables
            hicache.transfer_hicache_all_layer(k_dst, v_dst, index_dst, k_src, v_src,
                                               index_src, **kwargs)
    expected.check()


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("host_layout", LAYOUTS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("method", METHODS)
def test_all_layer_layouts_and_pages(method, direction, host_layout, page_size, granularity):
    run_all_layer(method, direction, host_layout=host_layout, page_size=page_size,
                  granularity=granularity)


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_all_layer_d2d_and_block_quota_below_layers(method):
    run_all_layer(method, "d2d", block_quota=2 if method == "kernel" else None)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("method", METHODS)
def test_all_layer_mla(method, direction, page_size):
    run_all_layer(method, direction, host_layout="page_first_direct", page_size=page_size,
                  mla=True, width=576, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_all_layer_kernel_skips_indices_outside_the_given_row_counts():
    idx_dst = [0, 1, 383, 384, -1, 7, 100, 2**40, 8]
    idx_src = [5, 512, 6, 7, 8, -3, 511, 9, 2**40]
    run_all_layer("kernel", "h2d", idx_dst=idx_dst, idx_src=idx_src, bounds=True)


def captured(call) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # build and load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_captured_in_a_cuda_graph(method):
    # The kernel reads the indices at each replay; the copy engines replay the copies of
    # the indices as they were at capture.
    src = layout_cache("page_first_direct", 512, (128,), torch.float16, "host")
    dst = layout_cache("flat", 384, (128,), torch.float16, "gpu", poison=True)
    idx_dst = token_indices(page_firsts(3, 384, 16), 16)
    idx_src = token_indices(page_firsts(3, 512, 16), 16)
    index_dst = index_tensor(idx_dst, torch.int64, method)
    index_src = index_tensor(idx_src, torch.int64, method)
    graph = captured(lambda: hicache.transfer_hicache_one_layer_mla(
        dst.view, index_dst, src.view, index_src, element_dim=128, page_size=16,
        method=method, index_granularity="page"))
    for _ in range(2):
        replayed_dst, replayed_src = list(idx_dst), list(idx_src)
        if method == "kernel":
            idx_src = token_indices(page_firsts(3, 512, 16), 16)
            replayed_src = idx_src
            index_src.copy_(torch.tensor(idx_src))
        else:
            index_src.copy_(torch.tensor(token_indices(page_firsts(3, 512, 16), 16)))
        src.base.copy_((torch.randn(src.base.shape) * 3).half())
        dst.base.view(torch.uint8).fill_(POISON)
        expected = Expected()
        expected.move(dst, src, slot_pairs(replayed_dst, replayed_src, 16, dst, src, None, 64))
        graph.replay()
        expected.check()


# --------------------------------------------------- SGLang's pools, as they call (GPU)
@contextlib.contextmanager
def host_pool(shape, dtype, kind):
    """A host pool as SGLang allocates one: torch-pinned, or mmap'ed and registered with
    cudaHostRegister (its shared-memory host pools); every byte POISON."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    if kind == "pinned":
        yield torch.full((nbytes,), POISON, dtype=torch.uint8).pin_memory().view(dtype).view(shape)
        return
    region = mmap.mmap(-1, nbytes)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    raw.fill_(POISON)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(raw.data_ptr(), nbytes, 0)) == 0
    try:
        yield raw.view(dtype).view(shape)
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(raw.data_ptr())
        del raw
        region.close()


HOST_KINDS = ["pinned", "registered"]


@pytest.mark.gpu
@pytest.mark.parametrize("host_kind", HOST_KINDS)
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_staged_write_back_as_sglang_pools_call_it(mla, page_size, host_kind):
    # MHA: 2 heads of 128 bf16 per layer; MLA: one 576-wide latent row.
    layers, pool_pages, host_pages, staged_pages = 3, 12, 10, 3
    row_shape = (1, 576) if mla else (2, 128)
    caches = 1 if mla else 2
    tokens = pool_pages * page_size
    device_layers = [[(torch.randn(tokens, *row_shape) * 3).bfloat16().cuda()
                      for _ in range(layers)] for _ in range(caches)]
    firsts_src = page_firsts(7, tokens, page_size)
    firsts_dst = page_firsts(7, host_pages * page_size, page_size)
    src_indices = torch.tensor(token_indices(firsts_src, page_size)).cuda()
    dst_indices = torch.tensor(token_indices(firsts_dst, page_size))
    staging = [torch.full((staged_pages * page_size, layers, *row_shape), 7.0,
                          dtype=torch.bfloat16, device="cuda") for _ in range(caches)]
    shape = (host_pages * page_size, layers, *row_shape)
    with contextlib.ExitStack() as stack:
        hosts = [stack.enter_context(host_pool(shape, torch.bfloat16, host_kind))
                 for _ in range(caches)]
        expected = [h.clone() for h in hosts]
        for layer_list, want in zip(device_layers, expected):
            staged_model([t.cpu() for t in layer_list], src_indices.tolist(),
                         dst_indices.tolist(), want, page_size)
        tables = [torch.tensor([t.data_ptr() for t in layer_list], dtype=torch.uint64).cuda()
                  for layer_list in device_layers]
        with torch.cuda.stream(torch.cuda.Stream()):
            if mla:
                hicache.transfer_hicache_all_layer_mla_staged_lf_pf(
                    ptr_src=tables[0], src_indices=src_indices, dst_indices=dst_indices,
                    staging=staging[0], dst=hosts[0], page_size=page_size)
            else:
                hicache.transfer_hicache_all_layer_staged_lf_pf(
                    k_ptr_src=tables[0], v_ptr_src=tables[1], src_indices=src_indices,
                    dst_indices=dst_indices, staging_k=staging[0], staging_v=staging[1],
                    dst_k=hosts[0], dst_v=hosts[1], page_size=page_size)
        torch.cuda.synchronize()
        for got, want in zip(hosts, expected):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.gpu
def test_staged_write_back_refuses_a_host_page_outside_the_pool():
    table = torch.zeros(2, dtype=torch.uint64, device="cuda")
    staging = torch.zeros(4, 2, 128, dtype=torch.bfloat16, device="cuda")
    host = torch.zeros(8, 2, 128, dtype=torch.bfloat16).pin_memory()
    expect_error(lambda: hicache.transfer_hicache_all_layer_mla_staged_lf_pf(
        table, torch.arange(4, device="cuda"), torch.tensor([0, 1, 7, 8]), staging, host,
        page_size=2), "'dst_indices'[2] = 7: a page of 2 tokens from there is outside the "
        "host pool (8 tokens)")


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])  # the kernel on copied indices; the engines
@pytest.mark.parametrize("pinned", [False, True])
def test_auto_reads_host_indices_during_the_call(pinned, page_size):
    src = (torch.randn(512, 512) * 3).bfloat16().cuda()  # rows of 1 KiB
    dst = torch.full((512, 512), 5.0, dtype=torch.bfloat16).pin_memory()
    firsts_dst, firsts_src = page_firsts(4, 512, 64), page_firsts(4, 512, 64)
    idx_dst = torch.tensor(token_indices(firsts_dst, 64))
    idx_src = torch.tensor(token_indices(firsts_src, 64))
    if pinned:
        idx_dst, idx_src = idx_dst.pin_memory(), idx_src.pin_memory()
    expected = dst.clone()
    expected[idx_dst] = src.cpu()[idx_src]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # the transfer runs well after the call returns
        hicache.transfer_hicache_one_layer_mla(dst, idx_dst, src, idx_src, page_size=page_size)
    idx_dst.fill_(0)
    idx_src.fill_(1)
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


@pytest.mark.gpu
def test_copy_engine_all_layer_copies_join_the_stream_of_the_tables_gpu():
    module = modules.copy_module()
    gpu = torch.empty(16, device="cuda")
    assert module.pointer_device(gpu.data_ptr()) == gpu.device.index
    assert module.pointer_device(torch.empty(16).pin_memory().data_ptr()) == -1
    assert module.pointer_device(12345) == -1
    if torch.cuda.device_count() < 2:
        return  # the stream choice below needs a second GPU
    with torch.cuda.device(1):
        src = torch.randn(64, 128, device="cuda:1").half()
    dst = torch.full((64, 128), 5.0, dtype=torch.float16).pin_memory()
    idx = torch.randperm(64)[:16]
    stream = torch.cuda.Stream(device=1)
    with torch.cuda.stream(stream), torch.cuda.device(0):  # cuda:1's current stream: `stream`
        torch.cuda._sleep(50_000_000)
        hicache.transfer_hicache_all_layer_mla(
            torch.tensor([dst.data_ptr()]), idx, torch.tensor([src.data_ptr()]), idx,
            cache_src_stride_bytes=256, cache_dst_stride_bytes=256, method="copy_engine")
    torch.cuda.synchronize(1)
    assert torch.equal(dst[idx], src.cpu()[idx])


@pytest.mark.gpu
def test_copy_engine_moves_inside_one_cache_that_do_not_chain():
    cache = (torch.randn(64, 128) * 3).half().cuda()
    before = cache.cpu()
    src, dst = torch.arange(0, 8), torch.arange(32, 40)
    hicache.transfer_hicache_one_layer_mla(cache, dst, cache, src, method="copy_engine")
    torch.cuda.synchronize()
    expected = before.clone()
    expected[dst] = before[src]
    assert torch.equal(cache.cpu(), expected)
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(
        cache, torch.tensor([1, 2]), cache, torch.tensor([0, 1]), method="copy_engine"),
        "a destination row of this call is also one of its source rows")


# SGLang 0.5.23's pools (sglang/srt/mem_cache/pool_host/*.py, memory_pool_host.py): the host
# layout of a pool kind, its row (dtype, shape after the token), and the call forms its
# load_to_device_per_layer / backup_from_device_all_layer make, with indices on the GPU as
# cache_controller.move_indices leaves them.
SGLANG_POOLS = {
    "mha": (torch.bfloat16, (4, 128), 2),        # K and V of 4 heads
    "mla": (torch.bfloat16, (1, 576), 1),        # DeepSeek's latent row
    "k_only": (torch.bfloat16, (2, 128), 1),     # one cache per layer
    "mxfp8_scales": (torch.uint8, (4, 4), 1),    # a scale byte per 32 elements of 4 x 128
    "dsa_page_rows": (torch.uint8, (64 * 132,), 1),  # DSA indexer: a 64-token page a row
}
SGLANG_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def sglang_layer_views(whole: torch.Tensor, layout: str, layer: int) -> torch.Tensor:
    """One layer of a host buffer as SGLang's pools cut it: [size, ...] for layer_first and
    page_first (strided rows), [pages, page_size, ...] for page_first_direct."""
    return whole[layer] if layout == "layer_first" else whole[:, layer]


def sglang_host_shape(layout, layers, size, page_size, row):
    return {"layer_first": (layers, size, *row), "page_first": (size, layers, *row),
            "page_first_direct": (size // page_size, layers, page_size, *row)}[layout]


def set_slots(view: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, paged: int | None):
    """view[slots] = values, for a [pages, page_size, ...] view with `paged` slots a page."""
    if paged:
        view[slots // paged, slots % paged] = values
    else:
        view[slots] = values


def get_slots(view: torch.Tensor, slots: torch.Tensor, paged: int | None) -> torch.Tensor:
    return view[slots // paged, slots % paged] if paged else view[slots]


@pytest.mark.gpu
@pytest.mark.parametrize("host_kind", HOST_KINDS)
@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("layout", SGLANG_LAYOUTS)
@pytest.mark.parametrize("pool", SGLANG_POOLS)
def test_sglang_pool_call_sites(pool, layout, page_size, host_kind):
    dtype, row, caches = SGLANG_POOLS[pool]
    layers, size, device_size = 2, 8 * 128, 4 * 128
    element_dim = int(torch.Size(row).numel())
    paged = page_size if layout == "page_first_direct" else None
    tokens = 3 * page_size + (5 if page_size == 1 else 0)
    # Whole pages on the host (SGLang's pages), token indices on both sides, on the GPU.
    host_idx = torch.tensor(token_indices(page_firsts(tokens // page_size or tokens, size,
                                                      page_size), page_size)[:tokens])
    device_idx = torch.randperm(device_size)[:tokens]
    shape = sglang_host_shape(layout, layers, size, page_size, row)
    with contextlib.ExitStack() as stack:
        hosts = [stack.enter_context(host_pool(shape, dtype, host_kind)) for _ in range(caches)]
        for h in hosts:  # random host data, never zeros
            raw = h.view(torch.uint8)
            raw.copy_(torch.randint(1, 255, raw.shape, dtype=torch.uint8))
        devices = [[torch.full((device_size, *row), 0, dtype=dtype, device="cuda").view(
            torch.uint8).fill_(POISON).view(dtype) for _ in range(layers)]
            for _ in range(caches)]
        # load_to_device_per_layer: host -> device, one layer at a time.
        for layer in range(layers):
            srcs = [sglang_layer_views(h, layout, layer) for h in hosts]
            dsts = [d[layer] for d in devices]
            options = {"element_dim": element_dim, "page_size": page_size}
            if caches == 2:
                hicache.transfer_hicache_one_layer(
                    k_cache_dst=dsts[0], v_cache_dst=dsts[1], k_cache_src=srcs[0],
                    v_cache_src=srcs[1], indices_dst=device_idx.cuda(),
                    indices_src=host_idx.cuda(), **options)
            else:
                hicache.transfer_hicache_one_layer_mla(
                    cache_dst=dsts[0], indices_dst=device_idx.cuda(), cache_src=srcs[0],
                    indices_src=host_idx.cuda(), **options)
        torch.cuda.synchronize()
        for layer in range(layers):
            for h, d in zip(hosts, devices):
                want = torch.full_like(d[layer].cpu().view(torch.uint8), POISON).view(dtype)
                want[device_idx] = get_slots(sglang_layer_views(h, layout, layer), host_idx,
                                             paged)
                assert torch.equal(d[layer].cpu().view(torch.uint8), want.view(torch.uint8))
        # backup_from_device_all_layer (layer_first: all layers in one call) and a write-back
        # per layer elsewhere, to fresh host rows, device indices on the GPU.
        for h in hosts:
            h.view(torch.uint8).fill_(POISON)
        expected = [h.clone() for h in hosts]
        for e, d in zip(expected, devices):
            for layer in range(layers):
                set_slots(sglang_layer_views(e, layout, layer), host_idx,
                          d[layer].cpu()[device_idx], paged)
        row_bytes = element_dim * dtype.itemsize
        if layout == "layer_first":
            tables = [(torch.tensor([h[layer].data_ptr() for layer in range(layers)],
                                    dtype=torch.uint64).cuda(),
                       torch.tensor([t.data_ptr() for t in d], dtype=torch.uint64).cuda())
                      for h, d in zip(hosts, devices)]
            if caches == 2:
                hicache.transfer_hicache_all_layer(
                    k_ptr_dst=tables[0][0], v_ptr_dst=tables[1][0], indices_dst=host_idx.cuda(),
                    k_ptr_src=tables[0][1], v_ptr_src=tables[1][1], indices_src=device_idx.cuda(),
                    kv_cache_dst_stride_bytes=row_bytes, kv_cache_src_stride_bytes=row_bytes,
                    element_size=row_bytes)
            else:
                hicache.transfer_hicache_all_layer_mla(
                    ptr_dst=tables[0][0], indices_dst=host_idx.cuda(), ptr_src=tables[0][1],
                    indices_src=device_idx.cuda(), cache_dst_stride_bytes=row_bytes,
                    cache_src_stride_bytes=row_bytes)
        else:
            for layer in range(layers):
                for h, d in zip(hosts, devices):
                    hicache.transfer_hicache_one_layer_mla(
                        sglang_layer_views(h, layout, layer), host_idx.cuda(), d[layer],
                        device_idx.cuda(), element_dim=element_dim, page_size=page_size)
        torch.cuda.synchronize()
        for h, e in zip(hosts, expected):
            assert torch.equal(h.view(torch.uint8), e.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [5, 100, 128, 165])
@pytest.mark.parametrize("method", ["kernel", "auto"])
def test_hisparse_mla_token_indices_with_page_size_64(method, count):
    # DeepSeek V3.2's HiSparse coordinator: MLA rows, page_size=64, a top-k of token indices.
    idx_dst, idx_src = page_firsts(count, 384, 1), page_firsts(count, 512, 1)
    where = "kernel" if method == "kernel" else "auto-host"
    run_one_layer(where, "h2d", page_size=64, idx_dst=idx_dst, idx_src=idx_src,
                  row_shape=(576,), dtype=torch.bfloat16, mla=True)
    run_all_layer("kernel", "d2h", page_size=64, idx_dst=idx_dst, idx_src=idx_src, mla=True,
                  width=576, dtype=torch.bfloat16)
