"""End-to-end: every numbered notebook runs headlessly through papermill (smoke profile)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from sprpo_lib.infra.io import read_json_lines
from sprpo_lib.infra.paths import notebooks_dir
from sprpo_lib.reproduce import PROFILES, plan, run

NOTEBOOKS = notebooks_dir()


def test_every_notebook_has_one_parameters_cell_short_code_cells_and_is_in_every_profile():
    import nbformat

    names = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    assert names, "no numbered notebooks found"
    for name in names:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, name
        long = [len(c.source.splitlines()) for c in nb.cells if c.cell_type == "code" and len(c.source.splitlines()) > 20]
        assert long == [], f"{name}: code cells of {long} lines; the logic belongs in sprpo_lib.paper"
        for prof in PROFILES.values():
            assert name in prof["notebooks"], (name, prof)


def test_a_notebook_run_with_its_defaults_shows_its_profile_s_whole_plan():
    """Opened in JupyterLab and run as it is, a notebook covers every environment its default profile
    runs it on (a default of one environment redrew only that one's part of a joint file)."""
    import ast

    import nbformat

    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        cell = next(c for c in nbformat.read(path, as_version=4).cells
                    if "parameters" in c.get("metadata", {}).get("tags", []))
        defaults = {t.id: ast.literal_eval(n.value) for n in ast.parse(cell.source).body
                    if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)
                    and isinstance(n.value, (ast.Constant, ast.List))}
        if "envs" not in defaults or "profile" not in defaults:
            continue
        planned = PROFILES[defaults["profile"]]["notebooks"][path.stem].get("envs")
        assert sorted(defaults["envs"]) == sorted(planned), (path.stem, defaults["envs"], planned)


def test_unknown_profile_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown profile"):
        plan("huge")


def test_a_stage_of_one_environment():
    """--envs keeps a notebook's environments that are listed; a notebook left without any is
    not run, one without environments (00, 02) is."""
    full = {p.stem: prm for p, prm in plan("cpu")}
    web = {p.stem: prm for p, prm in plan("cpu", envs=["webshop"])}
    assert set(web) == set(full) and web["04_robustness"]["envs"] == ["webshop"] and web["00_quickstart"] == full[
        "00_quickstart"]
    alf = {p.stem: prm for p, prm in plan("cpu", envs=["alfworld"])}
    assert "08_ablations" not in alf and alf["01_training"]["envs"] == ["alfworld"]
    with pytest.raises(SystemExit, match="--envs"):
        plan("cpu", only=["08"], envs=["alfworld"])


def test_a_render_only_page_takes_the_dtype_from_the_computing_pass_not_the_runs_at_hand(tmp_path):
    """Run folders present while redrawing need not be the ones that computed the cells (a
    retraining in progress): a render-only page states no dtype of its own, so the manifests keep
    the computing pass's; a computing page reads its runs'."""
    from sprpo_lib.infra.io import atomic_write_text
    from sprpo_lib.paper.notebook import ResultsPage

    run_dir = tmp_path / "runs" / "webshop-vanilla-smoke-seed0"
    atomic_write_text(run_dir / "config.json", json.dumps({"dtype": "float16", "config": {"seed": 0}}))
    for render_only, want in ((True, None), (False, {"webshop": ["float16"]})):
        page = ResultsPage("04_robustness", "smoke", ["webshop"], out_dir=tmp_path / "figs",
                           runs_root=tmp_path / "runs", render_only=render_only)
        page._runs["webshop"] = {("vanilla", 0): run_dir}
        assert page.design()["dtype"] == want


