"""Training-time perturbation methods, one registry entry each (App. B, Algs. 1-4).

A method decides (i) the FFN-channel perturbation ``xi`` under which the policy collects
its rollouts, (ii) the perturbation of the update, and (iii) what it learns from the
update.  The training loop (:mod:`sprpo_lib.train`) is the same for all:

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

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .perturb import sample_xi


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
        sigma_max: numerical guard, every sigma_lc is clamped to at most this (a factor
            1 + xi with |xi| >> 1 flips or explodes a channel).
        scale: how SPrPO's statistics enter sigma.  ``"raw"`` (default) is Alg. 1 line 3
            literally: sigma = rho * m_hat * S_hat^(-alpha/2) with the raw |dL/dxi|^2 and
            ||grad||^2, whose magnitudes depend on the loss scale and the model: on the
            cpu profile (SmolLM2, token-mean PPO loss) S_hat ~ 4e-7 and m_hat ~ 0.016
            after the first update, so 99.6% of the channels hit ``sigma_max``.
            ``"relative"`` (a documented deviation; the paper does not say how its
            statistics are scaled) uses S_hat / geomean(S_hat) and m_hat / m_1 (m_1 =
            the first measured m_hat): the same shape across channels and the same
            decay with the gradient norm, with sigma = rho at the log-average channel
            and at the first gradient norm.  The geometric mean, not the arithmetic
            one: S_hat is heavy-tailed (cpu probe: median 0.017x the mean, 99th
            percentile 12x), so dividing by the mean still clamped 61% of the
            channels at sigma_max, the geometric mean 15% (median sigma = rho).
    """

    name: str = "vanilla"
    sigma: float = 0.10
    sam_rho: float = 5e-3
    rho: float = 0.20
    alpha: float = 1.0
    schedule: bool = True
    sensitivity: str = "replay"
    s_floor: float = 1e-6
    sigma_max: float = 1.0
    scale: str = "raw"

    def __post_init__(self):
        if self.name not in METHODS:
            raise ValueError(f"unknown method {self.name!r}; expected one of {sorted(METHODS)}")
        if self.sensitivity not in ("replay", "one_pass"):
            raise ValueError(f"method.sensitivity must be 'replay' or 'one_pass', got {self.sensitivity!r}")
        if self.scale not in ("raw", "relative"):
            raise ValueError(f"method.scale must be 'raw' (Alg. 1 literally) or 'relative', got {self.scale!r}")
        for k in ("sigma", "sam_rho", "rho", "alpha", "s_floor", "sigma_max"):
            if getattr(self, k) < 0:
                raise ValueError(f"method.{k} must be >= 0, got {getattr(self, k)}")


class UpdateHost(Protocol):
    """What a method needs from the trainer."""

    shape: tuple[int, int]

    def backward(self, batch, xi: torch.Tensor | None = None, *, xi_grad: bool = False,
                 gain: bool = False, use_old: bool = False) -> dict: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def grad_norm_sq(self) -> float: ...


def _gen(seed: int, k: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(k) * 7919 + 17)


