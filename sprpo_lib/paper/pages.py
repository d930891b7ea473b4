"""What each numbered notebook writes from its runs or rows: one function per notebook, so a
notebook is its parameters, one call that loads or computes, and one that renders.  Each takes
``show`` (the notebook passes IPython's display: a DataFrame is shown as a table, a string as
Markdown) and returns the paths it wrote, manifests beside every one."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pandas as pd

from sprpo_lib.evaluate import load_episode_log
from sprpo_lib.infra.io import atomic_write_text
from sprpo_lib.infra.manifest import DESIGN_KEYS, not_applicable
from sprpo_lib.infra.paths import project_path
from sprpo_lib.paper import ablations as A
from sprpo_lib.paper import budget as B
from sprpo_lib.paper import claims as C
from sprpo_lib.paper import divergence as V
from sprpo_lib.paper import experiments as X
from sprpo_lib.paper import hparams as H
from sprpo_lib.paper import power as P
from sprpo_lib.paper import results as R
from sprpo_lib.paper import sigma as S
from sprpo_lib.paper import tables as T
from sprpo_lib.paper.notebook import ResultsPage, run_design, write_manifests
from sprpo_lib.paper.report import (
    before_after,
    find_runs,
    heldout_curve,
    heldout_rows,
    load_metrics,
    longer_grid,
    plot_training,
    run_grid,
)

Show = Callable[[object], None]


def _quiet(_obj) -> None:
    return None


def show(obj) -> None:
    """IPython's display of ``obj``: a string as Markdown, anything else as itself."""
    from IPython.display import Markdown, display  # a notebook's: loaded where one shows something

    display(Markdown(obj) if isinstance(obj, str) else obj)


def images(paths: Sequence[str | Path]) -> list[Path]:
    """The PNGs among ``paths`` (what a notebook displays last)."""
    return [Path(a) for a in paths if Path(a).suffix == ".png"]


# ----------------------------------------------------------------------------- 01 training
class TrainingRuns:
    """Notebook 01's runs: per environment the plan, its run folders (trained, resumed or, when
    ``render_only``, found) and the longer runs' folders; metrics and before/after summaries."""

    def __init__(self, profile: str, envs: Sequence[str], *, methods: Sequence[str] | None = None,
                 seeds=None, overrides: Sequence[str] = (), runs_root=None, render_only: bool = False):
        self.t_start = time.time()
        self.profile, self.envs, self.overrides, self.render_only = profile, list(envs), list(overrides), render_only
        self.plans = {env: X.plan(profile, env, overrides=tuple(overrides) or None) for env in envs}
        grid = find_runs if render_only else run_grid
        self.dirs, self.longer = {}, {}
        for env, p in self.plans.items():
            ms = list(methods or p.methods)
            self.dirs[env] = grid(profile, env, ms, seeds if seeds is not None else {m: list(p.seeds[m]) for m in ms},
                                  list(p.overrides), out_root=runs_root)
        for env, p in self.plans.items():  # continued to p.longer_iterations (copied, then resumed)
            longer = {m: s for m, s in p.longer().items() if m in (methods or p.methods)}
            if longer and seeds is None:  # (not for a hand-picked set of training seeds)
                self.longer[env] = longer_grid(profile, env, list(longer), longer, p.longer_iterations,
                                               list(p.overrides), out_root=runs_root, find=render_only)
        self.metrics = {env: load_metrics(d) for env, d in self.dirs.items()}
        self.summary = {env: before_after(d) for env, d in self.dirs.items()}


