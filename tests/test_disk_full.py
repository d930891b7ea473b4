"""A full disk is survived: a write that finds no space leaves no partial file a later run
could read as valid, the command says so in one line naming the folder and the space
needed, and once there is space the same command resumes to the very adapter an
uninterrupted run writes.  On a small tmpfs (skipped where mounting is not allowed)."""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from sprpo_lib.infra.io import DiskFullError, JsonLines, atomic_write_bytes, free_bytes
from sprpo_lib.train.trainer import main as train_main


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs, unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True,
                              text=True, check=False)
    except OSError as err:
        pytest.skip(f"no mount command here ({err})")
    if done.returncode:
        pytest.skip(f"mounting a tmpfs is not allowed here: {done.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all but about ``leave`` bytes of ``disk``'s free space."""
    filler = disk / "filler"
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free_bytes(disk) - leave))
    return filler


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_failed_writes_leave_no_partial_file(small_disk):
    old = atomic_write_bytes(small_disk / "a.json", b'{"old": 1}\n')
    log = JsonLines(small_disk / "log.jsonl")
    log.append_rows({"i": 0}, {"i": 1})
    before = log.path.read_bytes()
    filler = fill(small_disk, 20_000)
    with pytest.raises(DiskFullError) as err:
        atomic_write_bytes(old, b"x" * 100_000)
    assert old.read_bytes() == b'{"old": 1}\n' and sorted(p.name for p in small_disk.iterdir()) == [
        "a.json", "filler", "log.jsonl"]  # the old file whole, no temporary left
    assert str(small_disk) in str(err.value) and "needed" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DiskFullError):
        log.append_rows({"i": 2, "pad": "y" * 100_000})
    assert log.path.read_bytes() == before  # cut back: no torn line for the next append to follow
    filler.unlink()
    log.append_rows({"i": 3})
    assert [r["i"] for r in log.read_rows()] == [0, 1, 3]


def test_training_survives_a_full_disk_and_resumes_to_the_same_adapter(small_disk, tmp_path, capsys):
    args = ["--profile", "smoke", "--method", "sprpo", "--no-progress"]
    ref = tmp_path / "ref"
    assert train_main([*args, "--out", str(ref)]) == 0
    run = small_disk / "run"
    filler = fill(small_disk, 155_000)  # a third of the run's ~450 kB: it fails at its first checkpoint
    capsys.readouterr()
    assert train_main([*args, "--out", str(run)]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("sprpo-train")]
    assert len(lines) == 1 and lines[0].startswith(f"sprpo-train: error: no space left on the disk of {run}")
    assert "needed" in lines[0] and "free" in lines[0]
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp") or p.name.startswith(".")]  # nothing partial
    filler.unlink()
    assert train_main([*args, "--out", str(run)]) == 0
    for name in ("final/adapter/adapter_model.safetensors", "final/adapter/adapter_config.json"):
        assert sha(run / name) == sha(ref / name), name
    last = (ref / "checkpoints" / "latest").read_text().strip()
    for f in ("adapter/adapter_model.safetensors", "optimizer.pt", "method.safetensors"):
        assert sha(run / "checkpoints" / last / f) == sha(ref / "checkpoints" / last / f), f
