"""``sprpo-bench estimates``: does a replay of a share of the rows (``method.replay_frac``) give SPrPO
the noise the full replay (Alg. 1 line 7) gives, over the batches of a real run?

``bench train`` compares one batch's S_hat, but sigma is drawn from S-bar, an EMA of S_hat over
iterations (``MethodConfig.scale="energy"``), and one batch's S_hat moves a lot between batches: in
the committed ``cpu`` runs consecutive replays rank the channels with Spearman 0.20-0.30.  So this
bench runs ``iterations`` of SPrPO (rollout under its own sigma, line 6's PPO update, line 7 at
theta_{k+1} under xi_k) and runs line 7's replay as ``parts`` disjoint parts of the rows with a
non-zero advantage: the first is the subset ``replay_frac = 1/parts`` replays
(:func:`sprpo_lib.core.methods.replay_rows`, same rows, same factor), the rest split at random.
Their token-weighted sum is the replay's gradient (the same sum in another order), which the run's
method records: the run is an SPrPO run.  A shadow SPrPO records the first part's ratio estimate:
what a ``replay_frac = 1/parts`` run records on these batches.

Per batch: each part's ratio estimate against the replay, one half of the parts against the other,
and the replay against the previous iteration's (another batch, theta and xi: how much S_hat moves
in a run).  Through the EMAs: the shadow's S-bar and next sigma against the run's, beside the run's
own sigma step.

``float32=True`` (a 16-bit model) asks the same of the model's dtype: each batch's replay runs again
in float32 at the same theta_{k+1} and xi (the frozen weights cast,
:func:`sprpo_lib.core.perturb.float32_compute`), with old log-probs recomputed in float32 at theta_k
(what a float32 run reads, and what ``method.replay_float32`` measures), and a second shadow
records it.  The run's replay against that twin is the dtype's rounding alone, set beside the
sampling noise of half the rows; through the EMAs, the sigma a float32 replay would draw against
the run's.  A third replay, in float32 with the run's own old log-probs, says how much of the
difference the old log-probs' rounding makes (through the tokens the PPO clip keeps or drops)."""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import torch

from sprpo_lib.bench.suite import estimate_agreement, rel_l2
from sprpo_lib.core.actor import SURROGATE, Actor
from sprpo_lib.core.batch import Batch, build_batch
from sprpo_lib.core.methods import (
    Method,
    float32_old_log_probs,
    grad_leaf,
    make_method,
    rank_correlation,
    replay_rows,
)
from sprpo_lib.core.perturb import float32_compute
from sprpo_lib.infra import hardware as hw
from sprpo_lib.train.config import load_config
from sprpo_lib.train.trainer import Trainer, run_folder


def split_rows(batch: Batch, parts: int, seed: int, k: int) -> tuple[list[list[int]], float]:
    """``(parts, c)``: indices into ``batch.samples`` of the rows with a non-zero advantage in up to
    ``parts`` disjoint parts, the first the subset ``replay_rows(batch, 1/parts, seed, k)`` replays,
    the others the remaining rows split at random (a stream of their own); ``c`` is that subset's
    ratio-estimate factor (T_A / T)."""
    sub, c = replay_rows(batch, 1 / parts, seed, k)
    pos = {id(s): i for i, s in enumerate(batch.samples)}
    first = [pos[id(s)] for s in sub.samples]
    taken = set(first)
    rest = [i for i, s in enumerate(batch.samples) if s.adv != 0.0 and i not in taken]
    random.Random(f"estimates/{seed}/{k}").shuffle(rest)
    others = [sorted(rest[j::parts - 1]) for j in range(parts - 1)]
    return [p for p in [first, *others] if p], c


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


def float32_replay(actor: Actor, batch: Batch, xi: torch.Tensor, parts: Sequence[Sequence[int]]) -> dict:
    """Line 7's replay of every row of ``parts`` as one part in float32, at the actor's parameters,
    under ``xi``, with the samples' old log-probs: the frozen 16-bit weights are cast inside the pass
    (:func:`float32_compute`, bit-exact on the way back).  :func:`part_gradients`'s dict of that part."""
    with float32_compute(actor.model):
        if odd := {str(p.dtype) for p in actor.model.parameters()} - {"torch.float32"}:
            raise RuntimeError(f"bench estimates --float32: parameters in {sorted(odd)} inside the float32 replay")
        return part_gradients(actor, batch, xi, [sorted(i for p in parts for i in p)])[0]


