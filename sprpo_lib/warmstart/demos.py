"""Demonstrations for the warm start: who labels a state (:data:`DEMONSTRATORS`), how the
demonstrations are played, stored and weighed.

* **Prompts match RL token for token.**  :func:`collect_demonstrations` builds each
  prompt with :func:`agent.build_prompt` from the same state :func:`rollout.run_groups`
  would use (instruction, current observation, admissible actions, and the history of
  ``(parsed action, next observation)`` pairs).
* **DAgger-lite.**  With ``expert_prob < 1`` the *executed* action is, with
  probability ``1 - expert_prob``, a uniformly random admissible action (a template
  such as WebShop's ``search[<your query>]`` is filled with the task instruction),
  while the state is still labelled with the expert's action.  The demonstrations then
  also cover off-expert states (a wrong product page, a later results page) and how
  the expert recovers from them, which a pure expert trajectory never shows; the
  policy's own mistakes at test time land in such states.  With ``repeat_prob > 0``
  the executed action is, with that probability, the previous one again: the loop a
  small clone falls into (on ALFWorld a repeated ``go to`` or ``take`` is rejected with
  "Nothing happens."), so the demonstrations hold the state after a rejected action with
  the label that leaves it.
* **Relabelling** (``scripts``): the states another policy reached, labelled by the
  demonstrator; the step of full DAgger (:mod:`.dagger`).
"""
from __future__ import annotations

import json
import logging
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from sprpo_lib.agent.envs.alfworld_explorer import LABELS_VERSION as EXPLORER_LABELS
from sprpo_lib.agent.envs.base import TaskPool
from sprpo_lib.agent.envs.baselines import random_action
from sprpo_lib.agent.prompt import AgentConfig, HistoryStep, build_prompt, extract_action
from sprpo_lib.infra.io import atomic_write_text
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.infra.registry import Registry

log = logging.getLogger(__name__)

__all__ = ["Demo", "DEMONSTRATORS", "LABEL_VERSIONS", "collect_demonstrations", "save_demos", "load_demos",
           "label_verb", "label_weights"]


@dataclass
class Demo:
    """One behaviour-cloning example.

    Attributes:
        prompt: the agent prompt (:func:`agent.build_prompt`, before the chat
            template), exactly what :func:`rollout.run_groups` would show in that state.
        response: the target, ``<action>{expert action}</action>``.
        task_id: the task's id (``TaskHandle.task_id``).
        step: step index within the episode (0-based, as ``StepRecord.step``).
    """

    prompt: str
    response: str
    task_id: str
    step: int


#: who labels demonstrations: ``fn(episode, history) -> next action or None``.
DEMONSTRATORS: Registry = Registry("demonstrator", "sft.demonstrator")


#: demonstrators whose labels changed after a warm start was first cached: the version
#: joins that warm start's cache key, so stale demonstrations are never served
LABEL_VERSIONS = {"explorer": EXPLORER_LABELS}


@DEMONSTRATORS.register("expert")
def _expert(ep, history: Sequence[HistoryStep]) -> str | None:
    """The environment's expert / oracle (ALFWorld's planner, WebShop's goal oracle)."""
    return ep.expert_action()


@DEMONSTRATORS.register("shopper")
def _shopper(ep, history: Sequence[HistoryStep]) -> str | None:
    """WebShop's visible-information shopper (a function of what the agent sees)."""
    if not hasattr(ep, "shopper_action"):
        raise ValueError(f"sft.demonstrator='shopper': {type(ep).__name__} has no shopper_action() "
                         f"(only WebShop has one); use sft.demonstrator=expert")
    return ep.shopper_action([h.action for h in history])


@DEMONSTRATORS.register("explorer")
def _explorer(ep, history: Sequence[HistoryStep]) -> str | None:
    """ALFWorld's visible-information explorer (a function of what the agent sees and of
    where objects lie in the training games)."""
    if not hasattr(ep, "explorer_action"):
        raise ValueError(f"sft.demonstrator='explorer': {type(ep).__name__} has no explorer_action() "
                         f"(only ALFWorld has one); use sft.demonstrator=expert or shopper")
    return ep.explorer_action([h.action for h in history])


