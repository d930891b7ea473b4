"""Shared-prefix passes (update.prefix_min, with update.fused_lora, update.fused_entropy and update.native_gqa):
each prefix several rows share is computed once, and the gradient of every parameter, of xi
and of the channel gain, and every log-prob, equals the reference path that computes each
row whole (float32, tiny models, both paths in one run)."""
from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from sprpo_lib.core.actor import SURROGATE, TRAIN, Actor
from sprpo_lib.core.batch import Batch, PrefixGroup, Sample, prefix_groups, shareable
from sprpo_lib.core.losses import PPOLossConfig
from sprpo_lib.core.methods import grad_leaf
from sprpo_lib.core.perturb import FFNChannels
import sprpo_lib.model.layers as layers
from sprpo_lib.model.layers import decoder_layers
from sprpo_lib.model.load import load_policy
from sprpo_lib.model.lora import LoraSettings, add_lora, lora_on_last_layers


def _grouped_batch(seed: int = 0) -> Batch:
    """Rows as GiGPO groups make them: per task a common head, step-0 rows with the same
    whole prompt, later steps with their own prompt tails; advantages of both signs and 0."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731
    samples = []
    for _task in range(2):
        head = tok(rng.randrange(18, 26))
        first = head + tok(6)
        for _ in range(3):  # step 0: the same prompt, own responses
            n = rng.randrange(3, 7)
            samples.append(Sample(first + tok(n), n, rng.choice([1.0, -0.5, 0.0])))
        for _ in range(3):  # later steps: the head, then their own tails
            n = rng.randrange(3, 7)
            samples.append(Sample(head + tok(rng.randrange(4, 12)) + tok(n), n, rng.choice([0.7, -1.2])))
    samples += [Sample(tok(rng.randrange(15, 30)), 4, 0.3) for _ in range(2)]  # no partner
    rng.shuffle(samples)
    return Batch(samples)


def _actor(model, prefix_min: int, **kw) -> Actor:
    """The profile's passes (``prefix_min > 0``, fused LoRA linears and entropy, native GQA) or the reference."""
    kw.setdefault("fused_lora", prefix_min > 0)
    kw.setdefault("fused_entropy", prefix_min > 0)
    kw.setdefault("native_gqa", prefix_min > 0)
    params = [p for p in model.parameters() if p.requires_grad]
    return Actor(model, 0, torch.optim.Adam(params, lr=1e-3), micro_batch=2, prefix_min=prefix_min,
                 loss_cfg=PPOLossConfig(entropy_coeff=0.01), **kw)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("lora_layers", [None, 1])
