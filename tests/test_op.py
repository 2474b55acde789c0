"""jitk.op on a user's own kernel: a host-only module from cpp_files, made PyTorch operators
that torch.compile(fullgraph=True), torch.export, make_fx and opcheck handle, while an eager
call skips the dispatcher; argument types are checked with the parameter's name."""

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import jitk

KERNEL = Path(__file__).resolve().parent / "csrc" / "cpu_axpy.h"
loads = []  # one entry per module load: loading happens at run time, never while tracing
handed = []  # the address of every `y` the axpy kernel was handed


@functools.cache
def _module():
    loads.append(KERNEL)
    return jitk.load_jit("cpu_axpy", cpp_files=[KERNEL], cpp_wrappers=[("axpy", "cpu_axpy::axpy")])


@jitk.op("jitk_test::axpy", mutates_args=("y",))
def axpy(alpha: float, x: torch.Tensor, y: torch.Tensor) -> None:
    """y += alpha * x, in place."""
    handed.append(y.data_ptr())
    _module().axpy(alpha, x, y)


@jitk.op("jitk_test::scaled", mutates_args=())
def scaled(x: torch.Tensor, alpha: float = 1.0, offset: torch.Tensor | None = None, *,
           repeat: int = 1) -> torch.Tensor:
    """alpha * x (+ offset), `repeat` times over: a new tensor shaped like x."""
    out = torch.zeros_like(x) if offset is None else offset.clone()
    for _ in range(repeat):
        _module().axpy(alpha, x, out)
    return out


def _first_half_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0] // 2)