def collect_demonstrations(
    pool: TaskPool,
    split: str,
    indices: Iterable[int],
    agent: AgentConfig | None = None,
    expert_prob: float = 1.0,
    seed: int = 0,
    max_steps: int | None = None,
    stats: dict | None = None,
    demonstrator: str = "expert",
    repeat_prob: float = 0.0,
    scripts: Mapping[int, Sequence[tuple[str, str]]] | None = None,
    progress: bool = False,
) -> list[Demo]:
    """Play each task with the expert and record (prompt, expert response) per step.

    Args:
        pool: any :class:`~sprpo_lib.agent.envs.base.TaskPool` whose episodes implement
            ``expert_action()``.
        split, indices: the tasks (``pool.open(split, i)`` for each index, in order).
        agent: prompt settings (history length, observation cut); must be the ones the
            RL agent uses, or the prompts will not match.
        expert_prob: probability of *executing* the expert's action at a step; otherwise
            a uniformly random admissible action is executed (DAgger-lite, see the
            module docstring).  The label is always the expert's action.  1.0 = pure
            expert trajectories.
        seed: seed of the random actions; each task draws from its own stream
            (seeded by ``seed``, split and index), so a task's demonstrations do not
            depend on which other tasks are collected.
        max_steps: step limit per episode (default ``pool.max_steps``, as ``run_groups``).
        demonstrator: ``"expert"`` (``Episode.expert_action()``: the environment's
            oracle, which may use hidden state) or ``"shopper"`` (``shopper_action(actions)``:
            a scripted policy that reads only the prompt's information; WebShop's
            :func:`~sprpo_lib.agent.envs.webshop.visible_shopper_action`) or ``"explorer"``
            (ALFWorld's :func:`~sprpo_lib.agent.envs.alfworld_explorer.visible_explorer_action`).
        stats: if a dict is given, it is filled with ``episodes``, ``successes``,
            ``success_rate``, ``mean_score`` (of the played, possibly perturbed,
            episodes), ``demos`` and ``expert_none`` (episodes cut because the expert
            had no action).
        repeat_prob: probability of executing the previous executed action again at
            a step where the expert's action would be executed (not at the first step;
            see the module docstring).  The label is still the expert's.
        scripts: DAgger's relabelling (:func:`sprpo_lib.warmstart.dagger.dagger`): per task index, the
            ``(prompt, action)`` steps another policy played.  The task is replayed with
            those actions (no expert, random or repeated action is executed; the episode
            ends with its script) and every state it passes is labelled by the
            demonstrator.  Each replayed prompt must equal the recorded one (the
            environments are deterministic): a mismatch raises.  ``stats`` then also
            counts ``disagree``, the steps whose played action differs from the label.
        progress: show a bar over the tasks (200 ALFWorld games take minutes).

    Returns:
        The demonstrations, ordered by task and step.
    """
    if not 0.0 <= expert_prob <= 1.0:
        raise ValueError(f"expert_prob must be in [0, 1], got {expert_prob}")
    if not 0.0 <= repeat_prob < 1.0:
        raise ValueError(f"sft.repeat_prob must be in [0, 1), got {repeat_prob}")
    label = DEMONSTRATORS.get(demonstrator)
    agent = agent or AgentConfig()
    limit = max_steps or pool.max_steps
    bar = progress_bar(list(indices), desc=f"demonstrations ({demonstrator}, {split})", unit="task",
                       disable=not progress)
    played = [_demonstrate(pool.open(split, idx), label, agent, limit, random.Random(f"{seed}:{split}:{idx}"),
                           expert_prob, repeat_prob, None if scripts is None else scripts[idx]) for idx in bar]
    demos = [d for ep in played for d in ep.demos]
    n_ep, n_succ = len(played), sum(ep.success for ep in played)
    if stats is not None:
        stats.update(episodes=n_ep, successes=n_succ, success_rate=n_succ / max(1, n_ep),
                     mean_score=sum(ep.score for ep in played) / max(1, n_ep), demos=len(demos),
                     expert_none=sum(ep.expert_none for ep in played))
        if scripts is not None:
            stats["disagree"] = sum(ep.disagree for ep in played)
    log.info("collected %d demos from %d episodes (%d successful)", len(demos), n_ep, n_succ)
    return demos


