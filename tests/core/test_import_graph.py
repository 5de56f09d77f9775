"""No import circles: no module imports (at the top or inside a function) a module that
imports it back, directly or through others.

The graph is read from the source with `ast` (no module is imported): each `import` or
`from ... import` of a module of ours is an edge, wherever it stands in the file, except
under `if TYPE_CHECKING:` (never run). A package's `__init__` importing its own modules
is part of the graph like any module; the implicit import of a module's parent package
is not (every module would then sit on a circle with its package).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"tokamax_pass": ROOT / "src" / "tokamax_pass",
            "tokamax_kernels": ROOT / "kernels" / "tokamax_kernels"}
# Circles still to untie, each spelled as `circles` reports it. The list only shrinks:
# a new circle fails the test, and so does a listed one that no longer exists.
KNOWN_CIRCLES: list[list[str]] = []


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    assert set(PACKAGES) <= set(modules), f"a package is missing: {sorted(PACKAGES)}"
    return modules


def _owner(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The module of ours that `import name` runs (the longest known prefix), if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _imports(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block)
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(_owner(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from package import module` imports the module
                found.add(_owner(f"{base}.{alias.name}", modules))
    return found - {None, module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            if component:
                found.append(sorted([node, *component]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 20
    found = circles(graph)
    new = [c for c in found if c not in KNOWN_CIRCLES]
    assert not new, "import circles (each list imports itself around):\n" + "\n".join(
        " <-> ".join(c) for c in new)
    untied = [c for c in KNOWN_CIRCLES if c not in found]
    assert not untied, f"untied, so drop them from KNOWN_CIRCLES: {untied}"


def test_circle_finder_finds_circles():
    """The check can fail: a lazy import back (the old op <-> VJP pairing) is a circle."""
    graph = import_graph()
    fwd = "tokamax_kernels.layer_norm.pallas_triton"
    vjp = "tokamax_kernels.layer_norm.pallas_triton_vjp"
    assert vjp in graph[fwd]
    graph[vjp] = graph[vjp] | {fwd}
    assert [fwd, vjp] in circles(graph)