@jitk.op("jitk_test::first_half", mutates_args=(), fake=_first_half_fake)
def first_half(x: torch.Tensor) -> torch.Tensor:
    """A result not shaped like the input: its fake implementation is written by hand."""
    out = x.new_zeros(x.shape[0] // 2)
    _module().axpy(1.0, x[: out.shape[0]], out)
    return out


@jitk.op("jitk_test::touch", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def touch(x: torch.Tensor) -> None:
    """Returns nothing and writes no argument: kept in graphs for its side effect."""
    handed.append(x.data_ptr())


def block(x, y, alpha):
    """A little of everything: torch ops around three jitk ops."""
    z = scaled(x.sin(), alpha, repeat=2)
    axpy(alpha, z, y)
    return first_half(y * 2) + 1


@pytest.fixture(autouse=True)
def fresh_compiler():
    # No compiled graph may come from an earlier test or run: each is traced here.
    torch._dynamo.reset()
    with torch._inductor.utils.fresh_cache():
        yield
    torch._dynamo.reset()


def inputs(n=16):
    return torch.randn(n), torch.randn(n)


# ------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_fullgraph_equals_eager_and_loads_only_at_run_time(backend):
    # Inductor reinplaces the written argument; aot_eager (no reinplacing) hands the op a
    # copy and writes it back: both must give eager's results.
    x, y = inputs()
    y_eager = y.clone()
    expected = block(x, y_eager, 0.5)
    _module.cache_clear()
    loads.clear()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    got = compiled(x, y, 0.5)
    # Inductor's fused sin may differ from eager's in the last bit.
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(y, y_eager)
    # The module was loaded by the ops as they ran, not by tracing (the loader's file
    # system calls would have broken fullgraph).
    assert loads == [KERNEL]
    assert torch.compile(block, fullgraph=True, backend=backend)(x, y.clone(), 0.5).shape == (8,)


def test_inductor_hands_the_kernel_the_callers_tensor():
    # A kernel writing through the argument it was given (a KV cache, a flag) needs the
    # caller's tensor, not a functional copy: Inductor reinplaces jitk ops.
    def write(x, y):
        axpy(2.0, x, y)

    x, y = inputs()
    expected = y + 2.0 * x
    handed.clear()
    torch.compile(write, fullgraph=True)(x, y)
    assert handed == [y.data_ptr()]
    torch.testing.assert_close(y, expected)


def test_side_effect_only_op_survives_dead_code_elimination():
    def run(x):
        touch(x)
        return x + 1

    x = torch.randn(4)
    handed.clear()
    torch.compile(run, fullgraph=True)(x)
    assert handed == [x.data_ptr()]
    graph = make_fx(run)(x)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    assert "jitk_test.touch" in graph.code


# ------------------------------------------------------------------------------ tracing
def test_export_records_the_ops_and_runs_them():
    class Block(torch.nn.Module):
        def forward(self, x, y):
            return block(x, y, 0.25)

    x, y = inputs()
    exported = torch.export.export(Block(), (x, y.clone()))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"jitk_test.axpy.default", "jitk_test.scaled.default",
            "jitk_test.first_half.default"} <= targets
    y_exported, y_eager = y.clone(), y.clone()
    torch.testing.assert_close(exported.module()(x, y_exported), block(x, y_eager, 0.25))
    torch.testing.assert_close(y_exported, y_eager)


def test_make_fx_over_fake_cuda_tensors_traces_the_op_without_running_it():
    with FakeTensorMode():
        x = torch.empty(16, device="cuda")
        y = torch.empty(16, device="cuda")
    graph = make_fx(lambda x, y: block(x, y, 0.5))(x, y)
    calls = [str(n.target) for n in graph.graph.nodes if str(n.target).startswith("jitk_test")]
    assert calls == ["jitk_test.scaled.default", "jitk_test.axpy.default",
                     "jitk_test.first_half.default"]


def test_fake_implementations_give_the_result_shapes():
    with FakeTensorMode():
        x = torch.empty(10, 3)
        assert scaled(x, 2.0).shape == (10, 3)
        assert first_half(torch.empty(10)).shape == (5,)
        assert axpy(1.0, x, x) is None


def test_opcheck():
    x, y = inputs()
    torch.library.opcheck(axpy.op, (0.5, x, y))
    torch.library.opcheck(scaled.op, (x, 0.5), {"offset": y, "repeat": 3})
    torch.library.opcheck(first_half.op, (x,))
    torch.library.opcheck(touch.op, (x,))


# ------------------------------------------------------------------------------ eager path
def test_eager_call_skips_the_dispatcher():
    x, y = inputs()
    with torch.profiler.profile() as direct:
        axpy(0.5, x, y)
    with torch.profiler.profile() as dispatched:
        axpy.op(0.5, x, y)
    assert "jitk_test::axpy" not in [event.name for event in direct.events()]
    assert "jitk_test::axpy" in [event.name for event in dispatched.events()]


class Recorder:
    def __init__(self):
        self.seen = []

    def record(self, func, args, kwargs):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_and_function_modes_see_the_op():
    class DispatchRecorder(TorchDispatchMode, Recorder):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return self.record(func, args, kwargs)

    class FunctionRecorder(TorchFunctionMode, Recorder):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return self.record(func, args, kwargs)

    x, y = inputs()
    for mode in (DispatchRecorder(), FunctionRecorder()):
        Recorder.__init__(mode)
        expected = y + 0.5 * x
        with mode:
            axpy(0.5, x, y)
        assert "jitk_test.axpy.default" in mode.seen
        torch.testing.assert_close(y, expected)


def test_tensor_subclasses_go_through_the_dispatcher():
    # A FakeTensor used outside its mode has no data for a kernel to read: the call must
    # take the operator (and its fake implementation), not the kernel.
    with FakeTensorMode():
        x = torch.empty(6)
    out = scaled(x, 2.0)
    assert type(out) is type(x) and out.shape == (6,)
    weight = torch.nn.Parameter(torch.ones(6), requires_grad=False)  # a plain tensor
    torch.testing.assert_close(scaled(weight, 3.0), torch.full((6,), 3.0))


def test_meta_tensors_are_refused_naming_the_tensor_before_the_body_runs():
    handed.clear()
    x, meta = torch.empty(6), torch.empty(6, device="meta")
    for call, name in ((lambda: axpy(1.0, x, meta), "y"), (lambda: scaled(meta), "x"),
                       (lambda: scaled(x, offset=meta), "offset"), (lambda: touch(meta), "x")):
        with pytest.raises(jitk.ArgumentError, match=rf"\(\): '{name}' is on device meta, "
                                                     "expected cuda"):
            call()
    assert not handed, "the body ran"
    with FakeTensorMode():  # fakes still take the operator and its fake implementation
        assert scaled(torch.empty(6, device="cuda")).shape == (6,)


def test_eager_results_and_defaults():
    x, y = inputs()
    expected = y + 0.5 * x
    assert axpy(0.5, x, y) is None
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(scaled(x), x)
    torch.testing.assert_close(scaled(x, 2, offset=y, repeat=2), y + 4 * x)  # int for float
    torch.testing.assert_close(first_half(x), x[:8])


def test_wrapper_keeps_name_signature_and_docs():
    assert axpy.__name__ == "axpy" and axpy.__doc__ == "y += alpha * x, in place."
    assert list(__import__("inspect").signature(scaled).parameters) == \
        ["x", "alpha", "offset", "repeat"]
    assert str(axpy.op._schema) == \
        "jitk_test::axpy(float alpha, Tensor x, Tensor(a2!) y) -> ()"
    assert torch.Tag.cudagraph_unsafe in touch.op.tags
    assert torch.Tag.cudagraph_unsafe not in axpy.op.tags


# ------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("call, message", [
    (lambda x, y: axpy(0.5, None, y), r"axpy\(\): 'x' must be a torch.Tensor, got None$"),
    (lambda x, y: axpy(0.5, x, np.zeros(16, np.float32)),
     r"axpy\(\): 'y' must be a torch.Tensor, got numpy.ndarray$"),
    (lambda x, y: axpy([0.5], x, y), r"'alpha' must be a float, got list$"),
    (lambda x, y: axpy(True, x, y), r"'alpha' must be a float, got bool True$"),
    (lambda x, y: axpy("0.5", x, y), r"'alpha' must be a float, got str '0.5'$"),
    (lambda x, y: scaled(x, repeat=True), r"scaled\(\): 'repeat' must be an int, got bool"),
    (lambda x, y: scaled(x, repeat=2.0), r"'repeat' must be an int, got float 2.0$"),
    (lambda x, y: scaled(x, offset=3), r"'offset' must be a torch.Tensor or None, got int 3$"),
    (lambda x, y: scaled(x, offset=[y]), r"'offset' must be a torch.Tensor or None, got list"),
])
def test_wrong_argument_types_name_the_parameter(call, message):
    x, y = inputs()
    before = y.clone()
    with pytest.raises(TypeError, match=message):
        call(x, y)
    torch.testing.assert_close(y, before)


