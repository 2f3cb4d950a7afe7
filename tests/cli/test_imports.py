"""Imports point one way (DESIGN.md): no cycles, no private names across modules, layers downward.

The graph is read with `ast` alone (nothing is executed), function-level imports included, over
`ood_jax/` and `tfds_builders/`. Each check is also run on a small tree made here that breaks it,
so a checker that finds nothing cannot pass unnoticed.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("ood_jax", "tfds_builders")

# Top to bottom: a module may import its own layer or any layer below it, never one above.
# Every module of the two packages must fall in exactly one layer (the longest prefix wins).
LAYERS = (
    ("ood_jax.cli", "ood_jax.__main__"),
    ("ood_jax.report",),
    ("ood_jax.train",),
    ("ood_jax.detection",),
    ("ood_jax.eval",),
    ("ood_jax.mining",),
    ("ood_jax.scorers",),
    ("ood_jax.models",),
    ("ood_jax.datasets",),
    ("tfds_builders",),
    ("ood_jax.data",),
    ("ood_jax.metrics", "ood_jax.stats", "ood_jax.testing"),
    (
        "ood_jax",  # the package's __init__
        "ood_jax.sharding",
        "ood_jax.boxes",
        "ood_jax.files",
        "ood_jax.config_files",
        "ood_jax.prompts",
        "ood_jax.manifest",
        "ood_jax.malloc",
        "ood_jax.multihost",
        "ood_jax.launch",
        "ood_jax.progress",
    ),
)


def module_files(top: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file under the packages in `top`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((top / package).rglob("*.py")):
            parts = path.relative_to(top).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _owner(modules: dict[str, pathlib.Path], name: str) -> str | None:
    """The module `name` is, or the module it is an attribute of."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(top: pathlib.Path) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> modules it imports, ["A uses B._name", ...])."""
    modules = module_files(top)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    private: set[str] = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        aliases: dict[str, str] = {}  # local name -> module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(modules, alias.name)
                    if target:
                        graph[name].add(target)
                        bound = alias.name if alias.asname else alias.name.split(".")[0]
                        aliases[alias.asname or alias.name.split(".")[0]] = bound
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                if base.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    target = full if full in modules else _owner(modules, base)
                    if target:
                        graph[name].add(target)
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.add(f"{name} imports {alias.name} from {base}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and aliases[node.value.id] != name
            ):
                private.add(f"{name} uses {aliases[node.value.id]}.{node.attr}")
        graph[name].discard(name)
    return graph, sorted(private)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str, layers=LAYERS) -> int | None:
    best, best_len = None, -1
    for level, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    return best


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target, layers) < layer_of(module, layers)
    )


# ------------------------------------------------------------------------------------------------
# The project.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def project_graph():
    return import_graph(ROOT)


def test_no_import_cycles(project_graph):
    graph, _ = project_graph
    assert cycles(graph) == []


def test_no_private_names_across_modules(project_graph):
    _, private = project_graph
    assert private == []


def test_every_module_has_a_layer(project_graph):
    graph, _ = project_graph
    assert [m for m in graph if layer_of(m) is None] == []


def test_imports_point_down_the_layers(project_graph):
    graph, _ = project_graph
    assert upward_imports(graph) == []


def importers_of(graph: dict[str, set[str]], package: str) -> set[str]:
    """The modules outside `package` that import a module of it."""

    def inside(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    return {m for m, targets in graph.items() if not inside(m) and any(map(inside, targets))}


def test_no_library_imports_the_trainer(project_graph):
    graph, _ = project_graph
    importers = importers_of(graph, "ood_jax.train")
    assert {
        m for m in importers if m != "ood_jax.cli" and not m.startswith("ood_jax.cli.")
    } == set()


def test_only_datasets_imports_the_builders(project_graph):
    graph, _ = project_graph
    assert importers_of(graph, "tfds_builders") == {"ood_jax.datasets"}


# ------------------------------------------------------------------------------------------------
# The checker itself, on a tree that breaks every rule.
# ------------------------------------------------------------------------------------------------


def test_checker_finds_what_it_should(tmp_path):
    def write(relative: str, text: str) -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("ood_jax/__init__.py", "")
    write("ood_jax/data/__init__.py", "")
    write("ood_jax/data/a.py", "def f():\n    from ood_jax.data import b\n")
    write("ood_jax/data/b.py", "from ood_jax.data import a\nx = a._hidden\n")
    write("ood_jax/boxes.py", "from ood_jax.data.a import _secret\nimport ood_jax.train.train\n")
    write("ood_jax/train/__init__.py", "")
    write("ood_jax/train/train.py", "")
    write("tfds_builders/__init__.py", "")

    graph, private = import_graph(tmp_path)
    assert cycles(graph) == [["ood_jax.data.a", "ood_jax.data.b"]]
    assert private == [
        "ood_jax.boxes imports _secret from ood_jax.data.a",
        "ood_jax.data.b uses ood_jax.data.a._hidden",
    ]
    assert upward_imports(graph) == [
        "ood_jax.boxes imports ood_jax.data.a",
        "ood_jax.boxes imports ood_jax.train.train",
    ]
