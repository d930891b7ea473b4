"""DAgger rounds on top of a finished warm start (Ross et al., 2011): the clone plays,
its demonstrator labels the states it reached (:func:`~sprpo_lib.warmstart.demos.collect_demonstrations`
with ``scripts``), behaviour cloning continues on those labels (``sft.dagger_rounds``)."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from sprpo_lib.agent.engines import GenerationConfig
from sprpo_lib.agent.envs.base import TaskPool
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.core.config import SpeedConfig
from sprpo_lib.infra.hardware import compute_class
from sprpo_lib.infra.io import CorruptFileError, atomic_write_json, file_record, read_cached, read_json, verify_file
from sprpo_lib.model.load import Policy
from sprpo_lib.model.lora import check_adapter, load_adapter, save_adapter
from sprpo_lib.warmstart.demos import Demo, collect_demonstrations, load_demos, save_demos
from sprpo_lib.warmstart.heldout import play
from sprpo_lib.warmstart.sft import SFTConfig, train_sft

log = logging.getLogger(__name__)

__all__ = ["dagger", "dagger_indices", "without_dagger"]


def without_dagger(cfg: SFTConfig) -> SFTConfig:
    """``cfg`` with every DAgger field at its default: the warm start DAgger starts from."""
    dflt = {f.name: f.default for f in fields(SFTConfig) if f.name.startswith("dagger_")}
    return replace(cfg, **dflt)


def dagger_indices(cfg: SFTConfig, r: int, n: int) -> list[int]:
    """The demonstration tasks round ``r`` (1-based) plays: ``dagger_tasks`` of ``0 .. n-1``,
    starting where round ``r - 1`` stopped (wrapping around)."""
    start = (r - 1) * cfg.dagger_tasks
    return [(start + i) % n for i in range(min(cfg.dagger_tasks, n))]


def _round_done(rd: Path) -> dict | None:
    """The record of a finished DAgger round (``round.json``, written last), or None when the
    round is missing, unfinished or damaged (its adapter or labels do not verify)."""
    rec = read_cached(rd / "round.json")
    if not isinstance(rec, dict) or not (rd / "adapter").is_dir():
        return None
    try:
        check_adapter(rd / "adapter")
        verify_file(rd / "demos.jsonl", rec.get("labels") or {})
    except (CorruptFileError, OSError, TypeError, KeyError) as err:
        log.warning("dagger: %s is damaged (%s); the round runs again", rd, err)
        return None
    return rec


def dagger(
    policy: Policy,
    pool: TaskPool,
    base: str | Path,
    cfg: SFTConfig,
    agent: AgentConfig | None = None,
    out_dir: str | Path = "dagger",
    gen=None,
    engine: str = "hf",
    progress: bool = True,
    rounds_dir: str | Path | None = None,
    speed: SpeedConfig | None = None,
) -> dict:
    """DAgger (Ross et al., 2011) from a finished warm start ``base`` (its ``adapter/`` and
    ``demos.jsonl``), ``cfg.dagger_rounds`` rounds; each round:

    1. the current clone plays :func:`dagger_indices` at ``cfg.dagger_temperature``
       (:func:`~sprpo_lib.warmstart.heldout.play`, RL's rollout path and ``engine``; ``gen`` gives the other
       generation settings; the step limit is ``cfg.episode_steps`` or the pool's);
    2. :func:`~sprpo_lib.warmstart.demos.collect_demonstrations` replays each episode and the demonstrator labels
       every state the clone reached (``scripts``);
    3. :func:`train_sft` (speed levers ``speed``) continues the clone's adapter on those labels plus
       ``cfg.dagger_replay`` times as many earlier demonstrations.

    ``policy`` is a fresh base model (the adapter of ``base``, or of the last finished
    round, is loaded onto it).  Round ``r`` lives in ``rounds_dir/round-<r>/`` (default
    ``out_dir``; the clone's episodes, the labels, the adapter, ``round.json`` last): a
    killed run resumes after its last finished round, and within a round from
    :func:`train_sft`'s resume point; a run with more rounds in the same ``rounds_dir``
    continues where one with fewer stopped (round ``r`` does not depend on the count).
    The final adapter goes to ``out_dir/adapter``; returns the summary also written to
    ``out_dir/sft_summary.json``, whose ``seconds`` include the base warm start's."""
    if cfg.dagger_rounds < 1:
        raise ValueError("sft.dagger_rounds: dagger() needs at least one round; without, the base warm start is the "
                         "result")
    agent = agent or AgentConfig()
    if agent.max_prompt_tokens:
        raise ValueError("sft.dagger_rounds: DAgger relabels the prompts the clone was shown, which needs "
                         "rollout.agent.max_prompt_tokens: null (demonstrations are built without a prompt budget)")
    base, out = Path(base), Path(out_dir)
    rdir = Path(rounds_dir) if rounds_dir is not None else out
    n = min(cfg.n_tasks, pool.splits()[cfg.split])
    gen = gen or GenerationConfig()
    base_summary = read_json(base / "sft_summary.json")
    seen = load_demos(base / "demos.jsonl")
    rounds, last = [], 0
    for r in range(1, cfg.dagger_rounds + 1):
        rec = _round_done(rdir / f"round-{r}")
        if rec is None:
            break
        rounds.append(rec)
        seen += load_demos(rdir / f"round-{r}" / "demos.jsonl")
        last = r
    load_adapter(policy, (rdir / f"round-{last}" if last else base) / "adapter", trainable=True)
    for r in range(last + 1, cfg.dagger_rounds + 1):
        rec, new = _dagger_round(policy, pool, cfg, agent, gen, engine, progress, rdir / f"round-{r}", r, n, seen,
                                 speed)
        rounds.append(rec)
        seen += new
    b = base_summary.get("result") or {}
    result = {"adapter": str(save_adapter(policy, out / "adapter")), "base": str(base), "rounds": rounds,
              "demos": len(seen), "final_loss": rounds[-1]["sft"]["final_loss"],
              "steps": (b.get("steps") or 0) + sum(x["sft"]["steps"] for x in rounds),
              "seconds": round(float(b.get("seconds") or 0.0) + float((b.get("collect") or {}).get("seconds") or 0.0)
                               + sum(x["seconds"] for x in rounds), 2)}
    machines = {b.get("machine"), (b.get("collect") or {}).get("machine"), *(x.get("machine") for x in rounds)}
    if len(machines) == 1 and None not in machines:  # one class measured every part: the seconds name it
        result["machine"] = machines.pop()
    atomic_write_json(out / "sft_summary.json", {"config": asdict(cfg), "agent": asdict(agent), "result": result,
                                                  "model": policy.spec})
    policy.meta["sft"] = {k: result[k] for k in ("steps", "demos", "final_loss")}
    return result


def _dagger_round(policy: Policy, pool: TaskPool, cfg: SFTConfig, agent: AgentConfig, gen, engine: str,
                  progress: bool, rd: Path, r: int, n: int, seen: list[Demo],
                  speed: SpeedConfig | None = None) -> tuple[dict, list[Demo]]:
    """Round ``r`` of :func:`dagger` in ``rd`` (steps 1-3 there): its record (``round.json``,
    written last) and its new demonstrations."""
    t0 = time.perf_counter()
    tasks = dagger_indices(cfg, r, n)
    g = replace(gen, temperature=cfg.dagger_temperature, seed=cfg.seed + r)
    (rd / "episodes.jsonl").unlink(missing_ok=True)
    episodes, _ = play(policy, pool, cfg.split, tasks, agent, g, max_steps=cfg.episode_steps,
                       log_path=rd / "episodes.jsonl", progress=progress, engine=engine)
    played = time.perf_counter() - t0
    scripts = {e.task_index: [(s.prompt, s.action) for s in e.steps] for e in episodes}
    stats: dict = {}
    new = collect_demonstrations(pool, cfg.split, tasks, agent, demonstrator=cfg.demonstrator,
                                 max_steps=cfg.episode_steps, stats=stats, scripts=scripts)
    rng = random.Random(f"dagger:{cfg.seed}:{r}")
    replay = rng.sample(seen, min(len(seen), round(cfg.dagger_replay * len(new))))
    res = train_sft(policy, new + replay, cfg, rd, progress, agent, speed)
    save_demos(rd / "demos.jsonl", new)
    rec = {"round": r, "tasks": [tasks[0], tasks[-1]], "temperature": cfg.dagger_temperature,
           "clone_success_rate": sum(e.success for e in episodes) / max(1, len(episodes)),
           "labels": file_record(rd / "demos.jsonl"), "new": len(new), "replay": len(replay),
           "disagree_rate": stats["disagree"] / max(1, len(new)), "expert_none": stats["expert_none"],
           "play_s": round(played, 2), "sft": {k: res[k] for k in ("steps", "first_loss", "final_loss", "seconds")},
           "seconds": round(time.perf_counter() - t0, 2), "machine": compute_class()}
    atomic_write_json(rd / "round.json", rec)
    log.info("dagger round %d: clone success %.3f, %d labels (%.0f%% differ from the clone's action)", r,
             rec["clone_success_rate"], len(new), 100 * rec["disagree_rate"])
    return rec, new
