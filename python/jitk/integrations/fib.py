"""FlashInfer-Bench (pip install jitk[fib]): jitk ops as Definitions, jitk's kernels as
Solutions, and jitk as the builder of CUDA Solutions.

    jitk.fib.install_builder()                    # flashinfer-bench builds cuda Solutions with jitk
    definition = jitk.fib.definition(info, x, w, out, 1e-6, axes=..., const=...)
    python -m jitk fib export OUT_DIR [OP ...] [--family norm|hicache ...] [--hidden N ...]
                              [--dtype D ...] [--eps E ...]
    python -m jitk fib workloads LOGS OUT_DIR     # JITK_LOGLEVEL>=3 logs -> Workloads
    solution = jitk.fib.solution(definition)      # jitk's kernel for a dataset Definition

RMSNorm's Definitions and Solutions take FlashInfer-Bench's dataset form (fib_norm); the
HiCache transfers, which its dataset lacks, jitk's own (fib_hicache). Any other op with a
reference gets a Definition made by `definition()`:

A Definition is made from one example call of an op that has a reference: each tensor
parameter's dimensions become axes, named by `axes` (else '<parameter>_<dimension>'),
const with the example's size where the instantiation fixes it (`const`), var elsewhere;
the tensors the op only reads are inputs, those it writes are outputs ('<name>_out' where
it also reads them, its own name where it only writes them: `write_only`); non-tensor
arguments are fixed at the example's values. Its reference is the op's reference made
self-contained: the source of the reference and of the module's functions it calls, and a
`run` that takes the inputs and returns the outputs, as FlashInfer-Bench calls it.
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
import types
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from jitk.base.errors import ArgumentError
from jitk.integrations import fib_hicache, fib_norm
from jitk.integrations.fib_base import FibUnavailableError, require_fib, write_model
from jitk.integrations.fib_workloads import workloads
from jitk.runtime.op import OpInfo, find_op

__all__ = ["FAMILIES", "FibUnavailableError", "apply_config", "definition", "export",
           "install_builder", "solution", "workloads"]

# The ops export() writes, by kernel family (`python -m jitk fib export --family`).
FAMILIES = {"norm": fib_norm.OPS, "hicache": tuple(fib_hicache.OPS)}


def _op(op: OpInfo | str) -> OpInfo:
    """An OpInfo, or the op of a name; jitk's kernel modules are imported first, so that
    their ops are registered."""
    if isinstance(op, OpInfo):
        return op
    from jitk.runtime import registry

    for module in registry.kernel_modules():
        importlib.import_module(module)
    return find_op(op)


def solution(definition: object, name: str | None = None) -> object:
    """jitk's Solution of a Definition export() writes (RMSNorm's in the dataset's form, or
    a HiCache transfer's), checked against the kernel before anything is built: arity and
    argument names, dtypes, const axes and the reference's constants."""
    if fib_hicache.is_hicache(definition):
        return fib_hicache.solution(definition, name)
    return fib_norm.solution(definition, name)


# Relative size of one step (unit in the last place) at the bottom of a binade.
_ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}


def apply_config(dtype: str = "bfloat16", ulps: int = 2, **options: object) -> object:
    """A flashinfer_bench ApplyConfig that admits a Solution whose output differs from the
    Definition's reference by rounding alone: `ulps` steps of `dtype` relative, whatever the
    absolute size. Its default (max_atol 1e-2 and max_rtol 1e-5, both required) admits no
    trace of a 16-bit output, so apply() would always fall back. `options` go to ApplyConfig
    as they are (on_miss_policy, aot_ratio, ...)."""
    if dtype not in _ULP:
        raise ArgumentError(f"apply_config(): 'dtype' must be one of {', '.join(_ULP)}, got "
                            f"{dtype!r}")
    if not isinstance(ulps, int) or isinstance(ulps, bool) or ulps < 1:
        raise ArgumentError(f"apply_config(): 'ulps' must be an int >= 1, got {ulps!r}")
    require_fib()
    from flashinfer_bench.apply import ApplyConfig

    return ApplyConfig(max_atol=float("inf"), max_rtol=ulps * _ULP[dtype], **options)


