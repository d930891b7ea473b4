"""ALFWorld on the real TextWorld PDDL engine (App. B "Environment Details").

Games are played by TextWorld's :class:`textworld.envs.PddlEnv` with the ``alfred.pddl``
domain and ``alfred.twl2`` grammar stored in each ``game.tw-pddl`` (the files shipped in
the ``alfworld`` wheel), exactly the engine ALFWorld's ``AlfredTWEnv`` uses:
observations are the engine's feedback ("You arrive at fridge 1. The fridge 1 is
closed.", "Nothing happens." for anything it does not accept), admissible commands are
the engine's ``admissible_commands`` and success is the engine's ``won``.

Two sources of games, one code path (:func:`make_alfworld_pool`):

* real data: any folder in ALFWorld's ``json_2.1.1`` layout (``train`` /
  ``valid_seen`` = ID / ``valid_unseen`` = OOD), filtered with ALFWorld's loader rules;
* the offline default: games written lazily, in the same layout, by the seeded
  generator :mod:`sprpo_lib.agent.envs.alfworld_gen` (no download needed).

Sharing the reset cost across a GiGPO group.  Loading a TextWorld PDDL game translates
the problem to SAS+ with Fast Downward's translator (twice: plain and optimised), which
takes seconds; ``PddlEnv`` repeats it on every ``reset``.  Here a :class:`AlfworldTask`
grounds its game once: one translation, one planner library instance
(``fast_downward.load_lib``) holding the grounded task, and one initial
:class:`~textworld.envs.pddl.logic.PddlState`.  :meth:`AlfworldTask.spawn` then clones
that state: each :class:`AlfworldEpisode` keeps its own Python-side facts and its own
state id in the library's state registry (``get_state_id`` / ``set_state_id`` of
fast-downward-textworld's C interface), so G rollouts cost one grounding, not G.

Expert.  ``Episode.expert_action()`` follows the game's stored ``walkthrough`` while the
episode is on it; after a deviation it replans from the current state with Fast
Downward (the same search ``PddlState.replan`` runs) on the goal-relevant sub-problem
(objects of the goal's classes, objects in hand, receptacles of the goal's classes /
devices / holding those objects).  Pruning keeps the plan optimal and valid in the full
game -- the dropped objects and receptacles cannot help reach the goal -- but turns the
uniform-cost search over the whole room (tens of seconds to minutes in kitchens) into
milliseconds.  Generated games store such a plan, replayed and verified (``won``) on the
full game, as their ``walkthrough``.

Reward (App. B "Reward", following GiGPO): sparse, ``success_reward`` on the final step
when the goal is satisfied, else 0.  The default 10.0 is verl-agent's ALFWorld reward
(``compute_reward``: ``10.0 * float(info['won'])`` in
``agent_system/environments/env_package/alfworld/envs.py``).  ``help`` is executable but
not listed among admissible actions, as verl-agent's ALFWorld prompt builder drops it.

Workers.  Nothing here holds a thread or a subprocess.  :class:`AlfworldPool` pickles
as its configuration, :class:`AlfworldTask` as a ``(pool, split, index)`` reference
(unpickling re-grounds the game in the receiving process) and :class:`AlfworldEpisode`
as its task reference plus its action history (unpickling replays it).  A vectorised
runner can therefore ``open``/``spawn`` tasks inside worker processes and keep each
task's G episodes in the process that grounded it.  A task's episodes share one planner
library; calls are serialised by a per-task lock, so threads are safe but gain nothing
within one task.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import functools
import gzip
import importlib.metadata
import json
import logging
import os
import re
import sys
import threading
import weakref
import zlib
from pathlib import Path
from typing import Mapping, Sequence

import fast_downward
import textworld
from alfworld.agents.utils.misc import Demangler
from textworld.core import GameState
from textworld.envs import PddlEnv
from textworld.envs.pddl import logic as pddl_logic
from textworld.envs.pddl import textgen
from textworld.generator.game import EntityInfo

from sprpo_lib.agent.envs import alfworld_gen
from sprpo_lib.agent.envs.alfworld_explorer import receptacle_prior, visible_explorer_action
from sprpo_lib.agent.envs.base import GENERATED, DataError, Observation, check_split, resolve_data_dir
from sprpo_lib.infra.io import CorruptFileError, atomic_write_bytes, canonical_hash, read_cached
from sprpo_lib.infra.paths import cache_dir

log = logging.getLogger(__name__)

MAX_STEPS = 50  # App. B: ALFWorld episodes end after 50 environment steps.
PRIOR_GAMES = 60  # training games whose object placements give the explorer's search order
DEFAULT_SUCCESS_REWARD = 10.0  # verl-agent / GiGPO ALFWorld reward for ``won``.
SPLITS = alfworld_gen.SPLITS
TASK_TYPES = alfworld_gen.TASK_TYPES
HIDDEN_COMMANDS = frozenset({"help"})  # executable, not listed (verl-agent drops it)


class AlfworldDataError(DataError):
    """A real-data folder is missing or not in ALFWorld's ``json_2.1.1`` layout."""


# --------------------------------------------------------------------------- planner libraries
class _LibraryPool:
    """Per-process free list of Fast Downward library instances.

    ``fast_downward.load_lib`` copies ``libdownward.so`` (33 MB) and ``dlopen``s the
    copy, because the library keeps its task in globals; that costs ~0.1 s.  Tasks
    borrow an instance and give it back (``cleanup`` frees the grounded task) instead of
    unloading it: ``close_lib`` (``dlclose``) followed by new loads crashed here.
    """

    def __init__(self) -> None:
        self._free: list = []
        self._lock = threading.Lock()

    def acquire(self):
        with self._lock:
            if self._free:
                return self._free.pop()
        lib = fast_downward.load_lib()
        lib.get_state_id.argtypes = []
        lib.get_state_id.restype = int
        lib.set_state_id.argtypes = [ctypes.c_int]
        lib.set_state_id.restype = None
        return lib

    def release(self, lib) -> None:
        lib.cleanup()
        with self._lock:
            self._free.append(lib)


