"""What a reader can trust at a glance, checked on the figure object before it is saved.

Four rules, each a pure function of a matplotlib figure that returns readable problems
(an empty list: the figure passes):

* :func:`text_problems`: every visible text (titles, axis and tick labels, legend entries,
  annotations) lies inside the canvas and overlaps no other text, measured with the
  renderer's own bounding boxes;
* :func:`legend_problems`: no legend hides data: a line, error bar, marker, scatter point or
  bar of its axes drawn under the legend's box (filled backgrounds such as contours and
  bands are not data a legend can hide);
* :func:`line_problems`: every drawn line of data joins points of one evaluation design.
  The plotting code states the design a line was drawn from in its ``gid``
  (:func:`design_gid`: ``design:<goals>x<seeds>``, or ``reference:<what>`` for a line
  that is not measured data); a line with no such tag, or a tag naming several designs,
  is a problem.  A design is what sets a point's sampling error: test goals per split
  and training seeds;
* :func:`crossing_problems`: no line runs through a text inside its axes (a value label on
  a bar under the dashed clean level) unless the text sits on an opaque box drawn over it.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.path import Path
from matplotlib.text import Text
from matplotlib.transforms import Bbox

__all__ = ["DESIGN", "REFERENCE", "RULES", "warn_problems", "design_gid", "drawn_tick_labels", "data_lines", "text_problems",
           "legend_problems", "line_problems", "crossing_problems", "figure_problems"]

log = logging.getLogger(__name__)

DESIGN = "design:"
REFERENCE = "reference:"
#: Pixels two boxes may share before they count as overlapping (antialiasing, kerning).
OVERLAP_TOLERANCE_PX = 1.0


def design_gid(goals: int, seeds: int) -> str:
    """The ``gid`` of a line whose points were all measured on ``goals`` test goals per split
    over ``seeds`` training seeds."""
    return f"{DESIGN}{int(goals)}x{int(seeds)}"


def _renderer(fig):
    """The figure drawn by an Agg canvas (a closed figure gets a new one), and its renderer."""
    fresh = not hasattr(fig.canvas, "get_renderer")
    canvas = FigureCanvasAgg(fig) if fresh else fig.canvas
    if fresh or fig.stale:  # a figure changed since its last draw is stale
        canvas.draw()
    return canvas.get_renderer()


def drawn_tick_labels(axis) -> list:
    """The major tick labels matplotlib draws: those of ticks inside the view interval."""
    lo, hi = sorted(axis.get_view_interval())
    eps = 1e-9 * max(1.0, abs(hi - lo))
    return [t for loc, t in zip(axis.get_majorticklocs(), axis.get_majorticklabels()) if lo - eps <= loc <= hi + eps]


def _texts(fig) -> list:
    """Every visible, non-empty text the figure draws: its own texts and titles, its
    legends, and per axes the titles, axis labels, texts, legend and the tick labels of
    the ticks inside the view (matplotlib keeps labels of off-view ticks, never drawn)."""
    found = [*fig.texts, *(t for lg in fig.legends for t in lg.get_texts())]  # fig.texts holds the suptitle
    for ax in fig.get_axes():
        found += [c for c in ax.get_children() if isinstance(c, Text)]  # titles (centre, left, right), texts
        found += [ax.xaxis.label, ax.yaxis.label, *drawn_tick_labels(ax.xaxis), *drawn_tick_labels(ax.yaxis)]
        if ax.get_legend() is not None:
            found += ax.get_legend().get_texts()
    seen, out = set(), []
    for t in found:
        if t is None or id(t) in seen or not t.get_visible() or not t.get_text().strip():
            continue
        seen.add(id(t))
        out.append(t)
    return out


def _name(t) -> str:
    text = t.get_text().replace("\n", " ")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def text_problems(fig, tolerance: float = OVERLAP_TOLERANCE_PX, renderer=None) -> list[str]:
    """Texts outside the figure's canvas, and pairs of texts whose boxes overlap by more
    than ``tolerance`` pixels in both directions (``renderer``: of the figure drawn as it is)."""
    r = renderer or _renderer(fig)
    canvas = fig.bbox
    boxes = [(t, t.get_window_extent(r)) for t in _texts(fig)]
    out = []
    for t, b in boxes:
        if (b.x0 < canvas.x0 - tolerance or b.y0 < canvas.y0 - tolerance
                or b.x1 > canvas.x1 + tolerance or b.y1 > canvas.y1 + tolerance):
            out.append(f"text {_name(t)} lies outside the canvas ({b.x0:.0f}..{b.x1:.0f} x {b.y0:.0f}..{b.y1:.0f} px, "
                       f"canvas {canvas.width:.0f} x {canvas.height:.0f})")
    for i, (t1, b1) in enumerate(boxes):
        for t2, b2 in boxes[i + 1:]:
            dx = min(b1.x1, b2.x1) - max(b1.x0, b2.x0)
            dy = min(b1.y1, b2.y1) - max(b1.y0, b2.y0)
            if dx > tolerance and dy > tolerance:
                out.append(f"texts {_name(t1)} and {_name(t2)} overlap ({dx:.0f} x {dy:.0f} px)")
    return out


def _no_line(style) -> bool:
    return style in ("None", "none", "", " ")


def _points_in(xy: np.ndarray, box) -> bool:
    xy = xy[np.isfinite(xy).all(axis=1)]
    return bool(len(xy)) and bool(((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1)
                                   & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)).any())


def _path_hits(xy: np.ndarray, box) -> bool:
    """A polyline in display pixels crosses or enters ``box`` (NaN gaps split it)."""
    ok = np.isfinite(xy).all(axis=1)
    runs = np.split(xy, np.flatnonzero(~ok))
    return any(len(r) > 1 and Path(r).intersects_bbox(box, filled=False)
               for r in (run[np.isfinite(run).all(axis=1)] for run in runs))


def _hidden_by(ax, box, renderer) -> list[str]:
    """What of ``ax``'s data is drawn inside ``box`` (display pixels)."""
    hits = []
    for line in ax.get_lines():
        if not line.get_visible():
            continue
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        drawn = (not _no_line(line.get_linestyle()) and _path_hits(xy, box)) or (
            line.get_marker() not in (None, "None", "none", "", " ") and _points_in(xy, box))
        if drawn:
            hits.append(line.get_label() if not str(line.get_label()).startswith("_") else "a line")
    for coll in ax.collections:
        if not coll.get_visible():
            continue
        if isinstance(coll, LineCollection):  # error bars, vlines
            t = coll.get_transform()
            if any(_path_hits(t.transform(p.vertices), box) for p in coll.get_paths()):
                hits.append(coll.get_label() if not str(coll.get_label()).startswith("_") else "error bars")
        elif len(coll.get_offsets()) and type(coll).__name__ == "PathCollection":  # scatter points
            if _points_in(coll.get_offset_transform().transform(np.asarray(coll.get_offsets(), dtype=float)), box):
                hits.append(coll.get_label() if not str(coll.get_label()).startswith("_") else "scatter points")
    bars = [p for p in ax.patches if p.get_visible() and type(p).__name__ == "Rectangle"
            and p.get_window_extent(renderer).overlaps(box)]
    if bars:
        hits.append(f"{len(bars)} bar(s)")
    return hits


