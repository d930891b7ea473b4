"""SPrPO's noise scale, Alg. 1 line 3, as named pure functions: one per rule of
``method.scale``, and the running statistics the default rule reads.

* :func:`line3` (``scale="raw"``): the literal line, ``sigma = rho * m_hat * S_hat^(-alpha/2)``.
* :func:`relative` (``scale="relative"``): the same on S_hat / geomean(S_hat) and m_hat / m_1.
* :func:`energy_sigma` (``scale="energy"``, the default) departs from line 3: the literal rule is
  not unit-free (sigma scales with any rescaling of the loss, and on a small model nearly every
  channel sits at ``sigma_max``), so the default allocates ``sigma_c ~ S-bar_c^(-alpha/2)`` at a
  fixed RMS ``rho * s_k``, the allocation Corollary 1's bound on ``sum_c sigma_c^2 S_c`` favours.
  Evidence: notebook 08 trains the three rules side by side (``08_ablations_*_noise_rules.csv``);
  ``tests/test_energy_rule.py`` checks the rule's properties.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def floored(S_hat: torch.Tensor, s_floor: float) -> torch.Tensor:
    """S_hat clamped below at ``s_floor * mean(S_hat)`` (and 1e-30): a channel whose gradient
    vanished gets a finite sigma."""
    return S_hat.clamp_min(max(float(S_hat.mean()) * s_floor, 1e-30))


def line3(S_hat: torch.Tensor, m: float, rho: float, alpha: float, sigma_max: float,
          s_floor: float) -> torch.Tensor:
    """Alg. 1 line 3 as printed: ``sigma = rho * m * S_hat^(-alpha/2)``, clamped at ``sigma_max``."""
    return (rho * m * floored(S_hat, s_floor).pow(-alpha / 2.0)).clamp(max=sigma_max).float()


def relative(S_hat: torch.Tensor, m: float, rho: float, alpha: float, sigma_max: float,
             s_floor: float) -> torch.Tensor:
    """Line 3 on S_hat over its geometric mean (S_hat is heavy-tailed) and ``m`` already taken
    relative to the first measurement: sigma = rho at the log-average channel and the first norm."""
    S = floored(S_hat, s_floor)
    S = S / S.log().mean().exp()
    return (rho * m * S.pow(-alpha / 2.0)).clamp(max=sigma_max).float()


def energy_sigma(S_bar: torch.Tensor, alpha: float, target_rms: float, sigma_max: float,
                 s_quantile: float = 0.05) -> tuple[torch.Tensor, dict]:
    """``sigma_c = min(sigma_max, tau w_c)``, ``w_c = S_c^(-alpha/2)`` with S floored at its
    ``s_quantile`` quantile (of its positive values when more channels than that are exactly 0),
    and tau solved by water-filling so that ``RMS_c(sigma) = target_rms``.  Scaling S by any
    positive factor leaves sigma unchanged.  Returns sigma (float32) and ``{"tau",
    "clamped_frac", "energy_ratio"}``: V / V_G, ``V = sum sigma^2 S`` against isotropic noise of
    equal energy (<= 1 by Chebyshev's sum inequality)."""
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


@dataclass
class EnergyStats:
    """What ``scale="energy"`` reads: S-bar, an EMA of S_hat over iterations (a Monte-Carlo
    estimate of Corollary 1's expectation over xi), and m-bar, a bias-corrected EMA of m_hat
    (of log m_hat under ``m_stat="log"``), with its reference m-bar_ref (the plain average of the
    same measurements, or m-bar frozen after ``ref_after`` of them).  ``m_acc`` is the EMA's
    uncorrected sum, ``m_sum`` the measurements' plain sum, ``n`` their count."""

    S_bar: torch.Tensor
    m_bar: float = 1.0
    m_bar_ref: float = 0.0
    n: int = 0
    m_acc: float = 0.0
    m_sum: float = 0.0

    def add(self, S_hat: torch.Tensor, m_hat: float, *, ema: float, m_clip: float, log: bool, ref_after: int) -> None:
        """Fold one measurement in; a value further than ``m_clip`` from m-bar counts as that factor."""
        first = self.n == 0
        self.S_bar = S_hat.clone() if first else ema * self.S_bar + (1 - ema) * S_hat
        m = m_hat
        if m_clip and not first:  # a one-batch spike counts as m_clip times m-bar at most
            m = min(max(m, self.m_bar / m_clip), self.m_bar * m_clip)
        self.n += 1
        x = math.log(m) if log else m
        self.m_acc = ema * self.m_acc + (1 - ema) * x
        self.m_sum += x
        corrected = self.m_acc / (1 - ema ** self.n)  # Adam's bias correction: no weight on the zero start
        self.m_bar = math.exp(corrected) if log else corrected
        if not ref_after:  # the running reference: the plain average of the same measurements
            mean = self.m_sum / self.n
            self.m_bar_ref = math.exp(mean) if log else mean
        elif self.n == ref_after:  # a fixed reference: this same EMA, s_k = 1 here
            self.m_bar_ref = self.m_bar

    def schedule(self, p: float, s_lo: float, s_hi: float, on: bool = True) -> tuple[float, float]:
        """``s_k = clip((m-bar / m-bar_ref)^p, s_lo, s_hi)`` before and after clipping (1 until
        m-bar_ref is known, or with ``on=False``: the "w/o scheduling" ablation)."""
        if not on or self.m_bar_ref <= 0:
            return 1.0, 1.0
        raw = (self.m_bar / self.m_bar_ref) ** p
        return raw, min(max(raw, s_lo), s_hi)


def rank_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two equally shaped tensors (flattened; ties broken by
    position): whether one S_hat predicts the next, or how sigma orders channels against an
    importance score."""
    x, y = a.detach().double().flatten(), b.detach().double().flatten()
    if x.numel() != y.numel() or x.numel() < 2:
        raise ValueError(f"rank_correlation: need two tensors of equal size >= 2, got {x.numel()} and {y.numel()}")
    rx = torch.empty_like(x).scatter_(0, x.argsort(), torch.arange(x.numel(), dtype=torch.float64))
    ry = torch.empty_like(y).scatter_(0, y.argsort(), torch.arange(y.numel(), dtype=torch.float64))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / den if den > 0 else 0.0
