"""Advantage estimators for critic-free agent RL, as a registry (verl style).

The paper trains every method with GiGPO advantages (App. B "Training Details": "All
methods use GiGPO for advantage estimation"; Alg. 1 line 5, Algs. 2-4 "estimate
advantages A_i").  GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for
LLM Agent Training") adds to GRPO's episode-level group baseline a step-level one:

* **episode level** (GiGPO Eq. 3): the G rollouts of one task form a group; an
  episode's return ``R`` is normalised by the group's returns,
  ``A_E = (R - mean) / (std + eps)`` (``norm="mean_std"``) or ``R - mean``
  (``norm="mean"``);
* **step level** (Eqs. 5-7): discounted step returns ``G_t = r_t + gamma * G_{t+1}``
  within each episode; steps of one task group taken from the *same* anchor observation
  (across rollouts, and at any step index, including a revisit within one rollout) form
  a step group, whose returns are normalised the same way into ``A_S``;
* **combined** (Eq. 8): ``A = A_E + omega * A_S``.

GRPO is the episode-level part alone.  Each estimator maps a batch of
:class:`StepSample` (one per environment step; the order is free) to an
:class:`AdvantageOutput` of per-step tensors in the input order; a step's advantage is
then broadcast over its response tokens (:func:`to_token_advantages`) for the PPO loss
in :mod:`sprpo_lib.core.losses`.

Conventions (defaults; see :class:`AdvantageConfig` for the switches):

* std is the **unbiased** (Bessel, n-1) sample std, as ``torch.std`` in verl's
  ``compute_grpo_outcome_advantage`` and verl-agent's ``episode_norm_reward`` /
  ``step_norm_reward``; the divisor is ``std + eps`` with ``eps = 1e-6``.
* a group whose values are all **exactly equal** gets advantage 0 (also in
  ``mean_std`` mode; without this, float rounding of the mean divided by ``eps`` can
  give O(0.01-0.1) spurious advantages in float32).  All statistics are float64.
* **singleton step groups** (an anchor observation seen once in its task group) get
  ``A_S = 0``, as in verl-agent (mean = the value itself, std := 1).
* **singleton episode groups** (a task with one rollout) get ``A_E = 0`` by default
  (no baseline, no signal).  verl/verl-agent instead use mean 0, std 1, i.e. ``A_E = R``
  (or ``R / (1 + eps)``); ``singleton_episode="raw"`` reproduces that.
* episode statistics are taken over **episodes** (each rollout counted once, GiGPO
  Eq. 3, standard GRPO).  verl-agent's code (``compute_mean_std_cross_steps=True``)
  takes them over step records, i.e. weights each episode by its length;
  ``episode_stats="step"`` reproduces that.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Annotated, Callable, Hashable, Sequence

import torch
from annotated_types import Ge, Gt, Interval

from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.infra.registry import Registry

__all__ = [
    "StepSample",
    "AdvantageConfig",
    "AdvantageOutput",
    "ADVANTAGE_ESTIMATORS",
    "register_advantage",
    "get_advantage_estimator",
    "compute_advantages",
    "discounted_returns",
    "group_normalise",
    "gigpo_advantages",
    "episode_relative_advantages",
    "build_step_groups",
    "step_relative_advantages",
    "combine_advantages",
    "grpo_advantages",
    "to_token_advantages",
]


@dataclass(frozen=True)
class StepSample:
    """One environment step of one episode (one row of the PPO batch).

    Attributes:
        episode: episode (trajectory) uid, unique in the batch.
        group: task-group id; the G rollouts of one task share it (GiGPO's episode group).
        step: 0-based step index t within the episode; an episode's steps must be
            exactly ``0..n-1`` (any order in the input list).
        anchor: the environment observation the step's action was taken from (the
            anchor state; the raw observation, not the prompt with history).  Steps of
            one group with identical ``anchor`` form a step-level group.
        reward: the environment's step reward ``r_t``, used for the discounted step
            returns.
        episode_reward: the episode's task reward ``R(tau)``; equal on all its steps.
        penalty: this step's own penalty (the -0.1 format penalty of App. B "Reward"
            when the response had no valid action, else 0); where it enters is
            :attr:`AdvantageConfig.penalty_placement`.
    """

    episode: Hashable
    group: Hashable
    step: int
    anchor: str
    reward: float
    episode_reward: float
    penalty: float = 0.0


@dataclass(frozen=True)
class AdvantageConfig:
    """Settings of the advantage estimators (one config for all; GRPO ignores ``gamma``
    and ``omega``).

    Attributes:
        gamma: discount of the step returns; 0.95 (App. B, Table "Shared training
            hyperparameters", "Discount factor").
        omega: weight of the step-level advantage, ``A = A_E + omega * A_S`` (GiGPO
            Eq. 8; verl-agent ``step_advantage_w``, default 1.0; the paper does not
            change it).
        norm: ``"mean_std"`` ((x - mean) / (std + eps), verl-agent ``mean_std_norm``)
            or ``"mean"`` (x - mean, ``mean_norm``).  The paper does not say which;
            verl-agent's ``ppo_trainer.yaml`` defaults to ``mean_std_norm`` (its
            ``compute_gigpo_outcome_advantage`` signature and WebShop example script
            use ``mean_norm``).
        eps: added to the std in ``mean_std`` mode (1e-6, as verl/verl-agent).
        episode_stats: ``"episode"`` (each rollout counted once; GiGPO Eq. 3) or
            ``"step"`` (over step records, verl-agent's ``compute_mean_std_cross_steps``).
        singleton_episode: ``"zero"`` (A_E = 0 for a one-rollout group) or ``"raw"``
            (verl's mean 0 / std 1, i.e. A_E = R, or R / (1 + eps) with ``mean_std``).
        penalty_placement: where a step's ``penalty`` enters.  ``"step"`` (default,
            verl-agent's ``apply_invalid_action_penalty``): it is added to that step's
            own copy of the episode score and to its own step return *after*
            discounting, so it never leaks into earlier steps or other steps' episode
            values.  ``"return"``: it is part of the step reward, summed into the
            episode return and discounted into earlier steps' returns.
    """

    gamma: Annotated[float, Interval(ge=0, le=1)] = 0.95
    omega: Annotated[float, Ge(0)] = 1.0
    norm: str = "mean_std"
    eps: Annotated[float, Gt(0)] = 1e-6
    episode_stats: str = "episode"
    singleton_episode: str = "zero"
    penalty_placement: str = "step"

    def __post_init__(self):
        check_ranges(self)
        if self.norm not in ("mean_std", "mean"):
            raise ValueError(f"norm must be 'mean_std' or 'mean', got {self.norm!r}")
        if self.episode_stats not in ("episode", "step"):
            raise ValueError(f"episode_stats must be 'episode' or 'step', got {self.episode_stats!r}")
        if self.singleton_episode not in ("zero", "raw"):
            raise ValueError(f"singleton_episode must be 'zero' or 'raw', got {self.singleton_episode!r}")
        if self.penalty_placement not in ("step", "return"):
            raise ValueError(f"penalty_placement must be 'step' or 'return', got {self.penalty_placement!r}")


@dataclass
class AdvantageOutput:
    """Per-step results, aligned with the input list (float32 tensors of shape [N]).

    Attributes:
        advantages: the advantage used for the update (``A_E + omega * A_S`` for GiGPO).
        episode_advantages: ``A_E``.
        step_advantages: ``A_S`` (zeros for GRPO).
        step_returns: discounted ``G_t`` (GiGPO) or ``None`` (GRPO).
        step_groups: int64 step-group index per step (GiGPO) or ``None``.
        stats: scalar diagnostics (group sizes, advantage means) for logging.
    """

    advantages: torch.Tensor
    episode_advantages: torch.Tensor
    step_advantages: torch.Tensor
    step_returns: torch.Tensor | None = None
    step_groups: torch.Tensor | None = None
    stats: dict[str, float] = field(default_factory=dict)


AdvantageFn = Callable[[Sequence[StepSample], AdvantageConfig], AdvantageOutput]

#: name -> estimator ``fn(steps, config) -> AdvantageOutput``; add one with
#: ``@register_advantage("name")``.
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", "update.estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = ADVANTAGE_ESTIMATORS.get


def compute_advantages(
    steps: Sequence[StepSample], estimator: str = "gigpo", config: AdvantageConfig | None = None, **overrides
) -> AdvantageOutput:
    """``ADVANTAGE_ESTIMATORS[estimator](steps, config)``; keyword ``overrides`` replace
    fields of ``config`` (e.g. ``compute_advantages(steps, "gigpo", norm="mean")``)."""
    cfg = replace(config or AdvantageConfig(), **overrides)
    return get_advantage_estimator(estimator)(steps, cfg)


# ----------------------------------------------------------------------------- pieces
def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}``, ``G_n = 0`` (GiGPO Eq. 5), for one episode's
    rewards in step order."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def group_normalise(values: Sequence[float], norm: str = "mean_std", eps: float = 1e-6) -> list[float]:
    """Normalise one group: ``x - mean`` or ``(x - mean) / (std + eps)`` with the unbiased
    std.  A group of size 1 or of exactly equal values gives zeros (never NaN)."""
    n = len(values)
    if n == 0:
        return []
    if n == 1 or max(values) == min(values):
        return [0.0] * n
    mean = math.fsum(values) / n
    centred = [v - mean for v in values]
    if norm == "mean":
        return centred
    if norm != "mean_std":
        raise ValueError(f"norm must be 'mean_std' or 'mean', got {norm!r}")
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


def _check(steps: Sequence[StepSample]) -> dict[Hashable, list[int]]:
    """Validate the batch; return episode uid -> row indices in step order."""
    if len(steps) == 0:
        raise ValueError("no steps")
    rows: dict[Hashable, list[int]] = defaultdict(list)
    for i, s in enumerate(steps):
        if not (math.isfinite(s.reward) and math.isfinite(s.episode_reward) and math.isfinite(s.penalty)):
            raise ValueError(f"non-finite reward in step {i}: {s}")
        rows[s.episode].append(i)
    for ep, idx in rows.items():
        idx.sort(key=lambda i: steps[i].step)
        if [steps[i].step for i in idx] != list(range(len(idx))):
            raise ValueError(f"episode {ep!r}: step indices must be exactly 0..n-1, got "
                             f"{sorted(steps[i].step for i in idx)}")
        first = steps[idx[0]]
        for i in idx[1:]:
            if steps[i].group != first.group:
                raise ValueError(f"episode {ep!r} has steps in groups {first.group!r} and {steps[i].group!r}")
            if steps[i].episode_reward != first.episode_reward:
                raise ValueError(f"episode {ep!r}: episode_reward differs between its steps")
    return rows


def episode_relative_advantages(steps: Sequence[StepSample], rows: dict[Hashable, list[int]],
                                cfg: AdvantageConfig) -> tuple[list[float], dict[str, float]]:
    """GiGPO Eq. 3 / GRPO: each episode's return normalised within its task group (the G
    rollouts of one task), given to every step of the episode; returns ``(A_E, stats)``."""
    n = len(steps)
    adv = [0.0] * n
    by_group: dict[Hashable, list[Hashable]] = defaultdict(list)
    for ep, idx in rows.items():
        by_group[steps[idx[0]].group].append(ep)
    singletons = 0
    value = _episode_values(steps, rows, cfg)
    for eps_in_group in by_group.values():
        if cfg.episode_stats == "episode":
            units = [rows[ep] for ep in eps_in_group]
            values = [value[rows[ep][0]] - _own_penalty(steps, rows[ep][0], cfg) for ep in eps_in_group]
        else:  # one unit per step record (verl-agent compute_mean_std_cross_steps)
            units = [[i] for ep in eps_in_group for i in rows[ep]]
            values = [value[i] for ep in eps_in_group for i in rows[ep]]
        if len(values) == 1:
            singletons += 1
            if cfg.singleton_episode == "raw":
                normed = [values[0] if cfg.norm == "mean" else values[0] / (1.0 + cfg.eps)]
            else:
                normed = [0.0]
            scale = 1.0 if cfg.norm == "mean" else 1.0 + cfg.eps
        else:
            normed = group_normalise(values, cfg.norm, cfg.eps)
            scale = _group_scale(values, cfg)
        for idx, a in zip(units, normed):
            for i in idx:
                # a row's own penalty shifts its own value only ("step" placement)
                adv[i] = a + _own_penalty(steps, i, cfg) / scale if cfg.episode_stats == "episode" else a
    stats = {
        "episode_groups": float(len(by_group)),
        "episode_group_size_mean": len(rows) / len(by_group),
        "episode_singleton_groups": float(singletons),
    }
    return adv, stats


def _own_penalty(steps, i: int, cfg: AdvantageConfig) -> float:
    return steps[i].penalty if cfg.penalty_placement == "step" else 0.0


def _episode_values(steps, rows, cfg: AdvantageConfig) -> list[float]:
    """Per row, the episode value it carries: ``R`` plus its own penalty ("step"
    placement, verl-agent) or plus all the episode's penalties ("return")."""
    out = [0.0] * len(steps)
    for idx in rows.values():
        total = math.fsum(steps[i].penalty for i in idx)
        for i in idx:
            out[i] = steps[i].episode_reward + (steps[i].penalty if cfg.penalty_placement == "step" else total)
    return out


def _group_scale(values: Sequence[float], cfg: AdvantageConfig) -> float:
    """The divisor :func:`group_normalise` used for a group of >= 2 values."""
    if cfg.norm == "mean" or max(values) == min(values):
        return 1.0
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1)) + cfg.eps


