"""Rendering of the robustness experiments: figures, tables, paired comparisons, text
examples and headline numbers from tidy rows (:mod:`sprpo_lib.paper.experiments`) and run
folders.  Pure functions of their inputs (the logic of notebooks 03-07):

* :func:`plot_motivation` (Fig. 1), :func:`plot_curves` (Fig. 3), :func:`plot_landscape`
  (Fig. 4): PNG + PDF;
* :func:`paired_comparisons`: the reference method minus each baseline at every
  setting, paired bootstrap over training seeds and tasks (:func:`sprpo_lib.paper.stats.paired_bootstrap`);
* :func:`overhead` / :func:`overhead_latex`: App. "Training overhead" from the runs'
  own per-iteration metrics;
* :func:`pick_examples` / :func:`examples_markdown`: App. "Qualitative Examples",
  trajectory pairs chosen by a fixed rule from the evaluation's episode logs;
* :func:`headline` / :func:`headline_markdown` / :func:`without_paired`: the numbers the README quotes.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from sprpo_lib.core.compress import FAMILIES
from sprpo_lib.evaluate.cells import EVAL_SPLITS
from sprpo_lib.infra.io import atomic_write_text, read_cached
from sprpo_lib.infra.manifest import write_manifest
from sprpo_lib.paper.experiments import PLANS
from sprpo_lib.paper.figcheck import design_gid
from sprpo_lib.paper.report import load_metrics
from sprpo_lib.paper.stats import paired_bootstrap, seed_paired, success_intervals, summarize
from sprpo_lib.paper.style import LABEL_BOX, METHOD_COLORS, METHOD_MARKERS, NEUTRAL, pyplot, role, save_figure
from sprpo_lib.paper.tables import ENV_LABELS, FAMILY_LABELS, METHOD_LABELS, design_text, strength_label

__all__ = ["COLORS", "save_figure", "quiet_iterations", "plot_motivation", "plot_curves", "plot_landscape", "landscape_grid", "plot_longer",
           "plot_ablation", "ablation_bars", "PERTURBED_MEAN", "paired_comparisons", "perturbation_losses", "landscape_drop", "overhead", "overhead_latex",
           "EXAMPLE_RULE", "pick_examples", "examples_markdown", "headline", "headline_markdown", "merged_headline",
           "headline_caption", "seeds_text", "without_paired", "replace_block", "setting_label", "plain",
           "README_WIDTH_PX"]

COLORS = METHOD_COLORS  # one colour and marker per method, in every figure (sprpo_lib.paper.style)
MARKERS = METHOD_MARKERS
#: z_{0.975} + z_{0.80}: a difference of this many standard errors is detected with 80% power.
MDE80_Z = 1.959964 + 0.841621
CURVE_FAMILIES = ("gaussian", "dropout", "fisher", "sparsegpt", "rtn")
#: rows of a multi-environment figure, in the paper's order
ENV_ORDER = tuple(ENV_LABELS)
_AXIS = {f: FAMILIES[f].axis for f in CURVE_FAMILIES}


def _plt():
    return pyplot()


def pct_text(v: float) -> str:
    """A success % as a bar label: whole numbers bare, others to one decimal (12.5 stays 12.5,
    not Python's half-to-even 12)."""
    return f"{v:.0f}" if abs(v - round(v)) < 0.05 else f"{v:.1f}"


def _family_points(summary: pd.DataFrame, family: str, method: str) -> pd.DataFrame:
    """A method's curve for one family: the clean point (strength 0; 16 bits for RTN) then
    the family's strengths, growing (RTN: bits falling)."""
    sel = summary[summary["method"] == method]
    clean = sel[sel["family"] == "clean"].copy()
    clean["strength"] = 16.0 if family == "rtn" else 0.0
    fam = sel[sel["family"] == family]
    return pd.concat([clean, fam]).sort_values("strength", ascending=family != "rtn")


#: Sideways offset between methods' markers, as a fraction of a category (or of a third of
#: a continuous axis's range).
DODGE = 0.07


def _design(row) -> tuple[int | None, int]:
    """(test goals per split, training seeds) of a summary row: what sets its sampling error
    (goals ``None`` where the summary has no ``tasks``)."""
    tasks = row.get("tasks")
    return (int(tasks) if tasks is not None and pd.notna(tasks) else None), int(row.get("n", 1) or 1)


#: The width the README shows its opening figure at (px): :func:`plot_curves` with ``readme=True``
#: draws at exactly that size, so its text is read at the size it was set.
README_WIDTH_PX = 900


def plot_curves(summary: pd.DataFrame, methods: Sequence[str], path: str | Path, *, title: str = "",
                families: Sequence[str] = CURVE_FAMILIES, env_label: str = "", readme: bool = False) -> list[Path]:
    """Fig. 3: success against strength, one panel per family, one colour and marker per
    method, one row per environment of ``summary["env"]`` (the paper's order: ALFWorld,
    then WebShop).  The clean policy is the leftmost point.

    What the picture may suggest is what was measured
    (:mod:`sprpo_lib.paper.figcheck`): a line joins only points of the method's main design
    (that of its clean point: goals x training seeds); points of a smaller design are hollow
    markers, never joined; a level the method was not evaluated at is a gap in its line.
    Families with one strength, and quantization (BF16, INT8, INT6, INT4), sit on a
    categorical axis.  Error bars are each point's 95% interval where the summary has ``lo`` and
    ``hi`` (:func:`sprpo_lib.paper.stats.success_intervals`), else the std over training seeds.
    Each environment's row has one y scale, ending just above its highest interval (at most
    100%), so that success rates of a few tens of percent are not drawn flat.
    A footnote states the designs, from the data; ``<path>.csv`` holds every plotted point
    (not for the README's copy).  ``readme``: drawn at
    :data:`README_WIDTH_PX` (100 dpi), the size the README shows it."""
    plt = _plt()
    envs = [e for e in ENV_ORDER if "env" in summary and (summary["env"] == e).any()]
    envs += [e for e in (summary["env"].unique() if "env" in summary else []) if e not in envs]
    parts = [(e, summary[summary["env"] == e]) for e in envs] or [(None, summary)]
    fams = [f for f in families if (summary["family"] == f).any()]
    ncol = max(1, len(fams))
    width = README_WIDTH_PX / 100 if readme else 2.6 * ncol + 0.6
    fig, axes = plt.subplots(len(parts), ncol, figsize=(width, 2.5 * len(parts) + 1.0), squeeze=False)
    mains: dict[str, set] = {}
    others, single, points = set(), False, []
    intervals = {"lo", "hi"} <= set(summary.columns)
    shift = {m: i - (len(methods) - 1) / 2 for i, m in enumerate(methods)}  # sideways, so equal values stay visible
    for row, (env, part) in zip(axes, parts):
        drawn = part[part["method"].isin(methods)]
        spread = drawn["std"].fillna(0.0) if "std" in drawn else 0.0
        highest = float((drawn["hi"] if intervals else drawn["mean"] + spread).max())
        highest = highest if math.isfinite(highest) else 100.0  # no interval drawn: the whole range
        top = float(min(102.0, max(20.0, 10.0 * math.ceil((highest + 3.0) / 10.0))))  # one scale a row
        for ax, fam in zip(row, fams):
            zero = 16.0 if fam == "rtn" else 0.0
            levels = sorted({zero, *(float(b) for b in part.loc[part["family"] == fam, "strength"])},
                            reverse=fam == "rtn")
            categorical = fam == "rtn" or len(levels) <= 2
            if categorical:
                none = "BF16" if fam == "rtn" else "none"
                ticks = [strength_label("clean" if b == zero else fam, b, clean_label=none) for b in levels]
                ax.set_xticks(range(len(levels)), ticks)
                ax.set_xlim(-0.5, len(levels) - 0.5)
            for m in methods:
                pts = _family_points(part, fam, m)
                if pts.empty:
                    continue
                at = {float(b): r for b, r in zip(pts["strength"], pts.to_dict("records"))}
                main = _design(at[zero]) if zero in at else _design(next(iter(at.values())))
                dodge = DODGE * shift[m] * (1.0 if categorical else (levels[-1] - levels[0]) / 3.0)
                xs = [x + dodge for x in (range(len(levels)) if categorical else levels)]
                ys = [at[b]["mean"] if b in at and _design(at[b]) == main else np.nan for b in levels]
                if intervals:  # the 95% interval of every point (one seed: over its goals alone)
                    err = np.array([[at[b]["mean"] - at[b]["lo"], at[b]["hi"] - at[b]["mean"]]
                                    if b in at and _design(at[b]) == main else [np.nan, np.nan] for b in levels]).T
                else:
                    err = [at[b]["std"] if b in at and _design(at[b]) == main and main[1] > 1 else np.nan for b in levels]
                style = dict(color=COLORS.get(m), marker=MARKERS.get(m, "o"), ms=4)
                joined = not categorical or fam == "rtn"  # two levels on a categorical axis: markers only
                ax.plot(xs, ys, linestyle="-" if joined else "none", lw=1.4, label=METHOD_LABELS.get(m, m),
                        gid=design_gid(main[0] or 0, main[1]), **style)
                if intervals or main[1] > 1:
                    ax.errorbar(xs, ys, yerr=np.nan_to_num(np.clip(err, 0, None)), fmt="none", ecolor=COLORS.get(m),
                                capsize=2, lw=0.9)
                mains.setdefault(ENV_LABELS.get(env, env) if env else env_label, set()).add(main)
                single = single or main[1] == 1
                for b, r in at.items():
                    joined_point = _design(r) == main
                    points.append({"env": env, "method": m, "family": fam, "strength": float(b),
                                   "setting_family": r["family"], "mean": r["mean"],
                                   "lo": r.get("lo", np.nan), "hi": r.get("hi", np.nan), "goals": _design(r)[0],
                                   "seeds": _design(r)[1], "joined": joined_point})
                    if not joined_point:
                        others.add(_design(r))
                        ax.plot([xs[levels.index(b)]], [r["mean"]], linestyle="none", mfc="white", mew=1.1,
                                **style, label="_" + METHOD_LABELS.get(m, m))
            ax.set(xlabel="precision" if fam == "rtn" else _AXIS.get(fam, "strength"),
                   title=FAMILY_LABELS.get(fam, fam), ylim=(-0.02 * top, top))
            ax.grid(alpha=0.3)
        label = ENV_LABELS.get(env, env) if env else env_label
        row[0].set_ylabel(f"success (%){' - ' + label if label else ''}")
    top, above, below = _legend_and_notes(fig, axes, methods, mains, others, single, title, intervals)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, top))
    _hug_panels(fig, axes, above, below)
    if not readme:  # the plotted points, each with its design: what a reader checks against the tables
        atomic_write_text(Path(path).with_suffix(".csv"), pd.DataFrame(points).round(3).to_csv(index=False))
    return save_figure(fig, path, dpi=100 if readme else 150) + ([] if readme else [Path(path).with_suffix(".csv")])


