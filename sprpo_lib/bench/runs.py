"""``sprpo-bench runs``: two sets of finished RL runs of one profile, environment and seed
(e.g. the update's speed levers off, ``speed.prefix_min=0 speed.reuse_frozen=false``, and
on), compared method by method: seconds per iteration and per phase, the update's seconds
per step row, and whether the two learned alike.

"Alike" is read off the runs themselves: the config keys that differ between the two (the
levers, nothing else), whether iteration 0 played the same rollout (same samples, tokens,
success and score: the same policy and seeds), iteration 0's update and extra pass
seconds when it did (the one batch both sides ran, so its ratio is free of the later
batches' differences), the per-iteration success and valid-action rates, and the held-out
evaluation of the final policies on the same tasks with the same
generation seed: a paired bootstrap over tasks of after minus before (percentage points,
its 95% interval and the smallest difference it detects with 80% power, MDE80), and the
tasks solved by one side only with the exact sign test.  The interval carries task
variance only (one training seed per side); a rounding change acts on training like a
seed change, so it is the test of "same success within noise" the design affords.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from sprpo_lib.infra.paths import project_relative
from sprpo_lib.paper.report import find_runs, heldout_rows, load_metrics
from sprpo_lib.paper.results import MDE80_Z, overhead, quiet_iterations
from sprpo_lib.paper.stats import paired_bootstrap
from sprpo_lib.train.config import config_from_dict

#: Metrics of iteration 0 that must agree when both sides played the same first rollout.
FIRST_ROLLOUT_KEYS = ("samples", "response_tokens", "success", "score", "episode_length")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_diff(before: Path, after: Path) -> dict[str, list]:
    """``{dotted key: [before, after]}`` for every config value the two runs' ``config.json``
    disagree on, defaults included (``out_dir`` aside: where a run lives is not how it ran)."""
    a, b = (_flat(asdict(config_from_dict(json.loads((d / "config.json").read_text())["config"])))
            for d in (before, after))
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k != "out_dir"}


def _phases(run: Path, m: pd.DataFrame) -> dict:
    """Mean seconds per iteration and the update's seconds per step row of ``run`` (metrics
    ``m``), both over the iterations that ran on an idle machine
    (:func:`paper.results.quiet_iterations`)."""
    o = overhead([run]).iloc[0]
    q = m[quiet_iterations(m)]  # the iterations overhead() averages
    info = json.loads((run / "config.json").read_text())
    return {"iterations": len(m), "quiet_iterations": int(o["steps"]), "iteration_s": round(float(o["total"]), 2),
            "rollout_s": round(float(o["rollout"]), 2), "update_s": round(float(o["update"] - o["sensitivity"]), 2),
            "extra_s": round(float(o["sensitivity"]), 2),
            "update_s_per_sample": round(float(q["update_s"].sum() / max(1, q["samples"].sum())), 4),
            "success": [round(float(v), 4) for v in m["success"]],
            "valid_rate": [round(float(v), 4) for v in m["valid_rate"]],
            "commit": info.get("commit"), "cpu_model": (info.get("dtype_probe") or {}).get("key", {}).get("cpu_model")}


def _first_batch(mb: pd.DataFrame, ma: pd.DataFrame) -> dict:
    """Iteration 0's update and extra-pass seconds before and after, and their ratios: the
    same rollout batch from the same policy on both sides."""
    out = {}
    for key, col in (("update", "update_s"), ("extra", "sensitivity_s")):
        b, a = (float(m[col].iloc[0]) if col in m else 0.0 for m in (mb, ma))
        out[f"{key}_s"] = [round(b, 2), round(a, 2)]
        out[f"{key}_ratio"] = round(a / b, 3) if b > 0 else None
    return out


def _heldout(before: Sequence[Path], after: Sequence[Path], unit: tuple[str, ...]) -> dict:
    """After minus before on the final policies' held-out episodes, paired by ``unit``."""
    frames = []
    for side, dirs in (("before", before), ("after", after)):
        rows = heldout_rows(dirs)
        rows = rows[rows["iteration"] == rows.groupby("method")["iteration"].transform("max")]
        frames.append(rows.rename(columns={"method": "policy"}).assign(method=side))
    rows = pd.concat(frames, ignore_index=True)
    b = paired_bootstrap(rows, "after", "before", "clean", 0.0, unit=unit, seeds=None)
    rate = rows.groupby("method")["success"].mean()
    return {"tasks": b["tasks"], "before": round(100 * float(rate["before"]), 2),
            "after": round(100 * float(rate["after"]), 2), "diff_pp": round(b["success"], 2),
            "ci_pp": [round(v, 2) for v in b["success_ci"]], "mde80_pp": round(MDE80_Z * b["success_se"], 2),
            "only_after": b["wins"], "only_before": b["losses"], "sign_p": round(b["sign_p"], 4)}


def bench_runs(profile: str, env: str, methods: Sequence[str], seed: int, before_root: str | Path,
               after_root: str | Path) -> dict:
    """The comparison of the module docstring for each method's run under ``before_root`` and
    ``after_root`` (``<root>/<env>-<method>-<profile>-seed<seed>``), pooled over methods for
    the held-out test.  A missing run is one error naming its folder."""
    seeds = {m: [seed] for m in methods}
    before = find_runs(profile, env, methods, seeds, (), before_root)
    after = find_runs(profile, env, methods, seeds, (), after_root)
    out: dict = {"profile": profile, "env": env, "seed": seed, "before_root": project_relative(before[0].parent),
                 "after_root": project_relative(after[0].parent), "methods": {}}
    diffs: dict[str, list] = {}
    for m, b, a in zip(methods, before, after):
        mb, ma = load_metrics([b]), load_metrics([a])
        pb, pa = _phases(b, mb), _phases(a, ma)
        first = {k: [mb[k].iloc[0], ma[k].iloc[0]] for k in FIRST_ROLLOUT_KEYS}
        same_first = all(math.isclose(float(x), float(y), rel_tol=1e-9) for x, y in first.values())
        for k, v in config_diff(b, a).items():
            diffs.setdefault(k, v)
        out["methods"][m] = {
            "before": pb, "after": pa,
            "iteration_ratio": round(pa["iteration_s"] / pb["iteration_s"], 3),
            "update_ratio": round(pa["update_s"] / pb["update_s"], 3),
            "extra_ratio": round(pa["extra_s"] / pb["extra_s"], 3) if pb["extra_s"] > 0 else None,
            "update_per_sample_ratio": round(pa["update_s_per_sample"] / pb["update_s_per_sample"], 3),
            "same_curves": pb["success"] == pa["success"] and pb["valid_rate"] == pa["valid_rate"],
            "first_rollout_same": same_first,
            "first_batch": _first_batch(mb, ma) if same_first else None,
            "success_mean": [round(sum(p["success"]) / len(p["success"]), 4) for p in (pb, pa)],
            "heldout": _heldout([b], [a], ("env", "split", "task_index")),
        }
    out["config_diff"] = diffs
    out["heldout_pooled"] = _heldout(before, after, ("env", "policy", "split", "task_index"))
    return out
