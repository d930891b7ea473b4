"""The paper's robustness experiments as plans and cached computations (the layer under
notebooks 03-07).

A :class:`Plan` says, for one training profile and environment, which policies exist
(methods x training seeds, trained by :func:`sprpo_lib.paper.report.run_grid`) and what is
evaluated on them (App. C):

* ``table``: Table 1's strong settings, every policy (clean is always included);
* ``curves``: Fig. 3's strengths per family, on the policies of ``curve_seeds`` and
  ``curve_methods``;
  Fig. 1 (motivation) is Vanilla's part of the same cells;
* ``landscape_grid``: Fig. 4's ``(w1, w2)`` grid on the plane of two fixed
  multiplicative Gaussian directions (perturbation family ``plane``), for
  ``landscape_methods`` at training seed ``landscape_seed``.

Every evaluation goes through :func:`sprpo_lib.evaluate.sweep`: one content-keyed
cell per (policy, family, strength, evaluation seed), so a rerun computes only missing
cells and a killed sweep resumes; under ``--executor ray`` each missing cell is a Ray
task (:mod:`sprpo_lib.infra.executor`).  Every policy is evaluated on the same tasks with the
same evaluation seeds (the paired design of :func:`sprpo_lib.paper.stats.paired_bootstrap`).
The calibration pool of App. C (Fisher, SparseGPT) is collected once from the first
Vanilla policy's rollouts on training tasks and shared by every method.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Mapping, Sequence

import pandas as pd
from annotated_types import Ge

from sprpo_lib.agent.envs import GENERATED, data_source, make_pool
from sprpo_lib.core.compress import FAMILIES
from sprpo_lib.core.methods import METHODS
from sprpo_lib.evaluate import (
    CALIBRATED_FAMILIES,
    DEFAULT_CACHE,
    EvalConfig,
    ModelSource,
    build_calibration_pool,
    canonical_hash,
    config_from_run,
    RANDOM_FAMILIES,
    load_calibration,
    save_calibration,
    sweep,
)
from sprpo_lib.evaluate.divergence import DIVERGENCE_COLUMNS, divergence, draw_seeds, state_pool
from sprpo_lib.infra.io import CorruptFileError, atomic_write_text, key_fields, read_cached
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.infra.manifest import check_artifact, manifest_path
from sprpo_lib.infra.paths import project_path
from sprpo_lib.paper.report import run_grid
from sprpo_lib.paper.style import METHOD_DISPLAY
from sprpo_lib.train.config import load_config, profile_names, profile_section

__all__ = ["Plan", "PLANS", "plan", "policies", "calibration_pool", "robustness_rows", "landscape_rows",
           "save_rows", "load_rows", "ROW_KEEP", "METHOD_ORDER", "eval_config", "TABLE1",
           "WARM_START", "warm_start_config", "settings_configs", "slim_rows"]

METHOD_ORDER = tuple(m for m in METHOD_DISPLAY if m in METHODS)
#: The ``method`` of the warm-start policy's rows (a reference, not a trained method).
WARM_START = "warm_start"
#: Columns kept in the committed result CSVs (one row per episode); the two hashes name the policy's
#: content (its base weights and adapters), so that rows of two notebooks pair only the same policy.
ROW_KEEP = ("env", "split", "split_label", "task_index", "family", "strength", "w2", "seed", "method", "train_seed",
            "success", "score", "length", "valid_rate", "trace", "model_hash", "adapter_hash", "cell")
#: Table 1's strong settings (the paper's column headers).
TABLE1 = {"webshop": (("gaussian", 0.20), ("dropout", 0.05), ("fisher", 0.20), ("sparsegpt", 0.40), ("rtn", 6)),
          "alfworld": (("gaussian", 0.20), ("dropout", 0.05), ("fisher", 0.20), ("sparsegpt", 0.70), ("rtn", 6))}


@dataclass(frozen=True)
class Plan:
    """What one profile trains and evaluates on one environment (see the module doc).

    Attributes:
        profile, env: the training profile (``sprpo_lib/configs/<profile>.yaml``) and env.
        methods, seeds: the trained policies: ``seeds[method]`` training seeds each.
        overrides: training-config overrides (``key=value``) shared by every run.
        tasks: the first N held-out tasks of each split (``None``: App. C's full sets),
            clean and at Table 1's settings: where the paper's claims are.
        curve_tasks: the first N tasks at the curves' other strengths (``None``: ``tasks``).
        eval_seeds: evaluation seeds (generation stream and random families' draw).
        table: Table 1's (family, strength) columns after clean.
        curves: Fig. 3's strengths per family.
        curve_seeds: training seeds evaluated on the curves (``None``: all of them).
        curve_methods: methods evaluated on the curves (``None``: all of them); the
            others are evaluated clean and at the table settings only.
        landscape_grid: the values of ``w1`` and of ``w2`` (Fig. 4); ``()`` skips it.
        landscape_tasks: held-out tasks per landscape point (``None``: ``tasks``).
        landscape_methods, landscape_seed: whose surface is drawn (training seed).
        direction_seed: seed of the two shared directions of the plane.
        calibration_size: App. C's calibration pool (128 sequences).
        engine: generation engine of the evaluation (``None``: the training profile's).
        warm_start_row: evaluate the warm-start policy (when the profile has one) like a
            curve policy, as method ``warm_start``: the reference that shows whether RL
            made the agent more or less fragile than its starting point.
        longer_iterations: continue the runs of ``longer_methods`` (training seeds
            ``longer_seeds``; ``None``: all of the method's) to this many RL iterations
            (0: none), for notebook 01's held-out curve against the warm start
            (:func:`sprpo_lib.paper.report.longer_grid`); nothing else evaluates them.
        divergence_states: agent states per held-out split on which every policy's divergence under
            each perturbation is measured (:func:`divergence_rows`; 0: none), drawn from the warm
            start's held-out episodes; ``divergence_samples`` responses sampled per state (K) and
            ``divergence_draws`` draws of each random family (M), the same for every policy.
        divergence_curves: the strengths per family of Fig. 3 in KL (``None``: ``curves``;
            ``app_c`` in a profile: App. C's levels of every family), beside Table 1's settings.
        divergence_curve_seeds: training seeds of the ``divergence_curve_methods`` measured at those
            strengths off Table 1 (``None``: all); every policy is measured at Table 1's settings.
        divergence_curve_methods: methods measured at the KL curves' strengths (``None``:
            ``curve_methods``): divergence is cheap beside success, so every method can have its
            curve where only some have success curves.
        keep_pruned: SparseGPT's pruned weights kept per policy and ratio (``EvalConfig.keep_pruned``):
            notebooks 04 and 09 prune each once; one FFN copy on disk each.
    """

    profile: str
    env: str
    methods: tuple[str, ...] = METHOD_ORDER
    seeds: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: {m: (0, 1, 2) for m in METHOD_ORDER})
    overrides: tuple[str, ...] = ()
    tasks: Annotated[int, Ge(1)] | None = None
    curve_tasks: Annotated[int, Ge(1)] | None = None
    eval_seeds: tuple[Annotated[int, Ge(0)], ...] = (0,)
    table: tuple[tuple[str, float], ...] = ()
    curves: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    curve_seeds: tuple[Annotated[int, Ge(0)], ...] | None = None
    curve_methods: tuple[str, ...] | None = None
    landscape_grid: tuple[float, ...] = ()
    landscape_tasks: Annotated[int, Ge(1)] | None = None
    landscape_methods: tuple[str, ...] = ("vanilla", "sprpo")
    landscape_seed: Annotated[int, Ge(0)] = 0
    direction_seed: Annotated[int, Ge(0)] = 0
    calibration_size: Annotated[int, Ge(1)] = 128
    engine: str | None = None
    warm_start_row: bool = True
    longer_iterations: Annotated[int, Ge(0)] = 0
    longer_methods: tuple[str, ...] = ("vanilla",)
    longer_seeds: tuple[Annotated[int, Ge(0)], ...] | None = None
    divergence_states: Annotated[int, Ge(0)] = 0
    divergence_samples: Annotated[int, Ge(1)] = 4
    divergence_draws: Annotated[int, Ge(1)] = 2
    divergence_curves: Mapping[str, tuple[float, ...]] | None = None
    divergence_curve_seeds: tuple[Annotated[int, Ge(0)], ...] | None = None
    divergence_curve_methods: tuple[str, ...] | None = None
    keep_pruned: bool = False

    def __post_init__(self):
        check_ranges(self, "plan.")
        missing = [m for m in self.methods if m not in self.seeds]
        if missing:
            raise ValueError(f"Plan.seeds: no training seeds for method(s) {missing}")
        for name in ("curve_methods", "divergence_curve_methods"):
            bad = [m for m in getattr(self, name) or () if m not in self.methods]
            if bad:
                raise ValueError(f"Plan.{name}: {bad} are not trained in this plan ({list(self.methods)})")
        bad = [m for m in self.landscape_methods if m not in self.methods]
        if bad:
            raise ValueError(f"Plan.landscape_methods: {bad} are not trained in this plan ({list(self.methods)})")
        bad = [m for m in self.longer_methods if m not in self.methods] if self.longer_iterations else []
        if bad:
            raise ValueError(f"Plan.longer_methods: {bad} are not trained in this plan ({list(self.methods)})")

    def longer(self) -> dict[str, list[int]]:
        """``{method: training seeds}`` of the longer runs (empty without ``longer_iterations``)."""
        if not self.longer_iterations:
            return {}
        return {m: [s for s in self.seeds[m] if self.longer_seeds is None or s in self.longer_seeds]
                for m in self.longer_methods}

    def runs(self) -> list[tuple[str, int]]:
        """(method, training seed) of every policy, seed-major as :func:`run_grid` trains them."""
        seeds = sorted({s for m in self.methods for s in self.seeds[m]})
        return [(m, s) for s in seeds for m in self.methods if s in self.seeds[m]]

    def settings(self) -> list[tuple[str, float]]:
        """Every (family, strength) evaluated on all curve policies, clean first."""
        out = [("clean", 0.0)]
        for fam, strengths in self.curves.items():
            out += [(fam, float(s)) for s in strengths]
        out += [(f, float(s)) for f, s in self.table]
        return list(dict.fromkeys(out))

    def divergence_settings(self) -> list[tuple[str, float]]:
        """Every perturbed (family, strength) of the divergence grid: Table 1's, then the KL curves'."""
        curves = self.curves if self.divergence_curves is None else self.divergence_curves
        out = [(f, float(s)) for f, s in self.table]
        out += [(fam, float(s)) for fam, strengths in curves.items() for s in strengths]
        return list(dict.fromkeys(out))

    def on_kl_curve(self, method: str, seed: int) -> bool:
        """Whether the policy is measured at the KL curves' strengths off Table 1 (the warm start
        always is): its method in ``divergence_curve_methods`` (``None``: ``curve_methods``) and
        its seed in ``divergence_curve_seeds``."""
        methods = self.curve_methods if self.divergence_curve_methods is None else self.divergence_curve_methods
        return method == WARM_START or ((self.divergence_curve_seeds is None or seed in self.divergence_curve_seeds)
                                        and (methods is None or method in methods))

    def as_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), default=list))

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        """Inverse of :meth:`as_dict` (a manifest's record); fields added since take their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}

        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, list) else v

        kw = {k: ({m: tup(x) for m, x in v.items()} if isinstance(v, dict) else tup(v)) for k, v in kw.items()}
        return cls(**kw)


#: Fig. 3's curves in full (a plan's ``curves: app_c``): App. C's levels of every family for
#: the environment, in the paper's panel order.
APP_C_CURVES = ("gaussian", "dropout", "fisher", "rtn", "sparsegpt")


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _plan_values(fields: Mapping) -> dict:
    """Field values as :class:`Plan` holds them: lists as tuples, in the per-family and
    per-method maps too (as YAML and papermill give them: lists)."""
    return {k: {f: _tuples(x) for f, x in v.items()} if isinstance(v, Mapping) else _tuples(v)
            for k, v in fields.items()}


def plan_from_profile(profile: str, env: str) -> Plan:
    """The ``plan`` section of ``sprpo_lib/configs/<profile>.yaml`` for ``env``: its keys are
    :class:`Plan`'s fields, ``per_env.<env>`` overrides them (dotted keys reach into
    ``curves``); ``table`` defaults to Table 1's settings, ``seeds`` given as a list applies to
    every method, and ``curves: app_c`` is App. C's levels of every family."""
    section = dict(profile_section(profile, "plan"))
    per_env = section.pop("per_env", None) or {}
    if env not in per_env:
        raise ValueError(f"env: profile {profile!r} has no plan for {env!r} (it runs {sorted(per_env)}); "
                         f"run the paper profile for the other environment")
    for key, value in (per_env[env] or {}).items():
        head, _, sub = key.partition(".")
        if sub:
            section[head] = {**section.get(head, {}), sub: value}
        else:
            section[key] = value
    names = {f.name for f in dataclasses.fields(Plan)} - {"profile", "env"}
    unknown = sorted(set(section) - names)
    if unknown:
        raise ValueError(f"plan of profile {profile!r}: unknown key(s) {unknown}; expected Plan fields {sorted(names)}")
    kw = _plan_values(section)
    for key in ("curves", "divergence_curves"):
        if kw.get(key) == "app_c":
            kw[key] = {f: FAMILIES[f].levels[env] for f in APP_C_CURVES}
    methods = kw.setdefault("methods", METHOD_ORDER)
    if isinstance(kw.get("seeds"), tuple):
        kw["seeds"] = {m: kw["seeds"] for m in methods}
    kw.setdefault("table", TABLE1[env])
    return Plan(profile, env, **kw)


#: Plans per profile and env, read from each profile's YAML (``plan``): ``smoke``, the tiny
#: random model, seconds (tests); ``cpu``, the embedded SmolLM2 on both offline environments,
#: the design notebook 08's power analysis chose; ``paper``, App. C in full.
PLANS: dict[str, dict[str, Plan]] = {
    prof: {env: plan_from_profile(prof, env) for env in (profile_section(prof, "plan").get("per_env") or {})}
    for prof in profile_names()}


def plan(profile: str, env: str, **changes) -> Plan:
    """The plan of ``profile`` on ``env``, with fields replaced by ``changes``."""
    if profile not in PLANS:
        raise ValueError(f"profile: unknown profile {profile!r}; expected one of {sorted(PLANS)}")
    if env not in PLANS[profile]:
        raise ValueError(f"env: profile {profile!r} has no plan for {env!r} (it runs {sorted(PLANS[profile])}); "
                         f"run the paper profile for the other environment")
    p = PLANS[profile][env]
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Plan)})
    if unknown:
        raise ValueError(f"plan changes: unknown field(s) {unknown}; expected fields of Plan "
                         f"(sprpo_lib/paper/experiments.py), e.g. divergence_states")
    return dataclasses.replace(p, **{k: v for k, v in _plan_values(changes).items() if v is not None})


