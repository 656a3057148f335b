"""The shape of the package: subpackages by concern in layers, imports that point only down (those inside functions
too), no circle, a docstring saying what each subpackage owns, and rooms a reader takes in at one sitting. The checks
are shown to fail on a copy of the package with a planted upward import, circle and oversized class."""

import ast
import shutil
from pathlib import Path

from normlab.common.paths import PACKAGE_DIR

# Bottom to top: a module imports from its own subpackage or from a lower layer only
LAYERS = ("common", "model", "data", "probe", "training", "cluster", "interop", "study", "")  # "": cli, bench
MODULE_LINES, CLASS_LINES = 520, 160  # "about 500" and "about 150"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, name: str, is_package: bool) -> set[str]:
    """The normlab modules a module imports, anywhere in it (a `from normlab.x import y` of a submodule y: x.y)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "normlab"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                package = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(package + ([node.module] if node.module else []))
            if base.split(".")[0] == "normlab":
                found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = imported(ast.parse(path.read_text()), name, path.name == "__init__.py")
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def layer(module: str) -> tuple[int, str]:
    """A module's layer and subpackage ("" for the package's own modules: normlab/__init__ sits with common)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS):
        return LAYERS.index(parts[1]), parts[1]
    return (0, "common") if module == "normlab" else (len(LAYERS) - 1, "")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if layer(target)[0] > layer(module)[0]
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once (depth-first search; a back edge closes a circle)."""
    found, state, stack = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                found.append(f"{path.relative_to(root)}: class {node.name}: {node.end_lineno - node.lineno + 1} lines")
    return found


def test_every_import_points_down_and_none_closes_a_circle():
    graph = import_graph(PACKAGE_DIR)
    assert {layer(m)[1] for m in graph} == set(LAYERS)  # every layer exists, nothing outside them
    assert upward_imports(graph) == []
    assert circles(graph) == []


def test_each_subpackage_says_what_it_owns_and_no_room_is_too_big_to_take_in():
    for package in [p.parent for p in PACKAGE_DIR.rglob("__init__.py")]:
        assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), f"{package} has no docstring"
    assert oversized(PACKAGE_DIR) == []


def test_the_checks_catch_a_planted_upward_import_a_circle_and_an_oversized_class(tmp_path):
    root = tmp_path / "normlab"
    shutil.copytree(PACKAGE_DIR, root, ignore=shutil.ignore_patterns("conf", "__pycache__"))
    with open(root / "model" / "norms.py", "a") as f:  # the model reaching up into the study
        f.write("\n\ndef figure():\n    from normlab.study import report  # noqa\n")
    (root / "common" / "one.py").write_text("from normlab.common import two  # noqa\n")
    (root / "common" / "two.py").write_text("from normlab.common.one import x  # noqa\n")
    (root / "data" / "big.py").write_text("class Big:\n" + "    x = 1\n" * CLASS_LINES)
    graph, before = import_graph(root), import_graph(PACKAGE_DIR)  # what the planted faults add
    added = set(upward_imports(graph)) - set(upward_imports(before))
    assert added == {"normlab.model.norms imports normlab.study", "normlab.model.norms imports normlab.study.report"}
    planted = ["normlab.common.one", "normlab.common.two", "normlab.common.one"]
    new_circles = [c for c in circles(graph) if c not in circles(before)]
    assert planted in new_circles  # the other new ones go through the upward import (the study imports the model)
    assert all(c == planted or c[:2] == ["normlab.model.norms", "normlab.study.report"] for c in new_circles)
    assert set(oversized(root)) - set(oversized(PACKAGE_DIR)) == {f"data/big.py: class Big: {CLASS_LINES + 1} lines"}

