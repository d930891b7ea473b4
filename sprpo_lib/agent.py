"""The agent interface shared by ALFWorld and WebShop (App. B "Observation", "Action",
"Reward").

* :func:`build_prompt` renders the paper's prompt: ``Task`` / ``Interaction context``
  (the last ``history_len`` steps, default 2) / ``Current observation`` /
  ``Available actions`` / ``Response: Output the next action in <action>...</action>.``
  (no-thinking setting: the policy answers with the action only);
* :func:`chat_text` wraps it in the model's chat template (one user turn);
* :func:`extract_action` parses the response and flags format validity;
* :func:`step_reward` adds the step-level format penalty (-0.1) to the environment
  reward, which is sparse: ALFWorld's success reward / WebShop's task score on the
  final step, as in GiGPO.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

ACTION_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL)
RESPONSE_INSTRUCTION = "Output the next action in <action>...</action>."
INVALID_ACTION_MAX_CHARS = 200


@dataclass
class AgentConfig:
    """Prompt and reward shaping of the agent (App. B).

    Attributes:
        history_len: number of recent (action, observation) steps shown as interaction
            context (default 2).
        format_penalty: added to a step's reward when the response has no valid
            ``<action>...</action>`` (App. B "Reward": -0.1).
        max_obs_chars: observations longer than this are cut (with a marker) in the
            prompt; ``None`` keeps them whole.  Small CPU profiles use it to bound
            prompt length; the paper's budget is 3,072 (ALFWorld) / 4,096 (WebShop)
            prompt tokens.
        history_obs_chars: cut for the observations of the interaction context
            (``None``: ``max_obs_chars``).  Lets a small profile show the whole current
            page while keeping the history short.
        echo_instruction: keep an observation's echo of the task instruction (WebShop
            pages start with ``Instruction: [SEP] <instruction> [SEP]``, as in the
            original environment).  ``False`` removes that leading echo, which the
            prompt's ``Task:`` line already states, so a character budget is spent on
            the page itself (offline CPU profile); the paper keeps observations whole.
        system_prompt: optional system message; ``None`` sends only the user turn.
    """

    history_len: int = 2
    format_penalty: float = -0.1
    max_obs_chars: int | None = None
    history_obs_chars: int | None = None
    echo_instruction: bool = True
    system_prompt: str | None = None

    def __post_init__(self):
        if self.history_len < 0:
            raise ValueError(f"history_len must be >= 0, got {self.history_len}")
        if self.max_obs_chars is not None and self.max_obs_chars < 16:
            raise ValueError(f"max_obs_chars must be >= 16 or None, got {self.max_obs_chars}")
        if self.history_obs_chars is not None and self.history_obs_chars < 16:
            raise ValueError(f"history_obs_chars must be >= 16 or None, got {self.history_obs_chars}")


@dataclass
class ParsedAction:
    """Result of :func:`extract_action`.

    ``action`` is what is sent to the environment: the text inside the first
    ``<action>`` block when valid; otherwise the stripped response cut to 200
    characters, which the environment answers as an invalid action (so a malformed
    response is an ordinary, penalised step and never ends or crashes an episode).
    """

    action: str
    valid: bool


def extract_action(response: str) -> ParsedAction:
    """Parse ``<action>...</action>`` from a model response.

    Valid iff at least one block is present and its content is non-empty after
    stripping; the first block is used (a response is cut at the first
    ``</action>`` during generation anyway).  Whitespace inside is collapsed.
    """
    m = ACTION_RE.search(response or "")
    if m:
        act = " ".join(m.group(1).split())
        if act:
            return ParsedAction(act, True)
    raw = " ".join((response or "").split())[:INVALID_ACTION_MAX_CHARS]
    return ParsedAction(raw, False)


def step_reward(env_reward: float, valid: bool, cfg: AgentConfig) -> float:
    """Environment reward plus the format penalty for an invalid response."""
    return float(env_reward) + (0.0 if valid else cfg.format_penalty)


def _cut(text: str, limit: int | None) -> str:
    text = text.strip()
    if limit is None or len(text) <= limit:
        return text
    return text[: limit - 6].rstrip() + " [...]"


def _without_echo(text: str, instruction: str) -> str:
    """``text`` without a leading ``Instruction: [SEP] <instruction> [SEP]`` echo."""
    head = f"Instruction: [SEP] {instruction.strip()} [SEP] "
    text = text.strip()
    return text[len(head):] if text.startswith(head) else text


def build_prompt(
    instruction: str,
    observation: str,
    admissible: Sequence[str],
    history: Sequence[tuple[str, str]] = (),
    cfg: AgentConfig | None = None,
) -> str:
    """The paper's prompt (App. B "Observation").

    Args:
        instruction: the task instruction.
        observation: the current environment observation.
        admissible: the currently admissible actions.
        history: all previous steps as ``(action, observation after it)``; the last
            ``cfg.history_len`` are shown, numbered by their step in the episode.
    """
    cfg = cfg or AgentConfig()
    recent = list(history)[-cfg.history_len :] if cfg.history_len else []
    first = len(history) - len(recent) + 1

    def view(text: str, limit: int | None) -> str:
        return _cut(text if cfg.echo_instruction else _without_echo(text, instruction), limit)

    hist_limit = cfg.max_obs_chars if cfg.history_obs_chars is None else cfg.history_obs_chars
    if recent:
        context = "\n".join(
            f"[Step {first + i}] Action: {a} -> Observation: {view(o, hist_limit)}" for i, (a, o) in enumerate(recent)
        )
    else:
        context = "None (this is the first step)."
    actions = "\n".join(f"- {a}" for a in admissible) if admissible else "(none listed)"
    return (
        f"Task: {instruction.strip()}\n\n"
        f"Interaction context:\n{context}\n\n"
        f"Current observation: {view(observation, cfg.max_obs_chars)}\n\n"
        f"Available actions:\n{actions}\n\n"
        f"Response: {RESPONSE_INSTRUCTION}"
    )


def chat_text(tokenizer, prompt: str, cfg: AgentConfig | None = None) -> str:
    """``prompt`` as a user turn in the model's chat template, ready for generation."""
    cfg = cfg or AgentConfig()
    msgs = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    msgs.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
