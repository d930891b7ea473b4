"""Seeded ALFWorld task generator: real scenes, real PDDL, ALFWorld's on-disk layout.

The offline default of :mod:`sprpo_lib.agent.envs.alfworld` (App. B "Environment Details")
needs games without ALFWorld's data download.  This module writes them in exactly the
layout ALFWorld's own loader reads (``json_2.1.1/<split>/<task folder>/<trial>/``):

* ``traj_data.json``: ``task_id``, ``task_type``, ``scene``, ``pddl_params``
  (object / parent / toggle / mrecep targets, ``object_sliced``) and
  ``turk_annotations`` (the templated goal), like ALFRED's trajectory files;
* ``game.tw-pddl``: JSON with ``pddl_domain`` and ``grammar`` (the ``alfred.pddl`` and
  ``alfred.twl2`` shipped in the ``alfworld`` wheel, the grammar's ``UNKNOWN GOAL``
  replaced by the goal text as ``alfworld-generate`` does), ``pddl_problem``,
  ``solvable`` and ``walkthrough`` (the planner's solution).

Problems follow ``alfworld/gen/scripts/augment_pddl_states.py`` (the script that wrote
ALFWorld's ``initial_state.pddl`` files): the same objects / types header, the same
predicates, the goal from ``alfworld.gen.goal_library`` and the same name mangling
(``|`` -> ``_bar_`` ...).  Room content is sampled from the scene data the wheel ships
in ``alfworld/gen/layouts``:

* ``FloorPlan<N>-openable.json``: receptacle object ids with the agent pose from which
  they are used -> receptacles and their locations;
* ``FloorPlan<N>-objects.json``: the object classes present in the floor plan;
* ``FloorPlan<N>-layout.npy``: reachable floor points (agent start, and locations of
  receptacles / fixtures that have no precomputed pose).

Two liberties, both needed because the layout files are partial: receptacle classes
listed in ``-objects.json`` without a precomputed pose (garbage can, stove burners,
toaster, ...) get one instance (stove burners 2-4) at a random reachable point with a
synthesised THOR-style id; receptacles sharing a pose get distinct camera horizons, so
every ``go to <receptacle>`` command names exactly one receptacle (the grammar lists all
receptacles of the target location in the command).

Objects are spawned like ALFRED's ``InitialRandomSpawn`` (``alfworld.gen.constants``):
1..``MAX_NUM_OF_OBJ_INSTANCES`` copies of every pickupable class present, the target
1..``PICKUP_REPEAT_MAX`` times (at least 2 for ``pick_two_obj_and_place``), each put in a
random receptacle of the room that may hold it (``VAL_RECEPTACLE_OBJECTS``).  Goals and
rooms are matched with ``GOALS_VALID`` and ``VAL_ACTION_OBJECTS`` (cleanable /
heatable / coolable / toggleable).

Splits follow ALFWorld's rule (ALFRED splits by floor plan): ``valid_unseen`` (OOD)
uses only the four floor plans of ALFRED's *valid unseen* split (10, 219, 308, 424),
which ``train`` and ``valid_seen`` (ID) never use.  Split composition by task type
mirrors ALFWorld's (ALFWorld paper, Table 1 / the json_2.1.1 release): train 3,553 =
790 / 308 / 650 / 459 / 533 / 813, valid_seen 140 = 35 / 13 / 27 / 16 / 25 / 24,
valid_unseen 134 = 24 / 18 / 31 / 23 / 21 / 17 (in :data:`TASK_TYPES` order).

Game ``i`` of a split is a pure function of ``(seed, split, i)``: the task type comes
from a seeded permutation of the split's composition block (the block repeats beyond
the default size), everything else from ``random.Random(f"...{seed}/{split}/{i}")``.
Nothing is generated up front; :meth:`AlfworldGenerator.materialise` writes one game
(atomically) the first time it is needed.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import alfworld.gen.constants as C
import alfworld.gen.goal_library as glib
import numpy as np

from sprpo_lib.infra.io import atomic_write_json
from sprpo_lib.infra.paths import cache_dir

GENERATOR_VERSION = 1

SPLITS: tuple[str, ...] = ("train", "valid_seen", "valid_unseen")

#: ALFWorld's six task types, in the order of its ``TASK_TYPES`` ids 1..6.
TASK_TYPES: tuple[str, ...] = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

#: Tasks per type in ALFWorld's json_2.1.1 splits (sums: 3,553 / 140 / 134, App. B).
SPLIT_COMPOSITION: dict[str, tuple[int, ...]] = {
    "train": (790, 308, 650, 459, 533, 813),
    "valid_seen": (35, 13, 27, 16, 25, 24),
    "valid_unseen": (24, 18, 31, 23, 21, 17),
}
DEFAULT_SIZES: dict[str, int] = {s: sum(c) for s, c in SPLIT_COMPOSITION.items()}

#: Floor plans of ALFRED's valid_unseen split (ALFWorld's OOD evaluation set).
OOD_SCENES: tuple[int, ...] = (10, 219, 308, 424)

#: Non-openable furniture a lamp may stand on (lamps are scene fixtures that ALFRED's
#: PDDL records as ``inReceptacle`` of the furniture holding them; ``ToggleObject``
#: needs that fact).
LAMP_SUPPORTS: frozenset[str] = frozenset(
    {"Desk", "SideTable", "Dresser", "Shelf", "CoffeeTable", "DiningTable", "TVStand",
     "ArmChair", "Sofa", "Bed", "CounterTop"}
)
LAMPS: tuple[str, ...] = ("DeskLamp", "FloorLamp")

#: Receptacle / device a task type needs, and parent types it may not target.
_DEVICE: dict[str, str | None] = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
_ACTION_CLASS: dict[str, str] = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}
_EXCLUDED_PARENTS: dict[str, frozenset[str]] = {
    "pick_clean_then_place_in_recep": frozenset({"SinkBasin", "BathtubBasin"}),
    "pick_heat_then_place_in_recep": frozenset({"Microwave"}),
    "pick_cool_then_place_in_recep": frozenset({"Fridge"}),
}

STATIC_RECEPTACLES: frozenset[str] = frozenset(C.VAL_RECEPTACLE_OBJECTS) - C.MOVABLE_RECEPTACLES_SET
PICKUPABLE: frozenset[str] = frozenset(set().union(*C.VAL_RECEPTACLE_OBJECTS.values())) & frozenset(C.OBJECTS)
_KNOWN_CLASSES = frozenset(C.OBJECTS) | C.MOVABLE_RECEPTACLES_SET

LAYOUTS_DIR = Path(C.__file__).parent / "layouts"
DATA_DIR = Path(C.__file__).parent.parent / "data"

_MANGLE = str.maketrans({"-": "_minus_", "#": "-", "|": "_bar_", "+": "_plus_",
                         ".": "_dot_", ",": "_comma_"})


def mangle(text: str) -> str:
    """ALFRED's ``fix_pddl_str_chars``: make THOR ids / templates valid PDDL names."""
    return text.translate(_MANGLE)


