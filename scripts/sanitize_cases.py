"""One small case of every shipped kernel, for compute-sanitizer (memcheck):
    compute-sanitizer --tool memcheck python scripts/sanitize_cases.py
Each case checks its result too, so a case that runs but computes garbage also fails."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import probes  # noqa: E402

from jitk.kernels import hicache, norm, wait_value  # noqa: E402


def case(name):
    def register(fn):
        fn()
        torch.cuda.synchronize()
        print(f"ran {name}", flush=True)
        return fn
    return register


@case("launch_probe add_one")
def _():
    x = torch.randn(1000, device="cuda")
    y = torch.full_like(x, float("nan"))
    probes.launch_probe().add_one(x, y)
    assert torch.equal(y, x + 1)


@case("rmsnorm bf16 3x4096, fp32 5x100 strided, fused add")
def _():
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    norm.rmsnorm(x, w, out=out)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.float()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    wide = torch.randn(5, 130, device="cuda")[:, :100]
    w100 = torch.randn(100, device="cuda")
    norm.rmsnorm(wide, w100)
    residual = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    norm.fused_add_rmsnorm(x, residual, w)


@case("rmsnorm q/k heads of a fused qkv buffer (bf16 7x[4+2+2]x128), fused add, 40000 wide")
def _():
    qkv = torch.randn(7, 8 * 128, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :512].view(7, 4, 128), qkv[:, 512:768].view(7, 2, 128)
    w = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    expected = norm.rmsnorm(q.contiguous(), w)
    norm.rmsnorm(q, w)
    assert torch.equal(q, expected)
    norm.fused_add_rmsnorm(k, torch.randn(7, 2, 128, device="cuda", dtype=torch.bfloat16), w)
    wide = torch.randn(3, 40000, device="cuda", dtype=torch.bfloat16)
    norm.fused_add_rmsnorm(wide, torch.randn_like(wide), torch.randn_like(wide[0]))


@case("hicache one layer d2h/h2d/d2d, mla, all layer")
def _():
    tokens, dim = 64, 512
    gpu = [torch.randn(256, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    host = [torch.randn(256, dim, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
    idx_gpu = torch.randperm(256, device="cuda")[:tokens]
    idx_host = torch.randperm(256, device="cuda")[:tokens]
    hicache.transfer_hicache_one_layer(host[0], host[1], idx_host, gpu[0], gpu[1], idx_gpu)
    torch.cuda.synchronize()
    assert torch.equal(host[0][idx_host.cpu()], gpu[0][idx_gpu].cpu())
    hicache.transfer_hicache_one_layer(gpu[0], gpu[1], idx_gpu, host[0], host[1], idx_host)
    dst = torch.randn(300, dim, device="cuda", dtype=torch.bfloat16)
    hicache.transfer_hicache_one_layer_mla(dst, idx_gpu.int(), gpu[0], idx_gpu.int())
    assert torch.equal(dst[idx_gpu], gpu[0][idx_gpu])
    layers_src = [torch.randn(256, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    layers_dst = [torch.randn(256, dim, dtype=torch.bfloat16).pin_memory() for _ in range(3)]

    def table(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device="cuda")
    stride = dim * 2
    hicache.transfer_hicache_all_layer_mla(table(layers_dst), idx_host, table(layers_src), idx_gpu,
                                           cache_src_stride_bytes=stride,
                                           cache_dst_stride_bytes=stride)
    torch.cuda.synchronize()
    for src, dst in zip(layers_src, layers_dst):
        assert torch.equal(dst[idx_host.cpu()], src[idx_gpu].cpu())


@case("hicache pages of 16 into a page_first_direct host layout, kernel and copy engines")
def _():
    page, pages, layers, dim = 16, 8, 3, 256
    host = torch.zeros(pages, layers, page, dim, dtype=torch.float16).pin_memory()
    gpu = torch.randn(pages * page, dim, device="cuda", dtype=torch.float16)
    firsts = torch.randperm(pages)[:4] * page
    idx_host = (firsts[:, None] + torch.arange(page)).flatten()
    idx_gpu = (torch.randperm(pages)[:4, None] * page + torch.arange(page)).flatten()
    for layer, method in ((0, "kernel"), (2, "copy_engine")):
        on = "cuda" if method == "kernel" else "cpu"
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            hicache.transfer_hicache_one_layer_mla(
                host[:, layer], idx_host.to(on), gpu, idx_gpu.to(on), element_dim=dim,
                page_size=page, method=method)
        side.synchronize()
        got = host[:, layer].reshape(-1, dim)[idx_host]
        assert torch.equal(got, gpu[idx_gpu.cuda()].cpu()), method
    assert not host[:, 1].any()  # the layer between was not touched


@case("wait_value write then wait: int32/int64, cuda/pinned, memory ops and spin kernels")
def _():
    for spin in (False, True):
        wait_value._force_spin = spin  # the fallback's kernels are what memcheck can check
        for dtype in (torch.int32, torch.int64):
            for event in (wait_value.Event(dtype=dtype), wait_value.Event(host=True, dtype=dtype)):
                event.record(7)
                event.wait(7)
                event.wait(5, op="geq")
                torch.cuda.synchronize()
                assert event.flag.item() == 7
    wait_value._force_spin = False