def training(runs: TrainingRuns, *, out_dir="figures", cache_dir="runs/eval_cache", show: Show = _quiet) -> list[Path]:
    """Notebook 01's figures and tables per environment: training curves with the held-out curve
    against the warm start, SPrPO's noise (per-layer sigma, its rank correlation with Fisher
    importance, its health), the longer runs, and App. B's Tables 2-3 from the profiles."""
    out = project_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shown = []
    for env, dirs in runs.dirs.items():
        stem, m = f"01_training_{env}", runs.metrics[env]
        held = heldout_rows(dirs)  # the warm start and the policies along training on the same held-out tasks
        fig_path = plot_training(m, runs.summary[env], out / f"{stem}.png", heldout=held)
        curve = heldout_curve(held)  # RL minus warm start, paired over seeds and tasks
        csv_curve = atomic_write_text(out / f"{stem}_heldout.csv", curve.to_csv(index=False))
        show(curve)
        csv_metrics = atomic_write_text(out / f"{stem}_metrics.csv",
                                        m.drop(columns=["xi_sigma_layer_rms"], errors="ignore").to_csv(index=False))
        csv_summary = atomic_write_text(out / f"{stem}_summary.csv", runs.summary[env].to_csv(index=False))
        env_seeds = sorted({int(s) for s in m["seed"]})
        config = dict(profile=runs.profile, env=env, methods=sorted(set(m["method"])), seeds=env_seeds,
                      overrides=runs.overrides, runs=[str(d) for d in dirs], render_only=runs.render_only)
        sigma_paths = _sigma(runs, env, dirs, out / stem, cache_dir, show)
        run_commits = {d.name: json.loads((d / "config.json").read_text()).get("commit") for d in dirs}
        write_manifests([fig_path, csv_metrics, csv_summary, csv_curve, *sigma_paths], config, runs.t_start,
                        runs.render_only, seed=env_seeds[0] if len(env_seeds) == 1 else None,
                        extra={**run_design(dirs), "run_commits": run_commits})
        shown += [fig_path, *images(sigma_paths)]
        if env in runs.longer:
            shown += _longer(runs, env, out / stem, config, show)
    _hparams(out, runs, show)
    return shown


def _sigma(runs: TrainingRuns, env: str, dirs, stem: Path, cache_dir, show: Show) -> list[Path]:
    """SPrPO's noise: RMS sigma per layer over training, and the channels it protects vs. Fisher importance."""
    m = runs.metrics[env]
    layers = S.layer_sigma(m)
    if not len(layers):
        return []
    by_name = {d.name: d for d in dirs}
    pol = {(r.method, int(r.seed)): by_name[r.run] for r in m[["run", "method", "seed"]].drop_duplicates().itertuples()}
    corr = S.sigma_fisher(runs.plans[env], pol, [d for (k, _), d in pol.items() if k == "sprpo"], cache_dir=cache_dir)
    paths = S.plot_sigma(layers, corr, Path(f"{stem}_sigma"),
                         title=f"SPrPO's noise on {env} ({runs.profile} profile): where it goes and what it spares")
    paths.append(atomic_write_text(f"{stem}_sigma_fisher.csv", corr.to_csv(index=False)))
    health = S.noise_health(m)  # per run: RMS sigma / rho, clamped fraction, valid actions vs. S.HEALTH
    paths.append(atomic_write_text(f"{stem}_sigma_health.csv", health.to_csv(index=False)))
    show(corr[corr.layer == -1])
    show(health)
    return paths


def _longer(runs: TrainingRuns, env: str, stem: Path, config: dict, show: Show) -> list[Path]:
    """Longer RL: held-out success along the longer runs against the warm start."""
    held_long = heldout_rows(runs.longer[env])
    curve_long = heldout_curve(held_long)
    paths = [atomic_write_text(f"{stem}_longer.csv", curve_long.to_csv(index=False))]
    if len(curve_long):
        paths = R.plot_longer(held_long, curve_long, Path(f"{stem}_longer"),
                              title=f"{env} ({runs.profile} profile): longer RL against the warm start") + paths
    show(curve_long)
    p = runs.plans[env]
    write_manifests(paths, {**config, "runs": [str(d) for d in runs.longer[env]],
                            "longer_iterations": p.longer_iterations}, runs.t_start, runs.render_only,
                    extra={"longer": p.longer(), **run_design(runs.longer[env])})
    return images(paths[:1]) if len(curve_long) else []


