"""GiGPO / GRPO advantages and the dual-clip PPO loss against hand computations.

Expected numbers are derived by hand in the comments (plain Python arithmetic only; the
unbiased std is ``statistics.stdev``), never by calling the code under test.
"""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from sprpo_lib.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageOutput,
    StepSample,
    build_step_groups,
    combine_advantages,
    compute_advantages,
    episode_relative_advantages,
    register_advantage,
    step_relative_advantages,
    to_token_advantages,
)
from sprpo_lib.core.losses import (
    POLICY_LOSSES,
    PPOLossConfig,
    agg_loss,
    get_policy_loss,
    register_policy_loss,
    token_entropy,
    token_logprobs,
    token_logprobs_entropy,
)

EPS = 1e-6


# ============================================================================ GiGPO batch
def _batch() -> list[StepSample]:
    """Three task groups, gamma = 0.5 in the tests below.

    Group A (3 rollouts):
      e1 R=1: s0 r=0 | s1 r=0    | s2 r=1       G = [0.25, 0.5, 1.0]
      e2 R=0: s0 r=0 | s3 r=-0.1 | s1 r=0       G = [-0.05, -0.1, 0.0]   (s1 at t=2!)
      e3 R=1: s0 r=0 | s1 r=1                   G = [0.5, 1.0]
    Group B (2 rollouts, equal returns 0.7; its anchor "s0" is not A's "s0"):
      e4 R=0.7: s0 r=0 | x1 r=0.7               G = [0.35, 0.7]
      e5 R=0.7: s0 r=0.7                        G = [0.7]
    Group C (1 rollout): e6 R=0.5: s0 r=0.5     G = [0.5]
    """
    rows = [
        ("e1", "A", 0, "s0", 0.0, 1.0), ("e1", "A", 1, "s1", 0.0, 1.0), ("e1", "A", 2, "s2", 1.0, 1.0),
        ("e2", "A", 0, "s0", 0.0, 0.0), ("e2", "A", 1, "s3", -0.1, 0.0), ("e2", "A", 2, "s1", 0.0, 0.0),
        ("e3", "A", 0, "s0", 0.0, 1.0), ("e3", "A", 1, "s1", 1.0, 1.0),
        ("e4", "B", 0, "s0", 0.0, 0.7), ("e4", "B", 1, "x1", 0.7, 0.7),
        ("e5", "B", 0, "s0", 0.7, 0.7),
        ("e6", "C", 0, "s0", 0.5, 0.5),
    ]
    return [StepSample(*r) for r in rows]


# hand-derived discounted returns, row order of _batch()
RETURNS = [0.25, 0.5, 1.0, -0.05, -0.1, 0.0, 0.5, 1.0, 0.35, 0.7, 0.7, 0.5]

# Episode level, mean mode.  A: mean(1, 0, 1) = 2/3; B equal -> 0; C singleton -> 0.
EP_MEAN = [1 / 3] * 3 + [-2 / 3] * 3 + [1 / 3] * 2 + [0.0] * 4
# Step level, mean mode.  A/s0 = {.25, -.05, .5}, mean 7/30 -> {1/60, -17/60, 16/60};
# A/s1 = {.5 (e1 t1), 0 (e2 t2), 1 (e3 t1)}, mean .5 -> {0, -.5, .5}; A/s2, A/s3, B/x1,
# C/s0 singletons -> 0; B/s0 = {.35, .7}, mean .525 -> {-.175, .175}.
ST_MEAN = [1 / 60, 0.0, 0.0, -17 / 60, 0.0, -0.5, 16 / 60, 0.5, -0.175, 0.0, 0.175, 0.0]

