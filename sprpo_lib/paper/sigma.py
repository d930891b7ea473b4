"""SPrPO's noise over training and the channels it protects (notebook 01's sigma figure).

* :func:`layer_sigma`: the RMS sigma of every layer at every iteration, from the runs'
  ``metrics.jsonl`` (``xi_sigma_layer_rms``: the sigma each iteration's rollouts drew from);
* :func:`final_sigma`: the per-channel sigma after the last update (the run's newest
  checkpoint, Alg. 1 line 3 on the final statistics);
* :func:`sigma_fisher`: per layer, Spearman's rank correlation between that sigma and the
  diagonal-Fisher channel importance that structured pruning ranks by at evaluation
  (App. C), on the same calibration pool and the same policy.  Sensitivity-aware noise
  should protect (give small sigma to) the channels Fisher calls important, so a
  negative correlation is what Corollary 1's allocation predicts;
* :func:`plot_sigma`: the heatmap and the per-layer correlations.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd
import torch

from sprpo_lib.core import metrics as MK
from sprpo_lib.core.methods import make_method
from sprpo_lib.core.sigma import rank_correlation
from sprpo_lib.evaluate import ModelSource, fisher_scores_cached, load_calibration
from sprpo_lib.infra.io import read_json
from sprpo_lib.infra.paths import project_path
from sprpo_lib.paper import experiments as X
from sprpo_lib.paper.results import save_figure
from sprpo_lib.paper.style import METHOD_COLORS, pyplot
from sprpo_lib.train.checkpoint import final_method_state
from sprpo_lib.train.config import config_from_dict

__all__ = ["layer_sigma", "final_sigma", "sigma_fisher", "plot_sigma", "noise_health", "HEALTH"]

#: What a healthy noise schedule keeps to, per iteration: RMS sigma within these multiples of
#: rho, at most this fraction of channels at sigma_max, and (after iteration 0) at least this
#: valid-action rate in the run's own rollouts.
HEALTH = {"rms_over_rho": (0.5, 1.5), "clamped_max": 0.05, "valid_min": 0.80}


def noise_health(metrics: pd.DataFrame, by: str = "run") -> pd.DataFrame:
    """Per run with sigma statistics: the range of RMS sigma / rho over its iterations, the
    largest clamped fraction, the lowest valid-action rate after iteration 0, the largest
    sign-flip fraction of the realised xi, and whether every iteration kept to
    :data:`HEALTH` (``healthy``).  ``by``: the column that names a run (``variant`` for
    ablation runs, whose folders repeat the main runs' names)."""
    need = {MK.XI_SIGMA_RMS, MK.XI_RHO}
    if not need <= set(metrics.columns):
        return pd.DataFrame()
    out = []
    for run, m in metrics[metrics[MK.XI_SIGMA_RMS].notna()].groupby(by, sort=False):
        ratio = m[MK.XI_SIGMA_RMS] / m[MK.XI_RHO]
        later = m[m[MK.ITERATION] > m[MK.ITERATION].min()]
        row = {by: run, "method": m["method"].iloc[0], "seed": m["seed"].iloc[0], "iterations": len(m),
               "rho": float(m[MK.XI_RHO].iloc[0]), "rms_over_rho_min": float(ratio.min()),
               "rms_over_rho_max": float(ratio.max()), "clamped_max": float(m[MK.XI_SIGMA_CLAMPED_FRAC].max()),
               "valid_min_after_0": float(later[MK.VALID_RATE].min()) if len(later) else float("nan"),
               "flip_max": float(m[MK.XI_REAL_FLIP_FRAC].max()) if MK.XI_REAL_FLIP_FRAC in m else float("nan")}
        lo, hi = HEALTH["rms_over_rho"]
        tol = 1e-6  # sigma is float32: RMS at the schedule's clip lands within rounding of it
        row["healthy"] = bool(row["rms_over_rho_min"] >= lo * (1 - tol) and row["rms_over_rho_max"] <= hi * (1 + tol)
                              and row["clamped_max"] <= HEALTH["clamped_max"]
                              and not row["valid_min_after_0"] < HEALTH["valid_min"])
        out.append(row)
    return pd.DataFrame(out)


def layer_sigma(metrics: pd.DataFrame) -> pd.DataFrame:
    """Long rows ``run, method, seed, iteration, layer, sigma_rms`` of the runs that logged
    per-layer sigma (SPrPO)."""
    col = MK.XI_SIGMA_LAYER_RMS
    out = []
    if col in metrics:
        for r in metrics[metrics[col].notna()].itertuples(index=False):
            r = r._asdict()
            out += [{"run": r["run"], "method": r["method"], "seed": r["seed"], MK.ITERATION: r[MK.ITERATION],
                     "layer": i, "sigma_rms": float(v)} for i, v in enumerate(r[col])]
    return pd.DataFrame(out, columns=["run", "method", "seed", MK.ITERATION, "layer", "sigma_rms"])


def final_sigma(run_dir: str | Path) -> torch.Tensor | None:
    """The run's per-channel sigma ``[L, C]`` after its last update, or ``None`` (a method
    without statistics, or no checkpoint)."""
    run = project_path(run_dir)
    cfg = config_from_dict(read_json(run / "config.json")["config"])
    state = final_method_state(run)
    if state is None or "S_bar" not in state:
        return None
    method = make_method(cfg.method, tuple(state["S_bar"].shape), cfg.seed)
    method.load_state_dict(state)
    return method.sigma()


def sigma_fisher(plan: X.Plan, runs: Mapping[tuple[str, int], Path], run_dirs: Sequence[str | Path], *,
                 cache_dir: str | Path, progress: bool = True) -> pd.DataFrame:
    """Per SPrPO run and layer: Spearman's rank correlation of its final sigma with the
    Fisher importance of its own final policy (warm start + RL adapter, merged) on the
    plan's calibration pool; layer ``-1`` is all channels together.  The Fisher scores
    are the evaluation's (cached in ``<cache_dir>/fisher/``, reused by structured pruning)."""
    cache_dir = project_path(cache_dir)
    calib_path = X.calibration_pool(plan, runs, cache_dir, progress)
    calib = load_calibration(calib_path)
    out = []
    for d in map(project_path, run_dirs):
        sigma = final_sigma(d)
        if sigma is None:
            continue
        cfg = X.eval_config(plan, d, cache_dir)
        source = ModelSource(cfg, cache_dir / "file_hashes.json")
        fisher = fisher_scores_cached(source.policy(), calib, cache_dir, source.identity(), cfg.perturbation_options,
                                      progress)
        seed = cfg.tags.get("train_seed")
        for layer in range(sigma.shape[0]):
            out.append({"run": d.name, "seed": seed, "layer": layer,
                        "spearman": rank_correlation(sigma[layer], fisher[layer])})
        out.append({"run": d.name, "seed": seed, "layer": -1, "spearman": rank_correlation(sigma, fisher)})
    return pd.DataFrame(out, columns=["run", "seed", "layer", "spearman"])


def plot_sigma(layers: pd.DataFrame, corr: pd.DataFrame, path: str | Path, *, title: str = "") -> list[Path]:
    """One heatmap per SPrPO run (layer x iteration, RMS sigma of the layer, one colour
    scale), then Spearman(sigma, Fisher) per layer for every run (bars; the dashed line
    is the all-channel correlation)."""
    plt = pyplot()
    runs = list(dict.fromkeys(layers["run"]))
    n = len(runs) + (1 if len(corr) else 0)
    fig, axes = plt.subplots(1, max(1, n), figsize=(3.6 * max(1, n), 3.4), squeeze=False)
    vmax = float(layers["sigma_rms"].max()) if len(layers) else 1.0
    im = None
    for ax, run in zip(axes[0], runs):
        g = layers[layers["run"] == run].pivot_table(index="layer", columns=MK.ITERATION, values="sigma_rms")
        im = ax.imshow(g.to_numpy(), aspect="auto", origin="lower", cmap="magma", vmin=0, vmax=vmax,
                       extent=(g.columns.min() - 0.5, g.columns.max() + 0.5, -0.5, len(g) - 0.5))
        ax.set(xlabel="iteration", ylabel="layer", title=f"RMS sigma per layer\n{run}")
        ax.title.set_fontsize(8)
        ax.grid(False)  # the theme's grid would draw over the cells
    if im is not None:
        fig.colorbar(im, ax=axes[0][len(runs) - 1], label="RMS sigma")
    if len(corr):
        ax = axes[0][-1]
        per = corr[corr["layer"] >= 0]
        names = list(dict.fromkeys(per["run"]))
        w = 0.8 / max(1, len(names))
        for i, run in enumerate(names):  # every run is SPrPO's: its colour, one shade per run (paper.style)
            part = per[per["run"] == run]
            shade = 1.0 - 0.6 * i / max(1, len(names) - 1)
            ax.bar(part["layer"] + (i - (len(names) - 1) / 2) * w, part["spearman"], w, label=run,
                   color=METHOD_COLORS["sprpo"], alpha=shade)
            overall = corr[(corr["run"] == run) & (corr["layer"] == -1)]["spearman"]
            if len(overall):
                ax.axhline(float(overall.iloc[0]), ls="--", lw=1, color=METHOD_COLORS["sprpo"], alpha=shade,
                           gid=f"reference:all-channel correlation of {run}")
        ax.axhline(0, color="k", lw=0.6, gid="reference:zero")
        ax.set(xlabel="layer", ylabel="Spearman(sigma, Fisher importance)", ylim=(-1, 1),
               title="channels protected vs. Fisher importance\n(negative: important channels get less noise)")
        ax.title.set_fontsize(8)
        ax.legend(fontsize=6)
        ax.grid(axis="y", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)