def _hparams(out: Path, runs: TrainingRuns, show: Show) -> None:
    """App. B's Tables 2 and 3 from the profiles, beside the paper's values (bold in the .md: a profile's difference)."""
    paths = []
    for name, rows, caption, label in (
            ("shared", H.SHARED, "Shared training hyperparameters used across all methods.", "tab:training-hparams"),
            ("perturbation", H.PERTURBATION,
             "Perturbation-specific training hyperparameters used in the main experiments.", "tab:perturbation-hparams")):
        frame = H.hparam_frame(rows)
        paths += [atomic_write_text(out / f"01_training_hparams_{name}.csv", frame.to_csv(index=False)),
                  atomic_write_text(out / f"01_training_hparams_{name}.tex", H.hparam_latex(frame, caption, label)),
                  atomic_write_text(out / f"01_training_hparams_{name}.md", H.hparam_markdown(frame))]
        show(frame)
    write_manifests(paths, dict(profiles=["paper", "cpu"], render_only=runs.render_only), runs.t_start,
                    runs.render_only, extra={k: not_applicable("hyperparameter tables, no computation") for k in DESIGN_KEYS})


# ----------------------------------------------------------------------------- 03 motivation
def motivation(page: ResultsPage, rows: Mapping[str, pd.DataFrame], show: Show = _quiet) -> list[Path]:
    """Notebook 03 per environment: Vanilla (and the warm start) clean and at Table 1's settings,
    and C1: Vanilla's clean minus perturbed success, paired over goals and seeds, against the
    paper's drop."""
    artifacts = []
    for env, r in rows.items():
        summary = R.summary_of(r, intervals=True)  # every bar with its 95% interval, as Fig. 3's points
        show(summary)
        stem = page.out / f"03_motivation_{env}"
        ref = X.WARM_START if (r["method"] == X.WARM_START).any() else None
        # the bars: clean and Table 1's settings, the plan's one full design (the curves' strengths are Fig. 3's)
        table = {("clean", 0.0), *((f, float(s)) for f, s in page.plans[env].table)}
        bars = summary[[(f, float(s)) in table for f, s in zip(summary["family"], summary["strength"])]]
        artifacts += R.plot_motivation(bars, stem, reference=ref,
                                       title=f"Vanilla GiGPO on {T.ENV_LABELS.get(env, env)} ({page.profile} profile), "
                                             "clean and at Table 1's settings")
        T.to_csv(summary, f"{stem}_summary.csv", digits=3)
        c1 = C.c1_rows(R.perturbation_losses(r, "vanilla", [(f, float(s)) for f, s in page.plans[env].table]), env)
        T.to_csv(c1, f"{stem}_c1.csv", digits=3)
        artifacts += [Path(f"{stem}_summary.csv"), Path(f"{stem}_c1.csv"), Path(f"{stem}_rows.csv")]
        show(c1.drop(columns=["env", "claim", "versus"]))
    page.manifests(artifacts)
    return artifacts


# ----------------------------------------------------------------------------- 04 robustness
def shown_methods(r: pd.DataFrame, methods: Sequence[str]) -> list[str]:
    """The warm start (where the rows have it: RL's starting point, a reference row), then ``methods``."""
    return ([X.WARM_START] if (r["method"] == X.WARM_START).any() else []) + list(methods)