_LIBRARIES = _LibraryPool()
_TRANSLATOR_LOCK = threading.Lock()
_PDDL2SAS = fast_downward.pddl2sas
#: what a stored translation depends on besides the PDDL text: the translator's release
TRANSLATOR_VERSION = f"fast_downward_textworld {importlib.metadata.version('fast_downward_textworld')}"
#: translations kept per process (a game's plain and optimised SAS+ task, ~1 s each to
#: compute): an evaluation opens the same held-out games once per cell
TRANSLATION_MEMO_SIZE = 1024
_TRANSLATIONS: collections.OrderedDict = collections.OrderedDict()
_MADE: collections.Counter = collections.Counter()
_GAME_TEXTS: collections.OrderedDict = collections.OrderedDict()  # game texts -> _game_texts's record
_GAME_TEXTS_LOCK = threading.Lock()


def _read_sas(path: Path, key: str) -> str:
    """The SAS text of a stored translation, checked against its key."""
    try:
        entry = json.loads(gzip.decompress(path.read_bytes()).decode("utf-8"))
    except (OSError, EOFError, ValueError, zlib.error) as err:
        raise CorruptFileError(path, f"not a whole gzip-compressed JSON entry ({type(err).__name__})") from None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("sas"), str):
        raise CorruptFileError(path, "not the translation of this game")
    return entry["sas"]


def _parsed_task(domain: str, problem: str):
    """The PDDL task ``fast_downward.pddl2sas`` returns beside the SAS text: its parse and
    normalize steps (the translation itself leaves the task as they made it)."""
    sys.argv = ["translate.py", "domain", "task"]
    # imported after sys.argv is set: the translator's options module parses argv on import
    from fast_downward.translate import normalize  # (see the line above)
    from fast_downward.translate.pddl_parser import lisp_parser, parsing_functions  # (as above)

    task = parsing_functions.parse_task(lisp_parser.parse_nested_list(domain.split("\n")),
                                        lisp_parser.parse_nested_list(problem.split("\n")))
    normalize.normalize(task)
    return task


def _stored_pddl2sas(domain: str, problem: str, verbose: bool, optimize: bool):
    """``fast_downward.pddl2sas`` (``(task, sas)``) with the SAS text, its costly part, in a
    content-keyed store on disk, ``<cache>/alfworld/sas/`` (:func:`~sprpo_lib.infra.paths.cache_dir`):
    every process that opens a game (evaluation cells, notebooks, workers) translates it once
    per machine.  An entry is checked when read; a damaged one is translated again."""
    key = canonical_hash([TRANSLATOR_VERSION, domain, problem, bool(optimize)])
    path = cache_dir() / "alfworld" / "sas" / f"{key[:40]}.json.gz"
    sas = read_cached(path, _read_sas, key)
    if sas is not None:
        return _parsed_task(domain, problem), sas
    task, sas = _PDDL2SAS(domain, problem, verbose=verbose, optimize=optimize)
    _MADE["translations"] += 1
    try:
        atomic_write_bytes(path, gzip.compress(json.dumps({"key": key, "sas": sas}).encode("utf-8"), mtime=0))
    except OSError as err:  # a read-only or full cache: translate without storing
        log.warning("ALFWorld translation store %s: %s; translating without it", path.parent, err)
    return task, sas


def _game_texts(game_data: Mapping) -> dict:
    """What the grammar derives alike in every grounding of one game, kept per process by the
    game's texts (least recently used out): ``"intro"`` (:meth:`_Grounding.intro`) and
    ``"commands"``, the state-free command texts (:meth:`_SharedPddlEnv._gather_infos`).  An
    evaluation grounds the same held-out games once per cell; each cell then derives nothing
    the previous ones derived."""
    key = (game_data["pddl_domain"], game_data["grammar"], game_data["pddl_problem"])
    with _GAME_TEXTS_LOCK:
        record = _GAME_TEXTS.get(key)
        if record is None:
            record = _GAME_TEXTS[key] = {"intro": None, "commands": {}}
            while len(_GAME_TEXTS) > TRANSLATION_MEMO_SIZE:
                _GAME_TEXTS.popitem(last=False)
        else:
            _GAME_TEXTS.move_to_end(key)
    return record


def _memo_pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
    """``fast_downward.pddl2sas`` remembered by its inputs (least recently used out), over the
    store on disk (:func:`_stored_pddl2sas`).  The translation is a pure function of the PDDL
    text, and TextWorld's ``PddlState`` only reads the returned task, so states of the same
    game may share it."""
    key = (domain, problem, bool(optimize))
    hit = _TRANSLATIONS.get(key)
    if hit is None:
        hit = _TRANSLATIONS[key] = _stored_pddl2sas(domain, problem, verbose, optimize)
        while len(_TRANSLATIONS) > TRANSLATION_MEMO_SIZE:
            _TRANSLATIONS.popitem(last=False)
    else:
        _TRANSLATIONS.move_to_end(key)
    return hit


@functools.lru_cache(maxsize=8)
def parsed_game_logic(domain: str, grammar: str) -> pddl_logic.GameLogic:
    """TextWorld's ``GameLogic`` once per (domain, grammar) text: parsing the grammar is most
    of opening a game.  The logic is read, never changed, after it is built (``PddlState``
    adds the domain's types to it, the same for every game of the domain, a repeat is
    ignored), so the games of one domain may share it."""
    return pddl_logic.GameLogic(domain=domain, grammar=grammar)


