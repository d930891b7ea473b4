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

from sprpo_lib.paper.claims import PAPER
from sprpo_lib.paper.tables import markdown_table

__all__ = ["Z_POWER80", "Components", "cell_matrix", "variance_components", "difference_components", "mde",
           "designs_needed", "best_design", "ClaimSpec", "claim_specs", "claim_power", "power_summary",
           "power_markdown"]

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


def _cells(rows: pd.DataFrame, method: str, family: str, strength: float, unit: Sequence[str]) -> pd.DataFrame:
    sel = rows[(rows["method"] == method) & (rows["family"] == family) & (rows["strength"] == strength)]
    if sel.empty:
        raise ValueError(f"cell_matrix: no rows of method {method!r} at {family} {strength}")
    return 100.0 * sel.groupby(["train_seed", *unit])["success"].mean().unstack(list(unit))


def cell_matrix(rows: pd.DataFrame, method: str, family: str, strength: float,
                minus: str | tuple[str, str, float] | None = None, *,
                unit: Sequence[str] = ("env", "split", "task_index")) -> np.ndarray:
    """``[training seeds, goals]`` success (%) of ``method`` at a setting from evaluation rows
    (:mod:`sprpo_lib.paper.stats`' columns), each cell the mean over its evaluation seeds;
    with ``minus`` (a method at the same setting, or ``(method, family, strength)``), its
    cells subtracted, paired on the seed label and goal (the seeds and goals both have)."""
    a = _cells(rows, method, family, strength, unit)
    if minus is not None:
        bm, bf, bs = (minus, family, strength) if isinstance(minus, str) else minus
        b = _cells(rows, bm, bf, bs, unit)
        seeds = sorted(set(a.index) & set(b.index))
        goals = [g for g in a.columns if g in set(b.columns)]
        a = a.loc[seeds, goals] - b.loc[seeds, goals]
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
    ``cost_s(seeds, goals, iterations)`` within ``budget_s``.  Ties go to the design with
    the most power margin (the smallest largest MDE / effect among the claims it resolves),
    then to the cheaper one: a pilot's variances are estimates (optimistic when its policies
    barely differed), so budget left over buys margin rather than sitting idle.
    Iterations enter the cost only (the components are the pilot's, at its length).
    Returns the design, its cost, the claims it resolves and every claim's MDE there."""
    best = None
    for s, t, k in itertools.product(seeds, goals, iterations):
        cost = cost_s(s, t, k)
        if cost > budget_s:
            continue
        mdes = {name: mde(c, s, t) for name, (c, _) in claims.items()}
        resolved = [name for name, (_, eff) in claims.items() if mdes[name] <= abs(eff)]
        margin = max((mdes[name] / abs(claims[name][1]) for name in resolved), default=math.inf)
        key = (len(resolved), -round(margin, 6), -cost)
        if best is None or key > best[0]:
            best = (key, {"seeds": s, "goals": t, "iterations": k, "cost_s": cost, "resolved": resolved,
                          "mde": mdes})
    if best is None:
        raise ValueError(f"best_design: no design of the grid fits the budget of {budget_s:.0f} s; the cheapest "
                         f"costs {min(cost_s(s, t, k) for s, t, k in itertools.product(seeds, goals, iterations)):.0f} s")
    return best[1]


@dataclass(frozen=True)
class ClaimSpec:
    """One of the paper's claims as a paired comparison: ``a`` minus ``b`` (each ``(method,
    family, strength)``) in success points, the paper's difference ``effect``; an
    equivalence claim (``margin``) asks for a 95% interval inside +-margin instead."""

    key: str
    text: str
    source: str  # "main" (notebook 04's rows) or "ablation" (notebook 08's)
    a: tuple[str, str, float]
    b: tuple[str, str, float]
    effect: float
    margin: float | None = None


#: Table 1's perturbation families and settings per environment (the paper's strong settings).
TABLE1 = {"webshop": (("gaussian", 0.2), ("dropout", 0.05), ("fisher", 0.2), ("sparsegpt", 0.4), ("rtn", 6.0)),
          "alfworld": (("gaussian", 0.2), ("dropout", 0.05), ("fisher", 0.2), ("sparsegpt", 0.7), ("rtn", 6.0))}


def claim_specs(env: str) -> list[ClaimSpec]:
    """C1-C3, C5, C6 of ``env`` with the paper's numbers (:data:`sprpo_lib.paper.claims.PAPER`).
    C4 (a flatter reward surface) is read from notebook 05's landscape, not from these rows."""
    t1 = PAPER[env]["table1"]
    clean = ("clean", 0.0)

    def k(fam, s):
        return f"{fam}@{float(s):g}"

    g = ("gaussian", 0.2)
    out = [ClaimSpec("C1", "Vanilla loses success under Gaussian noise sigma = 0.2", "main", ("vanilla", *clean),
                     ("vanilla", *g), t1["vanilla"]["clean@0"] - t1["vanilla"][k(*g)])]
    out += [ClaimSpec(f"C2.{fam}", f"SPrPO keeps more success than Vanilla under {fam} {s:g}", "main", ("sprpo", fam, s),
                      ("vanilla", fam, s), t1["sprpo"][k(fam, s)] - t1["vanilla"][k(fam, s)]) for fam, s in TABLE1[env]]
    out.append(ClaimSpec("C3", "SPrPO's clean success within 2 pp of Vanilla's", "main", ("sprpo", *clean),
                         ("vanilla", *clean), t1["sprpo"]["clean@0"] - t1["vanilla"]["clean@0"], margin=2.0))
    comp = PAPER[env].get("components", {})
    for variant, label in (("alpha0", "w/o sensitivity"), ("no_schedule", "w/o scheduling")):
        if variant in comp:
            out.append(ClaimSpec(f"C5.{variant}", f"full SPrPO beats {label} (clean)", "ablation", ("full", *clean),
                                 (variant, *clean), t1["sprpo"]["clean@0"] - comp[variant]["clean@0"]))
    if env == "webshop":  # App. B: SAM at rho = 0.1 "leads to performance collapse"; read as losing its clean success
        out.append(ClaimSpec("C6", "channel SAM at rho = 0.1 collapses (against rho = 0.005, clean)", "ablation",
                             ("sam_5e-3", *clean), ("sam_0.1", *clean), t1["sam"]["clean@0"]))
    return out


def claim_power(rows: Mapping[str, pd.DataFrame], env: str, seeds: Sequence[int] = (1, 2, 3, 5),
                max_goals: int = 500) -> pd.DataFrame:
    """Per claim of :func:`claim_specs`: the pilot's design (training seeds x goals), its
    variance components (the seed variance borrowed where the pilot has one seed:
    :func:`difference_components`, from the two methods' own seed variances where they
    have several seeds, else 0 and marked), the MDE of that design, whether it resolves the
    claim, and the goals each number of ``seeds`` needs.  An equivalence claim (C3) needs
    its 95% half-width within the margin (and resolves only if the paper's own difference
    is inside it).  ``rows``: ``{"main": notebook 04's rows, "ablation": notebook 08's}``;
    a claim whose rows are missing is skipped."""
    out = []
    for c in claim_specs(env):
        r = rows.get(c.source)
        try:
            d = cell_matrix(r, *c.a, minus=c.b) if r is not None else None
        except ValueError:
            d = None
        if d is None or d.size == 0:
            continue
        comps = variance_components(d)
        if not comps.seed_measured:
            sv = []
            for m, fam, s in (c.a, c.b):
                try:
                    own = variance_components(cell_matrix(r, m, fam, s))
                    sv.append(own.var_seed if own.seed_measured else 0.0)
                except ValueError:
                    sv.append(0.0)
            comps = difference_components(d, *(sv if c.a[0] != c.b[0] else (sv[0], 0.0)))
        S, T = d.shape
        flat = comps.variance(1, 1) == 0
        row = {"env": env, "claim": c.key, "text": c.text, "paper": round(c.effect, 2), "seeds": S, "goals": T,
               "var_seed": comps.var_seed, "var_goal": comps.var_goal, "var_cell": comps.var_cell,
               "seed_measured": comps.seed_measured,
               "note": ("no variation in the pilot: the two policies agreed on every cell, so no design can be sized"
                        if flat else "" if comps.seed_measured else
                        f"one training seed: seed variance {comps.var_seed:.1f} borrowed from the methods' own seeds")}
        if c.margin is None:
            row["mde"] = mde(comps, S, T)
            row["resolvable"] = row["mde"] <= abs(c.effect) if row["mde"] > 0 else False
            need = designs_needed(comps, c.effect, seeds, max_goals)
        else:  # equivalence: the 95% half-width inside the margin
            half = lambda s, t: 1.959964 * math.sqrt(comps.variance(s, t))  # noqa: E731
            row["mde"] = half(S, T)
            row["resolvable"] = 0 < row["mde"] <= c.margin and abs(c.effect) < c.margin
            need = {s: next((t for t in range(1, max_goals + 1) if half(s, t) <= c.margin), None) for s in seeds}
        row.update({f"goals_at_{s}_seeds": None if flat else n for s, n in need.items()})
        out.append(row)
    table = pd.DataFrame(out)
    c2 = table[table["claim"].str.startswith("C2.")] if len(table) else table
    if len(c2):  # C2: at least 4 of the 5 families
        table = pd.concat([table, pd.DataFrame([{"env": env, "claim": "C2", "paper": float("nan"),
                                                 "text": "SPrPO keeps more than Vanilla in at least 4 of 5 families",
                                                 "resolvable": int(c2["resolvable"].sum()) >= 4}])], ignore_index=True)
    return table


def _num(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def power_summary(power: pd.DataFrame, design: pd.DataFrame | None = None) -> str:
    """Two sentences for the README, from the power table and the design table
    (``claims_design_<profile>.csv``): how many claims the pilot's own design resolves, and
    what the best design within the budget resolves and costs on each machine."""
    sized = power[power["claim"] != "C2"] if len(power) else power
    n_res = int(sized["resolvable"].astype(bool).sum()) if len(sized) else 0
    out = [f"At the pilot's own design {n_res} of its {len(sized)} claims could be told from 0 (MDE at 80% power "
           "no larger than the paper's difference, from the pilot's variances; its policies were a few optimizer steps "
           "apart, so these variances are optimistic)."]
    if design is not None and len(design) and "seeds" in design:
        ok = design.dropna(subset=["seeds"])
        for r in ok.to_dict("records"):
            others = "; ".join(f"{k[len('hours on '):]} {r[k]:.0f} h" for k in r if k.startswith("hours on ")
                               and not math.isnan(r[k]))
            out.append(f"{r['iterations']} RL iterations: {int(r['seeds'])} seed(s) x {int(r['goals_per_split'])} "
                       f"goals per split, {r['hours']:.1f} h on {r['machine']} ({others}), {int(r['resolved'])} claims.")
        none = design[design["seeds"].isna()]["iterations"].tolist() if "seeds" in design else []
        if none:
            out.append(f"No design fits {design['budget_h'].iloc[0]:.0f} h at {', '.join(map(str, none))} iterations.")
    return " ".join(out)


def power_markdown(power: pd.DataFrame, design: pd.DataFrame | None = None, profile: str = "cpu") -> str:
    """``claims_power_<profile>.md``: every claim with the pilot's design, its MDE, whether
    it is resolvable there and the goals each number of training seeds would need, then the
    budgeted designs (:func:`sprpo_lib.paper.budget.design_table`)."""
    seeds = sorted(int(c.split("_")[2]) for c in power.columns if c.startswith("goals_at_"))
    lines = [f"# Which of the paper's claims the `{profile}` profile can resolve", "", power_summary(power, design), "",
             "MDE: the smallest true difference (pp of success) a two-sided 5% test detects with 80% power at the "
             "pilot's design, from its two-way variance components (training seeds x goals); C3 is an equivalence "
             "claim (its 95% half-width against the 2 pp margin). Goals needed: per number of training seeds, "
             "\"-\" where no number of goals suffices.", "",
             "| Env | Claim | Paper | Pilot design | MDE | Resolvable | " + " | ".join(
                 f"goals at {s} seed{'s' if s > 1 else ''}" for s in seeds) + " | Note |",
             "|---|---|---|---|---|---|" + "---|" * len(seeds) + "---|"]
    for r in power.to_dict("records"):
        design_txt = (f"{int(r['seeds'])} x {int(r['goals'])}" if not (isinstance(r.get("seeds"), float)
                                                                        and math.isnan(r["seeds"])) else "-")
        lines.append(f"| {r['env']} | {r['claim']}: {r['text']} | {_num(r.get('paper'))} | {design_txt} | "
                     f"{_num(r.get('mde'))} | {'yes' if r.get('resolvable') is True or r.get('resolvable') == 1 else 'no'} | "
                     + " | ".join(_num(r.get(f"goals_at_{s}_seeds"), "{:.0f}") for s in seeds)
                     + f" | {r.get('note') if isinstance(r.get('note'), str) else ''} |")
    if design is not None and len(design):
        lines += ["", "## Designs within the budget", "",
                  "Per RL length, the training seeds (Vanilla and SPrPO; one for the other methods) and test goals per "
                  "split that resolve the most of C1-C3, at rates measured on the machine of the training runs, and "
                  "the same design's hours elsewhere (`sprpo_lib.paper.budget.design_table`).", "",
                  markdown_table(design)]
    return "\n".join(lines) + "\n"
