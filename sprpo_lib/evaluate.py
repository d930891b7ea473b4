"""Evaluation of LLM agents.

Two uses, one module:

* **Held-out evaluation during training** (:func:`evaluate_policy`): the same tasks and
  the same generation seed for every policy compared (the warm start and the RL-trained
  policies), at the paper's validation temperature 0.4 (Table 2).  ``eval.json`` holds
  the numbers and the settings they were made with; ``eval_episodes.jsonl`` one line
  per episode.
* **Robustness evaluation under deployment perturbations** (App. C, Table 1, Fig. 3):
  :func:`evaluate` plays any Hugging Face causal LM agent (a local directory, a hub id
  in the local cache, the embedded default or a tiny test model, plus peft adapters
  merged in order) on the held-out tasks of App. C under one perturbation family
  (:data:`sprpo_lib.compress.PERTURBATIONS`) at several strengths and evaluation seeds,
  and returns tidy rows, one per episode.  Every cell (model x env x family x strength
  x seed) is stored atomically in a content-keyed cache, so a sweep computes only
  missing cells and a killed sweep resumes.  ``python -m sprpo_lib.evaluate`` is its
  command line.

App. C protocol, as implemented here:

* held-out tasks: WebShop's 500 test goals (split ``test``), ALFWorld's official
  validation games, 140 ``valid_seen`` (ID) and 134 ``valid_unseen`` (OOD); ``tasks=N``
  keeps the first N of each split (a fixed, documented subset: the goal order is the
  environment's, fixed by its data and seed);
* temperature 0.4, one episode per task per evaluation seed; success and score per
  episode;
* evaluation seed ``s`` seeds the generation stream (``GenerationConfig.seed = s``; a
  fresh engine per cell, so the stream does not depend on what ran before) **and** the
  perturbation draw (``xi`` of ``gaussian``, the mask of ``dropout``: a new draw per
  seed).  The deterministic families (``fisher``, ``sparsegpt``, ``rtn``) ignore the
  seed except for generation.  Every family uses the same generation seeds, so clean
  and perturbed episodes of one seed are paired;
* adapters are merged into the weights before any perturbation (the deployed form);
* ``fisher`` and ``sparsegpt`` use a calibration pool of 128 agent-interaction token
  sequences collected once from one policy's rollouts on training tasks
  (:func:`build_calibration_pool`, stored as JSON) and shared by every evaluated model;
  Fisher scores (and SparseGPT) are computed per evaluated model on that pool.

A zero strength is the identity perturbation: such a cell *is* the clean cell (same
key, same rows, computed once) and its rows are labelled with the requested family and
strength.

Cache layout (``cache_dir``, default ``runs/eval_cache/``)::

    cells/<env>-<family>/<key>.json   one cell: {"key", "fields", "rows", "seconds", "commit", "date", "log"}
    cells/<env>-<family>/<key>.episodes.jsonl   what the agent saw and did in each episode
    fisher/<hash>.safetensors         Fisher scores of one model on one calibration pool
    file_hashes.json                  memo of file digests per (path, size, mtime, inode)

``key`` is the SHA-256 of ``fields`` (:func:`cell_fields`): :data:`EVALUATOR_VERSION`;
the model (digest of the base folder's safetensors, config and tokenizer files, or of
the tensors of a tiny model; digest of each adapter folder, in order; dtype; device
type); the env (name, data source, pool seed, step limit, the ``(split, index)`` task
list, a digest of the WebShop goals); generation (engine, temperature, top-p, response
length, batch size, stop string); the agent's prompt settings; the perturbation
(family, strength, options, and the calibration pool's hash for fisher / sparsegpt);
the evaluation seed.  Tags (method, training seed) are not part of it.

Nothing in the cache is served unverified.  A cell's JSON must parse, carry its key and
one row per task of the cell, in order; its ``log`` entry records the episode log's
SHA-256, size and line count (:func:`sprpo_lib.manifest.file_record`), which the log
must match (cells stored before that record must have a log that parses whole, one
episode per row, or none).  A cell that fails either check is recomputed (with a
warning), log and all; :func:`load_episode_log` refuses a log that fails them with one
error naming the file.  Fisher scores, the digest memo and held-out ``eval.json`` files
are recomputed when unreadable; a calibration pool must match its recorded hash.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .agent import AgentConfig
from .manifest import (CorruptFileError, atomic_write_bytes, atomic_write_json, atomic_write_text, file_record,
                       git_commit, read_cached, read_json, read_json_lines, read_safetensors, sha256_file,
                       verify_file)

logger = logging.getLogger(__name__)

# ============================================================================ held-out evaluation (training)


def held_out_tasks(cfg, n_pool: int, count: int) -> list[int]:
    """Training-pool tasks the warm start was not shown (indices after its
    demonstrations; from 0 without a warm start)."""
    first = min(cfg.sft.n_tasks, n_pool) if cfg.warm_start else 0
    return list(range(first, min(n_pool, first + count)))


def eval_temperature(cfg) -> float:
    """``cfg.eval_temperature`` (0.4) or, if ``None``, the rollout temperature."""
    return cfg.rollout.generation.temperature if cfg.eval_temperature is None else cfg.eval_temperature


def eval_settings(cfg) -> dict:
    """What a held-out evaluation's numbers depend on besides the policy and the tasks."""
    g = cfg.rollout.generation
    return {"temperature": eval_temperature(cfg), "top_p": g.top_p, "max_new_tokens": g.max_new_tokens,
            "max_steps": cfg.env.max_steps, "engine": cfg.rollout.engine}


def _eval_problem(res) -> str | None:
    if not isinstance(res, dict):
        return "not a JSON object"
    bad = [k for k in ("episodes", "success_rate", "mean_score", "valid_rate")
           if isinstance(res.get(k), bool) or not isinstance(res.get(k), (int, float))]
    return f"no number {bad[0]!r}" if bad else None


def load_eval(path: str | Path) -> dict:
    """A held-out evaluation (``eval.json`` of :func:`evaluate_policy`), verified with its
    ``eval_episodes.jsonl``: the log must match the SHA-256 and length recorded in
    ``eval.json`` (an older ``eval.json`` without that record: the log, if any, must parse
    whole, one line per episode).  Raises :class:`~sprpo_lib.manifest.CorruptFileError`
    naming the bad file, or ``FileNotFoundError``."""
    path = Path(path)
    fix = ("rerun the training command that wrote it (python -m sprpo_lib.train with the same arguments, or "
           "--warm-start-only for a warm start under runs/sft/): it is evaluated again")
    episodes = path.parent / "eval_episodes.jsonl"
    try:
        res = read_json(path, _eval_problem)
        if "log" in res:
            if not episodes.is_file():
                raise CorruptFileError(episodes, f"missing, though {path.name} records it")
            verify_file(episodes, res["log"])
        elif episodes.is_file():
            read_json_lines(episodes, check=lambda eps: None if len(eps) == res["episodes"] else
                            f"{len(eps)} episode lines where {path.name} counts {res['episodes']} (truncated)")
    except CorruptFileError as err:
        raise err.with_fix(fix) from None
    return res


def eval_is_current(path: Path, cfg, count: int) -> bool:
    """An ``eval.json`` exists, is whole (:func:`load_eval`; a corrupt one is not current, so
    it is recomputed) and was made with the current settings and task count."""
    res = read_cached(path, load_eval)
    return res is not None and res.get("episodes") == count and all(res.get(k) == v
                                                                     for k, v in eval_settings(cfg).items())


