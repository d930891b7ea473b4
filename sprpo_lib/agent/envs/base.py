"""Common interface of the text environments (App. B "Environment Details").

Both ALFWorld and WebShop are exposed through the same small protocol so that the
agent prompt (``sprpo_lib.agent.prompt``), the vectorised runner and the training loop never
branch on the environment:

* an :class:`EnvSpec`-like object knows the task pool: split names and their sizes,
  and how to open one *task* (a game / a shopping goal) by ``(split, index)``;
* opening a task gives a :class:`TaskHandle` whose ``spawn()`` returns independent
  :class:`Episode` objects that all play the same task.  The G rollouts of one
  GiGPO group share the task's (possibly expensive) preparation, e.g. ALFWorld's
  PDDL grounding, instead of paying it G times;
* an :class:`Episode` is a plain state machine: ``reset() -> Observation``,
  ``step(action) -> Observation``.  It never raises on a malformed action: an
  invalid action is an ordinary step with an explanatory observation.

Rewards follow GiGPO (App. B "Reward"): sparse, returned on the final step
(ALFWorld: ``success_reward`` on success, 0 otherwise; WebShop: the task score in
[0, 1]); ``success`` is task completion (WebShop: score == 1.0).  The step-level
format penalty (-0.1) is the agent interface's business, not the environment's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


class DataError(FileNotFoundError):
    """An environment's real data (``data_dir``, ``$WEBSHOP_DATA``, ``$ALFWORLD_DATA``) is
    missing, incomplete or unreadable; the message names the folder or file and the
    expected layout, and the commands print it without a traceback."""


@dataclass
class Observation:
    """What the agent sees after ``reset`` or ``step``.

    Attributes:
        text: the environment observation (ALFWorld feedback / WebShop page text
            joined with `` [SEP] ``).
        admissible: actions the environment accepts now (strings the policy may emit
            verbatim inside ``<action>...</action>``).
        reward: reward of the step that produced this observation (0.0 on reset).
        done: episode over (task finished, purchase made, or step limit reached).
        success: task completed (ALFWorld: goal satisfied; WebShop: score == 1.0).
        info: extra environment-specific fields (e.g. ``score``, ``expert_action``).
    """

    text: str
    admissible: list[str]
    reward: float = 0.0
    done: bool = False
    success: bool = False
    info: dict = field(default_factory=dict)


@runtime_checkable
class Episode(Protocol):
    """One play-through of one task."""

    instruction: str  # the task instruction shown in the prompt's "Task:" field
    max_steps: int

    def reset(self) -> Observation: ...

    def step(self, action: str) -> Observation: ...

    def expert_action(self) -> str | None:
        """Next action of the scripted expert / oracle from the current state, or None."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class TaskHandle(Protocol):
    """A prepared task; ``spawn`` is cheap, preparation is paid once."""

    task_id: str
    instruction: str

    def spawn(self) -> Episode: ...


@runtime_checkable
class TaskPool(Protocol):
    """The tasks of one environment (real data or the offline generated default)."""

    name: str  # "alfworld" | "webshop"
    max_steps: int  # 50 for ALFWorld, 15 for WebShop (App. B)

    def splits(self) -> dict[str, int]:
        """Split name -> number of tasks."""
        ...

    def open(self, split: str, index: int) -> TaskHandle: ...


def check_split(pool: TaskPool, split: str, index: int) -> None:
    """Raise a clear error for an unknown split or an out-of-range task index."""
    sizes = pool.splits()
    if split not in sizes:
        raise ValueError(
            f"{pool.name}: unknown split {split!r}; expected one of {sorted(sizes)}"
        )
    if not 0 <= index < sizes[split]:
        raise IndexError(
            f"{pool.name}: task index {index} out of range for split {split!r} "
            f"(size {sizes[split]})"
        )


def format_admissible(actions: Sequence[str]) -> str:
    """Render admissible actions for the prompt (one per line, stable order)."""
    return "\n".join(f"- {a}" for a in actions)
