"""A policy plays tasks on RL's rollout path and is scored (:func:`play`, :func:`evaluate_format`,
:func:`agreement`); held-out evaluation during training: the same tasks and the same generation seed for
every policy compared (the warm start and the RL-trained policies), at the paper's
validation temperature 0.4 (Table 2).  ``eval.json`` holds the numbers and the settings
they were made with, ``eval_episodes.jsonl`` one line per episode; a warm start's
``agreement.json`` how often it chooses its demonstrator's action, per verb."""
from __future__ import annotations

import logging
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Sequence

from sprpo_lib.agent.engines import GenerationConfig, close_engine, make_engine
from sprpo_lib.agent.envs.base import TaskPool
from sprpo_lib.agent.play import playing
from sprpo_lib.agent.prompt import AgentConfig, extract_action, parse_actions
from sprpo_lib.infra.hardware import compute_class
from sprpo_lib.infra.io import (
    CorruptFileError,
    atomic_write_json,
    file_record,
    read_cached,
    read_json,
    read_json_lines,
    verify_file,
)
from sprpo_lib.model.load import Policy
from sprpo_lib.warmstart.demos import LABEL_VERSIONS, Demo, collect_demonstrations, label_verb

logger = logging.getLogger(__name__)

# ============================================================================ playing and scoring a policy
def play(policy: Policy, pool: TaskPool, split: str, indices: Iterable[int], agent: AgentConfig | None = None,
         gen=None, group_size: int = 1, max_steps: int | None = None, log_path: str | Path | None = None,
         progress: bool = True, engine: str = "hf") -> tuple[list, dict]:
    """``policy`` plays the tasks through :func:`rollout.run_groups` with the generation
    ``engine`` (the code path of RL rollouts; ``gen`` defaults to temperature 0.4, the
    paper's validation temperature); returns the episode records and timing stats."""
    with playing(policy, pool, engine, gen or GenerationConfig(temperature=0.4), agent or AgentConfig(),
                 max_steps) as run:
        return run([(split, i) for i in indices], group_size, log_path, progress)


def admissible_from_prompt(prompt: str) -> list[str]:
    """The "Available actions" list of an agent prompt."""
    try:
        block = prompt.split("Available actions:\n", 1)[1].split("\n\nResponse:", 1)[0]
    except IndexError:
        return []
    return parse_actions(block)


_TEMPLATE_RE = re.compile(r"^(\w+)\[<[^\]]*>\]$")  # e.g. WebShop's "search[<your query>]"


def is_admissible(action: str, admissible: Sequence[str]) -> bool:
    if action in admissible:
        return True
    for a in admissible:  # a template "name[<...>]" admits any "name[...]"
        m = _TEMPLATE_RE.match(a)
        if m and action.startswith(m.group(1) + "[") and action.endswith("]") and len(action) > len(m.group(1)) + 2:
            return True
    return False


def evaluate_format(
    policy: Policy,
    pool: TaskPool,
    split: str,
    indices: Iterable[int],
    agent: AgentConfig | None = None,
    gen=None,
    group_size: int = 1,
    max_steps: int | None = None,
    log_path: str | Path | None = None,
    progress: bool = True,
    engine: str = "hf",
) -> dict:
    """Success, score and response-format statistics of ``policy`` on tasks.

    Plays the tasks with :func:`play` (:func:`rollout.run_groups` and the generation
    ``engine``, :func:`sprpo_lib.agent.engines.make_engine`), the code path of RL rollouts.

    Args:
        gen: a :class:`~sprpo_lib.agent.engines.GenerationConfig` (default: temperature 0.4, the paper's
            validation temperature).
        log_path: optional :class:`rollout.EpisodeLog` JSONL of the episodes.

    Returns:
        ``episodes``, ``success_rate``, ``mean_score``, ``valid_rate`` (share of steps
        whose response has a valid ``<action>`` block), ``admissible_rate`` (share of
        steps whose action is one of the listed admissible actions, a template such as
        ``search[<your query>]`` admitting any argument), ``all_valid_rate`` (share of
        episodes with every response valid), ``first_valid_rate`` (first step valid),
        ``mean_length``, ``steps``, ``generate_s``, ``env_s``, ``seconds``.
    """
    t0 = time.perf_counter()
    episodes, st = play(policy, pool, split, indices, agent, gen, group_size, max_steps, log_path, progress, engine)
    steps = [s for e in episodes for s in e.steps]
    n_ep, n_st = max(1, len(episodes)), max(1, len(steps))
    return {
        "episodes": len(episodes),
        "success_rate": sum(e.success for e in episodes) / n_ep,
        "mean_score": sum(e.score for e in episodes) / n_ep,
        "valid_rate": sum(s.valid for s in steps) / n_st,
        "admissible_rate": sum(s.valid and is_admissible(s.action, admissible_from_prompt(s.prompt))
                               for s in steps) / n_st,
        "all_valid_rate": sum(all(s.valid for s in e.steps) for e in episodes) / n_ep,
        "first_valid_rate": sum(bool(e.steps) and e.steps[0].valid for e in episodes) / n_ep,
        "mean_length": len(steps) / n_ep,
        "steps": len(steps),
        "generate_s": round(st["generate_s"], 2),
        "env_s": round(st["env_s"], 2),
        "seconds": round(time.perf_counter() - t0, 2),
        "machine": compute_class(),
    }


