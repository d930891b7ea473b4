"""The robustness-experiment layer (plans, rendering helpers) on crafted inputs, checked
against hand-computed answers."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pandas as pd
import pytest

from sprpo_lib.paper import experiments as X
from sprpo_lib.paper import results as R
from sprpo_lib.paper import stats as S
from sprpo_lib.train.config import config_dict, load_config


def test_plan_lookup_and_validation():
    p = X.plan("cpu", "webshop")
    assert p.runs()[:4] == [("vanilla", 0), ("gaussian", 0), ("sam", 0), ("sprpo", 0)]  # seed-major
    assert p.runs()[4:] == [("vanilla", s) if i % 2 == 0 else ("sprpo", s) for s in (1, 2) for i in (0, 1)]
    assert p.settings()[0] == ("clean", 0.0) and len(p.settings()) == len(set(p.settings()))
    assert ("sparsegpt", 0.4) in p.settings() and ("rtn", 6.0) in p.settings()
    assert X.plan("cpu", "webshop", tasks=5).tasks == 5
    with pytest.raises(ValueError, match="unknown profile"):
        X.plan("huge", "webshop")
    alf = X.plan("cpu", "alfworld")  # ALFWorld: the same policies, ID and OOD games, its Table 1 column
    assert alf.runs() == p.runs() and dict(alf.table)["sparsegpt"] == 0.70 and alf.landscape_grid == p.landscape_grid
    with pytest.raises(ValueError, match="no plan for 'scienceworld'"):
        X.plan("cpu", "scienceworld")
    with pytest.raises(ValueError, match="no training seeds"):
        X.Plan("x", "webshop", methods=("vanilla", "sprpo"), seeds={"vanilla": (0,)})
    with pytest.raises(ValueError, match="landscape_methods"):
        X.Plan("x", "webshop", methods=("vanilla",), seeds={"vanilla": (0,)})
    assert set(X.PLANS["paper"]) == {"alfworld", "webshop"}
    assert dict(X.PLANS["paper"]["alfworld"].table)["sparsegpt"] == 0.70  # Table 1's ALFWorld column


def test_a_pilot_changes_plan_fields_by_name_and_a_misspelt_one_is_one_error():
    """Plan changes as papermill passes them (lists, nested dicts) become the plan's tuples; a
    notebook page applies them to every environment; an unknown field names itself and the fix."""
    from sprpo_lib.paper.notebook import ResultsPage

    p = X.plan("cpu", "webshop", divergence_states=8, divergence_curves={"rtn": [8, 4]}, landscape_grid=[])
    assert (p.divergence_states, p.divergence_curves, p.landscape_grid) == (8, {"rtn": (8, 4)}, ())
    assert X.plan("cpu", "webshop").divergence_states == 16  # the profile's own plan is untouched
    page = ResultsPage("09_divergence", "cpu", ["webshop", "alfworld"], plan_changes={"divergence_states": 3})
    assert [page.plans[e].divergence_states for e in ("webshop", "alfworld")] == [3, 3]
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['divergence_state'\].*divergence_states"):
        X.plan("cpu", "webshop", divergence_state=8)


def test_plans_and_studies_are_read_from_the_profile_yaml(tmp_path, monkeypatch):
    """A profile's ``plan`` and ``ablation`` sections: per-env keys override, dotted keys reach
    into ``curves``, a seed list applies to every method, ``app_c`` is App. C's levels; an
    unknown key is one clear error; the training config ignores both sections."""
    import sprpo_lib.train.config as C
    from sprpo_lib.core.compress import FAMILIES
    from sprpo_lib.paper import ablations as A

    (tmp_path / "t.yaml").write_text(
        "iterations: 1\nplan:\n  seeds: [3]\n  tasks: 4\n  curves: {gaussian: [0.1], rtn: [8, 4]}\n"
        "  per_env:\n    webshop: {tasks: 2, curves.rtn: [6]}\n    alfworld: {methods: [vanilla, sprpo], curves: app_c}\n"
        "ablation:\n  webshop: {rho: 0.2, rhos: [0.0, 0.2], only: [full, alpha0]}\n")
    (tmp_path / "bad.yaml").write_text("plan:\n  taks: 4\n  per_env: {webshop: {}}\nablation:\n  webshop: {rho: 0.1, rhos: [0.1], lr: 1}\n")
    monkeypatch.setattr(C, "PROFILES_DIR", tmp_path)
    ws = X.plan_from_profile("t", "webshop")
    assert ws.tasks == 2 and ws.curves == {"gaussian": (0.1,), "rtn": (6,)} and ws.table == X.TABLE1["webshop"]
    assert ws.seeds == {m: (3,) for m in X.METHOD_ORDER}
    alf = X.plan_from_profile("t", "alfworld")
    assert alf.methods == ("vanilla", "sprpo") and alf.seeds == {"vanilla": (3,), "sprpo": (3,)} and alf.tasks == 4
    assert alf.curves == {f: FAMILIES[f].levels["alfworld"] for f in X.APP_C_CURVES}
    assert [v.key for v in A.study_from_profile("t", "webshop").variants] == ["full", "alpha0"]
    assert A.study_from_profile("t", "alfworld") is None
    assert C.load_config("t").iterations == 1  # the plan sections are no training config
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['taks'\]"):
        X.plan_from_profile("bad", "webshop")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lr'\]"):
        A.study_from_profile("bad", "webshop")
    with pytest.raises(ValueError, match="no plan for 'alfworld'"):
        X.plan_from_profile("bad", "alfworld")


def test_load_rows_missing_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="render_only=False"):
        X.load_rows(tmp_path / "nope.csv")
    rows = pd.DataFrame({"a": [1, 2]})
    X.save_rows(rows, tmp_path / "r.csv")
    assert X.load_rows(tmp_path / "r.csv").equals(rows)


def test_a_computing_pass_replaces_rows_whose_manifest_is_the_previous_computations(tmp_path):
    """A page recomputing its rows over a committed CSV and manifest (a staged rerun) reads back
    what it wrote, rewrites the manifest, and the render-only pass then draws the new rows; a
    new CSV left beside its old manifest (a pass killed before it) is refused when rendering."""
    from sprpo_lib.infra.io import CorruptFileError
    from sprpo_lib.paper.notebook import ResultsPage

    def page(render_only):
        pg = ResultsPage("03_motivation", "smoke", ["webshop"], out_dir=tmp_path, cache_dir=tmp_path / "cache",
                         render_only=render_only)
        pg.runs = lambda env: {}  # the rows below need no trained policy
        return pg

    old = pd.DataFrame({"method": ["vanilla"] * 3, "success": [0, 1, 0]})
    new = pd.DataFrame({"method": ["vanilla"] * 5, "success": [1, 1, 0, 1, 1]})
    first = page(False)
    first.rows(lambda p, runs: old)
    first.manifests([first.stem("webshop", "_rows.csv")])
    second = page(False)
    assert second.rows(lambda p, runs: new)["webshop"].equals(new)  # read back unverified, not refused
    with pytest.raises(CorruptFileError, match="against its manifest"):  # killed here: never served
        page(True).rows(lambda p, runs: pytest.fail("render-only computes nothing"))
    second.manifests([second.stem("webshop", "_rows.csv")])
    assert page(True).rows(lambda p, runs: pytest.fail("render-only computes nothing"))["webshop"].equals(new)


def _rows(outcomes: dict) -> pd.DataFrame:
    """outcomes[(method, family, strength)] = list of successes over task indices 0.."""
    out = []
    for (m, fam, s), succ in outcomes.items():
        for t, v in enumerate(succ):
            out.append({"env": "webshop", "split": "test", "task_index": t, "family": fam, "strength": s,
                        "seed": 0, "method": m, "train_seed": 0, "success": bool(v), "score": float(v),
                        "cell": f"{m}-{fam}-{s}"})
    return pd.DataFrame(out)


def test_pick_examples_follows_the_documented_rule():
    rows = _rows({
        ("vanilla", "clean", 0.0): [1, 1, 1, 0, 1, 1],
        ("sprpo", "clean", 0.0):   [1, 1, 1, 1, 1, 0],
        ("vanilla", "gaussian", 0.2): [1, 0, 1, 0, 0, 0],   # task 1 and 4 differ; task 3 not clean for vanilla
        ("sprpo", "gaussian", 0.2):   [1, 1, 0, 1, 1, 1],   # task 5: sprpo failed clean -> excluded
        ("vanilla", "gaussian", 0.1): [0, 1, 1, 1, 1, 1],
        ("sprpo", "gaussian", 0.1):   [1, 1, 1, 1, 1, 1],
    })
    picks = R.pick_examples(rows, "vanilla", "sprpo", per_family=1, min_pairs=1)
    assert len(picks) == 1
    r = picks.iloc[0]
    # strongest setting first; qualifying tasks (both solved clean: 0, 1, 2, 4): differ at 1 (sprpo), 2 (vanilla), 4 (sprpo)
    assert (r["family"], r["strength"], r["task_index"], r["rule"]) == ("gaussian", 0.2, 1, "strict")
    assert (r["sprpo_only"], r["vanilla_only"], r["eligible"]) == (2, 1, 4)
    assert r["cell_vanilla"] == "vanilla-gaussian-0.2" and r["cell_sprpo"] == "sprpo-gaussian-0.2"
    two = R.pick_examples(rows, "vanilla", "sprpo", per_family=3)
    assert list(two["task_index"]) == [1, 2, 4] and set(two["rule"]) == {"strict"}
    # fewer strict pairs than min_pairs: the relaxed rule adds tasks that differ whatever their clean outcome
    relaxed = R.pick_examples(rows, "vanilla", "sprpo", per_family=1, min_pairs=2)
    assert list(relaxed["rule"]) == ["strict", "relaxed"]
    extra = relaxed.iloc[1]  # the lowest differing task not yet taken, whatever its clean outcome
    assert (extra["task_index"], extra["clean_vanilla"], extra["clean_sprpo"]) == (2, True, True)
    only_relaxed = R.pick_examples(rows[rows["task_index"].isin([3, 5])], "vanilla", "sprpo")  # none solved by both
    assert list(only_relaxed["rule"]) == ["relaxed"] and only_relaxed.iloc[0]["task_index"] == 3
    assert not only_relaxed.iloc[0]["clean_vanilla"]
    none = R.pick_examples(_rows({("vanilla", "clean", 0.0): [1], ("sprpo", "clean", 0.0): [1],
                                  ("vanilla", "rtn", 4.0): [1], ("sprpo", "rtn", 4.0): [1]}))
    md = R.examples_markdown(none, {})
    assert none.empty and "No task qualifies" in md and md.startswith("Selection rule")


def test_examples_markdown_renders_both_trajectories():
    rows = _rows({("vanilla", "clean", 0.0): [1], ("sprpo", "clean", 0.0): [1],
                  ("vanilla", "dropout", 0.05): [0], ("sprpo", "dropout", 0.05): [1]})
    picks = R.pick_examples(rows)
    ep = lambda ok, act: {"split": "test", "task_index": 0, "task_id": "g0", "instruction": "buy a red shirt",  # noqa: E731
                          "success": ok, "score": float(ok), "steps": [
                              {"step": 0, "observation": "Search page", "response": f"<action>{act}</action>",
                               "action": act, "valid": True, "reward": 0.0}]}
    md = R.examples_markdown(picks, {"vanilla-dropout-0.05": [ep(False, "search[blue]")],
                                     "sprpo-dropout-0.05": [ep(True, "search[red shirt]")]})
    assert "buy a red shirt" in md and "search[blue]" in md and "search[red shirt]" in md
    assert "**Vanilla** (failure" in md and "**SPrPO** (success" in md
    assert "1 task(s) were solved by SPrPO only and 0 by Vanilla only, of 1" in md


def test_paired_comparisons_hand_cases():
    n = 20
    rows = _rows({("sprpo", "clean", 0.0): [1] * n, ("vanilla", "clean", 0.0): [1] * n,
                  ("sprpo", "rtn", 4.0): [1] * 10 + [0] * 10, ("vanilla", "rtn", 4.0): [0] * n,
                  ("sam", "clean", 0.0): [1] * n, ("sam", "rtn", 4.0): [1] * 10 + [0] * 10})
    pc = R.paired_comparisons(rows, "sprpo", ["vanilla", "sam", "gaussian"], [("clean", 0.0), ("rtn", 4.0)],
                              n_resamples=2000)
    assert set(pc["baseline"]) == {"vanilla", "sam"}  # gaussian has no rows: skipped
    v = pc[(pc.baseline == "vanilla") & (pc.family == "rtn")].iloc[0]
    assert v["success_diff"] == pytest.approx(50.0) and v["retention_diff"] == pytest.approx(50.0)
    assert v["success_lo"] < 50 < v["success_hi"] and v["success_lo"] > 20
    s = pc[(pc.baseline == "sam") & (pc.family == "rtn")].iloc[0]  # identical outcomes: zero, degenerate interval
    assert (s["success_diff"], s["success_lo"], s["success_hi"]) == (0.0, 0.0, 0.0)
    # SAM differs from SPrPO on no goal at any setting: no MDE can be estimated for the pair
    assert math.isnan(s["success_mde80"]) and not s["mde_pooled"] and v["success_mde80"] > 0 and not v["mde_pooled"]
    c = pc[(pc.baseline == "vanilla") & (pc.family == "clean")].iloc[0]
    assert c["success_diff"] == 0.0 and math.isnan(c["retention_diff"])
    # no goal differs at clean: the pair's MDE, from its one other setting's standard error
    assert c["mde_pooled"] and c["success_mde80"] == pytest.approx(v["success_mde80"])


def test_a_single_policy_is_paired_with_every_seed_of_the_other():
    """The warm start (one policy) against SPrPO's two seeds: the difference is that of the
    means a table shows (SPrPO 75% on seeds 0 and 1 together, the warm start 50%), over both
    seeds' episodes; two methods with several seeds keep to the seeds they share."""
    n = 20
    half = [1] * 10 + [0] * 10
    rows = pd.concat([_rows({("warm_start", "clean", 0.0): half, ("warm_start", "rtn", 4.0): half}),
                      _rows({("sprpo", "clean", 0.0): half, ("sprpo", "rtn", 4.0): [1] * n}),
                      _rows({("sprpo", "clean", 0.0): half, ("sprpo", "rtn", 4.0): half}).assign(train_seed=1)],
                     ignore_index=True)
    pc = R.paired_comparisons(rows, "sprpo", ["warm_start"], [("rtn", 4.0)], n_resamples=2000).iloc[0]
    assert pc["success_diff"] == pytest.approx(25.0) and pc["episodes"] == 2 * n and pc["train_seeds"] == "0 1"
    assert pc["one_seed"] == "warm_start" and pc["interval"] == "training seeds x tasks"
    assert (pc["wins"], pc["losses"]) == (10, 0)
    both, one = S.seed_paired(rows.assign(method=rows["method"].replace({"warm_start": "vanilla"}))
                              .pipe(lambda r: pd.concat([r, r[r.method == "vanilla"].assign(train_seed=2)])),
                              "sprpo", "vanilla")
    assert one is None and set(both["train_seed"]) == {0} and len(both) == 4 * n
    # a baseline trained at one seed: the claims table names it beside the goals x seeds
    from sprpo_lib.paper import claims as C

    pc = R.paired_comparisons(rows.replace({"method": {"warm_start": "gaussian"}}).assign(
        strength=lambda r: r["strength"].where(r["family"] != "rtn", 6.0)), "sprpo", ["gaussian"],
        [("clean", 0.0), ("rtn", 6.0)], n_resamples=200)
    md = C.claims_markdown(C.claim_rows(pc, None, "webshop"), profile="smoke")
    assert "| 20 x 2 (Gaussian: one seed) |" in md and md.count("(Gaussian: one seed)") == 2