def robustness(page: ResultsPage, rows: Mapping[str, pd.DataFrame], reference: str = "sprpo",
               show: Show = _quiet) -> list[Path]:
    """Notebook 04: per environment the summary, Fig. 3 from the table's own cells (every point
    with its interval), Table 1, the appendix tables (ALFWorld's ID and OOD apart), ``reference``
    paired against every other method; then the files gathering every environment (this pass's
    rows and the others' last ones) and the headline the README reads."""
    out, profile = page.out, page.profile
    artifacts, head, summaries, curve_summaries, shown_by = [], {}, {}, {}, {}
    for env, r in rows.items():
        p = page.plans[env]
        shown = shown_by[env] = shown_methods(r, p.methods)
        stem = out / f"04_robustness_{env}"
        summary = summaries[env] = R.summary_of(r)
        T.to_csv(summary, f"{stem}_summary.csv", digits=3)
        artifacts += [Path(f"{stem}_summary.csv"), out / f"04_robustness_{env}_rows.csv"]
        curve_summaries[env] = R.summary_of(r, intervals=True)
        artifacts += R.plot_curves(curve_summaries[env], shown, f"{stem}_curves", env_label=T.ENV_LABELS.get(env, env),
                                   title=f"{T.ENV_LABELS.get(env, env)}, {profile} profile: success vs strength")
        settings = {env: [("clean", 0.0), *[(f, float(s)) for f, s in p.table]]}
        artifacts += _tables(summary, r, env, settings, shown, stem)
        paired = R.paired_comparisons(r, reference, [m for m in shown if m != reference], settings[env])
        T.to_csv(paired, f"{stem}_paired.csv", digits=3)
        artifacts.append(Path(f"{stem}_paired.csv"))
        head[env] = R.headline(summary, paired, settings[env][1:], shown, env=env,
                               extra={"profile": profile, "tasks_per_split": R.tasks_per_split(r, settings[env]),
                                      "eval_seeds": list(p.eval_seeds),
                                      "training_seeds": {m: list(p.seeds[m]) for m in p.methods}})
        show(T.main_frame(summary, settings, shown))
        show(paired)
    artifacts += _every_env(page, rows, summaries, curve_summaries, shown_by)
    head = R.merged_headline(out / f"headline_{profile}.json", head)  # the other environment's numbers kept
    md = "".join(R.headline_caption(env, profile, h) + "\n\n" + R.headline_markdown(h, list(h["methods"])) + "\n"
                 for env, h in head.items())
    R.write_json(out / f"headline_{profile}.json", head)
    atomic_write_text(out / f"headline_{profile}.md", md)
    artifacts += [out / f"headline_{profile}.json", out / f"headline_{profile}.md"]
    page.manifests(artifacts, page.config(reference=reference))
    show(md)
    return artifacts


def _tables(summary, r, env, settings, shown, stem: Path) -> list[Path]:
    """Table 1 and the appendix table of one environment (ALFWorld's ID and OOD apart too)."""
    T.write_text(f"{stem}_table1.tex", T.main_table(summary, settings, shown))
    T.to_csv(T.main_frame(summary, settings, shown), f"{stem}_table1.csv", digits=3)
    T.write_text(f"{stem}_appendix.tex", T.appendix_table(summary, env, shown))
    T.to_csv(T.appendix_frame(summary, env, shown), f"{stem}_appendix.csv", digits=3)
    paths = [Path(f"{stem}{s}") for s in ("_table1.tex", "_table1.csv", "_appendix.tex", "_appendix.csv")]
    if env == "alfworld":  # App.: ALFWorld in-distribution (valid_seen) and out-of-distribution (valid_unseen)
        split_summary = R.summary_of(r, by=("env", "split"))
        groups = [("valid_seen", "ID"), ("valid_unseen", "OOD")]
        T.write_text(f"{stem}_appendix_id_ood.tex", T.appendix_table(split_summary, env, shown, groups=groups))
        T.to_csv(T.appendix_frame(split_summary, env, shown, groups=groups), f"{stem}_appendix_id_ood.csv", digits=3)
        paths += [Path(f"{stem}_appendix_id_ood.tex"), Path(f"{stem}_appendix_id_ood.csv")]
    return paths