def old_log_probs_at(actor: Actor, batch: Batch, xi: torch.Tensor, theta_k: Sequence[torch.Tensor]) -> Batch:
    """A copy of ``batch`` with old log-probs computed in float32 at ``theta_k`` (the adapter before
    line 6) under ``xi``, as ``method.replay_float32`` computes them before its update
    (:func:`sprpo_lib.core.methods.float32_old_log_probs`); the actor's parameters are put back."""
    now = [p.detach().clone() for p in actor.params]
    try:
        with torch.no_grad():
            for p, v in zip(actor.params, theta_k):
                p.copy_(v)
        return float32_old_log_probs(actor, batch, xi)
    finally:
        with torch.no_grad():
            for p, v in zip(actor.params, now):
                p.copy_(v)


def dtype_agreement(g32: dict, full: tuple[torch.Tensor, float], total_tokens: int, mcfg) -> dict:
    """The run's replay in the model's dtype (``full``: its S_hat and m_hat) against its float32 twin
    (``g32``, over the same rows): :func:`estimate_agreement` with float32 as the reference, and
    ``S_sum_ratio``, the total of S_hat over float32's (rounding noise adds its variance to every
    squared entry: a ratio above 1 over many batches would be a bias the EMA keeps)."""
    S32 = _stat(*combine([g32], total_tokens))
    return {**estimate_agreement(S32, full, mcfg),
            "S_sum_ratio": round(float(full[0].sum()) / max(float(S32[0].sum()), 1e-30), 4)}


def float32_twins(actor: Actor, batch: Batch, xi: torch.Tensor, parts: Sequence[Sequence[int]],
                  theta_k: Sequence[torch.Tensor], full: tuple[torch.Tensor, float], run: Method, shadow32: Method) -> dict:
    """The run's replay (``full``, at the actor's theta_{k+1}) against its float32 twins (module doc):
    ``shadow32`` records the twin with float32 old log-probs at ``theta_k``; returned are that twin's
    seconds, its agreement with the run's replay, the twin with the run's old log-probs against it
    (``old_logp_rounding``) and the EMAs' agreement (``ema_float32``, float32's the reference)."""
    g32_old = float32_replay(actor, batch, xi, parts)
    g32 = float32_replay(actor, old_log_probs_at(actor, batch, xi, theta_k), xi, parts)
    g_xi, g_th = combine([g32], batch.n_tokens)
    shadow32.record(g_xi, float(g_th.pow(2).sum()))
    with_run_old = _stat(*combine([g32_old], batch.n_tokens))
    return {"float32_s": round(g32["seconds"], 2),
            "dtype_vs_float32": dtype_agreement(g32, full, batch.n_tokens, shadow32.cfg),
            "old_logp_rounding": dtype_agreement(g32, with_run_old, batch.n_tokens, shadow32.cfg),
            "ema_float32": ema_agreement(shadow32, run)}


def combine(grads: Sequence[dict], total_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dL/dxi, grad_theta)`` of the token mean over ``total_tokens`` from parts' own token means:
    the sum of each part's gradient weighted by its share of the tokens."""
    w = [g["tokens"] / max(1, total_tokens) for g in grads]
    return sum(wi * g["xi"] for wi, g in zip(w, grads)), sum(wi * g["theta"] for wi, g in zip(w, grads))


def record_parts(run: Method, shadow: Method, grads: list[dict], c: float, total_tokens: int) -> None:
    """Line 7's ``record`` for both methods: the run gets the replay (the parts' token-weighted
    sum), the shadow the first part's ratio estimate (``c`` times its gradient), as
    ``SPrPO.update`` passes them under ``replay_frac`` 1 and ``1/parts``."""
    g_xi, g_th = combine(grads, total_tokens)
    run.record(g_xi, float(g_th.pow(2).sum()))
    shadow.record(c * grads[0]["xi"], c * c * float(grads[0]["theta"].pow(2).sum()))


def _stat(g_xi: torch.Tensor, g_th: torch.Tensor, c: float = 1.0) -> tuple[torch.Tensor, float]:
    """``(S_hat, m_hat)`` of a gradient scaled by the ratio-estimate factor ``c``."""
    return (c * g_xi).pow(2), float((c * g_th).pow(2).sum())


def _mean(rows: list[dict]) -> dict:
    """Field by field mean of dicts of numbers (unrounded)."""
    return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}


def _rounded(d: dict) -> dict:
    return {k: round(v, 4) for k, v in d.items()}