def test_perturbation_losses_pair_clean_and_perturbed_over_goals_and_seeds():
    """C1: Vanilla's clean minus perturbed success, by hand on two training seeds."""
    from sprpo_lib.paper import claims as C
    from sprpo_lib.paper.stats import sign_test

    outcomes = {  # (train seed, family, strength) -> success per goal
        (0, "clean", 0.0): [1] * 10 + [0] * 10, (0, "gaussian", 0.2): [0] * 6 + [1] * 4 + [0] * 10,
        (1, "clean", 0.0): [1] * 10 + [0] * 10, (1, "gaussian", 0.2): [1] * 12 + [0] * 8,
        (0, "dropout", 0.05): [1] * 10 + [0] * 10, (1, "dropout", 0.05): [1] * 10 + [0] * 10}
    rows = pd.DataFrame([{"env": "webshop", "split": "test", "task_index": t, "family": f, "strength": s, "seed": 0,
                          "method": m, "train_seed": k, "success": bool(v if m == "vanilla" else 1 - v)}
                         for m in ("vanilla", "sprpo") for (k, f, s), succ in outcomes.items()
                         for t, v in enumerate(succ)])
    got = R.perturbation_losses(rows, "vanilla", [("gaussian", 0.2), ("dropout", 0.05), ("fisher", 0.2)],
                                n_resamples=2000).set_index("family")
    assert list(got.index) == ["gaussian", "dropout"]  # fisher was not evaluated: skipped
    g = got.loc["gaussian"]
    # clean 20 of 40 episodes, perturbed 4 + 12 of 40: 10 pp lost; goals 0-5 lost on seed 0, goals 10-11 gained on seed 1
    assert g["success_diff"] == pytest.approx(10.0) and (g["success_clean"], g["success_perturbed"]) == (50.0, 40.0)
    assert (g["wins"], g["losses"], g["sign_p"]) == (6, 2, pytest.approx(sign_test(6, 2)))
    assert g["sign_p"] == pytest.approx(2 * (1 + 8 + 28) / 256)
    assert g["success_lo"] < 10.0 < g["success_hi"] and g["interval"] == "training seeds x tasks"
    d = got.loc["dropout"]  # no goal changed: zero-width interval, the MDE pooled from the other setting
    assert (d["success_diff"], d["success_lo"], d["success_hi"]) == (0.0, 0.0, 0.0)
    assert d["mde_pooled"] and d["success_mde80"] == pytest.approx(g["success_mde80"]) and not g["mde_pooled"]
    paper = {"webshop": {"table1": {"vanilla": {"clean@0": 57.0, "gaussian@0.2": 18.73, "dropout@0.05": 12.2}}}}
    c1 = C.c1_rows(got.reset_index(), "webshop", paper)
    assert list(c1.columns) == C.CLAIM_COLUMNS and c1["diff"].tolist() == [10.0, 0.0]
    assert c1["paper"].tolist() == [38.27, 44.8]
    assert c1.iloc[1]["reading"].startswith("no difference observed")
    assert c1.iloc[0]["reading"].startswith("not resolved")


