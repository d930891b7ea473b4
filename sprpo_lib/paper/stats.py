"""Statistics of robustness evaluations (Table 1, App. "More Experiment Results"): pure
functions on the tidy episode rows of :func:`sprpo_lib.evaluate.evaluate`.

* :func:`policy_success`: success rate (%) and mean score of each evaluated policy
  (one trained model: a method and a training seed) per setting, over all its episodes
  (tasks x evaluation seeds);
* :func:`mean_std`: mean +- sample standard deviation (ddof = 1) over training seeds,
  the paper's "over three seeds" (its ALFWorld standard deviations are consistent only
  with ddof = 1, e.g. 87.59 +- 0.97 is 238, 239, 243 of 274 tasks);
* :func:`add_retention`: retention = perturbed / clean success of the same method, the
  ratio of the seed means in percent (Table 1: 18.73 / 57.00 = 32.9);
  :func:`policy_retention` gives the per-policy ratio;
* :func:`paired_bootstrap`: two methods on the same tasks and seeds; percentile
  interval of the difference in success and in retention from resampling training seeds
  and tasks (a two-way bootstrap: both are random samples, crossed), and the goals whose
  outcome differs between the two with :func:`sign_test` on them;
* :func:`seed_paired`: the rows of two methods paired by training seed, a single policy
  (the warm start, a one-seed baseline) repeated under every seed of the other side;
* :func:`paired_kl_bootstrap`: the same design on the divergence rows of
  :func:`sprpo_lib.evaluate.divergence.divergence` (a policy's KL under a perturbation per
  agent state): difference and ratio of mean KL, training seeds x states resampled, the
  smallest difference the design detects, and the sign test on the states whose greedy
  action flips under one method and not the other.

Rows need the columns ``env, split, task_index, family, strength, seed, success`` plus a
method column and a training-seed column (the ``tags`` of an evaluation; names are
parameters).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

__all__ = ["policy_success", "mean_std", "add_retention", "policy_retention", "summarize", "paired_bootstrap",
           "seed_paired", "sign_test", "paired_kl_bootstrap", "crossed_weights", "crossed_means", "N_RESAMPLES", "Z80"]

#: Bootstrap resamples of :func:`paired_bootstrap` (percentile intervals at 95% move by
#: well under 0.5 percentage points between seeds at this size).
N_RESAMPLES = 10_000
#: z_{0.975} + z_{0.8}: a difference of this many standard errors is detected at 80% power by a
#: two-sided test at 5% (the minimum detectable effect, MDE80).
Z80 = 2.8016
SETTING = ("family", "strength")


def _need(df: pd.DataFrame, cols: Sequence[str], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: rows lack column(s) {missing}; have {list(df.columns)}")


def policy_success(rows: pd.DataFrame, by: Sequence[str] = ("env",), method: str = "method",
                   train_seed: str = "train_seed") -> pd.DataFrame:
    """Per policy (``method``, ``train_seed``) and setting (``by`` + family, strength):
    ``success`` (% of episodes), ``score`` (mean) and ``episodes``.  ``by=("env",)``
    pools ALFWorld's ID and OOD tasks (the overall table); ``("env", "split")`` keeps
    them apart."""
    keys = [method, train_seed, *by, *SETTING]
    _need(rows, [*keys, "success", "score"], "policy_success")
    g = rows.groupby(keys, sort=True, dropna=False)
    out = g.agg(success=("success", "mean"), score=("score", "mean"), episodes=("success", "size")).reset_index()
    out["success"] = 100.0 * out["success"]
    return out


def mean_std(per_policy: pd.DataFrame, value: str = "success", by: Sequence[str] = ("env",),
             method: str = "method", train_seed: str = "train_seed") -> pd.DataFrame:
    """Mean and sample standard deviation (ddof = 1; NaN for one seed) of ``value``
    over training seeds, with ``n`` the number of seeds."""
    keys = [method, *by, *SETTING]
    _need(per_policy, [*keys, value, train_seed], "mean_std")
    g = per_policy.groupby(keys, sort=True, dropna=False)[value]
    return g.agg(mean="mean", std=lambda x: x.std(ddof=1), n="size").reset_index()


def crossed_weights(rng: np.random.Generator, n_seeds: int, n_units: int,
                    n_resamples: int) -> tuple[np.ndarray, np.ndarray]:
    """The multiplicities of a two-way crossed bootstrap: each replicate draws the units (goals,
    states) and the training seeds with replacement, ``[R, n_seeds]`` and ``[R, n_units]`` (the
    units first; one seed: all ones, nothing drawn)."""
    ct = np.stack([np.bincount(d, minlength=n_units) for d in rng.integers(0, n_units, (n_resamples, n_units))])
    cs = (np.stack([np.bincount(d, minlength=n_seeds) for d in rng.integers(0, n_seeds, (n_resamples, n_seeds))])
          if n_seeds > 1 else np.ones((n_resamples, 1), dtype=int))
    return cs, ct


def crossed_means(grid: np.ndarray, cs: np.ndarray, ct: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Each replicate's mean of ``grid`` ``[seeds, units]`` under the weights of
    :func:`crossed_weights`, NaN cells left out, times ``scale`` (100: a percentage)."""
    ok = ~np.isnan(grid)
    num = np.einsum("rs,st,rt->r", cs, np.nan_to_num(grid), ct)
    den = np.einsum("rs,st,rt->r", cs, ok.astype(float), ct)
    with np.errstate(invalid="ignore", divide="ignore"):
        return scale * num / den


