"""RL training (issue 4): sensitivity vs finite differences, sigma = 0 equivalences, SAM's
direction, configs, and exact resume after kill -9."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sprpo_lib.core.actor import SURROGATE
from sprpo_lib.core.batch import build_batch
from sprpo_lib.core.methods import grad_leaf
from sprpo_lib.train.trainer import Trainer, load_config, train
from sprpo_lib.warmstart.cache import prepare_warm_start

ROOT = Path(__file__).resolve().parents[1]


def _trainer(tmp_path, *overrides, name="t"):
    cfg = load_config("smoke", list(overrides))
    return Trainer(cfg, tmp_path / name, progress=False)


def _rollout_batch(tr, k=0):
    eps, xi, _ = tr.collect(k)
    # give the batch non-trivial advantages (a random tiny model gets no reward signal)
    for i, e in enumerate(eps):
        e.steps[-1].env_reward += float(i % 3)
    batch, _ = build_batch(eps, tr.cfg.update.adv, "gigpo")
    return batch, xi


def _f64(tr):
    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for mod in tr.model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(norm, mod)


def test_sensitivity_matches_finite_differences(tmp_path):
    """S_hat = (dL/dxi)^2 of the surrogate at theta_{k+1} (replay, old log-probs fixed):
    the xi gradient from the replay backward equals central differences of the loss."""
    tr = _trainer(tmp_path, "model.dtype=float64", "method.name=sprpo", "update.loss.entropy_coeff=0.0")
    _f64(tr)
    batch, xi = _rollout_batch(tr)
    a = tr.actor
    a.backward(batch, xi)  # stores old log-probs at theta_k
    a.step()
    leaf = grad_leaf(xi, a)
    a.backward(batch, leaf, terms=SURROGATE)
    g = leaf.grad.double()
    a.zero_grad()
    assert g.abs().max() > 0
    eps = 1e-6
    for (l, c) in [(0, 3), (1, int(g[1].abs().argmax()))]:
        vals = []
        for sgn in (1, -1):
            x = xi.double().clone()
            x[l, c] += sgn * eps
            vals.append(a.backward(batch, x, terms=SURROGATE)["loss"])
            a.zero_grad()
        fd = (vals[0] - vals[1]) / (2 * eps)
        assert g[l, c].item() == pytest.approx(fd, rel=1e-4, abs=1e-9)


def test_sprpo_update_sets_state_from_replay(tmp_path):
    tr = _trainer(tmp_path, "method.name=sprpo", "method.scale=raw", "method.sigma_max=1.0")  # Alg. 1 line 3 literally
    batch, xi = _rollout_batch(tr)
    assert torch.equal(tr.method.sigma(), torch.full(tr.shape, 0.2))  # S = m = 1 at start, sigma = rho
    st = tr.method.update(tr.actor, batch, 0, xi)
    assert tr.method.S_hat.shape == tr.shape and tr.method.m_hat == pytest.approx(st["m_hat"])
    S = tr.method.S_hat.clamp_min(tr.method.S_hat.mean() * 1e-6)
    expect = (0.2 * tr.method.m_hat * S.pow(-0.5)).clamp(max=1.0).float()
    torch.testing.assert_close(tr.method.sigma(), expect)
    tr.method.S_hat.zero_()  # guard: vanished sensitivities never give inf/NaN sigma
    assert torch.isfinite(tr.method.sigma()).all() and tr.method.sigma().max() <= 1.0


def test_default_energy_rule_after_a_real_replay(tmp_path):
    """The default rule on a real line-7 measurement: RMS sigma = rho (the schedule waits for
    its reference), no channel above sigma_max, the surrogate change and diagnostics logged."""
    tr = _trainer(tmp_path, "method.name=sprpo")
    batch, xi = _rollout_batch(tr)
    st = tr.method.update(tr.actor, batch, 0, xi)
    sig = tr.method.sigma().double()
    assert float(sig.pow(2).mean().sqrt()) == pytest.approx(tr.cfg.method.rho, rel=1e-6)
    assert float(sig.max()) <= tr.cfg.method.sigma_max
    assert math.isfinite(st["surrogate_change"]) and math.isnan(st["S_rank_corr"])  # one measurement: no pair yet


def _adapter(out: Path):
    return load_file(str(next((out / "final" / "adapter").rglob("adapter_model.safetensors"))))


@pytest.mark.slow
def test_zero_sigma_gives_vanillas_update_exactly(tmp_path):
    outs = {}
    for name, ov in [("vanilla", []), ("gaussian", ["method.sigma=0.0"]), ("sprpo", ["method.rho=0.0"])]:
        cfg = load_config("smoke", [f"method.name={name}", "iterations=2", "rollout.tasks_per_step=1", *ov])
        outs[name] = _adapter(train(cfg, tmp_path / name, progress=False))
    for name in ("gaussian", "sprpo"):
        assert outs[name].keys() == outs["vanilla"].keys()
        assert all(torch.equal(outs[name][k], outs["vanilla"][k]) for k in outs[name])


def test_sam_xi_points_against_gain_gradient(tmp_path):
    tr = _trainer(tmp_path, "method.name=sam", "method.sam_rho=0.05")
    batch, _ = _rollout_batch(tr)
    u = torch.ones(tr.shape, requires_grad=True)
    tr.actor.backward(batch, gain=u, terms=SURROGATE)
    ref = u.grad.clone()  # dloss/du at theta_k, u = 1
    tr.actor.zero_grad()
    tr.method.update(tr.actor, batch.without_old(), 0, None)
    xi = tr.method.last_xi
    dL_du = -ref  # L = -loss
    assert xi.norm().item() == pytest.approx(0.05, rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(xi.flatten(), -dL_du.flatten(), dim=0)
    assert cos.item() == pytest.approx(1.0, abs=1e-5)


def test_config_profiles_and_errors():
    paper = load_config("paper")
    assert (paper.rollout.tasks_per_step, paper.rollout.group_size, paper.iterations) == (16, 8, 200)
    assert paper.update.lr == 3e-6 and paper.update.loss.clip_ratio_c == 3.0 and paper.update.adv.gamma == 0.95
    assert (paper.model.lora.rank, paper.model.lora.alpha) == (64, 64)
    cfg = load_config("smoke", ["method.name=sprpo", "method.alpha=0", "rollout.group_size=3"])
    assert cfg.method.alpha == 0 and cfg.rollout.group_size == 3
    with pytest.raises(ValueError, match="unknown config key 'method.rhoo'"):
        load_config("smoke", ["method.rhoo=1"])
    with pytest.raises(ValueError, match="unknown method"):
        load_config("smoke", ["method.name=ppo"])
    with pytest.raises(ValueError, match="unknown profile"):
        load_config("gpu-cluster")
    with pytest.raises(ValueError, match="key.sub=value"):
        load_config("smoke", ["method.rho"])
    cpu = load_config("cpu")
    assert cpu.sft.demonstrator == "shopper" and cpu.eval_temperature == 0.4 and cpu.method.scale == "energy" and cpu.update.adv.norm == "mean"
    alf = load_config("cpu", **{"env.name": "alfworld"})  # the profile's per_env ALFWorld settings
    assert (alf.sft.demonstrator, alf.env.max_steps, alf.update.adv.norm) == ("explorer", 20, "mean_std")
    assert alf.rollout.agent.compact_actions and not cpu.rollout.agent.compact_actions
    assert alf.sft.lora_layers is None and cpu.sft.lora_layers == 8  # ALFWorld's clone: LoRA on every layer
    with pytest.raises(ValueError, match="sft.demonstrator=expert"):
        load_config("cpu", ["sft.demonstrator=shopper"], **{"env.name": "alfworld"})


def test_speed_levers_have_their_own_section_and_old_records_still_read():
    """The paper profile's levers are speed's; a cpu run's stored config has no speed section (every
    lever at its default), and a config stored with levers under ``update`` reads as the same config."""
    from sprpo_lib.train.config import config_dict, config_from_dict, moved_levers

    paper = load_config("paper", **{"env.name": "webshop"})
    assert (paper.speed.prefix_min, paper.speed.grad_checkpointing, paper.speed.micro_batch_tokens) == (0, True, 32768)
    assert "speed" not in config_dict(load_config("cpu")) and "prefix_min" not in config_dict(load_config("cpu"))["update"]
    stored = config_dict(paper)
    old = {**stored, "update": {**stored["update"], **stored["speed"]}}
    del old["speed"]
    assert moved_levers(old) == stored and config_from_dict(old) == paper and moved_levers(stored) is stored


def _cli(out, *extra):
    return [sys.executable, "-m", "sprpo_lib.train", "--profile", "smoke", "--method", "sprpo", "--out", str(out),
            "--no-progress", "iterations=3", "rollout.tasks_per_step=1", *extra]


@pytest.mark.slow
def test_kill9_resume_matches_uninterrupted_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ref = tmp_path / "ref"
    subprocess.run(_cli(ref), check=True, env=env, cwd=ROOT, capture_output=True)
    run = tmp_path / "killed"
    p = subprocess.Popen(_cli(run), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = run / "checkpoints" / "latest"
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.is_file() and "iter_00000" in latest.read_text()):
        time.sleep(0.05)
    time.sleep(0.3)  # into iteration 1
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (run / "final").exists(), "run finished before it could be killed"
    subprocess.run(_cli(run), check=True, env=env, cwd=ROOT, capture_output=True)
    a, b = _adapter(ref), _adapter(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [__import__("json").loads(ln)["iteration"] for ln in lines] == [0, 1, 2]


def _warm_trainer(cfg, out):
    """An RL run's trainer after the warm-start stage, as sprpo-train and the notebooks run them."""
    prepare_warm_start(cfg, progress=False)
    return Trainer(cfg, out, progress=False)


