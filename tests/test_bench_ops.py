"""``sprpo-bench ops``: each op lands in its class with the work written out here (matmul FLOPs
2MKN, attention's rectangle and backward factor, bytes of a memory op, nothing for a view), and
on the smoke batch the classes' seconds add up to the spied update and the bound to its parts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sprpo_lib.bench.ops import BACKWARD_FLOPS, CLASSES, MATMUL_SIZES, ROLES, OpClock, bench_ops
from sprpo_lib.bench.report import SUMMARIES, headline


def _by_op(clock: OpClock) -> dict:
    return {name: (cls, calls, work) for (cls, name), (calls, _, work) in clock.stats.items()}


def test_matmuls_views_and_memory_ops_carry_their_own_work():
    a, b, bias = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    x, y = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with OpClock() as clock:
        a @ b
        torch.addmm(bias, a, b)
        torch.bmm(x, y)
        a.t()
        a.view(12)
        c = a * 2.0
        c.add_(1.0)
    ops = _by_op(clock)
    assert ops["mm"] == ("matmul", 1, 2 * 3 * 4 * 5)
    assert ops["addmm"] == ("matmul", 1, 2 * 3 * 4 * 5)
    assert ops["bmm"] == ("matmul", 1, 2 * 2 * 3 * 4 * 5)
    assert ops["t"][0] == ops["view"][0] == "views" and ops["t"][2] == 0
    assert ops["mul"] == ("memory", 1, 2 * 12 * 4)  # read a, write c
    assert ops["add_"] == ("memory", 1, 2 * 12 * 4)  # in place: read and write c


def test_matmuls_are_binned_by_their_smallest_dimension():
    """A rank-16 factor (K = 16), a weight gradient of 16 rows (M = 16), a 100-row linear and a
    300-row one land in the bins of min(M, K, N); the bins hold every matmul's calls and FLOPs."""
    x, w = torch.randn(300, 576), torch.randn(576, 1536)
    lora_a, short = torch.randn(576, 16), torch.randn(100, 576)
    with OpClock() as clock:
        x @ lora_a  # (300 x 576) @ (576 x 16): N = 16
        lora_a.t() @ x.t()[:, :300]  # (16 x 576) @ (576 x 300): M = 16
        short @ w  # 100 rows
        x @ w  # 300 rows
    low, mid, big = (label for _, label in MATMUL_SIZES)
    assert {k: v[0] for k, v in clock.sizes.items()} == {low: 2, mid: 1, big: 1}
    assert clock.sizes[mid][2] == 2 * 100 * 576 * 1536 and clock.sizes[big][2] == 2 * 300 * 576 * 1536
    mm = sum(v[2] for (cls, _), v in clock.stats.items() if cls == "matmul")
    assert sum(v[2] for v in clock.sizes.values()) == mm


def test_matmuls_are_sorted_by_role():
    """With rank 16 and a vocabulary of 1,000: a batched matmul is attention, a product with a
    1,000-wide side the LM head, one with a 16-wide side an adapter factor (either side, the
    weight gradient's rows too), and the rest the model's linears, split at 256 rows."""
    x, w, head = torch.randn(300, 576), torch.randn(576, 1536), torch.randn(576, 1000)
    lora_a, short = torch.randn(576, 16), torch.randn(100, 576)
    q, k = torch.randn(2, 5, 64), torch.randn(2, 64, 7)
    with OpClock(frozenset({16}), 1000) as clock:
        torch.bmm(q, k)
        x @ head
        x @ lora_a
        lora_a.t() @ x.t()  # (16 x 576) @ (576 x 300): the factor's gradient
        short @ w
        x @ w
    attention, factor, lm_head, few, many = ROLES
    assert {k: v[0] for k, v in clock.roles.items()} == {attention: 1, lm_head: 1, factor: 2, few: 1, many: 1}
    assert clock.roles[few][2] == 2 * 100 * 576 * 1536 and clock.roles[attention][2] == 2 * 2 * 5 * 64 * 7
    assert sum(v[2] for v in clock.roles.values()) == sum(v[2] for v in clock.sizes.values())
    with OpClock() as plain:  # no ranks or vocabulary given: no roles
        x @ w
    assert not plain.roles and sum(v[0] for v in plain.sizes.values()) == 1


