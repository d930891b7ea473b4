"""``sprpo-bench train``'s pricing against the actor it prices: each phase against its floor, the
replay from a kept graph, the old-log-prob pass that mini-batches add, the forward the first
step's own log-probs save (torch's FLOP counter as the reference), and the record's tables."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import adapted_policy, make_actor
from torch.utils.flop_counter import FlopCounterMode

from sprpo_lib.bench.suite import method_passes, pass_groups, phase_flops
from sprpo_lib.core.batch import Batch, Sample
from sprpo_lib.core.losses import PPOLossConfig
from sprpo_lib.infra import hardware as hw
from sprpo_lib.model.layers import decoder_layers
from sprpo_lib.model.load import load_policy


def test_bench_train_reports_each_phase_against_its_floor():
    """bench train on the smoke profile: every method on the four passes (whole rows, shared
    prefixes, those with SDPA's attention, those with fused kernels), each phase with its floor,
    the shared layout computing fewer positions than the whole rows."""
    from sprpo_lib.bench.report import section
    from sprpo_lib.bench.suite import bench_train

    res = bench_train("smoke", "webshop", repeats=1, overrides=["rollout.tasks_per_step=2"], replay_frac=0.5,
                      paths=("shared", "whole", "sdpa", "fused"))
    tok = res["tokens"]
    assert tok["shared_computed"] < tok["whole_computed"] and tok["prefix_groups"] >= 1
    for path in ("shared", "whole", "sdpa", "fused"):
        for m in ("vanilla", "sprpo", "sprpo_one_pass", "sam"):
            row = res[path][m]
            assert row["update_floor_s"] > 0 and row["update_over_floor"] > 0
            assert ("sensitivity_floor_s" in row) == (m in ("sprpo", "sam"))
        assert res[path]["sprpo_over_vanilla"] > 0 and res[path]["sprpo_subset_over_vanilla"] > 0
        assert res[path]["sprpo_subset"]["ppo_steps"] == res[path]["vanilla"]["ppo_steps"]
        assert 1 < res[path]["sam_over_vanilla_bound"]
    assert tok["trie_limit"] <= tok["shared_computed"] - tok["shared_padding"]
    assert res["rollout"]["floor_s"] > 0
    assert set(res["whole_over_shared"]) == {"vanilla", "sprpo", "sprpo_one_pass", "sam", "sprpo_subset"}
    assert set(res["fused_over_shared"]) == set(res["whole_over_shared"]) == set(res["sdpa_over_shared"])
    assert set(res["sdpa_extra_over_shared"]) == {"sprpo", "sam", "sprpo_subset"} and res["attention"] == "auto"
    assert res["fused"]["vanilla"]["update_floor_s"] == res["shared"]["vanilla"]["update_floor_s"]  # same work
    table = section({"bench": "train", "results": res}, Path("train.json"))
    assert "| fused | vanilla |" in table and "Fused kernels" in table
    assert "| sdpa | vanilla |" in table and "SDPA's attention (speed.attention=sdpa)" in table
    assert res["replay_frac"] == 0.5 and res["replay_rows"] <= max(1, res["samples_nonzero_adv"])
    # the generation floor covers every episode the rollout played, refill rounds included
    assert res["rollout"]["rounds"] >= 1 and res["rollout"]["episodes_played"] >= res["episodes"]
    assert res["shared"]["sprpo_one_pass"]["ppo_steps"] == 1 and res["shared"]["vanilla"]["ppo_steps"] >= 1
    assert isinstance(res["setup_s"], float) and res["setup_s"] >= 0  # model load and warm start, not timed
    # the floors use the faster of the two matmul probes (before and after the updates)
    assert len(res["matmul_gflops_probes"]) == 2 and res["matmul_gflops"] == max(res["matmul_gflops_probes"])
    with pytest.raises(ValueError, match="sprpo_subset needs --replay-frac"):
        bench_train("smoke", "webshop", methods=("sprpo_subset",))
    with pytest.raises(ValueError, match="--paths: expected some of whole,shared,sdpa,fused,full_replay"):
        bench_train("smoke", "webshop", paths=("shared", "fast"))


def test_bench_train_prices_the_replay_from_the_kept_graph_at_the_top_layers_forward():
    """bench train with LoRA on the last layer and several optimizer steps: on the shared
    passes SPrPO's update keeps the graph below the adapters (speed.replay_graph_gb) and the
    replay's floor drops the bottom layer's forward for those rows; the full_replay path
    (speed.replay_graph_gb=0) keeps none and prices every layer, side by side."""
    from sprpo_lib.bench.report import section
    from sprpo_lib.bench.suite import bench_train

    res = bench_train("smoke", "webshop", overrides=["model.lora_layers=1", "update.ppo_mini_batch_size=2",
                                                           "speed.replay_graph_gb=10"],
                      paths=("shared", "full_replay"), methods=())
    assert set(res["replay_graph"]) == {"shared"}
    g = res["replay_graph"]["shared"]
    assert g["rows"] == g["replay_rows"] == res["samples_nonzero_adv"] > 0 and 0 < g["kept_gib"] <= g["budget_gib"]
    shared, full = res["shared"]["sprpo"], res["full_replay"]["sprpo"]
    assert 0 < shared["sensitivity_gflop"] < full["sensitivity_gflop"] and shared["update_gflop"] == full["update_gflop"]
    assert shared["update_floor_s"] == full["update_floor_s"]  # the kept pass is the update's own
    assert res["full_replay_extra_over_shared"] > 0
    cmp = res["graph_vs_full_replay"]  # the same steps (float32 here): S_hat and m_hat within rounding
    assert cmp["S_spearman"] > 0.99 and cmp["S_rel_l2"] < 1e-4 and abs(cmp["m_hat_rel_diff"]) < 1e-4
    table = section({"bench": "train", "results": res}, Path("train.json"))
    assert "| full_replay | sprpo |" in table and "speed.replay_graph_gb=0" in table


def test_bench_train_at_the_default_keeps_no_graph_and_claims_no_graph_comparison():
    """speed.replay_graph_gb defaults to 0: both paths replay every layer, so the record holds
    no kept graph and no graph-against-full-replay comparison (which would compare a path
    with itself), and the report says nothing of a kept graph."""
    from sprpo_lib.bench.report import section
    from sprpo_lib.bench.suite import bench_train

    res = bench_train("smoke", "webshop", overrides=["model.lora_layers=1", "update.ppo_mini_batch_size=2"],
                      paths=("shared", "full_replay"), methods=())
    assert res["shared"]["sprpo"]["sensitivity_gflop"] == res["full_replay"]["sprpo"]["sensitivity_gflop"] > 0
    assert not {"replay_graph", "full_replay_extra_over_shared", "graph_vs_full_replay"} & set(res)
    assert "kept the graph" not in section({"bench": "train", "results": res}, Path("train.json"))


def test_phase_rows_price_each_pass_at_its_dtype_and_bound_the_ratio_at_the_floors():
    """Two methods run the same update passes; the one whose update ran in float32 is priced at
    the float32 rate (4x the floor at a quarter of the rate), and the at-floors ratio is
    (generation + update + extra pass floors) / (generation + Vanilla's update floor) by hand."""
    from types import SimpleNamespace

    from sprpo_lib.bench.suite import phase_rows
    from sprpo_lib.infra import hardware as hw

    config = SimpleNamespace(num_hidden_layers=2, hidden_size=8, intermediate_size=16, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=32, head_dim=4)
    rows = [Sample(ids=list(range(10)), n_resp=4, adv=1.0)]
    upd, extra = ("update_s", rows, 1, 2, True), ("sensitivity_s", rows, 2, 2, True)
    passes = {"vanilla": [upd], "sam": [extra, upd]}
    times = {"vanilla": {"update_s": [3.0], "sensitivity_s": [0.0], "update_float32": [False]},
             "sam": {"update_s": [5.0], "sensitivity_s": [2.0], "update_float32": [True]}}
    # rates in GFLOP/s that put this tiny model's floors at seconds (46,720 and 61,760 FLOPs)
    out = phase_rows(times, passes, config, 0, gflops=4e-5, rollout_s=1.0, samples=1, generation_floor_s=0.5,
                      float32_gflops=1e-5)
    work = hw.train_pass_flops(config, [(0, [10], [4])], 1, 2)["total"]
    probe = hw.train_pass_flops(config, [(0, [10], [4])], 2, 2)["total"]
    van, sam = round(work / 4e4, 2), round(work / 1e4, 2)
    assert (van, sam) == (1.17, 4.67)
    assert out["vanilla"]["update_floor_s"] == van and out["sam"]["update_floor_s"] == sam
    assert out["sam"]["update_dtype"] == "float32" and "update_dtype" not in out["vanilla"]
    assert out["sam"]["sensitivity_floor_s"] == round(probe / 4e4, 2)  # the probe pass ran in bfloat16
    assert out["sam_over_vanilla"] == round(8.0 / 4.0, 3)
    assert out["sam_over_vanilla_at_floors"] == round((0.5 + sam + out["sam"]["sensitivity_floor_s"]) / (0.5 + van), 3)
    from sprpo_lib.bench.report import SUMMARIES, headline

    res = {"env": "webshop", "profile": "cpu", "shared": out, "matmul_gflops_float32": 1e-5}
    text = "\n".join(SUMMARIES["train"](res))
    assert "| shared | sam (float32 update) |" in text and "the rate a float32 update is priced at" in text
    assert f"all at their floors (what the methods' work alone costs): SAM {out['sam_over_vanilla_at_floors']}x" in text
    assert headline({"bench": "train", "results": res}).endswith(
        f"(every phase at its floor: SAM {out['sam_over_vanilla_at_floors']})")
    assert "whole path's FLOPs" not in text  # no reference path in the record: no ratio to it
    # with a reference path of twice the FLOPs and 1.5x the seconds: FLOP ratio 0.5, measured 0.667
    whole = {"vanilla": {**out["vanilla"], "update_floor_s": 2 * van, "update_s": 4.5}}
    text = "\n".join(SUMMARIES["train"]({**res, "whole": whole}))
    assert "Vanilla's shared-pass update is 0.5x the whole path's FLOPs" in text and "(measured: 0.667x)" in text


def test_estimate_agreement_against_hand_values():
    """The bench's comparison of an S_hat / m_hat estimate with the replay's: identical
    measurements agree exactly; S and m scaled by 10 are off by 9 (relative L2, relative
    difference) while the sigma they give is the same (the energy rule is scale-free); two
    channels swapped among four move Spearman to 1 - 6 * 2 / (4 * 15) = 0.8."""
    from sprpo_lib.bench.suite import estimate_agreement
    from sprpo_lib.core.methods import MethodConfig

    S = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    mcfg = MethodConfig(name="sprpo")
    same = estimate_agreement((S, 2.0), (S.clone(), 2.0), mcfg)
    assert same == {"S_spearman": 1.0, "log_S_pearson": 1.0, "S_rel_l2": 0.0, "m_hat_rel_diff": 0.0, "sigma_rel_l2": 0.0}
    scaled = estimate_agreement((S, 2.0), (10 * S, 20.0), mcfg)
    assert scaled["S_rel_l2"] == pytest.approx(9.0) and scaled["m_hat_rel_diff"] == pytest.approx(9.0)
    assert scaled["sigma_rel_l2"] == 0.0 and scaled["S_spearman"] == 1.0
    swapped = torch.tensor([[2.0, 1.0], [3.0, 4.0]], dtype=torch.float64)
    assert estimate_agreement((S, 2.0), (swapped, 2.0), mcfg)["S_spearman"] == pytest.approx(0.8)


def test_bench_train_table_of_a_partial_record_names_only_what_it_measured():
    """A ``bench train --methods sprpo_subset`` record (no SAM, no one-pass estimate): the table
    and the README phrase show the subset's row and agreement and never a missing method."""
    from sprpo_lib.bench.report import SUMMARIES, headline

    row = {"update_s": 40.0, "sensitivity_s": 0.0, "update_s_per_sample": 0.8, "iteration_s": 60.0, "ppo_steps": 4.0,
           "update_over_floor": 4.0}
    shared = {"vanilla": row, "sprpo": {**row, "sensitivity_s": 60.0, "sensitivity_over_floor": 5.0, "iteration_s": 120.0},
              "sprpo_subset": {**row, "sensitivity_s": 15.0, "sensitivity_over_floor": 5.0, "iteration_s": 75.0},
              "sprpo_over_vanilla": 2.0, "sprpo_subset_over_vanilla": 1.25, "sprpo_over_vanilla_bound": 1.2}
    res = {"env": "webshop", "profile": "cpu", "replay_frac": 0.25, "replay_rows": 14, "shared": shared,
           "subset_vs_replay": {"S_spearman": 0.42, "S_rel_l2": 3.7, "m_hat_rel_diff": 5.0, "sigma_rel_l2": 1.01}}
    text = "\n".join(SUMMARIES["train"](res)[1:])  # the batch's line aside (this record has none of its fields)
    assert "| shared | sprpo_subset |" in text and "None" not in text and "SAM" not in text
    assert "Subset (14 rows, replay_frac 0.25) S_hat against the replay's on this batch: Spearman 0.42" in text
    phrase = headline({"bench": "train", "results": res})
    assert phrase.endswith("iteration x Vanilla: SPrPO 2.0 (replay), 1.25 (replay_frac 0.25)")


def test_bench_prices_the_old_log_prob_pass_that_mini_batches_add(tiny_spec):
    """An update in several mini-batches does exactly one forward pass more than the same
    update in one step (Actor.ppo_update's old log-probs, torch's FLOP counter on the
    linears: equal-length rows, no padding), and the bench's pass plan adds exactly that
    forward to every method that steps more than once, never to the one-pass estimate."""
    from torch.utils.flop_counter import FlopCounterMode

    from sprpo_lib.bench.suite import method_passes, pass_groups
    from sprpo_lib.infra import hardware as hw

    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    model = pol.model  # every weight trainable: the backward's FLOPs are the same in both updates
    for p in model.parameters():
        p.requires_grad_(True)
    rng = random.Random(1)
    batch = Batch([Sample([rng.randrange(3, 250) for _ in range(14)], 5, a) for a in (1.0, -0.5, 0.7, -1.2)])

    def counted(mini_batch) -> float:
        params = [p for p in model.parameters() if p.requires_grad]
        actor = make_actor(model, torch.optim.SGD(params, lr=0.0), micro_batch=2, prefix_min=0, mini_batch=mini_batch,
                      first_step_logp=False)
        with FlopCounterMode(display=False) as fc:
            st = actor.ppo_update(batch.without_old(), None)
        c = fc.get_flop_counts()["Global"]
        return sum(v for k, v in c.items() if str(k).split(".")[-1] in ("mm", "addmm")), st["ppo_steps"]

    (one, s1), (two, s2) = counted(None), counted(2)
    assert (s1, s2) == (1.0, 2.0)
    forward = hw.train_pass_flops(pol.model.config, pass_groups(batch.samples, 0), 0)
    assert two - one == forward["linear"] + forward["head"]  # the LM head too (2-D here: no prefix pass)

    L = pol.model.config.num_hidden_layers
    plan1, plan2 = (method_passes(batch, 1, L, False, steps=k) for k in (1, 2))
    for m in ("vanilla", "sprpo", "sam"):
        extra = [p for p in plan2[m] if p not in plan1[m]]
        assert [(t, len(r), d, f, h) for t, r, d, f, h in extra] == [("update_s", len(batch.samples), 0, L, True)]
    assert plan1["sprpo_one_pass"] == plan2["sprpo_one_pass"]
    # kept states (speed.reuse_frozen): the steps' forward runs the top layer only, the rest is as before
    kept = method_passes(batch, 1, L, False, steps=2, reuse_frozen=True)
    for m in ("vanilla", "sprpo", "sam"):
        assert [(t, d, f) for t, _, d, f, _ in kept[m] if (t, d) == ("update_s", 1)] == [("update_s", 1, 1)]
        assert [p for p in kept[m] if p[2:4] != (1, 1)] == [p for p in plan2[m] if p[2:4] != (1, L)]
    assert method_passes(batch, 1, L, False, steps=1, reuse_frozen=True) == plan1  # one step keeps nothing
    # the replay from a kept graph (speed.replay_graph_gb): those rows' forward runs the top layer only
    graph = method_passes(batch, 1, L, False, steps=2, reuse_frozen=True, graph_rows={id(batch.samples[0])})
    assert [(len(r), d, f) for t, r, d, f, _ in graph["sprpo"] if t == "sensitivity_s"] == [
        (1, L, 1), (len(batch.samples) - 1, L, L)]
    assert graph["vanilla"] == kept["vanilla"] and graph["sam"] == kept["sam"]


@pytest.mark.parametrize("lora_layers", [1, None])
def test_the_saved_forward_is_what_the_bench_floor_leaves_out(tiny_spec, lora_layers):
    """torch's FLOP counter (linears, adapters as peft runs them, LM head) over an update of 4
    equal rows in mini-batches of 2: with the rule the old-log-prob pass computes, for the first step's 2 rows, the layers
    below the adapters only (LoRA on the last layer, kept states) or nothing (LoRA everywhere);
    the difference is those rows' forward above the adapters and their LM head, which is what
    method_passes' plan takes out of the update's floor."""
    pol = adapted_policy(tiny_spec, lora_layers)
    params = [p for p in pol.model.parameters() if p.requires_grad]
    rng = random.Random(1)
    batch = Batch([Sample([rng.randrange(3, 250) for _ in range(14)], 5, a) for a in (1.0, -0.5, 0.7, -1.2)])
    config = pol.model.config
    L = int(config.num_hidden_layers)
    depth = L if lora_layers is None else lora_layers

    def counted(own: bool) -> float:
        actor = make_actor(pol.model, torch.optim.SGD(params, lr=0.0), micro_batch=2, prefix_min=0, mini_batch=2,
                      loss_cfg=PPOLossConfig(entropy_coeff=0.0), fused_lora=False, first_step_logp=own)
        with FlopCounterMode(display=False) as fc:
            actor.ppo_update(batch.without_old(), None)
        c = fc.get_flop_counts()["Global"]
        return sum(v for k, v in c.items() if str(k).split(".")[-1] in ("mm", "addmm"))

    saved = counted(False) - counted(True)
    assert saved > 0
    first = pass_groups(batch.samples[:2], 0)
    above = hw.train_pass_flops(config, first, 0, depth)
    tokens = sum(len(s.ids) for s in batch.samples[:2])
    assert saved == pytest.approx(above["linear"] + above["head"] + _adapter_flops(pol.model, depth, tokens), rel=1e-9)
    plan = {own: method_passes(batch, depth, L, False, steps=2, reuse_frozen=True,
                               first_rows=batch.samples[:2] if own else None)["vanilla"] for own in (False, True)}
    floor = {own: phase_flops(config, plan[own], 0, "update_s") for own in plan}
    assert floor[False] - floor[True] == pytest.approx(above["total"], rel=1e-9)


def _adapter_flops(model, depth: int, tokens: int) -> float:
    """FLOPs of the LoRA matmuls of the top ``depth`` layers' forward over ``tokens`` tokens
    (``2 * rank * (in + out)`` per adapted linear and token), which the floor leaves out."""
    total = 0
    for layer in list(decoder_layers(model))[len(decoder_layers(model)) - depth:]:
        for n, p in layer.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                total += 2 * p.numel()
    return float(total * tokens)