# ----------------------------------------------------------------------------- policies
def plan_data(p: Plan) -> str:
    """The data the plan's runs and evaluations play (:func:`sprpo_lib.agent.envs.data_source`):
    its ``env.data_dir`` override, else the environment's variable, else ``generated``."""
    return data_source(p.env, load_config(p.profile, list(p.overrides), **{"env.name": p.env}).env.data_dir)


def policies(p: Plan, runs_root: str | Path | None = None, progress: bool = True) -> dict[tuple[str, int], Path]:
    """Train, resume or find every policy of the plan; ``{(method, seed): run folder}``."""
    dirs = run_grid(p.profile, p.env, p.methods, {m: list(p.seeds[m]) for m in p.methods}, list(p.overrides),
                    out_root=runs_root, progress=progress)
    return dict(zip(p.runs(), dirs))


def eval_config(p: Plan, run: Path, cache_dir: Path, **kw) -> EvalConfig:
    """The evaluation config of one of the plan's policies: its run's model and prompt
    settings, the plan's tasks, evaluation seeds and engine, and ``kw``."""
    extra = {"engine": p.engine} if p.engine else {}
    return config_from_run(run, tasks=p.tasks, seeds=p.eval_seeds, cache_dir=str(cache_dir), keep_pruned=p.keep_pruned,
                           **extra, **kw)


