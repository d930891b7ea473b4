"""The divergence of a policy under a deployment perturbation, per agent state, without
playing an episode: the noise-light measure of robustness that the paper's theory names
(alpha = sup_s D_TV(pi(.|s), pi^xi(.|s)), Lemma 1 with pi' = pi^xi).

* A **state pool**: agent prompts exactly as the agent saw them, from held-out episodes of
  one reference policy, split labels kept (ALFWorld's ID and OOD apart), drawn once, seeded,
  stored with its content hash and verified on every read (like the calibration pool).
* At each state, K responses sampled from the clean policy at the evaluation temperature; along
  each, the exact per-token KLs of the clean and perturbed next-token distributions add up to an
  unbiased estimate of KL(pi(.|s) || pi^xi(.|s)) (:mod:`sprpo_lib.core.divergence`); Pinsker
  bounds D_TV; and the greedy action's **flip** (the action the environment would execute
  changes).  States go through in batches (left-padded, by prompt length): one prefill per
  batch and setting, its KV cache shared by each state's K responses.  The clean side (samples, log-probs, greedy action) is computed once per state and
  shared by every setting.
* Random families (Gaussian, dropout) use the same M seeded draws for every policy (common random
  numbers: xi depends only on the draw's seed and the model's FFN shape); deterministic ones
  (Fisher, SparseGPT, RTN) the same calibration pool as the success cells.
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch

from sprpo_lib.agent.engines.base import eos_ids
from sprpo_lib.agent.envs import make_pool
from sprpo_lib.agent.prompt import extract_action
from sprpo_lib.core.batch import length_runs
from sprpo_lib.core.compress import is_identity, perturbation
from sprpo_lib.core.divergence import pinsker, sequence_kl, tempered_logprobs
from sprpo_lib.evaluate.calibration import load_calibration, sampled_steps
from sprpo_lib.evaluate.cells import CALIBRATED_FAMILIES, EVAL_SPLITS, SPLIT_LABELS, select_tasks
from sprpo_lib.evaluate.sweep import EvalConfig, ModelSource, perturbation_kwargs
from sprpo_lib.infra.io import CorruptFileError, atomic_write_json, canonical_hash, key_fields, read_cached, read_json
from sprpo_lib.infra.hardware import compute_class
from sprpo_lib.infra.manifest import git_commit
from sprpo_lib.infra.paths import project_path
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.model.layers import float32_logits, native_gqa

STATES_FORMAT = "sprpo-states"
#: Changes whenever what a divergence cell computes changes (its cache key holds it).
DIVERGENCE_VERSION = 3
#: A batch's own cost beyond its prompt tokens (its teacher-forced pass and greedy decoding), in
#: prompt tokens: :func:`batches` pays it to pad less.
BATCH_OVERHEAD = 256
#: Per-state columns of :func:`divergence`'s rows, before ``cfg.tags``.
DIVERGENCE_COLUMNS = ("env", "state", "split", "split_label", "task_index", "step", "prompt_tokens", "family",
                      "strength", "seed", "kl", "kl_se", "log_ratio", "tv_bound", "tokens", "flip", "cell_seconds",
                      "model", "adapters", "model_hash", "adapter_hash", "cell")


# ============================================================================ the state pool
@dataclass
class StatePool:
    """Agent states: ``prompts`` (token ids of the templated prompt), ``origin`` (split, task
    index, step of each), their content hash and where they came from."""

    prompts: list[list[int]]
    origin: list[list]
    hash: str
    source: dict

    def __len__(self) -> int:
        return len(self.prompts)


def states_hash(prompts: Sequence[Sequence[int]], origin: Sequence[Sequence]) -> str:
    return canonical_hash({"prompts": [[int(t) for t in p] for p in prompts], "origin": [list(o) for o in origin]})


def build_state_pool(policy, pool, agent, *, splits: Sequence[str], per_split: int, per_episode: int = 2,
                     temperature: float = 0.4, max_new_tokens: int = 64, batch_size: int = 16,
                     max_steps: int | None = None, seed: int = 0, engine: str = "hf", progress: bool = True,
                     source: Mapping | None = None) -> StatePool:
    """``per_split`` states of each held-out split from ``policy``'s own episodes (the reference
    policy: the warm start), at most ``per_episode`` seeded steps of an episode, in split order."""
    prompts, origin = [], []
    for split in splits:
        for step in sampled_steps(policy, pool, agent, n=per_split, split=split, per_episode=per_episode,
                                  temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                  max_steps=max_steps, seed=seed, engine=engine, progress=progress):
            prompts.append([int(t) for t in step.prompt_ids])
            origin.append([step.split, step.task_index, step.step])
    src = {"env": pool.name, "data": pool.data_source, "splits": list(splits), "per_split": per_split,
           "per_episode": per_episode, "seed": seed, "temperature": temperature, "max_new_tokens": max_new_tokens,
           "max_steps": max_steps, "engine": engine, **dict(source or {})}
    return StatePool(prompts, origin, states_hash(prompts, origin), src)


def save_states(path: str | Path, states: StatePool) -> Path:
    """Write a state pool as JSON (atomic; never pickle)."""
    return atomic_write_json(path, {"format": STATES_FORMAT, "version": 1, "hash": states.hash, "n": len(states),
                                    "source": states.source, "prompts": states.prompts, "origin": states.origin})


def _states_problem(data) -> str | None:
    if not isinstance(data, dict) or data.get("format") != STATES_FORMAT:
        return f"not a state pool (format {STATES_FORMAT!r} expected)"
    prompts, origin = data.get("prompts"), data.get("origin")
    if (not isinstance(prompts, list) or not prompts or not isinstance(origin, list) or len(origin) != len(prompts)
            or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
        return "expected non-empty lists of prompt token ids and of their origins, as long as each other"
    if states_hash(prompts, origin) != data.get("hash"):
        return "its states do not match the recorded hash (edited or corrupted)"
    return None


def load_states(path: str | Path) -> StatePool:
    """A state pool written by :func:`save_states`, verified against its hash
    (:class:`~sprpo_lib.infra.io.CorruptFileError` otherwise: rebuild it, never serve it)."""
    p = Path(path)
    try:
        data = read_json(p, _states_problem)
    except CorruptFileError as err:
        raise err.with_fix(f"delete {p} and rerun: the pool is drawn again from the same seed") from None
    return StatePool(data["prompts"], data["origin"], data["hash"], data.get("source", {}))


def state_pool(reference: EvalConfig, per_split: int, *, per_episode: int = 2, seed: int = 0,
               progress: bool = True) -> tuple[StatePool, Path]:
    """The state pool that ``reference``'s policy (the warm start in the paper's plan) visits on
    its held-out splits (``reference.splits``, else App. C's), ``per_split`` states each:
    built once, stored under ``<cache_dir>/states/`` named by the content of what it depends on
    (the policy's weights, the task data, the prompt format, the sampling), read back verified; a
    damaged file is rebuilt from the same seed, never served."""
    store = project_path(reference.cache_dir)
    source = ModelSource(reference, store / "file_hashes.json")
    pool = make_pool(reference.env, reference.data_dir, reference.env_seed)
    splits = list(reference.splits or EVAL_SPLITS[reference.env])
    select_tasks(pool, reference.env, splits, None)  # one clear error for a split the pool lacks
    key = canonical_hash({"model": source.identity(), "env": reference.env, "data": pool.data_source,
                          "env_seed": reference.env_seed, "splits": splits, "per_split": per_split,
                          "per_episode": per_episode, "seed": seed, "temperature": reference.temperature,
                          "max_new_tokens": reference.max_new_tokens, "max_steps": reference.max_steps,
                          "engine": reference.engine, "agent": key_fields(reference.agent)})
    path = store / "states" / f"{reference.env}-{key[:16]}.json"
    states = read_cached(path, load_states)
    if states is None:
        states = build_state_pool(source.policy(), pool, reference.agent, splits=splits, per_split=per_split,
                                  per_episode=per_episode, temperature=reference.temperature,
                                  max_new_tokens=reference.max_new_tokens, batch_size=reference.batch_size,
                                  max_steps=reference.max_steps, seed=seed, engine=reference.engine,
                                  progress=progress, source={"model": reference.model,
                                                             "adapters": list(reference.adapters)})
        save_states(path, states)
    return states, path


# ============================================================================ a batch of states
@dataclass
class Prefilled:
    """Prompts prefilled together (left-padded): each row's next-token ``logits`` ``[R, V]``,
    the KV ``cache``, the attention mask ``att`` ``[R, W]`` and each row's next position
    ``pos`` ``[R]``; every continuation (:func:`fork`) starts from here."""

    logits: torch.Tensor
    cache: object
    att: torch.Tensor
    pos: torch.Tensor

    def __len__(self) -> int:
        return self.att.shape[0]


@torch.no_grad()
def prefill(model, prompts: Sequence[Sequence[int]], pad_id: int = 0) -> Prefilled:
    """One left-padded forward of ``prompts`` (position ids count each row's own tokens),
    keeping only the last position's logits."""
    from transformers import DynamicCache  # heavy (seconds to import): loaded on first use

    dev, width = next(model.parameters()).device, max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), int(pad_id), dtype=torch.long, device=dev)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), device=dev)
        att[i, width - len(p):] = 1
    out = model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp_min(0),
                past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return Prefilled(out.logits[:, -1], out.past_key_values, att, att.sum(-1))


