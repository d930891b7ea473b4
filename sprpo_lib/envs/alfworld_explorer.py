"""A visible-information ALFWorld agent: demonstrations a small policy can imitate.

Why it exists: the engine's expert (``AlfworldEpisode.expert_action``) plans on the full
PDDL state, so its first move goes straight to the receptacle that hides the object.  A
policy cloned on those labels has to guess locations it cannot see: SmolLM2-135M's warm
start on them solved 0 of 32 held-out games (it repeated one ``go to`` or took objects
that were not there).  This explorer's choices are a function of what the agent sees (the
instruction, the admissible commands and its own previous actions) plus one statistic of
the *training* games, where each object type tends to lie (:func:`receptacle_prior`), the
commonsense a pretrained model brings.  It is ``sft.demonstrator=explorer``; WebShop's
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


def visible_explorer_action(instruction: str, admissible: Sequence[str], actions: Sequence[str] = (),
                            prior: Mapping[str, Mapping[str, int]] | None = None) -> str | None:
    """The next command, from the instruction, the admissible commands and this episode's
    previous ``actions`` only.  Rules:

    * holding another object (after a random recovery action): put it down here;
    * holding the object: process it (``clean/heat/cool X with Y``, going to the first
      sinkbasin / microwave / fridge) unless done; for ``light``, use a lamp where one is
      admissible, else search the receptacles in the lamp's prior order; then put it in
      the target (go to each receptacle of the target type in turn, opening a closed one);
    * not holding it: take an instance of the object where one is admissible (not one
      already delivered), else open the receptacle just reached if it is closed, else go
      to the next receptacle not yet visited in the object's prior order
      (:func:`_search_order`); for ``two``, after delivering the first, the place it came
      from is searched again first.

    Returns ``None`` when nothing is admissible."""
    if not admissible:
        return None
    prior = prior or {}
    adm = list(admissible)
    kind, obj, target = parse_goal(instruction)
    goes = [a[6:] for a in adm if a.startswith("go to ")]
    here = next((a[6:] for a in reversed(actions) if a.startswith("go to ")), None)
    visited = [a[6:] for a in actions if a.startswith("go to ")]
    delivered = [a.split(" to ")[0][5:] for a in actions if a.startswith("move ") and _split(a.split(" to ")[-1])[0] == target]
    held = None
    for a in actions:  # the last take not followed by a move of the same object
        if a.startswith("take "):
            held = a[5:].split(" from ")[0]
        elif a.startswith("move ") and held and a[5:].startswith(held + " to "):
            held = None
    if held is not None and _split(held)[0] != obj:  # holding something else (a random action): put it down
        drop = next((a for a in adm if a.startswith(f"move {held} to ")), None)
        if drop:
            return drop
        return "go to " + sorted(goes, key=_split)[0] if goes else "look"
    if held is not None:
        if kind in APPLIANCE and not any(a.startswith(f"{kind} {held} with ") for a in actions):
            use = next((a for a in adm if a.startswith(f"{kind} {held} with ")), None)
            if use:
                return use
            dest = sorted((g for g in goes if _split(g)[0] == APPLIANCE[kind]), key=_split)
            return "go to " + dest[0] if dest else "look"
        if kind == "light":
            use = next((a for a in adm if a.startswith("use ") and _split(a[4:])[0] == target), None)
            if use:
                return use
            took = max(i for i, a in enumerate(actions) if a.startswith("take "))
            seen = {a[6:] for a in actions[took:] if a.startswith("go to ")}
            todo = [r for r in _search_order(goes, target, prior) if r not in seen] or _search_order(goes, target, prior)
            return "go to " + todo[0] if todo else "look"
        put = next((a for a in adm if a.startswith(f"move {held} to ") and _split(a.split(" to ")[-1])[0] == target), None)
        if put:
            return put
        if here and _split(here)[0] == target and f"open {here}" in adm:
            return f"open {here}"
        tried = set(visited[-1:])  # the receptacle just tried
        dest = sorted((g for g in goes if _split(g)[0] == target and g not in tried), key=_split)
        return "go to " + dest[0] if dest else "look"
    take = [a for a in adm if a.startswith(f"take {obj} ")]
    take = [a for a in take if a[5:].split(" from ")[0] not in delivered and _split(a.split(" from ")[-1])[0] != target]
    if take:
        return sorted(take, key=lambda a: _split(a[5:].split(" from ")[0]))[0]
    if here and f"open {here}" in adm and actions and actions[-1] == f"go to {here}":
        return f"open {here}"
    if kind == "two" and delivered:  # the second: the place the first came from, then the rest
        source = next((a.split(" from ")[-1] for a in reversed(actions) if a.startswith(f"take {delivered[0]} from ")), None)
        after = actions[max(i for i, a in enumerate(actions) if a.startswith("move ")):]
        if source in goes and f"go to {source}" not in after:
            return f"go to {source}"
    todo = [r for r in _search_order(goes, obj, prior) if r not in visited]
    if not todo:
        return "go to " + _search_order(goes, obj, prior)[0] if goes else "look"
    return "go to " + todo[0]