def _legend_and_notes(fig, axes, methods: Sequence[str], mains: dict[str, set], others: set, single: bool,
                      title: str, intervals: bool = False) -> tuple[float, list, object]:
    """:func:`plot_curves`'s title, one legend for all panels and the footnote on the designs;
    returns the top of the panels' area (a fraction of the figure's height), the artists above
    the panels (legend, then title) and the footnote."""
    legend: dict = {}  # every method drawn in any panel, once, in the order given
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(lab, h)
    order = [METHOD_LABELS.get(m, m) for m in methods]
    labels = sorted(legend, key=lambda lab: order.index(lab) if lab in order else len(order))
    handles = [legend[lab] for lab in labels]
    notes = ["; ".join(f"{name + ': ' if name else ''}{' / '.join(design_text(*d) for d in sorted(ds, reverse=True))}"
                       for name, ds in mains.items()) + " per point"]
    if others:
        notes.append(f"hollow markers, not joined: {' / '.join(design_text(*d) for d in sorted(others, reverse=True))}")
    notes.append("error bars: 95% interval, training seeds and goals resampled" if intervals else
                 "error bars: std over training seeds" + ("; single runs have none" if single else ""))
    notes.append("markers offset sideways so that equal values stay visible")
    top, above = 1.0, []
    if title:
        above.append(fig.suptitle(title, fontsize=9, y=0.995))
        top -= 0.45 / fig.get_figheight()
    if handles:  # one legend for all panels, under the title
        above.insert(0, fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, top), ncol=len(handles),
                                   fontsize=8, frameon=False))
        top -= 0.35 / fig.get_figheight()
    note = fig.text(0.5, 0.005, ". ".join(n[0].upper() + n[1:] for n in notes) + ".", ha="center", va="bottom",
                    fontsize=7, wrap=True)
    return top, above, note


def _hug_panels(fig, axes, above: Sequence, below) -> None:
    """Move ``above`` (the legend, then the title) to just over the panels' labels and ``below``
    (the footnote) to just under them, 0.08 in apart, so that the tight crop leaves no empty
    band where ``tight_layout`` reserved more room than they take (one row of panels)."""
    r = fig.canvas.get_renderer()
    inv, gap = fig.transFigure.inverted(), 0.08 / fig.get_figheight()
    boxes = [ax.get_tightbbox(r).transformed(inv) for ax in axes.flat if ax.get_visible()]
    y = max(b.y1 for b in boxes) + gap
    for a in above:  # each artist's top at y + its own height (legend: loc upper center; suptitle: va top)
        y += a.get_window_extent(r).transformed(inv).height
        if hasattr(a, "set_bbox_to_anchor"):
            a.set_bbox_to_anchor((0.5, y), transform=fig.transFigure)
        else:
            a.set_y(y)
        y += gap
    below.set(y=min(b.y0 for b in boxes) - gap, va="top")