def ema_agreement(run: Method, shadow: Method) -> dict:
    """The shadow method's S-bar and next sigma against the run's (what the next rollout draws)."""
    return {"S_bar_spearman": round(rank_correlation(run.S_bar, shadow.S_bar), 4),
            "S_bar_rel_l2": round(rel_l2(shadow.S_bar, run.S_bar), 4),
            "sigma_rel_l2": round(rel_l2(shadow.sigma(), run.sigma()), 4),
            "s_k_run": round(run.last.get("s_k", 1.0), 4), "s_k_shadow": round(shadow.last.get("s_k", 1.0), 4)}


def batch_agreement(grads: list[dict], full: tuple[torch.Tensor, float], c: float, mcfg) -> dict:
    """One batch: each part's ratio estimate against the replay (mean over the parts), and the
    first half of the parts against the second (each a ratio estimate of about half the rows; an
    even number of parts)."""
    parts = [estimate_agreement(full, _stat(g["xi"], g["theta"], c), mcfg) for g in grads]
    half = len(grads) // 2
    halves = [_stat(*combine(gs, sum(g["tokens"] for g in gs)), c) for gs in (grads[:half], grads[half:])]
    return {"part_vs_replay": _rounded(_mean(parts)), "half_vs_half": estimate_agreement(halves[0], halves[1], mcfg)}


def bench_estimates(profile: str = "cpu", env: str = "webshop", iterations: int = 6, parts: int = 4,
                    overrides: Sequence[str] | None = None, save: Callable[[dict], None] | None = None,
                    float32: bool = False) -> dict:
    """``iterations`` SPrPO iterations whose line 7 runs as ``parts`` disjoint parts (module doc);
    per iteration its seconds (``replay_parts_s``: the parts' backwards together, ``part0_s``: the
    first part's, what a ``1/parts`` replay costs), the per-batch agreements and the EMA agreement;
    ``summary``: means over the iterations measured and the last EMA agreement.  ``save(result)``
    runs after each iteration (a killed run keeps what it measured).  ``float32``: also the replay's
    float32 twins (module doc): ``dtype_vs_float32``, ``old_logp_rounding``, ``ema_float32`` and
    ``float32_s`` (the float32 replay's seconds) per batch."""
    if parts < 2 or parts % 2:
        raise ValueError(f"bench estimates --parts: expected an even number >= 2 (each part is a 1/parts replay; "
                         f"halves of the parts are compared), got {parts}")
    if iterations < 1:
        raise ValueError(f"bench estimates --iterations: expected at least 1, got {iterations}")
    cfg = load_config(profile, [hw.allocator_override(), *(overrides or []), f"env.name={env}", "method.name=sprpo",
                                "method.sensitivity=replay", "method.replay_frac=1.0"])
    if cfg.update.loss.loss_agg_mode != "token-mean" or cfg.method.scale != "energy":
        raise ValueError("bench estimates: needs update.loss.loss_agg_mode=token-mean (the ratio estimate) and "
                         f"method.scale=energy (sigma from S-bar), got {cfg.update.loss.loss_agg_mode!r} and "
                         f"{cfg.method.scale!r}")
    tr = Trainer(cfg, run_folder(cfg), progress=True)
    if float32 and tr.dtype == "float32":
        tr.envs.close()
        raise ValueError("bench estimates --float32: the model already runs in float32, so its replay has no float32 "
                         "twin; drop --float32 or run a 16-bit model (model.dtype=bfloat16)")
    run, shadow = tr.method, make_method(cfg.method, tr.shape, cfg.seed)
    shadow32 = make_method(cfg.method, tr.shape, cfg.seed) if float32 else None
    res: dict = {"profile": profile, "env": env, "overrides": list(overrides or []), "dtype": tr.dtype,
                 "parts": parts, "replay_frac": round(1 / parts, 4), "float32": float32, "iterations": []}
    previous: torch.Tensor | None = None
    try:
        for k in range(iterations):
            t0 = time.perf_counter()
            eps, xi, rst = tr.collect(k)
            batch, _ = build_batch(eps, cfg.update.adv, cfg.update.estimator)
            n = sum(1 for s in batch.samples if s.adv != 0.0)
            row = {"k": k, "rows": len(batch.samples), "rows_nonzero_adv": n, "tokens": batch.n_tokens,
                   "success": round(sum(e.success for e in eps) / max(1, len(eps)), 4),
                   "rollout_s": round(rst["rollout_s"], 2)}
            t1 = time.perf_counter()
            if not n:  # no signal: the method's own update, whose replay measures zeros (the energy rule skips them)
                tr.update(batch, xi, k)
                res["iterations"].append({**row, "update_s": round(time.perf_counter() - t1, 2),
                                          "skipped": "no row with A != 0"})
                continue
            theta_k = [p.detach().clone() for p in tr.actor.params] if shadow32 is not None else None
            tr.actor.ppo_update(batch, xi)  # line 6: theta_{k+1}
            row["update_s"] = round(time.perf_counter() - t1, 2)
            split, c = split_rows(batch, parts, cfg.seed, k)
            grads = part_gradients(tr.actor, batch, xi, split)  # line 7, in parts
            row.update(parts=len(split), part0_rows=len(split[0]), replay_parts_s=round(sum(g["seconds"] for g in grads), 2),
                       part0_s=round(grads[0]["seconds"], 2))
            sigma_before = run.sigma()
            record_parts(run, shadow, grads, c, batch.n_tokens)
            full = (run.S_hat, run.m_hat)
            if shadow32 is not None:  # the same replay in float32: the dtype's rounding alone
                row.update(float32_twins(tr.actor, batch, xi, split, theta_k, full, run, shadow32))
            if len(split) == parts:  # enough rows for every part
                row.update(batch_agreement(grads, full, c, cfg.method))
            row["replay_vs_previous_spearman"] = (round(rank_correlation(previous, full[0]), 4)
                                                  if previous is not None else None)
            previous = full[0]
            row["ema"] = {**ema_agreement(run, shadow), "sigma_step_rel_l2": round(rel_l2(run.sigma(), sigma_before), 4)}
            row["iteration_s"] = round(time.perf_counter() - t0, 2)
            res["iterations"].append(row)
            print(f"[estimates] {env} k={k}: {n} rows, replay in parts {row['replay_parts_s']} s; part vs replay "
                  f"Spearman {row.get('part_vs_replay', {}).get('S_spearman')}, half vs half "
                  f"{row.get('half_vs_half', {}).get('S_spearman')}, replay vs previous "
                  f"{row['replay_vs_previous_spearman']}; EMA: S-bar Spearman {row['ema']['S_bar_spearman']}, sigma "
                  f"rel L2 {row['ema']['sigma_rel_l2']} (the run's own step {row['ema']['sigma_step_rel_l2']})"
                  + (f"; {tr.dtype} vs float32 replay ({row['float32_s']} s): Spearman "
                     f"{row['dtype_vs_float32']['S_spearman']}, sigma through the EMAs rel L2 "
                     f"{row['ema_float32']['sigma_rel_l2']}" if "dtype_vs_float32" in row else ""), flush=True)
            res["summary"] = summarize(res["iterations"])
            if save is not None:
                save(res)
    finally:
        tr.envs.close()
    res["summary"] = summarize(res["iterations"])
    return res


