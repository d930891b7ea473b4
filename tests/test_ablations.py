"""The ablation study's plan, tables and readings, and the noise-health check, on synthetic
inputs with known answers (the end-to-end run is in test_notebooks)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sprpo_lib.paper import ablations as A
from sprpo_lib.paper import claims as C
from sprpo_lib.paper import results as R
from sprpo_lib.paper import sigma as S
from sprpo_lib.paper import tables as T
from sprpo_lib.paper.experiments import plan


def _summary(values: dict[str, dict[tuple[str, float], float]], std: float = float("nan")) -> pd.DataFrame:
    rows = [{"env": "webshop", "method": m, "family": f, "strength": s, "mean": v, "std": std, "n": 1, "retention": 50.0}
            for m, cells in values.items() for (f, s), v in cells.items()]
    return pd.DataFrame(rows)


def test_each_study_has_the_papers_groups_and_a_unique_reference():
    for profile, envs in A.ABLATIONS.items():
        for env, ab in envs.items():
            assert ab.variant(A.REFERENCE).method == "sprpo"
            assert all(g in A.GROUP_TITLES for v in ab.variants for g in v.groups)
    cpu = A.ablation("cpu", "webshop")
    assert [lab for _, lab in cpu.group("components")][-1] == "Full SPrPO*"
    # the cpu study keeps the variants the paper's claims compare: C5's components, C6's strategies
    assert {k for k, _ in cpu.group("components")} == {"full", "rho0", "alpha0", "no_schedule"}
    assert {k for k, _ in cpu.group("strategy")} == {"full", "gaussian_rho", "sam_0.1", "sam_5e-3"}
    assert cpu.variant("rho0").reuse == "vanilla" and cpu.goals(plan("cpu", "webshop")) == plan("cpu", "webshop").tasks
    assert {lab for _, lab in cpu.group("rho")} == {"0 (Vanilla)*", "0.1*"}  # around the profile's rho
    assert {k for k, _ in A.ablation("paper", "webshop").group("alpha")} == {"full", "alpha0", "alpha0.5", "alpha2"}
    assert cpu.variant("gaussian_rho").overrides == ("method.sigma=0.1",)
    with pytest.raises(ValueError, match="no study for profile 'cpu' on 'alfworld'"):
        A.ablation("cpu", "alfworld")
    with pytest.raises(ValueError, match="must be unique and include 'full'"):
        A.Ablation("cpu", "webshop", (A.Variant("x", {}, "sprpo"),))


def test_a_variant_with_the_main_config_is_the_main_run_and_nothing_is_trained(tmp_path):
    """The starred cells: full SPrPO, SAM at 5e-3 and Gaussian at sigma = rho are the main runs
    (found by config equality), rho = 0 is Vanilla; only the remaining variants would train."""
    p = plan("cpu", "webshop")
    main = {(m, s): tmp_path / f"{m}{s}" for m, s in p.runs()}
    ab = A.ablation("cpu", "webshop")
    keep = ("full", "rho0", "sam_5e-3", "gaussian_rho")
    lr_profile = A.Variant("lr_profile", {"lr": (3e-4, "0.0003*")}, "vanilla", settings="clean")  # no overrides
    sub = A.Ablation("cpu", "webshop", (*(v for v in ab.variants if v.key in keep), lr_profile), ab.seeds, ab.tasks)
    runs = A.variant_runs(sub, p, main, runs_root=tmp_path / "never")
    assert runs[("full", 0)] == main["sprpo", 0] and runs[("full", 1)] == main["sprpo", 1]
    assert runs[("rho0", 1)] == main["vanilla", 1] and runs[("sam_5e-3", 0)] == main["sam", 0]
    assert runs[("gaussian_rho", 0)] == main["gaussian", 0] and runs[("lr_profile", 0)] == main["vanilla", 0]
    assert not (tmp_path / "never").exists()
    # Fig. 5 and the tables star exactly these (the paper's starred cells), and name each value
    stars = A.starred(ab, p)
    assert stars == {"full", "rho0", "sam_5e-3", "gaussian_rho"}
    labels = dict(A.star(ab.group("strategy"), stars))
    assert labels["gaussian_rho"] == r"Gaussian $\sigma=\rho=0.1$*" and labels["sam_0.1"] == r"SAM $\rho=0.1$"
    assert labels["sam_5e-3"].endswith("*") and labels["full"].count("*") == 1


def test_ablation_table_bolds_the_best_of_each_group_in_the_papers_layout():
    settings = [("clean", 0.0), ("gaussian", 0.2), ("rtn", 6.0)]
    summ = _summary({"a": {s: 10.0 for s in settings}, "b": {s: 20.0 for s in settings},
                     "c": {("clean", 0.0): 5.0, ("gaussian", 0.2): 30.0, ("rtn", 6.0): 1.0}})
    groups = [("rho sweep", [("a", "0"), ("b", "0.1*")]), ("alpha sweep", [("c", "0"), ("a", "1*")])]
    tex = T.ablation_table(summ, "webshop", groups, settings)
    lines = tex.splitlines()
    assert lines[2] == r"Value & Clean & \shortstack{Gaussian\\$\sigma=.20$} & INT6 \\"
    assert r"\multicolumn{4}{l}{\textit{rho sweep}} \\" in lines and r"\multicolumn{4}{l}{\textit{alpha sweep}} \\" in lines
    row_b = next(ln for ln in lines if ln.startswith("0.1*"))
    assert row_b.count(r"\mathbf") == 3  # best in every column of its group
    row_c = next(ln for ln in lines if ln.startswith("0 &") and "30.00" in ln)
    assert r"\mathbf{30.00}" in row_c and r"\mathbf{5.00}" not in row_c  # group 2: c wins only the Gaussian column
    frame = T.ablation_frame(summ, "webshop", groups, settings)
    assert len(frame) == 4 * 3 and frame.groupby(["group", "column"])["best"].sum().min() >= 1


@pytest.mark.parametrize("diff,lo,hi,mde,expected,text", [
    (5.0, 1.0, 9.0, 4.0, 3.0, "agrees (interval above 0)"),
    (-5.0, -9.0, -1.0, 4.0, 3.0, "opposite sign to the paper (interval below 0)"),
    (1.0, -3.0, 5.0, 9.0, 3.0, "not resolved; the paper's difference is below this design's detectable 9.0 pp"),
    (4.0, -1.0, 12.0, 8.0, 11.0, "not resolved, though the design could detect the paper's difference"),
    (-4.0, -8.0, -0.5, 3.0, -2.0, "agrees (interval below 0)"),
    (2.1, 0.0, 6.2, 5.6, 11.4, "not resolved; smaller than the paper's: the interval leaves out +11.4"),
    (0.0, 0.0, 0.0, math.nan, 10.1, "no difference observed; this design cannot detect differences"),
    (0.0, 0.0, 0.0, 8.7, 0.0, "no difference observed; this design cannot detect less than 8.7 pp"),
    (4.2, 4.2, 4.2, math.nan, 3.0, "not resolved: an interval of zero width is no evidence either way; this design "
                                   "cannot detect differences"),
])
def test_reading_of_a_claim_follows_its_interval(diff, lo, hi, mde, expected, text):
    assert C.reading(diff, lo, hi, mde, expected) == text


def test_a_zero_width_reading_names_a_pooled_mde_as_such():
    assert C.reading(0.0, 0.0, 0.0, 12.3, 9.0, 0, 0, 1.0, True) == (
        "no difference observed; this design cannot detect less than 12.3 pp (pooled over the comparison's settings)")
    grid = C.claims_grid(pd.DataFrame([{"env": "webshop", "claim": "c", "versus": "SAM", "setting": "s", "paper": 9.0,
                                        "diff": 0.0, "lo": 0.0, "hi": 0.0, "mde80": 12.3, "mde_pooled": True,
                                        "tasks": 20, "reading": "no difference observed"}]), profile="cpu")
    assert "+0.0 [+0.0, +0.0] / ~12 / +9.0" in grid


@pytest.mark.parametrize("diff,lo,hi,mde,expected,counts,text", [
    # the committed SPrPO - SAM cell: below 0 on 4 discordant goals, all one way (p = 0.125)
    (-16.7, -33.3, -4.2, 21.0, 10.9, (0, 4, 0.125),
     "not resolved: the interval is below 0 but the exact sign test on the 4 discordant goals gives p = 0.125"),
    (5.0, 1.0, 9.0, 4.0, 3.0, (8, 0, 0.0078125), "agrees (interval above 0)"),
    (-5.0, -9.0, -1.0, 4.0, 3.0, (1, 9, 0.021484375), "opposite sign to the paper (interval below 0)"),
    # a bound at 0 only because no discordant goal went the other way: never "smaller than the paper's"
    (2.1, 0.0, 6.2, 5.6, 11.4, (3, 0, 0.25),
     "not resolved: all 3 discordant goals favour the first policy, whose bound at 0 says only that none favoured "
     "the other (exact sign test p = 0.25); this design cannot detect less than 5.6 pp"),
    (2.1, -2.0, 6.2, 5.6, 11.4, (3, 1, 0.625), "not resolved; smaller than the paper's: the interval leaves out +11.4"),
])
def test_reading_needs_the_sign_test_and_degenerate_bounds_say_so(diff, lo, hi, mde, expected, counts, text):
    assert C.reading(diff, lo, hi, mde, expected, *counts) == text
    grid = C.claims_grid(pd.DataFrame([{"env": "webshop", "claim": "c", "versus": "SAM", "setting": "s",
                                        "paper": expected, "diff": diff, "lo": lo, "hi": hi, "mde80": mde,
                                        "tasks": 24, "reading": text}]), profile="cpu")
    # the dagger (the legend's, plus one in the cell) only where the interval straddles 0 and leaves out the paper's
    assert grid.count("\u2020") == 1 + text.startswith("not resolved; smaller")


def test_claim_rows_take_the_papers_differences():
    paired = pd.DataFrame([{"baseline": "vanilla", "family": "gaussian", "strength": 0.2, "success_diff": 4.0,
                            "success_lo": -1.0, "success_hi": 12.0, "success_mde80": 7.0, "tasks": 200},
                           {"baseline": "warm_start", "family": "clean", "strength": 0.0, "success_diff": 1.0,
                            "success_lo": -1.0, "success_hi": 3.0, "success_mde80": 2.0, "tasks": 200}])
    abl = pd.DataFrame([{"baseline": "no_schedule", "family": "clean", "strength": 0.0, "success_diff": 2.0,
                         "success_lo": -3.0, "success_hi": 7.0, "success_mde80": 14.0, "tasks": 100}])
    rows = C.claim_rows(paired, abl, "webshop")
    assert list(rows.claim) == ["SPrPO keeps more success than Vanilla", "full SPrPO beats w/o scheduling"]
    assert rows.paper.tolist() == pytest.approx([30.13 - 18.73, 60.00 - 52.13])
    md = C.claims_markdown(rows, profile="cpu")
    assert "| +11.4 | +4.0 [-1.0, +12.0] | 7.0 | 200 x 1 (one seed) | not resolved, though" in md
    assert ("| +7.9 | +2.0 [-3.0, +7.0] | 14.0 | 100 x 1 (one seed) | not resolved; smaller than the paper's: the interval "
            "leaves out +7.9 |") in md
    assert rows.paper_source.tolist() == ["Table 1: SPrPO minus Vanilla",
                                          "App. table \"Component ablations\": full SPrPO minus the variant"]
    c6 = C.c6_rows(pd.DataFrame([{"baseline": "sam_0.1", "family": "clean", "strength": 0.0, "success_diff": 0.0,
                                  "success_lo": 0.0, "success_hi": 0.0, "success_mde80": 19.0, "tasks": 20,
                                  "train_seeds": "0"}]), "webshop")
    assert c6.paper_source.iloc[0].startswith("derived: SAM's Table 1 clean success minus 0")
    md6 = C.claims_markdown(pd.concat([rows.assign(train_seeds="0 1 2"), c6]), profile="cpu")
    assert "| +52.3\u2020 |" in md6 and "marked \u2020 for C6 are SAM's Table 1 clean success minus 0" in md6
    assert "200 x 3 |" in md6 and "20 x 1 (one seed)" in md6


def test_claims_cover_both_environments_in_one_grid_each():
    """ALFWorld's Table 1 (no ablation study there) and WebShop's with its ablation; the
    grid puts each comparison in the setting's column with the reading's mark."""
    def p(base, fam, s, d, lo, hi, tasks=24):
        return {"baseline": base, "family": fam, "strength": s, "success_diff": d, "success_lo": lo,
                "success_hi": hi, "success_mde80": 9.0, "tasks": tasks}
    paired = {"alfworld": pd.DataFrame([p("vanilla", "clean", 0.0, 8.0, 2.0, 14.0, 12),
                                        p("vanilla", "sparsegpt", 0.7, -6.0, -10.0, -1.0, 12),
                                        p("sam", "rtn", 6.0, 0.0, -4.0, 6.0, 12)]),
              "webshop": pd.DataFrame([p("vanilla", "gaussian", 0.2, 1.0, -1.0, 3.0)])}
    abl = {"webshop": pd.DataFrame([p("alpha0", "clean", 0.0, 2.0, -3.0, 7.0, 16)])}
    rows = C.claim_table(paired, abl)
    assert rows.env.tolist() == ["alfworld"] * 3 + ["webshop"] * 2
    assert rows.paper.tolist() == pytest.approx([91.85 - 87.59, 58.03 - 41.12, 91.24 - 86.25, 30.13 - 18.73,
                                                 60.00 - 48.80])
    grid = C.claims_grid(rows, profile="cpu", full="figures/claims_cpu.md")
    lines = grid.splitlines()
    alf = lines.index("**ALFWorld** (12 test goals)")
    assert lines[alf + 2] == "| SPrPO minus | Clean | Unstructured pruning r=0.70 | Quantization INT6 |"
    assert lines[alf + 4] == "| Vanilla | **+8.0 [+2.0, +14.0] / 9 / +4.3** | -6.0 [-10.0, -1.0] / 9 / +16.9 (!) |  |"
    assert lines[alf + 5] == "| SAM |  |  | +0.0 [-4.0, +6.0] / 9 / +5.0 |"
    web = lines.index("**WebShop** (16/24 test goals)")
    assert "\u2020" in lines[web + 4] and lines[web + 5].startswith("| w/o sensitivity (alpha = 0) |")
    assert C.claims_markdown(rows, profile="cpu").count("| Claim |") == 2


def test_noise_health_against_hand_computed_limits():
    m = pd.DataFrame({"run": ["r"] * 3, "method": ["sprpo"] * 3, "seed": [0] * 3, "iteration": [0, 1, 2],
                      "xi_rho": [0.1] * 3, "xi_sigma_rms": [0.1, 0.06, 0.14], "xi_sigma_clamped_frac": [0.0, 0.01, 0.05],
                      "valid_rate": [0.5, 0.9, 0.81], "xi_real_flip_frac": [0.0, 0.0, 0.001]})
    h = S.noise_health(m).iloc[0]
    assert h.rms_over_rho_min == pytest.approx(0.6) and h.rms_over_rho_max == pytest.approx(1.4)
    assert h.valid_min_after_0 == pytest.approx(0.81) and h.healthy  # iteration 0's 0.5 does not count
    m.loc[2, "xi_sigma_rms"] = 0.15000000765  # float32 sigma at the clip: within rounding
    assert S.noise_health(m).iloc[0].healthy
    m.loc[2, "xi_sigma_clamped_frac"] = 0.06
    assert not S.noise_health(m).iloc[0].healthy
    assert S.noise_health(m.drop(columns="xi_rho")).empty  # runs without sigma statistics


def test_motivation_figure_draws_the_warm_start_beside_vanilla(tmp_path):
    summ = _summary({"vanilla": {("clean", 0.0): 40.0, ("gaussian", 0.2): 16.0},
                     "warm_start": {("clean", 0.0): 25.0, ("gaussian", 0.2): 20.0}}, std=1.0)
    paths = R.plot_motivation(summ, tmp_path / "fig1", reference="warm_start")
    assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.stat().st_size > 0 for p in paths)
    assert math.isclose(R.MDE80_Z, 2.8016, abs_tol=1e-3)


def test_motivation_figure_marks_bars_measured_on_fewer_goals(tmp_path, monkeypatch):
    summ = _summary({"vanilla": {("clean", 0.0): 40.0, ("gaussian", 0.1): 30.0, ("gaussian", 0.2): 16.0},
                     "warm_start": {("clean", 0.0): 25.0, ("gaussian", 0.1): 20.0, ("gaussian", 0.2): 20.0}})
    summ["tasks"] = [24, 10, 24, 24, 10, 24]
    summ["n"] = [2, 1, 2, 1, 1, 1]
    figs = []
    monkeypatch.setattr(R, "save_figure", lambda fig, path, **kw: figs.append(fig) or [])
    R.plot_motivation(summ, tmp_path / "fig1", reference="warm_start")
    ticks = [t.get_text() for t in figs[0].axes[0].get_xticklabels()]
    assert ticks == ["Clean", "\u03c3=0.10\u2020", "\u03c3=0.20"]
    notes = [t.get_text() for t in figs[0].texts]
    assert notes and "24 goals x 2 training seeds per bar" in notes[0] and "\u2020 10 goals x 1 training seed" in notes[0]
    figs.clear()
    R.plot_motivation(summ.assign(tasks=24, n=2), tmp_path / "fig1", reference="warm_start")
    assert "\u2020" not in "".join(t.get_text() for t in figs[0].axes[0].get_xticklabels())
    assert "\u2020" not in figs[0].texts[0].get_text() and "24 goals x 2 training seeds per bar" in figs[0].texts[0].get_text()


def test_motivation_figure_wears_the_method_colours_and_no_zero_error_bars(tmp_path, monkeypatch):
    """Fig. 1's bars are Vanilla's colour and the warm start's outline its own (one colour per
    method in every figure); single runs get no error bar; the figure passes the figure check."""
    from matplotlib.colors import to_rgba

    from sprpo_lib.paper import figcheck as F

    summ = _summary({"vanilla": {("clean", 0.0): 40.0, ("gaussian", 0.2): 16.0, ("rtn", 6.0): 30.0},
                     "warm_start": {("clean", 0.0): 25.0, ("gaussian", 0.2): 20.0, ("rtn", 6.0): 22.0}}).assign(tasks=12)
    figs = []
    monkeypatch.setattr(R, "save_figure", lambda fig, path, **kw: figs.append(fig) or [])
    R.plot_motivation(summ, tmp_path / "fig1", reference="warm_start")
    from matplotlib.container import BarContainer

    bars, outlines = [c for c in figs[0].axes[0].containers if isinstance(c, BarContainer)]
    assert {p.get_facecolor() for p in bars.patches} == {to_rgba(R.COLORS["vanilla"])}
    assert {p.get_edgecolor() for p in outlines.patches} == {to_rgba(R.COLORS["warm_start"])}
    caps = [ln for c in (bars, outlines) if c.errorbar is not None for ln in c.errorbar.lines[1]]
    assert all(np.isnan(np.asarray(ln.get_ydata(), dtype=float)).all() for ln in caps)  # no zero-height caps
    assert "single runs have none" in figs[0].texts[0].get_text()
    assert F.figure_problems(figs[0]) == []


def test_fig3_rows_per_env_categorical_precision_and_one_marker_per_method(tmp_path, monkeypatch):
    cells = {("clean", 0.0): 40.0, ("gaussian", 0.1): 30.0, ("rtn", 8.0): 39.0, ("rtn", 6.0): 35.0,
             ("rtn", 4.0): 5.0}
    web = _summary({"vanilla": cells, "sprpo": {k: v + 1 for k, v in cells.items()}}).assign(tasks=10)
    alf = web.assign(env="alfworld")
    alf = alf[~((alf.method == "sprpo") & (alf.strength == 6.0))]  # a level not evaluated is a gap in the line
    figs = []
    monkeypatch.setattr(R, "save_figure", lambda fig, path, **kw: figs.append(fig) or [])
    R.plot_curves(pd.concat([web, alf]), ["vanilla", "sprpo"], tmp_path / "fig3", families=("gaussian", "rtn"))
    axes = np.asarray(figs[0].axes).reshape(2, 2)
    assert [ax.get_ylabel() for ax in axes[:, 0]] == ["success (%) - ALFWorld", "success (%) - WebShop"]
    for row in axes:
        rtn = row[1]
        assert [t.get_text() for t in rtn.get_xticklabels()] == ["BF16", "INT8", "INT6", "INT4"]
        lines = {ln.get_label(): ln for ln in rtn.get_lines() if not ln.get_label().startswith("_")}
        assert {k: ln.get_marker() for k, ln in lines.items()} == {"Vanilla": "o", "SPrPO": "D"}
        assert np.round(lines["Vanilla"].get_xdata(), 3).tolist() == [-0.035, 0.965, 1.965, 2.965]  # dodged left
    sp = [ln for ln in axes[0, 1].get_lines() if ln.get_label() == "SPrPO"][0]
    assert np.isnan(sp.get_ydata()[2]) and list(sp.get_ydata()[[0, 1, 3]]) == [41.0, 40.0, 6.0]
    assert not any(ax.containers for ax in axes.flat)  # single runs: no error bars
    assert "single runs have none" in figs[0].texts[-1].get_text() and "10 goals x 1 training seed" in figs[0].texts[-1].get_text()
    # one legend for all rows: a method drawn only in the second row is in it too
    sam_web_only = web[web.method == "vanilla"].assign(method="sam")
    R.plot_curves(pd.concat([sam_web_only, alf]), ["vanilla", "sam", "sprpo"], tmp_path / "f", families=("gaussian", "rtn"))
    assert [t.get_text() for t in figs[-1].legends[0].get_texts()] == ["Vanilla", "SAM", "SPrPO"]



def test_landscape_drop_is_the_centre_minus_the_ring_paired_by_goal():
    """C4 by hand: on 3 goals, Vanilla's drop from the centre of the plane to the mean of its 8
    other points is 1, 0.5, 0 and SPrPO's 0.25, 0.5, 0: Vanilla minus SPrPO = +25 pp, one goal
    for Vanilla's side (sign test p = 1); swapping the two negates it."""
    from sprpo_lib.paper.results import landscape_drop

    grid = [(w1, w2) for w2 in (-0.2, 0.0, 0.2) for w1 in (-0.2, 0.0, 0.2)]
    ring_wins = {"vanilla": (0, 4, 8), "sprpo": (6, 4, 8)}  # off-centre successes per goal, of 8
    rows = []
    for m, wins in ring_wins.items():
        for t, k in enumerate(wins):
            off = iter([True] * k + [False] * (8 - k))
            for w1, w2 in grid:
                ok = True if (w1, w2) == (0.0, 0.0) else next(off)
                rows.append({"env": "webshop", "split": "test", "task_index": t, "family": "plane", "strength": w1,
                             "w2": w2, "seed": 0, "method": m, "train_seed": 0, "success": ok})
    rows = pd.DataFrame(rows)
    got = landscape_drop(rows).iloc[0]
    assert got.success_diff == pytest.approx(25.0) and (got.wins, got.losses, got.sign_p) == (1, 0, 1.0)
    assert got.tasks == 3 and got.success_lo == pytest.approx(0.0) and got.success_hi == pytest.approx(75.0)
    assert landscape_drop(rows, "sprpo", "vanilla").iloc[0].success_diff == pytest.approx(-25.0)
    c4 = C.c4_rows(landscape_drop(rows), "webshop").iloc[0]
    assert c4.id == "C4" and math.isnan(c4.paper) and c4.reading.startswith("not resolved: all 1 discordant goals")
    assert landscape_drop(rows[rows.method == "vanilla"]).empty  # no SPrPO plane: nothing to compare


