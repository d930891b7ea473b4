"""How far a perturbation moves a policy at one state (the paper's alpha, Lemma 1 with
pi' = pi^xi): the sequence-level KL(pi(.|s) || pi^xi(.|s)) of the response, estimated from
K responses sampled from the clean policy, and Pinsker's bound on D_TV from it.

Along a sampled response x the per-token KLs of the two next-token distributions add up to
an unbiased estimate of the sequence KL (the chain rule: KL = E_x sum_t KL_t(x_<t)), with less
variance than the log-ratio sum_t log pi(x_t) / pi^xi(x_t), whose expectation is the same.
Pure functions of explicit tensors; the sampling and the passes live in
:mod:`sprpo_lib.evaluate.divergence`.
"""
from __future__ import annotations

import math

import torch


def tempered_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / T)`` in float32 (float64 stays float64): the distribution a
    sampler at temperature ``T`` draws from.  ``T = 0`` is refused (greedy has no density)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: the KL of two policies needs a temperature > 0")
    x = logits if logits.dtype == torch.float64 else logits.float()
    return torch.log_softmax(x / temperature, dim=-1)


def token_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Exact ``KL(p || q)`` of each position's next-token distributions.

    Args:
        logp, logq: ``[..., V]`` log-probabilities (:func:`tempered_logprobs`).
    Returns:
        ``[...]`` KL per position, >= 0 (clamped: rounding can give -1e-9).
    """
    p = logp.exp()
    return (p * (logp - logq)).sum(-1).clamp_min(0.0)


def sequence_kl(logp: torch.Tensor, logq: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> dict:
    """Both estimates of the sequence KL along K sampled responses.

    Args:
        logp, logq: ``[K, T, V]`` clean and perturbed log-probabilities at each response
            position (position t predicts token t).
        tokens: ``[K, T]`` the sampled response tokens (drawn from ``p``).
        mask: ``[K, T]`` 1 where the response has a token (0 after its end).
    Returns:
        ``kl`` and ``log_ratio``: ``[K]`` per-response estimates (sums over its tokens).
    """
    m = mask.to(logp.dtype)
    kl = (token_kl(logp, logq) * m).sum(-1)
    ratio = ((logp.gather(-1, tokens[..., None]) - logq.gather(-1, tokens[..., None]))[..., 0] * m).sum(-1)
    return {"kl": kl, "log_ratio": ratio}


def pinsker(kl: float) -> float:
    """Pinsker's bound: ``D_TV <= sqrt(KL / 2)``, capped at 1."""
    return min(1.0, math.sqrt(max(kl, 0.0) / 2.0))
