"""RMSNorm's batch invariance and accuracy, checked on the GPU: `python -m jitk check
--invariance` and tests/test_rmsnorm_invariance.py (docs/developer_guide/
verifying_and_tuning.md, "Batch invariance").

For each width and dtype, the first ALONE rows of a BATCH-row input are normalised one call a
row by the default's kernels: the bits every other way of normalising them must give. Then
each choice the tuner may pick (tuning_choices; a sample of them unless `full`) and the
public entry points (whatever the tuning file or the shipped table chose for each bucket)
normalise the first n rows, for each n in ROWS: out of place, in place, fused, and fused
with float_sum. A row that differs from its alone bits is a finding; so is a fused output
that differs from the plain rmsnorm of its residual, a float_sum output that differs from
rmsnorm of its input where the residual is zero (the same sum), a residual that is not input
+ residual rounded, and a 16-bit output more than one ulp from a float64 reference of its
formula.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

import torch

from jitk.build import toolchain
from jitk.kernels.norm import fused_add_rmsnorm, rmsnorm, tuning_choices
from jitk.runtime.op import find_op
from jitk.tools import autotune

WIDTHS = (128, 1000, 2048, 4095, 4096, 5120, 7168, 8192, 16384)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROWS = (1, 3, 16, 77, 256, 1024, 4096)
BATCH, ALONE = max(ROWS), 77
SAMPLE = 3  # choices besides the default a width and dtype, unless full
EPS = 1e-6
_MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


@dataclasses.dataclass
class Finding:
    """Rows (of `rows`) whose bits or accuracy are wrong for one way of normalising them."""

    case: str
    differing: int
    rows: int
    detail: str = ""

    def line(self) -> str:
        return f"{self.case}: {self.differing} of {self.rows} rows {self.detail}".rstrip()


def _sampled(choices: list, full: bool) -> list:
    """The default, then every choice (full) or SAMPLE spread over the rest."""
    rest = choices[1:]
    if full or len(rest) <= SAMPLE:
        return choices
    return [choices[0], *(rest[i * len(rest) // SAMPLE] for i in range(SAMPLE))]


def _ulps(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|out - exact| in ulps of the dtype at the exact value (subnormals: the smallest)."""
    info = torch.finfo(out.dtype)
    exponent = torch.floor(torch.log2(exact.abs().clamp_min(info.tiny)))
    return (out.double() - exact).abs() / torch.exp2(exponent - _MANTISSA_BITS[out.dtype])


def _exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS) * weight.double()


def _ways(kernels: Callable | None) -> dict[str, Callable]:
    """name -> f(x, residual, weight) returning (output, residual after or None): a choice's
    kernels, or the public entry points where `kernels` is None."""
    def plain(x, r, w):
        out = torch.empty_like(x)
        (kernels().rmsnorm if kernels else rmsnorm)(x, w, out, EPS)
        return out, None

    def in_place(x, r, w):
        x = x.clone()
        if kernels:
            kernels().rmsnorm(x, w, x, EPS)
        else:
            rmsnorm(x, w, eps=EPS)
        return x, None

    def fused(x, r, w):
        x, r = x.clone(), r.clone()
        (kernels().fused_add_rmsnorm if kernels else fused_add_rmsnorm)(x, r, w, EPS)
        return x, r

    def float_sum(x, r, w):
        x, r = x.clone(), r.clone()
        if kernels:
            kernels().fused_add_rmsnorm_float_sum()(x, r, w, EPS)
        else:
            fused_add_rmsnorm(x, r, w, EPS, float_sum=True)
        return x, r

    return {"rmsnorm": plain, "rmsnorm in place": in_place, "fused_add_rmsnorm": fused,
            "fused_add_rmsnorm float_sum": float_sum}


# Which alone bits each way is held to.
_FORMS = {"rmsnorm": "plain", "rmsnorm in place": "plain", "fused_add_rmsnorm": "fused",
          "fused_add_rmsnorm float_sum": "float sum"}


