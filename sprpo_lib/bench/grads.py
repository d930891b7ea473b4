"""``sprpo-bench grads``: how far the update's speed levers move its arithmetic on a real rollout
batch, set against how far the model's dtype moves it.

The gradient tests compare the profile's passes (``shared``) with the reference passes (``whole``,
:func:`sprpo_lib.bench.suite.path_levers`) on tiny models in float32.  This bench asks the same on
the profile's own model and batch: each method's update runs four times from one adapter and
optimizer state, on each path, in the model's dtype and in float32 (the frozen weights cast inside
the update, :func:`sprpo_lib.core.perturb.float32_compute`).  Recorded per update: the LoRA
gradient of the first optimizer step (SPrPO's under the rollout's xi, SAM's at its ascent point),
the parameter change over the whole update, SPrPO's S_hat and m_hat (Alg. 1 line 7), and the first
step's clipped share of tokens and largest ratio (:data:`FIRST_STEP`).

Compared: the paths in float32 (what the levers change beyond rounding: should be float32's own
rounding), the paths in the model's dtype, and each path against its float32 twin (that path's
rounding).  The first method's update on the profile's path in the model's dtype runs twice
(``run_to_run``): a difference there is nondeterminism, not rounding.  The parameter change over
several Adam steps amplifies a first-step difference; two runs whose curves part for that reason
part as two seeds would."""
from __future__ import annotations

import time

import torch

from sprpo_lib.bench.suite import (
    actor_levers,
    estimate_agreement,
    method_variants,
    path_levers,
    rel_l2,
    restore_point,
    rollout_batch,
    use_levers,
)
from sprpo_lib.core.methods import make_method
from sprpo_lib.core.perturb import float32_compute
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.train.config import load_config

PATHS = ("shared", "whole")
#: the first optimizer step's statistics kept per update: at theta_k the new log-probs equal the
#: old ones up to the rounding of two passes, so a clipped token there is a rounding effect
FIRST_STEP = ("clipfrac", "dual_clipfrac", "approx_kl", "ratio_max")
#: ``(name, (path, precision), reference (path, precision))``; ``model``: the model's own dtype
COMPARISONS = (("levers_float32", ("shared", "float32"), ("whole", "float32")),
               ("levers", ("shared", "model"), ("whole", "model")),
               ("rounding_whole", ("whole", "model"), ("whole", "float32")),
               ("rounding_shared", ("shared", "model"), ("shared", "float32")),
               ("run_to_run", ("shared", "model", 1), ("shared", "model")))


def flat(tensors) -> torch.Tensor:
    """The tensors as one float64 vector (a missing gradient as zeros of its parameter's size)."""
    return torch.cat([t.detach().double().flatten() for t in tensors])


def agreement(x: dict, ref: dict) -> dict:
    """One update against a reference update: relative L2 of the first gradient and of the
    parameter change, the share of gradient entries of the same sign, and SPrPO's S_hat
    agreement (:func:`estimate_agreement`) where both measured one."""
    out = {"grad_rel_l2": float(f"{rel_l2(x['grad'], ref['grad']):.3g}"),
           "grad_sign_agree": round(float((x["grad"].sign() == ref["grad"].sign()).double().mean()), 4),
           "delta_rel_l2": float(f"{rel_l2(x['delta'], ref['delta']):.3g}")}
    if "S_hat" in x and "S_hat" in ref:
        out["S_hat"] = estimate_agreement((ref["S_hat"], ref["m_hat"]), (x["S_hat"], x["m_hat"]), x["mcfg"])
    return out


