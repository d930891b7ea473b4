"""Held-out evaluation of a policy: the same tasks and the same generation seed for
every policy compared (the warm start and the RL-trained policies), at the paper's
validation temperature 0.4 (Table 2).  ``eval.json`` holds the numbers and the settings
they were made with; ``eval_episodes.jsonl`` one line per episode."""
from __future__ import annotations

import json
from pathlib import Path

from .manifest import atomic_write_json


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
            "max_steps": cfg.env.max_steps}


def eval_is_current(path: Path, cfg, count: int) -> bool:
    """An ``eval.json`` exists and was made with the current settings and task count."""
    if not path.is_file():
        return False
    res = json.loads(path.read_text())
    return res.get("episodes") == count and all(res.get(k) == v for k, v in eval_settings(cfg).items())


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
                          log_path=out / "eval_episodes.jsonl", progress=progress)
    res.update(split=cfg.sft.split, indices=[idx[0], idx[-1]] if idx else [], **eval_settings(cfg))
    atomic_write_json(out / "eval.json", res)
    return res
