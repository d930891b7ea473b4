"""Progress bars for long work: one helper, so every bar behaves the same everywhere.

* In a terminal, a plain ``tqdm`` bar; in JupyterLab, a widget (``tqdm.auto`` with
  ``ipywidgets``).
* Under ``sprpo-reproduce`` (``SPRPO_PROGRESS=lines``, inherited by the notebook kernels
  papermill starts), a text bar on stderr redrawn at most every
  :data:`LINE_INTERVAL_S` seconds, which ``reproduce`` streams to its own terminal: a
  40-minute training cell shows its iterations, their seconds and an ETA there, not
  only papermill's "cell 2/7".  Transient inner bars (``leave=False``: one rollout, one
  warm-start epoch) stay silent there, so each line is an outer bar's.
"""
from __future__ import annotations

import os
import sys

from tqdm import std as tqdm_std
from tqdm.auto import tqdm

PROGRESS_ENV = "SPRPO_PROGRESS"
LINE_INTERVAL_S = 10.0


def progress_bar(iterable=None, **kwargs):
    """A ``tqdm`` bar (same arguments) in the form that suits where it is shown."""
    if os.environ.get(PROGRESS_ENV) == "lines":
        if kwargs.get("leave") is False:  # a transient inner bar (one rollout): only its outer bar is shown
            kwargs["disable"] = True
        kwargs.setdefault("file", sys.stderr)
        kwargs.setdefault("mininterval", LINE_INTERVAL_S)
        kwargs.setdefault("ascii", True)
        kwargs.setdefault("ncols", 110)
        return tqdm_std.tqdm(iterable, **kwargs)

    return tqdm(iterable, **kwargs)