def check_width(hidden: int, dtype: torch.dtype, full: bool = False) -> Iterator[Finding]:
    """The findings at one width and dtype (none expected)."""
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(BATCH, hidden, device="cuda", generator=g).to(dtype)
    residual = torch.randn(BATCH, hidden, device="cuda", generator=g).to(dtype)
    weight = torch.randn(hidden, device="cuda", generator=g).to(dtype)
    summed = (x.float() + residual.float()).to(dtype)  # the fused form's residual, rounded
    choices = _sampled(tuning_choices(hidden, dtype), full)
    default = _ways(choices[0][1])
    ways = {"plain": default["rmsnorm"], "fused": default["fused_add_rmsnorm"],
            "float sum": default["fused_add_rmsnorm float_sum"]}
    batch = {form: run(x, residual, weight)[0] for form, run in ways.items()}
    # The bits of each row alone: plain rows of x, and (fused) of x + residual.
    alone = {form: torch.cat([run(x[i:i + 1], residual[i:i + 1], weight)[0]
                              for i in range(ALONE)]) for form, run in ways.items()}
    # What every way must give: each row's alone bits, the default's batch past them (the
    # default's own batch is one of the ways, so its first rows are held to the alone bits).
    expected = {form: torch.cat([alone[form], batch[form][ALONE:]]) for form in alone}
    name = f"{str(dtype).removeprefix('torch.')} {hidden}"
    same_as_plain = torch.equal(alone["fused"], default["rmsnorm"](summed[:ALONE], None,
                                                                   weight)[0])
    if not same_as_plain:
        yield Finding(f"{name} fused vs rmsnorm of its residual", ALONE, ALONE, "differ")
    zero_sum = ways["float sum"](x[:ALONE], torch.zeros_like(x[:ALONE]), weight)[0]
    if not torch.equal(zero_sum, alone["plain"]):
        yield Finding(f"{name} float_sum with a zero residual vs rmsnorm", ALONE, ALONE,
                      "differ")
    for label, kernels in [*((_changes(knobs, choices[0][0]), build) for knobs, build in choices),
                           ("public entry points", None)]:
        for way, run in _ways(kernels).items():
            wanted = expected[_FORMS[way]]
            for n in ROWS:
                out, residual_after = run(x[:n], residual[:n], weight)
                differing = int((out != wanted[:n]).any(-1).sum())
                if residual_after is not None:
                    differing += int((residual_after != summed[:n]).any(-1).sum())
                if differing:
                    yield Finding(f"{name} {label} {way} n={n}", differing, n,
                                  "differ from the same rows alone or in the default's batch")
    # float_sum's formula normalises the unrounded sum, exact in float64.
    sources = {"plain": x, "fused": summed, "float sum": x.double() + residual.double()}
    yield from _accuracy(name, alone, {form: rows[:ALONE] for form, rows in sources.items()},
                         weight)


def _accuracy(name: str, alone: dict, sources: dict,
              weight: torch.Tensor) -> Iterator[Finding]:
    """16-bit outputs within one ulp of float64; float32's largest distance as a note."""
    for form, source in sources.items():
        ulps = _ulps(alone[form], _exact(source, weight))
        worst = float(ulps.max())
        if alone[form].dtype == torch.float32:
            yield Finding(f"{name} {form} accuracy (note)", 0, len(source),
                          f"max {worst:.2f} ulps")
        elif worst > 1:
            yield Finding(f"{name} {form} accuracy", int((ulps > 1).any(-1).sum()), len(source),
                          f"beyond 1 ulp of float64 (max {worst:.2f})")


def _changes(knobs: dict, default: dict) -> str:
    changed = [f"{k}={v}" for k, v in knobs.items() if default[k] != v]
    return " ".join(changed) or "default"


def check(full: bool = False, widths: tuple = WIDTHS,
          dtypes: tuple = DTYPES) -> list[Finding]:
    """Every finding over the widths and dtypes; notes have `differing` 0."""
    if not torch.cuda.is_available():
        raise RuntimeError("the invariance check runs kernels on a GPU, and none is visible")
    space = find_op("jitk::rmsnorm").tuning  # a job a module, of those the check loads
    jobs = {space.job_key((hidden, dtype, 1), knobs): ("jitk::rmsnorm", (hidden, dtype, 1), knobs)
            for dtype in dtypes for hidden in widths
            for knobs, _ in _sampled(tuning_choices(hidden, dtype), full)}
    major, minor = toolchain.current_gpu_capability()
    autotune.prebuild(list(jobs.values()), f"{major}.{minor}", os.cpu_count() or 1)
    return [f for dtype in dtypes for hidden in widths for f in check_width(hidden, dtype, full)]