def test_overhead_means_from_metrics(tmp_path):
    def run(name, method, rows):
        d = tmp_path / name
        d.mkdir()
        cfg = load_config("smoke", **{"method.name": method})
        (d / "config.json").write_text(json.dumps({"config": config_dict(cfg)}))
        (d / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, **r}) + "\n" for i, r in enumerate(rows)))
        return d

    a = run("webshop-vanilla-smoke-seed0", "vanilla", [
        {"rollout_s": 10, "update_s": 4, "sensitivity_s": 0, "wall_s": 15, "success": 0, "score": 0},
        {"rollout_s": 12, "update_s": 6, "sensitivity_s": 0, "wall_s": 19, "success": 0, "score": 0}])
    b = run("webshop-sprpo-smoke-seed0", "sprpo", [
        {"rollout_s": 11, "update_s": 5, "sensitivity_s": 5, "wall_s": 22, "success": 0, "score": 0}])
    t = R.overhead([a, b]).set_index("method")
    assert t.loc["vanilla", "rollout"] == 11 and t.loc["vanilla", "update"] == 5 and t.loc["vanilla", "total"] == 17
    assert t.loc["sprpo", "update"] == 10 and t.loc["sprpo", "sensitivity"] == 5
    assert t.loc["sprpo", "total_vs_vanilla"] == pytest.approx(22 / 17)
    tex = R.overhead_latex(t.reset_index())
    assert "\\toprule" in tex and "WebShop & Vanilla & 11.0 & 5.0 & 17.0" in tex

    # a contended iteration (half the CPU per wall second of the others) is left out and counted
    c = run("webshop-vanilla-smoke-seed1", "vanilla", [
        {"rollout_s": 10, "update_s": 4, "wall_s": 15, "cpu_per_wall": 1.98, "success": 0, "score": 0},
        {"rollout_s": 40, "update_s": 30, "wall_s": 71, "cpu_per_wall": 0.8, "success": 0, "score": 0},
        {"rollout_s": 12, "update_s": 6, "wall_s": 19, "cpu_per_wall": 1.90, "success": 0, "score": 0}])
    t = R.overhead([c]).set_index("method")
    assert t.loc["vanilla", "total"] == 17 and t.loc["vanilla", "steps"] == 2 and t.loc["vanilla", "excluded"] == 1
    assert R.overhead([c], quiet=None).set_index("method").loc["vanilla", "total"] == pytest.approx(35)
    # a method none of whose iterations ran quiet keeps its row (all its iterations), flagged
    d = run("webshop-sprpo-smoke-seed1", "sprpo", [
        {"rollout_s": 20, "update_s": 20, "wall_s": 44, "cpu_per_wall": 0.9, "success": 0, "score": 0}])
    t = R.overhead([c, d]).set_index("method")
    assert list(t.index) == ["vanilla", "sprpo"] and t.loc["sprpo", "total"] == 44 and t.loc["sprpo", "all_contended"]
    assert not t.loc["vanilla", "all_contended"] and t.loc["vanilla", "excluded"] == 1


