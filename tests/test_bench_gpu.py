"""``sprpo-bench gpu`` checked on the CPU at a tiny shape: the record's structure, the
per-phase seconds and peak memory of each method's iteration, and the decode floor's
closed form."""
from __future__ import annotations

import json
import types

import pytest
import torch

from sprpo_lib.bench import cli as bench_cli
from sprpo_lib.bench.gpu import full_budget_batch
from sprpo_lib.bench.report import section
from sprpo_lib.bench.suite import restore_point
from sprpo_lib.core.batch import Batch, Sample
from sprpo_lib.infra import hardware as hw
from sprpo_lib.train.config import load_config


def test_decode_floor_reads_weights_and_live_kv_once_per_step():
    """2 layers, KV width 2 heads x 16 = 32, 4-byte values: 512 bytes of KV per token.
    Prompts of 10 and 20 tokens generating 2 and 1: step 0 reads 1000 + 512 * 30 bytes,
    step 1 (only the first still generating) 1000 + 512 * 11; at 1 GB/s that is 22,992 ns."""
    cfg = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert hw.decode_floor_s(cfg, [10, 20], [2, 1], 1000, 4, 1.0) == pytest.approx(22_992e-9)
    assert hw.decode_floor_s(cfg, [10], [0], 1000, 4, 1.0) == 0.0


def test_gpu_bench_runs_end_to_end_at_a_tiny_shape(tmp_path, monkeypatch):
    out = tmp_path / "gpu.json"
    argv = ["gpu", "--profile", "smoke", "--envs", "webshop,nosuchenv", "--methods", "vanilla,sprpo", "--model",
            "tiny-qwen2", "--device", "cpu", "--max-steps", "2", "--batch", "4", "--new-tokens", "4", "--no-tests",
            "--out", str(out), "rollout.tasks_per_step=1",
            "rollout.agent.max_prompt_tokens=96"]
    saved = []
    real_save = bench_cli.atomic_write_json
    monkeypatch.setattr(bench_cli, "atomic_write_json", lambda path, rec: saved.append(json.loads(json.dumps(rec))) or real_save(path, rec))
    assert bench_cli.main(argv) == 0
    rec = json.loads(out.read_text())
    res = rec["results"]
    # each stage saved as it ended, marked partial: generation first, then one method at a time;
    # the last write is the whole record
    stages = [sorted(k for k, v in r["results"].get("webshop", {}).items() if k != "full_budget" or len(v) > 2)
              for r in saved[:6]]
    assert stages == [[], ["full_budget"], ["full_budget"], ["full_budget", "rollout"],
                      ["full_budget", "rollout", "vanilla", "warmup_s"], ["full_budget", "rollout", "sprpo", "vanilla", "warmup_s"]]
    assert res["methods"] == ["vanilla", "sprpo"] and res["webshop"]["warmup_s"] > 0
    assert "| webshop | Vanilla update, untimed warm-up before the rows below |" in section(rec, out)
    assert all("generation" in r["results"] for r in saved)
    assert all(r.get("partial") for r in saved[:-1]) and "partial" not in rec and "generation" in res
    # a stage that fails is recorded with its error; the others still ran
    assert "nosuchenv" in res["nosuchenv"]["error"]
    # past the time budget no iteration starts: recorded as skipped, and the table says so
    argv[argv.index("--envs") + 1], argv[argv.index("--methods") + 1] = "webshop", "vanilla"
    assert bench_cli.main([*argv, "--budget-s", "0"]) == 0
    late = json.loads(out.read_text())
    assert late["results"]["webshop"]["vanilla"] == {"skipped": "deadline"} and "generation" in late["results"]
    assert "warmup_s" not in late["results"]["webshop"]  # the warm-up keeps to the budget too
    assert "| webshop | vanilla update | skipped (deadline) |" in section(late, out)
    assert "| webshop | rollout (" in section(late, out)
    assert "Partial" in section({**late, "partial": True}, out) and "Partial" not in section(late, out)
    assert res["device"] == "cpu" and res["bandwidth_gbs"] > 0 and "cuda_tests" not in res
    roll = res["webshop"]["rollout"]
    assert roll["samples"] > 0 and roll["tokens"] > roll["response_tokens"] > 0 and roll["rollout_s"] > 0
    assert roll["rollout_peak_rss_gib"] > 0
    for m in ("vanilla", "sprpo"):
        row = res["webshop"][m]
        assert row["update_s"] > 0 and row["update_peak_rss_gib"] > 0
    # SPrPO's replay ran, Vanilla has none; every pass over every row (a random model earns no reward)
    assert res["webshop"]["sprpo"]["sensitivity_s"] > 0 and res["webshop"]["vanilla"]["sensitivity_s"] == 0
    assert "speed.skip_zero_adv=false" in res["overrides"] and "model.spec=tiny-qwen2" in res["overrides"]
    # before the rollout, every method's update on one micro-batch at the profile's full prompt budget
    cfg = load_config("smoke", ["model.spec=tiny-qwen2"])
    fb = res["webshop"]["full_budget"]
    assert fb["rows"] == cfg.update.micro_batch and fb["tokens_per_row"] == 96 + cfg.rollout.generation.max_new_tokens
    assert fb["vanilla"]["update_s"] > 0 and fb["sprpo"]["sensitivity_s"] > 0 == fb["vanilla"]["sensitivity_s"]
    assert "| webshop | sprpo at the full budget update | " in section(rec, out)
    for name in ("hf", "hf-graphs"):  # the eager engine and the fixed-shape one, side by side
        gen = res["generation"][name]
        assert gen["new_tokens"] > 0 and gen["tokens_per_s"] > 0 and 0 < gen["floor_over_wall"]
        # the wall split: the prefill (one new token) and the decoding after it, each against its floor
        assert 0 < gen["prefill_s"] and gen["decode_s"] == pytest.approx(gen["wall_s"] - gen["prefill_s"],
                                                                                          abs=0.011)
        assert gen["prefill_floor_s"] > 0 and gen["matmul_gflops"] > 0 and gen["engine_forwards"] > 0
        assert f"`{name}` generation: " in section(rec, out) and "Prefill (one new token)" in section(rec, out)