GOAL_PLACEHOLDER = "UNKNOWN GOAL"  # what ALFWorld's add_task_to_grammar replaces in alfred.twl2
_TASK_RHS = re.compile(r'("rhs":\s*"Your task is to: )([^"\n]*)(\.")')
_LITERAL = re.compile(r'[^;|"<>\[\]#{}\\\t\n]*')  # textgen.ebnf's Literal, less its escapes and whitespace


def shared_game_logic(domain: str, grammar: str) -> pddl_logic.GameLogic:
    """The game's ``GameLogic``.  ALFWorld's games differ in one grammar line, the task rule
    ("Your task is to: <goal>.", :data:`GOAL_PLACEHOLDER` in ``alfred.twl2``), so the grammar
    is parsed once with the placeholder (:func:`parsed_game_logic`) and each game gets a copy
    whose task rule holds its goal.  A goal that is not one plain terminal of TextWorld's
    grammar, or a grammar without exactly one task rule, is parsed whole."""
    found = list(_TASK_RHS.finditer(grammar))
    goal = found[0].group(2) if len(found) == 1 else None
    if goal is None or not _LITERAL.fullmatch(goal) or GOAL_PLACEHOLDER in goal:
        return parsed_game_logic(domain, grammar)
    template = grammar[: found[0].start(2)] + GOAL_PLACEHOLDER + grammar[found[0].end(2):]
    base = parsed_game_logic(domain, template)
    logic = copy.copy(base)
    logic.grammar = textgen.ContextSensitiveGrammar()
    for name, rules in base.grammar._rules.items():
        logic.grammar._rules[name] = [_with_goal(rule, goal) for rule in rules]
    return logic


def _with_goal(rule: textgen.ProductionRule, goal: str) -> textgen.ProductionRule:
    """``rule`` with :data:`GOAL_PLACEHOLDER` in its terminal symbols replaced by ``goal``
    (the rule itself where none holds it)."""
    if not any(isinstance(s, textgen.TerminalSymbol) and GOAL_PLACEHOLDER in s.symbol for s in rule.rhs):
        return rule
    rhs = [textgen.TerminalSymbol(s.symbol.replace(GOAL_PLACEHOLDER, goal), s.context)
           if isinstance(s, textgen.TerminalSymbol) else s for s in rule.rhs]
    return textgen.ProductionRule(rule.lhs, rhs, rule.weight, rule.condition)


_TEXTGEN_PARSE = textgen._parse_and_convert
_PARSE_MEMO = threading.local()


@functools.lru_cache(maxsize=4096)
def _parsed_symbols(text: str) -> tuple:
    return tuple(_TEXTGEN_PARSE(text, rule_name="symbols"))


def _textgen_parse(text: str, rule_name: str | None = None, **kwargs):
    """TextWorld's grammar parse (tatsu), which ``derive`` runs on every command
    template of every step, remembered by text inside :func:`_remembered_parses`; a deep copy
    is served, since ``derive`` sets each symbol's context.  Elsewhere (ALFWorld's own
    ``PddlEnv``) it is TextWorld's parse unchanged."""
    if getattr(_PARSE_MEMO, "on", False) and rule_name == "symbols" and not kwargs.get("trace"):
        return copy.deepcopy(list(_parsed_symbols(text)))
    return _TEXTGEN_PARSE(text, rule_name=rule_name, **kwargs)


textgen._parse_and_convert = _textgen_parse


@contextlib.contextmanager
def _remembered_parses():
    """Grammar derivations in this thread use :func:`_textgen_parse`'s memo."""
    before = getattr(_PARSE_MEMO, "on", False)
    _PARSE_MEMO.on = True
    try:
        yield
    finally:
        _PARSE_MEMO.on = before


def translations_cached() -> int:
    """How many game translations this process remembers (:func:`_memo_pddl2sas`)."""
    return len(_TRANSLATIONS)


def translations_made() -> int:
    """How many game translations this process computed (not served from memory or disk)."""
    return _MADE["translations"]


def forget_translations() -> None:
    """Empty this process's memory of translations (the store on disk stays)."""
    _TRANSLATIONS.clear()


@contextlib.contextmanager
def _translator():
    """Fast Downward's translator keeps global options and overwrites ``sys.argv``:
    serialise it and restore ``sys.argv`` afterwards.  Inside, ``fast_downward.pddl2sas``
    (which TextWorld's ``PddlState`` calls) is the per-process memo
    :func:`_memo_pddl2sas`."""
    with _TRANSLATOR_LOCK:
        argv = list(sys.argv)
        fast_downward.pddl2sas = _memo_pddl2sas
        try:
            yield
        finally:
            fast_downward.pddl2sas = _PDDL2SAS
            sys.argv[:] = argv


def _translate(domain: str, problem: str, optimize: bool = False):
    """One translation, not remembered (the expert's replanning problems are one-offs)."""
    with _translator():
        return _PDDL2SAS(domain, problem, optimize=optimize)


# --------------------------------------------------------------------------- grounding
def _op_name(action: textworld.logic.Action) -> str:
    """Fast Downward operator name of an applicable action ("putobject agent1 l o r ot rt")."""
    return " ".join([action.name] + [v.name for v in action.mapping.values()])