def _as_tensor(x: Sequence[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(list(x), dtype=dtype)


# ----------------------------------------------------------------------------- estimators
@register_advantage("gigpo")
def gigpo_advantages(steps: Sequence[StepSample], config: AdvantageConfig | None = None) -> AdvantageOutput:
    """GiGPO: ``A = A_E + omega * A_S`` (Feng et al. 2025, Eqs. 3-8; module docstring), in
    the four named steps below, one per equation, as verl-agent's ``core_gigpo.py``."""
    cfg = config or AdvantageConfig()
    rows = _check(steps)
    ep_adv, stats = episode_relative_advantages(steps, rows, cfg)  # Eq. 3
    gid, members = build_step_groups(steps)  # Eq. 6
    step_adv, returns = step_relative_advantages(steps, rows, members, cfg)  # Eqs. 5, 7
    total = combine_advantages(ep_adv, step_adv, cfg.omega)  # Eq. 8

    sizes = [len(m) for m in members]
    stats.update(
        step_groups=float(len(members)),
        step_group_size_mean=sum(sizes) / len(sizes),
        step_singleton_fraction=sum(1 for z in sizes if z == 1) / len(sizes),
        adv_mean=sum(total) / len(total),
        episode_adv_mean=sum(ep_adv) / len(ep_adv),
        step_adv_mean=sum(step_adv) / len(step_adv),
    )
    return AdvantageOutput(
        advantages=_as_tensor(total),
        episode_advantages=_as_tensor(ep_adv),
        step_advantages=_as_tensor(step_adv),
        step_returns=_as_tensor(returns),
        step_groups=torch.tensor(gid, dtype=torch.int64),
        stats=stats,
    )


def build_step_groups(steps: Sequence[StepSample]) -> tuple[list[int], list[list[int]]]:
    """GiGPO Eq. 6: steps of one task group taken from the same anchor observation (across
    rollouts and step indices) form a step group.  Returns each row's group id and each
    group's rows, groups numbered in order of first appearance."""
    key_to_gid: dict[tuple, int] = {}
    members: list[list[int]] = []
    gid = [0] * len(steps)
    for i, s in enumerate(steps):
        k = (s.group, s.anchor)
        if k not in key_to_gid:
            key_to_gid[k] = len(members)
            members.append([])
        gid[i] = key_to_gid[k]
        members[gid[i]].append(i)
    return gid, members


def step_relative_advantages(steps: Sequence[StepSample], rows: dict[Hashable, list[int]],
                             members: Sequence[Sequence[int]], cfg: AdvantageConfig) -> tuple[list[float], list[float]]:
    """GiGPO Eqs. 5 and 7: discounted step returns ``G_t = r_t + gamma G_{t+1}`` within each
    episode (a step's own penalty added after discounting with ``penalty_placement="step"``,
    discounted into earlier steps with ``"return"``), normalised within each step group
    (a singleton group gives 0).  Returns ``(A_S, G)`` per row."""
    returns = [0.0] * len(steps)
    for idx in rows.values():
        if cfg.penalty_placement == "step":  # discount the env rewards, then add each step's own penalty
            rs = [steps[i].reward for i in idx]
            pen = [steps[i].penalty for i in idx]
        else:  # the penalty is part of the reward and is discounted into earlier steps
            rs = [steps[i].reward + steps[i].penalty for i in idx]
            pen = [0.0] * len(idx)
        for i, g, p in zip(idx, discounted_returns(rs, cfg.gamma), pen):
            returns[i] = g + p
    step_adv = [0.0] * len(steps)
    for idx in members:  # singletons -> 0 inside group_normalise
        for i, a in zip(idx, group_normalise([returns[i] for i in idx], cfg.norm, cfg.eps)):
            step_adv[i] = a
    return step_adv, returns


def combine_advantages(episode_adv: Sequence[float], step_adv: Sequence[float], omega: float) -> list[float]:
    """GiGPO Eq. 8: ``A = A_E + omega * A_S``, per row."""
    return [e + omega * a for e, a in zip(episode_adv, step_adv)]


@register_advantage("grpo")
def grpo_advantages(steps: Sequence[StepSample], config: AdvantageConfig | None = None) -> AdvantageOutput:
    """GRPO for multi-step episodes: the episode-level advantage alone, given to every
    step of the episode (``gamma``/``omega`` unused)."""
    cfg = config or AdvantageConfig()
    rows = _check(steps)
    ep_adv, stats = episode_relative_advantages(steps, rows, cfg)
    stats.update(adv_mean=sum(ep_adv) / len(ep_adv), episode_adv_mean=sum(ep_adv) / len(ep_adv))
    a = _as_tensor(ep_adv)
    return AdvantageOutput(advantages=a, episode_advantages=a.clone(),
                           step_advantages=torch.zeros_like(a), stats=stats)


def to_token_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-step advantages ``[N]`` over the step's response tokens:
    ``[N, T]``, zero where ``response_mask`` is 0."""
    if advantages.dim() != 1 or response_mask.dim() != 2 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(f"expected advantages [N] and response_mask [N, T], got "
                         f"{tuple(advantages.shape)} and {tuple(response_mask.shape)}")
    m = response_mask.to(torch.bool)
    a = advantages.to(response_mask.device, torch.float32)[:, None].expand(m.shape)
    return torch.where(m, a, torch.zeros((), dtype=a.dtype, device=a.device))
