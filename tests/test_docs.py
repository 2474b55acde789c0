"""The README and the developer guide cannot drift from the code: every link, path, Python
name, C++ name, command, setting and quoted source line they mention is checked here."""

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "jitk"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Files the guide invents to show a message's form; no such file exists anywhere.
ILLUSTRATIVE_FILES = {"my.cuh", "file.cuh", "my_kernel.cuh"}
# Where a quoted `name.cuh:line` may live.
KERNEL_DIRS = sorted(p.parent for p in (PACKAGE / "kernels").glob("*/*.cuh"))
SOURCE_DIRS = [PACKAGE / "include" / "jitk", *KERNEL_DIRS, ROOT / "tests" / "csrc",
               ROOT / "docs" / "developer_guide" / "example"]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def code_spans(page: Path) -> list[str]:
    """Inline `code` spans, outside fenced blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        assert linked.exists(), f"{page_id(page)} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            assert anchor in {slug(h) for h in headings}, \
                f"{page_id(page)} links to #{anchor}, a heading {linked.name} does not have"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_repository_paths_exist(page):
    for span in code_spans(page):
        for path in re.findall(r"(?:^|\s)((?:tests|benchmarks|experiments|scripts|python|docs"
                               r"|\.ci)/[\w./-]+)", span):
            assert (ROOT / path).exists(), f"{page_id(page)} names {path}, which does not exist"
        for header in re.findall(r"<?(jitk/[\w.]+\.(?:h|cuh))>?", span):
            assert (PACKAGE / "include" / header).exists(), \
                f"{page_id(page)} names {header}, which is not a jitk header"


def resolve_python_name(dotted: str) -> None:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return
    raise ImportError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_names_exist(page):
    for span in code_spans(page):
        for dotted in re.findall(r"(?<![\w/.])(jitk(?:\.\w+)+)", span):
            try:
                resolve_python_name(dotted)
            except (ImportError, AttributeError):
                pytest.fail(f"{page_id(page)} names {dotted}, which does not exist")


def cpp_identifiers() -> set[str]:
    words: set[str] = set()
    for directory in SOURCE_DIRS[:1 + len(KERNEL_DIRS)]:
        for source in filter(Path.is_file, directory.iterdir()):
            words.update(re.findall(r"\w+", source.read_text()))
    return words


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_cpp_names_exist(page):
    known = cpp_identifiers()
    for span in code_spans(page):
        for qualified in re.findall(r"jitk::[\w:]+", span):
            for name in qualified.split("::")[1:]:
                assert name in known, f"{page_id(page)} names {qualified}: no '{name}' in jitk"


def cli_subcommands() -> str:
    result = subprocess.run([sys.executable, "-m", "jitk", "--help"], capture_output=True,
                            text=True, timeout=60)
    return result.stdout


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_exist(page):
    helps = cli_subcommands()
    for span in code_spans(page):
        for sub in re.findall(r"python -m jitk (\w[\w-]*)", span):
            assert re.search(rf"\b{sub}\b", helps), \
                f"{page_id(page)} shows `python -m jitk {sub}`, which the CLI does not have"


def settings_read_by_the_package() -> set[str]:
    names = set()
    for source in PACKAGE.rglob("*.py"):
        names.update(re.findall(r"\"(JITK_[A-Z_]+)\"", source.read_text()))
    return names


def test_settings_documented_and_real():
    documented = set()
    for page in PAGES:
        documented.update(re.findall(r"\bJITK_[A-Z_]*[A-Z]\b", page.read_text()))
    macros = set()
    for header in (PACKAGE / "include" / "jitk").iterdir():
        macros.update(re.findall(r"#define (JITK_\w+)", header.read_text()))
    documented -= macros
    read = settings_read_by_the_package()
    assert read - documented == set(), "settings the package reads but no page documents"
    assert documented - read == set(), "settings the pages name but the package never reads"


# A quoted source position: the line a check stands on moves with every edit of its file, so a
# page may write `name.cuh:<line>`; a number is read as the same placeholder.
QUOTED_LINE = re.compile(r"([\w.]+\.(?:cuh|h)):(?:\d+|<line>)")


def without_line_numbers(text: str) -> str:
    return QUOTED_LINE.sub(r"\1:<line>", text)


def quoted_source(page: Path, file_name: str) -> str:
    found = [d / file_name for d in SOURCE_DIRS if (d / file_name).exists()]
    assert found, f"{page_id(page)} quotes {file_name}, but there is no {file_name}"
    return found[0].read_text()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_quoted_lines_hold_their_checks(page):
    """A quoted error names a real file, and that file holds the check the message comes from:
    a tensor check of the named tensor, or the literal text a RuntimeCheck or Panic starts its
    message with."""
    text = re.sub(r"\s+", " ", page.read_text())
    for file_name in set(QUOTED_LINE.findall(text)) - ILLUSTRATIVE_FILES:
        quoted_source(page, file_name)
    for tensor, file_name in re.findall(r"Tensor match failed for '([^']+)' .*? at "
                                        r"([\w.]+\.(?:cuh|h)):", text):
        if file_name in ILLUSTRATIVE_FILES:
            continue
        checks = [line for line in quoted_source(page, file_name).splitlines()
                  if f'"{tensor}"' in line and re.search(r"verify|check", line)]
        assert checks, f"{page_id(page)} quotes a failed match of '{tensor}' at {file_name}, " \
            f"which checks no tensor of that name"
    for kind, file_name, message in re.findall(r"(Runtime check failed|Panic) at "
                                               r"([\w.]+\.(?:cuh|h)):\S*?:? ([^`|]+)", text):
        if file_name in ILLUSTRATIVE_FILES:
            continue
        head = re.match(r"[^0-9'\"]*", message).group(0)  # the literal, before any value
        assert len(head) > 3 and f'"{head}' in quoted_source(page, file_name), \
            f"{page_id(page)} quotes '{kind} at {file_name}: {message.strip()}', but no " \
            f"message of {file_name} starts that way"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_parse(page):
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
        try:
            ast.parse(textwrap.dedent(block))
        except SyntaxError as error:
            pytest.fail(f"{page_id(page)} shows Python that does not parse: {error}\n{block}")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_quoted_errors_are_what_the_call_raises(page):
    """A page may mark an error it quotes with the call that raises it:
    <!-- error: CALL --> right above a fenced block holding `Kind: message`."""
    import torch

    import jitk

    for call, kind, message in re.findall(r"<!-- error: (.+?) -->\n```\n(\w+): (.+?)\n```",
                                          page.read_text()):
        with pytest.raises(Exception) as raised:
            eval(call, {"jitk": jitk, "torch": torch})
        assert type(raised.value).__name__ == kind
        assert without_line_numbers(str(raised.value)) == without_line_numbers(message), \
            f"{page_id(page)} quotes a stale error"


def test_readme_says_what_the_in_place_kernels_overwrite():
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| `jitk.rmsnorm("))
    assert "`rmsnorm` overwrites `x` unless `out` is given" in row
    assert "normalised sum into `x`" in row


def test_guide_names_the_torch_library_calls_jitk_op_makes():
    guide = (ROOT / "docs" / "developer_guide" / "adding_a_kernel.md").read_text()
    section = guide.split("## 3. A PyTorch operator", 1)[1].split("\n## ", 1)[0]
    code = (PACKAGE / "runtime" / "op.py").read_text()
    for call in ("define", "impl", "register_fake"):
        assert f"`{call}`" in section and f"{call}(" in code
    assert "custom_op`" not in section.split("What changes:")[0]
    assert "torch.library.custom_op(" not in code


# ------------------------------------------------------------------ call logging and FIB
GUIDE = ROOT / "docs" / "developer_guide"


def table_first_cells(page: Path, heading: str) -> list[str]:
    """The first column's `code` in the rows of the table under `## heading`."""
    section = page.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = section.split("| --- |", 1)[1]
    return re.findall(r"^\| `([^`]+)`", rows, flags=re.M)


