"""FFN-channel perturbation hooks against independent references (issue 2, item 3)."""
from __future__ import annotations

import copy

import pytest
import torch

from sprpo_lib.core.perturb import ChannelScale, FFNChannels, dropout_mask, perturbed, sample_xi
from sprpo_lib.model.layers import ffn_modules
from sprpo_lib.model.lora import add_lora


def _ids(n=2, t=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n, t), generator=g)


def test_hook_equals_scaling_down_proj_columns(tiny):
    """h * f before down_proj == W_down with column c scaled by f_c (Sec. 5)."""
    m = tiny.model
    fc = FFNChannels(m)
    xi = sample_xi(0.2, fc.shape, seed=3)
    mask = dropout_mask(0.1, fc.shape, seed=4)
    ids = _ids()
    with perturbed(m, xi=xi, mask=mask):
        hooked = m(ids).logits
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for i, mlp in enumerate(ffn_modules(ref)):
            mlp.down_proj.weight.mul_(((1 + xi[i]) * mask[i])[None, :])
    torch.testing.assert_close(hooked, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_zero_noise_is_bit_identical_and_hooks_removed(tiny):
    m = tiny.model
    ids = _ids()
    base = m(ids).logits
    fc = FFNChannels(m)
    with perturbed(m, xi=torch.zeros(fc.shape)):
        assert torch.equal(m(ids).logits, base)
    with perturbed(m, xi=sample_xi(0.5, fc.shape, seed=0)):
        assert not torch.equal(m(ids).logits, base)
    assert all(len(mlp.down_proj._forward_pre_hooks) == 0 for mlp in ffn_modules(m))
    assert torch.equal(m(ids).logits, base)


def test_hooks_removed_on_exception_and_nesting(tiny):
    m = tiny.model
    fc = FFNChannels(m).set(xi=sample_xi(0.1, FFNChannels(m).shape, seed=0))
    with pytest.raises(RuntimeError):
        with fc:
            raise RuntimeError("boom")
    assert all(len(mlp.down_proj._forward_pre_hooks) == 0 for mlp in ffn_modules(m))
    with fc:
        with fc:
            pass
        assert all(len(mlp.down_proj._forward_pre_hooks) == 1 for mlp in ffn_modules(m))
    assert all(len(mlp.down_proj._forward_pre_hooks) == 0 for mlp in ffn_modules(m))


def test_generate_with_kv_cache_matches_weight_scaling(tiny):
    """Under generate() with a KV cache the hook fires once per forward and the
    continuation equals the one of the model with scaled W_down."""
    m, tok = tiny.model, tiny.tokenizer
    fc = FFNChannels(m)
    xi = sample_xi(0.3, fc.shape, seed=7)
    ids = _ids(1, 9)
    calls = []
    with fc.set(xi=xi):
        h = ffn_modules(m)[0].down_proj.register_forward_pre_hook(lambda *a: calls.append(1))
        out = m.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id)
        h.remove()
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for i, mlp in enumerate(ffn_modules(ref)):
            mlp.down_proj.weight.mul_((1 + xi[i])[None, :])
    ref_out = ref.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id)
    assert torch.equal(out, ref_out)
    assert len(calls) == out.shape[1] - ids.shape[1]  # one call per forward (prefill + 5 decode)


