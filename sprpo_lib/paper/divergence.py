"""The paper's robustness claims read in the policy's own terms (notebook 09): how far each
method's policy moves under each perturbation, KL per agent state
(:func:`sprpo_lib.paper.experiments.divergence_rows`), where success on a few dozen goals
cannot resolve.

* :func:`kl_summary`: mean KL per method and setting with a two-way (training seeds x states)
  bootstrap interval, the flip rate;
* :func:`kl_claims`: C2-KL (SPrPO against Vanilla), T1-KL (against Gaussian and SAM) at every
  Table 1 setting and curve strength, C4-KL (a flatter surface: KL averaged over Fig. 4's plane),
  and RL-KL (whether RL made a policy more sensitive than its warm start), each a
  :func:`~sprpo_lib.paper.stats.paired_kl_bootstrap` with a reading by a fixed rule;
* :func:`kl_power`, :func:`kl_mde`, :func:`kl_design`: a pass read as a pilot: the variance
  components of a paired KL difference (seeds, states, draws, K samples), the MDE of any design,
  and the cheapest K, M and states that detect 10% of the baseline's KL; per comparison, the
  states or training seeds 10% needs (:func:`kl_states_for`, :func:`kl_seeds_for`);
* :func:`kl_success_correlation`: does the divergence track success?  Spearman's rank correlation
  of a policy's mean KL with its success loss over the settings where both were measured;
* :func:`plot_kl_curves`, :func:`plot_kl_surface`: Fig. 3 and Fig. 4 in KL.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from scipy.stats import rankdata

from sprpo_lib.core.compress import FAMILIES
from sprpo_lib.infra.io import atomic_write_json, atomic_write_text
from sprpo_lib.paper.claims import kl_claim_rows, kl_markdown
from sprpo_lib.paper.experiments import Plan
from sprpo_lib.paper.figcheck import design_gid
from sprpo_lib.paper.results import save_figure
from sprpo_lib.paper.stats import (N_RESAMPLES, Z80, crossed_means, crossed_weights, holm, paired_kl_bootstrap,
                                  seed_paired)
from sprpo_lib.paper.style import METHOD_COLORS, METHOD_MARKERS, pyplot, role
from sprpo_lib.paper.tables import ENV_LABELS, FAMILY_LABELS, METHOD_LABELS, to_csv

#: The comparisons of :func:`kl_claims`: (id, method, baseline, what it reads).
KL_CLAIMS = (("C2-KL", "sprpo", "vanilla", "SPrPO moves less than Vanilla under the perturbation"),
             ("T1-KL", "sprpo", "gaussian", "SPrPO moves less than the Gaussian baseline"),
             ("T1-KL", "sprpo", "sam", "SPrPO moves less than SAM"),
             ("RL-KL", "vanilla", "warm_start", "RL (Vanilla) moves more than its warm start"),
             ("RL-KL", "sprpo", "warm_start", "RL (SPrPO) moves more than its warm start"))
#: A relative MDE at or below this makes "no difference" an informative reading.
INFORMATIVE_MDE = 0.10
KL_CLAIM_COLUMNS = ["env", "id", "claim", "a", "b", "setting", "where", "states", "train_seeds", "seeds_a", "seeds_b",
                    "kl_a", "kl_b",
                    "diff", "lo", "hi", "ratio", "ratio_lo", "ratio_hi", "mde80", "mde80_rel", "flip_a", "flip_b",
                    "wins", "losses", "sign_p", "p", "p_holm", "reading"]


def _setting(family: str, strength: float) -> str:
    return f"{family} {strength:g}"


def kl_summary(rows: pd.DataFrame, *, n_resamples: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per method and setting (``family, strength, w2``): mean KL over training seeds and states
    with its 95% two-way bootstrap interval (states and seeds resampled), the flip rate, and the
    states, seeds and draws it rests on."""
    out = []
    rng = np.random.default_rng(seed)
    for (m, fam, s, w2), g in rows.groupby(["method", "family", "strength", "w2"], sort=False):
        cell = g.groupby(["train_seed", "state"])[["kl", "flip"]].mean()
        grid = cell["kl"].unstack("state").to_numpy(float)
        n_s, n_t = grid.shape
        boot = crossed_means(grid, *crossed_weights(rng, n_s, n_t, n_resamples))
        lo, hi = np.nanquantile(boot, [0.025, 0.975])
        out.append({"method": m, "family": fam, "strength": float(s), "w2": float(w2), "kl": float(np.nanmean(grid)),
                    "lo": float(lo), "hi": float(hi), "flip": float(cell["flip"].mean()), "states": n_t,
                    "train_seeds": n_s, "draws": int(g["seed"].nunique())})
    return pd.DataFrame(out)


