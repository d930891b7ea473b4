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
from sprpo_lib.core.sigma import EnergyStats, energy_sigma, line3, rank_correlation, relative
from sprpo_lib.infra.io import OMIT_AT_DEFAULT
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.infra.registry import Registry


@dataclass
class MethodConfig:
    """The methods' knobs (App. B, Table 3 "Perturbation-specific training hyperparameters").

    Attributes:
        name: ``vanilla`` | ``gaussian`` | ``sam`` | ``sprpo``.
        sigma: the Gaussian baseline's noise scale (Alg. 3).
        sam_rho: SAM's radius (Alg. 4 line 4).
        rho: SPrPO's base scale (Alg. 1 line 3).
        alpha: SPrPO's sensitivity exponent (0: the "w/o sensitivity" ablation).
        schedule: SPrPO's gradient-norm schedule (False: m_hat = 1, the "w/o scheduling" ablation).
        sensitivity: ``replay`` (Alg. 1 line 7 at theta_{k+1}) or ``one_pass`` (the update's own backward at theta_k).
        s_floor: S_hat's floor, a share of its mean, before the power (``raw``, ``relative``).
        sigma_max: the cap on every sigma_c (1 + xi flips sign with probability Phi(-1/sigma_max)).
        scale: line 3's rule, :mod:`sprpo_lib.core.sigma`: ``energy`` (default; why it departs from the literal line: there), ``raw`` (the literal line), ``relative``.
        ema: weight of the past in ``energy``'s EMAs.
        m_stat: ``log`` (an EMA of log m_hat, default) or ``linear``.
        m_clip: a measurement further than this factor from m-bar enters as that factor (0: off).
        s_quantile: the quantile of S-bar at which ``energy`` floors it.
        s_lo, s_hi, p: the schedule's clip range and exponent, ``s_k = clip((m-bar / m-bar_ref)^p, s_lo, s_hi)``.
        ref_after: 0: m-bar_ref is the running average; n > 0: m-bar after n measurements, then fixed.
        replay_frac: share of the non-zero-advantage rows line 7 replays, a ratio estimate below 1 (a deviation for cost).
        replay_float32: line 7 of a 16-bit model with float32 frozen weights and old log-probs.
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


@register_method("sprpo")
class SPrPO(Method):
    """Stable Perturbation-Robust Policy Optimization (Alg. 1).

    Line 1: S_hat = 1, m_hat = 1.  Line 3: sigma from them by the rule ``method.scale`` names
    (:mod:`sprpo_lib.core.sigma`).  Lines 4-5: xi ~ N(0, sigma^2), held through the rollout.
    Line 6: the PPO step under that xi.  Line 7: D_k replayed at theta_{k+1} under the same xi,
    old log-probs at theta_k: S_hat = (dL_k/dxi)^2 and m_hat = ||grad L_k||^2 from that one
    backward of the surrogate (``sensitivity="one_pass"``: from the step's own backward at theta_k).
    """

    name = "sprpo"

    def __init__(self, cfg: MethodConfig, shape: tuple[int, int], seed: int = 0):
        super().__init__(cfg, shape, seed)
        self.S_hat = torch.ones(self.shape, dtype=torch.float64)  # line 1
        self.m_hat = 1.0  # line 1
        self.m_ref = 0.0  # the first measured m_hat (0: none yet), scale="relative"'s m_1
        self.energy = EnergyStats(torch.ones(self.shape, dtype=torch.float64))  # scale="energy"'s EMAs
        self.last: dict = {}  # diagnostics: the last sigma's
        self.rank_corr = float("nan")  # Spearman of the last two S_hat measurements

    def schedule(self) -> tuple[float, float]:
        """``scale="energy"``'s s_k before and after clipping."""
        c = self.cfg
        return self.energy.schedule(c.p, c.s_lo, c.s_hi, on=c.schedule)

    def sigma(self) -> torch.Tensor:
        """Line 3, under the rule ``method.scale`` names."""
        c = self.cfg
        if c.scale == "energy":
            s_raw, s_k = self.schedule()
            sig, info = energy_sigma(self.energy.S_bar, c.alpha, c.rho * s_k, c.sigma_max, c.s_quantile)
            self.last = {"s_k_raw": s_raw, "s_k": s_k, "rho": c.rho, **info}
            return sig
        if c.scale == "raw":
            return line3(self.S_hat, self.m_hat if c.schedule else 1.0, c.rho, c.alpha, c.sigma_max, c.s_floor)
        m = (self.m_hat / self.m_ref if self.m_ref > 0 else self.m_hat) if c.schedule else 1.0
        return relative(self.S_hat, m, c.rho, c.alpha, c.sigma_max, c.s_floor)

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
        try:  # line 6: theta_{k+1}; the layers below the adapters keep their graph for line 7 (speed.replay_graph_gb)
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
        c = self.cfg
        if c.scale == "energy" and not (float(S_hat.sum()) > 0 and grad_norm_sq > 0):
            return
        self.rank_corr = rank_correlation(self.S_hat, S_hat) if self.m_ref > 0 else float("nan")
        self.S_hat, self.m_hat = S_hat, float(grad_norm_sq)
        if self.m_ref <= 0:
            self.m_ref = self.m_hat
        if c.scale == "energy":
            self.energy.add(self.S_hat, self.m_hat, ema=c.ema, m_clip=c.m_clip, log=c.m_stat == "log",
                            ref_after=c.ref_after)

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

    #: checkpoint scalars: (key, owner attribute path)
    _STATE = (("m_hat", "m_hat"), ("m_ref", "m_ref"), ("m_bar", "energy.m_bar"), ("m_bar_ref", "energy.m_bar_ref"),
              ("n_measured", "energy.n"), ("m_acc", "energy.m_acc"), ("m_sum", "energy.m_sum"),
              ("rank_corr", "rank_corr"))

    def _owner(self, path: str):
        head, _, attr = path.rpartition(".")
        return (self.energy if head else self), attr

    def state_dict(self) -> dict:
        out = {"S_hat": self.S_hat.clone(), "S_bar": self.energy.S_bar.clone()}
        for key, path in self._STATE:
            obj, attr = self._owner(path)
            out[key] = torch.tensor(float(getattr(obj, attr)), dtype=torch.float64)
        return out

    def load_state_dict(self, state: dict) -> None:
        self.S_hat = state["S_hat"].double().clone()
        e = self.energy
        e.S_bar = state["S_bar"].double().clone() if "S_bar" in state else torch.ones_like(self.S_hat)
        for key, path in self._STATE:  # checkpoints written before a field existed start it afresh
            if key in state:
                obj, attr = self._owner(path)
                setattr(obj, attr, int(state[key]) if key == "n_measured" else float(state[key]))
        if "m_acc" not in state and e.n > 0 and e.m_bar > 0:  # an older checkpoint: its m-bar
            log = self.cfg.m_stat == "log"
            x = math.log(e.m_bar) if log else e.m_bar
            e.m_acc, e.m_sum = x * (1 - self.cfg.ema ** e.n), x * e.n


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
