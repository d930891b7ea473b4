"""Provenance for every result file: atomic writes and manifests (config, seed, commit,
date, wall time) beside each figure and table."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: Permissions of files and directories the atomic writers create: what ``open`` and
#: ``mkdir`` would give under the process umask (mkstemp/mkdtemp alone give 0600/0700).
FILE_MODE, DIR_MODE = 0o666 & ~_umask(), 0o777 & ~_umask()


def cache_dir() -> Path:
    """The user cache root, read here only: ``$SPRPO_CACHE`` or ``~/.cache/sprpo``
    (converted models, generated ALFWorld games, the dtype probe)."""
    return Path(os.environ.get("SPRPO_CACHE") or os.path.join(Path.home(), ".cache", "sprpo"))


def git_commit(repo: str | Path | None = None) -> str:
    """Commit of the code that produced a result (``+dirty`` if tracked files outside
    ``figures/`` have changes)."""
    repo = Path(repo or Path(__file__).resolve().parents[1])
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)figures"],
            cwd=repo, capture_output=True, text=True,
        ).stdout.strip()  # rewritten outputs in figures/ do not make the code that wrote them dirty
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``:
    a killed process leaves either the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def atomic_dir(path: str | Path):
    """Build a directory under a temporary name (yielded) and rename it over ``path``
    only when the block succeeds: a killed writer leaves the old directory or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, DIR_MODE)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class JsonLines:
    """An append-only JSON-lines file: each :meth:`append` writes whole lines and
    fsyncs; :meth:`read` ignores a torn last line of a killed writer; :meth:`truncate`
    atomically keeps the rows a predicate accepts (e.g. iterations before a resume)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, *rows: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r, default=str) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        with open(self.path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # torn final line of a killed run
        return out

    def truncate(self, keep) -> None:
        if self.path.is_file():
            atomic_write_text(self.path, "".join(json.dumps(r, default=str) + "\n" for r in self.read() if keep(r)))


def write_manifest(
    artifact: str | Path, config: dict, seed: int | None, wall_seconds: float, extra: dict | None = None
) -> Path:
    """Write ``<artifact>.manifest.json`` beside a figure or table."""
    import torch

    artifact = Path(artifact)
    manifest = {
        "artifact": artifact.name,
        "config": config,
        "seed": seed,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_seconds": round(float(wall_seconds), 2),
        "host": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()},
    }
    try:  # CPU model and instruction set: where the numbers (and timings) were made
        from .hardware import machine_info

        manifest["host"].update({k: v for k, v in machine_info().items() if k in ("cpu_model", "capability",
                                                                                "logical_cpus", "torch_threads")})
    except Exception:  # noqa: BLE001 - a manifest is never lost for want of CPU details
        pass
    if extra:
        manifest.update(extra)
    return atomic_write_json(artifact.with_name(artifact.name + ".manifest.json"), manifest)