def kl_reading(r: dict) -> str:
    """What one paired KL comparison says, by a fixed rule: an interval that excludes 0 reads as
    a direction; one across 0 reads "no difference" only where the design detects 10% of the
    baseline's KL (:data:`INFORMATIVE_MDE`), else "not resolved" with what it could detect."""
    lo, hi = r["diff_ci"]
    if r["kl_b"] == 0 and r["kl_a"] == 0:
        return "no divergence under either policy"
    if lo > 0 or hi < 0:
        side = "less" if hi < 0 else "more"
        return f"{r['a']} moves {side} (ratio {r['ratio']:.3g} [{r['ratio_ci'][0]:.3g}, {r['ratio_ci'][1]:.3g}])"
    if r["mde80_rel"] <= INFORMATIVE_MDE:
        return f"no difference: the interval holds 0 and the design detects {100 * r['mde80_rel']:.1f}% of the baseline"
    return f"not resolved: the design detects only {100 * r['mde80_rel']:.0f}% of the baseline's KL"


def _claim_row(env: str, cid: str, claim: str, r: dict, where: str) -> dict:
    return {"env": env, "id": cid, "claim": claim, "a": r["a"], "b": r["b"],
            "setting": _setting(r["family"], r["strength"]), "where": where, "states": r["states"],
            "train_seeds": r["train_seeds"], "seeds_a": r["seeds_a"], "seeds_b": r["seeds_b"],
            "kl_a": r["kl_a"], "kl_b": r["kl_b"], "diff": r["diff"],
            "lo": r["diff_ci"][0], "hi": r["diff_ci"][1], "ratio": r["ratio"], "ratio_lo": r["ratio_ci"][0],
            "ratio_hi": r["ratio_ci"][1], "mde80": r["mde80"], "mde80_rel": r["mde80_rel"],
            "flip_a": r.get("flip_a"), "flip_b": r.get("flip_b"), "wins": r.get("wins"), "losses": r.get("losses"),
            "sign_p": r.get("sign_p"), "p": r["diff_p"], "p_holm": np.nan, "reading": kl_reading(r)}


def kl_claims(rows: pd.DataFrame, env: str, table: Sequence[tuple[str, float]], *,
              n_resamples: int = N_RESAMPLES) -> pd.DataFrame:
    """Every KL claim row of one environment: each comparison of :data:`KL_CLAIMS` whose two
    methods were measured at the setting, at every setting off the plane (``where``: ``table`` for
    Table 1's, ``curve`` for Fig. 3's other strengths, where the plan may measure fewer policies), and
    C4-KL on the plane's mean (SPrPO against Vanilla).  ``p`` is each comparison's bootstrap p-value,
    ``p_holm`` the same adjusted for all the environment's comparisons (:func:`~sprpo_lib.paper.stats.holm`):
    the readings stay per comparison, the family-wise count is :func:`~sprpo_lib.paper.claims.kl_multiplicity`'s."""
    out = []
    flat = rows[rows["family"] != "plane"]
    table = {(f, float(s)) for f, s in table}
    for (fam, s), at in flat.groupby(["family", "strength"], sort=False):
        where, have = "table" if (fam, float(s)) in table else "curve", set(at["method"])
        for cid, a, b, claim in KL_CLAIMS:
            if {a, b} <= have:
                out.append(_claim_row(env, cid, claim, paired_kl_bootstrap(flat, a, b, fam, s, n_resamples=n_resamples),
                                      where))
    plane = rows[rows["family"] == "plane"]
    if {"sprpo", "vanilla"} <= set(plane["method"]):
        mean = plane.groupby(["method", "train_seed", "state"], as_index=False)[["kl", "flip"]].mean()
        mean = mean.assign(family="plane mean", strength=0.0)
        r = paired_kl_bootstrap(mean, "sprpo", "vanilla", "plane mean", 0.0, n_resamples=n_resamples)
        out.append(_claim_row(env, "C4-KL", "SPrPO's surface is flatter: less KL over Fig. 4's plane", r, "plane"))
    claims = pd.DataFrame(out, columns=KL_CLAIM_COLUMNS)
    claims["p_holm"] = holm(claims["p"].to_numpy(float)) if len(claims) else claims["p"]
    return claims


