"""`python -m sprpo_lib.bench eval` on the tiny model: the same engine twice gives the same
episodes (paired difference exactly zero), and the reported rates follow from the counts."""
from __future__ import annotations

import pytest

from sprpo_lib.bench.suite import bench_eval, engine_runs


def test_bench_eval_side_by_side(one_thread):
    r = bench_eval("smoke", "webshop", ("hf", "hf:float32"), episodes=3)
    a, b = r["hf"], r["hf:float32"]
    assert a["dtype"] == b["dtype"] == "float32" and r["episodes"] == 3
    for row in (a, b):
        ev = row["eval"]
        assert ev["episodes"] == 3 and ev["prompt_tokens"] > 0 and ev["steps"] >= 3
        assert ev["prompt_tok_per_s"] > 0 and ev["generated_tok_per_s"] > 0
        assert ev["wall_over_prefill_floor"] > 0
        assert row["rollout"]["episodes"] == r["rollout_batch"]["tasks"] * r["rollout_batch"]["group_size"]
    # identical engine and seed: identical tokens and outcomes, so the paired difference is exactly 0
    assert a["eval"]["prompt_tokens"] == b["eval"]["prompt_tokens"]
    assert a["eval"]["generated_tokens"] == b["eval"]["generated_tokens"]
    p = b["eval"]["paired_vs_hf"]
    assert p["success_diff"] == 0 and p["ci95"] == [0, 0] and p["zero_in_ci"]


def test_engine_spec_parses_generation_settings():
    assert engine_runs("openvino") == ("openvino", "auto", {})
    assert engine_runs("hf:bfloat16") == ("hf", "bfloat16", {})
    assert engine_runs("openvino:auto:prefix_caching=false+batch_size=8") == (
        "openvino", "auto", {"prefix_caching": False, "batch_size": 8})
    assert engine_runs("openvino:auto:agent.compact_actions=false") == (
        "openvino", "auto", {"agent.compact_actions": False})
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        engine_runs("openvino:auto:prefix_cache=false")
    with pytest.raises(ValueError, match="agent.compact_actions"):
        engine_runs("hf:auto:agent.compact=true")


def test_bench_eval_agent_setting_changes_the_prompt(one_thread):
    """An ``agent.`` setting reaches the prompts: ALFWorld's compact action list is shorter."""
    r = bench_eval("smoke", "alfworld", ("hf", "hf:auto:agent.compact_actions=false"), episodes=2, rollout=False)
    compact, full = r["hf"]["eval"], r["hf:auto:agent.compact_actions=false"]["eval"]
    assert compact["prompt_tokens"] / compact["steps"] < full["prompt_tokens"] / full["steps"]