# mean_std: divide the deviations by (unbiased std + eps).
SD_A_EP = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # = sqrt(1/3)
SD_S0 = math.sqrt((1 + 17**2 + 16**2) / 3600 / 2)  # = sqrt(273)/60
SD_S1 = math.sqrt((0 + 0.25 + 0.25) / 2)  # = 0.5
SD_BS0 = math.sqrt(2 * 0.175**2)  # = 0.175 * sqrt(2)
EP_STD = [x / (SD_A_EP + EPS) for x in EP_MEAN[:8]] + [0.0] * 4
ST_STD = [
    (1 / 60) / (SD_S0 + EPS), 0.0, 0.0,
    (-17 / 60) / (SD_S0 + EPS), 0.0, -0.5 / (SD_S1 + EPS),
    (16 / 60) / (SD_S0 + EPS), 0.5 / (SD_S1 + EPS),
    -0.175 / (SD_BS0 + EPS), 0.0, 0.175 / (SD_BS0 + EPS), 0.0,
]


def _close(t: torch.Tensor, expected, atol=1e-6):
    assert t.dtype == torch.float32 and t.shape == (len(expected),)
    assert torch.isfinite(t).all()
    torch.testing.assert_close(t, torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def test_hand_stds_agree_with_statistics_stdev():
    """The closed forms above are the unbiased (n-1) std."""
    assert SD_A_EP == pytest.approx(statistics.stdev([1.0, 0.0, 1.0]))
    assert SD_S0 == pytest.approx(statistics.stdev([0.25, -0.05, 0.5])) == pytest.approx(math.sqrt(273) / 60)
    assert SD_S1 == pytest.approx(statistics.stdev([0.5, 0.0, 1.0]))
    assert SD_BS0 == pytest.approx(statistics.stdev([0.35, 0.7]))


def test_gigpo_mean_mode():
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean")
    assert isinstance(out, AdvantageOutput)
    _close(out.step_returns, RETURNS)
    _close(out.episode_advantages, EP_MEAN)
    _close(out.step_advantages, ST_MEAN)
    # A = A_E + A_S: clean numbers by hand
    _close(out.advantages, [0.35, 1 / 3, 1 / 3, -0.95, -2 / 3, -7 / 6, 0.6, 5 / 6, -0.175, 0.0, 0.175, 0.0])


def test_gigpo_mean_std_mode():
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean_std")
    _close(out.episode_advantages, EP_STD)
    _close(out.step_advantages, ST_STD)
    _close(out.advantages, [e + s for e, s in zip(EP_STD, ST_STD)])
    # spot values: A's episode advantages are +-1/sqrt(3), -2/sqrt(3); B/s0 is +-1/sqrt(2)
    assert float(out.episode_advantages[0]) == pytest.approx(1 / math.sqrt(3), abs=1e-5)
    assert float(out.episode_advantages[3]) == pytest.approx(-2 / math.sqrt(3), abs=1e-5)
    assert float(out.step_advantages[10]) == pytest.approx(1 / math.sqrt(2), abs=1e-5)


def test_the_four_named_steps_against_the_hand_derivation():
    """GiGPO's four steps one at a time (Eq. 3, Eq. 6, Eqs. 5/7, Eq. 8), each against the
    values derived by hand above, in mean mode with gamma = 0.5 and omega = 0.3."""
    steps = _batch()
    cfg = AdvantageConfig(gamma=0.5, norm="mean", omega=0.3)
    rows = {}
    for i, s in enumerate(steps):
        rows.setdefault(s.episode, []).append(i)
    ep, _ = episode_relative_advantages(steps, rows, cfg)  # Eq. 3
    assert ep == pytest.approx(EP_MEAN, abs=1e-12)
    gid, members = build_step_groups(steps)  # Eq. 6
    assert members[gid[0]] == [0, 3, 6] and members[gid[1]] == [1, 5, 7] and len(members) == 7
    st, returns = step_relative_advantages(steps, rows, members, cfg)  # Eqs. 5, 7
    assert returns == pytest.approx(RETURNS, abs=1e-12) and st == pytest.approx(ST_MEAN, abs=1e-12)
    total = combine_advantages(ep, st, cfg.omega)  # Eq. 8
    assert total == pytest.approx([e + 0.3 * a for e, a in zip(EP_MEAN, ST_MEAN)], abs=1e-12)
    _close(compute_advantages(steps, "gigpo", gamma=0.5, norm="mean", omega=0.3).advantages, total)


def test_step_groups_are_anchor_and_task_scoped():
    out = compute_advantages(_batch(), "gigpo", gamma=0.5)
    g = out.step_groups.tolist()
    assert g[0] == g[3] == g[6]  # A/s0 across rollouts
    assert g[1] == g[5] == g[7]  # A/s1 at t=1, t=2, t=1
    assert g[8] == g[10] != g[0]  # B/s0 is not A/s0
    assert g[11] not in (g[0], g[8])  # C/s0 neither
    assert len(set(g)) == 7  # A/s0 A/s1 A/s2 A/s3 B/s0 B/x1 C/s0
    assert out.stats["step_groups"] == 7
    assert out.stats["step_singleton_fraction"] == pytest.approx(4 / 7)


@pytest.mark.parametrize("norm", ["mean", "mean_std"])
def test_equal_rewards_and_singletons_give_zero_not_nan(norm):
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm=norm)
    for t in (out.advantages, out.episode_advantages, out.step_advantages):
        assert torch.isfinite(t).all()
    # group B (equal 0.7 returns, a float that is not exact in binary) and C (one rollout)
    assert out.episode_advantages[8:].abs().max() == 0
    # singleton step groups A/s2, A/s3, B/x1, C/s0
    assert out.step_advantages[[2, 4, 9, 11]].abs().max() == 0
    # groups of equal rewards whose float mean is not exactly the value (3 x 0.7 sums
    # to 2.0999999999999996): still exactly 0, not rounding error / eps
    for n in (3, 6, 8):
        steps = [StepSample(f"e{i}", "g", 0, "o", 0.7, 0.7) for i in range(n)]
        z = compute_advantages(steps, "gigpo", norm=norm)
        assert z.advantages.abs().max() == 0


