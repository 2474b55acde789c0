"""Every shipped entry point is a PyTorch operator, torch.ops.jitk.*.

CPU part: torch.compile(fullgraph=True) and make_fx over fake CUDA tensors trace each entry
point into a graph that calls its operator, without running (or loading) any kernel; the
written arguments are declared. GPU part (marked): opcheck on real tensors, capture of each
operator in a CUDA graph, and a compiled decoder block (reduce-overhead) equal to eager."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import jitk
import jitk.kernels.hicache
import jitk.kernels.norm
import jitk.kernels.wait_value

HIDDEN = 256
ROW = 128  # elements per KV row: 256 bytes in bfloat16
LATENT = 576  # DeepSeek's MLA latent row
LAYERS = 3
SHIPPED = ["rmsnorm", "fused_add_rmsnorm", "transfer_hicache_one_layer",
           "transfer_hicache_one_layer_mla", "transfer_hicache_all_layer",
           "transfer_hicache_all_layer_mla", "transfer_hicache_all_layer_staged_lf_pf",
           "transfer_hicache_all_layer_mla_staged_lf_pf", "stream_wait_value",
           "stream_write_value"]
# What each operator declares it writes. The all-layer transfers write through pointers and
# the wait reads its flag: they declare nothing and are kept as side effects instead.
WRITES = {"rmsnorm": {"out"}, "fused_add_rmsnorm": {"input", "residual"},
          "transfer_hicache_one_layer": {"k_cache_dst", "v_cache_dst"},
          "transfer_hicache_one_layer_mla": {"cache_dst"}, "transfer_hicache_all_layer": set(),
          "transfer_hicache_all_layer_mla": set(),
          "transfer_hicache_all_layer_staged_lf_pf": {"staging_k", "staging_v", "dst_k",
                                                      "dst_v"},
          "transfer_hicache_all_layer_mla_staged_lf_pf": {"staging", "dst"},
          "stream_wait_value": set(),
          "stream_write_value": {"flag"}}
# Operators whose arguments must be the caller's own memory inside a CUDA graph, which
# Inductor's graphs (mode="reduce-overhead") do not promise: a flag, a pinned host cache;
# and the staged write-back, which reads its host indices during the call.
OUTSIDE_INDUCTOR_GRAPHS = {"transfer_hicache_one_layer", "transfer_hicache_one_layer_mla",
                           "transfer_hicache_all_layer_staged_lf_pf",
                           "transfer_hicache_all_layer_mla_staged_lf_pf",
                           "stream_wait_value", "stream_write_value"}


def calls(tensor):
    """(operator name, public function, args, kwargs) for every shipped entry point, the
    arguments made by tensor(shape, dtype, where), where is "gpu" or "host"."""
    bf16, i64 = torch.bfloat16, torch.int64
    x, out, residual = (tensor((4, HIDDEN), bf16, "gpu") for _ in range(3))
    weight = tensor((HIDDEN,), bf16, "gpu")
    gpu_slots, host_slots = tensor((8,), i64, "gpu"), tensor((8,), i64, "gpu")
    k_gpu, v_gpu = (tensor((16, 2, ROW // 2), bf16, "gpu") for _ in range(2))
    k_host, v_host = (tensor((32, 2, ROW // 2), bf16, "host") for _ in range(2))
    latent_gpu, latent_host = tensor((16, LATENT), bf16, "gpu"), tensor((32, LATENT), bf16, "host")
    k_ptrs_host, v_ptrs_host, k_ptrs_gpu, v_ptrs_gpu = (tensor((LAYERS,), i64, "gpu")
                                                        for _ in range(4))
    staging_k, staging_v = (tensor((8, LAYERS, ROW), bf16, "gpu") for _ in range(2))
    pool_k, pool_v = (tensor((32, LAYERS, ROW), bf16, "host") for _ in range(2))
    staging_latent = tensor((8, LAYERS, LATENT), bf16, "gpu")
    pool_latent = tensor((32, LAYERS, LATENT), bf16, "host")
    host_pages = tensor((8,), i64, "host")
    flag = tensor((1,), torch.int32, "gpu")
    strides = {"kv_cache_src_stride_bytes": 2 * ROW, "kv_cache_dst_stride_bytes": 2 * ROW}
    latent_strides = {"cache_src_stride_bytes": 2 * LATENT,
                      "cache_dst_stride_bytes": 2 * LATENT}
    return [
        ("rmsnorm", jitk.rmsnorm, (x, weight, out, 1e-6), {}),
        ("fused_add_rmsnorm", jitk.fused_add_rmsnorm, (x, residual, weight, 1e-6), {}),
        ("transfer_hicache_one_layer", jitk.transfer_hicache_one_layer,
         (k_gpu, v_gpu, gpu_slots, k_host, v_host, host_slots), {}),
        ("transfer_hicache_one_layer_mla", jitk.transfer_hicache_one_layer_mla,
         (latent_gpu, gpu_slots, latent_host, host_slots), {}),
        ("transfer_hicache_all_layer", jitk.transfer_hicache_all_layer,
         (k_ptrs_host, v_ptrs_host, host_slots, k_ptrs_gpu, v_ptrs_gpu, gpu_slots), strides),
        ("transfer_hicache_all_layer_mla", jitk.transfer_hicache_all_layer_mla,
         (k_ptrs_host, host_slots, k_ptrs_gpu, gpu_slots), latent_strides),
        ("transfer_hicache_all_layer_staged_lf_pf", jitk.transfer_hicache_all_layer_staged_lf_pf,
         (k_ptrs_gpu, v_ptrs_gpu, gpu_slots, host_pages, staging_k, staging_v, pool_k, pool_v),
         {"page_size": 4}),
        ("transfer_hicache_all_layer_mla_staged_lf_pf",
         jitk.transfer_hicache_all_layer_mla_staged_lf_pf,
         (k_ptrs_gpu, gpu_slots, host_pages, staging_latent, pool_latent), {"page_size": 4}),
        ("stream_wait_value", jitk.stream_wait_value, (flag, 1), {}),
        ("stream_write_value", jitk.stream_write_value, (flag, 1), {}),
    ]


def fake_cuda_tensor(shape, dtype, where):
    return torch.empty(shape, dtype=dtype, device="cuda" if where == "gpu" else "cpu")


def cpu_tensor(shape, dtype, where):
    return torch.zeros(shape, dtype=dtype)


def jitk_calls(graph: torch.fx.GraphModule) -> list[str]:
    return [str(node.target) for node in graph.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("jitk.")]


def test_every_entry_point_is_an_operator_declaring_what_it_writes():
    assert [name for name, *_ in calls(cpu_tensor)] == SHIPPED
    for name in SHIPPED:
        operator = getattr(torch.ops.jitk, name).default
        schema = operator._schema
        written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
        assert written == WRITES[name], name
        assert not schema.returns, f"{name} returns something: an operator may not alias"
        unsafe = torch.Tag.cudagraph_unsafe in operator.tags
        assert unsafe == (name in OUTSIDE_INDUCTOR_GRAPHS), name


# A fresh process that imports jitk only, with compiling off and an empty cache.
AFTER_IMPORT = textwrap.dedent("""\
    import sys, torch, jitk
    missing = [name for name in sys.argv[2:] if not hasattr(torch.ops.jitk, name)]
    program = torch.export.load(sys.argv[1])
    print("missing", missing, "calls", sorted(str(node.target) for node in program.graph.nodes
                                               if str(node.target).startswith("jitk.")))