# --------------------------------------------------------------------------- scenes
@dataclass(frozen=True)
class Receptacle:
    """A static receptacle of a floor plan."""

    object_id: str  # THOR id, e.g. "Sink|-01.90|+00.97|-01.50|SinkBasin"
    rtype: str  # e.g. "SinkBasin"
    location: tuple[int, int, int, int]  # ALFRED grid pose (x, z, rotation, horizon)


@dataclass(frozen=True)
class Scene:
    """What the wheel's layout files say about one floor plan."""

    scene_num: int
    room_type: str
    receptacles: tuple[Receptacle, ...]  # only those with a precomputed pose
    classes: frozenset[str]  # object / receptacle classes present
    points: np.ndarray = field(compare=False)  # (n, 2) reachable floor points (metres)


def _grid(value: float) -> int:
    return int(round(value / C.AGENT_STEP_SIZE))


def _rtype_of(object_id: str) -> str:
    parts = object_id.split("|")
    return parts[-1] if len(parts) == 5 else parts[0]


def scene_numbers() -> list[int]:
    """All floor plans whose layout files ship in the ``alfworld`` wheel."""
    nums = {int(p.name[len("FloorPlan"):].split("-")[0]) for p in LAYOUTS_DIR.glob("FloorPlan*-objects.json")}
    return sorted(nums)


