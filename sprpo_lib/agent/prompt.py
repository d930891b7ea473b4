"""The agent interface shared by ALFWorld and WebShop (App. B "Observation", "Action",
"Reward").

* :func:`build_prompt` renders the paper's prompt: ``Task`` / ``Interaction context``
  (the last ``history_len`` previous steps, each the observation acted on and the
  action taken, as verl-agent's history; default 2) / ``Current observation`` /
  ``Available actions`` / ``Response: Output the next action in <action>...</action>.``
  (no-thinking setting: the policy answers with the action only);
* :func:`fit_prompt` keeps a prompt within a token budget (Table 2's prompt length):
  it cuts the interaction context first, then the current observation, never the
  task or the action list;
* :func:`chat_text` wraps it in the model's chat template (one user turn);
* :func:`extract_action` parses the response and flags format validity;
* the step-level format penalty (-0.1, ``AgentConfig.format_penalty``) is recorded
  per step beside the sparse environment reward (ALFWorld's success reward / WebShop's
  task score on the final step, as in GiGPO); where it enters the advantages is
  :attr:`sprpo_lib.core.advantages.AdvantageConfig.penalty_placement`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Callable, NamedTuple, Sequence

from annotated_types import Ge, Le

from sprpo_lib.infra.io import OMIT_AT_DEFAULT
from sprpo_lib.infra.ranges import check_ranges

ACTION_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL)
RESPONSE_INSTRUCTION = "Output the next action in <action>...</action>."
INVALID_ACTION_MAX_CHARS = 200


@dataclass
class AgentConfig:
    """Prompt and reward shaping of the agent (App. B).

    Attributes:
        history_len: number of previous steps (observation acted on, action taken)
            shown as interaction context (default 2).
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
        max_prompt_tokens: token budget of the templated prompt (Table 2: 4,096 for
            WebShop, 3,072 for ALFWorld); ``None``: no budget.  See :func:`fit_prompt`.
        compact_actions: list the available actions compactly (:func:`format_actions`):
            commands that differ only in their last object's number share one line,
            consecutive numbers as a range (``- go to cabinet 1-18, countertop 1-4``).
            Every admissible action is still listed; ALFWorld's ~36 "go to" lines are
            most of its prompt.  ``False`` (default, the paper): one line per action.
    """

    history_len: Annotated[int, Ge(0)] = 2
    format_penalty: Annotated[float, Le(0)] = -0.1
    max_obs_chars: Annotated[int, Ge(16)] | None = None
    history_obs_chars: Annotated[int, Ge(16)] | None = None
    echo_instruction: bool = True
    system_prompt: str | None = None
    max_prompt_tokens: Annotated[int, Ge(64)] | None = None
    compact_actions: bool = field(default=False, metadata=OMIT_AT_DEFAULT)

    def __post_init__(self):
        check_ranges(self)


class HistoryStep(NamedTuple):
    """One previous step of the interaction context: the observation the agent acted
    on, the action it took, and whether the environment rejected that action."""

    observation: str
    action: str
    invalid: bool = False


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


def _cut(text: str, limit: int | None) -> str:
    text = text.strip()
    if limit is None or len(text) <= limit:
        return text
    return text[: max(0, limit - len(CUT_MARK))].rstrip() + CUT_MARK


def _without_echo(text: str, instruction: str) -> str:
    """``text`` without a leading ``Instruction: [SEP] <instruction> [SEP]`` echo."""
    head = f"Instruction: [SEP] {instruction.strip()} [SEP] "
    text = text.strip()
    return text[len(head):] if text.startswith(head) else text


CUT_MARK = " [...]"


def build_prompt(
    instruction: str,
    observation: str,
    admissible: Sequence[str],
    history: Sequence[HistoryStep] = (),
    cfg: AgentConfig | None = None,
    *,
    obs_chars: int | None = None,
    shown: int | None = None,
) -> str:
    """The paper's prompt (App. B "Observation").

    Args:
        instruction: the task instruction.
        observation: the current environment observation.
        admissible: the currently admissible actions.
        history: all previous steps (:class:`HistoryStep`); the last
            ``cfg.history_len`` are shown, numbered by their step in the episode.  The
            current observation is never repeated there.
        obs_chars, shown: tighter limits used by :func:`fit_prompt` (characters of
            the current observation; number of history steps shown).
    """
    cfg = cfg or AgentConfig()
    n = cfg.history_len if shown is None else min(shown, cfg.history_len)
    recent = list(history)[-n:] if n else []
    first = len(history) - len(recent) + 1

    def view(text: str, limit: int | None) -> str:
        return _cut(text if cfg.echo_instruction else _without_echo(text, instruction), limit)

    hist_limit = cfg.max_obs_chars if cfg.history_obs_chars is None else cfg.history_obs_chars
    if recent:
        lines = [f"[Step {first + i}] Observation: {view(h.observation, hist_limit)} -> Action: {h.action}"
                 + (" (invalid: the environment did not accept it)" if h.invalid else "")
                 for i, h in enumerate(recent)]
        context = "\n".join(([f"[Steps 1-{first - 1} omitted]"] if first > 1 and shown is not None else []) + lines)
    elif history:
        context = f"[Steps 1-{len(history)} omitted]"
    else:
        context = "None (this is the first step)."
    limit = cfg.max_obs_chars if obs_chars is None else min(obs_chars, cfg.max_obs_chars or obs_chars)
    actions = format_actions(admissible, cfg.compact_actions)
    return (
        f"Task: {instruction.strip()}\n\n"
        f"Interaction context:\n{context}\n\n"
        f"Current observation: {view(observation, limit)}\n\n"
        f"Available actions:\n{actions}\n\n"
        f"Response: {RESPONSE_INSTRUCTION}"
    )


_NUMBERED = re.compile(r"^(.*\S) (\w+) (\d+)$")  # "<command prefix> <object name> <number>"


def _ranges(numbers: Sequence[int]) -> list[str]:
    """``[1, 2, 3, 5, 7]`` -> ``["1-3", "5", "7"]``: consecutive numbers as runs."""
    out, ns = [], sorted(set(numbers))
    start = prev = ns[0]
    for n in [*ns[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if n is not None:
            start = prev = n
    return out


def format_actions(admissible: Sequence[str], compact: bool = False) -> str:
    """The "Available actions" block: one ``- action`` line each, or with ``compact``
    the commands ``<prefix> <name> <n>`` that share a prefix (at least 3 of them) on one
    line, each name once with its numbers as runs: ``- go to cabinet 1-3, drawer 2, 5``
    (ALFWorld's receptacles).  :func:`parse_actions` inverts both forms."""
    if not admissible:
        return "(none listed)"
    if not compact:
        return "\n".join(f"- {a}" for a in admissible)
    groups: dict[str, dict[str, list[int]]] = {}
    for a in admissible:
        m = _NUMBERED.match(a)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(m.group(2), []).append(int(m.group(3)))
    big = {p for p, names in groups.items() if sum(len(v) for v in names.values()) >= 3}
    lines, done = [], set()
    for a in admissible:
        m = _NUMBERED.match(a)
        if m and m.group(1) in big:
            if m.group(1) not in done:
                done.add(m.group(1))
                items = [f"{name} {', '.join(_ranges(ns))}" for name, ns in sorted(groups[m.group(1)].items())]
                lines.append(f"- {m.group(1)} " + ", ".join(items))
        else:
            lines.append(f"- {a}")
    return "\n".join(lines)


_HEAD = re.compile(r"^(.*\S) (\w+) (\d+)(?:-(\d+))?$")  # "<prefix> <name> <n>[-<m>]"
_ITEM = re.compile(r"^(?:(\w+) )?(\d+)(?:-(\d+))?$")  # "[<name> ]<n>[-<m>]" (no name: the previous one)


def _expand(line: str) -> list[str] | None:
    """The actions of a compact line, or ``None`` if ``line`` is a single plain action."""
    parts = line.split(", ")
    head = _HEAD.match(parts[0])
    if head is None or (len(parts) == 1 and head.group(4) is None):
        return None
    items = [head.groups()[1:], *((m.groups() if (m := _ITEM.match(p)) else None) for p in parts[1:])]
    if any(it is None for it in items):  # an action with ", " in its text
        return None
    out, name = [], None
    for it_name, lo, hi in items:
        name = it_name or name
        out += [f"{head.group(1)} {name} {n}" for n in range(int(lo), int(hi or lo) + 1)]
    return out


def parse_actions(block: str) -> list[str]:
    """The actions of an "Available actions" block in either form of
    :func:`format_actions` (a compact line expands to one action per number)."""
    out = []
    for line in block.splitlines():
        if line.startswith("- "):
            out += _expand(line[2:]) or [line[2:]]
    return out


def fit_prompt(
    instruction: str,
    observation: str,
    admissible: Sequence[str],
    history: Sequence[HistoryStep],
    cfg: AgentConfig,
    count_tokens: Callable[[str], int] | None,
) -> str:
    """:func:`build_prompt` within ``cfg.max_prompt_tokens`` as counted by
    ``count_tokens`` (the templated prompt's token count).

    Over budget, the interaction context loses its oldest steps first (a marker says
    which were omitted), then the current observation is cut from the end (marker
    ``[...]``); the task and the action list are never cut.  If they alone exceed the
    budget the shortest prompt is returned (it is over budget, which the caller sees).
    """
    prompt = build_prompt(instruction, observation, admissible, history, cfg)
    if cfg.max_prompt_tokens is None or count_tokens is None or count_tokens(prompt) <= cfg.max_prompt_tokens:
        return prompt
    budget = cfg.max_prompt_tokens
    for shown in range(min(len(history), cfg.history_len) - 1, -1, -1):
        prompt = build_prompt(instruction, observation, admissible, history, cfg, shown=shown)
        if count_tokens(prompt) <= budget:
            return prompt
    lo, hi = 16, len(observation)  # longest observation cut that fits: binary search on characters
    best = build_prompt(instruction, observation, admissible, history, cfg, shown=0, obs_chars=lo)
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = build_prompt(instruction, observation, admissible, history, cfg, shown=0, obs_chars=mid)
        if count_tokens(cand) <= budget:
            best, lo = cand, mid + 1
        else:
            hi = mid - 1
    return best


PROMPT_SECTIONS = ("task", "interaction context", "current observation", "available actions", "template")


def prompt_sections(prompt: str) -> dict[str, str]:
    """Split a :func:`build_prompt` prompt into its sections (for token budgets): the
    text of each field, and ``template`` = the headers and the response instruction."""
    heads = [("task", "Task: "), ("interaction context", "\n\nInteraction context:\n"),
             ("current observation", "\n\nCurrent observation: "), ("available actions", "\n\nAvailable actions:\n"),
             ("end", "\n\nResponse: ")]
    pos = []
    at = 0
    for name, head in heads:
        i = prompt.find(head, at)
        if i < 0:
            raise ValueError(f"not a build_prompt prompt: no {head.strip()!r} section")
        pos.append((name, i, i + len(head)))
        at = i + len(head)
    out = {name: prompt[body:pos[k + 1][1]] for k, (name, _, body) in enumerate(pos[:-1])}
    out["template"] = "".join(head for _, head in heads) + RESPONSE_INSTRUCTION
    return out


def token_counter(tokenizer, cfg: AgentConfig | None = None) -> Callable[[str], int]:
    """``prompt -> number of tokens once templated``: what a prompt budget counts."""

    def count(prompt: str) -> int:
        return len(tokenizer(chat_text(tokenizer, prompt, cfg), add_special_tokens=False)["input_ids"])

    return count


def chat_text(tokenizer, prompt: str, cfg: AgentConfig | None = None) -> str:
    """``prompt`` as a user turn in the model's chat template, ready for generation."""
    cfg = cfg or AgentConfig()
    msgs = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    msgs.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
