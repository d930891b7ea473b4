"""`python -m sprpo_lib.bench eval` on the tiny model: the same engine twice gives the same
episodes (paired difference exactly zero), and the reported rates follow from the counts."""
from __future__ import annotations

import pytest

import sprpo_lib.bench.suite as suite
from sprpo_lib.agent.engines import GenerationConfig
from sprpo_lib.bench.report import SUMMARIES, headline
from sprpo_lib.bench.suite import CallLog, bench_eval, engine_runs, generation_phases, prefill_replay


def test_bench_eval_side_by_side(one_thread):
    r = bench_eval("smoke", "webshop", ("hf", "hf:float32"), episodes=3)
    a, b = r["hf"], r["hf:float32"]
    assert a["dtype"] == b["dtype"] == "float32" and r["episodes"] == 3
    for row in (a, b):
        ev = row["eval"]
        assert ev["episodes"] == 3 and ev["prompt_tokens"] > 0 and ev["steps"] >= 3
        assert ev["prompt_tok_per_s"] > 0 and ev["generated_tok_per_s"] > 0
        assert ev["wall_over_prefill_floor"] > 0
        # the least ratio: the prefilled share an unlimited prefix cache leaves plus the decode floor
        assert 0 < ev["prefix_cache_factor"] <= 1 and ev["decode_over_prefill_floor"] > 0
        assert ev["least_over_prefill_floor"] == pytest.approx(
            ev["prefix_cache_factor"] + ev["decode_over_prefill_floor"], abs=0.011)
        assert row["rollout"]["episodes"] == r["rollout_batch"]["tasks"] * r["rollout_batch"]["group_size"]
    # identical engine and seed: identical tokens and outcomes, so the paired difference is exactly 0
    assert a["eval"]["prompt_tokens"] == b["eval"]["prompt_tokens"]
    assert a["eval"]["generated_tokens"] == b["eval"]["generated_tokens"]
    assert a["eval"]["least_over_prefill_floor"] == b["eval"]["least_over_prefill_floor"]
    ev = a["eval"]
    least = f"{ev['least_over_prefill_floor']}x ({ev['prefix_cache_factor']} + {ev['decode_over_prefill_floor']})"
    table = "\n".join(SUMMARIES["eval"](r))
    assert least in table and "every one of the 3 tasks with the same outcome" in table  # no zero-width interval
    assert f"(at least {ev['least_over_prefill_floor']}x with an unlimited prefix cache" in headline(
        {"bench": "eval", "results": r})
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


def test_generation_floor_by_hand():
    """Decode steps follow the environment steps: step 0 has two live episodes (prompts of 10
    and 12 tokens generating 3 and 5: 3 decode steps with both, 2 with the second alone),
    step 1 one episode (prompt 15, 2 tokens).  FLOP-bound (endless bandwidth) each decode
    step costs its live episodes' FLOPs at their own context; bandwidth-bound each reads
    every weight and the live episodes' KV cache (prompt and tokens so far) once.  Prefill
    counts every prompt token once."""
    from sprpo_lib.agent.rollout import EpisodeRecord, StepRecord
    from sprpo_lib.bench.suite import generation_floor, shape_config
    from sprpo_lib.infra import hardware as hw

    def step(i, n_prompt, n_resp):
        return StepRecord(i, "", "", "", "", True, 0.0, 0.0, False, list(range(n_prompt)), list(range(n_resp)))

    eps = [EpisodeRecord("webshop", "test", 0, "a", 0, 0, "", [step(0, 10, 3), step(1, 15, 2)]),
           EpisodeRecord("webshop", "test", 1, "b", 1, 0, "", [step(0, 12, 5)])]
    config = shape_config("tiny-qwen2")
    rate = 1e-6  # GFLOP/s: 1,000 FLOPs per second
    flop_bound = generation_floor(config, eps, rate, bandwidth_gbs=1e9, weight_bytes=1, kv_bytes=2)
    f = lambda c: hw.decode_flops(config, c)  # noqa: E731
    want = (sum(f(10 + s) + f(12 + s) for s in range(3)) + f(15) + f(16) + f(12 + 3) + f(12 + 4)) / 1e3
    assert flop_bound["decode_floor_s"] == round(want, 2)
    assert flop_bound["prefill_floor_s"] == round(hw.prefill_flops(config, [10, 15, 12]) / 1e3, 2)
    assert flop_bound["prompt_tokens"] == 37
    # 1 byte/s: 3 bytes of weights per step, and per cached position K and V of every KV head in every layer
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
    assert hw.kv_bytes_per_token(config, 2) == kv
    cached = sum(10 + s + 12 + s for s in range(3)) + (12 + 3) + (12 + 4) + 15 + 16
    read_bound = generation_floor(config, eps, 1e9, bandwidth_gbs=1e-9, weight_bytes=3, kv_bytes=2)
    assert read_bound["decode_floor_s"] == round((5 + 2) * 3.0 + kv * cached, 2)


def test_call_log_and_prefill_replay_run_the_same_calls_with_one_new_token(monkeypatch):
    """The log passes each call through unchanged; the replay builds one fresh engine with
    max_new_tokens=1 and feeds it the logged calls in order, timing only them."""
    log = CallLog(lambda prompts: [p.upper() for p in prompts])
    assert log(["a", "b"]) == ["A", "B"] and log(["c"]) == ["C"]
    assert [p for p, _ in log.calls] == [["a", "b"], ["c"]] and all(t >= 0 for _, t in log.calls)
    built, seen, closed = [], [], []

    def fake_engine(name, pol, gen, agent):
        built.append((name, gen))
        return lambda prompts: seen.append(list(prompts))

    monkeypatch.setattr(suite, "make_engine", fake_engine)
    monkeypatch.setattr(suite, "close_engine", closed.append)
    gen = GenerationConfig(temperature=0.4, max_new_tokens=48, seed=3)
    assert prefill_replay("openvino", None, gen, None, log.calls) >= 0
    assert [(n, g.max_new_tokens, g.temperature, g.seed) for n, g in built] == [("openvino", 1, 0.4, 3)]
    assert seen == [["a", "b"], ["c"]] and len(closed) == 1
    # 5 s of generation, 3 of them the prefill, against a 4 s floor a cache cuts to 3 s, decoding's floor 1 s
    assert generation_phases(3.0, 5.0, 4.0, 0.75, 1.0) == {
        "prefill_s": 3.0, "prefill_over_floor": 0.75, "prefill_over_cached_floor": 1.0, "decode_s": 2.0,
        "decode_over_floor": 2.0}


def test_bench_eval_phases_split_generation_into_prefill_and_decode(one_thread):
    r = bench_eval("smoke", "webshop", ("hf",), episodes=2, rollout=False, phases=True)
    ev = r["hf"]["eval"]
    assert ev["prefill_s"] > 0
    assert ev["prefill_s"] + ev["decode_s"] == pytest.approx(ev["generate_s"], abs=0.06)  # generate_s rounded to 0.1 s
    assert ev["prefill_over_floor"] > 0 and ev["decode_over_floor"] is not None
    assert ev["prefill_over_cached_floor"] == pytest.approx(ev["prefill_over_floor"] / ev["prefix_cache_factor"],
                                                            rel=0.01)
    table = "\n".join(SUMMARIES["eval"](r))
    assert f"| `hf` | {ev['generate_s']} s | {ev['prefill_s']} s ({ev['prefill_over_floor']}x" in table
    assert f"its decoding {ev['decode_over_floor']}x its floor" in headline({"bench": "eval", "results": r})