def fork(pre: Prefilled, k: int) -> Prefilled:
    """A copy of ``pre`` with each row repeated ``k`` times in place (row i -> rows i*k .. i*k+k-1)."""
    cache = copy.deepcopy(pre.cache)
    if k > 1:
        cache.batch_repeat_interleave(k)
    rep = (lambda t: t.repeat_interleave(k, 0)) if k > 1 else (lambda t: t)
    return Prefilled(rep(pre.logits), cache, rep(pre.att), rep(pre.pos))


def advance(model, pre: Prefilled, tokens: torch.Tensor) -> torch.Tensor:
    """Feed ``tokens`` ``[R, n]`` after each row (in place: the cache, mask and positions grow);
    the logits ``[R, n, V]`` at the fed positions."""
    n = tokens.shape[1]
    pre.att = torch.cat([pre.att, pre.att.new_ones(len(pre), n)], 1)
    where = pre.pos[:, None] + torch.arange(n, device=pre.pos.device)
    logits = model(input_ids=tokens, attention_mask=pre.att, position_ids=where, past_key_values=pre.cache,
                   use_cache=True).logits
    pre.pos = pre.pos + n
    return logits


@torch.no_grad()
def extend(model, pre: Prefilled, tokens: Sequence[Sequence[int]]) -> None:
    """Feed each row of ``pre`` its own ``tokens`` (in place; lengths may differ, even 0): one
    forward, each row's tokens right-aligned in the chunk, the gap before them masked, position
    ids counting the row's own tokens.  ``pre.logits`` is left as it was."""
    n = max(len(t) for t in tokens)
    if n == 0:
        return
    dev = pre.att.device
    ids = torch.zeros(len(pre), n, dtype=torch.long, device=dev)
    fed = torch.zeros_like(ids)
    for i, t in enumerate(tokens):
        if len(t):
            ids[i, n - len(t):] = torch.as_tensor(list(t), device=dev)
            fed[i, n - len(t):] = 1
    pre.att = torch.cat([pre.att, fed], 1)
    where = pre.pos[:, None] + (fed.cumsum(1) - 1).clamp_min(0)
    model(input_ids=ids, attention_mask=pre.att, position_ids=where, past_key_values=pre.cache, use_cache=True,
          logits_to_keep=1)
    pre.pos = pre.pos + fed.sum(1)


