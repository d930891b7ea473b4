"""Paired held-out comparison of the warm start and the RL policy (sprpo_lib.paper.report)."""
from __future__ import annotations

import json

import pytest

from sprpo_lib.paper.report import mcnemar_exact_p, paired_outcomes


def test_mcnemar_exact_p_closed_forms():
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(3, 3) == 1.0
    assert mcnemar_exact_p(5, 0) == pytest.approx(2 / 32)  # 5 discordant pairs, all one way
    # Bin(12, 1/2): P(X <= 2) + P(X >= 10) = 2 * (1 + 12 + 66) / 4096
    assert mcnemar_exact_p(10, 2) == pytest.approx(158 / 4096)
    assert mcnemar_exact_p(2, 10) == mcnemar_exact_p(10, 2)


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