def test_landscape_grid_pivot():
    rows = []
    for w1 in (-0.1, 0.0, 0.1):
        for w2 in (-0.1, 0.0, 0.1):
            for t in range(4):
                rows.append({"method": "sprpo", "family": "plane", "strength": w1, "w2": w2, "task_index": t,
                             "success": t < (2 if w1 == w2 else 1)})
    w1, w2, z = R.landscape_grid(pd.DataFrame(rows), "sprpo")
    assert list(w1) == [-0.1, 0.0, 0.1] and list(w2) == [-0.1, 0.0, 0.1]
    assert np.allclose(np.diag(z), 50.0) and z[0, 1] == 25.0


def test_headline_and_readme_block():
    summary = pd.DataFrame([
        {"method": "vanilla", "env": "webshop", "family": "clean", "strength": 0.0, "mean": 40.0, "std": 2.0, "n": 2,
         "retention": 100.0},
        {"method": "vanilla", "env": "webshop", "family": "rtn", "strength": 4.0, "mean": 10.0, "std": float("nan"),
         "n": 1, "retention": 25.0}])
    h = R.headline(summary, pd.DataFrame(), [("rtn", 4.0)], ["vanilla"], env="webshop")
    assert h["methods"]["vanilla"]["rtn@4"] == {"success": 10.0, "std": None, "seeds": 1, "retention": 25.0}
    md = R.headline_markdown(h, ["vanilla"])
    assert "| Method | Clean | Quantization INT4 |" in md and "| Vanilla | 40.0 ± 2.0 | 10.0 (25%) |" in md
    text = "a\n<!-- headline-cpu:begin -->\nold 1.0\n<!-- headline-cpu:end -->\nb\n"
    new = R.replace_block(text, "headline-cpu", md)
    assert "old 1.0" not in new and md.strip() in new and new.startswith("a\n") and new.endswith("b\n")
    with pytest.raises(ValueError, match="markers"):
        R.replace_block("no markers", "headline-cpu", md)
    paired = pd.DataFrame([{"baseline": "vanilla", "family": "rtn", "strength": 4.0, "success_diff": 5.0,
                            "success_lo": -1.0, "success_hi": 9.0, "success_mde80": 12.0}])
    hp = R.headline(summary, paired, [("rtn", 4.0)], ["vanilla"], env="webshop")
    two = "**ALFWorld**\n\n" + R.headline_markdown(hp, ["vanilla"]) + "\n**WebShop**\n\n" + R.headline_markdown(hp, ["vanilla"])
    digest = R.without_paired(two)  # the README's copy: both success tables, no paired table
    assert two.count("+5.0 [-1.0, +9.0]") == 2 and "+5.0" not in digest and R.PAIRED_HEAD not in digest
    assert digest.count("| Vanilla | 40.0 ± 2.0 | 10.0 (25%) |") == 2 and "**WebShop**" in digest


