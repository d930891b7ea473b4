"""Shared-prefix passes (speed.prefix_min, with speed.fused_lora, speed.fused_entropy and speed.native_gqa):
each prefix several rows share is computed once, and the gradient of every parameter, of xi
and of the channel gain, and every log-prob, equals the reference path that computes each
row whole (float32, tiny models, both paths in one run)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from conftest import make_actor

import sprpo_lib.model.layers as layers
from sprpo_lib.core.actor import SURROGATE, TRAIN, Actor
from sprpo_lib.core.batch import Batch, PrefixGroup, Sample, prefix_groups, shareable
from sprpo_lib.core.losses import PPOLossConfig
from sprpo_lib.core.methods import grad_leaf
from sprpo_lib.core.perturb import FFNChannels
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
    return make_actor(model, torch.optim.Adam(params, lr=1e-3), micro_batch=2, prefix_min=prefix_min,
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
    # micro-batches within a budget of padded tokens (speed.micro_batch_tokens), on both layouts
    shared_tok, whole_tok = (_actor(pol.model, prefix_min=4, micro_batch_tokens=40),
                             _actor(pol.model, prefix_min=0, micro_batch_tokens=70))
    # and with every decoder layer recomputed in the backward (speed.grad_checkpointing)
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
    """speed.native_gqa alone on and off, everything else the same: LoRA gradients, dL/dxi,
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
    """speed.attention=matmul against sdpa, everything else the same: LoRA gradients, dL/dxi,
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
    actor = make_actor(pol.model, torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]), micro_batch=3, prefix_min=4)
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
    """speed.micro_batch_tokens: the DP's runs (shared layout) are the cheapest cut under the
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


def _recorded_update(model, start: list[torch.Tensor], xi, batch: Batch, **kw) -> tuple:
    """Actor.ppo_update from the trainable parameters ``start`` (SGD, micro-batches of 2,
    mini-batches of 5, two epochs; ``kw``: the actor's other settings): every step's gradient,
    the statistics, the old log-probs and how often the bottom and top decoder layers ran."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, v in zip(params, start):
            p.copy_(v)
    actor = make_actor(model, torch.optim.SGD(params, lr=0.5), micro_batch=2, mini_batch=5, epochs=2, **kw)
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
    """speed.first_step_logp on and off, everything else the same: every step's LoRA gradient
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