def test_warm_start_is_cached_and_merged(tmp_path, monkeypatch):

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    ov = ["warm_start=true", "sft.n_tasks=2", "sft.epochs=1", "sft.lora.rank=4", "iterations=1"]
    with pytest.raises(ValueError, match="prepare_warm_start"):  # RL starts from a prepared warm start only
        Trainer(load_config("smoke", ov), tmp_path / "a", progress=False)
    sft_dir = prepare_warm_start(load_config("smoke", ov), progress=False)
    a = Trainer(load_config("smoke", ov), tmp_path / "a", progress=False)
    assert a.warm_start_dir == sft_dir
    assert (sft_dir / "adapter").is_dir() and (sft_dir / "demos.jsonl").is_file()
    b = Trainer(load_config("smoke", ov), tmp_path / "b", progress=False)  # loads the cached adapter
    assert b.warm_start_dir == sft_dir
    ids = torch.randint(3, 250, (1, 12))
    torch.testing.assert_close(a.model(ids).logits, b.model(ids).logits)
    names = [n for n, p in b.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)  # fresh RL LoRA on the merged base


def test_cli_prepares_the_warm_start_before_rl(tmp_path, monkeypatch, capsys):
    """sprpo-train: --warm-start-only builds and scores the warm start, and prints it; a training
    command prepares it first (here served from that cache) and trains from it."""
    from sprpo_lib.train.trainer import main

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    ov = ["warm_start=true", "sft.n_tasks=2", "sft.epochs=1", "sft.lora.rank=4", "sft.eval_tasks=1",
          "iterations=1", "rollout.tasks_per_step=1", "env.max_steps=2"]
    assert main(["--profile", "smoke", "--no-progress", "--warm-start-only", *ov]) == 0
    shown = capsys.readouterr().out
    ws = next((tmp_path / "runs" / "sft").glob("webshop-*"))
    assert f"warm start: {ws}" in shown and '"success_rate"' in shown
    made = (ws / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns
    assert main(["--profile", "smoke", "--no-progress", "--out", str(tmp_path / "run"), *ov]) == 0
    assert (tmp_path / "run" / "final" / "adapter").is_dir()
    assert (ws / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns == made  # not built again


def test_dagger_warm_start_builds_on_the_cached_base(tmp_path, monkeypatch):
    """sft.dagger_rounds: the warm start without DAgger is built (or reused) under its own key,
    the rounds go to a folder of their own, and RL starts from the last round merged."""
    import dataclasses

    from sprpo_lib.model.load import load_policy
    from sprpo_lib.model.lora import load_adapter
    from sprpo_lib.warmstart.cache import warm_start_dir
    from sprpo_lib.warmstart.dagger import without_dagger

    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    ov = ["warm_start=true", "sft.n_tasks=2", "sft.epochs=1", "sft.lora.rank=4", "iterations=1", "sft.episode_steps=2"]
    cfg = load_config("smoke", ov + ["sft.dagger_rounds=1", "sft.dagger_tasks=1"])
    a = _warm_trainer(cfg, tmp_path / "a")
    base = warm_start_dir(dataclasses.replace(cfg, sft=without_dagger(cfg.sft)))
    assert a.warm_start_dir != base and base == warm_start_dir(load_config("smoke", ov))
    rounds = list(base.glob("dagger-*/round-1/round.json"))
    assert (base / "adapter").is_dir() and len(rounds) == 1 and (a.warm_start_dir / "adapter").is_dir()
    ref = load_policy(cfg.model.spec)
    load_adapter(ref, a.warm_start_dir / "adapter", merge=True)
    ids = torch.randint(3, 250, (1, 12))
    torch.testing.assert_close(a.model(ids).logits, ref.model(ids).logits)  # RL's fresh LoRA starts at zero
    b = _warm_trainer(load_config("smoke", ov), tmp_path / "b")  # the base is served from its cache
    assert b.warm_start_dir == base
    import sprpo_lib.warmstart.dagger as dagger_mod

    calls = []
    real = dagger_mod.train_sft
    monkeypatch.setattr(dagger_mod, "train_sft", lambda *a, **k: calls.append(1) or real(*a, **k))
    two = _warm_trainer(load_config("smoke", ov + ["sft.dagger_rounds=2", "sft.dagger_tasks=1"]),
                        tmp_path / "c")  # a second round extends the first, which is not run again
    assert len(calls) == 1 and sorted(p.name for p in rounds[0].parent.parent.iterdir()) == ["round-1", "round-2"]
    assert two.warm_start_dir not in (base, a.warm_start_dir)


def test_warm_start_key_follows_the_demonstrators_label_version(monkeypatch):
    """A demonstrator whose labels changed gets a new cache folder; the others keep theirs."""
    from sprpo_lib.warmstart import demos
    from sprpo_lib.warmstart.cache import warm_start_key

    alf = load_config("cpu", **{"env.name": "alfworld"})
    web = load_config("cpu")
    before = warm_start_key(alf, alf.rollout.agent), warm_start_key(web, web.rollout.agent)
    monkeypatch.setitem(demos.LABEL_VERSIONS, "explorer", demos.LABEL_VERSIONS["explorer"] + 1)
    after = warm_start_key(alf, alf.rollout.agent), warm_start_key(web, web.rollout.agent)
    assert after[0] != before[0] and after[1] == before[1]


def test_extend_run_and_refuse_other_config(tmp_path):
    ov = ["rollout.tasks_per_step=1", "method.name=vanilla"]
    out = train(load_config("smoke", ov + ["iterations=1"]), tmp_path / "r", progress=False)
    first = load_file(str(next((out / "final" / "adapter").rglob("adapter_model.safetensors"))))
    # extends it; where the metrics go is not part of the config: the new logger gets iteration 1
    out = train(load_config("smoke", ov + ["iterations=2", "logger=[jsonl,tensorboard]"]), tmp_path / "r",
                progress=False)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [__import__("json").loads(ln)["iteration"] for ln in lines] == [0, 1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    tb.Reload()
    last = __import__("json").loads(lines[1])
    numbers = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert set(tb.Tags()["scalars"]) == set(numbers)  # every metric of metrics.jsonl
    # peak memory per phase, and dynamic sampling's counts (off in smoke: one round, nothing dropped)
    assert 0 < last["rollout_peak_rss_gib"] < 64 and 0 < last["update_peak_rss_gib"] < 64
    assert last["rollout_rounds"] == 1 and last["episodes_dropped"] == 0 and last["updated"] in (0.0, 1.0)
    assert all([(e.step, e.value) for e in tb.Scalars(k)] == [(1, pytest.approx(v))] for k, v in numbers.items())
    meta = __import__("json").loads((out / "config.json").read_text())
    assert meta["commit"] and len(meta["entered_at"]) == 1  # the starting commit is kept
    second = load_file(str(next((out / "final" / "adapter").rglob("adapter_model.safetensors"))))
    assert any(not torch.equal(first[k], second[k]) for k in first)  # final/ rewritten after the new iteration
    with pytest.raises(ValueError, match="different config"):
        train(load_config("smoke", ov + ["iterations=2", "update.lr=0.5"]), tmp_path / "r", progress=False)


def test_a_longer_run_is_its_plan_run_continued_and_equals_one_trained_that_long(tmp_path):
    """paper.report.longer_grid copies a finished run and resumes it to more iterations: its
    first iterations are the copy's, and the whole run equals one trained that long from
    scratch (nothing in training depends on the total), metrics and final adapter alike."""
    import json

    from sprpo_lib.paper.report import longer_grid, run_grid

    ov = ["rollout.tasks_per_step=1", "iterations=1"]
    [base] = run_grid("smoke", "webshop", ["vanilla"], [0], ov, out_root=tmp_path / "plan", progress=False)
    [longer] = longer_grid("smoke", "webshop", ["vanilla"], [0], 2, ov, out_root=tmp_path / "plan", progress=False)
    [scratch] = run_grid("smoke", "webshop", ["vanilla"], [0], ov + ["iterations=2"], out_root=tmp_path / "scratch",
                         progress=False)
    assert longer == tmp_path / "plan" / "longer" / base.name

    def numbers(run):  # what the iteration computed, not how long it took
        rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not (k.endswith("_s") or "rss" in k or k in {"cpu_per_wall", "loadavg_1min"})}
                for r in rows]

    assert numbers(longer)[:1] == numbers(base) and len(numbers(longer)) == 2
    assert numbers(longer) == numbers(scratch)
    adapters = [load_file(str(next((r / "final" / "adapter").rglob("adapter_model.safetensors")))) for r in (longer, scratch)]
    assert adapters[0].keys() == adapters[1].keys() and all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    assert longer_grid("smoke", "webshop", ["vanilla"], [0], 2, ov, out_root=tmp_path / "plan", find=True) == [longer]
    with pytest.raises(ValueError, match="longer_iterations=1: a longer run needs more than"):
        longer_grid("smoke", "webshop", ["vanilla"], [0], 1, ov, out_root=tmp_path / "plan", progress=False)


def test_warm_start_and_final_eval_on_same_held_out_tasks(tmp_path, monkeypatch):
    import json


    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    ov = ["warm_start=true", "sft.n_tasks=2", "sft.epochs=1", "sft.lora.rank=4", "sft.eval_tasks=3",
          "eval_tasks=3", "iterations=1", "rollout.tasks_per_step=1", "sft.agreement=true"]
    prepare_warm_start(load_config("smoke", ov), progress=False)
    out = train(load_config("smoke", ov), tmp_path / "run", progress=False)
    start = json.loads(next((tmp_path / "runs" / "sft").glob("webshop-*/eval.json")).read_text())
    final = json.loads((out / "final" / "eval.json").read_text())
    assert start["indices"] == final["indices"] == [2, 4] and start["episodes"] == final["episodes"] == 3
    eps = [json.loads(ln) for ln in (out / "final" / "eval_episodes.jsonl").read_text().splitlines()]
    assert sorted(e["task_index"] for e in eps) == [2, 3, 4]
    assert start["temperature"] == final["temperature"] == 0.4  # Table 3 validation temperature
    cfg = load_config("smoke", ov)
    import sprpo_lib.warmstart.heldout as E

    assert E.eval_is_current(out / "final" / "eval.json", cfg, 3)
    assert not E.eval_is_current(out / "final" / "eval.json", cfg, 4)  # other task count: redo
    hot = load_config("smoke", ov + ["eval_temperature=null", "rollout.generation.temperature=0.9"])
    assert E.eval_temperature(hot) == 0.9 and not E.eval_is_current(out / "final" / "eval.json", hot, 3)
    longer = load_config("smoke", ov + ["rollout.generation.max_new_tokens=9"])
    assert not E.eval_is_current(out / "final" / "eval.json", longer, 3)  # generation settings changed: redo
    # sft.agreement: the clone against its demonstrator on the demonstrator's states of the same held-out tasks
    from sprpo_lib.agent.envs import make_pool
    from sprpo_lib.warmstart.cache import warm_start_dir
    from sprpo_lib.warmstart.demos import collect_demonstrations

    ws = warm_start_dir(cfg)
    agree = json.loads((ws / "agreement.json").read_text())
    pool = make_pool(cfg.env.name, seed=cfg.env.seed)
    demos = collect_demonstrations(pool, cfg.sft.split, [2, 3, 4], cfg.rollout.agent,
                                   demonstrator=cfg.sft.demonstrator, max_steps=cfg.sft.episode_steps)
    assert agree["states"] == len(demos) > 0 and agree["indices"] == [2, 4]
    assert sum(v["states"] for v in agree["by_verb"].values()) == len(demos) and 0 <= agree["agree"] <= len(demos)
    assert E.current_agreement(ws / "agreement.json", cfg, 3) == agree
    assert E.current_agreement(ws / "agreement.json", cfg, 4) is None  # other task count: redo
    assert warm_start_dir(load_config("smoke", ov[:-1])) == ws  # not part of the warm start's key


def test_sprpo_sigma_scales_closed_form():
    from sprpo_lib.core.methods import MethodConfig, make_method

    S = torch.tensor([[1e-8, 4e-8], [16e-8, 64e-8]], dtype=torch.float64)
    for scale in ("raw", "relative"):
        m = make_method(MethodConfig(name="sprpo", rho=0.2, scale=scale, sigma_max=1e9), (2, 2))
        torch.testing.assert_close(m.sigma(), torch.full((2, 2), 0.2))  # Alg. 1 line 1: S = m = 1 -> rho
        m.S_hat, m.m_hat, m.m_ref = S.clone(), 0.5, 0.02
        raw = 0.2 * 0.5 / S.sqrt()
        rel = 0.2 * (0.5 / 0.02) / (S / 8e-8).sqrt()  # geometric mean of S: (1*4*16*64)^(1/4) e-8
        torch.testing.assert_close(m.sigma().double(), raw if scale == "raw" else rel, rtol=1e-6, atol=0)
        st = m.state_dict()
        fresh = make_method(MethodConfig(name="sprpo", rho=0.2, scale=scale, sigma_max=1e9), (2, 2))
        fresh.load_state_dict(st)
        assert torch.equal(fresh.sigma(), m.sigma()) and fresh.m_ref == 0.02
    with pytest.raises(ValueError, match="method.scale"):
        MethodConfig(name="sprpo", scale="log")


def test_dynamic_sampling_refills_groups_without_a_score_spread(tmp_path, monkeypatch):
    """rollout.refill_rounds (DAPO's dynamic sampling): groups whose episodes all scored alike
    are dropped and new tasks are played, under the same xi, until tasks_per_step groups have a
    spread; the batch's groups are renumbered, the rest reported as dropped.  Scripted scores:
    round 0 has no spread, round 1 one group with it, round 2 two."""
    import sprpo_lib.train.trainer as T
    from sprpo_lib.agent.rollout import EpisodeRecord

    played = []

    def fake_run_groups(envs, tasks, group_size, gen, *a, **k):
        rnd = (gen.cfg.seed - tr.cfg.seed * 100_003) // 1_000_003
        played.append((rnd, list(tasks), tr.actor.fc.xi is not None))
        eps = []
        for g, (split, idx) in enumerate(tasks):
            spread = g < rnd  # round r: its first r groups have a spread
            for r in range(group_size):
                eps.append(EpisodeRecord("webshop", split, idx, f"t{idx}", g, r, "do it",
                                         score=float(r % 2) if spread else 0.0))
        return eps, {"generate_s": 1.0, "env_s": 0.5, "steps": len(eps)}

    monkeypatch.setattr(T, "run_groups", fake_run_groups)
    tr = _trainer(tmp_path, "method.name=gaussian", "rollout.refill_rounds=3", "rollout.tasks_per_step=2",
                  "rollout.group_size=2")
    eps, xi, st = tr.collect(4)
    assert [p[0] for p in played] == [0, 1, 2] and all(p[2] for p in played)  # stops once two groups have a spread
    assert played[0][1] == tr.sample_tasks(4) and played[1][1] != played[0][1]  # new tasks each round
    assert st["rounds"] == 3 and st["groups_with_spread"] == 2 and st["generate_s"] == 3.0
    assert sorted({e.group for e in eps}) == [0, 1] and len(eps) == 4
    assert all(len({e.score for e in eps if e.group == g}) == 2 for g in (0, 1))
    assert len(st["dropped"]) == 3 * 4 - 4
    # without refills: one round, every group kept as played
    played.clear()
    tr.cfg.rollout.refill_rounds = 0
    eps, _, st = tr.collect(4)
    assert len(played) == 1 and st["rounds"] == 1 and not st["dropped"] and len(eps) == 4


def test_eval_every_draws_the_curve_without_changing_the_training(tmp_path):
    """``eval_every`` (verl's test_freq): a held-out evaluation after every N-th iteration,
    in the metrics and in heldout/iter_<k>/, and the same adapter as a run without it."""
    import json

    from sprpo_lib.train.trainer import heldout_dir, is_complete
    from sprpo_lib.warmstart.heldout import load_eval

    ov = ["rollout.tasks_per_step=1", "method.name=vanilla", "iterations=2", "eval_tasks=2"]
    plain = _adapter(train(load_config("smoke", ov), tmp_path / "plain", progress=False))
    cfg = load_config("smoke", ov + ["eval_every=1"])
    out = train(cfg, tmp_path / "curve", progress=False)
    curve = _adapter(out)
    assert curve.keys() == plain.keys() and all(torch.equal(curve[k], plain[k]) for k in curve)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    # the final policy is the last iteration's: its evaluation is that one, not made again
    assert (out / "final" / "eval.json").read_text() == (heldout_dir(out, 1) / "eval.json").read_text()
    assert load_eval(out / "final" / "eval.json")["episodes"] == 2
    for k, row in enumerate(rows):
        res = load_eval(heldout_dir(out, k) / "eval.json")
        assert res["episodes"] == 2 and row["heldout_success"] == res["success_rate"]
    # the last one lost: the finished run is not complete, and training again evaluates it (nothing retrained)
    import shutil

    shutil.rmtree(heldout_dir(out, 1))
    assert not is_complete(cfg, out)
    train(cfg, out, progress=False)
    assert is_complete(cfg, out) and load_eval(heldout_dir(out, 1) / "eval.json")["episodes"] == 2
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    with pytest.raises(ValueError, match="eval_every=3 needs eval_tasks >= 1"):
        load_config("smoke", ["eval_every=3"])