def test_overview_reads_each_claim_by_its_own_rule():
    """C2 needs 4 of 5 families and C1 one of its settings, each after Holm's correction over the
    claim's settings (a sign test at p = 0.02 alone among 5 settings does not carry C1: 0.1 after
    Holm; one at 0.004 does), C3 is non-inferiority at 2 pp, C4 has a direction and no number, a
    claim without rows is "not measured"."""
    def row(env, cid, diff, lo, hi, paper=5.0, p=0.001, wins=8, losses=0):
        return {"env": env, "id": cid, "claim": "c", "versus": "Vanilla", "setting": f"s{lo}", "paper": paper,
                "diff": diff, "lo": lo, "hi": hi, "mde80": 6.0, "mde_pooled": False, "tasks": 40, "train_seeds": "0 1 2",
                "wins": wins, "losses": losses, "sign_p": p,
                "reading": C.reading(diff, lo, hi, 6.0, paper, wins, losses, p)}

    rows = [row("webshop", "C2", 9.0, 2.0 + k, 15.0) for k in range(4)] + [row("webshop", "C2", 1.0, -5.0, 7.0, p=0.6)]
    rows += [row("alfworld", "C2", 9.0, 2.0 + k, 15.0) for k in range(3)]
    rows += [row("alfworld", "C2", 1.0, -5.0, 7.0, p=0.6)] * 2
    for env, p in (("webshop", 0.02), ("alfworld", 0.004)):
        rows += [row(env, "C1", 9.0, 2.0, 15.0, p=p)] + [row(env, "C1", 1.0, -5.0, 7.0, p=0.6)] * 4
    rows += [row("webshop", "C3", 2.0, -1.5, 6.0), row("alfworld", "C3", 1.0, -3.0, 5.0)]
    rows += [row("webshop", "C4", 3.0, 1.0, 5.0, paper=math.nan)]
    ov = C.overview(pd.DataFrame(rows, columns=C.CLAIM_COLUMNS)).set_index(["id", "env"])["verdict"]
    assert ov["C2", "webshop"] == "agrees (4 of 5 agree, 4 of them after Holm's correction for the 5 settings; " \
        "the claim needs 4)"
    assert ov["C2", "alfworld"].startswith("not resolved (3 of 5 agree, 3 of them after Holm's")
    assert ov["C1", "webshop"] == "not resolved (1 of 5 agree, 0 of them after Holm's correction for the 5 settings)"
    assert ov["C1", "alfworld"] == "agrees (1 of 5 agree, 1 of them after Holm's correction for the 5 settings)"
    assert ov["C3", "webshop"].startswith("agrees") and ov["C3", "alfworld"].startswith("not resolved")
    assert ov["C4", "webshop"] == "agrees" and ov["C4", "alfworld"] == "not measured"
    assert ov["C6", "webshop"] == "not measured" and len(ov) == 2 * len(C.CLAIMS)
    assert C.reading(-3.0, -5.0, -1.0, 6.0, math.nan, 0, 8, 0.01).startswith("opposite sign")
    assert C.reading(0.5, -1.0, 2.0, 6.0, math.nan).startswith("not resolved; the paper gives no number")


