"""RL training of LLM agents: GiGPO advantages + PPO with LoRA, for every method in
:mod:`sprpo_lib.core.methods` (App. B "Training Details", Algs. 1-4).

    sprpo-train --env webshop --method sprpo --profile cpu --seed 0   # = python -m sprpo_lib.train
    sprpo-train --profile smoke method.rho=0.1 rollout.group_size=4

One iteration k (Alg. 1) is :meth:`Trainer.collect` then :meth:`Trainer.update`:

1. the method gives xi_k (Gaussian / SPrPO: drawn from a generator seeded by (seed,
   k); Vanilla / SAM: none), held fixed for the whole rollout and update;
2. ``tasks_per_step`` training tasks (seeded by (seed, k)) are played ``group_size``
   times each under pi^xi (GiGPO groups), in one vectorised rollout;
3. GiGPO advantages per step (:func:`sprpo_lib.core.batch.build_batch`);
4. the method's update (:meth:`sprpo_lib.core.methods.Method.update`);
5. metrics (JSON line), the iteration's episodes (JSON lines) and a checkpoint.

A killed run restarts from its last checkpoint with the same command and continues
exactly as an uninterrupted run (everything random is a function of (seed, k)).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import shutil
import sys
import time
from functools import partial
from pathlib import Path

import torch

from sprpo_lib.agent.engines import close_engine, effective_weights, make_engine
from sprpo_lib.agent.envs import GENERATED, DataError, data_header, data_source, make_pool
from sprpo_lib.agent.prompt import AgentConfig, token_counter
from sprpo_lib.agent.rollout import EpisodeLog, ProcessEnvs, SerialEnvs, episode_groups, run_groups, score_spread
from sprpo_lib.core import metrics as MK
from sprpo_lib.core.actor import Actor
from sprpo_lib.core.batch import build_batch
from sprpo_lib.core.methods import make_method
from sprpo_lib.core.perturb import xi_stats
from sprpo_lib.infra.hardware import compute_class, keep_freed, measured_peak, set_allocator, set_threads
from sprpo_lib.infra.io import (
    JsonLines,
    as_disk_full,
    atomic_dir,
    atomic_write_json,
    atomic_write_text,
    file_lock,
    read_cached,
)
from sprpo_lib.infra.manifest import git_commit
from sprpo_lib.infra.paths import project_path, runs_dir
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.infra.tracking import Tracking
from sprpo_lib.model.load import load_policy, resolve_device
from sprpo_lib.model.lora import adapter_is_whole, adapter_nbytes, add_lora, lora_on_last_layers, save_peft
from sprpo_lib.train.checkpoint import load_checkpoint, save_checkpoint
from sprpo_lib.train.config import TrainConfig, config_dict, load_config, moved_levers
from sprpo_lib.warmstart.cache import load_warm_start, prepare_warm_start
from sprpo_lib.warmstart.heldout import eval_is_current, evaluate_policy

log = logging.getLogger(__name__)

__all__ = ["Trainer", "train", "load_config", "TrainConfig", "default_out_dir", "run_folder", "main"]


class Trainer:
    """The policy, actor, method, generator and environments of one run, kept in the
    folder ``out`` (:func:`run_folder`)."""

    def __init__(self, cfg: TrainConfig, out: Path, progress: bool = True):
        self.cfg = cfg
        self.progress = progress
        set_threads(cfg.threads)
        set_allocator(cfg.allocator)
        if cfg.speed.replay_graph_gb:  # the replay's kept graph, every iteration: its pages stay mapped
            keep_freed(cfg.speed.replay_graph_gb + 1)
        self.out = Path(out)
        # the environment first: missing or damaged data is one error before the model loads
        factory = partial(make_pool, cfg.env.name, cfg.env.data_dir, cfg.env.seed)
        self.envs = ProcessEnvs(factory, cfg.env.workers) if cfg.env.workers else SerialEnvs(factory)
        self.pool = self.envs.pool
        self.policy = load_policy(cfg.model.spec, dtype=cfg.model.dtype, seed=cfg.seed,
                                  device=resolve_device(cfg.model.device))
        self.agent: AgentConfig = cfg.rollout.agent
        if cfg.warm_start:
            self.warm_start_dir = load_warm_start(self.policy, cfg)  # prepared before: prepare_warm_start
        if cfg.model.init_adapter:
            from peft import PeftModel  # heavy: loaded on first use

            self.policy.model = PeftModel.from_pretrained(self.policy.model, cfg.model.init_adapter, is_trainable=True)
        else:
            add_lora(self.policy, lora_on_last_layers(self.policy.model, cfg.model.lora, cfg.model.lora_layers),
                     seed=cfg.seed)
        self.model = self.policy.model
        self.gen = make_engine(cfg.rollout.engine, self.policy, dataclasses.replace(cfg.rollout.generation, seed=cfg.seed),
                               self.agent)
        self.count_tokens = token_counter(self.policy.tokenizer, self.agent)
        u = cfg.update
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=u.lr, betas=u.betas, weight_decay=u.weight_decay)
        self.actor = Actor(self.model, self.policy.tokenizer.pad_token_id, opt, u, cfg.speed)
        self.shape = self.actor.shape
        self.method = make_method(cfg.method, self.shape, cfg.seed)

    @property
    def dtype(self) -> str:
        return str(self.policy.dtype).replace("torch.", "")

    def sample_tasks(self, k: int, rnd: int = 0) -> list[tuple[str, int]]:
        """The training tasks of iteration ``k`` (refill round ``rnd``), a function of (seed, k, rnd)."""
        split = self.cfg.env.split
        n = self.pool.splits()[split]
        rng = random.Random(f"tasks/{self.cfg.seed}/{k}" + (f"/{rnd}" if rnd else ""))
        m = self.cfg.rollout.tasks_per_step
        idx = rng.sample(range(n), m) if m <= n else [rng.randrange(n) for _ in range(m)]
        return [(split, i) for i in idx]

    def collect(self, k: int):
        """Alg. 1 lines 3-5: xi_k from the method, then the rollouts of iteration ``k``
        under pi^xi, refilled (``rollout.refill_rounds``) with new tasks while fewer than
        ``tasks_per_step`` groups have a score spread.  Returns ``(episodes, xi, stats)``:
        the episodes of the batch (groups numbered in order), and in ``stats`` the episodes
        played but dropped (``dropped``), the rounds played and the groups with a spread."""
        xi = self.method.rollout_xi(k)
        self.actor.fc.set(xi=xi)
        t0 = time.perf_counter()
        rc = self.cfg.rollout
        st: dict = {}
        with self.actor.fc:
            if getattr(self.gen, "own_weights", False):  # an engine with its own weights: theta_k and xi_k now
                self.gen.load_weights(effective_weights(self.model))
            rounds: list[list[list]] = []  # per round, its groups of episodes
            for rnd in range(rc.refill_rounds + 1):
                self.gen.cfg.seed = self.cfg.seed * 100_003 + k + 1_000_003 * rnd
                self.gen.calls = 0
                episodes, got = run_groups(self.envs, self.sample_tasks(k, rnd), rc.group_size, self.gen,
                                           self.agent, self.cfg.env.max_steps, progress=self.progress,
                                           count_tokens=self.count_tokens)
                st = {k2: st.get(k2, 0) + v for k2, v in got.items()}
                rounds.append(episode_groups(episodes))
                spread = [g for r in rounds for g in r if score_spread(g)]
                if not rc.refill_rounds or len(spread) >= rc.tasks_per_step:
                    break
        self.actor.fc.clear()
        # the batch: every group of a single round; with refills the first tasks_per_step groups
        # whose scores differ (none: the first round's, whose update then has no episode signal)
        groups = rounds[0] if not rc.refill_rounds else (spread[:rc.tasks_per_step] or rounds[0])
        chosen = {id(e) for g in groups for e in g}
        kept = [dataclasses.replace(e, group=i) for i, g in enumerate(groups) for e in g]
        st.update(rollout_s=time.perf_counter() - t0, rounds=len(rounds),
                  groups_with_spread=sum(1 for g in groups if score_spread(g)),
                  dropped=[e for r in rounds for g in r for e in g if id(e) not in chosen])
        return kept, xi, st

    def update(self, batch, xi, k: int) -> dict:
        """Alg. 1 lines 6-7 (the method's update) on ``batch``; timings in the stats."""
        self.actor.timers = {MK.UPDATE_S: 0.0, MK.SENSITIVITY_S: 0.0}
        st = self.method.update(self.actor, batch, k, xi) if batch.samples else {"skipped": 1.0}
        return {**st, **{k2: round(v, 3) for k2, v in self.actor.timers.items()}}

    def iteration(self, k: int) -> dict:
        cfg = self.cfg
        t0, cpu0 = time.perf_counter(), time.process_time()
        eng0 = dict(getattr(self.gen, "stats", {}))  # engine counters (retries, worker CPU) before the iteration
        sig = self.method.sigma_stats()
        mem: dict = {}  # peak memory per phase
        with measured_peak(self.actor.device, mem, "rollout"):
            episodes, xi, rst = self.collect(k)
        batch, adv_stats = build_batch(episodes, cfg.update.adv, cfg.update.estimator)
        with measured_peak(self.actor.device, mem, "update"):
            ustats = self.update(batch, xi, k)  # the update and the method's extra pass (replay, SAM's gradient)
        played = episodes + rst["dropped"]  # the rollout's statistics: every episode played this iteration
        n = len(played)
        steps = [s for e in played for s in e.steps]
        cap = cfg.rollout.generation.max_new_tokens
        m = {
            MK.ITERATION: k,
            MK.SUCCESS: sum(e.success for e in played) / n,
            MK.SCORE: sum(e.score for e in played) / n,
            MK.VALID_RATE: sum(s.valid for e in played for s in e.steps) / max(1, sum(e.length for e in played)),
            "episode_length": sum(e.length for e in played) / n,
            # dynamic sampling (rollout.refill_rounds): rounds played, the batch's groups whose scores
            # differ, episodes played but left out; and whether the update had any signal at all
            MK.ROLLOUT_ROUNDS: rst["rounds"],
            "groups_with_spread": rst["groups_with_spread"],
            MK.EPISODES_DROPPED: len(rst["dropped"]),
            MK.UPDATED: float(any(s.adv != 0.0 for s in batch.samples)),
            MK.SAMPLES: len(batch.samples),
            "response_tokens": batch.n_tokens,
            MK.ROLLOUT_S: round(rst["rollout_s"], 3),
            MK.GENERATE_S: round(rst["generate_s"], 3),
            MK.ENV_S: round(rst["env_s"], 3),
            # rollout health: responses cut at max_new_tokens (no closing tag can follow)
            "truncated_frac": sum(len(s.response_ids) >= cap for s in steps) / max(1, len(steps)),
            **{f"xi_{k2}": v for k2, v in sig.items()},
            **{f"xi_real_{k2}": v for k2, v in xi_stats(xi).items()},
            **adv_stats,
            **{k2: v for k2, v in ustats.items() if isinstance(v, (int, float))},
            **mem,  # peak memory per phase: rollout_/update_ peak_rss_gib; on CUDA peak_cuda_gib and peak_cuda_reserved_gib
        }
        m[MK.WALL_S] = round(time.perf_counter() - t0, 3)
        m[MK.MACHINE] = compute_class()
        # contention check: this process's CPU seconds per wall second (about the thread count
        # when the machine is quiet) and the 1-minute load average of the machine
        # (an engine's worker process counts: its CPU seconds are in the engine's stats)
        eng = getattr(self.gen, "stats", {})
        worker_cpu = eng.get("worker_cpu_s", 0.0) - eng0.get("worker_cpu_s", 0.0)
        m["cpu_per_wall"] = round((time.process_time() - cpu0 + worker_cpu) / max(m[MK.WALL_S], 1e-9), 3)
        # engine calls past their deadline, abandoned and repeated (OpenVINOEngine)
        m["engine_retries"] = eng.get("retries", 0) - eng0.get("retries", 0)
        m["loadavg_1min"] = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
        if cfg.log_episodes:
            path = self.out / "episodes" / f"iter_{k:05d}.jsonl"
            path.unlink(missing_ok=True)
            EpisodeLog(path).write(episodes)
            if rst["dropped"]:  # played but left out of the batch by dynamic sampling
                path = path.with_name(f"iter_{k:05d}_dropped.jsonl")
                path.unlink(missing_ok=True)
                EpisodeLog(path).write(rst["dropped"])
        return m

    def held_out(self, k: int) -> dict:
        """The held-out evaluation after iteration ``k`` (``cfg.eval_every``), made once and
        kept in ``heldout/iter_<k>/``; the training's random streams are left as they were,
        so a run with the curve trains exactly as one without it."""
        out = heldout_dir(self.out, k)
        out.mkdir(parents=True, exist_ok=True)
        py_state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            res = evaluate_policy(self.policy, self.pool, self.cfg, self.agent, out, self.cfg.eval_tasks, self.progress)
        random.setstate(py_state)
        return {MK.HELDOUT_SUCCESS: res["success_rate"], "heldout_score": res["mean_score"],
                "heldout_valid_rate": res["valid_rate"], MK.HELDOUT_S: res.get("seconds")}

    def save(self, k: int) -> Path:
        return save_checkpoint(self.out, k, self.model, self.actor.opt, self.method, self.cfg, {"dtype": self.dtype})

    def resume(self) -> int | None:
        """Load the latest checkpoint if any; returns its iteration.  A run is never
        continued in another dtype than it was trained in (``dtype: auto`` can choose
        differently on another machine): that is an error saying how to proceed."""
        got = load_checkpoint(self.out, self.model, self.actor.opt, self.method, self.cfg)
        if got is None:
            return None
        k, state = got
        saved = state.get("dtype")
        if saved and saved != self.dtype:
            raise ValueError(f"{self.out} was trained in {saved}; this machine loaded the model in {self.dtype} "
                             f"(model.dtype={self.cfg.model.dtype!r}). Resume with the override model.dtype={saved} "
                             f"(slower here, same numerics) or start a new run with --fresh")
        return k


def heldout_due(cfg: TrainConfig) -> list[int]:
    """The iterations after which ``cfg.eval_every`` scores the policy on held-out tasks."""
    e = cfg.eval_every
    return [k for k in range(cfg.iterations) if e and (k + 1) % e == 0]


def heldout_dir(out: Path, k: int) -> Path:
    """Where the held-out evaluation after iteration ``k`` of the run in ``out`` is kept."""
    return Path(out) / "heldout" / f"iter_{k:05d}"


def default_out_dir(cfg: TrainConfig) -> Path:
    """A run's folder: ``runs/train/<env>-<method>-<profile>-seed<seed>`` under the project root."""
    return runs_dir("train", f"{cfg.env.name}-{cfg.method.name}-{cfg.profile}-seed{cfg.seed}")


def run_folder(cfg: TrainConfig, out_dir: str | Path | None = None) -> Path:
    """The folder of the run of ``cfg``: ``out_dir`` (a relative one under the project
    root), else ``cfg.out_dir``, else :func:`default_out_dir`."""
    return project_path(out_dir or cfg.out_dir or default_out_dir(cfg))


def _publish_adapter(model, final: Path) -> None:
    with atomic_dir(final, adapter_nbytes(model)) as tmp:
        save_peft(model, tmp / "adapter")


def is_complete(cfg: TrainConfig, out: Path, record: dict | None = None) -> bool:
    """``out`` holds a finished run of exactly ``cfg``: same config, every iteration
    logged, the final adapter published and (when asked for) its held-out evaluation
    current.  Such a run is found without loading a model (``record``: ``config_dict(cfg)``
    when the caller has it)."""
    return _run_state(cfg, out, config_dict(cfg) if record is None else record)[0]


def _run_state(cfg: TrainConfig, out: Path, record: dict) -> tuple[bool, dict]:
    """(:func:`is_complete`, the run's stored ``config.json``: ``{}`` when there is none or it is damaged)."""
    meta, metrics = out / "config.json", out / "metrics.jsonl"
    evals = [heldout_dir(out, k) / "eval.json" for k in heldout_due(cfg)]  # the held-out curve, then the final
    evals += [out / "final" / "eval.json"] if cfg.eval_tasks else []
    whole = metrics.is_file() and adapter_is_whole(out / "final" / "adapter")
    saved = read_cached(meta) if meta.is_file() else None  # a damaged config.json: not complete (train() rewrites it)
    saved = saved if isinstance(saved, dict) else {}
    if not (saved and whole):
        return False, saved
    if moved_levers(saved.get("config") or {}) != record:
        return False, saved
    if saved.get("data", GENERATED) != data_source(cfg.env.name, cfg.env.data_dir):  # other data: not this run
        return False, saved
    done = {row.get(MK.ITERATION) for row in JsonLines(metrics).read_rows()}
    current = all(eval_is_current(e, cfg, cfg.eval_tasks) for e in evals)
    return done == set(range(cfg.iterations)) and current, saved


def train(cfg: TrainConfig, out_dir: str | Path | None = None, fresh: bool = False, progress: bool = True) -> Path:
    """Run (or resume, or extend) training; returns the output folder.  With ``cfg.warm_start`` the
    run starts from the prepared warm start (:func:`~sprpo_lib.warmstart.cache.prepare_warm_start`)."""
    record = config_dict(cfg)  # what config.json and every checkpoint of this run record
    out = run_folder(cfg, out_dir)
    if not fresh and _run_state(cfg, out, record)[0]:  # nothing to do: found without loading the model
        return out
    with file_lock(out.parent / f".{out.name}.lock"):  # one process per run folder at a time
        done, old = (False, {}) if fresh else _run_state(cfg, out, record)
        if done:  # finished by the process that held the lock
            return out
        return _train(cfg, out, fresh, progress, record, old)


def _train(cfg: TrainConfig, out: Path, fresh: bool, progress: bool, record: dict, old: dict) -> Path:
    """Train into ``out``; ``old``: the ``config.json`` a run there stored (``{}`` when none or ``fresh``)."""
    source = data_source(cfg.env.name, cfg.env.data_dir)
    if old and old.get("data", GENERATED) != source:  # a run never mixes two task pools
        raise ValueError(f"{out} was trained on {cfg.env.name} data {old.get('data', GENERATED)}, and this command "
                         f"would continue it on {source}; pass --out <another folder> (or --fresh to start over)")
    tr = Trainer(cfg, out, progress)
    if progress:  # the data the run plays, once the pool has opened (a data error is one message before it)
        print(data_header(cfg.env.name, cfg.env.data_dir), file=sys.stderr)
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": record, "data": tr.pool.data_source, "commit": git_commit(), "dtype": tr.dtype,
            "dtype_probe": tr.policy.meta.get("dtype_probe"), "logger": list(cfg.logger)}
    if old:  # resumed / extended / re-entered: keep the commit the run started at
        meta["commit"] = old.get("commit", meta["commit"])
        meta["entered_at"] = list(dict.fromkeys(old.get("entered_at", []) + [git_commit()]))
    atomic_write_json(out / "config.json", meta)
    tracker = None
    try:
        done = tr.resume()
        start = 0 if done is None else done + 1
        # metrics.jsonl and the other loggers, iterations after the checkpoint dropped
        tracker = Tracking(cfg.logger, out, start=start, config=meta["config"])
        bar = progress_bar(range(start, cfg.iterations), desc=f"train {cfg.method.name}", disable=not progress,
                           initial=start, total=cfg.iterations)
        due = set(heldout_due(cfg))
        for k in bar:
            m = tr.iteration(k)
            if k in due:  # before the checkpoint: a run killed here repeats iteration k, then evaluates
                m.update(tr.held_out(k))
            tracker.log(m, step=k)
            tr.save(k)
            bar.set_postfix(success=f"{m['success']:.2f}", valid=f"{m['valid_rate']:.2f}", last_s=f"{m['wall_s']:.0f}")
        if start and start - 1 in due:  # resumed a finished run whose last evaluation was missing
            tr.held_out(start - 1)
        lost = [k for k in due if k < start - 1 and not eval_is_current(heldout_dir(out, k) / "eval.json", cfg,
                                                                           cfg.eval_tasks)]
        if lost:  # eval_every set after these iterations ran: their policies are no longer kept
            log.warning("%s: no held-out evaluation after iteration(s) %s and their policies are gone; rerun with "
                        "--fresh for the whole curve", out, lost)
        final = out / "final"
        if start < cfg.iterations or not adapter_is_whole(final / "adapter"):  # (re)written with its eval dropped
            _publish_adapter(tr.model, final)
        last = heldout_dir(out, cfg.iterations - 1)
        if cfg.eval_tasks and not eval_is_current(final / "eval.json", cfg, cfg.eval_tasks):
            if cfg.iterations - 1 in due and eval_is_current(last / "eval.json", cfg, cfg.eval_tasks):
                for name in ("eval_episodes.jsonl", "eval.json"):  # the same policy, tasks and seed: its numbers
                    atomic_write_text(final / name, (last / name).read_text())
            else:
                evaluate_policy(tr.policy, tr.pool, cfg, tr.agent, final, cfg.eval_tasks, progress)
    finally:
        if tracker is not None:
            tracker.close()
        tr.envs.close()
        close_engine(tr.gen)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sprpo-train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", help="smoke | cpu | paper (sprpo_lib/configs/*.yaml)")
    ap.add_argument("--env", choices=["webshop", "alfworld"])
    ap.add_argument("--method", help="vanilla | gaussian | sam | sprpo")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--out", help="output folder (default runs/train/<env>-<method>-<profile>-seed<seed>; relative paths are under the project root)")
    ap.add_argument("--fresh", action="store_true", help="delete the output folder and start over")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--warm-start-only", action="store_true",
                    help="build (or load) the cached supervised warm start, evaluate it, and stop")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. method.rho=0.1 rollout.group_size=4")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.profile, args.overrides, **{"env.name": args.env, "method.name": args.method,
                                                           "seed": args.seed, "iterations": args.iterations})
    except ValueError as err:  # a bad override or profile: one line, before anything loads
        print(f"sprpo-train: error: {err}", file=sys.stderr)
        return 2
    if args.warm_start_only:
        if not cfg.warm_start:
            ap.error(f"profile {cfg.profile!r} has warm_start: false; add the override warm_start=true")
        try:
            ws = prepare_warm_start(cfg, not args.no_progress)
        except (ValueError, DataError) as err:
            if args.debug:
                raise
            print(f"sprpo-train: error: {err}", file=sys.stderr)
            return 2
        shown = [ws / n for n in ("eval.json", "agreement.json")]
        print(f"warm start: {ws}" + "".join(f"\n{p.read_text()}" for p in shown if p.is_file()))
        return 0
    try:
        if cfg.warm_start:  # the stage before RL (App. B), built once and shared by every run of the profile
            prepare_warm_start(cfg, not args.no_progress)
        out = train(cfg, args.out, args.fresh, not args.no_progress)
    except (ValueError, DataError) as err:  # a checkpoint of another config or dtype, missing data: one message
        if args.debug:
            raise
        print(f"sprpo-train: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a full disk, whichever write found it: one line, the run resumes once there is space
        full = as_disk_full(err, run_folder(cfg, args.out))
        if args.debug or full is None:
            raise
        print(f"sprpo-train: error: {full}", file=sys.stderr)
        return 1
    print(f"done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
