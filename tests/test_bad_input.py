"""Bad input gets one clear line before anything loads: typed overrides (issue table rows),
each naming the key, the value, the type expected and a valid example."""
from __future__ import annotations

import pytest

from sprpo_lib.train.config import load_config
from sprpo_lib.train.trainer import main as train_main

#: What every manifest states (infra.manifest.DESIGN_KEYS).
DESIGN = {"dtype": "float32", "seeds": {"eval": [0]}, "goals": {"table": 2}}

#: (override, key named, what the message must say)
OVERRIDES = [
    ("method.rho=abc", "method.rho", "expected a finite number"),
    ("rollout.group_size=abc", "rollout.group_size", "expected an integer"),
    ("iterations=abc", "iterations", "expected an integer"),
    ("iterations=2.5", "iterations", "expected an integer"),
    ("speed.skip_zero_adv=maybe", "speed.skip_zero_adv", "expected true or false"),
    ("speed.skip_zero_adv=1", "speed.skip_zero_adv", "expected true or false"),
    ("method.rho=.nan", "method.rho", "expected a finite number"),
    ("method.rho=.inf", "method.rho", "expected a finite number"),
    ("method.rho=[1,", "method.rho", "not valid YAML"),
    ("update.betas=[0.9]", "update.betas", "a list of 2"),
    ("model.dtype=3", "model.dtype", "a string or null"),
    ("eval_every=5", "eval_every", "needs eval_tasks"),
    ("method.nosuch=1", "method.nosuch", "unknown config key"),
    ("iterations=0", "iterations", "expected an integer >= 1"),
    ("update.prefix_min=0", "update.prefix_min", "set as speed.prefix_min"),
]


@pytest.mark.parametrize("override,key,says", OVERRIDES)
def test_bad_override_is_one_line_naming_the_key(override, key, says, capsys):
    rc = train_main(["--profile", "smoke", "--no-progress", override])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert key in err and says in err
    if "expected" in says and "needs" not in says:  # a valid example of the same key, which itself loads
        example = err.split("for example ")[1]
        assert example.startswith(key + "=")
        load_config("smoke", [example])


@pytest.mark.parametrize("override", ["method.rho=1", "threads=null", "update.betas=[0.9, 0.99]", "logger=jsonl",
                                      "speed.skip_zero_adv=false", "eval_tasks=2"])
def test_good_overrides_still_load(override):
    load_config("smoke", [override])


