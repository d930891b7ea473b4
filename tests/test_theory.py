"""sprpo_lib.paper.theory against closed forms and independent re-computations (Lemma 1,
Theorem 1, Corollary 1, Theorem 2 of the paper), plus the notebook's smoke run."""
from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pandas as pd
import pytest

from sprpo_lib.paper import theory as th


def _switch_mdp(gamma: float) -> th.MDP:
    """2 states, action 0 stays, action 1 switches; reward 1 in state 1; start in state 0."""
    P = np.zeros((2, 2, 2))
    P[0, 0, 0] = P[1, 0, 1] = 1.0
    P[0, 1, 1] = P[1, 1, 0] = 1.0
    r = np.array([[0.0, 0.0], [1.0, 1.0]])
    return th.MDP(P=P, r=r, rho0=np.array([1.0, 0.0]), gamma=gamma)


@pytest.fixture
def garnet_case():
    rng = np.random.default_rng(7)
    mdp = th.garnet(7, 3, 3, 0.9, rng)
    pi = th.softmax(2.0 * rng.standard_normal((7, 3)))
    pi_new = th.softmax(np.log(pi) + 0.5 * rng.standard_normal((7, 3)))
    return mdp, pi, pi_new, rng


# ------------------------------------------------------------------ exact evaluation


def test_two_state_mdp_by_hand():
    g = 0.8
    mdp = _switch_mdp(g)
    ev = th.evaluate(mdp, np.full((2, 2), 0.5))
    v0 = g * 0.5 / (1 - g)  # V(s) = r(s) + g * mean(V): mean(V) = 0.5 / (1 - g)
    v1 = 1 + v0
    np.testing.assert_allclose(ev.V, [v0, v1], atol=1e-12)
    Q = np.array([[g * v0, g * v1], [1 + g * v1, 1 + g * v0]])
    np.testing.assert_allclose(ev.Q, Q, atol=1e-12)
    np.testing.assert_allclose(ev.A, Q - np.array([[v0], [v1]]), atol=1e-12)
    assert ev.J == pytest.approx(v0, abs=1e-12)
    np.testing.assert_allclose(ev.d, (1 - g) * np.array([1.0, 0.0]) + g * np.array([0.5, 0.5]), atol=1e-12)
    # deterministic "stay": J = 0 from state 0, V(1) = 1 / (1 - g), advantage of switching in 0
    stay = th.evaluate(mdp, np.array([[1.0, 0.0], [1.0, 0.0]]))
    np.testing.assert_allclose(stay.V, [0.0, 1 / (1 - g)], atol=1e-12)
    assert stay.A[0, 1] == pytest.approx(g / (1 - g), abs=1e-12)
    np.testing.assert_allclose(stay.d, [1.0, 0.0], atol=1e-12)


def test_exact_values_match_value_iteration_and_rollouts(garnet_case):
    mdp, pi, _, rng = garnet_case
    ev = th.evaluate(mdp, pi)
    # power iteration of the Bellman operator and of the state distribution
    P_pi = np.einsum("sa,sat->st", pi, mdp.P)
    r_pi = (pi * mdp.r).sum(1)
    V = np.zeros(7)
    mu, rho = mdp.rho0.copy(), np.zeros(7)
    for t in range(1500):
        V = r_pi + mdp.gamma * P_pi @ V
        rho += mdp.gamma ** t * mu
        mu = mu @ P_pi
    np.testing.assert_allclose(ev.V, V, atol=1e-10)
    np.testing.assert_allclose(ev.rho, rho, atol=1e-10)
    assert ev.d.sum() == pytest.approx(1.0, abs=1e-12)
    # Monte-Carlo rollouts (sampled trajectories), 150 steps: gamma^150 ~ 1e-7
    n, H = 20000, 150
    s = rng.choice(7, size=n, p=mdp.rho0)
    ret = np.zeros(n)
    cum_pi, cum_P = pi.cumsum(1), mdp.P.cumsum(2)
    for t in range(H):
        a = np.minimum((rng.uniform(size=(n, 1)) > cum_pi[s]).sum(1), 2)
        ret += mdp.gamma ** t * mdp.r[s, a]
        s = np.minimum((rng.uniform(size=(n, 1)) > cum_P[s, a]).sum(1), 6)
    assert abs(ret.mean() - ev.J) < 4 * ret.std() / math.sqrt(n)