def test_shared_prefix_gradients_equal_the_whole_row_path(tiny_spec, lora_layers):
    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    add_lora(pol, lora_on_last_layers(pol.model, LoraSettings(rank=4, alpha=8), lora_layers), seed=0)
    with torch.no_grad():  # LoRA B starts at 0: move it so the adapter takes part
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    batch = _grouped_batch()
    shared, whole = _actor(pol.model, prefix_min=4), _actor(pol.model, prefix_min=0, kl_coef=0.1)
    # micro-batches within a budget of padded tokens (update.micro_batch_tokens), on both layouts
    shared_tok, whole_tok = (_actor(pol.model, prefix_min=4, micro_batch_tokens=40),
                             _actor(pol.model, prefix_min=0, micro_batch_tokens=70))
    # and with every decoder layer recomputed in the backward (update.grad_checkpointing)
    shared_ck, whole_ck = (_actor(pol.model, prefix_min=4, grad_checkpointing=True),
                           _actor(pol.model, prefix_min=0, grad_checkpointing=True))
    for a in (shared, whole, shared_tok, whole_tok, shared_ck, whole_ck):
        a.kl_coef = 0.1
    saved = batch.computed_tokens(2, 4)
    assert saved["computed"] < batch.computed_tokens(2)["computed"]  # the test batch does share prefixes
    xi0 = torch.randn(shared.shape, generator=torch.Generator().manual_seed(2)) * 0.1
    out = {}
    for name, actor in (("shared", shared), ("whole", whole), ("shared_tok", shared_tok), ("whole_tok", whole_tok),
                        ("shared_ck", shared_ck), ("whole_ck", whole_ck)):
        xi = grad_leaf(xi0, actor)
        gain = torch.ones(actor.shape, requires_grad=True)
        actor.zero_grad()
        b = batch.without_old()
        for s in b.samples:
            s.ref_logp = None
        st = actor.backward(b, xi, gain=gain, terms=TRAIN)
        lp = actor.log_probs(b, xi0)
        out[name] = ([p.grad.clone() for p in actor.params], xi.grad.clone(), gain.grad.clone(), lp, st)
        actor.zero_grad()
    (gs, xs, us, lps, sts), (gw, xw, uw, lpw, stw) = out["shared"], out["whole"]
    assert all(float(g.abs().sum()) > 0 for g in gw)
    for a, b in zip(gs, gw):
        assert _rel(a, b) < 1e-5
    assert _rel(xs, xw) < 1e-5 and _rel(us, uw) < 1e-5  # dL/dxi (SPrPO's S_hat) and dL/du (SAM's g)
    assert float(xw[0].abs().sum()) > 0  # the gradient reaches the lowest layer's channels
    for a, b in zip(lps, lpw):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for k in ("loss", "pg_loss", "entropy", "kl"):
        assert sts[k] == pytest.approx(stw[k], rel=1e-5, abs=1e-7)
    for name in ("shared_tok", "whole_tok", "shared_ck", "whole_ck"):
        g, x, u = out[name][:3]
        assert all(_rel(a, b) < 1e-5 for a, b in zip(g, gw)) and _rel(x, xw) < 1e-5 and _rel(u, uw) < 1e-5


