"""The calibration pool that ``fisher`` and ``sparsegpt`` share (App. C: 128
agent-interaction token sequences from one policy's rollouts on training tasks),
stored as JSON with its hash."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from sprpo_lib.agent.engines import GenerationConfig
from sprpo_lib.agent.play import playing
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.infra.io import CorruptFileError, atomic_write_json, canonical_hash, key_fields, read_json

logger = logging.getLogger(__name__)

CALIBRATION_FORMAT = "sprpo-calibration"

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


@dataclass(frozen=True)
class SampledStep:
    """One agent step kept from a policy's own episode: where it was and its token ids."""

    split: str
    task_index: int
    step: int
    prompt_ids: list[int]
    response_ids: list[int]


def sampled_steps(policy, pool, agent: AgentConfig | None = None, *, n: int, split: str, first_task: int = 0,
                  per_episode: int = 4, temperature: float = 0.4, max_new_tokens: int = 64, batch_size: int = 16,
                  max_steps: int | None = None, seed: int = 0, engine: str = "hf", tasks_per_batch: int = 16,
                  progress: bool = True) -> list[SampledStep]:
    """``n`` steps of ``policy``'s own episodes on tasks ``first_task, first_task + 1, ...`` of
    ``split``: one episode each, ``tasks_per_batch`` at a time, at ``temperature`` with generation
    seed ``seed``; at most ``per_episode`` steps of an episode (a seeded random choice, so the
    steps span many tasks and all stages of an episode), in step order.  The templated prompt and
    the response exactly as generated."""
    if n < 1 or per_episode < 1:
        raise ValueError(f"n and per_episode must be >= 1, got {n}, {per_episode}")
    agent = agent or AgentConfig()
    size = pool.splits().get(split)
    if size is None:
        raise ValueError(f"{pool.name} has no split {split!r}; expected one of {sorted(pool.splits())}")
    rng = random.Random(seed)
    gen = GenerationConfig(temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed)
    out: list[SampledStep] = []
    task = first_task
    with playing(policy, pool, engine, gen, agent, max_steps) as run:
        while len(out) < n:
            if task >= size:
                raise ValueError(f"{split!r} of {pool.name} ran out of tasks after {len(out)} of {n} steps; raise "
                                 "per_episode or lower n")
            batch = [(split, i) for i in range(task, min(size, task + tasks_per_batch))]
            task += len(batch)
            episodes, _ = run(batch, progress=progress)
            for ep in episodes:
                steps = [s for s in ep.steps if s.prompt_ids and s.response_ids]
                for s in sorted(rng.sample(steps, min(per_episode, len(steps))), key=lambda s: s.step):
                    if len(out) < n:
                        out.append(SampledStep(ep.split, ep.task_index, s.step, [int(t) for t in s.prompt_ids],
                                               [int(t) for t in s.response_ids]))
    return out


def build_calibration_pool(policy, pool, agent: AgentConfig | None = None, *, n: int = 128,
                           split: str = "train", first_task: int = 0, per_episode: int = 4,
                           temperature: float = 0.4, max_new_tokens: int = 64, batch_size: int = 16,
                           max_steps: int | None = None, seed: int = 0, engine: str = "hf",
                           tasks_per_batch: int = 16, progress: bool = True,
                           source: Mapping | None = None) -> CalibrationPool:
    """Collect ``n`` agent-interaction sequences from ``policy``'s own rollouts on
    training tasks (App. C: 128 sequences from a Vanilla policy): the ``prompt_ids +
    response_ids`` of :func:`sampled_steps`."""
    try:
        steps = sampled_steps(policy, pool, agent, n=n, split=split, first_task=first_task, per_episode=per_episode,
                              temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                              max_steps=max_steps, seed=seed, engine=engine, tasks_per_batch=tasks_per_batch,
                              progress=progress)
    except ValueError as err:
        raise ValueError(f"calibration pool: {err}") from None
    seqs = [s.prompt_ids + s.response_ids for s in steps]
    tok = policy.tokenizer
    src = {"env": pool.name, "split": split, "steps": [[s.split, s.task_index, s.step] for s in steps],
           "per_episode": per_episode, "seed": seed, "temperature": temperature, "max_new_tokens": max_new_tokens,
           "max_steps": max_steps, "engine": engine, "agent": key_fields(agent or AgentConfig()),
           "policy": getattr(policy, "spec", None), "tokenizer": {"name": getattr(tok, "name_or_path", None),
                                                                 "vocab": len(tok)}, **dict(source or {})}
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
    :class:`~sprpo_lib.infra.io.CorruptFileError`)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--calibration: {p} does not exist; build it with --build-calibration {p}")
    try:
        data = read_json(p, _calibration_problem)
    except CorruptFileError as err:
        raise err.with_fix(f"--calibration: rebuild it with --build-calibration {p}") from None
    return CalibrationPool(data["sequences"], data["hash"], data.get("source", {}))
