"""Paired held-out comparison of the warm start and the RL policy (sprpo_lib.paper.report)."""
from __future__ import annotations

import json

import pytest

from sprpo_lib.paper.report import paired_outcomes


def _write(path, outcomes):
    path.write_text("".join(json.dumps({"task_id": f"t{i}", "success": s, "score": sc}) + "\n"
                            for i, (s, sc) in enumerate(outcomes)))
    return path


def test_paired_outcomes_counts_task_by_task(tmp_path):
    start = _write(tmp_path / "a.jsonl", [(True, 1.0), (False, 0.5), (False, 0.0), (True, 1.0)])
    final = _write(tmp_path / "b.jsonl", [(True, 1.0), (True, 1.0), (True, 1.0), (False, 0.5), (True, 1.0)])
    res = paired_outcomes(start, final)  # t4 exists only after: not paired
    assert res["paired_tasks"] == 4 and res["gained"] == 2 and res["lost"] == 1
    assert res["score_change"] == pytest.approx((0 + 0.5 + 1.0 - 0.5) / 4)
    assert res["mcnemar_p"] == pytest.approx(1.0)
    assert (res["score_up"], res["score_down"]) == (2, 1) and res["score_sign_p"] == pytest.approx(1.0)
    other = tmp_path / "c.jsonl"
    other.write_text(json.dumps({"task_id": "x", "success": True, "score": 1.0}) + "\n")
    with pytest.raises(ValueError, match="share no task"):
        paired_outcomes(start, other)


def test_training_figure_keeps_every_line_inside_its_axes_and_equal_runs_apart(tmp_path, monkeypatch):
    """ALFWorld pays 10 for a success: the score must get its own scale, not run off a [0, 1] axis; two runs
    with the same values (same seed, same first rollout) must not hide one behind the other."""
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd

    from sprpo_lib.paper.report import plot_training

    success = [0.375, 0.25, 0.0, 0.0, 0.0]
    rows = [{"run": f"alfworld-{m}-cpu-seed0", "method": m, "seed": 0, "iteration": i, "success": s,
             "score": 10.0 * s - 0.1 * (i == 2), "valid_rate": 1.0 - 0.1 * i, "temperature": 1.0}
            for m in ("vanilla", "sam") for i, s in enumerate(success)]
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    assert plot_training(pd.DataFrame(rows), None, tmp_path / "t.png").is_file()
    axes = figs[0].axes
    for ax in axes:
        lo, hi = ax.get_ylim()
        for line in ax.get_lines():
            y = np.asarray(line.get_ydata(), float)
            assert lo <= y.min() and y.max() <= hi, (ax.get_title(), ax.get_ylabel(), y, (lo, hi))
    xs = [tuple(np.asarray(line.get_xdata(), float)) for line in axes[0].get_lines()]
    assert len(xs) == 2 and xs[0] != xs[1]
    assert np.allclose(np.round(xs[0]), range(5)) and np.allclose(np.round(xs[1]), range(5))


def test_heldout_curve_against_hand_counts():
    """Two training seeds, four tasks: the paired difference, the tasks gained and lost
    (pooled over seeds) and the sign test, counted by hand; the warm start is one policy."""
    import pandas as pd

    from sprpo_lib.paper.report import heldout_curve

    start = [1, 0, 0, 0]
    after = {0: [1, 1, 0, 0], 1: [1, 1, 1, 0]}  # task 1 gained by both seeds, task 2 by one
    rows = [{"env": "webshop", "method": "vanilla", "train_seed": s, "iteration": it, "split": "train",
             "task_index": t, "seed": 0, "family": "clean", "strength": 0.0, "success": float(v), "score": 0.0}
            for s in (0, 1) for it, vals in ((0, start), (5, after[s])) for t, v in enumerate(vals)]
    cur = heldout_curve(pd.DataFrame(rows), n_resamples=2000)
    assert len(cur) == 1
    r = cur.iloc[0]
    assert (r["iteration"], r["train_seeds"], r["tasks"]) == (5, 2, 4)
    assert r["start"] == pytest.approx(25.0) and r["success"] == pytest.approx(100 * 5 / 8)
    assert r["diff"] == pytest.approx(100 * 5 / 8 - 25.0)
    assert (r["wins"], r["losses"]) == (2, 0) and r["sign_p"] == pytest.approx(0.5)
    assert r["lo"] <= r["diff"] <= r["hi"] and r["lo"] >= 0.0  # no task was lost: no resample below 0


