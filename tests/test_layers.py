"""The packages' layers, read statically from the source (nothing is imported): engine/ imports nothing of
the packages above it, not even inside a function, and the project's imports form no cycle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "deployments", "cluster", "loadtest", "dflash_serve")
ABOVE_ENGINE = ("deployments", "cluster", "loadtest", "dflash_serve", "ray", "locust")


def imported(path: Path) -> set[str]:
    """Every module `path` imports, wherever in the file (absolute names; the project uses no relative imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from engine import bench`
    return names


def modules() -> dict[str, Path]:
    """The project's modules by dotted name."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for package in PACKAGES for p in sorted((ROOT / package).glob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a package's own __init__ stands for the package)."""
    known = modules()
    return {name: {m for m in imported(path) if m in known and m != name} for name, path in known.items()}


def test_engine_imports_nothing_above_it():
    offenders = {f"{path.name}: {name}" for path in sorted((ROOT / "engine").glob("*.py")) for name in imported(path)
                 if name.split(".")[0] in ABOVE_ENGINE}
    assert not offenders, f"engine/ imports packages above it: {sorted(offenders)}"


def test_the_project_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "engine.engine" in graph["engine.config"]  # the graph was read
    state: dict[str, str] = {}  # module -> "open" while on the path, "done" after

    def visit(name: str, path: list[str]):
        state[name] = "open"
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                raise AssertionError("an import cycle: " + " -> ".join(path[path.index(dep):] + [name, dep]))
            if dep not in state:
                visit(dep, path + [name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    """The check above catches a cycle (the one deployments/shards.py and engine_replica.py once had)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, **{f"m{i}": set() for i in range(30)}, "engine.config": {"engine.engine"}}
    monkeypatch.setitem(globals(), "import_graph", lambda: graph)
    try:
        test_the_project_has_no_import_cycle()
    except AssertionError as e:
        assert "a -> b -> c -> a" in str(e)
    else:
        raise AssertionError("no cycle found")