@dataclass
class _Played:
    """One demonstrated episode: its demonstrations and what :func:`collect_demonstrations` counts."""

    demos: list[Demo]
    success: bool = False
    score: float = 0.0
    expert_none: int = 0
    disagree: int = 0


def _demonstrate(handle, label, agent: AgentConfig, limit: int, rng: random.Random, expert_prob: float,
                 repeat_prob: float, script: Sequence[tuple[str, str]] | None) -> _Played:
    """Play one task (see :func:`collect_demonstrations` for the arguments): label each state,
    then execute the label, a random admissible action, the previous action again, or the
    script's next action."""
    out = _Played([])
    ep = handle.spawn()
    try:
        obs = ep.reset()
        history: list[HistoryStep] = []
        for step in range(limit if script is None else min(limit, len(script))):
            expert = label(ep, history)
            if expert is None:
                out.expert_none += 1
                break
            response = f"<action>{expert}</action>"
            prompt = build_prompt(ep.instruction, obs.text, obs.admissible, history, agent)
            out.demos.append(Demo(prompt, response, handle.task_id, step))
            executed = response
            if script is not None:  # DAgger: the state another policy reached, with the demonstrator's label
                played_prompt, action = script[step]
                if played_prompt != prompt:
                    raise RuntimeError(f"DAgger relabelling: replaying task {handle.task_id} gave another prompt "
                                       f"at step {step} than the one played (the environment did not replay the "
                                       f"same states; it must be deterministic given the task and the actions)")
                out.disagree += action != expert
                executed = None
            elif expert_prob < 1.0 and obs.admissible and rng.random() >= expert_prob:
                executed = f"<action>{random_action(obs.admissible, ep.instruction.strip(), rng)}</action>"
            elif repeat_prob > 0.0 and history and rng.random() < repeat_prob:  # no draw at 0: same streams
                executed = f"<action>{history[-1].action}</action>"
            # run_groups steps the env with the *parsed* action and keeps it in the history
            if executed is not None:
                action = extract_action(executed).action
            nxt = ep.step(action)
            history.append(HistoryStep(obs.text, action, bool(nxt.info.get("invalid"))))
            out.score += nxt.reward
            out.success = out.success or nxt.success
            obs = nxt
            if obs.done:
                break
    finally:
        ep.close()
    return out


def save_demos(path: str | Path, demos: Sequence[Demo]) -> Path:
    """Write demonstrations as JSON lines (atomically)."""
    return atomic_write_text(path, "".join(json.dumps(asdict(d)) + "\n" for d in demos))


def load_demos(path: str | Path) -> list[Demo]:
    with open(path) as f:
        return [Demo(**json.loads(line)) for line in f if line.strip()]


def label_verb(response: str) -> str:
    """The verb of a response's action (``go`` for ``go to cabinet 1``, ``click`` for
    ``click[buy now]``): the class :func:`label_weights` balances."""
    m = re.match(r"[a-z_]+", extract_action(response).action.strip().lower())
    return m.group(0) if m else ""


def label_weights(responses: Sequence[str], balance: float) -> list[float]:
    """Per-demonstration loss weights ``(n_verb / n)^-balance``, scaled to mean 1, where
    ``n_verb`` counts the demonstrations whose action has the same verb
    (:func:`label_verb`).  ``balance=1``: every verb's demonstrations weigh the same in
    all; 0: all 1."""
    verbs = [label_verb(r) for r in responses]
    counts, n = Counter(verbs), len(verbs)
    raw = [(counts[v] / n) ** -balance for v in verbs]
    mean = sum(raw) / max(1, n)
    return [x / mean for x in raw]
