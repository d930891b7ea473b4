"""Fused elementwise kernels (speed.fused_kernels): the compiled RMSNorm, SwiGLU and rotary
embedding give the eager path's LoRA gradients, dL/dxi, dL/du and log-probs within 1e-5
relative (float32, tiny Qwen2/Llama, both paths in one run), restore the model on exit,
and fall back to the eager path where compilation fails."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
from conftest import adapted_policy, assert_same_pass, head_sharing_batch, make_actor, rel_l2

from sprpo_lib.core.actor import TRAIN
from sprpo_lib.core.losses import PPOLossConfig
from sprpo_lib.core.methods import grad_leaf
from sprpo_lib.core.perturb import FFNChannels
from sprpo_lib.model import fused
from sprpo_lib.model.fused import fused_kernels, fused_kernels_available, rms_norm, swiglu
from sprpo_lib.model.load import load_policy

pytestmark = pytest.mark.skipif(not fused_kernels_available(torch.float32)[0],
                                reason="torch.compile does not build here: " + fused_kernels_available()[1])


def test_the_restated_equations_are_the_models_own(tiny_spec):
    """rms_norm and swiglu, uncompiled, equal the modules they stand in for exactly."""
    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    x = torch.randn(2, 5, pol.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    norm = next(m for m in pol.model.modules() if type(m).__name__.endswith("RMSNorm"))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        assert torch.equal(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
        mlp = next(m for m in pol.model.modules() if hasattr(m, "gate_proj"))
        assert torch.equal(mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x))), mlp(x))


@pytest.mark.parametrize("prefix_min,ck", [(0, False), (4, False), (4, True)])
def test_fused_passes_give_the_reference_gradients(tiny_spec, prefix_min, ck):
    pol = adapted_policy(tiny_spec)
    batch = head_sharing_batch()
    xi0 = 0.1 * torch.randn(FFNChannels(pol.model).shape, generator=torch.Generator().manual_seed(2))
    out, calls = {}, []
    mlp = next(m for m in pol.model.modules() if hasattr(m, "gate_proj"))
    for on in (False, True):
        params = [p for p in pol.model.parameters() if p.requires_grad]
        actor = make_actor(pol.model, torch.optim.SGD(params, lr=0.1), micro_batch=2, prefix_min=prefix_min,
                      loss_cfg=PPOLossConfig(entropy_coeff=0.01), grad_checkpointing=ck, fused_kernels=on)
        xi = grad_leaf(xi0, actor)
        gain = torch.ones(actor.shape, requires_grad=True)
        actor.zero_grad()
        handle = mlp.register_forward_hook(lambda m, a, o: calls.append("forward" in m.__dict__))
        st = actor.backward(batch.without_old(), xi, gain=gain, terms=TRAIN)
        lp = actor.log_probs(batch, xi0)
        handle.remove()
        out[on] = ([p.grad.clone() for p in actor.params], xi.grad.clone(), gain.grad.clone(), lp, st)
        actor.zero_grad()
    assert any(calls) and not all(calls)  # the fused pass ran the patched MLP, the eager one did not
    assert_same_pass(out[True], out[False])


def test_one_forward_two_gradients_under_fused_kernels(tiny_spec):
    """SPrPO's one-pass estimate keeps the graph for a second gradient (split_regularisers):
    the fused pass gives the eager pass's surrogate gradient and side gradients."""
    pol = adapted_policy(tiny_spec)
    out = {}
    for on in (False, True):
        params = [p for p in pol.model.parameters() if p.requires_grad]
        actor = make_actor(pol.model, torch.optim.SGD(params, lr=0.1), micro_batch=3, prefix_min=4,
                      loss_cfg=PPOLossConfig(entropy_coeff=0.01), fused_kernels=on)
        xi = grad_leaf(torch.full(actor.shape, 0.05), actor)
        actor.zero_grad()
        actor.backward(head_sharing_batch(), xi, terms=TRAIN, split_regularisers=True)
        out[on] = ([p.grad.clone() for p in actor.params], xi.grad.clone(), [g.clone() for g in actor.side_grads])
        actor.zero_grad()
    for a, b in zip(out[True][0] + [out[True][1]] + out[True][2], out[False][0] + [out[False][1]] + out[False][2]):
        assert rel_l2(a, b) < 1e-5


