"""``sprpo-bench runs``: two sets of finished runs compared, checked against hand counts on
run folders written here (config, metrics and final held-out episodes, as training writes them)."""
from __future__ import annotations

import json

import pytest

from sprpo_lib.bench.cli import main as bench_main
from sprpo_lib.bench.report import headline, section
from sprpo_lib.train.config import config_dict, load_config

BEFORE = ["speed.prefix_min=0", "speed.reuse_frozen=false"]


def _run(root, method, overrides, metrics, heldout):
    cfg = load_config("smoke", overrides, **{"method.name": method, "iterations": len(metrics), "eval_every": 0})
    d = root / f"webshop-{method}-smoke-seed0"
    (d / "final").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"commit": "abc", "config": config_dict(cfg)}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, **r}) + "\n" for i, r in enumerate(metrics)))
    (d / "final" / "eval.json").write_text(json.dumps({"episodes": len(heldout), "success_rate": sum(heldout) / len(heldout),
                                                       "mean_score": 0.5, "valid_rate": 1.0}))
    (d / "final" / "eval_episodes.jsonl").write_text("".join(
        json.dumps({"split": "test", "task_index": i, "task_id": f"t{i}", "success": bool(s), "score": float(s)}) + "\n"
        for i, s in enumerate(heldout)))


def _it(wall, update, samples, success=0.25, sens=0.0):
    return {"wall_s": wall, "rollout_s": wall - update - sens, "update_s": update, "sensitivity_s": sens,
            "samples": samples, "response_tokens": 10 * samples, "success": success, "score": success,
            "episode_length": 3.0, "valid_rate": 1.0}


def test_runs_compares_seconds_and_learning_against_hand_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    before, after = tmp_path / "off", tmp_path / "on"
    _run(before, "vanilla", BEFORE, [_it(20, 12, 10), _it(30, 18, 10)], [0, 0, 1, 0, 1])
    _run(after, "vanilla", [], [_it(10, 5, 10), _it(14, 7, 10, success=0.5)], [1, 1, 1, 0, 1])
    _run(before, "sprpo", BEFORE, [_it(40, 10, 8, sens=10), _it(40, 10, 12, sens=10)], [1, 1, 0, 0, 0])
    _run(after, "sprpo", [], [_it(20, 6, 8, success=0.5, sens=5), _it(20, 6, 12, sens=5)], [1, 0, 0, 0, 0])
    out = tmp_path / "runs.json"
    assert bench_main(["runs", "--profile", "smoke", "--methods", "vanilla,sprpo", "--before", str(before),
                       "--after", str(after), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    res = rec["results"]
    assert res["config_diff"] == {"speed.prefix_min": [0, 16], "speed.reuse_frozen": [False, True]}
    v, s = res["methods"]["vanilla"], res["methods"]["sprpo"]
    assert v["iteration_ratio"] == pytest.approx(12 / 25) and v["update_ratio"] == pytest.approx(6 / 15)
    assert v["before"]["update_s_per_sample"] == 1.5 and v["update_per_sample_ratio"] == pytest.approx(0.4)
    assert v["extra_ratio"] is None and s["extra_ratio"] == pytest.approx(0.5)
    assert s["update_ratio"] == pytest.approx(0.6)  # the replay is not counted in the update
    assert v["first_rollout_same"] and not s["first_rollout_same"]  # sprpo's first success differs
    # iteration 0 ran the same batch on both sides: its own update ratio; sprpo's did not: none
    assert v["first_batch"] == {"update_s": [12.0, 5.0], "update_ratio": 0.417,
                                "extra_s": [0.0, 0.0], "extra_ratio": None}
    assert s["first_batch"] is None
    assert not v["same_curves"] and not s["same_curves"]
    assert v["before"]["success"] == [0.25, 0.25] and v["after"]["success"] == [0.25, 0.5]
    hv = v["heldout"]
    assert (hv["before"], hv["after"], hv["diff_pp"]) == (40.0, 80.0, 40.0)
    assert (hv["only_after"], hv["only_before"], hv["sign_p"]) == (2, 0, 0.5)  # 2 discordant tasks, both one way
    assert hv["ci_pp"][0] <= 40.0 <= hv["ci_pp"][1] and hv["mde80_pp"] > 0
    pooled = res["heldout_pooled"]  # 10 paired (method, task) units: 4 -> 5 successes
    assert pooled["tasks"] == 10 and pooled["diff_pp"] == pytest.approx(10.0)
    assert (pooled["only_after"], pooled["only_before"]) == (2, 1)
    text = section(rec, out)
    assert "configs differ in speed.prefix_min 0 -> 16, speed.reuse_frozen False -> True." in text
    assert "| vanilla | 25.0 -> 12.0 (0.48x) |" in text and "40.0 -> 80.0%, +40.0 pp" in text
    assert "| yes: 12.0 -> 5.0 (0.417x) |" in text and "| 10.0 -> 5.0 (0.5x) | no |" in text
    assert "vanilla 0.48x, sprpo 0.5x" in headline(rec)
    # a record from before first_batch existed: its first rollouts' match is still reported
    del v["first_batch"], s["first_batch"]
    text = section(rec, out)
    assert "| - | yes | 0.25,0.25 / 0.25,0.5 |" in text and "| 10.0 -> 5.0 (0.5x) | no |" in text
    # the same runs on both sides: no config difference, every held-out task alike (said, not a 0-width interval)
    assert bench_main(["runs", "--profile", "smoke", "--methods", "vanilla", "--before", str(after),
                       "--after", str(after), "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["results"]["config_diff"] == {} and rec["results"]["methods"]["vanilla"]["iteration_ratio"] == 1.0
    text = section(rec, out)
    assert "the same success and valid-action rate at every iteration; every held-out task (5)" in headline(rec)
    assert "(after), the same config." in text and "80.0% on both sides, every one of the 5 tasks with the same outcome" in text


def test_runs_names_a_missing_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    _run(tmp_path / "off", "vanilla", BEFORE, [_it(20, 12, 10)], [1])
    with pytest.raises(FileNotFoundError, match="webshop-vanilla-smoke-seed0"):
        bench_main(["runs", "--profile", "smoke", "--methods", "vanilla", "--before", str(tmp_path / "off"),
                    "--after", str(tmp_path / "on")])