def test_uncached_hub_id_is_one_line_without_network(capsys, monkeypatch, tmp_path):
    """Offline by default: a hub id not in the local cache is one error naming the id and the
    cache, without a download attempt (no retries), unless HF_HUB_OFFLINE=0 is set."""
    import time

    from sprpo_lib.evaluate.cli import main as eval_main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    t0 = time.perf_counter()
    rc = eval_main(["--model", "nosuchorg/nosuchmodel", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "'nosuchorg/nosuchmodel'" in err and "not in the local Hugging Face cache" in err and "HF_HUB_OFFLINE=0" in err
    assert time.perf_counter() - t0 < 10  # no HTTP retries
    assert train_main(["--profile", "smoke", "--no-progress", "model.spec=nosuchorg/nosuchmodel"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nosuchorg/nosuchmodel" in err and "model.spec=" in err


def test_reproduce_only_lists_the_valid_names():
    from sprpo_lib.reproduce import plan

    with pytest.raises(SystemExit, match="its notebooks: 00_quickstart, 01_training.*08_ablations"):
        plan("cpu", only=["99"])


def test_every_parameters_cell_parses_without_a_papermill_warning(caplog):
    import logging

    import papermill as pm

    from sprpo_lib.infra.paths import notebooks_dir

    with caplog.at_level(logging.WARNING):
        for nb in sorted(notebooks_dir().glob("[0-9][0-9]_*.ipynb")):
            assert pm.inspect_notebook(str(nb)), nb
    assert not [r for r in caplog.records if "Unable to parse" in r.getMessage()]


def test_missing_sprpo_home_is_one_line_and_creates_nothing(tmp_path):
    """Each command line, with ``SPRPO_HOME`` naming no folder (the three run side by side)."""
    import os
    import subprocess
    import sys

    argvs = [["sprpo_lib.train", "--profile", "smoke"], ["sprpo_lib.evaluate", "--model", "tiny-qwen2"],
             ["sprpo_lib.reproduce", "--profile", "smoke", "--only", "02"]]
    env = {**os.environ, "SPRPO_HOME": str(tmp_path / "typo")}
    procs = [subprocess.Popen([sys.executable, "-m", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for argv in argvs]
    for argv, proc in zip(argvs, procs):
        err = proc.communicate(timeout=300)[1].strip()
        assert proc.returncode == 2 and len(err.splitlines()) == 1, (argv, err)
        assert "SPRPO_HOME=" in err and "no such folder" in err, (argv, err)
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("layout,names", [
    ("missing", ["does not exist"]),
    ("empty", ["no complete product file pair", "items_shuffle.json"]),
    ("garbage", ["items_shuffle_1000.json is not a whole JSON file"]),
])
def test_webshop_data_errors_name_the_variable_and_the_file(layout, names, tmp_path, monkeypatch, capsys):
    """Data checks run before the model loads; the message names the variable, the file and the
    expected layout, without a traceback."""
    import sprpo_lib.train.trainer as T

    root = tmp_path / "data"
    if layout != "missing":
        root.mkdir()
    if layout == "garbage":
        for n in ("items_shuffle_1000.json", "items_ins_v2_1000.json", "items_human_ins.json"):
            (root / n).write_text("garbage")
    monkeypatch.setenv("WEBSHOP_DATA", str(root))
    monkeypatch.setattr(T, "load_policy", lambda *a, **k: pytest.fail("the model loaded before the data check"))
    assert train_main(["--profile", "smoke", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sprpo-train: error: WEBSHOP_DATA={root}: WebShop data:") and "Traceback" not in err
    assert all(n in err for n in names) and "Expected layout" in err


@pytest.mark.parametrize("damage", ["manifest truncated", "manifest garbage", "artifact edited", "artifact missing"])
def test_a_damaged_figure_or_manifest_is_not_up_to_date(damage, tmp_path):
    """What ``sprpo-reproduce`` checks before it skips a notebook as up to date: every
    artifact it wrote, against the SHA-256 its manifest records."""
    from sprpo_lib.infra.manifest import check_artifact, manifest_path, write_manifest
    from sprpo_lib.reproduce import damaged_artifact

    art = tmp_path / "04_robustness_webshop_rows.csv"
    art.write_text("method,family,strength,success\nvanilla,clean,0.0,1\n")
    write_manifest(art, {"profile": "smoke"}, seed=0, wall_seconds=1.0, extra=DESIGN)
    assert damaged_artifact([str(art)]) is None and check_artifact(art)["file"]["bytes"] == art.stat().st_size
    man = manifest_path(art)
    if damage == "manifest truncated":
        man.write_text(man.read_text()[:40])
    elif damage == "manifest garbage":
        man.write_bytes(b"\xff\xfe garbage")
    elif damage == "artifact edited":
        art.write_text(art.read_text().replace(",1\n", ",0\n"))
    else:
        art.unlink()
    msg = damaged_artifact([str(art)])
    assert msg and (art.name in msg or man.name in msg)


def test_a_figure_restored_from_git_is_not_the_stages_output(tmp_path):
    """A file and its manifest put back to an older, self-consistent state (``git checkout --
    figures/``) pass their own check but not the stamp's record of what the stage wrote: the
    stage runs again instead of leaving the old figure as if it were this pass's."""
    from sprpo_lib.infra.manifest import write_manifest
    from sprpo_lib.reproduce import damaged_artifact, written_digests

    art = tmp_path / "01_training_webshop_metrics.csv"
    art.write_text("method,success\nvanilla,0.5\n")
    write_manifest(art, {"profile": "smoke"}, seed=0, wall_seconds=1.0, extra=DESIGN)
    old = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    art.write_text("method,success\nvanilla,0.6\n")  # this pass's output and manifest
    write_manifest(art, {"profile": "smoke"}, seed=0, wall_seconds=1.0, extra=DESIGN)
    written = written_digests([str(art)])
    assert list(written) == [str(art)] and damaged_artifact([str(art)], written) is None
    for name, data in old.items():  # restored: consistent with its manifest, not with the stamp
        (tmp_path / name).write_bytes(data)
    assert damaged_artifact([str(art)]) is None  # what the manifest check alone sees
    msg = damaged_artifact([str(art)], written)
    assert msg and art.name in msg and "not the file this stage wrote" in msg
    assert written_digests([str(tmp_path / "missing.csv")]) == {}  # nothing recorded, nothing raised


@pytest.mark.parametrize("damage", ["truncated", "edited", "not a table"])
def test_render_only_rows_are_verified_or_one_error_naming_the_file(damage, tmp_path):
    from sprpo_lib.infra.io import CorruptFileError
    from sprpo_lib.infra.manifest import manifest_path, write_manifest
    from sprpo_lib.paper.experiments import load_rows

    art = tmp_path / "04_robustness_webshop_rows.csv"
    art.write_text("method,family,strength,success\n" + "vanilla,clean,0.0,1\n" * 20)
    write_manifest(art, {"profile": "smoke"}, seed=0, wall_seconds=1.0, extra=DESIGN)
    assert len(load_rows(art)) == 20
    if damage == "truncated":
        art.write_text(art.read_text()[:50])
    elif damage == "edited":
        art.write_text(art.read_text().replace("vanilla,clean,0.0,1", "vanilla,clean,0.0,0", 1))
    else:  # no manifest to check against: parsed, and it is not a result table
        manifest_path(art).unlink()
        art.write_text("garbage\n\x01\x02")
    with pytest.raises(CorruptFileError, match=f"corrupt file {art}.*sprpo-reproduce --only"):
        load_rows(art, columns=("method",))


@pytest.mark.parametrize("argv,says", [
    (["model.spec=/no/such"], "model.spec=/data/"),  # names the option sprpo-train has, not --model
    (["--iterations", "0"], "iterations=0: out of range; expected an integer >= 1"),
])
def test_train_command_errors_are_one_line(argv, says, capsys):
    assert train_main(["--profile", "smoke", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("sprpo-train: error:") and says in err, err
