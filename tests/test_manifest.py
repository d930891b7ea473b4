"""Provenance: the commit recorded beside results."""
from __future__ import annotations

import subprocess

import pytest

from sprpo_lib.infra.manifest import NOT_A_CHECKOUT, git_commit


def test_git_commit_dirty_flag_ignores_figure_outputs(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    try:
        git("init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git not available")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.csv").write_text("1\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    clean = git_commit(tmp_path)
    assert len(clean) == 40 and "+dirty" not in clean
    (tmp_path / "figures" / "a.csv").write_text("2\n")  # a rewritten output
    assert git_commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")  # changed code
    assert git_commit(tmp_path) == clean + "+dirty"
    # the project unpacked inside another repository: that repository's commit is not ours
    inner = tmp_path / "unpacked" / "sprpo"
    inner.mkdir(parents=True)
    assert git_commit(inner) == NOT_A_CHECKOUT


def test_git_commit_outside_any_repository(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above is searched
    assert git_commit(tmp_path) == NOT_A_CHECKOUT


def test_atomic_writes_get_the_permissions_open_and_mkdir_would(tmp_path):
    """mkstemp/mkdtemp alone create 0600/0700: results would be unreadable to a group."""
    import stat

    from sprpo_lib.infra.io import atomic_dir, atomic_write_text

    (tmp_path / "plain.txt").write_text("x")
    (tmp_path / "plain_dir").mkdir()
    atomic_write_text(tmp_path / "a.txt", "old")
    atomic_write_text(tmp_path / "a.txt", "new")
    with atomic_dir(tmp_path / "d") as d:
        (d / "f").write_text("1")
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert (tmp_path / "a.txt").read_text() == "new"
    assert mode(tmp_path / "a.txt") == mode(tmp_path / "plain.txt")
    assert mode(tmp_path / "d") == mode(tmp_path / "plain_dir")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