def kl_power(rows: pd.DataFrame, a: str, b: str, family: str, strength: float) -> dict:
    """The variance components of the paired KL difference ``d = KL_a - KL_b`` at one setting,
    from a pilot's rows (per training seed, state and draw; ``kl_se`` the K-sample standard
    error of each row), for :func:`kl_mde`:

    * ``v_k``: sampling noise of one (seed, state, draw) difference at the pilot's K (``kl_se``
      of both sides), which scales as 1/K;
    * ``v_m``: the variance between draws of a random family beyond that noise (common random
      numbers: both policies see the same draw);
    * ``v_s``: the variance between states of a seed's difference beyond both;
    * ``v_t``: the variance between training seeds of the mean difference beyond the states'.

    A single policy on one side (the warm start) is paired with every seed of the other
    (:func:`~sprpo_lib.paper.stats.seed_paired`)."""
    sel = seed_paired(rows[(rows["family"] == family) & (rows["strength"] == strength)], a, b)[0]
    cells = {m: sel[sel["method"] == m].groupby(["train_seed", "state", "seed"])[["kl", "kl_se"]].mean()
             for m in (a, b)}
    if any(c.empty for c in cells.values()):
        raise ValueError(f"kl_power: no rows of {a!r} or {b!r} at {family} {strength}")
    both = cells[a].add_suffix("_a").join(cells[b].add_suffix("_b"), how="inner")
    if both.empty:
        raise ValueError(f"kl_power: {a!r} and {b!r} share no (seed, state, draw) at {family} {strength}")
    d = both["kl_a"] - both["kl_b"]
    v_k = float((both["kl_se_a"].fillna(0) ** 2 + both["kl_se_b"].fillna(0) ** 2).mean())
    m0 = int(d.groupby(["train_seed", "state"]).size().min())
    v_m = max(0.0, float(d.groupby(["train_seed", "state"]).var(ddof=1).mean()) - v_k) if m0 > 1 else 0.0
    per_state = d.groupby(["train_seed", "state"]).mean()
    s0 = int(per_state.groupby("train_seed").size().min())
    within = float(per_state.groupby("train_seed").var(ddof=1).mean()) if s0 > 1 else float("nan")
    v_s = max(0.0, within - (v_m + v_k) / m0)
    per_seed = per_state.groupby("train_seed").mean()
    n_t = len(per_seed)
    v_t = max(0.0, float(per_seed.var(ddof=1)) - within / s0) if n_t > 1 else 0.0
    kl_b = float(both["kl_b"].mean())
    return {"a": a, "b": b, "family": family, "strength": strength, "train_seeds": n_t, "states": s0,
            "samples": None, "draws": m0, "kl_a": float(both["kl_a"].mean()), "kl_b": kl_b, "diff": float(d.mean()),
            "v_k": v_k, "v_m": v_m, "v_s": v_s, "v_t": v_t}


def kl_mde(power: dict, *, states: int, samples: int, draws: int, pilot_samples: int) -> float:
    """The MDE at 80% power of the paired KL difference, relative to b's mean KL, for a design
    of ``states`` states, K = ``samples`` responses and M = ``draws`` draws at the pilot's seeds
    (:func:`kl_power` components: ``Z80 * sqrt(v_t / n + v_s / S + (v_m + v_k K0 / K) / (M S n))``)."""
    n = power["train_seeds"]
    se2 = (power["v_t"] / n + power["v_s"] / states
           + (power["v_m"] + power["v_k"] * pilot_samples / samples) / (draws * states * n))
    return Z80 * math.sqrt(se2) / abs(power["kl_b"]) if power["kl_b"] else float("inf")


def kl_states_for(power: dict, *, samples: int, draws: int, pilot_samples: int, target: float = INFORMATIVE_MDE,
                  max_states: int = 4096) -> int | None:
    """The fewest states at which one comparison (:func:`kl_power`) detects ``target`` of its
    baseline's KL at 80% power with K = ``samples``, M = ``draws`` and the pilot's training seeds
    (:func:`kl_mde`); None where ``max_states`` states do not."""
    def mde(s: int) -> float:
        return kl_mde(power, states=s, samples=samples, draws=draws, pilot_samples=pilot_samples)

    if mde(max_states) > target:
        return None
    lo, hi = 1, max_states
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mde(mid) <= target else (mid + 1, hi)
    return lo


