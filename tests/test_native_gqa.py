"""Grouped-query attention without repeated keys and values (speed.native_gqa): the attention
function against a float64 masked softmax written out here, forward and gradients; the
context manager switches transformers' SDPA only, restores it, and the model under it gives
the same logits without transformers' K/V repeat."""
from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from torch import nn

import sprpo_lib.model.layers as layers
from sprpo_lib.core.config import SpeedConfig
from sprpo_lib.model.layers import NATIVE_GQA, matmul_attention, native_gqa, native_gqa_attention
from sprpo_lib.model.load import load_policy


def _reference(q, k, v, keep, scale):
    """Masked softmax attention in float64, K/V heads repeated for their query groups."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


def _case(dtype, seed=0):
    """Two rows, 6 query / 2 key-value heads, 5 new tokens after 4 prefix keys, row 0 left-padded by 2."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, 5, 8, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=dtype, requires_grad=True)
    keep = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    keep[:, :, :, 4:] = torch.ones(5, 5, dtype=torch.bool).tril()
    keep[0, :, :, 4:6] = False  # padding keys of row 0 (its padded queries still see the prefix)
    return q, k, v, keep


def _assert_same_gradients(out, ref, inputs, tol):
    """The gradients of ``out`` and of the float64 ``ref`` for one random output gradient agree
    within ``tol`` (relative L2) for every input."""
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * go).sum(), inputs, retain_graph=True)
    want = torch.autograd.grad((ref * go).sum(), inputs, retain_graph=True)
    for a, b in zip(grads, want):
        assert float((a.double() - b).norm() / b.norm()) < tol


