"""PYTHONPATH for a test's child process: jitk from this checkout, ahead of whatever the
caller's path adds (apache-tvm-ffi from a folder of its own on the GPU machine, say)."""

import os
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parent.parent / "python"
PYTHON_PATH = os.pathsep.join(filter(None, [str(PYTHON_DIR), os.environ.get("PYTHONPATH")]))