def success_intervals(rows: pd.DataFrame, by: Sequence[str] = ("env",), method: str = "method",
                      train_seed: str = "train_seed", unit: Sequence[str] = ("env", "split", "task_index"),
                      n_resamples: int = 2000, seed: int = 0, level: float = 0.95) -> pd.DataFrame:
    """Per (``method``, ``by``, family, strength): the 95% interval of the success (%) mean with a
    two-way bootstrap, training seeds and test goals resampled crossed (each replicate draws both
    with replacement), so the interval carries seed and goal variance; ``lo``, ``hi``.  A policy
    with one seed gets the goals' interval alone."""
    keys = [method, *by, *SETTING]
    unit = [c for c in unit if c in rows.columns]
    _need(rows, [*keys, train_seed, "success", *unit], "success_intervals")
    rng = np.random.default_rng(seed)
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    out = []
    for key, g in rows.groupby(keys, sort=True, dropna=False):
        grid = g.groupby([train_seed, *unit])["success"].mean().unstack(list(range(1, 1 + len(unit))))
        m = grid.to_numpy(float)
        boot = crossed_means(m, *crossed_weights(rng, *m.shape, n_resamples), scale=100.0)
        lo, hi = np.nanquantile(boot, q)
        out.append({**dict(zip(keys, key)), "lo": float(lo), "hi": float(hi)})
    return pd.DataFrame(out, columns=[*keys, "lo", "hi"])


def add_retention(summary: pd.DataFrame, by: Sequence[str] = ("env",), method: str = "method",
                  clean: tuple[str, float] = ("clean", 0.0)) -> pd.DataFrame:
    """``retention`` = 100 * mean / (the same method's clean mean in the same ``by``
    group): the share of clean performance kept (Table 1, in parentheses).  NaN when
    the clean row is missing or zero."""
    keys = [method, *by]
    _need(summary, [*keys, *SETTING, "mean"], "add_retention")
    is_clean = (summary["family"] == clean[0]) & (summary["strength"] == clean[1])
    ref = summary[is_clean][[*keys, "mean"]].rename(columns={"mean": "_clean"})
    if ref.duplicated(keys).any():
        raise ValueError("add_retention: more than one clean row per group; summarise before adding retention")
    out = summary.merge(ref, on=keys, how="left")
    out["retention"] = 100.0 * out["mean"] / out["_clean"].where(out["_clean"] != 0)
    return out.drop(columns="_clean")


