"""The ablation and hyperparameter study (Sec. 5.4, Fig. 5, App. tables "Component
ablations" and "Hyperparameter study") as a plan and cached computations (the layer
under ``notebooks/08_ablations.ipynb``).

An :class:`Ablation` lists training *variants*: a method plus config overrides, in the
paper's groups (a) perturbation strategies at the same magnitude, (b) gradient-norm
scheduling on and off, (c) the rho sweep, (d) the alpha sweep, SPrPO under the three
noise rules of ``method.scale`` (the evidence for the default), and, for the ``cpu``
profile, the learning-rate sweep of Vanilla that chose the profile's ``update.lr``.
A variant whose training config equals a main run's (notebooks 01/04) *is* that run, as
the paper's starred cells reuse Table 1's estimates; ``reuse`` names a main method that
stands for a variant whose config differs only in a way that does not change the
update (SPrPO at rho = 0 draws xi = 0: Vanilla's update, as the paper reuses Vanilla
for rho = 0).  Other variants are trained under ``runs/ablation/<key>/``.

Every variant is evaluated clean and at Table 1's settings on the first ``tasks`` test
goals with the main plan's evaluation seeds and calibration pool, through the same
content-keyed cells as notebook 04 (a reused run's cells are notebook 04's, restricted to
these tasks), so each variant is paired with full SPrPO task by task.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Mapping, Sequence

import pandas as pd
from annotated_types import Ge

from sprpo_lib.core import metrics as MK
from sprpo_lib.evaluate import DEFAULT_CACHE, sweep
from sprpo_lib.infra.paths import project_path, runs_dir
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.paper import experiments as X
from sprpo_lib.paper.report import load_metrics, run_grid
from sprpo_lib.train.config import config_dict, load_config, profile_names, profile_section

__all__ = ["Variant", "Ablation", "ABLATIONS", "ablation", "is_main_config", "trained_variants", "variant_runs", "ablation_rows", "noise_rules", "GROUP_TITLES",
           "REFERENCE"]

#: The variant every other one is compared with: full SPrPO (the main runs).
REFERENCE = "full"
#: Row-group titles of the tables and panels, in the paper's order.
GROUP_TITLES = {"strategy": "(a) perturbation strategy at the same magnitude",
                "schedule": "(b) gradient-norm scheduling",
                "rho": r"(c) $\rho$ sweep ($\alpha=1$)",
                "alpha": r"(d) $\alpha$ sweep",
                "components": "component ablations",
                "lr": "learning rate (Vanilla)",
                "scale": "noise rule (method.scale)"}


@dataclass(frozen=True)
class Variant:
    """One trained configuration of the study.

    Attributes:
        key: unique name (the ``method`` column of its result rows, its run folder).
        groups: the table groups / figure panels it appears in, with its position and
            row label in each (``{"alpha": (0.5, "0.5")}``).
        method: the training method.
        overrides: training-config overrides on top of the profile and the main plan's.
        reuse: a main-plan method whose runs stand for this variant (see module doc).
        settings: ``"table"`` (clean and Table 1's settings) or ``"clean"``.
    """

    key: str
    groups: Mapping[str, tuple[float, str]]
    method: str
    overrides: tuple[str, ...] = ()
    reuse: str | None = None
    settings: str = "table"


@dataclass(frozen=True)
class Ablation:
    """The study of one profile and environment: ``variants``, trained with ``seeds``
    (a reused main run keeps the main plan's seeds), evaluated on the first ``tasks``
    test goals (``None``: the main plan's, :meth:`goals`)."""

    profile: str
    env: str
    variants: tuple[Variant, ...]
    seeds: tuple[Annotated[int, Ge(0)], ...] = (0,)
    tasks: Annotated[int, Ge(1)] | None = None

    def __post_init__(self):
        check_ranges(self, "ablation.")
        keys = [v.key for v in self.variants]
        if len(set(keys)) != len(keys) or REFERENCE not in keys:
            raise ValueError(f"Ablation.variants: keys must be unique and include {REFERENCE!r}, got {keys}")

    def goals(self, p: X.Plan) -> int | None:
        """Test goals per split of the study: ``tasks``, or the main plan's (``None``: all)."""
        return self.tasks if self.tasks is not None else p.tasks

    def variant(self, key: str) -> Variant:
        return next(v for v in self.variants if v.key == key)

    def group(self, name: str) -> list[tuple[str, str]]:
        """``[(variant key, row label)]`` of one group, in order."""
        members = sorted((v.groups[name][0], i, v.key, v.groups[name][1]) for i, v in enumerate(self.variants)
                         if name in v.groups)
        return [(key, label) for _, _, key, label in members]

    def as_dict(self) -> dict:
        return {"profile": self.profile, "env": self.env, "seeds": list(self.seeds), "tasks": self.tasks,
                "variants": [{**dataclasses.asdict(v), "groups": {g: list(x) for g, x in v.groups.items()}}
                             for v in self.variants]}


def _study(profile: str, env: str, rho: float, rhos: Sequence[float], *, seeds=(0,), tasks=None,
           lrs: Sequence[float] = (), only: Sequence[str] | None = None) -> Ablation:
    """The paper's variants around a profile's ``rho`` (grid ``rhos``; 0 reuses Vanilla),
    each group in the paper's row order (sweeps by value, full SPrPO last among the
    components and strategies); ``only``: keep these variant keys (the smoke study keeps
    one of each kind)."""
    v = [Variant(REFERENCE, {"strategy": (3, "SPrPO*"), "schedule": (0, "on*"), "rho": (rho, f"{rho:g}*"),
                             "alpha": (1, "1*"), "components": (3, "Full SPrPO*"), "scale": (2, "energy*")}, "sprpo"),
         Variant("rho0", {"rho": (0, "0 (Vanilla)*"), "components": (0, r"w/o perturbation ($\rho=0$)*")}, "sprpo",
                 ("method.rho=0",), reuse="vanilla"),
         Variant("alpha0", {"alpha": (0, "0"), "components": (1, r"w/o sensitivity ($\alpha=0$)")}, "sprpo",
                 ("method.alpha=0",)),
         Variant("no_schedule", {"schedule": (1, "off"), "components": (2, "w/o scheduling")}, "sprpo",
                 ("method.schedule=false",)),
         Variant("gaussian_rho", {"strategy": (0, rf"Gaussian $\sigma=\rho={rho:g}$")}, "gaussian",
                 (f"method.sigma={rho:g}",)),
         Variant("sam_0.1", {"strategy": (1, r"SAM $\rho=0.1$")}, "sam", ("method.sam_rho=0.1",)),
         Variant("sam_5e-3", {"strategy": (2, r"SAM $\rho=0.005$")}, "sam", ("method.sam_rho=0.005",))]
    v += [Variant(f"scale_{sc}", {"scale": (i, sc)}, "sprpo", (f"method.scale={sc}",), settings="clean")
          for i, sc in enumerate(("raw", "relative"))]
    v += [Variant(f"rho{r:g}", {"rho": (r, f"{r:g}")}, "sprpo", (f"method.rho={r:g}",)) for r in rhos if r not in (0, rho)]
    v += [Variant(f"alpha{a:g}", {"alpha": (a, f"{a:g}")}, "sprpo", (f"method.alpha={a:g}",)) for a in (0.5, 2)]
    if lrs:  # Vanilla at the profile's lr (its main runs, starred) and at the other rates
        lr0 = load_config(profile, **{"env.name": env}).update.lr
        v += [Variant("lr_profile", {"lr": (lr0, f"{lr0:g}*")}, "vanilla", settings="clean")]
        v += [Variant(f"lr{lr:g}", {"lr": (lr, f"{lr:g}")}, "vanilla", (f"update.lr={lr:g}",), settings="clean")
              for lr in lrs if lr != lr0]
    v = [x for x in v if only is None or x.key in only]
    return Ablation(profile, env, tuple(v), tuple(seeds), tasks)


def study_from_profile(profile: str, env: str) -> Ablation | None:
    """The ``ablation`` section of ``sprpo_lib/configs/<profile>.yaml`` for ``env``: the
    arguments of :func:`_study` (``rho``, ``rhos``, ``seeds``, ``tasks``, ``lrs``, ``only``).
    ``cpu``: the variants the paper's claims compare (C5, C6), one training seed each on the
    main plan's goals, within the plan's 8-hour budget (:func:`sprpo_lib.paper.budget.design_seconds`
    prices them); the sweeps and the raw rule are no claim and stay for ``only=None`` and the
    ``paper`` study (the appendix tables' grid, three seeds)."""
    section = profile_section(profile, "ablation").get(env)
    if section is None:
        return None
    args = dict(section)
    allowed = {"rho", "rhos", "seeds", "tasks", "lrs", "only"}
    unknown = sorted(set(args) - allowed)
    if unknown:
        raise ValueError(f"ablation of profile {profile!r} on {env!r}: unknown key(s) {unknown}; "
                         f"expected {sorted(allowed)}")
    rho, rhos = args.pop("rho"), tuple(args.pop("rhos"))
    for k in ("seeds", "lrs", "only"):
        if k in args:
            args[k] = tuple(args[k])
    return _study(profile, env, rho, rhos, **args)


#: The study per profile and env, read from each profile's YAML (``ablation``).
ABLATIONS: dict[str, dict[str, Ablation]] = {
    prof: {env: study_from_profile(prof, env) for env in profile_section(prof, "ablation")}
    for prof in profile_names()}


def ablation(profile: str, env: str) -> Ablation:
    """The study of ``profile`` on ``env`` (one clear error for a missing one)."""
    if env not in ABLATIONS.get(profile, {}):
        have = {p: sorted(a) for p, a in ABLATIONS.items()}
        raise ValueError(f"ablation: no study for profile {profile!r} on {env!r}; studies exist for {have}")
    return ABLATIONS[profile][env]


def _cfg(p: X.Plan, method: str, seed: int, overrides: Sequence[str]):
    return load_config(p.profile, [*p.overrides, *overrides], **{"env.name": p.env, "method.name": method, "seed": seed})


def is_main_config(p: X.Plan, v: Variant, seed: int) -> bool:
    """Whether variant ``v`` at training ``seed`` is the main run's configuration (starred)."""
    return config_dict(_cfg(p, v.method, seed, v.overrides)) == config_dict(_cfg(p, v.method, seed, ()))


def starred(ab: Ablation, p: X.Plan) -> set[str]:
    """The variants whose runs are the main plan's (reused, or their method's main configuration
    at every seed): Table 1's cells, which the paper stars."""
    return {v.key for v in ab.variants
            if v.reuse or (v.method in p.methods and all(is_main_config(p, v, s) for s in ab.seeds))}


def star(members: Sequence[tuple[str, str]], keys: set[str]) -> list[tuple[str, str]]:
    """``members`` (variant key, label) with a star on every label of ``keys`` that lacks one."""
    return [(k, lab if lab.endswith("*") or k not in keys else f"{lab}*") for k, lab in members]


def trained_variants(ab: Ablation, p: X.Plan) -> list[Variant]:
    """The variants the study trains itself: neither reusing a main method's runs nor
    equal to the main configuration of their method."""
    return [v for v in ab.variants if not v.reuse
            and not (v.method in p.methods and all(is_main_config(p, v, s) for s in ab.seeds))]


def variant_runs(ab: Ablation, p: X.Plan, main: Mapping[tuple[str, int], Path], *,
                 runs_root: str | Path | None = None, progress: bool = True) -> dict[tuple[str, int], Path]:
    """``{(variant key, training seed): run folder}``: a main run where the variant's config
    equals it (or ``reuse`` names its method), else a run trained, resumed or found under
    ``<runs_root or runs/>/ablation/<key>/``."""
    out: dict[tuple[str, int], Path] = {}
    for v in ab.variants:
        if v.reuse:
            seeds = [s for (m, s) in main if m == v.reuse]
            out.update({(v.key, s): main[v.reuse, s] for s in seeds})
            continue
        same = [s for (m, s) in main if m == v.method and is_main_config(p, v, s)]
        if same:  # the variant is the main configuration: its runs, all seeds (starred)
            out.update({(v.key, s): main[v.method, s] for s in same})
            continue
        root = project_path(runs_root) / "ablation" / v.key if runs_root else runs_dir("ablation", v.key)
        dirs = run_grid(p.profile, p.env, [v.method], list(ab.seeds), [*p.overrides, *v.overrides], out_root=root,
                        progress=progress)
        out.update({(v.key, s): d for s, d in zip(ab.seeds, dirs)})
    return out


def ablation_rows(ab: Ablation, p: X.Plan, runs: Mapping[tuple[str, int], Path], main: Mapping[tuple[str, int], Path],
                  *, cache_dir: str | Path = DEFAULT_CACHE, progress: bool = True) -> pd.DataFrame:
    """Episode rows of every variant (``method`` = variant key, plus ``variant_method``),
    clean and at Table 1's settings (``settings="clean"``: clean only), on the first
    :meth:`Ablation.goals` test goals.  A main run is evaluated with the main plan's cells (cached
    by notebook 04) and restricted to those tasks."""
    cache_dir = project_path(cache_dir)
    table = [("clean", 0.0), *[(f, float(s)) for f, s in p.table]]
    calib = (str(X.calibration_pool(p, main, cache_dir, progress))
             if any(f in ("fisher", "sparsegpt") for f, _ in table) else None)
    main_dirs = set(main.values())
    cfgs = []
    for (key, seed), run in runs.items():
        v = ab.variant(key)
        tasks = p.tasks if run in main_dirs else ab.goals(p)
        wanted = table if v.settings == "table" else table[:1]
        base = X.eval_config(p, run, cache_dir)
        base = dataclasses.replace(base, tags={**base.tags, "method": key, "variant_method": v.method})
        cfgs += X.settings_configs(base, wanted, tasks=tasks, calibration=calib)
    rows = sweep(cfgs, progress=progress)
    goals = ab.goals(p)
    rows = rows[rows["task_index"] < goals].reset_index(drop=True) if goals is not None else rows
    return X.slim_rows(rows, extra=("variant_method",))


def noise_rules(ab: Ablation, runs: Mapping[tuple[str, int], Path]) -> pd.DataFrame:
    """The training metrics of SPrPO under each noise rule of the ``scale`` group, one row
    per (rule, seed, iteration): RMS / mean / max sigma, clamped fraction, schedule, realised
    sign flips, valid-action rate, rollout success and entropy (the evidence for the
    default rule)."""
    keys = [k for k, _ in ab.group("scale")]
    dirs = [(k, s, d) for (k, s), d in runs.items() if k in keys]
    if not dirs:
        return pd.DataFrame()
    # one frame per run: a variant's run folder has the main run's name under another root
    m = pd.concat([load_metrics([d]).assign(rule=ab.variant(k).groups["scale"][1], variant=k) for k, _, d in dirs],
                  ignore_index=True)
    cols = ["rule", "variant", "run", "seed", MK.ITERATION, MK.XI_RHO, MK.XI_SIGMA_RMS, MK.XI_SIGMA_MEAN, "xi_sigma_max",
            MK.XI_SIGMA_CLAMPED_FRAC, MK.XI_S_K, MK.XI_REAL_FLIP_FRAC, MK.VALID_RATE, MK.SUCCESS, "entropy"]
    return m[[c for c in cols if c in m]]