@pytest.mark.slow
def test_heldout_rows_follow_a_run_from_its_warm_start(tmp_path, monkeypatch):
    """A warm-started smoke run with ``eval_every=1``: the warm start (iteration 0) and each
    iteration's policy on the same held-out tasks, read back from their own episode logs."""
    from sprpo_lib.paper.report import heldout_curve, heldout_rows
    from sprpo_lib.train.trainer import load_config, train
    from sprpo_lib.warmstart.cache import prepare_warm_start

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    ov = ["warm_start=true", "sft.n_tasks=2", "sft.epochs=1", "sft.lora.rank=4", "sft.eval_tasks=3",
          "eval_tasks=3", "eval_every=1", "iterations=2", "rollout.tasks_per_step=1"]
    prepare_warm_start(load_config("smoke", ov), progress=False)
    out = train(load_config("smoke", ov), tmp_path / "run", progress=False)
    rows = heldout_rows([out])
    assert sorted(set(rows["iteration"])) == [0, 1, 2]
    assert all(sorted(g["task_index"]) == [2, 3, 4] for _, g in rows.groupby("iteration"))
    logged = [json.loads(ln)["success"] for ln in (out / "heldout" / "iter_00001" / "eval_episodes.jsonl")
              .read_text().splitlines()]
    assert rows[rows["iteration"] == 2]["success"].tolist() == [float(v) for v in logged]
    cur = heldout_curve(rows, n_resamples=200)
    assert cur["iteration"].tolist() == [1, 2] and (cur["tasks"] == 3).all()
    assert cur["diff"].tolist() == pytest.approx(list(cur["success"] - cur["start"]))


def test_merged_headline_keeps_the_other_environments_numbers(tmp_path):
    from sprpo_lib.paper.results import merged_headline, write_json

    path = tmp_path / "headline_cpu.json"
    assert merged_headline(path, {"webshop": {"clean": 1}}) == {"webshop": {"clean": 1}}  # no file yet
    write_json(path, {"alfworld": {"clean": 2}, "webshop": {"clean": 3}})
    assert merged_headline(path, {"webshop": {"clean": 4}}) == {"alfworld": {"clean": 2}, "webshop": {"clean": 4}}
    path.write_text("{garbage")
    assert merged_headline(path, {"webshop": {"clean": 4}}) == {"webshop": {"clean": 4}}  # damaged: nothing kept


def test_training_figures_of_a_full_grid_pass_the_figure_check(tmp_path, caplog):
    """Eight runs' before/after bars with three-line ticks (method and seed, gained/lost, McNemar p)
    do not overlap, and the longer runs' gained/lost labels sit clear of the zero line even where
    an interval's lower end is just above it (the cpu pass's WebShop values)."""
    import logging

    import pandas as pd

    from sprpo_lib.paper.report import plot_training
    from sprpo_lib.paper.results import plot_longer

    runs = [("vanilla", 0), ("gaussian", 0), ("sam", 0), ("sprpo", 0), ("vanilla", 1), ("sprpo", 1),
            ("vanilla", 2), ("sprpo", 2)]
    metrics = pd.DataFrame([{"run": f"webshop-{m}-cpu-seed{s}", "method": m, "seed": s, "iteration": i,
                             "success": 0.1 * i, "score": 0.1 * i + 0.05 * (i % 2), "valid_rate": 1.0,
                             "temperature": 1.0} for m, s in runs for i in range(5)])
    ps = [0.039, 1.0, 0.0078, 0.07, 0.039, 0.0078, 0.12, 0.12]
    summary = pd.DataFrame([{"method": m, "seed": s, "start_success": 0.22, "final_success": 0.3,
                             "gained": 8, "lost": 1, "mcnemar_p": p, "eval_episodes": 64}
                            for (m, s), p in zip(runs, ps)])
    held = pd.DataFrame([{"method": "vanilla", "train_seed": 0, "iteration": it, "success": v}
                         for it, v in ((0, 0.22), (5, 0.33), (10, 0.27), (15, 0.34))])
    curve = pd.DataFrame([{"method": "vanilla", "iteration": it, "diff": d, "lo": lo, "hi": hi, "wins": w,
                           "losses": ls, "sign_p": p} for it, d, lo, hi, w, ls, p in
                          ((5, 10.9, 3.1, 20.3, 8, 1, 0.039), (10, 4.7, -3.1, 12.5, 5, 2, 0.45),
                           (15, 12.5, 3.1, 21.9, 9, 1, 0.021))])
    with caplog.at_level(logging.WARNING):
        plot_training(metrics, summary, tmp_path / "t.png")
        plot_longer(held, curve, tmp_path / "t_longer")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("figure ")] == []