class Stop:
    """Whether a response has ended: its last token is an end-of-sequence id, or its text holds
    ``stop`` (the token that completes it is kept)."""

    def __init__(self, tokenizer=None, stop: str | None = None, eos: Sequence[int] = ()):
        self.tokenizer, self.stop, self.eos = tokenizer, stop, set(int(e) for e in eos)

    def __call__(self, tokens: list[int]) -> bool:
        if tokens[-1] in self.eos:
            return True
        return bool(self.stop) and self.tokenizer is not None and self.stop in self.tokenizer.decode(
            tokens, skip_special_tokens=False)


@torch.no_grad()
def decode(model, pre: Prefilled, pick, max_new_tokens: int, ended: Stop,
           prefix: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue every row of ``pre`` (consumed) with ``pick(logits, rows) -> tokens``, where
    ``rows`` are the indices of the rows still going, until each has ended or its response holds
    ``max_new_tokens``: the new tokens ``[R, T]`` and mask ``[R, T]`` (1 up to and including a row's
    last token).  ``prefix``: the tokens each row's response already holds (fed into ``pre``), which
    count toward the limit and toward ``ended``.  Finished rows leave the batch and the cache."""
    r = len(pre)
    rows = [[int(t) for t in p] for p in prefix] if prefix is not None else [[] for _ in range(r)]
    steps = max(1, max_new_tokens - min(len(x) for x in rows))
    tokens = torch.zeros(r, steps, dtype=torch.long)
    mask = torch.zeros(r, steps, dtype=torch.bool)
    alive, logits = list(range(r)), pre.logits
    for t in range(steps):
        nxt = pick(logits, alive).cpu()
        keep = []
        for j, (i, tok) in enumerate(zip(alive, nxt.tolist())):
            tokens[i, t], mask[i, t] = tok, True
            rows[i].append(tok)
            if not ended(rows[i]) and len(rows[i]) < max_new_tokens:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(alive):
            idx = torch.tensor(keep, device=pre.att.device)
            pre.cache.batch_select_indices(idx)
            pre.att, pre.pos, nxt = pre.att[idx], pre.pos[idx], nxt[keep]
            alive = [alive[j] for j in keep]
        logits = advance(model, pre, nxt[:, None].to(pre.att.device))[:, -1]
    width = int(mask.sum(1).max())
    return tokens[:, :width], mask[:, :width]


def sample_responses(model, pre: Prefilled, k: int, temperature: float, max_new_tokens: int, *,
                     generators: Sequence[torch.Generator], ended: Stop) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` responses per prompt of ``pre`` drawn at ``temperature`` from one prefill (rows
    ``i*k .. i*k+k-1`` belong to prompt i): tokens ``[R*k, T]``, mask ``[R*k, T]``.  Prompt i's
    draws come from ``generators[i]`` alone, for its live rows in order, so a prompt gets the same
    responses whichever prompts share its batch (up to rounding of the logits)."""
    if len(generators) != len(pre):
        raise ValueError(f"{len(generators)} generators for {len(pre)} prompts; expected one per prompt")

    def pick(logits, rows):
        p = tempered_logprobs(logits, temperature).exp().cpu()
        out = torch.empty(len(rows), dtype=torch.long)
        for i in sorted({r // k for r in rows}):
            at = [j for j, r in enumerate(rows) if r // k == i]
            out[at] = torch.multinomial(p[at], 1, generator=generators[i])[:, 0]
        return out

    return decode(model, fork(pre, k), pick, max_new_tokens, ended)


@torch.no_grad()
def response_logits(model, pre: Prefilled, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced next-token logits ``[R*k, T, V]`` (the model's dtype) at each position of
    ``tokens`` ``[R*k, T]`` (``k`` responses per prompt of ``pre``, grouped as
    :func:`sample_responses` returns them)."""
    k = tokens.shape[0] // len(pre)
    if k * len(pre) != tokens.shape[0]:
        raise ValueError(f"{tokens.shape[0]} responses for {len(pre)} prompts; expected a multiple")
    forked = fork(pre, k)
    logits = forked.logits[:, None]
    if tokens.shape[1] > 1:
        logits = torch.cat([logits, advance(model, forked, tokens[:, :-1].to(pre.att.device))], 1)
    return logits


def response_logprobs(model, pre: Prefilled, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """:func:`response_logits` as log-probabilities at ``temperature`` (float32, float64 stays)."""
    return tempered_logprobs(response_logits(model, pre, tokens), temperature)


def greedy(model, pre: Prefilled, max_new_tokens: int, ended: Stop) -> tuple[list[torch.Tensor], list[str | None]]:
    """Each prompt's greedy response (its tokens) and the action the environment would execute from it."""
    tokens, mask = decode(model, fork(pre, 1), lambda logits, rows: logits.argmax(-1), max_new_tokens, ended)
    return _actions([t[m] for t, m in zip(tokens, mask)], ended)


def greedy_after(model, pre: Prefilled, prefixes: Sequence[Sequence[int]], logits: torch.Tensor,
                 max_new_tokens: int, ended: Stop) -> tuple[list[torch.Tensor], list[str | None]]:
    """:func:`greedy` for responses known to begin with ``prefixes`` (one per row of ``pre``,
    consumed), ``logits`` ``[R, V]`` the next-token logits after each: the prefixes go in with one
    forward (:func:`extend`) and decoding starts where they end, not at the prompt."""
    extend(model, pre, prefixes)
    pre.logits = logits
    tokens, mask = decode(model, pre, lambda lg, rows: lg.argmax(-1), max_new_tokens, ended, prefix=prefixes)
    return _actions([torch.cat([torch.as_tensor(list(p), dtype=torch.long), t[m]]) for p, t, m
                     in zip(prefixes, tokens, mask)], ended)


def _actions(responses: list[torch.Tensor], ended: Stop) -> tuple[list[torch.Tensor], list[str | None]]:
    return responses, [extract_action(ended.tokenizer.decode(r.tolist(), skip_special_tokens=True)).action
                       for r in responses]


def subset(pre: Prefilled, rows: Sequence[int]) -> Prefilled:
    """A copy of ``pre`` holding only ``rows``."""
    cache = copy.deepcopy(pre.cache)
    idx = torch.tensor(list(rows), device=pre.att.device)
    cache.batch_select_indices(idx)
    return Prefilled(pre.logits[idx], cache, pre.att[idx], pre.pos[idx])


@dataclass
class CleanSide:
    """What every setting at one state compares with: the K sampled responses ``[K, T]`` and
    their mask, the clean policy's log-probabilities ``[K, T, V]`` along them, its greedy
    response and the action from it (``None`` without flips)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    logp: torch.Tensor
    action: str | None
    greedy: torch.Tensor | None = None


def _per_prompt(tokens: torch.Tensor, mask: torch.Tensor, k: int):
    """Split ``[R*k, T]`` rows into each prompt's ``k`` rows, trimmed to its own longest response."""
    for i in range(tokens.shape[0] // k):
        m = mask[i * k:(i + 1) * k]
        t = max(int(m.sum(1).max()), 1)
        yield slice(i * k, (i + 1) * k), t


@torch.no_grad()
def clean_sides(model, prompts: Sequence[Sequence[int]], *, k: int, temperature: float, max_new_tokens: int,
                seeds: Sequence[int], ended: Stop, pad_id: int = 0, flips: bool = True) -> list[CleanSide]:
    """For each prompt, ``k`` responses (drawn from a generator seeded by its ``seeds`` entry)
    scored by the clean policy, and its greedy response and action: all from one batched prefill."""
    pre = prefill(model, prompts, pad_id)
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    tokens, mask = sample_responses(model, pre, k, temperature, max_new_tokens, generators=gens, ended=ended)
    logp = response_logprobs(model, pre, tokens, temperature)
    responses, actions = greedy(model, pre, max_new_tokens, ended) if flips else ([None] * len(prompts),) * 2
    return [CleanSide(tokens[rows, :t], mask[rows, :t], logp[rows, :t].clone(), a, g)
            for (rows, t), a, g in zip(_per_prompt(tokens, mask, k), actions, responses)]


@torch.no_grad()
def compare(model, prompts: Sequence[Sequence[int]], cleans: Sequence[CleanSide], *, temperature: float,
            max_new_tokens: int, ended: Stop, pad_id: int = 0) -> list[dict]:
    """Each prompt under the perturbation in force on ``model``, from one batched prefill: ``kl``
    (mean of the K per-response estimates), ``kl_se``, ``log_ratio`` (the plain estimator, for
    comparison), ``tv_bound`` (Pinsker), ``tokens`` (mean response length) and, where the clean
    side has its greedy action, ``flip``.

    The clean greedy response rides along the teacher-forced pass: where the perturbed policy's
    argmax agrees with it at every position, its greedy response is the same and nothing flips.
    Elsewhere the perturbed greedy response shares the clean one's tokens up to the first
    disagreement and takes the perturbed argmax there: decoding goes on from that token
    (:func:`greedy_after`), not from the prompt."""
    k = cleans[0].tokens.shape[0]
    flips = all(c.greedy is not None for c in cleans)
    per = k + flips  # rows per state: its K responses, then its clean greedy response
    width = max([c.tokens.shape[1] for c in cleans] + [len(c.greedy) for c in cleans if flips])
    tokens = torch.zeros(len(cleans) * per, width, dtype=torch.long)
    for i, c in enumerate(cleans):
        tokens[i * per:i * per + k, :c.tokens.shape[1]] = c.tokens
        if flips:
            tokens[i * per + k, :len(c.greedy)] = c.greedy
    pre = prefill(model, prompts, pad_id)
    logits = response_logits(model, pre, tokens)
    out = []
    for i, c in enumerate(cleans):  # log-probabilities only where a response has tokens
        t = c.tokens.shape[1]
        est = sequence_kl(c.logp, tempered_logprobs(logits[i * per:i * per + k, :t], temperature), c.tokens, c.mask)
        kl = est["kl"].double()
        out.append({"kl": float(kl.mean()), "kl_se": float(kl.std() / k ** 0.5) if k > 1 else float("nan"),
                    "log_ratio": float(est["log_ratio"].double().mean()), "tv_bound": pinsker(float(kl.mean())),
                    "tokens": float(c.mask.sum(1).double().mean())})
    if flips:
        first = {}  # state -> the first position where the perturbed argmax leaves the clean greedy response
        for i, c in enumerate(cleans):
            left = (logits[i * per + k, :len(c.greedy)].argmax(-1).cpu() != c.greedy).nonzero()
            if len(left):
                first[i] = int(left[0])
        moved = list(first)
        actions = greedy_after(model, subset(pre, moved), [cleans[i].greedy[:first[i]].tolist() for i in moved],
                               torch.stack([logits[i * per + k, first[i]] for i in moved]), max_new_tokens,
                               ended)[1] if moved else []
        for i, c in enumerate(cleans):
            out[i]["flip"] = False
        for i, a in zip(moved, actions):
            out[i]["flip"] = a != cleans[i].action
    return out


def unmoved(cleans: Sequence[CleanSide]) -> list[dict]:
    """:func:`compare`'s rows where the setting changes nothing (:func:`~sprpo_lib.core.compress.is_identity`),
    exactly, without a pass: no KL, no flip."""
    return [{"kl": 0.0, "kl_se": 0.0 if c.tokens.shape[0] > 1 else float("nan"), "log_ratio": 0.0, "tv_bound": 0.0,
             "tokens": float(c.mask.sum(1).double().mean()), **({"flip": False} if c.greedy is not None else {})}
            for c in cleans]


def batches(prompts: Sequence[Sequence[int]], size: int, max_tokens: int | None = None) -> list[list[int]]:
    """State indices in batches of at most ``size``, longest prompt first (little padding).
    Without ``max_tokens``, fixed-size runs of the sorted states; with it, the cut that
    computes the fewest padded prompt tokens plus :data:`BATCH_OVERHEAD` per batch, no batch of
    several states over ``max_tokens`` padded tokens (:func:`~sprpo_lib.core.batch.length_runs`)."""
    if max_tokens is None:
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        return [order[s:s + size] for s in range(0, len(order), size)]
    return length_runs([len(p) for p in prompts], size, BATCH_OVERHEAD, max_tokens)


def draw_seeds(m: int, seed: int = 0) -> list[int]:
    """The M draws of a random family, the same for every policy (common random numbers)."""
    rng = random.Random(f"divergence-draws/{seed}")
    return [rng.randrange(2**31) for _ in range(m)]


# ============================================================================ a policy over the pool
def pool_clean_sides(model, states: StatePool, groups: Sequence[Sequence[int]], cfg: EvalConfig, samples: int,
                     ended: Stop, pad: int) -> list[CleanSide]:
    """:func:`clean_sides` of every state of the pool, batch by batch (``groups``), each state's
    responses from its own seed (a hash of the pool and its index: the same for every policy)."""
    clean: list = [None] * len(states)
    with native_gqa(model, False, cfg.attention), float32_logits(model, cfg.logits == "float32"):
        for group in groups:
            sides = clean_sides(model, [states.prompts[i] for i in group], k=samples, temperature=cfg.temperature,
                                max_new_tokens=cfg.max_new_tokens, ended=ended, pad_id=pad,
                                seeds=[int(canonical_hash([states.hash, i])[:8], 16) for i in group])
            for i, side in zip(group, sides):
                clean[i] = side
    return clean


def _cell_problem(key: str):
    def check(data) -> str | None:
        if not isinstance(data, dict) or data.get("key") != key:
            return "not this divergence cell"
        rows = data.get("rows")
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("kl"), float) for r in rows):
            return "expected a list of rows with a float 'kl'"
        return None
    return check


def divergence(cfg: EvalConfig, states: StatePool, *, samples: int = 4, progress: bool = True,
               shared: dict | None = None) -> pd.DataFrame:
    """Per state and setting of ``cfg`` (its family, strengths and seeds: the M draws of a random
    family), how far the perturbation moves ``cfg``'s policy on ``states``: one row each
    (:data:`DIVERGENCE_COLUMNS`).  Each setting over the pool is a cell, content-keyed by the model,
    the pool, the setting, K = ``samples``, the temperature and the response limit, stored under
    ``<cache_dir>/divergence/`` and verified when read (a damaged cell is recomputed).  States go
    through in batches (``cfg.batch_size`` states, ``cfg.batch_tokens`` padded prompt tokens) with
    ``cfg.attention``'s kernel (speed levers: the same rows up to rounding, not in the key), the
    logits in ``cfg.logits``'s dtype (in the key).  A cell
    records its ``seconds`` (the setting's pass) and ``clean_seconds`` (the clean side, where it was
    computed with this cell); rows carry ``cell_seconds``.  Calls on the same policy and pool
    that pass one ``shared`` dict (one per policy) load the policy and draw the clean side once."""
    cfg.validate()
    if samples < 1:
        raise ValueError(f"--samples: {samples}; expected at least 1 sampled response per state")
    store = project_path(cfg.cache_dir)
    shared = {} if shared is None else shared
    source = ModelSource(cfg, store / "file_hashes.json")
    ident = source.identity()
    clean_key = canonical_hash({"model": ident, "states": states.hash, "samples": samples, "batch": cfg.batch_size,
                                "batch_tokens": cfg.batch_tokens, "attention": cfg.attention, "logits": cfg.logits,
                                "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                                "stop": cfg.generation(0).stop})
    if shared.get("key") != clean_key:
        shared.clear()
        shared.update(key=clean_key, source=source, clean=None)
    source = shared["source"]
    cells = list(dict.fromkeys(c.canonical() for c in cfg.cells()))
    calib = load_calibration(project_path(cfg.calibration)) if any(c.family in CALIBRATED_FAMILIES for c in cells) else None
    stop = cfg.generation(0).stop
    base = {"evaluator": DIVERGENCE_VERSION, "model": ident, "states": states.hash, "samples": samples,
            "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens, "stop": stop,
            "options": dict(cfg.perturbation_options), "logits": cfg.logits}
    keyed = {c: canonical_hash({**base, "cell": [c.family, c.strength, c.seed],
                                "calibration": calib.hash if c.family in CALIBRATED_FAMILIES else None}) for c in cells}
    paths = {c: store / "divergence" / f"{k[:32]}.json" for c, k in keyed.items()}
    results = {c: read_cached(paths[c], read_json, _cell_problem(keyed[c])) for c in cells}
    clean: list[CleanSide] | None = shared["clean"]
    bar = progress_bar(total=len(cells) * len(states), desc=f"divergence {cfg.env} {cfg.family}", unit="state",
                       disable=not progress, initial=sum(len(states) for c in cells if results[c] is not None))
    groups = batches(states.prompts, cfg.batch_size, cfg.batch_tokens)
    for c in (c for c in cells if results[c] is None):
        t0 = time.perf_counter()
        policy = source.policy()
        model, tok = policy.model.eval(), policy.tokenizer
        ended, pad = Stop(tok, stop, eos_ids(model, tok)), tok.pad_token_id or 0
        clean_s = 0.0
        if clean is None:  # once per state, shared by every setting (the same seeds for every policy)
            clean = pool_clean_sides(model, states, groups, cfg, samples, ended, pad)
            clean_s = time.perf_counter() - t0
            shared["clean"] = clean
        if is_identity(c.family, c.strength, cfg.perturbation_options):  # clean, the plane's origin: nothing moves
            rows = unmoved(clean)
            bar.update(len(states))
        else:
            rows = [None] * len(states)
            kw = perturbation_kwargs(cfg, policy, c.family, c.strength, calib, store, ident, progress)
            with (perturbation(model, c.family, c.strength, c.seed, **kw),  # first: Fisher's scores and
                  native_gqa(model, False, cfg.attention),  # SparseGPT's passes as 04's
                  float32_logits(model, cfg.logits == "float32")):
                for group in groups:
                    got = compare(model, [states.prompts[i] for i in group], [clean[i] for i in group],
                                  temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, ended=ended,
                                  pad_id=pad)
                    for i, row in zip(group, got):
                        rows[i] = row
                    bar.update(len(group))
        seconds = time.perf_counter() - t0 - clean_s
        atomic_write_json(paths[c], {"key": keyed[c], "rows": rows, "seconds": round(seconds, 2), "machine": compute_class(),
                                     "clean_seconds": round(clean_s, 2), "batch": cfg.batch_size,
                                     "batch_tokens": cfg.batch_tokens, "attention": cfg.attention,
                                     "logits": cfg.logits, "commit": git_commit()})
        results[c] = {"rows": rows, "seconds": seconds}
    bar.close()
    out, hashes = [], source.hashes()
    for c in cfg.cells():
        canon = c.canonical()
        for i, r in enumerate(results[canon]["rows"]):
            split, task, step = states.origin[i]
            out.append({"env": cfg.env, "state": i, "split": split, "split_label": SPLIT_LABELS.get(split, split),
                        "task_index": task, "step": step, "prompt_tokens": len(states.prompts[i]),
                        "family": c.family, "strength": c.strength, "seed": c.seed, **r,
                        "cell_seconds": results[canon].get("seconds"), "model": cfg.model, "adapters": ";".join(cfg.adapters),
                        **hashes, "cell": keyed[canon][:12], **cfg.tags})
    return pd.DataFrame(out, columns=[*DIVERGENCE_COLUMNS, *cfg.tags])


def divergence_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per setting: states, mean KL with its standard error over states, the Pinsker bound of
    the mean, the flip rate."""
    g = rows.groupby(["family", "strength", "seed"], sort=False)
    s = g.agg(states=("kl", "size"), kl=("kl", "mean"), kl_se=("kl", "sem"), flip=("flip", "mean"))
    s["tv_bound"] = [pinsker(v) for v in s["kl"]]
    return s
