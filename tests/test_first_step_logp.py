"""Old log-probs of the first optimizer step's rows from that step's own forward
(speed.first_step_logp; its steps against the reference path: tests/test_shared_prefix.py):
the pass it saves is the one the bench's floor leaves out (torch's FLOP counter), the states
below the adapters are the ones the full pass keeps, and the rule stands aside where it would
not hold."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import make_actor

from sprpo_lib.core.batch import Batch, Sample
from sprpo_lib.core.losses import PPOLossConfig
from sprpo_lib.model.layers import below_layer, decoder_layers
from sprpo_lib.model.load import load_policy
from sprpo_lib.model.lora import LoraSettings, add_lora, lora_on_last_layers


def _batch(seed: int) -> Batch:
    """GiGPO-like rows: two tasks whose rows share a head (shared prefixes), advantages of both
    signs and 0, and two rows with no partner."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731
    samples = []
    for _ in range(2):
        head = tok(rng.randrange(16, 24))
        for _ in range(5):
            n = rng.randrange(3, 7)
            samples.append(Sample(head + tok(rng.randrange(2, 9)) + tok(n), n, rng.choice([1.0, -0.6, 0.0, 0.4])))
    samples += [Sample(tok(rng.randrange(12, 25)), 4, 0.3) for _ in range(2)]
    rng.shuffle(samples)
    return Batch(samples)


def _policy(spec: str, lora_layers: int | None = 1):
    pol = load_policy(spec, seed=0, dtype="float32")
    add_lora(pol, lora_on_last_layers(pol.model, LoraSettings(rank=4, alpha=8), lora_layers), seed=0)
    with torch.no_grad():  # non-zero B so that the adapters act from the first step
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return pol


def test_the_rule_stands_aside_where_it_would_not_hold(tiny_spec):
    """No rows when one of the first step's rows already has old log-probs (a caller's, under
    another xi perhaps) or the model drops anything in training mode; without a regulariser the
    rows with a zero advantage, which the first step skips, are filled by the pass as before."""
    pol = _policy(tiny_spec)
    params = [p for p in pol.model.parameters() if p.requires_grad]
    actor = make_actor(pol.model, torch.optim.SGD(params, lr=0.0), micro_batch=2, mini_batch=5,
                  loss_cfg=PPOLossConfig(entropy_coeff=0.0))
    batch = _batch(5).without_old()
    first = batch.mini_batches(5)[0]
    run = [s for s in first.samples if s.adv != 0.0]
    assert 0 < len(run) < len(first.samples)
    assert actor.first_step_rows(first, batch) == {id(s) for s in run}
    filled = Batch([s for s in batch.samples if s is not run[0]])  # one of them already has old log-probs
    assert actor.first_step_rows(first, filled) == set()
    skipped = next(s for s in first.samples if s.adv == 0.0)
    assert actor.first_step_rows(first, Batch([s for s in batch.samples if s is not skipped])) == {id(s) for s in run}
    actor.loss_cfg = PPOLossConfig(entropy_coeff=0.01)  # a regulariser: the first step runs every row
    assert actor.first_step_rows(first, batch) == {id(s) for s in first.samples}
    pol.model.config.attention_dropout = 0.1
    try:
        assert actor.first_step_rows(first, batch) == set()
    finally:
        pol.model.config.attention_dropout = 0.0


def test_below_layer_gives_the_states_the_kept_pass_holds(tiny_spec):
    """The decoder stack below the lowest LoRA layer (below_layer) returns that layer's input,
    the states the full pass's hook keeps, and restores the model; out-of-range stops are refused."""
    pol = _policy(tiny_spec)
    params = [p for p in pol.model.parameters() if p.requires_grad]
    actor = make_actor(pol.model, torch.optim.SGD(params, lr=0.0), micro_batch=2, prefix_min=4)
    batch = _batch(7).without_old()
    actor._frozen = {}
    actor.fill_old_log_probs(batch, None, "keep")
    kept = dict(actor._frozen)
    actor._frozen = {}
    actor.keep_states(batch, None)
    assert kept.keys() == actor._frozen.keys()
    for k, v in kept.items():
        torch.testing.assert_close(actor._frozen[k], v, rtol=0, atol=1e-5)
    n = len(decoder_layers(pol.model))
    with pytest.raises(ValueError, match="stop must be in"):
        with below_layer(pol.model, 0):
            pass
    with below_layer(pol.model, n - 1) as stack:
        assert len(stack.layers) == n - 1
    assert len(decoder_layers(pol.model)) == n and not isinstance(pol.model.get_base_model().model.norm,
                                                                  torch.nn.Identity)
