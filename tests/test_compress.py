"""Deployment perturbations (App. C) against independent references (issue 2, item 4)."""
from __future__ import annotations

import math

import pytest
import torch

from sprpo_lib.core.compress import (
    PERTURBATIONS,
    apply_perturbation,
    fisher_prune_mask,
    fisher_scores,
    gram,
    perturbation,
    prune_channels,
    rtn_quantize,
    rtn_quantize_tensor,
    sparsegpt_matrix,
    sparsegpt_prune,
    transformer_linears,
)
from sprpo_lib.core.perturb import FFNChannels, perturbed
from sprpo_lib.model.layers import decoder_layers, ffn_modules
from sprpo_lib.model.lora import add_lora


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# ------------------------------------------------------------------------------- RTN
@pytest.mark.parametrize("bits", [8, 6, 4, 3, 2])
def test_rtn_error_bound_and_grid(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(24, 300, generator=g) * torch.rand(24, 1, generator=g)  # 300: a partial group
    q = rtn_quantize_tensor(w, bits, 128)
    qmax = 2 ** (bits - 1) - 1
    wd = w.double()
    for r in range(w.shape[0]):
        for start in range(0, 300, 128):
            grp = wd[r, start : start + 128]
            s = grp.abs().max().item() / qmax
            qq = q[r, start : start + 128].double()
            codes = qq / s
            assert torch.all((qq - grp).abs() <= s / 2 + 1e-6 * s)  # round-to-nearest
            torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)  # on the grid
            assert codes.round().abs().max().item() <= qmax
            # independent float64 recomputation
            ref = torch.clamp(torch.round(grp / s), -qmax - 1, qmax) * s
            torch.testing.assert_close(qq, ref, rtol=0, atol=2e-7 * s * qmax)  # float32 product q*s


def test_rtn_zero_group_and_validation():
    w = torch.zeros(2, 256)
    w[1, 130] = 1.0
    q = rtn_quantize_tensor(w, 4)
    assert torch.equal(q, w)
    with pytest.raises(ValueError, match="bit width"):
        rtn_quantize_tensor(w, 1)
    with pytest.raises(ValueError, match="bit width"):
        rtn_quantize_tensor(w, 9)


def test_rtn_covers_all_transformer_linears_and_restores(tiny):
    m = tiny.model
    before = _state(m)
    names = [n for n, _ in transformer_linears(m)]
    per_layer = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(names) == 7 * len(decoder_layers(m))
    assert {n.split(".")[-1] for n in names} == per_layer
    snap = rtn_quantize(m, 4)
    after = m.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.split(".")[-2] in per_layer for k in changed)  # not embeddings/head/norms
    snap.restore()
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


# ------------------------------------------------------------------------------- SparseGPT
def _obs_reference(W, H, ratio, blocksize, percdamp):
    """Float64 SparseGPT/OBS without the Cholesky trick: every column update uses the
    explicit inverse of the Hessian restricted to the not-yet-processed columns."""
    W = W.double().clone()
    H = H.double().clone()
    cols = W.shape[1]
    H += percdamp * torch.diag(H).mean() * torch.eye(cols, dtype=torch.float64)
    inv_rows = [torch.linalg.inv(H[j:, j:])[0] for j in range(cols)]  # row 0 of (H_F)^-1
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        d = torch.stack([inv_rows[j][0] for j in range(i1, i2)])
        score = W[:, i1:i2] ** 2 / d[None, :]
        k = int(math.floor(ratio * score.numel()))
        mask = torch.zeros_like(score, dtype=torch.bool)
        mask.view(-1)[torch.argsort(score.flatten(), stable=True)[:k]] = True
        for j in range(i1, i2):
            w = W[:, j].clone()
            q = w.clone()
            q[mask[:, j - i1]] = 0
            err = (w - q) / inv_rows[j][0]
            W[:, j:] -= err[:, None] * inv_rows[j][None, :]
            W[:, j] = q
    return W


def _layer_problem(rows=16, cols=48, n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / math.sqrt(cols)
    X = (torch.randn(n, cols, generator=g) @ mix + 0.3 * torch.randn(n, cols, generator=g)).T  # correlated
    W = torch.randn(rows, cols, generator=g)
    H = 2.0 * X @ X.T / n
    return W, H, X


def test_sparsegpt_matches_float64_obs_reference():
    W, H, _ = _layer_problem()
    ours = sparsegpt_matrix(W, H, 0.5, blocksize=16, percdamp=0.01)
    ref = _obs_reference(W, H, 0.5, 16, 0.01)
    assert torch.equal(ours == 0, ref == 0)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 0.7])
def test_sparsegpt_exact_sparsity_per_block_and_beats_magnitude(ratio):
    W, H, X = _layer_problem(rows=32, cols=80, n=500, seed=1)
    bs = 32
    P = sparsegpt_matrix(W, H, ratio, blocksize=bs)
    for i1 in range(0, 80, bs):
        blk = P[:, i1 : i1 + bs]
        assert int((blk == 0).sum()) == int(math.floor(ratio * blk.numel()))
    k = int(math.floor(ratio * W.numel()))
    mag = W.clone()
    mag.view(-1)[torch.argsort(W.abs().flatten())[:k]] = 0
    err_sgpt = ((W - P) @ X).pow(2).sum()
    err_mag = ((W - mag) @ X).pow(2).sum()
    assert err_sgpt < err_mag