class _Attn(nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_attention_and_its_gradients_match_a_float64_masked_softmax(dtype, tol):
    q, k, v, keep = _case(dtype)
    out, _ = native_gqa_attention(_Attn(), q, k, v, keep, scaling=0.3)
    ref = _reference(q, k, v, keep, 0.3)
    assert out.shape == (2, 5, 6, 8)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    _assert_same_gradients(out, ref, (q, k, v), tol)


def test_other_calls_go_to_transformers_sdpa(monkeypatch):
    """No mask, one query (decoding) or one head per key/value head: transformers' function."""
    seen = []
    monkeypatch.setattr(hf_sdpa, "sdpa_attention_forward", lambda *a, **k: seen.append(a[4]) or ("hf", None))
    q, k, v, keep = _case(torch.float32)
    assert native_gqa_attention(_Attn(), q, k, v, None)[0] == "hf"
    assert native_gqa_attention(_Attn(), q[:, :, :1], k, v, keep[:, :, :1])[0] == "hf"
    one = _Attn()
    one.num_key_value_groups = 1
    assert native_gqa_attention(one, q[:, :2], k, v, keep)[0] == "hf"
    assert len(seen) == 3


def test_the_block_switches_sdpa_only_and_restores_it(tiny_spec, monkeypatch):
    pol = load_policy(tiny_spec, seed=0, dtype="float32")
    m, c = pol.model, pol.model.config
    assert c._attn_implementation == "sdpa" and c.num_key_value_heads < c.num_attention_heads
    ids = torch.randint(3, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, :4] = 0
    att[2, :1] = 0
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=att).logits
    repeats = []
    real = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: repeats.append(1) or real(*a))
    with torch.no_grad(), native_gqa(m) as on:
        assert on and c._attn_implementation == NATIVE_GQA
        with native_gqa(m) as inner:  # an enclosing block's switch is left to it
            assert not inner
        assert c._attn_implementation == NATIVE_GQA
        out = m(input_ids=ids, attention_mask=att).logits
    assert c._attn_implementation == "sdpa" and not repeats
    torch.testing.assert_close(out[att.bool()], ref[att.bool()], rtol=0, atol=1e-5)
    with torch.no_grad():
        m(input_ids=ids, attention_mask=att)
    assert repeats  # outside the block transformers repeats K and V again
    with native_gqa(m, on=False) as off:
        assert not off and c._attn_implementation == "sdpa"
    c._attn_implementation = "eager"
    try:
        with native_gqa(m) as on:
            assert not on and c._attn_implementation == "eager"
    finally:
        c._attn_implementation = "sdpa"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_matmul_attention_and_its_gradients_match_a_float64_masked_softmax(dtype, tol):
    """speed.attention=matmul: the stacked query heads of each key/value head against it,
    with a padding mask whose prefix keys every query sees (only the own keys are filled), one
    where a query does not see a prefix key, and a causal call whose mask transformers skipped (None)."""
    q, k, v, keep = _case(dtype)
    causal = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None].expand(2, 1, 5, 9)
    hidden = keep.clone()
    hidden[1, 0, 2, 0] = False  # a prefix key one query does not see: the whole product takes the fill
    for mask, want_mask in ((keep, keep), (hidden, hidden), (None, causal)):
        out, _ = matmul_attention(_Attn(), q, k, v, mask, scaling=0.3)
        ref = _reference(q, k, v, want_mask, 0.3)
        assert out.shape == (2, 5, 6, 8) and out.dtype == dtype
        assert float((out.double() - ref).detach().norm() / ref.detach().norm()) < tol
        _assert_same_gradients(out, ref, (q, k, v), tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_causal_calls_in_query_chunks_match_a_float64_masked_softmax(monkeypatch, dtype, tol):
    """Query chunks (query_chunks, forced here by 2 queries per chunk): a causal call, padded
    or not, behind a shared prefix or not, is computed chunk by chunk, each chunk's product
    stopping at its last query's key, with the output and gradients of the whole masked
    softmax; a mask where an early query sees a later key (bidirectional) stays one chunk."""
    monkeypatch.setattr(layers, "QUERY_CHUNK", 2)
    q, k, v, keep = _case(dtype, seed=4)
    causal = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None].expand(2, 1, 5, 9)
    hidden = keep.clone()
    hidden[1, 0, 2, 0] = False  # no shared prefix: the chunks still stop at their causal end
    both = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    for mask, want, edges in ((keep, keep, (0, 2, 5)), (hidden, hidden, (0, 2, 5)), (None, causal, (0, 2, 5)),
                              (both, both, (0, 5))):
        plan = layers.mask_plan(want if mask is None else mask, 5, dtype)
        assert plan.edges == edges
        out, _ = matmul_attention(_Attn(), q, k, v, mask, scaling=0.3)
        ref = _reference(q, k, v, want, 0.3)
        assert out.shape == (2, 5, 6, 8) and out.is_contiguous()
        assert float((out.double() - ref).detach().norm() / ref.detach().norm()) < tol
        _assert_same_gradients(out, ref, (q, k, v), tol)
    causal9 = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    assert layers.query_chunks(causal9, 9, 3) == (0, 3, 6, 9) and layers.query_chunks(causal9, 9, 0) == (0, 9)
    monkeypatch.setattr(layers, "MAX_CHUNKS", 2)
    assert layers.query_chunks(causal9, 9, 2) == (0, 4, 9)


