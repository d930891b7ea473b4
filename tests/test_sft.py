"""Behaviour-cloning warm start: demonstrations match RL prompts, the loss is the
response-token NLL, the pipeline learns, adapters round-trip, runs are deterministic."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from sprpo_lib.agent.engines import Generation, GenerationConfig, HFGenerator
from sprpo_lib.agent.envs.webshop import make_webshop_pool
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.agent.rollout import SerialEnvs, run_groups
from sprpo_lib.model.load import load_policy
from sprpo_lib.model.lora import LORA_TARGETS, LoraSettings, load_adapter
from sprpo_lib.warmstart.demos import Demo, collect_demonstrations, label_verb, label_weights, load_demos, save_demos
from sprpo_lib.warmstart.heldout import admissible_from_prompt, agreement, evaluate_format
from sprpo_lib.warmstart.sft import (
    IGNORE_INDEX,
    SFTConfig,
    collate,
    encode_demo,
    lr_at,
    response_nll,
    train_sft,
    warm_start,
)

AGENT = AgentConfig(max_obs_chars=100)  # short prompts: the tiny model's tokenizer is byte-level
SMALL_LORA = LoraSettings(rank=8, alpha=8)


pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops: one thread is faster on a shared machine


@pytest.fixture(scope="module")
def pool():
    return make_webshop_pool(seed=0)


@pytest.fixture(scope="module")
def demos(pool):
    return collect_demonstrations(pool, "train", range(3), AGENT)


class ReplayGenerator:
    """Answers each prompt with the demonstration recorded for it."""

    def __init__(self, demos):
        self.by_prompt = {d.prompt: d.response for d in demos}

    def __call__(self, prompts):
        return [Generation(self.by_prompt[p], [], []) for p in prompts]


def test_demos_reproduce_run_groups_prompts(pool, demos):
    stats = {}
    again = collect_demonstrations(pool, "train", range(3), AGENT, stats=stats)
    assert again == demos and stats["success_rate"] == 1.0 and stats["demos"] == len(demos)
    tasks = [("train", i) for i in range(3)]
    eps, _ = run_groups(SerialEnvs(lambda: pool), tasks, 1, ReplayGenerator(demos), AGENT, progress=False)
    replayed = [(e.task_id, s.step, s.prompt, s.response) for e in eps for s in e.steps]
    assert replayed == [(d.task_id, d.step, d.prompt, d.response) for d in demos]
    assert all(e.success and e.valid_rate == 1.0 for e in eps)
    assert demos[0].response.startswith("<action>search[") and demos[-1].response == "<action>click[buy now]</action>"
    # the history of a later step shows the previous actions exactly as RL would
    assert "-> Action: " + demos[0].response[8:-9] + "\n" in demos[1].prompt


def test_prompt_tokens_match_hf_generator(demos):
    pol = load_policy("tiny-qwen2")
    gens = HFGenerator(pol, GenerationConfig(temperature=0, max_new_tokens=1), AGENT)([d.prompt for d in demos[:2]])
    for d, g in zip(demos, gens):
        p_ids, r_ids = encode_demo(pol.tokenizer, d, AGENT)
        assert p_ids == g.prompt_ids
        assert r_ids[-1] == pol.tokenizer.eos_token_id
        assert pol.tokenizer.decode(r_ids[:-1]) == d.response


class _SpyEpisode:
    def __init__(self, ep, log):
        self.ep, self.log = ep, log
        self.instruction, self.max_steps = ep.instruction, ep.max_steps

    def reset(self):
        self.obs = self.ep.reset()
        return self.obs

    def expert_action(self):
        a = self.ep.expert_action()
        self.log.append(("expert", a, list(self.obs.admissible)))
        return a

    def step(self, action):
        self.log.append(("step", action, None))
        self.obs = self.ep.step(action)
        return self.obs

    def close(self):
        self.ep.close()


class _SpyPool:
    def __init__(self, pool):
        self.pool, self.name, self.max_steps, self.log = pool, pool.name, pool.max_steps, []

    def splits(self):
        return self.pool.splits()

    def open(self, split, index):
        handle, log = self.pool.open(split, index), self.log

        class H:
            task_id, instruction = handle.task_id, handle.instruction

            def spawn(self):
                return _SpyEpisode(handle.spawn(), log)

        return H()


def test_dagger_lite_labels_expert_and_diversifies_states(pool, demos):
    spy = _SpyPool(pool)
    mixed = collect_demonstrations(spy, "train", range(3), AGENT, expert_prob=0.5, seed=1)
    experts = [a for kind, a, _ in spy.log if kind == "expert"]
    assert [d.response for d in mixed] == [f"<action>{a}</action>" for a in experts]
    pairs = [(spy.log[i], spy.log[i + 1]) for i in range(0, len(spy.log), 2)]
    random_steps = [(e, s) for e, s in pairs if s[1] != e[1]]
    assert random_steps, "expert_prob=0.5 should take some random actions"
    for (_, _, admissible), (_, action, _) in random_steps:
        assert action in admissible or (action.startswith("search[") and "search[<your query>]" in admissible)
    assert {d.prompt for d in mixed} - {d.prompt for d in demos}, "no new states visited"
    assert collect_demonstrations(pool, "train", range(3), AGENT, expert_prob=0.5, seed=1) == mixed
    assert collect_demonstrations(pool, "train", [2], AGENT, expert_prob=0.5, seed=1) == \
        [d for d in mixed if d.task_id == "webshop/train/2"]  # per-task streams
    with pytest.raises(ValueError, match="expert_prob"):
        collect_demonstrations(pool, "train", [0], AGENT, expert_prob=1.5)


def test_repeat_recovery_executes_the_previous_action_and_keeps_the_label(pool, demos):
    """repeat_prob: some executed actions are the previous executed action again, the
    label stays the expert's, repeat_prob=0 draws nothing (the same demonstrations)."""
    spy = _SpyPool(pool)
    rep = collect_demonstrations(spy, "train", range(3), AGENT, repeat_prob=0.5, seed=1)
    experts = [a for kind, a, _ in spy.log if kind == "expert"]
    assert [d.response for d in rep] == [f"<action>{a}</action>" for a in experts]
    executed = [a for kind, a, _ in spy.log if kind == "step"]
    pairs = [(spy.log[i], spy.log[i + 1]) for i in range(0, len(spy.log), 2)]
    repeats = [i for i, (e, s) in enumerate(pairs) if s[1] != e[1]]
    assert repeats, "repeat_prob=0.5 should repeat some actions"
    assert all(i > 0 and executed[i] == executed[i - 1] for i in repeats)
    assert collect_demonstrations(pool, "train", range(3), AGENT, repeat_prob=0.0, seed=1) == demos
    with pytest.raises(ValueError, match="repeat_prob"):
        SFTConfig(repeat_prob=1.0)
    with pytest.raises(ValueError, match=r"balance=-0.5: out of range; expected a number in \[0, 2\]"):
        SFTConfig(balance=-0.5)