def calibration_pool(p: Plan, runs: Mapping[tuple[str, int], Path], cache_dir: str | Path = DEFAULT_CACHE,
                     progress: bool = True) -> Path:
    """App. C's calibration pool: ``calibration_size`` sequences from the first Vanilla
    policy's rollouts on training tasks, built once and stored under
    ``<cache_dir>/calibration/`` (named by that policy's content hash), shared by every
    method's Fisher scores and SparseGPT.  A stored pool that does not verify (truncated,
    garbage, or not matching its recorded hash) is rebuilt, with a warning."""
    vanilla = sorted(k for k in runs if k[0] == "vanilla")
    if not vanilla:
        raise ValueError("calibration pool: the plan trains no Vanilla policy (App. C collects the pool from one)")
    cfg = eval_config(p, runs[vanilla[0]], project_path(cache_dir))
    source = ModelSource(cfg, project_path(cache_dir) / "file_hashes.json")
    ident = source.identity()
    data = data_source(cfg.env, cfg.data_dir)  # keyed where real data is used (generated pools keep their key)
    key = canonical_hash({"model": ident, "env": p.env, "n": p.calibration_size, "agent": key_fields(cfg.agent),
                          "max_new_tokens": cfg.max_new_tokens, "max_steps": cfg.max_steps, "engine": cfg.engine,
                          **({"data": data} if data != GENERATED else {})})
    path = project_path(cache_dir) / "calibration" / f"{p.env}-{key[:16]}.json"
    if read_cached(path, load_calibration) is None:
        pool = make_pool(cfg.env, cfg.data_dir, cfg.env_seed)
        calib = build_calibration_pool(
            source.policy(), pool, cfg.agent, n=p.calibration_size, temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, max_steps=cfg.max_steps, seed=0,
            engine=cfg.engine, progress=progress,
            source={"model": cfg.model, "adapters": list(cfg.adapters), "model_identity": ident,
                    "policy_run": str(runs[vanilla[0]])})
        save_calibration(path, calib)
    return path