def kl_seeds_for(power: dict, *, target: float = INFORMATIVE_MDE) -> float:
    """The fewest training seeds per method at which one comparison could detect ``target`` of
    its baseline's KL at 80% power with unlimited states, samples and draws: the seeds' own term of
    :func:`kl_mde` alone, ``ceil(Z80^2 v_t / (target KL_b)^2)`` (at least 1; inf where KL_b is 0).  A
    lower bound, from a spread estimated on the pilot's few seeds."""
    if not power["kl_b"]:
        return math.inf
    return float(max(1, math.ceil(Z80 ** 2 * power["v_t"] / (target * power["kl_b"]) ** 2 - 1e-9)))


def kl_design(powers: Sequence[dict], *, pilot_samples: int, seconds_per_state, target: float = INFORMATIVE_MDE,
              samples: Sequence[int] = (1, 2, 4, 8), draws: Sequence[int] = (1, 2, 4),
              max_states: int = 4096) -> pd.DataFrame:
    """Per K and M, the fewest states per split at which every comparison of ``powers`` detects
    ``target`` of its baseline's KL at 80% power (:func:`kl_states_for`), and what that costs:
    ``seconds_per_state(K)`` (one setting of one policy) times the states; sorted cheapest
    first.  ``states`` is None where the training seeds' own spread already exceeds the target."""
    out = []
    random = any(p["draws"] > 1 for p in powers)
    for k in samples:
        for m in (draws if random else (1,)):
            need = 0
            for p in powers:
                s = kl_states_for(p, samples=k, draws=m, pilot_samples=pilot_samples, target=target,
                                  max_states=max_states)
                if s is None:
                    need = None
                    break
                need = max(need, s)
            cost = None if need is None else need * m * seconds_per_state(k)
            out.append({"samples": k, "draws": m, "states": need, "seconds_per_setting": cost})
    return pd.DataFrame(out).sort_values("seconds_per_setting", na_position="last", kind="stable").reset_index(drop=True)


def kl_frontier(powers: Sequence[dict], *, pilot_samples: int, seconds_per_state,
                states: Sequence[int] = (8, 16, 32, 64, 128, 256, 512, 1024), samples: Sequence[int] = (1, 2, 4),
                draws: Sequence[int] = (1, 2), target: float = INFORMATIVE_MDE) -> pd.DataFrame:
    """What a fixed design detects where no design meets ``target``: per K, M and states, the
    worst and median relative MDE over the comparisons of ``powers`` (:func:`kl_mde`), how many of
    them meet ``target``, the seconds one policy's setting costs, and the floor no number of
    states passes (the training seeds' own spread, ``Z80 * sqrt(v_t / n) / KL_b``)."""
    floor = max(Z80 * math.sqrt(p["v_t"] / p["train_seeds"]) / abs(p["kl_b"]) if p["kl_b"] else math.inf
                for p in powers)
    out = []
    for k in samples:
        for m in draws:
            for s in states:
                mdes = [kl_mde(p, states=s, samples=k, draws=m, pilot_samples=pilot_samples) for p in powers]
                out.append({"samples": k, "draws": m, "states": s, "seconds_per_setting": s * m * seconds_per_state(k),
                            "mde80_worst": max(mdes), "mde80_median": float(np.median(mdes)),
                            "meet_target": sum(x <= target for x in mdes), "comparisons": len(mdes),
                            "mde80_floor": floor})
    return pd.DataFrame(out).sort_values(["seconds_per_setting", "mde80_worst"], kind="stable").reset_index(drop=True)


