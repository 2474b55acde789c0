"""What jitk.fib's modules share: flashinfer-bench imported on first use, with the install
line where it is missing."""

from __future__ import annotations

import json
import types
from pathlib import Path

from jitk.base.errors import JitkError

__all__ = ["AUTHOR", "FibUnavailableError", "require_fib", "write_model"]

AUTHOR = "jitk"


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
