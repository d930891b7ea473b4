"""``sprpo-bench estimates`` against independent references: the parts of line 7's replay sum to
the whole replay's gradients (float32, one backward over the whole batch); on rows that are copies
of one row every part and every half is the replay exactly; a shadow method fed what the run
records agrees with it exactly; the float32 twin of a float32 model's replay is that replay; and
the bench runs end to end on the smoke profile, in bfloat16 with its float32 twin too."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import sprpo_lib.bench.estimates as E
from sprpo_lib.bench.cli import main
from sprpo_lib.bench.estimates import (
    batch_agreement,
    bench_estimates,
    combine,
    dtype_agreement,
    ema_agreement,
    float32_replay,
    old_log_probs_at,
    part_gradients,
    record_parts,
    split_rows,
)
from sprpo_lib.bench.report import headline, section
from sprpo_lib.bench.suite import rel_l2
from sprpo_lib.core.actor import SURROGATE
from sprpo_lib.core.batch import Batch, build_batch
from sprpo_lib.core.methods import MethodConfig, grad_leaf, make_method
from sprpo_lib.train.config import load_config
from sprpo_lib.train.trainer import Trainer


def _signal(eps):
    """A random tiny model earns no reward: give the batch's episodes different scores."""
    for i, e in enumerate(eps):
        e.steps[-1].env_reward += float(i % 3)
    return eps


def _trainer_batch(tmp_path):
    tr = Trainer(load_config("smoke", ["method.name=sprpo"]), tmp_path / "t", progress=False)
    eps, xi, _ = tr.collect(0)
    batch, _ = build_batch(_signal(eps), tr.cfg.update.adv, "gigpo")
    tr.actor.ppo_update(batch, xi)  # theta_{k+1}, old log-probs of theta_k kept on the samples
    return tr, batch, xi


def test_parts_sum_to_the_whole_replay(tmp_path):
    tr, batch, xi = _trainer_batch(tmp_path)
    a = tr.actor
    assert a.dtype == torch.float32
    nonzero = [i for i, s in enumerate(batch.samples) if s.adv != 0.0]
    assert len(nonzero) >= 3
    leaf = grad_leaf(xi, a)
    a.zero_grad()
    a.backward(batch, leaf, terms=SURROGATE)  # the replay as SPrPO.update runs it: the whole batch at once
    ref_xi = leaf.grad.detach().double().clone()
    ref_th = torch.cat([p.grad.detach().flatten().double() for p in a.params])
    a.zero_grad()
    parts = [nonzero[0::3], nonzero[1::3], nonzero[2::3]]
    grads = part_gradients(a, batch, xi, parts)
    assert [g["tokens"] for g in grads] == [sum(batch.samples[i].n_resp for i in p) for p in parts]
    g_xi, g_th = combine(grads, batch.n_tokens)
    assert float(ref_xi.abs().sum()) > 0 and float(ref_th.abs().sum()) > 0
    # float32 sums in another order: the relative L2 error of the vectors (not of their tiny entries)
    assert float((g_xi - ref_xi).norm() / ref_xi.norm()) < 1e-5
    assert float((g_th - ref_th).norm() / ref_th.norm()) < 1e-5


def test_the_bench_records_what_sprpo_update_records_under_replay_frac_1_and_1_over_parts(tmp_path):
    """The run's method gets line 7's full replay and the shadow the ``replay_frac = 1/parts`` replay
    (same rows, same factor), each checked against ``SPrPO.update`` itself from the same state."""
    tr, batch, xi = _trainer_batch(tmp_path)  # after one update: restore to a snapshot taken here
    snap = ([p.detach().clone() for p in tr.actor.params], copy.deepcopy(tr.actor.opt.state_dict()))

    def restore():
        with torch.no_grad():
            for p, v in zip(tr.actor.params, snap[0]):
                p.copy_(v)
        tr.actor.opt.load_state_dict(copy.deepcopy(snap[1]))

    ref = {}
    for frac in (1.0, 0.5):
        restore()
        m = make_method(MethodConfig(name="sprpo", replay_frac=frac), tr.shape)
        m.update(tr.actor, batch.without_old(), 1, xi)
        ref[frac] = (m.S_hat.clone(), m.m_hat)
    restore()
    fresh = batch.without_old()
    tr.actor.ppo_update(fresh, xi)
    split, c = split_rows(fresh, 2, 0, 1)
    nonzero = [i for i, s in enumerate(fresh.samples) if s.adv != 0.0]
    assert sorted(i for p in split for i in p) == nonzero and len(split) == 2  # disjoint, every row once
    run, shadow = (make_method(MethodConfig(name="sprpo"), tr.shape) for _ in range(2))
    record_parts(run, shadow, part_gradients(tr.actor, fresh, xi, split), c, fresh.n_tokens)
    for got, (S, m) in ((run, ref[1.0]), (shadow, ref[0.5])):
        assert rel_l2(got.S_hat, S) < 1e-4 and got.m_hat == pytest.approx(m, rel=1e-4)
    assert rel_l2(shadow.S_hat, run.S_hat) > 1e-3  # half of distinct rows is an estimate, not the replay


