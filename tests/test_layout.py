"""The package's shape, checked from its source: layers only import downwards, no import
cycle, no private name imported from another module, the benchmarks are a leaf, and the
tests use public names only.  Every import counts, also those inside functions."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sprpo_lib

PKG = Path(sprpo_lib.__file__).parent
TESTS = Path(__file__).parent

#: The layers, bottom first; a module may import its own layer or lower ones (the
#: package's docstring draws the same picture).
LAYERS: list[tuple[str, ...]] = [
    ("io", "paths", "registry", "progress", "hardware", "manifest"),  # files, places, machine
    ("models", "perturb", "compress", "agent", "envs"),  # policies, perturbations, environments
    ("engines",),  # generation back ends behind one interface
    ("rollout",),  # episodes played in groups
    ("advantages", "losses", "batch", "actor", "methods"),  # the algorithm (Alg. 1-4)
    ("config", "checkpoint", "sft", "heldout", "train"),  # training runs
    ("evaluate",),  # robustness evaluation (App. C)
    ("paper",),  # the paper's experiments, figures and tables
    ("reproduce",),  # the notebooks, run headlessly
    ("bench",),  # benchmarks: a leaf nothing imports
]


def module_name(path: Path, root: Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str | None) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in the file,
    relative imports resolved against ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            out += [(mod, a.name, node.lineno) for a in node.names]
    return out


def graph(root: Path = PKG) -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the package modules it imports, and the private cross-module imports."""
    mods = {module_name(p, root): p for p in root.rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, p in mods.items():
        for target, name, line in imports(p, m):
            if not target.startswith("sprpo_lib"):
                continue
            full = f"{target}.{name}" if name else None
            dest = full if full in mods else target
            if dest in mods and dest != m:
                edges[m].add(dest)
            if name and name.startswith("_") and not name.startswith("__") and dest != m:
                private.append(f"{p.relative_to(root.parent)}:{line} imports {name} from {target}")
    return edges, private


def layer(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return -1  # the package itself (sprpo_lib/__init__.py)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    edges, _ = graph()
    assert [m for m in edges if m != "sprpo_lib" and layer(m) < 0] == []


def test_no_import_cycle():
    assert cycles(graph()[0]) == []


def test_imports_go_down_the_layers_only():
    edges, _ = graph()
    up = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
          for m, ts in edges.items() for t in ts if m != "sprpo_lib" and layer(t) > layer(m)]
    assert up == []


def test_no_private_name_imported_across_modules():
    assert graph()[1] == []


def test_nothing_in_the_library_imports_the_benchmarks():
    edges, _ = graph()
    assert [m for m, ts in edges.items() if not m.startswith("sprpo_lib.bench")
            and any(t.startswith("sprpo_lib.bench") for t in ts)] == []


def test_tests_import_public_names_only():
    bad = [f"{p.name}:{line} imports {name} from {target}" for p in TESTS.glob("*.py")
           for target, name, line in imports(p, None)
           if target.startswith("sprpo_lib") and name and name.startswith("_") and not name.startswith("__")]
    assert bad == []


def test_the_checks_catch_what_they_guard_against(tmp_path):
    """The checker itself on a planted package: a cycle, an upward import, a private import
    and a library -> bench import are each reported."""
    pkg = tmp_path / "sprpo_lib"
    (pkg / "bench").mkdir(parents=True)
    for f in ("__init__.py", "bench/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "io.py").write_text("from sprpo_lib.train import _helper\n")  # up, private, and with train: a cycle
    (pkg / "train.py").write_text("from sprpo_lib import io\n\ndef f():\n    from sprpo_lib.bench import x\n")
    edges, private = graph(pkg)
    assert cycles(edges) == [["sprpo_lib.io", "sprpo_lib.train"]]
    assert layer("sprpo_lib.train") > layer("sprpo_lib.io")  # io -> train goes up
    assert private == ["sprpo_lib/io.py:1 imports _helper from sprpo_lib.train"]
    assert "sprpo_lib.bench" in edges["sprpo_lib.train"]


@pytest.mark.parametrize("name", ["sprpo_lib.bench", "sprpo_lib.evaluate", "sprpo_lib.reproduce", "sprpo_lib.train"])
def test_python_dash_m_entry_points_exist(name):
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is not None
    if spec.submodule_search_locations:  # a package: runs its __main__
        assert importlib.util.find_spec(f"{name}.__main__") is not None