def plot_motivation(summary: pd.DataFrame, path: str | Path, *, method: str = "vanilla",
                    reference: str | None = None, title: str = "", families: Sequence[str] = CURVE_FAMILIES) -> list[Path]:
    """Fig. 1: one method's success at clean and at each family's strengths (bars: the mean
    over its training seeds; whiskers: the 95% interval where the summary has ``lo`` and ``hi``,
    as Fig. 3's points, else the std over seeds), the clean level as a dashed line; ``reference`` (the
    warm start) as outlined bars beside them, so the reader sees whether RL made the agent
    more or less fragile than its starting point.  Ticks give the strength; the family
    names the group of ticks beneath; the value labels sit above the whiskers.  Where the
    summary has ``tasks`` and the bars of ``method`` rest on different designs (goals x
    training seeds), ticks off the clean bar's design carry a dagger and a footnote says
    both, so that no bar passes for more evidence than it has."""
    plt = _plt()
    intervals = {"lo", "hi"} <= set(summary.columns)

    def whisker(r) -> tuple[float, float]:  # (below, above) the bar's top
        if intervals:
            return float(r["mean"] - r["lo"]), float(r["hi"] - r["mean"])
        return (math.nan,) * 2 if pd.isna(r["std"]) or int(r.get("n", 1) or 1) < 2 else (float(r["std"]),) * 2

    def bars_of(m: str) -> list[tuple]:
        sel = summary[summary["method"] == m]
        clean = sel[sel["family"] == "clean"]
        out = [("Clean", float(clean["mean"].iloc[0]) if len(clean) else math.nan,
                whisker(clean.iloc[0]) if len(clean) else (math.nan,) * 2, "clean", 0.0,
                _design(clean.iloc[0]) if len(clean) else None)]
        for fam in families:
            part = sel[sel["family"] == fam].sort_values("strength", ascending=(fam != "rtn"))
            for _, r in part.iterrows():
                out.append((plain(strength_label(fam, r["strength"])), float(r["mean"]), whisker(r), fam,
                            float(r["strength"]), _design(r)))
        return out

    bars = bars_of(method)
    ref = {(b[3], b[4]): b for b in bars_of(reference)} if reference else {}
    fig, ax = plt.subplots(figsize=(max(5.0, (0.8 if ref else 0.6) * len(bars) + 1), 3.6))
    x = np.arange(len(bars))
    w = 0.42 if ref else 0.8
    dx = -w / 2 if ref else 0.0

    def errs(bs) -> np.ndarray:  # [2, bars]: below and above each top; NaN (no whisker) where none was measured
        return np.clip(np.array([b[2] for b in bs], float).T.reshape(2, len(bs)), 0, None)

    def values(xs, heights, es):
        for xi, h, e in zip(xs, heights, es[1]):
            if not math.isnan(h):
                ax.text(xi, h + (0 if math.isnan(e) else e) + 1, pct_text(h), ha="center", va="bottom", fontsize=6,
                        bbox=LABEL_BOX, zorder=3)  # over the dashed line

    ax.bar(x + dx, [b[1] for b in bars], w, yerr=errs(bars), capsize=2, color=COLORS.get(method),
           label=METHOD_LABELS.get(method, method))
    values(x + dx, [b[1] for b in bars], errs(bars))
    if ref:
        rb = [ref.get((b[3], b[4]), (None, math.nan, (math.nan,) * 2, None, None, None)) for b in bars]
        ax.bar(x + w / 2, [r[1] for r in rb], w, yerr=errs(rb), capsize=2, facecolor="none",
               edgecolor=COLORS.get(reference), hatch="//", label=METHOD_LABELS.get(reference, reference))
        values(x + w / 2, [r[1] for r in rb], errs(rb))
        ax.legend(fontsize=7, loc="upper right")
    if not math.isnan(bars[0][1]):
        ax.axhline(bars[0][1], ls="--", lw=1, color="k", alpha=0.6, gid="reference:clean success")
    main = bars[0][5]
    off = sorted({b[5] for b in bars if b[5] is not None and b[5] != main}, key=str)
    ax.set_xticks(x, [b[0] + ("\u2020" if off and b[5] != main else "") for b in bars], fontsize=7)
    note = f"{METHOD_LABELS.get(method, method)}: {design_text(*main)} per bar" if main is not None else ""
    if off:  # bars measured on another design than the clean bar's
        note += "; \u2020 " + "; ".join(design_text(*d) for d in off)
    if ref and {b[5][1] for b in ref.values() if b[5]} == {1}:
        note += f". {METHOD_LABELS.get(reference, reference)} (hatched): one policy on the same goals"
    if main is not None:
        note += (". Error bars: 95% interval, training seeds and goals resampled" if intervals else
                 ". Error bars: std over training seeds" + ("; single runs have none" if main[1] == 1 or ref else ""))
        note += ". Dashed: clean success"
        fig.text(0.01, 0.01, note + ".", fontsize=6, ha="left", va="bottom", alpha=0.8, wrap=True)
    for fam in ("clean", *families):  # the family under its group of ticks
        idx = [i for i, b in enumerate(bars) if b[3] == fam]
        if idx and fam != "clean":
            ax.annotate(FAMILY_LABELS.get(fam, fam).replace(" pruning", "\npruning"), xy=(np.mean(idx), 0),
                        xycoords=("data", "axes fraction"), xytext=(0, -20), textcoords="offset points",
                        ha="center", va="top", fontsize=7)
            if idx[0] > 0:
                ax.axvline(idx[0] - 0.5, color="k", lw=0.5, alpha=0.3, gid="reference:family separator")
    ax.set(ylabel="success (%)", ylim=(0, 110))
    ax.grid(False, axis="x")  # no grid line through the bars
    ax.set_title(title or f"{METHOD_LABELS.get(method, method)} under perturbations", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1) if main is not None else None)
    return save_figure(fig, path)


def landscape_grid(rows: pd.DataFrame, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(w1 values, w2 values, success % [len(w2), len(w1)]) of one method's plane rows."""
    sel = rows[(rows["method"] == method) & (rows["family"] == "plane")]
    g = sel.groupby(["w2", "strength"])["success"].mean().unstack("strength") * 100.0
    return g.columns.to_numpy(float), g.index.to_numpy(float), g.to_numpy(float)


def plot_landscape(rows: pd.DataFrame, methods: Sequence[str], path: str | Path, *, title: str = "") -> list[Path]:
    """Fig. 4: success over the ``(w1, w2)`` plane as measured, one heat map of cells per
    method (the same colour scale for all; each cell printed with its value; the
    unperturbed centre outlined), no surface or contour interpolated between the points;
    a footnote gives the episodes per point and whether the design can tell the two surfaces
    apart (:func:`surface_sentence`)."""
    grids = {m: landscape_grid(rows, m) for m in methods}
    if not any(z.size for _, _, z in grids.values()):
        raise ValueError(f"plot_landscape: no 'plane' rows for {list(methods)}; run the plan's landscape "
                         "(experiments.landscape_rows with a non-empty Plan.landscape_grid) first")
    plt = _plt()
    fig, axes = plt.subplots(1, len(methods), figsize=(3.4 * len(methods) + 0.8, 3.8), squeeze=False)
    im = None
    for ax, (m, (w1, w2, z)) in zip(axes[0], grids.items()):
        if z.size == 0:
            ax.set_axis_off()
            continue
        im = ax.imshow(z, origin="lower", cmap="viridis", vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(len(w1)), [f"{v:g}" for v in w1])
        ax.set_yticks(range(len(w2)), [f"{v:g}" for v in w2])
        for (i, j), v in np.ndenumerate(z):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color="w" if v < 60 else "k")
        if 0.0 in w1 and 0.0 in w2:  # the unperturbed policy
            j, i = list(w1).index(0.0), list(w2).index(0.0)
            ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec=role("accent"), lw=2))
        ax.set(xlabel="$w_1$", ylabel="$w_2$", title=METHOD_LABELS.get(m, m))
        ax.grid(False)
    fig.subplots_adjust(bottom=0.22, top=0.84, wspace=0.35)  # room for the footnote and the title
    if im is not None:
        fig.colorbar(im, ax=list(axes[0]), label="success (%)", shrink=0.85)
    per = rows[rows["family"] == "plane"].groupby(["method", "strength", "w2"]).size()
    n = f"{per.min()}" if per.min() == per.max() else f"{per.min()}-{per.max()}"
    fig.text(0.01, 0.01, f"{n} episodes per cell; outlined: the unperturbed policy (w1 = w2 = 0)."
             + surface_sentence(rows, methods), fontsize=7, ha="left", va="bottom", wrap=True)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def surface_sentence(rows: pd.DataFrame, methods: Sequence[str]) -> str:
    """What the landscape's design says about two surfaces (claim C4, :func:`landscape_drop`):
    the first method's drop from the centre minus the second's with its interval and MDE, and
    whether it resolves; "" without both methods' planes."""
    if len(methods) < 2 or not {"env", "task_index", "seed", "train_seed"} <= set(rows.columns):
        return ""  # rows without the goals they were played on: nothing to pair
    drop = landscape_drop(rows, methods[0], methods[1])
    if drop.empty:
        return ""
    r = drop.iloc[0]
    a, b = (METHOD_LABELS.get(m, m) for m in methods[:2])
    lo, hi, mde = r["success_lo"], r["success_hi"], r["success_mde80"]
    says = (f"the surfaces differ ({b} {'flatter' if lo > 0 else 'steeper'})" if lo > 0 or hi < 0 else
            "this design cannot tell the surfaces apart" + ("" if pd.isna(mde) else f" by less than {mde:.1f} pp"))
    return (f" {a}'s drop from the centre minus {b}'s: {r['success_diff']:+.1f} pp [{lo:+.1f}, {hi:+.1f}]"
            + ("" if pd.isna(mde) else f", MDE80 {mde:.1f} pp") + f": {says}.")


