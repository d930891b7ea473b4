"""The paper's claims against this reproduction: for each claim, the paper's number, this
run's paired difference with its 95% interval, the smallest difference the design can
detect (80% power), and a reading that follows from those three by a fixed rule
(:func:`reading`).  The README's claims section is :func:`claims_markdown` of the
results (notebook 08 writes it after notebooks 04 and 08 have computed their paired
comparisons); nothing in it is typed.

``PAPER`` holds the paper's own numbers (Table 1 for both environments, App. table
"Component ablations" for WebShop; success %), the reference each claim is read against.
:func:`claims_markdown` is the full table (``figures/claims_<profile>.md``);
:func:`claims_grid`, one compact grid per environment, is what the README shows.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from sprpo_lib.infra.io import atomic_write_text, read_json
from sprpo_lib.paper.experiments import WARM_START
from sprpo_lib.paper.results import landscape_drop, mde_text, paired_comparisons, setting_label
from sprpo_lib.paper.stats import holm
from sprpo_lib.paper.tables import ENV_LABELS, METHOD_LABELS, to_csv

__all__ = ["PAPER", "CLAIMS", "C3_MARGIN", "C2_FAMILIES", "CLAIM_COLUMNS", "reading", "claim_rows", "c1_rows",
           "c4_rows", "c6_rows", "claim_table", "all_claims", "claims_markdown", "claims_grid", "verdict_sentence", "overview",
           "overview_markdown", "SPRPO_IDS", "KL_COLUMNS", "kl_claim_rows", "kl_markdown", "write_claims",
           "KL_SUCCESS_ID", "correlation_rows", "correlation_markdown"]

#: The paper's success (%) per method and Table 1 setting (both environments), and its
#: WebShop component ablations.
PAPER = {
    "alfworld": {
        "table1": {
            "vanilla": {"clean@0": 87.59, "gaussian@0.2": 64.96, "dropout@0.05": 54.62, "fisher@0.2": 41.73,
                        "sparsegpt@0.7": 41.12, "rtn@6": 86.98},
            "gaussian": {"clean@0": 89.05, "gaussian@0.2": 72.26, "dropout@0.05": 57.79, "fisher@0.2": 23.72,
                         "sparsegpt@0.7": 32.85, "rtn@6": 87.47},
            "sam": {"clean@0": 86.86, "gaussian@0.2": 66.79, "dropout@0.05": 55.60, "fisher@0.2": 22.02,
                    "sparsegpt@0.7": 50.97, "rtn@6": 86.25},
            "sprpo": {"clean@0": 91.85, "gaussian@0.2": 75.91, "dropout@0.05": 64.60, "fisher@0.2": 47.08,
                      "sparsegpt@0.7": 58.03, "rtn@6": 91.24},
        },
    },
    "webshop": {
        "table1": {
            "vanilla": {"clean@0": 57.00, "gaussian@0.2": 18.73, "dropout@0.05": 12.20, "fisher@0.2": 2.27,
                        "sparsegpt@0.4": 42.00, "rtn@6": 45.20},
            "gaussian": {"clean@0": 50.60, "gaussian@0.2": 17.87, "dropout@0.05": 11.33, "fisher@0.2": 0.27,
                         "sparsegpt@0.4": 34.33, "rtn@6": 39.80},
            "sam": {"clean@0": 52.27, "gaussian@0.2": 15.20, "dropout@0.05": 8.87, "fisher@0.2": 0.60,
                    "sparsegpt@0.4": 29.53, "rtn@6": 34.93},
            "sprpo": {"clean@0": 60.00, "gaussian@0.2": 30.13, "dropout@0.05": 20.87, "fisher@0.2": 12.40,
                      "sparsegpt@0.4": 50.20, "rtn@6": 55.67},
        },
        "components": {"alpha0": {"clean@0": 48.80}, "no_schedule": {"clean@0": 52.13}},
    },
}


def _key(family: str, strength: float) -> str:
    return f"{family}@{float(strength):g}"


def reading(diff: float, lo: float, hi: float, mde: float, expected: float, wins: int | None = None,
            losses: int | None = None, sign_p: float | None = None, mde_pooled: bool = False) -> str:
    """What one paired comparison says about a claim whose paper difference is ``expected``,
    by a fixed rule:

    * an interval of zero width is no evidence either way: "no difference observed" when the
      difference is 0, and what this design cannot detect below (the MDE);
    * a bound exactly at 0 with every discordant goal (``wins``/``losses``: the goals on
      which the two policies' outcomes differ) on one side says only that the other side
      had none: not resolved, with the exact sign test (``sign_p``) and the MDE (``mde_pooled``: the
      comparison's MDE pooled over its other settings, where no goal differed at this one);
    * an interval above or below 0 reads "agrees" or "opposite sign" only when the exact
      sign test on the discordant goals also rejects no difference at 5%;
    * an interval across zero is "not resolved", and says whether it leaves out the paper's
      difference (the data are then at odds with an effect of the paper's size, though not
      with its sign) or whether that difference is below what the design detects;
    * ``expected`` NaN is a claim with a direction (positive) but no number (C4, Fig. 4).
    """
    detect = ("cannot detect differences" if math.isnan(mde) else f"cannot detect less than {mde:.1f} pp"
              + (" (pooled over the comparison's settings)" if mde_pooled else ""))
    if lo == hi:
        return (f"no difference observed; this design {detect}" if diff == 0
                else f"not resolved: an interval of zero width is no evidence either way; this design {detect}")
    one_sided = wins is not None and losses is not None and min(wins, losses) == 0
    if (lo == 0 or hi == 0) and one_sided:
        side = "the first" if wins else "the second"
        return (f"not resolved: all {wins + losses} discordant goals favour {side} policy, whose bound at 0 says only "
                f"that none favoured the other (exact sign test p = {sign_p:.3g}); this design {detect}")
    if lo > 0 or hi < 0:
        side = "above" if lo > 0 else "below"
        if sign_p is not None and not sign_p < 0.05:
            return (f"not resolved: the interval is {side} 0 but the exact sign test on the {wins + losses} discordant "
                    f"goals gives p = {sign_p:.3g}")
        same = (expected > 0 or math.isnan(expected)) == (lo > 0)
        return f"agrees (interval {side} 0)" if same else f"opposite sign to the paper (interval {side} 0)"
    if math.isnan(expected):  # a direction without a number (Fig. 4): nothing to set the interval against
        return f"not resolved; the paper gives no number to compare; this design {detect}"
    if not lo <= expected <= hi:
        return f"not resolved; smaller than the paper's: the interval leaves out {expected:+.1f}"
    if math.isnan(mde):
        return "not resolved"
    return ("not resolved; the paper's difference is below this design's detectable "
            f"{mde:.1f} pp" if abs(expected) < mde else "not resolved, though the design could detect the paper's difference")


#: The paper's claims this reproduction reads, by id (the ``id`` column of a claims table): C1-C6
#: as notebook 08's power analysis sizes them (:func:`sprpo_lib.paper.power.claim_specs`), and T1,
#: Table 1's comparisons of SPrPO with the Gaussian and SAM baselines.
CLAIMS = {
    "C1": "an RL-trained agent (Vanilla) loses much of its success under mild perturbations (Fig. 1, Table 1)",
    "C2": "SPrPO keeps more success than Vanilla in at least 4 of the 5 families (Table 1)",
    "C3": "SPrPO's clean success is not more than 2 pp below Vanilla's (Table 1)",
    "C4": "SPrPO's reward surface is flatter than Vanilla's (Fig. 4)",
    "C5": "full SPrPO beats SPrPO without sensitivity and without scheduling (App. \"Component ablations\")",
    "C6": "channel SAM at rho = 0.1 collapses (App. B)",
    "T1": "SPrPO keeps more success than the Gaussian and SAM baselines (Table 1)",
}
#: C3's margin (pp): SPrPO's clean success may fall this far below Vanilla's and still "match" it.
C3_MARGIN = 2.0
#: C2's count: the families (of Table 1's five) in which SPrPO must keep more success than Vanilla.
C2_FAMILIES = 4

#: The columns of a claims table (:func:`claim_rows`, :func:`c1_rows`, :func:`c4_rows`, :func:`c6_rows`).
CLAIM_COLUMNS = ["env", "id", "claim", "versus", "setting", "paper", "paper_source", "diff", "lo", "hi", "mde80",
                 "mde_pooled", "tasks", "train_seeds", "one_seed", "wins", "losses", "sign_p", "reading"]
#: Where each claim's paper number comes from (``paper_source``): read from a table, or derived.
PAPER_SOURCES = {
    "C1": "derived: Vanilla's Table 1 clean minus perturbed success",
    "C2": "Table 1: SPrPO minus Vanilla", "C3": "Table 1: SPrPO minus Vanilla, clean",
    "T1": "Table 1: SPrPO minus the baseline",
    "C4": "none: Fig. 4 draws the surfaces and gives no number",
    "C5": "App. table \"Component ablations\": full SPrPO minus the variant",
    "C6": "derived: SAM's Table 1 clean success minus 0 for a collapse (App. B gives no number)",
}


def _claims_frame(rows: list[dict]) -> pd.DataFrame:
    """Claim rows with their :func:`reading` and where their paper number comes from, as a
    table of :data:`CLAIM_COLUMNS`."""
    for r in rows:
        r.setdefault("paper_source", PAPER_SOURCES.get(r["id"], ""))
        r["reading"] = reading(r["diff"], r["lo"], r["hi"], r["mde80"], r["paper"], r["wins"], r["losses"],
                               r["sign_p"], r["mde_pooled"])
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def claim_rows(paired: pd.DataFrame, ablation_paired: pd.DataFrame | None, env: str,
               paper: Mapping | None = None) -> pd.DataFrame:
    """One row per (claim, setting) on ``env``: SPrPO minus each baseline (Table 1) and
    full SPrPO minus each ablation variant (App. "Component ablations"), with the paper's
    difference; ``versus`` names the other policy (a column of :func:`claims_grid`)."""
    ref = (paper or PAPER).get(env, {})
    t1 = ref.get("table1", {})
    out = []
    for r in paired.to_dict("records"):
        base, k = r["baseline"], _key(r["family"], r["strength"])
        if base not in t1 or k not in t1.get("sprpo", {}):
            continue
        # the paper prints one decimal: its differences are exact at two, and rounding them here keeps the
        # in-memory value equal to the CSV's, so every table formats it alike (10.95, not 10.950000000000003)
        expected = round(t1["sprpo"][k] - t1[base][k], 2)
        claim = (f"SPrPO {'matches or beats' if r['family'] == 'clean' else 'keeps more success than'} "
                 f"{METHOD_LABELS.get(base, base)}")
        cid = "T1" if base != "vanilla" else "C3" if r["family"] == "clean" else "C2"
        out.append({"env": env, "id": cid, "claim": claim, "versus": METHOD_LABELS.get(base, base),
                    "setting": setting_label(r["family"], r["strength"]), "paper": expected, **_nums(r)})
    comp = ref.get("components", {})
    if ablation_paired is not None:
        full = t1.get("sprpo", {})
        for r in ablation_paired.to_dict("records"):
            k = _key(r["family"], r["strength"])
            if r["baseline"] not in comp or k not in comp[r["baseline"]] or k not in full:
                continue
            name = {"alpha0": "w/o sensitivity (alpha = 0)", "no_schedule": "w/o scheduling"}[r["baseline"]]
            # the ablation rows are reference (full) minus variant: the paper's full minus variant
            out.append({"env": env, "id": "C5", "claim": f"full SPrPO beats {name}", "versus": name,
                        "setting": setting_label(r["family"], r["strength"]),
                        "paper": round(full[k] - comp[r["baseline"]][k], 2), **_nums(r)})
    return _claims_frame(out)


def c1_rows(losses: pd.DataFrame, env: str, paper: Mapping | None = None) -> pd.DataFrame:
    """Claim C1 on ``env`` (Sec. 1, Fig. 1: an RL-trained agent loses much of its success under
    mild perturbations): Vanilla's clean minus perturbed success at each Table 1 setting
    (:func:`~sprpo_lib.paper.results.perturbation_losses`) beside the paper's (its Table 1
    Vanilla row), read by :func:`reading`; the columns of :func:`claim_rows`."""
    t1 = (paper or PAPER).get(env, {}).get("table1", {}).get("vanilla", {})
    out = []
    for r in losses.to_dict("records"):
        k = _key(r["family"], r["strength"])
        if k not in t1 or "clean@0" not in t1:
            continue
        out.append({"env": env, "id": "C1", "claim": "Vanilla loses success under the perturbation",
                    "versus": "Vanilla, clean minus perturbed", "setting": setting_label(r["family"], r["strength"]),
                    "paper": round(t1["clean@0"] - t1[k], 2), **_nums(r)})
    return _claims_frame(out)


def c4_rows(drop: pd.DataFrame, env: str) -> pd.DataFrame:
    """Claim C4 on ``env`` from :func:`~sprpo_lib.paper.results.landscape_drop` (Vanilla's drop
    from the centre of the plane minus SPrPO's: positive, SPrPO's surface is flatter); the
    paper draws the surfaces but gives no number, so the reading has a direction only."""
    out = [{"env": env, "id": "C4", "claim": "SPrPO's reward surface is flatter than Vanilla's",
            "versus": "Vanilla's drop minus SPrPO's", "setting": "plane: centre minus the other grid points",
            "paper": math.nan, **_nums(r)} for r in drop.to_dict("records")]
    return _claims_frame(out)


def c6_rows(paired: pd.DataFrame, env: str, paper: Mapping | None = None) -> pd.DataFrame:
    """Claim C6 on ``env``: channel SAM at rho = 5e-3 minus SAM at rho = 0.1, clean
    (:func:`~sprpo_lib.paper.results.paired_comparisons` of the ablation variants ``sam_5e-3``
    and ``sam_0.1``, clean rows only: their MDE pooled over the other settings where no goal
    differed clean); App. B says rho = 0.1 "leads to performance collapse", read as losing
    SAM's whole clean success of Table 1 (the paper's difference)."""
    sam = (paper or PAPER).get(env, {}).get("table1", {}).get("sam", {})
    out = [{"env": env, "id": "C6", "claim": "channel SAM at rho = 0.1 collapses", "versus": "SAM rho = 5e-3 minus rho = 0.1",
            "setting": setting_label(r["family"], r["strength"]),
            "paper": round(sam[_key(r["family"], r["strength"])], 2), **_nums(r)}
           for r in paired.to_dict("records") if r["family"] == "clean" and _key(r["family"], r["strength"]) in sam]
    return _claims_frame(out)


def claim_table(paired: Mapping[str, pd.DataFrame], ablation_paired: Mapping[str, pd.DataFrame] | None = None,
                paper: Mapping | None = None) -> pd.DataFrame:
    """:func:`claim_rows` of every environment in ``paired`` (Table 1's comparisons, env ->
    rows), with that environment's ablation comparisons where ``ablation_paired`` has them."""
    parts = [claim_rows(p, (ablation_paired or {}).get(env), env, paper) for env, p in paired.items()]
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else claim_rows(pd.DataFrame(), None, "")