def test_wrong_types_are_caught_under_compile_too():
    with pytest.raises(Exception, match="'repeat' must be an int, got str"):
        torch.compile(lambda x: scaled(x, repeat="2"), fullgraph=True, backend="eager")(
            torch.randn(4))


def test_an_eager_write_bumps_the_version_counter_so_autograd_notices():
    x, y = torch.ones(4), torch.zeros(4)
    weight = torch.ones(4, requires_grad=True)
    product = weight * y  # saves y for the backward
    before = y._version
    axpy(2.0, x, y)  # the eager fast path: the kernel writes y
    assert y._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()
    axpy(2, x, y)  # an int for the float: the checked path, which calls axpy directly too
    assert y._version == before + 2
    scaled(x, offset=y)  # declares no write: no bump
    assert y._version == before + 2


def test_declaration_errors():
    with pytest.raises(TypeError, match="returns <class 'int'>.*must be given: fake=f"):
        @jitk.op("jitk_test::count", mutates_args=())
        def count(x: torch.Tensor) -> int:
            return x.numel()
    with pytest.raises(TypeError, match="no return annotation; write -> None"):
        @jitk.op("jitk_test::unannotated_return", mutates_args=())
        def unannotated_return(x: torch.Tensor): ...
    with pytest.raises(TypeError, match="'x' has no type annotation"):
        @jitk.op("jitk_test::unannotated", mutates_args=())
        def unannotated(x) -> None: ...
    with pytest.raises(TypeError, match="'x' is annotated <class 'numpy.ndarray'>"):
        @jitk.op("jitk_test::numpy_in", mutates_args=())
        def numpy_in(x: np.ndarray) -> None: ...
    with pytest.raises(TypeError, match=r"mutates_args takes parameter names, e.g. \('out',\)"):
        jitk.op("jitk_test::w", mutates_args="y")
    for name in ("axpy", "bad ns::x", "jitk_test::a b", "a::b::c", "jitk_test::"):
        with pytest.raises(ValueError, match=r"'namespace::name', two identifiers "
                           rf"\(letters, digits, _\), got '{name}'"):
            jitk.op(name, mutates_args=())
    for mutated in (None, 3, ["y", 1]):
        with pytest.raises(TypeError, match=r"mutates_args takes parameter names, e.g. "
                           r"\('out',\), or \(\) for none, got"):
            jitk.op("jitk_test::w", mutates_args=mutated)
    with pytest.raises(ValueError, match="mutates_args names 'z', not a parameter of"):
        @jitk.op("jitk_test::unknown_write", mutates_args=("z",))
        def unknown_write(x: torch.Tensor) -> None: ...
    with pytest.raises(TypeError, match="'_jitk_fn' is reserved"):
        @jitk.op("jitk_test::reserved", mutates_args=())
        def reserved(_jitk_fn: torch.Tensor) -> None: ...