# ----------------------------------------------------------------------------- sweeps
def slim_rows(rows: pd.DataFrame, extra: Sequence[str] = ()) -> pd.DataFrame:
    """The committed columns of result rows (:data:`ROW_KEEP`, missing ones filled) and
    ``extra`` columns where present."""
    for c in ROW_KEEP:
        if c not in rows:
            rows[c] = 0.0 if c == "w2" else None
    return rows[list(dict.fromkeys([*ROW_KEEP, *(c for c in extra if c in rows)]))]


def warm_start_config(p: Plan, runs: Mapping[tuple[str, int], Path], cache_dir: Path, **kw) -> EvalConfig | None:
    """The evaluation config of the plan's warm-start policy (the starting point every run
    shares: its cached adapter without any RL adapter), tagged ``method="warm_start"``;
    ``None`` when the profile has no warm start or the plan does not ask for the row."""
    if not p.warm_start_row or not runs:
        return None
    first = runs[sorted(runs)[0]]
    cfg = eval_config(p, first, cache_dir, **kw)
    if len(cfg.adapters) < 2:  # no warm start: the run's own adapter only
        return None
    return dataclasses.replace(cfg, adapters=cfg.adapters[:1], model_seed=0,
                               tags={**cfg.tags, "method": WARM_START, "train_seed": 0})


