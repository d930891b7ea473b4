"""The PPO batch: one row per environment step, with its GiGPO advantage and the
log-probs the update needs as explicit fields (verl's ``old_log_prob`` and
``ref_log_prob``), filled once and then read by every pass over the batch."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from sprpo_lib.core.advantages import AdvantageConfig, StepSample, compute_advantages


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
    #: after a shared prefix of ``prefix_len`` tokens: ``ids`` are the samples' own tokens,
    #: ``att`` ``[B, prefix_len + T]`` covers the prefix too, ``pos`` ``[B, T]`` their positions
    prefix_len: int = 0
    pos: torch.Tensor | None = None

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

    def micro_batch_order(self, size: int, sort: bool = True, max_tokens: int | None = None) -> list[list[Sample]]:
        """The samples in chunks of at most ``size``: longest first when ``sort`` (so that a
        chunk pads its rows to similar lengths: the gradient of a token-weighted sum is the
        same in any grouping), else in batch order; with ``max_tokens``, a chunk also closes
        before its padded positions (rows x longest row) would exceed it (a row longer than
        that runs alone)."""
        order = sorted(self.samples, key=lambda s: -len(s.ids)) if sort else list(self.samples)
        chunks: list[list[Sample]] = []
        for s in order:
            cur = chunks[-1] if chunks else None
            if (cur is None or len(cur) >= size or (max_tokens is not None and
                                                    (len(cur) + 1) * max(len(s.ids), *(len(x.ids) for x in cur)) > max_tokens)):
                chunks.append([s])
            else:
                cur.append(s)
        return chunks

    def padded_tokens(self, size: int, sort: bool = True, max_tokens: int | None = None) -> int:
        """Token positions the forward passes compute over, padding included."""
        return sum(len(c) * max(len(s.ids) for s in c) for c in self.micro_batch_order(size, sort, max_tokens))

    def micro_batches(self, size: int, pad_id: int, device, sort: bool = True,
                      max_tokens: int | None = None) -> list[MicroBatch]:
        """Left-padded :class:`MicroBatch` es (see :meth:`micro_batch_order`)."""
        return [_micro_batch(chunk, 0, pad_id, device) for chunk in self.micro_batch_order(size, sort, max_tokens)]

    def prefix_plan(self, min_prefix: int = 16) -> list[PrefixGroup]:
        """The batch as :class:`PrefixGroup` s (:func:`prefix_groups`)."""
        return prefix_groups(self.samples, min_prefix)

    def computed_tokens(self, size: int, min_prefix: int | None = None,
                        max_tokens: int | None = None) -> dict[str, int]:
        """What a pass computes over this batch: ``tokens`` in the batch, ``computed`` token
        positions (padding included; with ``min_prefix`` each shared prefix once) and the
        ``padding`` among them."""
        tokens = sum(len(s.ids) for s in self.samples)
        if min_prefix is None:
            computed = self.padded_tokens(size, max_tokens=max_tokens)
            return {"tokens": tokens, "computed": computed, "padding": computed - tokens}
        computed = padding = 0
        for g in self.prefix_plan(min_prefix):
            P = len(g.prefix)
            computed += P
            for chunk in padded_chunks(g.samples, size, P, max_tokens=max_tokens):
                T = max(len(s.ids) for s in chunk) - P
                computed += len(chunk) * T
                padding += sum(T - (len(s.ids) - P) for s in chunk)
        return {"tokens": tokens, "computed": computed, "padding": padding}

    def trie_tokens(self) -> int:
        """The fewest token positions any sharing of prefixes computes over this batch: the
        distinct prefixes of the rows' shareable tokens (:func:`shareable`; the nodes of
        their trie) plus each row's own tokens.  :meth:`prefix_plan` shares one prefix per
        row; nested sharing (a template shared by all rows, then a task by its group, then
        a history by its episode) could at best reach this."""
        root: dict = {}
        nodes = own = 0
        for s in self.samples:
            key = shareable(s)
            own += len(s.ids) - len(key)
            node = root
            for t in key:
                if t not in node:
                    node[t] = {}
                    nodes += 1
                node = node[t]
        return nodes + own

    def shared_micro_batches(self, size: int, pad_id: int, device, min_prefix: int = 16,
                             max_tokens: int | None = None) -> list[tuple[torch.Tensor | None, list[MicroBatch]]]:
        """Per :class:`PrefixGroup`: its prefix ids ``[1, P]`` (``None`` for the plain
        group) and the micro-batches of its samples' own tokens (:func:`padded_chunks`),
        left-padded as :meth:`micro_batches` does."""
        out = []
        for g in self.prefix_plan(min_prefix):
            P = len(g.prefix)
            mbs = [_micro_batch(chunk, P, pad_id, device)
                   for chunk in padded_chunks(g.samples, size, P, max_tokens=max_tokens)]
            out.append((torch.tensor([g.prefix], dtype=torch.long, device=device) if P else None, mbs))
        return out


def _micro_batch(chunk: list[Sample], P: int, pad_id: int, device) -> MicroBatch:
    """Tokens ``P:`` of each sample, left-padded to the longest; with a prefix (``P > 0``)
    the mask spans the prefix too and positions continue from ``P`` past the padding."""
    T = max(len(s.ids) for s in chunk) - P
    R = max(s.n_resp for s in chunk)
    ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(chunk), T), dtype=torch.long)
    mask = torch.zeros((len(chunk), R))
    adv = torch.zeros((len(chunk), R))
    for j, s in enumerate(chunk):
        own = s.ids[P:]
        ids[j, T - len(own):] = torch.tensor(own)
        att[j, T - len(own):] = 1
        mask[j, R - s.n_resp:] = 1.0
        adv[j, R - s.n_resp:] = s.adv
    pos = None
    if P:
        pos = (P + att.cumsum(1) - 1).clamp_min(P).to(device)
        att = torch.cat([torch.ones((len(chunk), P), dtype=torch.long), att], 1)
    return MicroBatch(chunk, ids.to(device), att.to(device), ids[:, T - R:].to(device), mask.to(device),
                      adv.to(device), P, pos)


@dataclass
class PrefixGroup:
    """Samples whose token ids begin with the same ``prefix``: a pass computes the prefix
    once and every sample's remaining tokens against its keys and values (the rows of a
    GiGPO group share the task text, and at identical states the whole prompt).  An
    empty ``prefix`` is a plain set of rows."""

    prefix: list[int]
    samples: list[Sample]

    @property
    def computed_tokens(self) -> int:
        """Token positions a pass over the group computes (padding excluded)."""
        return len(self.prefix) + sum(len(s.ids) - len(self.prefix) for s in self.samples)


def padded_chunks(samples: list[Sample], size: int, skip: int = 0, overhead: int = 32,
                  max_tokens: int | None = None) -> list[list[Sample]]:
    """The samples, longest first, cut into runs of at most ``size`` that minimise the
    token positions computed (:func:`length_runs` of their lengths less ``skip`` leading tokens
    not computed here, e.g. a shared prefix).  Fixed-size chunks pad a short row to a long one
    whenever lengths vary (a prefix group's later steps run from 12 to 750 tokens of their own)."""
    return [[samples[i] for i in run]
            for run in length_runs([len(s.ids) - skip for s in samples], size, overhead, max_tokens)]


def length_runs(lengths: Sequence[int], size: int, overhead: int = 32,
                max_tokens: int | None = None) -> list[list[int]]:
    """Indices of ``lengths``, longest first, cut into runs of at most ``size`` that minimise
    the token positions computed (each run pads to its longest row) plus ``overhead`` per run
    for the extra forward call: a dynamic programme over the sorted lengths.  ``max_tokens``:
    no run of several rows computes more padded positions than that (activation memory grows
    with them)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = [lengths[i] for i in order]
    best, cut = [0] + [None] * len(order), [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        for k in range(1, min(size, i) + 1):  # the run order[i-k:i], padded to n[i-k]
            if k > 1 and max_tokens is not None and k * n[i - k] > max_tokens:
                break  # longer runs only pad more
            c = best[i - k] + k * n[i - k] + overhead
            if best[i] is None or c < best[i]:
                best[i], cut[i] = c, i - k
    runs, i = [], len(order)
    while i > 0:
        runs.append(order[cut[i]:i])
        i = cut[i]
    return runs[::-1]


def shareable(s: Sample) -> list[int]:
    """The tokens of a sample that may sit in a shared prefix: the prompt without its last
    token, whose hidden state predicts the first response token (every position a loss
    reads stays in the sample's own part)."""
    return s.ids[:max(0, len(s.ids) - s.n_resp - 1)]


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_groups(samples: list[Sample], min_prefix: int = 16, overhead: int = 32) -> list[PrefixGroup]:
    """Partition ``samples`` into :class:`PrefixGroup` s that minimise the tokens computed.

    Samples are sorted by their shareable tokens (:func:`shareable`), so any set sharing a
    prefix is a run of neighbours whose common prefix is the smallest neighbour overlap in
    it; a dynamic programme over the sorted order picks the runs (``overhead`` tokens are
    charged per group for the extra forward call, so a saving smaller than that is not
    worth a group; a prefix shorter than ``min_prefix`` is not shared).  Samples in no
    group form one plain group (prefix ``[]``).  Exact: a causal model computes the same
    function of the tokens either way (Prefix Grouper's observation for GRPO)."""
    order = sorted(samples, key=shareable)
    keys = [shareable(s) for s in order]
    n = len(order)
    lcp = [_lcp(keys[i], keys[i + 1]) for i in range(n - 1)]
    best = [0.0] * (n + 1)  # best[i]: fewest tokens for order[:i]
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (start of the last run, its prefix; 0 = plain row)
    for i in range(1, n + 1):
        best[i], cut[i] = best[i - 1] + len(order[i - 1].ids), (i - 1, 0)
        tokens, p = len(order[i - 1].ids), None
        for j in range(i - 2, -1, -1):  # run order[j:i]
            p = lcp[j] if p is None else min(p, lcp[j])
            if p < min_prefix:
                break
            tokens += len(order[j].ids)
            cost = best[j] + tokens - (i - j - 1) * p + overhead
            if cost < best[i]:
                best[i], cut[i] = cost, (j, p)
    groups, plain, i = [], [], n
    while i > 0:
        j, p = cut[i]
        if p:
            groups.append(PrefixGroup(keys[j][:p], order[j:i]))
        else:
            plain.append(order[i - 1])
        i = j
    groups.reverse()
    if plain:
        groups.append(PrefixGroup([], plain[::-1]))
    return groups


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
