"""Policy losses, as a registry (verl style): PPO clipped surrogate with dual clip.

The paper optimises the perturbed PPO surrogate (Sec. 5, "perturbed loss surrogate with
PPO clipping")

    L_k(theta; xi_k) = 1/|D_k| sum_i min(r_i A_i, clip(r_i, 1-eps, 1+eps) A_i),
    r_i = pi_theta^xi(a_i|s_i) / pi_theta_k^xi(a_i|s_i),

as an objective to **maximise** (Alg. 1 line 6: ``theta_{k+1} = theta_k + eta grad L``).
Here we **minimise its negative**, per token:

    pg1 = -A * r,   pg2 = -A * clip(r, 1 - eps_low, 1 + eps_high),
    l   = max(pg1, pg2)                       (A >= 0)
    l   = min(max(pg1, pg2), -A * c)          (A <  0, dual clip, Ye et al. 2020)

with ``r = exp(logp - old_logp)`` per response token (both log-probs under the same
perturbation xi, which is the caller's business) and the step's advantage broadcast
over its response tokens.  The dual clip bounds the loss of a negative-advantage token
whose ratio has exploded (``r > c``); there the gradient is zero.  Aggregation is
``token-mean`` over all response tokens of the batch; an entropy bonus is subtracted:
``loss = agg(l) - entropy_coeff * agg(entropy)``.  All of this follows verl's
``compute_policy_loss`` (``verl/trainer/ppo/core_algos.py``) and its actor update,
with the hyperparameters of App. B, Table "Shared training hyperparameters" (PPO clip
ratio 0.2, dual-clip coefficient 3.0, entropy coefficient 0.001).

Also here: :func:`token_logprobs` and :func:`token_entropy` from logits (float32), and
:func:`token_logprobs_entropy`, both from one softmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Callable

import torch
from annotated_types import Ge, Gt
from torch.autograd.function import once_differentiable

from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.infra.registry import Registry

__all__ = [
    "PPOLossConfig",
    "POLICY_LOSSES",
    "LOSS_AGG_MODES",
    "register_policy_loss",
    "get_policy_loss",
    "agg_loss",
    "ppo_dual_clip_loss",
    "token_logprobs",
    "token_entropy",
    "token_logprobs_entropy",
    "kl_penalty",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class PPOLossConfig:
    """PPO policy-loss settings (App. B, Table "Shared training hyperparameters").

    Attributes:
        clip_ratio: PPO clip epsilon, 0.2 ("PPO clip ratio").
        clip_ratio_low, clip_ratio_high: asymmetric bounds ``1 - low``, ``1 + high``
            (DAPO's clip-higher); ``None`` means ``clip_ratio``.
        clip_ratio_c: dual-clip coefficient c > 1, 3.0 ("Dual-clip coefficient").
        entropy_coeff: entropy bonus weight, 0.001 ("Entropy coefficient").
        loss_agg_mode: ``"token-mean"`` (paper, verl default) or
            ``"seq-mean-token-mean"`` / ``"seq-mean-token-sum"``.
        log_ratio_clamp: ``logp - old_logp`` is clamped to +-this before ``exp``
            (verl uses 20) so a wild token cannot overflow the ratio.
    """

    clip_ratio: Annotated[float, Ge(0)] = 0.2
    clip_ratio_low: Annotated[float, Ge(0)] | None = None
    clip_ratio_high: Annotated[float, Ge(0)] | None = None
    clip_ratio_c: Annotated[float, Gt(1)] = 3.0
    entropy_coeff: Annotated[float, Ge(0)] = 1e-3
    loss_agg_mode: str = "token-mean"
    log_ratio_clamp: Annotated[float, Gt(0)] = 20.0

    def __post_init__(self):
        check_ranges(self)
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")

    @property
    def bounds(self) -> tuple[float, float]:
        low = self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low
        high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
        return 1.0 - low, 1.0 + high


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

#: name -> ``fn(logp, old_logp, advantages, response_mask, entropy=None, config=None)
#: -> (scalar loss to minimise, stats)``; add one with ``@register_policy_loss("name")``.
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "update.loss_name")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0).sum() / mask.sum().clamp(min=1)


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token matrix to a scalar over the tokens where ``mask``.

    * ``token-mean``: sum over all valid tokens / their number (each token weighs the same);
    * ``seq-mean-token-mean``: mean over sequences of each sequence's token mean;
    * ``seq-mean-token-sum``: mean over sequences of each sequence's token sum.

    Masked entries never contribute (even if NaN/inf).  An all-masked batch gives 0; a
    sequence without valid tokens is left out of the sequence mean (verl would count it
    in ``torch.mean`` and divide 0 by 0).
    """
    mask = mask.to(torch.bool)
    x = torch.where(mask, loss_mat, 0)
    if mode == "token-mean":
        return x.sum() / mask.sum().clamp(min=1)
    n_tok = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        seq = x.sum(-1) / n_tok.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        seq = x.sum(-1)
    else:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    return seq.sum() / (n_tok > 0).sum().clamp(min=1)


@register_policy_loss("ppo_dual_clip")
def ppo_dual_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    entropy: torch.Tensor | None = None,
    config: PPOLossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO loss (to minimise; the negative of the paper's surrogate L_k).

    Args:
        logp: ``[B, T]`` per-token log-probs under the current policy (carries the grad).
        old_logp: ``[B, T]`` log-probs under the rollout policy (treated as constant).
        advantages: ``[B, T]`` per-token advantages (a step's advantage broadcast over its
            response tokens, e.g. :func:`sprpo_lib.core.advantages.to_token_advantages`).
        response_mask: ``[B, T]`` 1 on response tokens, 0 on padding/prompt.  Values of
            the other inputs on masked tokens are ignored (may be -inf/NaN).
        entropy: optional ``[B, T]`` per-token entropy (:func:`token_entropy`), may carry
            grad; the bonus ``- entropy_coeff * agg(entropy)`` is applied only if given.
        config: :class:`PPOLossConfig` (defaults: the paper's).

    Returns:
        ``(loss, stats)``: the scalar loss, and floats ``pg_loss``, ``loss``, ``clipfrac``
        (share of valid tokens where the PPO clip is active, verl's ``pg_clipfrac``),
        ``dual_clipfrac`` (share where the dual clip is active, verl's
        ``pg_clipfrac_lower``), ``approx_kl`` (mean ``old_logp - logp``, verl's
        ``ppo_kl``: a k1 estimate of KL(pi_old || pi)), ``approx_kl_k3``
        (mean ``r - 1 - log r`` >= 0), ``ratio_mean``, ``ratio_max``, ``n_tokens``, and
        ``entropy`` (aggregated, if given).  All token statistics are token means over
        valid tokens.
    """
    cfg = config or PPOLossConfig()
    if not (logp.shape == old_logp.shape == advantages.shape == response_mask.shape):
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
                         f"advantages {tuple(advantages.shape)}, response_mask {tuple(response_mask.shape)}")
    dt = torch.promote_types(logp.dtype, torch.float32)
    mask = response_mask.to(torch.bool)
    zero = torch.zeros((), dtype=dt, device=logp.device)
    # masked positions are replaced before any arithmetic, so garbage there can't leak
    log_ratio = torch.where(mask, logp.to(dt) - old_logp.to(dt).detach(), zero)
    log_ratio = log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages.to(dt).detach(), zero)
    lo, hi = cfg.bounds

    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(lo, hi)
    clipped = torch.maximum(pg1, pg2)
    pg3 = -adv * cfg.clip_ratio_c
    per_token = torch.where(adv < 0, torch.minimum(clipped, pg3), clipped)

    pg_loss = agg_loss(per_token, mask, cfg.loss_agg_mode)
    loss = pg_loss
    ent = None
    if entropy is not None:
        if entropy.shape != logp.shape:
            raise ValueError(f"entropy shape {tuple(entropy.shape)} != {tuple(logp.shape)}")
        ent = agg_loss(entropy.to(dt), mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * ent

    with torch.no_grad():
        f = mask.to(dt)
        stats = {
            "loss": loss.item(),
            "pg_loss": pg_loss.item(),
            "clipfrac": float(_masked_mean((pg2 > pg1).to(dt), mask)),
            "dual_clipfrac": float(_masked_mean(((adv < 0) & (clipped > pg3)).to(dt), mask)),
            "approx_kl": float(_masked_mean(-log_ratio, mask)),
            "approx_kl_k3": float(_masked_mean(ratio - 1 - log_ratio, mask)),
            "ratio_mean": float(_masked_mean(ratio, mask)),
            "ratio_max": float(torch.where(mask, ratio, zero).max()) if mask.any() else 1.0,
            "n_tokens": float(f.sum()),
        }
        if ent is not None:
            stats["entropy"] = ent.item()
    return loss, stats


KL_ESTIMATORS = ("low_var_kl", "k1", "mse")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens (verl's ``kl_penalty``).

    ``low_var_kl`` (k3, Schulman): ``exp(ref - logp) - (ref - logp) - 1``, >= 0, clamped
    to [-10, 10] as verl; ``k1``: ``logp - ref``; ``mse``: ``(logp - ref)^2 / 2``.
    """
    d = ref_logp.detach().to(logp.dtype) - logp
    if kind == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(d) - d - 1.0).clamp(-10.0, 10.0)
    if kind == "k1":
        return -d
    if kind == "mse":
        return 0.5 * d.pow(2)
    raise ValueError(f"update.kl_type must be one of {KL_ESTIMATORS}, got {kind!r}")


# ----------------------------------------------------------------------------- from logits
def _f32(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., targets]`` in float32 (float64 stays float64).

    ``logits`` is ``[..., V]`` and ``targets`` ``[...]`` (int64), already aligned:
    ``logits[b, t]`` is the distribution ``targets[b, t]`` was drawn from (for a causal LM,
    the logits at position t-1 of the full sequence).  Computed as
    ``z[target] - logsumexp(z)`` without materialising the full log-softmax.
    """
    z = _f32(logits)
    return z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` in float32
    (float64 stays float64; differentiable; ``[..., V] -> [...]``; -inf logits allowed)."""
    z = _f32(logits)
    p = torch.softmax(z, dim=-1)
    # 0 * (-inf) for masked-out vocabulary entries would be NaN; such terms are 0
    return torch.logsumexp(z, dim=-1) - (p * torch.where(p > 0, z, 0)).sum(-1)


class _LogProbEntropy(torch.autograd.Function):
    """``(z[target] - lse, lse - sum_v p_v z_v)`` with ``p = softmax(z)`` computed once and kept for
    the backward, ``dz = -p (g_lp + g_H (z - E_p[z]))`` plus ``g_lp`` at the target (the two
    functions' closed-form derivatives, summed): about a third of the passes over the
    ``[positions, vocabulary]`` logits that the two functions' own graphs make."""

    @staticmethod
    def forward(ctx, z, targets):
        m = z.amax(-1, keepdim=True)
        p = torch.sub(z, m).exp_()
        s = p.sum(-1, keepdim=True)
        p.div_(s)
        lse = (m + s.log()).squeeze(-1)
        ez = torch.linalg.vecdot(p, z)  # E_p[z]
        masked = not bool(torch.isfinite(ez).all())  # -inf logits: 0 * (-inf) terms are 0
        if masked:
            ez = (p * torch.where(p > 0, z, 0)).sum(-1)
        ctx.save_for_backward(z, p, targets, ez)
        ctx.masked = masked
        return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse - ez

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_h):
        z, p, targets, ez = ctx.saved_tensors
        dz = torch.sub(torch.where(p > 0, z, 0) if ctx.masked else z, ez.unsqueeze(-1))
        dz.mul_(g_h.neg().unsqueeze(-1)).sub_(g_lp.unsqueeze(-1)).mul_(p)
        dz.scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1))
        return dz, None


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_logprobs(logits, targets), token_entropy(logits))`` from one softmax (float32;
    float64 stays float64; first-order differentiable; -inf logits allowed): what a training
    pass with the entropy bonus needs, at a fraction of the two functions' memory traffic
    (the logits are ``[positions, vocabulary]``, 49,152 wide for SmolLM2).  Equal up to
    float rounding."""
    return _LogProbEntropy.apply(_f32(logits), targets.long())