def legend_problems(fig, renderer=None) -> list[str]:
    """Legends drawn over their axes' data (the part of the legend's box inside the axes)."""
    r = renderer or _renderer(fig)
    out = []
    for k, ax in enumerate(fig.get_axes()):
        lg = ax.get_legend()
        if lg is None or not lg.get_visible():
            continue
        box = Bbox.intersection(lg.get_window_extent(r), ax.get_window_extent(r))
        if box is None or box.width <= 0 or box.height <= 0:
            continue  # a legend outside the axes hides nothing
        hits = _hidden_by(ax, box, r)
        if hits:
            where = ax.get_title().replace("\n", " ")[:40] or f"axes {k}"
            out.append(f"{where!r}: the legend hides {', '.join(dict.fromkeys(map(str, hits)))}")
    return out


def data_lines(ax) -> list:
    """The axes' lines that join points: two or more points drawn with a visible line style."""
    out = []
    for line in ax.get_lines():
        if not line.get_visible() or line.get_linestyle() in ("None", "none", "", " "):
            continue
        x = np.asarray(line.get_xdata(), dtype=float)
        y = np.asarray(line.get_ydata(), dtype=float)
        if np.count_nonzero(np.isfinite(x) & np.isfinite(y)) >= 2:
            out.append(line)
    return out


