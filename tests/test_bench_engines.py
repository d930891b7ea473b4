"""The engine and machine benchmarks a user reruns (``sprpo-bench generate|churn|prompts|machine``):
each runs end to end on a tiny model and its record holds what the README's tables read."""
from __future__ import annotations

import json

import pytest

from sprpo_lib.infra.hardware import CPU_CLASSES


@pytest.fixture(autouse=True)
def _single_threaded(one_thread):
    """Tiny models: two threads on the shared 2-core machine are many times slower."""


@pytest.fixture
def ov_cache(tmp_path, monkeypatch):
    """A conversion cache of the test's own."""
    pytest.importorskip("openvino")
    monkeypatch.setenv("SPRPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_bench_churn_counts_builds_hangs_and_injected_stalls(tmp_path, ov_cache):
    import json

    from sprpo_lib.bench import cli as bench_cli

    out = tmp_path / "churn.json"
    argv = ["churn", "--rounds", "2", "--deadline", "2", "--stall-every", "2", "--stall-s", "30", "--threads", "1",
            "--out", str(out)]
    assert bench_cli.main(argv) == 0
    res = json.loads(out.read_text())["results"]
    assert res["builds"] == 4 and res["calls"] == 8 and res["mismatches"] == 0 and res["unrecovered"] == 0
    assert res["injected"] == 1 and res["retries"] >= 1 and res["hangs"] == res["retries"] - 1
    assert res["machine"]["cpu_class"] in CPU_CLASSES


def test_bench_generate_compares_openvino_side_by_side(tmp_path, ov_cache):
    import json

    from sprpo_lib.bench import cli as bench_cli

    out = tmp_path / "generate.json"
    argv = ["generate", "--model", "tiny-llama", "--prompts", "3", "--new-tokens", "6", "--repeats", "1",
            "--engines", "hf_generator,hf,openvino,openvino_loop", "--dtypes", "float32", "--temperatures", "0",
            "--threads", "1", "--out", str(out)]
    assert bench_cli.main(argv) == 0
    res = json.loads(out.read_text())["results"]
    for name in ("hf", "openvino", "openvino_loop"):
        assert res["float32"]["T0"][name]["greedy_equal"] == "3/3"
        assert res["float32"]["T0"][name]["wall_over_prefill_floor"] > 0
    ov = res["openvino"]
    assert ov["openvino:float32"]["backend"] == "genai" and ov["openvino_loop:float32"]["backend"] == "loop"
    assert ov["openvino:float32"]["precision"] == "float32" and ov["openvino:float32"]["reload_s"] >= 0


def test_bench_generate_compares_engines_on_webshop_prompts(tmp_path):
    import json

    from sprpo_lib.bench import cli as bench_cli

    out = tmp_path / "generate.json"
    argv = ["generate", "--model", "tiny-llama", "--prompts", "3", "--new-tokens", "6", "--repeats", "2",
            "--dtypes", "float32", "--out", str(out)]
    assert bench_cli.main(argv) == 0
    res = json.loads(out.read_text())["results"]["float32"]
    assert res["T0"]["hf"]["greedy_equal"] == "3/3"
    for t in ("T0", "T0.4"):
        for name in ("hf_generator", "hf"):
            row = res[t][name]
            assert row["repeat_equal"] and row["prompt_tokens"] > 0 and row["wall_over_prefill_floor"] > 0


def test_bench_records_default_to_one_file_per_environment(tmp_path, monkeypatch):
    """Without --out a benchmark with --env writes runs/bench/<what>_<env>.json: a run on
    another environment leaves the first record in place.  (The smoke profile: ALFWorld's
    expert needs no receptacle prior, whose 60 generated games cost a minute on a new machine.)"""
    import json

    from sprpo_lib.bench import cli as bench_cli

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    for env in ("webshop", "alfworld"):
        assert bench_cli.main(["prompts", "--model", "tiny-llama", "--episodes", "1", "--env", env, "--profile", "smoke",
                               "--split", "test" if env == "webshop" else "valid_seen"]) == 0
    names = sorted(p.name for p in (tmp_path / "runs" / "bench").glob("*.json"))
    assert names == ["prompts_alfworld.json", "prompts_webshop.json"]
    assert json.loads((tmp_path / "runs" / "bench" / "prompts_alfworld.json").read_text())["results"]["env"] == "alfworld"
    assert bench_cli.record_name("machine", None) == "machine.json"
    assert bench_cli.record_name("ops", "webshop", "sprpo") == "ops_sprpo_webshop.json"
    assert bench_cli.record_name("ops", "webshop", "vanilla") == "ops_webshop.json"


def test_bench_prompts_splits_the_token_budget_by_section(tmp_path):
    import json

    from sprpo_lib.agent.envs import make_pool
    from sprpo_lib.agent.prompt import PROMPT_SECTIONS, token_counter
    from sprpo_lib.bench import cli as bench_cli
    from sprpo_lib.model.load import load_policy
    from sprpo_lib.train.config import load_config
    from sprpo_lib.warmstart.demos import collect_demonstrations

    out = tmp_path / "prompts.json"
    assert bench_cli.main(["prompts", "--model", "tiny-llama", "--episodes", "3", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    # independent: the whole templated prompts of the shopper's episodes under the cpu agent settings
    cfg = load_config("cpu")
    demos = collect_demonstrations(make_pool("webshop"), "test", range(3), cfg.rollout.agent,
                                   max_steps=cfg.env.max_steps, demonstrator="shopper")
    count = token_counter(load_policy("tiny-llama").tokenizer, cfg.rollout.agent)
    tokens = [count(d.prompt) for d in demos]
    assert res["prompts"] == len(demos) and res["episodes"] == 3
    assert res["mean_total_tokens"] == pytest.approx(sum(tokens) / len(tokens), abs=0.05)
    assert res["tokens_per_episode"] == pytest.approx(sum(tokens) / 3, abs=0.05)
    assert res["steps_per_episode"]["mean"] == pytest.approx(len(demos) / 3, abs=0.01)
    secs = res["sections"]
    assert set(secs) == {*PROMPT_SECTIONS, "chat_and_joins"}
    assert sum(v["share"] for v in secs.values()) == pytest.approx(1.0, abs=1e-3)
    assert all(secs[k]["mean_tokens"] > 0 for k in PROMPT_SECTIONS)
    assert res["actions_per_step"] == pytest.approx(
        sum(d.prompt.split("Available actions:\n")[1].split("\n\nResponse:")[0].count("- ") for d in demos) / len(demos),
        abs=0.05)
    reuse = res["prefix_reuse"]
    assert reuse["prompt_tokens"] == sum(tokens) and 0 < reuse["previous_step_share"] <= reuse["any_earlier_share"] < 1
    assert reuse["floor_factor"] == pytest.approx(1 - reuse["any_earlier_share"], abs=1e-4)


def test_prefix_reuse_by_hand():
    """Two episodes: [1,2,3] then [1,2,4,5], and [1,2,3] again.  The second prompt shares 2
    tokens with the one before it; an unlimited cache computes 3 + 2 + 1 of the 10 tokens
    (the repeated prompt's last token is computed for its logits).  A prompt equal to the one
    before it reuses all but its last token."""
    from sprpo_lib.bench.suite import prefix_reuse

    got = prefix_reuse([[[1, 2, 3], [1, 2, 4, 5]], [[1, 2, 3]]])
    assert got == {"prompt_tokens": 10, "previous_step_share": 0.2, "any_earlier_share": 0.4, "floor_factor": 0.6}
    same = prefix_reuse([[[7, 8], [7, 8]]])
    assert same == {"prompt_tokens": 4, "previous_step_share": 0.25, "any_earlier_share": 0.25, "floor_factor": 0.75}
    assert prefix_reuse([])["floor_factor"] == 1.0
    from sprpo_lib.bench.report import headline

    phrase = headline({"bench": "prompts", "results": {"env": "webshop", "mean_total_tokens": 5.0, "prefix_reuse": got}})
    assert phrase == "webshop 5.0 prompt tokens per step, of which a prefix cache of any size leaves at least 0.6x of the " \
                     "all-token prefill floor"


def test_bench_machine_reports_rates_and_floors(tmp_path):
    from sprpo_lib.bench import cli as bench_cli

    out = tmp_path / "machine.json"
    assert bench_cli.main(["machine", "--model", "tiny-qwen2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["shapes"]["hidden"] == 64 and res["fast_dtype"] in ("float32", "bfloat16")
    for d in ("float32", "bfloat16"):
        assert res["prefill_gflops"][d] > 0 and res["decode_gflops"][d] > 0
        assert res["prefill_floor_s_per_1k_tokens"][d] > 0
    assert res["bandwidth_gbs"] > 0 and res["machine"]["capability"]