def test_copies_of_one_row_make_every_part_the_replay(tmp_path):
    """Every part of rows that are copies of one row has the whole batch's per-token gradient, so its
    ratio estimate (factor T_A / T) is the replay's S_hat and m_hat, and the halves agree exactly."""
    tr, batch, xi = _trainer_batch(tmp_path)
    row = next(s for s in batch.samples if s.adv != 0.0)
    zero = [dataclasses.replace(s, adv=0.0) for s in batch.samples if s is not row][:3]
    dup = Batch([dataclasses.replace(row) for _ in range(4)] + zero)
    grads = part_gradients(tr.actor, dup, xi, [[0], [1], [2], [3]])
    c = 4 * row.n_resp / dup.n_tokens
    full_xi, full_th = combine(grads, dup.n_tokens)
    full = (full_xi.pow(2), float(full_th.pow(2).sum()))
    got = batch_agreement(grads, full, c, MethodConfig(name="sprpo"))
    assert got["part_vs_replay"]["S_spearman"] == pytest.approx(1.0, abs=1e-3)
    assert got["part_vs_replay"]["S_rel_l2"] < 1e-4 and got["part_vs_replay"]["m_hat_rel_diff"] < 1e-4
    assert got["half_vs_half"]["S_rel_l2"] < 1e-4 and got["half_vs_half"]["sigma_rel_l2"] < 1e-4


def test_ema_agreement_is_exact_for_the_same_measurements_and_moves_otherwise():
    shape = (3, 8)
    cfg = MethodConfig(name="sprpo")
    run, same, other = (make_method(cfg, shape, 0) for _ in range(3))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        d = torch.randn(shape, generator=g, dtype=torch.float64)
        run.record(d, 2.0)
        same.record(d.clone(), 2.0)
        other.record(torch.randn(shape, generator=g, dtype=torch.float64), 2.0)
    exact = ema_agreement(run, same)
    assert exact["S_bar_spearman"] == 1.0 and exact["S_bar_rel_l2"] == 0.0 and exact["sigma_rel_l2"] == 0.0
    moved = ema_agreement(run, other)
    assert moved["S_bar_spearman"] < 0.9 and moved["sigma_rel_l2"] > 0.01


