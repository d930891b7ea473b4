"""The figure check (sprpo_lib.paper.figcheck): texts inside the canvas without overlap, legends
clear of the data, lines that join points of one design; it fails on the old Fig. 3 and passes on the new one, drawn
from the committed rows."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from sprpo_lib.infra.paths import figures_dir  # noqa: E402
from sprpo_lib.paper import experiments as X  # noqa: E402
from sprpo_lib.paper import figcheck as F  # noqa: E402
from sprpo_lib.paper import results as R  # noqa: E402


def test_text_rule_finds_overlaps_and_texts_off_the_canvas():
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.set_title("a title")
    fig.tight_layout()
    assert F.text_problems(fig) == []
    ax.text(0.5, 0.5, "one label", transform=ax.transAxes)
    ax.text(0.52, 0.5, "another label", transform=ax.transAxes)
    fig.text(0.5, -0.2, "below the canvas")
    got = F.text_problems(fig)
    assert any("'one label' and 'another label' overlap" in p for p in got)
    assert any("'below the canvas' lies outside the canvas" in p for p in got)
    assert len(got) == 2
    plt.close(fig)


def test_legend_rule_finds_legends_over_data_and_passes_legends_beside_it():
    """A legend over a line, an error bar, scatter points or bars is flagged; the same legend
    under the axes (style.legend_below) or over a filled background only is not."""
    from sprpo_lib.paper.style import legend_below

    def drawn(what, below=False):
        fig, ax = plt.subplots(figsize=(3, 2.5))
        x = np.linspace(0, 1, 30)
        if what == "line":
            ax.plot(x, 0.1 * x, label="flat")  # low: clear of the upper-right legend
            ax.plot(x, x, label="rising")
        elif what == "errorbar":
            ax.errorbar([0.95], [0.5], yerr=[0.45], fmt="none", label="bar")
            ax.plot([0, 0.1], [0, 0.1], label="short")
        elif what == "scatter":
            ax.scatter(x, np.full_like(x, 0.9), label="point")
        elif what == "bars":
            ax.bar([0.9], [1.0], width=0.2, label="bar")
        elif what == "background":
            X, Y = np.meshgrid(x, x)
            ax.contourf(X, Y, X + Y)
            ax.plot([0, 0.1], [0, 0.1], label="short")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="x")
        (legend_below(ax) if below else ax.legend(loc="upper right"))
        fig.tight_layout()
        got = F.legend_problems(fig)
        plt.close(fig)
        return got

    assert any("rising" in p and "flat" not in p for p in drawn("line"))
    assert any("error bars" in p or "bar" in p for p in drawn("errorbar"))
    assert any("point" in p for p in drawn("scatter"))
    assert any("bar(s)" in p for p in drawn("bars"))
    assert drawn("background") == []
    for what in ("line", "errorbar", "scatter", "bars"):
        assert drawn(what, below=True) == [], what
    with pytest.raises(ValueError, match="unknown rule"):
        F.figure_problems(plt.figure(), ("text", "legends"))


def test_crossing_rule_finds_a_line_through_a_value_and_passes_one_behind_a_background():
    """The dashed clean level through a bar's value label is found; the same label on an opaque
    box drawn over the line is not; a label clear of the line never is."""
    for boxed, want in ((None, 1), (dict(fc="white", ec="none", alpha=0.9), 0)):
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.bar([0, 1], [18.0, 40.0])
        ax.axhline(18.3, ls="--", color="k", gid="reference:clean success")
        ax.text(0, 18.0, "18", ha="center", va="center", bbox=boxed, zorder=3)
        ax.text(1, 41.0, "40", ha="center", va="bottom", bbox=boxed, zorder=3)
        ax.set_ylim(0, 60)
        found = F.crossing_problems(fig)
        assert len(found) == want, found
        assert all("reference:clean success" in p and "'18'" in p for p in found)
        plt.close(fig)


def test_off_view_tick_labels_are_not_texts():
    """matplotlib keeps labels for ticks outside the view; they are never drawn, never checked."""
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 0.2], [0, 100])
    ax.set_xlim(-0.01, 0.21)
    fig.canvas.draw()
    drawn = F.drawn_tick_labels(ax.xaxis)
    assert 0 < len(drawn) < len(ax.get_xticklabels())
    assert all(-0.01 <= t.get_position()[0] <= 0.21 for t in drawn)
    plt.close(fig)


def test_line_rule_needs_one_stated_design():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 2], label="untagged")
    ax.plot([0, 1], [1, 2], gid=F.design_gid(24, 2), label="tagged")
    ax.plot([0, 1], [1, 2], gid="design:24x2,10x1", label="mixed")
    ax.plot([0, 1], [3, 3], gid=F.REFERENCE + "chance", label="reference")
    ax.plot([0, 1], [1, 2], linestyle="none", marker="o", label="markers only")
    ax.plot([0, np.nan], [1, np.nan], label="one point")
    got = F.line_problems(fig)
    assert len(got) == 2 and "'untagged'" in got[0] and "several designs (24x2,10x1)" in got[1]
    plt.close(fig)


def _curve_rows(p: X.Plan, rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of the old Fig. 3's one design: the curve policies' training seeds (``curve_seeds``)
    and the first ``curve_tasks`` goals of each split, at every setting, so that a line
    joins points measured alike (Table 1's larger design stays in Table 1)."""
    goals = p.curve_tasks or p.tasks
    keep = rows["train_seed"].isin(p.curve_seeds) if p.curve_seeds is not None else True
    if goals is not None:
        keep = keep & (rows["task_index"] < goals)
    return rows[keep]