def test_label_weights_balance_the_verbs():
    """balance=1: every verb's demonstrations weigh the same in all; mean weight 1; 0: ones."""
    resp = ["<action>go to desk 1</action>"] * 3 + ["<action>take pen 1 from desk 1</action>", "<action>click[buy now]</action>"]
    assert [label_verb(r) for r in resp] == ["go"] * 3 + ["take", "click"]
    assert label_weights(resp, 0.0) == [1.0] * 5
    w = label_weights(resp, 1.0)
    assert math.isclose(sum(w) / 5, 1.0)
    assert math.isclose(sum(w[:3]), w[3]) and math.isclose(w[3], w[4])
    half = label_weights(resp, 0.5)  # (share)^-1/2: take against go is sqrt(3)
    assert math.isclose(half[3] / half[0], math.sqrt(3))


def test_balanced_loss_equals_the_unweighted_loss_of_the_balanced_set(demos):
    """With balance=1, three copies of one go-to demonstration and one take weigh as one
    copy of each unweighted: one optimizer step gives the same adapter (an independent
    reference for the weighted loss)."""
    go = Demo(demos[0].prompt, "<action>go to desk 1</action>", demos[0].task_id, 0)
    take = Demo(demos[1].prompt, "<action>take pen 1 from desk 1</action>", demos[1].task_id, 1)
    cfg = SFTConfig(epochs=1, lr=1e-3, batch_size=4, lora=SMALL_LORA, shuffle=False)
    a, b = load_policy("tiny-qwen2"), load_policy("tiny-qwen2")
    train_sft(a, [go, go, go, take], dataclasses.replace(cfg, balance=1.0), progress=False, agent=AGENT)
    train_sft(b, [go, take], cfg, progress=False, agent=AGENT)
    sa, sb = _state(a), _state(b)
    assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
    c = load_policy("tiny-qwen2")  # unweighted on the unbalanced set: another step
    train_sft(c, [go, go, go, take], cfg, progress=False, agent=AGENT)
    assert any(not torch.allclose(sa[k], _state(c)[k], atol=1e-6) for k in sa)