class _Grounding:
    """The expensive, shareable part of one game (computed once per task).

    Holds the parsed grammar (``GameLogic``, shared: :func:`shared_game_logic`), a planner library
    with the grounded task loaded, the initial :class:`PddlState` (built by TextWorld itself,
    which is where the translation happens), ALFWorld's demangled entity names and the stored
    walkthrough.
    """

    def __init__(self, game_data: Mapping, game_file: str | None = None) -> None:
        self.game_data = dict(game_data)
        self.game_file = game_file
        self.walkthrough: list[str] | None = game_data.get("walkthrough") or None
        self.lock = threading.RLock()
        self.logic = shared_game_logic(game_data["pddl_domain"], game_data["grammar"])
        self.lib = _LIBRARIES.acquire()
        self._finalizer = weakref.finalize(self, _LIBRARIES.release, self.lib)
        self._finalizer.atexit = False
        with _translator(), self.lock:  # PddlState translates the problem (the slow part)
            self.initial_state = pddl_logic.PddlState(self.lib, game_data["pddl_problem"], self.logic)
            self.initial_sid = self.lib.get_state_id()
        self.initial_facts = list(self.initial_state.facts)
        # PddlEnv._get_entity_infos + ALFWorld's AlfredDemangler (shuffle=False).
        self.entity_infos = {v.name: EntityInfo(v.name, v.type) for f in self.initial_facts for v in f.arguments}
        for info in self.entity_infos.values():
            info.definite, info.indefinite = "the", "a"
        demangler = Demangler(game_infos=self.entity_infos, shuffle=False)
        for info in self.entity_infos.values():
            info.name = demangler.demangle_alfred_name(info.id)
        context = {"state": self.initial_state, "facts": self.initial_facts, "variables": {},
                   "mapping": {}, "entity_infos": self.entity_infos}
        with _remembered_parses():
            task_line = self.logic.grammar.derive("#task#", context).strip()
        self.instruction = re.sub(r"^Your task is to:\s*", "", task_line).rstrip(".").strip()
        self.goal_pddl = _goal_section(game_data["pddl_problem"])
        # Admissible-command cache (see _SharedPddlEnv._gather_infos).
        task = self.initial_state.task
        changed = {eff.literal.predicate for act in task.actions for eff in act.effects}
        changed |= {ax.name for ax in task.axioms}  # derived predicates follow the state
        self.static_predicates = {pred.name for pred in task.predicates} - changed
        self.texts = _game_texts(self.game_data)
        self.command_cache: dict[tuple, str] = self.texts["commands"]  # shared by the game's groundings
        self.cacheable_templates = {name: _state_free_template(act.template, self.static_predicates)
                                    for name, act in self.logic.actions.items()}
        self.template_placeholders: dict[str, frozenset[str]] = {}  # operator -> names its template uses

    def new_state(self) -> pddl_logic.PddlState:
        """A fresh copy of the initial state sharing the translated task and library."""
        state = copy.copy(self.initial_state)
        state._facts = collections.defaultdict(set)
        state._vars_by_name = {}
        state._vars_by_type = collections.defaultdict(set)
        state._var_counts = collections.Counter()
        state.add_facts(self.initial_facts)
        return state

    def intro(self, state: pddl_logic.PddlState) -> str:
        """The grammar's ``#intro#`` for ``state``, a fresh copy of the initial state: the same
        text for every episode of the game, so derived once per game and process
        (:func:`_game_texts`) instead of on every reset."""
        if self.texts["intro"] is None:
            context = {"state": state, "facts": list(state.facts), "variables": {}, "mapping": {},
                       "entity_infos": self.entity_infos}
            self.texts["intro"] = self.logic.grammar.derive("#intro#", context)
        return self.texts["intro"]

    def close(self) -> None:
        """Give the planner library back (episodes of this task become unusable)."""
        self._finalizer()


def _state_free_template(template: str, static_predicates: set[str]) -> bool:
    """Whether a command template derives to the same text in every state of a game.

    True when it expands no grammar symbol (``#...#``) and every query it makes
    (``{r.name | receptacleatlocation(r:receptacle, lend:location)}``) names only
    predicates no action ever changes; its text is then a function of the action's
    argument mapping alone.  Anything else (function calls in ``{...}`` included) is
    treated as state-dependent and derived every time."""
    if "#" in template:
        return False
    return all(name in static_predicates for name in re.findall(r"([A-Za-z_][\w-]*)\s*\(", template))


def _goal_section(problem: str) -> str:
    start = problem.lower().find("(:goal")
    if start < 0:
        raise ValueError("PDDL problem has no (:goal ...) section")
    return problem[start:]


_DEVICE_TYPES = {"isclean": ("sinktype", "sinkbasintype"), "ishot": ("microwavetype",),
                 "iscool": ("fridgetype",)}


def _relevant_problem(state: pddl_logic.PddlState, goal: str) -> str:
    """PDDL problem of ``state`` restricted to what the goal can depend on.

    Kept: objects of the goal's object classes and objects held by the agent; receptacles
    of the goal's receptacle classes, of the devices its predicates need (sink /
    microwave / fridge) and receptacles holding kept objects; their locations and the
    agent's.  Everything else only adds detours, so optimal plans are unchanged.
    """
    low_goal = goal.lower()
    otypes = set(re.findall(r"objecttype\s+\?\w+\s+([\w-]+)", low_goal))
    rtypes = set(re.findall(r"receptacletype\s+\?\w+\s+([\w-]+)", low_goal))
    for predicate, devices in _DEVICE_TYPES.items():
        if f"({predicate} " in low_goal:
            rtypes.update(devices)
    facts = [f for f in state.facts if not f.name.startswith(("not_", "new-axiom@"))]
    by_name = collections.defaultdict(list)
    for f in facts:
        by_name[f.name].append([v.name for v in f.arguments])
    objects = {o for o, t in by_name["objecttype"] if t in otypes}
    objects |= {o for _, o in by_name["holds"]}
    receptacles = {r for r, t in by_name["receptacletype"] if t in rtypes}
    receptacles |= {r for o, r in by_name["inreceptacle"] if o in objects}
    locations = {loc for r, loc in by_name["receptacleatlocation"] if r in receptacles}
    locations |= {loc for _, loc in by_name["atlocation"]}
    kept = objects | receptacles | locations
    typed = {name: t for name, t in state.name2type.items()
             if t in ("agent", "otype", "rtype") or name in kept}
    init = [f for f in facts if all(v.name in typed for v in f.arguments)]
    decl = "\n".join(f"{name} - {t}" for name, t in sorted(typed.items()))
    body = "\n".join("(" + " ".join([f.name] + [v.name for v in f.arguments]) + ")" for f in init)
    return f"(define (problem expert)\n(:domain alfred)\n(:objects\n{decl}\n)\n(:init\n{body}\n)\n{goal}"