def summarize(rows: list[dict]) -> dict:
    """Means over the measured iterations: the per-batch agreements, the EMA's sigma difference and
    the run's own sigma step, and the seconds; the last iteration's EMA agreement."""
    done = [r for r in rows if "ema" in r]
    if not done:
        return {"measured": 0}
    prev = [r["replay_vs_previous_spearman"] for r in done if r["replay_vs_previous_spearman"] is not None]

    def avg(key: str, sub: str | None = None) -> float:
        vals = [r[key] if sub is None else r[key][sub] for r in done]
        return round(sum(vals) / len(vals), 4)

    return {"measured": len(done),
            "part_vs_replay": _rounded(_mean([r["part_vs_replay"] for r in done if "part_vs_replay" in r])),
            "half_vs_half": _rounded(_mean([r["half_vs_half"] for r in done if "half_vs_half" in r])),
            "replay_vs_previous_spearman": round(sum(prev) / len(prev), 4) if prev else None,
            "ema_last": done[-1]["ema"], "ema_sigma_rel_l2_mean": avg("ema", "sigma_rel_l2"),
            "sigma_step_rel_l2_mean": avg("ema", "sigma_step_rel_l2"),
            "rollout_s_mean": avg("rollout_s"), "update_s_mean": avg("update_s"),
            "replay_parts_s_mean": avg("replay_parts_s"), "part0_s_mean": avg("part0_s"),
            **({"dtype_vs_float32": _rounded(_mean([r["dtype_vs_float32"] for r in done])),
                "old_logp_rounding": _rounded(_mean([r["old_logp_rounding"] for r in done])),
                "ema_float32_last": done[-1]["ema_float32"], "float32_s_mean": avg("float32_s")}
               if all("dtype_vs_float32" in r for r in done) else {})}


__all__ = ["batch_agreement", "bench_estimates", "combine", "dtype_agreement", "ema_agreement", "float32_replay",
           "float32_twins", "old_log_probs_at", "part_gradients", "record_parts", "split_rows", "summarize"]