def install_builder() -> object:
    """Puts jitk's builder first in flashinfer-bench's BuilderRegistry, so that cuda and cpp
    Solutions with the tvm-ffi binding are built by jitk.load_jit; returns the builder. Call
    it at the top level of the script: flashinfer-bench's benchmark workers are spawned
    processes, which import that script again and so install it too."""
    require_fib()
    from flashinfer_bench.compile import BuilderRegistry

    from jitk.integrations.fib_builder import JitkBuilder

    builders = BuilderRegistry.get_instance()
    # flashinfer-bench 0.1.2 has no call to add a builder: its list is the registry's own.
    for builder in builders._builders:
        if isinstance(builder, JitkBuilder):
            return builder
    builder = JitkBuilder()
    builders._builders.insert(0, builder)
    return builder


# ------------------------------------------------------------------------ Definitions
_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2}


def _dtype(tensor: torch.Tensor, where: str) -> str:
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"{where} is {tensor.dtype}, which a FlashInfer-Bench Definition "
                         "cannot describe")
    return str(tensor.dtype).removeprefix("torch.")


def _names(code: types.CodeType) -> list[str]:
    """The global names a function's code uses, its comprehensions' and lambdas' included."""
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [*code.co_names, *(name for inner in nested for name in _names(inner))]


def _called_functions(fn: Callable, seen: dict[str, str], modules: dict[str, str]) -> None:
    """The source of fn and of every function of its module that it calls, in call order
    (callees first), into `seen`; the modules they use (name -> module) into `modules`."""
    scope = fn.__globals__
    for name in _names(fn.__code__):
        called = scope.get(name)
        if isinstance(called, types.ModuleType):
            modules[name] = called.__name__
        elif (isinstance(called, types.FunctionType) and called.__module__ == fn.__module__
                and name not in seen):
            _called_functions(called, seen, modules)
    seen.setdefault(fn.__name__, textwrap.dedent(inspect.getsource(fn)))


def _reference_source(info: OpInfo, inputs: list[str], outputs: dict[str, str],
                      arguments: dict, shapes: dict[str, str]) -> str:
    """Python source with `run(<inputs>)` returning the outputs, through the op's reference."""
    reference = info.reference
    if not isinstance(reference, types.FunctionType) or reference.__name__ == "<lambda>":
        raise ValueError(f"{info.name}: the reference must be a def function to be exported "
                         f"as source, got {reference!r}")
    sources: dict[str, str] = {}
    modules = {"torch": "torch"}
    _called_functions(reference, sources, modules)
    body = []
    for name in outputs:
        if name in inputs:  # read and written: the reference writes a copy
            body.append(f"    {name} = {name}.clone()")
        else:
            value = arguments[name]
            body.append(f"    {name} = torch.empty({shapes[name]}, dtype=torch."
                        f"{str(value.dtype).removeprefix('torch.')}, device={inputs[0]}.device)")
    passed = ", ".join(f"{name}={name}" if name in inputs or name in outputs
                       else f"{name}={arguments[name]!r}" for name in arguments)
    body.append(f"    {reference.__name__}({passed})")
    body.append(f"    return {', '.join(outputs)}")
    run = f"def run({', '.join(inputs)}):\n" + "\n".join(body) + "\n"
    imports = "".join(f"import {module}\n" if module == name else f"import {module} as {name}\n"
                      for name, module in sorted(modules.items()))
    return imports + "\n\n" + "\n\n".join(sources.values()) + "\n\n" + run


