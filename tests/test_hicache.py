"""HiCache KV transfers (jitk/csrc/hicache.cuh through jitk.hicache).

CPU part: the module builds for sm_90 and every entry point refuses bad arguments with a
message naming the argument and the rule. GPU part: every direction against a byte-exact
reference computed with torch indexing on the CPU, destinations poisoned beforehand."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from errors import expect_error

from jitk import hicache

POISON = 0x7F

# The one module the CPU tests build: rows of 128 float16 = 256 bytes.
ROW = 128
ROW_BYTES = 256


def cpu_rows(rows=16, width=ROW, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(rows, width).to(dtype)


def one_layer_args(**changes) -> dict:
    args = dict(k_cache_dst=cpu_rows(), v_cache_dst=cpu_rows(), indices_dst=torch.arange(4),
                k_cache_src=cpu_rows(20), v_cache_src=cpu_rows(20), indices_src=torch.arange(4))
    return {**args, **changes}


def one_layer(**changes):
    return lambda: hicache.transfer_hicache_one_layer(**one_layer_args(**changes))


# ------------------------------------------------------------------------------ CPU / CI
def test_module_builds_for_sm90():
    kernels = hicache._kernels(ROW_BYTES, hicache.DEFAULT_UNROLL)
    assert all(callable(f) for f in kernels)
    assert hicache._kernels(ROW_BYTES, hicache.DEFAULT_UNROLL) is kernels  # cached


def test_cpu_indices_are_refused_naming_the_device():
    expect_error(one_layer(), "'indices_dst'", "Device mismatch: expected cuda but got cpu",
                 "hicache.cuh:")
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(
        cpu_rows(), torch.arange(3), cpu_rows(), torch.arange(3)),
        "'indices_dst'", "Device mismatch: expected cuda but got cpu", "hicache.cuh:")


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


def test_k_and_v_must_agree_in_shape_and_all_caches_in_dtype():
    expect_error(one_layer(v_cache_dst=cpu_rows(17)), "'v_cache_dst'",
                 "Size mismatch for shape#0('dst tokens'): expected 16 but got 17", "hicache.cuh:")
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


def test_rows_must_be_contiguous_and_one_stride_apart():
    expect_error(one_layer(k_cache_src=cpu_rows(20, 2 * ROW)[:, ::2]), "'k_cache_src'",
                 "must be contiguous", "dimension 1 has stride 2")
    padded = torch.randn(16, 256).half()[:, :240].unflatten(1, (3, 80))
    expect_error(one_layer(k_cache_dst=padded, element_dim=ROW), "'k_cache_dst'",
                 "must be contiguous", "dimension 0 has stride 256 where 240 was needed")
    gappy = torch.randn(2, 10, ROW).half()[:, :8]
    expect_error(one_layer(k_cache_dst=gappy, element_dim=ROW), "'k_cache_dst'",
                 "with one row stride",
                 "dimension 0 has stride 1280 where 1024 was needed")
    expect_error(one_layer(k_cache_dst=cpu_rows(1, ROW).expand(16, ROW)), "'k_cache_dst'",
                 "overlap")


def test_leading_dimensions_flatten_into_rows():
    # [2, 8, 128] with element_dim 128 is 16 rows: it passes every cache check and stops
    # only at the CPU indices. So do rows split out of one contiguous run.
    expect_error(one_layer(k_cache_dst=torch.randn(2, 8, ROW).half(), element_dim=ROW),
                 "'indices_dst'", "Device mismatch")
    expect_error(one_layer(v_cache_dst=torch.randn(8, 2 * ROW).half(), element_dim=ROW),
                 "'indices_dst'", "Device mismatch")
    expect_error(one_layer(v_cache_dst=torch.randn(8, 2 * ROW).half(), element_dim=ROW,
                           k_cache_dst=cpu_rows(15)),
                 "'v_cache_dst'", "expected 15 but got 16")


def test_rows_must_be_16_byte_aligned():
    shifted = torch.randn(16 * ROW + 4).half()[4:].view(16, ROW)
    expect_error(one_layer(k_cache_src=shifted), "'k_cache_src' starts at 0x",
                 "not 16-byte aligned")
    expect_error(one_layer(v_cache_dst=torch.randn(16, ROW + 4).half()[:, :ROW]),
                 "'v_cache_dst' has a row stride of 264 bytes, not a multiple of 16")


def test_launch_options_are_checked():
    expect_error(one_layer(unroll=3), "unroll must be one of (1, 2, 4, 8), got 3",
                 kind=ValueError)
    expect_error(one_layer(block_quota=0), "block_quota must be at least 1, got 0",
                 kind=ValueError)


def all_layer_args(**changes) -> dict:
    table = torch.zeros(4, dtype=torch.int64)
    args = dict(k_ptrs_dst=table, v_ptrs_dst=table, indices_dst=torch.arange(4),
                k_ptrs_src=table, v_ptrs_src=table, indices_src=torch.arange(4),
                kv_cache_src_stride_bytes=ROW_BYTES, kv_cache_dst_stride_bytes=ROW_BYTES)
    return {**args, **changes}


def all_layer(**changes):
    return lambda: hicache.transfer_hicache_all_layer(**all_layer_args(**changes))


def test_all_layer_checks_pointer_tables_strides_and_indices():
    expect_error(all_layer(), "'indices_dst'", "Device mismatch: expected cuda but got cpu",
                 "hicache.cuh:")
    expect_error(all_layer(v_ptrs_src=torch.zeros(5, dtype=torch.int64)), "'v_ptrs_src'",
                 "Size mismatch for shape#0('num layers'): expected 4 but got 5")
    expect_error(all_layer(k_ptrs_dst=torch.zeros(4, dtype=torch.int32)), "'k_ptrs_dst'",
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


def test_all_layer_mla_checks_pointer_tables():
    table = torch.zeros(4, dtype=torch.int64)
    expect_error(lambda: hicache.transfer_hicache_all_layer_mla(
        table, torch.arange(2), table[:3], torch.arange(2),
        kv_cache_src_stride_bytes=ROW_BYTES, kv_cache_dst_stride_bytes=ROW_BYTES),
        "'ptrs_src'", "'num layers'")
    expect_error(lambda: hicache.transfer_hicache_all_layer_mla(
        table, torch.arange(2), table, torch.arange(2),
        kv_cache_src_stride_bytes=ROW_BYTES, kv_cache_dst_stride_bytes=ROW_BYTES),
        "'indices_dst'", "expected cuda but got cpu")


def test_precompile_configs_are_a_few_labelled_thunks():
    configs = hicache.precompile_configs()
    assert 1 <= len(configs) <= 6
    labels = [label for label, _ in configs]
    assert len(set(labels)) == len(labels)
    assert all(callable(thunk) for _, thunk in configs)


# ------------------------------------------------------------------------------------ GPU
class Cache(NamedTuple):
    """A cache as the kernel sees it (`view`) and the whole allocation behind it (`base`,
    row padding included), which the checks compare byte for byte."""
    base: torch.Tensor
    view: torch.Tensor

    @property
    def row_bytes(self) -> torch.Tensor:
        """The rows' bytes, without padding, as a [rows, bytes] uint8 view of a CPU copy."""
        width = self.view[0].numel() * self.view.element_size()
        return self.base.cpu().view(torch.uint8)[:, :width]


