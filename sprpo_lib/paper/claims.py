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
from typing import Mapping

import pandas as pd

from sprpo_lib.paper.results import mde_text, setting_label
from sprpo_lib.paper.tables import ENV_LABELS, METHOD_LABELS

__all__ = ["PAPER", "CLAIM_COLUMNS", "reading", "claim_rows", "c1_rows", "claim_table", "claims_markdown",
           "claims_grid", "verdict_sentence"]

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
      with its sign) or whether that difference is below what the design detects.
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
        same = (expected > 0) == (lo > 0)
        return f"agrees (interval {side} 0)" if same else f"opposite sign to the paper (interval {side} 0)"
    if not lo <= expected <= hi:
        return f"not resolved; smaller than the paper's: the interval leaves out {expected:+.1f}"
    if math.isnan(mde):
        return "not resolved"
    return ("not resolved; the paper's difference is below this design's detectable "
            f"{mde:.1f} pp" if abs(expected) < mde else "not resolved, though the design could detect the paper's difference")


#: The columns of a claims table (:func:`claim_rows`, :func:`c1_rows`).
CLAIM_COLUMNS = ["env", "claim", "versus", "setting", "paper", "diff", "lo", "hi", "mde80", "mde_pooled", "tasks",
                 "train_seeds", "wins", "losses", "sign_p", "reading"]


def _claims_frame(rows: list[dict]) -> pd.DataFrame:
    """Claim rows with their :func:`reading`, as a table of :data:`CLAIM_COLUMNS`."""
    for r in rows:
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
        out.append({"env": env, "claim": claim, "versus": METHOD_LABELS.get(base, base),
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
            out.append({"env": env, "claim": f"full SPrPO beats {name}", "versus": name,
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
        out.append({"env": env, "claim": "C1: Vanilla loses success under the perturbation",
                    "versus": "Vanilla, clean minus perturbed", "setting": setting_label(r["family"], r["strength"]),
                    "paper": round(t1["clean@0"] - t1[k], 2), **_nums(r)})
    return _claims_frame(out)


def claim_table(paired: Mapping[str, pd.DataFrame], ablation_paired: Mapping[str, pd.DataFrame] | None = None,
                paper: Mapping | None = None) -> pd.DataFrame:
    """:func:`claim_rows` of every environment in ``paired`` (Table 1's comparisons, env ->
    rows), with that environment's ablation comparisons where ``ablation_paired`` has them."""
    parts = [claim_rows(p, (ablation_paired or {}).get(env), env, paper) for env, p in paired.items()]
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else claim_rows(pd.DataFrame(), None, "")


def _nums(r: Mapping) -> dict:
    mde = r.get("success_mde80", float("nan"))
    mde = float("nan") if mde is None else float(mde)
    def count(k):  # results written before the sign test have no counts: the rule then skips it
        v = r.get(k)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else v

    wins, losses, p = count("wins"), count("losses"), count("sign_p")
    return {"diff": r["success_diff"], "lo": r["success_lo"], "hi": r["success_hi"], "mde80": mde,
            "mde_pooled": r.get("mde_pooled") is True or r.get("mde_pooled") == 1,
            "tasks": r["tasks"], "train_seeds": r.get("train_seeds"), "wins": None if wins is None else int(wins),
            "losses": None if losses is None else int(losses), "sign_p": p}


def claims_markdown(rows: pd.DataFrame, *, profile: str) -> str:
    """The claims of :func:`claim_table` in Markdown, one full table per environment
    (claim, setting, the paper's difference, this run's with its interval, MDE, tasks,
    the reading)."""
    if rows.empty:
        return f"No claim of the paper can be read from the {profile} profile's results.\n"
    lines = [f"Paper's claims against the `{profile}` profile: differences in success (percentage points), "
             "SPrPO (full) minus the other policy or variant, paired over the same test goals and evaluation seeds (95% bootstrap over "
             "training seeds and tasks); MDE = the smallest difference this design detects with 80% power (~: no "
             "goal differed at that setting; the comparison's MDE pooled over its other settings). \"Agrees\" "
             "and \"opposite sign\" need the exact sign test on the goals whose outcomes differ at p < 0.05 as well."]
    for env, part in rows.groupby("env", sort=False):
        lines += ["", f"**{ENV_LABELS.get(env, env)}**", "",
                  "| Claim | Setting | Paper | This run [95% CI] | MDE | Tasks | Reading |", "|---|---|---|---|---|---|---|"]
        for r in part.to_dict("records"):
            mde = mde_text(r["mde80"], r.get("mde_pooled"))
            lines.append(f"| {r['claim']} | {r['setting']} | {r['paper']:+.1f} | {r['diff']:+.1f} [{r['lo']:+.1f}, "
                         f"{r['hi']:+.1f}] | {mde} | {int(r['tasks'])} | {r['reading']} |")
    return "\n".join(lines) + "\n"


#: Marks of :func:`claims_grid`: a reading of :func:`reading` by its opening words.
def verdict_sentence(rows: pd.DataFrame, *, profile: str) -> str:
    """One sentence of what the claims say at this profile's scale, from their readings:
    how many comparisons agree with the paper, go the other way, or resolve nothing."""
    if rows.empty:
        return f"The {profile} profile's results support no reading of the paper's claims yet."
    r = rows["reading"].astype(str)
    agree, opposite = int(r.str.startswith("agrees").sum()), int(r.str.startswith("opposite").sum())
    nothing = len(rows) - agree - opposite
    envs = " and ".join(ENV_LABELS.get(e, e) for e in dict.fromkeys(rows["env"]))
    if agree == opposite == 0:
        return (f"At the {profile} profile's scale no SPrPO comparison resolves: all {len(rows)} paired comparisons "
                f"on {envs} are within their noise, so these results neither confirm nor refute the paper.")
    return (f"At the {profile} profile's scale {agree} of {len(rows)} paired comparisons on {envs} agree with the "
            f"paper, {opposite} go the other way and {nothing} resolve nothing (exact sign test and 95% interval).")


GRID_MARKS = (("agrees", "**{}**"), ("opposite sign", "{} (!)"), ("not resolved; smaller than the paper's", "{} \u2020"))


def claims_grid(rows: pd.DataFrame, *, profile: str, full: str = "") -> str:
    """The claims of :func:`claim_table` as one compact grid per environment (rows: the
    other policy; columns: the settings; a cell: this run's difference [95% CI], MDE and
    the paper's difference), the readings as marks; ``full`` links the full table."""
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