def kl_power_table(rows: pd.DataFrame, plan: Plan) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """These rows as a pilot: per SPrPO comparison (C2-KL, T1-KL) at Table 1's settings, the
    variance components (:func:`kl_power`), the relative MDE of this design, the states (all
    splits) that would detect :data:`INFORMATIVE_MDE` at its K, M and seeds (:func:`kl_states_for`)
    and the training seeds its seeds' spread alone asks for (:func:`kl_seeds_for`); and per K and M
    the states per split that would detect :data:`INFORMATIVE_MDE` in every one of them, with the
    seconds one policy's setting would take (this pass's seconds per state, scaled by the tokens a
    state costs: the prompt, K responses and the greedy one); and :func:`kl_frontier`, what each
    affordable design detects where none meets the target."""
    k0 = plan.divergence_samples
    powers = []
    for fam, st in plan.table:
        have = set(rows.loc[(rows["family"] == fam) & (rows["strength"] == float(st)), "method"])
        for cid, a, b, _ in KL_CLAIMS:
            if cid in ("C2-KL", "T1-KL") and {a, b} <= have:
                p = kl_power(rows, a, b, fam, float(st))
                p["mde80_rel"] = kl_mde(p, states=p["states"], samples=k0, draws=p["draws"], pilot_samples=k0)
                p["states_for_target"] = kl_states_for(p, samples=k0, draws=p["draws"], pilot_samples=k0)
                p["seeds_for_target"] = kl_seeds_for(p)
                powers.append({"id": cid, **p, "samples": k0})
    table = pd.DataFrame(powers)
    if table.empty:
        return table, pd.DataFrame(), pd.DataFrame()
    timed = rows.dropna(subset=["cell_seconds"]) if "cell_seconds" in rows else rows.iloc[:0]
    per_state = (timed.groupby("cell")["cell_seconds"].first() / timed.groupby("cell").size()).median() \
        if len(timed) else float("nan")
    prompt, response = float(rows["prompt_tokens"].mean()), float(rows["tokens"].mean())

    def seconds(k: int) -> float:
        return per_state * (prompt + (k + 1) * response) / (prompt + (k0 + 1) * response)

    splits = max(1, rows["split"].nunique())
    design = kl_design(powers, pilot_samples=k0, seconds_per_state=seconds)
    design.insert(3, "states_per_split", [None if pd.isna(n) else math.ceil(n / splits) for n in design["states"]])
    return table, design, kl_frontier(powers, pilot_samples=k0, seconds_per_state=seconds)


def kl_target_sentence(power: pd.DataFrame, target: float = INFORMATIVE_MDE, max_states: int = 4096) -> str:
    """What the pilot's comparisons (:func:`kl_power_table`'s first table) would need to detect
    ``target`` of the baseline's KL: those that more states would do at this K, M and seeds; those
    whose seeds' own spread asks for more training seeds per method; the rest, more than
    ``max_states`` states."""
    if power.empty:
        return ""
    n, seeds, states = len(power), int(power["train_seeds"].max()), int(power["states"].max())
    need = pd.to_numeric(power["states_for_target"], errors="coerce")
    more = pd.to_numeric(power["seeds_for_target"], errors="coerce")
    reach, seed_bound = need.dropna(), more[need.isna() & (more > seeds)]
    parts = [f"At Table 1's settings, {len(reach)} of {n} SPrPO comparisons would detect {100 * target:.0f}% of the "
             f"baseline's KL at 80% power with more states at this design's K, M and {seeds} training seeds"
             + (f" ({_span(reach)} states, against {states} here)" if len(reach) else "")]
    if len(seed_bound):
        finite = seed_bound[np.isfinite(seed_bound)]
        parts.append(f"{len(seed_bound)} {'needs' if len(seed_bound) == 1 else 'need'} more training seeds"
                     + (f": their seeds' own spread alone asks for {_span(finite)} seeds per method (median "
                        f"{finite.median():.0f}; lower bounds)" if len(finite) else ""))
    rest = n - len(reach) - len(seed_bound)
    if rest:
        parts.append(f"{rest} {'needs' if rest == 1 else 'need'} more than {max_states} states")
    return "; ".join(parts) + "."


def _span(values: pd.Series) -> str:
    lo, hi = int(values.min()), int(values.max())
    return f"{lo}" if lo == hi else f"{lo} to {hi}"


