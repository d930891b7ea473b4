"""Tests of the ALFWorld environment on the real TextWorld PDDL engine (App. B).

The generated games are cached in a temporary directory for the whole module; the
default run grounds about a dozen games (seconds each on a busy 2-core machine).
"""
from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from pathlib import Path

import pytest

pytest.importorskip("alfworld")
textworld = pytest.importorskip("textworld")

from textworld.envs import PddlEnv  # noqa: E402

from sprpo_lib.agent.envs import alfworld_gen as gen  # noqa: E402
from sprpo_lib.agent.envs import make_pool  # noqa: E402
from sprpo_lib.agent.envs.alfworld import AlfworldDataError, AlfworldTask, make_alfworld_pool
from sprpo_lib.agent.envs.base import Episode, TaskHandle, TaskPool  # noqa: E402

SEED = 0
KITCHEN_ONLY = {"pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("alfworld_cache")


@pytest.fixture(scope="module")
def pool(cache):
    return make_alfworld_pool(seed=SEED, cache_dir=cache)


def _small_game(split: str, task_type: str, start: int = 0) -> int:
    """Index of a game of ``task_type`` outside kitchens when possible (cheap to ground)."""
    fallback = None
    for i in range(start, start + 400):
        spec = gen.sample_game(SEED, split, i)
        if spec.task_type != task_type:
            continue
        if spec.scene_num > 100 or task_type in KITCHEN_ONLY:
            return i
        fallback = i if fallback is None else fallback
    assert fallback is not None
    return fallback


@pytest.fixture(scope="module")
def small(pool):
    """A grounded cheap game (pick_and_place_simple outside a kitchen) of valid_seen."""
    index = _small_game("valid_seen", "pick_and_place_simple")
    return pool.open("valid_seen", index)


def _play_expert(episode) -> tuple:
    obs = episode.reset()
    while not obs.done:
        action = episode.expert_action()
        assert action is not None, "expert gave up"
        obs = episode.step(action)
    return obs


# --------------------------------------------------------------------------- protocol / pool
def test_pool_protocol_and_sizes(pool, small):
    assert isinstance(pool, TaskPool)
    assert pool.name == "alfworld" and pool.max_steps == 50
    assert pool.splits() == {"train": 3553, "valid_seen": 140, "valid_unseen": 134}
    assert isinstance(small, TaskHandle)
    episode = small.spawn()
    assert isinstance(episode, Episode)
    assert episode.max_steps == 50 and episode.instruction == small.instruction
    with pytest.raises(ValueError):
        pool.open("test", 0)
    with pytest.raises(IndexError):
        pool.open("valid_seen", 140)
    custom = make_alfworld_pool(seed=SEED, cache_dir=pool.cache_dir, sizes={"train": 10})
    assert custom.splits()["train"] == 10


def test_composition_matches_alfworld():
    for split, counts in gen.SPLIT_COMPOSITION.items():
        types = [gen.task_type_of(SEED, split, i) for i in range(gen.DEFAULT_SIZES[split])]
        assert [types.count(t) for t in gen.TASK_TYPES] == list(counts)


# --------------------------------------------------------------------------- files
def test_game_file_layout_and_schema(pool, small, cache):
    path = Path(small.game_file)
    root = cache / str(SEED) / "json_2.1.1"
    rel = path.parent.relative_to(root).parts
    assert rel[0] == "valid_seen" and rel[2].startswith("trial_")
    assert rel[1].startswith("pick_and_place_simple-") and "-None-" in rel[1]
    game = json.loads(path.read_text())
    assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
    domain, grammar = gen.game_logic()
    assert game["pddl_domain"] == domain  # the wheel's alfred.pddl, verbatim
    assert game["grammar"] == grammar.replace("UNKNOWN GOAL", small.instruction)
    assert game["solvable"] is True and game["walkthrough"] and len(game["walkthrough"]) <= 50
    assert "(:domain alfred)" in game["pddl_problem"] and "(:goal" in game["pddl_problem"]
    traj = json.loads((path.parent / "traj_data.json").read_text())
    assert traj["task_type"] == "pick_and_place_simple"
    params = traj["pddl_params"]
    assert set(params) >= {"object_target", "parent_target", "toggle_target", "mrecep_target", "object_sliced"}
    assert params["object_target"] in gen.PICKUPABLE and params["parent_target"] in gen.STATIC_RECEPTACLES
    assert not list(path.parent.glob("*.tmp"))  # atomic writes leave no temporaries


def test_generation_is_deterministic_and_lazy(pool, small, cache):
    a = gen.sample_game(SEED, "train", 123)
    b = gen.sample_game(SEED, "train", 123)
    assert a == b
    assert gen.sample_game(SEED + 1, "train", 123).pddl_problem != a.pddl_problem
    assert gen.sample_game(SEED, "train", 124).pddl_problem != a.pddl_problem
    # The cached file is exactly the spec plus the stored walkthrough.
    game = json.loads(Path(small.game_file).read_text())
    spec = gen.sample_game(SEED, "valid_seen", small.ref[2])
    assert spec.game_data(game["walkthrough"]) == game
    # Nothing is generated up front: only games that were opened exist.
    written = list((cache / str(SEED) / "json_2.1.1").rglob("game.tw-pddl"))
    assert 0 < len(written) < 50


def test_ood_scenes_never_in_training():
    assert set(gen.split_scenes("valid_unseen")) == set(gen.OOD_SCENES)
    assert not set(gen.split_scenes("train")) & set(gen.OOD_SCENES)
    assert gen.split_scenes("valid_seen") == gen.split_scenes("train")
    train = {gen.sample_game(SEED, "train", i).scene_num for i in range(400)}
    seen = {gen.sample_game(SEED, "valid_seen", i).scene_num for i in range(140)}
    unseen = {gen.sample_game(SEED, "valid_unseen", i).scene_num for i in range(134)}
    assert not train & set(gen.OOD_SCENES) and not seen & set(gen.OOD_SCENES)
    assert unseen <= set(gen.OOD_SCENES)
    assert seen <= set(gen.split_scenes("train"))


# --------------------------------------------------------------------------- engine behaviour
def test_reset_observation_like_alfworld(small):
    obs = small.spawn().reset()
    assert obs.text.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert "You are in the middle of a room." in obs.text
    assert f"Your task is to: {small.instruction}." in obs.text
    assert obs.reward == 0.0 and not obs.done and not obs.success
    assert "help" not in obs.admissible and "look" in obs.admissible
    assert any(a.startswith("go to ") for a in obs.admissible)


@pytest.mark.parametrize("task_type", gen.TASK_TYPES)
def test_expert_solves_each_task_type(pool, task_type):
    split = "valid_unseen" if task_type in KITCHEN_ONLY else "valid_seen"
    task = pool.open(split, _small_game(split, task_type))
    assert task.task_type == task_type
    episode = task.spawn()
    obs = _play_expert(episode)
    assert obs.success and obs.info["won"]
    assert obs.reward == pytest.approx(10.0)
    assert episode.actions == task.walkthrough
    task.close()


def test_invalid_actions_do_not_crash(small):
    episode = small.spawn()
    obs = episode.reset()
    for bad in ["", "   ", "xyzzy", "go to", "take the moon", "GO TO " + obs.admissible[0][6:],
                "<action>look</action>", "x" * 5000, 42, None]:
        obs = episode.step(bad)
        assert obs.text == "Nothing happens."
        assert obs.info["valid_action"] is False and obs.reward == 0.0 and not obs.done
    assert obs.info["step"] == 10
    obs = episode.step("help")  # executable, though not listed
    assert obs.info["valid_action"] and "Available commands" in obs.text
    with pytest.raises(RuntimeError):
        small.spawn().step("look")  # before reset


def test_step_limit_and_reward(small, pool):
    episode = small.spawn()
    episode.reset()
    for t in range(50):
        obs = episode.step("look")
        assert obs.done == (t == 49)
    assert obs.info["truncated"] and not obs.success and obs.reward == 0.0
    with pytest.raises(RuntimeError):
        episode.step("look")
    custom = make_alfworld_pool(seed=SEED, cache_dir=pool.cache_dir, success_reward=1.0)
    task = custom.open(*small.ref[1:])
    assert _play_expert(task.spawn()).reward == 1.0


def test_expert_replans_after_deviation(small):
    episode = small.spawn()
    obs = episode.reset()
    off_plan = next(a for a in obs.admissible if a.startswith("go to") and a != small.walkthrough[0])
    episode.step(off_plan)
    episode.step("inventory")
    obs = _continue_expert(episode)
    assert obs.success


def _continue_expert(episode):
    while True:
        obs = episode.step(episode.expert_action())
        if obs.done:
            return obs


def test_group_spawn_shares_preparation(pool, small, monkeypatch):
    """A group's episodes reuse the task's grounding: spawning and resetting 8 of them
    neither grounds the game again nor loads it into a TextWorld ``PddlEnv`` (what the
    seconds are is the ``env`` benchmark's business, not a test's)."""
    from textworld.envs.pddl import logic as pddl_logic

    split, index = small.ref[1:]
    task = pool.open(split, index)
    calls = {"translate": 0, "grammar": 0, "load": 0}

    def counting(name, real):
        def wrapper(self, *a, **k):
            calls[name] += 1
            return real(self, *a, **k)
        return wrapper

    # TextWorld's three costly steps: translating the PDDL problem into a state, parsing the
    # grammar, and PddlEnv's own load of the game file (ALFWorld's per-rollout cost)
    monkeypatch.setattr(pddl_logic.PddlState, "__init__", counting("translate", pddl_logic.PddlState.__init__))
    monkeypatch.setattr(pddl_logic.GameLogic, "__init__", counting("grammar", pddl_logic.GameLogic.__init__))
    monkeypatch.setattr(PddlEnv, "load", counting("load", PddlEnv.load))
    episodes = []
    for _ in range(8):
        episode = task.spawn()
        episode.reset()
        episodes.append(episode)
    assert calls == {"translate": 0, "grammar": 0, "load": 0}
    again = pool.open(split, index)  # while grounding a game does all but the load and the grammar
    assert calls["translate"] == 1 and calls["grammar"] == 0  # (parsed once per domain and grammar)
    from textworld.envs.pddl.textgen import ContextSensitiveGrammar

    calls["derive"] = 0  # the next cell's grounding of the game derives no text the first one derived
    monkeypatch.setattr(ContextSensitiveGrammar, "derive", counting("derive", ContextSensitiveGrammar.derive))
    mine, first_cells = again.spawn().reset(), episodes[0].reset()
    assert (mine.text, mine.admissible) == (first_cells.text, first_cells.admissible) and calls["derive"] == 0
    again.close()
    # ... and the episodes are independent.
    first = episodes[0].step(task.walkthrough[0])
    assert first.info["valid_action"]
    fresh = episodes[1].expert_action()
    assert fresh == task.walkthrough[0]
    assert episodes[1].step("inventory").text == "You are not carrying anything."
    for a in task.walkthrough[1:]:
        last = episodes[0].step(a)
    assert last.success and not episodes[1].done
    task.close()


def test_pickling_by_reference(pool, small):
    assert pickle.loads(pickle.dumps(pool)).splits() == pool.splits()
    episode = small.spawn()
    episode.reset()
    episode.step(small.walkthrough[0])
    clone = pickle.loads(pickle.dumps(episode))  # re-grounds the task, replays the actions
    assert isinstance(clone.task, AlfworldTask) and clone.task.task_id == small.task_id
    assert clone.actions == episode.actions
    assert clone.expert_action() == small.walkthrough[1]


# --------------------------------------------------------------------------- real-data path
def test_missing_data_path_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    for path in [tmp_path / "nope", "$ALFWORLD_DATA"]:
        with pytest.raises(AlfworldDataError) as err:
            make_alfworld_pool(data_dir=path)
        msg = str(err.value)
        assert str(path) in msg and "json_2.1.1" in msg and "valid_unseen" in msg
        assert "alfworld-download" in msg and "Without data_dir and with ALFWORLD_DATA unset" in msg


def test_fake_real_data_folder_loads(pool, small, tmp_path):
    src = Path(small.game_file).parent
    root = tmp_path / "alfworld_data" / "json_2.1.1"
    good = root / "valid_seen" / src.parent.name / src.name
    shutil.copytree(src, good)
    # Folders ALFWorld's loader skips: movable / Sliced paths, unsolvable games.
    shutil.copytree(src, root / "train" / "pick_and_place_with_movable_recep-X-Y-Z-1" / "trial_1")
    shutil.copytree(src, root / "train" / "pick_heat_then_place_in_recep-AppleSliced-None-Fridge-1" / "trial_1")
    unsolvable = root / "valid_unseen" / src.parent.name / "trial_2"
    shutil.copytree(src, unsolvable)
    game = json.loads((unsolvable / "game.tw-pddl").read_text())
    game["solvable"] = False
    (unsolvable / "game.tw-pddl").write_text(json.dumps(game))
    real = make_alfworld_pool(data_dir=tmp_path / "alfworld_data")
    assert real.source == "real"
    assert real.splits() == {"train": 0, "valid_seen": 1, "valid_unseen": 0}
    task = real.open("valid_seen", 0)
    assert task.task_type == small.task_type and task.instruction == small.instruction
    assert task.task_id == f"valid_seen/{src.parent.name}/{src.name}"
    assert _play_expert(task.spawn()).success


# --------------------------------------------------------------------------- the data rule
@pytest.fixture(scope="module")
def real_data(pool, small, tmp_path_factory) -> Path:
    """A folder in ALFWorld's real layout: two games in ``json_2.1.1`` (one per held-out split),
    solvable by the engine's expert, their task folders named apart from the generated games'."""
    other = pool.open("valid_unseen", _small_game("valid_unseen", "pick_and_place_simple"))
    root = tmp_path_factory.mktemp("alfworld_real") / "data"
    for split, task in (("valid_seen", small), ("valid_unseen", other)):
        shutil.copytree(Path(task.game_file).parent, root / "json_2.1.1" / split / f"real-{split}" / "trial_T0")
    return root


def test_alfworld_data_variable_is_honoured(real_data, tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(real_data))
    real = make_pool("alfworld")
    assert real.data_source == str(real_data.resolve())
    assert real.splits() == {"train": 0, "valid_seen": 1, "valid_unseen": 1}
    for split in ("valid_seen", "valid_unseen"):
        task = real.open(split, 0)
        assert task.task_id == f"{split}/real-{split}/trial_T0"
        assert _play_expert(task.spawn()).success
    # an explicit data_dir wins over the variable; unset, the generated default
    with pytest.raises(AlfworldDataError, match="data_dir="):
        make_pool("alfworld", tmp_path / "elsewhere")
    monkeypatch.delenv("ALFWORLD_DATA")
    assert make_pool("alfworld").data_source == "generated"


def test_alfworld_data_without_games_is_one_error(real_data, tmp_path, monkeypatch, capsys):
    from sprpo_lib.evaluate.cli import main as eval_main

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("ALFWORLD_DATA", str(empty))
    with pytest.raises(AlfworldDataError, match=f"ALFWORLD_DATA={empty}") as err:
        make_pool("alfworld")
    assert "json_2.1.1/{train,valid_seen,valid_unseen}" in str(err.value) and "traj_data.json" in str(err.value)
    assert eval_main(["--model", "tiny-qwen2", "--env", "alfworld", "--family", "gaussian", "--strength", "0.1",
                      "--tasks", "1", "--no-progress"]) == 2
    printed = capsys.readouterr().err
    assert f"ALFWORLD_DATA={empty}" in printed and "Traceback" not in printed
    (empty / "json_2.1.1" / "valid_seen").mkdir(parents=True)  # the layout's folders, no game in them
    with pytest.raises(AlfworldDataError, match="holds no playable game"):
        make_pool("alfworld")
    bad = tmp_path / "bad"
    shutil.copytree(real_data, bad)
    game = next(bad.rglob("game.tw-pddl"))
    game.write_text(game.read_text()[:500])  # a truncated download
    monkeypatch.setenv("ALFWORLD_DATA", str(bad))
    with pytest.raises(AlfworldDataError, match=f"{game} is not a whole JSON file"):
        make_pool("alfworld")


def test_cells_are_keyed_by_the_data_played(real_data, tmp_path, monkeypatch):
    """A cell computed on generated games is never served for a real-data request, and the
    variable and an explicit data_dir naming the same folder are the same data."""
    from sprpo_lib.evaluate import EvalConfig, evaluate, missing_cells

    cfg = EvalConfig(model="tiny-qwen2", env="alfworld", tasks=1, max_steps=2, max_new_tokens=8, batch_size=4,
                     dtype="float32", cache_dir=str(tmp_path / "cache"))
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    generated = evaluate(cfg, progress=False)
    assert not missing_cells(cfg) and not generated.task_id.str.contains("real-").any()
    monkeypatch.setenv("ALFWORLD_DATA", str(real_data))
    assert len(missing_cells(cfg)) == 1  # not served from the generated games' cell
    played = evaluate(cfg, progress=False)
    assert sorted(played.task_id) == ["valid_seen/real-valid_seen/trial_T0", "valid_unseen/real-valid_unseen/trial_T0"]
    explicit = dataclasses.replace(cfg, data_dir=str(real_data))
    assert not missing_cells(explicit)  # the same data by another name: the same cell
    monkeypatch.delenv("ALFWORLD_DATA")
    assert not missing_cells(cfg)  # and the generated games' cell is still there, as it was


# --------------------------------------------------------------------------- heavier
@pytest.mark.slow
@pytest.mark.parametrize("task_type", gen.TASK_TYPES)
def test_expert_solves_sampled_games_slow(pool, task_type):
    for start in (0, 500, 1000):
        index = next(i for i in range(start, start + 300) if gen.task_type_of(SEED, "train", i) == task_type)
        task = pool.open("train", index)
        assert _play_expert(task.spawn()).success
        task.close()


@pytest.mark.parametrize("split,task_type", [("valid_seen", "pick_and_place_simple"),
                                             ("valid_unseen", "pick_heat_then_place_in_recep")])
def test_random_play_matches_alfworld_engine(pool, split, task_type):
    """Two interleaved episodes of one grounded task (sharing the admissible-command cache
    with each other and with the game's earlier grounding) against ALFWorld's own stack
    (TextWorld ``PddlEnv`` + ``AlfredDemangler``, every command derived by the grammar):
    same feedback, admissible commands and ``won`` at every step of a seeded random
    admissible walk with a few invalid moves, from the same first observation."""
    import random

    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler

    from sprpo_lib.agent.envs.alfworld import translations_cached

    index = _small_game(split, task_type)
    pool.open(split, index).close()
    before = translations_cached()
    task = pool.open(split, index)  # grounded again from the per-process translation memo
    assert translations_cached() == before >= 2  # a hit: nothing translated anew
    episodes = [task.spawn(), task.spawn()]
    refs = []
    for _ in episodes:
        ref = AlfredDemangler(PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True)), shuffle=False)
        ref.load(task.game_file)
        refs.append(ref)
    obs = [e.reset() for e in episodes]
    ref_states = [r.reset() for r in refs]
    assert obs[0].text == obs[1].text == ref_states[0].feedback.strip()  # the intro, derived once per game
    rng = random.Random(7)
    for t in range(40):
        for k in (0, 1):
            hidden = {"help"}
            assert obs[k].admissible == [c for c in ref_states[k]["admissible_commands"] if c not in hidden]
            assert obs[k].success == bool(ref_states[k]["won"])
            if obs[k].done:
                continue
            action = "jump" if rng.random() < 0.1 else rng.choice(obs[k].admissible)
            obs[k] = episodes[k].step(action)
            ref_states[k], _, _ = refs[k].step(action)
            assert obs[k].text == ref_states[k].feedback.strip(), (t, action)
    task.close()


