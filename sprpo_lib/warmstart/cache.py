"""The warm start (App. B's supervised stage before RL) and its cache: one folder per (base model,
task pool, prompt format, SFT settings), shared by every method and seed of a profile, built once
(under a lock: stages started together build it once), scored on held-out tasks, and rebuilt,
never loaded, when damaged.  :func:`prepare_warm_start` is the stage; an RL run starts from it with
:func:`load_warm_start`.  ``cfg`` is a :class:`~sprpo_lib.train.config.TrainConfig` (read by
attribute: this layer sits below it)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

from sprpo_lib.agent.envs import GENERATED, data_source, make_pool
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.infra.io import canonical_hash, file_lock, key_fields
from sprpo_lib.infra.paths import runs_dir
from sprpo_lib.model.load import load_policy, resolve_device
from sprpo_lib.model.lora import adapter_is_whole, is_peft, load_adapter, merge_lora
from sprpo_lib.warmstart.dagger import dagger, without_dagger
from sprpo_lib.warmstart.demos import LABEL_VERSIONS
from sprpo_lib.warmstart.heldout import current_agreement, eval_is_current, evaluate_agreement, evaluate_policy
from sprpo_lib.warmstart.sft import warm_start

log = logging.getLogger(__name__)


def warm_start_key(cfg, agent: AgentConfig) -> str:
    """Hash of what the warm start depends on: base model, task pool (the data actually
    used: ``data_dir``, else ``$ALFWORLD_DATA`` / ``$WEBSHOP_DATA``, else generated) and step
    limit (demonstrations and the evaluation), prompt format and SFT settings; not the RL
    settings, so every method and seed of a profile starts from the same cached policy;
    and the demonstrator's label version where it has one (``demos.LABEL_VERSIONS``)."""
    m, e = cfg.model, cfg.env
    source = data_source(e.name, e.data_dir)
    key = {"model": {"spec": m.spec, "dtype": m.dtype},
           "env": {"name": e.name, "seed": e.seed, "data_dir": None if source == GENERATED else source,
                   "max_steps": e.max_steps},
           "agent": key_fields(agent), "sft": key_fields(cfg.sft)}
    if cfg.sft.demonstrator in LABEL_VERSIONS:
        key["labels"] = LABEL_VERSIONS[cfg.sft.demonstrator]
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=list).encode()).hexdigest()[:12]


def warm_start_dir(cfg, agent: AgentConfig | None = None) -> Path:
    """The one folder of a warm start: ``runs/sft/<env>-<key>`` under the project root
    (adapter, ``eval.json``, ``eval_episodes.jsonl``); ``agent`` defaults to the run's."""
    return runs_dir("sft", f"{cfg.env.name}-{warm_start_key(cfg, agent or cfg.rollout.agent)}")


def warm_start_ready(cfg) -> bool:
    """The warm start of ``cfg`` is built (a whole adapter) and scored where ``cfg.sft`` asks
    (a current held-out evaluation and agreement): found without loading a model."""
    out, n = warm_start_dir(cfg), cfg.sft.eval_tasks
    return (adapter_is_whole(out / "adapter") and (not n or eval_is_current(out / "eval.json", cfg, n))
            and (not (n and cfg.sft.agreement) or current_agreement(out / "agreement.json", cfg, n) is not None))


def prepare_warm_start(cfg, progress: bool = True) -> Path:
    """The warm-start stage of ``cfg`` (``warm_start: true``), run before its RL runs: loads the
    base model and the task pool, builds what is missing (:func:`warm_start_policy`) and returns
    the folder.  A prepared one returns at once; ``sprpo-train`` and the notebooks call this."""
    if not warm_start_ready(cfg):
        pool = make_pool(cfg.env.name, cfg.env.data_dir, cfg.env.seed)  # missing data: one error before the model
        policy = load_policy(cfg.model.spec, dtype=cfg.model.dtype, seed=cfg.seed,
                             device=resolve_device(cfg.model.device))
        warm_start_policy(policy, pool, cfg, cfg.rollout.agent, progress)
    return warm_start_dir(cfg)