def line_problems(fig, renderer=None) -> list[str]:
    """Lines of data with no design tag, or whose tag names more than one design."""
    out = []
    for k, ax in enumerate(fig.get_axes()):
        where = ax.get_title() or f"axes {k}"
        for line in data_lines(ax):
            gid = line.get_gid() or ""
            label = line.get_label() if not str(line.get_label()).startswith("_") else "unlabelled line"
            if gid.startswith(REFERENCE):
                continue
            if not gid.startswith(DESIGN):
                out.append(f"{where}: line {label!r} joins points without a stated design (gid {gid!r})")
            elif "," in gid[len(DESIGN):]:
                out.append(f"{where}: line {label!r} joins points of several designs ({gid[len(DESIGN):]})")
    return out


def crossing_problems(fig, renderer=None) -> list[str]:
    """Texts inside axes (value labels, notes) that a drawn line runs through, with no opaque
    background drawn over the line (``bbox`` with a face, above the line's ``zorder``)."""
    r = renderer or _renderer(fig)
    out = []
    for k, ax in enumerate(fig.get_axes()):
        where = ax.get_title().replace("\n", " ")[:40] or f"axes {k}"
        for t in ax.texts:
            if not t.get_visible() or not t.get_text().strip():
                continue
            box = t.get_window_extent(r)
            patch = t.get_bbox_patch()
            for line in ax.get_lines():
                if not line.get_visible() or _no_line(line.get_linestyle()):
                    continue
                covered = (patch is not None and patch.get_facecolor()[3] * (patch.get_alpha() or 1.0) >= 0.5
                           and t.get_zorder() > line.get_zorder())
                xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
                if not covered and _path_hits(xy, box):
                    name = line.get_label() if not str(line.get_label()).startswith("_") else (line.get_gid() or "a line")
                    out.append(f"{where!r}: {name} runs through text {_name(t)}")
    return out


#: The rules by name (a figure that draws no measured lines, such as the theory checks,
#: leaves out ``lines``).
RULES = {"text": text_problems, "legend": legend_problems, "lines": line_problems, "crossed": crossing_problems}


def figure_problems(fig, rules: Sequence[str] = ("text", "legend", "lines", "crossed")) -> list[str]:
    """Every problem of ``fig`` under ``rules`` (names in :data:`RULES`)."""
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"figure_problems: unknown rule(s) {sorted(unknown)}; rules: {list(RULES)}")
    renderer = _renderer(fig)  # one draw for every rule (reading tick labels marks a figure stale)
    return [p for name in rules for p in RULES[name](fig, renderer=renderer)]


def warn_problems(fig, name: str, rules: Sequence[str] = ("text", "legend", "lines", "crossed")) -> list[str]:
    """:func:`figure_problems` of ``fig`` logged as warnings under the figure's ``name`` (so a
    notebook's output shows them before the figure is saved); returns them."""
    problems = figure_problems(fig, rules)
    for problem in problems:
        log.warning("figure %s: %s", name, problem)
    return problems
