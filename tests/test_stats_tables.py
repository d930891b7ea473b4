"""Statistics and tables on crafted data with closed-form answers: seed mean and sample
std, retention, paired bootstrap intervals, bold-best with ties, the paper's layouts."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sprpo_lib.paper import stats, tables


def episodes(method: str, train_seed: int, family: str, strength: float, successes: list[int],
             env: str = "webshop", split: str = "test", eval_seeds=(0,)) -> list[dict]:
    return [{"method": method, "train_seed": train_seed, "env": env, "split": split, "task_index": i,
             "family": family, "strength": strength, "seed": s, "success": bool(v), "score": float(v)}
            for s in eval_seeds for i, v in enumerate(successes)]


def k_of(n: int, k: int) -> list[int]:
    return [1] * k + [0] * (n - k)


# ----------------------------------------------------------------------------- mean, std, retention
def test_seed_mean_and_sample_std_reproduce_the_paper():
    """ALFWorld Vanilla clean 87.59 +- 0.97: 238, 239, 243 of 274 tasks (ddof = 1)."""
    rows = pd.DataFrame([r for seed, k in enumerate((238, 239, 243))
                         for r in episodes("vanilla", seed, "clean", 0.0, k_of(274, k), env="alfworld")])
    s = stats.summarize(rows)
    assert len(s) == 1 and s["n"].iloc[0] == 3
    assert f"{s['mean'].iloc[0]:.2f}" == "87.59" and f"{s['std'].iloc[0]:.2f}" == "0.97"
    rates = np.array([238, 239, 243]) / 274 * 100
    assert s["std"].iloc[0] == pytest.approx(rates.std(ddof=1))
    assert s["retention"].iloc[0] == pytest.approx(100.0)


def test_policy_success_pools_eval_seeds_and_splits():
    rows = pd.DataFrame(episodes("m", 0, "clean", 0.0, [1, 0, 0, 0], split="valid_seen", eval_seeds=(0, 1))
                        + episodes("m", 0, "clean", 0.0, [1, 1], split="valid_unseen", eval_seeds=(0, 1)))
    overall = stats.policy_success(rows)
    assert overall["success"].iloc[0] == pytest.approx(100 * 6 / 12) and overall["episodes"].iloc[0] == 12
    by_split = stats.policy_success(rows, by=("env", "split")).set_index("split")["success"]
    assert by_split["valid_seen"] == pytest.approx(25.0) and by_split["valid_unseen"] == pytest.approx(100.0)


def test_retention_is_the_ratio_of_seed_means():
    rows = []
    for seed, (clean, pert) in enumerate(((10, 5), (6, 1))):  # of 10 tasks
        rows += episodes("vanilla", seed, "clean", 0.0, k_of(10, clean))
        rows += episodes("vanilla", seed, "gaussian", 0.2, k_of(10, pert))
    s = stats.summarize(pd.DataFrame(rows)).set_index("family")
    assert s.loc["gaussian", "mean"] == pytest.approx(30.0)
    assert s.loc["gaussian", "retention"] == pytest.approx(100 * 30 / 80)  # 37.5, not mean(50, 16.7) = 33.3
    per = stats.policy_retention(stats.policy_success(pd.DataFrame(rows)))
    got = per[per["family"] == "gaussian"].set_index("train_seed")["retention"]
    assert got[0] == pytest.approx(50.0) and got[1] == pytest.approx(100 / 6)
    # Table 1, WebShop Vanilla, Gaussian sigma = .20: 18.73 / 57.00 -> (32.9)
    summary = pd.DataFrame([{"method": "v", "env": "w", "family": "clean", "strength": 0.0, "mean": 57.00},
                            {"method": "v", "env": "w", "family": "gaussian", "strength": 0.2, "mean": 18.73}])
    assert f"{stats.add_retention(summary)['retention'].iloc[1]:.1f}" == "32.9"


def test_summary_counts_distinct_tasks_per_setting():
    """``tasks`` counts goals (over splits, evaluation and training seeds), so a setting
    measured on fewer goals says so."""
    rows = (episodes("m", 0, "clean", 0.0, [1, 0, 1], split="valid_seen", eval_seeds=(0, 1))
            + episodes("m", 0, "clean", 0.0, [1, 1], split="valid_unseen", eval_seeds=(0, 1))
            + episodes("m", 1, "clean", 0.0, [0, 0, 0], split="valid_seen")
            + episodes("m", 0, "rtn", 4.0, [1]))
    s = stats.summarize(pd.DataFrame(rows)).set_index("family")
    assert s.loc["clean", "tasks"] == 5 and s.loc["rtn", "tasks"] == 1
    assert s.loc["clean", "n"] == 2 and s.loc["rtn", "n"] == 1


def test_single_seed_has_no_std():
    s = stats.summarize(pd.DataFrame(episodes("m", 0, "clean", 0.0, [1, 0])))
    assert s["n"].iloc[0] == 1 and math.isnan(s["std"].iloc[0])


# ----------------------------------------------------------------------------- paired bootstrap
def paired(a_clean, a_pert, b_clean, b_pert, seeds=(0,)):
    rows = []
    for s in seeds:
        rows += episodes("a", s, "clean", 0.0, a_clean) + episodes("a", s, "rtn", 4.0, a_pert)
        rows += episodes("b", s, "clean", 0.0, b_clean) + episodes("b", s, "rtn", 4.0, b_pert)
    return pd.DataFrame(rows)


def test_bootstrap_degenerate_and_two_task_closed_forms():
    n = 8
    res = stats.paired_bootstrap(paired([1] * n, [1] * n, [1] * n, [0] * n), "a", "b", "rtn", 4.0, n_resamples=500)
    assert res["success"] == 100.0 and res["success_ci"] == (100.0, 100.0)
    assert res["retention"] == 100.0 and res["retention_ci"] == (100.0, 100.0)
    # two tasks, per-task difference (0, 100): resampled means are 0, 50, 100 with
    # probabilities 1/4, 1/2, 1/4, so the 95% percentile interval is [0, 100]
    res = stats.paired_bootstrap(paired([1, 1], [1, 1], [1, 1], [1, 0]), "a", "b", "rtn", 4.0, n_resamples=4000)
    assert res["success"] == 50.0 and res["success_ci"] == (0.0, 100.0) and res["tasks"] == 2


def test_bootstrap_standard_error_matches_the_closed_form():
    """The bootstrap distribution of a mean of T per-task differences d_t has standard
    deviation sqrt(mean((d - mean d)^2) / T)."""
    rng = np.random.default_rng(1)
    t = 60
    a = rng.integers(0, 2, t).tolist()
    b = rng.integers(0, 2, t).tolist()
    res = stats.paired_bootstrap(paired([1] * t, a, [1] * t, b), "a", "b", "rtn", 4.0, n_resamples=20_000, seed=3)
    d = 100.0 * (np.array(a) - np.array(b))
    assert res["success"] == pytest.approx(d.mean())
    assert res["success_se"] == pytest.approx(math.sqrt(d.var() / t), rel=0.03)
    lo, hi = res["success_ci"]
    assert lo < d.mean() < hi
    assert hi - lo == pytest.approx(2 * 1.96 * math.sqrt(d.var() / t), rel=0.08)  # normal approximation


def test_bootstrap_retention_difference_and_seeding():
    # a keeps 3 of its 4 clean successes (75%), b keeps 1 of 2 (50%): +25 points
    df = paired([1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], seeds=(0, 1))
    res = stats.paired_bootstrap(df, "a", "b", "rtn", 4.0, n_resamples=300, seed=5)
    assert res["retention"] == pytest.approx(25.0) and res["success"] == pytest.approx(50.0)
    assert res["episodes_per_method"] == 8 and res["n_resamples"] == 300
    again = stats.paired_bootstrap(df, "a", "b", "rtn", 4.0, n_resamples=300, seed=5)
    other = stats.paired_bootstrap(df, "a", "b", "rtn", 4.0, n_resamples=300, seed=6)
    assert again == res  # seeded: reproducible
    assert other["success_se"] != res["success_se"]  # another seed draws other resamples
    assert res["retention_undefined"] > 0  # resamples with only task 2 and 3 leave b without clean successes


def test_two_way_bootstrap_carries_training_seed_variance():
    """Hand-computed: a succeeds on both tasks with training seed 0 and on neither with seed
    1, b never.  Every task differs alike (+50 pooled), so resampling tasks alone gives the
    zero-width [50, 50]; resampling the two seeds too gives 0, 50, 100 with probabilities
    1/4, 1/2, 1/4, so the 95% interval is [0, 100] and the standard error 25 *sqrt(2)."""
    rows = []
    for sd, a_succ in ((0, [1, 1]), (1, [0, 0])):
        rows += episodes("a", sd, "clean", 0.0, [1, 1]) + episodes("a", sd, "rtn", 4.0, a_succ)
        rows += episodes("b", sd, "clean", 0.0, [1, 1]) + episodes("b", sd, "rtn", 4.0, [0, 0])
    df = pd.DataFrame(rows)
    tasks_only = stats.paired_bootstrap(df, "a", "b", "rtn", 4.0, n_resamples=4000, seeds=None)
    assert tasks_only["success_ci"] == (50.0, 50.0) and tasks_only["interval"] == "tasks"
    both = stats.paired_bootstrap(df, "a", "b", "rtn", 4.0, n_resamples=20_000, seed=1)
    assert both["success"] == 50.0 and both["success_ci"] == (0.0, 100.0)
    assert both["interval"] == "training seeds x tasks" and both["train_seeds"] == 2
    assert both["success_se"] == pytest.approx(25.0 * math.sqrt(2), rel=0.03)
    assert (both["wins"], both["losses"]) == (2, 0) and both["sign_p"] == 0.5


@pytest.mark.parametrize("wins,losses,p", [(4, 0, 0.125), (0, 5, 0.0625), (6, 0, 0.03125), (3, 3, 1.0),
                                           (0, 0, 1.0), (8, 2, 0.109375)])
def test_exact_sign_test(wins, losses, p):
    """Two-sided exact binomial probabilities, by hand: 2 * P(X <= min) at n, 1/2
    (4 of 4: 2/16; 8 of 10: 2 * 56/1024)."""
    assert stats.sign_test(wins, losses) == pytest.approx(p, rel=1e-12)


def test_bootstrap_refuses_unpaired_data():
    df = paired([1, 1], [1, 0], [1, 1], [0, 0])
    df = df[~((df["method"] == "b") & (df["family"] == "rtn") & (df["task_index"] == 1))]
    with pytest.raises(ValueError, match="same tasks"):
        stats.paired_bootstrap(df, "a", "b", "rtn", 4.0)
    with pytest.raises(ValueError, match="no rows"):
        stats.paired_bootstrap(df, "a", "c", "rtn", 4.0)


# ----------------------------------------------------------------------------- tables
def summary_of(cells: dict) -> pd.DataFrame:
    """{(method, family, strength): (mean, std)} -> a summary with retention."""
    rows = [{"method": m, "env": "webshop", "family": f, "strength": s, "mean": mu, "std": sd, "n": 3}
            for (m, f, s), (mu, sd) in cells.items()]
    return stats.add_retention(pd.DataFrame(rows))


CRAFTED = summary_of({
    ("vanilla", "clean", 0.0): (57.0, 4.39), ("sam", "clean", 0.0): (60.004, 1.0), ("sprpo", "clean", 0.0): (60.0, 0.72),
    ("vanilla", "gaussian", 0.2): (18.73, 3.03), ("sam", "gaussian", 0.2): (15.2, 2.65),
    ("sprpo", "gaussian", 0.2): (30.13, 1.81),
    ("vanilla", "rtn", 8.0): (56.67, 4.67), ("sam", "rtn", 8.0): (float("nan"), float("nan")),
    ("sprpo", "rtn", 8.0): (9.87, 5.46), ("vanilla", "rtn", 4.0): (9.6, 2.31), ("sam", "rtn", 4.0): (9.87, 5.46),
    ("sprpo", "rtn", 4.0): (8.2, 2.42),
})
METHODS = ["vanilla", "sam", "sprpo"]


def test_best_flags_include_ties_at_printed_precision():
    assert tables.best_flags([60.0, 60.004, 59.99]) == [True, True, False]  # 60.00 twice
    assert tables.best_flags([1.0, float("nan"), 0.5]) == [True, False, False]
    assert tables.best_flags([60.0, 60.006]) == [False, True]  # 60.00 < 60.01


def test_main_table_layout_bold_ties_and_retention():
    tex = tables.main_table(CRAFTED, {"webshop": [("clean", 0.0), ("gaussian", 0.2), ("rtn", 4.0)]}, METHODS)
    lines = tex.splitlines()
    assert lines[2] == r"\begin{tabular}{@{}lccc@{}}" and lines[3] == r"\toprule" and lines[-1] == r"\end{tabular}"
    assert r"\providecommand{\meanstd}" in tex and lines[-2] == r"\bottomrule"
    assert r"\textit{WebShop}" in tex and r"& \shortstack{Gaussian\\($\sigma=.20$)}" in tex
    assert r"\shortstack{Quantization\\(INT4)} \\" in tex
    assert r"& \meanstd{57.00}{4.39}" in lines and r"& \meanstd{18.73}{3.03}~(32.9)" in lines
    assert r"& \bestmeanstd{60.00}{1.00}" in lines and r"& \bestmeanstd{60.00}{0.72}" in lines  # tie: both bold
    assert r"& \bestmeanstd{30.13}{1.81}~(50.2)" in lines
    assert r"& \bestmeanstd{9.87}{5.46}~(16.4) \\" in lines  # the best of a column need not be ours
    i = lines.index(r"\rowcolor{blue!8}")
    assert lines[i + 1] == r"\textbf{SPrPO (Ours)}"
    assert sum(ln.startswith(r"& \bestmeanstd") for ln in lines) == 4


def test_main_table_marks_a_method_with_fewer_training_seeds():
    """SAM trained at one seed beside three: a dagger on its name and a note that counts them;
    the warm start (not trained) and equal counts get none."""
    one = CRAFTED.assign(n=CRAFTED["method"].map({"sam": 1}).fillna(3))
    one = pd.concat([one, one[one["method"] == "vanilla"].assign(method="warm_start", n=1)], ignore_index=True)
    tex = tables.main_table(one, {"webshop": [("clean", 0.0), ("gaussian", 0.2)]}, ["warm_start", *METHODS])
    lines = tex.splitlines()
    assert "SAM$^\\dagger$" in lines and "Warm start" in lines and "Vanilla" in lines
    note = lines[lines.index(r"\bottomrule") + 1]
    assert note.startswith(r"\multicolumn{3}{@{}l}{\footnotesize $^\dagger$ SAM: 1 training seed, the others 3")
    assert "$^\\dagger$" not in tables.main_table(CRAFTED, {"webshop": [("clean", 0.0)]}, METHODS)


def test_every_table_states_its_goals_and_daggers_a_method_of_fewer_seeds():
    """Table 1, the appendix and the ablation tables say how many goals stand behind each cell
    (per environment where they differ) and mark a trained method or variant of fewer training
    seeds than the others with a dagger and its count; one design and no goal counts: no note."""
    from sprpo_lib.paper import tables as T

    one = CRAFTED.assign(n=CRAFTED["method"].map({"sam": 1}).fillna(3), tasks=20)
    note = "SAM: 1 training seed, the others 3; no std, and a paired comparison with it uses the shared seeds."
    app = T.appendix_table(one, "webshop", METHODS).splitlines()
    assert app[2] == r"Perturbation & Strength & Vanilla & SAM$^\dagger$ & \textbf{SPrPO} \\"
    assert app[-2] == (r"\multicolumn{5}{@{}l}{\footnotesize $^\dagger$ " + note + r" Goals per cell: 20.} \\")
    two = pd.concat([one, one.assign(env="alfworld", tasks=40)], ignore_index=True)
    main = T.main_table(two, {"webshop": [("clean", 0.0)], "alfworld": [("clean", 0.0)]}, METHODS).splitlines()
    assert main[-2].endswith("Goals per cell: WebShop 20; ALFWorld 40.} \\\\") and note in main[-2]
    assert T.main_frame(two, {"webshop": [("clean", 0.0)]}, METHODS)["tasks"].tolist() == [20, 20, 20]
    abl = T.ablation_table(one, "webshop", [("", [("vanilla", "rho=0"), ("sam", "SAM")])], [("clean", 0.0)])
    assert "SAM$^\\dagger$ & " in abl and "SAM: 1 training seed, the others 3" in abl and "Goals per cell: 20." in abl
    assert "footnotesize" not in T.appendix_table(CRAFTED, "webshop", METHODS)  # one design, no goal counts
    fewer_goals = one.assign(tasks=one["family"].map({"rtn": 10}).fillna(20))  # a row measured on other goals
    rows = [ln.split(" & ")[1] for ln in T.appendix_table(fewer_goals, "webshop", METHODS).splitlines()[3:]
            if " & " in ln and "footnotesize" not in ln]
    assert rows == ["BF16", r"$\sigma=0.20$", "INT8 (10 goals)", "INT4 (10 goals)"]


def test_main_table_stacks_envs():
    two = pd.concat([CRAFTED, CRAFTED.assign(env="alfworld")], ignore_index=True)
    tex = tables.main_table(two, {"webshop": [("clean", 0.0), ("gaussian", 0.2)],
                                  "alfworld": [("clean", 0.0), ("rtn", 8.0)]}, METHODS, highlight=None)
    assert tex.count(r"\midrule") == 3 and r"\textit{ALFWorld}" in tex and r"\rowcolor" not in tex
    with pytest.raises(ValueError, match="same number of columns"):
        tables.main_table(two, {"webshop": [("clean", 0.0)], "alfworld": [("clean", 0.0), ("rtn", 8.0)]}, METHODS)


def test_appendix_table_layout():
    tex = tables.appendix_table(CRAFTED, "webshop", METHODS)
    lines = tex.splitlines()
    assert lines[:3] == [r"\begin{tabular}{@{}llccc@{}}", r"\toprule",
                         r"Perturbation & Strength & Vanilla & SAM & \textbf{SPrPO} \\"]
    body = [ln for ln in lines if "&" in ln][1:]
    assert [ln.split(" & ")[:2] for ln in body] == [["Clean", "BF16"], ["Gaussian", r"$\sigma=0.20$"],
                                                    ["Quantization", "INT8"], ["", "INT4"]]
    assert lines.count(r"\midrule") == 3
    assert body[0].count(r"\mathbf") == 2  # 60.00 tie
    assert r"\ensuremath{\mathbf{56.67}\,{\scriptstyle\pm\,4.67}} & -- & \ensuremath{9.87" in body[2]
    assert body[3].count(r"\mathbf{9.87}") == 1


def test_appendix_groups_and_csv(tmp_path):
    split = pd.concat([CRAFTED.assign(split="valid_seen"), CRAFTED.assign(split="valid_unseen",
                                                                          mean=CRAFTED["mean"] - 1)],
                      ignore_index=True).assign(env="alfworld")
    groups = [("valid_seen", "ID"), ("valid_unseen", "OOD")]
    tex = tables.appendix_table(split, "alfworld", METHODS, groups=groups)
    assert r"\multicolumn{2}{c}{} & \multicolumn{3}{c}{ID} & \multicolumn{3}{c}{OOD} \\" in tex
    assert r"\cmidrule(lr){3-5}\cmidrule(lr){6-8}" in tex and "{@{}llcccccc@{}}" in tex
    frame = tables.appendix_frame(split, "alfworld", METHODS, groups=groups)
    assert len(frame) == 4 * 2 * 3 and frame["best"].sum() == 2 * (2 + 1 + 1 + 1)
    text = tables.to_csv(frame, tmp_path / "t.csv")
    back = pd.read_csv(tmp_path / "t.csv")
    assert text.startswith("env,group,family,strength,method,mean,std,n,tasks,retention,best")
    pd.testing.assert_frame_equal(back, frame, check_dtype=False)


def test_strength_labels():
    assert tables.strength_label("gaussian", 0.2) == r"$\sigma=0.20$"
    assert tables.strength_label("gaussian", 0.2, short=True) == r"$\sigma=.20$"
    assert tables.strength_label("dropout", 0.05) == "$p=0.05$"
    assert tables.strength_label("sparsegpt", 0.4, short=True) == "$r=.40$"
    assert tables.strength_label("rtn", 6.0) == "INT6" and tables.strength_label("clean", 0.0) == "BF16"
    assert tables.default_levels(CRAFTED) == [("clean", 0.0), ("gaussian", 0.2), ("rtn", 8.0), ("rtn", 4.0)]


def test_hyperparameter_tables_read_the_profiles_and_mark_every_difference():
    """App. B's Tables 2-3: the paper profile equals the paper on every row but its documented
    response budget (64 new tokens: single actions); each cpu value is the profile's own."""
    from sprpo_lib.paper import hparams as H
    from sprpo_lib.train.config import load_config

    shared = H.hparam_frame(H.SHARED).set_index("hyperparameter")
    differs = set(shared.index[shared["differs"].str.contains("paper")])
    assert differs == {"WebShop prompt / response length", "ALFWorld prompt / response length"}
    cpu = load_config("cpu", **{"env.name": "alfworld"})
    assert shared.loc["ALFWorld prompt / response length", "cpu"].endswith(f"/ {cpu.rollout.generation.max_new_tokens}")
    assert shared.loc["Learning rate", "cpu"] == f"{cpu.update.lr:g}" and "cpu" in shared.loc["Learning rate", "differs"]
    pert = H.hparam_frame(H.PERTURBATION)
    assert (pert["paper"] == pert["paper (App. B)"]).all()
    md = H.hparam_markdown(pert)
    assert f"**{load_config('cpu').method.rho:g}**" in md and "**0.005**" not in md
    assert md.startswith("| group | hyperparameter | paper (App. B) | `paper` profile | `cpu` profile |")
    tex = H.hparam_latex(pert, "c", "tab:perturbation-hparams")
    assert r"\label{tab:perturbation-hparams}" in tex and r"SPrPO & Sensitivity exponent $\alpha$ & 1 & 1 & 1 \\" in tex