# --------------------------------------------------------------------------- visible explorer
from sprpo_lib.agent.envs.alfworld_explorer import MEMORY, parse_goal, receptacle_prior, visible_explorer_action  # noqa: E402


@pytest.mark.parametrize("text,want", [
    ("put a mug in cabinet", ("simple", "mug", "cabinet")),
    ("put some keychain on dresser", ("simple", "keychain", "dresser")),
    ("clean some plate and put it in shelf", ("clean", "plate", "shelf")),
    ("put a hot apple in fridge", ("heat", "apple", "fridge")),
    ("put a cool mug in cabinet.", ("cool", "mug", "cabinet")),
    ("find two pen and put them in desk", ("two", "pen", "desk")),
    ("put two box in sofa", ("two", "box", "sofa")),
    ("look at bowl under the desklamp", ("light", "bowl", "desklamp")),
    ("examine the keychain with the floorlamp", ("light", "keychain", "floorlamp")),
])
def test_explorer_reads_every_instruction_form(text, want):
    assert parse_goal(text) == want


def test_explorer_unknown_instruction_is_one_clear_error():
    with pytest.raises(ValueError, match="not an ALFWorld instruction"):
        parse_goal("make a sandwich")


def test_explorer_puts_down_a_wrong_object():
    """After a random recovery action picked up the wrong object, the explorer drops it."""
    adm = ["go to cabinet 1", "move pen 1 to drawer 2", "examine pen 1", "look"]
    acts = ["go to drawer 2", "open drawer 2", "take pen 1 from drawer 2"]
    assert visible_explorer_action("put a mug in cabinet", adm, acts) == "move pen 1 to drawer 2"