@lru_cache(maxsize=None)
def load_scene(scene_num: int) -> Scene:
    """Read one floor plan's layout files from ``alfworld/gen/layouts``."""
    stem = LAYOUTS_DIR / f"FloorPlan{scene_num}"
    with open(f"{stem}-openable.json") as f:
        poses = json.load(f)
    with open(f"{stem}-objects.json") as f:
        classes = frozenset(json.load(f))
    receptacles = []
    for oid, (x, z, rot, hor) in sorted(poses.items()):
        rtype = _rtype_of(oid)
        if rtype in STATIC_RECEPTACLES:
            receptacles.append(Receptacle(oid, rtype, (_grid(x), _grid(z), int(rot) // 90, int(hor))))
    room = next(name for name, nums in C.SCENE_TYPE.items() if scene_num in nums)
    return Scene(scene_num, room, tuple(receptacles), classes, np.load(f"{stem}-layout.npy"))


def split_scenes(split: str) -> list[int]:
    """Floor plans of a split: OOD plans for valid_unseen, all others for train / valid_seen."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if split == "valid_unseen":
        return list(OOD_SCENES)
    return [n for n in scene_numbers() if n not in OOD_SCENES]


def _receptacle_types(scene: Scene) -> set[str]:
    """Static receptacle classes of a room (with or without a precomputed pose)."""
    return {r.rtype for r in scene.receptacles} | (set(scene.classes) & STATIC_RECEPTACLES)


def _candidates(task_type: str, scene: Scene) -> list[tuple[str, str]]:
    """Feasible ``(object_target, parent_or_toggle_target)`` pairs of a task type in a room."""
    if scene.room_type not in C.GOALS_VALID[task_type]:
        return []
    rtypes = _receptacle_types(scene)
    objects = sorted(PICKUPABLE & scene.classes)
    pairs: list[tuple[str, str]] = []
    if task_type == "look_at_obj_in_light":
        if not rtypes & LAMP_SUPPORTS:
            return []
        lamps = [lamp for lamp in LAMPS if lamp in scene.classes]
        return [(o, lamp) for lamp in lamps for o in objects
                if any(o in C.VAL_RECEPTACLE_OBJECTS[r] for r in rtypes)]
    device = _DEVICE.get(task_type)
    if device is not None and device not in rtypes:
        return []
    action_class = _ACTION_CLASS.get(task_type)
    excluded = _EXCLUDED_PARENTS.get(task_type, frozenset())
    for o in objects:
        if action_class and o not in C.VAL_ACTION_OBJECTS[action_class]:
            continue
        holders = {r for r in rtypes if o in C.VAL_RECEPTACLE_OBJECTS[r]}
        for parent in sorted(holders - excluded):
            if holders - {parent}:  # the object can start somewhere else
                pairs.append((o, parent))
    return pairs


@lru_cache(maxsize=None)
def feasible_scenes(split: str, task_type: str) -> tuple[int, ...]:
    """Floor plans of ``split`` where ``task_type`` has at least one feasible goal."""
    return tuple(n for n in split_scenes(split) if _candidates(task_type, load_scene(n)))


# --------------------------------------------------------------------------- specs
@dataclass
class GameSpec:
    """One generated game, before the planner's walkthrough is attached."""

    seed: int
    split: str
    index: int
    task_type: str
    scene_num: int
    object_target: str
    parent_target: str  # "" for look_at_obj_in_light
    toggle_target: str  # "" unless look_at_obj_in_light
    task_desc: str
    pddl_problem: str

    @property
    def task_id(self) -> str:
        return f"trial_G{self.seed}_{self.split}_{self.index:05d}"

    @property
    def rel_dir(self) -> str:
        """Folder relative to the ``json_2.1.1`` root, named like ALFWorld's."""
        second = self.toggle_target or self.parent_target
        task_dir = f"{self.task_type}-{self.object_target}-None-{second}-{self.scene_num}"
        return f"{self.split}/{task_dir}/{self.task_id}"

    def traj_data(self) -> dict:
        return {
            "task_id": self.task_id,
            "task_type": self.task_type,
            "scene": {"floor_plan": f"FloorPlan{self.scene_num}", "scene_num": self.scene_num},
            "pddl_params": {
                "object_target": self.object_target,
                "parent_target": self.parent_target,
                "toggle_target": self.toggle_target,
                "mrecep_target": "",
                "object_sliced": False,
            },
            "turk_annotations": {"anns": [{"task_desc": self.task_desc}]},
            "sprpo_generator": {"version": GENERATOR_VERSION, "seed": self.seed,
                                "split": self.split, "index": self.index},
        }

    def game_data(self, walkthrough: Sequence[str] | None) -> dict:
        domain, grammar = game_logic()
        return {
            "pddl_domain": domain,
            "grammar": grammar.replace("UNKNOWN GOAL", self.task_desc),
            "pddl_problem": self.pddl_problem,
            "solvable": walkthrough is not None,
            "walkthrough": list(walkthrough) if walkthrough is not None else None,
        }


@lru_cache(maxsize=1)
def game_logic() -> tuple[str, str]:
    """The ``alfred.pddl`` domain and ``alfred.twl2`` grammar shipped in the wheel."""
    return (DATA_DIR / "alfred.pddl").read_text(), (DATA_DIR / "alfred.twl2").read_text()


def _task_type_schedule(seed: int, split: str) -> list[str]:
    """One block of a split's composition, permuted by ``(seed, split)``."""
    block = [t for t, n in zip(TASK_TYPES, SPLIT_COMPOSITION[split]) for _ in range(n)]
    random.Random(f"sprpo-alfworld/schedule/{seed}/{split}").shuffle(block)
    return block


_schedule = lru_cache(maxsize=None)(_task_type_schedule)


def task_type_of(seed: int, split: str, index: int) -> str:
    """Task type of game ``index`` (exact ALFWorld composition per block of the split)."""
    block = _schedule(seed, split)
    return block[index % len(block)]


def _id(cls: str, xyz: Sequence[float]) -> str:
    return f"{cls}|" + "|".join(f"{v:+06.2f}" for v in xyz)


def _xyz_of(object_id: str) -> tuple[float, float, float]:
    x, y, z = (float(v) for v in object_id.split("|")[1:4])
    return x, y, z


def sample_game(seed: int, split: str, index: int) -> GameSpec:
    """Game ``index`` of ``split`` for ``seed`` (pure and cheap: no planning)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if index < 0:
        raise IndexError(f"negative game index {index}")
    task_type = task_type_of(seed, split, index)
    rng = random.Random(f"sprpo-alfworld/game/{seed}/{split}/{index}")
    scenes = feasible_scenes(split, task_type)
    scene = load_scene(rng.choice(scenes))
    obj, second = rng.choice(_candidates(task_type, scene))
    toggle = second if task_type == "look_at_obj_in_light" else ""
    parent = "" if toggle else second
    return _build(seed, split, index, task_type, scene, obj, parent, toggle, rng)


def _build(seed: int, split: str, index: int, task_type: str, scene: Scene, obj: str,
           parent: str, toggle: str, rng: random.Random) -> GameSpec:
    """The game spec of one task: the target object, its parent receptacle or lamp, and every
    other object of the scene placed by ALFRED's random-spawn rule, with fresh THOR ids.

    Long on purpose: one scene's placement is a sequence of draws from ``rng`` whose order
    fixes every generated game; split up, that order would be spread over several functions."""
    used_ids: set[str] = set()
    points = [tuple(p) for p in scene.points.tolist()]

    def fresh_id(cls: str, near: tuple[float, float, float], spread: float) -> str:
        while True:
            xyz = (near[0] + rng.uniform(-spread, spread), max(0.0, near[1] + rng.uniform(0.0, spread)),
                   near[2] + rng.uniform(-spread, spread))
            # THOR names basins after their fixture: "Sink|x|y|z|SinkBasin".
            oid = _id(cls[:-len("Basin")], xyz) + f"|{cls}" if cls.endswith("Basin") else _id(cls, xyz)
            if oid not in used_ids:
                used_ids.add(oid)
                return oid

    def random_pose() -> tuple[int, int, int, int]:
        px, pz = rng.choice(points)
        return (_grid(px), _grid(pz), rng.randrange(4), 30)

    # Receptacles: those with a precomputed pose, plus one instance (stove: 2-4) at a
    # reachable point for each static receptacle class present without one.
    receptacles = list(scene.receptacles)
    used_ids.update(r.object_id for r in receptacles)
    missing = sorted((scene.classes & STATIC_RECEPTACLES) - {r.rtype for r in receptacles})
    for rtype in missing:
        for _ in range(rng.randint(2, 4) if rtype == "StoveBurner" else 1):
            pose = random_pose()
            near = (pose[0] * C.AGENT_STEP_SIZE, rng.uniform(0.0, 1.0), pose[1] * C.AGENT_STEP_SIZE)
            receptacles.append(Receptacle(fresh_id(rtype, near, 0.5), rtype, pose))
    # One receptacle per location, so "go to <receptacle>" is unambiguous: receptacles
    # sharing a pose are told apart by the camera horizon (ALFRED uses 0..60 degrees).
    taken: set[tuple[int, int, int, int]] = set()
    placed_receptacles = []
    for r in receptacles:
        loc = r.location
        while loc in taken:
            loc = (loc[0], loc[1], loc[2], loc[3] + 15)
        taken.add(loc)
        placed_receptacles.append(Receptacle(r.object_id, r.rtype, loc))
    receptacles = placed_receptacles
    by_type: dict[str, list[Receptacle]] = {}
    for r in receptacles:
        by_type.setdefault(r.rtype, []).append(r)

    # Objects (ALFRED InitialRandomSpawn): instances of every class present.
    objects: list[tuple[str, str, Receptacle | None, tuple[int, int, int, int]]] = []  # id, cls, in, loc
    for cls in sorted(scene.classes & _KNOWN_CLASSES):
        if cls in STATIC_RECEPTACLES:
            continue
        if cls in PICKUPABLE:
            holders = [r for r in receptacles if cls in C.VAL_RECEPTACLE_OBJECTS[r.rtype]]
            if cls == obj:
                holders = [r for r in holders if r.rtype != parent]
                low = 2 if task_type == "pick_two_obj_and_place" else 1
                count = rng.randint(low, C.PICKUP_REPEAT_MAX)
            else:
                count = rng.randint(1, C.MAX_NUM_OF_OBJ_INSTANCES)
            if not holders:
                continue
            for _ in range(count):
                r = rng.choice(holders)
                objects.append((fresh_id(cls, _xyz_of(r.object_id), 0.3), cls, r, r.location))
        elif cls in LAMPS:
            supports = [r for r in receptacles if r.rtype in LAMP_SUPPORTS]
            if not supports:
                continue
            r = rng.choice(supports)
            objects.append((fresh_id(cls, _xyz_of(r.object_id), 0.3), cls, r, r.location))
        else:  # fixtures (paintings, windows, ...) only have a location
            pose = random_pose()
            near = (pose[0] * C.AGENT_STEP_SIZE, rng.uniform(0.0, 2.0), pose[1] * C.AGENT_STEP_SIZE)
            objects.append((fresh_id(cls, near, 0.5), cls, None, pose))

    # Agent start: a reachable point that is not a receptacle's location
    # ("You are in the middle of a room.").
    while True:
        start = random_pose()
        if start not in taken:
            break

    goal_key = task_type
    template = rng.choice(glib.gdict[goal_key]["templates"])
    task_desc = template.format(obj=obj.lower(), recep=parent.lower(), toggle=toggle.lower(), mrecep="")
    goal = glib.gdict[goal_key]["pddl"].format(obj=obj, recep=parent, toggle=toggle, mrecep="")
    task_id = f"trial_G{seed}_{split}_{index:05d}"
    problem = _problem_text(task_id, receptacles, objects, start, goal)
    return GameSpec(seed, split, index, task_type, scene.scene_num, obj, parent, toggle, task_desc, problem)


def _loc(pose: tuple[int, int, int, int]) -> str:
    return mangle("loc|%d|%d|%d|%d" % pose)


def _problem_text(task_id: str, receptacles: list[Receptacle],
                  objects: list[tuple[str, str, Receptacle | None, tuple[int, int, int, int]]],
                  start: tuple[int, int, int, int], goal: str) -> str:
    """PDDL problem in the layout of ALFWorld's ``initial_state.pddl``."""
    receptacle_types = set(C.RECEPTACLES) - C.MOVABLE_RECEPTACLES_SET
    classes = sorted(C.OBJECTS_SET - receptacle_types)
    locations = sorted({r.location for r in receptacles} | {loc for *_, loc in objects} | {start})
    ind = "\n        "
    header = ["agent1 - agent"]
    header += [f"{c} - object" for c in classes]
    header += [f"{c}Type - otype" for c in classes]
    header += [f"{c}Type - rtype" for c in sorted(receptacle_types)]
    header += [f"{mangle(oid)} - object" for oid, *_ in sorted(objects)]
    header += [f"{mangle(r.object_id)} - receptacle" for r in sorted(receptacles, key=lambda r: r.object_id)]
    header += [f"{_loc(loc)} - location" for loc in locations]

    present = {cls for _, cls, _, _ in objects}
    rtypes = sorted({r.rtype for r in receptacles})
    init = [f"(receptacleType {mangle(r.object_id)} {r.rtype}Type)" for r in receptacles]
    init += [f"(objectType {mangle(oid)} {cls}Type)" for oid, cls, _, _ in objects]
    init += [f"(canContain {rt}Type {o}Type)" for rt in rtypes
             for o in sorted(C.VAL_RECEPTACLE_OBJECTS[rt] & present)]
    init += [f"(pickupable {mangle(oid)})" for oid, cls, _, _ in objects if cls in PICKUPABLE]
    init += [f"(isReceptacleObject {mangle(oid)})" for oid, cls, _, _ in objects
             if cls in C.MOVABLE_RECEPTACLES_SET]
    init += [f"(openable {mangle(r.object_id)})" for r in receptacles if r.rtype in C.OPENABLE_CLASS_SET]
    init.append(f"(atLocation agent1 {_loc(start)})")
    for prop, action_class in (("cleanable", "Cleanable"), ("heatable", "Heatable"), ("coolable", "Coolable"),
                               ("toggleable", "Toggleable"), ("sliceable", "Sliceable")):
        init += [f"({prop} {mangle(oid)})" for oid, cls, _, _ in objects if cls in C.VAL_ACTION_OBJECTS[action_class]]
    init += [f"(inReceptacle {mangle(oid)} {mangle(r.object_id)})" for oid, _, r, _ in objects if r is not None]
    init += [f"(receptacleAtLocation {mangle(r.object_id)} {_loc(r.location)})"
             for r in sorted(receptacles, key=lambda r: r.object_id)]
    init += [f"(objectAtLocation {mangle(oid)} {_loc(loc)})" for oid, _, _, loc in objects]
    return (f"\n(define (problem plan_{task_id})\n(:domain alfred)\n(:objects\n"
            + ind.join(header) + "\n        )\n\n(:init\n" + ind + ind.join(init) + "\n        )\n\n"
            + mangle(goal))


# --------------------------------------------------------------------------- files
def default_cache_root() -> Path:
    """``<cache root>/alfworld`` (:func:`sprpo_lib.infra.paths.cache_dir`)."""
    return cache_dir() / "alfworld"


class AlfworldGenerator:
    """Lazily materialised generated pool under ``<cache_root>/<seed>/json_2.1.1``.

    Args:
        seed: generator seed; game ``i`` of a split depends only on (seed, split, i).
        cache_root: cache directory (default :func:`default_cache_root`).
    """

    def __init__(self, seed: int = 0, cache_root: str | os.PathLike | None = None) -> None:
        self.seed = int(seed)
        self.root = Path(cache_root or default_cache_root()) / str(self.seed) / "json_2.1.1"

    def spec(self, split: str, index: int) -> GameSpec:
        return sample_game(self.seed, split, index)

    def game_path(self, split: str, index: int) -> Path:
        """Path of game ``index``'s ``game.tw-pddl`` (it may not exist yet)."""
        return self.root / self.spec(split, index).rel_dir / "game.tw-pddl"

    def materialise(self, split: str, index: int,
                    solve: Callable[[dict], Sequence[str] | None]) -> Path:
        """Write game ``index`` if missing and return its ``game.tw-pddl`` path.

        ``solve(game_data)`` must return the planner's walkthrough (a list of commands)
        or None; an unsolvable generated game is a generator bug and raises.
        ``traj_data.json`` is written first and ``game.tw-pddl`` last, each atomically,
        so an existing game file always belongs to a complete game.
        """
        spec = self.spec(split, index)
        game_path = self.root / spec.rel_dir / "game.tw-pddl"
        if game_path.exists():
            return game_path
        walkthrough = solve(spec.game_data(None))
        if not walkthrough:
            raise RuntimeError(f"generated ALFWorld game {spec.rel_dir} has no plan (generator bug)")
        atomic_write_json(game_path.parent / "traj_data.json", spec.traj_data())
        atomic_write_json(game_path, spec.game_data(walkthrough))
        return game_path
