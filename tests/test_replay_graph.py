"""speed.replay_graph_gb: SPrPO's replay (Alg. 1 line 7) runs the adapted layers alone and one
backward through the graph the update's pass below them kept, and measures the same S_hat and
m_hat, and leaves the same adapter, as the replay through every layer (float32, tiny models,
both paths in one run); a budget too small for every row replays the rest whole."""
from __future__ import annotations

import pytest
import torch
from conftest import adapted_policy, head_sharing_batch, make_actor, rel_l2

from sprpo_lib.core.actor import SavedBytes
from sprpo_lib.core.config import SpeedConfig
from sprpo_lib.core.losses import PPOLossConfig
from sprpo_lib.core.methods import MethodConfig, make_method
from sprpo_lib.core.perturb import FFNChannels
from sprpo_lib.model.layers import decoder_layers


def _sprpo_update(model, start, xi, graph_gb: float, prefix_min: int, entropy: float, lr: float = 0.5) -> dict:
    """SPrPO's update (line 6, then line 7's replay) from the adapter ``start``: its S_hat,
    m_hat, the adapter after it, the kept graph's bytes and rows, and how often the bottom
    decoder layer ran in the replay."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, v in zip(params, start):
            p.copy_(v)
    actor = make_actor(model, torch.optim.SGD(params, lr=lr), micro_batch=2, mini_batch=5, epochs=2,
                  prefix_min=prefix_min, loss_cfg=PPOLossConfig(entropy_coeff=entropy), replay_graph_gb=graph_gb)
    method = make_method(MethodConfig(name="sprpo"), actor.shape, seed=0)
    bottom, replaying = [0], [False]

    def counting_backward(batch, x=None, **kw):
        replaying[0] = x is not None and x.requires_grad
        return backward(batch, x, **kw)

    backward, actor.backward = actor.backward, counting_backward
    hook = decoder_layers(model)[0].register_forward_hook(
        lambda *a: bottom.__setitem__(0, bottom[0] + replaying[0]))
    try:
        st = method.update(actor, head_sharing_batch().without_old(), 0, xi)
    finally:
        hook.remove()
    return {"S": method.S_hat, "m": method.m_hat, "theta": [p.detach().clone() for p in params], "stats": st,
            "kept_rows": len(actor.graph_rows), "bytes": actor.graph_bytes, "replay_bottom": bottom[0],
            "graph_after": actor._graph}  # noqa: SLF001 (the test checks it was freed)


@pytest.mark.parametrize("prefix_min,entropy,lora_layers", [(4, 0.0, 1), (0, 0.01, 1), (4, 0.01, None)])
def test_the_kept_graph_gives_the_full_replays_S_hat_and_m_hat(tiny_spec, prefix_min, entropy, lora_layers):
    """Every row kept, the first micro-batch's alone (a budget it exceeds), none (LoRA on every
    layer: nothing below the adapters): S_hat, m_hat, the replayed loss and the adapter after the
    step within 1e-5 relative of the replay through every layer."""
    pol = adapted_policy(tiny_spec, lora_layers)
    start = [p.detach().clone() for p in pol.model.parameters() if p.requires_grad]
    xi = 0.1 * torch.randn(FFNChannels(pol.model).shape, generator=torch.Generator().manual_seed(3))
    ref = _sprpo_update(pol.model, start, xi, 0.0, prefix_min, entropy)
    full = _sprpo_update(pol.model, start, xi, 100.0, prefix_min, entropy)
    part = _sprpo_update(pol.model, start, xi, 1e-9, prefix_min, entropy)  # the first micro-batch alone
    line7_rows = sum(1 for s in head_sharing_batch().samples if s.adv != 0)
    assert ref["kept_rows"] == 0 and ref["bytes"] == 0
    if lora_layers is None:
        assert full["kept_rows"] == part["kept_rows"] == 0
    else:
        assert full["kept_rows"] == line7_rows and 0 < part["kept_rows"] < line7_rows
        assert full["bytes"] > part["bytes"] > 0
    assert float(ref["S"].sum()) > 0 and ref["m"] > 0
    for run in (full, part):
        assert rel_l2(run["S"], ref["S"]) < 1e-5
        assert run["m"] == pytest.approx(ref["m"], rel=1e-5)
        assert all(rel_l2(a, b) < 1e-5 for a, b in zip(run["theta"], ref["theta"]))  # line 6 unchanged
        assert run["stats"]["replay_loss"] == pytest.approx(ref["stats"]["replay_loss"], rel=1e-5, abs=1e-7)
        assert run["graph_after"] is None  # freed once the replay has read it
    # the bottom layer: every replayed row in the reference, only the rows beyond the budget with it
    if lora_layers is not None:
        assert full["replay_bottom"] == 0 < part["replay_bottom"] < ref["replay_bottom"]


def test_saved_bytes_counts_each_saved_storage_once_and_not_the_weights():
    lin = torch.nn.Linear(64, 32, bias=False).requires_grad_(False)
    x = torch.randn(10, 64, requires_grad=True)
    with SavedBytes(lin) as held:
        y = lin(x * 2.0)  # mul by a constant saves nothing; the linear saves nothing for x's grad beyond W
        z = (y.exp() * y.exp()).sum()  # exp saves its output (2 storages of 10x32 floats)
    assert held.nbytes == 2 * 10 * 32 * 4
    z.backward()
    with SavedBytes(lin) as again:
        a = torch.randn(8, 8, requires_grad=True)
        b = a.tanh()
        (b * b).sum()  # tanh's output, saved by tanh and twice by mul: one storage
    assert again.nbytes == 8 * 8 * 4


def test_replay_graph_gb_rejects_a_negative_budget():
    with pytest.raises(ValueError, match="replay_graph_gb=-1: out of range; expected a number >= 0"):
        SpeedConfig(replay_graph_gb=-1)


def test_in_bfloat16_the_kept_graph_leaves_the_update_bit_identical(tiny_spec):
    """In bfloat16 the pass that keeps its graph computes the same states as the pass without
    one (the perturbed product is the inference path's, perturb.ChannelScale), so line 6's steps
    and the adapter they leave are bit-identical with and without the kept graph; S_hat and
    m_hat differ by the replay's rounding alone."""
    pol = adapted_policy(tiny_spec, 1)
    pol.model.to(torch.bfloat16)
    start = [p.detach().clone() for p in pol.model.parameters() if p.requires_grad]
    xi = 0.1 * torch.randn(FFNChannels(pol.model).shape, generator=torch.Generator().manual_seed(3))
    ref = _sprpo_update(pol.model, start, xi, 0.0, 4, 0.0, lr=0.05)
    kept = _sprpo_update(pol.model, start, xi, 100.0, 4, 0.0, lr=0.05)
    assert kept["kept_rows"] > 0 and kept["replay_bottom"] == 0
    assert all(torch.equal(a, b) for a, b in zip(kept["theta"], ref["theta"]))
    assert float(ref["S"].sum()) > 0
    assert rel_l2(kept["S"], ref["S"]) < 2e-2 and kept["m"] == pytest.approx(ref["m"], rel=2e-2)
