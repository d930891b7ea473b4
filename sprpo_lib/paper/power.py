"""Power analysis: which design of training seeds and test goals can resolve a claim.

A paired comparison of two methods estimates the mean over training seeds s and test
goals t of ``d[s, t]`` (a success difference of one cell, or one policy's success), modelled
as a crossed two-way random-effects design::

    d[s, t] = delta + u_s + v_t + e[s, t],   Var u = var_seed, Var v = var_goal, Var e = var_cell

(``e`` holds the seed-by-goal interaction and the episode noise of a cell).  The estimate
over S seeds and T goals has ``Var = var_seed / S + var_goal / T + var_cell / (S T)``; the
smallest true difference a two-sided 5% test detects with 80% power is ``MDE = (z_0.975 +
z_0.8) * sqrt(Var)``.  :func:`variance_components` estimates the three variances from a
pilot's ``[seeds, goals]`` matrix by the method of moments of the two-way ANOVA (the
expected mean squares; negative estimates truncated at 0).  A pilot with one training seed
cannot separate ``var_seed``: :func:`difference_components` then takes it from methods
evaluated with several seeds (two independently trained policies: the sum of their
between-seed variances).  :func:`best_design` picks, from a grid of designs and a cost per
design, the one that resolves the most claims within a budget.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = ["Z_POWER80", "Components", "cell_matrix", "variance_components", "difference_components", "mde",
           "designs_needed", "best_design"]

#: z_{0.975} + z_{0.80}: a two-sided test at 5% with 80% power.
Z_POWER80 = 1.959964 + 0.841621


@dataclass(frozen=True)
class Components:
    """Variances of the crossed design, in the squared unit of ``d`` (pp^2 for success in %)."""

    var_seed: float
    var_goal: float
    var_cell: float
    #: the pilot's shape, and whether var_seed was measured (``False``: assumed 0 or borrowed)
    seeds: int = 0
    goals: int = 0
    seed_measured: bool = True

    def variance(self, seeds: int, goals: int) -> float:
        """Variance of the mean over ``seeds`` x ``goals`` cells."""
        if seeds < 1 or goals < 1:
            raise ValueError(f"a design needs at least one training seed and one goal, got {seeds} x {goals}")
        return self.var_seed / seeds + self.var_goal / goals + self.var_cell / (seeds * goals)


def cell_matrix(rows: pd.DataFrame, method: str, family: str, strength: float, minus: str | None = None, *,
                unit: Sequence[str] = ("env", "split", "task_index")) -> np.ndarray:
    """``[training seeds, goals]`` success (%) of ``method`` at a setting from evaluation rows
    (:mod:`sprpo_lib.paper.stats`' columns), each cell the mean over its evaluation seeds;
    with ``minus``, that method's cells subtracted (paired on the seed label and goal: the
    seeds both have)."""
    def one(m: str) -> pd.DataFrame:
        sel = rows[(rows["method"] == m) & (rows["family"] == family) & (rows["strength"] == strength)]
        if sel.empty:
            raise ValueError(f"cell_matrix: no rows of method {m!r} at {family} {strength}")
        return 100.0 * sel.groupby(["train_seed", *unit])["success"].mean().unstack(list(unit))

    a = one(method)
    if minus is not None:
        b = one(minus)
        seeds = sorted(set(a.index) & set(b.index))
        a = a.loc[seeds] - b.loc[seeds]
    if a.isna().any().any():
        raise ValueError(f"cell_matrix: {method!r} at {family} {strength} was not evaluated on the same goals for every "
                         "training seed")
    return a.to_numpy(float)


def variance_components(d: np.ndarray) -> Components:
    """Method-of-moments estimates from a ``[seeds, goals]`` matrix of cell values (one value
    per cell: average a cell's evaluation episodes first).  With one seed, ``var_seed`` is 0
    and ``seed_measured`` False; with one goal, likewise for ``var_goal``."""
    d = np.asarray(d, dtype=float)
    if d.ndim != 2 or d.size == 0 or np.isnan(d).any():
        raise ValueError(f"variance_components: need a complete [seeds, goals] matrix, got shape {d.shape}")
    S, T = d.shape
    m = d.mean()
    ms_seed = T * ((d.mean(1) - m) ** 2).sum() / (S - 1) if S > 1 else math.nan
    ms_goal = S * ((d.mean(0) - m) ** 2).sum() / (T - 1) if T > 1 else math.nan
    resid = d - d.mean(1, keepdims=True) - d.mean(0, keepdims=True) + m
    # one seed (or one goal): the cell variance cannot be told apart from the other factor's,
    # which then holds both
    ms_cell = (resid ** 2).sum() / ((S - 1) * (T - 1)) if S > 1 and T > 1 else 0.0
    var_seed = max(0.0, (ms_seed - ms_cell) / T) if S > 1 else 0.0
    var_goal = max(0.0, (ms_goal - ms_cell) / S) if T > 1 else 0.0
    return Components(var_seed, var_goal, ms_cell, S, T, seed_measured=S > 1)


def difference_components(diff: np.ndarray, seed_var_a: float, seed_var_b: float) -> Components:
    """Components of a difference of two independently trained methods measured on one
    training seed: goal and cell variance from the pilot's ``[1, goals]`` differences (their
    sum: one seed cannot tell them apart, so all of it counts as goal variance, the
    conservative choice for designs with more seeds), and seed variance as the sum of the
    two methods' between-seed variances measured elsewhere (:func:`variance_components` of a
    method's own ``[seeds, goals]`` success matrix)."""
    c = variance_components(np.atleast_2d(diff))
    if c.seeds > 1:
        return c
    return Components(seed_var_a + seed_var_b, c.var_goal, c.var_cell, c.seeds, c.goals, seed_measured=False)