def evaluate_policy(policy, pool, cfg, agent, out: Path, count: int, progress: bool = True) -> dict:
    """Success and score of ``policy`` on ``count`` held-out tasks (:func:`held_out_tasks`),
    one rollout each at :func:`eval_temperature` with the generation seed ``cfg.sft.seed``;
    written to ``out/eval.json`` and ``out/eval_episodes.jsonl`` (a killed evaluation
    starts over)."""
    from dataclasses import replace

    from .sft import evaluate_format

    idx = held_out_tasks(cfg, pool.splits()[cfg.sft.split], count)
    gen = replace(cfg.rollout.generation, temperature=eval_temperature(cfg), seed=cfg.sft.seed)
    (out / "eval_episodes.jsonl").unlink(missing_ok=True)
    res = evaluate_format(policy, pool, cfg.sft.split, idx, agent, gen, max_steps=cfg.env.max_steps,
                          log_path=out / "eval_episodes.jsonl", progress=progress, engine=cfg.rollout.engine)
    res.update(split=cfg.sft.split, indices=[idx[0], idx[-1]] if idx else [], **eval_settings(cfg))
    if (out / "eval_episodes.jsonl").is_file():  # what load_eval checks the log against
        res["log"] = file_record(out / "eval_episodes.jsonl")
    atomic_write_json(out / "eval.json", res)
    return res


# ============================================================================ robustness evaluation (App. C)

#: Bumped whenever a change to this module can change the rows of a cell; part of every
#: cache key, so rows made by an older evaluator are never returned.
EVALUATOR_VERSION = 1

#: App. C held-out sets per environment.
EVAL_SPLITS: dict[str, tuple[str, ...]] = {"webshop": ("test",), "alfworld": ("valid_seen", "valid_unseen")}
#: How the appendix tables name the ALFWorld splits.
SPLIT_LABELS: dict[str, str] = {"test": "all", "valid_seen": "ID", "valid_unseen": "OOD"}
DEFAULT_CACHE = Path("runs") / "eval_cache"
#: Columns of :func:`evaluate`'s rows (then the config's tags).
ROW_COLUMNS = ("env", "split", "split_label", "task_index", "task_id", "family", "strength", "seed", "success",
               "score", "length", "valid_rate", "trace", "model", "adapters", "model_hash", "adapter_hash", "cell")
CALIBRATION_FORMAT = "sprpo-calibration"

# family -> (strength symbol, expected range in words, check).  The random families draw
# per evaluation seed; the others are deterministic given the model (and the calibration).
_RANGES = {
    "clean": ("none", "0 (no perturbation)", lambda s: s == 0),
    "gaussian": ("sigma", "0 <= sigma (finite); App. C sweeps 0.02-0.20",
                 lambda s: 0 <= s < math.inf),
    "dropout": ("p", "0 <= p < 1; App. C sweeps 0.01-0.05", lambda s: 0 <= s < 1),
    "fisher": ("r", "0 <= r < 1; App. C sweeps 0.05-0.20", lambda s: 0 <= s < 1),
    "sparsegpt": ("r", "0 <= r < 1; App. C sweeps 0.1-0.4 (WebShop), 0.1-0.7 (ALFWorld)",
                  lambda s: 0 <= s < 1),
    "rtn": ("bits", "an integer bit width 2..8; App. C uses 8, 6, 4",
            lambda s: float(s).is_integer() and 2 <= s <= 8),
    "plane": ("w1", "any finite weight of the first landscape direction (Fig. 4 grid); w2 is an option",
              lambda s: math.isfinite(s)),
}
RANDOM_FAMILIES = ("gaussian", "dropout")
CALIBRATED_FAMILIES = ("fisher", "sparsegpt")
ZERO_IS_IDENTITY = ("gaussian", "dropout", "fisher", "sparsegpt")  # sigma, p, r = 0 change nothing


def families() -> list[str]:
    """``clean`` and every registered perturbation family."""
    from .compress import PERTURBATIONS

    return ["clean", *PERTURBATIONS.names()]


def check_strength(family: str, strength: float) -> float:
    """The canonical strength of ``family`` (a float; an int-valued float for ``rtn``),
    or a ValueError naming the option, the range expected and a fix."""
    if family not in families():
        raise ValueError(f"--family / EvalConfig.family: unknown perturbation family {family!r}; expected one of "
                         f"{families()} (App. C). Fix: e.g. --family gaussian")
    try:
        s = float(strength)
    except (TypeError, ValueError):
        raise ValueError(f"--strength / EvalConfig.strengths: {strength!r} is not a number") from None
    symbol, text, ok = _RANGES.get(family, ("strength", "any finite value", lambda v: math.isfinite(v)))
    if not (math.isfinite(s) and ok(s)):
        example = {"rtn": "--strength 8 6 4", "clean": "omit --strength"}.get(family, "--strength 0.05")
        raise ValueError(f"--strength / EvalConfig.strengths: {strength!r} is outside the range of family "
                         f"{family!r} ({symbol}: expected {text}). Fix: {example}")
    return s + 0.0  # -0.0 -> 0.0


@dataclass(frozen=True)
class Cell:
    """One evaluation cell of a model on an env: a family, a strength and an evaluation seed."""

    family: str
    strength: float
    seed: int

    def canonical(self) -> "Cell":
        """Zero strength is the identity perturbation: the clean cell of the same seed."""
        if self.family in ZERO_IS_IDENTITY and self.strength == 0:
            return Cell("clean", 0.0, self.seed)
        return self