def place(t: torch.Tensor, where: str) -> torch.Tensor:
    return t.cuda() if where == "gpu" else t.pin_memory()


def make_cache(rows, row_shape, dtype, where, *, pad=0, poison=False) -> Cache:
    """Rows of `row_shape`, `pad` elements of padding after each. Random data (never zeros),
    or every byte POISON for a destination."""
    width = int(torch.Size(row_shape).numel())
    if poison:
        base = torch.full((rows, (width + pad) * dtype.itemsize), POISON, dtype=torch.uint8)
        base = base.view(dtype)
    else:
        base = (torch.randn(rows, width + pad) * 3).to(dtype)
    base = place(base, where)
    return Cache(base, base[:, :width].unflatten(1, tuple(row_shape)))


def gpu_indices(values, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device="cuda")


def distinct_rows(count: int, rows: int) -> list[int]:
    return torch.randperm(rows)[:count].tolist()


def expected_bytes(dst: Cache, src: Cache, idx_dst, idx_src, src_rows, dst_rows):
    """dst's bytes after the transfer: rows copied for in-range pairs, all else untouched."""
    expected = dst.base.cpu().view(torch.uint8).clone()
    width = src.row_bytes.shape[1]
    pairs = [(d, s) for d, s in zip(idx_dst, idx_src) if 0 <= d < dst_rows and 0 <= s < src_rows]
    if pairs:
        d, s = zip(*pairs)
        expected[:, :width][list(d)] = src.row_bytes[list(s)]
    return expected