def test_claims_format_the_papers_difference_alike_from_memory_and_from_the_csv(tmp_path):
    """The claims table (in memory) and the README grid (from the CSV) print the paper's
    difference the same: 10.95 is not 10.950000000000003 in one and 10.95 in the other."""
    import pandas as pd

    from sprpo_lib.paper import claims as C

    paired = pd.DataFrame([{"baseline": "vanilla", "family": "gaussian", "strength": 0.2, "success_diff": 0.0,
                            "success_lo": -10.0, "success_hi": 10.0, "success_mde80": 12.0, "tasks": 12,
                            "train_seeds": "0", "wins": 1, "losses": 1, "sign_p": 1.0}])
    paper = {"alfworld": {"table1": {"sprpo": {"gaussian@0.2": 30.1}, "vanilla": {"gaussian@0.2": 19.15}}}}
    assert 30.1 - 19.15 != 10.95  # the float the paper's two numbers give
    rows = C.claim_rows(paired, None, "alfworld", paper)
    tables.to_csv(rows, tmp_path / "c.csv", digits=3)  # as notebook 08 writes claims_<profile>.csv
    again = pd.read_csv(tmp_path / "c.csv")
    assert float(rows["paper"].iloc[0]) == float(again["paper"].iloc[0])
    grid = C.claims_grid(rows, profile="cpu").splitlines()[-1]
    assert grid == C.claims_grid(again, profile="cpu").splitlines()[-1]