def robustness_rows(p: Plan, runs: Mapping[tuple[str, int], Path], *, methods: Sequence[str] | None = None,
                    cache_dir: str | Path = DEFAULT_CACHE, progress: bool = True) -> pd.DataFrame:
    """Episode rows of every evaluation of the plan (clean, Table 1, Fig. 3 curves) for
    ``methods`` (default all, and the warm start): clean and the table settings on every
    policy with ``tasks`` goals, the curves' other strengths on the policies of
    ``curve_seeds`` / ``curve_methods`` (and the warm start) with ``curve_tasks`` goals.
    Cached per cell; returns one row per episode."""
    cache_dir = project_path(cache_dir)
    with_warm_start = methods is None or WARM_START in methods
    methods = list(methods or p.methods)
    keep = [(m, s) for (m, s) in p.runs() if m in methods]
    need_calib = any(f in ("fisher", "sparsegpt") for f, _ in p.settings())
    calib = str(calibration_pool(p, runs, cache_dir, progress)) if need_calib else None
    table = [("clean", 0.0), *[(f, float(s)) for f, s in p.table]]
    extra = [x for x in p.settings() if x not in table]
    jobs = []  # (base config, settings, tasks)
    for m, s in keep:
        on_curve = (p.curve_seeds is None or s in p.curve_seeds) and (p.curve_methods is None or m in p.curve_methods)
        base = eval_config(p, runs[m, s], cache_dir)
        jobs += [(base, table, p.tasks)] + ([(base, extra, p.curve_tasks or p.tasks)] if on_curve and extra else [])
    ws = warm_start_config(p, runs, cache_dir)
    if ws is not None and with_warm_start:
        jobs += [(ws, table, p.tasks)] + ([(ws, extra, p.curve_tasks or p.tasks)] if extra else [])
    cfgs = [c for base, wanted, tasks in jobs for c in settings_configs(base, wanted, tasks=tasks, calibration=calib)]
    return slim_rows(sweep(cfgs, progress=progress))


