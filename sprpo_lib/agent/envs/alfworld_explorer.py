"""A visible-information ALFWorld agent: demonstrations a small policy can imitate.

Why it exists: the engine's expert (``AlfworldEpisode.expert_action``) plans on the full
PDDL state, so its first move goes straight to the receptacle that hides the object.  A
policy cloned on those labels has to guess locations it cannot see: SmolLM2-135M's warm
start on them solved 0 of 32 held-out games (it repeated one ``go to`` or took objects
that were not there).  This explorer's choices are a function of what the policy's prompt shows (the
instruction, the admissible commands and the last ``MEMORY`` actions) plus one statistic
of the *training* games, where each object type tends to lie (:func:`receptacle_prior`),
the commonsense a pretrained model brings.  It keeps no other memory: a first version
that skipped every receptacle visited earlier in the episode won 24/24 games when
played, but its clone (which sees two steps back) solved 1 of 32 held-out games, looping
``shelf 1 -> shelf 2 -> shelf 1``: its labels depended on steps the prompt no longer
showed.  Here the search walks a fixed order and goes to the receptacle after the
current one, so equal prompts get equal labels.  An action the engine rejected ("Nothing
happens.", visible in the prompt as the observation after it) changed nothing, so the
explorer skips it when it reads where it is (version 3): the clone can learn to leave the
loop of repeating a rejected ``go to``.  It is ``sft.demonstrator=explorer``; WebShop's
counterpart is ``envs.webshop.visible_shopper_action``.
"""
from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

#: appliance that each processing verb uses (ALFWorld's ``clean/heat/cool X with Y``)
APPLIANCE = {"clean": "sinkbasin", "heat": "microwave", "cool": "fridge"}
_GOALS = (  # (pattern, kind); kind None: the verb in group "kind" names it
    (re.compile(r"^(?:look at|examine) (?:the )?(?P<obj>\w+) (?:under|with) the (?P<target>\w+)$"), "light"),
    (re.compile(r"^(?P<kind>clean|heat|cool) some (?P<obj>\w+) and put it (?:in|on) (?P<target>\w+)$"), None),
    (re.compile(r"^put a (?P<kind>clean|hot|cool) (?P<obj>\w+) (?:in|on) (?P<target>\w+)$"), None),
    (re.compile(r"^(?:find two (?P<obj>\w+) and put them|put two (?P<obj2>\w+)) (?:in|on) (?P<target>\w+)$"), "two"),
    (re.compile(r"^put (?:a|an|some) (?P<obj>\w+) (?:in|on) (?P<target>\w+)$"), "simple"),
)
_INSTANCE = re.compile(r"^(\w+) (\d+)$")
_PDDL_FACT = re.compile(r"\(inReceptacle (\S+) (\S+)\)")
_PLACE = re.compile(r"^(?:go to|open|close|examine) (\w+ \d+)$"
                    r"|^(?:take \w+ \d+ from|move \w+ \d+ to|(?:clean|heat|cool) \w+ \d+ with) (\w+ \d+)$")
#: previous actions the explorer reads: the cpu profile's ``rollout.agent.history_len``
MEMORY = 2
#: bump when the explorer's choices change: the warm start's cache key holds it (1: the
#: first version, which remembered every receptacle visited in the episode; 2: the last
#: MEMORY actions, rejected ones included)
LABELS_VERSION = 3


def _text_name(pddl_id: str) -> str:
    """The text name of a PDDL object id, as ALFWorld's demangler makes it: the part before
    the first ``_bar_``, lower-case, with ``basin`` appended for basins
    (``Sink_bar_..._bar_SinkBasin`` -> ``sinkbasin``)."""
    name = pddl_id.split("_bar_", 1)[0].lower()
    return name + "basin" if "basin" in pddl_id.lower() and not name.endswith("basin") else name


def parse_goal(instruction: str) -> tuple[str, str, str]:
    """``(kind, object type, target)`` of an ALFWorld instruction; kind is one of
    simple, clean, heat, cool, light, two (the six task types)."""
    text = instruction.strip().lower().rstrip(".")
    for pattern, kind in _GOALS:
        m = pattern.match(text)
        if m:
            g = m.groupdict()
            k = kind or {"hot": "heat"}.get(g["kind"], g["kind"])
            return k, g.get("obj") or g.get("obj2"), g["target"]
    raise ValueError(f"not an ALFWorld instruction this explorer knows: {instruction!r}")


def receptacle_prior(game_files: Iterable[str | Path]) -> dict[str, dict[str, int]]:
    """Object type -> receptacle type -> count of ``inReceptacle`` facts in these games'
    initial PDDL states (lower-case, as the text names them: ``mug`` -> ``fridge``)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for f in game_files:
        problem = json.loads(Path(f).read_text())["pddl_problem"]
        for obj, rec in _PDDL_FACT.findall(problem):
            counts[_text_name(obj)][_text_name(rec)] += 1
    return {o: dict(c) for o, c in counts.items()}


def _split(name: str) -> tuple[str, int]:
    m = _INSTANCE.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _search_order(receptacles: Sequence[str], wanted: str, prior: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Receptacles by how often ``wanted`` lies in their type (most first), then by name
    and number: the order in which the explorer looks."""
    p = prior.get(wanted, {})
    return sorted(receptacles, key=lambda r: (-p.get(_split(r)[0], 0), _split(r)))


