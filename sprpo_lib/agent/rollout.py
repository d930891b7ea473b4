"""Vectorised rollouts: N episodes stepped together so one batched generation serves
them all (Alg. 1 line 5 "Collect D_k").

* Generation goes through an engine of :mod:`sprpo_lib.agent.engines` (any callable mapping
  prompts to :class:`~sprpo_lib.agent.engines.Generation` records with prompt/response token
  ids for the update).  Any FFN perturbation in force (``with FFNChannels(...)``)
  applies to it: the paper holds one xi through the whole rollout.
* :func:`run_groups` plays ``group_size`` rollouts of each task (GiGPO's groups share
  the task and its preparation), step by step, and records each episode.
* Environment work runs in-process (:class:`SerialEnvs`) or in worker processes
  (:class:`ProcessEnvs`): whole groups are placed on workers so a task is prepared
  once, and workers step their episodes concurrently, so a slow game never holds up
  the others' steps on a machine with spare cores.
* :class:`EpisodeLog` appends one JSON line per finished episode (observations, raw
  model outputs, actions, rewards, validity); a torn last line of a killed run is
  ignored on reading.
"""
from __future__ import annotations

import multiprocessing as mp
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from sprpo_lib.agent.engines.base import Generation, Generator
from sprpo_lib.agent.envs.base import Observation, TaskPool
from sprpo_lib.agent.envs.baselines import random_action
from sprpo_lib.agent.prompt import AgentConfig, HistoryStep, extract_action, fit_prompt
from sprpo_lib.infra.io import JsonLines
from sprpo_lib.infra.progress import progress_bar


# ----------------------------------------------------------------------------- records
@dataclass
class StepRecord:
    step: int
    observation: str  # the observation the action was taken from (GiGPO's anchor state)
    prompt: str
    response: str
    action: str
    valid: bool
    env_reward: float
    penalty: float  # the format penalty of this step (App. B "Reward": -0.1 without a valid <action>)
    done: bool
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    response_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class EpisodeRecord:
    env: str
    split: str
    task_index: int
    task_id: str
    group: int  # index of the group (task) within the batch
    rollout: int  # index within the group
    instruction: str
    steps: list[StepRecord] = field(default_factory=list)
    success: bool = False
    score: float = 0.0  # the episode's task reward (sum of env rewards)
    env_seconds: float = 0.0

    @property
    def length(self) -> int:
        return len(self.steps)

    @property
    def valid_rate(self) -> float:
        return sum(s.valid for s in self.steps) / max(1, len(self.steps))

    def to_json(self, with_ids: bool = False) -> dict:
        d = asdict(self)
        if not with_ids:
            for s in d["steps"]:
                s.pop("prompt_ids"), s.pop("response_ids")
        d.update(length=self.length, valid_rate=self.valid_rate)
        return d


class EpisodeLog:
    """Append-only JSON-lines log of finished episodes (one line each, fsynced; a torn
    last line of a killed run is ignored on reading)."""

    def __init__(self, path: str | Path, with_ids: bool = False):
        self.lines = JsonLines(path)
        self.path = self.lines.path
        self.with_ids = with_ids

    def write(self, episodes: Sequence[EpisodeRecord]) -> None:
        self.lines.append_rows(*(ep.to_json(self.with_ids) for ep in episodes))

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        return JsonLines(path).read_rows()


# ----------------------------------------------------------------------------- env executors
class _EnvHost:
    """Owns opened tasks and live episodes; the same code runs in-process or in a worker."""

    def __init__(self, pool: TaskPool):
        self.pool = pool
        self.episodes: dict[int, object] = {}

    def open(self, split: str, index: int, eids: Sequence[int]) -> list[tuple[int, Observation, str, str]]:
        handle = self.pool.open(split, index)
        out = []
        for eid in eids:
            ep = handle.spawn()
            self.episodes[eid] = ep
            out.append((eid, ep.reset(), handle.task_id, ep.instruction))
        return out

    def step(self, actions: Sequence[tuple[int, str]]) -> list[tuple[int, Observation, float]]:
        out = []
        for eid, action in actions:
            t0 = time.perf_counter()
            obs = self.episodes[eid].step(action)
            out.append((eid, obs, time.perf_counter() - t0))
            if obs.done:
                self.episodes.pop(eid).close()
        return out

    def discard(self, eids: Sequence[int]) -> list:
        """Close episodes cut off by the runner's step limit."""
        for eid in eids:
            ep = self.episodes.pop(eid, None)
            if ep is not None:
                ep.close()
        return []