def _every_env(page: ResultsPage, rows, summaries, curve_summaries, shown_by) -> list[Path]:
    """Fig. 3 in the paper's layout (a row per environment), the README's opening figure and
    Table 1 with both blocks, where the plan has several environments."""
    alls = page.with_others(rows)  # files of every environment: this pass's rows, the others' last ones
    if len(alls) < 2:
        return []
    for env, r in alls.items():  # an environment this pass leaves out, from its rows
        if env not in summaries:
            summaries[env], curve_summaries[env] = R.summary_of(r), R.summary_of(r, intervals=True)
            shown_by[env] = shown_methods(r, page.plan_of(env).methods)
    both = list(dict.fromkeys(m for env in alls for m in shown_by[env]))
    joint = pd.concat([summaries[env] for env in alls])
    curves = pd.concat([curve_summaries[env] for env in alls])
    out, profile = page.out, page.profile
    paths = R.plot_curves(curves, both, out / "04_robustness_curves",
                          title=f"{profile} profile: success vs strength, every environment of the plan")
    # the README's opening figure: both environments, the families with several strengths, at the README's width
    paths += R.plot_curves(curves, both, out / "04_robustness_readme", families=("gaussian", "fisher", "rtn"),
                           readme=True, title=f"{profile} profile: held-out success as the perturbation grows")
    table = {env: [("clean", 0.0), *[(f, float(s)) for f, s in page.plan_of(env).table]] for env in alls}
    T.write_text(out / "04_robustness_table1.tex", T.main_table(joint, table, both))  # Table 1: both blocks
    T.to_csv(T.main_frame(joint, table, both), out / "04_robustness_table1.csv", digits=3)
    return paths + [out / "04_robustness_table1.tex", out / "04_robustness_table1.csv"]


# ----------------------------------------------------------------------------- 07 examples
def examples(page: ResultsPage, per_family: int = 1, show: Show = _quiet) -> list[Path]:
    """Notebook 07: Vanilla-SPrPO trajectory pairs by :data:`~sprpo_lib.paper.results.EXAMPLE_RULE`
    from notebook 04's rows and the episode logs stored with their cells."""
    artifacts = []
    for env in page.plans:
        r = X.load_rows(page.out / f"04_robustness_{env}_rows.csv")  # the rows notebook 04 computed
        picks = R.pick_examples(r, "vanilla", "sprpo", per_family=per_family)
        logs = {c: load_episode_log(page.cache_dir, c) for c in set(picks.filter(like="cell_").stack()) if c}
        missing = sorted(c for c, v in logs.items() if v is None)
        if missing and page.render_only:  # the committed examples are not replaced by ones without their episodes
            raise FileNotFoundError(f"{len(missing)} episode log(s) are not in {page.cache_dir} (the evaluation cache "
                                    "is not committed); run notebook 04 without render_only first")
        if missing:
            print("some episode logs are missing from", page.cache_dir,
                  "(cells computed elsewhere or before logs were kept)")
        md = R.examples_markdown(picks, logs)
        stem = page.out / f"07_examples_{env}"
        T.to_csv(picks, f"{stem}.csv")
        atomic_write_text(f"{stem}.md", md)
        artifacts += [Path(f"{stem}.md"), Path(f"{stem}.csv")]
        show(picks)
        show(md)
    page.manifests(artifacts, {"profile": page.profile, "envs": page.envs, "per_family": per_family,
                               "rule": R.EXAMPLE_RULE.format(n=2)})
    return artifacts


# ----------------------------------------------------------------------------- 08 ablations
class Ablations:
    """Notebook 08's study per environment (:func:`sprpo_lib.paper.ablations.ablation`) and the
    variants' run folders of a computing pass (a render-only pass reads the rows CSVs)."""

    def __init__(self, page: ResultsPage):
        self.page = page
        self.studies = {env: A.ablation(page.profile, env) for env in page.envs}
        self.runs: dict[str, dict] = {}

    def compute(self, p: X.Plan, main) -> pd.DataFrame:
        ab = self.studies[p.env]
        runs = self.runs[p.env] = A.variant_runs(ab, p, main, runs_root=self.page.runs_root)
        return A.ablation_rows(ab, p, runs, main, cache_dir=self.page.cache_dir)

    def rows(self) -> dict[str, pd.DataFrame]:
        return self.page.rows(self.compute)