def test_singleton_episode_group_raw_reproduces_verl():
    """verl/verl-agent: one-sample group -> mean 0, std 1, so A_E = R (/(1+eps))."""
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean", singleton_episode="raw")
    assert float(out.episode_advantages[11]) == pytest.approx(0.5)
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean_std", singleton_episode="raw")
    assert float(out.episode_advantages[11]) == pytest.approx(0.5 / (1 + EPS))
    _close(out.episode_advantages[:11], EP_STD[:11])  # other groups unchanged


def test_episode_stats_over_steps_reproduces_verl_agent_weighting():
    """episode_stats="step": A's records carry R = 1,1,1, 0,0,0, 1,1 -> mean 5/8."""
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean", episode_stats="step")
    _close(out.episode_advantages, [3 / 8] * 3 + [-5 / 8] * 3 + [3 / 8] * 2 + [0.0] * 4)
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean_std", episode_stats="step")
    sd = statistics.stdev([1, 1, 1, 0, 0, 0, 1, 1])
    _close(out.episode_advantages, [(3 / 8) / (sd + EPS)] * 3 + [(-5 / 8) / (sd + EPS)] * 3
           + [(3 / 8) / (sd + EPS)] * 2 + [0.0] * 4)


def test_omega_weighting():
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean", omega=0.5)
    _close(out.advantages, [e + 0.5 * s for e, s in zip(EP_MEAN, ST_MEAN)])
    out = compute_advantages(_batch(), "gigpo", gamma=0.5, norm="mean", omega=0.0)
    _close(out.advantages, EP_MEAN)


def test_default_gamma_discounting():
    """Defaults are the paper's: gamma 0.95 (App. B table), omega 1, mean_std."""
    cfg = AdvantageConfig()
    assert (cfg.gamma, cfg.omega, cfg.norm, cfg.eps) == (0.95, 1.0, "mean_std", 1e-6)
    steps = [StepSample("e", "g", t, f"o{t}", r, 1.0) for t, r in enumerate([0.0, -0.1, 1.0])]
    out = compute_advantages(steps)
    # G_2 = 1; G_1 = -0.1 + 0.95; G_0 = 0 + 0.95 * 0.85
    _close(out.step_returns, [0.8075, 0.85, 1.0])


def test_order_of_rows_is_free():
    steps = _batch()
    perm = list(range(len(steps)))
    random.Random(0).shuffle(perm)
    out = compute_advantages([steps[i] for i in perm], "gigpo", gamma=0.5, norm="mean_std")
    _close(out.advantages, [EP_STD[i] + ST_STD[i] for i in perm])


