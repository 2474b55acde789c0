"""HiCache transfers in FlashInfer-Bench's terms: jitk's own Definitions (its dataset has no
KV-transfer op) and jitk's transfer kernel as Solutions its stock builder compiles.

Four ops, `op_type` "kv_transfer", named `jitk_hicache_<kind>_<row>_<dtype>`:
- one_layer (K and V, rows of heads x head_dim) and one_layer_mla (one cache, rows of
  latent_dim): caches [slots, row...]; `dst[indices_dst[i]] = src[indices_src[i]]`.
- all_layer and all_layer_mla: caches [num_layers, slots, row...], the same for every layer.
  jitk's all-layer op takes one base address per layer (pointer tables), which a Definition's
  tensors cannot state; its Definition stacks the layers in one tensor instead, and the
  Solution builds the tables from that tensor's layers.
Indices are int64 token indices (one slot each); an index pair with either side outside its
cache moves nothing, as jitk's kernel skips it; indices_dst must not repeat among the pairs
that move (which source row then lands is unspecified, in the kernel as in the reference).

FlashInfer-Bench's schema forbids an output that is also an input, so a transfer, which
writes into its destination cache, is value-returning here: the destination caches are
inputs, and the outputs (`<cache>_dst_out`) are copies of them with the moved rows written.
The Solution (destination-passing, as FlashInfer-Bench calls a cuda Solution) copies each
destination into its output, then runs jitk's kernel on the outputs.
"""

from __future__ import annotations

import re

import torch

from jitk.base.errors import ArgumentError, ArgumentTypeError
from jitk.build.jit import KERNEL_DIR
from jitk.integrations.fib_base import AUTHOR, COPY_INTO, require_fib, shipped_files
from jitk.integrations.fib_norm import NVCC_APPEND_FLAGS
from jitk.kernels.hicache import DEFAULT_UNROLL, MAX_ELEMENT_BYTES, VECTOR_BYTES
from jitk.kernels.hicache.modules import KERNEL_FILES

__all__ = ["KINDS", "OPS", "definition", "definition_name", "is_hicache", "solution"]

KINDS = ("one_layer", "one_layer_mla", "all_layer", "all_layer_mla")
# The ops export() takes by label, each with its Definition kind.
OPS = {f"transfer_hicache_{kind}": kind for kind in KINDS}
# Rows of the examples export writes: 8 KV heads of 128, MLA's 576-wide latent row.
DEFAULT_ROWS = {"one_layer": (8, 128), "one_layer_mla": (576,), "all_layer": (8, 128),
                "all_layer_mla": (576,)}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_NAME = re.compile(r"^jitk_hicache_(one_layer|all_layer)(_mla)?_((?:\d+x)?\d+)_(\w+)$")

_REFERENCE = '''\
import torch


@torch.no_grad()
def run({params}):
    dst_slots, src_slots = {dst}.shape[{slot_dim}], {src}.shape[{slot_dim}]
    to, take = indices_dst.to(torch.int64), indices_src.to(torch.int64)
    moves = (to >= 0) & (to < dst_slots) & (take >= 0) & (take < src_slots)
    to, take = to[moves], take[moves]
    outputs = []
    for dst, src in (({pairs})):
        out = dst.clone()
        out[{at}to.to(out.device)] = src[{at}take.to(src.device)].to(out.device)
        outputs.append(out)
    return {returned}
'''


def _caches(kind: str) -> list[str]:
    return ["cache"] if kind.endswith("_mla") else ["k_cache", "v_cache"]