def test_shopper_demonstrator_labels_its_own_actions(pool):
    from sprpo_lib.agent.envs.webshop import visible_shopper_action

    demos = collect_demonstrations(pool, "train", range(4), AGENT, demonstrator="shopper")
    assert demos and demos[0].response.startswith("<action>search[")
    for i in range(4):  # replay each task: the label is the shopper's action on the prompt's page
        ep, acts = pool.open("train", i).spawn(), []
        obs = ep.reset()
        for d in [d for d in demos if d.task_id == f"webshop/train/{i}"]:
            action = visible_shopper_action(ep.instruction, obs.text, obs.admissible, acts)
            assert d.response == f"<action>{action}</action>"
            obs = ep.step(action)
            acts.append(action)
        assert obs.done
    with pytest.raises(ValueError, match="demonstrator"):
        collect_demonstrations(pool, "train", [0], AGENT, demonstrator="oracle")
    with pytest.raises(ValueError, match="no shopper_action"):  # e.g. ALFWorld: only the expert
        collect_demonstrations(_SpyPool(pool), "train", [0], AGENT, demonstrator="shopper")
    with pytest.raises(ValueError, match="sft.demonstrator"):
        SFTConfig(demonstrator="human")


def test_loss_masks_prompt_and_matches_direct_ce(demos):
    pol = load_policy("tiny-qwen2")
    tok = pol.tokenizer
    enc = [encode_demo(tok, d, AGENT) for d in (demos[0], demos[1])]  # different lengths -> padding
    assert len(enc[0][0]) + len(enc[0][1]) != len(enc[1][0]) + len(enc[1][1])
    batch = collate(enc, tok.pad_token_id)
    for row, (p, r) in enumerate(enc):
        lab = batch["labels"][row]
        assert (lab[: len(p)] == IGNORE_INDEX).all() and (lab[len(p) + len(r):] == IGNORE_INDEX).all()
        assert lab[len(p): len(p) + len(r)].tolist() == r
    with torch.no_grad():
        nll = response_nll(pol.model, batch)
        assert nll.dtype == torch.float32 and nll.numel() == sum(len(r) for _, r in enc)
        ours = nll.mean()
        # reference: every example unpadded, CE on all next-token targets, weighted by a response mask
        masks, targets_all, logits_all = [], [], []
        for p, r in enc:
            ids = torch.tensor([p + r])
            logits = pol.model(input_ids=ids).logits[0, :-1].float()
            targets = ids[0, 1:].clone()
            mask = torch.zeros_like(targets, dtype=torch.bool)
            mask[len(p) - 1:] = True
            logits_all.append(logits), targets_all.append(targets), masks.append(mask)

        def ref_loss(targets_list):
            num = sum((F.cross_entropy(lg, t, reduction="none") * m).sum()
                      for lg, t, m in zip(logits_all, targets_list, masks))
            return num / sum(m.sum() for m in masks)

        ref = ref_loss(targets_all)
        assert torch.allclose(ours, ref, atol=1e-5), (ours, ref)
        # changing prompt-token labels does not change the loss ...
        g = torch.Generator().manual_seed(0)
        scrambled = [torch.where(m, t, torch.randint(0, 256, t.shape, generator=g)) for t, m in zip(targets_all, masks)]
        assert torch.equal(ref_loss(scrambled), ref)
        # ... and neither does it in ours: prompt inputs unchanged, prompt labels are ignored
        b2 = dict(batch)
        b2["labels"] = batch["labels"].clone()
        b2["labels"][0, 5] = 7  # un-mask one prompt position: now it counts
        assert not torch.allclose(response_nll(pol.model, b2).mean(), ours)
    # bf16 models: the loss is still float32 and close to the float32 model's
    pol16 = load_policy("tiny-qwen2", dtype="bfloat16")
    with torch.no_grad():
        n16 = response_nll(pol16.model, batch)
    assert n16.dtype == torch.float32 and abs(float(n16.mean()) - float(ours)) < 0.05