def _place(action: str) -> str | None:
    """The receptacle an action happens at (``go to/open/close X``, ``take o from X``,
    ``move o to X``, ``heat o with X``), or None (``look``, ``inventory``, ``use``)."""
    m = _PLACE.match(action)
    return (m.group(1) or m.group(2)) if m else None


def _after(order: Sequence[str], here: str | None, choices: Sequence[str]) -> str | None:
    """The first of ``order`` after ``here`` (wrapping round; from the start when ``here``
    is not in it) that is among ``choices``."""
    start = order.index(here) + 1 if here in order else 0
    return next((r for r in [*order[start:], *order[:start]] if r in choices), None)


def visible_explorer_action(instruction: str, admissible: Sequence[str], actions: Sequence[str] = (),
                            prior: Mapping[str, Mapping[str, int]] | None = None, memory: int = MEMORY,
                            rejected: Sequence[bool] = ()) -> str | None:
    """The next command, from the instruction, the admissible commands and the last
    ``memory`` of this episode's ``actions`` (what the policy's prompt shows), less those
    the engine rejected (``rejected``, aligned with the end of ``actions``: "Nothing
    happens.", which changed nothing).  Rules:

    * where it is: the receptacle of the last recent action that names one;
    * what it holds: the object of an admissible ``move o to ...``, ``heat o with ...`` or
      ``examine o`` (the engine offers these for a held object only), else one taken in
      the recent actions and not put down;
    * holding another object (after a random recovery action): put it down here;
    * holding the object: process it (``clean/heat/cool X with Y``, going to the first
      sinkbasin / microwave / fridge) unless a recent action did or it is at the target
      already (it only goes there processed); for ``light``, use a lamp where one is
      admissible, else search the lamp's prior order; then put it in the target (open
      it if closed, else go to the next receptacle of the target type);
    * not holding it: take an instance where one is admissible (never from the target
      type: those are delivered), else open the closed receptacle it is at, else go to the
      receptacle after this one in the object's prior order (:func:`_search_order`, the
      target type left out), from the start when it is elsewhere.

    Returns ``None`` when nothing is admissible."""
    if not admissible:
        return None
    prior = prior or {}
    adm = list(admissible)
    if len(rejected) > len(actions):
        raise ValueError(f"rejected: {len(rejected)} flags for {len(actions)} actions; give one per action (or fewer, "
                         "aligned with the last actions)")
    flags = [False] * (len(actions) - len(rejected)) + [bool(r) for r in rejected]
    shown = list(zip(actions, flags))[-memory:] if memory > 0 else []
    recent = [a for a, bad in shown if not bad]
    kind, obj, target = parse_goal(instruction)
    goes = sorted((a[6:] for a in adm if a.startswith("go to ")), key=_split)
    here = next((p for p in map(_place, reversed(recent)) if p), None)
    rooms = sorted({*goes, *([here] if here else [])}, key=_split)
    held = next((" ".join(a.split()[1:3]) for a in adm if a.split()[0] in ("move", *APPLIANCE)
                 or (a.startswith("examine ") and a[8:] not in rooms)), None)
    if held is None:
        for a in recent:  # taken and not put down (at a closed receptacle no move is admissible)
            if a.startswith("take "):
                held = a[5:].split(" from ")[0]
            elif a.startswith("move ") and held and a[5:].startswith(held + " to "):
                held = None
    if held is not None and _split(held)[0] != obj:  # holding something else (a random action): put it down
        drop = next((a for a in adm if a.startswith(f"move {held} to ")), None)
        return drop or ("go to " + goes[0] if goes else "look")
    if held is not None:
        at_target = here is not None and _split(here)[0] == target
        if kind in APPLIANCE and not at_target and not any(a.startswith(f"{kind} {held} with ") for a in recent):
            use = next((a for a in adm if a.startswith(f"{kind} {held} with ")), None)
            if use:
                return use
            dest = [g for g in goes if _split(g)[0] == APPLIANCE[kind]]
            return "go to " + dest[0] if dest else "look"
        if kind == "light":
            use = next((a for a in adm if a.startswith("use ") and _split(a[4:])[0] == target), None)
            if use:
                return use
            just_took = bool(recent) and recent[-1].startswith(f"take {held} from ")
            nxt = _after(_search_order(rooms, target, prior), None if just_took else here, goes)
            return "go to " + nxt if nxt else "look"
        put = next((a for a in adm if a.startswith(f"move {held} to ") and _split(a.split(" to ")[-1])[0] == target), None)
        if put:
            return put
        if at_target and f"open {here}" in adm:
            return f"open {here}"
        nxt = _after([r for r in rooms if _split(r)[0] == target], here, goes)
        return "go to " + nxt if nxt else "look"
    take = [a for a in adm if a.startswith(f"take {obj} ") and _split(a.split(" from ")[-1])[0] != target]
    if take:
        return min(take, key=lambda a: _split(a[5:].split(" from ")[0]))
    if here and f"open {here}" in adm:
        return f"open {here}"
    nxt = _after(_search_order([r for r in rooms if _split(r)[0] != target], obj, prior), here, goes)
    return "go to " + (nxt or goes[0]) if goes else "look"
