"""Held-out evaluation during training: the same tasks and the same generation seed for
every policy compared (the warm start and the RL-trained policies), at the paper's
validation temperature 0.4 (Table 2).  ``eval.json`` holds the numbers and the settings
they were made with, ``eval_episodes.jsonl`` one line per episode; a warm start's
``agreement.json`` how often it chooses its demonstrator's action, per verb."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from sprpo_lib.agent.engines import close_engine, make_engine
from sprpo_lib.infra.io import (
    CorruptFileError,
    atomic_write_json,
    file_record,
    read_cached,
    read_json,
    read_json_lines,
    verify_file,
)
from sprpo_lib.warmstart.sft import LABEL_VERSIONS, agreement, collect_demonstrations, evaluate_format

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
    whole, one line per episode).  Raises :class:`~sprpo_lib.infra.io.CorruptFileError`
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


def agreement_settings(cfg, count: int) -> dict:
    """What :func:`evaluate_agreement`'s numbers depend on besides the adapter."""
    return {"tasks": count, "demonstrator": cfg.sft.demonstrator, "labels": LABEL_VERSIONS.get(cfg.sft.demonstrator),
            "episode_steps": cfg.sft.episode_steps,
            "max_new_tokens": cfg.rollout.generation.max_new_tokens, "engine": cfg.rollout.engine}


def agreement_is_current(path: Path, cfg, count: int) -> bool:
    """An ``agreement.json`` exists, parses, and was made with the current settings."""
    res = read_cached(path)
    return isinstance(res, dict) and isinstance(res.get("rate"), float) and res.get("settings") == \
        agreement_settings(cfg, count)


def evaluate_agreement(policy, pool, cfg, agent, out: Path, count: int) -> dict:
    """The clone's greedy agreement with its demonstrator (:func:`sprpo_lib.warmstart.sft.agreement`) on
    the demonstrator's own episodes of the held-out tasks of :func:`evaluate_policy`
    (no random actions, the demonstrations' step limit), written to ``out/agreement.json``."""
    t0 = time.perf_counter()
    idx = held_out_tasks(cfg, pool.splits()[cfg.sft.split], count)
    demos = collect_demonstrations(pool, cfg.sft.split, idx, agent, 1.0, cfg.sft.seed,
                                   demonstrator=cfg.sft.demonstrator, max_steps=cfg.sft.episode_steps)
    eng = make_engine(cfg.rollout.engine, policy, replace(cfg.rollout.generation, temperature=0.0), agent)
    try:
        policy.model.eval()
        res = agreement(eng, demos)
    finally:
        close_engine(eng)
    res.update(split=cfg.sft.split, indices=[idx[0], idx[-1]] if idx else [], settings=agreement_settings(cfg, count),
               seconds=round(time.perf_counter() - t0, 2))
    atomic_write_json(out / "agreement.json", res)
    logger.info("warm start agreement with the %s: %.3f of %d states (%s)", cfg.sft.demonstrator, res["rate"],
                res["states"], ", ".join(f"{v} {r['rate']:.2f}" for v, r in res["by_verb"].items()))
    return res