def ablations(study: Ablations, rows: Mapping[str, pd.DataFrame], show: Show = _quiet) -> list[Path]:
    """Notebook 08: per environment the ablation tables and Fig. 5, the paired comparisons with
    the reference, SPrPO's noise rules; then every claim (C1-C6 and notebook 09's KL claims),
    each claim's power from these rows and the design it would need."""
    page = study.page
    artifacts, ablation_paired = [], {}
    for env, r in rows.items():
        artifacts += _ablation_env(study, env, r, ablation_paired, show)
    artifacts += _claims(page, rows, ablation_paired, show)
    artifacts += _power(page, rows, show)
    page.manifests(artifacts, page.config(studies={env: ab.as_dict() for env, ab in study.studies.items()}))
    return artifacts


def _ablation_env(study: Ablations, env: str, r: pd.DataFrame, ablation_paired: dict, show: Show) -> list[Path]:
    ab, p, page = study.studies[env], study.page.plans[env], study.page
    stem = page.stem(env)
    settings = [("clean", 0.0), *[(f, float(s)) for f, s in p.table]]
    summary = R.summary_of(r)
    T.to_csv(summary, f"{stem}_summary.csv", digits=3)
    stars = A.starred(ab, p)  # every variant whose runs are the main runs (Table 1's cells) carries a star
    components = [("", A.star(ab.group("components"), stars))]
    hyper = [(A.GROUP_TITLES[g], A.star(ab.group(g), stars)) for g in ("rho", "alpha", "lr") if ab.group(g)]
    T.write_text(f"{stem}_components.tex",
                 T.ablation_table(summary, env, components, settings, first_column="Training variant"))
    T.to_csv(T.ablation_frame(summary, env, components, settings), f"{stem}_components.csv", digits=3)
    T.write_text(f"{stem}_hyperparameters.tex", T.ablation_table(summary, env, hyper, settings))
    T.to_csv(T.ablation_frame(summary, env, hyper, settings), f"{stem}_hyperparameters.csv", digits=3)
    others = [k for k in dict.fromkeys(r["method"]) if k != A.REFERENCE]
    paired = R.paired_comparisons(r, A.REFERENCE, others, settings)
    T.to_csv(paired, f"{stem}_paired.csv", digits=3)
    paths = []
    rules = A.noise_rules(ab, study.runs.get(env, {}))
    if len(rules):  # SPrPO under raw / relative / energy: sigma and rollout health per iteration
        T.to_csv(rules, f"{stem}_noise_rules.csv", digits=4)
        paths.append(Path(f"{stem}_noise_rules.csv"))
        show(S.noise_health(rules.assign(method=rules["rule"]), by="variant"))
    panels = [(R.plain(A.GROUP_TITLES[g]), A.star(ab.group(g), stars))
              for g in ("strategy", "schedule", "rho", "alpha") if ab.group(g)]
    paths += R.plot_ablation(R.ablation_bars(r, settings), panels, len(settings) - 1, f"{stem}_fig5", env=env,
                             title=f"{T.ENV_LABELS.get(env, env)}, {page.profile} profile: ablations")
    paths += [Path(f"{stem}{s}") for s in ("_rows.csv", "_summary.csv", "_components.tex", "_components.csv",
                                           "_hyperparameters.tex", "_hyperparameters.csv", "_paired.csv")]
    show(T.ablation_frame(summary, env, components + hyper, settings)
         .pivot_table(index=["group", "label"], columns="column", values="mean", sort=False).round(1))
    show(paired[["baseline", "family", "strength", "success_diff", "success_lo", "success_hi", "success_mde80"]])
    ablation_paired[env] = paired
    return paths