def load_warm_start(policy, cfg) -> Path:
    """An RL run's starting point (Alg. 1's initial theta): the prepared warm start merged into
    ``policy``'s base weights, frozen, so RL adds its own fresh LoRA on top; one clear error when
    :func:`prepare_warm_start` has not built it."""
    out = warm_start_dir(cfg)
    if not adapter_is_whole(out / "adapter"):
        raise ValueError(f"warm_start: true, but {out} holds no whole warm start; prepare it first with "
                         f"sprpo_lib.warmstart.cache.prepare_warm_start(cfg) (sprpo-train --warm-start-only; "
                         f"sprpo-train and the notebooks do it before training)")
    load_adapter(policy, out / "adapter", merge=True)
    for p in policy.model.parameters():
        p.requires_grad_(False)
    return out


def warm_start_policy(policy, pool, cfg, agent: AgentConfig, progress: bool = True) -> Path:
    """Supervised warm start: behaviour cloning on demonstrations in the exact RL prompt
    format, cached under ``runs/sft/<env>-<key>/``, then merged into the base weights,
    so RL adds its own fresh LoRA on top, as it would on an instruct model.  With
    ``sft.dagger_rounds`` the rounds start from the warm start without them (its own
    cached folder, built first if missing: :func:`sprpo_lib.warmstart.dagger.dagger`)."""

    out = build_warm_start(policy, pool, cfg, agent, progress)
    if not is_peft(policy.model):
        load_adapter(policy, out / "adapter")
    merge_lora(policy)
    for p in policy.model.parameters():
        p.requires_grad_(False)
    with file_lock(out.parent / f".{out.name}.lock"):  # each computed once, then read back
        if cfg.sft.eval_tasks:
            evaluate_policy(policy, pool, cfg, agent, out, cfg.sft.eval_tasks, progress)
        if cfg.sft.eval_tasks and cfg.sft.agreement:
            evaluate_agreement(policy, pool, cfg, agent, out, cfg.sft.eval_tasks)
    return out


def build_warm_start(policy, pool, cfg, agent: AgentConfig, progress: bool) -> Path:
    """The warm start's folder with a whole adapter, trained on ``policy`` when missing (the
    policy then carries it, unmerged); a cached one leaves ``policy`` as it was."""
    out = warm_start_dir(cfg, agent)
    with file_lock(out.parent / f".{out.name}.lock"):  # runs started together (Ray tasks) build it once
        if (out / "adapter").is_dir() and not adapter_is_whole(out / "adapter"):  # a cache: rebuilt, never loaded
            shutil.rmtree(out / "adapter")
            for name in ("eval.json", "eval_episodes.jsonl", "agreement.json"):  # they described the old adapter
                (out / name).unlink(missing_ok=True)
        if (out / "adapter").is_dir():
            return out
        if not cfg.sft.dagger_rounds:
            warm_start(policy, pool, cfg.sft, agent, out, progress, cfg.speed)
            return out
        base = build_warm_start(policy, pool, dataclasses.replace(cfg, sft=without_dagger(cfg.sft)), agent, progress)
        if is_peft(policy.model):  # the base was trained just now: DAgger loads it onto the plain model
            policy.model = policy.model.unload()
        # the rounds live beside the base, keyed by the DAgger settings but their count: more rounds extend fewer
        d = {k: v for k, v in dataclasses.asdict(cfg.sft).items() if k.startswith("dagger_") and k != "dagger_rounds"}
        d |= {"max_new_tokens": cfg.rollout.generation.max_new_tokens, "top_p": cfg.rollout.generation.top_p,
              "engine": cfg.rollout.engine}
        rounds = base / f"dagger-{canonical_hash(d)[:12]}"
        dagger(policy, pool, base, cfg.sft, agent, out, cfg.rollout.generation, cfg.rollout.engine, progress, rounds,
               cfg.speed)
    return out
