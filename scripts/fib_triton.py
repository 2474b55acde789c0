"""A Triton Solution of each dataset-shaped RMSNorm Definition (rmsnorm_h<N>,
fused_add_rmsnorm_h<N>), the peer scripts/fib_gpu.py benchmarks jitk's Solutions beside.

A plain kernel, one row a program: the row (plus the residual, for the fused op) loaded whole
into float32, the sum of squares, the row scaled by rsqrt(mean + eps) and the weight, one
rounding to the dtype. Value-returning, as fib_gpu.py's torch Solution is; eps and the hidden
size are the Definition's, fixed in the source as constants."""

from jitk.integrations import fib_norm

ENTRY_POINT = "main.py::run"

TRITON_SOURCE = '''\
import torch
import triton
import triton.language as tl

HIDDEN = {hidden}
EPS = {eps!r}
BLOCK = triton.next_power_of_2(HIDDEN)
# A row's elements spread over the warps so that each thread holds a few vectors of it.
NUM_WARPS = min(max(BLOCK // 512, 1), 16)


@triton.jit
def rmsnorm_row(x_ptr, x_stride, r_ptr, r_stride, w_ptr, out_ptr, out_stride, eps,
                hidden: tl.constexpr, block: tl.constexpr, add_residual: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, block)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if add_residual:
        x += tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_rms * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def run({params}):
{no_residual}    output = torch.empty_like(hidden_states)
    if hidden_states.shape[0] == 0:
        return output
    # The kernel walks a row by unit steps; rows may lie at any stride.
    for name, tensor in (("hidden_states", hidden_states), ("residual", residual),
                         ("weight", weight)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{{name}}: the last dimension's stride must be 1, got "
                             f"{{tensor.stride(-1)}}")
    rmsnorm_row[(hidden_states.shape[0],)](
        hidden_states, hidden_states.stride(0), residual, residual.stride(0), weight,
        output, output.stride(0), EPS, hidden=HIDDEN, block=BLOCK,
        add_residual={fused}, num_warps=NUM_WARPS)
    return output
'''

# rmsnorm's run() has no residual: the kernel is handed hidden_states' pointer, never read.
NO_RESIDUAL = "    residual = hidden_states  # unread: add_residual is False\n"


def triton_source(definition: object) -> str:
    """The Solution's main.py for a dataset-shaped RMSNorm Definition (checked by
    fib_norm.signature: names, dtypes, hidden size, eps)."""
    op, hidden, _, eps = fib_norm.signature(definition)
    fused = op == "fused_add_rmsnorm"
    return TRITON_SOURCE.format(hidden=hidden, eps=eps, params=", ".join(definition.inputs),
                                no_residual="" if fused else NO_RESIDUAL, fused=fused)


def triton_solution(definition: object) -> object:
    """A value-returning Triton Solution of `definition`, named <definition>_triton."""
    from flashinfer_bench.data import Solution

    return Solution(
        name=f"{definition.name}_triton", definition=definition.name, author="fib_triton.py",
        spec={"language": "triton", "target_hardware": ["cuda"], "entry_point": ENTRY_POINT,
              "destination_passing_style": False},
        sources=[{"path": "main.py", "content": triton_source(definition)}],
        description="Triton, one row a program, float32 inside")
