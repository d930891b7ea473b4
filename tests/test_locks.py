"""The dependency declarations agree: every exact pin of both locks (requirements.txt, the CPU
lock; requirements-gpu.txt, the CUDA lock) lies in the range pyproject.toml declares for that
package, and each lock pins every declared dependency exactly once."""
from __future__ import annotations

import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from sprpo_lib.infra.paths import project_root

LOCKS = ("requirements.txt", "requirements-gpu.txt")


def _declared() -> tuple[dict[str, Requirement], dict[str, Requirement]]:
    meta = tomllib.loads((project_root() / "pyproject.toml").read_text())["project"]
    core = {canonicalize_name(Requirement(r).name): Requirement(r) for r in meta["dependencies"]}
    extra = {canonicalize_name(Requirement(r).name): Requirement(r)
             for reqs in meta.get("optional-dependencies", {}).values() for r in reqs}
    return core, extra


def _pins(lock: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (project_root() / lock).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"{lock}: {line!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in out, f"{lock}: {req.name} pinned twice"
        out[name] = spec[0].version
    return out


@pytest.mark.parametrize("lock", LOCKS)
def test_every_pin_lies_in_the_declared_range(lock):
    core, extra = _declared()
    pins = _pins(lock)
    assert set(core) <= set(pins), f"{lock} lacks {sorted(set(core) - set(pins))}"
    for name, version in pins.items():
        req = core.get(name) or extra.get(name)
        if req is not None:
            assert req.specifier.contains(version, prereleases=True), f"{lock}: {name}=={version} outside {req}"


def test_the_cuda_lock_holds_the_paper_engine_and_the_versions_it_requires():
    """vLLM 0.33.0's wheel declares torch==2.14.0 and transformers>=5.16.1,<5.21 (its METADATA);
    its mistral-common needs numpy<2.4 on Python <= 3.12."""
    gpu = _pins("requirements-gpu.txt")
    assert gpu["vllm"] == "0.33.0" and gpu["torch"] == "2.14.0"
    assert Requirement("transformers>=5.16.1,<5.21").specifier.contains(gpu["transformers"])
    assert Requirement("numpy<2.4").specifier.contains(gpu["numpy"])
    cpu = _pins("requirements.txt")
    differ = {n for n in set(cpu) & set(gpu) if cpu[n] != gpu[n]}
    assert differ == {"torch", "transformers", "numpy"}, differ  # one set of versions everywhere else


def _closure(reqs: list[Requirement]) -> set[str]:
    """The installed distributions that ``reqs`` require, themselves included, with the extras
    each requirement asks for (alfworld's ``textworld[pddl]``)."""
    from importlib.metadata import PackageNotFoundError, requires

    seen, todo = set(), [(canonicalize_name(r.name), extra) for r in reqs for extra in ("", *r.extras)]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            lines = requires(name) or []
        except PackageNotFoundError:
            continue
        for line in lines:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(canonicalize_name(req.name), e) for e in ("", *req.extras)]
    return {name for name, _ in seen}


def test_every_module_level_import_is_a_declared_dependency():
    """What the package imports when its modules load (a module-level ``import``, not one inside a
    function that an optional engine guards) is installed by ``pip install sprpo``: its
    distribution is a declared dependency or one that a declared dependency requires."""
    import ast
    import sys
    from importlib.metadata import packages_distributions

    core, _ = _declared()
    installed = _closure(list(core.values()))
    dists = packages_distributions()
    undeclared = {}
    for path in sorted((project_root() / "sprpo_lib").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"sprpo_lib"}:
                if not {canonicalize_name(d) for d in dists.get(top, [top])} & installed:
                    undeclared.setdefault(top, []).append(str(path.relative_to(project_root())))
    assert not undeclared, f"imported at module level but not installed with the package: {undeclared}"