def test_tasks_per_split_counts_the_rows_not_the_plan():
    """The headline's task count is what was evaluated: the fewest distinct tasks of any
    split and setting (a plan of 200 on a split of 40 evaluated 40)."""
    rows = pd.DataFrame([{"split": sp, "family": f, "strength": s, "task_index": t, "method": m}
                         for sp, n in (("valid_seen", 5), ("valid_unseen", 4))
                         for f, s in (("clean", 0.0), ("rtn", 4.0)) for t in range(n) for m in ("a", "b")])
    assert R.tasks_per_split(rows) == 4
    assert R.tasks_per_split(rows[rows["split"] == "valid_seen"]) == 5
    fewer = rows[~((rows["family"] == "rtn") & (rows["task_index"] > 1))]  # a curve strength on 2 tasks
    assert R.tasks_per_split(fewer) == 2
    assert R.tasks_per_split(fewer, [("clean", 0)]) == 4  # the headline's settings only
    with pytest.raises(ValueError, match="no rows at the settings"):
        R.tasks_per_split(rows, [("gaussian", 0.2)])


def test_readme_headline_block_is_the_digest(tmp_path, monkeypatch):
    """sprpo-reproduce copies headline_<profile>.md into the README without its paired tables."""
    from sprpo_lib.reproduce import update_readme

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    summary = pd.DataFrame([{"method": "vanilla", "env": "webshop", "family": "clean", "strength": 0.0, "mean": 40.0,
                             "std": 2.0, "n": 2, "retention": 100.0}])
    paired = pd.DataFrame([{"baseline": "vanilla", "family": "clean", "strength": 0.0, "success_diff": 5.0,
                            "success_lo": -1.0, "success_hi": 9.0, "success_mde80": 12.0}])
    md = R.headline_markdown(R.headline(summary, paired, [], ["vanilla"], env="webshop"), ["vanilla"])
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "headline_cpu.md").write_text(md)
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- headline-cpu:begin -->\nold\n<!-- headline-cpu:end -->\nrest\n")
    assert update_readme("cpu", "figures", readme)
    text = readme.read_text()
    assert "| Vanilla | 40.0 ± 2.0 |" in text and "+5.0" not in text and "old" not in text and text.endswith("rest\n")


