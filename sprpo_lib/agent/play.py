"""Playing tasks with a policy, outside training: the one way held-out evaluation, the
robustness sweep and the calibration and state pools do it.  One generation engine and the
environments stay open for a series of task batches (the engine's seeded stream runs on
across them); each batch goes through :func:`sprpo_lib.agent.rollout.run_groups`, the code
path of RL rollouts."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from sprpo_lib.agent.engines import GenerationConfig, close_engine, make_engine
from sprpo_lib.agent.envs.base import TaskPool
from sprpo_lib.agent.prompt import AgentConfig, token_counter
from sprpo_lib.agent.rollout import EpisodeLog, SerialEnvs, run_groups

#: ``play(tasks, group_size=1, log_path=None, progress=False) -> (episode records, timing stats)``
Play = Callable[..., tuple[list, dict]]


@contextmanager
def playing(policy, pool: TaskPool, engine: str, gen: GenerationConfig, agent: AgentConfig,
            max_steps: int | None) -> Iterator[Play]:
    """Inside the block, ``play(tasks, ...)`` runs episodes of ``(split, index)`` tasks with
    ``policy`` (in eval mode) under whatever perturbation is in force on its model; the engine
    and environments close on exit."""
    eng = make_engine(engine, policy, gen, agent)
    envs = SerialEnvs(lambda: pool)
    count = token_counter(policy.tokenizer, agent)

    def play(tasks: Sequence[tuple[str, int]], group_size: int = 1, log_path: str | Path | None = None,
             progress: bool = False) -> tuple[list, dict]:
        return run_groups(envs, list(tasks), group_size, eng, agent, max_steps,
                          EpisodeLog(log_path) if log_path else None, progress, count_tokens=count)

    try:
        policy.model.eval()
        yield play
    finally:
        envs.close()
        close_engine(eng)
