"""The figures' one visual language: a seaborn theme, one colour per method (from
:data:`METHOD_DISPLAY`), and colours for everything that is not a method
drawn from a palette that shares none of them, so that a method's colour means that
method in every figure.

* :func:`apply`: the theme (seaborn's ``paper`` context, white grid, font sizes readable at
  the README's width); :func:`pyplot` (the Agg backend with the theme) is how every
  plotting function of :mod:`sprpo_lib.paper` gets matplotlib.
* :data:`METHOD_DISPLAY`: every method's label, colour and marker (the one place they live);
  :data:`METHOD_COLORS`, :data:`METHOD_MARKERS` read it.
* :data:`ROLE_COLORS`: named roles that are not methods (clean vs perturbed bars, the
  theory figures' runs and bounds); :func:`role` looks one up.
* :func:`save_figure`: every figure's one way to disk: the figure check first, then PNG and
  PDF written atomically, with no creation date or producer, so a render-only pass rewrites
  the same bytes.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import matplotlib
import matplotlib.pyplot as plt
import seaborn as sns

from sprpo_lib.infra.io import atomic_write_bytes
from sprpo_lib.paper.figcheck import RULES, warn_problems

__all__ = ["METHOD_DISPLAY", "METHOD_COLORS", "METHOD_MARKERS", "ROLE_COLORS", "NEUTRAL", "LABEL_BOX", "apply", "pyplot", "role",
           "save_figure"]


@dataclass(frozen=True)
class MethodDisplay:
    """How figures and tables show a method: its name, its one colour and its one marker
    everywhere."""

    label: str
    color: str
    marker: str = "o"


#: Every method's label and colour, in the paper's order (the baselines, then SPrPO), and
#: the warm-start reference; the plans, figures and tables read it.
METHOD_DISPLAY: dict[str, MethodDisplay] = {
    "vanilla": MethodDisplay("Vanilla", "#7f7f7f", "o"),
    "gaussian": MethodDisplay("Gaussian", "#1f77b4", "s"),
    "sam": MethodDisplay("SAM", "#ff7f0e", "^"),
    "sprpo": MethodDisplay("SPrPO", "#d62728", "D"),
    # not a training method: the supervised warm start every cpu run starts from (a reference row)
    "warm_start": MethodDisplay("Warm start", "#2ca02c", "v"),
}

METHOD_COLORS = {m: d.color for m, d in METHOD_DISPLAY.items()}
METHOD_MARKERS = {m: d.marker for m, d in METHOD_DISPLAY.items()}
#: Greys for what carries no identity (references, separators, clean baselines).
NEUTRAL = {"light": "#c7c7c7", "mid": "#7f7f7f", "dark": "#3b3b3b"}
#: A value label's opaque box (``bbox=``, with ``zorder`` above the lines): a reference line passes behind it.
LABEL_BOX = {"fc": "white", "ec": "none", "pad": 0.4, "alpha": 0.9}
#: Roles that are not methods, in colours no method wears (tab10's purple, brown, pink,
#: olive and cyan; the methods hold its grey, blue, orange, red and green).
ROLE_COLORS = {
    "clean": NEUTRAL["light"],
    "perturbed": "#8c564b",
    "unconstrained": "#9467bd",
    "bound": "#9467bd",
    "stable_m": "#17becf",
    "stable_mu": "#bcbd22",
    "accent": "#e377c2",
}

_THEME = {"axes.titlesize": 9, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
          "legend.fontsize": 7, "figure.titlesize": 9, "savefig.dpi": 150}


def apply() -> None:
    """The shared theme: seaborn ``whitegrid`` at the ``paper`` context, with the sizes
    above (idempotent; cheap enough to call at the top of every plotting function)."""
    sns.set_theme(context="paper", style="whitegrid", rc=_THEME)


def pyplot():
    """matplotlib's pyplot on the Agg backend (headless: papermill, CI) with the theme applied."""
    matplotlib.use("Agg")

    apply()
    return plt


#: per format: matplotlib's metadata keys that would record when or with what a file was made
_NO_STAMP = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None}}


def save_figure(fig, path: str | Path, *, dpi: int = 150, rules: Sequence[str] = tuple(RULES),
                formats: Sequence[str] = ("png", "pdf")) -> list[Path]:
    """Save ``fig`` beside ``path`` (its suffix replaced) in each of ``formats``, each rendered in
    memory and written atomically; returns the paths.  The figure check
    (:func:`sprpo_lib.paper.figcheck.warn_problems` under ``rules``) runs first and its problems
    are logged as warnings, so a notebook's output shows them."""
    warn_problems(fig, Path(path).name, rules)
    stem, out = Path(path).with_suffix(""), []
    for ext in formats:
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=dpi, bbox_inches="tight", metadata=_NO_STAMP[ext])
        out.append(atomic_write_bytes(stem.with_name(f"{stem.name}.{ext}"), buf.getvalue()))
    plt.close(fig)
    return out


def legend_below(ax, ncol: int = 1, **kw):
    """The axes' legend under its x label, clear of the data it explains (the figure check's
    legend rule); ``tight_layout`` and ``bbox_inches="tight"`` make room for it."""
    return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, frameon=False, **kw)


def role(name: str) -> str:
    """The colour of a non-method role (one clear error for an unknown one)."""
    if name not in ROLE_COLORS:
        raise KeyError(f"style.role: unknown role {name!r}; roles: {sorted(ROLE_COLORS)}")
    return ROLE_COLORS[name]
