"""The calibration pool that ``fisher`` and ``sparsegpt`` share (App. C: 128
agent-interaction token sequences from one policy's rollouts on training tasks),
stored as JSON with its hash."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from sprpo_lib.agent.engines import GenerationConfig, close_engine, make_engine
from sprpo_lib.agent.prompt import AgentConfig, token_counter
from sprpo_lib.agent.rollout import SerialEnvs, run_groups
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
           "agent": key_fields(agent), "policy": getattr(policy, "spec", None),
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
    :class:`~sprpo_lib.infra.io.CorruptFileError`)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--calibration: {p} does not exist; build it with --build-calibration {p}")
    try:
        data = read_json(p, _calibration_problem)
    except CorruptFileError as err:
        raise err.with_fix(f"--calibration: rebuild it with --build-calibration {p}") from None
    return CalibrationPool(data["sequences"], data["hash"], data.get("source", {}))