def test_explorer_knows_what_it_holds_beyond_its_memory():
    """Two moves after the take, the held object shows only as ``examine o`` (no move is
    admissible where a lamp stands): the explorer still uses the lamp."""
    adm = ["examine armchair 1", "examine statue 1", "go to shelf 1", "look", "use floorlamp 1"]
    acts = ["take statue 1 from shelf 2", "go to sidetable 1", "go to armchair 1"]
    assert visible_explorer_action("examine the statue with the floorlamp", adm, acts) == "use floorlamp 1"


def test_explorer_searches_after_the_current_receptacle():
    """Not holding the object, it goes to the receptacle after this one in the prior's
    order (wrapping round), never to a receptacle of the target type."""
    prior = {"mug": {"cabinet": 3, "shelf": 1}}
    goes = ["go to cabinet 1", "go to cabinet 3", "go to desk 1", "go to shelf 1"]
    put_mug = "put a mug in desk"
    assert visible_explorer_action(put_mug, goes + ["look"], ["go to cabinet 2"], prior) == "go to cabinet 3"
    assert visible_explorer_action(put_mug, goes + ["look"], ["go to cabinet 3", "go to shelf 2"], prior) == "go to cabinet 1"
    assert visible_explorer_action(put_mug, goes + ["look"], [], prior) == "go to cabinet 1"
    assert visible_explorer_action(put_mug, goes + ["open cabinet 2"], ["go to cabinet 2"], prior) == "open cabinet 2"


