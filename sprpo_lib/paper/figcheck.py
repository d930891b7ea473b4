"""What a reader can trust at a glance, checked on the figure object before it is saved.

Two rules, each a pure function of a matplotlib figure that returns readable problems
(an empty list: the figure passes):

* :func:`text_problems`: every visible text (titles, axis and tick labels, legend entries,
  annotations) lies inside the canvas and overlaps no other text, measured with the
  renderer's own bounding boxes;
* :func:`line_problems`: every drawn line of data joins points of one evaluation design.
  The plotting code states the design a line was drawn from in its ``gid``
  (:func:`design_gid`: ``design:<goals>x<seeds>``, or ``reference:<what>`` for a line
  that is not measured data); a line with no such tag, or a tag naming several designs,
  is a problem.  A design is what sets a point's sampling error: test goals per split
  and training seeds.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text

__all__ = ["DESIGN", "REFERENCE", "design_gid", "drawn_tick_labels", "data_lines", "text_problems", "line_problems",
           "figure_problems"]

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
    canvas = fig.canvas if hasattr(fig.canvas, "get_renderer") else FigureCanvasAgg(fig)
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


def text_problems(fig, tolerance: float = OVERLAP_TOLERANCE_PX) -> list[str]:
    """Texts outside the figure's canvas, and pairs of texts whose boxes overlap by more
    than ``tolerance`` pixels in both directions."""
    r = _renderer(fig)
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


def line_problems(fig) -> list[str]:
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


def figure_problems(fig, rules: Sequence[str] = ("text", "lines")) -> list[str]:
    """Every problem of ``fig`` under ``rules`` (``text``, ``lines``)."""
    out = []
    if "text" in rules:
        out += text_problems(fig)
    if "lines" in rules:
        out += line_problems(fig)
    return out