def kl_success_correlation(kl: pd.DataFrame, success: pd.DataFrame, *, n_resamples: int = N_RESAMPLES,
                           seed: int = 0) -> dict:
    """Spearman's rank correlation, over the (policy, setting) pairs measured both ways, between
    a policy's mean KL at a setting and its success loss there (clean minus perturbed success, in
    percentage points, on the same policy), with a 95% bootstrap interval over the pairs.

    The same policy means the same weights: success rows pair only where their ``model_hash`` and
    ``adapter_hash`` (empty: no adapter) equal the KL rows' (``stale``: the policies whose success
    rows name other weights, e.g. a pass before a retrain); rows without the hashes pair nothing
    (``unnamed``)."""
    ids = ["model_hash", "adapter_hash"]
    if not all(c in frame for frame in (kl, success) for c in ids) or kl["model_hash"].isna().any() \
            or success["model_hash"].isna().any():
        return {"pairs": 0, "spearman": float("nan"), "lo": float("nan"), "hi": float("nan"), "stale": 0,
                "unnamed": True}
    kl, success = (f.assign(adapter_hash=f["adapter_hash"].fillna("")) for f in (kl, success))  # "": no adapter
    named = kl.groupby(["method", "train_seed"])[ids].first().reset_index()
    policies = success[["method", "train_seed", *ids]].drop_duplicates()
    same = policies.merge(named, on=["method", "train_seed", *ids])
    stale = len(policies.merge(named[["method", "train_seed"]], on=["method", "train_seed"])) - len(same)
    success = success.merge(same, on=["method", "train_seed", *ids])
    k = (kl[kl["family"] != "plane"].groupby(["method", "train_seed", "family", "strength"])["kl"].mean()
         .rename("kl"))
    per = success.groupby(["method", "train_seed", "family", "strength"])["success"].mean() * 100
    if "clean" not in per.index.get_level_values("family"):  # no policy paired (all stale), or none clean
        return {"pairs": 0, "spearman": float("nan"), "lo": float("nan"), "hi": float("nan"), "stale": stale,
                "unnamed": False}
    clean = per.xs("clean", level="family").droplevel("strength")
    loss = (clean.reindex(per.index.droplevel(["family", "strength"])).to_numpy() - per.to_numpy())
    loss = pd.Series(loss, index=per.index, name="loss")
    both = pd.concat([k, loss], axis=1, join="inner").dropna()
    n = len(both)
    if n < 3:
        return {"pairs": n, "spearman": float("nan"), "lo": float("nan"), "hi": float("nan"), "stale": stale,
                "unnamed": False}
    x, y = both["kl"].rank().to_numpy(), both["loss"].rank().to_numpy()
    rho = float(np.corrcoef(x, y)[0, 1])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, (n_resamples, n))  # ranks of all resamples at once (average ranks, as pandas)
    rxs, rys = (rankdata(both[c].to_numpy()[idx], axis=1) for c in ("kl", "loss"))
    boot = [np.corrcoef(rx, ry)[0, 1] for rx, ry in zip(rxs, rys) if rx.std() > 0 and ry.std() > 0]
    lo, hi = np.quantile(boot, [0.025, 0.975]) if boot else (float("nan"), float("nan"))
    return {"pairs": n, "spearman": rho, "lo": float(lo), "hi": float(hi), "stale": stale, "unnamed": False}


def correlation_sentence(c: dict) -> str:
    """One plain sentence on :func:`kl_success_correlation`."""
    if c.get("unnamed"):
        return ("Whether KL tracks success is not computed: the success rows or the KL rows do not name their "
                "policies' weights (an older pass); run notebooks 04 and 09 again.")
    stale = (f" ({c['stale']} polic{'y' if c['stale'] == 1 else 'ies'} left out: its success rows are of other "
             "weights; run notebook 04 again)") if c.get("stale") else ""
    if c["pairs"] < 3 or math.isnan(c["spearman"]):
        return (f"Too few (policy, setting) pairs measured both ways ({c['pairs']}) to say whether KL tracks "
                f"success{stale}.")
    what = ("tracks success loss" if c["lo"] > 0 else "runs against success loss" if c["hi"] < 0
            else "does not resolve a relation with success loss")
    return (f"Mean KL {what}: Spearman {c['spearman']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}] over {c['pairs']} "
            f"(policy, setting) pairs{stale}.")