def settings_configs(base: EvalConfig, settings: Sequence[tuple[str, float]], *, tasks: int | None,
                     calibration: str | None) -> list[EvalConfig]:
    """``base`` (one policy) at every ``(family, strength)`` of ``settings`` on the first
    ``tasks`` goals: one configuration per family, the calibration pool passed to the
    families that need one (evaluated together by :func:`sprpo_lib.evaluate.sweep`)."""
    by_family: dict[str, list[float]] = {}
    for fam, st in settings:
        by_family.setdefault(fam, []).append(float(st))
    return [dataclasses.replace(base, family=fam, strengths=tuple(strengths), tasks=tasks,
                                calibration=calibration if fam in CALIBRATED_FAMILIES else None)
            for fam, strengths in by_family.items()]


def divergence_rows(p: Plan, runs: Mapping[tuple[str, int], Path], *, cache_dir: str | Path = DEFAULT_CACHE,
                    progress: bool = True) -> pd.DataFrame:
    """How far each policy of the plan (and the warm start, as ``warm_start``) moves under each
    perturbation, per agent state (the paper's alpha: :func:`sprpo_lib.evaluate.divergence.divergence`):
    every Table 1 setting, the KL curves' strengths (:meth:`Plan.divergence_settings`) on the
    ``divergence_curve_seeds`` policies of the ``divergence_curve_methods`` and the warm start, the random families at the same
    ``divergence_draws`` draws for every policy, and the landscape plane (Fig. 4's grid, rows with ``w2``) for the
    landscape policies; all on one state pool from the warm start's held-out episodes (the first
    Vanilla policy's where the profile has no warm start).  Cached per cell."""
    cols = [*DIVERGENCE_COLUMNS, "method", "train_seed", "profile", "w2"]
    if not p.divergence_states:
        return pd.DataFrame(columns=cols)
    cache_dir = project_path(cache_dir)
    ws = warm_start_config(p, runs, cache_dir)
    vanilla = sorted(k for k in runs if k[0] == "vanilla")
    reference = ws or (eval_config(p, runs[vanilla[0]], cache_dir) if vanilla else None)
    if reference is None:
        raise ValueError("divergence: the plan has neither a warm start nor a Vanilla policy to draw its states from")
    states, _ = state_pool(reference, p.divergence_states, progress=progress)
    settings = p.divergence_settings()
    table = [(f, float(s)) for f, s in p.table]
    calib = str(calibration_pool(p, runs, cache_dir, progress)) if any(
        f in CALIBRATED_FAMILIES for f, _ in settings) else None
    draws = tuple(draw_seeds(p.divergence_draws))
    frames = []
    bases = [eval_config(p, runs[k], cache_dir) for k in p.runs()] + ([ws] if ws is not None else [])
    for base in bases:
        seed = base.tags["train_seed"]
        method = base.tags["method"]
        cfgs = [dataclasses.replace(c, seeds=draws if c.family in RANDOM_FAMILIES else (0,))
                for c in settings_configs(base, settings if p.on_kl_curve(method, seed) else table, tasks=None,
                                          calibration=calib)]
        if (p.landscape_grid and base.tags["method"] in p.landscape_methods
                and base.tags["train_seed"] == p.landscape_seed):
            cfgs += [dataclasses.replace(base, family="plane", strengths=tuple(float(w) for w in p.landscape_grid),
                                         seeds=(0,), tags={**base.tags, "w2": float(w2)},
                                         perturbation_options={"w2": float(w2), "direction_seed": p.direction_seed})
                     for w2 in p.landscape_grid]
        shared: dict = {}  # one load of the policy and one clean side for all its settings
        frames += [divergence(c, states, samples=p.divergence_samples, progress=progress, shared=shared) for c in cfgs]
    rows = pd.concat(frames, ignore_index=True)
    rows["w2"] = rows["w2"].fillna(0.0) if "w2" in rows else 0.0
    return rows[[c for c in cols if c in rows]]