def test_overrides_reach_every_notebook_that_trains_or_evaluates():
    """--model and --override (e.g. the paper's engine, rollout.engine=vllm) become config overrides
    of the notebooks that take a profile; the others (00, 02) get none."""
    jobs = {p.stem: prm for p, prm in plan("paper", model="/m", overrides=["rollout.engine=vllm"])}
    assert jobs["01_training"]["overrides"][-2:] == ["model.spec=/m", "rollout.engine=vllm"]
    assert jobs["04_robustness"]["overrides"][-2:] == ["model.spec=/m", "rollout.engine=vllm"]
    assert "overrides" not in jobs["02_theory"]


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
    assert {"config", "seed", "commit", "date", "wall_seconds", "dtype", "seeds", "goals"} <= set(man)
    assert man["config"]["model"] == "tiny-qwen2" and man["dtype"] in ("float32", "bfloat16")
    # second run with the same parameters at a clean commit is skipped; dirty trees rerun
    again = run("smoke", only=["00"], runs_dir=tmp_path / "runs", out_dir=str(out))
    assert again[0]["status"] in {"skipped", "ok"}
    assert (tmp_path / "runs" / "smoke" / "notebooks" / "00_quickstart.ipynb").is_file()


@pytest.fixture(scope="module")
def smoke_01(tmp_path_factory):
    """Notebook 01 on the smoke profile, once for the module: the folder holding its ``runs``
    and ``figs``.  The result notebooks start from a copy of its runs, as a reproduction's
    03-09 find 01's (and train only what 01 does not)."""
    root = tmp_path_factory.mktemp("smoke_01")
    recs = run("smoke", only=["01"], force=True, runs_dir=root / "runs", out_dir=str(root / "figs"))
    assert [r["status"] for r in recs] == ["ok"]
    return root


@pytest.mark.slow
def test_training_notebook_smoke(smoke_01):
    tmp_path = smoke_01
    out = tmp_path / "figs"
    m = pd.read_csv(out / "01_training_webshop_metrics.csv")
    assert set(m.method) == {"vanilla", "sprpo"} and len(m) == 2 * 3  # smoke: 3 iterations per run
    assert m.success.between(0, 1).all() and (m.update_s > 0).all()
    assert (m[m.method == "sprpo"].sensitivity_s > 0).all() and (m[m.method == "vanilla"].sensitivity_s == 0).all()
    runs = sorted(p.name for p in (tmp_path / "runs" / "smoke" / "train").iterdir() if not p.name.startswith("."))
    assert runs == ["alfworld-sprpo-smoke-seed0", "alfworld-vanilla-smoke-seed0", "longer", "webshop-sprpo-smoke-seed0",
                    "webshop-vanilla-smoke-seed0"]  # each beside its hidden lock file (one process per run folder)
    for env in ("webshop", "alfworld"):  # the plan's longer run: Vanilla's run copied and continued to 4 iterations
        base = tmp_path / "runs" / "smoke" / "train" / f"{env}-vanilla-smoke-seed0"
        # records, not frames: read_json makes an all-integral float column int, so the 4th row's dtype leaked
        rows = [read_json_lines(r / "metrics.jsonl") for r in (base, base.parent / "longer" / base.name)]
        assert [r["iteration"] for r in rows[1]] == [0, 1, 2, 3] and rows[1][:3] == rows[0]
    longer = json.loads((out / "01_training_webshop_longer.csv.manifest.json").read_text())
    assert longer["config"]["runs"][0].endswith("longer/webshop-vanilla-smoke-seed0") and longer["longer"] == {"vanilla": [0]}
    assert list(pd.read_csv(out / "01_training_webshop_longer.csv").columns[:3]) == ["env", "method", "iteration"]
    alf = pd.read_csv(out / "01_training_alfworld_metrics.csv")  # ALFWorld: the same page, its own files
    assert set(alf.method) == {"vanilla", "sprpo"} and len(alf) == 2 * 3 and alf.success.between(0, 1).all()
    assert (out / "01_training_alfworld.png").is_file() and (out / "01_training_alfworld_sigma_fisher.csv").is_file()
    s = pd.read_csv(out / "01_training_webshop_summary.csv")
    assert len(s) == 2 and (s.iterations == 3).all()
    assert (out / "01_training_webshop.png").read_bytes()[:4] == b"\x89PNG"
    man = json.loads((out / "01_training_webshop.png.manifest.json").read_text())
    assert man["config"]["profile"] == "smoke" and set(man["run_commits"]) == {r for r in runs if r.startswith("webshop")}
    assert man["dtype"] and man["seeds"] == {"train": [0]} and man["goals"]["heldout"]  # the runs' own records
    for m_path in out.glob("*.manifest.json"):
        rec = json.loads(m_path.read_text())
        assert all(rec.get(k) not in (None, [], {}) for k in ("dtype", "seeds", "goals")), m_path.name
    # SPrPO's sigma figure: per-layer RMS sigma over training, Spearman with Fisher importance per layer
    corr = pd.read_csv(out / "01_training_webshop_sigma_fisher.csv")
    assert set(corr.run) == {"webshop-sprpo-smoke-seed0"} and corr.spearman.between(-1, 1).all()
    assert (out / "01_training_webshop_sigma.png").is_file() and "xi_real_flip_frac" in m and "truncated_frac" in m
    health = pd.read_csv(out / "01_training_webshop_sigma_health.csv")
    assert list(health.run) == ["webshop-sprpo-smoke-seed0"] and health.rms_over_rho_max.iloc[0] <= 1.5 + 1e-9


