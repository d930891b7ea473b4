"""``sprpo-bench attention``: every SDPA backend it times computes the attention of a float64
softmax written out here (masks, causal GQA, a strided query), the calls of a tiny model's
forward are recorded once per layer, and the totals and floor follow from the per-shape rows."""
from __future__ import annotations

import pytest
import torch

from sprpo_lib.bench.attention import BACKENDS, BACKWARD_FLOPS, attend, attention_flops, record_calls, time_signatures
from sprpo_lib.bench.report import SUMMARIES, headline


def _reference(q, k, v, keep, scale):
    """softmax(q k^T * scale, masked) v in float64, keys shared across the query heads of a group."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("case", ["mask", "causal_gqa"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backend_is_the_float64_softmax_attention(backend, case):
    g = torch.Generator().manual_seed(0)
    b, h, hk, tq, tk, d = 2, 4, (4 if case == "mask" else 2), 5, 9, 8
    if case == "causal_gqa":
        tk = tq
    q0 = torch.randn(b, tq, h, d, generator=g).transpose(1, 2)  # strided, as the projections' view
    k0, v0 = torch.randn(b, hk, tk, d, generator=g), torch.randn(b, hk, tk, d, generator=g)
    keep = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)[None, None].repeat(b, 1, 1, 1)
    mask = None
    if case == "mask":
        keep[1, :, :, :3] = False  # row 1 left-padded by 3 keys
        mask = keep
    dout = torch.randn(b, h, tq, d, generator=g)
    got = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    out = attend(backend, *got, mask, case == "causal_gqa", case == "causal_gqa", 0.3)
    out.backward(dout)
    ref = [t.double().clone().requires_grad_() for t in (q0, k0, v0)]
    want = _reference(*ref, keep, 0.3)
    want.backward(dout.double())
    assert out.shape == want.shape
    for x, y in [(out, want)] + [(a.grad, r.grad) for a, r in zip(got, ref)]:
        assert float((x.detach().double() - y.detach()).norm() / y.detach().norm()) < 1e-5


def test_recorded_calls_and_timed_totals_of_a_tiny_model(one_thread):
    from sprpo_lib.model.load import load_policy

    pol = load_policy("tiny-qwen2", seed=0, dtype="float32")
    cfg = pol.model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    for p in pol.model.parameters():
        p.requires_grad_(False)
    emb = pol.model.get_input_embeddings()(ids).requires_grad_()  # a gradient through every layer
    with record_calls() as (counts, masks):
        pol.model(inputs_embeds=emb).logits.sum().backward()
    assert sum(counts.values()) == cfg.num_hidden_layers  # one call per layer, all of one signature here
    (sig, n), = counts.items()
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = cfg.hidden_size // heads
    assert sig[0] == (2, heads, 11, dim) and sig[1][2:] == (11, dim) and sig[1][1] in (heads, kv) and sig[5]
    assert torch.nn.functional.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"  # restored

    res = time_signatures(counts, masks, gflops=10.0, repeats=1, progress=False)
    floor = n * attention_flops(sig[0], sig[1]) * (1 + BACKWARD_FLOPS) / 1e10
    assert res["floor_s"] == pytest.approx(floor, rel=1e-3)
    (row,) = res["by_shape"]
    for b in BACKENDS:
        tot = res["backends"][b]
        assert tot["total_s"] == pytest.approx(n * sum(row[f"{b}_ms"]) / 1e3, rel=0.01)
        assert tot["over_floor"] == pytest.approx(tot["total_s"] / res["floor_s"], rel=0.02)
    best = min(res["backends"][b]["total_s"] for b in BACKENDS)
    assert res["fastest_per_shape_s"] <= best * 1.001 and row["fastest"] in BACKENDS
    assert max(res["max_rel_diff"].values()) < 1e-4  # float32: the backends agree

    rec = {"env": "webshop", "profile": "smoke", "dtype": "float32", "rows": 2, "replay_s": 1.0, "calls": n,
           "shapes": 1, "matmul_gflops": 10.0, "flash_share_of_replay": res["backends"]["flash"]["total_s"], **res}
    table = "\n".join(SUMMARIES["attention"](rec))
    assert f"| flash | {res['backends']['flash']['forward_s']} |" in table and "fastest backend per shape" in table
    assert f"backward {res['backends']['flash']['backward_over_forward']}x its forward" in headline(
        {"bench": "attention", "results": rec})


def test_attention_flops_by_hand():
    assert attention_flops((2, 3, 5, 8), (2, 3, 7, 8)) == 4 * 2 * 3 * 5 * 7 * 8
    with pytest.raises(ValueError, match="expected one of flash, math, eager"):
        attend("xformers", *(torch.zeros(1, 1, 2, 4),) * 3, None, True, False, None)