# ---------------------------------------------------------------- registry, slot, references
def _axpy_reference(alpha: float, x: torch.Tensor, y: torch.Tensor) -> None:
    y.add_(x, alpha=alpha)


@jitk.op("jitk_test::axpy_checked", mutates_args=("y",), reference=_axpy_reference,
         tolerance=jitk.Tolerance(1e-6, 1e-6))
def axpy_checked(alpha: float, x: torch.Tensor, y: torch.Tensor) -> None:
    _module().axpy(alpha, x, y)


def test_registry_records_each_op():
    info = jitk.runtime.op.registered_ops()["jitk_test::axpy_checked"]
    assert info is axpy_checked.info and info.operator is axpy_checked.op
    assert info.mutates_args == ("y",) and info.reference is _axpy_reference
    assert info.tolerance == (1e-6, 1e-6) and list(info.signature.parameters) == \
        ["alpha", "x", "y"]
    assert jitk.runtime.op.find_op("axpy_checked") is info
    with pytest.raises(KeyError, match="no jitk op named 'nope'"):
        jitk.runtime.op.find_op("nope")


def test_unwrapped_slot_is_the_body_itself():
    # Nothing between the generated eager function and the body: host time as before.
    assert axpy_checked.__globals__["_jitk_fn"] is axpy_checked.info.fn


def test_call_wrapper_sees_eager_and_dispatcher_calls_and_is_removed():
    seen = []

    def factory(info, fn):
        if info.name != "jitk_test::axpy_checked":
            return None

        def logged(*args, **kwargs):
            seen.append(info.name)
            return fn(*args, **kwargs)
        return logged

    jitk.runtime.op.add_call_wrapper(factory)
    try:
        x, y = inputs()
        axpy_checked(1.0, x, y)
        axpy_checked.op(1.0, x, y)
        torch.compile(lambda x, y: axpy_checked(1.0, x, y), backend="aot_eager",
                      fullgraph=True)(x, y)
        axpy(1.0, x, y)  # another op: left alone
    finally:
        jitk.runtime.op.remove_call_wrapper(factory)
    assert seen == ["jitk_test::axpy_checked"] * 3
    assert axpy_checked.__globals__["_jitk_fn"] is axpy_checked.info.fn


def test_reference_mode_switches_named_ops_and_warns_once(monkeypatch):
    ran = []
    monkeypatch.setattr(axpy_checked.info, "reference",
                        lambda alpha, x, y: ran.append(alpha) or _axpy_reference(alpha, x, y))
    x, y = inputs()
    want = y + 2.0 * x
    with pytest.warns(UserWarning, match=r"jitk_test::axpy_checked") as caught:
        with jitk.reference_mode("axpy_checked"):
            axpy_checked(2.0, x, y)
            axpy_checked.op(0.0, x, y)
    assert ran == [2.0, 0.0] and len([w for w in caught if "reference mode" in
                                      str(w.message)]) == 1
    torch.testing.assert_close(y, want)
    axpy_checked(0.0, x, y)  # after the block: the kernel again
    assert ran == [2.0, 0.0]
    with pytest.raises(KeyError, match="nope names no registered jitk op with a reference"):
        with jitk.reference_mode(["nope"]):
            pass