class SerialEnvs:
    """Environment work in this process."""

    def __init__(self, pool_factory: Callable[[], TaskPool]):
        self.host = _EnvHost(pool_factory())
        self.pool = self.host.pool

    def open_groups(self, groups: Sequence[tuple[str, int, list[int]]]):
        return [r for split, idx, eids in groups for r in self.host.open(split, idx, eids)]

    def step(self, actions: Sequence[tuple[int, str]]):
        return self.host.step(actions)

    def discard(self, eids: Sequence[int]) -> None:
        self.host.discard(eids)

    def close(self) -> None:
        self.host.discard(list(self.host.episodes))


def _worker(conn, pool_factory):
    host = _EnvHost(pool_factory())
    while True:
        msg = conn.recv()
        if msg[0] == "close":
            conn.close()
            return
        try:
            conn.send(("ok", getattr(host, msg[0])(*msg[1:])))
        except Exception as err:  # report, keep serving
            conn.send(("error", f"{type(err).__name__}: {err}"))


class ProcessEnvs:
    """Environment work in ``n`` worker processes; groups are placed round-robin and
    each call fans out to all workers at once."""

    def __init__(self, pool_factory: Callable[[], TaskPool], n: int):
        if n < 1:
            raise ValueError(f"need at least one env worker, got {n}")
        ctx = mp.get_context("spawn")
        self.pool = pool_factory()
        self.conns, self.procs = [], []
        for _ in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(b, pool_factory), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        self.where: dict[int, int] = {}

    def _fan(self, per_worker: list[tuple]):
        for c, msg in zip(self.conns, per_worker):
            if msg is not None:
                c.send(msg)
        out = []
        for w, (c, msg) in enumerate(zip(self.conns, per_worker)):
            if msg is None:
                continue
            try:
                status, payload = c.recv()
            except (EOFError, ConnectionError) as err:
                self.procs[w].join(timeout=1)
                raise RuntimeError(
                    f"environment worker {w} died (exit code {self.procs[w].exitcode}); its stderr says why"
                ) from err
            if status != "ok":
                raise RuntimeError(f"environment worker failed: {payload}")
            out += payload
        return out

    def open_groups(self, groups: Sequence[tuple[str, int, list[int]]]):
        per: list[list] = [[] for _ in self.conns]
        for gi, (split, idx, eids) in enumerate(groups):
            w = gi % len(self.conns)
            per[w].append((split, idx, eids))
            for e in eids:
                self.where[e] = w
        out = []
        # one message per group keeps the worker protocol minimal
        while any(per):
            batch = [("open", *p.pop(0)) if p else None for p in per]
            out += self._fan(batch)
        return out

    def step(self, actions: Sequence[tuple[int, str]]):
        per: list[list] = [[] for _ in self.conns]
        for eid, a in actions:
            per[self.where[eid]].append((eid, a))
        return self._fan([("step", p) if p else None for p in per])

    def discard(self, eids: Sequence[int]) -> None:
        per: list[list] = [[] for _ in self.conns]
        for e in eids:
            per[self.where.pop(e)].append(e)
        self._fan([("discard", p) if p else None for p in per])

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------- runner
def _open_episodes(envs: SerialEnvs | ProcessEnvs, tasks: Sequence[tuple[str, int]],
                   group_size: int) -> tuple[dict[int, EpisodeRecord], dict[int, Observation]]:
    """Open ``group_size`` episodes of every task, numbered by group then rollout: their
    empty records and first observations."""
    eids, groups = {}, []
    for g, (split, idx) in enumerate(tasks):
        ids = list(range(g * group_size, (g + 1) * group_size))
        groups.append((split, idx, ids))
        for r, e in enumerate(ids):
            eids[e] = (g, r, split, idx)
    records: dict[int, EpisodeRecord] = {}
    current: dict[int, Observation] = {}
    for eid, obs, task_id, instruction in envs.open_groups(groups):
        g, r, split, idx = eids[eid]
        records[eid] = EpisodeRecord(envs.pool.name, split, idx, task_id, g, r, instruction)
        current[eid] = obs
    return records, current