@dataclass
class EvalConfig:
    """One robustness evaluation (App. C): a model, an environment's held-out tasks, a
    perturbation family at some strengths, and evaluation seeds.

    Attributes:
        model: ``load_policy`` spec: a local HF directory (safetensors weights), a hub
            id already in the local cache, ``"smollm2-135m"``, or ``"tiny-qwen2"`` /
            ``"tiny-llama"`` (tests; initialised with ``model_seed``).
        adapters: peft adapter directories (``save_pretrained``, safetensors), merged
            into the weights in this order before any perturbation (a ``cpu``-profile
            agent is the warm-start adapter, then the RL adapter).
        env, data_dir, env_seed: the task pool (:func:`sprpo_lib.envs.make_pool`).
        splits: held-out splits; ``None``: App. C's (:data:`EVAL_SPLITS`).
        tasks: keep the first N tasks of each split (``None``: all of them).
        family, strengths: the perturbation and its strengths (``()``: App. C's levels,
            :data:`sprpo_lib.compress.PAPER_LEVELS`; ``clean`` has the single strength 0).
        seeds: evaluation seeds; each seeds generation and the random families' draw.
        temperature, top_p, max_new_tokens, batch_size: sampling (App. C: T = 0.4).
        max_steps: episode step limit (``None``: the environment's, 15 / 50).
        engine: generation engine (:func:`sprpo_lib.engines.make_engine`).
        prefix_caching: engines with a paged KV cache reuse computed prompt prefixes
            (``GenerationConfig.prefix_caching``); part of the cache key.
        max_batched_tokens: the ``openvino`` scheduler's tokens per step
            (``GenerationConfig.max_batched_tokens``); part of the cache key.
        agent: prompt settings; must match the ones the policy was trained with.
        calibration: calibration-pool JSON (:func:`build_calibration_pool`), needed by
            ``fisher`` and ``sparsegpt``.
        perturbation_options: extra keywords of the family (``scope`` of fisher,
            ``group_size`` of rtn, ``blocksize``/``percdamp`` of sparsegpt,
            ``batch_size``); part of the cache key.
        dtype, device, trust_remote_code, model_seed: how the model is loaded.
        cache_dir: the cell cache (default ``runs/eval_cache``).
        tags: columns added to every row (e.g. ``{"method": "sprpo", "train_seed": 0}``);
            not part of the cache key.
    """

    model: str
    adapters: tuple[str, ...] = ()
    env: str = "webshop"
    data_dir: str | None = None
    env_seed: int = 0
    splits: tuple[str, ...] | None = None
    tasks: int | None = None
    family: str = "clean"
    strengths: tuple[float, ...] = ()
    seeds: tuple[int, ...] = (0,)
    temperature: float = 0.4
    top_p: float = 1.0
    max_new_tokens: int = 64
    batch_size: int = 16
    max_steps: int | None = None
    engine: str = "hf"
    prefix_caching: bool = True
    max_batched_tokens: int = 1024
    agent: AgentConfig = field(default_factory=AgentConfig)
    calibration: str | None = None
    perturbation_options: dict = field(default_factory=dict)
    dtype: str = "auto"
    device: str = "cpu"
    trust_remote_code: bool = False
    model_seed: int = 0
    cache_dir: str = str(DEFAULT_CACHE)
    tags: dict = field(default_factory=dict)

    def __post_init__(self):
        self.adapters = tuple(str(a) for a in ([self.adapters] if isinstance(self.adapters, (str, Path))
                                               else self.adapters))
        self.splits = tuple(self.splits) if self.splits is not None else None
        self.seeds = tuple(int(s) for s in self.seeds)
        self.strengths = tuple(self.strengths)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """One clear ValueError per bad option: which option, what was expected, how to fix."""
        from .engines import ENGINES
        from .envs import ENVIRONMENTS
        from .rollout import GenerationConfig

        if self.env not in ENVIRONMENTS:
            raise ValueError(f"--env / EvalConfig.env: unknown environment {self.env!r}; expected one of "
                             f"{ENVIRONMENTS.names()}")
        if self.family not in families():
            check_strength(self.family, 0.0)  # the unknown-family error
        for s in self.resolved_strengths():
            check_strength(self.family, s)
        if not self.seeds:
            raise ValueError("--seeds / EvalConfig.seeds: no evaluation seed given; expected one or more integers, "
                             "e.g. --seeds 0 1 2")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds / EvalConfig.seeds: {list(self.seeds)} repeats a seed; give each seed once")
        if self.tasks is not None and int(self.tasks) < 1:
            raise ValueError(f"--tasks / EvalConfig.tasks: {self.tasks} selects no tasks; expected a positive count "
                             "(the first N tasks of each split) or nothing for all held-out tasks")
        if self.splits is not None and not self.splits:
            raise ValueError("--split / EvalConfig.splits: empty list of splits; omit it for App. C's held-out sets")
        if self.splits is None and self.env not in EVAL_SPLITS:
            raise ValueError(f"--split / EvalConfig.splits: no App. C held-out split is known for {self.env!r}; "
                             "name the splits to evaluate")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine / EvalConfig.engine: unknown generation engine {self.engine!r}; expected one "
                             f"of {sorted(ENGINES)}")
        clash = sorted(set(self.tags) & set(ROW_COLUMNS))
        if clash:
            raise ValueError(f"--tag / EvalConfig.tags: {clash} would overwrite row columns; rename them "
                             "(e.g. train_seed instead of seed)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps / EvalConfig.max_steps: expected >= 1 or None, got {self.max_steps}")
        try:
            GenerationConfig(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                             batch_size=self.batch_size)
        except ValueError as err:
            raise ValueError(f"--temperature/--top-p/--max-new-tokens/--batch-size: {err}") from None
        for a in self.adapters:
            check_adapter_dir(a)
        _check_options(self.family, self.perturbation_options)
        _check_model_spec(self.model)
        needs_calib = self.family in CALIBRATED_FAMILIES and any(s != 0 for s in self.resolved_strengths())
        if needs_calib and not self.calibration:
            raise ValueError(f"--calibration / EvalConfig.calibration: family {self.family!r} needs the shared "
                             "calibration pool (App. C: 128 agent-interaction sequences). Fix: build it once from "
                             "a Vanilla policy with --build-calibration PATH, then pass --calibration PATH")
        if needs_calib and not Path(self.calibration).is_file():
            raise ValueError(f"--calibration / EvalConfig.calibration: {self.calibration} does not exist; build it "
                             "with python -m sprpo_lib.evaluate --build-calibration PATH --model <vanilla policy> ...")

    # ------------------------------------------------------------------ derived
    def resolved_strengths(self) -> tuple[float, ...]:
        """The strengths to evaluate: as given, else App. C's levels for the env."""
        from .compress import PAPER_LEVELS

        if self.strengths:
            return tuple(self.strengths)
        if self.family == "clean":
            return (0.0,)
        levels = PAPER_LEVELS.get(self.family, {}).get(self.env)
        if levels is None:
            raise ValueError(f"--strength / EvalConfig.strengths: no App. C levels for {self.family!r} on "
                             f"{self.env!r}; give the strengths")
        return tuple(levels)

    def cells(self) -> list[Cell]:
        """Requested cells, strengths outer, seeds inner."""
        return [Cell(self.family, check_strength(self.family, s), seed)
                for s in self.resolved_strengths() for seed in self.seeds]

    def generation(self, seed: int):
        """The sampling settings of evaluation seed ``seed``."""
        from .rollout import GenerationConfig

        return GenerationConfig(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                                batch_size=self.batch_size, seed=int(seed), prefix_caching=self.prefix_caching,
                                max_batched_tokens=self.max_batched_tokens)


def _check_model_spec(spec: str) -> None:
    from .models import DEFAULT_MODEL, TINY_SPECS, _looks_like_hub_id

    if spec in TINY_SPECS or spec == DEFAULT_MODEL:
        return
    p = Path(spec).expanduser()
    if p.is_dir():
        if not any(p.glob("*.safetensors")):
            raise ValueError(f"--model / EvalConfig.model: {spec} holds no *.safetensors weights; expected a Hugging "
                             "Face directory saved with save_pretrained(safe_serialization=True) (pickled weights "
                             "are not loaded). Fix: re-save the model as safetensors")
        return
    if _looks_like_hub_id(spec):
        return
    raise ValueError(f"--model / EvalConfig.model: {spec!r} is neither a known name ({DEFAULT_MODEL!r}, "
                     f"{', '.join(TINY_SPECS)}), an existing directory, nor a hub id 'org/name'. Fix: pass the "
                     "path of a local copy, e.g. --model /data/Qwen2.5-1.5B-Instruct")


