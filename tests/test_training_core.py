"""The training core against independent references: penalty placement by hand, the
exact prompt of a scripted episode, SAM-sized perturbations in bf16 against a float32
reference, surrogate-only statistics, PPO mini-batches/epochs, the replay at
theta_{k+1}, micro-batch accumulation, the KL loss and the prompt budget."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from conftest import make_actor

from sprpo_lib.agent.engines import Generation
from sprpo_lib.agent.envs.base import Observation
from sprpo_lib.agent.prompt import AgentConfig, HistoryStep, build_prompt, fit_prompt
from sprpo_lib.agent.rollout import SerialEnvs, run_groups
from sprpo_lib.core.actor import SURROGATE
from sprpo_lib.core.advantages import StepSample, compute_advantages
from sprpo_lib.core.batch import Batch, Sample, build_batch
from sprpo_lib.core.losses import PPOLossConfig, kl_penalty, ppo_dual_clip_loss, token_logprobs
from sprpo_lib.core.methods import grad_leaf
from sprpo_lib.model.load import load_policy
from sprpo_lib.model.lora import LoraSettings, add_lora
from sprpo_lib.train.trainer import Trainer, load_config


# ============================================================================ penalty placement
def _penalty_batch():
    """Group G, gamma 0.5.  e1: anchors a,b,c, env rewards 0,0,1, penalties 0,-0.1,0
    (R = 1); e2: anchors a,d, env rewards 0,0, penalties -0.1,0 (R = 0)."""
    return [StepSample("e1", "G", 0, "a", 0.0, 1.0, 0.0), StepSample("e1", "G", 1, "b", 0.0, 1.0, -0.1),
            StepSample("e1", "G", 2, "c", 1.0, 1.0, 0.0),
            StepSample("e2", "G", 0, "a", 0.0, 0.0, -0.1), StepSample("e2", "G", 1, "d", 0.0, 0.0, 0.0)]


def _close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_penalty_on_its_own_step_as_verl_agent():
    """"step": returns [.25, .5, 1] + own penalty -> [.25, .4, 1]; e2 [-.1, 0].  Row
    values (stats over rows): 1, .9, 1, -.1, 0, mean .56.  Step group a: .25, -.1, mean
    .075 -> +-.175; b, c, d singletons."""
    out = compute_advantages(_penalty_batch(), "gigpo", gamma=0.5, norm="mean", episode_stats="step",
                             penalty_placement="step")
    _close(out.step_returns, [0.25, 0.4, 1.0, -0.1, 0.0])
    _close(out.episode_advantages, [0.44, 0.34, 0.44, -0.66, -0.56])
    _close(out.advantages, [0.615, 0.34, 0.44, -0.835, -0.56])


def test_penalty_in_the_return_is_the_option():
    """"return": rewards 0, -.1, 1 -> G = .2, .4, 1; e2 -.1, 0.  Episode values .9 (x3),
    -.1 (x2): mean .5.  Step group a: .2, -.1 -> +-.15."""
    out = compute_advantages(_penalty_batch(), "gigpo", gamma=0.5, norm="mean", episode_stats="step",
                             penalty_placement="return")
    _close(out.step_returns, [0.2, 0.4, 1.0, -0.1, 0.0])
    _close(out.advantages, [0.55, 0.4, 0.4, -0.75, -0.6])


def test_penalty_with_per_episode_statistics():
    """GiGPO Eq. 3 statistics over episodes (R = 1, 0: +-.5), each row shifted by its own penalty."""
    out = compute_advantages(_penalty_batch(), "gigpo", gamma=0.5, norm="mean", episode_stats="episode")
    _close(out.episode_advantages, [0.5, 0.4, 0.5, -0.6, -0.5])


# ============================================================================ history
class _Episode:
    """page n after n accepted actions; the action "bad" is rejected (page unchanged)."""

    instruction, max_steps = "fake task", 10

    def __init__(self):
        self.n = 0

    def reset(self):
        return Observation(f"page {self.n}", ["a0"])

    def step(self, action):
        if action == "bad":
            return Observation(f"page {self.n}", ["a0"], info={"invalid": True})
        self.n += 1
        return Observation(f"page {self.n}", ["a0"], done=self.n >= 5)

    def close(self):
        pass


class _Pool:
    name, max_steps = "fake", 10

    def splits(self):
        return {"train": 1}

    def open(self, split, index):
        class H:
            task_id, instruction = "fake/0", "fake task"

            def spawn(self):
                return _Episode()

        return H()


def test_history_shows_previous_steps_not_the_current_page():
    script = iter(["a0", "bad", "a2", "a3", "a4", "a5"])

    def gen(prompts):
        return [Generation(f"<action>{next(script)}</action>", [], []) for _ in prompts]

    eps, _ = run_groups(SerialEnvs(_Pool), [("train", 0)], 1, gen, AgentConfig(history_len=2), progress=False)
    assert eps[0].steps[3].prompt == (
        "Task: fake task\n\n"
        "Interaction context:\n"
        "[Step 2] Observation: page 1 -> Action: bad (invalid: the environment did not accept it)\n"
        "[Step 3] Observation: page 1 -> Action: a2\n\n"
        "Current observation: page 2\n\n"
        "Available actions:\n- a0\n\n"
        "Response: Output the next action in <action>...</action>."
    )
    assert [s.observation for s in eps[0].steps[:4]] == ["page 0", "page 1", "page 1", "page 2"]


# ============================================================================ prompt budget
def test_prompt_budget_cuts_history_then_observation_never_task_or_actions():
    words = lambda text: len(text.split())  # noqa: E731  (a token counter for the test)
    hist = [HistoryStep(f"old page {i} " + "w " * 30, f"click[{i}]") for i in range(4)]
    obs = " ".join(f"o{i}" for i in range(200))
    actions = ["click[x]", "click[y]"]
    cfg = AgentConfig(history_len=2, max_prompt_tokens=10_000)
    full = fit_prompt("the task", obs, actions, hist, cfg, words)
    assert full == build_prompt("the task", obs, actions, hist, cfg)  # within budget: unchanged
    one = fit_prompt("the task", obs, actions, hist, dataclasses.replace(cfg, max_prompt_tokens=words(full) - 30),
                     words)
    assert "[Steps 1-3 omitted]" in one and "[Step 4]" in one and "[Step 3]" not in one and obs in one
    tight = dataclasses.replace(cfg, max_prompt_tokens=120)
    cut = fit_prompt("the task", obs, actions, hist, tight, words)
    assert words(cut) <= 120 and "[Steps 1-4 omitted]" in cut and "Observation:" not in cut.split("Current")[0]
    assert cut.startswith("Task: the task\n\n") and "Available actions:\n- click[x]\n- click[y]\n\n" in cut
    shown = cut.split("Current observation: ")[1].split("\n\n")[0]
    assert shown.endswith(" [...]") and obs.startswith(shown[:-6].rstrip())
    longest = shown[:-6].rstrip().split()[-1]
    assert words(cut) > 120 - 3, f"observation cut too early (last word {longest})"


# ============================================================================ SAM in bf16
def _token_batch(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch([Sample(torch.randint(3, 250, (30,), generator=g).tolist(), 8, 1.0) for _ in range(n)])


def _actor(model, **kw):
    params = [p for p in model.parameters() if p.requires_grad] or [torch.nn.Parameter(torch.zeros(1))]
    return make_actor(model, torch.optim.Adam(params, lr=1e-3), **kw)


def test_sam_sized_xi_survives_bf16_and_matches_float32():
    pol = load_policy("tiny-qwen2", seed=0, dtype="bfloat16")
    add_lora(pol, LoraSettings(rank=4, alpha=8), seed=0)
    ref = copy.deepcopy(pol.model).float()  # the same (bf16-rounded) weights, computed in float32
    a16, a32 = _actor(pol.model), _actor(ref)
    direction = torch.randn(a16.shape, generator=torch.Generator().manual_seed(1))
    xi = 5e-3 * direction / direction.norm()  # SAM's rho spread over all channels (Alg. 4 line 4)
    batch = _token_batch()
    lp32 = torch.cat(a32.log_probs(batch, xi))
    effect = (lp32 - torch.cat(a32.log_probs(batch, None))).norm()
    assert effect > 1e-5  # the perturbation does move the policy
    lp16 = torch.cat(a16.log_probs(batch, xi))
    assert (lp16 - lp32).norm() <= 0.05 * effect  # the bf16 model's perturbed policy is the reference's
    # without carrying the perturbation in float32, bf16 rounding swamps it (what the fix is for)
    import sprpo_lib.core.actor as A

    orig = A.below_resolution
    A.below_resolution = lambda xi, dtype: False
    try:
        raw = torch.cat(a16.log_probs(batch, xi))
    finally:
        A.below_resolution = orig
    assert (raw - lp32).norm() > 2 * effect
    for p in pol.model.parameters():  # frozen weights are back in bf16, bit for bit
        assert p.dtype == torch.bfloat16 or p.requires_grad


# ============================================================================ trainer-level
def _trainer(tmp_path, *overrides, name="t"):
    return Trainer(load_config("smoke", list(overrides)), tmp_path / name, progress=False)


def _batch(tr, k=0):
    eps, xi, _ = tr.collect(k)
    for i, e in enumerate(eps):
        e.steps[-1].env_reward += float(i % 3)  # a random tiny model earns no reward: give the batch signal
    batch, _ = build_batch(eps, tr.cfg.update.adv, "gigpo")
    return batch, xi


def _snapshot(tr):
    return [p.detach().clone() for p in tr.actor.params], copy.deepcopy(tr.actor.opt.state_dict())


def _restore(tr, snap):
    with torch.no_grad():
        for p, v in zip(tr.actor.params, snap[0]):
            p.copy_(v)
    tr.actor.opt.load_state_dict(copy.deepcopy(snap[1]))


def _direct_surrogate_grads(tr, batch, xi):
    """Gradient of the token-mean clipped surrogate, sample by sample without padding or
    micro-batches, by torch.autograd.grad: an independent re-computation."""
    a = tr.actor
    leaf = grad_leaf(xi, a)
    a.fc.set(xi=leaf)
    logps, olds, advs = [], [], []
    with torch.enable_grad(), a.fc:
        for s in batch.samples:
            ids = torch.tensor([s.ids])
            logits = a.model(input_ids=ids, use_cache=False).logits[0, -s.n_resp - 1:-1]
            logps.append(token_logprobs(logits, torch.tensor(s.ids[-s.n_resp:])))
            olds.append(s.old_logp)
            advs.append(torch.full((s.n_resp,), s.adv))
    a.fc.clear()
    lp, old, adv = torch.cat(logps)[None], torch.cat(olds)[None], torch.cat(advs)[None]
    loss, _ = ppo_dual_clip_loss(lp, old, adv, torch.ones_like(lp), None, PPOLossConfig(entropy_coeff=0.0))
    grads = torch.autograd.grad(loss, a.params + [leaf])
    return grads[-1], float(sum(g.double().pow(2).sum() for g in grads[:-1]))


def test_replay_runs_at_theta_k_plus_1_and_m_hat_is_the_gradient_norm(tmp_path):
    tr = _trainer(tmp_path, "method.name=sprpo", "update.loss.entropy_coeff=0.01")
    batch, xi = _batch(tr)
    tr.actor.fill_old_log_probs(batch, xi)
    S_k, _ = _direct_surrogate_grads(tr, batch, xi)  # at theta_k
    tr.method.update(tr.actor, batch, 0, xi)
    S_k1, m_k1 = _direct_surrogate_grads(tr, batch, xi)  # at theta_{k+1}
    torch.testing.assert_close(tr.method.S_hat, S_k1.double().pow(2), rtol=1e-4, atol=1e-12)
    assert tr.method.m_hat == pytest.approx(m_k1, rel=1e-4)
    assert not torch.allclose(tr.method.S_hat, S_k.double().pow(2), rtol=1e-3, atol=0)


def test_replay_frac_is_a_ratio_estimate_of_the_whole_batch(tmp_path):
    """``method.replay_frac``: on a batch whose non-zero-advantage rows are copies of one row
    (every subset then has the whole batch's per-token gradient), half of them give the full
    replay's S_hat and m_hat: the subset's token-mean is rescaled by T_A / T, the tokens of all
    non-zero rows over the batch's (rescaling by the subset's own share would halve dL/dxi)."""
    from sprpo_lib.core.methods import MethodConfig, make_method, replay_rows
    from sprpo_lib.infra.io import key_fields

    tr = _trainer(tmp_path, "method.name=sprpo")
    batch, xi = _batch(tr)
    row = next(s for s in batch.samples if s.adv != 0.0)
    zero = [dataclasses.replace(s, adv=0.0) for s in batch.samples if s is not row][:3]
    dup = Batch([dataclasses.replace(row) for _ in range(4)] + zero).without_old()
    sub, c = replay_rows(dup, 0.5, 0, 0)
    assert len(sub) == 2 and all(s.adv == row.adv for s in sub.samples)
    assert c == pytest.approx(4 * row.n_resp / dup.n_tokens)
    snap = _snapshot(tr)
    got = {}
    for frac in (1.0, 0.5):
        _restore(tr, snap)
        m = make_method(MethodConfig(name="sprpo", replay_frac=frac), tr.shape)
        st = m.update(tr.actor, dup.without_old(), 0, xi)
        got[frac] = (m.S_hat.clone(), m.m_hat, st["replay_rows"], st["replay_token_frac"])
    torch.testing.assert_close(got[0.5][0], got[1.0][0], rtol=1e-4, atol=1e-14)
    assert got[0.5][1] == pytest.approx(got[1.0][1], rel=1e-4)
    assert (got[1.0][2], got[0.5][2]) == (len(dup), 2)
    assert got[0.5][3] == pytest.approx(got[1.0][3], rel=1e-6)
    assert float(got[1.0][0].sum()) > 0
    # a subset of distinct rows is an estimate, not the full replay; at 1 the cache keys are unchanged
    _restore(tr, snap)
    m = make_method(MethodConfig(name="sprpo", replay_frac=0.3), tr.shape)
    m.update(tr.actor, batch.without_old(), 0, xi)
    assert m.S_hat.shape == got[1.0][0].shape and float(m.S_hat.sum()) > 0
    assert "replay_frac" not in key_fields(MethodConfig()) and key_fields(MethodConfig(replay_frac=0.5))["replay_frac"] == 0.5
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"replay_frac=.*expected a number in \(0, 1\]"):
            MethodConfig(name="sprpo", replay_frac=bad)


def _float32_log_probs(tr, batch, xi):
    """Each sample's response log-probs in float32, one sample at a time without padding: an
    independent re-computation of the old log-probs a float32 pass reads."""
    from sprpo_lib.core.perturb import float32_compute

    a = tr.actor
    a.fc.set(xi=xi.to(a.fc.dtype))
    out = []
    with torch.no_grad(), a.fc, float32_compute(tr.model):
        for s in batch.samples:
            logits = a.model(input_ids=torch.tensor([s.ids]), use_cache=False).logits[0, -s.n_resp - 1:-1]
            out.append(token_logprobs(logits.float(), torch.tensor(s.ids[-s.n_resp:])))
    a.fc.clear()
    return out


def test_replay_float32_measures_line_7_in_float32_on_a_bfloat16_model(tmp_path):
    """``method.replay_float32``: on a bf16 model line 7's S_hat and m_hat match a float32 sample-by-
    sample re-computation of L_k at theta_{k+1} (the same bf16 weights and xi, old log-probs of
    theta_k in float32), where the bf16 replay does not; the update itself is unchanged (it keeps
    its own old log-probs) and the frozen weights stay bf16."""
    from sprpo_lib.core.methods import MethodConfig, make_method
    from sprpo_lib.core.perturb import float32_compute
    from sprpo_lib.infra.io import key_fields

    tr = _trainer(tmp_path, "method.name=sprpo", "model.dtype=bfloat16")
    assert tr.dtype == "bfloat16"
    batch, xi = _batch(tr)
    old32 = _float32_log_probs(tr, batch, xi)  # at theta_k
    snap = _snapshot(tr)
    got = {}
    for f32 in (True, False):
        _restore(tr, snap)
        m = make_method(MethodConfig(name="sprpo", replay_float32=f32), tr.shape)
        st = m.update(tr.actor, batch.without_old(), 0, xi)
        got[f32] = (m.S_hat.clone(), m.m_hat, [p.detach().clone() for p in tr.actor.params], st)
        assert all(p.dtype == torch.bfloat16 for p in tr.model.parameters() if not p.requires_grad)
    assert all(torch.equal(a, b) for a, b in zip(got[True][2], got[False][2]))  # the same theta_{k+1}
    assert got[True][3]["pg_loss"] == got[False][3]["pg_loss"]
    ref_batch = Batch([dataclasses.replace(s, old_logp=o) for s, o in zip(batch.samples, old32)])
    with float32_compute(tr.model):
        d_xi, m_ref = _direct_surrogate_grads(tr, ref_batch, xi)
    S_ref = d_xi.double().pow(2)

    def err(S):
        return float((S - S_ref).norm() / S_ref.norm())

    assert float(S_ref.sum()) > 0 and err(got[True][0]) < 1e-5
    assert got[True][1] == pytest.approx(m_ref, rel=1e-5)
    assert err(got[False][0]) > 20 * err(got[True][0])
    assert "replay_float32" not in key_fields(MethodConfig()) and key_fields(MethodConfig(replay_float32=True))["replay_float32"]
    with pytest.raises(ValueError, match="method.replay_float32"):
        MethodConfig(name="sprpo", sensitivity="one_pass", replay_float32=True)


def test_statistics_exclude_the_entropy_bonus(tmp_path):
    """SAM's channel gradient and one-pass S_hat / m_hat are of L_k alone (Alg. 4 line 3,
    Alg. 1 line 7): the same with entropy_coeff 0.05 as with 0."""
    tr = _trainer(tmp_path, "method.name=sam", "method.sam_rho=0.05")
    batch, _ = _batch(tr)
    snap = _snapshot(tr)
    out = {}
    for coef in (0.0, 0.05):
        _restore(tr, snap)
        tr.actor.loss_cfg = dataclasses.replace(tr.actor.loss_cfg, entropy_coeff=coef)
        st = tr.method.update(tr.actor, batch.without_old(), 0, None)
        out[coef] = (st["sam_g_norm"], tr.method.last_xi.clone())
    assert out[0.0][0] == pytest.approx(out[0.05][0], rel=1e-6)
    torch.testing.assert_close(out[0.0][1], out[0.05][1])
    from sprpo_lib.core.methods import MethodConfig, make_method

    xi = 0.1 * torch.randn(tr.shape, generator=torch.Generator().manual_seed(0))
    stats = {}
    for coef in (0.0, 0.05):
        _restore(tr, snap)
        tr.actor.loss_cfg = dataclasses.replace(tr.actor.loss_cfg, entropy_coeff=coef)
        m = make_method(MethodConfig(name="sprpo", sensitivity="one_pass"), tr.shape)
        m.update(tr.actor, batch.without_old(), 0, xi)
        stats[coef] = (m.S_hat.clone(), m.m_hat)
    torch.testing.assert_close(stats[0.0][0], stats[0.05][0], rtol=1e-5, atol=1e-14)
    assert stats[0.0][1] == pytest.approx(stats[0.05][1], rel=1e-6)


def test_ppo_mini_batches_and_epochs_keep_old_log_probs_of_theta_k(tmp_path):
    tr = _trainer(tmp_path, "update.ppo_mini_batch_size=2", "update.ppo_epochs=2")
    batch, _ = _batch(tr)
    n = len(batch.samples)
    assert n >= 3
    at_k = tr.actor.log_probs(batch, None)
    st = tr.actor.ppo_update(batch, None)
    assert st["ppo_steps"] == 2 * math.ceil(n / 2)
    steps = {int(s["step"]) for s in tr.actor.opt.state_dict()["state"].values()}
    assert steps == {2 * math.ceil(n / 2)}
    for s, lp in zip(batch.samples, at_k):
        torch.testing.assert_close(s.old_logp, lp)  # fixed before the first step, never refreshed
    after = tr.actor.log_probs(batch, None)
    assert any(not torch.allclose(a, b) for a, b in zip(at_k, after))


def test_micro_batch_accumulation_equals_one_full_batch(tmp_path):
    tr = _trainer(tmp_path)
    batch, _ = _batch(tr)
    grads = {}
    for mb in (1, len(batch.samples)):
        tr.actor.micro_batch = mb
        tr.actor.zero_grad()
        tr.actor.backward(batch, None)
        grads[mb] = [p.grad.clone() for p in tr.actor.params]
    tr.actor.zero_grad()
    for a, b in zip(grads[1], grads[len(batch.samples)]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_length_sorted_micro_batches_keep_order_and_gradient(tmp_path):
    """Micro-batches are cut from the length-sorted batch: less padding, log-probs back in
    batch order (each equal to its sample's own unpadded forward), the same gradient as
    micro-batches in batch order."""
    tr = _trainer(tmp_path)
    batch, _ = _batch(tr)
    assert len({len(s.ids) for s in batch.samples}) > 1
    assert batch.padded_tokens(3) <= batch.padded_tokens(3, sort=False)
    assert sorted(map(id, batch.samples)) == sorted(id(s) for c in batch.micro_batch_order(3) for s in c)
    tr.actor.micro_batch = 3
    together = tr.actor.log_probs(batch, None)
    for s, lp in zip(batch.samples, together):
        torch.testing.assert_close(lp, tr.actor.log_probs(Batch([s]), None)[0], rtol=1e-4, atol=1e-5)
    grads = {}
    for sort in (True, False):
        tr.actor.sort_micro_batches = sort
        tr.actor.zero_grad()
        tr.actor.backward(batch.without_old(), None)
        grads[sort] = [p.grad.clone() for p in tr.actor.params]
    tr.actor.zero_grad()
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_zero_advantage_rows_are_skipped_with_the_same_gradient(tmp_path):
    """A row with A = 0 carries no gradient of the token-mean surrogate: passes over the
    surrogate alone skip it (speed.skip_zero_adv, the default) and give the parameters',
    the channels' (SPrPO's S_hat, SAM's g) and the loss's values of running every row.
    A pass with the entropy bonus runs every row; one without any non-zero advantage runs
    none and leaves zero gradients, as the full pass does."""
    tr = _trainer(tmp_path)
    batch, xi = _batch(tr)
    batch = batch.without_old()
    for i, s in enumerate(batch.samples):
        if i % 2:
            s.adv = 0.0
    live = sum(s.n_resp for s in batch.samples if s.adv != 0)
    assert 0 < live < batch.n_tokens
    xi = 0.1 * torch.randn(tr.shape, generator=torch.Generator().manual_seed(3))
    out = {}
    for skip in (True, False):
        tr.actor.skip_zero_adv = skip
        leaf = grad_leaf(xi, tr.actor)
        tr.actor.zero_grad()
        st = tr.actor.backward(batch.without_old(), leaf, terms=SURROGATE)
        out[skip] = ([p.grad.clone() for p in tr.actor.params], leaf.grad.clone(), st)
    for a, b in zip(out[True][0], out[False][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=1e-4, atol=1e-9)
    assert out[True][1].abs().sum() > 0
    assert out[True][2]["pg_loss"] == pytest.approx(out[False][2]["pg_loss"], rel=1e-4, abs=1e-9)
    assert out[True][2]["grad_token_frac"] == pytest.approx(live / batch.n_tokens)
    assert out[False][2]["grad_token_frac"] == 1.0
    tr.actor.skip_zero_adv = True
    tr.actor.zero_grad()
    assert tr.actor.loss_cfg.entropy_coeff > 0
    assert tr.actor.backward(batch.without_old(), None)["grad_token_frac"] == 1.0  # TRAIN: the bonus needs every row
    for s in batch.samples:
        s.adv = 0.0
    for skip in (True, False):
        tr.actor.skip_zero_adv = skip
        tr.actor.zero_grad()
        leaf = grad_leaf(xi, tr.actor)
        st = tr.actor.backward(batch.without_old(), leaf, terms=SURROGATE)
        assert st["pg_loss"] == 0.0 and st["grad_token_frac"] == (0.0 if skip else 1.0)
        assert all(p.grad is not None and not p.grad.any() for p in tr.actor.params)
        assert leaf.grad is not None and not leaf.grad.any()
    tr.actor.zero_grad()


def test_kl_loss_low_var_kl(tmp_path):
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    expect = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(logp.tolist(), ref.tolist())]
    torch.testing.assert_close(kl_penalty(logp, ref), torch.tensor(expect))
    tr = _trainer(tmp_path, "update.kl_coef=0.01")
    batch, _ = _batch(tr)
    st = tr.actor.backward(batch, None)  # at theta_k the fresh LoRA (B = 0) is the reference policy
    assert st["kl"] == 0.0
    assert all(s.ref_logp is not None for s in batch.samples)
    tr.actor.step()
    tr.actor.zero_grad()
    assert tr.actor.backward(batch, None)["kl"] > 0


def test_config_errors_and_paper_defaults():
    paper = load_config("paper")
    a = paper.update.adv
    assert (a.episode_stats, a.singleton_episode, a.penalty_placement, a.norm) == ("step", "raw", "step", "mean")
    assert paper.rollout.agent.max_prompt_tokens == 4096
    alf = load_config("paper", **{"env.name": "alfworld"})
    assert alf.update.adv.norm == "mean_std" and alf.rollout.agent.max_prompt_tokens == 3072
    assert load_config("paper", ["update.adv.norm=mean_std"]).update.adv.norm == "mean_std"  # CLI wins
    with pytest.raises(ValueError, match="one_pass"):
        load_config("smoke", ["method.name=sprpo", "method.sensitivity=one_pass", "update.ppo_epochs=2"])
    with pytest.raises(ValueError, match=r"unknown method 'ppo' \(method.name\); expected one of"):
        load_config("smoke", ["method.name=ppo"])


def test_perturbation_keywords_are_checked():
    from sprpo_lib.core.compress import apply_perturbation

    pol = load_policy("tiny-qwen2", seed=0)
    with pytest.raises(ValueError, match=r"takes no keyword\(s\) \['group_sise'\]; valid: .*group_size"):
        apply_perturbation(pol.model, "rtn", 4, group_sise=64)
