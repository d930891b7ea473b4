"""The divergence of a policy under a perturbation (the paper's alpha): the estimator against
the exact sequence KL of a model small enough to enumerate every response, zero where nothing
moves, common random numbers across policies, and the state pool and cells content-keyed and
rebuilt when damaged."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import sprpo_lib.evaluate.divergence as D
from sprpo_lib.core.compress import perturbation
from sprpo_lib.core.divergence import pinsker, sequence_kl
from sprpo_lib.core.perturb import active_factor
from sprpo_lib.evaluate import EvalConfig
from sprpo_lib.evaluate.cli import main as eval_main
from sprpo_lib.infra.io import CorruptFileError
from sprpo_lib.model.load import load_policy

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def enumerable():
    """A float64 model with 8 tokens: every 3-token response can be listed (512)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    model = Qwen2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # peakier next-token distributions than a fresh init's
    return model


def exact_kl(model, temperature, family, strength) -> float:
    seqs = torch.tensor(list(itertools.product(range(8), repeat=3)))

    def logp_all():
        lp = D.response_logprobs(model, D.prefill(model, [PROMPT]), seqs, temperature)
        return lp.gather(-1, seqs[..., None])[..., 0].sum(-1)

    lp = logp_all()
    with perturbation(model, family, strength, seed=1):
        lq = logp_all()
    assert abs(float(lp.exp().sum()) - 1) < 1e-12  # every response listed
    return float((lp.exp() * (lp - lq)).sum())


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("strength", [0.05, 0.2])
def test_estimator_matches_the_exact_sequence_kl(enumerable, temperature, strength):
    exact = exact_kl(enumerable, temperature, "gaussian", strength)
    n = 3000
    pre = D.prefill(enumerable, [PROMPT])
    toks, mask = D.sample_responses(enumerable, pre, n, temperature, 3, generators=[torch.Generator().manual_seed(0)],
                                    ended=D.Stop())
    assert toks.shape == (n, 3) and bool(mask.all())
    logp = D.response_logprobs(enumerable, pre, toks, temperature)
    with perturbation(enumerable, "gaussian", strength, seed=1):
        logq = D.response_logprobs(enumerable, D.prefill(enumerable, [PROMPT]), toks, temperature)
    est = sequence_kl(logp, logq, toks, mask)
    kl, ratio = est["kl"], est["log_ratio"]
    se = float(kl.std()) / n ** 0.5
    assert exact > 0 and abs(float(kl.mean()) - exact) < 4 * se, (float(kl.mean()), exact, se)
    assert abs(float(ratio.mean()) - exact) < 4 * float(ratio.std()) / n ** 0.5  # the same expectation
    assert float(kl.var()) < float(ratio.var())  # with less variance
    assert pinsker(exact) == min(1.0, (exact / 2) ** 0.5)


def test_nothing_moved_is_zero_exactly(tiny):
    tok = tiny.tokenizer
    prompt = tok("Task: buy a red mug.\nAvailable actions:\n- search[red mug]\n")["input_ids"]
    kw = dict(temperature=0.4, max_new_tokens=6, ended=D.Stop(tok, "</action>", [tok.eos_token_id]))
    clean = D.clean_sides(tiny.model, [prompt], k=3, seeds=[0], **kw)
    [same] = D.compare(tiny.model, [prompt], clean, **kw)
    assert same["kl"] == 0.0 and same["log_ratio"] == 0.0 and same["flip"] is False
    with perturbation(tiny.model, "gaussian", 0.0, seed=3):
        [zero] = D.compare(tiny.model, [prompt], clean, **kw)
    assert zero["kl"] == 0.0
    with perturbation(tiny.model, "gaussian", 0.5, seed=3):
        [moved] = D.compare(tiny.model, [prompt], clean, **kw)
    assert moved["kl"] > 0 and moved["tv_bound"] == pinsker(moved["kl"])


def test_a_batch_of_states_gives_each_state_its_own_result():
    """Left-padded batches against one state at a time (float32): the same K responses (each
    state's own generator), the same greedy actions, the same KLs up to rounding."""
    pol = load_policy("tiny-qwen2", seed=0, dtype="float32")
    model, tok = pol.model.eval(), pol.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("Task: buy a mug.", "Task: buy a red mug and a blue hat, size 7 please.",
                                             "Go to the kitchen then open the fridge")]
    assert len({len(p) for p in prompts}) == 3
    kw = dict(temperature=0.7, max_new_tokens=7, ended=D.Stop(tok, "</action>", [tok.eos_token_id]),
              pad_id=tok.pad_token_id)
    seeds = [11, 12, 13]
    together = D.clean_sides(model, prompts, k=3, seeds=seeds, **kw)
    alone = [D.clean_sides(model, [p], k=3, seeds=[s], **kw)[0] for p, s in zip(prompts, seeds)]
    for a, b in zip(together, alone):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask) and a.action == b.action
        torch.testing.assert_close(a.logp, b.logp, atol=1e-4, rtol=1e-4)
    with perturbation(model, "gaussian", 0.3, seed=5):
        rows = D.compare(model, prompts, together, **kw)
        ones = [D.compare(model, [p], [c], **kw)[0] for p, c in zip(prompts, together)]
    for r, o in zip(rows, ones):
        assert r["flip"] == o["flip"] and r["tokens"] == o["tokens"]
        assert r["kl"] > 0 and abs(r["kl"] - o["kl"]) < 1e-4 * (1 + o["kl"])
    assert [sorted(g) for g in D.batches(prompts, 2)] == [[1, 2], [0]]