def _committed_summary() -> tuple[pd.DataFrame, pd.DataFrame]:
    """The committed cpu rows of both envs: their summary (Table 1's design at clean and the
    table settings, the curve design elsewhere) and the summary of Fig. 3's one design."""
    out = figures_dir()
    paths = {e: out / f"04_robustness_{e}_rows.csv" for e in ("alfworld", "webshop")}
    if not all(p.is_file() for p in paths.values()):
        pytest.skip("no committed cpu rows")
    rows = {e: X.load_rows(p) for e, p in paths.items()}
    plans = {e: _recorded_plan(out, e) for e in rows}
    whole = pd.concat([R.summary_of(r) for r in rows.values()])
    curve = pd.concat([R.summary_of(_curve_rows(plans[e], r)) for e, r in rows.items()])
    return whole, curve


def _recorded_plan(out, env: str) -> X.Plan:
    import json

    rec = json.loads((out / f"04_robustness_{env}_rows.csv.manifest.json").read_text())
    return X.Plan.from_dict(rec["config"]["plan"][env])


def _old_fig3(summary: pd.DataFrame):
    """Fig. 3 as the first cpu run drew it: one errorbar line per method and family through
    every point it has, whatever design each point came from, legend below the axes."""
    fams = ["gaussian", "rtn"]
    fig, axes = plt.subplots(1, 2, figsize=(6.2, 2.9))
    web = summary[summary.env == "webshop"]
    for ax, fam in zip(axes, fams):
        for m in ("vanilla", "sprpo"):
            pts = pd.concat([web[(web.method == m) & (web.family == "clean")], web[(web.method == m) & (web.family == fam)]])
            ax.errorbar(range(len(pts)), pts["mean"], yerr=pts["std"].fillna(0).to_numpy(), label=m)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2)
    return fig


def test_the_old_fig3_fails_and_the_new_one_passes_on_the_committed_rows(tmp_path, monkeypatch):
    whole, curve = _committed_summary()
    old = _old_fig3(whole)
    problems = F.figure_problems(old)
    assert any("without a stated design" in p for p in problems)
    assert any("outside the canvas" in p for p in problems)  # the legend hung below the figure
    plt.close(old)

    figs = []
    monkeypatch.setattr(R, "save_figure", lambda fig, path, **kw: figs.append(fig) or [])
    R.plot_curves(curve, ["warm_start", "vanilla", "gaussian", "sam", "sprpo"], tmp_path / "fig3",
                  title="cpu profile: success vs strength, every environment of the plan")
    assert F.figure_problems(figs[0]) == []
    # and each tag tells the truth: every joined point is a summary row of the stated design
    for ax in figs[0].axes:
        for line in F.data_lines(ax):
            goals, seeds = map(int, line.get_gid()[len(F.DESIGN):].split("x"))
            env = "ALFWorld" if ax.get_subplotspec().rowspan.start == 0 else "WebShop"
            part = curve[curve.env == env.lower()]
            assert ((part["tasks"] == goals) & (part["n"] == seeds)).any()
            ys = [y for y in line.get_ydata() if np.isfinite(y)]
            assert set(np.round(ys, 3)) <= set(np.round(part["mean"], 3))

    # a point of another design (here: one of Vanilla's, on half the goals) stays off the line
    figs.clear()
    mixed = whole.reset_index(drop=True)
    other = mixed.index[(mixed["method"] == "vanilla") & (mixed["family"] == "gaussian")][:1]
    mixed.loc[other, "tasks"] = mixed.loc[other, "tasks"] // 2
    R.plot_curves(mixed, ["vanilla", "sprpo"], tmp_path / "mixed")
    assert F.line_problems(figs[0]) == []
    hollow = [ln for ax in figs[0].axes for ln in ax.get_lines() if ln.get_markerfacecolor() == "white"]
    assert hollow and all(len(ln.get_xdata()) == 1 for ln in hollow)


def test_fig4_is_a_heat_map_of_the_measured_cells(tmp_path, monkeypatch):
    """Fig. 4 draws each grid point as one cell with its value (no interpolated surface or
    contour), the centre outlined, and the episodes per cell in a footnote."""
    rows = pd.DataFrame([{"method": m, "family": "plane", "strength": w1, "w2": w2, "task_index": t,
                          "success": float((t + int(10 * w1) + int(10 * w2)) % 3 == 0)}
                         for m in ("vanilla", "sprpo") for w1 in (-0.2, 0.0, 0.2) for w2 in (-0.2, 0.0, 0.2)
                         for t in range(6)])
    figs = []
    monkeypatch.setattr(R, "save_figure", lambda fig, path, **kw: figs.append(fig) or [])
    R.plot_landscape(rows, ["vanilla", "sprpo"], tmp_path / "fig4", title="a title")
    fig = figs[0]
    heat = [ax for ax in fig.axes if ax.images]
    assert len(heat) == 2 and not any(ax.collections for ax in heat)  # no contour bands
    assert all(ax.name == "rectilinear" for ax in fig.axes)  # no 3-D surface
    w1, w2, z = R.landscape_grid(rows, "vanilla")
    assert np.array_equal(heat[0].images[0].get_array(), z)  # the cells are the measured means
    assert sorted(t.get_text() for t in heat[0].texts) == sorted(f"{v:.0f}" for v in z.ravel())
    assert len(heat[0].patches) == 1  # the unperturbed centre
    assert any("6 episodes per cell" in t.get_text() for t in fig.texts)
    assert F.figure_problems(fig) == []
