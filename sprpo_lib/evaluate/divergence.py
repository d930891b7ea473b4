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
  changes).  The prompt is prefilled once per state and setting, its KV cache shared by the K
  responses.  The clean side (samples, log-probs, greedy action) is computed once per state and
  shared by every setting.
* Random families (Gaussian, dropout) use the same M seeded draws for every policy (common random
  numbers: xi depends only on the draw's seed and the model's FFN shape); deterministic ones
  (Fisher, SparseGPT, RTN) the same calibration pool as the success cells.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch

from sprpo_lib.agent.engines.base import eos_ids
from sprpo_lib.agent.envs import make_pool
from sprpo_lib.agent.prompt import extract_action
from sprpo_lib.core.compress import perturbation
from sprpo_lib.core.divergence import pinsker, sequence_kl, tempered_logprobs
from sprpo_lib.evaluate.calibration import load_calibration, sampled_steps
from sprpo_lib.evaluate.cells import CALIBRATED_FAMILIES, EVAL_SPLITS, SPLIT_LABELS, select_tasks
from sprpo_lib.evaluate.sweep import EvalConfig, ModelSource, perturbation_kwargs
from sprpo_lib.infra.io import CorruptFileError, atomic_write_json, canonical_hash, key_fields, read_cached, read_json
from sprpo_lib.infra.paths import project_path
from sprpo_lib.infra.progress import progress_bar

STATES_FORMAT = "sprpo-states"
#: Changes whenever what a divergence cell computes changes (its cache key holds it).
DIVERGENCE_VERSION = 1
#: Per-state columns of :func:`divergence`'s rows, before ``cfg.tags``.
DIVERGENCE_COLUMNS = ("env", "state", "split", "split_label", "task_index", "step", "family", "strength", "seed",
                      "kl", "kl_se", "log_ratio", "tv_bound", "tokens", "flip", "model", "adapters", "cell")


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


# ============================================================================ one state
def prefill(model, prompt: Sequence[int]) -> tuple[torch.Tensor, object]:
    """The prompt's last logits ``[1, V]`` and its KV cache: one prefill that the K responses,
    their teacher-forced pass and the greedy response all continue from (:func:`fork`)."""
    dev = next(model.parameters()).device
    out = model(input_ids=torch.tensor([list(prompt)], device=dev), use_cache=True)
    return out.logits[:, -1], out.past_key_values


def fork(prefilled: tuple[torch.Tensor, object], k: int) -> tuple[torch.Tensor, object]:
    """A copy of a prefilled prompt for ``k`` continuations (its cache repeated ``k`` times)."""
    logits, cache = prefilled
    cache = copy.deepcopy(cache)
    if k > 1:
        cache.batch_repeat_interleave(k)
    return logits.expand(k, -1), cache


def _ended(tokens: list[int], tokenizer, stop: str | None, eos: set[int]) -> bool:
    if tokens[-1] in eos:
        return True
    return bool(stop) and tokenizer is not None and stop in tokenizer.decode(tokens, skip_special_tokens=False)


