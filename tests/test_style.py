"""The form of the code is the formatters' to keep: clang-format (.clang-format) for C++ and
CUDA, ruff (pyproject.toml) for Python. Both are test dependencies, pinned, so every machine
formats alike."""

import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tool(name: str) -> str:
    """The pinned formatter from the test dependencies; CI always has it, a GPU machine that
    runs the tests without them skips."""
    path = Path(sysconfig.get_path("scripts")) / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: pip install -e '.[test]'")
    return str(path)


def tracked(*patterns: str) -> list[str]:
    """The files git tracks; an exported tree (git archive, a source tarball) has no list, and
    the check is then the repository's, not the tarball's."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("git is not installed, so the tracked files are unknown")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not a git checkout (an exported tree), so the tracked files "
                    "are unknown")
    # experiments/ are one-off studies outside the product (experiments/README.md).
    listed = subprocess.run(["git", "ls-files", *patterns, ":!:experiments/"], cwd=ROOT,
                            capture_output=True, text=True, check=True, timeout=60)
    return listed.stdout.split()


def test_cpp_is_clang_formatted():
    files = tracked("*.h", "*.cuh", "*.cu", "*.cpp")
    assert files
    result = subprocess.run([tool("clang-format"), "--dry-run", "-Werror", *files], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, "run clang-format -i on:\n" + result.stderr[-3000:]


def test_python_is_ruff_clean():
    result = subprocess.run([tool("ruff"), "check", "--no-cache", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
