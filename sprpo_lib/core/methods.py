"""Training-time perturbation methods, one registry entry each (App. B, Algs. 1-4).

A method decides (i) the FFN-channel perturbation ``xi`` under which the policy collects
its rollouts (:meth:`Method.rollout_xi`) and (ii) its update (:meth:`Method.update`),
written with the explicit-tensor operations of :class:`sprpo_lib.core.actor.Actor`, so each
``update`` can be read next to its algorithm box.  The training loop
(:mod:`sprpo_lib.train.trainer`) is the same for all:

=============  ========================  ===================================  ========================
method         rollout (Alg. line)       update                                after the update
=============  ========================  ===================================  ========================
``vanilla``    pi_theta (Alg. 2 l. 2)    grad L(theta_k)                      --
``gaussian``   pi^xi, xi = sigma z       grad L(theta_k; xi), same xi         --
               (Alg. 3 l. 2-4)
``sam``        pi_theta (Alg. 4 l. 2)    g = dL/du at u=1; xi = -rho g/|g|;   --
                                         replay under xi (Alg. 4 l. 3-5)
``sprpo``      pi^xi, xi ~ N(0, sigma^2) grad L(theta_k; xi), same xi         S = |dL/dxi|^2, m = |grad L|^2
               sigma = rho m S^(-a/2)    (Alg. 1 l. 6)                        at theta_{k+1} (Alg. 1 l. 7)
               (Alg. 1 l. 3-5)
=============  ========================  ===================================  ========================

``L`` is the paper's surrogate (to maximise); the code minimises ``loss = -L``, so
``dL/dv = -dloss/dv`` wherever a sign matters (SAM's direction).

Each ``xi`` is drawn from a generator seeded by ``(seed, iteration)``, so a resumed run
draws the same perturbations as an uninterrupted one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Annotated

import torch
from annotated_types import Ge, Interval

from sprpo_lib.core import metrics as MK
from sprpo_lib.core.actor import SURROGATE, TRAIN, Actor
from sprpo_lib.core.batch import Batch
from sprpo_lib.core.perturb import float32_compute, sample_xi
from sprpo_lib.infra.io import OMIT_AT_DEFAULT
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.infra.registry import Registry


@dataclass
class MethodConfig:
    """Hyper-parameters of all methods (App. B, Table "Perturbation-specific ...").

    Attributes:
        name: ``vanilla`` | ``gaussian`` | ``sam`` | ``sprpo``.
        sigma: Gaussian baseline noise scale (0.10).
        sam_rho: SAM perturbation radius (5e-3; rho = 0.1 collapsed in the paper).
        rho: SPrPO base perturbation scale (0.20).
        alpha: SPrPO sensitivity exponent (1.0; ``0`` = the "w/o sensitivity" ablation).
        schedule: SPrPO gradient-norm scheduling; ``False`` keeps m_hat = 1 (the "w/o
            scheduling" ablation).
        sensitivity: ``"replay"`` (Alg. 1 line 7: one extra forward/backward of the same
            batch at theta_{k+1}) or ``"one_pass"`` (reuse the update's own backward at
            theta_k: one step stale, no extra pass).
        s_floor: numerical guard, S_hat is clamped below at ``s_floor * mean(S_hat)``
            (and at 1e-30) before the power, so a channel whose gradient vanished does
            not get an infinite sigma.
        sigma_max: every sigma_lc is clamped to at most this.  A channel's factor 1 + xi
            flips sign with probability Phi(-1 / sigma): 15.9% at sigma = 1, 2.3% at 0.5
            (the default), 0.6% at 0.4, so a sign flip, which is not a small perturbation,
            stays rare.
        scale: how SPrPO's statistics enter sigma.  ``"energy"`` (default) is described
            last.  ``"raw"`` is Alg. 1 line 3
            literally: sigma = rho * m_hat * S_hat^(-alpha/2) with the raw |dL/dxi|^2 and
            ||grad||^2, whose magnitudes depend on the loss scale and the model (on a
            small model they put 99.6% of the channels at ``sigma_max``; not unit-free:
            sigma scales with lambda under a rescaling lambda of the loss).
            ``"relative"`` (a documented deviation; the paper does not say how its
            statistics are scaled) uses S_hat / geomean(S_hat) and m_hat / m_1 (m_1 =
            the first measured m_hat): the same shape across channels and the same
            decay with the gradient norm, with sigma = rho at the log-average channel
            and at the first gradient norm.  The geometric mean because S_hat is
            heavy-tailed: the arithmetic mean is dominated by a few channels.  Its
            anchor is one noisy measurement and S_hat a one-sample estimate (chi^2_1-like
            noise inflates the mean sigma by about 1.5x): in the first ``cpu`` runs it
            let sigma run away to the clamp.
            ``"energy"``: the energy-normalised rule (:func:`energy_sigma`).  Corollary 1
            bounds ``sum_c sigma_c^2 S_c``; at a fixed noise energy the entropy-maximising
            allocation under that bound is ``sigma_c ~ S_c^(-1/2)`` (alpha = 1).  S-bar is an
            EMA of S_hat over iterations (a Monte-Carlo estimate of the expectation over xi
            in Corollary 1), floored at its ``s_quantile`` quantile (scale-free); weights
            ``w_c = S-bar_c^(-alpha/2)``; ``sigma_c = min(sigma_max, tau_k w_c)`` with tau_k
            solved so that ``RMS_c(sigma) = rho * s_k``, where ``s_k = clip((m-bar_k /
            m-bar_ref)^p, s_lo, s_hi)``, m-bar a bias-corrected EMA of m_hat (``m_stat``, each
            measurement limited to ``m_clip`` around m-bar) and m-bar_ref the plain average of the
            same measurements so far (``ref_after``), so s_k = 1 at the first measurement, tracks
            the gradient norm's trend (Alg. 1: sigma ~ m) and averages to about 1 over a run whose
            m_hat only fluctuates.  Invariant to any rescaling of the loss.
        ema: weight of the past in the EMAs of ``scale="energy"`` (0: the last measurement).
        m_stat: the EMA behind m-bar (``scale="energy"``).  ``"log"`` (default): of log m_hat,
            a geometric average.  m_hat = ||grad L||^2 is a square of a one-batch estimate: in
            the ``cpu`` runs it moved by up to 70x between consecutive iterations (0.0014 ->
            2e-5), and an arithmetic EMA let one large value hold s_k at s_hi for several
            iterations (mean s_k 1.28 over a WebShop run, 1.29 over the other seed, with a
            reference fixed after two measurements).  Replayed on the same measurements the
            log EMA with ``m_clip=3`` and the running reference averages s_k = 0.995 and 0.981.
            ``"linear"``: the arithmetic EMA.
        m_clip: a measurement further than this factor from m-bar enters as that factor (a
            one-batch spike then moves s_k by at most ``m_clip^(1-ema)`` at once); ``0`` off.
        s_quantile: quantile of S-bar at which ``scale="energy"`` floors it.
        s_lo, s_hi, p: the schedule's clip range and exponent (``scale="energy"``).
        ref_after: ``0`` (default): m-bar_ref is the average of every measurement so far (in
            the ``m_stat`` space).  ``n > 0``: m-bar_ref is m-bar once n measurements are in,
            then fixed (s_k = 1 there).  A reference from the first two one-batch measurements
            put a whole run's noise off rho by up to 1.5x on simulated log-normal m_hat; the
            running one keeps the run's mean s_k within 0.71-1.29.
        replay_frac: share of the rows with a non-zero advantage that line 7's replay runs (a
            deviation for cost; the paper replays all of D_k).  ``1.0`` (default): every row.
            Below 1: a uniform random subset of ``ceil(replay_frac * n)`` of those rows, drawn
            from ``(seed, k)``, whose token-mean gradient is scaled by ``T_A / T`` (the response
            tokens of all non-zero-advantage rows over the batch's): a ratio estimate of the whole
            batch's token-mean gradient (zero-advantage rows add nothing to it but their tokens to
            its denominator, as in :meth:`Actor.rows_with_gradient`).
            A subset adds sampling noise to S_hat and m_hat (E|g_sub|^2 = |g|^2 + its variance):
            ``sprpo-bench train --replay-frac`` reports its agreement with the full replay.  On a
            ``cpu`` WebShop batch of 53 rows (AMX Xeon, bf16) a quarter of the rows cut the iteration
            from 1.91x to 1.31x Vanilla's, but its S_hat ranked channels with Spearman 0.42 against
            the replay's (half the rows: 0.47), m_hat was off by a relative 5.0 (1.4), and the sigma
            it implies differed by a relative L2 of 1.0: per-row gradients mostly cancel in the
            batch mean, so a subset's is dominated by their variance.  Hence the default of 1.
            Nor does the EMA behind sigma close the gap: ``sprpo-bench estimates`` feeds a shadow
            method a quarter's estimate on each batch of a real run, and its sigma stays further
            from the replay's than the run's own sigma moves in an iteration (the records in
            ``figures/bench_*.md``): the replay's own halves of one batch rank the channels with a
            Spearman of about 0.3, so the replay itself is a noisy measurement that a share of it
            cannot reproduce.
        replay_float32: line 7 of a 16-bit model in float32: theta_k's log-probs (computed before
            line 6, :func:`float32_old_log_probs`) and the replay at theta_{k+1} run with the frozen
            weights cast (:func:`sprpo_lib.core.perturb.float32_compute`); line 6's update is
            unchanged.  ``False`` (default): the model's dtype, as a bf16 GPU run measures it.
            Rounding is a noise of its own here: ``sprpo-bench estimates --float32`` compares
            each batch's bf16 replay with this float32 one at the same theta_{k+1} over a run
            (records in ``figures/bench_*.md``).  On the ``cpu`` batches (WebShop, ALFWorld) the
            two ranked the channels with a Spearman of 0.61 and 0.81 (half the rows against the
            other half: 0.31 and 0.39), and after 6 and 4 iterations the sigma drawn from the EMAs
            differed by a relative L2 of 0.33 in both (the run's own last step: 0.15 and 0.37).
            A float32 replay that kept the bf16 old log-probs agreed with this one only to a
            Spearman of 0.77 in both: much of the difference is the old log-probs' rounding,
            through the tokens the PPO clip drops, hence both passes here.  A float32 replay
            costs 1.7-2.1x the bf16 one on a CPU without AMX (``sprpo-bench grads``, the same
            batches), plus the float32 forward at theta_k, and no run has yet shown that it changes
            learning, hence the default.
    """

    name: str = "vanilla"
    sigma: Annotated[float, Ge(0)] = 0.10
    sam_rho: Annotated[float, Ge(0)] = 5e-3
    rho: Annotated[float, Ge(0)] = 0.20
    alpha: Annotated[float, Ge(0)] = 1.0
    schedule: bool = True
    sensitivity: str = "replay"
    s_floor: Annotated[float, Ge(0)] = 1e-6
    sigma_max: Annotated[float, Ge(0)] = 0.5
    scale: str = "energy"
    ema: Annotated[float, Interval(ge=0, lt=1)] = 0.8
    m_stat: str = "log"
    m_clip: Annotated[float, Ge(0)] = 3.0
    s_quantile: Annotated[float, Interval(ge=0, lt=1)] = 0.05
    s_lo: Annotated[float, Interval(gt=0, le=1)] = 0.5
    s_hi: Annotated[float, Ge(1)] = 1.5
    p: Annotated[float, Ge(0)] = 1.0
    ref_after: Annotated[int, Ge(0)] = 0
    replay_frac: Annotated[float, Interval(gt=0, le=1)] = field(default=1.0, metadata=OMIT_AT_DEFAULT)
    replay_float32: bool = field(default=False, metadata=OMIT_AT_DEFAULT)

    def __post_init__(self):
        check_ranges(self)
        METHODS.get(self.name)  # an unknown name lists the valid ones
        if self.sensitivity not in ("replay", "one_pass"):
            raise ValueError(f"method.sensitivity must be 'replay' or 'one_pass', got {self.sensitivity!r}")
        if self.scale not in ("raw", "relative", "energy"):
            raise ValueError(f"method.scale must be 'raw' (Alg. 1 literally), 'relative' or 'energy', got {self.scale!r}")
        if self.m_stat not in ("log", "linear"):
            raise ValueError(f"method.m_stat must be 'log' (EMA of log m_hat) or 'linear', got {self.m_stat!r}")
        if not (self.m_clip == 0 or self.m_clip > 1):
            raise ValueError(f"method.m_clip={self.m_clip}: expected 0 (off) or a factor > 1; for example method.m_clip=3")
        if self.replay_float32 and self.sensitivity != "replay":
            raise ValueError("method.replay_float32 runs line 7's replay in float32, and method.sensitivity="
                             f"{self.sensitivity!r} has no replay: set method.sensitivity=replay or method.replay_float32=false")


def _gen(seed: int, k: int, salt: int = 17) -> torch.Generator:
    """The generator of iteration ``k``'s draws; ``salt`` keeps streams apart (17: xi)."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(k) * 7919 + salt)


def grad_leaf(t: torch.Tensor, actor: Actor) -> torch.Tensor:
    """A fresh leaf copy of ``t`` whose ``.grad`` a backward pass fills."""
    return t.detach().to(actor.fc.device, actor.fc.dtype).clone().requires_grad_(True)


class Method:
    """Base: Vanilla GiGPO (Alg. 2)."""

    name = "vanilla"

    def __init__(self, cfg: MethodConfig, shape: tuple[int, int], seed: int = 0):
        self.cfg, self.shape, self.seed = cfg, tuple(shape), seed

    def rollout_xi(self, k: int) -> torch.Tensor | None:
        """The perturbation under which iteration ``k`` collects rollouts."""
        return None

    def update(self, actor: Actor, batch, k: int, xi: torch.Tensor | None) -> dict:
        """Alg. 2 line 4: theta_{k+1} = theta_k + eta grad L_k(theta_k)."""
        return actor.ppo_update(batch, xi)

    def sigma_stats(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


METHODS: Registry[type[Method]] = Registry("method", "method.name")
register_method = METHODS.register
METHODS.register("vanilla")(Method)


@register_method("gaussian")
class Gaussian(Method):
    """Isotropic multiplicative noise, xi = sigma z, z ~ N(0, I), held through the
    rollout and the update (Alg. 3 lines 2-5; the update is the base class's)."""

    name = "gaussian"

    def rollout_xi(self, k: int) -> torch.Tensor:
        return sample_xi(self.cfg.sigma, self.shape, generator=_gen(self.seed, k))  # Alg. 3 lines 2-3

    def sigma_stats(self) -> dict:
        return {"sigma_mean": self.cfg.sigma, "sigma_min": self.cfg.sigma, "sigma_max": self.cfg.sigma}


@register_method("sam")
class SAM(Method):
    """FFN-channel SAM (Alg. 4): unperturbed rollout (line 2), channel gradient of the
    surrogate at u = 1 (line 3), xi = -rho g / ||g|| (line 4), replay under xi (line 5)."""

    name = "sam"

    def update(self, actor: Actor, batch, k: int, xi: torch.Tensor | None) -> dict:
        u = torch.ones(self.shape, device=actor.fc.device, dtype=actor.fc.dtype, requires_grad=True)
        with actor.timing(MK.SENSITIVITY_S):
            actor.zero_grad()
            probe = actor.backward(batch, gain=u, terms=SURROGATE)  # line 3: u.grad = dloss/du = -dL/du = -g
            actor.zero_grad()
        g = -u.grad.detach().float().cpu()
        norm = g.norm()
        adv_xi = -self.cfg.sam_rho * g / norm if norm > 0 else torch.zeros(self.shape)  # line 4
        stats = actor.ppo_update(batch.without_old(), adv_xi)  # line 5: ratios under xi_k
        self.last_xi = adv_xi
        return {**stats, "sam_g_norm": float(norm), "sam_xi_norm": float(adv_xi.norm()),
                "sam_token_frac": probe["grad_token_frac"]}


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two equally shaped tensors (flattened; ties broken
    by position): whether S_hat of one iteration predicts the next one's (signal) or not
    (noise), or how sigma orders channels against an importance score."""
    x, y = a.detach().double().flatten(), b.detach().double().flatten()
    if x.numel() != y.numel() or x.numel() < 2:
        raise ValueError(f"rank_correlation: need two tensors of equal size >= 2, got {x.numel()} and {y.numel()}")
    rx = torch.empty_like(x).scatter_(0, x.argsort(), torch.arange(x.numel(), dtype=torch.float64))
    ry = torch.empty_like(y).scatter_(0, y.argsort(), torch.arange(y.numel(), dtype=torch.float64))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den > 0 else 0.0


def energy_sigma(S_bar: torch.Tensor, alpha: float, target_rms: float, sigma_max: float,
                 s_quantile: float = 0.05) -> tuple[torch.Tensor, dict]:
    """``scale="energy"``: ``sigma_c = min(sigma_max, tau w_c)``, ``w_c = S_c^(-alpha/2)`` with S
    floored at its ``s_quantile`` quantile (of its positive values when more channels than that
    are exactly 0: they then share the floor's sigma), and tau solved so that ``RMS_c(sigma) = target_rms``
    (clamped channels hold ``sigma_max``; the others share the rest of the energy).  Scaling
    S by any positive factor leaves sigma unchanged.  Returns sigma (float32) and
    ``{"tau", "clamped_frac", "energy_ratio"}``, where the energy ratio is V / V_G:
    ``V = sum sigma^2 S`` against the same sum for isotropic noise of equal energy (<= 1 by
    Chebyshev's sum inequality, sigma being non-increasing in S)."""
    S = S_bar.double()
    floor = float(torch.quantile(S.flatten(), s_quantile))
    if not floor > 0:  # more than s_quantile of the channels at 0: the quantile of the positive ones
        pos = S[S > 0]
        floor = float(torch.quantile(pos, s_quantile)) if pos.numel() else 1.0
    S = S.clamp_min(floor)
    if alpha == 0:
        w = torch.ones_like(S)
    else:
        w = (S / floor).pow(-alpha / 2.0)  # scale-free and <= 1 (1 at the floor): no overflow at any scale
    n, clamped = w.numel(), torch.zeros_like(w, dtype=torch.bool)
    target2 = float(target_rms) ** 2
    tau = float(target_rms) / float(w.pow(2).mean().sqrt())  # exact when nothing clamps (alpha = 0: target)
    for _ in range(w.numel() + 1):  # water-filling: a clamped channel stays clamped as tau grows
        now = tau * w >= sigma_max
        if torch.equal(now, clamped):
            break
        clamped = now
        free = w[~clamped]
        rest = n * target2 - int(clamped.sum()) * sigma_max ** 2
        if free.numel() == 0 or rest <= 0:  # the target exceeds what sigma_max allows: all at the cap
            tau = float("inf")
            break
        tau = (rest / float(free.pow(2).sum())) ** 0.5
    sigma = (tau * w).clamp(max=sigma_max) if tau != float("inf") else torch.full_like(w, sigma_max)
    v = float((sigma.pow(2) * S).sum())
    v_iso = float(sigma.pow(2).mean() * S.sum())
    info = {"tau": tau, "clamped_frac": float((sigma >= sigma_max).double().mean()),
            "energy_ratio": v / v_iso if v_iso > 0 else 1.0}
    return sigma.float(), info


@register_method("sprpo")
class SPrPO(Method):
    """Stable Perturbation-Robust Policy Optimization (Alg. 1).

    State: ``S_hat`` ``[L, C]`` and ``m_hat`` (both 1 at start, line 1).  ``sigma`` is
    line 3 (with the guards and the ``scale`` option of :class:`MethodConfig`), xi is
    drawn in line 4 and held through the rollout (line 5) and the update (line 6);
    line 7 replays the batch at theta_{k+1} under the same xi, old log-probs fixed at
    theta_k, and reads ``S_hat = (dL_k/dxi)^2`` and ``m_hat = ||grad_theta L_k||^2``
    from that one backward pass of the surrogate.  ``sensitivity="one_pass"`` reads
    both from the surrogate's gradient at theta_k instead (one step stale; the step
    itself then uses that gradient, plus the regularisers' when they are non-zero).
    """

    name = "sprpo"

    def __init__(self, cfg: MethodConfig, shape: tuple[int, int], seed: int = 0):
        super().__init__(cfg, shape, seed)
        self.S_hat = torch.ones(self.shape, dtype=torch.float64)  # line 1
        self.m_hat = 1.0
        self.m_ref = 0.0  # first measured m_hat (scale="relative"); 0 = not measured yet
        # scale="energy": EMAs of S_hat and m_hat (m_acc: the EMA's un-corrected sum, m_sum: the
        # measurements' plain sum, both of log m_hat under m_stat="log"), and the reference m-bar
        self.S_bar = torch.ones(self.shape, dtype=torch.float64)
        self.m_bar, self.m_bar_ref, self.n_measured, self.m_acc, self.m_sum = 1.0, 0.0, 0, 0.0, 0.0
        self.last: dict = {}  # the last sigma's diagnostics
        self.rank_corr = float("nan")  # Spearman of the last two S_hat measurements

    def schedule(self) -> tuple[float, float]:
        """``scale="energy"``: s_k before and after clipping (1 until m-bar_ref is known)."""
        c = self.cfg
        if not c.schedule or self.m_bar_ref <= 0:
            return 1.0, 1.0
        raw = (self.m_bar / self.m_bar_ref) ** c.p
        return raw, min(max(raw, c.s_lo), c.s_hi)

    def sigma(self) -> torch.Tensor:
        """Line 3: sigma = rho * m_hat * S_hat^(-alpha/2)."""
        c = self.cfg
        if c.scale == "energy":
            s_raw, s_k = self.schedule()
            sig, info = energy_sigma(self.S_bar, c.alpha, c.rho * s_k, c.sigma_max, c.s_quantile)
            self.last = {"s_k_raw": s_raw, "s_k": s_k, "rho": c.rho, **info}
            return sig
        S = self.S_hat.clamp_min(max(float(self.S_hat.mean()) * c.s_floor, 1e-30))
        m = self.m_hat if c.schedule else 1.0
        if c.scale == "relative":
            S = S / S.log().mean().exp()  # geometric mean (see MethodConfig.scale)
            if c.schedule and self.m_ref > 0:
                m = self.m_hat / self.m_ref
        return (c.rho * m * S.pow(-c.alpha / 2.0)).clamp(max=c.sigma_max).float()

    def rollout_xi(self, k: int) -> torch.Tensor:
        return sample_xi(self.sigma(), self.shape, generator=_gen(self.seed, k))  # line 4

    def update(self, actor: Actor, batch, k: int, xi: torch.Tensor | None) -> dict:
        if self.cfg.sensitivity == "one_pass":
            return self._update_one_pass(actor, batch, xi)
        if self.cfg.replay_frac < 1 and actor.loss_cfg.loss_agg_mode != "token-mean":
            raise ValueError(f"method.replay_frac < 1 estimates a token-mean surrogate; update.loss.loss_agg_mode is "
                             f"{actor.loss_cfg.loss_agg_mode!r}: set method.replay_frac=1 or update.loss.loss_agg_mode=token-mean")
        xi_leaf = grad_leaf(xi, actor)
        f32 = self.cfg.replay_float32 and actor.dtype != torch.float32
        rows, c = replay_rows(batch, self.cfg.replay_frac, self.seed, k)  # the batch's own samples
        if f32:  # line 7's L_k reads theta_k's log-probs: computed in float32 now, for the replayed rows alone
            rows = float32_old_log_probs(actor, rows, xi)
        kept = self.cfg.replay_frac >= 1 and not f32  # a kept graph is in the model's dtype
        try:  # line 6: theta_{k+1}; the layers below the adapters keep their graph for line 7 (update.replay_graph_gb)
            stats = actor.ppo_update(batch, xi, graph_xi=xi_leaf if kept else None)
            # line 7: replay D_k at theta_{k+1} under xi_k (in float32 under method.replay_float32)
            with actor.timing(MK.SENSITIVITY_S), float32_compute(actor.model, f32):
                actor.zero_grad()
                replay = actor.backward(rows, xi_leaf, terms=SURROGATE)
                self.record(xi_leaf.grad * c, actor.grad_norm_sq() * c * c)
                actor.zero_grad()
        finally:
            actor.drop_graph()
        # the surrogate's change theta_k -> theta_{k+1} on D_k under xi_k (L = -pg_loss), the margin Corollary 1 needs
        change = stats.get("pg_loss", 0.0) - c * replay.get("pg_loss", 0.0)
        return {**stats, "replay_loss": c * replay["loss"], "surrogate_change": change,
                "replay_token_frac": c * replay["grad_token_frac"], "replay_rows": len(rows), **self._measured()}

    def _measured(self) -> dict:
        return {"S_hat_mean": float(self.S_hat.mean()), MK.M_HAT: self.m_hat, "S_rank_corr": self.rank_corr}

    def _update_one_pass(self, actor: Actor, batch, xi: torch.Tensor) -> dict:
        xi_leaf = grad_leaf(xi, actor)
        actor.zero_grad()
        # one forward at theta_k: grad of L_k (-> S_hat, m_hat) in .grad, the regularisers' apart
        stats = actor.backward(batch, xi_leaf, terms=TRAIN, split_regularisers=True)
        self.record(xi_leaf.grad, actor.grad_norm_sq())
        actor.add_side_grads()  # the step's objective: L_k and the regularisers
        actor.step()  # line 6
        return {**stats, **self._measured()}

    def record(self, dloss_dxi: torch.Tensor, grad_norm_sq: float) -> None:
        """Line 7: S_hat = |dL/dxi|^2 (the sign of loss = -L does not matter), m_hat = ||grad||^2.
        ``scale="energy"`` folds them into its EMAs; an all-zero measurement (a batch without
        a non-zero advantage) carries no information and is skipped."""
        S_hat = dloss_dxi.detach().double().cpu().pow(2)
        if self.cfg.scale == "energy" and not (float(S_hat.sum()) > 0 and grad_norm_sq > 0):
            return
        measured_before = self.m_ref > 0
        self.rank_corr = rank_correlation(self.S_hat, S_hat) if measured_before else float("nan")
        self.S_hat, self.m_hat = S_hat, float(grad_norm_sq)
        if self.m_ref <= 0:
            self.m_ref = self.m_hat
        if self.cfg.scale == "energy":
            e, first = self.cfg.ema, self.n_measured == 0
            self.S_bar = self.S_hat.clone() if first else e * self.S_bar + (1 - e) * self.S_hat
            m = self.m_hat
            if self.cfg.m_clip and not first:  # a one-batch spike counts as m_clip times m-bar at most
                m = min(max(m, self.m_bar / self.cfg.m_clip), self.m_bar * self.cfg.m_clip)
            self.n_measured += 1
            log = self.cfg.m_stat == "log"
            x = math.log(m) if log else m
            self.m_acc = e * self.m_acc + (1 - e) * x
            self.m_sum += x
            corrected = self.m_acc / (1 - e ** self.n_measured)  # Adam's bias correction: no weight on the zero start
            self.m_bar = math.exp(corrected) if log else corrected
            if not self.cfg.ref_after:  # the running reference: the plain average of the same measurements
                mean = self.m_sum / self.n_measured
                self.m_bar_ref = math.exp(mean) if log else mean
            elif self.n_measured == self.cfg.ref_after:  # a fixed reference: this same EMA, s_k = 1 here
                self.m_bar_ref = self.m_bar

    def sigma_stats(self) -> dict:
        s = self.sigma()
        q = torch.quantile(s.double().flatten(), torch.tensor([0.01, 0.99], dtype=torch.float64))
        out = {"sigma_mean": float(s.mean()), "sigma_min": float(s.min()), "sigma_max": float(s.max()),
               "sigma_rms": float(s.double().pow(2).mean().sqrt()), "sigma_p1": float(q[0]), "sigma_p99": float(q[1]),
               "sigma_clamped_frac": float((s >= self.cfg.sigma_max).float().mean()),
               "sigma_layer_rms": [round(float(v), 6) for v in s.double().pow(2).mean(1).sqrt()], "rho": self.cfg.rho}
        if self.cfg.scale == "energy":
            out.update({k: self.last[k] for k in ("s_k_raw", "s_k", "tau", "energy_ratio")})
        return out

    _STATE = ("m_hat", "m_ref", "m_bar", "m_bar_ref", "n_measured", "m_acc", "m_sum", "rank_corr")

    def state_dict(self) -> dict:
        return {"S_hat": self.S_hat.clone(), "S_bar": self.S_bar.clone(),
                **{k: torch.tensor(float(getattr(self, k)), dtype=torch.float64) for k in self._STATE}}

    def load_state_dict(self, state: dict) -> None:
        self.S_hat = state["S_hat"].double().clone()
        self.S_bar = state["S_bar"].double().clone() if "S_bar" in state else torch.ones_like(self.S_hat)
        for k in self._STATE:  # checkpoints written before a field existed start it afresh
            if k in state:
                setattr(self, k, int(state[k]) if k == "n_measured" else float(state[k]))
        if "m_acc" not in state and self.n_measured > 0 and self.m_bar > 0:  # an older checkpoint: its m-bar
            e, log = self.cfg.ema, self.cfg.m_stat == "log"
            x = math.log(self.m_bar) if log else self.m_bar
            self.m_acc, self.m_sum = x * (1 - e ** self.n_measured), x * self.n_measured


def float32_old_log_probs(actor: Actor, batch: Batch, xi: torch.Tensor) -> Batch:
    """``method.replay_float32``: a copy of ``batch`` whose old log-probs are computed in float32 at
    the actor's parameters (theta_k, before line 6) under ``xi``, for line 7's replay; the update keeps
    the batch's own (its first step's, in the model's dtype, so nothing clips at theta_k by rounding).
    Timed as line 7's (``sensitivity_s``)."""
    with actor.timing(MK.SENSITIVITY_S), float32_compute(actor.model):
        lps = actor.log_probs(batch, xi)
    return Batch([replace(s, old_logp=lp) for s, lp in zip(batch.samples, lps)])


def replay_rows(batch: Batch, frac: float, seed: int, k: int) -> tuple[Batch, float]:
    """Line 7's rows under ``MethodConfig.replay_frac``: ``(batch, 1.0)`` at 1; else a uniform
    random ``ceil(frac * n)`` of the ``n`` rows with a non-zero advantage (drawn from run seed
    ``seed`` and iteration ``k``, apart from xi's stream) and the factor
    ``c = T_A / T`` (the response tokens of all ``n`` rows over the batch's) that turns the
    subset's token-mean surrogate, and its gradients, into a ratio estimate of the whole
    batch's (exact when the subset is all ``n`` rows)."""
    if frac >= 1:
        return batch, 1.0
    nonzero = [s for s in batch.samples if s.adv != 0.0]
    if not nonzero:
        return Batch(nonzero), 0.0
    pick = torch.randperm(len(nonzero), generator=_gen(seed, k, salt=29))[:math.ceil(frac * len(nonzero))].sort().values
    return Batch([nonzero[i] for i in pick.tolist()]), sum(s.n_resp for s in nonzero) / max(1, batch.n_tokens)


def make_method(cfg: MethodConfig, shape: tuple[int, int], seed: int = 0) -> Method:
    return METHODS.get(cfg.name)(cfg, shape, seed)
