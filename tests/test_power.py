"""Power analysis (:mod:`sprpo_lib.paper.power`) against hand-computed ANOVA, simulation
and a brute-force design search."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from sprpo_lib.paper import power as P


def test_components_of_a_hand_computed_matrix():
    """2 seeds x 3 goals: grand mean 3, seed means (2, 4), goal means (2, 3, 4), residuals
    (+-0.5 / 0 / -+0.5): MS_seed = 3 * 2 / 1 = 6, MS_goal = 2 * 2 / 2 = 2, MS_cell =
    1 / 2 = 0.5, so var_seed = (6 - 0.5) / 3, var_goal = (2 - 0.5) / 2, var_cell = 0.5."""
    d = np.array([[1.5, 2.0, 2.5], [2.5, 4.0, 5.5]])
    c = P.variance_components(d)
    assert c.var_seed == pytest.approx(5.5 / 3) and c.var_goal == pytest.approx(0.75) and c.var_cell == pytest.approx(0.5)
    assert c.seed_measured and (c.seeds, c.goals) == (2, 3)
    # the variance of the design's mean and the MDE follow the closed form
    assert c.variance(4, 10) == pytest.approx(5.5 / 12 + 0.075 + 0.5 / 40)
    assert P.mde(c, 4, 10) == pytest.approx((1.959964 + 0.841621) * math.sqrt(5.5 / 12 + 0.075 + 0.5 / 40))


def test_components_are_unbiased_on_simulated_designs():
    """Known components (seed 4, goal 9, cell 1): averaged over 400 simulated 3 x 40 pilots,
    the estimates are within a few standard errors of the truth, and the design variance
    they imply matches the simulated spread of the grand mean."""
    rng = np.random.default_rng(0)
    est, means = [], []
    for _ in range(400):
        d = (2.0 + rng.normal(0, 2, (3, 1)) + rng.normal(0, 3, (1, 40)) + rng.normal(0, 1, (3, 40)))
        c = P.variance_components(d)
        est.append((c.var_seed, c.var_goal, c.var_cell))
        means.append(d.mean())
    e = np.array(est).mean(0)
    assert e[0] == pytest.approx(4.0, rel=0.15) and e[1] == pytest.approx(9.0, rel=0.1) and e[2] == pytest.approx(1.0, rel=0.05)
    assert np.var(means) == pytest.approx(P.Components(4, 9, 1).variance(3, 40), rel=0.2)


def test_one_seed_borrows_the_seed_variance_and_says_so():
    diff = np.array([[10.0, -10.0, 0.0, 0.0]])
    c = P.difference_components(diff, 20.0, 30.0)
    assert not c.seed_measured and c.var_seed == 50.0
    assert c.var_goal == pytest.approx(np.var(diff, ddof=1)) and c.var_cell == 0.0
    # the seed variance is a floor: with var_seed 50 no number of goals detects 15 pp with one
    # seed (2.80^2 * 50 > 15^2), with three seeds some number does
    need = P.designs_needed(c, 15.0, seeds=(1, 2, 3, 5), max_goals=10_000)
    assert need[1] is None and need[3] is not None and need[5] < need[3]
    assert P.mde(c, 3, need[3]) <= 15.0 < P.mde(c, 3, need[3] - 1)


def test_best_design_is_the_brute_force_optimum():
    claims = {"big": (P.Components(1.0, 100.0, 50.0), 8.0), "small": (P.Components(4.0, 400.0, 100.0), 5.0),
              "tiny": (P.Components(10.0, 900.0, 300.0), 1.0)}
    cost = lambda s, t, k: s * (k * 100.0 + t * 10.0)  # noqa: E731
    grid = dict(seeds=(1, 2, 3, 4), goals=(12, 24, 48, 96, 192), iterations=(5, 10))
    got = P.best_design(claims, cost, 8000.0, **grid)
    feasible = [(s, t, k) for s, t, k in itertools.product(*grid.values()) if cost(s, t, k) <= 8000.0]

    def score(d):  # most claims, then the most margin (smallest largest MDE / effect), then the cheapest
        ratios = [P.mde(c, d[0], d[1]) / e for c, e in claims.values() if P.mde(c, d[0], d[1]) <= e]
        return len(ratios), -round(max(ratios, default=float("inf")), 6), -cost(*d)

    s, t, k = max(feasible, key=score)
    assert (got["seeds"], got["goals"], got["iterations"]) == (s, t, k)
    cheapest_tie = min((d for d in feasible if score(d)[0] == score((s, t, k))[0]), key=lambda d: cost(*d))
    assert cost(s, t, k) >= cost(*cheapest_tie)  # the spare budget went to margin
    assert "tiny" not in got["resolved"] and got["cost_s"] <= 8000.0
    with pytest.raises(ValueError, match="no design"):
        P.best_design(claims, cost, 10.0, **grid)


def _rows(cells: dict, goals: int = 6, seeds=(0, 1)):
    """Episode rows: ``cells[(method, family, strength)][seed][goal]`` success (0/1)."""
    import pandas as pd

    out = []
    for (m, fam, s), by_seed in cells.items():
        for sd in seeds:
            for t in range(goals):
                out.append({"method": m, "family": fam, "strength": s, "train_seed": sd, "env": "webshop",
                            "split": "test", "task_index": t, "seed": 0, "success": by_seed[sd][t]})
    return pd.DataFrame(out)


def test_claim_power_reads_each_claim_from_the_rows():
    """C1 (Vanilla clean minus Vanilla at Gaussian 0.2) from a hand-made pilot: its matrix is
    the per-cell difference, its MDE the closed form of its components; a family whose two
    policies agree on every goal is flagged, never sized; C2 needs 4 of 5 families."""
    from sprpo_lib.paper import power as P

    ones, zeros = [1] * 6, [0] * 6
    cells = {("vanilla", "clean", 0.0): {0: ones, 1: [1, 1, 1, 1, 0, 0]},
             ("vanilla", "gaussian", 0.2): {0: [0, 0, 1, 0, 0, 0], 1: zeros},
             ("sprpo", "gaussian", 0.2): {0: [0, 0, 1, 0, 0, 0], 1: zeros}}
    table = P.claim_power({"main": _rows(cells)}, "webshop").set_index("claim")
    d = 100.0 * np.array([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=float)
    c = P.variance_components(d)
    assert table.loc["C1", "mde"] == pytest.approx(P.mde(c, 2, 6))
    assert table.loc["C1", "var_goal"] == pytest.approx(c.var_goal) and bool(table.loc["C1", "seed_measured"])
    assert table.loc["C1", "paper"] == pytest.approx(57.00 - 18.73)
    flat = table.loc["C2.gaussian"]
    assert not flat["resolvable"] and "no variation" in flat["note"] and pd_isna(flat["goals_at_3_seeds"])
    assert not table.loc["C2", "resolvable"]  # one family of five measured
    assert "C6" not in table.index  # no ablation rows given


def pd_isna(v) -> bool:
    import pandas as pd

    return bool(pd.isna(v))


def test_design_seconds_counts_runs_iterations_and_episodes():
    """Hand count on the cpu WebShop plan: 2 seeds of Vanilla and SPrPO, one of Gaussian and SAM,
    and the ablation study's three trained variants (alpha = 0 and no scheduling: SPrPO; SAM at 0.1)."""
    from sprpo_lib.paper import budget as B

    rates = B.Rates("test", {"webshop": {"vanilla": 10.0, "gaussian": 11.0, "sam": 20.0, "sprpo": 30.0}},
                    {"webshop": 2.0})
    p = B.design_plan("webshop", 2, 24)
    assert {m: len(s) for m, s in p.seeds.items()} == {"vanilla": 2, "gaussian": 1, "sam": 1, "sprpo": 2}
    got = B.design_seconds("webshop", 2, 24, 7, rates)
    assert got["train_s"] == pytest.approx(7 * (2 * 10 + 11 + 20 + 2 * 30 + (30 + 30 + 20)))
    # 9 runs, one curve point (iteration 5: cpu.yaml's eval_every) each, of cpu.yaml's 64 WebShop tasks
    assert got["heldout_s"] == pytest.approx(9 * 1 * 64 * 2.0)
    eps = B.planned_episodes(p)
    assert eps["ablations"] == 24 * 6 * 3  # the plan's goals, clean and Table 1's five settings, 3 variants
    assert got["eval_s"] == pytest.approx(2.0 * (eps["table"] + eps["curves"] + eps["landscape"] + eps["ablations"]))
    assert got["total_s"] == pytest.approx(got["train_s"] + got["heldout_s"] + got["eval_s"])