def design_note(flat: pd.DataFrame, table: Sequence[tuple[str, float]]) -> str:
    """What each point of :func:`plot_kl_curves` averages, at Table 1's strengths and at the others:
    states x training seeds x draws, and the policies measured so."""
    at_table = {(f, float(s)) for f, s in table}
    where = ["at Table 1's strengths" if (f, float(s)) in at_table else "at the other strengths"
             for f, s in zip(flat["family"], flat["strength"])]
    parts = []
    for w, g in flat.assign(where=where).groupby("where", sort=False):
        designs = [f"{s} x {t} x {d} ({', '.join(METHOD_LABELS.get(m, m) for m in dict.fromkeys(d_g['method']))})"
                   for (s, t, d), d_g in g.groupby(["states", "train_seeds", "draws"], sort=True)]
        parts.append(f"{w} " + ", ".join(designs))
    return "States x training seeds x draws per point: " + "; ".join(parts) + "."


def plot_kl_curves(summary: pd.DataFrame, path: str | Path, *, title: str = "",
                   table: Sequence[tuple[str, float]] = ()) -> list[Path]:
    """Fig. 3 in KL: per family (the paper's panels), mean KL per method against strength with
    its 95% interval (log scale: KL spans orders of magnitude); a footnote gives states, seeds
    and draws per point (:func:`design_note`, ``table``: Table 1's settings)."""
    flat = summary[summary["family"] != "plane"]
    fams = [f for f in FAMILY_LABELS if f in set(flat["family"])]
    if not fams:
        raise ValueError("plot_kl_curves: no divergence rows off the plane; run experiments.divergence_rows first")
    plt = pyplot()
    fig, axes = plt.subplots(1, len(fams), figsize=(2.6 * len(fams) + 0.6, 3.2), squeeze=False)
    for ax, fam in zip(axes[0], fams):
        part = flat[flat["family"] == fam]
        for m, g in part.groupby("method", sort=False):
            g = g.sort_values("strength")
            design = list(zip(g["states"], g["train_seeds"]))
            main = max(dict.fromkeys(design), key=design.count)  # the line joins one design's points
            style = dict(color=METHOD_COLORS.get(m), marker=METHOD_MARKERS.get(m, "o"), ms=4, capsize=2)
            for joined, sub in g.groupby([d == main for d in design], sort=False):
                err = np.vstack([sub["kl"] - sub["lo"], sub["hi"] - sub["kl"]]).clip(min=0)
                if joined:
                    bars = ax.errorbar(sub["strength"], sub["kl"], yerr=err, lw=1.2, label=METHOD_LABELS.get(m, m),
                                       **style)
                    bars.lines[0].set_gid(design_gid(*main))
                else:  # another design (Table 1's seeds): its own hollow points, not on the line
                    ax.errorbar(sub["strength"], sub["kl"], yerr=err, linestyle="none", mfc="white", mew=1.1,
                                lw=0.9, label="_" + METHOD_LABELS.get(m, m), **style)
        if (part["kl"] > 0).all():
            ax.set_yscale("log")
        if fam == "rtn":
            ax.invert_xaxis()  # fewer bits is the stronger perturbation
        ax.set(title=FAMILY_LABELS.get(fam, fam), xlabel=FAMILIES[fam].axis if fam in FAMILIES else "strength")
    axes[0][0].set_ylabel(r"KL$(\pi\,\|\,\pi^{\xi})$ per state")  # once, at the left: every panel measures the same
    inch = 1.0 / fig.get_figheight()
    top = 1.0 - (0.45 * inch if title else 0.0)
    if title:
        fig.suptitle(title, fontsize=9, y=0.995)
    handles, labels = axes[0][0].get_legend_handles_labels()  # one legend over the panels, under the title
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, top), ncol=len(labels), frameon=False,
               fontsize=7)
    note = fig.text(0.5, 0.005, design_note(flat, table) + " Lines join one design's points; hollow points are of "
                    "another. Bars: 95% two-way bootstrap (seeds x states).", fontsize=7, ha="center", va="bottom",
                    wrap=True)
    fig.canvas.draw()  # the wrapped footnote's height sets the bottom margin (x labels above it)
    note_h = note.get_window_extent().height / fig.dpi
    wide = 1.0 / fig.get_figwidth()
    fig.subplots_adjust(left=0.75 * wide, right=1 - 0.15 * wide, bottom=(note_h + 0.55) * inch, top=top - 0.6 * inch,
                        wspace=0.45)
    return save_figure(fig, path)