def assert_bytes_equal(cache: Cache, expected: torch.Tensor) -> None:
    got = cache.base.cpu().view(torch.uint8)
    mismatched = (got != expected).any(dim=1).nonzero().flatten().tolist()
    assert not mismatched, f"{len(mismatched)} rows differ, first rows {mismatched[:8]}"


DIRECTIONS = {"d2h": ("gpu", "host"), "h2d": ("host", "gpu"), "d2d": ("gpu", "gpu"),
              "h2h": ("host", "host")}
INDEX_DTYPES = [torch.int32, torch.int64]
# (dtype, row shape, padding): 2048-byte rows from [heads, head_dim], 48-byte rows (three
# vectors), 256-byte fp8 rows; padding makes the row strides differ from the row size.
ROW_CASES = {
    "fp16-8x128": (torch.float16, (8, 128), 0),
    "bf16-24": (torch.bfloat16, (24,), 8),
    "fp8-256": (torch.float8_e4m3fn, (256,), 48),
}


def run_one_layer(direction, index_dtype, dtype, row_shape, pad, *, src_rows=301,
                  dst_rows=517, count=199, idx_dst=None, idx_src=None, **options):
    src_at, dst_at = DIRECTIONS[direction]
    # Each cache its own row stride: K and V, source and destination all differ.
    k_src = make_cache(src_rows, row_shape, dtype, src_at, pad=pad)
    v_src = make_cache(src_rows, row_shape, dtype, src_at, pad=2 * pad)
    k_dst = make_cache(dst_rows, row_shape, dtype, dst_at, pad=3 * pad, poison=True)
    v_dst = make_cache(dst_rows, row_shape, dtype, dst_at, poison=True)
    idx_dst = distinct_rows(count, dst_rows) if idx_dst is None else idx_dst
    idx_src = distinct_rows(count, src_rows) if idx_src is None else idx_src
    expected_k = expected_bytes(k_dst, k_src, idx_dst, idx_src, src_rows, dst_rows)
    expected_v = expected_bytes(v_dst, v_src, idx_dst, idx_src, src_rows, dst_rows)
    hicache.transfer_hicache_one_layer(
        k_dst.view, v_dst.view, gpu_indices(idx_dst, index_dtype),
        k_src.view, v_src.view, gpu_indices(idx_src, index_dtype), **options)
    torch.cuda.synchronize()
    assert_bytes_equal(k_dst, expected_k)
    assert_bytes_equal(v_dst, expected_v)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ROW_CASES)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_one_layer_matches_torch(direction, index_dtype, case):
    run_one_layer(direction, index_dtype, *ROW_CASES[case])


@pytest.mark.gpu
@pytest.mark.parametrize("block_quota", [None, 1, 3])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_many_tokens_and_block_quota(direction, block_quota):
    # 5000 tokens of 2 KiB: several grid-stride rounds at the default grid, thousands
    # with one block.
    run_one_layer(direction, torch.int64, torch.bfloat16, (1024,), 0, src_rows=6000,
                  dst_rows=5500, count=5000, block_quota=block_quota)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_deeper_unroll_with_fewer_threads(direction):
    run_one_layer(direction, torch.int32, torch.float16, (128,), 16, unroll=8)


