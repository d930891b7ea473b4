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

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

#: The variable each environment reads its real data folder from when no ``data_dir`` is given.
DATA_VARS = {"webshop": "WEBSHOP_DATA", "alfworld": "ALFWORLD_DATA"}
#: What cache keys, manifests and headers record of the offline generated default.
GENERATED = "generated"
#: The folder that importing ``alfworld`` writes into ``$ALFWORLD_DATA`` when it is unset
#: (``alfworld.info``, creating it empty).
ALFWORLD_DEFAULT = "~/.cache/alfworld"


class DataError(FileNotFoundError):
    """An environment's real data (``data_dir``, ``$WEBSHOP_DATA``, ``$ALFWORLD_DATA``) is
    missing, incomplete or unreadable; the message names the folder or file and the
    expected layout, and the commands print it without a traceback."""


def resolve_data_dir(env: str, data_dir: str | os.PathLike | None = None) -> tuple[Path | None, str]:
    """The one rule for an environment's data, both environments: an explicit ``data_dir``,
    else the folder in ``$WEBSHOP_DATA`` / ``$ALFWORLD_DATA``, else None (the offline
    generated default).  Returns the absolute folder (``~`` and ``$VAR`` expanded) and how the
    user named it (``data_dir=<as given>`` or ``ALFWORLD_DATA=<as set>``: the prefix of a data
    error; :data:`GENERATED` for the default).  ``$ALFWORLD_DATA`` naming :data:`ALFWORLD_DEFAULT`
    with no ``json_2.1.1`` data in it counts as unset: that is what importing ``alfworld``
    leaves there, not a choice of data."""
    raw, where = (str(data_dir), f"data_dir={data_dir}") if data_dir not in (None, "") else (None, GENERATED)
    if raw is None and (var := DATA_VARS.get(env)) and os.environ.get(var):
        raw, where = os.environ[var], f"{var}={os.environ[var]}"
    if raw is None:
        return None, GENERATED
    folder = Path(os.path.expandvars(raw)).expanduser().resolve()
    if not where.startswith("data_dir=") and folder == Path(ALFWORLD_DEFAULT).expanduser().resolve() and not any(
            (folder / "json_2.1.1").glob("*")):  # alfworld's import set the variable to its empty default folder
        return None, GENERATED
    return folder, where


@contextlib.contextmanager
def data_vars_kept():
    """Restore the data variables after the block: importing ``alfworld`` sets
    ``$ALFWORLD_DATA`` to its default cache folder, which would then read as the user's
    choice of real data (:func:`resolve_data_dir`)."""
    saved = {var: os.environ.get(var) for var in DATA_VARS.values()}
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def data_source(env: str, data_dir: str | os.PathLike | None = None) -> str:
    """What a result records of its data (:func:`resolve_data_dir`): the absolute real-data
    folder, or :data:`GENERATED`.  Pools carry it as ``.data_source``."""
    folder, _ = resolve_data_dir(env, data_dir)
    return GENERATED if folder is None else str(folder)


def data_header(env: str, data_dir: str | os.PathLike | None = None) -> str:
    """The line a command prints before it plays ``env``'s tasks: the data it uses and why."""
    folder, where = resolve_data_dir(env, data_dir)
    if folder is None:
        return (f"{env} data: {GENERATED} (the offline default; set {DATA_VARS.get(env, 'data_dir')}=<folder> or "
                "data_dir for the real data)")
    return f"{env} data: {folder} (from {where})"


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
    data_source: str  # the data actually played (:func:`data_source`): cache keys and manifests record it

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
