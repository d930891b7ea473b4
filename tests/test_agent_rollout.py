"""Agent interface (App. B prompt, action parsing, format penalty) and the vectorised runner."""
from __future__ import annotations

from functools import partial

import pytest

from sprpo_lib.agent.engines import Generation, GenerationConfig, HFGenerator
from sprpo_lib.agent.envs.webshop import make_webshop_pool
from sprpo_lib.agent.prompt import AgentConfig, HistoryStep, build_prompt, chat_text, extract_action
from sprpo_lib.agent.rollout import EpisodeLog, ProcessEnvs, RandomAdmissibleGenerator, SerialEnvs, run_groups


def test_prompt_matches_paper_structure():
    hist = [HistoryStep("You are in the middle of a room.", "go to desk 1"),
            HistoryStep("On the desk 1, you see a pen 1.", "take pen 1 from desk 1"),
            HistoryStep("You pick up the pen 1.", "go to shelf 1")]
    p = build_prompt("put a pen on shelf.", "On the shelf 1, you see nothing.", ["put pen 1 in/on shelf 1", "look"], hist)
    assert p == (  # previous steps: the observation acted on, then the action; never the current one again
        "Task: put a pen on shelf.\n\n"
        "Interaction context:\n"
        "[Step 2] Observation: On the desk 1, you see a pen 1. -> Action: take pen 1 from desk 1\n"
        "[Step 3] Observation: You pick up the pen 1. -> Action: go to shelf 1\n\n"
        "Current observation: On the shelf 1, you see nothing.\n\n"
        "Available actions:\n- put pen 1 in/on shelf 1\n- look\n\n"
        "Response: Output the next action in <action>...</action>."
    )
    p0 = build_prompt("t", "o", ["a"], hist, AgentConfig(history_len=0))
    assert "[Steps 1-3 omitted]" in p0 and "None (this is the first step)." in build_prompt("t", "o", ["a"], ())
    long = build_prompt("t", "x" * 500, ["a"], (), AgentConfig(max_obs_chars=50))
    assert "x" * 44 + " [...]" in long and "x" * 45 not in long
    with pytest.raises(ValueError, match="history_len"):
        AgentConfig(history_len=-1)


def test_prompt_echo_removal_and_history_cut():
    instr = "i need a red mug, and price lower than 20.00 dollars"
    page = f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] B0AAAA [SEP] Red Mug"
    hist = [HistoryStep(page, "click[b0aaaa]")]
    full = build_prompt(instr, page, ["click[b0aaaa]"], hist)
    assert full.count(instr) == 3  # task line + two echoes: the paper's (and WebShop's) format
    cfg = AgentConfig(echo_instruction=False, max_obs_chars=200, history_obs_chars=20)
    p = build_prompt(instr, page, ["click[b0aaaa]"], hist, cfg)
    assert p.count(instr) == 1
    assert "Current observation: Back to Search [SEP] Page 1 (Total results: 50) [SEP] B0AAAA [SEP] Red Mug\n" in p
    assert "[Step 1] Observation: Back to Search [...] -> Action: click[b0aaaa]\n" in p  # 20 characters in history
    other = "Instruction: [SEP] another task [SEP] Back to Search"
    assert f"Current observation: {other}" in build_prompt(instr, other, [], (), cfg)  # only its own echo goes
    with pytest.raises(ValueError, match="history_obs_chars"):
        AgentConfig(history_obs_chars=3)


@pytest.mark.parametrize(
    "resp,action,valid",
    [
        ("<action>go to desk 1</action>", "go to desk 1", True),
        ("I think <action>\n  click[Buy Now] </action> done", "click[Buy Now]", True),
        ("<action>a</action><action>b</action>", "a", True),
        ("<action>   </action>", "<action> </action>", False),
        ("go to desk 1", "go to desk 1", False),
        ("<action>go to desk 1", "<action>go to desk 1", False),
        ("", "", False),
        ("x" * 1000, "x" * 200, False),
    ],
)
def test_extract_action(resp, action, valid):
    p = extract_action(resp)
    assert (p.action, p.valid) == (action, valid)


def test_format_penalty_default():
    assert AgentConfig().format_penalty == pytest.approx(-0.1)  # App. B "Reward"


def _webshop_envs(workers=0):
    factory = partial(make_webshop_pool, seed=0)
    return ProcessEnvs(factory, workers) if workers else SerialEnvs(factory)


def test_runner_groups_log_and_penalty(tmp_path):
    envs = _webshop_envs()
    log = EpisodeLog(tmp_path / "eps.jsonl")
    tasks = [("test", 3), ("test", 7)]
    eps, stats = run_groups(envs, tasks, 3, RandomAdmissibleGenerator(1), log=log, progress=False)
    assert [(e.group, e.rollout) for e in eps] == [(g, r) for g in range(2) for r in range(3)]
    assert {e.task_index for e in eps if e.group == 1} == {7}
    assert len({e.instruction for e in eps if e.group == 0}) == 1
    for e in eps:
        assert 1 <= e.length <= 15
        assert e.steps[-1].done and not any(s.done for s in e.steps[:-1])
        assert all(s.valid for s in e.steps)
        assert e.success == (e.score == 1.0)
    assert stats["steps"] == sum(e.length for e in eps)
    rows = EpisodeLog.read(log.path)
    assert len(rows) == 6 and {"observation", "response", "action", "env_reward", "penalty", "valid"} <= set(rows[0]["steps"][0])
    with open(log.path, "a") as f:
        f.write('{"torn": ')  # a killed run's partial line
    assert len(EpisodeLog.read(log.path)) == 6