def run_groups(
    envs: SerialEnvs | ProcessEnvs,
    tasks: Sequence[tuple[str, int]],
    group_size: int,
    generate: Generator,
    agent: AgentConfig | None = None,
    max_steps: int | None = None,
    log: EpisodeLog | None = None,
    progress: bool = True,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[list[EpisodeRecord], dict]:
    """Play ``group_size`` rollouts of every task; all live episodes share each
    generation call.

    ``count_tokens`` counts a prompt's templated tokens; needed when the agent has a
    prompt budget (:func:`sprpo_lib.agent.prompt.fit_prompt`).

    Returns the episode records (ordered by group, then rollout) and timing stats
    (``generate_s``, ``env_s`` wall seconds, of which ``open_s`` for opening the tasks
    and resetting the episodes, ``steps``).
    """
    agent = agent or AgentConfig()
    if agent.max_prompt_tokens and count_tokens is None:
        raise ValueError("rollout.agent.max_prompt_tokens is set: run_groups needs count_tokens "
                         "(e.g. sprpo_lib.agent.prompt.token_counter(tokenizer, agent))")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    pool = envs.pool
    max_steps = max_steps or pool.max_steps
    stats = {"generate_s": 0.0, "env_s": 0.0, "open_s": 0.0, "steps": 0}
    t0 = time.perf_counter()
    records, current = _open_episodes(envs, tasks, group_size)
    stats["open_s"] = time.perf_counter() - t0  # task preparation + resets (part of env_s)
    stats["env_s"] += stats["open_s"]
    history: dict[int, list[HistoryStep]] = {e: [] for e in current}
    live = sorted(current)
    bar = progress_bar(total=max_steps, desc=f"rollout {pool.name}", disable=not progress, leave=False)
    for step in range(max_steps):
        if not live:
            break
        prompts = [fit_prompt(records[e].instruction, current[e].text, current[e].admissible, history[e], agent,
                              count_tokens) for e in live]
        t0 = time.perf_counter()
        gens = generate(prompts)
        stats["generate_s"] += time.perf_counter() - t0
        parsed = [extract_action(g.text) for g in gens]
        t0 = time.perf_counter()
        results = envs.step([(e, p.action) for e, p in zip(live, parsed)])
        stats["env_s"] += time.perf_counter() - t0
        by_eid = {eid: (obs, secs) for eid, obs, secs in results}
        finished = []
        for e, prompt, gen, p in zip(live, prompts, gens, parsed):
            obs, secs = by_eid[e]
            done = obs.done or step + 1 >= max_steps
            rec = records[e]
            rec.steps.append(StepRecord(step, current[e].text, prompt, gen.text, p.action, p.valid, obs.reward,
                                        0.0 if p.valid else agent.format_penalty, done, gen.prompt_ids,
                                        gen.response_ids))
            rec.env_seconds += secs
            rec.score += obs.reward
            rec.success = rec.success or obs.success
            history[e].append(HistoryStep(current[e].text, p.action, bool(obs.info.get("invalid"))))
            current[e] = obs
            if done:
                finished.append(e)
        stats["steps"] += len(live)
        done_now = set(finished)
        live = [e for e in live if e not in done_now]
        if log is not None and finished:
            log.write([records[e] for e in finished])
        bar.update(1)
    bar.close()
    if live:
        envs.discard(live)
    return [records[e] for e in sorted(records)], stats


def episode_groups(episodes: Sequence[EpisodeRecord]) -> list[list[EpisodeRecord]]:
    """The episodes by group (a task's ``group_size`` rollouts), groups in order of appearance."""
    out: dict[int, list[EpisodeRecord]] = {}
    for e in episodes:
        out.setdefault(e.group, []).append(e)
    return list(out.values())


def score_spread(group: Sequence[EpisodeRecord]) -> bool:
    """Whether a group's episodes scored differently: otherwise GiGPO's episode-level
    advantage is 0 for all of them (DAPO drops such groups)."""
    return len({e.score for e in group}) > 1


# ----------------------------------------------------------------------------- baselines
class RandomAdmissibleGenerator:
    """The random admissible-action agent (:func:`sprpo_lib.agent.envs.baselines.random_action`)
    as a generator: it reads the actions off the prompt's "Available actions" list."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def __call__(self, prompts: Sequence[str]) -> list[Generation]:
        out = []
        for p in prompts:
            block = p.split("Available actions:\n", 1)[1].split("\n\nResponse:", 1)[0]
            actions = [line[2:] for line in block.splitlines() if line.startswith("- ")]
            task = p.split("Task: ", 1)[1].split("\n\n", 1)[0]
            out.append(Generation(f"<action>{random_action(actions, task, self.rng)}</action>", [], []))
        return out