def _loss(m, ids):
    logits = m(ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_gain_gradient_matches_finite_difference(tiny64):
    """dL/du_lc at u=1 vs central differences of L under h*(1 + eps e_lc) (float64)."""
    m = tiny64.model
    ids = _ids()
    fc = FFNChannels(m)
    xi = sample_xi(0.1, fc.shape, seed=1).double()
    fc.set(xi=xi)
    with torch.enable_grad(), fc.gain() as u:
        _loss(m, ids).backward()
    g = u.grad.clone()
    eps = 1e-5
    for layer, ch in [(0, 0), (0, 5), (1, 17), (1, 127)]:
        vals = []
        for sgn in (1, -1):
            bump = torch.ones(fc.shape, dtype=torch.float64)
            bump[layer, ch] += sgn * eps
            with perturbed(m, xi=(1 + xi) * bump - 1):
                vals.append(_loss(m, ids).item())
        fd = (vals[0] - vals[1]) / (2 * eps)
        assert g[layer, ch].item() == pytest.approx(fd, rel=1e-5, abs=1e-10)


def test_xi_gradient_is_gain_gradient_over_one_plus_xi(tiny64):
    """With xi a leaf requiring grad, xi.grad = dL/dxi = (dL/du) / (1 + xi)."""
    m = tiny64.model
    ids = _ids()
    fc = FFNChannels(m)
    xi = sample_xi(0.2, fc.shape, seed=2).double()
    with torch.enable_grad(), fc.gain() as u:
        fc.set(xi=xi)
        _loss(m, ids).backward()
    xi_leaf = xi.clone().requires_grad_(True)
    fc.set(xi=xi_leaf)
    with torch.enable_grad(), fc:
        _loss(m, ids).backward()
    torch.testing.assert_close(xi_leaf.grad, u.grad / (1 + xi), rtol=1e-10, atol=1e-14)


def test_per_sequence_gain_gives_per_sequence_gradients(tiny64):
    m = tiny64.model
    ids = _ids(3)
    fc = FFNChannels(m)
    with torch.enable_grad(), fc.gain(batch=3) as u:
        logits = m(ids).logits[:, :-1]
        per = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        ).mean(1)
        per.sum().backward()
    for b in range(3):
        with torch.enable_grad(), fc.gain() as ub:
            _loss(m, ids[b : b + 1]).backward()
        torch.testing.assert_close(u.grad[b], ub.grad, rtol=1e-9, atol=1e-12)


def test_works_with_peft_lora(tiny):
    m = tiny.model
    ids = _ids()
    fc = FFNChannels(m)
    xi = sample_xi(0.2, fc.shape, seed=5)
    with perturbed(m, xi=xi):
        plain = m(ids).logits
    add_lora(tiny, seed=0)
    with perturbed(tiny.model, xi=xi):
        wrapped = tiny.model(ids).logits
    torch.testing.assert_close(wrapped, plain, rtol=1e-5, atol=1e-5)  # LoRA B = 0 at init
    # gradients reach the LoRA parameters through the perturbed path
    with torch.enable_grad(), perturbed(tiny.model, xi=xi):
        _loss(tiny.model, ids).backward()
    grads = [p.grad for n, p in tiny.model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None for g in grads)


def test_bfloat16_noise_is_not_quantised_away():
    """In bf16 models a noise of 3e-3 (below bf16's resolution near 1) still changes h:
    inference computes h + h*xi (error within one bf16 ulp of the exact product), and the
    differentiable path (ChannelScale) the same, bit for bit."""
    from sprpo_lib.model.load import load_policy

    pol = load_policy("tiny-qwen2", dtype="bfloat16")
    fc = FFNChannels(pol.model)
    seen = {}
    h0 = ffn_modules(pol.model)[0].down_proj.register_forward_pre_hook(lambda mod, a: seen.update(h=a[0]))
    pol.model(_ids(1, 5))
    base = seen["h"].clone()
    h0.remove()
    exact = base.double() * 1.003
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
    fc.set(xi=torch.full(fc.shape, 3e-3))
    with fc:
        fast = fc.layer_hook(0)(None, (base,))[0]
    assert fast.dtype == torch.bfloat16
    assert torch.all((fast.double() - exact).abs() <= ulp)
    assert (fast != base).float().mean() > 0.3  # 1 + 3e-3 in bf16 would be exactly 1.0
    fc.set(xi=torch.full(fc.shape, 3e-3).requires_grad_(True))
    with fc:  # with gradients: the inference path's product (ChannelScale), bit for bit
        assert torch.equal(fc.layer_hook(0)(None, (base,))[0], fast)
    keep = torch.ones(fc.shape)
    keep[0, :5] = 0
    fc.set(xi=torch.full(fc.shape, 0.1), mask=keep)
    with fc:
        masked = fc.layer_hook(0)(None, (base,))[0]
    assert torch.all(masked[..., :5] == 0)