@pytest.mark.parametrize("cols,block", [(48, 16), (50, 16), (40, 256)])
def test_gram_is_the_float64_product_over_valid_rows(cols, block):
    """Only the blocks on and above the diagonal are multiplied: the result is still the whole
    symmetric ``X^T X / n`` over the rows the masks keep (padding left out), as float64 has it."""
    g = torch.Generator().manual_seed(cols)
    xs = [torch.randn(3, 7, cols, generator=g).to(torch.bfloat16), torch.randn(2, 5, cols, generator=g)]
    valid = [torch.rand(3, 7, generator=g) > 0.3, torch.ones(2, 5, dtype=torch.bool)]
    X = torch.cat([x[v].double() for x, v in zip(xs, valid)])
    G = gram(xs, valid, block=block)
    assert G.dtype == torch.float32 and torch.equal(G, G.T)
    torch.testing.assert_close(G.double(), X.T @ X / X.shape[0], rtol=1e-5, atol=1e-5)


def test_sparsegpt_model_prunes_only_ffn_and_restores(tiny, calib):
    m = tiny.model
    before = _state(m)
    ids = torch.tensor([calib[0]])
    base = m(ids).logits
    snap = sparsegpt_prune(m, calib, 0.5, blocksize=64, batch_size=5, pad_id=tiny.tokenizer.pad_token_id, progress=False)
    after = m.state_dict()
    for k in before:
        if any(p in k for p in ("gate_proj", "up_proj", "down_proj")):
            w = after[k]
            assert abs((w == 0).float().mean().item() - 0.5) < 0.01, k
        else:
            assert torch.equal(before[k], after[k]), k
    assert not torch.equal(m(ids).logits, base)
    snap.restore()
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_sparsegpt_layerwise_uses_pruned_inputs(tiny64, calib):
    """Layer 1 is pruned with the Hessian of inputs produced by the already-pruned
    layer 0: recompute that Hessian independently and compare W_gate of layer 1."""
    m = tiny64.model
    layers = decoder_layers(m)
    # reference: prune layer 0 with our routine, then collect layer-1 FFN inputs
    ref_model = __import__("copy").deepcopy(m)
    sparsegpt_prune(m, calib, 0.4, blocksize=32, batch_size=len(calib), progress=False)
    xs = []
    mlp1 = ffn_modules(ref_model)[1]
    # prune layer 0 of the reference exactly as the routine did (same weights)
    with torch.no_grad():
        for k in ("gate_proj", "up_proj", "down_proj"):
            getattr(ffn_modules(ref_model)[0], k).weight.copy_(getattr(ffn_modules(m)[0], k).weight)
    h = mlp1.register_forward_pre_hook(lambda mod, args: xs.append(args[0]))
    with torch.no_grad():
        for s in calib:
            ref_model(torch.tensor([s]))
    h.remove()
    X = torch.cat([x[0] for x in xs]).double()
    H = 2.0 * X.T @ X / X.shape[0]
    expect = sparsegpt_matrix(mlp1.gate_proj.weight, H, 0.4, blocksize=32)
    torch.testing.assert_close(ffn_modules(m)[1].gate_proj.weight, expect, rtol=1e-6, atol=1e-8)
    assert len(layers) == 2


# ------------------------------------------------------------------------------- Fisher
def test_fisher_scores_match_hand_computation(tiny64, calib):
    """F_lc = mean_s (sum_t h_tlc dL_s/dh_tlc)^2 with h and dL/dh read off the graph
    sequence by sequence (no padding, no gain trick)."""
    m = tiny64.model
    ours = fisher_scores(m, calib, batch_size=5, pad_id=0, progress=False)
    mlps = ffn_modules(m)
    emb = m.get_input_embeddings().weight
    emb.requires_grad_(True)
    acc = torch.zeros(ours.shape, dtype=torch.float64)
    try:
        for s in calib:
            hs = []
            handles = [
                mlp.down_proj.register_forward_pre_hook(lambda mod, a: (a[0].retain_grad(), hs.append(a[0]))[0])
                for mlp in mlps
            ]
            ids = torch.tensor([s])
            with torch.enable_grad():
                logits = m(ids).logits[0, :-1]
                loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
                loss.backward()
            for h in handles:
                h.remove()
            for li, h in enumerate(hs):
                acc[li] += (h * h.grad).sum(dim=(0, 1)).pow(2)
    finally:
        emb.requires_grad_(False)
    torch.testing.assert_close(ours.double(), (acc / len(calib)), rtol=1e-4, atol=1e-12)


