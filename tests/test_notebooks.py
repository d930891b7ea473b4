"""End-to-end: every numbered notebook runs headlessly through papermill (smoke profile)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from sprpo_lib.reproduce import NOTEBOOKS, PROFILES, plan, run


def test_every_notebook_has_one_parameters_cell_and_is_in_every_profile():
    import nbformat

    names = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    assert names, "no numbered notebooks found"
    for name in names:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, name
        for prof in PROFILES.values():
            assert name in prof["notebooks"], (name, prof)


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown profile"):
        plan("huge")


@pytest.mark.slow
def test_quickstart_notebook_smoke(tmp_path):
    out = tmp_path / "figs"
    recs = run("smoke", only=["00"], force=True, runs_dir=tmp_path / "runs", out_dir=str(out))
    assert recs[0]["status"] == "ok"
    df = pd.read_csv(out / "00_quickstart_perturbations.csv")
    assert list(df.family) == ["gaussian", "dropout", "fisher", "sparsegpt", "rtn"]
    assert (df.kl_mean > 0).all() and df.top1_agreement.between(0, 1).all()
    png = out / "00_quickstart_perturbations.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    man = json.loads((out / "00_quickstart_perturbations.png.manifest.json").read_text())
    assert {"config", "seed", "commit", "date", "wall_seconds"} <= set(man)
    assert man["config"]["model"] == "tiny-qwen2"
    # second run with the same parameters at a clean commit is skipped; dirty trees rerun
    again = run("smoke", only=["00"], runs_dir=tmp_path / "runs", out_dir=str(out))
    assert again[0]["status"] in {"skipped", "ok"}
    assert (tmp_path / "runs" / "smoke" / "notebooks" / "00_quickstart.ipynb").is_file()


@pytest.mark.slow
def test_training_notebook_smoke(tmp_path):
    out = tmp_path / "figs"
    recs = run("smoke", only=["01"], force=True, runs_dir=tmp_path / "runs", out_dir=str(out))
    assert recs[0]["status"] == "ok"
    m = pd.read_csv(out / "01_training_webshop_metrics.csv")
    assert set(m.method) == {"vanilla", "sprpo"} and len(m) == 2 * 3  # smoke: 3 iterations per run
    assert m.success.between(0, 1).all() and (m.update_s > 0).all()
    assert (m[m.method == "sprpo"].sensitivity_s > 0).all() and (m[m.method == "vanilla"].sensitivity_s == 0).all()
    runs = sorted(p.name for p in (tmp_path / "runs" / "smoke" / "train").iterdir())
    assert runs == ["webshop-sprpo-smoke-seed0", "webshop-vanilla-smoke-seed0"]
    s = pd.read_csv(out / "01_training_webshop_summary.csv")
    assert len(s) == 2 and (s.iterations == 3).all()
    assert (out / "01_training_webshop.png").read_bytes()[:4] == b"\x89PNG"
    man = json.loads((out / "01_training_webshop.png.manifest.json").read_text())
    assert man["config"]["profile"] == "smoke" and set(man["run_commits"]) == set(runs)