def test_explorer_skips_rejected_actions():
    """An action the engine rejected ("Nothing happens.") changed nothing: the explorer
    reads where it is from the accepted ones among the prompt's last MEMORY actions."""
    prior = {"mug": {"cabinet": 3}}
    adm = ["go to cabinet 1", "go to cabinet 2", "go to cabinet 3", "go to desk 1", "look"]
    put_mug = "put a mug in desk"
    acts = ["go to cabinet 1", "go to cabinet 9"]  # cabinet 9 does not exist
    assert visible_explorer_action(put_mug, adm, acts, prior, rejected=[False, True]) == "go to cabinet 2"
    assert visible_explorer_action(put_mug, adm, acts, prior) == "go to cabinet 1"  # taken as at cabinet 9
    again = ["go to cabinet 2", "go to cabinet 2"]  # a repeated go to
    assert visible_explorer_action(put_mug, adm, again, prior, rejected=[True]) == \
        visible_explorer_action(put_mug, adm, again[:1], prior) == "go to cabinet 3"
    with pytest.raises(ValueError, match="rejected"):
        visible_explorer_action(put_mug, adm, acts[:1], prior, rejected=[False, True])


@pytest.fixture(scope="module")
def one_of_each(pool):
    games = {}
    for t in gen.TASK_TYPES:
        split = "valid_unseen" if t in KITCHEN_ONLY else "valid_seen"
        games[t] = pool.open(split, _small_game(split, t))
    yield games
    for task in games.values():
        task.close()