def definition(info: OpInfo | str, *args: object, axes: dict[str, Iterable[str]] | None = None,
               const: Iterable[str] = (), write_only: Iterable[str] = (),
               name: str | None = None, op_type: str | None = None,
               description: str | None = None, **kwargs: object) -> object:
    """The Definition (a flashinfer_bench.data.Definition) of `info`'s op for the example
    call (*args, **kwargs); see the module docstring."""
    fib = require_fib()
    info = _op(info)
    if info.reference is None:
        raise ValueError(f"{info.name} has no reference (jitk.op(reference=...)), which a "
                         "Definition needs")
    bound = info.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    axes, const, write_only = dict(axes or {}), set(const), set(write_only)
    tensors = {key: value for key, value in arguments.items() if isinstance(value, torch.Tensor)}
    for key in [*axes, *write_only]:
        if key not in tensors:
            raise ValueError(f"{info.name}: '{key}' is not a tensor parameter of this call "
                             f"(tensors: {', '.join(tensors)})")
    if any(isinstance(v, list | tuple) and any(isinstance(i, torch.Tensor) for i in v)
           for v in arguments.values()):
        raise ValueError(f"{info.name}: lists of tensors have no Definition form")
    sizes: dict[str, int] = {}
    shapes: dict[str, list[str]] = {}
    for key, tensor in tensors.items():
        names = list(axes.get(key, [f"{key}_{i}" for i in range(tensor.dim())]))
        if len(names) != tensor.dim():
            raise ValueError(f"{info.name}: axes['{key}'] names {len(names)} dimensions, the "
                             f"example tensor has {tensor.dim()}")
        for axis, size in zip(names, tensor.shape):
            if sizes.setdefault(axis, size) != size:
                raise ValueError(f"{info.name}: axis '{axis}' is {sizes[axis]} in one tensor "
                                 f"and {size} in '{key}'")
        shapes[key] = names
    if unknown := const - set(sizes):
        raise ValueError(f"{info.name}: const names unknown axes {', '.join(sorted(unknown))}")
    inputs = [key for key in tensors if key not in write_only]
    if not inputs:
        raise ValueError(f"{info.name}: a Definition needs at least one input tensor")
    written = [key for key in info.mutates_args if key in tensors]
    if not written:
        raise ValueError(f"{info.name} writes no tensor argument; a Definition needs outputs")
    outputs = {key: (f"{key}_out" if key in inputs else key) for key in written}
    shape_code = {key: "(" + "".join(
        (f"{sizes[axis]}, " if axis in const else f"{_bound_dim(axis, inputs, shapes)}, ")
        for axis in shapes[key]) + ")" for key in written}
    source = _reference_source(info, inputs, outputs, arguments, shape_code)
    spec = lambda key: {"shape": shapes[key], "dtype": _dtype(tensors[key], key)}
    fixed = {key: value for key, value in arguments.items() if key not in tensors}
    return fib.data.Definition(
        name=name or f"{info.label}_" + "_".join(f"{a}{sizes[a]}" for a in sorted(const)),
        op_type=op_type or info.label,
        axes={axis: {"type": "const", "value": size} if axis in const else {"type": "var"}
              for axis, size in sizes.items()},
        inputs={key: spec(key) for key in inputs},
        outputs={outputs[key]: spec(key) for key in written},
        reference=source, tags=[f"jitk:{info.name}"],
        description=description or f"jitk op {info.name}" + (
            f" with {', '.join(f'{k}={v!r}' for k, v in fixed.items())}" if fixed else ""))


def _bound_dim(axis: str, inputs: list[str], shapes: dict[str, list[str]]) -> str:
    for key in inputs:
        if axis in shapes[key]:
            return f"{key}.shape[{shapes[key].index(axis)}]"
    raise ValueError(f"axis '{axis}' of an output appears in no input; make it const")


def export(out_dir: Path | str, ops: Iterable[str] | None = None,
           hidden: Iterable[int] = fib_norm.DEFAULT_HIDDEN, dtypes: Iterable[str] = ("bfloat16",),
           eps: Iterable[float] = (fib_norm.DATASET_EPS,)) -> list[Path]:
    """Writes a TraceSet folder: OUT_DIR/definitions/<op_type>/<name>.json and jitk's
    Solutions, OUT_DIR/solutions/<op_type>/<name>_jitk.json, for the named ops (label or
    name; default all of them): RMSNorm's at every hidden size x dtype x eps (fib_norm), the
    HiCache transfers' at their default rows x dtype (fib_hicache). Returns the paths. An
    unknown op raises KeyError; a user op (whose example shapes jitk does not know: call
    definition() for it), ArgumentError."""
    require_fib()
    out_dir, written = Path(out_dir), []
    chosen = [_op(name) for name in ops or [*fib_norm.OPS, *fib_hicache.OPS]]
    for info in chosen:
        if info.label not in fib_norm.OPS and info.label not in fib_hicache.OPS:
            raise ArgumentError(f"{info.name}: export covers {', '.join(fib_norm.OPS)}, "
                                f"{', '.join(fib_hicache.OPS)}; for another op with a "
                                "reference, call jitk.fib.definition(op, *example_args, ...)")
    sizes = fib_norm.sizes(hidden, dtypes, eps)
    made = []
    for info in chosen:
        if info.label in fib_norm.OPS:
            made += [fib_norm.definition(op, size, dtype, e)
                     for op, size, dtype, e in sizes if op == info.label]
        else:
            made += [fib_hicache.definition(fib_hicache.OPS[info.label], dtype=dtype)
                     for dtype in dict.fromkeys(dtype for _, _, dtype, _ in sizes)]
    for definition_ in made:
        written += [write_model(out_dir, "definitions", definition_),
                    write_model(out_dir, "solutions", solution(definition_))]
    return written
