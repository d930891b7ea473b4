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