def test_receptacle_prior_holds_where_the_planner_takes_the_object(one_of_each):
    for task in one_of_each.values():
        prior = receptacle_prior([task.game_file])
        takes = [a for a in task.walkthrough if a.startswith("take ")]
        obj, rec = takes[0][5:].split(" from ")
        assert prior[obj.split()[0]].get(rec.split()[0], 0) >= 1


@pytest.mark.parametrize("task_type", gen.TASK_TYPES)
def test_explorer_solves_each_task_type_from_what_it_sees(one_of_each, task_type):
    """The explorer sees only the instruction, the admissible commands and its last
    MEMORY actions, with a prior from the *other* games, and still wins within 50 steps."""
    task = one_of_each[task_type]
    prior = receptacle_prior([g.game_file for t, g in one_of_each.items() if t != task_type])
    episode = task.spawn()
    obs, actions = episode.reset(), []
    while not obs.done:
        action = visible_explorer_action(task.instruction, obs.admissible, actions, prior)
        if len(actions) >= MEMORY:  # what the prompt no longer shows does not matter
            older = ["inventory", "go to nowhere 9", "take thing 1 from nowhere 9"]
            assert action == visible_explorer_action(task.instruction, obs.admissible, older + actions[-MEMORY:], prior)
        actions.append(action)
        obs = episode.step(action)
        assert obs.info["valid_action"], action
    assert obs.success, actions


