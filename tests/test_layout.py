"""The package's floors hold: each module imports only from its own floor or those below it
(imports inside functions included), no two modules import each other by any path, no module
takes another's private names, and the kernel families stay apart from one another.

The floors, bottom to top: base, build, runtime, tools, kernels, integrations, cli; the
package's own __init__, __main__ and its public aliases (jitk.persistent, ...) stand on top."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "jitk"
FLOORS = ("base", "build", "runtime", "tools", "kernels", "integrations", "cli")
TOP = len(FLOORS)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else TOP


def family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "kernels" else None


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def jitk_module(name: str) -> str | None:
    """The package module an import names (the longest that exists), or None."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


def imports(module: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names taken from it) for every import of a jitk module."""
    path = MODULES[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, target, []) for alias in node.names
                      if (target := jitk_module(alias.name))]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, path.name == "__init__.py", node)
            if not (source == "jitk" or source.startswith("jitk.")):
                continue
            for alias in node.names:
                submodule = jitk_module(f"{source}.{alias.name}")
                if submodule and submodule != source:  # `from jitk.build import cache`
                    found.append((node.lineno, submodule, []))
                elif target := jitk_module(source):
                    found.append((node.lineno, target, [alias.name]))
    return found


def test_every_module_is_on_a_floor():
    loose = [m for m in MODULES if floor(m) == TOP and m.count(".") > 1]
    assert not loose, f"modules outside every floor: {loose}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = floor(module)
    wrong = []
    for line, target, _ in imports(module):
        theirs = floor(target)
        if target == "jitk" and mine < TOP:
            wrong.append(f"line {line}: the package itself (jitk), which is the top floor")
        elif theirs > mine:
            wrong.append(f"line {line}: {target} ({FLOORS[theirs] if theirs < TOP else 'top'})"
                         f" is above {FLOORS[mine] if mine < TOP else 'top'}")
        elif family(module) and family(target) and family(target) != family(module):
            wrong.append(f"line {line}: {target} is another kernel family")
    assert not wrong, f"{module} imports upward:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_private_names_across_modules(module):
    taken = [f"line {line}: {name} from {target}" for line, target, names in imports(module)
             for name in names
             if target != module and name.startswith("_") and not name.startswith("__")]
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    aliases = {}  # a name bound to a jitk module by an import
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = resolve(module, path.name == "__init__.py", node)
            for alias in node.names:
                if (target := jitk_module(f"{source}.{alias.name}")) and target != source:
                    aliases[alias.asname or alias.name] = target
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            taken.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    assert not taken, f"{module} takes private names of other modules:\n" + "\n".join(taken)


def test_no_import_circles():
    graph = {m: {t for _, t, _ in imports(m) if t != m and t != "jitk"} for m in MODULES}
    # Tarjan's strongly connected components: any with more than one module is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    """The rules above fail on a planted upward import, private name and circle."""
    planted = {"jitk.build.bad": "from jitk.tools import timing\nfrom jitk.build.jit import "
                                 "_shipped\n",
               "jitk.build.a": "from jitk.build import b\n",
               "jitk.build.b": "def f():\n    from jitk.build import a\n"}
    for name, text in planted.items():
        path = tmp_path / f"{name.rsplit('.', 1)[1]}.py"
        path.write_text(text)
        monkeypatch.setitem(MODULES, name, path)
    with pytest.raises(AssertionError, match="above build"):
        test_imports_point_down("jitk.build.bad")
    with pytest.raises(AssertionError, match="_shipped from jitk.build.jit"):
        test_no_private_names_across_modules("jitk.build.bad")
    with pytest.raises(AssertionError, match="jitk.build.a"):
        test_no_import_circles()