def all_claims(paired: Mapping[str, pd.DataFrame], ablation_paired: Mapping[str, pd.DataFrame] | None = None, *,
               c1: Mapping[str, pd.DataFrame] | None = None, landscapes: Mapping[str, pd.DataFrame] | None = None,
               ablation_rows: Mapping[str, pd.DataFrame] | None = None, paper: Mapping | None = None) -> pd.DataFrame:
    """Every claim of :data:`CLAIMS` that the results can read, per environment in the paper's
    order of claims: :func:`claim_table` (C2, C3, C5, T1), ``c1`` (notebook 03's
    :func:`c1_rows`, env -> table), C4 from ``landscapes`` (notebook 05's plane rows, env ->
    rows; :func:`~sprpo_lib.paper.results.landscape_drop`) and C6 from ``ablation_rows``
    (notebook 08's rows of the variants ``sam_5e-3`` and ``sam_0.1``)."""
    parts = [claim_table(paired, ablation_paired, paper)]
    parts += [t.assign(id="C1", paper_source=PAPER_SOURCES["C1"]).reindex(columns=CLAIM_COLUMNS)
              for t in (c1 or {}).values() if len(t)]
    parts += [c4_rows(landscape_drop(r), env) for env, r in (landscapes or {}).items()]
    parts += [c6_rows(paired_comparisons(r, "sam_5e-3", ["sam_0.1"],  # every setting: the MDE pools over them
                                         list(dict.fromkeys(zip(r["family"], r["strength"].astype(float))))), env, paper)
              for env, r in (ablation_rows or {}).items()]
    table = pd.concat([p for p in parts if len(p)] or [parts[0]], ignore_index=True)
    order = {k: i for i, k in enumerate(CLAIMS)}
    envs = {e: i for i, e in enumerate(dict.fromkeys(table["env"]))}
    return (table.assign(_e=table["env"].map(envs), _c=table["id"].map(order))
            .sort_values(["_e", "_c"], kind="stable").drop(columns=["_e", "_c"]).reset_index(drop=True))