def test_readme_claims_block_is_every_claims_verdict_and_links_the_full_table(tmp_path, monkeypatch):
    from sprpo_lib.paper import claims as C
    from sprpo_lib.reproduce import update_readme

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    paired = pd.DataFrame([{"baseline": "vanilla", "family": "clean", "strength": 0.0, "success_diff": 5.0,
                            "success_lo": -1.0, "success_hi": 9.0, "success_mde80": 12.0, "tasks": 24}])
    rows = C.claim_table({"webshop": paired})
    (tmp_path / "figures").mkdir()
    rows.to_csv(tmp_path / "figures" / "claims_cpu.csv", index=False)
    (tmp_path / "figures" / "claims_cpu.md").write_text(C.claims_markdown(rows, profile="cpu"))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- claims-cpu:begin -->\nSTALE\n<!-- claims-cpu:end -->\nrest\n")
    assert update_readme("cpu", "figures", readme)
    text = readme.read_text()
    # C3 (non-inferiority at 2 pp): the lower bound -1.0 is above -2; the claims without rows are not measured
    assert ("| C3: SPrPO's clean success is not more than 2 pp below Vanilla's (Table 1) | **agrees (lower bound above "
            "-2 pp)**: Clean: +5.0 [-1.0, +9.0], MDE 12.0 |") in text and "(figures/claims_cpu.md)" in text
    assert text.count("**not measured**") == len(C.CLAIMS) - 1 and "| Claim | WebShop |" in text
    assert "STALE" not in text and text.endswith("rest\n")


def test_blocks_go_to_the_page_with_their_markers_and_links_resolve_from_it(tmp_path, monkeypatch):
    """update_readme writes each block into whichever page (README or the library's page) has its
    markers; on the page below the root, the block's relative links are rebased so they resolve."""
    from sprpo_lib.reproduce import update_readme

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    (tmp_path / "figures").mkdir()
    (tmp_path / "sprpo_lib").mkdir()
    front, lib = tmp_path / "README.md", tmp_path / "sprpo_lib" / "README.md"
    front.write_text("a\n<!-- notebooks:begin -->\n<!-- notebooks:end -->\n")
    lib.write_text("b\n<!-- plans:begin -->\n<!-- plans:end -->\n<!-- paper-cost:begin -->\n<!-- paper-cost:end -->\n")
    assert update_readme("cpu", "figures")
    assert "| `01_training` |" in front.read_text()
    text = lib.read_text()
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert links and all(link.startswith("../figures/") for link in links)
    assert all((lib.parent / link).is_file() for link in links)  # plans.md, written by the same call