def _check_options(family: str, options: Mapping) -> None:
    """Extra perturbation keywords must be ones the family takes (``calib``/``scores``
    are the evaluator's business)."""
    import inspect

    from .compress import PERTURBATIONS

    if not options:
        return
    if family == "clean":
        raise ValueError(f"EvalConfig.perturbation_options: {sorted(options)} given for the clean family, which "
                         "takes none; drop them")
    fn = PERTURBATIONS.get(family)
    valid = [n for n, p in inspect.signature(fn).parameters.items()
             if p.kind is p.KEYWORD_ONLY and n not in ("calib", "scores", "pad_id")]
    bad = sorted(set(options) - set(valid))
    if bad:
        raise ValueError(f"EvalConfig.perturbation_options: family {family!r} takes no option(s) {bad}; "
                         f"expected some of {valid}")


def check_adapter_dir(path: str | Path) -> Path:
    """A peft adapter directory with safetensors weights, or a ValueError saying what is missing."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"--adapter / EvalConfig.adapters: {path} is not a directory; expected a peft adapter saved "
                         "with save_pretrained (adapter_config.json + adapter_model.safetensors), e.g. "
                         "runs/train/<run>/final/adapter")
    missing = [n for n in ("adapter_config.json", "adapter_model.safetensors") if not (p / n).is_file()]
    if missing:
        raise ValueError(f"--adapter / EvalConfig.adapters: {path} lacks {missing}; expected a peft adapter saved "
                         "with save_pretrained(safe_serialization=True) (pickled adapter_model.bin is not loaded)")
    return p


# ============================================================================ content hashes

_MEMO: dict[str, dict] = {}
_HASHED_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken")
_RACY_SECONDS = 2.0  # files changed this recently are hashed again (their mtime may not tick on a rewrite)


def file_digest(path: str | Path, memo_path: str | Path | None = None) -> str:
    """SHA-256 of a file's bytes, memoised per (path, size, mtime, inode) in memory and,
    when ``memo_path`` is given, in that JSON file (large weights are hashed once).

    A file modified within the last 2 seconds is never memoised (a rewrite inside one
    filesystem timestamp tick would otherwise keep its old digest, as in git's "racy"
    index entries); rewriting a file with the same size *and* forcing the old mtime
    back would fool the memo."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    key = str(path)
    disk: dict = {}
    if memo_path is not None:  # an unreadable memo is rebuilt
        disk = read_cached(memo_path, read_json, lambda d: None if isinstance(d, dict) else "not a JSON object") or {}
    for memo in (_MEMO, disk):
        hit = memo.get(key)
        if (isinstance(hit, dict) and all(hit.get(k) == v for k, v in stamp.items())
                and isinstance(hit.get("sha256"), str) and len(hit["sha256"]) == 64):
            return hit["sha256"]
    digest = sha256_file(path)
    if time.time() - st.st_mtime_ns / 1e9 > _RACY_SECONDS:
        _MEMO[key] = {**stamp, "sha256": digest}
        if memo_path is not None:
            disk[key] = _MEMO[key]
            atomic_write_json(memo_path, disk)
    return digest


def dir_digest(path: str | Path, memo_path: str | Path | None = None) -> str:
    """SHA-256 over the top-level weight, config and tokenizer files of a model or
    adapter directory (``*.safetensors``, ``*.json``, ``*.model``, ``*.txt``, ``*.jinja``),
    by name and content: what the evaluated policy is made of."""
    path = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _HASHED_SUFFIXES):
        h.update(f"{f.name}\0{file_digest(f, memo_path)}\n".encode())
    return h.hexdigest()


def state_dict_digest(model) -> str:
    """SHA-256 of a model's tensors in memory (names, dtypes, shapes, bytes): the
    identity of a model without files (the tiny random models)."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def canonical_hash(obj) -> str:
    """SHA-256 of an object's canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ============================================================================ calibration pool


@dataclass
class CalibrationPool:
    """The shared calibration set of App. C: token-id sequences (prompt + response of
    agent steps), their content hash, and where they came from."""

    sequences: list[list[int]]
    hash: str
    source: dict

    def __len__(self) -> int:
        return len(self.sequences)


def sequences_hash(sequences: Sequence[Sequence[int]]) -> str:
    return canonical_hash([[int(t) for t in s] for s in sequences])


