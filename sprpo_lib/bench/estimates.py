"""``sprpo-bench estimates``: does a replay of a share of the rows (``method.replay_frac``) give SPrPO
the noise the full replay (Alg. 1 line 7) gives, over the batches of a real run?

``bench train`` compares one batch's S_hat, but sigma is drawn from S-bar, an EMA of S_hat over
iterations (``MethodConfig.scale="energy"``), and one batch's S_hat is mostly batch noise: in the
committed ``cpu`` runs consecutive replays rank the channels with Spearman 0.20-0.30.  So this
bench runs ``iterations`` of SPrPO (rollout under its own sigma, line 6's PPO update, line 7 at
theta_{k+1} under xi_k) and runs line 7's replay as ``parts`` disjoint random parts of the rows
with a non-zero advantage.  Their token-weighted sum is the replay's gradient (the same sum in
another order), which advances the run's method: the run is an SPrPO run.  Each part alone is a
``replay_frac = 1/parts`` estimate (:func:`sprpo_lib.core.methods.replay_rows`' ratio estimate).

Per batch: every part against the replay, one half of the rows against the other, and the replay
against the previous iteration's (how much S_hat moves between batches).  Through the EMAs: a
shadow SPrPO fed the first part each iteration (what a run with ``replay_frac = 1/parts`` records
on these batches) against the run's own method: S-bar's rank correlation and the relative L2 of
the sigma each would draw next."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from sprpo_lib.bench.suite import estimate_agreement
from sprpo_lib.core.actor import SURROGATE, Actor
from sprpo_lib.core.batch import Batch, build_batch
from sprpo_lib.core.methods import Method, grad_leaf, make_method, rank_correlation
from sprpo_lib.train.config import load_config
from sprpo_lib.train.trainer import Trainer, run_folder


def part_gradients(actor: Actor, batch: Batch, xi: torch.Tensor, parts: Sequence[Sequence[int]]) -> list[dict]:
    """Line 7's surrogate gradient at the actor's parameters under ``xi``, one backward per part
    (indices into ``batch.samples``): per part ``xi`` (dL/dxi ``[L, C]``), ``theta`` (the flattened
    gradient of every trainable parameter) and ``tokens`` (the part's response tokens), both of
    the part's own token mean, float64 on the CPU, and ``seconds``."""
    leaf = grad_leaf(xi, actor)
    out = []
    for idx in parts:
        rows = Batch([batch.samples[i] for i in idx])
        t0 = time.perf_counter()
        actor.zero_grad()
        leaf.grad = None
        actor.backward(rows, leaf, terms=SURROGATE)
        g_xi = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        g_th = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double().cpu()
                          for p in actor.params])
        out.append({"xi": g_xi.detach().double().cpu().clone(), "theta": g_th, "tokens": rows.n_tokens,
                    "seconds": time.perf_counter() - t0})
    actor.zero_grad()
    return out


def combine(grads: Sequence[dict], total_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dL/dxi, grad_theta)`` of the token mean over ``total_tokens`` from parts' own token means:
    the sum of each part's gradient weighted by its share of the tokens."""
    w = [g["tokens"] / max(1, total_tokens) for g in grads]
    return sum(wi * g["xi"] for wi, g in zip(w, grads)), sum(wi * g["theta"] for wi, g in zip(w, grads))


def _stat(g_xi: torch.Tensor, g_th: torch.Tensor, c: float = 1.0) -> tuple[torch.Tensor, float]:
    """``(S_hat, m_hat)`` of a gradient, scaled by the ratio-estimate factor ``c``."""
    return (c * g_xi).pow(2), float((c * g_th).pow(2).sum())