@pytest.mark.slow
@pytest.mark.timeout(1500)  # seven notebooks on both environments: ~7 min alone on 2 AVX2 cores, twice that shared
def test_result_notebooks_smoke_and_render_only(tmp_path, smoke_01):
    """03-09 end to end on the tiny model (01's policies found, the others trained, cells evaluated
    and cached), then --render-only redraws the same tables from the result CSVs without evaluating."""
    import hashlib
    import shutil

    from sprpo_lib.evaluate import load_episode_log

    out = tmp_path / "figs"
    shutil.copytree(smoke_01 / "runs", tmp_path / "runs")  # 01's runs: 03 trains only Gaussian and SAM
    def finals():  # each run's final/ folder and its mtime (a retrained run writes it again)
        return {p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "runs" / "smoke" / "train").glob("*/final")}

    found = finals()
    assert len(found) == 4
    recs = run("smoke", only=["03", "04", "05", "06", "07", "08", "09"], force=True, runs_dir=tmp_path / "runs",
               out_dir=str(out))
    assert {n: t for n, t in finals().items() if n in found} == found  # reused, not retrained
    assert [r["status"] for r in recs] == ["ok"] * 7
    from sprpo_lib.infra.manifest import DESIGN_KEYS, check_artifact

    for man in out.glob("*.manifest.json"):  # every artifact matches the SHA-256 its manifest records
        assert "file" in check_artifact(man.with_name(man.name[: -len(".manifest.json")])), man
        m = json.loads(man.read_text())  # and states the dtype, the seeds and the goals per point
        assert all(m.get(k) not in (None, [], {}) for k in DESIGN_KEYS), (man.name, {k: m.get(k) for k in DESIGN_KEYS})
    rows = pd.read_csv(out / "04_robustness_webshop_rows.csv")
    assert set(rows.method) == {"vanilla", "gaussian", "sam", "sprpo"}
    per_cell = rows.groupby(["method", "family", "strength"]).size()
    assert (per_cell == 2).all()  # smoke plan: 2 tasks, 1 evaluation seed, every policy on every setting
    assert {("rtn", 6.0), ("sparsegpt", 0.4), ("fisher", 0.2), ("clean", 0.0)} <= set(zip(rows.family, rows.strength))
    # the same tasks for every method (the paired design)
    tasks = rows.groupby("method")["task_index"].apply(lambda s: tuple(sorted(set(s))))
    assert tasks.nunique() == 1
    # every stored cell has its episode log, agreeing with its rows
    for cell, part in rows.groupby("cell"):
        log = load_episode_log(tmp_path / "runs" / "smoke" / "eval_cache", cell)
        assert log is not None and len(log) == len(part)
        got = {(e["split"], e["task_index"]): e["success"] for e in log}
        assert all(got[(r.split, r.task_index)] == r.success for r in part.itertuples())
    tex = (out / "04_robustness_webshop_table1.tex").read_text()
    assert "\\toprule" in tex and "SPrPO (Ours)" in tex and "\\shortstack{Quantization\\\\(INT6)}" in tex
    paired = pd.read_csv(out / "04_robustness_webshop_paired.csv")
    assert set(paired.baseline) == {"vanilla", "gaussian", "sam"} and len(paired) == 3 * 6
    grid = pd.read_csv(out / "05_landscape_webshop_grid.csv")
    assert len(grid) == 2 * 3 * 3 and set(grid.method) == {"vanilla", "sprpo"}
    overhead = pd.read_csv(out / "06_overhead_webshop.csv")
    assert list(overhead.method) == ["vanilla", "gaussian", "sam", "sprpo"] and (overhead.total > 0).all()
    assert (out / "07_examples_webshop.md").is_file() and (out / "03_motivation_webshop.png").is_file()
    head = json.loads((out / "headline_smoke.json").read_text())
    assert set(head["webshop"]["methods"]) == {"vanilla", "gaussian", "sam", "sprpo"}
    # ALFWorld: both held-out splits (ID = valid_seen, OOD = valid_unseen), its own tables and headline block
    alf = pd.read_csv(out / "04_robustness_alfworld_rows.csv")
    assert set(alf.method) == {"vanilla", "sprpo"} and set(alf.split) == {"valid_seen", "valid_unseen"}
    assert (alf.groupby(["method", "family", "strength", "split"]).size() == 2).all()
    id_ood = (out / "04_robustness_alfworld_appendix_id_ood.tex").read_text()
    assert "\\toprule" in id_ood and "ID" in id_ood and "OOD" in id_ood
    assert set(head["alfworld"]["methods"]) == {"vanilla", "sprpo"}
    # the README's budget table counts exactly the episodes the notebooks evaluate
    from sprpo_lib.paper import ablations as A
    from sprpo_lib.paper import experiments as X
    from sprpo_lib.paper.budget import planned_episodes

    for env, r in (("webshop", rows), ("alfworld", alf)):
        planned = planned_episodes(X.plan("smoke", env))
        assert len(r) == planned["table"] + planned["curves"], env
    planned = planned_episodes(X.plan("smoke", "webshop"))
    trained_keys = [v.key for v in A.trained_variants(A.ablation("smoke", "webshop"), X.plan("smoke", "webshop"))]
    abl_rows = pd.read_csv(out / "08_ablations_webshop_rows.csv")
    assert len(abl_rows[abl_rows.method.isin(trained_keys)]) == planned["ablations"] > 0
    both = (out / "04_robustness_table1.tex").read_text()  # Table 1 with both environments' blocks
    assert "ALFWorld" in both and "WebShop" in both and (out / "04_robustness_curves.png").is_file()
    for env in ("alfworld", "webshop"):
        assert_curves_match_table(out, env)
    for name in ("03_motivation_alfworld.png", "05_landscape_alfworld.png", "06_overhead_alfworld.csv",
                 "07_examples_alfworld.md"):
        assert (out / name).is_file(), name
    for name in ("04_robustness_webshop_table1.tex", "05_landscape_webshop.png", "headline_smoke.md"):
        man = json.loads((out / f"{name}.manifest.json").read_text())
        assert {"config", "commit", "date", "wall_seconds", "host"} <= set(man) and man["config"]["profile"] == "smoke"
    # 08: every variant paired with full SPrPO on the same tasks; main runs reused, not retrained
    abl = pd.read_csv(out / "08_ablations_webshop_rows.csv")
    assert set(abl.method) == {"full", "rho0", "alpha0", "sam_5e-3", "lr_profile", "lr0.0003", "scale_relative"}
    assert set(abl[abl.method.str.startswith(("lr", "scale"))].family) == {"clean"}
    cells = {m: set(rows[rows.method == m].cell) for m in ("vanilla", "sprpo", "sam")}
    assert set(abl[abl.method == "rho0"].cell) <= cells["vanilla"] and set(abl[abl.method == "full"].cell) <= cells["sprpo"]
    assert set(abl[abl.method == "sam_5e-3"].cell) <= cells["sam"]  # the main SAM run, found by its config
    assert not set(abl[abl.method == "alpha0"].cell) & cells["sprpo"]  # a trained variant: its own cells
    trained = sorted(p.parent.parent.name for p in (tmp_path / "runs" / "smoke" / "train" / "ablation").glob("*/*/config.json"))
    assert trained == ["alpha0", "lr0.0003", "scale_relative"]
    rules = pd.read_csv(out / "08_ablations_webshop_noise_rules.csv")
    assert set(rules.rule) == {"energy*", "relative"} and rules.xi_sigma_rms.notna().all()
    comp = (out / "08_ablations_webshop_components.tex").read_text()
    assert "\\toprule" in comp and "Full SPrPO*" in comp and "w/o sensitivity" in comp
    ab_paired = pd.read_csv(out / "08_ablations_webshop_paired.csv")
    assert set(ab_paired.baseline) == {"rho0", "alpha0", "sam_5e-3", "lr_profile", "lr0.0003", "scale_relative"}
    assert (ab_paired.success_lo <= ab_paired.success_diff).all() and (ab_paired.success_mde80.isna() | (ab_paired.success_mde80 > 0)).all()
    assert (out / "08_ablations_webshop_fig5.png").read_bytes()[:4] == b"\x89PNG"
    # 09: every policy's KL on the same states and draws, the claims beside their rows, both environments
    div = pd.read_csv(out / "09_divergence_webshop_rows.csv")
    assert set(div.method) == {"vanilla", "gaussian", "sam", "sprpo"} and (div.kl >= 0).all()
    assert div.groupby(["method", "family", "strength", "w2"]).state.apply(tuple).nunique() == 1  # paired by state
    assert {("rtn", 6.0), ("gaussian", 0.1)} <= set(zip(div.family, div.strength)) and (div.family == "plane").any()
    kl_claims = pd.read_csv(out / "09_divergence_webshop_claims.csv")
    assert {"C2-KL", "T1-KL", "C4-KL"} <= set(kl_claims.id) and kl_claims.reading.notna().all()
    assert "pairs" in json.loads((out / "09_divergence_webshop_correlation.json").read_text())
    assert set(pd.read_csv(out / "09_divergence_alfworld_rows.csv").split) == {"valid_seen", "valid_unseen"}
    assert (out / "09_divergence_webshop_curves.png").is_file() and (out / "09_divergence_webshop_surface.png").is_file()
    def rendered():  # every file the notebooks draw (PDFs and PNGs too: no creation date), not the manifests
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()
                if p.name[:2] in ("03", "04", "05", "06", "08", "09", "cl", "he") and not p.name.endswith(".manifest.json")}

    digest = rendered()
    # render-only: nothing evaluated (an empty cache would fail any evaluation), same tables
    shutil.rmtree(tmp_path / "runs" / "smoke" / "eval_cache" / "cells")
    # 03-06 for WebShop alone (ALFWorld's render-only pages: the committed render test): a pass on one
    # environment rewrites its own files and the files gathering both (Table 1, Fig. 3, the headline)
    # byte for byte as the two-environment pass wrote them, and keeps the other's
    again = run("smoke", only=["03", "04", "05", "06", "08"], runs_dir=tmp_path / "runs", out_dir=str(out),
                render_only=True, envs=["webshop"])
    again += run("smoke", only=["09"], runs_dir=tmp_path / "runs", out_dir=str(out), render_only=True)
    assert [r["status"] for r in again] == ["rendered"] * 6
    changed = sorted(n for n, h in rendered().items() if digest.get(n) != h)
    assert changed == [], changed  # the computing pass and the render-only pass: the same bytes


