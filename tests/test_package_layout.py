"""The import graph of cute_kernels (parsed with ast, nothing imported): no cycle runs between its subpackages."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cute_kernels"


def unit(module: str) -> str | None:
    """The subpackage (cute_kernels.boundary, ...) a module belongs to; None for the package's own modules."""
    parts = module.split(".")
    if parts[0] != "cute_kernels" or len(parts) < 2 or not (PACKAGE / parts[1]).is_dir():
        return None
    return ".".join(parts[:2])


def imported(path: Path, module: str) -> set[str]:
    """Every module `path` imports, at any depth of the file (lazy imports in functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def subpackage_graph() -> dict[str, set[str]]:
    """subpackage -> the other subpackages its modules import."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        source = unit(module)
        if source is None:
            continue
        targets = {unit(name) for name in imported(path, module)} - {None, source}
        graph.setdefault(source, set()).update(targets)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path = path + [node]
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path)):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [])):
            return found
    return None


def test_no_cycle_between_cute_kernels_subpackages() -> None:
    graph = subpackage_graph()
    assert {"cute_kernels.boundary", "cute_kernels.allreduce", "cute_kernels.coefficients"} <= set(graph)
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