def test_a_gpu_record_is_filed_under_its_gpu():
    from sprpo_lib.bench.report import machine_slug

    host = {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_class": "amx"}
    assert machine_slug(host) == "intel-xeon-platinum-8480-amx"
    assert machine_slug({**host, "gpu": "NVIDIA H200"}) == "nvidia-h200"


def test_the_full_budget_batch_fills_the_prompt_budget_with_every_row_counted():
    """``update.micro_batch`` rows, each a full prompt plus a full response, advantages of
    both signs (none zero, so no pass skips a row), the same rows for the same seed."""
    cfg = load_config("paper", ["env.name=webshop"])
    b = full_budget_batch(cfg, 1000, seed=3)
    assert len(b) == cfg.update.micro_batch == 16
    assert {len(s.ids) for s in b.samples} == {4096 + 64} and {s.n_resp for s in b.samples} == {64}
    assert sorted({s.adv for s in b.samples}) == [-1.0, 1.0] and max(max(s.ids) for s in b.samples) < 1000
    assert [s.ids for s in full_budget_batch(cfg, 1000, seed=3).samples] == [s.ids for s in b.samples]
    assert len(full_budget_batch(load_config("paper", ["env.name=alfworld"]), 1000).samples[0].ids) == 3072 + 64


def test_the_paper_profile_splits_a_full_budget_micro_batch_but_not_a_rollouts():
    """``speed.micro_batch_tokens``: 16 rows at WebShop's full budget (4,160 tokens) go in
    micro-batches of at most 32,768 padded tokens (7 + 7 + 2 rows); 16 rows of ~1,200 tokens
    (the H200 rollouts' batches averaged 880 and 1,208) stay one micro-batch."""
    cfg = load_config("paper", ["env.name=webshop"])
    full = full_budget_batch(cfg, 1000)
    chunks = full.micro_batch_order(cfg.update.micro_batch, max_tokens=cfg.speed.micro_batch_tokens)
    assert [len(c) for c in chunks] == [7, 7, 2]
    assert full.padded_tokens(cfg.update.micro_batch, max_tokens=cfg.speed.micro_batch_tokens) == 16 * 4160
    typical = Batch([Sample(list(range(1200 + 10 * i)), 64, 1.0) for i in range(16)])
    assert len(typical.micro_batch_order(cfg.update.micro_batch, max_tokens=cfg.speed.micro_batch_tokens)) == 1


def _record(**envs) -> dict:
    return {"bench": "gpu", "date": "2026-12-05T00:00:00Z", "machine": {"gpu": "Test GPU"}, "results": envs}


def test_projected_cost_is_the_recorded_phases_scaled_to_the_step_limits():
    """By hand: 12 episodes of 3 turns in 30 s of rollout and a 6 s update give, at WebShop's 15-step
    limit, (30 + 6) x 15/3 = 180 s per iteration, x 200 iterations = 10 h per run; a method the record
    lacks in ALFWorld takes SPrPO's update there x its WebShop ratio to SPrPO (2 x 6 / 3)."""
    from sprpo_lib.paper import budget as B
    from sprpo_lib.paper import experiments as X

    roll = {"episodes": 12, "samples": 36, "rollout_s": 30.0}
    web = {"rollout": roll, **{m: {"update_s": u} for m, u in
                               (("vanilla", 6.0), ("gaussian", 6.0), ("sam", 12.0), ("sprpo", 9.0))}}
    alf = {"rollout": {"episodes": 12, "samples": 36, "rollout_s": 60.0}, "sprpo": {"update_s": 3.0}}
    df = B.projected_costs(_record(webshop=web, alfworld=alf), iterations=200).set_index(["env", "method"])
    v = df.loc[("webshop", "vanilla")]
    assert v.iteration_s == pytest.approx(180.0) and v.hours_per_run == pytest.approx(10.0)
    assert v.runs == len(X.PLANS["paper"]["webshop"].seeds["vanilla"]) and v.source == "measured"
    a = df.loc[("alfworld", "vanilla")]
    assert a.update_s == pytest.approx(2.0 * 50 / 3, abs=0.05) and a.source.startswith("estimated")
    assert a.iteration_s == pytest.approx((60.0 + 2.0) * 50 / 3, abs=0.05)
    assert df["hours"].sum() == pytest.approx(sum(df["hours_per_run"] * df["runs"]), rel=1e-2)
    text = B.projected_markdown({**_record(webshop=web, alfworld=alf), "name": "t"})
    assert "Test GPU" in text and "| all |" in text and "estimated" in text
    assert B.projected_costs(_record(webshop={"rollout": roll})).empty  # no update measured: no projection


def test_the_readme_cost_line_comes_from_the_newest_gpu_record(tmp_path):
    from sprpo_lib.paper import budget as B

    assert "at the paper's seconds per step" in B.cost_summary(tmp_path)  # no record: the paper's table
    web = {"rollout": {"episodes": 12, "samples": 36, "rollout_s": 30.0},
           **{m: {"update_s": 6.0} for m in ("vanilla", "gaussian", "sam", "sprpo")}}
    old = _record(webshop=web)
    new = {**_record(webshop={**web, "rollout": {**web["rollout"], "rollout_s": 60.0}}), "date": "2026-12-06T00:00:00Z"}
    (tmp_path / "bench_a.json").write_text(json.dumps({"gpu_old": old}))
    (tmp_path / "bench_b.json").write_text(json.dumps({"gpu_new": new, "other": {"bench": "train", "results": {}}}))
    line = B.cost_summary(tmp_path)
    hours = B.projected_costs(new)["hours"].sum()
    assert line.startswith(f"About {hours:.0f} GPU-hours") and "bench_b.json" in line and "2026-12-06" in line


def test_the_readme_cost_line_reads_the_project_figures_from_any_folder(tmp_path, monkeypatch):
    """update_readme run from another working directory (a notebook's folder) finds the GPU record
    in the project's figures/ and keeps the projected line, not the paper's table alone."""
    from sprpo_lib.reproduce import update_readme

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    (tmp_path / "figures").mkdir()
    web = {"rollout": {"episodes": 12, "samples": 36, "rollout_s": 30.0},
           **{m: {"update_s": 6.0} for m in ("vanilla", "gaussian", "sam", "sprpo")}}
    (tmp_path / "figures" / "bench_g.json").write_text(json.dumps({"gpu": _record(webshop=web)}))
    page = tmp_path / "README.md"
    page.write_text("a\n<!-- paper-cost:begin -->\n<!-- paper-cost:end -->\n")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")
    update_readme("cpu", "figures", readme=page)
    assert "bench_g.json" in page.read_text() and "GPU-hours" in page.read_text()


def test_restore_point_puts_parameters_and_optimizer_state_back():
    w = torch.nn.Parameter(torch.ones(3))
    actor = type("A", (), {"params": [w], "opt": torch.optim.Adam([w], lr=0.1)})()
    restore = restore_point(actor)
    for _ in range(2):
        (w * w).sum().backward()
        actor.opt.step()
        assert not torch.equal(w.detach(), torch.ones(3)) and actor.opt.state[w]
        restore()
        assert torch.equal(w.detach(), torch.ones(3)) and not actor.opt.state_dict()["state"]