def policy_retention(per_policy: pd.DataFrame, by: Sequence[str] = ("env",), method: str = "method",
                     train_seed: str = "train_seed", clean: tuple[str, float] = ("clean", 0.0)) -> pd.DataFrame:
    """Per-policy retention: 100 * success / the same policy's clean success."""
    return add_retention(per_policy.rename(columns={"success": "mean"}), (train_seed, *by), method,
                         clean).rename(columns={"mean": "success"})


def summarize(rows: pd.DataFrame, by: Sequence[str] = ("env",), method: str = "method",
              train_seed: str = "train_seed") -> pd.DataFrame:
    """Episode rows -> one row per (method, ``by``, family, strength): success ``mean``,
    ``std`` over training seeds, ``n`` seeds, ``tasks`` (distinct test tasks, where rows
    have ``task_index``), ``retention``, and the seed-mean score ``score``.  The input of
    :mod:`sprpo_lib.paper.tables`."""
    per = policy_success(rows, by, method, train_seed)
    out = mean_std(per, "success", by, method, train_seed)
    score = mean_std(per, "score", by, method, train_seed)[[method, *by, *SETTING, "mean"]]
    out = out.merge(score.rename(columns={"mean": "score"}), on=[method, *by, *SETTING])
    if "task_index" in rows.columns:  # how many goals stand behind each mean (settings may differ)
        unit = [c for c in ("env", "split", "task_index") if c in rows.columns]
        keys = [method, *by, *SETTING]
        tasks = rows[list(dict.fromkeys([*keys, *unit]))].drop_duplicates().groupby(keys, dropna=False).size()
        out = out.merge(tasks.rename("tasks").reset_index(), on=keys, how="left")
    return add_retention(out, by, method)


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test: the probability, under no difference (each discordant
    goal favours either side with probability 1/2), of a split at least as uneven as
    ``wins``:``losses`` (1.0 without a discordant goal)."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def bootstrap_p(diffs: np.ndarray) -> float:
    """Two-sided p-value of "no difference" from bootstrap replicates of a difference: twice the
    smaller share of replicates on either side of 0, each counted with the observed one
    (``(k + 1) / (B + 1)``, never 0), at most 1: below 0.05 about where the 95% percentile
    interval excludes 0."""
    d = np.asarray(diffs, float)
    d = d[~np.isnan(d)]
    below, above = (int((d <= 0).sum()) + 1) / (len(d) + 1), (int((d >= 0).sum()) + 1) / (len(d) + 1)
    return min(1.0, 2.0 * min(below, above))