@torch.no_grad()
def sample_responses(model, prompt: Sequence[int], k: int, temperature: float, max_new_tokens: int, *,
                     generator: torch.Generator, tokenizer=None, stop: str | None = None,
                     eos: Sequence[int] = (), prefilled=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` responses drawn from ``model`` at ``temperature`` (one prefill, a shared cache):
    tokens ``[k, T]`` and mask ``[k, T]`` (a response ends with an end-of-sequence id, or the
    token that completes ``stop``, both kept; later positions are masked)."""
    logits, cache = fork(prefilled or prefill(model, prompt), k)
    eos, alive = set(int(e) for e in eos), [True] * k
    toks, masks, rows = [], [], [[] for _ in range(k)]
    for _ in range(max_new_tokens):
        p = tempered_logprobs(logits, temperature).exp()
        nxt = torch.multinomial(p.cpu(), 1, generator=generator)[:, 0].to(logits.device)
        toks.append(nxt)
        masks.append(torch.tensor(alive, device=logits.device))
        for i, t in enumerate(nxt.tolist()):
            if alive[i]:
                rows[i].append(t)
                alive[i] = not _ended(rows[i], tokenizer, stop, eos)
        if not any(alive):
            break
        logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    return torch.stack(toks, 1), torch.stack(masks, 1)


@torch.no_grad()
def response_logprobs(model, prompt: Sequence[int], tokens: torch.Tensor, temperature: float,
                      prefilled=None) -> torch.Tensor:
    """Teacher-forced ``[K, T, V]`` log-probabilities at each response position."""
    k, t = tokens.shape
    first, cache = fork(prefilled or prefill(model, prompt), k)
    logits = first[:, None]
    if t > 1:
        logits = torch.cat([logits, model(input_ids=tokens[:, :-1], past_key_values=cache, use_cache=True).logits], 1)
    return tempered_logprobs(logits, temperature)


@torch.no_grad()
def greedy_action(model, tokenizer, prompt: Sequence[int], max_new_tokens: int, stop: str | None,
                  eos: Sequence[int], prefilled=None) -> str:
    """The action the environment would execute from the greedy response."""
    logits, cache = fork(prefilled or prefill(model, prompt), 1)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1)
        out.append(int(nxt))
        if _ended(out, tokenizer, stop, set(int(e) for e in eos)):
            break
        logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    return extract_action(tokenizer.decode(out, skip_special_tokens=True)).action


@dataclass
class CleanSide:
    """What every setting at one state compares with: the K sampled responses, the clean
    policy's log-probabilities along them and its greedy action."""

    tokens: torch.Tensor
    mask: torch.Tensor
    logp: torch.Tensor
    action: str | None


@torch.no_grad()
def clean_side(model, prompt: Sequence[int], *, k: int, temperature: float, max_new_tokens: int, seed: int,
               tokenizer=None, stop: str | None = None, eos: Sequence[int] = (), flips: bool = True) -> CleanSide:
    """Sample ``k`` responses (generator seeded by ``seed``) and score them with the clean policy,
    all from one prefill of the prompt."""
    gen = torch.Generator().manual_seed(int(seed))
    pre = prefill(model, prompt)
    tokens, mask = sample_responses(model, prompt, k, temperature, max_new_tokens, generator=gen,
                                    tokenizer=tokenizer, stop=stop, eos=eos, prefilled=pre)
    logp = response_logprobs(model, prompt, tokens, temperature, prefilled=pre)
    action = greedy_action(model, tokenizer, prompt, max_new_tokens, stop, eos, prefilled=pre) if flips else None
    return CleanSide(tokens, mask, logp, action)


@torch.no_grad()
def compare(model, prompt: Sequence[int], clean: CleanSide, *, temperature: float, max_new_tokens: int,
            tokenizer=None, stop: str | None = None, eos: Sequence[int] = ()) -> dict:
    """One state under the perturbation in force on ``model``, from one prefill of the prompt:
    ``kl`` (mean of the K per-response estimates), ``kl_se``, ``log_ratio`` (the plain estimator,
    for comparison), ``tv_bound`` (Pinsker), ``tokens`` (mean response length) and, where the
    clean side has its greedy action, ``flip``."""
    pre = prefill(model, prompt)
    logq = response_logprobs(model, prompt, clean.tokens, temperature, prefilled=pre)
    est = sequence_kl(clean.logp, logq, clean.tokens, clean.mask)
    kl, k = est["kl"].double(), clean.tokens.shape[0]
    row = {"kl": float(kl.mean()), "kl_se": float(kl.std() / k ** 0.5) if k > 1 else float("nan"),
           "log_ratio": float(est["log_ratio"].double().mean()), "tv_bound": pinsker(float(kl.mean())),
           "tokens": float(clean.mask.sum(1).double().mean())}
    if clean.action is not None:
        row["flip"] = greedy_action(model, tokenizer, prompt, max_new_tokens, stop, eos, prefilled=pre) != clean.action
    return row


def draw_seeds(m: int, seed: int = 0) -> list[int]:
    """The M draws of a random family, the same for every policy (common random numbers)."""
    rng = random.Random(f"divergence-draws/{seed}")
    return [rng.randrange(2**31) for _ in range(m)]


# ============================================================================ a policy over the pool
def _cell_problem(key: str):
    def check(data) -> str | None:
        if not isinstance(data, dict) or data.get("key") != key:
            return "not this divergence cell"
        rows = data.get("rows")
        if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("kl"), float) for r in rows):
            return "expected a list of rows with a float 'kl'"
        return None
    return check


def divergence(cfg: EvalConfig, states: StatePool, *, samples: int = 4, progress: bool = True) -> pd.DataFrame:
    """Per state and setting of ``cfg`` (its family, strengths and seeds: the M draws of a random
    family), how far the perturbation moves ``cfg``'s policy on ``states``: one row each
    (:data:`DIVERGENCE_COLUMNS`).  Each setting over the pool is a cell, content-keyed by the model,
    the pool, the setting, K = ``samples``, the temperature and the response limit, stored under
    ``<cache_dir>/divergence/`` and verified when read (a damaged cell is recomputed)."""
    cfg.validate()
    if samples < 1:
        raise ValueError(f"--samples: {samples}; expected at least 1 sampled response per state")
    store = project_path(cfg.cache_dir)
    source = ModelSource(cfg, store / "file_hashes.json")
    ident = source.identity()
    cells = list(dict.fromkeys(c.canonical() for c in cfg.cells()))
    calib = load_calibration(project_path(cfg.calibration)) if any(c.family in CALIBRATED_FAMILIES for c in cells) else None
    stop = cfg.generation(0).stop
    base = {"evaluator": DIVERGENCE_VERSION, "model": ident, "states": states.hash, "samples": samples,
            "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens, "stop": stop,
            "options": dict(cfg.perturbation_options)}
    keyed = {c: canonical_hash({**base, "cell": [c.family, c.strength, c.seed],
                                "calibration": calib.hash if c.family in CALIBRATED_FAMILIES else None}) for c in cells}
    paths = {c: store / "divergence" / f"{k[:32]}.json" for c, k in keyed.items()}
    results = {c: read_cached(paths[c], read_json, _cell_problem(keyed[c])) for c in cells}
    clean: list[CleanSide] | None = None
    bar = progress_bar(total=len(cells) * len(states), desc=f"divergence {cfg.env} {cfg.family}", unit="state",
                       disable=not progress, initial=sum(len(states) for c in cells if results[c] is not None))
    for c in (c for c in cells if results[c] is None):
        policy = source.policy()
        model, tok = policy.model.eval(), policy.tokenizer
        eos = sorted(eos_ids(model, tok))
        if clean is None:  # once per state, shared by every setting (the same seeds for every policy)
            clean = [clean_side(model, p, k=samples, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                seed=int(canonical_hash([states.hash, i])[:8], 16), tokenizer=tok, stop=stop, eos=eos)
                     for i, p in enumerate(states.prompts)]
        kw = perturbation_kwargs(cfg, policy, c.family, calib, store, ident, progress)
        rows = []
        with perturbation(model, "none" if c.family == "clean" else c.family, c.strength, c.seed, **kw):
            for i, p in enumerate(states.prompts):
                rows.append(compare(model, p, clean[i], temperature=cfg.temperature,
                                    max_new_tokens=cfg.max_new_tokens, tokenizer=tok, stop=stop, eos=eos))
                bar.update(1)
        atomic_write_json(paths[c], {"key": keyed[c], "rows": rows})
        results[c] = {"rows": rows}
    bar.close()
    out = []
    for c in cfg.cells():
        canon = c.canonical()
        for i, r in enumerate(results[canon]["rows"]):
            split, task, step = states.origin[i]
            out.append({"env": cfg.env, "state": i, "split": split, "split_label": SPLIT_LABELS.get(split, split),
                        "task_index": task, "step": step, "family": c.family, "strength": c.strength,
                        "seed": c.seed, **r, "model": cfg.model, "adapters": ";".join(cfg.adapters),
                        "cell": keyed[canon][:12], **cfg.tags})
    return pd.DataFrame(out, columns=[*DIVERGENCE_COLUMNS, *cfg.tags])


def divergence_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per setting: states, mean KL with its standard error over states, the Pinsker bound of
    the mean, the flip rate."""
    g = rows.groupby(["family", "strength", "seed"], sort=False)
    s = g.agg(states=("kl", "size"), kl=("kl", "mean"), kl_se=("kl", "sem"), flip=("flip", "mean"))
    s["tv_bound"] = [pinsker(v) for v in s["kl"]]
    return s
