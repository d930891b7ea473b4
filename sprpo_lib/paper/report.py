"""Training runs as tidy tables and figures (logic of ``notebooks/01_training.ipynb``).

A run folder (``runs/train/<env>-<method>-<profile>-seed<seed>/``, written by
:func:`train.train`) holds ``config.json``, ``metrics.jsonl`` (one line per iteration)
and, when the config asks for it, ``final/eval.json``: the final policy's success on
the held-out training tasks where the warm start was scored (``runs/sft/<key>/eval.json``,
same tasks, same generation seed).  This module reads them; it trains nothing itself
except through :func:`run_grid`, which calls :func:`train.train` (resuming finished or
killed runs from their checkpoints), one run after another or, under ``--executor ray``,
each run a Ray task (:mod:`sprpo_lib.infra.executor`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from sprpo_lib.core import metrics as MK
from sprpo_lib.infra.executor import current
from sprpo_lib.infra.io import atomic_dir, read_json_lines
from sprpo_lib.infra.paths import project_path, runs_dir
from sprpo_lib.paper.stats import N_RESAMPLES, paired_bootstrap, sign_test
from sprpo_lib.paper.style import LABEL_BOX, METHOD_DISPLAY, legend_below, pyplot, save_figure
from sprpo_lib.train.config import TrainConfig, config_from_dict, load_config
from sprpo_lib.train.trainer import default_out_dir, heldout_dir, heldout_due, train
from sprpo_lib.warmstart.cache import prepare_warm_start, warm_start_dir
from sprpo_lib.warmstart.heldout import load_eval


__all__ = ["run_grid", "find_runs", "LONGER", "longer_root", "longer_grid", "load_metrics", "before_after", "paired_outcomes", "plot_training",
           "heldout_rows", "heldout_curve"]


def run_grid(profile: str, env: str, methods: Sequence[str], seeds: Sequence[int] | Mapping[str, Sequence[int]],
             overrides: Sequence[str] = (), out_root: str | Path | None = None,
             progress: bool = True, executor=None) -> list[Path]:
    """Train (or resume, or just find) one run per (method, seed), seed-major; returns the folders.
    ``seeds`` is one list for every method or a ``{method: seeds}`` mapping (the ``cpu``
    profile trains more seeds of Vanilla and SPrPO than of the other baselines).
    ``executor``: where the runs execute (default :func:`sprpo_lib.infra.executor.current`)."""
    if isinstance(seeds, Mapping):
        missing = [m for m in methods if m not in seeds]
        if missing:
            raise ValueError(f"seeds: no training seeds given for method(s) {missing}; give a list per method "
                             f"(e.g. {{'vanilla': [0, 1]}}) or one list for all")
    jobs = [(cfg, out, False, progress) for cfg, out in _grid(profile, env, methods, seeds, overrides, out_root)]
    for cfg in {warm_start_dir(c): c for c, *_ in reversed(jobs) if c.warm_start}.values():  # the first run's config
        prepare_warm_start(cfg, progress)  # the stage before RL, once for every run that starts from it
    return (executor or current()).map(train, jobs, kind="run", desc=f"train {env}", progress=progress)


def _grid(profile, env, methods, seeds, overrides, out_root):
    per = {m: list(seeds[m] if isinstance(seeds, Mapping) else seeds) for m in methods}
    out = []  # seed-major: every method's first seed before any second seed
    for seed in sorted({s for v in per.values() for s in v}):
        for method in (m for m in methods if seed in per[m]):
            cfg = load_config(profile, list(overrides), **{"env.name": env, "method.name": method, "seed": seed})
            out.append((cfg, project_path(out_root) / default_out_dir(cfg).name if out_root else default_out_dir(cfg)))
    return out


def find_runs(profile: str, env: str, methods: Sequence[str], seeds: Sequence[int] | Mapping[str, Sequence[int]],
              overrides: Sequence[str] = (), out_root: str | Path | None = None) -> list[Path]:
    """The run folders :func:`run_grid` would train, without training (render-only);
    a run that has logged no iteration is one clear error."""
    dirs = [d for _, d in _grid(profile, env, methods, seeds, overrides, out_root)]
    missing = [str(d) for d in dirs if not (d / "metrics.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(f"no training run in {missing}; run the notebook with render_only=False to train")
    return dirs


#: Subfolder of the runs root holding the longer runs (:func:`longer_grid`).
LONGER = "longer"


def longer_root(out_root: str | Path | None = None) -> Path:
    """Where the longer runs of a plan whose runs live under ``out_root`` are kept:
    ``<out_root>/longer/``, or ``runs/longer/`` beside the default ``runs/train/``."""
    return project_path(out_root) / LONGER if out_root else runs_dir(LONGER)


def longer_grid(profile: str, env: str, methods: Sequence[str], seeds: Sequence[int] | Mapping[str, Sequence[int]],
                iterations: int, overrides: Sequence[str] = (), out_root: str | Path | None = None, *,
                find: bool = False, progress: bool = True, executor=None) -> list[Path]:
    """The plan's runs (under ``out_root``, as :func:`run_grid` trains them) continued to
    ``iterations`` RL iterations, each under :func:`longer_root` with the run's name: the
    held-out curve that shows whether more RL moves the policy.  A longer run starts as a
    copy of the finished plan run (nothing in training depends on the total number of
    iterations, so the copy's iterations are the ones a longer run from scratch makes), then
    resumes from its last checkpoint; ``find``: only find them (render-only)."""
    more = [*overrides, f"iterations={int(iterations)}"]
    root = longer_root(out_root)
    if find:
        return find_runs(profile, env, methods, seeds, more, out_root=root)
    for cfg, base in _grid(profile, env, methods, seeds, overrides, out_root):
        if iterations <= cfg.iterations:
            raise ValueError(f"plan.longer_iterations={iterations}: a longer run needs more than the profile's "
                             f"{cfg.iterations} iterations; set it above {cfg.iterations}, or to 0 for none")
        target = root / base.name
        if not (target / "metrics.jsonl").is_file() and (base / "metrics.jsonl").is_file():
            with atomic_dir(target) as tmp:  # the plan run's iterations, once (a killed copy leaves none)
                shutil.copytree(base, tmp, dirs_exist_ok=True)
    return run_grid(profile, env, methods, seeds, more, out_root=root, progress=progress, executor=executor)


def _config(run_dir: Path) -> TrainConfig:
    return config_from_dict(json.loads((run_dir / "config.json").read_text())["config"])


def load_metrics(run_dirs: Sequence[str | Path]) -> pd.DataFrame:
    """One row per (run, iteration): the ``metrics.jsonl`` columns plus ``env``,
    ``method``, ``seed``, ``profile``, ``temperature`` (of the rollouts) and ``run``."""
    frames = []
    for d in map(project_path, run_dirs):
        cfg = _config(d)
        rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        if not rows:
            continue
        df = pd.DataFrame(rows)
        df.insert(0, "run", d.name)
        df.insert(1, "env", cfg.env.name)
        df.insert(2, "method", cfg.method.name)
        df.insert(3, "seed", cfg.seed)
        df.insert(4, "profile", cfg.profile)
        df.insert(5, "temperature", cfg.rollout.generation.temperature)
        frames.append(df)
    if not frames:
        raise ValueError(f"no metrics in {list(map(str, run_dirs))}: train first (python -m sprpo_lib.train ...)")
    return pd.concat(frames, ignore_index=True)


def paired_outcomes(start_episodes: str | Path, final_episodes: str | Path) -> dict:
    """Task-by-task comparison of two evaluations of the same held-out tasks
    (``eval_episodes.jsonl`` files): tasks solved only after RL (``gained``), only
    before (``lost``), the exact McNemar p-value, the mean score change and a sign test
    on the scores (tasks whose score rose / fell, exact two-sided p)."""
    def by_task(path):  # every line whole, or one error naming the file
        return {e["task_id"]: e for e in read_json_lines(path)}

    a, b = by_task(start_episodes), by_task(final_episodes)
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError(f"{start_episodes} and {final_episodes} share no task: not a paired evaluation")
    gained = sum(b[t]["success"] and not a[t]["success"] for t in common)
    lost = sum(a[t]["success"] and not b[t]["success"] for t in common)
    up = sum(b[t]["score"] > a[t]["score"] for t in common)
    down = sum(b[t]["score"] < a[t]["score"] for t in common)
    return {"paired_tasks": len(common), "gained": gained, "lost": lost,
            "mcnemar_p": sign_test(gained, lost),
            "score_change": sum(b[t]["score"] - a[t]["score"] for t in common) / len(common),
            "score_up": up, "score_down": down, "score_sign_p": sign_test(up, down)}


def before_after(run_dirs: Sequence[str | Path]) -> pd.DataFrame:
    """Per run: success of the starting policy (the warm start's ``eval.json``) and of
    the final policy (``final/eval.json``) on the same held-out training tasks with the
    task-by-task comparison of :func:`paired_outcomes`, and the mean rollout success of
    the first and last iterations (at the rollout noise)."""
    rows = []
    for d in map(project_path, run_dirs):
        cfg = _config(d)
        m = load_metrics([d])
        row = {"run": d.name, "env": cfg.env.name, "method": cfg.method.name, "seed": cfg.seed,
               "iterations": len(m), "rollout_success_first": m[MK.SUCCESS].iloc[0],
               "rollout_success_last": m[MK.SUCCESS].iloc[-1],
               "rollout_success_first_half": m[MK.SUCCESS].iloc[: max(1, len(m) // 2)].mean(),
               "rollout_success_second_half": m[MK.SUCCESS].iloc[len(m) // 2:].mean(),
               # iterations whose batch had a non-zero advantage, so that the policy moved (Alg. 1 line 6)
               "updated_fraction": float(m[MK.UPDATED].mean()) if MK.UPDATED in m else float("nan")}
        start = warm_start_dir(cfg) / "eval.json"
        final = d / "final" / "eval.json"
        for name, path in (("start", start), ("final", final)):
            if cfg.warm_start or name == "final":
                if path.is_file():
                    ev = load_eval(path)  # verified with its episode log, or one error naming the file
                    row.update({f"{name}_success": ev["success_rate"], f"{name}_score": ev["mean_score"],
                                f"{name}_valid": ev["valid_rate"], "eval_episodes": ev["episodes"]})
        eps = [p.parent / "eval_episodes.jsonl" for p in (start, final)]
        if cfg.warm_start and all(p.is_file() for p in eps):
            row.update(paired_outcomes(*eps))
        rows.append(row)
    return pd.DataFrame(rows)


def heldout_rows(run_dirs: Sequence[str | Path]) -> pd.DataFrame:
    """One row per held-out episode of every policy along each run, all on the same tasks
    with the same generation seed and temperature: the warm start (``iteration`` 0, its
    ``eval.json``; one policy, repeated under every run's ``train_seed``), the policy after
    every ``eval_every``-th iteration (``heldout/iter_<k>/``: ``iteration`` k + 1) and the
    final one (``final/eval.json``, unless the last iteration's is already there).
    Columns: env, method, train_seed, iteration, split, task_index, seed (the evaluation's
    generation seed, one per policy), family (``clean``), strength (0), success, score."""
    rows = []
    for d in map(project_path, run_dirs):
        cfg = _config(d)
        done = len(load_metrics([d])) if (d / "metrics.jsonl").is_file() else 0
        points = [(0, warm_start_dir(cfg))] if cfg.warm_start else []
        points += [(k + 1, heldout_dir(d, k)) for k in heldout_due(cfg) if k < done]
        if done == cfg.iterations and cfg.iterations not in {i for i, _ in points}:
            points.append((cfg.iterations, d / "final"))
        for it, folder in points:
            if not (folder / "eval.json").is_file():
                continue
            load_eval(folder / "eval.json")  # verified with its episode log, or one error naming the file
            for e in read_json_lines(folder / "eval_episodes.jsonl"):
                rows.append({"env": cfg.env.name, "method": cfg.method.name, "train_seed": cfg.seed, "iteration": it,
                             "split": e["split"], "task_index": e["task_index"], "seed": cfg.sft.seed,
                             "family": "clean", "strength": 0.0, "success": float(e["success"]),
                             "score": float(e["score"])})
    return pd.DataFrame(rows)


#: Columns of :func:`heldout_curve` (also of an empty one: a profile without a held-out curve).
HELDOUT_CURVE_COLUMNS = ("env", "method", "iteration", "train_seeds", "tasks", "success", "start", "diff", "lo", "hi",
                         "wins", "losses", "sign_p")


def heldout_curve(rows: pd.DataFrame, n_resamples: int = N_RESAMPLES, seed: int = 0) -> pd.DataFrame:
    """Per (env, method, iteration > 0): held-out success (%) of the policies after that many
    iterations against the warm start's on the same tasks, with the two-way paired bootstrap
    over training seeds and tasks of :func:`~sprpo_lib.paper.stats.paired_bootstrap` (``diff``,
    ``lo``, ``hi`` in pp; ``wins`` / ``losses`` the tasks gained / lost pooled over seeds,
    ``sign_p`` their exact sign test): whether RL moved the policy, and by how much."""
    out = []
    if rows.empty:
        return pd.DataFrame(out, columns=list(HELDOUT_CURVE_COLUMNS))
    start = rows[rows["iteration"] == 0]
    for (env, method, it), after in rows[rows["iteration"] > 0].groupby(["env", "method", "iteration"]):
        seeds = sorted(set(after["train_seed"]))
        base = start[(start["env"] == env) & start["train_seed"].isin(seeds)]
        if set(base["train_seed"]) != set(seeds):
            continue  # no warm start to pair with (a profile without one)
        both = pd.concat([after.assign(policy="after"), base.assign(policy="start")], ignore_index=True)
        res = paired_bootstrap(both, "after", "start", "clean", 0.0, method="policy", n_resamples=n_resamples,
                               seed=seed)
        lo, hi = res["success_ci"]
        out.append({"env": env, "method": method, "iteration": int(it), "train_seeds": len(seeds),
                    "tasks": int(after.groupby("train_seed").size().iloc[0]),
                    "success": 100 * after["success"].mean(), "start": 100 * base["success"].mean(),
                    "diff": res["success"], "lo": lo, "hi": hi, "wins": res["wins"],
                    "losses": res["losses"], "sign_p": res["sign_p"]})
    return pd.DataFrame(out, columns=list(HELDOUT_CURVE_COLUMNS))


TRAINING_DODGE = 0.05
"""Sideways offset (iterations) between consecutive runs in ``plot_training``: runs that share a seed
roll out the same first batch, and equal values would otherwise hide one line behind another."""


def _heldout_panel(ax, heldout: pd.DataFrame | None, summary: pd.DataFrame | None, has_curve: bool,
                   styles: Sequence) -> None:
    """``plot_training``'s last panel: held-out success along training (``heldout`` with points
    between the warm start and the end), else before / after bars (the warm start once where
    every run starts from the same evaluated one)."""
    if has_curve:
        for (method, seed), df in heldout.groupby(["method", "train_seed"]):
            disp = METHOD_DISPLAY.get(method)
            per = df.groupby("iteration")["success"].mean()
            ax.plot(per.index, per.values, color=disp.color if disp else None, ls=styles[int(seed) % len(styles)],
                    marker=disp.marker if disp else "o", ms=4, label=f"{disp.label if disp else method} s{seed}")
        n = int(heldout.groupby(["train_seed", "iteration"]).size().max())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="RL iterations (0: warm start)", ylabel="held-out success",
               title=f"held-out training tasks (n={n}, T=0.4)", ylim=(0, 1))
        legend_below(ax, ncol=2, fontsize=6.5)
    else:
        s = summary.dropna(subset=["start_success", "final_success"])
        x = range(len(s))
        ws = METHOD_DISPLAY["warm_start"]  # the warm start in its colour, each trained run in its method's
        one_start = s["start_success"].nunique() == 1  # every run starts from the same evaluated warm start
        if one_start:
            ax.axhline(float(s["start_success"].iloc[0]), color=ws.color, ls="--", lw=1,
                       label=f"{ws.label} ({float(s['start_success'].iloc[0]):.2f})")
        else:
            ax.bar([i - 0.2 for i in x], s["start_success"], width=0.4, color=ws.color, label=ws.label)
        width, dx = (0.6, 0.0) if one_start else (0.4, 0.2)
        ax.bar([i + dx for i in x], s["final_success"], width=width, label="after RL (method colour)",
               color=[METHOD_DISPLAY[m].color if m in METHOD_DISPLAY else "0.5" for m in s["method"]])
        for i, (a, b) in enumerate(zip(s["start_success"], s["final_success"])):
            if not one_start:
                ax.text(i - dx, a + 0.01, f"{a:.2f}", ha="center", va="bottom", fontsize=6, bbox=LABEL_BOX, zorder=3)
            ax.text(i + dx, b + 0.01, f"{b:.2f}", ha="center", va="bottom", fontsize=6, bbox=LABEL_BOX, zorder=3)
        ticks = [f"{METHOD_DISPLAY[m].label if m in METHOD_DISPLAY else m}\ns{sd}" for m, sd in zip(s["method"], s["seed"])]
        if "gained" in s:  # tasks solved only after / only before RL, exact McNemar p; short lines, no overlap
            ticks = [f"{t}\n+{g}/-{lo}\np={pv:.2g}" for t, g, lo, pv in zip(ticks, s["gained"], s["lost"], s["mcnemar_p"])]
        ax.set_xticks(list(x), ticks, fontsize=6.5)
        n = int(s["eval_episodes"].iloc[0]) if len(s) else 0
        ax.set(ylabel="success", title=f"held-out training tasks (n={n})", ylim=(0, 1))
        ax.legend(fontsize=7, loc="upper right")


VALID_FLAT = 0.02
"""``plot_training`` draws the valid-action rate only where it spans more than this over all runs and
iterations; a flatter rate is stated in the footnote with its range."""


def plot_training(metrics: pd.DataFrame, summary: pd.DataFrame | None, path: str | Path,
                  heldout: pd.DataFrame | None = None):
    """Per iteration, one line per run: rollout success; the score on the env's own scale
    where it says more than success (WebShop's partial matches; ALFWorld's score is 10 x
    success); the valid-action rate where it varies (a constant rate is stated in the
    footnote, not drawn as a flat line); then the held-out success before/after training:
    along training (``heldout``: :func:`heldout_rows` with points between the warm start and
    the end, one line per run from the warm start at 0) or as bars before / after.  Each
    quantity has its own axes (no twin axes over many runs)."""
    plt = pyplot()
    has_curve = heldout is not None and not heldout.empty and heldout["iteration"].nunique() > 2
    has_eval = has_curve or (summary is not None and "final_success" in summary and "start_success" in summary)
    ratio = float(metrics[MK.SCORE].abs().max()) / max(float(metrics[MK.SUCCESS].max()), 1e-12)
    score_shown = not np.allclose(metrics[MK.SCORE], ratio * metrics[MK.SUCCESS], atol=1e-9)
    valid = metrics[MK.VALID_RATE].dropna()
    valid_shown = len(valid) and float(valid.max() - valid.min()) > VALID_FLAT
    kinds = ["success"] + ["score"] * score_shown + ["valid"] * bool(valid_shown) + ["eval"] * has_eval
    # bars before / after RL: the held-out panel widens with the runs so their three-line ticks fit
    bars = 0 if has_curve or not has_eval else int(summary.dropna(subset=["start_success", "final_success"]).shape[0])
    widths = [1.0] * (len(kinds) - has_eval) + [max(1.0, bars / 5)] * has_eval
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.3 * sum(widths), 3.6), gridspec_kw={"width_ratios": widths})
    panel = dict(zip(kinds, np.atleast_1d(axes)))

    styles = ("-", ":", "-.", (0, (5, 2)))
    runs = list(metrics.groupby("run"))
    for k, (run, df) in enumerate(runs):
        method, seed = df["method"].iloc[0], int(df["seed"].iloc[0])
        disp = METHOD_DISPLAY.get(method)
        label = f"{disp.label if disp else method} s{seed}"
        kw = {"color": disp.color if disp else None, "ls": styles[seed % len(styles)],
              "marker": disp.marker if disp else "o", "ms": 3}
        x = df[MK.ITERATION] + (k - (len(runs) - 1) / 2) * TRAINING_DODGE  # equal runs stay visible side by side
        panel["success"].plot(x, df[MK.SUCCESS], label=label, **kw)
        if score_shown:
            panel["score"].plot(x, df[MK.SCORE], label=label, **kw)
        if valid_shown:
            panel["valid"].plot(x, df[MK.VALID_RATE], label=label, **kw)
    for kind in ("success", "score", "valid"):
        if kind in panel:
            panel[kind].xaxis.set_major_locator(MaxNLocator(integer=True))
    temps = sorted(set(metrics["temperature"])) if "temperature" in metrics else []
    t = f", T={temps[0]:g}" if len(temps) == 1 else ""
    panel["success"].set(xlabel="iteration (runs offset sideways)", ylabel="rollout success",
                         title=f"success (rollouts on training tasks{t})", ylim=(-0.02, 1.02))
    if score_shown:
        lo, hi = min(0.0, float(metrics[MK.SCORE].min())), max(1.0, float(metrics[MK.SCORE].max()))
        pad = 0.02 * (hi - lo)
        panel["score"].set(xlabel="iteration", ylabel="mean score", title="score (partial credit)",
                           ylim=(lo - pad, hi + pad))
    if valid_shown:
        panel["valid"].set(xlabel="iteration", ylabel="valid-action rate", title="valid-action rate",
                           ylim=(-0.02, 1.08))  # a rate of 1 stays off the frame
    notes = [f"score = {ratio:g} x success (not drawn)"] * (not score_shown)
    if len(valid) and not valid_shown:
        notes.append(f"valid-action rate between {float(valid.min()):.3f} and {float(valid.max()):.3f} at every "
                     f"iteration of every run (not drawn)")
    # the runs' colours and line styles are the same in every panel: one legend, under the first
    legend_below(panel["success"], ncol=4 if len(runs) > 6 else 2, fontsize=6.5)
    if has_eval:
        _heldout_panel(panel["eval"], heldout, summary, has_curve, styles)
    if notes:
        fig.text(0.01, 0.005, "; ".join(notes).capitalize() + ".", fontsize=6.5, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.25 / fig.get_figheight() if notes else 0, 1, 1))
    return save_figure(fig, path, dpi=130, rules=("text", "legend", "crossed"), formats=("png",))[0]