def test_pool_prior_and_episode_explorer_action(cache, small, monkeypatch):
    """The pool's prior counts its first PRIOR_GAMES training games; an episode's explorer
    action is admissible and is what the pure function returns on the same inputs."""
    from sprpo_lib.agent.envs import alfworld

    monkeypatch.setattr(alfworld, "PRIOR_GAMES", 2)
    fresh = make_alfworld_pool(seed=SEED, cache_dir=cache)
    prior = fresh.receptacle_prior()
    assert prior == receptacle_prior([fresh.game_file("train", 0), fresh.game_file("train", 1)])
    task = fresh.open("valid_seen", _small_game("valid_seen", "pick_and_place_simple"))
    ep = task.spawn()
    obs = ep.reset()
    action = ep.explorer_action([])
    assert action in obs.admissible
    assert action == visible_explorer_action(task.instruction, obs.admissible, [], prior)
    obs = ep.step(action)
    obs = ep.step(action)  # the same go to again: rejected, and the explorer knows it
    assert obs.text == "Nothing happens." and not obs.info["valid_action"]
    assert ep.explorer_action([action, action]) == visible_explorer_action(
        task.instruction, obs.admissible, [action], prior)
    with pytest.raises(ValueError, match="explorer_action"):
        ep.explorer_action([action])
    task.close()