def build_calibration_pool(policy, pool, agent: AgentConfig | None = None, *, n: int = 128,
                           split: str = "train", first_task: int = 0, per_episode: int = 4,
                           temperature: float = 0.4, max_new_tokens: int = 64, batch_size: int = 16,
                           max_steps: int | None = None, seed: int = 0, engine: str = "hf",
                           tasks_per_batch: int = 16, progress: bool = True,
                           source: Mapping | None = None) -> CalibrationPool:
    """Collect ``n`` agent-interaction sequences from ``policy``'s own rollouts on
    training tasks (App. C: 128 sequences from a Vanilla policy).

    Training tasks ``first_task, first_task + 1, ...`` of ``split`` are played one
    episode each, ``tasks_per_batch`` at a time, at ``temperature`` with generation
    seed ``seed``; from each episode at most ``per_episode`` steps are kept (a seeded
    random choice, so the pool spans many tasks and all stages of an episode); each
    kept step gives ``prompt_ids + response_ids``, the templated prompt and the
    response exactly as generated.  Stops as soon as ``n`` sequences are collected.
    """
    from .agent import token_counter
    from .engines import close_engine, make_engine
    from .rollout import GenerationConfig, SerialEnvs, run_groups

    if n < 1 or per_episode < 1:
        raise ValueError(f"calibration pool: n and per_episode must be >= 1, got {n}, {per_episode}")
    agent = agent or AgentConfig()
    size = pool.splits().get(split)
    if size is None:
        raise ValueError(f"calibration pool: {pool.name} has no split {split!r}; expected one of {sorted(pool.splits())}")
    rng = random.Random(seed)
    gen = GenerationConfig(temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
    eng = make_engine(engine, policy, gen, agent)
    seqs: list[list[int]] = []
    origin: list[list] = []
    task = first_task
    envs = SerialEnvs(lambda: pool)
    try:
        policy.model.eval()
        while len(seqs) < n:
            if task >= size:
                raise ValueError(f"calibration pool: {split!r} ran out of tasks after {len(seqs)} of {n} sequences; "
                                 "raise per_episode or lower n")
            batch = [(split, i) for i in range(task, min(size, task + tasks_per_batch))]
            task += len(batch)
            episodes, _ = run_groups(envs, batch, 1, eng, agent, max_steps, progress=progress,
                                     count_tokens=token_counter(policy.tokenizer, agent))
            for ep in episodes:
                steps = [s for s in ep.steps if s.prompt_ids and s.response_ids]
                for s in sorted(rng.sample(steps, min(per_episode, len(steps))), key=lambda s: s.step):
                    if len(seqs) < n:
                        seqs.append([int(t) for t in s.prompt_ids] + [int(t) for t in s.response_ids])
                        origin.append([ep.split, ep.task_index, s.step])
    finally:
        envs.close()
        close_engine(eng)
    tok = policy.tokenizer
    src = {"env": pool.name, "split": split, "steps": origin, "per_episode": per_episode, "seed": seed,
           "temperature": temperature, "max_new_tokens": max_new_tokens, "max_steps": max_steps, "engine": engine,
           "agent": dataclasses.asdict(agent), "policy": getattr(policy, "spec", None),
           "tokenizer": {"name": getattr(tok, "name_or_path", None), "vocab": len(tok)}, **dict(source or {})}
    return CalibrationPool(seqs, sequences_hash(seqs), src)


def save_calibration(path: str | Path, calib: CalibrationPool) -> Path:
    """Write a calibration pool as JSON (atomic; never pickle)."""
    return atomic_write_json(path, {"format": CALIBRATION_FORMAT, "version": 1, "hash": calib.hash,
                                    "n": len(calib), "source": calib.source, "sequences": calib.sequences})


def _calibration_problem(data) -> str | None:
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        return f"not a calibration pool (format {CALIBRATION_FORMAT!r} expected)"
    seqs = data.get("sequences")
    if (not isinstance(seqs, list) or not seqs
            or not all(isinstance(s, list) and len(s) >= 2 and all(isinstance(t, int) for t in s) for s in seqs)):
        return "expected a non-empty list of token-id lists of length >= 2"
    if sequences_hash(seqs) != data.get("hash"):
        return "its sequences do not match the recorded hash (edited or corrupted)"
    return None


def load_calibration(path: str | Path) -> CalibrationPool:
    """Read a calibration pool written by :func:`save_calibration`; its content must
    match its recorded hash (a hand-edited, truncated or garbage file is refused with
    :class:`~sprpo_lib.manifest.CorruptFileError`)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--calibration: {p} does not exist; build it with --build-calibration {p}")
    try:
        data = read_json(p, _calibration_problem)
    except CorruptFileError as err:
        raise err.with_fix(f"--calibration: rebuild it with --build-calibration {p}") from None
    return CalibrationPool(data["sequences"], data["hash"], data.get("source", {}))


# ============================================================================ tasks, rows, cache


def select_tasks(pool, env: str, splits: Sequence[str] | None = None, count: int | None = None) -> list[tuple[str, int]]:
    """The held-out tasks ``[(split, index)]``: App. C's splits (or ``splits``), all
    tasks or the first ``count`` of each split."""
    splits = tuple(splits) if splits else EVAL_SPLITS.get(env, ())
    sizes = pool.splits()
    bad = [s for s in splits if s not in sizes]
    if bad or not splits:
        raise ValueError(f"--split / EvalConfig.splits: {list(bad or splits)} not split(s) of {env!r}; expected some "
                         f"of {sorted(sizes)} (App. C: {list(EVAL_SPLITS.get(env, ()))})")
    if count is not None and count < 1:
        raise ValueError(f"--tasks / EvalConfig.tasks: {count} selects no tasks; expected a positive count")
    tasks = [(s, i) for s in splits for i in range(sizes[s] if count is None else min(count, sizes[s]))]
    if not tasks:
        raise ValueError(f"--split / EvalConfig.splits: {list(splits)} of {env!r} hold no tasks; choose other splits")
    return tasks


def _data_source(env: str, data_dir: str | None) -> str:
    """The task pool's data: the given folder, the folder in the env variable, or the
    offline generated default."""
    var = {"webshop": "WEBSHOP_DATA", "alfworld": "ALFWORLD_DATA"}.get(env)
    d = data_dir or (os.environ.get(var) if var else None)
    return str(Path(os.path.expandvars(d)).expanduser().resolve()) if d else "generated"


def _tasks_digest(pool, tasks: Sequence[tuple[str, int]]) -> str | None:
    """Digest of the tasks' content where the pool exposes it cheaply (WebShop goals)."""
    goal = getattr(pool, "goal", None)
    if goal is None:
        return None
    return canonical_hash([goal(s, i) for s, i in tasks])


def episode_log(records, obs_chars: int = 600) -> list[dict]:
    """What the agent saw and did, one dict per episode (observations cut to
    ``obs_chars``): the source of the text examples (App. "Qualitative Examples")."""
    return [{"split": r.split, "task_index": int(r.task_index), "task_id": r.task_id, "instruction": r.instruction,
             "success": bool(r.success), "score": float(r.score),
             "steps": [{"step": s.step, "observation": s.observation[:obs_chars], "response": s.response,
                        "action": s.action, "valid": bool(s.valid), "reward": float(s.env_reward)}
                       for s in r.steps]}
            for r in records]


def episode_rows(records) -> list[dict]:
    """One tidy row per episode (no model or perturbation columns).  ``trace`` is a
    short digest of the episode's responses: equal traces mean the same behaviour, so
    cells can be compared episode by episode beyond success and score."""
    return [{"env": r.env, "split": r.split, "task_index": int(r.task_index), "task_id": r.task_id,
             "success": bool(r.success), "score": float(r.score), "length": int(r.length),
             "valid_rate": float(r.valid_rate),
             "trace": hashlib.sha256("\0".join(s.response for s in r.steps).encode()).hexdigest()[:16]}
            for r in records]


#: What every stored row of a cell holds (:func:`episode_rows`).
_ROW_KEYS = ("env", "split", "task_index", "task_id", "success", "score", "length", "valid_rate", "trace")
_LOG_SUFFIX = ".episodes.jsonl"


def _read_cell(path: Path, key: str, tasks: Sequence[Sequence] | None = None) -> dict:
    """A stored cell, checked: a JSON object with this key and one whole row per task of
    the cell (``tasks``, default the tasks its stored fields name), in order."""
    def problem(data) -> str | None:
        if not isinstance(data, dict):
            return "not a JSON object"
        if data.get("key") != key:
            return f"its key {str(data.get('key'))[:12]}... is not the {key[:12]}... of its name"
        rows, want = data.get("rows"), [tuple(t) for t in (data["fields"]["env"]["tasks"] if tasks is None else tasks)]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in _ROW_KEYS) for r in rows):
            return "its rows are not a list of episode rows"
        if [(r["split"], r["task_index"]) for r in rows] != want:
            return f"its {len(rows)} rows are not the cell's {len(want)} tasks in order"
        return None

    return read_json(path, problem)


def _check_cell_log(path: Path, data: dict, parse: bool) -> list[dict] | None:
    """The episode log beside the cell ``data`` read from ``path``, checked against the cell:
    against its recorded SHA-256 and size (read as data only when ``parse``), or for cells
    stored before that record, parsed whole with one episode per row.  ``None`` when a cell
    stored without a record has no log.  Raises CorruptFileError."""
    lp = path.with_name(path.stem + _LOG_SUFFIX)
    rec = data.get("log")
    if rec is not None:
        if not lp.is_file():
            raise CorruptFileError(lp, f"missing, though its cell {path.name} records it")
        if not parse:
            verify_file(lp, rec)
            return None
        return read_json_lines(lp, rec)
    if not lp.is_file():
        return None
    rows = data["rows"]

    def same_episodes(eps) -> str | None:
        got = [(e["split"], e["task_index"], e["success"]) for e in eps]
        if got != [(r["split"], r["task_index"], r["success"]) for r in rows]:
            return f"its {len(eps)} episodes do not match the {len(rows)} rows of its cell {path.name} (truncated?)"
        return None

    return read_json_lines(lp, check=same_episodes)