class Method:
    """Base: Vanilla GiGPO (Alg. 2)."""

    name = "vanilla"

    def __init__(self, cfg: MethodConfig, shape: tuple[int, int], seed: int = 0):
        self.cfg, self.shape, self.seed = cfg, tuple(shape), seed

    def rollout_xi(self, k: int) -> torch.Tensor | None:
        """The perturbation under which iteration ``k`` collects rollouts."""
        return None

    def update(self, host: UpdateHost, batch, k: int, xi: torch.Tensor | None) -> dict:
        """One policy update on ``batch`` (rollouts of iteration k under ``xi``)."""
        stats = host.backward(batch, xi)
        host.step()
        return stats

    def sigma_stats(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


METHODS: dict[str, type[Method]] = {}


def register_method(name: str) -> Callable[[type[Method]], type[Method]]:
    def deco(cls: type[Method]) -> type[Method]:
        if name in METHODS and METHODS[name] is not cls:
            raise ValueError(f"method {name!r} is already registered")
        cls.name = name
        METHODS[name] = cls
        return cls

    return deco


register_method("vanilla")(Method)


@register_method("gaussian")
class Gaussian(Method):
    """Isotropic multiplicative noise, xi = sigma z, z ~ N(0, I), held through the
    rollout and the update (Alg. 3)."""

    def rollout_xi(self, k: int) -> torch.Tensor:
        return sample_xi(self.cfg.sigma, self.shape, generator=_gen(self.seed, k))

    def sigma_stats(self) -> dict:
        return {"sigma_mean": self.cfg.sigma, "sigma_min": self.cfg.sigma, "sigma_max": self.cfg.sigma}


@register_method("sam")
class SAM(Method):
    """FFN-channel SAM (Alg. 4): unperturbed rollout; one extra backward for the channel
    gain gradient g = dL/du at u = 1; xi = -rho g / ||g||_2; replay the batch under xi and
    update.  With loss = -L, ``-g = dloss/du`` so ``xi = rho * dloss/du / ||dloss/du||``."""

    def update(self, host: UpdateHost, batch, k: int, xi: torch.Tensor | None) -> dict:
        gstats = host.backward(batch, None, gain=True)
        dloss_du = gstats.pop("gain_grad")
        host.zero_grad()
        norm = dloss_du.norm()
        adv_xi = self.cfg.sam_rho * dloss_du / norm if norm > 0 else torch.zeros(self.shape)
        stats = host.backward(batch, adv_xi)
        host.step()
        stats.update(sam_g_norm=float(norm), sam_xi_norm=float(adv_xi.norm()))
        self.last_xi = adv_xi
        return stats


@register_method("sprpo")
class SPrPO(Method):
    """Stable Perturbation-Robust Policy Optimization (Alg. 1).

    State: ``S_hat`` ``[L, C]`` and ``m_hat`` (both 1 at start, Alg. 1 line 1).
    ``sigma = rho * m_hat * S_hat^(-alpha/2)`` (line 3), guarded by ``s_floor`` and
    ``sigma_max`` (see :class:`MethodConfig`); xi ~ N(0, sigma^2) (line 4) is held through
    the rollout and the update (lines 5-6); afterwards S_hat = (dL/dxi)^2 and
    m_hat = ||grad_theta L||^2 at theta_{k+1} under the same xi and batch (line 7;
    ``sensitivity="one_pass"`` takes both from the update's backward at theta_k).
    ``schedule=False`` keeps m_hat = 1.
    """

    def __init__(self, cfg: MethodConfig, shape: tuple[int, int], seed: int = 0):
        super().__init__(cfg, shape, seed)
        self.S_hat = torch.ones(self.shape, dtype=torch.float64)
        self.m_hat = 1.0
        self.m_ref = 0.0  # first measured m_hat (scale="relative"); 0 = not measured yet

    def sigma(self) -> torch.Tensor:
        c = self.cfg
        S = self.S_hat
        floor = max(float(S.mean()) * c.s_floor, 1e-30)
        S = S.clamp_min(floor)
        m = self.m_hat if c.schedule else 1.0
        if c.scale == "relative":
            S = S / S.log().mean().exp()  # geometric mean (see MethodConfig.scale)
            if c.schedule and self.m_ref > 0:
                m = self.m_hat / self.m_ref
        sig = c.rho * m * S.pow(-c.alpha / 2.0)
        return sig.clamp(max=c.sigma_max).float()

    def rollout_xi(self, k: int) -> torch.Tensor:
        return sample_xi(self.sigma(), self.shape, generator=_gen(self.seed, k))

    def update(self, host: UpdateHost, batch, k: int, xi: torch.Tensor | None) -> dict:
        one_pass = self.cfg.sensitivity == "one_pass"
        stats = host.backward(batch, xi, xi_grad=one_pass)
        if one_pass:
            dxi = stats.pop("xi_grad")
            m = host.grad_norm_sq()
        host.step()
        if not one_pass:  # replay D_k at theta_{k+1} under the same xi (Alg. 1 line 7)
            host.zero_grad()
            rstats = host.backward(batch, xi, xi_grad=True, use_old=True)
            dxi = rstats.pop("xi_grad")
            m = host.grad_norm_sq()
            host.zero_grad()
            stats["replay_loss"] = rstats["loss"]
        self.S_hat = dxi.double().pow(2)
        self.m_hat = float(m)
        if self.m_ref <= 0:
            self.m_ref = self.m_hat
        stats.update(S_hat_mean=float(self.S_hat.mean()), m_hat=self.m_hat)
        return stats

    def sigma_stats(self) -> dict:
        s = self.sigma()
        return {"sigma_mean": float(s.mean()), "sigma_min": float(s.min()), "sigma_max": float(s.max()),
                "sigma_clamped_frac": float((s >= self.cfg.sigma_max).float().mean())}

    def state_dict(self) -> dict:
        return {"S_hat": self.S_hat.clone(), "m_hat": torch.tensor(self.m_hat, dtype=torch.float64),
                "m_ref": torch.tensor(self.m_ref, dtype=torch.float64)}

    def load_state_dict(self, state: dict) -> None:
        self.S_hat = state["S_hat"].double().clone()
        self.m_hat = float(state["m_hat"])
        self.m_ref = float(state["m_ref"]) if "m_ref" in state else 0.0


def make_method(cfg: MethodConfig, shape: tuple[int, int], seed: int = 0) -> Method:
    return METHODS[cfg.name](cfg, shape, seed)