def test_agreement_counts_the_demonstrators_actions_per_verb(demos):
    """Against counts by hand: a generator that answers with the demonstration agrees
    everywhere; one that keeps the search but clicks elsewhere, or drops the <action>
    tags, agrees on the searches only."""
    verbs = [label_verb(d.response) for d in demos]
    n = {v: verbs.count(v) for v in set(verbs)}
    assert n.get("search") and n.get("click")
    full = agreement(ReplayGenerator(demos), demos)
    assert full["states"] == full["agree"] == len(demos) and full["rate"] == 1.0
    assert full["by_verb"] == {v: {"states": k, "agree": k, "rate": 1.0} for v, k in n.items()}

    class Other(ReplayGenerator):
        def __call__(self, prompts):
            out = super().__call__(prompts)
            for i, g in enumerate(out):
                if "click[" in g.text:  # another product, or the right one without the tags
                    g.text = "<action>click[next >]</action>" if i % 2 else g.text.replace("<action>", "")
            return out

    part = agreement(Other(demos), demos)
    assert part["by_verb"]["click"] == {"states": n["click"], "agree": 0, "rate": 0.0}
    assert part["by_verb"]["search"]["agree"] == n["search"] and part["agree"] == n["search"]
    assert agreement(ReplayGenerator(demos), []) == {"states": 0, "agree": 0, "rate": 0.0, "by_verb": {}}
    with pytest.raises(RuntimeError, match="2 responses for 3"):
        agreement(lambda prompts: ReplayGenerator(demos)(prompts)[:2], demos[:3])


def test_overfit_reproduces_demo_greedily(pool):
    pol = load_policy("tiny-qwen2")
    agent = AgentConfig(max_obs_chars=40, history_len=0)  # shorter prompts, same pipeline
    pair = [d for d in collect_demonstrations(pool, "train", [0], agent) if d.step in (0, 3)]
    assert pair[0].response.startswith("<action>search[") and pair[1].response == "<action>click[buy now]</action>"
    # LoRA on lm_head too: the random tiny model's head is too small to become confident otherwise
    lora = LoraSettings(rank=16, alpha=16, targets=LORA_TARGETS + ("lm_head",))
    cfg = SFTConfig(epochs=100, lr=5e-3, batch_size=2, lora=lora, log_every=20)
    res = train_sft(pol, pair, cfg, progress=False, agent=agent)
    assert res["steps"] == 100 and res["final_loss"] < 0.05 and res["first_loss"] > 3
    gen = HFGenerator(pol, GenerationConfig(temperature=0, max_new_tokens=60), agent)
    assert [g.text for g in gen([d.prompt for d in pair])] == [d.response for d in pair]
    assert agreement(gen, pair)["by_verb"] == {v: {"states": 1, "agree": 1, "rate": 1.0} for v in ("click", "search")}


def _state(pol):
    return {k: v.detach().clone() for k, v in pol.model.named_parameters() if "lora_" in k}


