"""The PPO batch: one row per environment step, with its GiGPO advantage and the
log-probs the update needs as explicit fields (verl's ``old_log_prob`` and
``ref_log_prob``), filled once and then read by every pass over the batch."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from sprpo_lib.advantages import AdvantageConfig, StepSample, compute_advantages


@dataclass
class Sample:
    """One step: prompt + response token ids, its advantage, and per response token
    the old log-prob (at theta_k under the update's xi) and the reference log-prob
    (the starting policy, for the KL loss); ``None`` until filled."""

    ids: list[int]
    n_resp: int
    adv: float
    old_logp: torch.Tensor | None = field(default=None, repr=False)
    ref_logp: torch.Tensor | None = field(default=None, repr=False)


@dataclass
class MicroBatch:
    """Left-padded tensors of a few samples: ``ids``/``att`` ``[B, T]``; ``tgt``,
    ``mask``, ``adv`` ``[B, R]`` over the last R positions (the responses)."""

    samples: list[Sample]
    ids: torch.Tensor
    att: torch.Tensor
    tgt: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor

    def field(self, name: str) -> torch.Tensor | None:
        """``old_logp`` / ``ref_logp`` of the samples as ``[B, R]`` (None if any is unfilled)."""
        vals = [getattr(s, name) for s in self.samples]
        if any(v is None for v in vals):
            return None
        out = torch.zeros(self.mask.shape, dtype=torch.float32, device=self.mask.device)
        R = out.shape[1]
        for j, v in enumerate(vals):
            out[j, R - v.numel():] = v.to(out.device)
        return out

    def store(self, name: str, values: torch.Tensor) -> None:
        """Write ``[B, R]`` log-probs back to the samples' ``name`` field."""
        R = values.shape[1]
        for j, s in enumerate(self.samples):
            setattr(s, name, values[j, R - s.n_resp:].detach().float().cpu().clone())


@dataclass
class Batch:
    samples: list[Sample]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_resp for s in self.samples)

    def mini_batches(self, size: int | None) -> list["Batch"]:
        """Consecutive chunks of ``size`` samples (``None``: the whole batch); the
        chunks share the samples, so filled fields are seen by all."""
        if size is None or size >= len(self.samples):
            return [self]
        return [Batch(self.samples[i:i + size]) for i in range(0, len(self.samples), size)]

    def without_old(self) -> "Batch":
        """The same steps with the old log-probs unfilled (a pass under another xi)."""
        return Batch([replace(s, old_logp=None) for s in self.samples])

    def micro_batch_order(self, size: int, sort: bool = True) -> list[list[Sample]]:
        """The samples in chunks of ``size``: longest first when ``sort`` (so that a chunk
        pads its rows to similar lengths: the gradient of a token-weighted sum is the
        same in any grouping), else in batch order."""
        order = sorted(self.samples, key=lambda s: -len(s.ids)) if sort else list(self.samples)
        return [order[i:i + size] for i in range(0, len(order), size)]

    def padded_tokens(self, size: int, sort: bool = True) -> int:
        """Token positions the forward passes compute over, padding included."""
        return sum(len(c) * max(len(s.ids) for s in c) for c in self.micro_batch_order(size, sort))

    def micro_batches(self, size: int, pad_id: int, device, sort: bool = True) -> list[MicroBatch]:
        """Left-padded :class:`MicroBatch` es of ``size`` samples (see :meth:`micro_batch_order`)."""
        out = []
        for chunk in self.micro_batch_order(size, sort):
            T = max(len(s.ids) for s in chunk)
            R = max(s.n_resp for s in chunk)
            ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
            att = torch.zeros((len(chunk), T), dtype=torch.long)
            mask = torch.zeros((len(chunk), R))
            adv = torch.zeros((len(chunk), R))
            for j, s in enumerate(chunk):
                ids[j, T - len(s.ids):] = torch.tensor(s.ids)
                att[j, T - len(s.ids):] = 1
                mask[j, R - s.n_resp:] = 1.0
                adv[j, R - s.n_resp:] = s.adv
            out.append(MicroBatch(chunk, ids.to(device), att.to(device), ids[:, T - R:].to(device),
                                  mask.to(device), adv.to(device)))
        return out


def build_batch(episodes, adv_cfg: AdvantageConfig, estimator: str = "gigpo") -> tuple[Batch, dict]:
    """Step samples of all episodes with their advantages (Alg. 1 line 5).  A step's
    anchor is the raw observation it acted on; its reward the environment's, its
    penalty the format penalty (placed per ``adv_cfg.penalty_placement``)."""
    steps, rows = [], []
    for e in episodes:
        score = sum(s.env_reward for s in e.steps)
        for s in e.steps:
            steps.append(StepSample((e.group, e.rollout), e.group, s.step, s.observation, s.env_reward, score,
                                    s.penalty))
            rows.append(s)
    if not steps:
        return Batch([]), {}
    out = compute_advantages(steps, estimator, adv_cfg)
    samples = [Sample(s.prompt_ids + s.response_ids, len(s.response_ids), float(a))
               for s, a in zip(rows, out.advantages.tolist()) if s.response_ids]
    return Batch(samples), {f"adv_{k}": v for k, v in out.stats.items()}