class _Planner:
    """Fast Downward search (``solve_sas``: the lazy uniform-cost search of the engine's
    ``replan``) on relevance-pruned problems, with its own library instance."""

    def __init__(self) -> None:
        self._lib = None
        self._lock = threading.Lock()

    def plan(self, domain: str, problem: str) -> list[str] | None:
        """Operator names of an optimal plan, or None if the problem is unsolvable."""
        _, sas = _translate(domain, problem, optimize=True)
        with self._lock:
            if self._lib is None:
                self._lib = _LIBRARIES.acquire()
            if not self._lib.solve_sas(sas.encode("utf-8"), False):
                return None
            ops = (fast_downward.Operator * self._lib.get_last_plan_length())()
            self._lib.get_last_plan(ops)
            return [op.name for op in ops]


_PLANNER = _Planner()


# --------------------------------------------------------------------------- engine env
class _SharedPddlEnv(PddlEnv):
    """TextWorld's ``PddlEnv`` playing a grounded game without re-translating it.

    ``step`` and ``_gather_infos`` are TextWorld's own; only construction (no private
    library, no ``load``) and ``reset`` (a cloned initial state instead of a new
    ``PddlState``) differ.  The caller selects the episode's state id in the shared
    library before each call.
    """

    def __init__(self, grounding: _Grounding) -> None:
        textworld.Environment.__init__(self, textworld.EnvInfos(admissible_commands=True, won=True))
        self._grounding = grounding
        self.downward_lib = grounding.lib
        self._game_data = grounding.game_data
        self._game_file = grounding.game_file
        self.walkthrough = grounding.walkthrough
        self._logic = grounding.logic
        self._entity_infos = grounding.entity_infos

    def load(self, filename_or_data) -> None:  # pragma: no cover - guard
        raise NotImplementedError("a _SharedPddlEnv plays the game it was built for")

    def reset(self) -> GameState:
        """Mirror of ``PddlEnv.reset`` starting from the shared initial state."""
        self._pddl_state = self._grounding.new_state()
        self.prev_state = None
        self.state = GameState()
        self._last_action = None
        self._moves = 0
        self.state.feedback = self._grounding.intro(self._pddl_state)
        self.state.raw = self.state.feedback
        self._gather_infos()
        return self.state

    def _gather_infos(self) -> None:
        """``PddlEnv._gather_infos`` with the admissible commands memoised per game.

        TextWorld derives the text of every applicable action through its grammar on
        every step (a parser run and deep copies per action: ~0.2 s a step with ~40
        actions, most of an ALFWorld step).  Templates that are state-free (see
        :func:`_state_free_template`; all of ``alfred.twl2``'s) give the same command
        for the same operator arguments in every state, so the derived text is kept per
        game and process (:func:`_game_texts`: every grounding and episode of the game)
        under (operator, arguments);
        other templates are derived exactly as TextWorld does.  The result is identical
        (tested against an uncached ``PddlEnv`` on the same action sequence)."""
        st, g = self.state, self._grounding
        st["command_templates"] = sorted({a.template for a in self._logic.actions.values()})
        st["won"] = self._pddl_state.check_goal()
        st["lost"] = False
        st["_entity_infos"] = dict(self._entity_infos)
        st["_facts"] = list(self._pddl_state.facts)
        st["last_action"] = None
        st["_last_action"] = self._last_action
        st["_valid_actions"] = list(self._pddl_state.all_applicable_actions())
        mapping = {k: info.name for k, info in self._entity_infos.items()}
        facts = None
        commands = []
        for action in st["_valid_actions"]:
            key = None
            if g.cacheable_templates.get(action.name, False):
                used = g.template_placeholders.get(action.name)
                if used is None:  # the text depends only on the placeholders it names
                    template = self._logic.actions[action.name].template
                    used = frozenset(ph.name for ph in action.mapping
                                     if re.search(rf"(?<![\w-]){re.escape(ph.name)}(?![\w-])", template))
                    g.template_placeholders[action.name] = used
                key = (action.name, tuple(sorted((ph.name, var.name) for ph, var in action.mapping.items()
                                                 if ph.name in used)))
                cached = g.command_cache.get(key)
                if cached is not None:
                    action.command_template = cached
                    commands.append(action.format_command(mapping))
                    continue
            if facts is None:
                facts = list(self._pddl_state.facts)
            context = {"state": self._pddl_state, "facts": facts,
                       "variables": {ph.name: self._entity_infos[var.name] for ph, var in action.mapping.items()},
                       "mapping": action.mapping, "entity_infos": self._entity_infos}
            action.command_template = self._logic.grammar.derive(action.command_template, context)
            if key is not None:
                g.command_cache[key] = action.command_template
            commands.append(action.format_command(mapping))
        st["_valid_commands"] = commands
        st["admissible_commands"] = sorted(set(commands))
        if self.request_infos.moves:
            st["moves"] = self._moves