#: Prompts per generate call of :func:`agreement` (a few hundred states would otherwise be one
#: call, longer than an OpenVINO worker's first-call deadline on 2 cores).
AGREEMENT_CHUNK = 64


def agreement(generate, demos: Sequence[Demo]) -> dict:
    """How often a clone's action equals its demonstrator's on the demonstrator's own
    states (held-out games), overall and per verb (:func:`~sprpo_lib.warmstart.demos.label_verb` of the label).

    ``generate`` maps prompts to :class:`~sprpo_lib.agent.engines.Generation` records (an engine,
    greedy for a clone's preferred action).  A success rate over a few dozen games cannot
    tell a clone that walks well but never takes the task's object from one that wanders;
    the per-verb agreement on a few hundred states can.  Returns ``states``, ``agree``,
    ``rate`` and ``by_verb`` ({verb: the same three})."""
    outs = []  # in chunks: an engine's first call has a fixed deadline, later ones scale with the measured speed
    for i in range(0, len(demos), AGREEMENT_CHUNK):
        outs += generate([d.prompt for d in demos[i:i + AGREEMENT_CHUNK]])
    if len(outs) != len(demos):
        raise RuntimeError(f"agreement: the generator returned {len(outs)} responses for {len(demos)} prompts")
    counts: dict[str, list[int]] = {}
    for d, o in zip(demos, outs):
        c = counts.setdefault(label_verb(d.response), [0, 0])
        c[0] += 1
        mine, theirs = extract_action(o.text), extract_action(d.response)
        c[1] += int(mine.valid and mine.action == theirs.action)

    def rec(n: int, k: int) -> dict:
        return {"states": n, "agree": k, "rate": k / n if n else 0.0}

    return {**rec(sum(n for n, _ in counts.values()), sum(k for _, k in counts.values())),
            "by_verb": {v: rec(n, k) for v, (n, k) in sorted(counts.items())}}


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


def current_eval(path: Path, cfg, count: int) -> dict | None:
    """The ``eval.json`` at ``path`` when it is whole (:func:`load_eval`; a corrupt one is not
    current, so it is recomputed) and was made with the current settings and task count."""
    want = {"episodes": count, **eval_settings(cfg)}
    res = read_cached(path, load_eval)
    return res if res is not None and all(res.get(k) == v for k, v in want.items()) else None


def eval_is_current(path: Path, cfg, count: int) -> bool:
    """:func:`current_eval` finds a current evaluation at ``path``."""
    return current_eval(path, cfg, count) is not None


def evaluate_policy(policy, pool, cfg, agent, out: Path, count: int, progress: bool = True) -> dict:
    """Success and score of ``policy`` on ``count`` held-out tasks (:func:`held_out_tasks`),
    one rollout each at :func:`eval_temperature` with the generation seed ``cfg.sft.seed``;
    written to ``out/eval.json`` and ``out/eval_episodes.jsonl`` (a killed evaluation
    starts over).  A current one there (:func:`current_eval`) is returned as it is."""
    res = current_eval(out / "eval.json", cfg, count)
    if res is not None:
        return res
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


def current_agreement(path: Path, cfg, count: int, settings: dict | None = None) -> dict | None:
    """The ``agreement.json`` at ``path`` when it parses and was made with the current settings
    (``settings``: :func:`agreement_settings` of ``cfg`` and ``count``, when the caller has them)."""
    want = agreement_settings(cfg, count) if settings is None else settings
    res = read_cached(path)
    ok = isinstance(res, dict) and isinstance(res.get("rate"), float) and res.get("settings") == want
    return res if ok else None


def evaluate_agreement(policy, pool, cfg, agent, out: Path, count: int) -> dict:
    """The clone's greedy agreement with its demonstrator (:func:`agreement`) on
    the demonstrator's own episodes of the held-out tasks of :func:`evaluate_policy`
    (no random actions, the demonstrations' step limit), written to ``out/agreement.json``;
    a current one there (:func:`current_agreement`) is returned as it is."""
    settings = agreement_settings(cfg, count)
    res = current_agreement(out / "agreement.json", cfg, count, settings)
    if res is not None:
        return res
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
    res.update(split=cfg.sft.split, indices=[idx[0], idx[-1]] if idx else [], settings=settings,
               seconds=round(time.perf_counter() - t0, 2))
    atomic_write_json(out / "agreement.json", res)
    logger.info("warm start agreement with the %s: %.3f of %d states (%s)", cfg.sft.demonstrator, res["rate"],
                res["states"], ", ".join(f"{v} {r['rate']:.2f}" for v, r in res["by_verb"].items()))
    return res