def _adapted_tiny(tiny_spec):
    """A tiny float32 policy with LoRA whose B factors are non-zero (so every gradient is)."""
    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    add_lora(pol, LoraSettings(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return pol


def _train_pass(a: Actor, batch: Batch, xi0: torch.Tensor) -> tuple:
    """One training pass of ``a``: LoRA gradients, dL/dxi, the log-probs and the stats."""
    xi = grad_leaf(xi0, a)
    a.zero_grad()
    st = a.backward(batch.without_old(), xi, terms=TRAIN)
    out = ([p.grad.clone() for p in a.params], xi.grad.clone(), a.log_probs(batch.without_old(), xi0), st)
    a.zero_grad()
    return out


def _assert_same_pass(got: tuple, want: tuple) -> None:
    """Two passes' gradients, dL/dxi, log-probs and loss agree within 1e-5 (float32); none is zero."""
    (g1, x1, lp1, st1), (g0, x0, lp0, st0) = got, want
    assert all(float(g.abs().sum()) > 0 for g in g0) and float(x0.abs().sum()) > 0
    assert all(_rel(a, b) < 1e-5 for a, b in zip(g1, g0)) and _rel(x1, x0) < 1e-5
    for a, b in zip(lp1, lp0):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert st1["loss"] == pytest.approx(st0["loss"], rel=1e-5)


@pytest.mark.parametrize("prefix_min", [0, 4])
def test_native_gqa_passes_give_the_repeated_kv_gradients(tiny_spec, prefix_min, monkeypatch):
    """update.native_gqa alone on and off, everything else the same: LoRA gradients, dL/dxi,
    log-probs and the loss agree (float32, both paths in one run); the tiny models have
    grouped-query attention (4 query heads, 2 key/value heads) and the passes are masked."""
    pol = _adapted_tiny(tiny_spec)
    assert pol.model.config.num_key_value_heads < pol.model.config.num_attention_heads
    batch = _grouped_batch(5)
    xi0 = torch.randn(FFNChannels(pol.model).shape, generator=torch.Generator().manual_seed(2)) * 0.1
    out, repeats = {}, []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: repeats.append(on) or real(*a))
    for on in (True, False):
        out[on] = _train_pass(_actor(pol.model, prefix_min=prefix_min, native_gqa=on), batch, xi0)
    assert repeats and not any(repeats)  # K and V were repeated in the reference passes only
    _assert_same_pass(out[True], out[False])


@pytest.mark.parametrize("prefix_min,chunk", [(0, None), (4, None), (0, 2), (4, 2)])
def test_matmul_attention_passes_give_the_sdpa_gradients(tiny_spec, prefix_min, chunk, monkeypatch):
    """update.attention=matmul against sdpa, everything else the same: LoRA gradients, dL/dxi,
    log-probs and the loss agree (float32, both paths in one run, masked grouped-query calls);
    with ``chunk`` queries per chunk the causal calls run in query chunks (some did)."""
    chunked, real = [], layers.query_chunks
    monkeypatch.setattr(layers, "query_chunks", lambda *a: chunked.append(real(*a)) or chunked[-1])
    pol = _adapted_tiny(tiny_spec)
    batch = _grouped_batch(6)
    xi0 = torch.randn(FFNChannels(pol.model).shape, generator=torch.Generator().manual_seed(2)) * 0.1
    out = {k: _train_pass(_actor(pol.model, prefix_min=prefix_min, attention=k, attention_chunk=chunk or 0), batch, xi0)
           for k in ("matmul", "sdpa")}
    _assert_same_pass(out["matmul"], out["sdpa"])
    assert bool(chunk) == any(len(edges) > 2 for edges in chunked)


def test_surrogate_only_pass_with_skipped_rows_matches(tiny_spec):
    """SPrPO's replay shape: surrogate alone, zero-advantage rows skipped, xi leaf."""
    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    add_lora(pol, LoraSettings(rank=4, alpha=8), seed=0)
    batch = _grouped_batch(3)
    grads = {}
    for pm in (0, 4):
        a = _actor(pol.model, prefix_min=pm)
        xi = grad_leaf(torch.full(a.shape, 0.05), a)
        a.zero_grad()
        a.backward(batch.without_old(), xi, terms=SURROGATE)
        grads[pm] = (xi.grad.clone(), a.grad_norm_sq())
        a.zero_grad()
    assert _rel(grads[4][0], grads[0][0]) < 1e-5
    assert grads[4][1] == pytest.approx(grads[0][1], rel=1e-5)


def _brute_force(samples, min_prefix, overhead):
    """Fewest tokens over every partition of the samples into runs of the sorted order."""
    order = sorted(samples, key=shareable)
    best = float("inf")
    n = len(order)
    for cuts in itertools.product([0, 1], repeat=n - 1):
        total, start = 0, 0
        for i in range(1, n + 1):
            if i == n or cuts[i - 1]:
                run = order[start:i]
                p = min((len(_common(shareable(a), shareable(b))) for a, b in zip(run, run[1:])), default=0)
                if len(run) > 1 and p >= min_prefix:
                    total += sum(len(s.ids) for s in run) - (len(run) - 1) * p + overhead
                else:
                    total += sum(len(s.ids) for s in run)
                start = i
        best = min(best, total)
    return best


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


@pytest.mark.parametrize("seed", range(6))
def test_prefix_plan_is_a_partition_with_the_fewest_tokens(seed):
    batch = _grouped_batch(seed)
    samples = batch.samples[:9]
    groups = prefix_groups(samples, min_prefix=4, overhead=5)
    assert sorted(id(s) for g in groups for s in g.samples) == sorted(id(s) for s in samples)
    for g in groups:
        assert isinstance(g, PrefixGroup)
        for s in g.samples:  # the prefix never reaches the last prompt token or the response
            assert shareable(s)[:len(g.prefix)] == g.prefix
    cost = sum(g.computed_tokens + (5 if g.prefix else 0) for g in groups)
    assert cost == _brute_force(samples, 4, 5)


@pytest.mark.parametrize("seed", range(4))
def test_trie_tokens_count_every_distinct_prefix_once(seed):
    """The trie bound against a set of every prefix of every row's shareable tokens; no
    plan computes fewer positions."""
    batch = _grouped_batch(seed)
    distinct = {tuple(shareable(s)[:n]) for s in batch.samples for n in range(1, len(shareable(s)) + 1)}
    own = sum(len(s.ids) - len(shareable(s)) for s in batch.samples)
    assert batch.trie_tokens() == len(distinct) + own
    plan = batch.computed_tokens(size=64, min_prefix=1)
    assert batch.trie_tokens() <= plan["computed"] - plan["padding"] <= batch.computed_tokens(64)["tokens"]


def test_pass_flop_model_counts_what_a_shared_pass_multiplies(tiny_spec):
    """hardware.train_pass_flops against torch's own FLOP counter on a real shared-prefix
    forward: the linears and the LM head together, exactly (rows of equal length per group: no
    padding).  The counter does not see the fused attention kernel, so the attention term
    is not checked here."""
    from torch.utils.flop_counter import FlopCounterMode

    from sprpo_lib.infra import hardware as hw

    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731
    head = tok(20)
    batch = Batch([Sample(head + tok(9), 4, 1.0) for _ in range(3)] + [Sample(tok(17), 5, 1.0) for _ in range(2)])
    actor = Actor(pol.model, 0, torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]), micro_batch=3, prefix_min=4)
    groups = [(len(g.prefix), [len(s.ids) for s in g.samples], [s.n_resp for s in g.samples])
              for g in batch.prefix_plan(4)]
    assert groups[0][0] == 20 and groups[1][0] == 0
    with FlopCounterMode(display=False) as fc:
        actor.log_probs(batch)
    counted = fc.get_flop_counts()["Global"]
    model = hw.train_pass_flops(pol.model.config, groups, grad_layers=0)
    products = sum(v for k, v in counted.items() if str(k).split(".")[-1] in ("mm", "addmm"))
    prefix_logit = 2 * pol.model.config.hidden_size * pol.model.config.vocab_size  # the prefix pass keeps one logit
    # every linear and the LM head (on a row-major copy of [B, R+1, H]: model.layers.dense_head_input) are
    # matrix products; none is a batched product over an expanded weight
    assert products == model["linear"] + model["head"] + prefix_logit
    assert not any(str(k).split(".")[-1] == "bmm" for k in counted)
    assert model["computed_tokens"] == 20 + 3 * 9 + 2 * 17