def test_logging_page_lists_every_level_and_setting_with_its_default():
    from jitk.tools import api_log

    page = GUIDE / "debugging_a_serving_process.md"
    assert table_first_cells(page, "Levels") == [str(level) for level in api_log.LEVELS]
    settings = {value for name, value in vars(api_log).items() if name.endswith("_ENV")}
    assert set(table_first_cells(page, "Settings")) == settings
    text = page.read_text()
    assert f"(default `{api_log.DEFAULT_DUMP_DIR}`)" in text
    assert f"(default {api_log.DEFAULT_DUMP_MAX_GB:g})" in text
    assert f"(default {api_log.DEFAULT_DUMP_MAX_COUNT})" in text
    from jitk.tools import call_dumps

    for name in (call_dumps.CALL_FILE, call_dumps.INPUTS_FILE, call_dumps.OUTPUTS_FILE):
        assert f"`{name}`" in text


def test_logging_page_shows_the_line_format_the_code_writes():
    from jitk.tools import api_log

    page = (GUIDE / "debugging_a_serving_process.md").read_text()
    shown = re.search(r"```\n(\[jitk pid .*?)```", page, flags=re.S).group(1).splitlines()
    assert re.fullmatch(r"\[jitk pid \d+ [\d:]+\] jitk::rmsnorm call 1", shown[0])
    import torch
    assert shown[1].startswith("  input: " + api_log.describe_tensor(
        torch.empty(4, 128, dtype=torch.bfloat16)).split(", device")[0])
    assert shown[-1] == ("  note: kernel=jitk::norm::RMSNorm<128, bf16_t>, rows_bucket=4, "
                         "tuning=default")


