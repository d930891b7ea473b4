"""Where things live, resolved in one place and never against the working directory.

* The **project root** holds ``runs/`` (training runs, warm starts, the evaluation-cell
  cache, benchmark JSON) and ``figures/``: ``$SPRPO_HOME`` when set, else the checkout
  that holds this package and ``notebooks/`` (a clone, installed with ``pip install -e .``).
  A copy installed into site-packages has no checkout: set ``SPRPO_HOME`` there.
* The **user cache** holds what any project can share (converted models, generated
  ALFWorld games, the dtype probe): ``$SPRPO_CACHE`` or ``~/.cache/sprpo``.

A relative path of the project's own files (a notebook's ``out_dir``, ``--cache-dir``,
``--out``, ``--calibration``, ``--run``) is taken relative to the project root, so a
notebook run from ``notebooks/`` (as JupyterLab does) writes to the same ``figures/`` as
``sprpo-reproduce`` run from anywhere.  Inputs from outside the project (a model folder,
a data folder) are used as given, like any command-line path.
"""
from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SPRPO_HOME"
CACHE_ENV = "SPRPO_CACHE"


class ProjectRootError(RuntimeError, ValueError):
    """No usable project root (a ``SPRPO_HOME`` that does not exist, an install outside a
    checkout); a ``ValueError`` too, so the commands print it as their one-line error."""


def package_checkout() -> Path:
    """The folder above the ``sprpo_lib`` package (the checkout, for an editable install)."""
    return Path(__file__).resolve().parents[2]


def project_root() -> Path:
    """``$SPRPO_HOME`` (an existing folder: it is never created silently), else the
    checkout holding ``sprpo_lib/`` and ``notebooks/``."""
    home = os.environ.get(HOME_ENV)
    if home:
        root = Path(home).expanduser().resolve()
        if not root.is_dir():  # a typo would otherwise scatter outputs into a new folder
            raise ProjectRootError(f"{HOME_ENV}={home}: no such folder. Fix: correct the path, or create it first "
                               f"(mkdir -p {root}) to start a new project root there")
        return root
    checkout = package_checkout()
    if (checkout / "notebooks").is_dir():
        return checkout
    raise ProjectRootError(f"sprpo_lib is installed at {checkout}, outside a checkout of the project: set {HOME_ENV} to "
                       "the folder for runs/ and figures/ (for example the clone: export "
                       f"{HOME_ENV}=/path/to/sprpo), or install the clone with `pip install -e .`")


def project_path(path: str | os.PathLike) -> Path:
    """``path`` itself when absolute (``~`` expanded), else the same path under the project root."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else project_root() / p


def project_relative(path: str | os.PathLike) -> str:
    """``path`` as recorded in manifests and notebook parameters: relative to the project root
    when it lies under it (so a record names the same file in every clone), else as given."""
    try:
        # absolute but not resolved: a worktree whose runs/ is a link still records runs/...
        return Path(os.path.abspath(Path(path).expanduser())).relative_to(project_root()).as_posix()
    except ValueError:  # outside the project (a model folder, a data folder): kept as given
        return str(path)


def runs_dir(*parts: str) -> Path:
    """``<root>/runs/<parts...>``: training runs, warm starts, caches, benchmark JSON."""
    return project_root().joinpath("runs", *parts)


def figures_dir() -> Path:
    """``<root>/figures``: every committed figure and table, each with its manifest."""
    return project_root() / "figures"


def notebooks_dir() -> Path:
    """The numbered notebooks (in the checkout, or under ``$SPRPO_HOME`` when it has them)."""
    root = project_root()
    return root / "notebooks" if (root / "notebooks").is_dir() else package_checkout() / "notebooks"


def cache_dir() -> Path:
    """The user cache root: ``$SPRPO_CACHE`` or ``~/.cache/sprpo`` (converted models,
    generated ALFWorld games, the dtype probe)."""
    return Path(os.environ.get(CACHE_ENV) or os.path.join(Path.home(), ".cache", "sprpo"))