@pytest.mark.parametrize("prefix_min,lora_layers,ck", [(0, None, False), (4, None, False), (4, 1, False), (4, 1, True)])
def test_one_forward_split_equals_two_passes(prefix_min, lora_layers, ck):
    """SPrPO's one-pass estimate in one forward: the surrogate's gradient (S_hat = (dL/dxi)^2,
    m_hat = ||grad||^2) and the step's whole gradient equal a surrogate pass followed by a
    regulariser pass (entropy and KL)."""
    pol = load_policy("tiny-llama", seed=0, dtype="float32")
    add_lora(pol, lora_on_last_layers(pol.model, LoraSettings(rank=4, alpha=8), lora_layers), seed=0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    actor = _actor(pol.model, prefix_min, kl_coef=0.2, grad_checkpointing=ck)
    batch = _grouped_batch(5)
    xi0 = torch.randn(actor.shape, generator=torch.Generator().manual_seed(2)) * 0.1
    got = {}
    for mode in ("two", "split"):
        b = batch.without_old()
        xi = grad_leaf(xi0, actor)
        actor.zero_grad()
        if mode == "two":
            actor.backward(b, xi, terms=SURROGATE)
            S, m = xi.grad.clone(), actor.grad_norm_sq()
            actor.backward(b, xi0, terms=frozenset({"entropy", "kl"}))
        else:
            actor.backward(b, xi, terms=TRAIN, split_regularisers=True)
            S, m = xi.grad.clone(), actor.grad_norm_sq()
            assert any(g is not None and float(g.abs().sum()) > 0 for g in actor.side_grads)
            actor.add_side_grads()
        got[mode] = (S, m, [p.grad.clone() for p in actor.params])
        actor.zero_grad()
    (S2, m2, g2), (S1, m1, g1) = got["two"], got["split"]
    assert _rel(S1, S2) < 1e-5 and m1 == pytest.approx(m2, rel=1e-5)
    for a, b in zip(g1, g2):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_padded_chunks_are_the_cheapest_cut_of_the_sorted_rows(seed):
    from sprpo_lib.core.batch import padded_chunks

    rng = random.Random(seed)
    samples = [Sample(list(range(rng.choice([12, 15, 300, 310, 700]))), 2, 1.0) for _ in range(7)]
    runs = padded_chunks(samples, size=3, skip=5, overhead=20)
    assert sorted(id(s) for r in runs for s in r) == sorted(id(s) for s in samples)
    assert all(1 <= len(r) <= 3 for r in runs)
    cost = lambda rs: sum(len(r) * (max(len(s.ids) for s in r) - 5) + 20 for r in rs)  # noqa: E731
    order = sorted(samples, key=lambda s: -len(s.ids))
    best = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (7,))])
               for k in range(7) for cuts in itertools.combinations(range(1, 7), k)
               if all(b - a <= 3 for a, b in zip((0,) + cuts, cuts + (7,))))
    assert cost(runs) == best