def test_fisher_mask_global_and_layer():
    scores = torch.tensor([[5.0, 1.0, 3.0, 7.0], [0.5, 0.6, 9.0, 8.0]])
    g = fisher_prune_mask(scores, 0.25, "global")  # removes 2 lowest overall: 0.5, 0.6
    assert torch.equal(g, torch.tensor([[1.0, 1, 1, 1], [0, 0, 1, 1]]))
    lay = fisher_prune_mask(scores, 0.25, "layer")  # removes 1 per layer
    assert torch.equal(lay, torch.tensor([[1.0, 0, 1, 1], [0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="scope"):
        fisher_prune_mask(scores, 0.1, "row")


def test_channel_pruning_equals_channel_mask(tiny):
    m = tiny.model
    fc = FFNChannels(m)
    g = torch.Generator().manual_seed(0)
    keep = (torch.rand(fc.shape, generator=g) > 0.2).float()
    ids = torch.randint(3, 250, (2, 15), generator=g)
    with perturbed(m, mask=keep):
        masked = m(ids).logits
    before = _state(m)
    snap = prune_channels(m, keep)
    for i, mlp in enumerate(ffn_modules(m)):
        drop = keep[i] == 0
        assert torch.all(mlp.gate_proj.weight[drop] == 0) and torch.all(mlp.up_proj.weight[drop] == 0)
        assert torch.all(mlp.down_proj.weight[:, drop] == 0)
        assert torch.equal(mlp.gate_proj.weight[~drop], before[f"model.layers.{i}.mlp.gate_proj.weight"][~drop])
    torch.testing.assert_close(m(ids).logits, masked, rtol=1e-5, atol=1e-6)
    snap.restore()
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


# ------------------------------------------------------------------------------- registry
@pytest.mark.parametrize(
    "family,strength", [("gaussian", 0.1), ("dropout", 0.05), ("fisher", 0.2), ("sparsegpt", 0.3), ("rtn", 4), ("none", 0)]
)
def test_every_family_changes_output_and_restores_bit_exactly(tiny, calib, family, strength):
    m = tiny.model
    ids = torch.tensor([calib[0]])
    base = m(ids).logits
    before = _state(m)
    with perturbation(m, family, strength, seed=1, calib=calib, batch_size=4) as ap:
        out = m(ids).logits
        assert ap.family == family
    if family == "none":
        assert torch.equal(out, base)
    else:
        assert not torch.equal(out, base)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert torch.equal(m(ids).logits, base)
    assert all(len(mlp.down_proj._forward_pre_hooks) == 0 for mlp in ffn_modules(m))


def test_registry_errors(tiny, calib):
    m = tiny.model
    assert set(PERTURBATIONS) == {"gaussian", "dropout", "fisher", "sparsegpt", "rtn", "plane"}
    with pytest.raises(ValueError, match="unknown perturbation"):
        apply_perturbation(m, "int4", 4)
    with pytest.raises(ValueError, match="calib"):
        apply_perturbation(m, "sparsegpt", 0.5)
    with pytest.raises(ValueError, match="bit width"):
        apply_perturbation(m, "rtn", 4.5)
    add_lora(tiny)
    with pytest.raises(TypeError, match="merge LoRA"):
        apply_perturbation(tiny.model, "rtn", 4)
    with pytest.raises(TypeError, match="merge LoRA"):
        apply_perturbation(tiny.model, "sparsegpt", 0.5, calib=calib)


def test_landscape_plane_is_the_fixed_two_direction_combination(tiny):
    """Fig. 4: point (w1, w2) multiplies h by 1 + w1 xi_1 + w2 xi_2 with directions fixed by
    direction_seed only: (0, 0) is the clean model, the eval seed changes nothing, and the
    down-projection input is scaled by exactly that factor (a float64 re-computation)."""
    from sprpo_lib.core.compress import plane_directions
    from sprpo_lib.core.perturb import FFNChannels

    m = tiny.model
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        base = m(ids).logits
        with perturbation(m, "plane", 0.0, seed=5, w2=0.0):
            assert torch.equal(m(ids).logits, base)
        with perturbation(m, "plane", 0.3, seed=0, w2=-0.2, direction_seed=1):
            a = m(ids).logits
        with perturbation(m, "plane", 0.3, seed=9, w2=-0.2, direction_seed=1):
            assert torch.equal(m(ids).logits, a)
        assert not torch.equal(a, base)
        with perturbation(m, "plane", 0.3, seed=0, w2=-0.2, direction_seed=2):
            assert not torch.equal(m(ids).logits, a)
    d1, d2 = plane_directions(FFNChannels(m).shape, 1)
    assert d1.shape == d2.shape and not torch.equal(d1, d2)
    assert abs(float(d1.double().std()) - 1) < 0.1  # unit-variance directions
    seen = []
    down = ffn_modules(m)[0].down_proj

    def record(mod, args):
        seen.append(args[0].detach().double())

    with torch.no_grad():
        hook = down.register_forward_pre_hook(record)
        m(ids)
        hook.remove()
        with perturbation(m, "plane", 0.3, seed=0, w2=-0.2, direction_seed=1):
            hook = down.register_forward_pre_hook(record)  # after the perturbation's hook: sees its output
            m(ids)
            hook.remove()
    factor = 1 + 0.3 * d1[0].double() - 0.2 * d2[0].double()
    torch.testing.assert_close(seen[1], seen[0] * factor, rtol=1e-5, atol=1e-6)