def test_the_additive_mask_is_built_once_per_mask_and_gives_the_fill_bit_for_bit():
    """mask_plan: every layer of a pass gets one mask object, so its additive form is built
    once (the same tensor again), rebuilt for another mask, an in-place change or another
    dtype; with it the 16-bit attention equals the masked-fill form bit for bit (a visible
    score plus 0 is itself; a hidden one's probability is 0 either way), gradients too."""
    q, k, v, keep = _case(torch.bfloat16)
    lead, bias, edges = layers.mask_plan(keep, 5, torch.bfloat16)
    assert lead == 4 and bias.shape == (2, 1, 1, 5, 5) and edges == (0, 5)  # 5 queries: one chunk
    assert layers.mask_plan(keep, 5, torch.bfloat16).bias is bias
    assert layers.mask_plan(keep.clone(), 5, torch.bfloat16).bias is not bias
    assert layers.mask_plan(keep, 5, torch.float32).bias.dtype == torch.float32
    hidden = keep.clone()
    first = layers.mask_plan(hidden, 5, torch.bfloat16)
    hidden[1, 0, 2, 0] = False  # in place: a prefix key one query does not see
    lead, full, _ = layers.mask_plan(hidden, 5, torch.bfloat16)
    assert lead == 0 and full.shape == (2, 1, 1, 5, 9) and full is not first.bias
    assert torch.equal(full[0, 0, 0] == 0, hidden[0, 0]) and torch.equal(full[1, 0, 0] == 0, hidden[1, 0])

    def filled(mask):  # the masked-fill form: the whole product, transformers' eager equation
        s = (q * 0.3).reshape(2, 2, 15, 8) @ k.transpose(-1, -2)
        s = s.view(2, 2, 3, 5, 9).masked_fill(~mask[:, :, None], torch.finfo(q.dtype).min)
        return (torch.softmax(s, -1).view(2, 2, 15, 9) @ v).view(2, 6, 5, 8).transpose(1, 2)

    go = torch.randn(2, 5, 6, 8, generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16)
    for mask in (keep, hidden):
        out, want = matmul_attention(_Attn(), q, k, v, mask, scaling=0.3)[0], filled(mask)
        assert torch.equal(out, want)
        for a, b in zip(torch.autograd.grad((out * go).sum(), (q, k, v)), torch.autograd.grad((want * go).sum(), (q, k, v))):
            assert torch.equal(a, b)


def test_matmul_attention_sends_other_calls_to_sdpa(monkeypatch):
    """One query (decoding) or dropout: the SDPA path, never the matmuls."""
    seen = []
    monkeypatch.setattr(layers, "native_gqa_attention", lambda *a, **k: seen.append(a[1].shape) or ("sdpa", None))
    q, k, v, keep = _case(torch.float32)
    assert matmul_attention(_Attn(), q[:, :, :1], k, v, keep[:, :, :1])[0] == "sdpa"
    assert matmul_attention(_Attn(), q, k, v, keep, dropout=0.1)[0] == "sdpa"
    assert len(seen) == 2


@pytest.mark.parametrize("kernel,fp32_calls,bf16_calls", [("auto", "sdpa", "matmul"), ("matmul", "matmul", "matmul"),
                                                          ("sdpa", "sdpa", "sdpa")])
def test_the_attention_kernel_is_chosen_per_call_by_dtype(tiny_spec, monkeypatch, kernel, fp32_calls, bf16_calls):
    """``auto`` runs the matmuls for a 16-bit call only, so a 16-bit model's pass cast to float32
    (SAM's xi below bfloat16's resolution) keeps SDPA; the model's logits stay the same."""
    seen = []
    real_mm, real_sdpa = layers.matmul_attention, layers.native_gqa_attention
    monkeypatch.setattr(layers, "matmul_attention", lambda *a, **k: seen.append("matmul") or real_mm(*a, **k))
    monkeypatch.setattr(layers, "native_gqa_attention", lambda *a, **k: seen.append("sdpa") or real_sdpa(*a, **k))
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, :3] = 0
    for dtype, want in ((torch.float32, fp32_calls), (torch.bfloat16, bf16_calls)):
        m = load_policy(tiny_spec, seed=0, dtype="float32").model.to(dtype)
        with torch.no_grad():
            ref = m(input_ids=ids, attention_mask=att).logits.float()
            seen.clear()
            with native_gqa(m, kernel=kernel) as on:
                out = m(input_ids=ids, attention_mask=att).logits.float()
        assert on and seen and set(seen) == {want}, (dtype, seen)
        tol = 1e-5 if dtype == torch.float32 else 0.15
        torch.testing.assert_close(out[att.bool()], ref[att.bool()], rtol=0, atol=tol)


def test_a_bad_attention_kernel_is_one_clear_error():
    with pytest.raises(ValueError, match=r"speed.attention='flash'.*auto, sdpa, matmul"):
        SpeedConfig(attention="flash")
    with pytest.raises(ValueError, match="speed.attention"), native_gqa(nn.Linear(2, 2), kernel="flash"):
        pass
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=r"attention_chunk=.*integer >= 0"):
            SpeedConfig(attention_chunk=bad)