class CellCache:
    """Cells stored one JSON file each: ``<root>/cells/<env>-<family>/<key>.json`` with
    the key's fields (what the rows depend on), the rows, and provenance, and beside it
    the cell's episode log, whose SHA-256 and size the cell records.  Written atomically
    (the log first), so a killed sweep leaves whole cells or none; read back verified, so
    a truncated or garbage cell or log is recomputed, never served."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, key: str, fields: Mapping) -> Path:
        return self.root / "cells" / f"{fields['env']['name']}-{fields['perturbation']['family']}" / f"{key}.json"

    def get(self, key: str, fields: Mapping) -> list[dict] | None:
        """The cell's rows, or ``None`` when it is missing or it (or its episode log) does
        not verify: then it is recomputed (with a warning) and rewritten."""
        p = self.path(key, fields)
        if not p.is_file():
            return None
        try:
            data = _read_cell(p, key, fields["env"]["tasks"])
            _check_cell_log(p, data, parse=False)
        except CorruptFileError as err:
            logger.warning("%s", err.with_fix("recomputing the cell"))
            return None
        return data["rows"]

    def log_path(self, key: str, fields: Mapping) -> Path:
        return self.path(key, fields).with_suffix(_LOG_SUFFIX)

    def put(self, key: str, fields: Mapping, rows: list[dict], seconds: float, log: list[dict] | None = None) -> Path:
        cell = {"key": key, "fields": fields, "rows": rows, "seconds": round(seconds, 2), "commit": git_commit(),
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        if log is not None:  # written first: a stored cell always has its log, and records what it is
            lp = atomic_write_text(self.log_path(key, fields), "".join(json.dumps(e) + "\n" for e in log))
            cell["log"] = file_record(lp)
        return atomic_write_json(self.path(key, fields), cell)


def load_episode_log(cache_dir: str | Path, cell: str) -> list[dict] | None:
    """The episode log of the cell whose key starts with ``cell`` (the rows' ``cell``
    column), or None when that cell was stored without one.  The log is checked against
    its cell (:class:`CellCache`); one that does not verify is an error naming it
    (:class:`~sprpo_lib.manifest.CorruptFileError`), never returned."""
    hits = sorted(Path(cache_dir).glob(f"cells/*/{cell}*{_LOG_SUFFIX}"))
    if not hits:
        return None
    lp = hits[0]
    cp = lp.with_name(lp.name[: -len(_LOG_SUFFIX)] + ".json")
    fix = (f"rerun the evaluation that made it (python -m sprpo_lib.evaluate, or the notebook or sweep that "
           f"computed cell {cp.stem[:12]}): the cell is recomputed with its log; or delete {lp.name} and {cp.name}")
    try:
        if not cp.is_file():  # a log whose cell was never stored (killed between the two writes): parsed whole
            return read_json_lines(lp)
        return _check_cell_log(cp, _read_cell(cp, cp.stem), parse=True)
    except CorruptFileError as err:
        raise err.with_fix(fix) from None


def cell_key(fields: Mapping) -> str:
    """The cache key of a cell: SHA-256 of its canonical fields (:func:`cell_fields`)."""
    return canonical_hash(fields)


# ============================================================================ the evaluated model


class ModelSource:
    """The evaluated policy: identified by content before loading, loaded (and its
    adapters merged) only when a cell has to be computed."""

    def __init__(self, cfg: EvalConfig, memo_path: Path | None = None):
        self.cfg = cfg
        self.memo_path = memo_path
        self._policy = None
        self._merged = False
        self._identity: dict | None = None

    def _dir(self) -> Path | None:
        from .models import DEFAULT_MODEL, TINY_SPECS, convert_smollm2

        spec = self.cfg.model
        if spec in TINY_SPECS:
            return None
        if spec == DEFAULT_MODEL:
            return convert_smollm2()
        p = Path(spec).expanduser()
        if p.is_dir():
            return p
        try:  # a hub id: its snapshot in the local cache, if there is one
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(spec, local_files_only=True))
        except Exception:
            return None

    def dtype(self, model_dir: Path | None) -> str:
        """The dtype the model is (or will be) loaded in: part of the key."""
        from .hardware import linear_shapes
        from .models import TINY_SPECS, resolve_dtype

        cfg = self.cfg
        if cfg.dtype != "auto":
            return str(resolve_dtype(cfg.dtype)).replace("torch.", "")
        if cfg.model in TINY_SPECS:
            return "float32"
        from transformers import AutoConfig

        conf = AutoConfig.from_pretrained(str(model_dir or cfg.model), trust_remote_code=cfg.trust_remote_code)
        conf = getattr(conf, "text_config", None) or conf
        return str(resolve_dtype("auto", linear_shapes(conf), cfg.device)).replace("torch.", "")

    def identity(self) -> dict:
        """Content hashes of the base weights and of each adapter, plus dtype and device."""
        if self._identity is None:
            d = self._dir()
            dtype = self.dtype(d)
            if d is not None:
                base = dir_digest(d, self.memo_path)
            else:
                base = state_dict_digest(self._load_base(dtype).model)
            self._identity = {"base": base, "adapters": [dir_digest(check_adapter_dir(a), self.memo_path)
                                                         for a in self.cfg.adapters],
                              "dtype": dtype, "device": str(self.cfg.device).split(":")[0]}
        return self._identity

    def _load_base(self, dtype: str):
        from .models import load_policy

        if self._policy is None:
            self._policy = load_policy(self.cfg.model, dtype=dtype, device=self.cfg.device, seed=self.cfg.model_seed,
                                       trust_remote_code=self.cfg.trust_remote_code)
        return self._policy

    def policy(self):
        """The deployed policy: base weights with every adapter merged, in order."""
        from .sft import load_adapter

        pol = self._load_base(self.identity()["dtype"])
        if not self._merged:
            for a in self.cfg.adapters:
                load_adapter(pol, a, merge=True)
            for p in pol.model.parameters():
                p.requires_grad_(False)
            pol.model.eval()
            self._merged = True
        return pol


# ============================================================================ playing cells


def cell_fields(cfg: EvalConfig, identity: Mapping, env_fields: Mapping, cell: Cell,
                calib_hash: str | None) -> dict:
    """Everything a cell's rows depend on: the key's content."""
    return {
        "evaluator": EVALUATOR_VERSION,
        "model": dict(identity),
        "env": dict(env_fields),
        "generation": {"engine": cfg.engine, "prefix_caching": cfg.prefix_caching,
                       "max_batched_tokens": cfg.max_batched_tokens,
                       "temperature": cfg.temperature, "top_p": cfg.top_p,
                       "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size,
                       "stop": cfg.generation(0).stop},
        "agent": dataclasses.asdict(cfg.agent),
        "perturbation": {"family": cell.family, "strength": cell.strength,
                         "options": dict(sorted(cfg.perturbation_options.items())) if cell.family != "clean" else {},
                         "calibration": calib_hash if cell.family in CALIBRATED_FAMILIES else None},
        "seed": cell.seed,
    }


def play_cell(policy, pool, tasks: Sequence[tuple[str, int]], cfg: EvalConfig, seed: int,
              progress: bool = False, with_log: bool = False):
    """Play one episode per task with evaluation seed ``seed`` under whatever
    perturbation is in force on ``policy.model``; a fresh engine, so generation
    depends only on the seed.  Returns the rows, or ``(rows, episode_log)``."""
    from .agent import token_counter
    from .engines import close_engine, make_engine
    from .rollout import SerialEnvs, run_groups

    eng = make_engine(cfg.engine, policy, cfg.generation(seed), cfg.agent)
    envs = SerialEnvs(lambda: pool)
    try:
        records, _ = run_groups(envs, list(tasks), 1, eng, cfg.agent, cfg.max_steps, progress=progress,
                                count_tokens=token_counter(policy.tokenizer, cfg.agent))
    finally:
        envs.close()
        close_engine(eng)
    return (episode_rows(records), episode_log(records)) if with_log else episode_rows(records)


def _fisher_scores(policy, calib: CalibrationPool, store: Path, identity: Mapping, options: Mapping,
                   progress: bool):
    """Fisher channel scores of this model on the shared pool (App. C), cached as
    safetensors under ``<cache>/fisher/``."""
    import safetensors.torch as st

    from .compress import fisher_scores

    bs = int(options.get("batch_size", 8))
    key = canonical_hash({"evaluator": EVALUATOR_VERSION, "model": dict(identity), "calibration": calib.hash,
                          "batch_size": bs})
    path = store / "fisher" / f"{key}.safetensors"
    cached = read_cached(path, read_safetensors)
    if cached is not None:
        scores = cached.get("scores")
        if scores is not None and scores.dim() == 2 and scores.is_floating_point() and bool(scores.isfinite().all()):
            return scores
        logger.warning("corrupt file %s: no finite 2-D tensor 'scores'; recomputing it", path)
    scores = fisher_scores(policy.model, calib.sequences, batch_size=bs, pad_id=policy.tokenizer.pad_token_id,
                           progress=progress)
    atomic_write_bytes(path, st.save({"scores": scores.contiguous()}))
    return scores


def _check_calibration_fits(calib: CalibrationPool, policy) -> None:
    vocab = policy.model.get_input_embeddings().weight.shape[0]
    top = max(max(s) for s in calib.sequences)
    if top >= vocab:
        raise ValueError(f"--calibration: token id {top} is outside this model's vocabulary ({vocab}); the pool was "
                         "built with another tokenizer. Build one from a policy of the same base model")


def evaluate(cfg: EvalConfig, *, progress: bool = True, pool=None) -> "pd.DataFrame":  # noqa: F821
    """Rows of every requested cell of ``cfg``, computing only cells missing from the cache.

    Returns a DataFrame with one row per episode: ``env, split, split_label, task_index,
    task_id, family, strength, seed, success, score, length, valid_rate, trace, model,
    adapters, model_hash, adapter_hash, cell`` plus ``cfg.tags``.  Rows are ordered by
    strength, seed, then task."""
    import pandas as pd
    from tqdm.auto import tqdm

    from .compress import perturbation
    from .envs import make_pool

    cfg.validate()
    store = Path(cfg.cache_dir)
    cache = CellCache(store)
    pool = pool if pool is not None else make_pool(cfg.env, cfg.data_dir, cfg.env_seed)
    tasks = select_tasks(pool, cfg.env, cfg.splits, cfg.tasks)
    env_fields = {"name": cfg.env, "data": _data_source(cfg.env, cfg.data_dir), "seed": cfg.env_seed,
                  "max_steps": cfg.max_steps or pool.max_steps, "tasks": [list(t) for t in tasks],
                  "content": _tasks_digest(pool, tasks)}
    requested = cfg.cells()
    needs_calib = any(c.canonical().family in CALIBRATED_FAMILIES for c in requested)
    calib = load_calibration(cfg.calibration) if needs_calib else None
    source = ModelSource(cfg, store / "file_hashes.json")
    ident = source.identity()
    keyed = {}
    for c in requested:
        canon = c.canonical()
        if canon not in keyed:
            f = cell_fields(cfg, ident, env_fields, canon, calib.hash if calib else None)
            keyed[canon] = (cell_key(f), f)
    results = {c: cache.get(k, f) for c, (k, f) in keyed.items()}
    missing = [c for c, rows in results.items() if rows is None]
    bar = tqdm(total=len(keyed), initial=len(keyed) - len(missing), desc=f"eval {cfg.env} {cfg.family}",
               unit="cell", disable=not progress)
    # deterministic families are applied once per strength for all seeds; random ones per seed
    groups: dict[tuple, list[Cell]] = {}
    for c in missing:
        groups.setdefault((c.family, c.strength, c.seed if c.family in RANDOM_FAMILIES else None), []).append(c)
    for (family, strength, _), cells in groups.items():
        policy = source.policy()
        kw: dict = {}
        if family != "clean":
            kw = {"pad_id": policy.tokenizer.pad_token_id, **cfg.perturbation_options}
            if family in CALIBRATED_FAMILIES:
                _check_calibration_fits(calib, policy)
                kw["calib"] = calib.sequences
            if family == "fisher":
                kw["scores"] = _fisher_scores(policy, calib, store, ident, cfg.perturbation_options, progress)
                kw.pop("calib")
        with perturbation(policy.model, "none" if family == "clean" else family, strength, cells[0].seed, **kw):
            for c in cells:
                bar.set_postfix_str(f"{c.family} {c.strength:g} seed {c.seed}")
                t0 = time.perf_counter()
                rows, log = play_cell(policy, pool, tasks, cfg, c.seed, progress=progress, with_log=True)
                key, fields = keyed[c]
                cache.put(key, fields, rows, time.perf_counter() - t0, log)
                results[c] = rows
                bar.update(1)
    bar.close()
    out = []
    adapters = ";".join(cfg.adapters)
    adapter_hash = canonical_hash(ident["adapters"])[:12] if cfg.adapters else ""
    for c in requested:
        key = keyed[c.canonical()][0]
        for r in results[c.canonical()]:
            out.append({**r, "split_label": SPLIT_LABELS.get(r["split"], r["split"]), "family": c.family,
                        "strength": c.strength, "seed": c.seed, "model": cfg.model, "adapters": adapters,
                        "model_hash": ident["base"][:12], "adapter_hash": adapter_hash, "cell": key[:12],
                        **cfg.tags})
    return pd.DataFrame(out, columns=[*ROW_COLUMNS, *cfg.tags])


def sweep(cfgs: Iterable[EvalConfig], *, progress: bool = True) -> "pd.DataFrame":  # noqa: F821
    """:func:`evaluate` for several configurations (families, models), rows concatenated.
    Each configuration's cells are cached as soon as they are computed."""
    import pandas as pd

    frames = [evaluate(c, progress=progress) for c in cfgs]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# ============================================================================ configurations from training runs