def bench_grads(profile: str = "cpu", env: str = "webshop", methods: tuple[str, ...] = ("vanilla",),
                overrides: list[str] | None = None) -> dict:
    """Each method's update on one rollout batch, on both paths, in the model's dtype and in
    float32, from one adapter and optimizer state: the comparisons of :data:`COMPARISONS` and
    each update's seconds, optimizer steps and norms.

    A model already in float32 has one precision, and only ``levers`` and ``run_to_run`` are
    compared."""
    variants = method_variants(load_config(profile, list(overrides or [])).method)  # a wrong --methods fails first
    unknown = [m for m in methods if m not in variants]
    if unknown or not methods:
        raise ValueError(f"bench grads --methods: expected some of {','.join(variants)}, got {','.join(methods)}")
    tr, batch, _, xi, _, setup_s = rollout_batch(profile, env, overrides)
    if not any(s.adv != 0.0 for s in batch.samples):
        raise ValueError(f"bench grads: every advantage in this {env} batch is 0, so no update takes a gradient step; "
                         "run it with another seed (seed=1) or more tasks (rollout.tasks_per_step=...)")
    a = tr.actor
    own = actor_levers(a)
    levers = {path: path_levers(own, path, tr.cfg.update.prefix_min) for path in PATHS}
    precisions = ("model",) if tr.dtype == "float32" else ("model", "float32")
    restore = restore_point(a)
    theta0 = flat(a.params)
    seen: dict = {"grad": None, "steps": 0}  # of the update running
    step = a.opt.step

    def counted_step(*args, **kwargs):  # the first step's gradient, then the optimizer's own step
        if seen["grad"] is None:
            seen["grad"] = flat(p.grad if p.grad is not None else torch.zeros_like(p) for p in a.params)
        seen["steps"] += 1
        return step(*args, **kwargs)

    runs = [(m, path, prec, k) for m in methods for path in PATHS for prec in precisions
            for k in ((0, 1) if (m, path, prec) == (methods[0], "shared", "model") else (0,))]
    results: dict = {m: {} for m in methods}
    done: dict[tuple, dict] = {}
    bar = progress_bar(total=len(runs), desc="bench grads: updates", unit="update")
    a.opt.step = counted_step
    try:
        for m, path, prec, k in runs:
            bar.set_postfix_str(f"{m} {path} {prec}", refresh=True)
            use_levers(a, levers[path])
            restore()
            seen.update(grad=None, steps=0)
            tr.method = make_method(variants[m], tr.shape, tr.cfg.seed)
            with float32_compute(tr.model, prec == "float32"):
                if prec == "float32" and (odd := {str(p.dtype) for p in tr.model.parameters()} - {"torch.float32"}):
                    raise RuntimeError(f"bench grads: parameters in {sorted(odd)} inside the float32 update")
                t0 = time.perf_counter()
                st = tr.update(batch.without_old(), xi if m.startswith("sprpo") else None, 0)
                seconds = time.perf_counter() - t0
            run = {"grad": seen["grad"], "delta": flat(a.params) - theta0, "mcfg": variants[m]}
            if m.startswith("sprpo"):
                run.update(S_hat=tr.method.S_hat.detach().clone(), m_hat=float(tr.method.m_hat))
            done[(m, path, prec, k)] = run
            results[m].setdefault("updates", {})[f"{path}/{prec}" + ("/again" if k else "")] = {
                "seconds": round(seconds, 2), "extra_pass_s": round(st["sensitivity_s"], 2),
                "optimizer_steps": seen["steps"], "grad_norm": float(f"{float(run['grad'].norm()):.4g}"),
                "delta_norm": float(f"{float(run['delta'].norm()):.4g}"),
                **{f"first_step_{k}": float(f"{st[k]:.4g}") for k in FIRST_STEP if k in st}}
            bar.write(f"  {m} {path} {prec}: update {seconds:.1f} s, {seen['steps']} optimizer steps")
            bar.update()
    finally:
        a.opt.step = step
        use_levers(a, own)
        bar.close()
    for m in methods:
        for name, x, ref in COMPARISONS:
            kx, kr = (m, *x[:2], x[2] if len(x) > 2 else 0), (m, *ref[:2], 0)
            if kx in done and kr in done:
                results[m][name] = agreement(done[kx], done[kr])
    return {"profile": profile, "env": env, "overrides": list(overrides or []), "dtype": tr.dtype,
            "setup_s": round(setup_s, 2), "samples": len(batch.samples),
            "samples_nonzero_adv": sum(1 for s in batch.samples if s.adv != 0.0),
            "lora_params": int(theta0.numel()), "levers": {p: {k: str(v) for k, v in lv.items()} for p, lv in levers.items()},
            "methods": results}