def test_bench_estimates_runs_a_real_sprpo_run_and_saves_each_iteration(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    real = E.build_batch
    monkeypatch.setattr(E, "build_batch", lambda eps, *a, **kw: real(_signal(eps), *a, **kw))
    saved = []
    res = bench_estimates("smoke", "alfworld", iterations=2, parts=2, save=lambda r: saved.append(json.dumps(r)))
    assert len(res["iterations"]) == 2 and len(saved) == 2
    first, second = res["iterations"]
    assert first["replay_vs_previous_spearman"] is None and second["replay_vs_previous_spearman"] is not None
    for row in res["iterations"]:
        assert row["rows_nonzero_adv"] >= 2 and row["parts"] == 2 and row["replay_parts_s"] >= row["part0_s"] >= 0
        assert -1 <= row["part_vs_replay"]["S_spearman"] <= 1 and row["half_vs_half"]["S_rel_l2"] > 0
    assert res["summary"]["measured"] == 2 and res["summary"]["ema_last"] == second["ema"]
    for bad in (1, 3):
        with pytest.raises(ValueError, match="--parts"):
            bench_estimates("smoke", "alfworld", iterations=1, parts=bad)


def test_cli_writes_the_record(tmp_path, monkeypatch):
    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    real = E.build_batch
    monkeypatch.setattr(E, "build_batch", lambda eps, *a, **kw: real(_signal(eps), *a, **kw))
    out = tmp_path / "est.json"
    assert main(["estimates", "--profile", "smoke", "--env", "alfworld", "--iterations", "1", "--parts", "2",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["bench"] == "estimates" and "partial" not in rec and rec["results"]["summary"]["measured"] == 1
    text = section(rec, out)  # the report's table: one row per iteration, then the means
    row = rec["results"]["iterations"][0]
    assert (f"| 0 | {row['rows_nonzero_adv']} | {row['replay_parts_s']} ({row['part0_s']}) | "
            f"{row['part_vs_replay']['S_spearman']} |") in text
    assert "Means over 1 batches" in text
    assert f"Spearman {row['part_vs_replay']['S_spearman']} per batch" in headline(rec)


def test_float32_twin_of_a_float32_model_is_the_replay(tmp_path):
    """On a float32 model the twin is the replay itself: the same gradient as the parts' sum, and an
    exact agreement (Spearman 1, S_hat total 1x); the bench refuses such a model with --float32."""
    tr, batch, xi = _trainer_batch(tmp_path)
    nonzero = [i for i, s in enumerate(batch.samples) if s.adv != 0.0]
    parts = [nonzero[0::2], nonzero[1::2]]
    grads = part_gradients(tr.actor, batch, xi, parts)
    g32 = float32_replay(tr.actor, batch, xi, parts)
    g_xi, g_th = combine(grads, batch.n_tokens)
    t_xi, t_th = combine([g32], batch.n_tokens)
    assert rel_l2(t_xi, g_xi) < 1e-5 and rel_l2(t_th, g_th) < 1e-5
    full = (g_xi.pow(2), float(g_th.pow(2).sum()))
    got = dtype_agreement(g32, full, batch.n_tokens, MethodConfig(name="sprpo"))
    assert got["S_spearman"] == pytest.approx(1.0, abs=1e-3) and got["S_sum_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert got["S_rel_l2"] < 1e-4 and got["sigma_rel_l2"] < 1e-4


def test_float32_twin_of_a_bfloat16_run(tmp_path, monkeypatch):
    """A bfloat16 run's replay against its float32 twin: rounding moves S_hat (not exactly the twin),
    the frozen weights are bfloat16 again after each twin, and the record's table and phrase show it."""
    monkeypatch.setenv("SPRPO_HOME", str(tmp_path))
    real = E.build_batch
    monkeypatch.setattr(E, "build_batch", lambda eps, *a, **kw: real(_signal(eps), *a, **kw))
    seen = []
    real_twin = E.float32_replay

    def spy(actor, *a, **kw):
        out = real_twin(actor, *a, **kw)
        seen.append({str(p.dtype) for p in actor.model.parameters() if not p.requires_grad})
        return out

    monkeypatch.setattr(E, "float32_replay", spy)
    out = tmp_path / "est.json"
    assert main(["estimates", "--profile", "smoke", "--env", "alfworld", "--iterations", "1", "--parts", "2",
                 "--float32", "--out", str(out), "model.dtype=bfloat16"]) == 0
    rec = json.loads(out.read_text())
    res = rec["results"]
    assert res["dtype"] == "bfloat16" and res["float32"] is True and seen == [{"torch.bfloat16"}] * 2
    row = res["iterations"][0]
    d32 = row["dtype_vs_float32"]
    assert row["float32_s"] > 0 and 0 < d32["S_rel_l2"] and -1 <= d32["S_spearman"] <= 1 and d32["S_sum_ratio"] > 0
    assert res["summary"]["dtype_vs_float32"]["S_spearman"] == d32["S_spearman"]
    assert 0 < row["old_logp_rounding"]["S_rel_l2"] and "old_logp_rounding" in res["summary"]
    text = section(rec, out)
    assert f"| {row['float32_s']} | {d32['S_spearman']} ({d32['S_sum_ratio']}) |" in text
    assert "against the same replay in float32" in text
    assert f"the bfloat16 replay against float32's: Spearman {d32['S_spearman']}" in headline(rec)
    with pytest.raises(ValueError, match="already runs in float32"):
        bench_estimates("smoke", "alfworld", iterations=1, parts=2, float32=True)


def test_old_log_probs_at_theta_k_are_the_first_steps(tmp_path):
    """Recomputed at the adapter before the update, the old log-probs are the ones the update's first
    step read (a float32 model: equal up to float32 rounding), and the actor keeps theta_{k+1}."""
    tr = Trainer(load_config("smoke", ["method.name=sprpo"]), tmp_path / "t", progress=False)
    eps, xi, _ = tr.collect(0)
    batch, _ = build_batch(_signal(eps), tr.cfg.update.adv, "gigpo")
    theta_k = [p.detach().clone() for p in tr.actor.params]
    tr.actor.ppo_update(batch, xi)
    theta_k1 = [p.detach().clone() for p in tr.actor.params]
    assert any(not torch.equal(a, b) for a, b in zip(theta_k, theta_k1))
    again = old_log_probs_at(tr.actor, batch, xi, theta_k)
    assert all(torch.equal(p, v) for p, v in zip(tr.actor.params, theta_k1))
    for s, t in zip(batch.samples, again.samples):
        assert s.old_logp is not None and t.old_logp.shape == s.old_logp.shape
        assert float((t.old_logp - s.old_logp).abs().max()) < 1e-4
    moved = old_log_probs_at(tr.actor, batch, xi, theta_k1)  # at theta_{k+1}: other log-probs
    assert max(float((t.old_logp - s.old_logp).abs().max()) for s, t in zip(batch.samples, moved.samples)) > 1e-3