def config_from_run(run_dir: str | Path, **overrides) -> EvalConfig:
    """An :class:`EvalConfig` for a training run folder (``runs/.../<env>-<method>-<profile>-seed<s>``):
    its base model and dtype, the warm-start adapter (cached under ``runs/sft/``) when
    the profile has one, then the run's ``final/adapter``; its prompt settings, step
    limit, engine and response length; tags ``method``, ``train_seed``, ``profile``.
    ``overrides`` replace any field (e.g. ``family="rtn"``, ``tasks=64``)."""
    from .config import config_from_dict
    from .train import ROOT, warm_start_key

    run = Path(run_dir)
    meta_path = run / "config.json"
    if not meta_path.is_file():
        raise ValueError(f"--run: {run} has no config.json; expected a training run folder (runs/train/<run>)")
    try:
        meta = read_json(meta_path, lambda m: None if isinstance(m.get("config"), dict) else "no 'config' object")
    except CorruptFileError as err:
        raise err.with_fix(f"the run cannot be identified; retrain it (python -m sprpo_lib.train --out {run} --fresh "
                           "with its arguments)") from None
    tc = config_from_dict(meta["config"])
    adapters = []
    if tc.warm_start:
        adapters.append(str(ROOT / "runs" / "sft" / f"{tc.env.name}-{warm_start_key(tc, tc.rollout.agent)}" / "adapter"))
    adapters.append(str(run / "final" / "adapter"))
    g = tc.rollout.generation
    base = dict(model=tc.model.spec, adapters=tuple(adapters), env=tc.env.name, data_dir=tc.env.data_dir,
                env_seed=tc.env.seed, top_p=g.top_p, max_new_tokens=g.max_new_tokens, max_steps=tc.env.max_steps,
                engine=tc.rollout.engine, prefix_caching=g.prefix_caching, max_batched_tokens=g.max_batched_tokens,
                agent=tc.rollout.agent,
                dtype=meta.get("dtype") or tc.model.dtype or "auto",
                model_seed=tc.seed, tags={"method": tc.method.name, "train_seed": tc.seed, "profile": tc.profile})
    base.update(overrides)
    return EvalConfig(**base)