# --------------------------------------------------------------------------- protocol objects
class AlfworldEpisode:
    """One play-through of one ALFWorld game (the ``Episode`` protocol of ``base.py``)."""

    def __init__(self, task: "AlfworldTask") -> None:
        self.task = task
        self.instruction = task.instruction
        self.max_steps = task.max_steps
        self._env = _SharedPddlEnv(task._grounding)
        self._sid: int | None = None
        self._actions: list[str] = []
        self._rejected: list[bool] = []  # per action: the engine did not accept it ("Nothing happens.")
        self._state: GameState | None = None
        self._done = False
        self._plan: list[str] | None = None  # expert plan: commands or operator names
        self._plan_ops = False
        self._plan_pos = 0

    # -- protocol
    def reset(self) -> Observation:
        g = self.task._grounding
        with g.lock, _remembered_parses():
            g.lib.set_state_id(g.initial_sid)
            self._state = self._env.reset()
            self._sid = g.lib.get_state_id()
        self._actions, self._rejected = [], []
        self._done = False
        self._plan, self._plan_ops, self._plan_pos = g.walkthrough, False, 0
        return self._observation(self._state.feedback, reward=0.0, valid=True)

    def step(self, action: str) -> Observation:
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over; call reset() to play again")
        command = action if isinstance(action, str) else str(action)
        g = self.task._grounding
        prev = self._state
        valid = command.strip() in prev["_valid_commands"]
        op = _op_name(prev["_valid_actions"][prev["_valid_commands"].index(command.strip())]) if valid else None
        with g.lock, _remembered_parses():
            g.lib.set_state_id(self._sid)
            self._state, _, _ = self._env.step(command)
            self._sid = g.lib.get_state_id()
        self._actions.append(command)
        self._rejected.append(not valid)
        self._track_expert(command.strip(), op)
        won = bool(self._state["won"])
        truncated = not won and len(self._actions) >= self.max_steps
        self._done = won or truncated
        reward = self.task.success_reward if won else 0.0
        return self._observation(self._state.feedback, reward=reward, valid=valid, truncated=truncated)

    def expert_action(self) -> str | None:
        """Next action of the engine's expert (walkthrough, else a fresh plan), or None."""
        if self._state is None or self._done:
            return None
        if self._plan is None or self._plan_pos >= len(self._plan):
            self._replan()
            if not self._plan:
                return None
        command = self._plan_command(self._plan[self._plan_pos])
        if command is None:  # an operator plan that no longer applies: plan once more
            self._replan()
            command = self._plan_command(self._plan[0]) if self._plan else None
        return command

    def explorer_action(self, actions: Sequence[str] = ()) -> str | None:
        """The visible-information explorer's next command
        (:func:`~sprpo_lib.agent.envs.alfworld_explorer.visible_explorer_action`) on the current
        admissible commands, with the pool's receptacle prior; ``actions``: the actions
        taken so far in this episode (which of them the engine rejected comes from the
        episode's own record)."""
        if self._state is None or self._done:
            return None
        if len(actions) != len(self._actions):
            raise ValueError(f"explorer_action: got {len(actions)} actions, the episode has taken {len(self._actions)}; "
                             "pass every action of this episode")
        pool = self.task.ref[0] if self.task.ref else None
        prior = pool.receptacle_prior() if pool is not None else {}
        admissible = [c for c in self._state["admissible_commands"] if c not in HIDDEN_COMMANDS]
        return visible_explorer_action(self.instruction, admissible, actions, prior, rejected=self._rejected)

    def close(self) -> None:
        """Drop per-episode state (the task's grounding stays with the task)."""
        self._state = None
        self._done = True

    # -- helpers
    @property
    def actions(self) -> list[str]:
        """Actions sent so far (what pickling replays)."""
        return list(self._actions)

    @property
    def done(self) -> bool:
        return self._done

    def _track_expert(self, command: str, op: str | None) -> None:
        if self._plan is None or self._plan_pos >= len(self._plan) or op is None:
            return  # invalid actions change nothing
        expected = self._plan[self._plan_pos]
        if (op if self._plan_ops else command) == expected:
            self._plan_pos += 1
        else:
            self._plan = None

    def _plan_command(self, step: str) -> str | None:
        """The command for a plan step (a command, or an operator name to match)."""
        if not self._plan_ops:
            return step
        for act, command in zip(self._state["_valid_actions"], self._state["_valid_commands"]):
            if _op_name(act) == step:
                return command
        return None

    def _replan(self) -> None:
        g = self.task._grounding
        problem = _relevant_problem(self._env._pddl_state, g.goal_pddl)
        self._plan = _PLANNER.plan(g.game_data["pddl_domain"], problem)
        self._plan_ops, self._plan_pos = True, 0

    def _observation(self, text: str, reward: float, valid: bool, truncated: bool = False) -> Observation:
        st = self._state
        admissible = [c for c in st["admissible_commands"] if c not in HIDDEN_COMMANDS]
        info = {"won": bool(st["won"]), "step": len(self._actions), "valid_action": valid,
                "truncated": truncated, "task_type": self.task.task_type, "task_id": self.task.task_id}
        return Observation(text=text.strip(), admissible=admissible, reward=reward, done=self._done,
                           success=bool(st["won"]), info=info)

    def __reduce__(self):
        return (_restore_episode, (self.task, self.actions, self._state is not None))


def _restore_episode(task: "AlfworldTask", actions: Sequence[str], started: bool) -> AlfworldEpisode:
    episode = task.spawn()
    if started:
        episode.reset()
        for a in actions:
            episode.step(a)
    return episode


