"""Numerical checks of the paper's theory (Sec. 3-4, App. A) on exact tabular MDPs.

Logic behind ``notebooks/02_theory.ipynb``.  Everything is exact linear algebra in float64
(no sampling of trajectories): random Garnet MDPs, softmax policies, and for every policy
J, V, Q, A and the normalised discounted state distribution d_pi from two linear solves.
Only the perturbation xi is sampled (Monte Carlo over nu), which is what the statements
are about.

The perturbation mirrors the LLM's FFN-channel noise ``h * (1 + xi)`` (Sec. 5): a policy
has fixed state features ``phi`` (n_states x d channels, the "hidden representation") and
parameters ``theta`` (d x n_actions, the "down projection"); the perturbed logits are
``logits[s, a] = sum_c phi[s, c] (1 + xi_c) theta[c, a]``.

Checked statements (paper numbering):

* Lemma 1 (TRPO lower bound, Sec. 2.2, eq. trpo_improvement_bound),
* Theorem 1 (stable policy improvement, Cantelli; App. A.1),
* Corollary 1 (Gaussian-Poincare variance bound and the stability condition; App. A.2),
* Theorem 2 (convergence of stable updates, the set U_beta of eq. safe-set; App. A.3),
* Fig. 2 (isotropic vs SAM-style vs sensitivity-controlled noise on a 2-D landscape).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import NormalDist

import matplotlib
import numpy as np
import pandas as pd

from sprpo_lib.infra.io import atomic_write_text
from sprpo_lib.infra.manifest import not_applicable, write_manifest
from sprpo_lib.infra.paths import project_path
from sprpo_lib.paper.style import legend_below, pyplot, role
from sprpo_lib.paper.style import save_figure as style_save

# --------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TheorySizes:
    """Problem sizes and Monte-Carlo budgets of the theory notebook (one preset per
    reproduce profile; see :meth:`preset`).

    MDP: ``n_states`` states, ``n_actions`` actions, each (s, a) reaching ``branching``
    random next states (Garnet), discount ``gamma``, ``n_channels`` perturbed channels.
    ``sigma`` is the base per-channel std of the multiplicative Gaussian noise (Theorem 1,
    Corollary 1), ``t2_sigma`` the one of the Theorem 2 runs."""

    n_states: int = 12
    n_actions: int = 4
    branching: int = 3
    n_channels: int = 6
    gamma: float = 0.9
    sigma: float = 0.6
    # Lemma 1: random MDPs x random policy pairs, plus an adversarial search on small MDPs
    lemma_mdps: int = 40
    lemma_pairs: int = 1000
    lemma_search_mdps: int = 10
    lemma_search_steps: int = 600
    # Theorem 1 / Corollary 1: fixed updates theta -> theta', Monte Carlo over xi
    n_updates: int = 6
    mc_samples: int = 40000
    betas: tuple = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
    poincare_scales: tuple = (0.01, 0.03, 0.1, 0.3, 1.0, 2.0)
    alloc_alphas: tuple = (0.0, 0.5, 1.0, 2.0)
    n_boot: int = 200
    # Theorem 2: stable iteration vs unconstrained perturbed policy gradient
    t2_sigma: float = 0.3
    t2_iters: int = 40
    t2_train_samples: int = 256
    t2_eval_samples: int = 4000
    t2_lr: float = 4.0
    t2_grad_samples: int = 8
    t2_halvings: int = 14
    t2_beta: float = 0.1
    t2_eps_frac: float = 0.02  # epsilon as a fraction of C_J = r_range / (1 - gamma)
    t2_beta_bar: float = 0.1
    t2_delta: float = 3.0  # support radius of nu_delta in units of sigma: |xi_i| <= delta sigma_i
    # Fig. 2 toy landscape
    toy_steps: int = 300
    toy_seeds: int = 20
    seed: int = 0

    @classmethod
    def preset(cls, name: str, **overrides) -> TheorySizes:
        """``smoke`` runs in seconds (tests), ``cpu`` makes Monte-Carlo intervals tight
        within a few minutes on 2 cores, ``paper`` is larger."""
        presets = {
            "smoke": {"n_states": 6, "n_actions": 3, "branching": 2, "n_channels": 4, "lemma_mdps": 3,
                      "lemma_pairs": 60, "lemma_search_mdps": 2, "lemma_search_steps": 30, "n_updates": 2,
                      "mc_samples": 1500, "betas": (0.05, 0.2, 0.5), "poincare_scales": (0.03, 0.3, 1.0),
                      "n_boot": 50, "t2_iters": 6, "t2_train_samples": 64, "t2_eval_samples": 400,
                      "t2_halvings": 4, "toy_steps": 40, "toy_seeds": 3},
            "cpu": {},
            "paper": {"lemma_mdps": 60, "lemma_search_mdps": 16, "n_updates": 8, "mc_samples": 60000,
                      "t2_iters": 60, "t2_eval_samples": 8000, "toy_seeds": 40},
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(presets)}")
        return replace(cls(), **{**presets[name], **overrides})

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


# --------------------------------------------------------------------------------------
# exact tabular MDPs
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MDP:
    """Finite discounted MDP (S, A, P, r, rho0, gamma) of Sec. 2.1: ``P[s, a, s']``,
    ``r[s, a]``, initial distribution ``rho0``."""

    P: np.ndarray
    r: np.ndarray
    rho0: np.ndarray
    gamma: float  # P, r, rho0 may carry leading batch axes (a batch of MDPs)

    @property
    def n_states(self) -> int:
        return self.P.shape[-3]

    @property
    def n_actions(self) -> int:
        return self.P.shape[-2]

    @property
    def return_range(self) -> float:
        """C_J of Sec. 4.2 (J_max - J_min), bounded by (r_max - r_min) / (1 - gamma)."""
        return float(self.r.max() - self.r.min()) / (1.0 - self.gamma)


def garnet(n_states: int, n_actions: int, branching: int, gamma: float, rng: np.random.Generator) -> MDP:
    """Random Garnet MDP: every (s, a) moves to ``branching`` distinct random states with
    uniform-spacing probabilities; rewards U(0, 1); Dirichlet(1) initial distribution."""
    P = np.zeros((n_states, n_actions, n_states))
    for s in range(n_states):
        for a in range(n_actions):
            nxt = rng.choice(n_states, size=branching, replace=False)
            cuts = np.sort(rng.uniform(size=branching - 1))
            P[s, a, nxt] = np.diff(np.concatenate([[0.0], cuts, [1.0]]))
    r = rng.uniform(size=(n_states, n_actions))
    rho0 = rng.dirichlet(np.ones(n_states))
    return MDP(P=P, r=r, rho0=rho0, gamma=float(gamma))


@dataclass(frozen=True)
class PolicyEval:
    """Exact quantities of a (batch of) policies ``pi[..., s, a]``: value V, action value Q,
    advantage A = Q - V, unnormalised discounted visitation ``rho = sum_t gamma^t Pr(s_t=s)``,
    normalised ``d = (1 - gamma) rho`` (Lemma 1's d_pi), return J = rho0 . V."""

    pi: np.ndarray
    V: np.ndarray
    Q: np.ndarray
    A: np.ndarray
    rho: np.ndarray
    d: np.ndarray
    J: np.ndarray
    M: np.ndarray  # I - gamma P_pi


def state_transition(mdp: MDP, pi: np.ndarray) -> np.ndarray:
    """P_pi[..., s, s'] = sum_a pi(a|s) P(s'|s, a)."""
    return np.einsum("...sa,...sat->...st", pi, mdp.P)


def evaluate(mdp: MDP, pi: np.ndarray) -> PolicyEval:
    """Exact policy evaluation by two linear solves (batched over leading axes of ``pi``):
    V = (I - gamma P_pi)^-1 r_pi and rho = (I - gamma P_pi)^-T rho0."""
    M = np.eye(mdp.n_states) - mdp.gamma * state_transition(mdp, pi)
    r_pi = (pi * mdp.r).sum(-1)
    V = np.linalg.solve(M, r_pi[..., None])[..., 0]
    Q = mdp.r + mdp.gamma * np.einsum("...sat,...t->...sa", mdp.P, V)
    rho0 = np.broadcast_to(mdp.rho0, V.shape)
    rho = np.linalg.solve(np.swapaxes(M, -1, -2), rho0[..., None])[..., 0]
    return PolicyEval(pi=pi, V=V, Q=Q, A=Q - V[..., None], rho=rho, d=(1 - mdp.gamma) * rho,
                      J=(V * rho0).sum(-1), M=M)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def softmax_backward(pi: np.ndarray, grad_pi: np.ndarray) -> np.ndarray:
    """Gradient w.r.t. the logits of a function of ``pi = softmax(logits)`` given its
    gradient w.r.t. pi."""
    return pi * (grad_pi - (pi * grad_pi).sum(-1, keepdims=True))


def surrogate(ev: PolicyEval, pi_new: np.ndarray) -> np.ndarray:
    """L(pi') = 1/(1-gamma) E_{s~d_pi, a~pi'}[A_pi(s, a)] (Lemma 1's first term; equal to the
    importance-weighted form of Def. 2, eq. perturbed_surrogate_single)."""
    return (ev.rho * (pi_new * ev.A).sum(-1)).sum(-1)


def tv_max(pi: np.ndarray, pi_new: np.ndarray) -> np.ndarray:
    """alpha = sup_s D_TV(pi(.|s), pi'(.|s)) with D_TV = 1/2 sum_a |p - q| (Lemma 1)."""
    return 0.5 * np.abs(pi - pi_new).sum(-1).max(-1)


def a_max(ev: PolicyEval) -> np.ndarray:
    """sup_{s,a} |A_pi(s, a)| (Lemma 1's A_max, taken as small as the lemma allows)."""
    return np.abs(ev.A).max((-1, -2))


def trpo_penalty_coef(gamma: float, amax) -> np.ndarray:
    """C = 4 gamma A_max / (1 - gamma)^2 of Lemma 1 / Theorem 1."""
    return 4.0 * gamma * np.asarray(amax) / (1.0 - gamma) ** 2


def grad_return_pi(ev: PolicyEval) -> np.ndarray:
    """dJ/dpi(s, a) = rho(s) Q(s, a) (policy-gradient theorem, unnormalised visitation)."""
    return ev.rho[..., None] * ev.Q


def grad_surrogate_pi(mdp: MDP, ev: PolicyEval, pi_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of L(pi, pi') = rho_pi^T (r_pi' + gamma P_pi' V_pi - V_pi) w.r.t. the old
    policy pi (through rho_pi and V_pi, by adjoint solves) and the new policy pi'.

    dL = gamma rho^T dP_pi u + w^T (dr_pi + gamma dP_pi V) with (I - gamma P_pi) u = g,
    g(s) = sum_a pi'(a|s) A(s, a), and (I - gamma P_pi)^T w = gamma P_pi'^T rho - rho."""
    g = (pi_new * ev.A).sum(-1)
    u = np.linalg.solve(ev.M, g[..., None])[..., 0]
    P_new = state_transition(mdp, pi_new)
    rhs = mdp.gamma * np.einsum("...st,...s->...t", P_new, ev.rho) - ev.rho
    w = np.linalg.solve(np.swapaxes(ev.M, -1, -2), rhs[..., None])[..., 0]
    g_old = mdp.gamma * ev.rho[..., None] * np.einsum("...sat,...t->...sa", mdp.P, u) + w[..., None] * ev.Q
    g_new = ev.rho[..., None] * ev.Q
    return g_old, g_new


# --------------------------------------------------------------------------------------
# channel-perturbed softmax policies: logits = phi diag(1 + xi) theta
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelPolicy:
    """Softmax policy with ``d`` channels: ``logits[s, a] = sum_c phi[s, c] (1 + xi_c)
    theta[c, a]``.  ``xi_c`` multiplies channel c of the state representation, exactly as
    SPrPO's ``h * (1 + xi)`` multiplies an FFN channel before the down projection (Sec. 5)."""

    phi: np.ndarray  # (n_states, d)

    @property
    def n_channels(self) -> int:
        return self.phi.shape[1]

    def logits(self, theta: np.ndarray, xi: np.ndarray | None = None) -> np.ndarray:
        if xi is None:
            return self.phi @ theta
        return np.einsum("sc,...c,ca->...sa", self.phi, 1.0 + np.asarray(xi), theta)

    def probs(self, theta: np.ndarray, xi: np.ndarray | None = None) -> np.ndarray:
        return softmax(self.logits(theta, xi))

    def back_theta(self, grad_logits: np.ndarray, xi: np.ndarray | None = None) -> np.ndarray:
        """Chain rule from logits to theta: d/dtheta[c, a] = sum_s g[s, a] phi[s, c] (1 + xi_c)."""
        if xi is None:
            return self.phi.T @ grad_logits
        return np.einsum("...sa,sc,...c->...ca", grad_logits, self.phi, 1.0 + np.asarray(xi))

    def back_xi(self, grad_logits: np.ndarray, theta: np.ndarray) -> np.ndarray:
        """Chain rule from logits to xi: d/dxi_c = sum_{s,a} g[s, a] phi[s, c] theta[c, a]."""
        return np.einsum("...sa,sc,ca->...c", grad_logits, self.phi, theta)


def channel_policy(n_states: int, n_channels: int, rng: np.random.Generator,
                   scale_range: tuple[float, float] = (2.0, 0.25)) -> ChannelPolicy:
    """Gaussian state features whose channel scales decay geometrically over
    ``scale_range``: channels of very different sensitivity, as FFN channels are."""
    scales = np.geomspace(scale_range[0], scale_range[1], n_channels)
    return ChannelPolicy(phi=rng.standard_normal((n_states, n_channels)) * scales)


def perturbed_return(mdp: MDP, pol: ChannelPolicy, theta: np.ndarray, xi: np.ndarray,
                     with_grad: bool = False):
    """J(pi_theta^xi) for a batch of perturbations ``xi[..., d]``; with ``with_grad`` also
    dJ/dtheta per perturbation (exact policy gradient)."""
    ev = evaluate(mdp, pol.probs(theta, xi))
    if not with_grad:
        return ev.J
    g = pol.back_theta(softmax_backward(ev.pi, grad_return_pi(ev)), xi)
    return ev.J, g


@dataclass(frozen=True)
class UpdateStats:
    """Per-perturbation quantities of one update theta -> theta' (Def. 2 and Theorem 1):
    ``delta_j`` = Delta J_xi, ``surr`` = L_xi(theta'), ``alpha`` = alpha_xi,
    ``amax`` = sup |A_{pi_theta^xi}|, ``j_old`` / ``j_new`` = J(pi_theta^xi) / J(pi_theta'^xi),
    and optionally ``grad_xi`` = dL_xi(theta')/dxi."""

    delta_j: np.ndarray
    surr: np.ndarray
    alpha: np.ndarray
    amax: np.ndarray
    j_old: np.ndarray
    j_new: np.ndarray
    grad_xi: np.ndarray | None = None


def update_stats(mdp: MDP, pol: ChannelPolicy, theta: np.ndarray, theta_new: np.ndarray, xi: np.ndarray,
                 with_grad: bool = False, chunk: int = 4096) -> UpdateStats:
    """Exact Delta J_xi, L_xi(theta'), alpha_xi, A_max(xi) (and dL_xi/dxi) for a batch of
    perturbations, in chunks to bound memory."""
    xi = np.atleast_2d(xi)
    parts = []
    for i in range(0, len(xi), chunk):
        x = xi[i:i + chunk]
        pi, pi_new = pol.probs(theta, x), pol.probs(theta_new, x)
        ev, ev_new = evaluate(mdp, pi), evaluate(mdp, pi_new)
        part = {"delta_j": ev_new.J - ev.J, "surr": surrogate(ev, pi_new), "alpha": tv_max(pi, pi_new),
                "amax": a_max(ev), "j_old": ev.J, "j_new": ev_new.J}
        if with_grad:
            g_old, g_new = grad_surrogate_pi(mdp, ev, pi_new)
            part["grad_xi"] = (pol.back_xi(softmax_backward(pi, g_old), theta)
                               + pol.back_xi(softmax_backward(pi_new, g_new), theta_new))
        parts.append(part)
    return UpdateStats(**{k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


# --------------------------------------------------------------------------------------
# statistics: Cantelli, exact binomial intervals, Poincare
# --------------------------------------------------------------------------------------


def cantelli_threshold(mean, var, beta):
    """mean - sqrt((1 - beta)/beta * var): by Cantelli's inequality P(X >= threshold) >=
    1 - beta for any X with that mean and variance (Theorem 1, App. A.1)."""
    beta = np.asarray(beta, dtype=float)
    return np.asarray(mean) - np.sqrt((1.0 - beta) / beta * np.asarray(var))


def certified_beta(margin: float, var: float) -> float:
    """Smallest beta for which ``margin >= sqrt((1 - beta)/beta * var)``, i.e.
    var / (var + margin^2) (the "consequently" of Theorem 1 and the condition of
    Corollary 1, eq. gaussian_stable_improvement_condition); 1 when margin <= 0."""
    if margin <= 0:
        return 1.0
    return float(var / (var + margin * margin)) if var > 0 else 0.0


def _binom_logpmf(n: int) -> tuple[np.ndarray, np.ndarray]:
    k = np.arange(n + 1)
    logc = np.array([math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(n + 1)])
    return k, logc


def _binom_tail(k: np.ndarray, logc: np.ndarray, n: int, p: float, lo: int, hi: int) -> float:
    """P(lo <= X <= hi) for X ~ Bin(n, p), summed in log space."""
    if p <= 0.0:
        return float(lo <= 0 <= hi)
    if p >= 1.0:
        return float(lo <= n <= hi)
    sl = slice(lo, hi + 1)
    lp = logc[sl] + k[sl] * math.log(p) + (n - k[sl]) * math.log1p(-p)
    mx = lp.max()
    return float(math.exp(mx) * np.exp(lp - mx).sum())


def clopper_pearson(x: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval for a binomial proportion x/n: the p with
    P(X >= x; p) = a/2 and P(X <= x; p) = a/2, by bisection on the exact binomial tail."""
    a = 1.0 - level
    k, logc = _binom_logpmf(n)

    def solve(f, target):  # f increasing in p
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return 0.5 * (lo + hi)

    lower = 0.0 if x == 0 else solve(lambda p: _binom_tail(k, logc, n, p, x, n), a / 2)
    upper = 1.0 if x == n else solve(lambda p: 1.0 - _binom_tail(k, logc, n, p, 0, x), 1.0 - a / 2)
    return lower, upper


def wilson(x: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for x/n."""
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = x / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (0.0 if x == 0 else max(0.0, c - h)), (1.0 if x == n else min(1.0, c + h))


def poincare_bound(grads: np.ndarray, sigma: np.ndarray) -> float:
    """sum_i sigma_i^2 S_i with S_i = E[(df/dxi_i)^2] estimated from gradient samples
    (Corollary 1, App. A.2: Var[f(xi)] <= E[grad^T Sigma grad] for xi ~ N(0, Sigma))."""
    return float((np.asarray(sigma) ** 2 * (np.asarray(grads) ** 2).mean(0)).sum())


def poincare_ratio(values: np.ndarray, grads: np.ndarray, sigma: np.ndarray, n_boot: int,
                   rng: np.random.Generator, xi: np.ndarray | None = None, g0: np.ndarray | None = None,
                   level: float = 0.95) -> tuple[float, float, float]:
    """Var[f(xi)] / (sum_i sigma_i^2 S_i) from samples, with a percentile-bootstrap interval.

    With ``xi`` and the gradient ``g0`` of f at xi = 0, the variance uses the linear part
    l = g0 . xi as a control variate with known moments: Var f = g0^T Sigma g0 +
    2 Cov(l, f - l) + Var(f - l), exact in the first term.  This removes the sampling noise
    of the leading (linear) term, so that the ratio's approach to 1 as sigma -> 0 is
    visible instead of being drowned in O(1/sqrt(n)) noise; the bound is the plain mean
    of grad^T Sigma grad.  The interval is ratio +- z * (bootstrap standard error), so a
    Bonferroni ``level`` close to 1 is cheap."""
    s2 = np.asarray(sigma) ** 2
    values, grads = np.asarray(values), np.asarray(grads)
    contrib = (grads ** 2) @ s2  # grad^T Sigma grad per sample
    if g0 is None:
        def var_of(idx):
            return np.var(values[idx], ddof=1)
    else:
        lin = np.asarray(xi) @ g0
        rem = values - lin
        exact = float((g0 ** 2) @ s2)

        def var_of(idx):
            c = np.cov(lin[idx], rem[idx], ddof=1)
            return exact + 2 * c[0, 1] + c[1, 1]
    n = len(values)
    ratio = float(var_of(np.arange(n)) / contrib.mean())
    boots = [var_of(idx) / contrib[idx].mean() for idx in (rng.integers(0, n, n) for _ in range(n_boot))]
    half = NormalDist().inv_cdf(0.5 + level / 2) * float(np.std(boots, ddof=1))  # normal-bootstrap interval
    return ratio, ratio - half, ratio + half


def gaussian_sample(sigma: np.ndarray, n: int, rng: np.random.Generator, delta: float | None = None) -> np.ndarray:
    """n draws of xi ~ N(0, diag sigma^2); with ``delta``, conditioned on |xi_i| <= delta
    sigma_i (rejection), so that nu_delta is supported on a bounded set as Def. 1 asks."""
    sigma = np.asarray(sigma, dtype=float)
    if delta is None:
        return rng.standard_normal((n, len(sigma))) * sigma
    out = np.empty((0, len(sigma)))
    while len(out) < n:
        z = rng.standard_normal((2 * (n - len(out)) + 16, len(sigma)))
        out = np.concatenate([out, z[np.abs(z).max(1) <= delta]])
    return out[:n] * sigma


# --------------------------------------------------------------------------------------
# Lemma 1 (TRPO lower bound)
# --------------------------------------------------------------------------------------


def lemma1_terms(mdp: MDP, pi: np.ndarray, pi_new: np.ndarray) -> dict:
    """Both sides of Lemma 1 (eq. trpo_improvement_bound) exactly, for a batch of pairs:
    Delta J = J(pi') - J(pi), L = 1/(1-gamma) E_{d_pi, pi'}[A_pi], alpha = max TV,
    A_max = sup |A_pi|, penalty = 4 gamma A_max alpha^2 / (1-gamma)^2, bound = L - penalty,
    slack = Delta J - bound (>= 0 iff the lemma holds) and ``tightness`` = (L - Delta J) /
    penalty (<= 1 iff it holds; how much of the penalty the true gap uses)."""
    ev, ev_new = evaluate(mdp, pi), evaluate(mdp, pi_new)
    dj = ev_new.J - ev.J
    surr = surrogate(ev, pi_new)
    alpha = tv_max(pi, pi_new)
    amax = a_max(ev)
    pen = trpo_penalty_coef(mdp.gamma, amax) * alpha ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        tight = np.where(pen > 0, (surr - dj) / pen, 0.0)
    return {"delta_j": dj, "surrogate": surr, "alpha": alpha, "amax": amax, "penalty": pen, "bound": surr - pen,
            "slack": dj - (surr - pen), "tightness": tight}


def random_policy_pairs(n_states: int, n_actions: int, n_pairs: int, rng: np.random.Generator):
    """Random softmax pairs covering all distances: pi = softmax(tau z), pi' = softmax(tau z +
    t z') with tau ~ logU(0.3, 5) (near-uniform to near-deterministic) and t ~ logU(1e-3, 5)."""
    tau = np.exp(rng.uniform(np.log(0.3), np.log(5.0), n_pairs))[:, None, None]
    t = np.exp(rng.uniform(np.log(1e-3), np.log(5.0), n_pairs))[:, None, None]
    base = tau * rng.standard_normal((n_pairs, n_states, n_actions))
    return softmax(base), softmax(base + t * rng.standard_normal((n_pairs, n_states, n_actions)))


def lemma1_random(sizes: TheorySizes, rng: np.random.Generator):
    """Lemma 1 on ``lemma_mdps`` Garnet MDPs x ``lemma_pairs`` random policy pairs; one row
    per pair."""
    rows = []
    for i in range(sizes.lemma_mdps):
        mdp = garnet(sizes.n_states, sizes.n_actions, sizes.branching, sizes.gamma, rng)
        pi, pi_new = random_policy_pairs(sizes.n_states, sizes.n_actions, sizes.lemma_pairs, rng)
        rows.append(pd.DataFrame({"mdp": i, **lemma1_terms(mdp, pi, pi_new)}))
    return pd.concat(rows, ignore_index=True)


def _search_point(x: dict, gamma: float) -> tuple[MDP, np.ndarray, np.ndarray]:
    """Decode unconstrained search variables into (MDP batch, pi, pi')."""
    mdp = MDP(P=softmax(x["P"]), r=1.0 / (1.0 + np.exp(-x["r"])), rho0=softmax(x["rho0"]), gamma=gamma)
    return mdp, softmax(x["pi"]), softmax(x["pi_new"])


def lemma1_search(sizes: TheorySizes, rng: np.random.Generator, n_states: int = 3, n_actions: int = 2,
                  pop: int = 64) -> pd.DataFrame:
    """Adversarial search for a violation of Lemma 1: on small MDPs (where extreme cases are
    easiest to reach) hill-climb everything the lemma quantifies over -- transitions,
    rewards in [0, 1], initial distribution and both policies, all through unconstrained
    logits -- to maximise the tightness (L - Delta J) / penalty, which exceeds 1 exactly
    when the lemma fails.  One row per restart: the best instance found."""
    shapes = {"P": (n_states, n_actions, n_states), "r": (n_states, n_actions), "rho0": (n_states,),
              "pi": (n_states, n_actions), "pi_new": (n_states, n_actions)}
    rows = []
    for i in range(sizes.lemma_search_mdps):
        x = {k: 2.0 * rng.standard_normal((pop, *v)) for k, v in shapes.items()}
        best, best_t, step = None, -np.inf, 1.0
        for _ in range(sizes.lemma_search_steps):
            terms = lemma1_terms(*_search_point(x, sizes.gamma))
            t = np.where(terms["alpha"] > 1e-3, terms["tightness"], -np.inf)  # away from round-off
            j = int(np.argmax(t))
            if t[j] > best_t:
                best_t, best = float(t[j]), {k: v[j] for k, v in x.items()}
                step = min(2.0, step * 1.5)
            else:
                step = max(0.02, step * 0.9)
            x = {k: v + step * rng.standard_normal((pop, *v.shape)) for k, v in best.items()}
        terms = lemma1_terms(*_search_point({k: v[None] for k, v in best.items()}, sizes.gamma))
        rows.append({"restart": i, "evaluated": pop * sizes.lemma_search_steps,
                     **{k: float(v[0]) for k, v in terms.items()}})
    return pd.DataFrame(rows)


def loglog_slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of log y on log x (positive entries only)."""
    x, y = np.asarray(x), np.asarray(y)
    ok = (x > 0) & (y > 0)
    return float(np.polyfit(np.log(x[ok]), np.log(y[ok]), 1)[0])


# --------------------------------------------------------------------------------------
# Theorem 1 and Corollary 1: a fixed update theta -> theta' under Gaussian xi
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Update:
    """One update theta -> theta' = theta + step * direction of a channel policy on an MDP,
    and the isotropic per-channel noise std ``sigma`` it is analysed under."""

    name: str
    mdp: MDP
    pol: ChannelPolicy
    theta: np.ndarray
    theta_new: np.ndarray
    sigma: np.ndarray
    step: float


def improvement_margin(gamma: float, st: UpdateStats) -> float:
    """m_nu = L_nu(theta') - 4 gamma A_max E[alpha_xi^2] / (1-gamma)^2 (Theorem 1, eq.
    mean_improvement_margin), with expectations and the sup over xi of A_max taken over the
    Monte-Carlo sample (the smallest A_max the sample allows: the strictest test)."""
    return float(st.surr.mean() - trpo_penalty_coef(gamma, st.amax.max()) * (st.alpha ** 2).mean())


def make_updates(sizes: TheorySizes, rng: np.random.Generator | None = None, n_pilot: int = 1024) -> list[Update]:
    """``n_updates`` random (MDP, channel policy, theta ~ N(0, 1)) instances, each updated
    along the exact policy gradient at ONE sampled perturbation (as Alg. 1 line 6 updates
    from perturbed rollouts), with two step sizes: the trust-region step maximising m_nu
    on a pilot sample ("trust"), and a plain step of length ``2 * sigma`` ("large")."""
    rng = rng if rng is not None else _rng(sizes, 0)
    out = []
    d, m = sizes.n_channels, sizes.n_actions
    for i in range(sizes.n_updates):
        mdp = garnet(sizes.n_states, m, sizes.branching, sizes.gamma, rng)
        pol = channel_policy(sizes.n_states, d, rng)
        theta = rng.standard_normal((d, m))
        sigma = np.full(d, sizes.sigma)
        _, g = perturbed_return(mdp, pol, theta, gaussian_sample(sigma, 1, rng), with_grad=True)
        direction = g[0] / np.linalg.norm(g[0])
        pilot = gaussian_sample(sigma, n_pilot, rng)
        grid = np.geomspace(1e-4, 1.0, 25)
        margins = [improvement_margin(mdp.gamma, update_stats(mdp, pol, theta, theta + s * direction, pilot))
                   for s in grid]
        for name, step in (("trust", float(grid[int(np.argmax(margins))])), ("large", 2.0 * sizes.sigma)):
            out.append(Update(f"mdp{i}-{name}", mdp, pol, theta, theta + step * direction, sigma, step))
    return out


def update_sample(upd: Update, sigma: np.ndarray, n: int, rng: np.random.Generator,
                  with_grad: bool = False) -> tuple[np.ndarray, UpdateStats]:
    """n perturbations xi ~ N(0, diag sigma^2) and the exact update statistics under each."""
    xi = gaussian_sample(sigma, n, rng)
    return xi, update_stats(upd.mdp, upd.pol, upd.theta, upd.theta_new, xi, with_grad=with_grad)


def theorem1_rows(upd: Update, st: UpdateStats, betas) -> list[dict]:
    """Theorem 1 (eq. general_probabilistic_improvement) for each beta: the empirical
    P(Delta J_xi >= m_nu - sqrt((1-beta)/beta v_nu)) with an exact Clopper-Pearson interval,
    the same with the true mean mu_nu in place of m_nu (Cantelli alone), and the theorem's
    consequence P(Delta J_xi >= 0) >= 1 - beta* where beta* = v / (v + m_nu^2) if m_nu > 0."""
    n = len(st.delta_j)
    m, mu, v = improvement_margin(upd.mdp.gamma, st), float(st.delta_j.mean()), float(st.delta_j.var(ddof=1))
    n_improve = int((st.delta_j >= 0).sum())
    bstar = certified_beta(m, v)
    rows = []
    for beta in betas:
        row = {"update": upd.name, "step": upd.step, "beta": float(beta), "n": n, "m_nu": m, "mu_nu": mu,
               "v_nu": v, "beta_star": bstar, "p_improve": n_improve / n}
        for key, centre in (("m", m), ("mu", mu)):
            thr = float(cantelli_threshold(centre, v, beta))
            x = int((st.delta_j >= thr).sum())
            lo, hi = clopper_pearson(x, n)
            row.update({f"thr_{key}": thr, f"p_{key}": x / n, f"lo_{key}": lo, f"hi_{key}": hi,
                        f"slack_{key}": x / n - (1 - beta), f"violated_{key}": hi < 1 - beta})
        rows.append(row)
    return rows


def corollary1_rows(upd: Update, scales, n: int, n_boot: int, rng: np.random.Generator,
                    level: float = 0.95) -> list[dict]:
    """Corollary 1 / App. A.2 for xi ~ N(0, (scale sigma)^2 I) per scale: the Gaussian
    Poincare inequality Var[L_xi(theta')] <= sum_i sigma_i^2 S_i (ratio with a bootstrap
    interval; the linear part at xi = 0 as control variate), and the corollary's conclusion
    P(Delta J_xi >= 0) >= 1 - beta* where beta* is
    the smallest beta satisfying eq. gaussian_stable_improvement_condition, with
    alpha_bar = sup_xi alpha_xi and A_max taken over the sample."""
    g0 = update_stats(upd.mdp, upd.pol, upd.theta, upd.theta_new, np.zeros((1, len(upd.sigma))),
                      with_grad=True).grad_xi[0]
    rows = []
    for scale in scales:
        sigma = scale * upd.sigma
        xi, st = update_sample(upd, sigma, n, rng, with_grad=True)
        ratio, lo, hi = poincare_ratio(st.surr, st.grad_xi, sigma, n_boot, rng, xi=xi, g0=g0, level=level)
        bound = poincare_bound(st.grad_xi, sigma)
        margin = float(st.surr.mean() - trpo_penalty_coef(upd.mdp.gamma, st.amax.max()) * st.alpha.max() ** 2)
        bstar = certified_beta(margin, bound)
        x = int((st.delta_j >= 0).sum())
        plo, phi_ = clopper_pearson(x, n)
        rows.append({"update": upd.name, "step": upd.step, "scale": float(scale), "sigma": float(sigma.mean()),
                     "n": n, "var_L": float(st.surr.var(ddof=1)), "poincare_bound": bound, "ratio": ratio,
                     "ratio_lo": lo, "ratio_hi": hi, "poincare_violated": lo > 1.0, "margin_bar": margin,
                     "beta_star": bstar, "p_improve": x / n, "p_improve_lo": plo, "p_improve_hi": phi_,
                     "corollary_violated": bool(bstar < 1 and phi_ < 1 - bstar)})
    return rows


def allocate_sigma(S: np.ndarray, energy: float, alpha: float) -> np.ndarray:
    """Per-channel std with sigma_i^2 proportional to S_i^-alpha and sum_i sigma_i^2 =
    ``energy``: alpha = 0 is isotropic, alpha = 1 is SPrPO's sigma_i ~ S_i^-1/2 (Sec. 5,
    Alg. 1 line 3 up to the common factor rho m_hat)."""
    w = np.asarray(S, dtype=float) ** (-alpha)
    return np.sqrt(energy * w / w.sum())


def allocation_rows(upd: Update, alphas, n: int, rng: np.random.Generator) -> list[dict]:
    """The allocation question of Corollary 1 at equal total noise energy sum sigma_i^2:
    sensitivities S_i from an isotropic pilot, then for each exponent alpha the variance of
    Delta J_xi and L_xi, the Poincare bound, and P(Delta J_xi >= 0) (Wilson interval); all
    allocations share the same standard-normal draws (common random numbers)."""
    d = len(upd.sigma)
    energy = float((upd.sigma ** 2).sum())
    _, pilot = update_sample(upd, upd.sigma, max(256, n // 8), rng, with_grad=True)
    S = (pilot.grad_xi ** 2).mean(0)
    z = rng.standard_normal((n, d))
    rows = []
    for alpha in alphas:
        sigma = allocate_sigma(S, energy, alpha)
        st = update_stats(upd.mdp, upd.pol, upd.theta, upd.theta_new, z * sigma, with_grad=True)
        x = int((st.delta_j >= 0).sum())
        lo, hi = wilson(x, n)
        m, v = improvement_margin(upd.mdp.gamma, st), float(st.delta_j.var(ddof=1))
        rows.append({"update": upd.name, "alpha": float(alpha), "energy": energy, "n": n,
                     "sigma_min": float(sigma.min()), "sigma_max": float(sigma.max()),
                     "S_min": float(S.min()), "S_max": float(S.max()),
                     "mean_dj": float(st.delta_j.mean()), "var_dj": v, "var_L": float(st.surr.var(ddof=1)),
                     "poincare_bound": poincare_bound(st.grad_xi, sigma), "p_improve": x / n,
                     "p_improve_lo": lo, "p_improve_hi": hi, "m_nu": m, "beta_star": certified_beta(m, v),
                     "mean_j_new": float(st.j_new.mean()), "sd_j_new": float(st.j_new.std(ddof=1))})
    return rows


# --------------------------------------------------------------------------------------
# Theorem 2: stable updates pi_{k+1} in U_beta(pi_k) vs unconstrained perturbed PG
# --------------------------------------------------------------------------------------


def in_safe_set(gamma: float, st: UpdateStats, beta: float, margin: str = "m") -> tuple[bool, float, float]:
    """Membership of a candidate in U_beta(pi_k) (eq. safe-set) on the Monte-Carlo sample
    ``st``: margin >= sqrt((1-beta)/beta Var_nu[Delta J_xi]).  ``margin="m"`` is the paper's
    m_nu,k (Lemma 1 lower bound); ``margin="mu"`` uses the expected improvement
    mu = E[Delta J_xi] >= m_nu instead: a larger set for which the proof of Theorem 2 goes
    through unchanged (App. A.3 Step 1 only uses J_bar_{k+1} - J_bar_k >= sqrt(...))."""
    v = float(st.delta_j.var(ddof=1))
    m = improvement_margin(gamma, st) if margin == "m" else float(st.delta_j.mean())
    return bool(m >= math.sqrt((1 - beta) / beta * v)), m, v


def stable_step(mdp: MDP, pol: ChannelPolicy, theta: np.ndarray, xi: np.ndarray, direction: np.ndarray,
                lr: float, halvings: int, beta: float, margin: str = "m") -> tuple[np.ndarray, dict]:
    """One iteration of the stable scheme of Sec. 4.2: candidates theta + lr 2^-j direction
    (j = 0..halvings); among those in U_beta(pi_k) (tested on the perturbation sample ``xi``)
    keep the best by mean perturbed return.  pi_k itself is always in U_beta (margin 0 =
    variance), so the iteration is well defined even when no step qualifies."""
    jbar = float(perturbed_return(mdp, pol, theta, xi).mean())
    best = {"theta": theta, "step": 0.0, "jbar": jbar, "margin": 0.0, "v": 0.0}
    n_ok = 0
    for j in range(halvings + 1):
        cand = theta + lr * 2.0 ** -j * direction
        st = update_stats(mdp, pol, theta, cand, xi)
        ok, m, v = in_safe_set(mdp.gamma, st, beta, margin)
        n_ok += ok
        if ok and st.j_new.mean() > best["jbar"]:
            best = {"theta": cand, "step": lr * 2.0 ** -j, "jbar": float(st.j_new.mean()), "margin": m, "v": v}
    return best.pop("theta"), {**best, "admissible": n_ok}


def perturbed_gradient(mdp: MDP, pol: ChannelPolicy, theta: np.ndarray, xi: np.ndarray) -> np.ndarray:
    """mean_xi grad_theta J(pi_theta^xi): the policy gradient under sampled perturbations."""
    return perturbed_return(mdp, pol, theta, xi, with_grad=True)[1].mean(0)


THEOREM2_RUNS = ("pg", "stable_m", "stable_mu")


def theorem2_runs(sizes: TheorySizes, rng: np.random.Generator):
    """Unconstrained perturbed PG vs the stable iteration on one Garnet MDP, from the same
    start, with the same perturbation batches (xi ~ N(0, sigma^2 I) truncated to |xi_i| <=
    delta sigma: the bounded-support nu_delta of Def. 1).  Each iteration draws a batch; the
    direction is the perturbed policy gradient on its first ``t2_grad_samples`` draws (a
    rollout batch); PG steps ``t2_lr`` along it; the stable runs pick the best step in
    U_beta tested on the whole batch, with the paper's margin m_nu ("stable_m") or with the
    expected improvement ("stable_mu").  Every iterate is evaluated on one fixed held-out
    sample: J_bar_k, sd_k of J(pi_k^xi), and the App. A.3 Step-2 bound sd_0 +
    sqrt(beta/(1-beta)) (J_bar_k - J_bar_0) (beta_0 = 0, Xi_0 = Xi_delta).
    Returns (history DataFrame, final J(pi^xi) per run on the evaluation sample, setup)."""
    d, m = sizes.n_channels, sizes.n_actions
    mdp = garnet(sizes.n_states, m, sizes.branching, sizes.gamma, rng)
    pol = channel_policy(sizes.n_states, d, rng)
    sigma = np.full(d, sizes.t2_sigma)
    theta0 = 0.1 * rng.standard_normal((d, m))
    xi_eval = gaussian_sample(sigma, sizes.t2_eval_samples, rng, sizes.t2_delta)
    thetas = {run: theta0 for run in THEOREM2_RUNS}
    prev: dict[str, np.ndarray] = {}
    rows = []
    for k in range(sizes.t2_iters + 1):
        cur = {}
        for run, th in thetas.items():
            j = perturbed_return(mdp, pol, th, xi_eval)
            inc = j - prev[run] if run in prev else np.full_like(j, np.nan)  # paired on the common sample
            cur[run] = {"run": run, "iteration": k, "jbar": float(j.mean()), "sd": float(j.std(ddof=1)),
                            "increment": float(inc.mean()), "increment_se": float(inc.std(ddof=1) / math.sqrt(len(j))),
                            "theta_norm": float(np.linalg.norm(th))}
            rows.append(cur[run])
            prev[run] = j
        if k == sizes.t2_iters:
            break
        xi = gaussian_sample(sigma, sizes.t2_train_samples, rng, sizes.t2_delta)
        for run, th in thetas.items():
            direction = perturbed_gradient(mdp, pol, th, xi[:sizes.t2_grad_samples])
            if run == "pg":
                thetas[run] = th + sizes.t2_lr * direction
                continue
            thetas[run], info = stable_step(mdp, pol, th, xi, direction, sizes.t2_lr, sizes.t2_halvings,
                                            sizes.t2_beta, margin=run.split("_")[1])
            cur[run].update({f"next_{key}": val for key, val in info.items()})
    hist = pd.DataFrame(rows)
    c = math.sqrt(sizes.t2_beta / (1 - sizes.t2_beta))
    for _, g in hist.groupby("run"):
        hist.loc[g.index, "sd_bound"] = g.sd.iloc[0] + c * (g.jbar - g.jbar.iloc[0])
    setup = {"C_J": mdp.return_range, "sigma": sizes.t2_sigma, "delta": sizes.t2_delta, "beta": sizes.t2_beta}
    return hist, prev, setup


def robustness_row(j: np.ndarray, eps: float, beta_bar: float) -> dict:
    """(delta, epsilon, beta_bar)-probabilistic robustness (Def. 1, eq. robustness) by Monte
    Carlo: P(J(pi^xi) >= J_bar - epsilon) with an exact interval, against 1 - beta_bar."""
    x = int((j >= j.mean() - eps).sum())
    lo, hi = clopper_pearson(x, len(j))
    return {"n": len(j), "jbar": float(j.mean()), "sd": float(j.std(ddof=1)), "eps": eps, "beta_bar": beta_bar,
                "p": x / len(j), "lo": lo, "hi": hi, "robust": lo >= 1 - beta_bar, "violated": hi < 1 - beta_bar}


def theorem2_requirements(C_J: float, eps: float, beta_bar: float, sd0: float, beta: float) -> dict:
    """Theorem 2's hypotheses for the run: beta <= eps^2 beta_bar / (100 C_J^2 + eps^2 beta_bar)
    and Assumption 1's sigma_0 < eps sqrt(beta_bar) / 4 (with beta_0 = 0)."""
    beta_req = eps ** 2 * beta_bar / (100 * C_J ** 2 + eps ** 2 * beta_bar)
    sd0_max = eps * math.sqrt(beta_bar) / 4
    return {"beta_required": beta_req, "beta_used": beta, "beta_ok": beta <= beta_req,
            "sigma0": sd0, "sigma0_max": sd0_max, "assumption1_ok": sd0 < sd0_max}


# --------------------------------------------------------------------------------------
# Fig. 2: a 2-D landscape with a sharp and a flat direction
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToyLandscape:
    """R(x, y) = exp(-(x - c(y))^2 / (2 w^2)) exp(-(y - y_peak)^2 / (2 length^2)) with a
    curved crest c(y) = amp sin(freq y): a narrow ridge (sharp direction across it, flat
    along it) leading to the peak at (c(y_peak), y_peak).  Gradient ascent with step ``lr``
    from ``start``; ``noise`` is the per-direction nominal perturbation std (isotropic
    energy 2 noise^2, SAM radius sqrt(2) noise); lr < 2 w^2 keeps noise-free ascent stable
    across the ridge."""

    w: float = 0.2
    amp: float = 0.4
    freq: float = 1.2
    y_peak: float = 2.0
    length: float = 2.0
    lr: float = 0.07
    noise: float = 0.2
    start: tuple = (0.0, -2.0)
    ema: float = 0.9

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    def reward(self, p: np.ndarray) -> np.ndarray:
        x, y = p[..., 0], p[..., 1]
        return (np.exp(-(x - self.amp * np.sin(self.freq * y)) ** 2 / (2 * self.w ** 2))
                * np.exp(-(y - self.y_peak) ** 2 / (2 * self.length ** 2)))

    def grad(self, p: np.ndarray) -> np.ndarray:
        x, y = p[..., 0], p[..., 1]
        u = (x - self.amp * np.sin(self.freq * y)) / self.w ** 2
        R = self.reward(p)
        dc = self.amp * self.freq * np.cos(self.freq * y)
        return np.stack([-u * R, R * (u * dc - (y - self.y_peak) / self.length ** 2)], -1)


TOY_METHODS = ("none", "isotropic", "sam", "controlled")


def toy_trajectory(toy: ToyLandscape, method: str, steps: int, rng: np.random.Generator) -> np.ndarray:
    """Perturbed gradient ascent theta <- theta + lr grad R(theta + e) (the gradient is taken
    at the perturbed point, as the policy gradient is taken on perturbed rollouts):
    ``none`` e = 0; ``isotropic`` e ~ N(0, noise^2 I); ``sam`` e = -sqrt(2) noise
    grad R / |grad R| (the adversarial direction, which on a ridge is the sharp one);
    ``controlled`` e ~ N(0, diag sigma^2) with sigma_i ~ S_i^-1/2 at the same energy, S_i an
    exponential average of the squared perturbed gradient (Alg. 1 lines 3 and 7, S_1 = 1)."""
    p = np.asarray(toy.start, dtype=float)
    S = np.ones(2)
    out = [p.copy()]
    radius = math.sqrt(2) * toy.noise
    for _ in range(steps):
        if method == "none":
            e = np.zeros(2)
        elif method == "isotropic":
            e = toy.noise * rng.standard_normal(2)
        elif method == "sam":
            g = toy.grad(p)
            e = -radius * g / (np.linalg.norm(g) + 1e-12)
        elif method == "controlled":
            e = allocate_sigma(S, radius ** 2, 1.0) * rng.standard_normal(2)
        else:
            raise ValueError(f"unknown method {method!r}; expected one of {TOY_METHODS}")
        g = toy.grad(p + e)
        if method == "controlled":
            S = toy.ema * S + (1 - toy.ema) * g ** 2
        p = p + toy.lr * g
        out.append(p.copy())
    return np.array(out)


def toy_experiment(sizes: TheorySizes, toy: ToyLandscape | None = None, seed: int = 0):
    """``toy_seeds`` trajectories per method (one for the deterministic ones); returns
    (trajectories {method: [array]}, DataFrame of final rewards per method)."""
    toy = toy or ToyLandscape()
    trajs, rows = {}, []
    for mi, method in enumerate(TOY_METHODS):
        n = 1 if method in ("none", "sam") else sizes.toy_seeds
        trajs[method] = [toy_trajectory(toy, method, sizes.toy_steps, np.random.default_rng([seed, mi, i]))
                         for i in range(n)]
        final = np.array([float(toy.reward(t[-1])) for t in trajs[method]])
        rows.append({"method": method, "runs": n, "steps": sizes.toy_steps, "final_reward_mean": final.mean(),
                         "final_reward_sd": final.std(ddof=1) if n > 1 else 0.0, "final_reward_min": final.min(),
                         "final_reward_max": final.max(), "peak_reward": 1.0, "noise": toy.noise, "lr": toy.lr})
    return trajs, pd.DataFrame(rows)


# --------------------------------------------------------------------------------------
# experiments (what the notebook calls, one per section)
# --------------------------------------------------------------------------------------


def _rng(sizes: TheorySizes, stream: int) -> np.random.Generator:
    """Independent stream per experiment, so changing one budget leaves the others' draws."""
    return np.random.default_rng([sizes.seed, stream])


def lemma1_experiment(sizes: TheorySizes) -> dict:
    """Lemma 1 on random pairs and by adversarial search, with the growth of the slack
    (and of the true gap |Delta J - L| and of the penalty) with alpha: log-log slopes for
    alpha < 0.05 and medians per alpha decade."""
    pairs = lemma1_random(sizes, _rng(sizes, 1))
    search = lemma1_search(sizes, _rng(sizes, 2))
    pairs["gap"] = (pairs.surrogate - pairs.delta_j).abs()
    small = pairs[pairs.alpha < 0.05]
    edges = np.array([0.0, 1e-3, 1e-2, 1e-1, 0.5, 1.0])
    pairs["alpha_bin"] = pd.cut(pairs.alpha, edges, include_lowest=True).astype(str)
    by_alpha = (pairs.groupby("alpha_bin", sort=False)
                .agg(pairs=("slack", "size"), alpha_median=("alpha", "median"), slack_median=("slack", "median"),
                     slack_min=("slack", "min"), penalty_median=("penalty", "median"), gap_median=("gap", "median"),
                     tightness_max=("tightness", "max"))
                .sort_values("alpha_median").reset_index())
    return {"pairs": pairs, "search": search, "by_alpha": by_alpha,
            "slope_slack": loglog_slope(small.alpha, small.slack), "slope_gap": loglog_slope(small.alpha, small.gap),
            "slope_penalty": loglog_slope(small.alpha, small.penalty)}


def theorem1_experiment(sizes: TheorySizes, updates: list[Update]) -> dict:
    """Theorem 1 for every update and beta; keeps the Delta J_xi samples of the first two
    updates for the histogram."""
    rng = _rng(sizes, 3)
    rows, samples = [], {}
    for i, upd in enumerate(updates):
        _, st = update_sample(upd, upd.sigma, sizes.mc_samples, rng)
        rows += theorem1_rows(upd, st, sizes.betas)
        if i < 2:
            samples[upd.name] = st.delta_j
    return {"table": pd.DataFrame(rows), "samples": samples}


def corollary1_experiment(sizes: TheorySizes, updates: list[Update]) -> dict:
    """Poincare ratio per update and noise scale (Bonferroni-corrected 95% intervals over
    all of them), the corollary's conclusion, and the allocation comparison."""
    rng = _rng(sizes, 4)
    level = 1 - 0.05 / (len(updates) * len(sizes.poincare_scales))
    n = max(500, sizes.mc_samples // 4)
    poincare = pd.DataFrame([r for upd in updates
                             for r in corollary1_rows(upd, sizes.poincare_scales, n, sizes.n_boot, rng, level)])
    alloc = pd.DataFrame([r for upd in updates for r in allocation_rows(upd, sizes.alloc_alphas, n * 2, rng)])
    iso = alloc[alloc.alpha == 0].set_index("update")
    alloc["var_dj_rel"] = alloc.var_dj / alloc["update"].map(iso.var_dj)
    alloc["var_L_rel"] = alloc.var_L / alloc["update"].map(iso.var_L)
    return {"poincare": poincare, "allocation": alloc, "level": level}


def theorem2_experiment(sizes: TheorySizes) -> dict:
    """Theorem 2 runs plus the final policies' (delta, epsilon, beta_bar)-robustness, the
    empirical P(J < J_bar - eps) over an epsilon grid next to the Cantelli bound the
    proof gives from the Step-2 deviation bound, and the theorem's hypotheses."""
    hist, finals, setup = theorem2_runs(sizes, _rng(sizes, 5))
    eps = sizes.t2_eps_frac * setup["C_J"]
    robust = pd.DataFrame([{"run": run, **robustness_row(j, eps, sizes.t2_beta_bar)} for run, j in finals.items()])
    curves = []
    for run, j in finals.items():
        g = hist[hist.run == run]
        sd_bar = float(g.sd_bound.iloc[-1])
        for e in np.linspace(0, 1.5 * eps, 61):
            curves.append({"run": run, "eps": e, "p_below": float((j < j.mean() - e).mean()),
                               "cantelli": sd_bar ** 2 / (sd_bar ** 2 + e ** 2) if e > 0 else 1.0})
    req = theorem2_requirements(setup["C_J"], eps, sizes.t2_beta_bar, float(hist.sd.iloc[0]), sizes.t2_beta)
    return {"history": hist, "finals": finals, "setup": setup, "robustness": robust, "curves": pd.DataFrame(curves),
                "requirements": req, "eps": eps}


def summary_table(lem: dict, thm1: dict, cor1: dict, thm2: dict) -> pd.DataFrame:
    """One row per checked statement: instances tried, violations (significant at the
    stated level where Monte Carlo is involved), minimum slack (in the statement's own
    unit) and what the slack measures."""
    rows = []

    def add(check, statement, instances, violations, min_slack, unit, notes=""):
        rows.append({"check": check, "statement": statement, "instances": int(instances), "violations": int(violations),
                         "min_slack": float(min_slack), "slack_unit": unit, "notes": notes})

    p, s = lem["pairs"], lem["search"]
    add("Lemma 1", "Delta J >= L - 4 gamma A_max alpha^2/(1-gamma)^2 (random pairs)", len(p), (p.slack < -1e-10).sum(),
        p.slack.min(), "return", f"max (L-DJ)/penalty {p.tightness.max():.3f}; slack ~ alpha^{lem['slope_slack']:.2f},"
        f" |DJ-L| ~ alpha^{lem['slope_gap']:.2f} (alpha < 0.05)")
    add("Lemma 1", "same, adversarial search over MDP and policies", s.evaluated.sum(), (s.tightness > 1).sum(),
        s.slack.min(), "return", f"max (L-DJ)/penalty {s.tightness.max():.3f} over {len(s)} restarts")
    t = thm1["table"]
    add("Theorem 1", "P(DJ_xi >= m_nu - sqrt((1-beta)/beta v_nu)) >= 1-beta", len(t), t.violated_m.sum(),
        t.slack_m.min(), "probability", "violation: Clopper-Pearson 95% upper < 1-beta")
    add("Theorem 1 (Cantelli step)", "same with mu_nu = E[DJ_xi] in place of m_nu", len(t), t.violated_mu.sum(),
        t.slack_mu.min(), "probability", "")
    u = t.drop_duplicates("update")
    cert = u[u.beta_star < 1]
    lo_hi = [clopper_pearson(round(r.p_improve * r.n), int(r.n)) for r in cert.itertuples()]
    add("Theorem 1 (consequence)", "m_nu >= sqrt((1-beta)v/beta) => P(DJ_xi >= 0) >= 1-beta", len(cert),
        sum(hi < 1 - b for (_, hi), b in zip(lo_hi, cert.beta_star)),
        (cert.p_improve - (1 - cert.beta_star)).min() if len(cert) else float("nan"), "probability",
        f"at beta* = v/(v+m^2); {len(u) - len(cert)} updates with m_nu <= 0")
    pc = cor1["poincare"]
    level = f"Bonferroni {100 * cor1['level']:.2f}%"
    add("Corollary 1 (Poincare)", "Var[L_xi] <= sum_i sigma_i^2 S_i", len(pc), pc.poincare_violated.sum(),
        1 - pc.ratio.max(), "1 - Var/bound", f"violation: {level} lower > 1"
        + (f"; the negative min slack is Monte Carlo error of Var (ratio {pc.ratio.max():.4f}, {level} interval "
           f"reaching below 1)" if pc.ratio.max() > 1 else ""))
    cc = pc[pc.beta_star < 1]
    add("Corollary 1", "stability condition => P(DJ_xi >= 0) >= 1-beta", len(cc), cc.corollary_violated.sum(),
        (cc.p_improve - (1 - cc.beta_star)).min() if len(cc) else float("nan"), "probability",
        f"at the smallest admissible beta*; {len(pc) - len(cc)} cases with margin <= 0")
    h = thm2["history"]
    for run, label in (("stable_m", "U_beta with m_nu"), ("stable_mu", "U_beta with E[DJ] (proof-sufficient)"),
                       ("pg", "[reference, no guarantee] unconstrained PG")):
        g = h[(h.run == run) & (h.iteration > 0)]
        add(f"Theorem 2 ({run})", f"J_bar_k non-decreasing, {label}", len(g),
            (g.increment < -2 * g.increment_se).sum(), g.increment.min(), "return",
            f"violation: increment < -2 SE (paired, {len(thm2['finals'][run])} held-out xi); "
            f"J_bar {g.jbar.iloc[0] - g.increment.iloc[0]:.3f} -> {g.jbar.iloc[-1]:.3f}")
        g0 = h[h.run == run]
        add(f"Theorem 2 ({run})", "sd_k <= sd_0 + sqrt(beta/(1-beta)) (J_bar_k - J_bar_0) (App. A.3 Step 2)",
            len(g0), (g0.sd > g0.sd_bound + 1e-12).sum(), (g0.sd_bound - g0.sd).min(), "return",
            f"sd {g0.sd.iloc[0]:.4f} -> {g0.sd.iloc[-1]:.4f}, max {g0.sd.max():.4f}")
        r = thm2["robustness"].set_index("run").loc[run]
        q = thm2["requirements"]
        add(f"Theorem 2 ({run})", "final policy (delta, eps, beta_bar)-robust: P(J >= J_bar - eps) >= 1-beta_bar", 1,
            int(r.violated), r.p - (1 - r.beta_bar), "probability",
            f"eps={r.eps:.3f}, beta_bar={r.beta_bar}; CP 95% [{r.lo:.4f}, {r.hi:.4f}]; hypotheses: beta "
            f"{q['beta_used']:g} vs required <= {q['beta_required']:.1e} ({'met' if q['beta_ok'] else 'NOT met'}), "
            f"Assumption 1 {'met' if q['assumption1_ok'] else 'NOT met'}")
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------
# figures and tables
# --------------------------------------------------------------------------------------


def _yerr(mid, lo, hi) -> list:
    """Asymmetric error bars, clipped at 0 against round-off at the interval ends."""
    return [np.clip(np.asarray(mid) - lo, 0, None), np.clip(np.asarray(hi) - mid, 0, None)]


def _colors(n: int) -> np.ndarray:
    """n colours along viridis, one line per update (no method's colour: paper.style)."""
    return matplotlib.colormaps["viridis"](np.linspace(0.0, 0.9, max(n, 1)))


def _plt():
    return pyplot()


def plot_lemma1(lem: dict):
    """Lemma 1: Delta J against the bound (every pair above the diagonal), slack / penalty /
    true gap against alpha, and the share of the penalty the true gap uses."""
    plt = _plt()
    p, s, b = lem["pairs"], lem["search"], lem["by_alpha"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    sc = ax[0].scatter(p.bound, p.delta_j, c=np.log10(p.alpha.clip(1e-6)), s=4, cmap="viridis", rasterized=True)
    lim = [min(p.bound.min(), p.delta_j.min()), max(p.bound.max(), p.delta_j.max())]
    ax[0].plot(lim, lim, "k--", lw=1, label=r"$\Delta J$ = bound")
    ax[0].set_xscale("symlog", linthresh=1e-3)
    ax[0].set_yscale("symlog", linthresh=1e-3)
    ticks = [t for t in (-1e3, -1e1, -1e-1, 0.0, 1e-1, 1e1) if lim[0] - 1 <= t <= lim[1] + 1]
    ax[0].set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=8)
    ax[0].set(xlabel=r"Lemma 1 bound  $L - 4\gamma A_{\max}\alpha^2/(1-\gamma)^2$",
              ylabel=r"$\Delta J = J(\pi') - J(\pi)$", title=f"Lemma 1: {len(p)} random pairs, min slack {p.slack.min():.2e}")
    legend_below(ax[0])
    fig.colorbar(sc, ax=ax[0], label=r"$\log_{10}\alpha$")
    ok = p.alpha > 0
    ax[1].loglog(p.alpha[ok], p.slack[ok].clip(1e-16), ".", ms=2, alpha=0.3, label=r"slack $\Delta J$ - bound",
                 rasterized=True)
    ax[1].loglog(b.alpha_median, b.penalty_median, "s-", label="penalty (median)")
    ax[1].loglog(b.alpha_median, b.gap_median, "o-", label=r"$|\Delta J - L|$ (median)")
    ax[1].set(xlabel=r"$\alpha = \max_s D_{TV}(\pi, \pi')$", ylabel="return units",
              title=rf"slopes ($\alpha$<0.05): slack {lem['slope_slack']:.2f}, gap {lem['slope_gap']:.2f}")
    legend_below(ax[1], ncol=2)
    ax[2].semilogx(p.alpha[ok], p.tightness[ok], ".", ms=2, alpha=0.3, label="random pairs", rasterized=True)
    ax[2].semilogx(s.alpha, s.tightness, "*", color=role("accent"), ms=9, label="adversarial search (best per restart)")
    ax[2].axhline(1, color="k", ls="--", lw=1, label="lemma fails above 1")
    ax[2].set(xlabel=r"$\alpha$", ylabel=r"$(L - \Delta J)$ / penalty", ylim=(-0.1, 1.1),
              title=f"share of the penalty used: max {max(p.tightness.max(), s.tightness.max()):.3f}")
    legend_below(ax[2], ncol=2)
    fig.tight_layout()
    return fig


def plot_theorem1(thm1: dict):
    """Theorem 1: Delta J_xi distributions with m_nu and the Cantelli thresholds, and the
    empirical probability against the guaranteed 1 - beta (exact 95% intervals)."""
    plt = _plt()
    t = thm1["table"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for a, (name, dj) in zip(ax[:2], thm1["samples"].items()):
        r = t[t["update"] == name]
        a.hist(dj, bins=80, color="0.6")
        a.axvline(r.mu_nu.iloc[0], color="k", label=r"$\mu_\nu = E[\Delta J_\xi]$")
        if r.m_nu.iloc[0] > dj.min() - (dj.max() - dj.min()):  # far-off m_nu would squash the histogram
            a.axvline(r.m_nu.iloc[0], color=role("bound"), label=r"$m_\nu$ (Thm 1)")
        else:  # said, not silently dropped
            a.plot([], [], color=role("bound"), label=rf"$m_\nu$ = {r.m_nu.iloc[0]:.3g}: off the axis, left")
        for thr in r.thr_mu:
            a.axvline(thr, color=role("accent"), ls=":", lw=1)
        a.xaxis.set_major_locator(plt.MaxNLocator(5))
        a.axvline(0, color="k", ls="--", lw=0.8)
        a.plot([], [], color=role("accent"), ls=":", lw=1, label=r"$\mu_\nu - \sqrt{(1-\beta)/\beta\ v_\nu}$ per $\beta$")
        a.set(xlabel=r"$\Delta J_\xi$", ylabel="count",
              title=rf"{name} (step {r.step.iloc[0]:.3g}): $m_\nu$={r.m_nu.iloc[0]:.3g},"
                    f"\n" + rf"$\mu_\nu$={r.mu_nu.iloc[0]:.3g}, $P(\Delta J_\xi \geq 0)$={r.p_improve.iloc[0]:.3f}")
        legend_below(a, ncol=2)
    names = list(dict.fromkeys(t["update"]))
    colors = _colors(len(names))
    for key, mk, lab in (("m", "o", r"threshold $m_\nu - \sqrt{(1-\beta)/\beta\ v_\nu}$"),
                         ("mu", "s", r"threshold $\mu_\nu - \sqrt{(1-\beta)/\beta\ v_\nu}$")):
        for i, name in enumerate(names):
            g = t[t["update"] == name]
            x = 1 - g.beta + 0.01 * (i / max(len(names) - 1, 1) - 0.5)
            ax[2].errorbar(x, g[f"p_{key}"], yerr=_yerr(g[f"p_{key}"], g[f"lo_{key}"], g[f"hi_{key}"]), fmt=mk, ms=3,
                           color=colors[i], mfc=colors[i] if key == "m" else "none", label=lab if i == 0 else None)
    ax[2].plot([0, 1], [0, 1], "k--", lw=1, label=r"guarantee $1 - \beta$")
    ax[2].set(xlabel=r"$1 - \beta$", ylabel=r"empirical $P(\Delta J_\xi \geq$ threshold$)$", xlim=(0.25, 1.0), ylim=(0.25, 1.01),
              title=f"Theorem 1: {len(t)} (update, beta) pairs,\n"
                    f"{int(t.violated_m.sum() + t.violated_mu.sum())} violations (exact 95% intervals)")
    legend_below(ax[2])
    fig.tight_layout()
    return fig


def plot_corollary1(cor1: dict):
    """Corollary 1: Poincare ratio Var/bound against the noise scale, and the allocation
    comparison at equal total noise energy (variance of Delta J_xi, P(Delta J_xi >= 0))."""
    plt = _plt()
    pc, al = cor1["poincare"], cor1["allocation"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    names = list(dict.fromkeys(pc["update"]))
    colors = _colors(len(names))
    for i, name in enumerate(names):
        g = pc[pc["update"] == name]
        ax[0].errorbar(g.sigma, g.ratio, yerr=_yerr(g.ratio, g.ratio_lo, g.ratio_hi), fmt="o-", ms=3,
                       color=colors[i], label=name, capsize=2)
    ax[0].axhline(1, color="k", ls="--", lw=1)
    ax[0].set(xscale="log", xlabel=r"$\sigma$ (isotropic, per channel)", ylabel=r"Var$[L_\xi] / \sum_i \sigma_i^2 S_i$",
              title="Gaussian Poincare (App. A.2): ratio " + r"$\leq$ 1" + f"\n(Bonferroni {100 * cor1['level']:.2f}% intervals)",
              ylim=(0, 1.1))
    for i, name in enumerate(names):
        g = al[al["update"] == name]
        ax[1].semilogy(g.alpha, g.var_dj_rel, "o-", color=colors[i], label=name)
        ax[2].errorbar(g.alpha, g.p_improve, yerr=_yerr(g.p_improve, g.p_improve_lo, g.p_improve_hi),
                       fmt="o-", color=colors[i], ms=3, capsize=2, label=name)
    for a in ax[1:]:
        a.axvline(1.0, color="k", ls=":", lw=1)
    ax[1].set(xlabel=r"allocation exponent $\alpha$ ($\sigma_i^2 \propto S_i^{-\alpha}$; 0 isotropic, 1 SPrPO)",
              ylabel=r"Var$[\Delta J_\xi]$ / Var at $\alpha$=0", title=r"equal energy $\sum_i \sigma_i^2$: variance")
    ax[2].set(xlabel=r"allocation exponent $\alpha$", ylabel=r"$P(\Delta J_\xi \geq 0)$ (Wilson 95%)",
              title="equal energy: probability of improvement")
    for a in ax:
        legend_below(a, ncol=3, fontsize=6)
    fig.tight_layout()
    return fig


RUN_STYLE = {"pg": (role("unconstrained"), "unconstrained PG"),
             "stable_m": (role("stable_m"), r"stable, $U_\beta$ with $m_\nu$"),
             "stable_mu": (role("stable_mu"), r"stable, $U_\beta$ with $E[\Delta J]$")}


def plot_theorem2(thm2: dict):
    """Theorem 2: mean perturbed return and its spread per iteration (with the Step-2 bound),
    and the final policies' lower-tail probability against the proof's Cantelli bound."""
    plt = _plt()
    h, cv = thm2["history"], thm2["curves"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    for run, g in h.groupby("run"):
        c, lab = RUN_STYLE[run]
        ax[0].plot(g.iteration, g.jbar, "-", color=c, label=lab)
        ax[0].fill_between(g.iteration, g.jbar - 2 * g.sd / np.sqrt(len(thm2["finals"][run])),
                           g.jbar + 2 * g.sd / np.sqrt(len(thm2["finals"][run])), color=c, alpha=0.2)
        ax[1].plot(g.iteration, g.sd, "-", color=c, label=f"{lab}: sd")
        if run != "pg":
            ax[1].plot(g.iteration, g.sd_bound, "--", color=c, lw=1, label=f"{lab}: Step-2 bound")
        k = cv[cv.run == run]
        ax[2].semilogy(k.eps, k.p_below.clip(1e-5), "-", color=c, label=f"{lab}: empirical")
        if run != "pg":
            ax[2].semilogy(k.eps, k.cantelli, "--", color=c, lw=1, label=f"{lab}: Cantelli bound")
    s = thm2["setup"]
    ax[0].set(xlabel="iteration $k$", ylabel=r"$\bar J_k = E_\xi J(\pi_k^\xi)$ (held-out $\xi$)",
              title=rf"$\sigma$={s['sigma']}, $|\xi_i| \leq$ {s['delta']}$\sigma$, $\beta$={s['beta']}")
    ax[1].set(xlabel="iteration $k$", ylabel=r"sd of $J(\pi_k^\xi)$", title="spread of the perturbed return")
    ax[2].axvline(thm2["eps"], color="k", ls=":", lw=1, label=r"$\epsilon$ of the robustness check")
    ax[2].set(xlabel=r"$\epsilon$", ylabel=r"$P(J(\pi^\xi) < \bar J - \epsilon)$", title="final policies: lower tail",
              ylim=(1e-5, 1.5))
    for a in ax:
        legend_below(a, ncol=2, fontsize=6)
    fig.tight_layout()
    return fig


def plot_fig2(trajs: dict, finals: pd.DataFrame, toy: ToyLandscape | None = None, max_lines: int = 5):
    """The paper's Fig. 2 on a 2-D toy: trajectories under isotropic noise, SAM-style
    adversarial perturbation and sensitivity-controlled noise (same nominal magnitude),
    over the reward contours; the noise-free ascent dashed; final rewards in the titles."""
    plt = _plt()
    toy = toy or ToyLandscape()
    allp = np.concatenate([t for ts in trajs.values() for t in ts])
    x = np.linspace(min(-1.2, allp[:, 0].min() - 0.2), max(1.2, allp[:, 0].max() + 0.2), 240)
    y = np.linspace(min(-2.6, allp[:, 1].min() - 0.2), max(3.0, allp[:, 1].max() + 0.2), 240)
    X, Y = np.meshgrid(x, y)
    Z = toy.reward(np.stack([X, Y], -1))
    fig, ax = plt.subplots(1, 3, figsize=(14, 4.6), sharey=True)
    titles = {"isotropic": "isotropic noise", "sam": "SAM-style (adversarial)", "controlled": "sensitivity-controlled"}
    f = finals.set_index("method")
    colors = _colors(max_lines)  # one per drawn seed, no method's colour (paper.style)
    for a, method in zip(ax, ("isotropic", "sam", "controlled")):
        a.contourf(X, Y, Z, levels=20, cmap="Greys", alpha=0.8)
        ref = trajs["none"][0]
        a.plot(ref[:, 0], ref[:, 1], "k--", lw=1, label=f"no noise (R={f.loc['none', 'final_reward_mean']:.2f})")
        drawn = trajs[method][:max_lines]
        for i, t in enumerate(drawn):
            a.plot(t[:, 0], t[:, 1], "-", lw=1, color=colors[i], alpha=0.9, gid=f"reference:trajectory {i}")
            a.plot(*t[-1], "o", color=colors[i], ms=4)
        a.plot(*toy.start, "k^", ms=7)
        r = f.loc[method]
        sd = f" +- {r.final_reward_sd:.2f} over {int(r.runs)} runs" if r.runs > 1 else ""
        shown = f"; {len(drawn)} of {int(r.runs)} runs drawn" if r.runs > len(drawn) else ""
        a.set(title=f"{titles[method]}: final R = {r.final_reward_mean:.2f}{sd}{shown}", xlabel="x (sharp direction)")
        a.title.set_fontsize(8)
        a.legend(fontsize=7, loc="lower right")
    ax[0].set_ylabel("y (flat direction)")
    fig.tight_layout()
    return fig


def exact_design(seed: int | None) -> dict:
    """What the theory artifacts' manifests state: exact MDPs in float64, their instance seed."""
    return {"dtype": "float64", "seeds": {"instances": seed},
            "goals": not_applicable("exact MDPs: every state and action enumerated, no test goals")}


def save_figure(fig, out_dir: str | Path, stem: str, config: dict, seed: int | None, wall_seconds: float,
                extra: dict | None = None) -> list[Path]:
    """Save ``fig`` as PNG and PDF (:func:`sprpo_lib.paper.style.save_figure`, at 130 dpi) with
    a manifest each.  The figure check's text and legend rules run first (these figures draw
    exact quantities, not evaluation designs); their problems are logged as warnings."""
    paths = style_save(fig, project_path(out_dir) / stem, dpi=130, rules=("text", "legend", "crossed"))
    for path in paths:
        write_manifest(path, config, seed, wall_seconds, {**exact_design(seed), **(extra or {})})
    return paths


def _latex_escape(text: str) -> str:
    for a, b in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("$", r"\$"), ("#", r"\#"),
                 ("_", r"\_"), ("{", r"\{"), ("}", r"\}"), ("~", r"\textasciitilde{}"), ("^", r"\^{}")):
        text = text.replace(a, b) if a != "\\" else text.replace(a, "\0")
    return text.replace("\0", r"\textbackslash{}")


def to_booktabs(df: pd.DataFrame, caption: str = "", label: str = "") -> str:
    """A LaTeX table (booktabs rules) of ``df``: floats in 3 significant digits, text escaped,
    a ``notes`` column wrapped in a paragraph column."""
    def fmt(v):
        if isinstance(v, (float, np.floating)):
            return "--" if not np.isfinite(v) else f"{v:.3g}"
        return _latex_escape(str(v))

    lines = [r"\begin{table}[t]", r"\centering", r"\small"]
    if caption:
        lines.append(rf"\caption{{{_latex_escape(caption)}}}")
    if label:
        lines.append(rf"\label{{{label}}}")
    spec = "".join("l" if i < 2 else ("p{5.5cm}" if c == "notes" else "r") for i, c in enumerate(df.columns))
    lines += [rf"\begin{{tabular}}{{{spec}}}", r"\toprule",
              " & ".join(_latex_escape(str(c)) for c in df.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(fmt(v) for v in row) + r" \\" for row in df.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    return "\n".join(lines)


def save_table(df: pd.DataFrame, out_dir: str | Path, stem: str, config: dict, seed: int | None,
               wall_seconds: float, extra: dict | None = None, latex_columns: list[str] | None = None,
               caption: str = "") -> list[Path]:
    """Write ``df`` as CSV (and, with ``latex_columns``, as a booktabs .tex) atomically, each
    with its manifest."""
    paths = [atomic_write_text(project_path(out_dir) / f"{stem}.csv", df.to_csv(index=False))]
    if latex_columns:
        paths.append(atomic_write_text(project_path(out_dir) / f"{stem}.tex",
                                       to_booktabs(df[latex_columns], caption, f"tab:{stem}")))
    for path in paths:
        write_manifest(path, config, seed, wall_seconds, {**exact_design(seed), **(extra or {})})
    return paths