""")


class Normed(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        jitk.rmsnorm(x, weight, out=out)
        return out * 2


def test_operators_exist_after_import_jitk_and_a_saved_export_loads(tmp_path):
    program = torch.export.export(Normed(), (torch.randn(4, HIDDEN), torch.randn(HIDDEN)))
    torch.export.save(program, tmp_path / "normed.pt2")
    cache_dir = tmp_path / "cache"
    env = {**os.environ, "JITK_DISABLE_JIT": "1", "JITK_CACHE_DIR": str(cache_dir)}
    result = subprocess.run([sys.executable, "-c", AFTER_IMPORT, tmp_path / "normed.pt2",
                             *SHIPPED], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "missing [] calls ['jitk.rmsnorm.default']"
    assert not cache_dir.exists()  # definitions only: nothing built or looked up


def test_make_fx_over_fake_cuda_tensors_traces_every_operator():
    # Had any kernel run (or any module loaded), fake CUDA tensors on a machine without a
    # GPU would have failed it.
    with FakeTensorMode():
        cases = calls(fake_cuda_tensor)
    for name, function, args, kwargs in cases:
        graph = make_fx(lambda *a, f=function, kw=kwargs: f(*a, **kw))(*args)
        assert jitk_calls(graph) == [f"jitk.{name}.default"], graph.code


def test_make_fx_traces_a_sequence_of_operators_in_order():
    with FakeTensorMode():
        cases = calls(fake_cuda_tensor)

    def everything(*flat):
        i = 0
        for _, function, args, kwargs in cases:
            function(*flat[i:i + len(args)], **kwargs)
            i += len(args)

    graph = make_fx(everything)(*(a for _, _, args, _ in cases for a in args))
    assert jitk_calls(graph) == [f"jitk.{name}.default" for name in SHIPPED]


def test_dynamo_traces_every_entry_point_in_one_graph():
    # Before the operators, fullgraph failed on the loader's `posix.stat`.
    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph)
        return lambda *args: ()  # traced, never run: these are CPU tensors

    for name, function, args, kwargs in calls(cpu_tensor):
        def call(*args, function=function, kwargs=kwargs) -> None:
            function(*args, **kwargs)  # the graph returns nothing, so capture's () fits

        torch._dynamo.reset()
        graphs.clear()
        torch.compile(call, fullgraph=True, backend=capture)(*args)
        assert [jitk_calls(g) for g in graphs] == [[f"jitk.{name}.default"]]
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------
# GPU: real tensors.

def rms_norm_reference(x, weight, eps=1e-6):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class Transfer:
    """A HiCache load (host -> GPU) or backup (GPU -> host) with its expected result: rows
    at `dst_slots` of each destination equal rows at `src_slots` of its source."""

    def __init__(self, sources, destinations, src_slots, dst_slots):
        self.sources, self.destinations = sources, destinations
        self.src_slots, self.dst_slots = src_slots, dst_slots

    def prepare(self):
        for source in self.sources:
            source.copy_(torch.randn(source.shape).to(source.dtype))
        for destination in self.destinations:
            destination.fill_(float("nan"))

    def check(self):
        torch.cuda.synchronize()
        for source, destination in zip(self.sources, self.destinations):
            got = destination.cpu()[self.dst_slots.cpu()]
            torch.testing.assert_close(got, source.cpu()[self.src_slots.cpu()], rtol=0, atol=0)


def gpu_cases():
    """(operator name, args, kwargs, prepare, check) on real tensors, for every operator but
    the flag ones (their GPU checks run in a subprocess: a wrong wait would hang)."""
    bf16 = torch.bfloat16
    cuda = {"device": "cuda"}
    x, residual, out = (torch.empty(4, HIDDEN, dtype=bf16, **cuda) for _ in range(3))
    weight = torch.randn(HIDDEN, **cuda).to(bf16)
    expected = {}

    def prepare_norm():
        x.copy_(torch.randn(4, HIDDEN))
        residual.copy_(torch.randn(4, HIDDEN))
        out.fill_(float("nan"))
        expected["out"] = rms_norm_reference(x, weight)
        expected["residual"] = (residual.float() + x.float()).to(bf16)
        expected["x"] = rms_norm_reference(expected["residual"], weight)

    def check_rmsnorm():
        torch.testing.assert_close(out, expected["out"], rtol=2e-2, atol=2e-2)

    def check_fused():
        torch.testing.assert_close(residual, expected["residual"], rtol=0, atol=0)
        torch.testing.assert_close(x, expected["x"], rtol=2e-2, atol=2e-2)

    host_slots = torch.randperm(32, **cuda)[:8]
    gpu_slots = torch.randperm(16, **cuda)[:8]
    host = lambda *shape: torch.empty(*shape, dtype=bf16, pin_memory=True)
    gpu = lambda *shape: torch.empty(*shape, dtype=bf16, **cuda)
    k_host, v_host, latent_host = host(32, ROW), host(32, ROW), host(32, LATENT)
    k_gpu, v_gpu, latent_gpu = gpu(16, ROW), gpu(16, ROW), gpu(16, LATENT)
    load = Transfer([k_host, v_host], [k_gpu, v_gpu], host_slots, gpu_slots)
    load_mla = Transfer([latent_host], [latent_gpu], host_slots, gpu_slots)
    # All layers at once, GPU -> host, through pointer tables.
    k_layers, v_layers = ([gpu(16, ROW) for _ in range(LAYERS)] for _ in range(2))
    k_backup, v_backup = ([host(32, ROW) for _ in range(LAYERS)] for _ in range(2))
    ptrs = lambda tensors: torch.tensor([t.data_ptr() for t in tensors], **cuda)
    backup = Transfer(k_layers + v_layers, k_backup + v_backup, gpu_slots, host_slots)
    backup_mla = Transfer(k_layers, k_backup, gpu_slots, host_slots)
    strides = {"kv_cache_src_stride_bytes": 2 * ROW, "kv_cache_dst_stride_bytes": 2 * ROW}
    return [
        ("rmsnorm", (x, weight, out, 1e-6), {}, prepare_norm, check_rmsnorm),
        ("fused_add_rmsnorm", (x, residual, weight, 1e-6), {}, prepare_norm, check_fused),
        ("transfer_hicache_one_layer", (k_gpu, v_gpu, gpu_slots, k_host, v_host, host_slots),
         {}, load.prepare, load.check),
        ("transfer_hicache_one_layer_mla", (latent_gpu, gpu_slots, latent_host, host_slots), {},
         load_mla.prepare, load_mla.check),
        ("transfer_hicache_all_layer", (ptrs(k_backup), ptrs(v_backup), host_slots,
                                        ptrs(k_layers), ptrs(v_layers), gpu_slots), strides,
         backup.prepare, backup.check),
        ("transfer_hicache_all_layer_mla", (ptrs(k_backup), host_slots, ptrs(k_layers),
                                            gpu_slots),
         {"cache_src_stride_bytes": 2 * ROW, "cache_dst_stride_bytes": 2 * ROW},
         backup_mla.prepare, backup_mla.check),
    ]


@pytest.mark.gpu
def test_every_operator_runs_and_replays_from_a_cuda_graph():
    for name, args, kwargs, prepare, check in gpu_cases():
        operator = getattr(torch.ops.jitk, name).default
        prepare()
        operator(*args, **kwargs)  # through the dispatcher, eagerly; also loads the module
        check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            operator(*args, **kwargs)
        for _ in range(2):
            prepare()
            graph.replay()
            check()


@pytest.mark.gpu
def test_opcheck_every_operator():
    for name, args, kwargs, prepare, _ in gpu_cases():
        if name.startswith("transfer_hicache_one_layer"):
            # opcheck copies its arguments, and a copy of pinned memory is pageable, which
            # a kernel may not touch: the sources move to the GPU here.
            args = tuple(a.cuda() if a.is_pinned() else a for a in args)
        prepare()
        torch.library.opcheck(getattr(torch.ops.jitk, name).default, args, kwargs)


FLAG_SCRIPT = textwrap.dedent("""\
    import time, torch
    import jitk.kernels.wait_value  # registers the operators
    wait = torch.ops.jitk.stream_wait_value.default
    write = torch.ops.jitk.stream_write_value.default
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.library.opcheck(write, (flag, 5))
    write(flag, 5)
    torch.cuda.synchronize()
    assert flag.item() == 5, flag
    torch.library.opcheck(wait, (flag, 5))  # holds the value already: every copy passes
    host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wait(host, 3)
        write(flag, 9)
    flag.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph.replay()
        done = torch.cuda.Event()
        done.record()
    time.sleep(0.2)
    assert not done.query(), "the replay ran past its wait"
    host[0] = 3
    deadline = time.monotonic() + 20
    while not done.query():
        assert time.monotonic() < deadline, "the replayed wait was never released"
    assert flag.item() == 9, flag
    print("flag operators ok")