class AlfworldTask:
    """A grounded ALFWorld game (``TaskHandle``): ``spawn`` is cheap, grounding is paid once.

    Pickles as a reference ``(pool, split, index)``; the receiving process grounds again.
    """

    def __init__(self, grounding: _Grounding, task_id: str, task_type: str,
                 max_steps: int = MAX_STEPS, success_reward: float = DEFAULT_SUCCESS_REWARD,
                 ref: tuple["AlfworldPool", str, int] | None = None) -> None:
        self.task_id = task_id
        self.task_type = task_type
        self.instruction = grounding.instruction
        self.max_steps = max_steps
        self.success_reward = success_reward
        self.game_file = grounding.game_file
        self.ref = ref
        self._grounding = grounding

    def spawn(self) -> AlfworldEpisode:
        return AlfworldEpisode(self)

    @property
    def walkthrough(self) -> list[str] | None:
        return self._grounding.walkthrough

    def close(self) -> None:
        """Give the planner library back now (otherwise at garbage collection)."""
        self._grounding.close()

    def __reduce__(self):
        if self.ref is None:
            raise TypeError("only tasks opened from an AlfworldPool can be pickled")
        return (_open_task, self.ref)


def _open_task(pool: "AlfworldPool", split: str, index: int) -> AlfworldTask:
    return pool.open(split, index)


# --------------------------------------------------------------------------- real data
LAYOUT = ("<data_dir>/json_2.1.1/{train,valid_seen,valid_unseen}/<task folder>/<trial>/ (or <data_dir> = that "
          "json_2.1.1 folder), each trial holding traj_data.json and its game file game.tw-pddl")


def data_error(where: str, problem: str) -> AlfworldDataError:
    """One clear error: the folder (and where it came from), what is wrong, the expected
    layout, how to get the data, and the offline default."""
    return AlfworldDataError(
        f"ALFWorld data {where}: {problem}.\n"
        f"Expected: {LAYOUT}.\n"
        "Get it with `pip install alfworld==0.4.2 && alfworld-download` (writes $ALFWORLD_DATA, default "
        "~/.cache/alfworld) and set ALFWORLD_DATA=<that folder> or pass data_dir=<that folder>.\n"
        "Without data_dir and with ALFWORLD_DATA unset, the offline default generates games from the scene "
        "data shipped in the alfworld wheel and needs no data."
    )


def resolve_data_root(data_dir: str | os.PathLike, where: str | None = None) -> Path:
    """The ``json_2.1.1`` folder of a real-data directory, or :class:`AlfworldDataError`
    (``where``: how the error names the folder, default ``data_dir=<data_dir>``)."""
    path = Path(os.path.expanduser(os.path.expandvars(str(data_dir))))
    for root in (path / "json_2.1.1", path):
        if root.is_dir() and any((root / s).is_dir() for s in SPLITS):
            return root
    problem = f"{path} does not exist" if not path.is_dir() else f"{path} has none of {list(SPLITS)} in it"
    raise data_error(where or f"data_dir={data_dir}", problem)