def test_fig5_bars_average_each_goal_over_the_perturbed_settings_with_95_intervals(tmp_path, monkeypatch):
    """ablation_bars: a variant's perturbed bar is each goal's mean over the perturbed settings,
    averaged over goals and seeds (hand-computed), inside its two-way interval; a variant evaluated
    at clean alone has none; one seed of identical goals has a zero-width interval.  plot_ablation
    draws each whisker from the bar's interval."""
    settings = [("clean", 0.0), ("gaussian", 0.2), ("rtn", 6.0)]
    rng = np.random.default_rng(0)
    outcome = {("full", s, t, f): bool(rng.random() < 0.4) for s in (0, 1) for t in range(6) for f, _ in settings}
    rows = [{"env": "webshop", "split": "test", "task_index": t, "seed": 0, "method": "full", "train_seed": s,
             "family": f, "strength": st, "success": outcome[("full", s, t, f)], "score": 0.0}
            for s in (0, 1) for t in range(6) for f, st in settings]
    rows += [{"env": "webshop", "split": "test", "task_index": t, "seed": 0, "method": "alpha0", "train_seed": 0,
              "family": f, "strength": st, "success": True, "score": 1.0} for t in range(6) for f, st in settings]
    rows += [{"env": "webshop", "split": "test", "task_index": t, "seed": 0, "method": "lr0", "train_seed": 0,
              "family": "clean", "strength": 0.0, "success": t < 3, "score": 0.0} for t in range(6)]
    bars = R.ablation_bars(pd.DataFrame(rows), settings).set_index(["method", "family"])
    want = 100 * np.mean([np.mean([outcome[("full", s, t, f)] for f in ("gaussian", "rtn")])
                          for s in (0, 1) for t in range(6)])
    full = bars.loc[("full", R.PERTURBED_MEAN)]
    assert full["mean"] == pytest.approx(want) and full["lo"] <= full["mean"] <= full["hi"] and full["n"] == 2
    assert (bars.loc[("alpha0", R.PERTURBED_MEAN)][["mean", "lo", "hi"]] == 100.0).all()
    assert ("lr0", R.PERTURBED_MEAN) not in bars.index and bars.loc[("lr0", "clean"), "mean"] == pytest.approx(50.0)
    figs = []
    monkeypatch.setattr(R, "save_figure", lambda fig, path, **kw: figs.append(fig) or [])
    R.plot_ablation(bars.reset_index(), [("Components", [("full", "Full"), ("lr0", "lr")])], 2, tmp_path / "f5",
                    env="webshop")
    from matplotlib.container import BarContainer

    clean, pert = [c for c in figs[0].axes[0].containers if isinstance(c, BarContainer)]
    whisker = np.asarray(pert.errorbar.lines[2][0].get_segments()[0])[:, 1]
    assert whisker == pytest.approx([full["lo"], full["hi"]])
    note = figs[0].texts[0].get_text()
    assert "95% interval" in note and "mean of 2 settings" in note
    assert note.startswith("Bars: 6 goals x 2 training seeds") and "\u2020 6 goals x 1 training seed" in note
    assert [t.get_text() for t in figs[0].axes[0].get_xticklabels()] == ["Full", "lr\u2020"]  # lr0: one seed


def test_motivation_whiskers_are_each_bars_95_interval(tmp_path, monkeypatch):
    """Fig. 1 from a summary with ``lo``/``hi`` (every bar with its interval, as Fig. 3's points):
    each whisker spans the bar's interval, a single run's too, and the note says so."""
    summ = _summary({"vanilla": {("clean", 0.0): 40.0, ("gaussian", 0.2): 16.0}}).assign(
        tasks=20, lo=[25.0, 5.0], hi=[55.0, 30.0])
    figs = []
    monkeypatch.setattr(R, "save_figure", lambda fig, path, **kw: figs.append(fig) or [])
    R.plot_motivation(summ, tmp_path / "fig1")
    from matplotlib.container import BarContainer

    (bars,) = [c for c in figs[0].axes[0].containers if isinstance(c, BarContainer)]
    spans = [np.asarray(seg)[:, 1].tolist() for seg in bars.errorbar.lines[2][0].get_segments()]
    assert spans == [[25.0, 55.0], [5.0, 30.0]]
    assert "95% interval, training seeds and goals resampled" in figs[0].texts[0].get_text()