def test_the_first_screen_sentence_counts_the_verdicts():
    import pandas as pd

    from sprpo_lib.paper import claims as C

    rows = pd.DataFrame({"env": ["webshop", "webshop", "alfworld", "alfworld"],
                         "reading": ["agrees (interval above 0)", "not resolved; ...", "opposite sign to the paper (...)",
                                     "no difference observed; ..."]})
    s = C.verdict_sentence(rows, profile="cpu")
    assert "1 of 4 paired comparisons on WebShop and ALFWorld agree" in s and "1 go the other way" in s
    assert "2 resolve nothing" in s
    none = C.verdict_sentence(rows.assign(reading="not resolved"), profile="cpu")
    assert "no SPrPO comparison resolves: all 4" in none and "neither confirm nor refute" in none


def test_crossed_bootstrap_weights_and_means_by_hand():
    """Each replicate draws n units and n seeds (multiplicities sum to n; one seed is never drawn);
    unit weights give the plain mean of the non-missing cells; a replicate's mean is the weighted one."""
    rng = np.random.default_rng(3)
    cs, ct = stats.crossed_weights(rng, 3, 5, 200)
    assert cs.shape == (200, 3) and ct.shape == (200, 5)
    assert (cs.sum(1) == 3).all() and (ct.sum(1) == 5).all()
    one, _ = stats.crossed_weights(rng, 1, 5, 4)
    assert (one == 1).all()
    grid = np.array([[1.0, 2.0, np.nan], [3.0, 4.0, 5.0]])
    flat = stats.crossed_means(grid, np.ones((1, 2)), np.ones((1, 3)), scale=100.0)
    assert flat[0] == pytest.approx(100.0 * np.nanmean(grid))
    w_s, w_t = np.array([[2.0, 0.0]]), np.array([[0.0, 1.0, 3.0]])  # seed 0 twice; units 1 once, 2 three times
    assert stats.crossed_means(grid, w_s, w_t)[0] == pytest.approx(2.0)  # only cell (0, 1) = 2 is both weighted and present