def test_every_relative_link_of_the_two_pages_resolves():
    """The README and the library's page: each relative link names a file or folder of the checkout."""
    from sprpo_lib.infra.paths import package_checkout
    from sprpo_lib.paper.results import DOC_PAGES

    root = package_checkout()
    bad = []
    for rel in DOC_PAGES:
        page = root / rel
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+:", link) and not (page.parent / link).exists():
                bad.append(f"{rel}: {link}")
    assert bad == []


def test_recorded_compute_adds_every_pass_and_counts_a_shared_cell_once(tmp_path, monkeypatch):
    """The stage table's recorded compute, against sums by hand: 01 = its runs' iteration
    wall_s and held-out seconds (a longer run: its own iterations only) + their warm start's seconds
    (collection, cloning, held-out score); a cell in 03's and 04's rows counts for 03 only; each
    record's seconds under the machine class it names, unnamed where it names none; a machine
    without the runs and cells keeps the table it replaces."""
    from sprpo_lib import reproduce as R
    from sprpo_lib.train.config import config_dict, load_config

    out, runs = tmp_path / "figs", tmp_path / "runs"
    run = runs / "cpu" / "train" / "webshop-vanilla-cpu-seed0"
    run.mkdir(parents=True)
    out.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0, "wall_s": 1.5}\n{"iteration": 1, "wall_s": 2.5, "heldout_s": 0.25}\n')
    (run / "config.json").write_text(json.dumps({"config": config_dict(load_config("cpu"))}))
    longer = runs / "cpu" / "train" / "longer" / run.name  # a copy of the run, continued: its new iteration only
    longer.mkdir(parents=True)
    (longer / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text()
                                          + '{"iteration": 2, "wall_s": 3.0, "heldout_s": 1.0}\n')
    (longer / "config.json").write_text((run / "config.json").read_text())
    warm = tmp_path / "sft"
    warm.mkdir()
    (warm / "sft_summary.json").write_text(json.dumps({"result": {"seconds": 10.0, "collect": {"seconds": 0.5,
                                                                                                "machine": "amx"}}}))
    (warm / "eval.json").write_text(json.dumps({"seconds": 2.0}))
    monkeypatch.setattr(R, "warm_start_dir", lambda cfg, agent=None: warm)  # where reproduce looks it up
    (out / "01_training_webshop.png.manifest.json").write_text(json.dumps({"config": {"runs": [str(run)]}}))
    (out / "01_training_webshop_longer.png.manifest.json").write_text(json.dumps({"config": {"runs": [str(longer)]}}))
    for key, secs in (("a" * 64, 3.0), ("b" * 64, 4.0)):
        f = runs / "cpu" / "eval_cache" / "cells" / "webshop-clean" / f"{key}.json"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"key": key, "seconds": secs, "rows": []}))
    pd.DataFrame({"cell": ["a" * 12, "a" * 12]}).to_csv(out / "03_motivation_webshop_rows.csv", index=False)
    pd.DataFrame({"cell": ["a" * 12, "b" * 12]}).to_csv(out / "04_robustness_webshop_rows.csv", index=False)
    abl = runs / "cpu" / "train" / "ablation" / "alpha0" / "webshop-sprpo-cpu-seed0"
    abl.mkdir(parents=True)
    (abl / "metrics.jsonl").write_text('{"iteration": 0, "wall_s": 7.0, "machine": "avx2"}\n')
    div = runs / "cpu" / "eval_cache" / "divergence"  # a divergence cell: its pass and the clean side computed with it
    div.mkdir(parents=True)
    (div / f"{'c' * 32}.json").write_text(json.dumps({"key": "c" * 64, "rows": [], "seconds": 5.0, "clean_seconds": 2.0,
                                                   "machine": "amx"}))
    pd.DataFrame({"cell": ["c" * 12, "c" * 12]}).to_csv(out / "09_divergence_webshop_rows.csv", index=False)
    (runs / "cpu" / "eval_cache" / "cells" / "webshop-clean" / f"{'b' * 64}.json").write_text(
        json.dumps({"key": "b" * 64, "seconds": 4.0, "rows": [], "machine": "amx"}))
    got = {nb: dict(c) for nb, c in R.recorded_compute("cpu", out, runs).items()}
    assert got["01_training"] == {R.UNNAMED: 1.5 + 2.5 + 0.25 + 3.0 + 1.0 + 12.0, "amx": 0.5}
    assert got["03_motivation"] == {R.UNNAMED: 3.0} and got["04_robustness"] == {"amx": 4.0}
    assert got["08_ablations"] == {"avx2": 7.0} and got["05_landscape"] == {} and got["09_divergence"] == {"amx": 7.0}
    table = R.stage_table("cpu", out, runs)
    assert "| `01_training` | 0.0 min | 0.3 min (unnamed 0.3, amx 0.0) |" in table
    assert "| `03_motivation` | not run | 0.1 min |" in table
    assert "| `04_robustness` | not run | 0.1 min (amx) |" in table
    assert table.rstrip().endswith("| all | 0.0 min | 0.7 min (unnamed 0.4, amx 0.2, avx2 0.1) | | |")
    again = R.stage_table("cpu", out, tmp_path / "elsewhere", previous=table)  # a machine without the runs and cells
    assert again.splitlines()[2:] == table.splitlines()[2:]