def _read_game_json(path: Path, where: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise data_error(where, f"{path} is not a whole JSON file ({type(err).__name__}: "
                                f"{str(err).splitlines()[0][:120]}); download it again") from None
    if not isinstance(data, dict):
        raise data_error(where, f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def collect_game_files(split_dir: Path, where: str | None = None) -> list[Path]:
    """ALFWorld's ``AlfredTWEnv.collect_game_files`` rules, in sorted path order.

    Keep a trial folder if it has ``traj_data.json`` and ``game.tw-pddl``, its path has
    neither "movable" nor "Sliced", its task type is one of the six and the game file
    says ``solvable: true``.  A file that is not a JSON object is an :class:`AlfworldDataError`
    naming it (``where``: the data folder the error names).
    """
    where = where or str(split_dir)
    games = []
    for root, _, files in os.walk(split_dir):
        if "traj_data.json" not in files or "movable" in root or "Sliced" in root:
            continue
        game_file = Path(root) / "game.tw-pddl"
        if not game_file.exists():
            continue
        if _read_game_json(Path(root) / "traj_data.json", where).get("task_type") not in TASK_TYPES:
            continue
        game = _read_game_json(game_file, where)
        if game.get("solvable") is not True:
            continue
        missing = [k for k in ("pddl_domain", "grammar", "pddl_problem") if not isinstance(game.get(k), str)]
        if missing:
            raise data_error(where, f"{game_file} is not an ALFWorld game: no {', '.join(missing)}")
        games.append(game_file)
    return sorted(games)


# --------------------------------------------------------------------------- pool
class AlfworldPool:
    """ALFWorld tasks (``TaskPool``): real ``json_2.1.1`` data or the generated default.

    Build it with :func:`make_alfworld_pool`.  Pickles as its configuration.
    """

    name = "alfworld"
    max_steps = MAX_STEPS

    def __init__(self, data_dir: str | os.PathLike | None = None, seed: int = 0,
                 sizes: Mapping[str, int] | None = None, cache_dir: str | os.PathLike | None = None,
                 success_reward: float = DEFAULT_SUCCESS_REWARD) -> None:
        folder, self._where = resolve_data_dir(self.name, data_dir)  # data_dir, else $ALFWORLD_DATA, else generated
        self.data_dir = None if folder is None else str(folder)
        self.seed = int(seed)
        self.cache_dir = None if cache_dir is None else str(cache_dir)
        self.success_reward = float(success_reward)
        self._requested_sizes = dict(sizes or {})
        unknown = set(self._requested_sizes) - set(SPLITS)
        if unknown:
            raise ValueError(f"alfworld: unknown split(s) {sorted(unknown)} in sizes; expected {list(SPLITS)}")
        self._setup()

    def _setup(self) -> None:
        self.data_source = GENERATED if self.data_dir is None else self.data_dir
        if self.data_dir is None:
            self.source = "generated"
            self.generator = alfworld_gen.AlfworldGenerator(self.seed, self.cache_dir)
            self._games: dict[str, list[Path]] | None = None
            self._sizes = {s: int(self._requested_sizes.get(s, alfworld_gen.DEFAULT_SIZES[s])) for s in SPLITS}
        else:
            self.source = "real"
            self.generator = None
            root = resolve_data_root(self.data_dir, self._where)
            self.root = root
            self._games = {s: collect_game_files(root / s, self._where) if (root / s).is_dir() else [] for s in SPLITS}
            if not any(self._games.values()):
                raise data_error(self._where, f"{root} holds no playable game (a trial folder with traj_data.json of one "
                                        "of the six task types and a solvable game.tw-pddl)")
            self._sizes = {s: min(len(g), int(self._requested_sizes.get(s, len(g)))) for s, g in self._games.items()}

    def __getstate__(self) -> dict:
        return {"data_dir": self.data_dir, "seed": self.seed, "cache_dir": self.cache_dir,
                "success_reward": self.success_reward, "_requested_sizes": self._requested_sizes,
                "_where": self._where}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def splits(self) -> dict[str, int]:
        return dict(self._sizes)

    def game_file(self, split: str, index: int) -> Path:
        """Path of a game (generated games: where it is / will be cached)."""
        check_split(self, split, index)
        if self._games is not None:
            return self._games[split][index]
        return self.generator.game_path(split, index)

    def task_type(self, split: str, index: int) -> str:
        """Task type of a game without grounding it."""
        check_split(self, split, index)
        if self._games is None:
            return alfworld_gen.task_type_of(self.seed, split, index)
        with open(self._games[split][index].parent / "traj_data.json") as f:
            return json.load(f)["task_type"]

    def receptacle_prior(self) -> dict[str, dict[str, int]]:
        """Where each object type lies in the first :data:`PRIOR_GAMES` training games
        (:func:`~sprpo_lib.agent.envs.alfworld_explorer.receptacle_prior`; generated games are
        made first if needed): the explorer's search order.  Computed once per pool."""
        if getattr(self, "_prior", None) is None:
            n = min(PRIOR_GAMES, self._sizes["train"])
            for i in range(n):
                if not self.game_file("train", i).exists():
                    self.open("train", i).close()
            self._prior = receptacle_prior(self.game_file("train", i) for i in range(n))
        return self._prior

    def open(self, split: str, index: int) -> AlfworldTask:
        """Ground game ``index`` of ``split`` (generating and caching it first if needed)."""
        check_split(self, split, index)
        path = self.game_file(split, index)
        grounding = None
        if not path.exists():  # generated game, first use: ground, plan, verify, write
            made: dict[str, _Grounding] = {}

            def solve(game_data: dict) -> list[str] | None:
                made["g"] = _Grounding(game_data, str(path))
                return solve_with_expert(made["g"], self.max_steps)

            self.generator.materialise(split, index, solve)
            grounding = made.get("g")
            if grounding is not None:
                with open(path) as f:
                    grounding.walkthrough = json.load(f)["walkthrough"]
        if grounding is None:
            with open(path) as f:
                data = json.load(f)
            try:
                grounding = _Grounding(data, str(path))
            except Exception as err:  # a real game the engine cannot read: one error naming the file
                if self._games is None:
                    raise
                raise data_error(self._where,
                                 f"{path} could not be loaded by the PDDL engine ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0][:160] if str(err) else ''})") from None
        task_type = self.task_type(split, index)
        root = self.generator.root if self._games is None else self.root
        task_id = str(path.parent.relative_to(root))
        return AlfworldTask(grounding, task_id, task_type, self.max_steps, self.success_reward,
                            ref=(self, split, index))


def solve_with_expert(grounding: _Grounding, max_steps: int = MAX_STEPS) -> list[str] | None:
    """Play the expert on a fresh episode of ``grounding``; its commands if it wins."""
    episode = AlfworldTask(grounding, "solve", "", max_steps=max_steps).spawn()
    obs = episode.reset()
    while not obs.done:
        action = episode.expert_action()
        if action is None:
            return None
        obs = episode.step(action)
    return episode.actions if obs.success else None


def make_alfworld_pool(data_dir: str | os.PathLike | None = None, seed: int = 0,
                       sizes: Mapping[str, int] | None = None,
                       cache_dir: str | os.PathLike | None = None,
                       success_reward: float = DEFAULT_SUCCESS_REWARD) -> AlfworldPool:
    """ALFWorld task pool (App. B): ``.name == "alfworld"``, ``.max_steps == 50``.

    Args:
        data_dir: real data, a folder in ALFWorld's ``json_2.1.1`` layout (or its parent).
            None (default): the folder in ``$ALFWORLD_DATA``, else generated games
            (:func:`~sprpo_lib.agent.envs.base.resolve_data_dir`, the rule of both environments).
        seed: generator seed (generated games only).
        sizes: split -> number of tasks; generated default train 3,553 / valid_seen 140 /
            valid_unseen 134; for real data a cap on the games found.
        cache_dir: cache root of generated games (default ``$SPRPO_CACHE/alfworld`` or
            ``~/.cache/sprpo/alfworld``); games live in ``<cache_dir>/<seed>/json_2.1.1``.
        success_reward: reward of a successful final step (default 10.0, verl-agent).
    """
    return AlfworldPool(data_dir=data_dir, seed=seed, sizes=sizes, cache_dir=cache_dir,
                        success_reward=success_reward)
