"""The house rules, read off the code itself: no import circles between our modules (lazy imports
inside functions count: a circle hidden in a function is still a circle), no source file over
500 lines, and the chat app and the quantize script never reach into the CLI."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mlx_specdec", "tui", "quantize")
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files():
    return sorted(f for package in PACKAGES for f in (ROOT / package).rglob("*.py"))


def imported_modules(path: Path, known: set) -> set:
    """Every one of our modules that `path` imports, at the top or inside a function. `from X
    import name` counts as X.name where that is a module (a submodule), else as X."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` where a.b.c is a function etc.
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict:
    files = source_files()
    known = {module_name(f) for f in files}
    return {module_name(f): imported_modules(f, known) for f in files}


def find_cycle(graph: dict):
    """One import circle as a list of modules, or None (depth-first search, colouring nodes)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_lazy_circle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_graph_sees_lazy_imports():
    """The adapter loads the fork probe inside a function body's branch; the graph must see it."""
    graph = import_graph()
    assert "mlx_specdec.apar.probe" in graph["mlx_specdec.apar.adapter"]
    assert "tui.cli" in graph["mlx_specdec.cli.chat"]  # lazy: the CLI starts the app on demand


@pytest.mark.parametrize("package", ["tui", "quantize"])
def test_app_and_quantize_never_import_the_cli(package):
    graph = import_graph()
    offenders = {m: sorted(t for t in targets if t.startswith("mlx_specdec.cli"))
                 for m, targets in graph.items() if m.split(".")[0] == package}
    assert not {m: t for m, t in offenders.items() if t}


def test_no_source_file_is_over_500_lines():
    long = {str(f.relative_to(ROOT)): n for f in source_files()
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long