def config_from_profile(profile: str, env: str, **overrides) -> EvalConfig:
    """An :class:`EvalConfig` with a training profile's prompt settings, step limit,
    engine and response length for ``env`` (so a policy is evaluated with the prompts
    it was trained on); ``overrides`` set the model and anything else."""
    from .config import load_config

    tc = load_config(profile, **{"env.name": env})
    g = tc.rollout.generation
    base = dict(model=tc.model.spec, env=env, data_dir=tc.env.data_dir, env_seed=tc.env.seed, top_p=g.top_p,
                max_new_tokens=g.max_new_tokens, max_steps=tc.env.max_steps, engine=tc.rollout.engine,
                prefix_caching=g.prefix_caching, max_batched_tokens=g.max_batched_tokens, agent=tc.rollout.agent,
                dtype=tc.model.dtype or "auto")
    base.update(overrides)
    return EvalConfig(**base)


# ============================================================================ command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m sprpo_lib.evaluate",
        description="Evaluate an LLM agent under a deployment perturbation (App. C); rows are cached per cell "
                    "under --cache-dir, so a rerun computes only missing cells.")
    ap.add_argument("--model", help="HF directory (safetensors), hub id in the local cache, smollm2-135m, tiny-qwen2")
    ap.add_argument("--adapter", nargs="+", default=[], metavar="DIR",
                    help="peft adapter dir(s) (safetensors), merged in order before perturbing")
    ap.add_argument("--run", help="a training run folder: model, adapters, prompt settings and tags from it")
    ap.add_argument("--profile", help="take prompt/generation settings from a training profile (smoke|cpu|paper)")
    ap.add_argument("--env", default=None, help="webshop | alfworld (default webshop, or the run's)")
    ap.add_argument("--family", default="clean", help="clean | gaussian | dropout | fisher | sparsegpt | rtn")
    ap.add_argument("--strength", nargs="+", type=float, default=[],
                    help="sigma | p | r | bits; default: App. C's levels for the family and env")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="evaluation seeds (generation + draw)")
    ap.add_argument("--tasks", type=int, help="first N tasks of each split (default: all held-out tasks)")
    ap.add_argument("--split", nargs="+", help="splits (default: webshop test; alfworld valid_seen valid_unseen)")
    ap.add_argument("--engine", default=None, help="generation engine (default hf)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="engines with a paged KV cache (openvino, vllm) recompute every prompt in full")
    ap.add_argument("--calibration", help="calibration pool JSON (fisher, sparsegpt)")
    ap.add_argument("--build-calibration", metavar="PATH",
                    help="collect the calibration pool from this policy's rollouts on training tasks, write it, exit")
    ap.add_argument("--calibration-size", type=int, default=128, help="sequences in a built pool (App. C: 128)")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (App. C: 0.4)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--max-steps", type=int, help="episode step limit (default: the env's, 15 / 50)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--dtype", default=None, help="auto | float32 | bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow model code from the model folder")
    ap.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    ap.add_argument("--tag", nargs="+", default=[], metavar="KEY=VALUE", help="columns added to every row")
    ap.add_argument("--out", help="write the rows as CSV here")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def config_from_args(args) -> EvalConfig:
    """The :class:`EvalConfig` a command line describes (ValueError on bad input)."""
    import yaml

    tags = {}
    for t in args.tag:
        if "=" not in t:
            raise ValueError(f"--tag: {t!r} must look like KEY=VALUE, e.g. --tag method=sprpo train_seed=0")
        k, v = t.split("=", 1)
        tags[k] = yaml.safe_load(v)  # numbers stay numbers (train_seed=0)
    kw = {"family": args.family, "strengths": tuple(args.strength), "seeds": tuple(args.seeds), "tasks": args.tasks,
          "splits": tuple(args.split) if args.split else None, "calibration": args.calibration,
          "device": args.device, "trust_remote_code": args.trust_remote_code, "cache_dir": args.cache_dir}
    opt = {"env": args.env, "engine": args.engine, "temperature": args.temperature,
           "max_new_tokens": args.max_new_tokens, "max_steps": args.max_steps, "batch_size": args.batch_size,
           "dtype": args.dtype, "prefix_caching": False if args.no_prefix_caching else None}
    kw.update({k: v for k, v in opt.items() if v is not None})
    if args.run:
        if args.model or args.adapter:
            raise ValueError("--run sets the model and adapters; drop --model/--adapter (or drop --run)")
        cfg = config_from_run(args.run, **kw)
        if tags:
            cfg.tags = {**cfg.tags, **tags}
        return cfg
    if not args.model:
        raise ValueError("--model: no model given; expected a HF directory, a cached hub id, smollm2-135m or "
                         "tiny-qwen2 (or --run <training run folder>)")
    kw.update(model=args.model, adapters=tuple(args.adapter), tags=tags)
    kw.setdefault("env", "webshop")
    if args.profile:
        env = kw.pop("env")
        return config_from_profile(args.profile, env, **kw)
    return EvalConfig(**kw)


def _summary(rows) -> str:
    g = rows.groupby(["family", "strength", "split_label", "seed"], sort=False)
    s = g.agg(episodes=("success", "size"), success=("success", "mean"), score=("score", "mean"),
              length=("length", "mean"))
    s["success"] = (100 * s["success"]).round(2)
    return s.round(3).to_string()


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as err:
        ap.error(str(err))
    progress = not args.no_progress
    if args.build_calibration:
        from .envs import make_pool

        if args.calibration_size < 1:
            ap.error("--calibration-size: expected a positive number of sequences (App. C: 128)")
        source = ModelSource(cfg, Path(cfg.cache_dir) / "file_hashes.json")
        pol = source.policy()
        pool = make_pool(cfg.env, cfg.data_dir, cfg.env_seed)
        calib = build_calibration_pool(
            pol, pool, cfg.agent, n=args.calibration_size, temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, max_steps=cfg.max_steps,
            seed=cfg.seeds[0], engine=cfg.engine, progress=progress,
            source={"model": cfg.model, "adapters": list(cfg.adapters), "model_identity": source.identity()})
        save_calibration(args.build_calibration, calib)
        print(f"calibration pool: {len(calib)} sequences, hash {calib.hash[:12]} -> {args.build_calibration}")
        return 0
    try:
        rows = evaluate(cfg, progress=progress)
    except ValueError as err:
        ap.error(str(err))
    if args.out:
        from .manifest import atomic_write_text

        atomic_write_text(args.out, rows.to_csv(index=False))
    print(_summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