def test_grpo_is_the_episode_part():
    for norm, ep in (("mean", EP_MEAN), ("mean_std", EP_STD)):
        out = compute_advantages(_batch(), "grpo", norm=norm, gamma=0.5, omega=3.0)
        _close(out.advantages, ep)
        _close(out.episode_advantages, ep)
        assert out.step_advantages.abs().max() == 0
        assert out.step_returns is None
        gi = compute_advantages(_batch(), "gigpo", norm=norm, gamma=0.5)
        assert torch.equal(out.advantages, gi.episode_advantages)


def test_advantage_registry_and_validation():
    assert {"gigpo", "grpo"} <= set(ADVANTAGE_ESTIMATORS)

    @register_advantage("_test_const")
    def const(steps, config):
        a = torch.full((len(steps),), 2.0)
        return AdvantageOutput(a, a, torch.zeros_like(a))

    try:
        assert compute_advantages(_batch(), "_test_const").advantages.tolist() == [2.0] * 12
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("_test_const")(lambda s, c: None)
    finally:
        del ADVANTAGE_ESTIMATORS["_test_const"]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages(_batch(), "nope")
    with pytest.raises(ValueError, match="norm"):
        AdvantageConfig(norm="std")
    bad_gap = [StepSample("e", "g", 0, "a", 0, 1), StepSample("e", "g", 2, "b", 1, 1)]
    with pytest.raises(ValueError, match="0..n-1"):
        compute_advantages(bad_gap)
    bad_dup = [StepSample("e", "g", 0, "a", 0, 1), StepSample("e", "g", 0, "b", 1, 1)]
    with pytest.raises(ValueError, match="0..n-1"):
        compute_advantages(bad_dup)
    bad_r = [StepSample("e", "g", 0, "a", 0, 1), StepSample("e", "g", 1, "b", 1, 0.5)]
    with pytest.raises(ValueError, match="episode_reward"):
        compute_advantages(bad_r)
    bad_g = [StepSample("e", "g", 0, "a", 0, 1), StepSample("e", "h", 1, "b", 1, 1)]
    with pytest.raises(ValueError, match="groups"):
        compute_advantages(bad_g)
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages([StepSample("e", "g", 0, "a", float("nan"), 1)])


def test_to_token_advantages():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = to_token_advantages(torch.tensor([0.5, -2.0]), mask)
    assert out.tolist() == [[0.5, 0.5, 0.0], [0.0, -2.0, -2.0]]