def test_a_game_is_translated_once_per_machine_and_a_damaged_translation_is_redone(pool, monkeypatch, tmp_path):
    """The PDDL -> SAS translation of a game is stored on disk by content: a process with an empty
    memo plays the game from the store without translating, step for step as from a fresh
    translation (the expert's episode: every observation and command list); a damaged entry is
    translated again (never served) and rewritten whole."""
    import gzip

    from sprpo_lib.agent.envs.alfworld import forget_translations, translations_made

    monkeypatch.setenv("SPRPO_CACHE", str(tmp_path))
    index = _small_game("valid_seen", "pick_and_place_simple")
    made = translations_made()

    class Calls:  # translations computed since the test began
        def __len__(self):
            return translations_made() - made

    calls = Calls()

    def expert_episode():
        forget_translations()  # a new process: nothing remembered
        episode = pool.open("valid_seen", index).spawn()
        seen = [episode.reset()]
        while not seen[-1].done:
            seen.append(episode.step(episode.expert_action()))
        return [(o.text, tuple(o.admissible), o.done) for o in seen]

    want = expert_episode()
    stored = sorted((tmp_path / "alfworld" / "sas").glob("*.json.gz"))
    assert len(calls) == len(stored) >= 2 and want[-1][2]
    assert expert_episode() == want and len(calls) == len(stored)  # served from the store
    stored[0].write_bytes(stored[0].read_bytes()[:100])  # a truncated entry
    assert expert_episode() == want and len(calls) == len(stored) + 1
    assert isinstance(json.loads(gzip.decompress(stored[0].read_bytes()))["sas"], str)  # rewritten whole
    assert expert_episode() == want and len(calls) == len(stored) + 1


def test_games_share_one_grammar_parse_and_each_keeps_its_goal(pool):
    """Each game's GameLogic equals TextWorld's own parse of its grammar, rule for rule and
    action for action, while the grammar is parsed once for all goals; a goal that is not a
    plain terminal of TextWorld's grammar (a '#' starts a nonterminal) takes the whole parse."""
    from textworld.envs.pddl import logic as pddl_logic

    from sprpo_lib.agent.envs.alfworld import GOAL_PLACEHOLDER, parsed_game_logic, shared_game_logic

    def described(logic):
        return ({name: [repr(r) for r in rules] for name, rules in logic.grammar._rules.items()},
                {name: (a.template, a.pddl, a.feedback_rule) for name, a in logic.actions.items()})

    domain, template = gen.game_logic()
    goals = [gen.sample_game(SEED, "valid_seen", i).task_desc for i in range(6)]
    assert len(set(goals)) > 1
    parsed_game_logic.cache_clear()
    for goal in goals + ["put a #mug# in fridge"]:
        grammar = template.replace(GOAL_PLACEHOLDER, goal)
        ours, want = described(shared_game_logic(domain, grammar)), described(pddl_logic.GameLogic(domain, grammar))
        assert ours == want, goal
        assert not any(GOAL_PLACEHOLDER in r for r in ours[0]["task"])
        assert any(goal in r for r in ours[0]["task"]) or "#" in goal
    assert parsed_game_logic.cache_info().misses == 2  # the template once, the '#' goal whole