@pytest.mark.parametrize("prefix_min", [0, 4])
def test_checkpointed_layers_keep_far_less_for_the_backward(tiny_spec, prefix_min):
    """What autograd saves for the backward, summed over every saved tensor (a deterministic
    count, no timer or RSS): with every decoder layer checkpointed it is a fraction of the
    plain pass's, and the layers are back to their own forward afterwards."""
    from sprpo_lib.model.layers import decoder_layers
    from sprpo_lib.model.load import TinyConfig

    pol = load_policy(tiny_spec, seed=0, dtype="float32", tiny=TinyConfig(hidden_size=64, intermediate_size=256,
                                                                           num_hidden_layers=4))
    add_lora(pol, lora_on_last_layers(pol.model, LoraSettings(rank=4, alpha=8), None), seed=0)
    batch = _grouped_batch()
    saved = {}
    for ck in (False, True):
        actor = _actor(pol.model, prefix_min=prefix_min, grad_checkpointing=ck)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            actor.backward(batch.without_old(), terms=TRAIN)
        actor.zero_grad()
        saved[ck] = total[0]
    assert saved[True] < 0.5 * saved[False]
    assert all("forward" not in vars(layer) for layer in decoder_layers(pol.model))


@pytest.mark.parametrize("seed", range(4))
def test_a_token_budget_bounds_every_micro_batch_of_several_rows(seed):
    """update.micro_batch_tokens: the DP's runs (shared layout) are the cheapest cut under the
    budget (brute force), the greedy chunks (whole rows) partition the rows in order; no
    micro-batch of two or more rows pads past the budget."""
    from sprpo_lib.core.batch import padded_chunks

    rng = random.Random(seed)
    samples = [Sample(list(range(rng.choice([12, 15, 300, 310, 700]))), 2, 1.0) for _ in range(7)]
    budget = 650
    runs = padded_chunks(samples, size=3, skip=5, overhead=20, max_tokens=budget)
    assert sorted(id(s) for r in runs for s in r) == sorted(id(s) for s in samples)
    assert all(len(r) == 1 or len(r) * (max(len(s.ids) for s in r) - 5) <= budget for r in runs)
    cost = lambda rs: sum(len(r) * (max(len(s.ids) for s in r) - 5) + 20 for r in rs)  # noqa: E731
    order = sorted(samples, key=lambda s: -len(s.ids))
    ok = lambda r: len(r) == 1 or len(r) * (len(r[0].ids) - 5) <= budget  # noqa: E731
    best = min(cost(rs) for k in range(7) for cuts in itertools.combinations(range(1, 7), k)
               if all(b - a <= 3 and ok(order[a:b]) for a, b in zip((0,) + cuts, cuts + (7,)))
               for rs in [[order[a:b] for a, b in zip((0,) + cuts, cuts + (7,))]])
    assert cost(runs) == best
    chunks = Batch(samples).micro_batch_order(3, sort=False, max_tokens=budget)
    assert [s for c in chunks for s in c] == samples
    assert all(len(c) == 1 or len(c) * max(len(s.ids) for s in c) <= budget for c in chunks)
    assert all(1 <= len(c) <= 3 for c in chunks)


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
    assert "| sdpa | vanilla |" in table and "SDPA's attention (update.attention=sdpa)" in table
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
    passes SPrPO's update keeps the graph below the adapters (update.replay_graph_gb) and the
    replay's floor drops the bottom layer's forward for those rows; the full_replay path
    (update.replay_graph_gb=0) keeps none and prices every layer, side by side."""
    from sprpo_lib.bench.report import section
    from sprpo_lib.bench.suite import bench_train

    res = bench_train("smoke", "webshop", overrides=["model.lora_layers=1", "update.ppo_mini_batch_size=2",
                                                           "update.replay_graph_gb=10"],
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
    assert "| full_replay | sprpo |" in table and "update.replay_graph_gb=0" in table


def test_bench_train_at_the_default_keeps_no_graph_and_claims_no_graph_comparison():
    """update.replay_graph_gb defaults to 0: both paths replay every layer, so the record holds
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
        actor = Actor(model, 0, torch.optim.SGD(params, lr=0.0), micro_batch=2, prefix_min=0, mini_batch=mini_batch,
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
    # kept states (update.reuse_frozen): the steps' forward runs the top layer only, the rest is as before
    kept = method_passes(batch, 1, L, False, steps=2, reuse_frozen=True)
    for m in ("vanilla", "sprpo", "sam"):
        assert [(t, d, f) for t, _, d, f, _ in kept[m] if (t, d) == ("update_s", 1)] == [("update_s", 1, 1)]
        assert [p for p in kept[m] if p[2:4] != (1, 1)] == [p for p in plan2[m] if p[2:4] != (1, L)]
    assert method_passes(batch, 1, L, False, steps=1, reuse_frozen=True) == plan1  # one step keeps nothing
    # the replay from a kept graph (update.replay_graph_gb): those rows' forward runs the top layer only
    graph = method_passes(batch, 1, L, False, steps=2, reuse_frozen=True, graph_rows={id(batch.samples[0])})
    assert [(len(r), d, f) for t, r, d, f, _ in graph["sprpo"] if t == "sensitivity_s"] == [
        (1, L, 1), (len(batch.samples) - 1, L, L)]
    assert graph["vanilla"] == kept["vanilla"] and graph["sam"] == kept["sam"]


def _recorded_update(model, start: list[torch.Tensor], xi, batch: Batch, **kw) -> tuple:
    """Actor.ppo_update from the trainable parameters ``start`` (SGD, micro-batches of 2,
    mini-batches of 5, two epochs; ``kw``: the actor's other settings): every step's gradient,
    the statistics, the old log-probs and how often the bottom and top decoder layers ran."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, v in zip(params, start):
            p.copy_(v)
    actor = Actor(model, 0, torch.optim.SGD(params, lr=0.5), micro_batch=2, mini_batch=5, epochs=2, **kw)
    grads, step = [], actor.step

    def recording_step():
        grads.append([p.grad.detach().clone() for p in actor.params])
        step()

    actor.step = recording_step
    layers = decoder_layers(model)
    calls = {"bottom": 0, "top": 0}
    hooks = [layers[0].register_forward_hook(lambda *a: calls.__setitem__("bottom", calls["bottom"] + 1)),
             layers[-1].register_forward_hook(lambda *a: calls.__setitem__("top", calls["top"] + 1))]
    try:
        st = actor.ppo_update(batch, xi)
    finally:
        for h in hooks:
            h.remove()
    return grads, st, [s.old_logp for s in batch.samples], calls


def _adapted(spec: str):
    """A tiny float32 policy with LoRA on its last layer, B non-zero so the adapters act at once."""
    pol = load_policy(spec, seed=0, dtype="float32")
    add_lora(pol, lora_on_last_layers(pol.model, LoraSettings(rank=4, alpha=8), 1), seed=0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return pol


@pytest.mark.parametrize("prefix_min,with_xi,entropy,ck", [(0, False, 0.0, False), (4, False, 0.0, False),
                                                           (4, True, 0.01, False), (4, True, 0.0, True)])
def test_kept_states_below_the_trainable_layers_give_the_reference_steps(tiny_spec, prefix_min, with_xi, entropy, ck):
    """An update of several mini-batches that runs each step from the hidden states kept at
    the lowest LoRA layer (Actor.reuse_frozen) takes the same steps as the reference path that
    runs every layer each time: every step's LoRA gradient within 1e-5 relative (float32), the
    old log-probs and the returned statistics equal, both paths in one run."""
    pol = _adapted(tiny_spec)
    start = [p.detach().clone() for p in pol.model.parameters() if p.requires_grad]
    L, C = FFNChannels(pol.model).shape
    xi = 0.1 * torch.randn(L, C, generator=torch.Generator().manual_seed(3)) if with_xi else None
    runs = {reuse: _recorded_update(pol.model, start, xi, _grouped_batch(2).without_old(), prefix_min=prefix_min,
                                    loss_cfg=PPOLossConfig(entropy_coeff=entropy), grad_checkpointing=ck,
                                    reuse_frozen=reuse, first_step_logp=False) for reuse in (False, True)}
    (g_ref, st_ref, old_ref, n_ref), (g_new, st_new, old_new, n_new) = runs[False], runs[True]
    # the bottom layer ran in the old-log-prob pass only, not in the 6 steps
    assert 0 < n_new["bottom"] and n_ref["bottom"] - n_new["bottom"] >= 6
    assert len(g_ref) == len(g_new) == 6  # 14 rows in mini-batches of 5, two epochs
    for a, b in zip(g_new, g_ref):
        for x, y in zip(a, b):
            assert _rel(x, y) < 1e-5
    for a, b in zip(old_new, old_ref):
        assert torch.equal(a, b)
    assert st_new["pg_loss"] == pytest.approx(st_ref["pg_loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("prefix_min,reuse,entropy", [(0, True, 0.0), (4, True, 0.01), (4, False, 0.0),
                                                      (0, False, 0.01)])
def test_first_step_logp_takes_the_reference_steps(tiny_spec, prefix_min, reuse, entropy):
    """update.first_step_logp on and off, everything else the same: every step's LoRA gradient
    within 1e-5 relative, every row's old log-probs within 1e-5, the first step's statistics
    alike (its ratio 1: it is at theta_k), and the top layer runs fewer times (with kept states
    the bottom one no more often, without them less often), under xi, both in one run."""
    pol = _adapted(tiny_spec)
    start = [p.detach().clone() for p in pol.model.parameters() if p.requires_grad]
    xi = 0.1 * torch.randn(FFNChannels(pol.model).shape, generator=torch.Generator().manual_seed(3))
    runs = {own: _recorded_update(pol.model, start, xi, _grouped_batch(3).without_old(), prefix_min=prefix_min,
                                  loss_cfg=PPOLossConfig(entropy_coeff=entropy), reuse_frozen=reuse,
                                  first_step_logp=own) for own in (False, True)}
    (g_ref, st_ref, old_ref, n_ref), (g_new, st_new, old_new, n_new) = runs[False], runs[True]
    assert len(g_ref) == len(g_new) == 6
    assert all(float(g.abs().sum()) > 0 for g in g_ref[0])
    for a, b in zip(g_new, g_ref):
        assert all(_rel(x, y) < 1e-5 for x, y in zip(a, b))
    assert all(o is not None for o in old_new)
    for a, b in zip(old_new, old_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for k in ("pg_loss", "loss"):
        assert st_new[k] == pytest.approx(st_ref[k], rel=1e-5, abs=1e-7)
    assert st_new["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert n_new["top"] < n_ref["top"]
    assert n_new["bottom"] <= n_ref["bottom"] if reuse else n_new["bottom"] < n_ref["bottom"]
