"""The fused adapted linear (speed.fused_lora): LoraLinear's gradients against finite
differences (float64), its dtypes under float32 compute of a bfloat16 adapter, peft's
forward kept wherever it would compute something else, and the training passes' LoRA
gradients, dL/dxi, dL/du and log-probs within 1e-5 relative of peft's (float32, tiny
Qwen2/Llama, both paths in one run); in bfloat16 as close to float32 as peft."""
from __future__ import annotations

import pytest
import torch
from conftest import adapted_policy, assert_same_pass, head_sharing_batch, make_actor, rel_l2
from torch import nn

from sprpo_lib.core.actor import TRAIN
from sprpo_lib.core.losses import PPOLossConfig
from sprpo_lib.core.methods import grad_leaf
from sprpo_lib.core.perturb import FFNChannels
from sprpo_lib.model.load import load_policy
from sprpo_lib.model.lora import LoraLinear, LoraSettings, add_lora, fused_lora


@pytest.mark.parametrize("bias", [True, False])
def test_lora_linear_gradients_match_finite_differences(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    a = torch.randn(2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bb = torch.randn(7, 2, dtype=torch.float64, generator=g, requires_grad=True)
    y = LoraLinear.apply(x, w, b, a, bb, 1.5)
    ref = x @ w.T + (0 if b is None else b) + 1.5 * (x @ a.T) @ bb.T  # the closed form
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *t: LoraLinear.apply(*t, 1.5), (x, w, b, a, bb))
    # only what is asked is computed: a frozen base weight gets no gradient, the others do
    w.requires_grad_(False)
    LoraLinear.apply(x, w, b, a, bb, 1.5).sum().backward()
    assert w.grad is None and x.grad is not None and a.grad is not None and bb.grad is not None


def test_a_bfloat16_adapter_under_float32_compute_keeps_its_dtype():
    """float32_compute casts the frozen base to float32 and leaves the adapter in bfloat16:
    the adapter's gradients come back in bfloat16, computed in float32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, requires_grad=True)
    w = torch.randn(3, 6, generator=g)
    a = torch.randn(2, 6, generator=g).bfloat16().requires_grad_()
    bb = torch.randn(3, 2, generator=g).bfloat16().requires_grad_()
    y = LoraLinear.apply(x, w, None, a, bb, 2.0)
    assert y.dtype == torch.float32
    y.square().sum().backward()
    assert a.grad.dtype == torch.bfloat16 and bb.grad.dtype == torch.bfloat16
    a32, b32 = a.detach().float().requires_grad_(), bb.detach().float().requires_grad_()
    (x.detach() @ w.T + 2.0 * (x.detach() @ a32.T) @ b32.T).square().sum().backward()
    assert rel_l2(a.grad.float(), a32.grad) < 1e-2 and rel_l2(bb.grad.float(), b32.grad) < 1e-2


@pytest.mark.parametrize("prefix_min,layers", [(0, None), (4, None), (4, 1)])
def test_fused_passes_give_peft_gradients(tiny_spec, prefix_min, layers):
    pol = adapted_policy(tiny_spec, layers)
    batch = head_sharing_batch()
    xi0 = 0.1 * torch.randn(FFNChannels(pol.model).shape, generator=torch.Generator().manual_seed(2))
    out, calls = {}, []
    real = LoraLinear.apply
    for on in (False, True):
        params = [p for p in pol.model.parameters() if p.requires_grad]
        actor = make_actor(pol.model, torch.optim.SGD(params, lr=0.1), micro_batch=2, prefix_min=prefix_min,
                      loss_cfg=PPOLossConfig(entropy_coeff=0.01), kl_coef=0.1, fused_lora=on)
        xi = grad_leaf(xi0, actor)
        gain = torch.ones(actor.shape, requires_grad=True)
        actor.zero_grad()
        b = batch.without_old()
        LoraLinear.apply = lambda *t, on=on: (calls.append(on), real(*t))[1]
        try:
            st = actor.backward(b, xi, gain=gain, terms=TRAIN)  # KL: a pass with the adapter disabled too
            lp = actor.log_probs(b, xi0)
        finally:
            LoraLinear.apply = real
        out[on] = ([p.grad.clone() for p in actor.params], xi.grad.clone(), gain.grad.clone(), lp, st)
        actor.zero_grad()
    assert calls and all(calls)  # the fused passes ran LoraLinear, peft's did not
    assert_same_pass(out[True], out[False], ("loss", "kl", "entropy"))


def test_peft_forward_runs_where_the_fused_one_would_differ(tiny_spec, monkeypatch):
    """Adapter dropout (random), a disabled adapter, a merged one: peft's own forward, bit for bit."""
    ids = torch.tensor([[5, 9, 13, 7, 21, 3]])
    used = []
    real = LoraLinear.apply
    monkeypatch.setattr(LoraLinear, "apply", lambda *t: (used.append(1), real(*t))[1])
    pol = adapted_policy(tiny_spec, dropout=0.5)
    pol.model.eval()  # dropout off in eval, but peft's module is still a Dropout: not fused
    with torch.no_grad():
        ref = pol.model(input_ids=ids).logits
        with fused_lora(pol.model) as n:
            assert n == 7 * pol.model.config.num_hidden_layers
            assert torch.equal(pol.model(input_ids=ids).logits, ref) and not used
    pol = adapted_policy(tiny_spec)
    with torch.no_grad():
        with pol.model.disable_adapter():
            base = pol.model(input_ids=ids).logits
        with fused_lora(pol.model):
            with pol.model.disable_adapter():
                assert torch.equal(pol.model(input_ids=ids).logits, base) and not used
            fused = pol.model(input_ids=ids).logits
            assert used
        torch.testing.assert_close(fused, pol.model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(fused, base)  # the adapter does take part


def test_the_block_restores_the_model_and_nests(tiny_spec):
    pol = adapted_policy(tiny_spec, layers=1)
    patched = lambda: [m for m in pol.model.modules() if "forward" in m.__dict__]
    with fused_lora(pol.model) as n:
        assert n == 7 and len(patched()) == 7  # q, k, v, o, gate, up, down of the one adapted layer
        with fused_lora(pol.model) as inner:  # an inner block leaves the outer one's patches alone
            assert inner == 0
        assert len(patched()) == 7
    assert not patched()
    with fused_lora(pol.model, on=False) as n:
        assert n == 0 and not patched()
    # a base linear with its own hook (e.g. a user's probe) keeps peft's path, so the hook fires
    layer = next(m for m in pol.model.modules() if isinstance(getattr(m, "base_layer", None), nn.Linear))
    seen, used = [], []
    layer.base_layer.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    real = LoraLinear.apply
    LoraLinear.apply = lambda *t: (used.append(1), real(*t))[1]
    try:
        with torch.no_grad(), fused_lora(pol.model):
            pol.model(input_ids=torch.tensor([[5, 9, 13]]))
    finally:
        LoraLinear.apply = real
    assert len(seen) == 1 and len(used) == 6


def test_in_bfloat16_the_fused_linear_is_as_close_to_float32_as_peft(tiny_spec):
    """A bfloat16 model keeps float32 adapters; the fused linear runs the adapter in bfloat16,
    peft in float32.  Against the same model in float32, the fused pass's logits and LoRA
    gradients are within 1.25x peft's own bfloat16 error."""
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))

    def run(dtype: str, on: bool):
        pol = load_policy(tiny_spec, seed=0, dtype=dtype)
        add_lora(pol, LoraSettings(rank=4, alpha=8), seed=0)
        with torch.no_grad():
            for n, p in pol.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        with fused_lora(pol.model, on):
            logits = pol.model(input_ids=ids).logits.float()
            logits.logsumexp(-1).sum().backward()
        return [logits.detach()] + [p.grad.float() for n, p in pol.model.named_parameters() if "lora" in n]

    ref, peft, fused = run("float32", False), run("bfloat16", False), run("bfloat16", True)
    err_peft = [rel_l2(a, b) for a, b in zip(peft, ref, strict=True)]
    err_fused = [rel_l2(a, b) for a, b in zip(fused, ref, strict=True)]
    assert 0 < max(err_peft) < 0.05  # bfloat16 does round
    assert err_fused[0] <= 1.25 * err_peft[0] and max(err_fused[1:]) <= 1.25 * max(err_peft[1:])