def holm(p: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjustment of ``p`` for its family of comparisons (the family-wise error
    rate): the i-th smallest p times (m - i + 1), kept non-decreasing in that order, at most 1;
    a missing p stays missing and does not count."""
    p = np.asarray(p, float)
    out = np.full(p.shape, np.nan)
    have = np.flatnonzero(~np.isnan(p))
    order = have[np.argsort(p[have], kind="stable")]
    m = len(order)
    out[order] = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    return out


def _cell_sums(rows: pd.DataFrame, seed_col: str | None, unit: Sequence[str], seeds: list,
               tasks: pd.Index) -> tuple[np.ndarray, np.ndarray]:
    """Successes and episodes per (training seed, task): ``[seeds, tasks]`` arrays."""
    s = np.zeros((len(seeds), len(tasks)))
    n = np.zeros((len(seeds), len(tasks)))
    for i, sd in enumerate(seeds):
        part = rows if seed_col is None else rows[rows[seed_col] == sd]
        g = part.groupby(list(unit))["success"].agg(["sum", "size"]).reindex(tasks)
        s[i], n[i] = g["sum"].to_numpy(float), g["size"].to_numpy(float)
    return s, n


def paired_bootstrap(rows: pd.DataFrame, a: str, b: str, family: str, strength: float, *,
                     method: str = "method", pair: Sequence[str] = ("train_seed", "seed"),
                     unit: Sequence[str] = ("env", "split", "task_index"),
                     clean: tuple[str, float] = ("clean", 0.0), n_resamples: int = N_RESAMPLES,
                     seed: int = 0, level: float = 0.95, seeds: str | None = "train_seed") -> dict:
    """Paired bootstrap of method ``a`` minus method ``b`` at one setting.

    Both methods must have been evaluated on the same tasks with the same
    (training seed, evaluation seed) pairs, clean and perturbed.  Each of ``n_resamples``
    replicates draws the tasks (``unit``) with replacement and, with ``seeds`` (a column of
    ``pair``: the training seed), the training seeds with replacement too, independently
    (a two-way bootstrap of a crossed design: every episode of a drawn (seed, task) cell
    comes along, both methods and clean and perturbed alike, which keeps the pairing; the
    policies of both methods are paired by their seed label).  So the interval carries
    training-seed variance as well as task variance; with one training seed it carries
    task variance only (``train_seeds`` says how many).  ``seeds=None`` resamples tasks
    alone.  A ``numpy`` generator seeded with ``seed`` draws the tasks, then the seeds.

    Statistics, in percentage points: ``success`` = success(a) - success(b) at the
    setting; ``retention`` = retention(a) - retention(b), each the pooled perturbed /
    clean success ratio of the method.  Intervals are percentile intervals at ``level``
    (resamples whose clean success is zero give no retention and are left out, counted in
    ``retention_undefined``).  ``wins`` / ``losses``: the tasks on which a's success
    (pooled over seeds) is above / below b's at the setting, and ``sign_p`` the exact sign
    test on them (:func:`sign_test`).

    Long on purpose: the resampled indices of tasks and seeds are shared by every statistic,
    so they are drawn and used in one place.
    """
    if n_resamples < 1 or not 0 < level < 1:
        raise ValueError(f"paired_bootstrap: need n_resamples >= 1 and 0 < level < 1, got {n_resamples}, {level}")
    if seeds is not None and seeds not in pair:
        raise ValueError(f"paired_bootstrap: seeds={seeds!r} must be one of the pairing columns {list(pair)} or None")
    _need(rows, [method, *pair, *unit, *SETTING, "success"], "paired_bootstrap")
    parts = {}
    for m in (a, b):
        for name, (fam, s) in (("pert", (family, strength)), ("clean", clean)):
            sel = rows[(rows[method] == m) & (rows["family"] == fam) & (rows["strength"] == s)]
            if sel.empty:
                raise ValueError(f"paired_bootstrap: no rows of method {m!r} at {fam} {s}")
            parts[m, name] = sel
    ref = parts[a, "pert"]
    keyset = set(map(tuple, ref[[*unit, *pair]].to_numpy().tolist()))
    for k, sel in parts.items():
        if set(map(tuple, sel[[*unit, *pair]].to_numpy().tolist())) != keyset:
            raise ValueError(f"paired_bootstrap: {k[0]!r} ({k[1]}) was not evaluated on the same tasks and "
                             f"{'/'.join(pair)} as {a!r} at {family} {strength}: a paired comparison needs them equal")
    keys = sorted(set(map(tuple, ref[list(unit)].to_numpy().tolist())))
    tasks = pd.MultiIndex.from_tuples(keys, names=list(unit)) if len(unit) > 1 else pd.Index([k[0] for k in keys])
    seed_ids = sorted(set(ref[seeds])) if seeds is not None else [None]
    sums = {k: _cell_sums(v, seeds, unit, seed_ids, tasks) for k, v in parts.items()}

    def stats(cs, ct):  # cs: [..., seeds] and ct: [..., tasks] draw counts
        tot = {k: (((cs @ s) * ct).sum(-1), ((cs @ n) * ct).sum(-1)) for k, (s, n) in sums.items()}
        rate = {k: 100.0 * s / n for k, (s, n) in tot.items()}
        with np.errstate(divide="ignore", invalid="ignore"):
            ret = {m: np.where(tot[m, "clean"][0] > 0, 100.0 * tot[m, "pert"][0] / tot[m, "clean"][0]
                               * tot[m, "clean"][1] / tot[m, "pert"][1], np.nan) for m in (a, b)}
        return rate[a, "pert"] - rate[b, "pert"], ret[a] - ret[b]

    t, k_s = len(tasks), len(seed_ids)
    point_s, point_r = stats(np.ones(k_s), np.ones(t))
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, t, size=(n_resamples, t))
    ct = np.stack([np.bincount(d, minlength=t) for d in draws]).astype(float)
    cs = (np.stack([np.bincount(d, minlength=k_s) for d in rng.integers(0, k_s, size=(n_resamples, k_s))])
          .astype(float) if k_s > 1 else np.ones((n_resamples, 1)))
    boot_s, boot_r = stats(cs, ct)
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    ok = ~np.isnan(boot_r)
    (sa, na), (sb, nb) = sums[a, "pert"], sums[b, "pert"]
    per_task = sa.sum(0) / na.sum(0) - sb.sum(0) / nb.sum(0)
    wins, losses = int((per_task > 0).sum()), int((per_task < 0).sum())
    return {
        "a": a, "b": b, "family": family, "strength": strength, "tasks": t,
        "train_seeds": k_s if seeds is not None else len(set(ref[pair[0]])),
        "interval": "training seeds x tasks" if seeds is not None and k_s > 1 else "tasks",
        "episodes_per_method": len(ref), "n_resamples": n_resamples, "seed": seed, "level": level,
        "success": float(point_s), "success_ci": tuple(float(v) for v in np.quantile(boot_s, q)),
        "success_se": float(boot_s.std(ddof=1)) if n_resamples > 1 else float("nan"),
        "retention": float(point_r),
        "retention_ci": tuple(float(v) for v in np.quantile(boot_r[ok], q)) if ok.any() else (np.nan, np.nan),
        "retention_undefined": int((~ok).sum()),
        "wins": wins, "losses": losses, "sign_p": sign_test(wins, losses),
    }


def seed_paired(rows: pd.DataFrame, a: str, b: str, *, method: str = "method",
                seeds: str = "train_seed") -> tuple[pd.DataFrame, str | None]:
    """The rows of methods ``a`` and ``b`` paired by training seed: on the seeds both share,
    or, where one of them has a single policy and the other several seeds, that policy's rows
    repeated under each of the other's seeds (its name is returned beside the rows)."""
    own = {m: sorted(set(rows.loc[rows[method] == m, seeds])) for m in (a, b)}
    one = next((m for m in (a, b) if len(own[m]) == 1 and len(own[a if m == b else b]) > 1), None)
    if one is None:
        shared = set(own[a]) & set(own[b])
        return rows[rows[method].isin([a, b]) & rows[seeds].isin(shared)], None
    many = a if one == b else b
    single = rows[rows[method] == one]
    return pd.concat([rows[rows[method] == many], *(single.assign(**{seeds: t}) for t in own[many])],
                     ignore_index=True), one


def paired_kl_bootstrap(rows: pd.DataFrame, a: str, b: str, family: str, strength: float, *,
                        method: str = "method", seeds: str | None = "train_seed", unit: str = "state",
                        n_resamples: int = N_RESAMPLES, seed: int = 0, level: float = 0.95) -> dict:
    """Paired bootstrap of method ``a`` against ``b`` on the KL of their policies under one
    perturbation setting, state by state (both on the same states and training seeds; draws of a
    random family averaged per state first).  Each replicate draws the states and, with ``seeds``,
    the training seeds with replacement (two-way, crossed), so the interval carries seed and state
    variance.  Returns ``diff`` = mean KL(a) - mean KL(b) and ``ratio`` = mean KL(a) / mean KL(b)
    with percentile intervals, ``diff_p`` (:func:`bootstrap_p`), ``mde80`` (:data:`Z80` bootstrap
    standard errors of the difference) and its share of b's mean (``mde80_rel``), and on the flips
    (the greedy action changes under the perturbation): ``wins`` / ``losses`` the states where a
    flips less / more often than b, pooled over seeds and draws, and ``sign_p`` the exact sign test
    on them."""
    if n_resamples < 2 or not 0 < level < 1:
        raise ValueError(f"paired_kl_bootstrap: need n_resamples >= 2 and 0 < level < 1, got {n_resamples}, {level}")
    _need(rows, [method, unit, "family", "strength", "kl", *([seeds] if seeds else [])], "paired_kl_bootstrap")
    sel = rows[(rows["family"] == family) & (rows["strength"] == strength)]
    for m in (a, b):
        if not (sel[method] == m).any():
            raise ValueError(f"paired_kl_bootstrap: no divergence rows of method {m!r} at {family} {strength}")
    own = {m: sorted(set(sel.loc[sel[method] == m, seeds])) if seeds else [None] for m in (a, b)}
    seed_ids = max(own.values(), key=len)
    for m in (a, b):  # a single policy (the warm start) is the reference of every seed of the other side
        if len(own[m]) != len(seed_ids) and len(own[m]) != 1 or len(own[m]) == len(seed_ids) and own[m] != seed_ids:
            raise ValueError(f"paired_kl_bootstrap: training seeds {own[a]} of {a!r} and {own[b]} of {b!r} differ; a "
                             "paired comparison needs the same seeds, or one policy on one side")
    if seeds:
        sel = seed_paired(sel, a, b, method=method, seeds=seeds)[0]
    by = [seeds, unit] if seeds else [unit]
    cells = {}
    for m in (a, b):
        part = sel[sel[method] == m]
        agg = {"kl": ("kl", "mean"), **({"flip": ("flip", "mean")} if "flip" in part else {})}
        cells[m] = part.groupby(by).agg(**agg)
    states = sorted(set(cells[a].index.get_level_values(-1)))
    if set(cells[b].index.get_level_values(-1)) != set(states):
        raise ValueError(f"paired_kl_bootstrap: {a!r} and {b!r} were not measured on the same states at {family} "
                         f"{strength}: a paired comparison needs them equal")

    def grid(m, col):  # [seeds, states]
        if not seeds:
            return cells[m][col].reindex(states).to_numpy(float)[None]
        return cells[m][col].unstack(unit).reindex(index=seed_ids, columns=states).to_numpy(float)

    ka, kb = grid(a, "kl"), grid(b, "kl")
    if np.isnan(ka).any() or np.isnan(kb).any():
        raise ValueError(f"paired_kl_bootstrap: {a!r} or {b!r} lacks some (seed, state) cells at {family} {strength}")
    n_s, n_t = ka.shape
    cs, ct = crossed_weights(np.random.default_rng(seed), n_s, n_t, n_resamples)
    ma, mb = crossed_means(ka, cs, ct), crossed_means(kb, cs, ct)
    pa, pb = float(ka.mean()), float(kb.mean())
    q = [(1 - level) / 2, 1 - (1 - level) / 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = ma / mb
    se = float((ma - mb).std(ddof=1))
    out = {"a": a, "b": b, "family": family, "strength": strength, "states": n_t, "train_seeds": n_s,
           "seeds_a": len(own[a]), "seeds_b": len(own[b]),
           "interval": "training seeds x states" if n_s > 1 else "states", "n_resamples": n_resamples,
           "kl_a": pa, "kl_b": pb, "diff": pa - pb, "diff_ci": tuple(float(v) for v in np.quantile(ma - mb, q)),
           "diff_p": bootstrap_p(ma - mb),
           "ratio": pa / pb if pb > 0 else float("nan"),
           "ratio_ci": tuple(float(v) for v in np.nanquantile(ratios, q)) if pb > 0 else (np.nan, np.nan),
           "mde80": Z80 * se, "mde80_rel": Z80 * se / pb if pb > 0 else float("nan")}
    if "flip" in cells[a] and "flip" in cells[b]:
        fa, fb = np.nanmean(grid(a, "flip"), 0), np.nanmean(grid(b, "flip"), 0)
        wins, losses = int((fa < fb).sum()), int((fa > fb).sum())
        out.update(flip_a=float(fa.mean()), flip_b=float(fb.mean()), wins=wins, losses=losses,
                   sign_p=sign_test(wins, losses))
    return out