def plot_longer(held: pd.DataFrame, curve: pd.DataFrame, path: str | Path, *, title: str = "") -> list[Path]:
    """Longer RL against the warm start (notebook 01, ``Plan.longer_iterations``): left, the
    held-out success of every run along training (0: the warm start; one line per training
    seed, the mean over seeds bold); right, RL minus warm start per evaluated iteration with
    its 95% paired interval over training seeds and tasks (:func:`~sprpo_lib.paper.report.heldout_curve`),
    the tasks gained / lost and their exact sign test under each point."""
    if held.empty or curve.empty:
        raise ValueError("plot_longer: no held-out evaluations along the longer runs; the profile needs "
                         "warm_start, eval_tasks and eval_every (the cpu profile has them)")
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.5, 3.4))
    for method, df in held.groupby("method"):
        disp = (COLORS.get(method, NEUTRAL["dark"]), MARKERS.get(method, "o"))
        per = df.groupby(["train_seed", "iteration"])["success"].mean().unstack("train_seed") * 100.0
        goals = int(df.groupby(["train_seed", "iteration"]).size().max())  # every point: the same held-out tasks
        for seed in per.columns:
            ax.plot(per.index, per[seed], color=disp[0], lw=0.8, alpha=0.45, marker=disp[1], ms=3,
                    gid=design_gid(goals, 1))
        ax.plot(per.index, per.mean(axis=1), color=disp[0], lw=2.2, marker=disp[1], ms=5, gid=design_gid(goals, per.shape[1]),
                label=f"{METHOD_LABELS.get(method, method)}, mean of {per.shape[1]} seed(s) (thin: each seed)")
        c = curve[curve["method"] == method].sort_values("iteration")
        bars = bx.errorbar(c["iteration"], c["diff"], yerr=[c["diff"] - c["lo"], c["hi"] - c["diff"]], color=disp[0],
                           marker=disp[1], ms=5, capsize=3, lw=1.2, label=METHOD_LABELS.get(method, method))
        bars.lines[0].set_gid(design_gid(goals, per.shape[1]))
        for r in c.itertuples():  # under the interval and under the zero line, so the line never crosses it
            bx.annotate(f"+{r.wins}/-{r.losses}\np={r.sign_p:.2g}", (r.iteration, min(r.lo, 0.0)), textcoords="offset points",
                        xytext=(0, -8), ha="center", va="top", fontsize=6)
    bx.axhline(0.0, color=NEUTRAL["mid"], lw=0.8, gid="reference:no change")
    n = int(held.groupby(["method", "train_seed", "iteration"]).size().max())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="RL iterations (0: warm start)", ylabel="held-out success (%)", ylim=(0, 100),
           title=f"held-out training tasks (n={n} per policy, T=0.4)")
    ax.legend(fontsize=6.5, loc="upper left")
    lo = min(float(curve["lo"].min()), 0.0)
    bx.set(xlabel="RL iterations", ylabel="RL minus warm start (pp)", ylim=(lo - 8, max(float(curve["hi"].max()), 0) + 4),
           title="paired over seeds and tasks, 95% CI; +gained/-lost, sign p")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def setting_label(family: str, strength: float) -> str:
    """A perturbation setting in words for Markdown (``Gaussian σ=0.20``, ``Quantization INT6``, ``Clean``)."""
    if family == "clean":
        return "Clean"
    return f"{FAMILY_LABELS.get(family, family)} {plain(strength_label(family, float(strength)))}"


def plain(label: str) -> str:
    """A LaTeX label as plain text for a figure or Markdown (``$\\rho=0.1$`` -> ``ρ=0.1``)."""
    for tex, uni in (("$", ""), ("\\sigma", "σ"), ("\\rho", "ρ"), ("\\alpha", "α")):
        label = label.replace(tex, uni)
    return label


#: Fig. 5's second bar of every variant: its success averaged over Table 1's perturbed settings.
PERTURBED_MEAN = "perturbed"


def ablation_bars(rows: pd.DataFrame, settings: Sequence[tuple[str, float]]) -> pd.DataFrame:
    """Fig. 5's bars from episode rows: per variant its clean success and, as family
    :data:`PERTURBED_MEAN`, its success averaged over the perturbed ``settings`` (each goal's
    mean over them first; a variant missing one of them gets no such bar), each with its 95%
    interval (:func:`summary_of`, training seeds and goals resampled)."""
    pert = {(f, float(s)) for f, s in settings if f != "clean"}
    at = pd.Series([(f, float(s)) for f, s in zip(rows["family"], rows["strength"])], index=rows.index)
    on = rows[at.isin(pert)]
    n_settings = on.drop_duplicates(["method", "family", "strength"]).groupby("method").size()
    on = on[on["method"].isin(n_settings[n_settings == len(pert)].index)]
    keys = [c for c in ("method", "env", "train_seed", "split", "task_index", "seed") if c in rows.columns]
    pooled = on.groupby(keys, dropna=False)[["success", "score"]].mean().reset_index()
    pooled = pooled.assign(family=PERTURBED_MEAN, strength=0.0)
    return summary_of(pd.concat([rows[rows["family"] == "clean"], pooled], ignore_index=True), intervals=True)