def test_the_matmul_attention_lever_gives_sdpas_rows(monkeypatch):
    """EvalConfig.attention: the clean side and a setting's rows with attention as matmuls
    (the kernel ``auto`` picks for a 16-bit model on a CPU) against SDPA's, the reference, on a
    left-padded batch of three prompt lengths (float32): the same responses and flips, the
    log-probabilities and KLs up to rounding; the matmul kernel did run."""
    import sprpo_lib.model.layers as L

    calls = []
    real = L.matmul_attention
    monkeypatch.setattr(L, "matmul_attention", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    pol = load_policy("tiny-qwen2", seed=0, dtype="float32")
    model, tok = pol.model.eval(), pol.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("Task: buy a mug.", "Task: buy a red mug and a blue hat, size 7 please.",
                                             "Go to the kitchen then open the fridge")]
    kw = dict(temperature=0.7, max_new_tokens=7, ended=D.Stop(tok, "</action>", [tok.eos_token_id]),
              pad_id=tok.pad_token_id)
    ref = D.clean_sides(model, prompts, k=3, seeds=[1, 2, 3], **kw)
    with L.native_gqa(model, False, "matmul"):
        got = D.clean_sides(model, prompts, k=3, seeds=[1, 2, 3], **kw)
    assert calls, "the matmul kernel never ran"
    for a, b in zip(ref, got):
        assert torch.equal(a.tokens, b.tokens) and a.action == b.action
        torch.testing.assert_close(a.logp, b.logp, atol=1e-4, rtol=1e-4)
    with perturbation(model, "gaussian", 0.3, seed=5):
        want = D.compare(model, prompts, ref, **kw)
        with L.native_gqa(model, False, "matmul"):
            rows = D.compare(model, prompts, ref, **kw)
    assert model.config._attn_implementation == "sdpa"  # restored on leaving
    for r, w in zip(rows, want):
        assert r["flip"] == w["flip"] and w["kl"] > 0 and abs(r["kl"] - w["kl"]) < 1e-4 * (1 + w["kl"])