def test_fib_page_example_and_quoted_error_hold():
    pytest.importorskip("flashinfer_bench",
                        reason="flashinfer-bench is not installed: pip install -e '.[fib]'")
    import torch

    import jitk.fib  # the example's names

    page = (GUIDE / "flashinfer_bench.md").read_text()
    quoted = re.search(r"BuildError: (jitk failed to compile Solution )'\w+':", page).group(1)
    assert f'"{quoted}' in (PACKAGE / "integrations" / "fib_builder.py").read_text()
    example = re.search(r"```python\n(definition = .*?)```", page, flags=re.S).group(1)
    x, out = torch.empty(2, 4096, dtype=torch.bfloat16), torch.empty(2, 4096, dtype=torch.bfloat16)
    namespace = {"jitk": jitk, "x": x, "weight": torch.empty(4096, dtype=torch.bfloat16),
                 "out": out}
    exec(example, namespace)  # noqa: S102
    made = namespace["definition"]
    assert made.name == "rmsnorm_hidden_size4096"
    assert made.axes["hidden_size"].value == 4096 and made.axes["batch_size"].type == "var"


# ------------------------------------------------------------------ code blocks build and run
# A block may be marked by an HTML comment on the line right above its fence:
# <!-- fragment --> (not whole: shown, not built), <!-- gpu --> (Python that needs a GPU),
# <!-- fib --> (Python that needs flashinfer-bench: run where it is installed) or
# <!-- file: NAME --> (written out as NAME beside the page's Python blocks when they run).
BLOCK = re.compile(r"(?:<!-- ([\w-]+)(?:: ([\w./-]+))? -->\n[ \t]*)?```(\w[\w+]*)\n(.*?)```",
                   re.S)
CPP_LANGUAGES = {"cpp", "cuda", "c++"}
SNIPPET_TIMEOUT_S = 600


def code_blocks(page: Path) -> list[tuple[str | None, str | None, str, str]]:
    """(marker, its argument, language, text) of each fenced block of `page`."""
    return [(m.group(1), m.group(2), m.group(3), m.group(4))
            for m in BLOCK.finditer(page.read_text())]


def finish_all(commands: dict[str, tuple[list[str], dict]]) -> dict[str, tuple[int, str]]:
    """Runs the commands at once and returns each one's (exit code, output); a command still
    running after SNIPPET_TIMEOUT_S is killed and reported so."""
    started = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, **options)
               for name, (argv, options) in commands.items()}
    results = {}
    for name, process in started.items():
        try:
            output = process.communicate(timeout=SNIPPET_TIMEOUT_S)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            output = process.communicate()[0] + f"\n(killed after {SNIPPET_TIMEOUT_S} s)"
        results[name] = (process.returncode, output)
    return results


def test_cpp_blocks_compile(tmp_path):
    """Every whole C++ block of every page compiles for sm_90 against jitk's headers."""
    from jitk.build import toolchain
    from jitk.build.builder import include_flags

    flags = ["-ccbin", toolchain.nvcc_host_compiler(), "-std=c++20", "--expt-relaxed-constexpr",
             "-arch=sm_90", "-x", "cu", *include_flags([PACKAGE / "include"])]
    commands = {}
    for page in PAGES:
        for index, (marker, _, language, text) in enumerate(code_blocks(page)):
            if language not in CPP_LANGUAGES or marker == "fragment":
                continue
            source = tmp_path / f"{page.stem}_{index}.cu"
            source.write_text(text)
            commands[f"{page_id(page)} block {index}"] = (
                [toolchain.nvcc_path(), *flags, "-c", str(source), "-o",
                 str(source.with_suffix(".o"))], {})
    assert any(name.startswith("docs/developer_guide/persistent_kernels.md")
               for name in commands)
    failed = {name: output for name, (code, output) in finish_all(commands).items() if code}
    assert not failed, "C++ blocks that do not compile:\n" + "\n".join(
        f"--- {name}\n{output[-2000:]}" for name, output in failed.items())


def test_python_blocks_run(tmp_path):
    """Every whole Python block that needs no GPU runs as written, each in its own process,
    beside the files its page's <!-- file: NAME --> blocks hold."""
    path = os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "JITK_CUDA_ARCH": "9.0"}
    commands = {}
    skipped = {"fragment", "gpu"} | (
        set() if importlib.util.find_spec("flashinfer_bench") else {"fib"})
    for number, page in enumerate(PAGES):
        folder = tmp_path / f"{number}_{page.stem}"  # two pages are README.md
        folder.mkdir()
        blocks = code_blocks(page)
        for marker, name, _, text in blocks:
            if marker == "file":
                (folder / Path(name).name).write_text(text)
        for index, (marker, _, language, text) in enumerate(blocks):
            if language != "python" or marker in skipped:
                continue
            script = folder / f"block_{index}.py"
            script.write_text(textwrap.dedent(text))
            commands[f"{page_id(page)} block {index}"] = (
                [sys.executable, str(script)], {"cwd": folder, "env": env})
    assert any(name.startswith("docs/developer_guide/persistent_kernels.md")
               for name in commands)
    failed = {name: output for name, (code, output) in finish_all(commands).items() if code}
    assert not failed, "Python blocks that do not run:\n" + "\n".join(
        f"--- {name}\n{output[-2000:]}" for name, output in failed.items())