def plot_ablation(bars: pd.DataFrame, panels: Sequence[tuple[str, Sequence[tuple[str, str]]]],
                  n_settings: int, path: str | Path, *, env: str, title: str = "") -> list[Path]:
    """Fig. 5: one panel per group ``(title, [(variant key, label)])``: each variant's clean
    success and its mean success over the ``n_settings`` perturbed settings (:func:`ablation_bars`:
    bars the mean over training seeds, whiskers the 95% interval, as every point of Figs. 1 and 3),
    in the non-method colours of :mod:`sprpo_lib.paper.style` (clean grey, perturbed brown); a
    footnote gives the main runs' design (goals x training seeds), and a dagger on a variant's label
    the design of those measured otherwise, and what the perturbed bar averages."""
    plt = _plt()
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(3.3 * max(1, len(panels)), 3.4), squeeze=False)
    here = bars[bars["env"] == env]
    design = {k: _design(g.iloc[0]) for k, g in here.groupby("method")}  # goals x training seeds per variant
    main = max(design.values(), key=lambda d: (d[1], d[0] or 0)) if design else None  # the main runs' design

    def bar(k: str, family: str) -> tuple[float, float, float]:  # mean and the whisker below and above it
        r = here[(here["method"] == k) & (here["family"] == family)]
        if r.empty:
            return (math.nan,) * 3
        m, lo, hi = (float(r[c].iloc[0]) for c in ("mean", "lo", "hi"))
        return m, max(0.0, m - lo), max(0.0, hi - m)

    for ax, (ptitle, members) in zip(axes[0], panels):
        x = np.arange(len(members))
        bars_at = ((-0.2, "clean", role("clean"), "clean"),
                   (0.2, PERTURBED_MEAN, role("perturbed"), "mean over Table 1's perturbations"))
        for dx, family, colour, label in bars_at:
            got = np.array([bar(k, family) for k, _ in members]).reshape(len(members), 3)
            ax.bar(x + dx, got[:, 0], 0.4, yerr=got[:, 1:].T, capsize=2, color=colour, label=label)
            for xi, (v, _, up) in zip(x, got):
                if not math.isnan(v):  # above the whisker
                    ax.text(xi + dx, v + (0 if math.isnan(up) else up) + 1, pct_text(v), ha="center", va="bottom",
                            fontsize=6)
        # long labels break at their first space (rotated ones collided at four bars a panel); a dagger: another design
        ax.set_xticks(x, [(plain(lab).replace(" ", "\n", 1) if len(plain(lab)) > 8 else plain(lab))
                          + ("\u2020" if design.get(k, main) != main else "") for k, lab in members], fontsize=7)
        ax.set(title=plain(ptitle), ylim=(0, 110))
        ax.title.set_fontsize(8)
        ax.grid(axis="y", alpha=0.3)
        ax.grid(False, axis="x")  # no grid line through the bars
    axes[0][0].set_ylabel("success (%)")
    axes[0][0].legend(fontsize=6, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=9)
    others = sorted({d for d in design.values() if d != main}, reverse=True)
    note = (f"Bars: {design_text(*main) if main else 'none'}"
            + "".join(f"; \u2020 {design_text(*d)}" for d in others)
            + "; * the main runs' own cells (Table 1's runs, not trained again)"
            + "; error bars: 95% interval, training seeds and goals resampled. "
            f"Perturbed: the mean of {n_settings} settings, above clean where a perturbation helped on these goals.")
    note = fig.text(0.01, 0.005, note, fontsize=6, ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))
    _hug_panels(fig, axes, [], note)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- paired statistics
def mde_text(mde: float | None, pooled=False, digits: int = 1) -> str:
    """An MDE as the tables print it: ``-`` where there is none, ``~`` before one pooled over
    the comparison's other settings (:func:`paired_comparisons`' ``mde_pooled``)."""
    if mde is None or math.isnan(mde):
        return "-"
    return f"{'~' if pooled is True or pooled == 1 else ''}{mde:.{digits}f}"


def paired_comparisons(rows: pd.DataFrame, reference: str, baselines: Sequence[str],
                       settings: Sequence[tuple[str, float]], *, n_resamples: int = 10_000,
                       seed: int = 0) -> pd.DataFrame:
    """``reference`` minus each baseline at each setting: success and retention
    differences (percentage points) with paired 95% bootstrap intervals over training seeds
    and tasks (:func:`sprpo_lib.paper.stats.paired_bootstrap`; ``interval`` says which), on
    the training seeds both methods share (their policies are paired by seed), and the
    goals each side wins with the exact sign test on them (``wins``, ``losses``,
    ``sign_p``).  A method with one policy (the warm start, or a baseline trained on one seed)
    is paired with every seed of the other, as :func:`sprpo_lib.paper.divergence.kl_power`
    pairs KL, so the difference is that of the means a table shows; its own seed variance
    is then not in the interval (``one_seed`` names that method, "" where none).  A
    setting either method lacks is skipped.  ``success_mde80`` is the smallest true
    difference this design detects with 80% power at two-sided 5% (normal approximation:
    (1.96 + 0.84) x the bootstrap standard error of the paired difference).  Where no task's
    outcome differs between the two, the standard error is 0, which says nothing about what
    the design could detect (near-identical policies can agree task by task): the MDE is then
    the pair's own, from the root mean square of its standard errors at the other settings
    (``mde_pooled`` True), and NaN only where the pair differs nowhere."""
    out = []
    for b in baselines:
        first = len(out)
        sub, one = seed_paired(rows, reference, b)
        if sub.empty:
            continue
        shared = sorted(set(sub["train_seed"]))
        for fam, s in settings:
            have = sub[(sub["family"] == fam) & (sub["strength"] == s)]
            if set(have["method"]) != {reference, b}:
                continue
            r = paired_bootstrap(sub, reference, b, fam, s, n_resamples=n_resamples, seed=seed)
            out.append({"reference": reference, "baseline": b, "family": fam, "strength": s,
                        "train_seeds": " ".join(map(str, shared)), "tasks": r["tasks"],
                        "episodes": r["episodes_per_method"], "success_diff": r["success"],
                        "success_lo": r["success_ci"][0], "success_hi": r["success_ci"][1],
                        "success_se": r["success_se"],  # -> success_mde80 and mde_pooled below
                        "retention_diff": r["retention"] if fam != "clean" else math.nan,
                        "retention_lo": r["retention_ci"][0] if fam != "clean" else math.nan,
                        "retention_hi": r["retention_ci"][1] if fam != "clean" else math.nan,
                        "interval": r["interval"], "one_seed": one or "", "wins": r["wins"], "losses": r["losses"],
                        "sign_p": r["sign_p"]})
        _add_mde(out[first:])
    cols = ["reference", "baseline", "family", "strength", "train_seeds", "tasks", "episodes", "success_diff",
            "success_lo", "success_hi", "success_mde80", "mde_pooled", "retention_diff", "retention_lo",
            "retention_hi", "interval", "one_seed", "wins", "losses", "sign_p"]
    return pd.DataFrame(out, columns=cols)


def _add_mde(comparisons: list[dict]) -> None:
    """Replace each comparison's ``success_se`` by ``success_mde80`` (:data:`MDE80_Z` x the
    standard error) and ``mde_pooled``: where no goal differed (standard error 0) the MDE is
    that of the comparisons' root mean square standard error, NaN if none differed anywhere."""
    seen = [o["success_se"] for o in comparisons if o["success_se"] > 0]
    pooled = math.sqrt(float(np.mean(np.square(seen)))) if seen else math.nan
    for o in comparisons:
        se = o.pop("success_se")
        o["success_mde80"], o["mde_pooled"] = MDE80_Z * (se if se > 0 else pooled), not se > 0 and bool(seen)


def perturbation_losses(rows: pd.DataFrame, method: str, settings: Sequence[tuple[str, float]], *,
                        n_resamples: int = 10_000, seed: int = 0) -> pd.DataFrame:
    """Claim C1 (an RL agent loses much of its success under mild perturbations): ``method``'s
    clean success minus its success at each perturbed setting, in percentage points, paired
    over the same goals, evaluation seeds and training seeds.  Each training seed's clean and
    perturbed policy enter :func:`~sprpo_lib.paper.stats.paired_bootstrap` as two policies on
    the same cells, so the interval is the same two-way bootstrap over training seeds and
    goals as :func:`paired_comparisons`'; ``wins`` / ``losses`` count the goals the
    perturbation lost / gained (pooled over seeds) with the exact sign test on them, and the
    MDE is :func:`paired_comparisons`' (pooled where no goal changed)."""
    sub = rows[rows["method"] == method]
    clean = sub[(sub["family"] == "clean") & (sub["strength"] == 0.0)].assign(policy="clean")
    out = []
    for fam, s in settings:
        pert = sub[(sub["family"] == fam) & (sub["strength"] == s)]
        if fam == "clean" or clean.empty or pert.empty:
            continue
        both = pd.concat([clean, pert.assign(policy="perturbed", family="clean", strength=0.0)], ignore_index=True)
        r = paired_bootstrap(both, "clean", "perturbed", "clean", 0.0, method="policy", n_resamples=n_resamples,
                             seed=seed)
        out.append({"method": method, "family": fam, "strength": s,
                    "train_seeds": " ".join(map(str, sorted(set(pert["train_seed"])))), "tasks": r["tasks"],
                    "episodes": r["episodes_per_method"], "success_clean": 100.0 * clean["success"].mean(),
                    "success_perturbed": 100.0 * pert["success"].mean(), "success_diff": r["success"],
                    "success_lo": r["success_ci"][0], "success_hi": r["success_ci"][1], "success_se": r["success_se"],
                    "interval": r["interval"], "wins": r["wins"], "losses": r["losses"], "sign_p": r["sign_p"]})
    _add_mde(out)
    cols = ["method", "family", "strength", "train_seeds", "tasks", "episodes", "success_clean", "success_perturbed",
            "success_diff", "success_lo", "success_hi", "success_mde80", "mde_pooled", "interval", "wins", "losses",
            "sign_p"]
    return pd.DataFrame(out, columns=cols)