def test_sampling_is_seeded_and_validated():
    a = sample_xi(0.1, (3, 8), seed=11)
    assert torch.equal(a, sample_xi(0.1, (3, 8), seed=11))
    assert not torch.equal(a, sample_xi(0.1, (3, 8), seed=12))
    sig = torch.rand(3, 8)
    z = sample_xi(1.0, (3, 8), seed=4)
    torch.testing.assert_close(sample_xi(sig, (3, 8), seed=4), z * sig)
    with pytest.raises(ValueError, match="sigma"):
        sample_xi(-0.1, (3, 8))
    with pytest.raises(ValueError, match="shape"):
        sample_xi(torch.ones(2, 8), (3, 8))
    m = dropout_mask(0.3, (50, 400), seed=0)
    assert abs((m == 0).float().mean().item() - 0.3) < 0.01
    with pytest.raises(ValueError, match="dropout"):
        dropout_mask(1.0, (2, 2))


def test_bad_shapes_give_clear_errors(tiny):
    fc = FFNChannels(tiny.model)
    with pytest.raises(ValueError, match=r"layers x FFN channels"):
        fc.set(xi=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="NaN"):
        fc.set(xi=torch.full(fc.shape, float("nan")))
    with pytest.raises(TypeError, match="gated FFN"):
        FFNChannels(torch.nn.Linear(3, 3))


def test_active_factor_is_the_product_of_attached_hooks():
    """What an engine with its own weights must fold in: every attached instance's
    (1 + xi) * mask, multiplied; nothing once detached; per-sequence factors refused."""
    from sprpo_lib.core.perturb import active_factor, dropout_mask, sample_xi
    from sprpo_lib.model.load import load_policy

    m = load_policy("tiny-qwen2").model
    a, b = FFNChannels(m), FFNChannels(m)
    xi, mask, xi2 = sample_xi(0.2, a.shape, seed=1), dropout_mask(0.3, a.shape, seed=2), sample_xi(0.1, a.shape, seed=3)
    a.set(xi=xi, mask=mask)
    b.set(xi=xi2)
    assert active_factor(m) is None
    with a:
        torch.testing.assert_close(active_factor(m), ((1 + xi.double()) * mask.double()).float())
        with b, b.gain():
            want = (1 + xi.double()) * mask.double() * (1 + xi2.double())
            torch.testing.assert_close(active_factor(m).double(), want, rtol=1e-6, atol=1e-7)
    assert active_factor(m) is None
    a.set(xi=sample_xi(0.2, (3, *a.shape), seed=1))
    with a, pytest.raises(ValueError, match="per-sequence"):
        active_factor(m)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_channel_scale_gradients_match_finite_differences_in_float64(per_sequence):
    """ChannelScale's backward (the 16-bit perturbed product's) is the derivative of
    h * f: torch.autograd.gradcheck in float64, for a factor per channel and per sequence."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 7, dtype=torch.float64, generator=g).requires_grad_(True)
    shape = (2, 1, 7) if per_sequence else (7,)
    f = (1 + 0.1 * torch.randn(*shape, dtype=torch.float64, generator=g)).requires_grad_(True)
    assert torch.autograd.gradcheck(ChannelScale.apply, (h, f))
    torch.testing.assert_close(ChannelScale.apply(h, f), h * f, rtol=1e-15, atol=1e-15)


def test_channel_scale_in_bfloat16_is_within_its_rounding_of_float64():
    """In bfloat16: the forward is the inference path's h + h * (f - 1) bit for bit; dh is g * f
    rounded once (within one bf16 ulp of the float64 product); df, the sum over 4,000 tokens
    of g * h (signs cancelling), within 1e-5 relative of its float64 value (float32 sums)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 1000, 64, generator=g).bfloat16().requires_grad_(True)
    f = (1 + 0.05 * torch.randn(64, generator=g)).requires_grad_(True)
    up = torch.randn(4, 1000, 64, generator=g).bfloat16()
    out = ChannelScale.apply(h, f)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.addcmul(h, h, (f - 1).to(torch.bfloat16)))
    out.backward(up)
    exact_dh = up.double() * f.detach().double()
    assert torch.all((h.grad.double() - exact_dh).abs() <= torch.finfo(torch.bfloat16).eps * exact_dh.abs() + 1e-30)
    exact_df = (up.double() * h.detach().double()).sum((0, 1))
    assert f.grad.dtype == torch.float32
    assert float((f.grad.double() - exact_df).norm() / exact_df.norm()) < 1e-5