def test_malformed_outputs_never_crash_and_are_penalised():
    def garbage(prompts):
        outs = ["", "<action>", "click[", "<action>click[nonexistent thing]</action>", "\x00\x01 " * 300]
        return [Generation(outs[i % len(outs)], [], []) for i in range(len(prompts))]

    eps, _ = run_groups(_webshop_envs(), [("test", 0)], 5, garbage, max_steps=4, progress=False)
    for e in eps:
        assert e.length == 4 and e.score == 0.0 and not e.success
        for s in e.steps:
            assert s.penalty == (0.0 if s.valid else -0.1) and s.env_reward == 0.0
    assert sum(not s.valid for e in eps for s in e.steps) == 16


@pytest.mark.slow
def test_process_workers_match_serial():
    tasks = [("test", i) for i in range(4)]
    serial, _ = run_groups(_webshop_envs(), tasks, 2, RandomAdmissibleGenerator(3), progress=False)
    envs = _webshop_envs(workers=2)
    try:
        par, _ = run_groups(envs, tasks, 2, RandomAdmissibleGenerator(3), progress=False)
    finally:
        envs.close()
    strip = lambda eps: [(e.task_id, [(s.action, s.env_reward, s.observation) for s in e.steps]) for e in eps]  # noqa: E731
    assert strip(serial) == strip(par)


def test_hf_generator_is_seeded_and_cuts_responses(tiny):
    gen = HFGenerator(tiny, GenerationConfig(temperature=1.0, max_new_tokens=12, batch_size=2, seed=5))
    prompts = [build_prompt("t", f"obs {i}", ["a"]) for i in range(3)]
    a = gen(prompts)
    b = HFGenerator(tiny, GenerationConfig(temperature=1.0, max_new_tokens=12, batch_size=2, seed=5))(prompts)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    tok = tiny.tokenizer
    for g, p in zip(a, prompts):
        assert 0 < len(g.response_ids) <= 12
        assert tok.pad_token_id not in g.response_ids
        assert g.prompt_ids == tok(chat_text(tok, p), add_special_tokens=False)["input_ids"]
    greedy = HFGenerator(tiny, GenerationConfig(temperature=0.0, max_new_tokens=6))
    assert [g.text for g in greedy(prompts[:1])] == [g.text for g in greedy(prompts[:1])]


def test_runner_with_tiny_model_end_to_end(tiny):
    gen = HFGenerator(tiny, GenerationConfig(max_new_tokens=8, batch_size=4))
    eps, stats = run_groups(_webshop_envs(), [("train", 0)], 2, gen, max_steps=2, progress=False)
    assert all(e.length == 2 and not any(s.valid for s in e.steps) for e in eps)  # random model: no tags
    assert stats["generate_s"] > 0


def test_prompt_sections_partition_the_prompt():
    from sprpo_lib.agent.prompt import prompt_sections

    hist = [HistoryStep("page one", "click[a]"), HistoryStep("page two", "click[b]")]
    p = build_prompt("buy a mug", "the page\nwith lines", ["click[x]", "click[y]"], hist)
    parts = prompt_sections(p)
    assert parts["task"] == "buy a mug" and parts["current observation"] == "the page\nwith lines"
    assert parts["available actions"] == "- click[x]\n- click[y]" and "click[b]" in parts["interaction context"]
    assert sum(len(v) for v in parts.values()) == len(p)
    with pytest.raises(ValueError, match="not a build_prompt prompt"):
        prompt_sections("hello")


def test_compact_action_list_lists_every_admissible_action_once():
    import random

    from sprpo_lib.agent.prompt import format_actions, parse_actions

    rng = random.Random(0)
    names = ["cabinet", "drawer", "countertop", "fridge", "sinkbasin", "shelf"]
    for trial in range(200):
        adm = {f"go to {n} {k}" for n in rng.sample(names, rng.randint(0, 6)) for k in rng.sample(range(1, 25), rng.randint(1, 8))}
        adm |= {f"take {o} {rng.randint(1, 3)} from {n} {rng.randint(1, 9)}" for o in ("mug", "apple") for n in names[:2]}
        adm |= set(rng.sample(["look", "inventory", "examine mug 1", "open fridge 1", "search[<your query>]",
                               "click[small, medium 2, 3]", "click[< prev]"], 4))
        adm = sorted(adm) if trial % 2 else rng.sample(sorted(adm), len(adm))
        assert parse_actions(format_actions(adm)) == adm  # the paper's one line per action
        compact = format_actions(adm, compact=True)
        assert sorted(parse_actions(compact)) == sorted(adm)
        assert len(compact) <= len(format_actions(adm))
    block = format_actions([f"go to drawer {k}" for k in (7, 1, 3, 2, 5)] + ["go to cabinet 1", "look"], compact=True)
    assert block == "- go to cabinet 1, drawer 1-3, 5, 7\n- look"


def test_an_option_added_later_leaves_existing_keys_and_configs_unchanged():
    import dataclasses

    from sprpo_lib.agent.prompt import AgentConfig
    from sprpo_lib.infra.io import key_fields
    from sprpo_lib.train.config import config_dict, config_from_dict, load_config

    plain = dataclasses.asdict(AgentConfig())
    assert key_fields(AgentConfig()) == {k: v for k, v in plain.items() if k != "compact_actions"}
    assert key_fields(AgentConfig(compact_actions=True))["compact_actions"] is True
    cfg = load_config("smoke")
    assert "compact_actions" not in config_dict(cfg)["rollout"]["agent"]
    on = load_config("smoke", ["rollout.agent.compact_actions=true"])
    assert config_dict(on)["rollout"]["agent"]["compact_actions"] is True
    assert config_from_dict(config_dict(on)) == on and config_from_dict(config_dict(cfg)) == cfg