def plot_kl_surface(summary: pd.DataFrame, methods: Sequence[str], path: str | Path, *, title: str = "") -> list[Path]:
    """Fig. 4 in KL: mean KL over the plane ``w1 xi1 + w2 xi2`` per method, one heat map each on
    one colour scale, each cell printed with its value, the unperturbed centre outlined."""
    plane = summary[summary["family"] == "plane"]
    if plane.empty:
        raise ValueError("plot_kl_surface: no 'plane' rows; give the plan a landscape_grid")
    plt = pyplot()
    vmax = float(plane["kl"].max()) or 1.0
    fig, axes = plt.subplots(1, len(methods), figsize=(3.4 * len(methods) + 0.8, 3.8), squeeze=False)
    im = None
    for ax, m in zip(axes[0], methods):
        z = plane[plane["method"] == m].pivot_table(index="w2", columns="strength", values="kl")
        if z.empty:
            ax.set_axis_off()
            continue
        im = ax.imshow(z.to_numpy(), origin="lower", cmap="magma", vmin=0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(z.shape[1]), [f"{v:g}" for v in z.columns])
        ax.set_yticks(range(z.shape[0]), [f"{v:g}" for v in z.index])
        for (i, j), v in np.ndenumerate(z.to_numpy()):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color="w" if v < vmax / 2 else "k")
        if 0.0 in z.columns and 0.0 in z.index:
            j, i = list(z.columns).index(0.0), list(z.index).index(0.0)
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec=role("accent"), lw=2))
        ax.set(xlabel="$w_1$", ylabel="$w_2$", title=METHOD_LABELS.get(m, m))
        ax.grid(False)
    fig.subplots_adjust(bottom=0.22, top=0.84, wspace=0.35)
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), label="mean KL per state", shrink=0.85)
    n = plane.groupby(["states", "train_seeds"]).size().index.tolist()
    fig.text(0.01, 0.01, "; ".join(f"{s} states x {t} training seed(s) per cell" for s, t in n)
             + "; outlined: the unperturbed policy.", fontsize=7, ha="left", va="bottom")
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def render(rows: pd.DataFrame, plan: Plan, out: Path, *, success: pd.DataFrame | None = None) -> list[Path]:
    """Notebook 09's artifacts for one environment from its divergence rows: the summary
    (``_summary.csv``), Fig. 3 and Fig. 4 in KL, the KL claims (``_claims.csv/.md``), this pass
    read as a pilot (``_power.csv``, ``_design.csv``, ``_frontier.csv``: :func:`kl_power_table`) and the
    KL-success correlation (``_correlation.json``, against notebook 04's rows where given)."""
    env, stem = plan.env, out / f"09_divergence_{plan.env}"
    summary = kl_summary(rows)
    to_csv(summary, f"{stem}_summary.csv", digits=6)
    label = f"{ENV_LABELS.get(env, env)}, {plan.profile} profile"
    arts = [Path(f"{stem}_summary.csv")]
    arts += plot_kl_curves(summary, f"{stem}_curves", title=f"{label}: how far each policy moves (Fig. 3 in KL)",
                           table=plan.table)
    if (summary["family"] == "plane").any():
        arts += plot_kl_surface(summary, list(plan.landscape_methods), f"{stem}_surface",
                                title=f"{label}: KL over the plane w1*xi1 + w2*xi2 (Fig. 4 in KL)")
    claims = kl_claims(rows, env, plan.table)
    to_csv(claims, f"{stem}_claims.csv", digits=6)
    power, design, frontier = kl_power_table(rows, plan)
    if len(power):  # this pass as a pilot: what each comparison detects, and the design that detects 10%
        to_csv(power, f"{stem}_power.csv", digits=6)
        to_csv(design, f"{stem}_design.csv", digits=3)
        to_csv(frontier, f"{stem}_frontier.csv", digits=3)
        arts += [Path(f"{stem}_power.csv"), Path(f"{stem}_design.csv"), Path(f"{stem}_frontier.csv")]
    atomic_write_text(f"{stem}_claims.md", kl_markdown(kl_claim_rows(claims))
                      + (f"\n{kl_target_sentence(power)}\n" if len(power) else ""))
    arts += [Path(f"{stem}_claims.csv"), Path(f"{stem}_claims.md")]
    if success is not None:
        corr = kl_success_correlation(rows, success)
        atomic_write_json(f"{stem}_correlation.json", {**corr, "sentence": correlation_sentence(corr)})
        arts.append(Path(f"{stem}_correlation.json"))
    return arts