@pytest.fixture(autouse=True)
def notebooks_folder_untouched():
    """No notebook run writes into notebooks/ (JupyterLab runs them there; outputs go to figures/)."""
    before = sorted(p.name for p in NOTEBOOKS.iterdir())
    yield
    assert sorted(p.name for p in NOTEBOOKS.iterdir()) == before


def test_the_package_imports_from_the_notebooks_folder():
    """JupyterLab starts a notebook's kernel in notebooks/: the installed package (pip install -e .)
    is the checkout's, and its project root is the checkout, not the working directory.  What a
    result notebook's first cell imports leaves transformers and TextWorld unloaded (a render-only
    kernel needs neither; they load with a model or an ALFWorld game)."""
    import subprocess
    import sys

    from sprpo_lib.infra.paths import package_checkout

    code = ("import sys, sprpo_lib, sprpo_lib.infra.paths as p; print(sprpo_lib.__file__); print(p.project_root());"
            "from sprpo_lib.paper import experiments, pages, notebook;"
            "print(sorted({'transformers', 'textworld', 'peft'} & set(sys.modules)))")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "SPRPO_HOME")}
    out = subprocess.run([sys.executable, "-c", code], cwd=NOTEBOOKS, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:] + "\nfix: pip install --no-deps -e . (README, first command)"
    where, root, heavy = out.stdout.split("\n")[:3]
    assert where == str(package_checkout() / "sprpo_lib" / "__init__.py") and root == str(package_checkout())
    assert heavy == "[]"