def test_adapter_saved_reloads_identically_and_runs_are_deterministic(demos, tmp_path):
    cfg = SFTConfig(epochs=2, max_steps=3, lr=1e-3, batch_size=2, grad_accum=2, lora=SMALL_LORA, log_every=2)
    pol = load_policy("tiny-qwen2")
    res = train_sft(pol, demos, cfg, out_dir=tmp_path / "run", progress=False, agent=AGENT)
    assert res["steps"] == 3 and res["stopped"] == "max_steps" and res["skipped_long"] == 0
    adapter = tmp_path / "run" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file() and not list(adapter.glob("*.bin"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    summary = json.loads((tmp_path / "run" / "sft_summary.json").read_text())
    assert summary["result"]["steps"] == 3 and summary["config"]["lora"]["rank"] == 8

    batch = collate([encode_demo(pol.tokenizer, d, AGENT) for d in demos[:2]], pol.tokenizer.pad_token_id)
    kw = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        trained = pol.model(**kw).logits
        base = load_policy("tiny-qwen2")
        before = base.model(**kw).logits
        reloaded = load_adapter(base, adapter).model(**kw).logits
    assert torch.equal(trained, reloaded)
    assert not torch.allclose(trained, before)

    # same seed: bit-identical adapter and losses; another seed: different
    pol2 = load_policy("tiny-qwen2")
    res2 = train_sft(pol2, demos, cfg, progress=False, agent=AGENT)
    s1, s2 = _state(pol), _state(pol2)
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert (res2["first_loss"], res2["final_loss"]) == (res["first_loss"], res["final_loss"])
    pol3 = load_policy("tiny-qwen2")
    cfg3 = SFTConfig(**{**cfg.__dict__, "seed": 1})
    train_sft(pol3, demos, cfg3, progress=False, agent=AGENT)
    s3 = _state(pol3)
    assert any(not torch.equal(s1[k], s3[k]) for k in s1)

    # a peft-wrapped policy keeps training its own adapter (no second wrap)
    n_lora = len(s1)
    train_sft(pol, demos[:2], SFTConfig(epochs=1, lora=SMALL_LORA), progress=False, agent=AGENT)
    assert len(_state(pol)) == n_lora


def test_speed_levers_take_the_same_steps_up_to_rounding(demos, monkeypatch):
    """The RL update's levers in the SFT (fused LoRA, native grouped-query attention, the matmul
    kernel) train the same adapter as the reference path (peft's layers, transformers' SDPA)."""
    import sprpo_lib.model.layers as layers
    from sprpo_lib.core.config import SpeedConfig

    calls = []
    real = layers.matmul_attention
    monkeypatch.setattr(layers, "matmul_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = SFTConfig(epochs=1, max_steps=3, lr=1e-3, batch_size=2, lora=SMALL_LORA)
    got = {}
    for name, speed in (("reference", SpeedConfig(fused_lora=False, native_gqa=False, attention="sdpa")),
                        ("levers", SpeedConfig(attention="matmul"))):
        pol = load_policy("tiny-qwen2", dtype="float32")
        assert pol.model.config.num_key_value_heads < pol.model.config.num_attention_heads  # grouped queries
        res = train_sft(pol, demos, cfg, progress=False, agent=AGENT, speed=speed)
        got[name] = (_state(pol), res["first_loss"], res["final_loss"])
        assert bool(calls) == (name == "levers")  # the reference never takes the matmul kernel; the levers do
    (ref, ref_first, ref_final), (fast, first, final) = got["reference"], got["levers"]
    assert first == pytest.approx(ref_first, rel=1e-5) and final == pytest.approx(ref_final, rel=1e-4)
    assert ref.keys() == fast.keys() and all(torch.allclose(fast[k], ref[k], atol=1e-5, rtol=1e-4) for k in ref)
    assert all(fast[k].abs().max() > 1e-4 for k in fast if "lora_B" in k)  # the steps moved B off its zero init


def test_long_prompts_are_skipped_and_config_checked(demos):
    pol = load_policy("tiny-qwen2")
    lens = sorted(len(encode_demo(pol.tokenizer, d, AGENT)[0]) for d in demos)
    limit = lens[len(lens) // 2]
    res = train_sft(pol, demos, SFTConfig(epochs=1, max_prompt_tokens=limit, lora=SMALL_LORA), progress=False,
                    agent=AGENT)
    assert res["skipped_long"] == sum(n > limit for n in lens) > 0
    assert res["demos"] == len(demos) - res["skipped_long"]
    with pytest.raises(ValueError, match="no demonstrations"):
        train_sft(load_policy("tiny-qwen2"), demos, SFTConfig(max_prompt_tokens=10), progress=False, agent=AGENT)
    top = load_policy("tiny-qwen2")
    train_sft(top, demos[:2], SFTConfig(epochs=1, lora=SMALL_LORA, lora_layers=1), progress=False, agent=AGENT)
    adapted = {k.split("layers.")[1].split(".")[0] for k in _state(top)}
    assert adapted == {"1"} and all(v.abs().sum() > 0 for k, v in _state(top).items() if "lora_B" in k)
    with pytest.raises(ValueError, match="layers"):
        train_sft(load_policy("tiny-qwen2"), demos, SFTConfig(lora_layers=3), progress=False, agent=AGENT)
    for bad in (dict(lr=0), dict(lora_layers=0), dict(batch_size=0), dict(schedule="step"), dict(expert_prob=2.0), dict(max_steps=0)):
        with pytest.raises(ValueError):
            SFTConfig(**bad)
    cfg = SFTConfig(lr=1.0, warmup_steps=2, schedule="linear")
    assert [lr_at(s, 6, cfg) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    assert lr_at(5, 6, SFTConfig(lr=1.0, schedule="cosine")) == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 6)))


def test_warm_start_and_evaluate_format(pool, tmp_path):
    pol = load_policy("tiny-qwen2")
    cfg = SFTConfig(n_tasks=2, epochs=1, batch_size=4, lora=SMALL_LORA, expert_prob=0.8)
    res = warm_start(pol, pool, cfg, AGENT, out_dir=tmp_path, progress=False)
    assert res["collect"]["episodes"] == 2 and res["demos"] == res["collect"]["demos"]
    assert load_demos(tmp_path / "demos.jsonl")[0].task_id == "webshop/train/0"
    assert json.loads((tmp_path / "sft_summary.json").read_text())["result"]["collect"] == res["collect"]
    rep = evaluate_format(pol, pool, "test", [0, 1], AGENT, GenerationConfig(temperature=0.4, max_new_tokens=8),
                          max_steps=2, log_path=tmp_path / "eval.jsonl", progress=False)
    assert rep["episodes"] == 2 and rep["steps"] == 4
    for k in ("success_rate", "mean_score", "valid_rate", "admissible_rate", "all_valid_rate", "first_valid_rate"):
        assert 0.0 <= rep[k] <= 1.0
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2
    one = warm_start(load_policy("tiny-qwen2"), pool, dataclasses.replace(cfg, episode_steps=1), AGENT,
                     out_dir=tmp_path / "one", progress=False)  # demonstrations stop at RL's step limit
    assert one["demos"] == 2 and [d.step for d in load_demos(tmp_path / "one" / "demos.jsonl")] == [0, 0]
    with pytest.raises(ValueError, match="episode_steps=0: out of range; expected an integer >= 1"):
        SFTConfig(episode_steps=0)


def test_admissible_parsing_and_demo_io(demos, tmp_path):
    acts = admissible_from_prompt(demos[1].prompt)
    assert acts[0] == "click[back to search]" and all(a.startswith("click[") for a in acts)
    assert admissible_from_prompt(demos[0].prompt) == ["search[<your query>]"]
    from sprpo_lib.warmstart.heldout import is_admissible

    assert is_admissible("search[red shoes]", ["search[<your query>]"])
    assert not is_admissible("search[]", ["search[<your query>]"])
    assert not is_admissible("click[nope]", acts) and is_admissible(acts[2], acts)
    save_demos(tmp_path / "d.jsonl", demos)
    assert load_demos(tmp_path / "d.jsonl") == demos
    assert isinstance(demos[0], Demo)


def test_a_killed_warm_start_resumes_to_the_same_adapter(demos, tmp_path, monkeypatch):
    """Killed mid-epoch (an exception in the 5th micro-batch), rerun: it continues from its
    last resume point and ends bit-identical to an uninterrupted run (adapter, losses,
    logged rows); a damaged resume point is ignored and training starts over."""
    import sprpo_lib.warmstart.sft as sft_mod

    cfg = SFTConfig(epochs=2, lr=1e-3, batch_size=2, grad_accum=1, lora=SMALL_LORA, log_every=1)
    ref = load_policy("tiny-qwen2")
    res_ref = train_sft(ref, demos, cfg, out_dir=tmp_path / "ref", progress=False, agent=AGENT)
    assert res_ref["steps"] >= 6 and not (tmp_path / "ref" / "resume").exists()

    monkeypatch.setattr(sft_mod, "RESUME_EVERY_S", 0.0)  # a resume point before every step
    real, calls = sft_mod.response_nll, {"n": 0}

    def dies_at_5(model, batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("killed")
        return real(model, batch)

    monkeypatch.setattr(sft_mod, "response_nll", dies_at_5)
    with pytest.raises(KeyboardInterrupt):
        train_sft(load_policy("tiny-qwen2"), demos, cfg, out_dir=tmp_path / "run", progress=False, agent=AGENT)
    state = json.loads((tmp_path / "run" / "resume" / "state.json").read_text())
    assert state["run"]["step"] == 4
    monkeypatch.setattr(sft_mod, "response_nll", real)
    pol = load_policy("tiny-qwen2")
    res = train_sft(pol, demos, cfg, out_dir=tmp_path / "run", progress=False, agent=AGENT)
    s_ref, s_new = _state(ref), _state(pol)
    assert s_ref.keys() == s_new.keys() and all(torch.equal(s_ref[k], s_new[k]) for k in s_ref)
    assert (res["steps"], res["first_loss"], res["final_loss"], res["response_tokens"]) == (
        res_ref["steps"], res_ref["first_loss"], res_ref["final_loss"], res_ref["response_tokens"])
    rows = lambda d: [{k: v for k, v in json.loads(x).items() if k != "elapsed_s"}  # noqa: E731
                      for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    assert rows("run") == rows("ref") and not (tmp_path / "run" / "resume").exists()

    # a damaged resume point: a warning, a fresh start, the same result
    calls["n"] = 0
    monkeypatch.setattr(sft_mod, "response_nll", dies_at_5)
    with pytest.raises(KeyboardInterrupt):
        train_sft(load_policy("tiny-qwen2"), demos, cfg, out_dir=tmp_path / "bad", progress=False, agent=AGENT)
    monkeypatch.setattr(sft_mod, "response_nll", real)
    (tmp_path / "bad" / "resume" / "optimizer.pt").write_bytes(b"garbage")
    pol = load_policy("tiny-qwen2")
    train_sft(pol, demos, cfg, out_dir=tmp_path / "bad", progress=False, agent=AGENT)
    s_bad = _state(pol)
    assert all(torch.equal(s_ref[k], s_bad[k]) for k in s_ref) and rows("bad") == rows("ref")


def test_dagger_relabelling_of_the_experts_own_play_is_its_demonstrations(pool, demos):
    """DAgger on the expert's own episodes is the identity: same prompts, same labels, no
    disagreement; on another policy's episodes it labels the states that policy reached."""
    from sprpo_lib.agent.rollout import RandomAdmissibleGenerator

    tasks = [("train", i) for i in range(3)]
    eps, _ = run_groups(SerialEnvs(lambda: pool), tasks, 1, ReplayGenerator(demos), AGENT, progress=False)
    stats = {}
    again = collect_demonstrations(pool, "train", range(3), AGENT, stats=stats,
                                   scripts={e.task_index: [(s.prompt, s.action) for s in e.steps] for e in eps})
    assert again == demos and stats["disagree"] == 0
    rnd, _ = run_groups(SerialEnvs(lambda: pool), tasks, 1, RandomAdmissibleGenerator(seed=3), AGENT, max_steps=4,
                        progress=False)
    scripts = {e.task_index: [(s.prompt, s.action) for s in e.steps] for e in rnd}
    stats = {}
    lab = collect_demonstrations(pool, "train", range(3), AGENT, stats=stats, scripts=scripts)
    assert [d.prompt for d in lab] == [s.prompt for e in rnd for s in e.steps]  # the random policy's states
    assert lab[0].response == demos[0].response  # the first state is the same for both
    played = [s.action for e in rnd for s in e.steps]
    assert stats["disagree"] == sum(a != d.response[8:-9] for a, d in zip(played, lab)) > 0
    assert all(d.response[8:-9] in admissible_from_prompt(d.prompt) or d.response.startswith("<action>search[")
               for d in lab)
    bad = {**scripts, 1: [("another prompt", a) for _, a in scripts[1]]}
    with pytest.raises(RuntimeError, match="did not replay the same states"):
        collect_demonstrations(pool, "train", range(3), AGENT, scripts=bad)


def _adapter_tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(next(folder.rglob("adapter_model.safetensors"))))


def test_dagger_rounds_train_on_the_clones_states_and_resume(pool, tmp_path, monkeypatch):
    import sprpo_lib.warmstart.dagger as dagger_mod
    from sprpo_lib.warmstart.dagger import dagger, dagger_indices, without_dagger

    cfg = SFTConfig(n_tasks=3, epochs=1, batch_size=4, lora=SMALL_LORA, episode_steps=3, dagger_rounds=2,
                    dagger_tasks=2, dagger_temperature=1.0)
    assert without_dagger(cfg) == dataclasses.replace(cfg, dagger_rounds=0, dagger_tasks=50, dagger_temperature=0.4)
    assert [dagger_indices(cfg, r, 3) for r in (1, 2, 3)] == [[0, 1], [2, 0], [1, 2]]
    gen = GenerationConfig(max_new_tokens=8)
    warm_start(load_policy("tiny-qwen2"), pool, without_dagger(cfg), AGENT, out_dir=tmp_path / "base", progress=False)
    res = dagger(load_policy("tiny-qwen2"), pool, tmp_path / "base", cfg, AGENT, tmp_path / "d", gen, progress=False)
    base = json.loads((tmp_path / "base" / "sft_summary.json").read_text())["result"]
    assert [r["round"] for r in res["rounds"]] == [1, 2] and res["demos"] == base["demos"] + sum(
        r["new"] for r in res["rounds"])
    for r in res["rounds"]:
        rd = tmp_path / "d" / f"round-{r['round']}"
        eps = [json.loads(x) for x in (rd / "episodes.jsonl").read_text().splitlines()]
        labels = load_demos(rd / "demos.jsonl")
        # the clone's states, labelled; one replayed old demonstration per new label
        assert [d.prompt for d in labels] == [s["prompt"] for e in eps for s in e["steps"]]
        assert r["new"] == len(labels) > 0 and r["replay"] == len(labels)
        assert 0.0 <= r["disagree_rate"] <= 1.0 and r["sft"]["steps"] == math.ceil(2 * len(labels) / 4)
    assert res["seconds"] > base["seconds"]
    final = _adapter_tensors(tmp_path / "d" / "adapter")
    assert final.keys() == _adapter_tensors(tmp_path / "base" / "adapter").keys()
    assert any(not torch.equal(final[k], _adapter_tensors(tmp_path / "base" / "adapter")[k]) for k in final)

    # killed during round 2: only round 2 runs again, and ends where the uninterrupted run did
    (tmp_path / "d" / "round-2" / "round.json").unlink()
    calls = []
    real = dagger_mod.train_sft
    monkeypatch.setattr(dagger_mod, "train_sft", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = dagger(load_policy("tiny-qwen2"), pool, tmp_path / "base", cfg, AGENT, tmp_path / "d", gen, progress=False)
    def untimed(r):
        return {k: v for k, v in r.items() if k not in ("seconds", "play_s", "sft")} | {"loss": r["sft"]["final_loss"]}

    assert len(calls) == 1 and [untimed(r) for r in again["rounds"]] == [untimed(r) for r in res["rounds"]]
    redo = _adapter_tensors(tmp_path / "d" / "adapter")
    assert all(torch.equal(final[k], redo[k]) for k in final)
    # a damaged round's labels are not served: that round runs again
    (tmp_path / "d" / "round-1" / "demos.jsonl").write_text("garbage\n")
    calls.clear()
    dagger(load_policy("tiny-qwen2"), pool, tmp_path / "base", cfg, AGENT, tmp_path / "d", gen, progress=False)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="dagger_rounds=-1: out of range; expected an integer >= 0"):
        SFTConfig(dagger_rounds=-1)


def test_resumed_warm_start_reuses_its_demonstrations_unless_damaged(pool, tmp_path, monkeypatch):
    """A killed warm start's rerun trains on the demonstrations it had saved (no second
    collection: 200 ALFWorld games take minutes), the same ones a fresh collection gives;
    a damaged ``demos.jsonl`` (a line dropped) is collected again, never served."""
    import sprpo_lib.warmstart.sft as S

    cfg = SFTConfig(n_tasks=2, expert_prob=0.5)
    trained: list[list[Demo]] = []
    monkeypatch.setattr(S, "train_sft", lambda policy, demos, *a, **k: trained.append(list(demos)) or {})
    monkeypatch.setattr(S, "read_json", lambda path: {})  # the stubbed trainer writes no sft_summary.json
    collected = []
    real_collect = S.collect_demonstrations
    monkeypatch.setattr(S, "collect_demonstrations", lambda *a, **k: collected.append(1) or real_collect(*a, **k))

    first = warm_start(None, pool, cfg, AGENT, tmp_path, progress=False)
    again = warm_start(None, pool, cfg, AGENT, tmp_path, progress=False)
    assert len(collected) == 1 and trained[0] == trained[1] and len(trained[0]) > 2
    assert again["collect"] == first["collect"]

    path = tmp_path / "demos.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    warm_start(None, pool, cfg, AGENT, tmp_path, progress=False)
    assert len(collected) == 2 and trained[2] == trained[0]
    warm_start(None, pool, dataclasses.replace(cfg, expert_prob=1.0), AGENT, tmp_path, progress=False)
    assert len(collected) == 3 and trained[3] != trained[0]  # other settings: collected again