def landscape_drop(rows: pd.DataFrame, a: str = "vanilla", b: str = "sprpo", *, n_resamples: int = 10_000,
                   seed: int = 0) -> pd.DataFrame:
    """Claim C4 (Fig. 4: SPrPO's reward surface is flatter than Vanilla's) as a paired
    comparison: on each goal (and evaluation seed), a policy's drop is its success at the
    centre of the plane (w1 = w2 = 0) minus its mean success over the grid's other points;
    ``a``'s drop minus ``b``'s, in percentage points (positive: ``b`` is flatter), through the
    same bootstrap and exact sign test as :func:`paired_comparisons` (the landscape has one
    training seed: the interval is over goals).  One row of :func:`paired_comparisons`'
    columns, empty where the rows have no plane of both policies."""
    cols = ["reference", "baseline", "family", "strength", "train_seeds", "tasks", "episodes", "success_diff",
            "success_lo", "success_hi", "success_mde80", "mde_pooled", "interval", "wins", "losses", "sign_p"]
    plane = rows[(rows["family"] == "plane") & rows["method"].isin([a, b])]
    if set(plane["method"]) != {a, b}:
        return pd.DataFrame([], columns=cols)
    key = ["method", "env", "split", "task_index", "train_seed", "seed"]
    centre = (plane["strength"] == 0.0) & (plane["w2"] == 0.0)
    drop = (plane[centre].groupby(key)["success"].mean()
            - plane[~centre].groupby(key)["success"].mean()).rename("success").reset_index()
    drop = drop.assign(family="clean", strength=0.0)
    r = paired_bootstrap(drop, a, b, "clean", 0.0, n_resamples=n_resamples, seed=seed)
    out = [{"reference": a, "baseline": b, "family": "plane", "strength": 0.0,
            "train_seeds": " ".join(map(str, sorted(set(drop["train_seed"])))), "tasks": r["tasks"],
            "episodes": int(len(plane) / 2), "success_diff": r["success"], "success_lo": r["success_ci"][0],
            "success_hi": r["success_ci"][1], "success_se": r["success_se"], "interval": r["interval"],
            "wins": r["wins"], "losses": r["losses"], "sign_p": r["sign_p"]}]
    _add_mde(out)
    return pd.DataFrame(out, columns=cols)


# ----------------------------------------------------------------------------- overhead
def quiet_iterations(m: pd.DataFrame, quiet: float | None = 0.9) -> pd.Series:
    """Which iterations of the metrics ``m`` ran on an otherwise idle machine: ``cpu_per_wall``
    (process CPU seconds per wall second) at least ``quiet`` x the highest in ``m``; every one
    when ``quiet`` is None or nothing logged it."""
    if quiet is None or "cpu_per_wall" not in m or not m["cpu_per_wall"].notna().any():
        return pd.Series(True, index=m.index)
    return m["cpu_per_wall"].fillna(0.0) >= quiet * m["cpu_per_wall"].max()


def overhead(run_dirs: Sequence[str | Path], quiet: float | None = 0.9) -> pd.DataFrame:
    """App. "Training overhead": mean seconds per training step per (env, method) from
    the runs' ``metrics.jsonl``: rollout, update (the method's update including SPrPO's
    replay, whose share is ``sensitivity``), total (the whole iteration, no evaluation or
    checkpoint), and the contention columns ``cpu_per_wall`` / ``loadavg`` when logged.

    Timings are only comparable on an otherwise idle machine: with ``quiet`` set, an
    iteration counts only if its ``cpu_per_wall`` (process CPU seconds per wall second) is
    at least ``quiet`` x the highest of all iterations (the uncontended level, about the
    thread count); ``excluded`` counts the others (shared or paused machine); a method with
    no such iteration keeps all of its own, marked ``all_contended``.  ``None`` keeps every
    iteration."""
    m = load_metrics(run_dirs)
    if m.empty:
        return pd.DataFrame()
    m = m.copy()
    m["excluded"] = ~quiet_iterations(m, quiet)
    sens = m["sensitivity_s"] if "sensitivity_s" in m else 0.0
    m["update_total_s"] = m["update_s"] + sens
    agg = {"rollout": ("rollout_s", "mean"), "update": ("update_total_s", "mean"),
           "sensitivity": ("sensitivity_s", "mean") if "sensitivity_s" in m else ("update_s", lambda x: 0.0),
           "total": ("wall_s", "mean"), "steps": ("iteration", "size"), "runs": ("run", "nunique")}
    for col, name in (("cpu_per_wall", "cpu_per_wall"), ("loadavg_1min", "loadavg")):
        if col in m:
            agg[name] = (col, "mean")
    # a method none of whose iterations ran quiet keeps them all (flagged): a row is never lost to contention
    every = m.groupby(["env", "method"], sort=False)["excluded"].transform("all")
    kept = m[~m["excluded"] | every]
    out = kept.groupby(["env", "method"], sort=False).agg(**agg).reset_index()
    dropped = m[~every].groupby(["env", "method"], sort=False)["excluded"].sum()
    out["excluded"] = [int(dropped.get((e, k), 0)) for e, k in zip(out["env"], out["method"])]
    contended = set(m[every][["env", "method"]].itertuples(index=False, name=None))
    out["all_contended"] = [(e, k) in contended for e, k in zip(out["env"], out["method"])]
    order = {k: i for i, k in enumerate(("vanilla", "gaussian", "sam", "sprpo"))}
    out = out.sort_values(["env", "method"], key=lambda s: s.map(order) if s.name == "method" else s)
    base = out[out["method"] == "vanilla"].set_index("env")["total"]
    out["total_vs_vanilla"] = [t / base.get(e, math.nan) for e, t in zip(out["env"], out["total"])]
    return out.reset_index(drop=True)