def test_reference_mode_refuses_an_op_without_a_reference_at_once():
    with pytest.raises(jitk.JitkError, match=r"reference_mode\('axpy'\): axpy names no "
                       r"registered jitk op with a reference \(ops with one: .*"
                       r"jitk_test::axpy_checked"):
        jitk.reference_mode("axpy").__enter__()


def _copy_reference(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


@jitk.op("jitk_test::copy_checked", mutates_args=("out",), reference=_copy_reference)
def copy_checked(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


def test_overlapping_reference_blocks_in_threads_restore_their_own_selection():
    # A opens, B opens, A closes: B's selection still holds; B closes: the kernels again.
    import threading
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def block_a():
        with jitk.reference_mode("copy_checked"):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def block_b():
        a_in.wait(10)
        with jitk.reference_mode("axpy_checked"):
            b_in.set()
            a_out.wait(10)
            seen.append(axpy_checked.info.uses_reference())
            seen.append(not copy_checked.info.uses_reference())
            seen.append(axpy_checked.__globals__["_jitk_fn"] is not axpy_checked.info.fn)

    threads = [threading.Thread(target=block_a), threading.Thread(target=block_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == [True, True, True]
    assert not axpy_checked.info.uses_reference() and not copy_checked.info.uses_reference()
    assert axpy_checked.__globals__["_jitk_fn"] is axpy_checked.info.fn


@pytest.mark.parametrize("names", ["rmsnrom", "axpy"])
def test_reference_env_naming_no_op_with_a_reference_fails_the_first_call(names):
    import subprocess
    import sys
    script = ("import torch, jitk, jitk.kernels.norm\n"
              "x, wt = torch.randn(3, 8), torch.randn(8)\n"
              "try:\n"
              "    jitk.rmsnorm(x, wt, out=torch.empty_like(x))\n"
              "except jitk.SettingError as e:\n"
              "    print('refused:', e)\n")
    env = {**__import__("os").environ, "JITK_REFERENCE": names}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"refused: jitk: JITK_REFERENCE={names}: {names} names no registered jitk op with " \
        "a reference" in result.stdout and "jitk::rmsnorm" in result.stdout


def test_reference_env_selects_ops_in_a_fresh_process():
    import subprocess
    import sys
    script = ("import warnings, torch, jitk, jitk.kernels.norm\n"
              "with warnings.catch_warnings(record=True) as w:\n"
              "    warnings.simplefilter('always')\n"
              "    x, wt = torch.randn(3, 8), torch.randn(8)\n"
              "    jitk.rmsnorm(x, wt, out=torch.empty_like(x))\n"
              "print([str(m.message) for m in w])\n")
    env = {**__import__("os").environ, "JITK_REFERENCE": "rmsnorm"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "jitk::rmsnorm" in result.stdout and "fused_add_rmsnorm" not in result.stdout


@jitk.op("jitk_test::doubled_detached", mutates_args=())
def doubled_detached(x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """2 * x computed as a kernel does: invisible to autograd."""
    return x.detach() * 2


def test_a_call_that_needs_a_gradient_does_what_the_operator_does():
    import warnings
    outcomes = {}
    for path, call in (("eager", doubled_detached), ("operator", doubled_detached.op)):
        for where in ("x", "extra"):
            x = torch.ones(3, requires_grad=where == "x")
            extra = torch.ones(3, requires_grad=True) if where == "extra" else None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = call(x, extra)
                grad = None
                if x.requires_grad:
                    (result * x).sum().backward()
                    grad = x.grad.tolist()
            outcomes[path, where] = (result.requires_grad, grad,
                                     sorted({str(w.message) for w in caught}))
    for where in ("x", "extra"):
        assert outcomes["eager", where] == outcomes["operator", where]
    assert any("autograd kernel was not registered" in text
               for text in outcomes["operator", "x"][2])
    with torch.no_grad():  # the fast path: not through the operator, nothing attached
        assert not doubled_detached(torch.ones(3, requires_grad=True)).requires_grad