def test_jupyterlab_lists_the_numbered_notebooks():
    """What JupyterLab's file browser shows at the repository root (its contents API)."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    from sprpo_lib.infra.paths import package_checkout

    cm = FileContentsManager(root_dir=str(package_checkout()))
    listed = {m["name"] for m in cm.get("notebooks", content=True)["content"] if m["type"] == "notebook"}
    assert {p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")} <= listed and len(listed) >= 8


@pytest.mark.slow
def test_committed_results_render_byte_identical_from_the_notebooks_folder(tmp_path):
    """``cd notebooks && papermill 0X.ipynb ... -p render_only True`` on the committed cpu results:
    every CSV, LaTeX and Markdown file is written again byte for byte, and nothing lands in
    notebooks/ (the fixture checks)."""
    import hashlib
    import shutil

    import papermill as pm

    from sprpo_lib.infra.paths import figures_dir

    committed = figures_dir()
    out = shutil.copytree(committed, tmp_path / "figures")
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in committed.iterdir()
              if p.suffix in (".csv", ".tex", ".md") and p.name[:2] in ("03", "04", "05", "06", "he")}
    # what rendering reads: the rows of every env, and the overhead tables
    inputs = {p.name for p in committed.glob("*_rows.csv")} | {p.name for p in committed.glob("06_overhead_*.csv")}
    for name in set(digest) - inputs:  # rendering must write these again, not find them
        (out / name).unlink()
    for nb in ("03_motivation", "04_robustness", "05_landscape", "06_overhead"):
        pm.execute_notebook(str(NOTEBOOKS / f"{nb}.ipynb"), str(tmp_path / f"{nb}.ipynb"), cwd=str(NOTEBOOKS),
                            parameters={"profile": "cpu", "envs": ["alfworld", "webshop"], "render_only": True,
                                        "out_dir": str(out),
                                        "cache_dir": str(tmp_path / "no_cache")}, kernel_name="python3",
                            progress_bar=False)
    got = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in digest if (out / name).is_file()}
    assert got == digest
    for env in ("alfworld", "webshop"):  # one cell, one number: Fig. 3's points are Table 1's cells
        assert_curves_match_table(out, env)
    table1 = (out / "04_robustness_table1.tex").read_text()
    assert "ALFWorld" in table1 and "WebShop" in table1
    # (a pass on one environment keeping the other's files: the smoke result test, byte for byte)


def assert_curves_match_table(out, env: str) -> None:
    """Every point of ``04_robustness_<env>_curves.csv`` at a Table 1 setting equals that
    method's cell in ``04_robustness_<env>_table1.csv``, and carries a 95% interval around it."""
    import pandas as pd

    curves = pd.read_csv(out / f"04_robustness_{env}_curves.csv")
    table = pd.read_csv(out / f"04_robustness_{env}_table1.csv")
    curves["strength"] = curves["strength"].where(curves["setting_family"] != "clean", 0.0)
    both = curves.merge(table, left_on=["method", "setting_family", "strength"],
                        right_on=["method", "family", "strength"], suffixes=("_fig", "_table"))
    assert len(both) >= len(table), (len(both), len(table))  # every table cell is drawn
    assert (both["mean_fig"] - both["mean_table"]).abs().max() < 1e-6, both[["method", "family_table", "strength",
                                                                              "mean_fig", "mean_table"]]
    assert ((both["lo"] <= both["mean_fig"] + 1e-9) & (both["mean_fig"] <= both["hi"] + 1e-9)).all()