def overhead_latex(table: pd.DataFrame, methods: Sequence[str] = ("vanilla", "sprpo")) -> str:
    """The overhead table in the paper's layout (Environment, Method, Rollout, Update, Total), its
    unit in the header: seconds per RL iteration (the paper's caption: per training step)."""
    lines = [r"\begin{tabular}{@{}llrrr@{}}", r"\toprule",
             r"Environment & Method & Rollout (s) & Update (s) & Total (s) \\"]
    for i, (env, sub) in enumerate(table[table["method"].isin(methods)].groupby("env", sort=False)):
        lines.append(r"\midrule")
        for _, r in sub.iterrows():
            lines.append(f"{ENV_LABELS.get(env, env)} & {METHOD_LABELS.get(r['method'], r['method'])} & "
                         f"{r['rollout']:.1f} & {r['update']:.1f} & {r['total']:.1f} \\\\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- text examples
#: The rule of :func:`pick_examples`, in words (the examples page opens with it).
EXAMPLE_RULE = ("Selection rule, fixed before looking: per perturbation family (strongest setting first), the "
                "lowest-numbered task where the two policies (same training seed, evaluation seed and task) differ "
                "in success under the perturbation while both solved it clean ('strict'); where fewer than {n} such "
                "pairs exist in the environment, tasks where they differ under the perturbation whatever their clean "
                "outcome ('relaxed', clean outcomes shown). Counts per setting say how many tasks went each way, so "
                "no pair passes for the typical case.")


def pick_examples(rows: pd.DataFrame, a: str = "vanilla", b: str = "sprpo", *, train_seed: int = 0, seed: int = 0,
                  per_family: int = 1, min_pairs: int = 2) -> pd.DataFrame:
    """Trajectory pairs for the text examples by :data:`EXAMPLE_RULE`: at each perturbed
    setting of the rows (strongest first within a family), the tasks where ``a`` and ``b``
    (same training seed, same evaluation seed, same task) differ in success under the
    perturbation while both succeeded on it clean (``rule`` "strict"); the ``per_family``
    lowest task indices of each family, in either direction.  Where that gives fewer than
    ``min_pairs`` pairs, tasks that differ under the perturbation whatever their clean
    outcome are added the same way (``rule`` "relaxed").  ``counts`` columns report how many
    tasks went each way, so the chosen pairs are not mistaken for the typical case."""
    key = ["env", "split", "task_index"]
    sel = rows[(rows["train_seed"] == train_seed) & (rows["seed"] == seed) & rows["method"].isin([a, b])]
    clean = sel[sel["family"] == "clean"].pivot_table(index=key, columns="method", values="success", aggfunc="first")
    if not {a, b} <= set(clean.columns):
        return pd.DataFrame()
    both_clean = clean[(clean[a] == 1) & (clean[b] == 1)].index
    out: list[dict] = []

    def scan(rule: str, eligible) -> None:
        taken = {(r["family"], r["split"], r["task_index"]) for r in out}
        for fam in [f for f in CURVE_FAMILIES if (sel["family"] == f).any()]:
            picked = sum(1 for r in out if r["family"] == fam and r["rule"] == rule)
            for st in sorted(set(sel.loc[sel["family"] == fam, "strength"]), reverse=(fam != "rtn")):
                if picked >= per_family:
                    break
                part = sel[(sel["family"] == fam) & (sel["strength"] == st)]
                piv = part.pivot_table(index=key, columns="method", values=["success", "cell"], aggfunc="first")
                if not {a, b} <= set(piv["success"].columns):
                    continue
                piv = piv[piv.index.isin(eligible)]
                diff = piv[piv["success"][a] != piv["success"][b]]
                wins, losses = int((diff["success"][b] == 1).sum()), int((diff["success"][a] == 1).sum())
                for idx, r in diff.sort_index(level="task_index").iterrows():
                    if picked >= per_family:
                        break
                    if (fam, idx[1], int(idx[2])) in taken:
                        continue
                    out.append({"env": idx[0], "split": idx[1], "task_index": int(idx[2]), "family": fam,
                                "strength": st, "train_seed": train_seed, "seed": seed, "rule": rule,
                                f"success_{a}": bool(r["success"][a]), f"success_{b}": bool(r["success"][b]),
                                f"clean_{a}": bool(clean.loc[idx, a]), f"clean_{b}": bool(clean.loc[idx, b]),
                                f"cell_{a}": r["cell"][a], f"cell_{b}": r["cell"][b], f"{b}_only": wins,
                                f"{a}_only": losses, "eligible": len(piv)})
                    picked += 1

    scan("strict", both_clean)
    if len(out) < min_pairs:
        scan("relaxed", clean.index)
    return pd.DataFrame(out)


def _episode(log: list[dict] | None, split: str, task_index: int) -> dict | None:
    for e in log or []:
        if e["split"] == split and int(e["task_index"]) == int(task_index):
            return e
    return None


def examples_markdown(picks: pd.DataFrame, logs: Mapping[str, list[dict] | None], a: str = "vanilla",
                      b: str = "sprpo", *, obs_chars: int = 240) -> str:
    """The chosen pairs as Markdown: the task, then each method's steps (action and the
    start of the feedback) side by side in sequence; ``logs`` maps a cell prefix to its
    episode log (:func:`sprpo_lib.evaluate.load_episode_log`)."""
    rule = EXAMPLE_RULE.format(n=2) + "\n"
    if picks.empty:
        return (rule + f"\nNo task qualifies: at no evaluated setting did {METHOD_LABELS.get(a, a)} and "
                f"{METHOD_LABELS.get(b, b)} differ on a task under a perturbation.\n")
    parts = [rule]
    for i, r in enumerate(picks.to_dict("records"), 1):
        label = f"{FAMILY_LABELS.get(r['family'], r['family'])} {strength_label(r['family'], r['strength'])}"
        parts.append(f"### Example {i} ({r.get('rule', 'strict')}): {r['env']} task {r['split']}/{r['task_index']}, "
                     f"{label}\n")
        clean = ("" if r.get("rule", "strict") == "strict" else
                 f" Clean, {METHOD_LABELS.get(a, a)} {'succeeded' if r[f'clean_{a}'] else 'failed'} and "
                 f"{METHOD_LABELS.get(b, b)} {'succeeded' if r[f'clean_{b}'] else 'failed'} on this task.")
        parts.append(f"At this setting {r[b + '_only']} task(s) were solved by {METHOD_LABELS.get(b, b)} only and "
                     f"{r[a + '_only']} by {METHOD_LABELS.get(a, a)} only, of {r['eligible']} eligible "
                     f"(training seed {r['train_seed']}, evaluation seed {r['seed']}).{clean}\n")
        first = True
        for m in (a, b):
            ep = _episode(logs.get(r[f"cell_{m}"]), r["split"], r["task_index"])
            if ep is None:
                parts.append(f"*{METHOD_LABELS.get(m, m)}: no episode log stored for this cell.*\n")
                continue
            if first:
                parts.append(f"**Task:** {ep['instruction']}\n")
                first = False
            outcome = "success" if ep["success"] else "failure"
            parts.append(f"**{METHOD_LABELS.get(m, m)}** ({outcome}, score {ep['score']:.2f})\n")
            for s in ep["steps"]:
                obs = " ".join(s["observation"].split())[:obs_chars]
                valid = "" if s["valid"] else " *(invalid)*"
                parts.append(f"{s['step'] + 1}. `{s['action'] or s['response'].strip()[:120]}`{valid}  \n"
                             f"   <sub>saw: {obs}</sub>")
            parts.append("")
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------- headline numbers
def headline(summary: pd.DataFrame, paired: pd.DataFrame, settings: Sequence[tuple[str, float]],
             methods: Sequence[str], *, env: str, extra: Mapping | None = None) -> dict:
    """The numbers the README quotes: per method clean success and, per setting, success
    and retention (mean, std, seeds); per baseline the paired differences of SPrPO."""
    out: dict = {"env": env, "methods": {}, "paired": [], **dict(extra or {})}
    for m in methods:
        rec = {}
        for fam, s in [("clean", 0.0), *settings]:
            r = summary[(summary["method"] == m) & (summary["env"] == env) & (summary["family"] == fam)
                        & (summary["strength"] == s)]
            if r.empty:
                continue
            r = r.iloc[0]
            rec[f"{fam}@{s:g}"] = {"success": round(float(r["mean"]), 2),
                                   "std": None if pd.isna(r["std"]) else round(float(r["std"]), 2),
                                   "seeds": int(r["n"]),
                                   "retention": None if pd.isna(r["retention"]) else round(float(r["retention"]), 1)}
        out["methods"][m] = rec
    for r in paired.to_dict("records"):
        out["paired"].append({k: (round(v, 2) if isinstance(v, float) and not math.isnan(v) else
                                  (None if isinstance(v, float) else v)) for k, v in r.items()})
    return out


def tasks_per_split(rows: pd.DataFrame, settings: Sequence[tuple[str, float]] | None = None) -> int:
    """The held-out tasks each split was evaluated on, counted from the result rows (the
    fewest over splits and ``settings``, every setting of the rows when None), not taken
    from the plan: a plan asks for at most its ``tasks``, a split may hold fewer, and curve
    strengths may use fewer tasks than Table 1's settings."""
    if settings is not None:
        keep = {(f, float(s)) for f, s in settings}
        rows = rows[[(f, float(s)) in keep for f, s in zip(rows["family"], rows["strength"])]]
        if rows.empty:
            raise ValueError(f"tasks_per_split: no rows at the settings {sorted(keep)}")
    return int(rows.groupby(["split", "family", "strength"])["task_index"].nunique().min())


PAIRED_HEAD = "Paired differences"  # how headline_markdown's paired table starts (without_paired finds it)


def seeds_text(seeds: Mapping[str, Sequence[int]]) -> str:
    """``Vanilla 0, 1; Gaussian 0; ...``: a plan's training seeds per method, for a caption."""
    return "; ".join(f"{METHOD_LABELS.get(m, m)} {', '.join(map(str, s))}" for m, s in seeds.items())


def headline_caption(env: str, profile: str, h: Mapping) -> str:
    """The line above one environment's headline table: design and what the cells hold."""
    per = " per split" if len(EVAL_SPLITS.get(env, ())) > 1 else ""  # WebShop has one test split
    return (f"**{ENV_LABELS.get(env, env)}** ({profile} profile; {h['tasks_per_split']} held-out tasks{per}, "
            f"evaluation seeds {', '.join(map(str, h['eval_seeds']))}; "
            f"training seeds {seeds_text(h['training_seeds'])}); "
            f"success % mean ± std over training seeds (retention %: perturbed / clean success of the same method, "
            f"above 100 where a perturbation helped on these goals):")


def headline_markdown(h: Mapping, methods: Sequence[str]) -> str:
    """A Markdown table of :func:`headline` (success, retention) plus the paired intervals."""
    cols = list(next((v for v in h["methods"].values() if v), {}).keys())

    def label(c: str) -> str:
        fam, s = c.split("@")
        return setting_label(fam, float(s))

    head = ["Method", *[label(c) for c in cols]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        rec = h["methods"].get(m, {})
        cells = []
        for c in cols:
            v = rec.get(c)
            if v is None:
                cells.append("-")
                continue
            txt = f"{v['success']:.1f}" + (f" ± {v['std']:.1f}" if v["std"] is not None else "")
            if v["retention"] is not None and not c.startswith("clean"):
                txt += f" ({v['retention']:.0f}%)"
            cells.append(txt)
        lines.append(f"| {METHOD_LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if h.get("paired"):
        text += (f"\n{PAIRED_HEAD} (reference minus baseline, percentage points, 95% bootstrap over training seeds "
                 "and tasks; a policy of one training seed is paired with each seed of the other, so the interval "
                 "carries none of its own seed variance, and over tasks alone where both have one seed; MDE: the smallest difference the "
                 "design detects with 80% power, ~ where no goal's outcome differed at that setting and the MDE is "
                 "the pair's, pooled over its other settings):\n\n")
        text += "| Setting | vs. | Success diff [95% CI] | MDE | Retention diff [95% CI] |\n|---|---|---|---|---|\n"
        for p in h["paired"]:
            ret = ("-" if p.get("retention_diff") is None else
                   f"{p['retention_diff']:+.1f} [{p['retention_lo']:+.1f}, {p['retention_hi']:+.1f}]")
            mde = mde_text(p.get("success_mde80"), p.get("mde_pooled"))
            text += (f"| {label(p['family'] + '@' + str(p['strength']))} | {METHOD_LABELS.get(p['baseline'], p['baseline'])} | "
                     f"{p['success_diff']:+.1f} [{p['success_lo']:+.1f}, {p['success_hi']:+.1f}] | {mde} | {ret} |\n")
    return text


def without_paired(md: str) -> str:
    """Headline Markdown (:func:`headline_markdown`, one section per environment) without
    its paired-difference tables: the README's digest, which links the whole file."""
    out, skip = [], False
    for line in md.splitlines(keepends=True):
        if line.startswith(PAIRED_HEAD):
            skip = True
        elif skip and not (line.startswith("|") or not line.strip()):
            skip = False
        if not skip:
            out.append(line)
    return "".join(out)


def replace_block(text: str, name: str, body: str, prefix: str = "") -> str:
    """Replace what lies between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in
    ``text`` (the README's generated sections); a missing marker is an error.  ``prefix``
    rebases the body's relative links for a page below the project root (``"../"``)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"replace_block: markers {begin} ... {end} not found")
    if prefix:
        body = re.sub(r"\]\((?![a-z]+:|#|/)([^)]+)\)", lambda m: f"]({prefix}{m.group(1)})", body)
    return text[: i + len(begin)] + "\n" + body.rstrip("\n") + "\n" + text[j:]


#: The pages with generated blocks, relative to the project root: the front page and the
#: library's page beside the code; a block is written wherever its markers are.
DOC_PAGES = ("README.md", "sprpo_lib/README.md")


def doc_pages(root: Path) -> list[tuple[Path, str]]:
    """Each page of :data:`DOC_PAGES` under ``root`` that exists, with the prefix that
    rebases root-relative links for it."""
    out = []
    for rel in DOC_PAGES:
        page = root / rel
        if page.is_file():
            depth = len(Path(rel).parts) - 1
            out.append((page, "../" * depth))
    return out


def write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def merged_headline(path: str | Path, head: Mapping) -> dict:
    """The headline of every environment, by name: this pass's ``head`` over what ``path``
    holds for the others, so that a pass on one environment keeps the other's numbers (and
    the README's results block built from them); a damaged file keeps nothing."""
    old = read_cached(path)
    kept = {env: h for env, h in old.items() if env not in head and isinstance(h, dict)} if isinstance(old, dict) else {}
    merged = {**kept, **head}
    return {env: merged[env] for env in sorted(merged)}


def summary_of(rows: pd.DataFrame, by: Sequence[str] = ("env",), intervals: bool = False) -> pd.DataFrame:
    """:func:`sprpo_lib.paper.stats.summarize` of result rows; with ``intervals``, each row's 95%
    interval too (``lo``, ``hi``: :func:`sprpo_lib.paper.stats.success_intervals`)."""
    out = summarize(rows, by)
    if intervals:
        out = out.merge(success_intervals(rows, by), on=["method", *by, "family", "strength"], how="left")
    return out


def manifests(paths: Sequence[str | Path], config: Mapping, wall_seconds: float, *, seed: int | None = None,
              extra: Mapping | None = None) -> list[Path]:
    """A manifest beside every artifact (:func:`sprpo_lib.infra.manifest.write_manifest`)."""
    return [write_manifest(p, dict(config), seed, wall_seconds, dict(extra or {})) for p in paths]


def absent_envs(profile: str, envs: Sequence[str]) -> list[str]:
    """Sentences for the environments a profile has no runs of (stated, not drawn)."""
    have = PLANS.get(profile, {})
    return [f"{e}: profile {profile!r} trains no {e} policies, so its panels and tables are absent here "
            f"(the paper profile has them)." for e in envs if e not in have]