def test_attention_counts_the_rectangle_forward_and_backward_factor():
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 7, 8, requires_grad=True), torch.randn(1, 2, 7, 8, requires_grad=True)
    mask = torch.ones(5, 7, dtype=torch.bool).tril(2)
    with OpClock() as clock:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    att = {name: work for (cls, name), (_, _, work) in clock.stats.items() if cls == "attention"}
    if not att:
        pytest.skip("SDPA chose a non-fused backend here")
    fwd = 4.0 * 1 * 2 * 5 * 7 * 8
    assert sorted(att.values()) == [fwd, fwd * BACKWARD_FLOPS]


def test_bench_ops_on_the_smoke_batch_adds_up():
    res = bench_ops("smoke", "webshop")
    c = res["classes"]
    assert set(c) == set(CLASSES)
    ops_s = sum(r["seconds"] for r in c.values())
    assert ops_s == pytest.approx(res["ops_s"], abs=0.02) and ops_s <= res["spied_update_s"] + 0.01
    assert c["matmul"]["work"] > 0 and c["memory"]["work"] > 0 and c["views"]["work"] == 0
    bound = c["matmul"]["at_roofline_s"] + c["memory"]["at_roofline_s"] + c["attention"]["seconds"]
    assert res["eager_bound_s"] == pytest.approx(bound, abs=0.02)
    assert res["update_over_floor"] == pytest.approx(res["update_s"] / res["floor_s"], rel=0.02)
    sizes = res["matmul_sizes"]
    assert sum(r["calls"] for r in sizes) == c["matmul"]["calls"]
    assert sum(r["gflop"] for r in sizes) == pytest.approx(c["matmul"]["work"], abs=0.01 * len(sizes) + 1e-6)
    roles = res["matmul_roles"]
    assert sum(r["calls"] for r in roles) == c["matmul"]["calls"]
    assert sum(r["gflop"] for r in roles) == pytest.approx(c["matmul"]["work"], abs=0.01 * len(roles) + 1e-6)
    assert any(r["role"] == ROLES[1] for r in roles) and any(r["role"] == ROLES[2] for r in roles)
    table = "\n".join(SUMMARIES["ops"](res))
    assert "| matmul |" in table and "Eager bound" in table and "smallest dimension" in table
    assert "Matmuls by role" in table and f"| {ROLES[1]} |" in table
    line = headline({"bench": "ops", "results": res})
    assert "eager bound" in line
    assert ("of the matmul time" in line) == sizes[0]["size"].startswith("<=")


def test_bench_ops_files_sprpos_replay_apart_from_its_update():
    """SPrPO's update and its S_hat replay (Alg. 1 line 7) are timed apart, each op under the phase
    the actor ran it in.  On the smoke model (adapters on every layer, one optimizer step) the two
    phases run the same passes over the same rows, so their matmuls match call for call and FLOP
    for FLOP; an op filed under the wrong phase would show as a difference."""
    with pytest.raises(ValueError, match="bench ops --method: expected one of vanilla, sprpo"):
        bench_ops("smoke", "webshop", method="sam")
    res = bench_ops("smoke", "webshop", method="sprpo")
    assert res["method"] == "sprpo" and res["ppo_steps"] == 1
    up, ex = res, res["extra"]
    for phase, name in ((up, "update"), (ex, "extra")):
        c = phase["classes"]
        assert sum(r["seconds"] for r in c.values()) == pytest.approx(phase["ops_s"], abs=0.02)
        assert phase["ops_s"] <= phase[f"spied_{name}_s"] + 0.01 and phase["floor_s"] > 0
        assert phase[f"{name}_over_floor"] == pytest.approx(phase[f"{name}_s"] / phase["floor_s"], rel=0.02)
    assert ex["classes"]["matmul"]["calls"] == up["classes"]["matmul"]["calls"] > 0
    assert ex["classes"]["matmul"]["work"] == pytest.approx(up["classes"]["matmul"]["work"], rel=1e-6)
    assert ex["floor_s"] == pytest.approx(up["floor_s"], rel=1e-6)
    table = "\n".join(SUMMARIES["ops"](res))
    assert "SPrPO's update" in table and "SPrPO's S_hat replay (Alg. 1 line 7)" in table
    assert table.count("Eager bound") == 2 and "share of the replay" in table
    line = headline({"bench": "ops", "results": res})
    assert line.startswith("webshop SPrPO update") and f"its S_hat replay {ex['extra_over_floor']}x its floor" in line
