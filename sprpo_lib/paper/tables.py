"""The paper's results tables from :func:`sprpo_lib.paper.stats.summarize` output: LaTeX in
the paper's layout (booktabs) and CSV with the same numbers.

* :func:`main_table`: Table 1: one block per environment, methods as rows, a few
  settings as columns, ``mean +- std (retention)``;
* :func:`appendix_table`: App. "More Experiment Results": (perturbation, strength) as
  rows, methods as columns, optionally in column groups (ALFWorld ID / OOD).

Both mark the best mean of each column (Table 1) or row (appendix) in bold, ties
included, comparing means as printed (``digits`` decimals: what the reader sees), and
print std = NaN (a single training seed) as the mean alone.  :func:`main_frame` and
:func:`appendix_frame` are the same tables as tidy DataFrames (one row per printed
cell, with the ``best`` flag); :func:`to_csv` writes them.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from sprpo_lib.core.compress import FAMILIES
from sprpo_lib.core.methods import METHODS
from sprpo_lib.infra.io import atomic_write_text
from sprpo_lib.paper.style import METHOD_DISPLAY

__all__ = ["FAMILY_LABELS", "METHOD_LABELS", "ENV_LABELS", "strength_label", "design_text", "meanstd",
           "best_flags", "main_frame", "main_table", "appendix_frame", "appendix_table", "default_levels", "ablation_frame", "ablation_table", "to_csv",
           "write_text", "markdown_table"]

FAMILY_ORDER = ("clean", "gaussian", "dropout", "fisher", "sparsegpt", "rtn")
#: Labels and symbols of the families and methods, read from their one table each.
FAMILY_LABELS = {f: FAMILIES[f].label for f in FAMILY_ORDER}
METHOD_LABELS = {m: d.label for m, d in METHOD_DISPLAY.items()}
#: the environments in the paper's order (tables and figure rows: ALFWorld, then WebShop)
ENV_LABELS = {"alfworld": "ALFWorld", "webshop": "WebShop"}
MACROS = (r"\providecommand{\meanstd}[2]{\ensuremath{#1\,{\scriptstyle\pm\,#2}}}" "\n"
          r"\providecommand{\bestmeanstd}[2]{\ensuremath{\mathbf{#1}\,{\scriptstyle\pm\,#2}}}" "\n")


def strength_label(family: str, strength: float, short: bool = False, clean_label: str = "BF16") -> str:
    """``$\\sigma=0.02$``, ``$p=0.01$``, ``$r=0.05$``, ``INT8``, or ``clean_label``;
    ``short`` drops the leading zero (``$\\sigma=.20$``, Table 1's headers)."""
    if family == "clean":
        return clean_label
    if family == "rtn":
        return f"INT{int(strength)}"
    v = f"{strength:.2f}"
    if short and v.startswith("0."):
        v = v[1:]
    spec = FAMILIES.get(family)
    return f"${spec.latex if spec and spec.latex else 's'}={v}$"


def _num(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def meanstd(mean: float, std: float, bold: bool = False, digits: int = 2, macro: bool = False) -> str:
    """``\\ensuremath{m\\,{\\scriptstyle\\pm\\,s}}`` (bold mean when ``bold``), or the
    ``\\meanstd{m}{s}`` / ``\\bestmeanstd{m}{s}`` macros of Table 1; ``--`` for a missing mean."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "--"
    m = _num(mean, digits)
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return rf"\ensuremath{{\mathbf{{{m}}}}}" if bold else rf"\ensuremath{{{m}}}"
    s = _num(std, digits)
    if macro:
        return rf"\bestmeanstd{{{m}}}{{{s}}}" if bold else rf"\meanstd{{{m}}}{{{s}}}"
    mm = rf"\mathbf{{{m}}}" if bold else m
    return rf"\ensuremath{{{mm}\,{{\scriptstyle\pm\,{s}}}}}"


def best_flags(means: Sequence[float], digits: int = 2) -> list[bool]:
    """True for every mean equal (as printed) to the highest one; NaN is never best."""
    shown = [None if m is None or math.isnan(m) else float(_num(m, digits)) for m in means]
    top = max((v for v in shown if v is not None), default=None)
    return [v is not None and v == top for v in shown]


def _row(summary: pd.DataFrame, where: Mapping) -> pd.Series | None:
    sel = summary
    for k, v in where.items():
        sel = sel[sel[k] == v]
    if len(sel) > 1:
        raise ValueError(f"tables: {len(sel)} summary rows match {dict(where)}; summarise by these keys first")
    return None if sel.empty else sel.iloc[0]


def _cell(summary: pd.DataFrame, where: Mapping) -> dict:
    r = _row(summary, where)
    get = (lambda k: float(r[k]) if r is not None and k in r.index and pd.notna(r[k]) else float("nan"))
    return {"mean": get("mean"), "std": get("std"), "n": get("n"), "tasks": get("tasks"), "retention": get("retention")}


def design_text(goals: int | None, seeds: int) -> str:
    """``20 goals x 3 training seeds``: what sets a number's sampling error (goals ``None``: not known)."""
    return (f"{goals} goals x " if goals is not None else "") + f"{seeds} training seed{'s' if seeds != 1 else ''}"


def _fewer_seeds(frame: pd.DataFrame, key: str, trained: Sequence[str]) -> dict[str, tuple[int, int]]:
    """The ``trained`` rows of ``frame`` (methods, variants) with fewer training seeds than the
    most of them: key -> (its seeds, the most).  The warm start, one policy, is not trained."""
    seeds = frame[frame[key].isin(list(trained))].groupby(key)["n"].max().dropna()
    return {k: (int(n), int(seeds.max())) for k, n in seeds.items() if n < seeds.max()}


def _design_footnote(fewer: Mapping[str, tuple[int, int]], goals: Mapping[str, set], ncols: int) -> str | None:
    """The note under a table: the dagger's seed counts (``fewer``: label -> (seeds, the most)),
    then the goals behind each cell (``goals``: block name, "" for one, -> goal counts); ``None``
    where there is nothing to say."""
    by_count: dict[tuple[int, int], list[str]] = {}
    for m, km in fewer.items():
        by_count.setdefault(km, []).append(m)
    said = [rf"$^\dagger$ " + "; ".join(f"{', '.join(ms)}: {k} training seed{'s' * (k != 1)}, the others {most}"
                                        for (k, most), ms in by_count.items())
            + "; no std, and a paired comparison with it uses the shared seeds."] if fewer else []
    known = {b: sorted(int(g) for g in gs if pd.notna(g)) for b, gs in goals.items()}
    known = {b: gs for b, gs in known.items() if gs}
    if known:
        said.append("Goals per cell: " + "; ".join(f"{b + ' ' if b else ''}{' or '.join(map(str, gs))}"
                                                  for b, gs in known.items()) + ".")
    return rf"\multicolumn{{{ncols}}}{{@{{}}l}}{{\footnotesize {' '.join(said)}}} \\" if said else None


# ----------------------------------------------------------------------------- Table 1
def main_frame(summary: pd.DataFrame, settings: Mapping[str, Sequence[tuple[str, float]]], methods: Sequence[str],
               *, method: str = "method", digits: int = 2) -> pd.DataFrame:
    """Table 1 as tidy rows: for each env (keys of ``settings``, in order), method and
    column ``(family, strength)``: ``mean, std, n, retention, best``."""
    out = []
    for env, cols in settings.items():
        for j, (fam, s) in enumerate(cols):
            cells = [_cell(summary, {"env": env, method: m, "family": fam, "strength": s}) for m in methods]
            for m, c, b in zip(methods, cells, best_flags([c["mean"] for c in cells], digits)):
                out.append({"env": env, "method": m, "column": j, "family": fam, "strength": s, **c, "best": b})
    return pd.DataFrame(out, columns=["env", "method", "column", "family", "strength", "mean", "std", "n", "tasks",
                                      "retention", "best"])


#: The paper's Table 1 blocks, top to bottom.
TABLE1_ENV_ORDER = ("webshop", "alfworld")


def main_table(summary: pd.DataFrame, settings: Mapping[str, Sequence[tuple[str, float]]], methods: Sequence[str],
               *, method: str = "method", highlight: str | None = "sprpo", method_labels: Mapping | None = None,
               env_labels: Mapping | None = None, digits: int = 2, retention_digits: int = 1) -> str:
    """Table 1's LaTeX (``tabular`` with booktabs rules and the ``\\meanstd`` macros,
    defined with ``\\providecommand``): per env a header row (italic env name, column
    titles), then one row per method, ``mean +- std`` and, off the clean column, the
    retention in parentheses; the best mean of each column bold (ties included); the
    ``highlight`` method's row shaded (``\\rowcolor``, needs ``colortbl``) and labelled
    "(Ours)"; the environments in the paper's order (:data:`TABLE1_ENV_ORDER`).  A trained
    method with fewer training seeds than the block's most (``n``) wears a dagger, and a note
    under the table gives the counts (its cells have no std; a paired comparison with it uses
    the shared seeds).  Every env must have the same number of columns."""
    frame = main_frame(summary, settings, methods, method=method, digits=digits)
    labels = {**METHOD_LABELS, **(method_labels or {})}
    envs = {**ENV_LABELS, **(env_labels or {})}
    widths = {len(c) for c in settings.values()}
    if len(widths) != 1:
        raise ValueError(f"main_table: every env needs the same number of columns, got {sorted(widths)}")
    ncols = widths.pop()
    lines = [MACROS.rstrip("\n"), rf"\begin{{tabular}}{{@{{}}l{'c' * ncols}@{{}}}}", r"\toprule"]
    fewer: dict[str, tuple[int, int]] = {}  # method label -> (its seeds, the most in its block)
    goals: dict[str, set] = {}  # env label -> the goal counts of its cells
    order = [e for e in TABLE1_ENV_ORDER if e in settings] + [e for e in settings if e not in TABLE1_ENV_ORDER]
    for i, (env, cols) in enumerate((e, settings[e]) for e in order):
        if i:
            lines.append(r"\midrule")
        head = [rf"\textit{{{envs.get(env, env)}}}"]
        for fam, s in cols:
            name = FAMILY_LABELS.get(fam, fam).replace(" pruning", " Pruning")
            head.append(name if fam == "clean" else
                        rf"\shortstack{{{name}\\({strength_label(fam, s, short=True)})}}")
        lines.append("\n& ".join(head) + r" \\")
        lines.append(r"\midrule")
        block = frame[frame["env"] == env]
        marked = _fewer_seeds(block, "method", list(METHODS))
        fewer.update({labels.get(m, m): km for m, km in marked.items()})
        goals[envs.get(env, env)] = set(block.loc[block["mean"].notna(), "tasks"])
        for m in methods:
            sub = block[block["method"] == m].sort_values("column")
            name = labels.get(m, m)
            if m in marked:
                name = rf"{name}$^\dagger$"
            row = []
            if m == highlight:
                row.append(r"\rowcolor{blue!8}")
                name = rf"\textbf{{{name} (Ours)}}"
            cells = [name]
            for _, c in sub.iterrows():
                txt = meanstd(c["mean"], c["std"], bool(c["best"]), digits, macro=True)
                if c["family"] != "clean" and not math.isnan(c["retention"]):
                    txt += f"~({_num(c['retention'], retention_digits)})"
                cells.append(txt)
            row.append("\n& ".join(cells) + r" \\")
            lines.extend(row)
    lines.append(r"\bottomrule")
    note = _design_footnote(fewer, goals if len(goals) > 1 else {"": g for g in goals.values()}, ncols + 1)
    lines += [note] if note else []
    lines.append(r"\end{tabular}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- appendix tables
def default_levels(summary: pd.DataFrame, env: str | None = None) -> list[tuple[str, float]]:
    """Rows of an appendix table: clean first, then each family's strengths present in
    ``summary`` (ascending; RTN from 8 bits down, as the paper)."""
    sel = summary if env is None else summary[summary["env"] == env]
    pairs = set(zip(sel["family"], sel["strength"]))
    out = [p for p in pairs if p[0] == "clean"][:1]
    known = [f for f in FAMILY_ORDER if f != "clean"] + sorted({f for f, _ in pairs} - set(FAMILY_ORDER))
    for f in known:
        out += sorted((p for p in pairs if p[0] == f), key=lambda p: -p[1] if f == "rtn" else p[1])
    return out


def appendix_frame(summary: pd.DataFrame, env: str, methods: Sequence[str], *, method: str = "method",
                   groups: Sequence[tuple[str, str]] | None = None, group_col: str = "split",
                   levels: Sequence[tuple[str, float]] | None = None, digits: int = 2) -> pd.DataFrame:
    """An appendix table as tidy rows: for each level ``(family, strength)``, group
    (``(value of group_col, title)``, e.g. ``("valid_seen", "ID")``; ``None``: one
    group) and method: ``mean, std, n, retention, best`` (best within the row and group)."""
    levels = list(levels) if levels is not None else default_levels(summary, env)
    out = []
    for fam, s in levels:
        for gval, gtitle in (groups or [(None, "")]):
            where = {"env": env, "family": fam, "strength": s}
            if gval is not None:
                where[group_col] = gval
            cells = [_cell(summary, {**where, method: m}) for m in methods]
            for m, c, b in zip(methods, cells, best_flags([c["mean"] for c in cells], digits)):
                out.append({"env": env, "group": gtitle, "family": fam, "strength": s, "method": m, **c, "best": b})
    return pd.DataFrame(out, columns=["env", "group", "family", "strength", "method", "mean", "std", "n", "tasks",
                                      "retention", "best"])


def appendix_table(summary: pd.DataFrame, env: str, methods: Sequence[str], *, method: str = "method",
                   groups: Sequence[tuple[str, str]] | None = None, group_col: str = "split",
                   levels: Sequence[tuple[str, float]] | None = None, highlight: str | None = "sprpo",
                   method_labels: Mapping | None = None, clean_label: str = "BF16", digits: int = 2) -> str:
    """An appendix table's LaTeX: ``Perturbation & Strength & <methods>`` (the
    ``highlight`` method's header bold), a ``\\midrule`` between families, the family
    name on its first row only, ``mean +- std`` cells with the row's best mean bold
    (ties included); ``groups`` repeats the method columns under ``\\multicolumn``
    titles with ``\\cmidrule``s (ALFWorld ID / OOD).  The note under it gives the goals of most
    cells; a row measured on other goals says so beside its strength, and a trained method of
    fewer training seeds wears a dagger."""
    frame = appendix_frame(summary, env, methods, method=method, groups=groups, group_col=group_col, levels=levels,
                           digits=digits)
    labels = {**METHOD_LABELS, **(method_labels or {})}
    marked = _fewer_seeds(frame, "method", list(METHODS))
    heads = [labels.get(m, m) + (r"$^\dagger$" if m in marked else "") for m in methods]
    heads = [rf"\textbf{{{h}}}" if m == highlight else h for m, h in zip(methods, heads)]
    ngroups = len(groups) if groups else 1
    k = len(methods)
    lines = [rf"\begin{{tabular}}{{@{{}}ll{'c' * (k * ngroups)}@{{}}}}", r"\toprule"]
    if groups:
        lines.append(r"\multicolumn{2}{c}{} & " + " & ".join(rf"\multicolumn{{{k}}}{{c}}{{{t}}}" for _, t in groups)
                     + r" \\")
        lines.append("".join(rf"\cmidrule(lr){{{3 + i * k}-{2 + (i + 1) * k}}}" for i in range(ngroups)))
    lines.append(" & ".join(["Perturbation", "Strength", *heads * ngroups]) + r" \\")
    measured = frame[frame["mean"].notna() & frame["tasks"].notna()]
    common = measured["tasks"].mode().max() if len(measured) else None  # the goals of most cells
    prev = None
    for fam, s in (list(levels) if levels is not None else default_levels(summary, env)):
        if fam != prev:
            lines.append(r"\midrule")
        sub = frame[(frame["family"] == fam) & (frame["strength"] == s)]
        cells = [meanstd(c["mean"], c["std"], bool(c["best"]), digits) for _, c in sub.iterrows()]
        first = "" if fam == prev else FAMILY_LABELS.get(fam, fam)
        goals = sorted({int(g) for g in sub["tasks"].dropna()} - {int(common)}) if common is not None else []
        level = strength_label(fam, s, clean_label=clean_label) + (f" ({'/'.join(map(str, goals))} goals)" if goals else "")
        lines.append(" & ".join([first, level, *cells]) + r" \\")
        prev = fam
    note = _design_footnote({labels.get(m, m): km for m, km in marked.items()},
                            {"": {common} if common is not None else set()}, 2 + k * ngroups)
    lines += [r"\bottomrule", *([note] if note else []), r"\end{tabular}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- ablation tables
def ablation_frame(summary: pd.DataFrame, env: str, groups: Sequence[tuple[str, Sequence[tuple[str, str]]]],
                   settings: Sequence[tuple[str, float]], *, method: str = "method", digits: int = 2) -> pd.DataFrame:
    """The ablation tables as tidy rows: per group ``(title, [(variant key, row label)])``,
    variant and column ``(family, strength)``: ``mean, std, n, retention, best`` (best
    within the group's column, ties included)."""
    out = []
    for title, members in groups:
        for j, (fam, s) in enumerate(settings):
            cells = [_cell(summary, {"env": env, method: k, "family": fam, "strength": s}) for k, _ in members]
            for (k, label), c, b in zip(members, cells, best_flags([c["mean"] for c in cells], digits)):
                out.append({"env": env, "group": title, "variant": k, "label": label, "column": j, "family": fam,
                            "strength": s, **c, "best": b})
    return pd.DataFrame(out, columns=["env", "group", "variant", "label", "column", "family", "strength", "mean",
                                      "std", "n", "tasks", "retention", "best"])


def ablation_table(summary: pd.DataFrame, env: str, groups: Sequence[tuple[str, Sequence[tuple[str, str]]]],
                   settings: Sequence[tuple[str, float]], *, first_column: str = "Value", method: str = "method",
                   digits: int = 2) -> str:
    """The App. tables "Hyperparameter study" / "Component ablations" in the paper's layout:
    ``first_column`` then Table 1's columns (short headers), one italic title row per group
    when there are several, ``mean +- std`` cells with the group's best mean bold."""
    frame = ablation_frame(summary, env, groups, settings, method=method, digits=digits)
    marked = _fewer_seeds(frame, "variant", list(frame["variant"]))  # every variant is trained
    heads = []
    for fam, s in settings:
        name = {"clean": "Clean", "fisher": "Struct.", "sparsegpt": "Unstruct."}.get(fam, FAMILY_LABELS.get(fam, fam))
        if fam not in ("clean", "rtn"):
            name = rf"\shortstack{{{name}\\{strength_label(fam, s, short=True)}}}"
        heads.append(strength_label(fam, s) if fam == "rtn" else name)
    n = len(settings) + 1
    lines = [rf"\begin{{tabular}}{{@{{}}l{'c' * len(settings)}@{{}}}}", r"\toprule", " & ".join([first_column, *heads]) + r" \\",
             r"\midrule"]
    for i, (title, members) in enumerate(groups):
        if len(groups) > 1:
            if i:
                lines.append(r"\midrule")
            lines += [rf"\multicolumn{{{n}}}{{l}}{{\textit{{{title}}}}} \\", r"\midrule"]
        for k, label in members:
            sub = frame[(frame["group"] == title) & (frame["variant"] == k)].sort_values("column")
            cells = [meanstd(c["mean"], c["std"], bool(c["best"]), digits) for _, c in sub.iterrows()]
            lines.append(" & ".join([label + (r"$^\dagger$" if k in marked else ""), *cells]) + r" \\")
    note = _design_footnote({label: marked[k] for _, members in groups for k, label in members if k in marked},
                            {"": set(frame.loc[frame["mean"].notna(), "tasks"])}, n)
    lines += [r"\bottomrule", *([note] if note else []), r"\end{tabular}"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- files
def to_csv(frame: pd.DataFrame, path: str | Path | None = None, digits: int | None = None) -> str:
    """CSV text of a table frame (or a summary); written atomically to ``path`` if given."""
    text = (frame.round(digits) if digits is not None else frame).to_csv(index=False)
    if path is not None:
        atomic_write_text(path, text)
    return text


def write_text(path: str | Path, text: str) -> Path:
    """Write a LaTeX table atomically."""
    return atomic_write_text(path, text)


def markdown_table(df: pd.DataFrame, digits: int = 1) -> str:
    """A data frame as a Markdown table (floats to ``digits`` places, missing values "-")."""
    def cell(v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return f"{v:.{digits}f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)