def test_performance_difference_identity(garnet_case):
    mdp, pi, pi_new, _ = garnet_case
    ev, ev_new = th.evaluate(mdp, pi), th.evaluate(mdp, pi_new)
    rhs = 1 / (1 - mdp.gamma) * (ev_new.d * (pi_new * ev.A).sum(1)).sum()
    assert ev_new.J - ev.J == pytest.approx(rhs, abs=1e-10)
    # the surrogate of Lemma 1 / Def. 2: importance-weighted form equals E_{a~pi'}[A]
    iw = 1 / (1 - mdp.gamma) * (ev.d * (pi * pi_new / pi * ev.A).sum(1)).sum()
    assert th.surrogate(ev, pi_new) == pytest.approx(iw, abs=1e-12)
    assert th.surrogate(ev, pi) == pytest.approx(0.0, abs=1e-12)


def test_batched_evaluation_equals_single(garnet_case):
    mdp, pi, pi_new, _ = garnet_case
    both = th.evaluate(mdp, np.stack([pi, pi_new]))
    assert both.J[1] == pytest.approx(th.evaluate(mdp, pi_new).J, abs=1e-13)


# ------------------------------------------------------------------ gradients


def _fd(f, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        g[idx] = (f(x + e) - f(x - e)) / (2 * h)
    return g


def test_surrogate_and_return_gradients_against_finite_differences(garnet_case):
    mdp, pi, pi_new, _rng = garnet_case
    lo, ln = np.log(pi), np.log(pi_new)
    ev = th.evaluate(mdp, pi)
    g_old, g_new = th.grad_surrogate_pi(mdp, ev, pi_new)
    f_old = lambda z: th.surrogate(th.evaluate(mdp, th.softmax(z)), pi_new)
    f_new = lambda z: th.surrogate(ev, th.softmax(z))
    np.testing.assert_allclose(th.softmax_backward(pi, g_old), _fd(f_old, lo), atol=1e-7)
    np.testing.assert_allclose(th.softmax_backward(pi_new, g_new), _fd(f_new, ln), atol=1e-7)
    f_j = lambda z: th.evaluate(mdp, th.softmax(z)).J
    np.testing.assert_allclose(th.softmax_backward(pi, th.grad_return_pi(ev)), _fd(f_j, lo), atol=1e-7)
    # the surrogate is first-order exact at pi' = pi: same gradient as J
    _, g_same = th.grad_surrogate_pi(mdp, ev, pi)
    np.testing.assert_allclose(th.softmax_backward(pi, g_same), _fd(f_j, lo), atol=1e-7)


def test_channel_gradients_against_finite_differences():
    rng = np.random.default_rng(3)
    mdp = th.garnet(6, 3, 2, 0.85, rng)
    pol = th.channel_policy(6, 4, rng)
    theta = rng.standard_normal((4, 3))
    theta_new = theta + 0.3 * rng.standard_normal((4, 3))
    xi = 0.3 * rng.standard_normal((3, 4))
    st = th.update_stats(mdp, pol, theta, theta_new, xi, with_grad=True)
    for b in range(3):
        f = lambda x: th.update_stats(mdp, pol, theta, theta_new, x[None]).surr[0]
        np.testing.assert_allclose(st.grad_xi[b], _fd(f, xi[b]), atol=1e-7)
    _, g = th.perturbed_return(mdp, pol, theta, xi, with_grad=True)
    for b in range(3):
        x = xi[b:b + 1]
        np.testing.assert_allclose(g[b], _fd(lambda t, x=x: th.perturbed_return(mdp, pol, t, x)[0], theta), atol=1e-7)
    # xi = 0 is the unperturbed policy; logits are phi diag(1 + xi) theta
    np.testing.assert_allclose(pol.probs(theta, np.zeros(4)), pol.probs(theta), atol=1e-15)
    np.testing.assert_allclose(pol.logits(theta, xi[0]), pol.phi @ np.diag(1 + xi[0]) @ theta, atol=1e-12)


# ------------------------------------------------------------------ Lemma 1


def test_lemma1_holds_and_search_reports_tightness():
    rng = np.random.default_rng(0)
    mdp = th.garnet(5, 3, 2, 0.9, rng)
    pi, pi_new = th.random_policy_pairs(5, 3, 400, rng)
    t = th.lemma1_terms(mdp, pi, pi_new)
    assert (t["slack"] >= -1e-10).all() and (t["tightness"] <= 1).all()
    np.testing.assert_allclose(t["bound"], t["surrogate"] - 4 * 0.9 * t["amax"] * t["alpha"] ** 2 / 0.01, rtol=1e-12)
    assert ((t["alpha"] >= 0) & (t["alpha"] <= 1)).all()
    sizes = th.TheorySizes.preset("smoke", lemma_search_mdps=1, lemma_search_steps=40)
    s = th.lemma1_search(sizes, rng)
    assert len(s) == 1 and 0 < s.tightness.iloc[0] <= 1 and s.evaluated.iloc[0] == 64 * 40


def test_loglog_slope():
    x = np.geomspace(1e-3, 1, 20)
    assert th.loglog_slope(x, 3 * x ** 2) == pytest.approx(2.0, abs=1e-10)


# ------------------------------------------------------------------ Theorem 1 (Cantelli) and intervals


@pytest.mark.parametrize("beta", [0.02, 0.1, 0.3, 0.5, 0.9])
def test_cantelli_threshold_on_known_distributions(beta):
    k = math.sqrt((1 - beta) / beta)
    assert th.cantelli_threshold(2.0, 4.0, beta) == pytest.approx(2.0 - 2.0 * k)
    # Gaussian: P(X >= mu - k sd) = Phi(k) >= 1 - beta
    assert NormalDist().cdf(k) >= 1 - beta
    # Exponential(1) (mean 1, variance 1): P(X >= t) = exp(-max(t, 0))
    t = float(th.cantelli_threshold(1.0, 1.0, beta))
    assert math.exp(-max(t, 0.0)) >= 1 - beta
    # two-point extremal law (mean 0, variance v): Cantelli is attained, P(X <= -t) = beta
    v = 0.7
    tt = math.sqrt((1 - beta) / beta * v)
    p_low = v / (v + tt * tt)
    assert p_low == pytest.approx(beta)
    mean = p_low * (-tt) + (1 - p_low) * (v / tt)
    var = p_low * tt ** 2 + (1 - p_low) * (v / tt) ** 2 - mean ** 2
    assert mean == pytest.approx(0, abs=1e-12) and var == pytest.approx(v)
    assert float(th.cantelli_threshold(mean, var, beta)) == pytest.approx(-tt)
    assert th.certified_beta(tt, v) == pytest.approx(beta)


def test_certified_beta_edges():
    assert th.certified_beta(-1.0, 1.0) == 1.0 and th.certified_beta(0.0, 1.0) == 1.0
    assert th.certified_beta(1.0, 0.0) == 0.0


def test_clopper_pearson_and_wilson():
    n, a = 10, 0.05
    assert th.clopper_pearson(0, n) == (0.0, pytest.approx(1 - (a / 2) ** (1 / n), abs=1e-12))
    assert th.clopper_pearson(n, n) == (pytest.approx((a / 2) ** (1 / n), abs=1e-12), 1.0)
    lo, hi = th.clopper_pearson(3, 10)  # R: binom.test(3, 10)$conf.int
    assert lo == pytest.approx(0.06673951, abs=1e-7) and hi == pytest.approx(0.65245285, abs=1e-7)
    lo, hi = th.clopper_pearson(9500, 10000)
    wl, wh = th.wilson(9500, 10000)
    assert lo < 0.95 < hi and abs(lo - wl) < 1e-3 and abs(hi - wh) < 1e-3
    assert th.wilson(50, 50)[1] == 1.0 and th.wilson(0, 50)[0] == 0.0


def test_theorem1_rows_hold_on_a_real_update():
    sizes = th.TheorySizes.preset("smoke")
    upd = th.make_updates(sizes, np.random.default_rng(1))[0]
    _, st = th.update_sample(upd, upd.sigma, 3000, np.random.default_rng(2))
    rows = pd.DataFrame(th.theorem1_rows(upd, st, (0.1, 0.5)))
    assert (rows.m_nu <= rows.mu_nu + 1e-12).all()  # Lemma 1 in expectation
    assert not rows.violated_m.any() and not rows.violated_mu.any()
    assert (rows.lo_m <= rows.p_m).all() and (rows.p_m <= rows.hi_m).all()


# ------------------------------------------------------------------ Corollary 1 (Poincare)


def test_poincare_bound_is_exact_for_linear_functions():
    rng = np.random.default_rng(0)
    sigma = np.array([0.1, 0.5, 2.0])
    g = np.array([3.0, -1.0, 0.25])
    xi = th.gaussian_sample(sigma, 2000, rng)
    grads = np.tile(g, (2000, 1))
    assert th.poincare_bound(grads, sigma) == pytest.approx(float((sigma ** 2 * g ** 2).sum()), rel=1e-14)
    ratio, lo, _hi = th.poincare_ratio(xi @ g, grads, sigma, 50, rng, xi=xi, g0=g)
    assert ratio == pytest.approx(1.0, abs=1e-12) and lo == pytest.approx(1.0, abs=1e-9)


def test_poincare_ratio_on_nonlinear_closed_forms():
    rng = np.random.default_rng(1)
    s = 0.8
    z = th.gaussian_sample(np.array([s]), 200000, rng)
    # f = sin(xi): Var = (1 - e^{-2s^2})/2, bound = s^2 (1 + e^{-2s^2})/2, ratio tanh(s^2)/s^2
    ratio, lo, hi = th.poincare_ratio(np.sin(z[:, 0]), np.cos(z), np.array([s]), 30, rng, xi=z, g0=np.array([1.0]))
    assert lo - 0.01 < math.tanh(s * s) / (s * s) < hi + 0.01 and ratio < 1
    # f = xi^2: Var = 2 s^4, bound = 4 s^4
    ratio, _, _ = th.poincare_ratio(z[:, 0] ** 2, 2 * z, np.array([s]), 10, rng)
    assert ratio == pytest.approx(0.5, abs=0.02)


def test_truncated_gaussian_support():
    xi = th.gaussian_sample(np.array([0.5, 2.0]), 5000, np.random.default_rng(0), delta=1.5)
    assert xi.shape == (5000, 2) and (np.abs(xi) <= 1.5 * np.array([0.5, 2.0])).all()


def test_allocation_keeps_energy_and_equalises_contributions():
    S = np.array([4.0, 1.0, 0.01])
    for alpha in (0.0, 0.5, 1.0, 2.0):
        assert (th.allocate_sigma(S, 3.0, alpha) ** 2).sum() == pytest.approx(3.0)
    np.testing.assert_allclose(th.allocate_sigma(S, 3.0, 0.0), 1.0)
    c = th.allocate_sigma(S, 3.0, 1.0) ** 2 * S  # sigma_i ~ S_i^-1/2: equal sigma_i^2 S_i
    np.testing.assert_allclose(c, c[0])


# ------------------------------------------------------------------ Theorem 2


def test_stable_step_stays_in_the_safe_set():
    sizes = th.TheorySizes.preset("smoke")
    rng = np.random.default_rng(4)
    mdp = th.garnet(6, 3, 2, 0.9, rng)
    pol = th.channel_policy(6, 4, rng)
    theta = 0.1 * rng.standard_normal((4, 3))
    xi = th.gaussian_sample(np.full(4, 0.3), 128, rng, 3.0)
    # the current policy is in U_beta (margin 0 = variance, up to round-off): stable_step keeps it
    _, m, v = th.in_safe_set(mdp.gamma, th.update_stats(mdp, pol, theta, theta, xi), 0.1)
    assert v == 0 and abs(m) < 1e-12
    direction = th.perturbed_gradient(mdp, pol, theta, xi[:8])
    j0 = th.perturbed_return(mdp, pol, theta, xi).mean()
    for margin in ("m", "mu"):
        new, info = th.stable_step(mdp, pol, theta, xi, direction, 4.0, 12, 0.1, margin)
        assert info["jbar"] >= j0 and th.perturbed_return(mdp, pol, new, xi).mean() == pytest.approx(info["jbar"])
        assert info["margin"] >= math.sqrt(9 * info["v"]) - 1e-15
    assert sizes.t2_halvings >= 1


def test_theorem2_requirements_formula():
    r = th.theorem2_requirements(C_J=10.0, eps=1.0, beta_bar=0.1, sd0=0.01, beta=1e-6)
    assert r["beta_required"] == pytest.approx(0.1 / (100 * 100 + 0.1))
    assert r["beta_ok"] and r["assumption1_ok"] and r["sigma0_max"] == pytest.approx(math.sqrt(0.1) / 4)
    row = th.robustness_row(np.array([0.0] * 99 + [-10.0]), eps=1.0, beta_bar=0.05)  # J_bar = -0.1
    assert row["p"] == pytest.approx(0.99) and row["lo"] < 0.95 < row["hi"]
    assert not row["robust"] and not row["violated"]  # 99/100 cannot certify 95%, nor refute it


# ------------------------------------------------------------------ Fig. 2 toy, tables


def test_toy_gradient_and_methods():
    toy = th.ToyLandscape()
    p = np.array([0.13, -0.7])
    np.testing.assert_allclose(toy.grad(p), _fd(lambda q: float(toy.reward(q)), p), atol=1e-8)
    assert toy.lr < 2 * toy.w ** 2  # noise-free ascent is stable across the ridge
    ref = th.toy_trajectory(toy, "none", 300, np.random.default_rng(0))
    assert toy.reward(ref[-1]) > 0.95
    with pytest.raises(ValueError, match="unknown method"):
        th.toy_trajectory(toy, "bogus", 3, np.random.default_rng(0))


def test_theory_figures_pass_the_text_and_legend_checks():
    """Every theory figure, drawn from the smoke preset's experiments, keeps its texts apart and
    inside the canvas and no legend over its data (the old layout failed both)."""
    from sprpo_lib.paper.figcheck import figure_problems

    sizes = th.TheorySizes.preset("smoke", seed=0)
    updates = th.make_updates(sizes)
    figs = {"lemma1": th.plot_lemma1(th.lemma1_experiment(sizes)),
            "theorem1": th.plot_theorem1(th.theorem1_experiment(sizes, updates)),
            "corollary1": th.plot_corollary1(th.corollary1_experiment(sizes, updates)),
            "theorem2": th.plot_theorem2(th.theorem2_experiment(sizes)),
            "fig2": th.plot_fig2(*th.toy_experiment(sizes, seed=0))}
    for name, fig in figs.items():
        assert figure_problems(fig, ("text", "legend")) == [], name
        if name != "fig2":  # the toy's axes are plain x, y
            assert any("$" in t.get_text() for ax in fig.axes for t in (ax.xaxis.label, ax.yaxis.label)), name


def test_booktabs_escapes_and_rules():
    tex = th.to_booktabs(pd.DataFrame({"check": ["a_b"], "statement": ["x^2 & 5%"], "n": [3.14159]}), "cap", "tab:x")
    assert r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex
    assert r"a\_b" in tex and r"x\^{}2 \& 5\%" in tex and "3.14" in tex


def test_presets():
    assert th.TheorySizes.preset("smoke").mc_samples < th.TheorySizes.preset("cpu").mc_samples
    assert th.TheorySizes.preset("cpu", seed=3).seed == 3
    with pytest.raises(ValueError, match="unknown preset"):
        th.TheorySizes.preset("huge")


# ------------------------------------------------------------------ notebook


@pytest.mark.slow
def test_theory_notebook_smoke(tmp_path):
    from sprpo_lib.reproduce import run

    out = tmp_path / "figs"
    recs = run("smoke", only=["02"], force=True, runs_dir=tmp_path / "runs", out_dir=str(out))
    assert recs[0]["status"] == "ok"
    summary = pd.read_csv(out / "02_theory_summary.csv")
    assert {"check", "statement", "instances", "violations", "min_slack"} <= set(summary.columns)
    assert (summary.instances > 0).all()
    guaranteed = summary[~summary.check.str.contains("pg")]
    assert (guaranteed.violations == 0).all(), guaranteed
    assert r"\toprule" in (out / "02_theory_summary.tex").read_text()
    for stem in ("lemma1", "theorem1", "corollary1", "theorem2", "fig2"):
        assert (out / f"02_theory_{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"02_theory_{stem}.pdf").read_bytes()[:4] == b"%PDF"
        man = json.loads((out / f"02_theory_{stem}.png.manifest.json").read_text())
        assert {"config", "seed", "commit", "date", "wall_seconds"} <= set(man)
        assert man["config"]["preset"] == "smoke"