@pytest.mark.gpu
def test_element_dim_splits_rows():
    # [rows, 2, 128] seen as rows of 128: twice the rows, half the width.
    src = make_cache(50, (2, 128), torch.float16, "gpu")
    dst = make_cache(40, (2, 128), torch.float16, "host", poison=True)
    idx_dst, idx_src = distinct_rows(30, 80), distinct_rows(30, 100)
    half = lambda c: Cache(c.base.view(-1, 128), c.view.reshape(-1, 128))  # noqa: E731
    expected = expected_bytes(half(dst), half(src), idx_dst, idx_src, 100, 80)
    hicache.transfer_hicache_one_layer_mla(
        dst.view, gpu_indices(idx_dst, torch.int64), src.view,
        gpu_indices(idx_src, torch.int64), element_dim=128)
    torch.cuda.synchronize()
    assert_bytes_equal(half(dst), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_empty_indices_change_nothing(direction):
    run_one_layer(direction, torch.int64, torch.float16, (128,), 0, idx_dst=[], idx_src=[])


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_out_of_range_indices_are_skipped(direction, index_dtype):
    src_rows, dst_rows = 64, 48
    top = torch.iinfo(index_dtype).max
    idx_dst = [0, 5, -1, 7, 9, dst_rows, 11, 13, top, 47, 20, -dst_rows]
    idx_src = [3, -1, 2, src_rows, 8, 1, -(2**31), 63, 4, 6, top, 10]
    run_one_layer(direction, index_dtype, torch.float16, (8, 16), 0, src_rows=src_rows,
                  dst_rows=dst_rows, idx_dst=idx_dst, idx_src=idx_src)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_one_layer_mla(direction):
    src_at, dst_at = DIRECTIONS[direction]
    src = make_cache(700, (576,), torch.bfloat16, src_at, pad=64)
    dst = make_cache(333, (576,), torch.bfloat16, dst_at, poison=True)
    idx_dst, idx_src = distinct_rows(257, 333), distinct_rows(257, 700)
    expected = expected_bytes(dst, src, idx_dst, idx_src, 700, 333)
    hicache.transfer_hicache_one_layer_mla(
        dst.view, gpu_indices(idx_dst, torch.int32), src.view, gpu_indices(idx_src, torch.int32))
    torch.cuda.synchronize()
    assert_bytes_equal(dst, expected)


class LayeredCache(NamedTuple):
    """Per-layer caches: on the GPU one tensor per layer; on the host one buffer
    [tokens, layers, row] (layer-interleaved), so that its row stride spans all layers."""
    layers: list[Cache]
    stride_bytes: int

    def table(self, dtype) -> torch.Tensor:
        return torch.tensor([c.view.data_ptr() for c in self.layers], dtype=dtype).cuda()


def make_layered(num_layers, rows, width, dtype, where, *, poison=False) -> LayeredCache:
    if where == "gpu":
        layers = [make_cache(rows, (width,), dtype, where, poison=poison)
                  for _ in range(num_layers)]
        return LayeredCache(layers, width * dtype.itemsize)
    whole = make_cache(rows, (num_layers, width), dtype, where, poison=poison)
    layers = []
    for layer in range(num_layers):
        # Each layer's base is the whole buffer: the rows it owns are a strided slice of it.
        view = whole.view[:, layer]
        layers.append(Cache(whole.base, view))
    return LayeredCache(layers, num_layers * width * dtype.itemsize)


def layer_bytes(layered: LayeredCache, layer: int) -> Cache:
    """One layer of a layered cache as a Cache whose `base` holds only that layer's rows."""
    view = layered.layers[layer].view
    return Cache(view.contiguous(), view)


def run_all_layer(direction, table_dtype, *, num_layers=5, width=128, dtype=torch.float16,
                  mla=False, src_rows=300, dst_rows=250, idx_dst=None, idx_src=None,
                  bounds=False, **options):
    src_at, dst_at = DIRECTIONS[direction]
    caches = 1 if mla else 2
    srcs = [make_layered(num_layers, src_rows, width, dtype, src_at) for _ in range(caches)]
    dsts = [make_layered(num_layers, dst_rows, width, dtype, dst_at, poison=True)
            for _ in range(caches)]
    idx_dst = distinct_rows(180, dst_rows) if idx_dst is None else idx_dst
    idx_src = distinct_rows(180, src_rows) if idx_src is None else idx_src
    # Without row bounds the kernel trusts the upper bound: give it only in-range ones then.
    limit_src, limit_dst = (src_rows, dst_rows) if bounds else (2**62, 2**62)
    expected = [[expected_bytes(layer_bytes(d, layer), layer_bytes(s, layer), idx_dst, idx_src,
                                limit_src, limit_dst) for layer in range(num_layers)]
                for d, s in zip(dsts, srcs)]
    row_bytes = width * dtype.itemsize
    element_size = row_bytes if srcs[0].stride_bytes != dsts[0].stride_bytes else None
    tables = [t for pair in zip(dsts, srcs) for t in pair]
    kwargs = dict(kv_cache_src_stride_bytes=srcs[0].stride_bytes,
                  kv_cache_dst_stride_bytes=dsts[0].stride_bytes, element_size=element_size,
                  **options)
    if bounds:
        kwargs.update(num_tokens_src=src_rows, num_tokens_dst=dst_rows)
    index_dst, index_src = gpu_indices(idx_dst, torch.int64), gpu_indices(idx_src, torch.int64)
    if mla:
        hicache.transfer_hicache_all_layer_mla(dsts[0].table(table_dtype), index_dst,
                                               srcs[0].table(table_dtype), index_src, **kwargs)
    else:
        k_dst, k_src, v_dst, v_src = (t.table(table_dtype) for t in tables)
        hicache.transfer_hicache_all_layer(k_dst, v_dst, index_dst, k_src, v_src, index_src,
                                           **kwargs)
    torch.cuda.synchronize()
    for dst, per_layer in zip(dsts, expected):
        for layer in range(num_layers):
            assert_bytes_equal(layer_bytes(dst, layer), per_layer[layer])


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_all_layer_matches_torch(direction):
    run_all_layer(direction, torch.int64)


@pytest.mark.gpu
def test_all_layer_uint64_tables_and_block_quota_below_layers():
    run_all_layer("d2h", torch.uint64, block_quota=2)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_all_layer_mla(direction):
    run_all_layer(direction, torch.int64, mla=True, width=576, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_all_layer_skips_indices_outside_the_given_row_counts():
    idx_dst = [0, 1, 249, 250, -1, 7, 100, 2**40, 8]
    idx_src = [5, 300, 6, 7, 8, -3, 299, 9, 2**40]
    run_all_layer("h2d", torch.int64, idx_dst=idx_dst, idx_src=idx_src, bounds=True)


@pytest.mark.gpu
def test_pageable_host_memory_is_refused():
    gpu = torch.randn(32, 128, device="cuda").half()
    pageable = torch.randn(32, 128).half()
    assert not pageable.is_pinned()
    idx = torch.arange(8, device="cuda")
    expect_error(lambda: hicache.transfer_hicache_one_layer(pageable, pageable, idx, gpu, gpu,
                                                            idx),
                 "'k_cache_dst' is in pageable host memory", "pin_memory=True", "hicache.cuh:")
    expect_error(lambda: hicache.transfer_hicache_one_layer_mla(gpu, idx, pageable, idx),
                 "'cache_src' is in pageable host memory")


@pytest.mark.gpu
def test_captured_in_a_cuda_graph():
    src = make_cache(300, (128,), torch.float16, "host")
    dst = make_cache(200, (128,), torch.float16, "gpu", poison=True)
    idx_dst, idx_src = distinct_rows(150, 200), distinct_rows(150, 300)
    index_dst, index_src = gpu_indices(idx_dst, torch.int64), gpu_indices(idx_src, torch.int64)
    transfer = lambda: hicache.transfer_hicache_one_layer_mla(  # noqa: E731
        dst.view, index_dst, src.view, index_src)
    transfer()  # build and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        transfer()
    for _ in range(2):
        src.base.copy_(torch.randn(src.base.shape).half())
        dst.base.view(torch.uint8).fill_(POISON)
        expected = expected_bytes(dst, src, idx_dst, idx_src, 300, 200)
        graph.replay()
        torch.cuda.synchronize()
        assert_bytes_equal(dst, expected)