def test_choose_design_is_the_brute_force_best_and_skips_unsizable_claims():
    import pandas as pd

    from sprpo_lib.paper import budget as B

    rates = B.Rates("test", {"webshop": {"vanilla": 10.0, "gaussian": 10.0, "sam": 20.0, "sprpo": 20.0}},
                    {"webshop": 1.0})
    power = pd.DataFrame([
        {"env": "webshop", "claim": "C1", "paper": 30.0, "var_seed": 20.0, "var_goal": 400.0, "var_cell": 800.0},
        {"env": "webshop", "claim": "C2.rtn", "paper": 10.0, "var_seed": 5.0, "var_goal": 100.0, "var_cell": 300.0},
        {"env": "webshop", "claim": "C2.dropout", "paper": 9.0, "var_seed": 0.0, "var_goal": 0.0, "var_cell": 0.0},
        {"env": "webshop", "claim": "C3", "paper": 3.0, "var_seed": 1.0, "var_goal": 10.0, "var_cell": 10.0}])
    grid = dict(seeds=(1, 2, 3), goals=(6, 12, 24, 48), iterations=(5, 10))
    budget = 6 * 3600
    d = B.choose_design(power, rates, budget, envs=("webshop",), **grid)
    assert "webshop:C2.dropout" not in d["mde"]  # no variation in the pilot: cannot be sized
    comps = {r.claim: (P.Components(r.var_seed, r.var_goal, r.var_cell),
                       2.0 * P.Z_POWER80 / 1.959964 if r.claim == "C3" else r.paper)
             for r in power.itertuples() if r.claim != "C2.dropout"}
    best = None
    for s, t, k in itertools.product(*grid.values()):
        cost = B.design_seconds("webshop", s, t, k, rates)["total_s"]
        if cost <= budget:
            ratios = [P.mde(c, s, t) / e for c, e in comps.values() if P.mde(c, s, t) <= e]
            key = (len(ratios), -round(max(ratios, default=float("inf")), 6), -cost)
            if best is None or key > best[0]:
                best = (key, (s, t, k))
    assert (d["seeds"], d["goals"], d["iterations"]) == best[1] and len(d["resolved"]) == best[0][0]


