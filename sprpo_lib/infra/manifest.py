"""Provenance for every result file: the manifest (config, seed, commit, date, wall time,
machine) written beside each figure and table, and the commit of the code that made it."""
from __future__ import annotations

import datetime as _dt
import platform
import subprocess
from pathlib import Path

import torch

from sprpo_lib.infra.hardware import machine_info
from sprpo_lib.infra.io import CorruptFileError, atomic_write_json, file_record, read_json, verify_file
from sprpo_lib.infra.paths import package_checkout, project_relative

NOT_A_CHECKOUT = "unknown (not a git checkout)"
#: What every manifest states beside config, commit, date, wall time and machine: the dtype the
#: numbers were computed in, the seeds (training and evaluation) and the goals per point.  A writer
#: with nothing to state gives the reason (:func:`not_applicable`).
DESIGN_KEYS = ("dtype", "seeds", "goals")


def not_applicable(why: str) -> str:
    """A manifest value that does not apply to this artifact, with the reason."""
    return f"n/a: {why}"


def git_commit(repo: str | Path | None = None) -> str:
    """Commit of the code that produced a result (``+dirty`` if tracked files other than
    the outputs, ``figures/`` and the READMEs with their generated blocks (the top level's and
    the library's bench block), have changes).  Only a repository whose top level is the
    checkout holding the package counts: a copy unpacked inside another repository would
    otherwise record that repository's commit.  Elsewhere :data:`NOT_A_CHECKOUT`."""
    repo = Path(repo or package_checkout()).resolve()
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=repo, capture_output=True, text=True,
                             check=True).stdout.strip()
        if Path(top).resolve() != repo:
            return NOT_A_CHECKOUT
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)figures",
             ":(exclude,glob)**/README.md"],
            cwd=repo, capture_output=True, text=True,
        ).stdout.strip()  # rewritten outputs (figures/, READMEs) do not make the code that wrote them dirty
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return NOT_A_CHECKOUT


def portable(obj):
    """``obj`` with every absolute path string under the project root made project-relative
    (:func:`~sprpo_lib.infra.paths.project_relative`): a committed manifest names the same
    run folders in every clone, and no one's home directory."""
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v) for v in obj]
    if isinstance(obj, Path) or (isinstance(obj, str) and obj.startswith("/")):
        return project_relative(obj)
    return obj


def write_manifest(
    artifact: str | Path, config: dict, seed: int | None, wall_seconds: float, extra: dict | None = None
) -> Path:
    """Write ``<artifact>.manifest.json`` beside a figure or table; ``extra`` must state
    :data:`DESIGN_KEYS` (a ValueError names what a writer left out).  ``seed`` is the one seed of
    an artifact made from a single one; ``None`` (several seeds) leaves it out, and ``seeds``
    (a design key) lists them."""
    artifact = Path(artifact)
    missing = [k for k in DESIGN_KEYS if k not in (extra or {})]
    if missing:
        raise ValueError(f"manifest of {artifact.name}: the writer states no {', '.join(missing)}; pass them in extra "
                         f"(a value, or not_applicable(why) where none applies)")
    manifest = {
        "artifact": artifact.name,
        "config": portable(config),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(float(wall_seconds), 2),
        "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()},
    }
    try:  # CPU model and instruction set: where the numbers (and timings) were made
        manifest["host"].update({k: v for k, v in machine_info().items() if k in ("cpu_model", "capability", "cpu_class",
                                                                                "isa_limits", "logical_cpus",
                                                                                "torch_threads", "allocator")})
    except Exception:  # noqa: BLE001 - a manifest is never lost for want of CPU details
        pass
    if seed is not None:
        manifest["seed"] = seed
    if extra:
        manifest.update(portable(extra))
    if artifact.is_file():  # what readers verify the artifact against (check_artifact)
        manifest["file"] = file_record(artifact)
    return atomic_write_json(artifact.with_name(artifact.name + ".manifest.json"), manifest)


def manifest_path(artifact: str | Path) -> Path:
    """``<artifact>.manifest.json``."""
    artifact = Path(artifact)
    return artifact.with_name(artifact.name + ".manifest.json")


def check_artifact(artifact: str | Path) -> dict:
    """The manifest of ``artifact``, verified: a JSON object naming this artifact, and the
    artifact matching the SHA-256 and size it records (manifests written before that record
    are checked for their form only).  Raises :class:`~sprpo_lib.infra.io.CorruptFileError` naming
    the damaged file, or ``FileNotFoundError``."""
    artifact = Path(artifact)

    def problem(m) -> str | None:
        if not isinstance(m, dict):
            return "not a JSON object"
        if m.get("artifact") != artifact.name:
            return f"it describes {m.get('artifact')!r}, not {artifact.name}"
        if "file" in m and not isinstance(m["file"], dict):
            return "its 'file' record is not an object"
        return None

    if not artifact.is_file():
        raise FileNotFoundError(f"{artifact}: missing, though it should have been written")
    m = read_json(manifest_path(artifact), problem)
    if "file" in m:
        try:
            verify_file(artifact, m["file"])
        except CorruptFileError as err:
            raise CorruptFileError(artifact, f"{err.problem} (against its manifest {manifest_path(artifact).name})",
                                   err.fix) from None
    return m