def _nums(r: Mapping) -> dict:
    mde = r.get("success_mde80", float("nan"))
    mde = float("nan") if mde is None else float(mde)
    def count(k):  # results written before the sign test have no counts: the rule then skips it
        v = r.get(k)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v

    wins, losses, p = count("wins"), count("losses"), count("sign_p")
    one = r.get("one_seed")  # a one-seed policy paired with each seed of the other (not the warm start: one by nature)
    one = METHOD_LABELS.get(one, one) if isinstance(one, str) and one and one != WARM_START else ""
    return {"one_seed": one, "diff": r["success_diff"], "lo": r["success_lo"], "hi": r["success_hi"], "mde80": mde,
            "mde_pooled": r.get("mde_pooled") is True or r.get("mde_pooled") == 1,
            "tasks": r["tasks"], "train_seeds": r.get("train_seeds"), "wins": None if wins is None else int(wins),
            "losses": None if losses is None else int(losses), "sign_p": p}


def _seeds(r: Mapping) -> int:
    """The training seeds a claim row's comparison rests on (its ``train_seeds``, "0 1 2")."""
    return len(str(r.get("train_seeds") or "").split()) or 1


def claims_markdown(rows: pd.DataFrame, *, profile: str) -> str:
    """The claims of :func:`claim_table` in Markdown, one full table per environment
    (claim, setting, the paper's difference with a dagger where it is derived, this run's with
    its interval, MDE, goals x training seeds with a mark where one seed stands for a method,
    the reading); a footnote says where each derived number comes from."""
    if rows.empty:
        return f"No claim of the paper can be read from the {profile} profile's results.\n"
    derived = {r["id"]: r["paper_source"] for r in rows.to_dict("records")
               if str(r.get("paper_source") or "").startswith("derived")}
    lines = [f"Paper's claims against the `{profile}` profile: differences in success (percentage points), "
             "paired over the same test goals and evaluation seeds (95% bootstrap over training seeds and tasks): "
             "SPrPO (full) minus the other policy or variant (C2, C3, C5, T1), Vanilla's clean minus perturbed "
             "success (C1), Vanilla's drop from the centre of the reward landscape minus SPrPO's (C4), SAM at "
             "rho = 5e-3 minus SAM at rho = 0.1 (C6); MDE = the smallest difference this design detects with 80% "
             "power (~: no goal differed at that setting; the comparison's MDE pooled over its other settings). "
             "\"Agrees\" and \"opposite sign\" need the exact sign test on the goals whose outcomes differ at "
             "p < 0.05 as well; a claim that one (C1) or some (C2) of its settings can carry counts a setting only "
             "where that test holds after Holm's correction over the claim's settings. Goals x seeds: the test goals "
             "and the training seeds the paired comparison rests on; x 1 (one seed): both policies trained at one seed; "
             "(X: one seed): X was trained at one seed and is paired with each of the other method's seeds, so the "
             "difference is that of the tables' means and the interval carries none of X's own seed variance. "
             + "".join(f"Paper numbers marked \u2020 for {k} are {v[len('derived: '):]}. " for k, v in derived.items())
             + "Claims: " + "; ".join(f"{k}, {v}" for k, v in CLAIMS.items()) + "."]
    for env, part in rows.groupby("env", sort=False):
        lines += ["", f"**{ENV_LABELS.get(env, env)}**", "",
                  "| Id | Claim | Setting | Paper | This run [95% CI] | MDE | Goals x seeds | Reading |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in part.to_dict("records"):
            mde = mde_text(r["mde80"], r.get("mde_pooled"))
            paper = "-" if math.isnan(r["paper"]) else f"{r['paper']:+.1f}" + ("\u2020" if r["id"] in derived else "")
            n = _seeds(r)
            mark = _one_seed_mark(r) or (" (one seed)" if n == 1 else "")
            lines.append(f"| {r['id']} | {r['claim']} | {r['setting']} | {paper} | {r['diff']:+.1f} [{r['lo']:+.1f}, "
                         f"{r['hi']:+.1f}] | {mde} | {int(r['tasks'])} x {n}{mark} | "
                         f"{r['reading']} |")
    return "\n".join(lines) + "\n"


#: Marks of :func:`claims_grid`: a reading of :func:`reading` by its opening words.
def verdict_sentence(rows: pd.DataFrame, *, profile: str) -> str:
    """One sentence of what the claims say at this profile's scale, from their readings:
    how many comparisons agree with the paper, go the other way, or resolve nothing; and,
    where the table has them, one on SPrPO's KL comparisons (:func:`kl_sentence`) and whether KL
    tracks success, per environment (:func:`correlation_rows`)."""
    corr = rows[_measured(rows, "correlation")]
    kl = kl_sentence(rows) + "".join(f" {ENV_LABELS.get(r['env'], r['env'])}: {r['reading']}"
                                     for r in corr.to_dict("records"))
    rows = rows[rows["id"].isin(SPRPO_IDS)] if "id" in rows else rows
    if rows.empty:
        return f"The {profile} profile's results support no reading of the paper's claims yet." + kl
    r = rows["reading"].astype(str)
    agree, opposite = int(r.str.startswith("agrees").sum()), int(r.str.startswith("opposite").sum())
    nothing = len(rows) - agree - opposite
    envs = " and ".join(ENV_LABELS.get(e, e) for e in dict.fromkeys(rows["env"]))
    if agree == opposite == 0:
        return (f"At the {profile} profile's scale no SPrPO comparison resolves: all {len(rows)} paired comparisons "
                f"on {envs} are within their noise, so these results neither confirm nor refute the paper." + kl)
    return (f"At the {profile} profile's scale {agree} of {len(rows)} paired comparisons on {envs} agree with the "
            f"paper, {opposite} go the other way and {nothing} resolve nothing (exact sign test and 95% interval)."
            + kl)


# ----------------------------------------------------------------------------- KL claims
#: What the KL claims (notebook 09) add to the claims table; success rows leave them empty and
#: have ``measure`` "success".
KL_COLUMNS = ["measure", "ratio", "ratio_lo", "ratio_hi", "mde80_rel", "p_holm"]
#: The KL comparisons of SPrPO with another policy (the verdict sentence counts them).
SPRPO_KL_IDS = ("C2-KL", "T1-KL", "C4-KL")


def kl_claim_rows(kl: pd.DataFrame) -> pd.DataFrame:
    """KL claim rows (:func:`sprpo_lib.paper.divergence.kl_claims`) in the claims table's
    columns: ``diff``/``lo``/``hi``/``mde80`` in nats of mean KL per state, ``tasks`` the states,
    ``measure`` "KL", the ratio of mean KLs with its interval, the MDE relative to the baseline and
    the Holm-adjusted p-value (``p_holm``); ``one_seed`` names a trained policy of one seed compared
    with the other method's several (each of them paired with it), "" otherwise (the warm start is
    the one starting point of every seed, not a one-seed baseline)."""
    out = []
    for r in kl.to_dict("records"):
        seeds = {m: r.get(f"seeds_{side}") for side, m in (("a", r["a"]), ("b", r["b"]))}
        one = [m for m, n in seeds.items() if pd.notna(n) and int(n) == 1 and m != WARM_START
               and any(pd.notna(k) and int(k) > 1 for k in seeds.values())]
        family, strength = str(r["setting"]).rsplit(" ", 1)
        setting = "plane mean" if r["where"] == "plane" else setting_label(family, float(strength))
        out.append({"env": r["env"], "id": r["id"], "claim": r["claim"],
                    "versus": f"{METHOD_LABELS.get(r['a'], r['a'])} vs {METHOD_LABELS.get(r['b'], r['b'])}",
                    "setting": f"{setting} ({r['where']})", "paper": float("nan"), "diff": r["diff"], "lo": r["lo"],
                    "hi": r["hi"], "mde80": r["mde80"], "mde_pooled": False, "tasks": r["states"],
                    "train_seeds": r["train_seeds"], "wins": r.get("wins"), "losses": r.get("losses"),
                    "sign_p": r.get("sign_p"), "reading": r["reading"], "measure": "KL", "ratio": r["ratio"],
                    "ratio_lo": r["ratio_lo"], "ratio_hi": r["ratio_hi"], "mde80_rel": r["mde80_rel"],
                    "p_holm": r.get("p_holm", float("nan")),
                    "one_seed": METHOD_LABELS.get(one[0], one[0]) if one else ""})
    return pd.DataFrame(out, columns=[*CLAIM_COLUMNS, *KL_COLUMNS])


def _measured(rows: pd.DataFrame, measure: str) -> pd.Series:
    """Rows of one ``measure`` ("KL", "correlation"); none in a file from before the column."""
    return rows["measure"].eq(measure) if "measure" in rows else pd.Series(False, index=rows.index)


def _is_success(rows: pd.DataFrame) -> pd.Series:
    """Rows of success claims (a file written before the ``measure`` column holds only those)."""
    return rows["measure"].isna() | rows["measure"].eq("success") if "measure" in rows else \
        pd.Series(True, index=rows.index)


#: The claims-table row per environment that says whether the divergence tracks success.
KL_SUCCESS_ID = "KL-success"


def correlation_rows(correlations: Mapping[str, Mapping]) -> pd.DataFrame:
    """Per environment, notebook 09's ``09_divergence_<env>_correlation.json``
    (:func:`sprpo_lib.paper.divergence.kl_success_correlation` and its sentence) as a claims row:
    ``measure`` "correlation", ``diff`` Spearman's rho between a policy's mean KL at a setting and
    its success loss there, ``lo``/``hi`` its 95% interval, ``tasks`` the (policy, setting) pairs."""
    out = [{"env": env, "id": KL_SUCCESS_ID, "claim": "a policy's mean KL at a setting tracks its success loss there",
            "versus": "every policy", "setting": "every setting measured both ways", "diff": c.get("spearman"),
            "lo": c.get("lo"), "hi": c.get("hi"), "tasks": c.get("pairs"), "reading": c.get("sentence", ""),
            "measure": "correlation"} for env, c in correlations.items()]
    return pd.DataFrame(out, columns=[*CLAIM_COLUMNS, *KL_COLUMNS])


def correlation_markdown(rows: pd.DataFrame) -> str:
    """The correlation rows of a claims table (:func:`correlation_rows`): one line per environment."""
    corr = rows[_measured(rows, "correlation")]
    if corr.empty:
        return ""
    lines = ["**Does the divergence track success?** Spearman's rank correlation between a policy's mean KL at a "
             "setting and its success loss there (clean minus perturbed success of the same weights), over the "
             "(policy, setting) pairs where both were measured, 95% bootstrap interval over the pairs:", ""]
    lines += [f"- {ENV_LABELS.get(r['env'], r['env'])}: {r['reading']}" for r in corr.to_dict("records")]
    return "\n".join(lines) + "\n"


def kl_markdown(rows: pd.DataFrame) -> str:
    """The KL rows of a claims table as one Markdown table per environment."""
    kl = rows[_measured(rows, "KL")]
    if kl.empty:
        return ""
    lines = ["KL claims: how far each policy moves under the perturbation, KL(pi || pi^xi) per agent state (notebook "
             "09), paired by state and training seed (two-way bootstrap, 95%). Ratio: mean KL of the first policy over "
             "the second's; MDE80 relative to the second's mean KL; flips: the exact sign test on the states whose "
             "greedy action flips under one policy only. \"No difference\" is read only where the design detects 10% "
             "of the baseline's KL. Holm p: the comparison's bootstrap p-value adjusted for all of its environment's "
             "comparisons (family-wise error). States x seeds: (X: one seed) marks a policy trained at one seed, "
             "paired with each of the other method's seeds: the interval carries none of X's own seed variance."]
    for env, part in kl.groupby("env", sort=False):
        lines += ["", f"**{ENV_LABELS.get(env, env)}, KL**", "", kl_multiplicity(part), "",
                  "| Id | Policies | Setting | Difference [95% CI] | Ratio [95% CI] | MDE80 | Holm p | States x seeds "
                  "| Reading |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in part.to_dict("records"):
            ratio = "" if pd.isna(r["ratio"]) else f"{r['ratio']:.3g} [{r['ratio_lo']:.3g}, {r['ratio_hi']:.3g}]"
            mde = "" if pd.isna(r["mde80_rel"]) else f"{100 * r['mde80_rel']:.1f}%"
            p_holm = "" if pd.isna(r.get("p_holm", np.nan)) else f"{r['p_holm']:.2g}"
            lines.append(f"| {r['id']} | {r['versus']} | {r['setting']} | {r['diff']:+.3g} [{r['lo']:+.3g}, "
                         f"{r['hi']:+.3g}] | {ratio} | {mde} | {p_holm} | {int(r['tasks'])} x {r['train_seeds']}"
                         f"{_one_seed_mark(r)} | {r['reading']} |")
    return "\n".join(lines) + "\n"


def _one_seed_mark(r: Mapping) -> str:
    """`` (X: one seed)`` for a claim row whose ``one_seed`` names a policy, else ""."""
    one = r.get("one_seed")
    return f" ({one}: one seed)" if isinstance(one, str) and one else ""


def kl_multiplicity(part: pd.DataFrame, level: float = 0.05) -> str:
    """One environment's KL comparisons as a family: how many intervals exclude 0, how many would
    by chance alone if no policy differed from another, and which keep their direction after
    Holm's correction for all of them (``p_holm``; rows without it count as not kept)."""
    n = len(part)
    resolved = part["reading"].astype(str).str.contains(" moves (?:less|more) ", regex=True)
    p_holm = pd.to_numeric(part.get("p_holm", pd.Series(np.nan, index=part.index)), errors="coerce")
    kept = part[resolved & (p_holm < level)]
    named = "; ".join(f"{r['id']} {r['versus']} at {r['setting']} (Holm p = {r['p_holm']:.2g})"
                      for r in kept.to_dict("records"))
    keeps = "keeps its" if len(kept) == 1 else "keep their"
    return (f"{int(resolved.sum())} of {n} comparisons resolve at 95% each, where about {level * n:.1f} would by "
            f"chance alone if no policy differed; {len(kept)} {keeps} direction after Holm's correction for the "
            f"{n} comparisons" + (f": {named}." if named else "."))


def kl_sentence(rows: pd.DataFrame) -> str:
    """One sentence (with a leading space) on SPrPO's KL comparisons, or "" where there are none."""
    if "id" not in rows:
        return ""
    kl = rows[rows["id"].isin(SPRPO_KL_IDS) & _measured(rows, "KL")]
    if kl.empty:
        return ""
    r = kl["reading"].astype(str)
    less, more = int(r.str.contains("moves less").sum()), int(r.str.contains("moves more").sum())
    same = int(r.str.startswith("no difference").sum())
    p_holm = pd.to_numeric(kl.get("p_holm", pd.Series(np.nan, index=kl.index)), errors="coerce")
    held = int((r.str.contains(" moves (?:less|more) ", regex=True) & (p_holm < 0.05)).sum())
    holm_note = "" if p_holm.isna().all() else \
        f" ({held} of these {less + more} hold after Holm's correction for all of an environment's KL comparisons)"
    unresolved = len(kl) - less - more - same
    mde = pd.to_numeric(kl.get("mde80_rel", pd.Series(np.nan, index=kl.index)), errors="coerce")
    mde = mde[~r.str.contains(" moves (?:less|more) ", regex=True) & ~r.str.startswith("no difference")].dropna()
    reach = (f" (the design detects a relative difference of {100 * mde.median():.0f}% of the baseline's KL at the "
             f"median, {100 * mde.min():.0f}% at best, against the 10% target)") if unresolved and len(mde) else ""
    return (f" In the policy's own terms (KL per agent state, notebook 09), SPrPO moves less than the other policy in "
            f"{less} of {len(kl)} paired comparisons, more in {more}{holm_note}; {same} read no difference at an MDE "
            f"of at most 10% and {unresolved} are not resolved{reach}.")


def write_claims(out: str | Path, profile: str, success: pd.DataFrame | None = None,
                 kl: Mapping[str, pd.DataFrame] | None = None) -> list[Path]:
    """Write ``claims_<profile>.csv`` and ``.md``: the success claims (``success``, else those the
    file already holds), the KL claims of every environment (``kl``, else each
    ``09_divergence_<env>_claims.csv`` in ``out``) and whether KL tracks success (each
    ``09_divergence_<env>_correlation.json``: :func:`correlation_rows`); the Markdown is the
    verdicts, the success table, the KL table, then the correlation.  Notebook 08 calls it with its
    claims, notebook 09 after its own."""
    out = Path(out)
    csv, md = out / f"claims_{profile}.csv", out / f"claims_{profile}.md"
    if success is None:
        old = pd.read_csv(csv) if csv.is_file() else pd.DataFrame(columns=CLAIM_COLUMNS)
        success = old[_is_success(old)].reindex(columns=CLAIM_COLUMNS)  # a file from before a column: left empty
    if kl is None:
        found = sorted(out.glob("09_divergence_*_claims.csv"))
        kl = {f.name[len("09_divergence_"):-len("_claims.csv")]: pd.read_csv(f) for f in found}
    kl_rows = [kl_claim_rows(t) for t in kl.values() if len(t)]
    found = sorted(out.glob("09_divergence_*_correlation.json"))
    corr = correlation_rows({f.name[len("09_divergence_"):-len("_correlation.json")]: read_json(f) for f in found})
    success = success.assign(measure="success")
    rows = pd.concat([success, *kl_rows, *([corr] if len(corr) else [])], ignore_index=True)
    rows = rows.reindex(columns=[*CLAIM_COLUMNS, *KL_COLUMNS])
    to_csv(rows, csv, digits=3)
    text = ""
    if len(success):
        text = (overview_markdown(overview(success), profile=profile) + "\n"
                + claims_markdown(success, profile=profile))
    text += ("\n" if text else "") + kl_markdown(rows)
    text += ("\n" if text and len(corr) else "") + correlation_markdown(rows)
    atomic_write_text(md, text or f"No claim of the paper can be read from the {profile} profile's results yet.\n")
    return [csv, md]


GRID_MARKS = (("agrees", "**{}**"), ("opposite sign", "{} (!)"), ("not resolved; smaller than the paper's", "{} \u2020"))


def claims_grid(rows: pd.DataFrame, *, profile: str, full: str = "") -> str:
    """The claims of :func:`claim_table` as one compact grid per environment (rows: the
    other policy; columns: the settings; a cell: this run's difference [95% CI], MDE and
    the paper's difference), the readings as marks; ``full`` links the full table.  Only
    SPrPO's comparisons (:data:`SPRPO_IDS`) are in the grid."""
    rows = rows[rows["id"].isin(SPRPO_IDS)] if "id" in rows else rows
    if rows.empty:
        return f"No claim of the paper can be read from the {profile} profile's results.\n"
    lines = ["SPrPO minus each policy, success in percentage points: this run's paired difference [95% CI] "
             "/ the smallest difference its design detects (80% power; ~: no goal differed at that setting, "
             "so it is the comparison's, pooled over its other settings) / the paper's difference. "
             "**Bold**: the interval excludes 0 on the paper's side and the exact sign test on the goals whose "
             "outcomes differ gives p < 0.05; (!): the same on the other side; \u2020: the interval straddles 0 and "
             "leaves out the paper's difference"
             + (f"; readings in words: [{full}]({full})." if full else ".")]
    for env, part in rows.groupby("env", sort=False):
        settings = list(dict.fromkeys(part["setting"]))
        tasks = sorted({int(t) for t in part["tasks"]})
        lines += ["", f"**{ENV_LABELS.get(env, env)}** ({'/'.join(map(str, tasks))} test goals)", "",
                  "| SPrPO minus | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
        for versus, g in part.groupby("versus", sort=False):
            by = {r["setting"]: r for r in g.to_dict("records")}
            cells = []
            for st in settings:
                r = by.get(st)
                if r is None:
                    cells.append("")
                    continue
                mde = mde_text(r["mde80"], r.get("mde_pooled"), digits=0)
                cell = f"{r['diff']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}] / {mde} / {r['paper']:+.1f}"
                mark = next((m for start, m in GRID_MARKS if str(r["reading"]).startswith(start)), "{}")
                cells.append(mark.format(cell))
            lines.append(f"| {versus} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: The ids of the comparisons of SPrPO with another policy or variant (the grid and verdict sentence).
SPRPO_IDS = ("C2", "C3", "T1", "C5")


def _short(reading_text: str) -> str:
    """A reading's verdict: its words before the first ';', ':' or '('."""
    for sep in (";", ":", " ("):
        reading_text = reading_text.split(sep)[0]
    return reading_text.strip()


def _numbers(r: Mapping, versus: bool = False) -> str:
    mde = mde_text(r["mde80"], r.get("mde_pooled"))
    p = "" if r.get("sign_p") is None or (isinstance(r["sign_p"], float) and math.isnan(r["sign_p"])) else \
        f", sign p = {r['sign_p']:.2g}"
    who = f" ({r['versus']})" if versus else ""
    return f"{r['setting']}{who}: {r['diff']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}], MDE {mde}{p}"


def _holm_held(rows: list[dict], read: list[str], level: float = 0.05) -> tuple[list[dict], str]:
    """The rows of a claim that any (or some) of its settings can carry whose reading holds as a
    family: the sign test after Holm's correction over the claim's settings (a claim read from
    its luckiest setting of several would otherwise agree more often than 5% by chance), and the
    words that say so.  Rows written before the sign test have no p: they are kept as read."""
    p = [float("nan") if r.get("sign_p") is None else float(r["sign_p"]) for r in rows]
    if all(math.isnan(v) for v in p):
        return [r for r, t in zip(rows, read) if t.startswith(("agrees", "opposite"))], ""
    adjusted = holm(p)
    held = [r for r, t, q in zip(rows, read, adjusted) if t.startswith(("agrees", "opposite")) and q < level]
    n_read = sum(t.startswith(("agrees", "opposite")) for t in read)
    return held, ("" if n_read == 0 else f", {len(held)} of them after Holm's correction for the {len(rows)} settings")


def _verdict(cid: str, part: pd.DataFrame) -> tuple[str, str]:
    """(verdict, evidence) of one claim on one environment from its rows of the claims table."""
    rows = part.to_dict("records")
    if cid == "C3":  # non-inferiority at C3_MARGIN: the interval's lower bound against -margin
        r = rows[0]
        if r["lo"] > -C3_MARGIN:
            verdict = f"agrees (lower bound above -{C3_MARGIN:g} pp)"
        elif r["hi"] < -C3_MARGIN:
            verdict = f"opposite (more than {C3_MARGIN:g} pp below)"
        else:
            verdict = f"not resolved (the interval reaches below -{C3_MARGIN:g} pp)"
        return verdict, _numbers(r)
    if len(rows) == 1:
        return _short(rows[0]["reading"]), _numbers(rows[0])
    read = [str(r["reading"]) for r in rows]
    agree = [r for r, t in zip(rows, read) if t.startswith("agrees")]
    opposite = [r for r, t in zip(rows, read) if t.startswith("opposite")]
    need = {"C1": 1, "C2": C2_FAMILIES}.get(cid, len(rows))
    held, note = _holm_held(rows, read) if need < len(rows) else (agree + opposite, "")
    n_agree, n_opposite = sum(r in held for r in agree), sum(r in held for r in opposite)
    verdict = "agrees" if n_agree >= need else "opposite" if n_opposite >= need else "not resolved"
    verdict += f" ({len(agree)} of {len(rows)} agree" + (f", {len(opposite)} opposite" if opposite else "") + note + \
        (f"; the claim needs {need})" if need not in (1, len(rows)) else ")")
    shown = agree + opposite
    if shown:
        return verdict, "; ".join(_numbers(r, versus=cid in ("T1", "C5")) for r in shown)
    mdes = [r["mde80"] for r in rows if not math.isnan(r["mde80"])]
    left_out = sum(t.startswith("not resolved; smaller than the paper's") for t in read)
    span = "" if not mdes else f"{min(mdes):.0f}" if round(min(mdes)) == round(max(mdes)) else \
        f"{min(mdes):.0f}-{max(mdes):.0f}"
    return verdict, (f"no interval resolves (MDE {span} pp)" if mdes else "no interval resolves") \
        + (f"; {left_out} of {len(rows)} leave out the paper's difference" if left_out else "")


def overview(rows: pd.DataFrame, envs: list[str] | None = None) -> pd.DataFrame:
    """One row per claim of :data:`CLAIMS` and environment: its verdict from the claims table's
    rows (:func:`_verdict`: C1 agrees where any setting agrees, C2 where at least
    :data:`C2_FAMILIES` families do, each after Holm's correction over the claim's settings
    (:func:`_holm_held`), C3 by non-inferiority at :data:`C3_MARGIN`, C5 and T1
    where every comparison does, C4 and C6 by their one reading) and the numbers it rests on;
    "not measured" where this profile's plan has no rows for it."""
    envs = envs or (list(dict.fromkeys(rows["env"])) if len(rows) else [])
    out = []
    for cid, text in CLAIMS.items():
        for env in envs:
            part = rows[(rows["env"] == env) & (rows["id"] == cid)] if len(rows) else rows
            missing = ("not measured", "this profile's plan has no rows for it on this environment")
            verdict, evidence = _verdict(cid, part) if len(part) else missing
            out.append({"id": cid, "claim": text, "env": env, "verdict": verdict, "evidence": evidence})
    return pd.DataFrame(out, columns=["id", "claim", "env", "verdict", "evidence"])


def overview_markdown(ov: pd.DataFrame, *, profile: str, full: str = "") -> str:
    """:func:`overview` as one Markdown table (a row per claim, a column per environment)."""
    envs = list(dict.fromkeys(ov["env"]))
    lines = [f"Every claim of the paper against the `{profile}` profile: the verdict, then the numbers it rests on "
             "(paired difference in pp [95% CI], the smallest difference the design detects at 80% power, the exact "
             "sign test on the goals whose outcomes differ)" + (f"; every comparison: [{full}]({full})." if full else "."),
             "", "| Claim | " + " | ".join(ENV_LABELS.get(e, e) for e in envs) + " |", "|---" * (len(envs) + 1) + "|"]
    for cid, part in ov.groupby("id", sort=False):
        by = {r["env"]: r for r in part.to_dict("records")}
        cells = [f"**{by[e]['verdict']}**: {by[e]['evidence']}" if e in by else "" for e in envs]
        lines.append(f"| {cid}: {part['claim'].iloc[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