def test_bench_rates_use_the_machines_own_numbers_and_scale_the_rest():
    from sprpo_lib.paper import budget as B

    ref = B.Rates("ref", {"webshop": {"vanilla": 60.0, "gaussian": 66.0, "sam": 150.0, "sprpo": 120.0},
                          "alfworld": {"vanilla": 120.0, "gaussian": 132.0, "sam": 300.0, "sprpo": 240.0}},
                  {"webshop": 1.0, "alfworld": 4.0})
    ev = {"episodes": 32, "wall_s": 96.0}
    shared = {"vanilla": {"iteration_s": 90.0, "update_s": 40.0}, "sprpo": {"iteration_s": 180.0, "update_s": 40.0},
              "sam": {"iteration_s": 171.0, "update_s": 60.0}}
    bench = {"train_webshop": {"results": {"machine": {"cpu_model": "X", "cpu_class": "avx2"}, "shared": shared,
                                           "ppo_mini_batch_size": 16}},
             "eval_openvino": {"results": {"env": "webshop", "openvino": {"eval": ev}}}}
    old = B.bench_rates({**bench, "train_webshop": {"results": {"machine": {"cpu_model": "X"}, "shared": shared}}},
                        ref, update_factor=1.5)  # a record from before mini-batches: its update priced at 1.5x
    assert old.iteration_s["webshop"]["sam"] == pytest.approx(171.0 + 0.5 * 60.0)
    assert "update x1.5" in old.sources["iteration_s"]
    r = B.bench_rates(bench, ref)
    assert r.machine == "X (avx2)"
    assert r.iteration_s["webshop"] == {"vanilla": 90.0, "sprpo": 180.0, "sam": 171.0, "gaussian": pytest.approx(99.0)}
    assert r.iteration_s["alfworld"]["sprpo"] == pytest.approx(240.0 * 1.5)  # WebShop's Vanilla ratio 90 / 60
    assert r.episode_s == {"webshop": 3.0, "alfworld": pytest.approx(12.0)}  # 96 s / 32, ALFWorld x 3
    assert "x 3.00" in r.sources["episode_s"] and "x 1.50" in r.sources["iteration_s"]


def test_training_rates_price_single_step_runs_at_minibatches():
    """Runs with one optimizer step per iteration are priced with their update scaled; the
    method ratios come from WebShop's same-scaled means (a hand computation)."""
    import pandas as pd

    from sprpo_lib.paper import budget as B

    web = pd.DataFrame({"method": ["vanilla", "vanilla", "sprpo"], "wall_s": [60.0, 80.0, 150.0],
                        "update_s": [40.0, 40.0, 50.0], "ppo_steps": [1, 1, 1]})
    alf = pd.DataFrame({"method": ["vanilla"], "wall_s": [100.0], "update_s": [60.0], "ppo_steps": [1]})
    assert not B.uses_minibatches(web) and B.uses_minibatches(web.assign(ppo_steps=4))
    r = B.training_rates({"webshop": web, "alfworld": alf}, update_factor=1.5)
    assert r["webshop"]["vanilla"] == pytest.approx(90.0)  # (60 + 20 + 80 + 20) / 2
    assert r["webshop"]["sprpo"] == pytest.approx(175.0)  # 150 + 25
    assert r["alfworld"]["sprpo"] == pytest.approx(130.0 * 175.0 / 90.0)
    assert B.training_rates({"webshop": web, "alfworld": alf})["webshop"]["vanilla"] == pytest.approx(70.0)
