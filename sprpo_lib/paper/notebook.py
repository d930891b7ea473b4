"""The steps every results notebook (03-07) repeats around its own figure or table:
resolve its folders under the project root, state the environments its profile lacks,
load each environment's plan, load-or-compute the result rows (cached apart from
rendering: ``render_only`` reads the rows CSV, otherwise the rows are computed from the
training runs and the cell cache and written to it), and write a manifest beside every
artifact."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd

from sprpo_lib.evaluate import DEFAULT_CACHE
from sprpo_lib.infra.io import read_cached
from sprpo_lib.infra.paths import project_path
from sprpo_lib.paper import experiments as X
from sprpo_lib.paper import results as R
from sprpo_lib.paper.report import find_runs

ALL_ENVS = ("alfworld", "webshop")
#: What a render-only manifest keeps of the manifest of the run that computed the artifact.
COMPUTED_KEYS = ("wall_seconds", "date", "commit", "host", "data", "dtype")
#: The dtype of an artifact computed before manifests stated it (a render-only pass cannot know).
UNRECORDED = "unrecorded: computed before manifests stated the dtype"


def run_dtypes(dirs) -> list[str]:
    """The dtypes training runs were made in (their ``config.json``), each once."""
    out = set()
    for d in dirs:
        meta = read_cached(Path(d) / "config.json")
        if isinstance(meta, dict) and meta.get("dtype"):
            out.add(str(meta["dtype"]))
    return sorted(out)


def run_design(dirs) -> dict:
    """What notebook 01's manifests state about training runs: their dtypes (``None`` where no
    run folder is at hand: a render-only pass then keeps the computing pass's), training seeds
    and the held-out goals of their curve (``eval_tasks``)."""
    seeds, goals = set(), set()
    for d in dirs:
        meta = read_cached(Path(d) / "config.json")
        cfg = meta.get("config") if isinstance(meta, dict) else None
        if isinstance(cfg, dict):
            seeds.add(cfg.get("seed"))
            goals.add(cfg.get("eval_tasks"))
    return {"dtype": run_dtypes(dirs) or None, "seeds": {"train": sorted(s for s in seeds if s is not None)},
            "goals": {"heldout": sorted(g for g in goals if g is not None)}}


def plan_design(p: X.Plan) -> dict:
    """What a plan's points rest on, for the manifests: training seeds per method, evaluation seeds
    and draws, and goals per split (``None``: App. C's full sets) at each kind of point."""
    seeds = {"train": {m: list(p.seeds[m]) for m in p.methods}, "eval": list(p.eval_seeds)}
    goals = {"table": p.tasks, "curves": p.curve_tasks or p.tasks}
    if p.landscape_grid:
        goals["landscape"] = p.landscape_tasks or p.tasks
    if p.divergence_states:
        seeds["divergence_draws"] = p.divergence_draws
        goals["divergence_states"] = p.divergence_states
    return {"seeds": seeds, "goals": goals}


class ResultsPage:
    """One results notebook's run: ``name`` (``"04_robustness"``) prefixes its files in
    ``out_dir``; relative folders are taken under the project root, so the notebook
    writes to the project's ``figures/`` from whatever folder it runs in.  ``overrides``
    (``key=value`` training-config changes, e.g. ``model.spec=...``) apply to every plan;
    ``plan_changes`` replace plan fields (e.g. a pilot's ``{"divergence_states": 8}``)."""

    def __init__(self, name: str, profile: str, envs: Sequence[str], *, out_dir: str | Path = "figures",
                 cache_dir: str | Path = DEFAULT_CACHE, runs_root: str | Path | None = None,
                 render_only: bool = False, overrides: Sequence[str] = (), plan_changes: Mapping | None = None):
        self.t_start = time.time()
        self.name, self.profile, self.envs, self.render_only = name, profile, list(envs), render_only
        self.out = project_path(out_dir)
        self.cache_dir = project_path(cache_dir)
        self.runs_root = project_path(runs_root) if runs_root else None
        for line in R.absent_envs(profile, ALL_ENVS):
            print(line)
        # training-config overrides (sprpo-reproduce --model) reach every plan's runs
        self.plans = {env: X.plan(profile, env, overrides=tuple(overrides) or None, **dict(plan_changes or {}))
                      for env in self.envs}
        self._runs: dict[str, dict] = {}
        if render_only:  # redraw the committed state: the plan its manifests recorded, where they did
            self.plans.update({env: p for env in self.envs if (p := self.recorded_plan(env)) is not None})

    def recorded_plan(self, env: str) -> X.Plan | None:
        """The plan recorded in the manifests of this page's ``env`` files (the run that
        computed them), or None when there is none."""
        for man in sorted(self.out.glob(f"{self.name}_{env}*.manifest.json")):
            rec = read_cached(man)
            plan = ((rec or {}).get("config") or {}).get("plan", {}).get(env) if isinstance(rec, dict) else None
            if isinstance(plan, dict):
                return X.Plan.from_dict(plan)
        return None

    def stem(self, env: str, suffix: str = "") -> Path:
        """``<out>/<name>_<env><suffix>``: the path prefix of one environment's artifacts."""
        return self.out / f"{self.name}_{env}{suffix}"

    def plan_of(self, env: str) -> X.Plan:
        """The plan of ``env``: this pass's, else the one its files record, else the profile's."""
        return self.plans.get(env) or self.recorded_plan(env) or X.plan(self.profile, env)

    def with_others(self, rows: Mapping[str, pd.DataFrame], suffix: str = "_rows.csv") -> dict[str, pd.DataFrame]:
        """``rows`` and, for the profile's environments this pass leaves out, the rows their last
        pass wrote (``<name>_<env><suffix>``, where present), in the paper's order: what a file
        that gathers several environments is drawn from, so a pass over a subset replaces only
        its own part of it."""
        out = {}
        for env in ALL_ENVS:
            if env in rows:
                out[env] = rows[env]
            elif env in X.PLANS.get(self.profile, {}) and self.stem(env, suffix).is_file():
                out[env] = X.load_rows(self.stem(env, suffix), columns=("method",))
        return out

    def runs(self, env: str) -> dict[tuple[str, int], Path]:
        """The plan's training runs (trained, resumed or found)."""
        if env not in self._runs:
            self._runs[env] = X.policies(self.plans[env], self.runs_root)
        return self._runs[env]

    def design(self) -> dict:
        """What the manifests state about the numbers: per environment, the dtype of the policies
        (their runs' records; a render-only pass keeps the computing pass's: the run folders at
        hand need not be the ones that computed the cells), the seeds and the goals per point
        (:func:`plan_design`)."""
        per = {env: plan_design(p) for env, p in self.plans.items()}
        dtype = {}
        for env, p in ({} if self.render_only else self.plans).items():
            if env in self._runs:
                dirs = list(self._runs[env].values())
            else:  # a page that read no runs (the examples): the plan's run folders, where they are
                try:
                    dirs = find_runs(self.profile, env, list(p.methods), {m: list(p.seeds[m]) for m in p.methods},
                                     list(p.overrides), out_root=self.runs_root)
                except FileNotFoundError:
                    dirs = []
            if run_dtypes(dirs):
                dtype[env] = run_dtypes(dirs)
        return {"dtype": dtype or None, "seeds": {e: d["seeds"] for e, d in per.items()},
                "goals": {e: d["goals"] for e, d in per.items()}}

    def rows(self, compute: Callable[[X.Plan, Mapping], pd.DataFrame], suffix: str = "_rows.csv",
             save: Callable[[pd.DataFrame, Path], object] = X.save_rows) -> dict[str, pd.DataFrame]:
        """Per environment: the rows in ``<stem><suffix>`` when rendering only, else
        ``compute(plan, runs)``, written there with ``save`` and read back, so that a
        computing pass and a render-only pass draw from the same (rounded) numbers."""
        out = {}
        for env, p in self.plans.items():
            path = self.stem(env, suffix)
            if self.render_only:
                out[env] = X.load_rows(path, columns=("method",))
            else:
                save(compute(p, self.runs(env)), path)  # the old manifest is replaced by manifests()
                out[env] = X.load_rows(path, columns=("method",), verify=False)
        return out

    def config(self, **extra) -> dict:
        """What the manifests record: profile, environments, plans, render-only, and ``extra``."""
        return {"profile": self.profile, "envs": self.envs, "plan": {e: p.as_dict() for e, p in self.plans.items()},
                "render_only": self.render_only, **extra}

    def manifests(self, artifacts: Sequence[str | Path], config: Mapping | None = None, **kw) -> list[Path]:
        """A manifest beside every artifact, with the wall time since the page started
        (:func:`write_manifests`)."""
        kw["extra"] = {**self.design(), **(kw.get("extra") or {})}
        if not self.render_only:  # the data the computation played (a render-only pass keeps it in "computed")
            kw["extra"]["data"] = {e: X.plan_data(p) for e, p in self.plans.items()}
        return write_manifests(artifacts, self.config() if config is None else config, self.t_start, self.render_only,
                               **kw)


def write_manifests(artifacts: Sequence[str | Path], config: Mapping, t_start: float, render_only: bool,
                    **kw) -> list[Path]:
    """A manifest beside every artifact (:func:`sprpo_lib.paper.results.manifests`), with the
    wall time since ``t_start``.  A render-only pass keeps the record of the run that computed
    the artifact (``computed``: its wall time, date, commit and machine), so redrawing loses
    no provenance and the stage times stay those of the computation; it states the dtype
    that pass recorded (:data:`UNRECORDED` where it recorded none)."""
    if not render_only:
        return R.manifests(artifacts, config, time.time() - t_start, **kw)
    for a in artifacts:
        old = read_cached(Path(f"{a}.manifest.json"))
        computed = None
        if isinstance(old, dict):
            computed = old.get("computed") or (None if (old.get("config") or {}).get("render_only") else
                                               {k: old.get(k) for k in COMPUTED_KEYS})
        extra = {**(kw.get("extra") or {}), **({"computed": computed} if computed else {})}
        if extra.get("dtype") is None:
            extra["dtype"] = (computed or {}).get("dtype") or UNRECORDED
        R.manifests([a], config, time.time() - t_start, **{**kw, "extra": extra})
    return [Path(f"{a}.manifest.json") for a in artifacts]