def _mean(rows: list[dict]) -> dict:
    return {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in rows[0]} if rows else {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 of ``b`` against ``a``."""
    return float((b.double() - a.double()).norm() / a.double().norm().clamp_min(1e-30))


def ema_agreement(run: Method, shadow: Method) -> dict:
    """The shadow method's S-bar and next sigma against the run's (what the next rollout draws)."""
    s_run, s_sh = run.sigma(), shadow.sigma()
    return {"S_bar_spearman": round(rank_correlation(run.S_bar, shadow.S_bar), 4),
            "S_bar_rel_l2": round(_rel(run.S_bar, shadow.S_bar), 4),
            "sigma_rel_l2": round(_rel(s_run, s_sh), 4),
            "s_k_run": round(run.last.get("s_k", 1.0), 4), "s_k_shadow": round(shadow.last.get("s_k", 1.0), 4)}


def batch_agreement(grads: list[dict], full: tuple[torch.Tensor, float], c: float, mcfg) -> dict:
    """One batch: each part's ratio estimate against the replay (mean over parts), and the first
    half of the parts against the second half (each a ratio estimate of half the rows)."""
    parts = [estimate_agreement(full, _stat(g["xi"], g["theta"], c), mcfg) for g in grads]
    half = len(grads) // 2
    halves = [_stat(*combine(gs, sum(g["tokens"] for g in gs)), c) for gs in (grads[:half], grads[half:])]
    return {"part_vs_replay": _mean(parts), "half_vs_half": estimate_agreement(halves[0], halves[1], mcfg)}


def bench_estimates(profile: str = "cpu", env: str = "webshop", iterations: int = 6, parts: int = 4,
                    overrides: Sequence[str] | None = None, save: Callable[[dict], None] | None = None) -> dict:
    """``iterations`` SPrPO iterations whose line 7 runs as ``parts`` disjoint parts (module doc);
    per iteration its timings, the per-batch agreements and the EMA agreement; ``summary``: their
    means over the iterations measured, the last iteration's EMA agreement.  ``save(result)`` is
    called after each iteration (a killed run keeps what it measured)."""
    if parts < 2:
        raise ValueError(f"bench estimates --parts: expected at least 2 (each part is a 1/parts replay), got {parts}")
    if iterations < 1:
        raise ValueError(f"bench estimates --iterations: expected at least 1, got {iterations}")
    cfg = load_config(profile, list(overrides or []) + [f"env.name={env}", "method.name=sprpo",
                                                        "method.sensitivity=replay", "method.replay_frac=1.0"])
    if cfg.update.loss.loss_agg_mode != "token-mean":
        raise ValueError("bench estimates: the ratio estimate needs update.loss.loss_agg_mode=token-mean, "
                         f"got {cfg.update.loss.loss_agg_mode!r}")
    tr = Trainer(cfg, run_folder(cfg), progress=True)
    run, shadow = tr.method, make_method(cfg.method, tr.shape, cfg.seed)
    res: dict = {"profile": profile, "env": env, "overrides": list(overrides or []), "dtype": tr.dtype,
                 "parts": parts, "replay_frac": round(1 / parts, 4), "iterations": []}
    previous: torch.Tensor | None = None
    try:
        for k in range(iterations):
            t0 = time.perf_counter()
            eps, xi, rst = tr.collect(k)
            batch, _ = build_batch(eps, cfg.update.adv, cfg.update.estimator)
            nonzero = [i for i, s in enumerate(batch.samples) if s.adv != 0.0]
            row = {"k": k, "rows": len(batch.samples), "rows_nonzero_adv": len(nonzero), "tokens": batch.n_tokens,
                   "success": round(sum(e.success for e in eps) / max(1, len(eps)), 4),
                   "rollout_s": round(rst["rollout_s"], 2)}
            t1 = time.perf_counter()
            tr.actor.ppo_update(batch, xi)  # Alg. 1 line 6: theta_{k+1}
            row["update_s"] = round(time.perf_counter() - t1, 2)
            if not nonzero:  # no signal: line 7 measures zeros, which the method skips (MethodConfig.scale)
                res["iterations"].append({**row, "skipped": "no row with A != 0"})
                continue
            n_parts = min(parts, len(nonzero))
            perm = torch.randperm(len(nonzero), generator=torch.Generator().manual_seed(cfg.seed * 7919 + k))
            split = [sorted(nonzero[i] for i in perm[j::n_parts].tolist()) for j in range(n_parts)]
            grads = part_gradients(tr.actor, batch, xi, split)  # line 7, in parts
            row["replay_s"] = round(sum(g["seconds"] for g in grads), 2)
            c = sum(batch.samples[i].n_resp for i in nonzero) / max(1, batch.n_tokens)  # replay_rows' factor
            full = _stat(*combine(grads, batch.n_tokens))
            sigma_before = run.sigma()
            run.record(full[0], full[1])  # the run advances as under the full replay
            shadow.record(*_stat(grads[0]["xi"], grads[0]["theta"], c))  # ... and the shadow as under replay_frac
            if n_parts >= 2:
                row.update(batch_agreement(grads, full, c, cfg.method))
            row["replay_vs_previous_spearman"] = (round(rank_correlation(previous, full[0]), 4)
                                                  if previous is not None else None)
            previous = full[0]
            row["ema"] = {**ema_agreement(run, shadow), "sigma_step_rel_l2": round(_rel(sigma_before, run.sigma()), 4)}
            row["iteration_s"] = round(time.perf_counter() - t0, 2)
            res["iterations"].append(row)
            print(f"[estimates] {env} k={k}: {row['rows_nonzero_adv']} rows, replay {row['replay_s']} s; part vs replay "
                  f"Spearman {row.get('part_vs_replay', {}).get('S_spearman')}, half vs half "
                  f"{row.get('half_vs_half', {}).get('S_spearman')}, replay vs previous "
                  f"{row['replay_vs_previous_spearman']}; EMA: S-bar Spearman {row['ema']['S_bar_spearman']}, sigma "
                  f"rel L2 {row['ema']['sigma_rel_l2']} (the run's own step {row['ema']['sigma_step_rel_l2']})", flush=True)
            res["summary"] = summarize(res["iterations"])
            if save is not None:
                save(res)
    finally:
        tr.envs.close()
    res["summary"] = summarize(res["iterations"])
    return res


def summarize(rows: list[dict]) -> dict:
    """Means over the measured iterations of the per-batch agreements, the last EMA agreement, and
    the share of line 7's seconds a ``1/parts`` replay would take (its mean part)."""
    done = [r for r in rows if "ema" in r]
    if not done:
        return {"measured": 0}
    prev = [r["replay_vs_previous_spearman"] for r in done if r["replay_vs_previous_spearman"] is not None]
    return {"measured": len(done),
            "part_vs_replay": _mean([r["part_vs_replay"] for r in done if "part_vs_replay" in r]),
            "half_vs_half": _mean([r["half_vs_half"] for r in done if "half_vs_half" in r]),
            "replay_vs_previous_spearman": round(sum(prev) / len(prev), 4) if prev else None,
            "ema_last": done[-1]["ema"],
            "ema_sigma_rel_l2_mean": round(sum(r["ema"]["sigma_rel_l2"] for r in done) / len(done), 4),
            "sigma_step_rel_l2_mean": round(sum(r["ema"]["sigma_step_rel_l2"] for r in done) / len(done), 4),
            "replay_s_mean": round(sum(r["replay_s"] for r in done) / len(done), 2),
            "update_s_mean": round(sum(r["update_s"] for r in done) / len(done), 2),
            "rollout_s_mean": round(sum(r["rollout_s"] for r in done) / len(done), 2)}


__all__ = ["batch_agreement", "bench_estimates", "combine", "ema_agreement", "part_gradients", "summarize"]