# ============================================================================ PPO loss
# Per-token ratios r and advantages A (eps = 0.2, c = 3).  Row 2 has two padded tokens,
# row 3 is all padding.  Hand per-token losses l and whether dl/dlogp != 0 ("free"):
#   row 0, A=+2 : r=1.1 -> -2.2 free | r=1.5 -> -2.4 (upper clip) | r=0.5 -> -1.0 free
#                 (A>0 is not clipped below) | r=4.0 -> -2.4 (upper clip, no dual clip for A>0)
#   row 1, A=-1 : r=0.9 -> 0.9 free | r=0.5 -> 0.8 (lower clip) | r=1.5 -> 1.5 free
#                 (A<0 is not clipped above...) | r=4.0 -> 3.0 (...but dual-clipped at c=3)
#   row 2, A=-.5: r=2.0 -> 1.0 free | r=5.0 -> 1.5 (dual clip: min(2.5, 0.5*3)) | pad | pad
RATIOS = [[1.1, 1.5, 0.5, 4.0], [0.9, 0.5, 1.5, 4.0], [2.0, 5.0, 7.0, 9.0], [3.0, 0.1, 1.0, 8.0]]
ADV = [2.0, -1.0, -0.5, 1e9]
MASK = [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
FREE = [[1, 0, 1, 0], [1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
ROW_SUMS = [-2.2 - 2.4 - 1.0 - 2.4, 0.9 + 0.8 + 1.5 + 3.0, 1.0 + 1.5]  # -8.0, 6.2, 2.5
N_TOK = 10
ENT = [[1.0, 2.0, 3.0, 4.0], [0.5] * 4, [4.0, 2.0, float("nan"), float("nan")], [float("nan")] * 4]


def _ppo_inputs(pad_garbage: bool = True):
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.7, -1.2, -2.2, -0.1],
                        [-1.5, -4.0, -0.3, -2.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    logp = old + torch.tensor(RATIOS, dtype=torch.float64).log()
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None].expand(4, 4).clone()
    mask = torch.tensor(MASK)
    if pad_garbage:  # whatever sits on padded tokens must not matter
        logp = torch.where(mask.bool(), logp, torch.tensor(float("-inf"), dtype=torch.float64))
        adv = torch.where(mask.bool(), adv, torch.tensor(float("nan"), dtype=torch.float64))
    return logp.requires_grad_(True), old, adv, mask


def test_ppo_defaults_are_the_papers():
    cfg = PPOLossConfig()
    assert (cfg.clip_ratio, cfg.clip_ratio_c, cfg.entropy_coeff, cfg.loss_agg_mode) == (0.2, 3.0, 1e-3, "token-mean")
    assert cfg.bounds == (0.8, 1.2)
    assert get_policy_loss("ppo_dual_clip") is POLICY_LOSSES["ppo_dual_clip"]
    with pytest.raises(ValueError):
        PPOLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError):
        PPOLossConfig(loss_agg_mode="token-sum")


def test_ppo_token_mean_value_and_stats():
    logp, old, adv, mask = _ppo_inputs()
    loss, st = POLICY_LOSSES["ppo_dual_clip"](logp, old, adv, mask)
    assert loss.item() == pytest.approx(sum(ROW_SUMS) / N_TOK)  # 0.7 / 10
    assert st["pg_loss"] == st["loss"] == pytest.approx(0.07)
    assert st["clipfrac"] == pytest.approx(3 / 10)  # row0 r=1.5, r=4.0; row1 r=0.5
    assert st["dual_clipfrac"] == pytest.approx(2 / 10)  # row1 r=4.0; row2 r=5.0
    valid = [r for row, m in zip(RATIOS, MASK) for r, k in zip(row, m) if k]
    assert len(valid) == st["n_tokens"] == N_TOK
    assert st["ratio_mean"] == pytest.approx(sum(valid) / 10)  # 2.1
    assert st["ratio_max"] == pytest.approx(5.0)
    assert st["approx_kl"] == pytest.approx(-sum(math.log(r) for r in valid) / 10)
    assert st["approx_kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in valid) / 10)
    assert "entropy" not in st


def test_ppo_gradient_zero_on_clipped_tokens_else_minus_A_ratio_over_N():
    logp, old, adv, mask = _ppo_inputs()
    loss, _ = POLICY_LOSSES["ppo_dual_clip"](logp, old, adv, mask)
    loss.backward()
    expected = [[-ADV[b] * RATIOS[b][t] / N_TOK if FREE[b][t] else 0.0 for t in range(4)] for b in range(4)]
    assert torch.isfinite(logp.grad).all()
    torch.testing.assert_close(logp.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=1e-9)
    # e.g. row 0 r=1.1: -2 * 1.1 / 10; row 1 r=1.5: +1.5 / 10; the clipped ones exactly 0
    assert float(logp.grad[0, 0]) == pytest.approx(-0.22)
    assert float(logp.grad[1, 2]) == pytest.approx(0.15)
    assert logp.grad[0, 1] == 0 and logp.grad[1, 1] == 0 and logp.grad[1, 3] == 0 and logp.grad[2, 1] == 0


def test_ppo_masking_ignores_padded_tokens():
    a, st_a = POLICY_LOSSES["ppo_dual_clip"](*_ppo_inputs(pad_garbage=True))
    b, st_b = POLICY_LOSSES["ppo_dual_clip"](*_ppo_inputs(pad_garbage=False))
    assert torch.isfinite(a) and a.item() == pytest.approx(b.item())
    assert st_a == pytest.approx(st_b)
    # an all-padding batch: zero loss, no NaN
    logp, old, adv, mask = _ppo_inputs()
    z, st = POLICY_LOSSES["ppo_dual_clip"](logp, old, adv, torch.zeros_like(mask))
    assert z.item() == 0.0 and st["n_tokens"] == 0 and math.isfinite(st["approx_kl"])


def test_ppo_aggregation_modes():
    logp, old, adv, mask = _ppo_inputs()
    f = POLICY_LOSSES["ppo_dual_clip"]
    tm, _ = f(logp, old, adv, mask, config=PPOLossConfig(loss_agg_mode="token-mean"))
    smtm, _ = f(logp, old, adv, mask, config=PPOLossConfig(loss_agg_mode="seq-mean-token-mean"))
    smts, _ = f(logp, old, adv, mask, config=PPOLossConfig(loss_agg_mode="seq-mean-token-sum"))
    assert tm.item() == pytest.approx(0.7 / 10)
    # the all-padding row 3 is not a sequence: 3 sequences of 4, 4, 2 tokens
    assert smtm.item() == pytest.approx((-8.0 / 4 + 6.2 / 4 + 2.5 / 2) / 3)
    assert smts.item() == pytest.approx((-8.0 + 6.2 + 2.5) / 3)
    # agg_loss alone on a plain matrix
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    assert float(agg_loss(x, m, "token-mean")) == pytest.approx(3.0)
    assert float(agg_loss(x, m, "seq-mean-token-mean")) == pytest.approx(3.5)
    assert float(agg_loss(x, m, "seq-mean-token-sum")) == pytest.approx(4.5)


def test_ppo_entropy_bonus():
    logp, old, adv, mask = _ppo_inputs()
    ent = torch.tensor(ENT, dtype=torch.float64, requires_grad=True)
    loss, st = POLICY_LOSSES["ppo_dual_clip"](logp, old, adv, mask, entropy=ent)
    # token-mean entropy over the 10 valid tokens: (10 + 2 + 6) / 10 = 1.8
    assert st["entropy"] == pytest.approx(1.8)
    assert loss.item() == pytest.approx(0.07 - 1e-3 * 1.8)
    assert st["pg_loss"] == pytest.approx(0.07)
    loss.backward()
    expected = [[-1e-3 / N_TOK if k else 0.0 for k in row] for row in MASK]
    torch.testing.assert_close(ent.grad, torch.tensor(expected, dtype=torch.float64))
    # the entropy is aggregated like the loss (verl): seq-mean-token-mean (2.5 + .5 + 3) / 3
    cfg = PPOLossConfig(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01)
    _, st = POLICY_LOSSES["ppo_dual_clip"](logp, old, adv, mask, entropy=ent, config=cfg)
    assert st["entropy"] == pytest.approx(2.0)
    assert st["loss"] == pytest.approx(st["pg_loss"] - 0.01 * 2.0)


def test_ppo_zero_advantage_and_on_policy_gradient():
    """A = 0: zero loss and grad, never counted as clipped.  On-policy (r = 1): the
    gradient is the plain policy gradient -A/N."""
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[0.0, 1.5, -0.5]], dtype=torch.float64)
    loss, st = POLICY_LOSSES["ppo_dual_clip"](logp, old, adv, torch.ones(1, 3))
    loss.backward()
    assert loss.item() == pytest.approx((0 - 1.5 + 0.5) / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 1 / 6]], dtype=torch.float64))
    assert st["clipfrac"] == 0 and st["dual_clipfrac"] == 0 and st["approx_kl"] == 0