def test_new_row_counts_and_lengths_compile_nothing_new(tiny_spec):
    """The kernels see rows ``[N, C]``: once each has run with and without gradients, passes of
    other row counts and lengths (one row, one token, a ``cos`` shared by the rows) reuse the
    graphs.  On ``[B, T, C]`` inputs a batch of one took a graph of its own for every kernel,
    and the mixes ran them into torch._dynamo's recompile limit mid-run, eager from there on."""
    from torch._dynamo.utils import counters

    pol = adapted_policy(tiny_spec)
    ids = torch.arange(5, 5 + 3 * 9).view(3, 9)

    def passes(shapes):
        for b, t in shapes:
            pol.model(input_ids=ids[:b, :t]).logits.sum().backward()
            with torch.no_grad():
                pol.model(input_ids=ids[:b, :t], position_ids=torch.arange(t)[None])

    with fused_kernels(pol.model) as on:
        assert on
        passes([(2, 6)])
        before = counters["stats"]["unique_graphs"]
        passes([(1, 6), (3, 4), (1, 9), (2, 1), (1, 1)])
        assert counters["stats"]["unique_graphs"] == before


def test_the_block_restores_the_model_and_nests(tiny_spec):
    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    attn = next(m for m in pol.model.modules() if type(m).__name__.endswith("Attention"))
    mod = sys.modules[type(attn).__module__]
    rotary = mod.apply_rotary_pos_emb
    ids = torch.tensor([[5, 9, 13, 7, 21]])
    with torch.no_grad():
        ref = pol.model(input_ids=ids).logits
        with fused_kernels(pol.model) as on:
            assert on and mod.apply_rotary_pos_emb is not rotary
            patched = [m for m in pol.model.modules() if "forward" in m.__dict__]
            assert len(patched) == 3 * pol.model.config.num_hidden_layers + 1  # 2 norms + MLP per layer, final norm
            with fused_kernels(pol.model) as inner:  # an inner block leaves the outer one's patches alone
                assert inner
            assert all("forward" in m.__dict__ for m in patched) and mod.apply_rotary_pos_emb is not rotary
            torch.testing.assert_close(pol.model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
    assert not any("forward" in m.__dict__ for m in pol.model.modules())
    assert mod.apply_rotary_pos_emb is rotary
    with fused_kernels(pol.model, on=False) as on:
        assert not on and not any("forward" in m.__dict__ for m in pol.model.modules())


def test_without_a_compiler_the_passes_run_eagerly_and_say_so(tiny_spec, monkeypatch, caplog):
    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no C++ compiler found")
        return run

    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    monkeypatch.setattr(fused.torch, "compile", broken)
    fused.compiled.cache_clear()
    fused_kernels_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="sprpo_lib.model.fused"), fused_kernels(pol.model) as on:
            assert not on and not any("forward" in m.__dict__ for m in pol.model.modules())
        assert "speed.fused_kernels" in caplog.text and "no C++ compiler" in caplog.text
        assert fused_kernels_available(torch.float32) == (False, "RuntimeError: no C++ compiler found")
    finally:
        fused.compiled.cache_clear()
        fused_kernels_available.cache_clear()


def test_a_miscompile_is_caught_and_the_passes_run_eagerly(monkeypatch):
    """The availability check compares the compiled kernels with the eager functions: a
    compiled kernel that returns wrong values (here: one NaN) is refused, with the reason."""
    real = fused.torch.compile

    def wrong(fn, **kw):
        run = real(fn, **kw)
        return lambda *a, **k: run(*a, **k) * torch.where(torch.rand(()) > 2, 1.0, float("nan"))

    monkeypatch.setattr(fused.torch, "compile", wrong)
    fused.compiled.cache_clear()
    fused_kernels_available.cache_clear()
    try:
        ok, why = fused_kernels_available(torch.float32)
        assert not ok and why.startswith("ArithmeticError: the compiled forward disagrees with eager")
    finally:
        fused.compiled.cache_clear()
        fused_kernels_available.cache_clear()
