"""The package's shape, checked from its source: layers only import downwards, no import
cycle, no private name imported from another module, the benchmarks are a leaf, and the
tests use public names only.  Every import counts, also those inside functions."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

import sprpo_lib

PKG = Path(sprpo_lib.__file__).parent
TESTS = Path(__file__).parent

#: The layers, bottom first, read from the package's folders: a module may import its own
#: layer or lower ones (the package's docstring draws the same picture).
LAYERS: list[tuple[str, ...]] = [
    ("infra",),  # files, places, machine, where work runs and where metrics go
    ("model",),  # the policy model: loading, layers, LoRA
    ("core",),  # the algorithm on explicit tensors (Algs. 1-4) and the perturbations
    ("agent",),  # prompts, engines, environments, episodes
    ("warmstart",),  # demonstrations, behaviour cloning, DAgger, held-out evaluation
    ("train",),  # training runs
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


@functools.lru_cache(maxsize=None)  # a module is imported from many files: parse it once
def defined_names(path: Path) -> frozenset[str]:
    """Names a module defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def unresolved(root: Path = PKG, files: list[Path] | None = None) -> list[str]:
    """Imports of package modules that do not exist, or of names those modules do not define."""
    mods = {module_name(p, root): p for p in root.rglob("*.py")}
    bad = []
    for path in files or list(mods.values()):
        name = module_name(path, root) if path.is_relative_to(root) else None
        for target, imported, line in imports(path, name):
            if not target.startswith("sprpo_lib"):
                continue
            where = f"{path.name}:{line}"
            if target not in mods:
                bad.append(f"{where}: no module {target}")
            elif imported and imported != "*" and f"{target}.{imported}" not in mods \
                    and imported not in defined_names(mods[target]):
                bad.append(f"{where}: {target} defines no {imported}")
    return bad


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
    for d in ("bench", "infra", "train"):
        (pkg / d).mkdir(parents=True)
    for f in ("__init__.py", "bench/__init__.py", "infra/__init__.py", "train/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "infra/io.py").write_text("from sprpo_lib.train.trainer import _helper\n")  # up, private, and a cycle
    (pkg / "train/trainer.py").write_text("from sprpo_lib.infra import io\nimport sprpo_lib.infra.io as alias\n\n"
                                          "def f():\n    from sprpo_lib.bench import x\n    from sprpo_lib.gone import y\n")
    edges, private = graph(pkg)
    assert cycles(edges) == [["sprpo_lib.infra.io", "sprpo_lib.train.trainer"]]
    assert layer("sprpo_lib.train.trainer") > layer("sprpo_lib.infra.io")  # io -> train goes up
    assert private == ["sprpo_lib/infra/io.py:1 imports _helper from sprpo_lib.train.trainer"]
    assert "sprpo_lib.bench" in edges["sprpo_lib.train.trainer"]
    assert sorted(unresolved(pkg)) == ["io.py:1: sprpo_lib.train.trainer defines no _helper",
                                       "trainer.py:5: sprpo_lib.bench defines no x",
                                       "trainer.py:6: no module sprpo_lib.gone"]


@pytest.mark.parametrize("name", ["sprpo_lib.bench", "sprpo_lib.evaluate", "sprpo_lib.reproduce", "sprpo_lib.train"])
def test_python_dash_m_entry_points_exist(name):
    import importlib.util

    spec = importlib.util.find_spec(name)
    assert spec is not None
    if spec.submodule_search_locations:  # a package: runs its __main__
        assert importlib.util.find_spec(f"{name}.__main__") is not None


def test_every_import_of_the_package_resolves():
    """What ruff cannot see: each ``sprpo_lib`` import names an existing module and a name it defines."""
    assert unresolved(files=[*PKG.rglob("*.py"), *TESTS.glob("*.py")]) == []


def test_engine_registry_paths_resolve():
    """The registry names its plug-ins by import path: each path is a module defining the class."""
    from sprpo_lib.agent.engines import ENGINES

    mods = {module_name(p): p for p in PKG.rglob("*.py")}
    for name, entry in ENGINES.items():
        module, _, attr = entry.partition(":")
        assert module in mods and attr in defined_names(mods[module]), (name, entry)
        assert layer(module) == layer("sprpo_lib.agent.engines")


def test_tests_touch_no_private_attribute_of_the_package():
    """``module._name`` and ``monkeypatch.setattr(module, "_name", ...)`` on package modules."""
    bad = []
    for p in TESTS.glob("*.py"):
        tree = ast.parse(p.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname or a.name for a in node.names if a.name.startswith("sprpo_lib")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sprpo_lib"):
                aliases |= {a.asname or a.name for a in node.names if a.name[:1].islower()}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and isinstance(node.value, ast.Name) and node.value.id in aliases:
                bad.append(f"{p.name}:{node.lineno} {node.value.id}.{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "setattr" and len(node.args) >= 2 \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases \
                    and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_"):
                bad.append(f"{p.name}:{node.lineno} setattr({node.args[0].id}, {node.args[1].value!r})")
    assert bad == []


def test_the_layers_are_the_folders_and_the_packages_docstring():
    """Each layer is one folder (or one top-level module) of the package and each folder is a
    layer; the package docstring lists them in the same order."""
    tops = {p.stem if p.is_file() else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert tops == {n for names in LAYERS for n in names}
    doc = sprpo_lib.__doc__
    pos = [doc.index(f"``{n}/``") if (PKG / n).is_dir() else doc.index(f"``{n}``") for names in LAYERS for n in names]
    assert pos == sorted(pos)


def code_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines without its docstring."""
    n = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        n -= first.end_lineno - first.lineno + 1
    return n


def test_a_function_over_80_lines_says_why_in_its_docstring():
    long = []
    for p in PKG.rglob("*.py"):
        for fn in ast.walk(ast.parse(p.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(fn) > 80 \
                    and "Long on purpose:" not in (ast.get_docstring(fn) or ""):
                long.append(f"{p.relative_to(PKG)}:{fn.lineno} {fn.name} ({code_lines(fn)} lines)")
    assert long == []


def test_imports_sit_at_the_top_but_for_heavy_optional_packages_with_a_reason():
    """An import inside a function is a heavy or optional package (transformers, peft, ray,
    openvino, vllm, ...) and says why on its line or the line above."""
    bad = []
    for p in PKG.rglob("*.py"):
        src = p.read_text()
        lines = src.splitlines()
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#") \
                        or lines[node.lineno - 2].strip() == "try:"
                    if mod.startswith("sprpo_lib") and "alfworld" not in mod or not said:
                        bad.append(f"{p.relative_to(PKG)}:{node.lineno} {mod}")
    assert bad == []


def test_the_files_the_pages_name_exist_and_the_library_page_is_short():
    """Every ``.py`` path the READMEs and requirements files name is a file of the checkout (relative
    to the root or to the package), and ``sprpo_lib/README.md`` stays within 150 lines."""
    root = PKG.parent
    missing = []
    for page in [root / "README.md", PKG / "README.md", *root.glob("requirements*.txt")]:
        for m in re.finditer(r"(?<![\w.])((?:sprpo_lib|tests|[a-z_]+)/[\w/]*\w\.py)\b", page.read_text()):
            if not ((root / m.group(1)).is_file() or (PKG / m.group(1)).is_file()):
                missing.append(f"{page.name}: {m.group(1)}")
    assert missing == []
    assert len((PKG / "README.md").read_text().splitlines()) <= 150