def test_policy_loss_registry():
    @register_policy_loss("_test_zero")
    def zero(logp, old_logp, advantages, response_mask, entropy=None, config=None):
        return (logp * 0).sum(), {}

    try:
        assert get_policy_loss("_test_zero") is zero
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("_test_zero")(lambda *a, **k: None)
    finally:
        del POLICY_LOSSES["_test_zero"]
    with pytest.raises(ValueError, match="unknown policy loss"):
        get_policy_loss("nope")


# ============================================================================ from logits
LOGITS = [[[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]], [[-1.0, 3.0, 2.0], [10.0, -10.0, 0.0]]]
TARGETS = [[1, 2], [0, 0]]


def _ref_logprob(z, k):
    return z[k] - math.log(sum(math.exp(v) for v in z))


def _ref_entropy(z):
    s = sum(math.exp(v) for v in z)
    return -sum(math.exp(v) / s * math.log(math.exp(v) / s) for v in z)


def test_token_logprobs_and_entropy_against_plain_python():
    logits = torch.tensor(LOGITS)
    lp = token_logprobs(logits, torch.tensor(TARGETS))
    ref = [[_ref_logprob(LOGITS[b][t], TARGETS[b][t]) for t in range(2)] for b in range(2)]
    torch.testing.assert_close(lp, torch.tensor(ref), atol=1e-6, rtol=0)
    assert float(lp[0, 1]) == pytest.approx(-math.log(3))  # uniform over 3
    ent = token_entropy(logits)
    torch.testing.assert_close(ent, torch.tensor([[_ref_entropy(z) for z in row] for row in LOGITS]),
                               atol=1e-6, rtol=0)
    assert float(ent[0, 1]) == pytest.approx(math.log(3))


