"""The form of the code is the formatters' to keep: clang-format (.clang-format) for C++ and
CUDA, ruff (pyproject.toml) for Python. Both are test dependencies, pinned, so every machine
formats alike. And the code holds no measured figure: those live in the docs' dated entries."""

import re
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


# A measured figure: a time or a bandwidth after a number, or a ratio to a peer or a copy.
# Settings are code (`_SPIN_NS = 20_000`), which this does not read as a figure.
FIGURE = re.compile(r"\d(?:[\d.,]*\d)?\s*(?:µs|us|ms|ns)\b|\d\s*[GT]B/s"
                    r"|\d\.\d+\s+of\s+(?:SGLang|the copy|a copy)"
                    r"|\d+(?:\.\d+)?\s*[x×]\s+(?:slower|faster)"
                    r"|\d+(?:\.\d+)?%\s+(?:slower|faster|ahead|behind|of the)", re.IGNORECASE)


def test_no_measured_figure_in_the_package():
    """Code says why; how fast lives in the docs' dated measured entries
    (debugging_and_performance.md, verifying_and_tuning.md), where a figure keeps its date,
    device and harness."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted((ROOT / "python" / "jitk").rglob("*"))
             if path.suffix in {".py", ".cuh", ".h", ".cu", ".cpp"}
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if FIGURE.search(line)]
    assert not found, "measured figures in code; move them to the docs:\n" + "\n".join(found)


def test_the_figure_pattern_sees_figures():
    quoted = ["1.8 us a copy", "5.9-6.0 µs", "55 GB/s", "0.982 of SGLang", "2.7x slower",
              "3-7% slower", "in steps of 32 ns"]
    assert all(FIGURE.search(text) for text in quoted)
    assert not any(FIGURE.search(text) for text in ["timeout=60", "_SPIN_NS = 20_000",
                                                    "sm_90", "x 1 KiB rows", "bf16 8192^3"])
