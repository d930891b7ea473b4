"""Provenance: the commit recorded beside results."""
from __future__ import annotations

import json
import subprocess

import pytest

from sprpo_lib.infra.manifest import NOT_A_CHECKOUT, git_commit

#: What every manifest states (infra.manifest.DESIGN_KEYS).
DESIGN = {"dtype": "float32", "seeds": {"eval": [0]}, "goals": {"table": 2}}


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
    (tmp_path / "README.md").write_text("<!-- results:begin -->1<!-- results:end -->\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "README.md").write_text("<!-- bench:begin -->1<!-- bench:end -->\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    clean = git_commit(tmp_path)
    assert len(clean) == 40 and "+dirty" not in clean
    (tmp_path / "figures" / "a.csv").write_text("2\n")  # a rewritten output
    assert git_commit(tmp_path) == clean
    (tmp_path / "README.md").write_text("<!-- results:begin -->2<!-- results:end -->\n")  # its generated blocks
    assert git_commit(tmp_path) == clean
    (tmp_path / "lib" / "README.md").write_text("<!-- bench:begin -->2<!-- bench:end -->\n")  # the library's bench block
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


def test_manifests_name_project_files_relative_to_the_project_root(tmp_path, monkeypatch):
    """A committed manifest names the same run folders in every clone: paths under the project
    root are recorded relative to it (also through a linked runs/ folder, as in a worktree);
    paths outside it (a model folder) are kept as given."""
    from sprpo_lib.infra import paths
    from sprpo_lib.infra.manifest import write_manifest

    root, elsewhere = tmp_path / "clone", tmp_path / "shared-runs"
    (root / "figures").mkdir(parents=True)
    (elsewhere / "cpu" / "train" / "webshop-sprpo-cpu-seed0").mkdir(parents=True)
    (root / "runs").symlink_to(elsewhere)  # a worktree sharing another clone's runs/
    monkeypatch.setenv(paths.HOME_ENV, str(root))
    run = root / "runs" / "cpu" / "train" / "webshop-sprpo-cpu-seed0"
    config = {"runs": [str(run), run], "model": str(tmp_path / "models" / "qwen"), "spec": "smollm2-135m",
              "nested": {"cache_dir": str(root / "runs" / "cpu" / "eval_cache")}}
    m = json.loads(write_manifest(root / "figures" / "fig.png", config, 0, 1.0,
                                  {"run_dirs": {"a": str(run)}, **DESIGN}).read_text())
    assert m["config"]["runs"] == ["runs/cpu/train/webshop-sprpo-cpu-seed0"] * 2
    assert m["config"]["nested"]["cache_dir"] == "runs/cpu/eval_cache"
    assert m["config"]["model"] == str(tmp_path / "models" / "qwen") and m["config"]["spec"] == "smollm2-135m"
    assert m["run_dirs"] == {"a": "runs/cpu/train/webshop-sprpo-cpu-seed0"}
    assert str(tmp_path) not in json.dumps({k: v for k, v in m.items() if k != "config"})


def test_a_writer_that_states_no_dtype_seeds_or_goals_is_refused(tmp_path):
    """Every manifest states the dtype, the seeds and the goals per point: a writer that leaves one
    out gets one error naming it, and not_applicable(why) states an exception."""
    from sprpo_lib.infra.manifest import DESIGN_KEYS, not_applicable, write_manifest

    art = tmp_path / "t.csv"
    art.write_text("a\n1\n")
    for left_out in DESIGN_KEYS:
        with pytest.raises(ValueError, match=f"states no {left_out}"):
            write_manifest(art, {}, 0, 1.0, {k: v for k, v in DESIGN.items() if k != left_out})
    m = json.loads(write_manifest(art, {}, 0, 1.0, {**DESIGN, "goals": not_applicable("one prompt")}).read_text())
    assert m["dtype"] == "float32" and m["goals"] == "n/a: one prompt" and m["seeds"] == {"eval": [0]}


def test_the_top_level_seed_is_written_only_where_one_seed_made_the_file(tmp_path):
    """A file made from one seed records it; one made from several (seed None) has no top-level
    ``seed`` (never a bare null), and its ``seeds`` block lists them."""
    from sprpo_lib.infra.manifest import write_manifest

    art = tmp_path / "t.csv"
    art.write_text("a\n1\n")
    assert json.loads(write_manifest(art, {}, 3, 1.0, DESIGN).read_text())["seed"] == 3
    m = json.loads(write_manifest(art, {}, None, 1.0, {**DESIGN, "seeds": {"train": [0, 1, 2]}}).read_text())
    assert "seed" not in m and m["seeds"] == {"train": [0, 1, 2]}