def test_holm_against_its_definition_and_a_worked_example():
    """Holm's step-down: the worked example (0.01, 0.04, 0.03, 0.005) -> (0.03, 0.06, 0.06, 0.02),
    and on random p-values with gaps the definition itself, max over the smaller ones of
    min(1, (m - rank + 1) p), computed by a plain loop; a missing p stays missing, uncounted."""
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    rng = np.random.default_rng(3)
    p = rng.uniform(0, 0.2, 12)
    p[[2, 7]] = np.nan
    have = [i for i in range(12) if not math.isnan(p[i])]
    ranked = sorted(have, key=lambda i: p[i])
    want = {i: max(min(1.0, (len(have) - r) * p[j]) for r, j in enumerate(ranked[: ranked.index(i) + 1]))
            for i in have}
    got = stats.holm(p)
    assert np.isnan(got[[2, 7]]).all() and [got[i] for i in have] == pytest.approx([want[i] for i in have])


def test_bootstrap_p_agrees_with_the_percentile_interval():
    """All replicates above 0: the smallest p the replicates allow, 2/(B+1); centred on 0: 1; and
    p < 0.05 exactly where the 95% percentile interval of well-separated normal replicates
    excludes 0 (shifts of 0.5 and 3 standard errors)."""
    assert stats.bootstrap_p(np.linspace(0.1, 1, 999)) == pytest.approx(2 / 1000)
    assert stats.bootstrap_p(np.array([-1.0, 1.0])) == 1.0
    z = np.random.default_rng(0).standard_normal(20_000)
    for shift in (0.5, 3.0):
        lo, hi = np.quantile(z + shift, [0.025, 0.975])
        assert (stats.bootstrap_p(z + shift) < 0.05) == (lo > 0 or hi < 0)