def test_the_pass_runs_its_configured_kernel_and_budget(tmp_path, monkeypatch):
    """divergence() attends with ``cfg.attention`` and batches within ``cfg.batch_tokens``: rows
    with the matmul kernel and a budget that splits the pool equal SDPA's in one batch up to
    rounding; the cell records both levers."""
    import dataclasses
    import json

    import sprpo_lib.model.layers as L

    cfg = config(tmp_path, attention="sdpa", batch_tokens=None)
    states, _ = D.state_pool(cfg, 3, progress=False)
    want = D.divergence(cfg, states, samples=2, progress=False)
    calls, seen = [], []
    real, cut = L.matmul_attention, D.batches
    monkeypatch.setattr(L, "matmul_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(D, "batches", lambda *a: seen.append(cut(*a)) or seen[-1])
    budget = min(len(p) for p in states.prompts) + 1  # one state per batch
    lever = dataclasses.replace(cfg, attention="matmul", batch_tokens=budget, cache_dir=str(tmp_path / "lever"))
    got = D.divergence(lever, states, samples=2, progress=False)
    assert calls and seen[-1] == [[i] for i in cut(states.prompts, 4)[0]]
    assert got.flip.tolist() == want.flip.tolist()
    for a, b in zip(got.kl, want.kl):
        assert abs(a - b) < 1e-4 * (1 + b)
    cell = json.loads(next((tmp_path / "lever" / "divergence").glob("*.json")).read_text())
    assert cell["attention"] == "matmul" and cell["batch_tokens"] == budget


def test_a_setting_that_changes_nothing_is_zero_without_a_pass(tmp_path, monkeypatch):
    """The landscape plane's origin (w1 = w2 = 0) is the clean policy: its rows are compare()'s on
    the unperturbed model (exact zeros, no flip, the same response lengths), written without a
    pass; a point off the origin is measured."""
    import dataclasses

    from sprpo_lib.core.compress import is_identity

    assert is_identity("plane", 0.0) and is_identity("plane", 0.0, {"w2": 0.0}) and is_identity("gaussian", 0.0)
    assert not (is_identity("plane", 0.0, {"w2": 0.2}) or is_identity("plane", 0.1) or is_identity("rtn", 8))
    cfg = config(tmp_path, family="plane", strengths=(0.0,), seeds=(0,), perturbation_options={"w2": 0.0})
    states, _ = D.state_pool(cfg, 3, progress=False)
    shared: dict = {}
    with monkeypatch.context() as mp:
        mp.setattr(D, "compare", lambda *a, **k: pytest.fail("the origin was measured"))
        rows = D.divergence(cfg, states, samples=2, progress=False, shared=shared)
    pol = shared["source"].policy()
    want = D.compare(pol.model.eval(), states.prompts, shared["clean"], temperature=cfg.temperature,
                     max_new_tokens=cfg.max_new_tokens, pad_id=pol.tokenizer.pad_token_id,
                     ended=D.Stop(pol.tokenizer, cfg.generation(0).stop, [pol.tokenizer.eos_token_id]))
    for col in ("kl", "kl_se", "log_ratio", "tv_bound", "tokens", "flip"):
        assert rows[col].tolist() == [w[col] for w in want], col
    off = dataclasses.replace(cfg, strengths=(0.5,), perturbation_options={"w2": 0.5})
    assert D.divergence(off, states, samples=2, progress=False, shared=shared).kl.gt(0).all()


def test_float32_logits_take_the_rounding_of_a_16_bit_head_out():
    """float32_logits: a bfloat16 model's logits inside the block are its final hidden states times
    the head's weight (float64 reference) up to float32 rounding, where the bfloat16 head's own are
    off by its rounding; a nested block and a float32 model are left alone; the head's forward is
    back on exit."""
    from sprpo_lib.model.layers import float32_logits

    pol = load_policy("tiny-qwen2", seed=0, dtype="bfloat16")
    model, tok = pol.model.eval(), pol.tokenizer
    ids = torch.tensor([tok("Task: buy a red mug and a blue hat, size 7 please.")["input_ids"]])
    head = model.get_output_embeddings()
    with torch.no_grad():
        ref = model.model(input_ids=ids).last_hidden_state.double() @ head.weight.double().T
        own = model(input_ids=ids).logits
        with float32_logits(model) as on:
            got = model(input_ids=ids).logits
            with float32_logits(model) as nested:
                assert not nested and torch.equal(model(input_ids=ids).logits, got)
        back = model(input_ids=ids).logits
    assert on and got.dtype == torch.float32 and own.dtype == back.dtype == torch.bfloat16
    err32, err16 = float((got.double() - ref).abs().max()), float((own.double() - ref).abs().max())
    assert err32 < 1e-5 * float(ref.abs().max()) and err16 > 100 * err32
    assert torch.equal(back, own) and "forward" not in vars(head)
    with float32_logits(load_policy("tiny-qwen2", seed=0, dtype="float32").model) as on32:
        assert not on32


def test_the_logits_dtype_is_in_a_cells_key(tmp_path, monkeypatch):
    """EvalConfig.logits changes what a cell measures on a 16-bit model: a cell of the other choice
    is computed, not served (on this float32 model, with the same rows); a bad value is one error."""
    import dataclasses

    cfg = config(tmp_path)
    states, _ = D.state_pool(cfg, 2, progress=False)
    rows = D.divergence(cfg, states, samples=2, progress=False)
    calls, real = [], D.compare
    monkeypatch.setattr(D, "compare", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert D.divergence(cfg, states, samples=2, progress=False).kl.tolist() == rows.kl.tolist() and not calls
    other = D.divergence(dataclasses.replace(cfg, logits="model"), states, samples=2, progress=False)
    assert calls and other.kl.tolist() == rows.kl.tolist()
    with pytest.raises(ValueError, match="--logits / EvalConfig.logits: 'half'"):
        dataclasses.replace(cfg, logits="half")


def test_batches_within_a_padded_token_budget():
    """EvalConfig.batch_tokens: every state in one batch once, none over the size, no batch of
    several states over the budget, and on the cpu plan's WebShop pool (its prompt lengths) far
    less padding than fixed batches of 16; without a budget, fixed runs of the sorted states."""
    lengths = [790, 790, 705, 680, 483, 483, 451, 446, 419, 419, 413, 406, 370, 355, 306, 143]
    prompts = [[0] * n for n in lengths[::-1]]  # the pool's order is not the length order

    def padded(groups):
        return sum(len(g) * max(len(prompts[i]) for i in g) for g in groups)

    fixed, budget = D.batches(prompts, 16), D.batches(prompts, 16, 4096)
    assert fixed == [sorted(range(16), key=lambda i: -len(prompts[i]))]
    for groups in (fixed, budget):
        assert sorted(i for g in groups for i in g) == list(range(16))
    assert all(len(g) == 1 or len(g) * max(len(prompts[i]) for i in g) <= 4096 for g in budget)
    assert padded(fixed) == 12640 and padded(budget) < 0.7 * padded(fixed) and sum(lengths) <= padded(budget)
    assert all(len(g) <= 3 for g in D.batches(prompts, 3, 10**6))
    assert D.batches([[0] * 900, [0] * 10], 4, 512) == [[0], [1]]  # a prompt over the budget goes alone


def test_two_policies_see_the_same_draws():
    """Common random numbers: xi depends on the draw's seed and the FFN shape, not the weights."""
    a, b = load_policy("tiny-qwen2", seed=0).model, load_policy("tiny-qwen2", seed=1).model
    assert not torch.equal(a.model.layers[0].mlp.down_proj.weight, b.model.layers[0].mlp.down_proj.weight)
    for family in ("gaussian", "dropout"):
        for seed in D.draw_seeds(2):
            with perturbation(a, family, 0.1, seed=seed), perturbation(b, family, 0.1, seed=seed):
                fa, fb = active_factor(a), active_factor(b)
                assert fa is not None and torch.equal(fa, fb)
    assert D.draw_seeds(3) == D.draw_seeds(3) and len(set(D.draw_seeds(3))) == 3


def config(tmp_path, **kw) -> EvalConfig:
    base = dict(model="tiny-qwen2", env="webshop", max_steps=2, max_new_tokens=8, batch_size=4, dtype="float32",
                cache_dir=str(tmp_path / "cache"), family="gaussian", strengths=(0.2,), seeds=(0, 1))
    return EvalConfig(**{**base, **kw})


def test_state_pool_and_cells_are_content_keyed_and_never_served_damaged(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    states, path = D.state_pool(cfg, 3, progress=False)
    assert len(states) == 3 and {o[0] for o in states.origin} == {"test"}
    monkeypatch.setattr(D, "build_state_pool", lambda *a, **k: pytest.fail("a stored pool was built again"))
    again, same = D.state_pool(cfg, 3, progress=False)
    assert same == path and again.hash == states.hash and again.prompts == states.prompts
    monkeypatch.undo()
    assert D.state_pool(cfg, 2, progress=False)[1] != path  # keyed by what it depends on
    path.write_text(path.read_text()[:200])  # truncated
    with pytest.raises(CorruptFileError):
        D.load_states(path)
    monkeypatch.undo()
    rebuilt, _ = D.state_pool(cfg, 3, progress=False)
    assert rebuilt.hash == states.hash  # drawn again from the same seed, the damaged file never served
    rows = D.divergence(cfg, states, samples=2, progress=False)
    assert len(rows) == 2 * 3 and set(rows.seed) == {0, 1} and (rows.kl > 0).all()
    monkeypatch.setattr(D, "compare", lambda *a, **k: pytest.fail("a stored cell was computed again"))
    assert D.divergence(cfg, states, samples=2, progress=False).kl.tolist() == rows.kl.tolist()
    cell = next((tmp_path / "cache" / "divergence").glob("*.json"))
    cell.write_text("{garbage")
    monkeypatch.undo()
    assert D.divergence(cfg, states, samples=2, progress=False).kl.tolist() == rows.kl.tolist()  # recomputed alike


def test_settings_of_one_policy_share_its_clean_side(tmp_path, monkeypatch):
    """A ``shared`` dict across one policy's settings draws the clean side once and gives the rows
    that separate calls give."""
    import dataclasses

    cfg = config(tmp_path)
    states, _ = D.state_pool(cfg, 3, progress=False)
    other = dataclasses.replace(cfg, family="dropout", strengths=(0.1,), cache_dir=str(tmp_path / "apart"))
    apart = [D.divergence(c, states, samples=2, progress=False) for c in (cfg, other)]
    calls = []
    real = D.clean_sides
    monkeypatch.setattr(D, "clean_sides", lambda *a, **k: calls.append(1) or real(*a, **k))
    shared: dict = {}
    together = [D.divergence(dataclasses.replace(c, cache_dir=str(tmp_path / "together")), states, samples=2,
                             progress=False, shared=shared) for c in (cfg, other)]
    assert len(calls) == 1  # one batch of 3 states, drawn for the first setting only
    for a, b in zip(apart, together):
        assert a.kl.tolist() == b.kl.tolist() and a.flip.tolist() == b.flip.tolist()


def test_cli_prints_and_writes_the_table(tmp_path, capsys):
    out, pool = tmp_path / "rows.csv", tmp_path / "states.json"
    argv = ["--metric", "divergence", "--model", "tiny-qwen2", "--env", "webshop", "--family", "rtn", "--strength",
            "8", "4", "--states", "2", "--samples", "2", "--max-steps", "2", "--max-new-tokens", "8",
            "--dtype", "float32", "--cache-dir", str(tmp_path / "cache"), "--states-file", str(pool),
            "--out", str(out), "--no-progress"]
    assert eval_main(argv) == 0
    printed = capsys.readouterr().out
    assert "kl" in printed and "flip" in printed and pool.is_file()
    rows = out.read_text().splitlines()
    assert len(rows) == 1 + 2 * 2 and rows[0].startswith("env,state,split")


def test_paired_kl_bootstrap_against_closed_forms():
    """One training seed: the bootstrap's standard error of the mean difference is the closed
    form sd / sqrt(n); a single reference policy is paired with every seed of the other side."""
    import numpy as np
    import pandas as pd

    from sprpo_lib.paper.stats import Z80, paired_kl_bootstrap

    rng = np.random.default_rng(1)
    n = 400
    base, d = rng.gamma(2.0, 0.05, n), rng.normal(0.02, 0.05, n)
    flips_a, flips_b = rng.random(n) < 0.2, rng.random(n) < 0.3
    rows = pd.DataFrame([{"method": m, "train_seed": 0, "state": i, "family": "rtn", "strength": 4.0, "kl": kl,
                          "flip": f} for m, kls, fl in (("a", base + d, flips_a), ("b", base, flips_b))
                         for i, (kl, f) in enumerate(zip(kls, fl))])
    r = paired_kl_bootstrap(rows, "a", "b", "rtn", 4.0, n_resamples=4000)
    se = d.std(ddof=1) / n ** 0.5
    assert r["diff"] == pytest.approx(d.mean()) and r["ratio"] == pytest.approx((base + d).mean() / base.mean())
    assert r["mde80"] == pytest.approx(Z80 * se, rel=0.1)
    assert (r["diff_ci"][1] - r["diff_ci"][0]) / 2 == pytest.approx(1.96 * se, rel=0.15)
    assert (r["wins"], r["losses"]) == (int((flips_a < flips_b).sum()), int((flips_a > flips_b).sum()))
    seeds = pd.concat([rows[rows.method == "a"].assign(train_seed=s, kl=lambda x, s=s: x.kl + s) for s in (0, 1, 2)]
                      + [rows[rows.method == "b"]])
    r3 = paired_kl_bootstrap(seeds, "a", "b", "rtn", 4.0, n_resamples=500)
    assert r3["seeds_a"] == 3 and r3["seeds_b"] == 1 and r3["diff"] == pytest.approx(d.mean() + 1)
    with pytest.raises(ValueError, match="same states"):
        paired_kl_bootstrap(rows[rows.state != 3].pipe(lambda x: x[(x.method == "a") | (x.state != 4)]), "a", "b",
                            "rtn", 4.0, n_resamples=10)


def test_kl_claims_and_the_kl_success_correlation():
    """Claims on synthetic rows where SPrPO moves half as far as Vanilla (resolves, ratio 0.5) and
    as far as SAM (no difference), and a curve strength that only Vanilla and SPrPO were measured
    at (its one comparison, no other); the correlation is Spearman's rank correlation (scipy's)."""
    import numpy as np
    import pandas as pd
    from scipy.stats import spearmanr

    from sprpo_lib.paper.divergence import correlation_sentence, kl_claims, kl_success_correlation
    from sprpo_lib.paper.stats import holm as stats_holm

    rng = np.random.default_rng(0)
    base = rng.gamma(2.0, 0.05, 60)
    scale = {"vanilla": 1.0, "gaussian": 1.0, "sam": 0.5, "sprpo": 0.5}
    rows = pd.DataFrame([{"method": m, "train_seed": 0, "state": i, "family": f, "strength": s, "w2": w2, "seed": 0,
                          "kl": k * s * base[i] * (1 + 0.01 * rng.normal()), "flip": False}
                         for m, k in scale.items()
                         for f, s, w2 in (("rtn", 4.0, 0.0), ("plane", 0.2, 0.2), ("gaussian", 0.02, 0.0))
                         for i in range(60) if f == "rtn" or m in ("vanilla", "sprpo")])
    claims = kl_claims(rows, "webshop", [("rtn", 4.0)], n_resamples=500).set_index(["id", "b", "setting"])
    curve = claims.xs("gaussian 0.02", level="setting")
    assert list(curve.index) == [("C2-KL", "vanilla")] and (curve["where"] == "curve").all()
    c2 = claims.loc[("C2-KL", "vanilla", "rtn 4")]
    assert c2.ratio == pytest.approx(0.5, rel=0.02) and c2.hi < 0 and c2.reading.startswith("sprpo moves less")
    assert c2["where"] == "table"
    sam = claims.loc[("T1-KL", "sam", "rtn 4")]
    assert sam.lo < 0 < sam.hi and sam.reading.startswith("no difference")  # the MDE is well under 10% here
    assert claims.loc[("C4-KL", "vanilla", "plane mean 0")].ratio == pytest.approx(0.5, rel=0.02)
    # the family: every comparison's bootstrap p adjusted by Holm over the environment's comparisons
    assert (claims.p_holm >= claims.p).all() and c2.p_holm < 0.05 and sam.p > 0.05
    assert claims.p_holm.to_numpy() == pytest.approx(stats_holm(claims.p.to_numpy()))
    from sprpo_lib.paper.claims import kl_claim_rows, kl_markdown

    md = kl_markdown(kl_claim_rows(claims.reset_index()))
    n, k = len(claims), int(claims.reading.str.contains(" moves ").sum())
    assert f"{k} of {n} comparisons resolve at 95% each, where about {0.05 * n:.1f} would by chance" in md
    family = md.split("Holm's correction", 1)[1].split("\n", 1)[0]
    assert "C2-KL SPrPO vs Vanilla at Quantization INT4 (table)" in family and "SAM" not in family
    # success loss per (policy, setting) against mean KL
    kl = pd.DataFrame([{"method": m, "train_seed": 0, "family": "rtn", "strength": s, "state": 0, "kl": v}
                       for m, v0 in (("a", 0.1), ("b", 0.3)) for s, v in ((8.0, v0), (4.0, 2 * v0 + 0.05))])
    succ = pd.DataFrame([{"method": m, "train_seed": 0, "family": f, "strength": s, "success": ok}
                         for m, clean, a8, a4 in (("a", 0.9, 0.8, 0.5), ("b", 0.7, 0.65, 0.1))
                         for f, s, p in (("clean", 0.0, clean), ("rtn", 8.0, a8), ("rtn", 4.0, a4))
                         for ok in [1] * int(round(p * 20)) + [0] * (20 - int(round(p * 20)))])
    def named(frame, **other):  # each policy's weights named as the row writers name them
        return frame.assign(model_hash="base", adapter_hash=frame["method"].map(lambda m: other.get(m, f"ad-{m}")))

    kl, succ = named(kl), named(succ)
    c = kl_success_correlation(kl, succ, n_resamples=200)
    loss = [10.0, 40.0, 5.0, 60.0]  # a@8, a@4, b@8, b@4 in percentage points
    assert c["pairs"] == 4 and c["spearman"] == pytest.approx(spearmanr([0.1, 0.25, 0.3, 0.65], loss).statistic)
    assert c["stale"] == 0 and "left out" not in correlation_sentence(c)
    # success rows of other weights (a pass before a retrain) pair nothing; rows that name no weights neither
    c = kl_success_correlation(kl, named(succ, b="ad-b-before"), n_resamples=200)
    assert c["pairs"] == 2 and c["stale"] == 1 and "1 policy left out" in correlation_sentence(c)
    c = kl_success_correlation(kl.assign(model_hash="retrained"), succ, n_resamples=200)  # every policy stale
    assert (c["pairs"], c["stale"]) == (0, 2) and "2 policies left out" in correlation_sentence(c)
    base = {"a": "", "b": ""}  # the bare model's rows name no adapter: read back from a CSV, "" is NaN
    c = kl_success_correlation(named(kl, **base).replace("", None), named(succ, **base), n_resamples=200)
    assert c["pairs"] == 4 and c["stale"] == 0
    c = kl_success_correlation(kl, succ.drop(columns=["adapter_hash"]), n_resamples=200)
    assert c["pairs"] == 0 and c["unnamed"] and correlation_sentence(c).startswith("Whether KL tracks success is not")
    # its interval over 12 pairs with ties: scipy's Spearman on each resample (the same draws), degenerate ones out
    x = np.round(rng.gamma(2.0, 0.1, 12), 1)  # KL per (method, strength), in the pairs' index order
    y = np.round(100 * x + rng.normal(0, 8, 12), 0)
    pairs = [(m, s) for m in "abcd" for s in (2.0, 4.0, 8.0)]
    kl = pd.DataFrame([{"method": m, "train_seed": 0, "family": "rtn", "strength": s, "state": 0, "kl": v}
                       for (m, s), v in zip(pairs, x)])
    succ = pd.DataFrame([{"method": m, "train_seed": 0, "family": f, "strength": s, "success": v}
                         for (m, s), v in zip(pairs, y) for f, s, v in (("clean", 0.0, 100.0), ("rtn", s, 100.0 - v))])
    c = kl_success_correlation(named(kl), named(succ.drop_duplicates()), n_resamples=300)
    boot = [spearmanr(x[i], y[i]).statistic for i in np.random.default_rng(0).integers(0, 12, (300, 12))
            if np.ptp(x[i]) > 0 and np.ptp(y[i]) > 0]
    assert c["pairs"] == 12 and c["spearman"] == pytest.approx(spearmanr(x, y).statistic)
    assert [c["lo"], c["hi"]] == pytest.approx(list(np.quantile(boot, [0.025, 0.975])), abs=1e-12)
    assert -1 < c["lo"] < c["hi"] < 1


def test_kl_claims_join_the_success_claims_and_the_verdict(tmp_path):
    """claims_<profile>.csv/.md: the success rows as notebook 08 wrote them, then every env's KL
    claims from notebook 09's files; rewriting from the files alone keeps both; the verdict
    sentence counts SPrPO's KL comparisons by their readings."""
    import json

    import pandas as pd

    from sprpo_lib.paper import claims as C

    success = pd.DataFrame([{"env": "webshop", "id": "C2", "claim": "SPrPO keeps more success than Vanilla",
                             "versus": "Vanilla", "setting": "Quantization INT4", "paper": 4.3, "diff": 1.0, "lo": -5.0,
                             "hi": 7.0, "mde80": 9.0, "mde_pooled": False, "tasks": 20, "train_seeds": "0 1 2",
                             "wins": 2, "losses": 1, "sign_p": 1.0, "reading": "not resolved"}])
    kl = pd.DataFrame([{"env": "webshop", "id": "C2-KL", "claim": "SPrPO moves less than Vanilla", "a": "sprpo",
                        "b": "vanilla", "setting": "rtn 4", "where": "table", "states": 64, "train_seeds": 3,
                        "kl_a": 0.5, "kl_b": 1.0, "diff": -0.5, "lo": -0.6, "hi": -0.4, "ratio": 0.5, "ratio_lo": 0.45,
                        "ratio_hi": 0.55, "mde80": 0.07, "mde80_rel": 0.07, "flip_a": 0.1, "flip_b": 0.2, "wins": 1,
                        "losses": 5, "sign_p": 0.2, "reading": "sprpo moves less (ratio 0.5 [0.45, 0.55])"},
                       {"env": "webshop", "id": "C4-KL", "claim": "flatter", "a": "sprpo", "b": "vanilla",
                        "setting": "plane mean 0", "where": "plane", "states": 64, "train_seeds": 1, "kl_a": 1.0,
                        "kl_b": 1.0, "diff": 0.0, "lo": -0.3, "hi": 0.3, "ratio": 1.0, "ratio_lo": 0.7, "ratio_hi": 1.3,
                        "mde80": 0.4, "mde80_rel": 0.4, "flip_a": None, "flip_b": None, "wins": None, "losses": None,
                        "sign_p": None, "reading": "not resolved: the design detects only 40% of the baseline's KL"}])
    sam = {**kl.iloc[0].to_dict(), "id": "T1-KL", "b": "sam", "seeds_a": 3, "seeds_b": 1}  # SAM trained at one seed
    kl = pd.concat([kl, pd.DataFrame([sam])], ignore_index=True)
    kl.to_csv(tmp_path / "09_divergence_webshop_claims.csv", index=False)
    corr = {"pairs": 12, "spearman": 0.61, "lo": 0.2, "hi": 0.85, "sentence": "Mean KL tracks success loss: Spearman "
            "0.61 [0.20, 0.85] over 12 (policy, setting) pairs."}
    (tmp_path / "09_divergence_webshop_correlation.json").write_text(json.dumps(corr))
    C.write_claims(tmp_path, "cpu", success=success)
    first = (tmp_path / "claims_cpu.md").read_text()
    C.write_claims(tmp_path, "cpu")  # notebook 09's call: both parts read back from the files
    rows = pd.read_csv(tmp_path / "claims_cpu.csv")
    assert (tmp_path / "claims_cpu.md").read_text() == first
    assert list(rows["measure"]) == ["success", "KL", "KL", "KL", "correlation"]
    assert list(rows["id"]) == ["C2", "C2-KL", "C4-KL", "T1-KL", "KL-success"]
    # a one-seed baseline is marked beside its states x seeds (the warm start would not be)
    assert "| 64 x 3 (SAM: one seed) |" in first and "| 64 x 3 |" in first and list(rows["one_seed"].fillna("")) == [
        "", "", "", "SAM", ""]
    # does KL track success: Spearman with its interval, in the file, the table and the first screen
    assert rows.iloc[-1][["diff", "lo", "hi", "tasks"]].tolist() == [0.61, 0.2, 0.85, 12]
    assert first.rstrip().endswith("- WebShop: " + corr["sentence"]) and "Does the divergence track success?" in first
    assert C.verdict_sentence(rows, profile="cpu").endswith(" WebShop: " + corr["sentence"])
    rows = rows[rows["measure"] != "correlation"]
    assert rows.loc[1, "setting"] == "Quantization INT4 (table)" and rows.loc[1, "versus"] == "SPrPO vs Vanilla"
    assert "**WebShop, KL**" in first and "0.5 [0.45, 0.55]" in first and "C2 | SPrPO keeps more" in first
    sentence = C.verdict_sentence(rows, profile="cpu")
    assert sentence.startswith("At the cpu profile's scale no SPrPO comparison resolves: all 1 paired")
    assert "moves less than the other policy in 2 of 3 paired comparisons, more in 0; 0 read no difference" in sentence
    assert "and 1 are not resolved (the design detects a relative difference of 40% of the baseline's KL at the " \
           "median, 40% at best, against the 10% target)." in sentence
    holm = C.verdict_sentence(rows.assign(p_holm=[None, 0.2, 0.3, 0.01]), profile="cpu")  # rows written with Holm's p
    assert "more in 0 (1 of these 2 hold after Holm's correction for all of an environment's KL comparisons);" in holm
    assert C.overview(rows[rows["measure"] == "success"])["id"].tolist().count("C2") == 1


def test_kl_power_recovers_the_variance_components_and_sizes_the_design():
    """Simulated pilot with known components (seed 0.02^2, state 0.1^2, draw 0.1^2, K-sample
    noise 0.1^2 per difference): kl_power recovers them, kl_mde is the closed form, and
    kl_design's state count is the first that meets the target."""
    import numpy as np
    import pandas as pd

    from sprpo_lib.paper.divergence import kl_design, kl_frontier, kl_mde, kl_power
    from sprpo_lib.paper.stats import Z80

    rng = np.random.default_rng(1)
    n_t, n_s, n_m, se = 3, 400, 2, 0.1 / 2 ** 0.5
    t, s, m = rng.normal(0, 0.02, n_t), rng.normal(0, 0.1, (n_t, n_s)), rng.normal(0, 0.1, (n_t, n_s, n_m))
    base = 2 + rng.gamma(2, 0.5, n_s)
    rows = []
    for i in range(n_t):
        for j in range(n_s):
            for k in range(n_m):
                b = base[j] + rng.normal(0, se)
                a = base[j] + 0.1 + t[i] + s[i, j] + m[i, j, k] + rng.normal(0, se)
                rows += [{"method": "sprpo", "train_seed": i, "state": j, "seed": k, "family": "gaussian",
                          "strength": 0.2, "kl": a, "kl_se": se},
                         {"method": "vanilla", "train_seed": i, "state": j, "seed": k, "family": "gaussian",
                          "strength": 0.2, "kl": b, "kl_se": se}]
    p = kl_power(pd.DataFrame(rows), "sprpo", "vanilla", "gaussian", 0.2)
    assert p["train_seeds"] == 3 and p["states"] == 400 and p["draws"] == 2
    assert p["v_k"] == pytest.approx(0.01, rel=1e-9)
    assert p["v_m"] == pytest.approx(0.1 ** 2, rel=0.2) and p["v_s"] == pytest.approx(0.1 ** 2, rel=0.15)
    assert p["diff"] == pytest.approx(0.1 + t.mean(), abs=0.01)
    closed = Z80 * (p["v_t"] / 3 + p["v_s"] / 50 + (p["v_m"] + p["v_k"] * 4 / 8) / (2 * 50 * 3)) ** 0.5 / p["kl_b"]
    assert kl_mde(p, states=50, samples=8, draws=2, pilot_samples=4) == pytest.approx(closed)
    design = kl_design([p], pilot_samples=4, seconds_per_state=lambda k: 1.0 + 0.1 * k, target=0.05)
    for r in design.itertuples():
        if r.states is not None and not pd.isna(r.states):
            s_ = int(r.states)
            assert kl_mde(p, states=s_, samples=r.samples, draws=r.draws, pilot_samples=4) <= 0.05
            assert s_ == 1 or kl_mde(p, states=s_ - 1, samples=r.samples, draws=r.draws, pilot_samples=4) > 0.05
            assert r.seconds_per_setting == pytest.approx(s_ * r.draws * (1.0 + 0.1 * r.samples))
    assert design["seconds_per_setting"].is_monotonic_increasing
    q = {**p, "kl_b": 2 * p["kl_b"]}  # a second comparison, half as hard
    front = kl_frontier([p, q], pilot_samples=4, seconds_per_state=lambda k: 1.0 + 0.1 * k, states=(10, 100))
    assert len(front) == 3 * 2 * 2 and front["comparisons"].eq(2).all()
    for r in front.itertuples():
        mdes = [kl_mde(x, states=r.states, samples=r.samples, draws=r.draws, pilot_samples=4) for x in (p, q)]
        assert r.mde80_worst == pytest.approx(max(mdes)) and r.mde80_median == pytest.approx(sum(mdes) / 2)
        assert r.meet_target == sum(m <= 0.1 for m in mdes)
        assert r.seconds_per_setting == pytest.approx(r.states * r.draws * (1.0 + 0.1 * r.samples))
        assert r.mde80_floor == pytest.approx(Z80 * (p["v_t"] / 3) ** 0.5 / p["kl_b"]) and r.mde80_floor < r.mde80_worst


def test_what_the_target_needs_inverts_the_mde():
    """kl_states_for is the first state count whose MDE (kl_mde) meets the target; kl_seeds_for is
    the first seed count whose MDE meets it with states, samples and draws unlimited; the sentence
    sorts the comparisons by which of the two binds."""
    import pandas as pd

    from sprpo_lib.paper.divergence import kl_mde, kl_seeds_for, kl_states_for, kl_target_sentence

    base = {"train_seeds": 3, "states": 32, "draws": 1, "kl_b": 0.5, "v_m": 0.0}
    easy = {**base, "v_t": 0.0001, "v_s": 0.12, "v_k": 0.3}  # more states do it
    seedy = {**base, "v_t": 0.04, "v_s": 0.12, "v_k": 0.3}  # the seeds' spread alone is above 10%
    wide = {**base, "v_t": 0.0, "v_s": 300.0, "v_k": 0.3}  # no seed spread, but states beyond 4096
    kw = dict(samples=2, draws=1, pilot_samples=2)
    s = kl_states_for(easy, **kw)
    assert s is not None and kl_mde(easy, states=s, **kw) <= 0.1 < kl_mde(easy, states=s - 1, **kw)
    assert kl_states_for(seedy, **kw) is None and kl_states_for(wide, **kw) is None
    unlimited = dict(states=10 ** 15, samples=10 ** 6, draws=10 ** 6, pilot_samples=2)
    n = int(kl_seeds_for(seedy))
    assert n > 3 and kl_mde({**seedy, "train_seeds": n}, **unlimited) <= 0.1 \
        < kl_mde({**seedy, "train_seeds": n - 1}, **unlimited)
    assert kl_seeds_for(wide) == 1 and kl_seeds_for({**seedy, "kl_b": 0.0}) == float("inf")
    table = pd.DataFrame([{**p, "states_for_target": kl_states_for(p, **kw), "seeds_for_target": kl_seeds_for(p)}
                          for p in (easy, seedy, wide)])
    text = kl_target_sentence(table)
    assert text.startswith("At Table 1's settings, 1 of 3 SPrPO comparisons would detect 10% ")
    assert f"({s} states, against 32 here)" in text and f"1 needs more training seeds: their seeds' own spread " \
        f"alone asks for {n} seeds per method" in text and text.endswith("1 needs more than 4096 states.")


def test_flips_from_the_teacher_forced_greedy_response_match_full_greedy_decoding(monkeypatch):
    """compare() decodes greedily only the states whose clean greedy response the perturbed argmax
    leaves; its flips equal those of decoding every state (here the action is the whole response
    text, so any change of the greedy response is a flip), at strengths from none to most."""
    from types import SimpleNamespace

    monkeypatch.setattr(D, "extract_action", lambda text: SimpleNamespace(action=text))
    pol = load_policy("tiny-qwen2", seed=0, dtype="float32")
    model, tok = pol.model.eval(), pol.tokenizer
    prompts = [tok(f"Task {i}: buy item {i * 7} " + "x " * i)["input_ids"] for i in range(6)]
    kw = dict(temperature=0.7, max_new_tokens=6, ended=D.Stop(tok, None, [tok.eos_token_id]), pad_id=tok.pad_token_id)
    cleans = D.clean_sides(model, prompts, k=2, seeds=range(6), **kw)
    seen = set()
    for strength in (0.0, 0.02, 0.1, 0.5):
        with perturbation(model, "gaussian", strength, seed=7):
            got = [r["flip"] for r in D.compare(model, prompts, cleans, **kw)]
            _, actions = D.greedy(model, D.prefill(model, prompts, tok.pad_token_id), 6, kw["ended"])
        want = [a != c.action for a, c in zip(actions, cleans)]
        assert got == want, strength
        seen |= set(want)
    assert seen == {False, True}  # both cases met


def test_greedy_after_a_shared_prefix_is_greedy_decoding_from_the_prompt():
    """greedy_after (a known prefix of each response fed in one forward, decoding from its end)
    gives each row the response greedy() decodes token by token from the prompt (float64: no
    rounding between the two orders): prefixes of every length in one batch, each row its own, and
    a stop string that a prefix begins and the continuation completes."""
    pol = load_policy("tiny-qwen2", seed=0, dtype="float32")
    model, tok = pol.model.double().eval(), pol.tokenizer
    prompts = [tok(f"Order {i}: " + "item " * (2 * i + 1))["input_ids"] for i in range(3)]
    eos = D.Stop(tok, None, [tok.eos_token_id])
    pre = D.prefill(model, prompts, tok.pad_token_id)
    full, _ = D.greedy(model, pre, 8, eos)
    assert min(len(r) for r in full) >= 6  # long enough for every cut below
    stop = tok.decode(full[0][3:5].tolist())  # begins in a prefix of 4 tokens, completes after it
    for ended in (eos, D.Stop(tok, stop, [tok.eos_token_id])):
        want, want_actions = D.greedy(model, pre, 8, ended)
        for cuts in ([0, 0, 0], [4, 1, 5], [1, 5, 0]):
            prefixes = [r[:c].tolist() for r, c in zip(want, cuts)]
            width = max(len(r) for r in want)
            teacher = torch.zeros(len(prompts), width, dtype=torch.long)
            for i, r in enumerate(want):
                teacher[i, :len(r)] = r
            logits = D.response_logits(model, pre, teacher)
            fed = D.subset(pre, range(3))  # extend() leaves each row where its prefix ends: the next token's logits
            D.extend(model, fed, prefixes)
            nxt = D.advance(model, fed, teacher[range(3), cuts][:, None])[:, -1]
            torch.testing.assert_close(nxt, logits[range(3), [c + 1 for c in cuts]], rtol=0, atol=1e-10)
            got, actions = D.greedy_after(model, D.subset(pre, range(3)), prefixes,
                                          torch.stack([logits[i, c] for i, c in enumerate(cuts)]), 8, ended)
            assert [g.tolist() for g in got] == [w.tolist() for w in want], (stop if ended.stop else None, cuts)
            assert actions == want_actions
    assert len(D.greedy(model, pre, 8, D.Stop(tok, stop, [tok.eos_token_id]))[0][0]) < len(full[0])  # the stop acts


def test_the_kl_curves_footnote_says_what_each_point_averages():
    """Table 1's strengths (every policy, three seeds for two of them) apart from the curve's other
    strengths (fewer policies, one seed): each design with the policies measured so."""
    import pandas as pd

    from sprpo_lib.paper.divergence import design_note

    flat = pd.DataFrame([{"family": f, "strength": s, "method": m, "states": 16, "train_seeds": t, "draws": 1}
                         for f, s, methods in (("rtn", 6.0, ("vanilla", "sam", "sprpo")), ("rtn", 8.0, ("vanilla", "sprpo")))
                         for m in methods for t in [3 if m != "sam" and s == 6.0 else 1]])
    assert design_note(flat, [("rtn", 6)]) == (
        "States x training seeds x draws per point: at Table 1's strengths 16 x 1 x 1 (SAM), 16 x 3 x 1 (Vanilla, "
        "SPrPO); at the other strengths 16 x 1 x 1 (Vanilla, SPrPO).")


def test_a_kl_curve_joins_one_design_and_draws_the_others_hollow(tmp_path, monkeypatch):
    """Vanilla at Table 1's strength has three seeds, at its other strengths one: the line joins
    the one-seed points only (tagged with that design, so the figure check finds nothing) and the
    three-seed point stands apart, hollow, with its own interval."""
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from sprpo_lib.paper import divergence as D
    from sprpo_lib.paper.figcheck import data_lines, figure_problems
    from sprpo_lib.paper.style import METHOD_COLORS

    rows = [{"method": m, "family": "gaussian", "strength": s, "w2": 0.0, "kl": kl, "lo": kl * 0.8, "hi": kl * 1.2,
             "flip": 0.1, "states": 16, "train_seeds": 3 if (m == "vanilla" and s == 0.2) else 1, "draws": 1}
            for m in ("vanilla", "sprpo") for s, kl in ((0.05, 0.1), (0.1, 0.4), (0.2, 1.5), (0.3, 3.0))]
    drawn = {}
    real_save = D.save_figure

    def keep(fig, path, **kw):
        drawn["fig"] = fig
        return real_save(fig, path, **kw)

    monkeypatch.setattr(D, "save_figure", keep)
    D.plot_kl_curves(pd.DataFrame(rows), tmp_path / "curves.png", table=[("gaussian", 0.2)])
    ax = drawn["fig"].get_axes()[0]
    lines = {m: line for line in data_lines(ax) for m, c in METHOD_COLORS.items()
             if m in ("vanilla", "sprpo") and line.get_color() == c}
    assert len(data_lines(ax)) == 2 and sorted(lines) == ["sprpo", "vanilla"]
    assert [t.get_text() for t in drawn["fig"].legends[0].get_texts()] == ["Vanilla", "SPrPO"]
    assert list(lines["vanilla"].get_xdata()) == [0.05, 0.1, 0.3] and lines["vanilla"].get_gid() == "design:16x1"
    assert list(lines["sprpo"].get_xdata()) == [0.05, 0.1, 0.2, 0.3]
    hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"]
    assert [(list(h.get_xdata()), list(h.get_ydata())) for h in hollow] == [([0.2], [1.5])]
    assert [p for p in figure_problems(drawn["fig"]) if "design" in p] == []
