"""What jitk.fib's modules share: flashinfer-bench imported on first use, with the install
line where it is missing."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

from jitk.base.errors import JitkError
from jitk.build.jit import INCLUDE_DIR

__all__ = ["AUTHOR", "CHECK_WHOLE", "COPY_INTO", "FibUnavailableError", "require_fib",
           "shipped_files", "write_model"]

AUTHOR = "jitk"

# C++ for a Solution's main.cu: the rule for the tensors FlashInfer-Bench passes (whole,
# contiguous, of one shape and dtype), which every helper below checks first.
CHECK_WHOLE = """
void check_whole(const jitk::TensorView& out, const jitk::TensorView& in) {
  jitk::RuntimeCheck(out.numel() == in.numel() && out.dtype() == in.dtype() &&
                         out.stride(-1) == 1 && in.stride(-1) == 1 &&
                         out.stride(0) * out.size(0) == out.numel() &&
                         in.stride(0) * in.size(0) == in.numel(),
                     "jitk Solution: the tensors must be contiguous and of one shape and dtype");
}
"""

# Copies a whole tensor into another on the current stream, as a destination-passing Solution
# does where jitk's kernel works in place.
COPY_INTO = CHECK_WHOLE + """
size_t bytes_of(const jitk::TensorView& t) {
  return static_cast<size_t>(t.numel()) * (t.dtype().bits / 8);
}

void copy_into(const jitk::TensorView& out, const jitk::TensorView& in) {
  check_whole(out, in);
  jitk::RuntimeDeviceCheck(cudaMemcpyAsync(
      static_cast<char*>(out.data_ptr()) + out.byte_offset(),
      static_cast<const char*>(in.data_ptr()) + in.byte_offset(), bytes_of(in),
      cudaMemcpyDeviceToDevice, jitk::current_stream(in.device())));
}
"""


class FibUnavailableError(JitkError, ImportError):
    """flashinfer-bench is not installed."""


def require_fib() -> types.ModuleType:
    try:
        import flashinfer_bench
    except ImportError as error:
        raise FibUnavailableError(f"jitk.fib needs flashinfer-bench ({error}): pip install "
                                  "'jitk[fib]'") from None
    return flashinfer_bench


def write_model(out_dir: Path, kind: str, model: object) -> Path:
    """OUT_DIR/<kind>/<op_type>/<name>.json, the folder a TraceSet reads ("definitions",
    "solutions"); a Solution's op_type is its Definition's, passed as the model's `op_type`
    attribute or looked up from the Definition written beside it."""
    op_type = getattr(model, "op_type", None) or _op_type_of(out_dir, model.definition)
    path = out_dir / kind / op_type / f"{model.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model.model_dump(mode="json"), indent=2) + "\n")
    return path


def _op_type_of(out_dir: Path, definition: str) -> str:
    for path in (out_dir / "definitions").glob(f"*/{definition}.json"):
        return path.parent.name
    raise FileNotFoundError(f"write the Definition {definition} before its Solutions")


def shipped_files(files: dict[str, str], kernel_dir: Path | None = None
                  ) -> list[dict[str, str]]:
    """A Solution's sources: `files` (path -> text), the files of `kernel_dir` they include
    by quoted name (`#include "rmsnorm.cuh"`), beside them, and every jitk header they include,
    transitively, under jitk/, which the Solution's folder on the include path resolves."""
    files, headers = dict(files), {}
    pending = list(files.values())
    while pending:
        text = pending.pop()
        for name in re.findall(r'#include "([\w.]+)"', text) if kernel_dir else ():
            if name not in files:
                files[name] = (kernel_dir / name).read_text()
                pending.append(files[name])
        for name in re.findall(r"#include <(jitk/[\w./]+)>", text):
            if name not in headers:
                headers[name] = (INCLUDE_DIR / name).read_text()
                pending.append(headers[name])
    return [{"path": path, "content": text}
            for path, text in [*files.items(), *sorted(headers.items())]]