def test_logprobs_and_entropy_from_one_softmax_match_each_function():
    """token_logprobs_entropy: the plain-python values, float32 out of bfloat16, and in float64
    gradients against finite differences and against the two functions' own graphs, a -inf
    logit included (no NaN, its terms 0)."""
    lp, ent = token_logprobs_entropy(torch.tensor(LOGITS), torch.tensor(TARGETS))
    ref = [[_ref_logprob(LOGITS[b][t], TARGETS[b][t]) for t in range(2)] for b in range(2)]
    torch.testing.assert_close(lp, torch.tensor(ref), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, torch.tensor([[_ref_entropy(z) for z in row] for row in LOGITS]),
                               atol=1e-6, rtol=0)
    lp16, ent16 = token_logprobs_entropy(torch.tensor(LOGITS, dtype=torch.bfloat16), torch.tensor(TARGETS))
    assert lp16.dtype == ent16.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 7, dtype=torch.float64, generator=g)
    t = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs_entropy(x, t), (z.clone().requires_grad_(),))
    z[0, 1, :3] = float("-inf")  # masked vocabulary entries, never a target
    t[0, 1] = 5
    w = torch.randn(2, 3, dtype=torch.float64, generator=g)
    grads = []
    for fused in (True, False):
        x = z.clone().requires_grad_()
        lp, ent = token_logprobs_entropy(x, t) if fused else (token_logprobs(x, t), token_entropy(x))
        assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
        grads.append(torch.autograd.grad((w * lp).sum() - 0.3 * ent.sum(), x)[0])
    assert torch.isfinite(grads[0]).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_token_logprobs_float32_from_bf16_and_masked_vocab():
    logits = torch.tensor(LOGITS, dtype=torch.bfloat16)
    lp = token_logprobs(logits, torch.tensor(TARGETS))
    assert lp.dtype == torch.float32 and token_entropy(logits).dtype == torch.float32
    # computed from the bf16 values, in float32
    z = logits.float().tolist()
    ref = [[_ref_logprob(z[b][t], TARGETS[b][t]) for t in range(2)] for b in range(2)]
    torch.testing.assert_close(lp, torch.tensor(ref), atol=1e-6, rtol=0)
    # a -inf logit (masked vocabulary entry) contributes nothing, and no NaN
    z = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    h = token_entropy(z)
    assert h.item() == pytest.approx(math.log(2))
    h.sum().backward()
    assert torch.isfinite(z.grad).all()


def test_end_to_end_logits_to_loss_gradient():
    """token_logprobs -> to_token_advantages -> loss backprops finite grads to logits."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    with torch.no_grad():
        old = token_logprobs(logits, targets) + 0.1 * torch.randn(3, 5, generator=g)
    adv = to_token_advantages(torch.tensor([1.0, -0.5, 2.0]), mask)
    loss, st = POLICY_LOSSES["ppo_dual_clip"](token_logprobs(logits, targets), old, adv, mask,
                                              entropy=token_entropy(logits))
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    assert logits.grad[0, 3:].abs().max() == 0 and logits.grad[2, 1:].abs().max() == 0
    assert 0 <= st["clipfrac"] <= 1 and st["n_tokens"] == 9