def landscape_rows(p: Plan, runs: Mapping[tuple[str, int], Path], *, cache_dir: str | Path = DEFAULT_CACHE,
                   progress: bool = True) -> pd.DataFrame:
    """Fig. 4: success at every ``(w1, w2)`` of the grid for the landscape policies,
    all on the same plane (``direction_seed``) and tasks.  Rows carry ``strength`` = w1
    and ``w2``."""
    if not p.landscape_grid:
        return slim_rows(pd.DataFrame(columns=list(ROW_KEEP)))
    cfgs = []
    for m in p.landscape_methods:
        run = runs[m, p.landscape_seed]
        for w2 in p.landscape_grid:
            cfg = eval_config(p, run, project_path(cache_dir), family="plane",
                              strengths=tuple(float(w) for w in p.landscape_grid),
                              perturbation_options={"w2": float(w2), "direction_seed": p.direction_seed})
            cfg = dataclasses.replace(cfg, tags={**cfg.tags, "w2": float(w2)},
                                      tasks=cfg.tasks if p.landscape_tasks is None else p.landscape_tasks)
            cfgs.append(cfg)
    return slim_rows(sweep(cfgs, progress=progress))


# ----------------------------------------------------------------------------- tidy files
def save_rows(rows: pd.DataFrame, path: str | Path) -> Path:
    """Write result rows as CSV (atomic)."""
    return atomic_write_text(path, rows.to_csv(index=False))


def load_rows(path: str | Path, columns: Sequence[str] = (), *, verify: bool = True) -> pd.DataFrame:
    """Read result rows written by :func:`save_rows` (the render-only path), verified
    against their manifest's SHA-256 when it records one and parsed whole, with ``columns``
    present: a missing or damaged file is one clear error naming it and saying how to
    compute it again.  ``verify=False`` is for the pass that has just written the rows,
    whose manifest (if any) is still the previous computation's until the page rewrites it."""
    p = Path(path)
    fix = ("run its notebook with render_only=False (or sprpo-reproduce --only <its number> without --render-only) "
           "to compute it again")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no cached results; run the notebook with render_only=False (or "
                                "python -m sprpo_lib.reproduce without --render-only) to compute them")
    if verify and manifest_path(p).is_file():  # the rows a figure is drawn from are the rows that were computed
        try:
            check_artifact(p)
        except CorruptFileError as err:
            raise err.with_fix(fix) from None
    try:  # the policy hashes stay text (an all-digit hash would read as a number, without its leading zeros)
        rows = pd.read_csv(p, dtype={"model_hash": str, "adapter_hash": str})
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as err:
        raise CorruptFileError(p, f"not a whole CSV table ({type(err).__name__})", fix) from None
    missing = [c for c in columns if c not in rows]
    if missing:
        raise CorruptFileError(p, f"no column(s) {missing}: not the table it should be", fix)
    return rows