def _claims(page: ResultsPage, rows, ablation_paired: dict, show: Show) -> list[Path]:
    """Every claim from notebook 04's headline (paired comparisons, every env), C1 from notebook
    03's tables, C4 from notebook 05's landscape rows, C6 from these ablation rows, and notebook
    09's KL claims where present."""
    out, profile = page.out, page.profile
    head = out / f"headline_{profile}.json"
    if not head.is_file():
        return []
    headline = json.loads(head.read_text())
    found = {(e, k): out / f"{k}_{e}_{s}.csv" for e in headline
             for k, s in (("03_motivation", "c1"), ("05_landscape", "rows"))}
    found = {k: pd.read_csv(f) for k, f in found.items() if f.is_file()}
    claims = C.all_claims({e: pd.DataFrame(h["paired"]) for e, h in headline.items() if h.get("paired")},
                          ablation_paired,
                          c1={e: t for (e, k), t in found.items() if k == "03_motivation"},
                          landscapes={e: t for (e, k), t in found.items() if k == "05_landscape" and len(t)},
                          ablation_rows={e: r for e, r in rows.items() if {"sam_5e-3", "sam_0.1"} <= set(r["method"])})
    paths = C.write_claims(out, profile, success=claims)
    show((out / f"claims_{profile}.md").read_text())
    return paths


def _power(page: ResultsPage, rows, show: Show) -> list[Path]:
    """Each claim's power from these pilot rows (the MDE here, the goals a design needs), the
    design the power table chooses per RL length within 8 hours, and its hours elsewhere."""
    out, profile = page.out, page.profile
    power, powers, paths = pd.DataFrame(), [], []
    for env in ("alfworld", "webshop"):
        main_rows = out / f"04_robustness_{env}_rows.csv"  # notebook 04's episode rows
        if main_rows.is_file():
            powers.append(P.claim_power({"main": pd.read_csv(main_rows),
                                         **({"ablation": rows[env]} if env in rows else {})}, env))
    if powers:
        power = pd.concat(powers, ignore_index=True)
        T.to_csv(power, out / f"claims_power_{profile}.csv", digits=3)
        paths.append(out / f"claims_power_{profile}.csv")
        show(power.drop(columns=["text"]))
    design = B.design_from_figures(out, power if len(power) else None)
    if len(design):
        T.to_csv(design, out / f"claims_design_{profile}.csv", digits=2)
        paths.append(out / f"claims_design_{profile}.csv")
        show(design.drop(columns=["claims"], errors="ignore"))
    if len(power):  # every claim, its MDE, what a design would need; the README copies the first paragraph
        atomic_write_text(out / f"claims_power_{profile}.md",
                          P.power_markdown(power, design if len(design) else None, profile=profile))
        paths.append(out / f"claims_power_{profile}.md")
    return paths


# ----------------------------------------------------------------------------- 09 divergence
def divergence(page: ResultsPage, rows: Mapping[str, pd.DataFrame], show: Show = _quiet) -> list[Path]:
    """Notebook 09 per environment (:func:`sprpo_lib.paper.divergence.render`, against notebook
    04's success rows where present), then the claims file with the KL claims beside the success ones."""
    out, artifacts = page.out, []
    for env, r in rows.items():
        if r.empty:  # the plan measures no divergence on this env
            print(f"{env}: the {page.profile} plan sets no divergence_states; nothing to draw")
            artifacts.append(out / f"09_divergence_{env}_rows.csv")
            continue
        success = out / f"04_robustness_{env}_rows.csv"
        artifacts += V.render(r, page.plans[env], out, success=X.load_rows(success) if success.is_file() else None)
        artifacts.append(out / f"09_divergence_{env}_rows.csv")
        show((out / f"09_divergence_{env}_claims.md").read_text())
    artifacts += C.write_claims(out, page.profile)  # claims_<profile>.csv/.md: notebook 08's success claims and these
    page.manifests(artifacts)
    return artifacts