""")


@pytest.mark.gpu
def test_flag_operators_opcheck_and_replay():
    # In a subprocess: a wait that is never released would hold the GPU until exit.
    result = subprocess.run([sys.executable, "-c", FLAG_SCRIPT], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and "flag operators ok" in result.stdout, result.stderr


def decoder_block(x, residual, w_in, w_proj, w_post, k_gpu, v_gpu, gpu_slots, k_host, v_host,
                  host_slots):
    """rmsnorm -> matmul -> fused add + rmsnorm, and the next layer's KV loaded from host."""
    h = jitk.rmsnorm(x, w_in, out=torch.empty_like(x))
    h = h @ w_proj
    jitk.fused_add_rmsnorm(h, residual, w_post)
    jitk.transfer_hicache_one_layer(k_gpu, v_gpu, gpu_slots, k_host, v_host, host_slots)
    return h


def decoder_inputs(tokens=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(bf16)
    host = lambda t: t.pin_memory()
    return [rand(tokens, HIDDEN).cuda(), rand(tokens, HIDDEN).cuda(), rand(HIDDEN).cuda(),
            (rand(HIDDEN, HIDDEN) / 16).cuda(), rand(HIDDEN).cuda(),
            torch.full((64, ROW), float("nan"), dtype=bf16, device="cuda"),
            torch.full((64, ROW), float("nan"), dtype=bf16, device="cuda"),
            torch.randperm(64, generator=generator)[:tokens].cuda(),
            host(rand(256, ROW)), host(rand(256, ROW)),
            torch.randperm(256, generator=generator)[:tokens].cuda()]


def clone_inputs(inputs):
    return [t.clone().pin_memory() if not t.is_cuda else t.clone() for t in inputs]


@pytest.mark.gpu
def test_compiled_decoder_block_equals_eager():
    torch._dynamo.reset()
    compiled = torch.compile(decoder_block, fullgraph=True, mode="reduce-overhead")
    with torch.inference_mode():
        for step in range(4):  # warm-up, recording, replays
            inputs = decoder_inputs(seed=step)
            eager_inputs, compiled_inputs = clone_inputs(inputs), clone_inputs(inputs)
            expected = decoder_block(*eager_inputs)
            got = compiled(*compiled_inputs).clone()
            torch.cuda.synchronize()
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
            for i in (1, 5, 6):  # residual and the loaded K and V caches
                torch.testing.assert_close(compiled_inputs[i], eager_inputs[i], rtol=1e-2,
                                           atol=1e-2, equal_nan=True)
    torch._dynamo.reset()


@pytest.mark.parametrize("name, change, error, message", [
    ("weight", lambda t: t.new_empty(63), jitk.ArgumentError, r"'weight' must have shape \(64,\)"),
    ("weight", lambda t: t.float(), jitk.ArgumentTypeError, "'weight' must have input's dtype"),
    ("out", lambda t: t.new_empty(3, 64), jitk.ArgumentError, r"'out' must have shape \(4, 64\)"),
    ("residual", lambda t: t.float(), jitk.ArgumentTypeError, "'residual' must have input's"),
])
def test_norm_fakes_refuse_what_the_kernel_refuses(name, change, error, message):
    with FakeTensorMode():
        x = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
        tensors = {"weight": torch.empty(64, dtype=torch.bfloat16, device="cuda"),
                   "out": torch.empty_like(x), "residual": torch.empty_like(x)}
        tensors[name] = change(tensors[name])
        with pytest.raises(error, match=message):
            if name == "residual":
                jitk.fused_add_rmsnorm(x, tensors["residual"], tensors["weight"])
            else:
                jitk.rmsnorm(x, tensors["weight"], out=tensors["out"])