def _row_axes(kind: str) -> list[str]:
    return ["latent_dim"] if kind.endswith("_mla") else ["heads", "head_dim"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def definition_name(kind: str, row: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"jitk_hicache_{kind}_{'x'.join(map(str, row))}_{_dtype_name(dtype)}"


def is_hicache(definition: object) -> bool:
    """Whether a Definition is named as one of these (solution() checks the rest)."""
    return getattr(definition, "name", "").startswith("jitk_hicache_")


def definition(kind: str, row: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.bfloat16) -> object:
    """The Definition of a HiCache transfer (`kind` among KINDS) for rows of `row` elements
    ((heads, head_dim), or (latent_dim,) for MLA; DEFAULT_ROWS by default) of `dtype`."""
    fib = require_fib()
    if kind not in KINDS:
        raise ArgumentError(f"jitk.fib: 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    row = DEFAULT_ROWS[kind] if row is None else tuple(row)
    axes_of_row = _row_axes(kind)
    if len(row) != len(axes_of_row) or not all(isinstance(n, int) and n >= 1 for n in row):
        raise ArgumentError(f"jitk.fib: 'row' of {kind} must be {len(axes_of_row)} int(s) >= 1 "
                            f"({', '.join(axes_of_row)}), got {row!r}")
    if dtype not in _DTYPES.values():
        raise ArgumentTypeError(f"jitk.fib: 'dtype' must be one of {', '.join(_DTYPES)}, "
                                f"got {dtype}")
    row_bytes = torch.Size(row).numel() * dtype.itemsize
    if row_bytes % VECTOR_BYTES or row_bytes > MAX_ELEMENT_BYTES:
        raise ArgumentError(f"jitk.fib: 'row' {row!r} of {dtype} is {row_bytes} bytes; jitk's "
                            f"kernel moves rows of a multiple of {VECTOR_BYTES} bytes up to "
                            f"{MAX_ELEMENT_BYTES}")
    layers = ["num_layers"] if kind.startswith("all_layer") else []
    caches = _caches(kind)

    def cache(side: str) -> dict:
        return {"shape": [*layers, f"{side}_slots", *axes_of_row], "dtype": _dtype_name(dtype)}

    indices = {"shape": ["num_tokens"], "dtype": "int64"}
    inputs = {**{f"{c}_dst": cache("dst") for c in caches}, "indices_dst": indices,
              **{f"{c}_src": cache("src") for c in caches}, "indices_src": indices}
    outputs = {f"{c}_dst_out": cache("dst") for c in caches}
    source = _REFERENCE.format(
        params=", ".join(inputs), dst=f"{caches[0]}_dst", src=f"{caches[0]}_src",
        slot_dim=len(layers), at=":, " if layers else "",
        pairs="".join(f"({c}_dst, {c}_src), " for c in caches),
        returned="outputs[0], outputs[1]" if len(caches) == 2 else "outputs[0]")
    where = ("for every layer l, " if layers else "") + " and ".join(
        f"{c}_dst_out{'[l]' if layers else ''}[indices_dst[i]] = "
        f"{c}_src{'[l]' if layers else ''}[indices_src[i]]" for c in caches)
    return fib.data.Definition(
        name=definition_name(kind, row, dtype), op_type="kv_transfer",
        tags=["jitk", f"jitk:jitk::transfer_hicache_{kind}"],
        axes={**{a: {"type": "var"} for a in [*layers, "dst_slots", "src_slots", "num_tokens"]},
              **{a: {"type": "const", "value": n} for a, n in zip(axes_of_row, row)}},
        inputs=inputs, outputs=outputs, reference=source,
        description=f"jitk's HiCache {kind} transfer: the destination caches with {where} "
                    "(int64 token indices; a pair with either index outside its cache moves "
                    "nothing; indices_dst must not repeat among the pairs that move). "
                    "Value-returning: FlashInfer-Bench's schema forbids an output that is "
                    "also an input, so the outputs are copies of the destinations, written.")


def _signature(given: object) -> tuple[str, tuple[int, ...], torch.dtype]:
    """(kind, row, dtype) of a Definition of definition()'s form, checked against what
    jitk's kernel takes: names, arity, axes and dtypes."""
    parts = _NAME.match(getattr(given, "name", ""))
    if parts is None:
        raise ArgumentError(f"jitk.fib.solution: 'definition' {getattr(given, 'name', '')!r} "
                            "is not named jitk_hicache_<kind>_<row>_<dtype>")
    kind = parts[1] + (parts[2] or "")
    if parts[4] not in _DTYPES:
        raise ArgumentTypeError(f"jitk.fib.solution: {given.name}: dtype {parts[4]!r} is "
                                f"not one of {', '.join(_DTYPES)}")
    row = tuple(int(n) for n in parts[3].split("x"))
    expected = definition(kind, row, _DTYPES[parts[4]])
    for part in ("inputs", "outputs", "axes"):
        got, want = getattr(given, part), getattr(expected, part)
        if list(got) != list(want):
            raise ArgumentError(f"jitk.fib.solution: {given.name}: {part} "
                                f"({', '.join(got)}); jitk's {kind} kernel takes "
                                f"({', '.join(want)})")
        for key in want:
            if got[key] != want[key]:
                error = ArgumentTypeError if part != "axes" and got[key].shape == want[
                    key].shape else ArgumentError
                what = {"inputs": "input", "outputs": "output", "axes": "axis"}[part]
                raise error(f"jitk.fib.solution: {given.name}: {what} '{key}' is "
                            f"{got[key]}; jitk's kernel takes {want[key]}")
    if given.reference != expected.reference:  # what jitk's kernel computes, and nothing else
        raise ArgumentError(f"jitk.fib.solution: {given.name}: its reference differs from the "
                            f"one jitk.fib writes for {kind}, whose transfer the kernel makes")
    return kind, row, _DTYPES[parts[4]]


_ONE_LAYER = """
void run({params}) {{
  // jitk's kernel writes in place: each destination is copied into its output first.
{views}{copies}  Transfer::{entry}({outs}indices_dst, {srcs}indices_src, kRowElements,
                      /*page_size=*/1, /*block_quota=*/jitk::hicache::kNotGiven);
}}
"""

_ALL_LAYER = """
// Layer l's base address of each cache into tables[c * layers + l].
struct Bases {{
  uint64_t address[{tables}];
  uint64_t layer_bytes[{tables}];
}};

__global__ void fill_tables(uint64_t* tables, int64_t layers, Bases bases) {{
  for (int64_t i = blockIdx.x * int64_t{{blockDim.x}} + threadIdx.x; i < layers * {tables};
       i += int64_t{{gridDim.x}} * blockDim.x) {{
    tables[i] = bases.address[i / layers] + static_cast<uint64_t>(i % layers) *
                                                 bases.layer_bytes[i / layers];
  }}
}}

// Stream-ordered scratch, freed on every way out of run (a failed check throws).
struct Scratch {{
  void* data = nullptr;
  cudaStream_t stream;
  ~Scratch() {{
    if (data != nullptr) cudaFreeAsync(data, stream);
  }}
}};

uint64_t address_of(const jitk::TensorView& t) {{
  return reinterpret_cast<uint64_t>(t.data_ptr()) + t.byte_offset();
}}
}}  // namespace

void run({params}) {{
  // jitk's kernel writes in place: each destination is copied into its output first.
{views}{copies}  const jitk::TensorView caches[] = {{{outs}{srcs}}};
  int64_t layers = caches[0].size(0);
  for (const auto& cache : caches) {{
    jitk::RuntimeCheck(cache.size(0) == layers && cache.stride(1) * {elem} == kRowBytes,
                       "jitk Solution: every cache must be [num_layers, slots, row] with "
                       "contiguous rows");
  }}
  const auto stream = jitk::current_stream(caches[0].device());
  Bases bases{{}};
  for (int c = 0; c < {tables}; ++c) {{
    bases.address[c] = address_of(caches[c]);
    bases.layer_bytes[c] = static_cast<uint64_t>(caches[c].stride(0)) * {elem};
  }}
  Scratch scratch{{nullptr, stream}};
  jitk::RuntimeDeviceCheck(
      cudaMallocAsync(&scratch.data, sizeof(uint64_t) * {tables} * layers, stream));
  auto* tables = static_cast<uint64_t*>(scratch.data);
  fill_tables<<<1, 256, 0, stream>>>(tables, layers, bases);
  jitk::RuntimeDeviceCheck(cudaGetLastError());
  DLTensor table_tensors[{tables}];
  for (int c = 0; c < {tables}; ++c) {{
    table_tensors[c] = {{tables + c * layers, caches[0].device(), 1,
                        DLDataType{{kDLUInt, 64, 1}}, &layers, nullptr, 0}};
  }}
  const int64_t dst_slots = caches[0].size(1), src_slots = caches[{caches}].size(1);
  // The all-layer kernel cannot tell where its tables point, so its default quota is the one
  // for transfers across PCIe; every cache here is on the GPU: one block per SM, as the
  // one-layer kernel takes for GPU caches.
  int sms = 0;
  jitk::RuntimeDeviceCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                                  caches[0].device().device_id));
  Transfer::{entry}({tables_args}, kRowBytes, kRowBytes, kRowBytes, /*page_size=*/1,
                      /*page_rows=*/1, jitk::hicache::kNotGiven, jitk::hicache::kNotGiven,
                      src_slots, dst_slots, /*block_quota=*/sms);
}}
"""


def _entry(kind: str, row: tuple[int, ...], dtype: torch.dtype) -> str:
    """main.cu: `run` taking the Definition's inputs then its outputs."""
    caches = _caches(kind)
    elements = torch.Size(row).numel()
    inputs = [*(f"{c}_dst" for c in caches), "indices_dst", *(f"{c}_src" for c in caches),
              "indices_src"]
    outputs = [f"{c}_dst_out" for c in caches]
    params = ", ".join(f"tvm::ffi::TensorView {name}_" for name in [*inputs, *outputs])
    views = "".join(f"  const jitk::TensorView {name}({name}_);\n"
                    for name in [*inputs, *outputs])
    copies = "".join(f"  copy_into({c}_dst_out, {c}_dst);\n" for c in caches)
    outs = "".join(f"{c}_dst_out, " for c in caches)
    srcs = "".join(f"{c}_src, " for c in caches)
    fields = {"params": params, "views": views, "copies": copies, "outs": outs,
              "srcs": srcs, "entry": kind, "caches": len(caches), "tables": 2 * len(caches),
              "elem": dtype.itemsize}
    if kind.startswith("one_layer"):
        body = "}  // namespace\n" + _ONE_LAYER.format(**fields)
    else:
        table = "jitk::TensorView(&table_tensors[{}])".format
        n = len(caches)
        fields["tables_args"] = ", ".join([*map(table, range(n)), "indices_dst",
                                           *map(table, range(n, 2 * n)), "indices_src"])
        body = _ALL_LAYER.format(**fields)
    return f"""\
// jitk's HiCache {kind} transfer as a FlashInfer-Bench Solution of
// {definition_name(kind, row, dtype)} (written by jitk.fib): destination-passing.
#include <jitk/utils.cuh>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include "hicache.cuh"

namespace {{
constexpr int64_t kRowElements = {elements};
constexpr int64_t kRowBytes = {elements * dtype.itemsize};
using Transfer = jitk::hicache::HiCache<kRowBytes, {DEFAULT_UNROLL}>;
{COPY_INTO}{body}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(run, run);
"""


def solution(definition: object, name: str | None = None) -> object:
    """jitk's Solution of a HiCache Definition of definition()'s form, checked against the
    kernel first: its name, arity, argument names and order, axes and dtypes."""
    fib = require_fib()
    if not isinstance(definition, fib.data.Definition):
        raise ArgumentTypeError(f"jitk.fib.solution: 'definition' must be a "
                                f"flashinfer_bench Definition, got {type(definition).__name__}")
    kind, row, dtype = _signature(definition)
    files = {"main.cu": _entry(kind, row, dtype)}
    files.update({path: (KERNEL_DIR / "hicache" / path).read_text() for path in KERNEL_FILES})
    return fib.data.Solution(
        name=name or f"{definition.name}_jitk", definition=definition.name, author=AUTHOR,
        spec=fib.data.BuildSpec(language="cuda", binding="tvm-ffi", target_hardware=["cuda"],
                                entry_point="main.cu::run", destination_passing_style=True),
        sources=shipped_files(files),
        description=f"jitk's HiCache transfer kernel ({kind}), self-contained; "
                    "FlashInfer-Bench's tvm-ffi builder builds it with "
                    f"NVCC_APPEND_FLAGS='{NVCC_APPEND_FLAGS}' set")