def test_landscape_figure_without_plane_rows_is_one_clear_error(tmp_path):
    """A plan without a landscape (cpu ALFWorld) has no plane rows: one error naming the fix, not a NameError."""
    empty = pd.DataFrame(columns=["method", "family", "strength", "w2", "task_index", "success"])
    with pytest.raises(ValueError, match="landscape_grid"):
        R.plot_landscape(empty, ("vanilla", "sprpo"), tmp_path / "l")
    rows = [{"method": "sprpo", "family": "plane", "strength": w1, "w2": w2, "task_index": 0, "success": w1 == w2}
            for w1 in (-0.1, 0.0, 0.1) for w2 in (-0.1, 0.0, 0.1)]
    assert R.plot_landscape(pd.DataFrame(rows), ("vanilla", "sprpo"), tmp_path / "l")  # one method drawn


def test_the_divergence_grid_is_table_1_then_the_kl_curves(monkeypatch):
    """Plan.divergence_settings: Table 1's settings, then the KL curves' strengths (``app_c`` in a
    profile: every family at App. C's levels, 5/5/4/4/3), each once; without KL curves, the
    success curves'."""
    from sprpo_lib.core.compress import FAMILIES

    p = X.plan("smoke", "webshop")
    assert p.divergence_curves is None and p.divergence_settings()[:5] == [(f, float(s)) for f, s in p.table]
    assert set(p.divergence_settings()) == set(p.settings()) - {("clean", 0.0)}
    section = {"per_env": {"webshop": {}}, "divergence_curves": "app_c", "divergence_curve_seeds": [0]}
    monkeypatch.setattr(X, "profile_section", lambda profile, name: section)
    full = X.plan_from_profile("cpu", "webshop")
    want = [(f, float(s)) for f in X.APP_C_CURVES for s in FAMILIES[f].levels["webshop"]]
    assert [len(FAMILIES[f].levels["webshop"]) for f in X.APP_C_CURVES] == [5, 5, 4, 3, 4]
    assert set(full.divergence_settings()) == set(want) | set(full.table)
    assert len(full.divergence_settings()) == len(set(full.divergence_settings()))
    assert full.divergence_curve_seeds == (0,) and full.curves == {}
    assert X.Plan.from_dict(full.as_dict()) == full


def test_the_kl_curves_measure_every_method_where_success_curves_measure_two():
    """The cpu plan: success curves on Vanilla and SPrPO alone (they cost episodes), the KL curves on
    every method's first seed and the warm start (T1-KL along Fig. 3's strengths needs Gaussian and
    SAM); without divergence_curve_methods the KL curves follow curve_methods."""
    p = X.plan("cpu", "webshop")
    assert p.curve_methods == ("vanilla", "sprpo")
    on = {k for k in p.runs() if p.on_kl_curve(*k)}
    assert on == {(m, 0) for m in p.methods} and p.on_kl_curve("warm_start", 0)
    old = dataclasses.replace(p, divergence_curve_methods=None)
    assert {k for k in old.runs() if old.on_kl_curve(*k)} == {("vanilla", 0), ("sprpo", 0)}
    everyone = dataclasses.replace(p, curve_methods=None, divergence_curve_methods=None, divergence_curve_seeds=None)
    assert all(everyone.on_kl_curve(*k) for k in everyone.runs())
    with pytest.raises(ValueError, match="divergence_curve_methods: \\['sgd'\\] are not trained"):
        dataclasses.replace(p, divergence_curve_methods=("vanilla", "sgd"))
    with pytest.raises(ValueError, match="curve_methods"):
        dataclasses.replace(p, curve_methods=("vanila",))


def test_result_rows_read_back_the_policy_hashes_as_text(tmp_path):
    """An all-digit hash with a leading zero, or one that looks like a float, reads back as written."""
    import pandas as pd

    from sprpo_lib.paper.experiments import load_rows, save_rows

    rows = pd.DataFrame({"method": ["vanilla", "sprpo"], "model_hash": ["012345678901", "012345678901"],
                         "adapter_hash": ["1234e5678901", "000000000042"]})
    save_rows(rows, tmp_path / "r.csv")
    back = load_rows(tmp_path / "r.csv", columns=("method",))
    assert back["model_hash"].tolist() == rows["model_hash"].tolist()
    assert back["adapter_hash"].tolist() == rows["adapter_hash"].tolist()
