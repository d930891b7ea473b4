"""Scripted agents over the task-pool protocol, for any environment: the random
admissible-action agent (the floor every trained policy must beat) and the expert /
oracle (the ceiling).  ``python -m sprpo_lib.agent.envs random|expert`` runs them."""
from __future__ import annotations

import random
import re
import time
from typing import Sequence

import numpy as np

from sprpo_lib.agent.envs.base import TaskPool
from sprpo_lib.infra.progress import progress_bar

_TEMPLATE = re.compile(r"^(\w+)\[<[^>]*>\]$")


def random_action(admissible: Sequence[str], instruction: str, rng: random.Random) -> str:
    """A uniformly random admissible action; a free-form template such as WebShop's
    ``search[<your query>]`` is filled with the task instruction (the only sensible
    query a random agent has)."""
    if not admissible:
        return "look"
    action = rng.choice(list(admissible))
    m = _TEMPLATE.match(action)
    return f"{m.group(1)}[{instruction}]" if m else action


AGENTS = ("random", "expert", "shopper", "explorer")


def play(pool: TaskPool, split: str, indices: Sequence[int], agent: str = "random", seed: int = 0,
         rollouts: int = 1, progress: bool = True) -> dict:
    """Play ``rollouts`` episodes of each task with the ``random`` or ``expert`` agent, or
    a visible-information one (``shopper`` on WebShop, ``explorer`` on ALFWorld: the warm
    starts' demonstrators);
    success, mean score and episode length overall and per task type (where the task
    handle has one, e.g. ALFWorld's six types), and the length distribution (what
    ``env.max_steps`` is sized from: the expert's longest solution)."""
    if agent not in AGENTS:
        raise ValueError(f"agent must be one of {AGENTS}, got {agent!r}")
    rng = random.Random(seed)
    t0 = time.perf_counter()
    episodes, wins, score, steps = 0, 0, 0.0, 0
    lengths: list[int] = []
    per_type: dict[str, list[int]] = {}
    for i in progress_bar(list(indices), desc=f"{agent} agent {pool.name}/{split}", disable=not progress, leave=False):
        task = pool.open(split, i)
        counts = per_type.setdefault(getattr(task, "task_type", pool.name), [0, 0])
        for _ in range(rollouts):
            ep = task.spawn()
            obs, ret, length, taken = ep.reset(), 0.0, 0, []
            while not obs.done:
                if agent == "random":
                    action = random_action(obs.admissible, ep.instruction, rng)
                elif agent == "expert":
                    action = ep.expert_action()
                elif hasattr(ep, f"{agent}_action"):
                    action = getattr(ep, f"{agent}_action")(taken)
                else:
                    raise ValueError(f"agent {agent!r} does not play {pool.name} (shopper: webshop, explorer: alfworld)")
                taken.append(action)
                if action is None:
                    break
                obs = ep.step(action)
                ret += obs.reward
                length += 1
            ep.close()
            lengths.append(length)
            steps += length
            episodes += 1
            wins += bool(obs.success)
            score += ret
            counts[0] += bool(obs.success)
            counts[1] += 1
        if hasattr(task, "close"):
            task.close()
    n = max(episodes, 1)
    return {"env": pool.name, "split": split, "agent": agent, "tasks": len(list(indices)), "rollouts": rollouts,
            "episodes": episodes, "successes": wins, "success_rate": wins / n, "mean_score": score / n,
            "mean_steps": steps / n, "seconds": round(time.perf_counter() - t0, 2),
            "steps_quantiles": {**{f"p{q}": float(np.percentile(lengths, q)) if lengths else 0.0 for q in (50, 90, 99)},
                                "max": max(lengths, default=0)},
            "per_type": {k: {"successes": v[0], "episodes": v[1]} for k, v in sorted(per_type.items())}}