def mde(c: Components, seeds: int, goals: int) -> float:
    """Smallest true difference detected with 80% power at two-sided 5% (normal approximation)."""
    return Z_POWER80 * math.sqrt(c.variance(seeds, goals))


def designs_needed(c: Components, effect: float, seeds: Sequence[int], max_goals: int) -> dict[int, int | None]:
    """Per number of training seeds, the fewest goals (at most ``max_goals``) whose MDE is at
    most ``abs(effect)``; None where none is (seed variance alone can keep the MDE above
    the effect: ``Z * sqrt(var_seed / S)`` is a floor no number of goals lowers)."""
    out: dict[int, int | None] = {}
    for s in seeds:
        out[s] = next((t for t in range(1, max_goals + 1) if mde(c, s, t) <= abs(effect)), None)
    return out


def best_design(claims: Mapping[str, tuple[Components, float]], cost_s: Callable[[int, int, int], float],
                budget_s: float, seeds: Sequence[int], goals: Sequence[int], iterations: Sequence[int]) -> dict:
    """The design (training seeds, test goals, RL iterations) from the grid that resolves the
    most claims (``claims``: name -> (components, the effect to detect)) at a cost
    ``cost_s(seeds, goals, iterations)`` within ``budget_s``; ties go to the cheaper design.
    Iterations enter the cost only (the components are the pilot's, at its length).
    Returns the design, its cost, the claims it resolves and every claim's MDE there."""
    best = None
    for s, t, k in itertools.product(seeds, goals, iterations):
        cost = cost_s(s, t, k)
        if cost > budget_s:
            continue
        mdes = {name: mde(c, s, t) for name, (c, _) in claims.items()}
        resolved = [name for name, (_, eff) in claims.items() if mdes[name] <= abs(eff)]
        key = (len(resolved), -cost)
        if best is None or key > best[0]:
            best = (key, {"seeds": s, "goals": t, "iterations": k, "cost_s": cost, "resolved": resolved,
                          "mde": mdes})
    if best is None:
        raise ValueError(f"best_design: no design of the grid fits the budget of {budget_s:.0f} s; the cheapest "
                         f"costs {min(cost_s(s, t, k) for s, t, k in itertools.product(seeds, goals, iterations)):.0f} s")
    return best[1]
