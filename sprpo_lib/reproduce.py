"""Regenerate every figure and table: run the numbered notebooks headlessly (papermill).

    python -m sprpo_lib.reproduce --profile smoke   # tiny random model, a minute; CI
    python -m sprpo_lib.reproduce --profile cpu     # embedded SmolLM2 + offline envs, figures/
    python -m sprpo_lib.reproduce --profile paper   # Qwen2.5-1.5B-Instruct (local copy), GPU

Each notebook has exactly one ``parameters`` cell; a profile is a set of parameter
overrides per notebook.  Executed notebooks land in ``runs/<profile>/notebooks/``; the
``cpu`` and ``paper`` profiles write figures and tables (with manifests) to
``figures/``, ``smoke`` to ``runs/smoke/figures/`` so tests never touch the committed
figures.  A notebook already executed with the same parameters at the same commit is
skipped (``--force`` reruns it), so a killed reproduction resumes where it stopped;
training runs and evaluation cells are cached too (``runs/<profile>/train/``,
``runs/<profile>/eval_cache/``), so a rerun computes only what is missing.
``--render-only`` redraws every figure and table from the cached results.  The run
ends with a summary (each notebook, its time, the files it wrote) and, for the ``cpu``
and ``paper`` profiles, copies the headline numbers into the README's generated block.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .manifest import atomic_write_json, git_commit

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

#: Notebooks of the robustness experiments (plans in :data:`sprpo_lib.experiments.PLANS`).
RESULT_NOTEBOOKS = ("03_motivation", "04_robustness", "05_landscape", "06_overhead", "07_examples")

PROFILES: dict[str, dict] = {
    "smoke": {
        "out_dir": "runs/smoke/figures",
        "notebooks": {
            "00_quickstart": {"model": "tiny-qwen2", "n_calib": 4, "max_new_tokens": 6},
            "01_training": {"profile": "smoke", "env": "webshop", "methods": ["vanilla", "sprpo"], "seeds": [0]},
            "02_theory": {"preset": "smoke"},
            **{nb: {"profile": "smoke", "envs": ["webshop"]} for nb in RESULT_NOTEBOOKS},
        },
    },
    "cpu": {
        "out_dir": "figures",
        "notebooks": {
            "00_quickstart": {"model": "smollm2-135m", "n_calib": 32, "max_new_tokens": 24},
            "01_training": {"profile": "cpu", "env": "webshop", "methods": ["vanilla", "sprpo", "gaussian", "sam"],
                            "seeds": {"vanilla": [0, 1], "sprpo": [0, 1], "gaussian": [0], "sam": [0]}},
            "02_theory": {"preset": "cpu"},
            **{nb: {"profile": "cpu", "envs": ["webshop"]} for nb in RESULT_NOTEBOOKS},
        },
    },
    "paper": {
        "out_dir": "figures/paper",
        "notebooks": {
            "00_quickstart": {"model": "Qwen/Qwen2.5-1.5B-Instruct", "n_calib": 128, "max_new_tokens": 32},
            "01_training": {"profile": "paper", "env": "alfworld", "methods": ["vanilla", "gaussian", "sam", "sprpo"],
                            "seeds": [0, 1, 2]},
            "02_theory": {"preset": "paper"},
            **{nb: {"profile": "paper", "envs": ["alfworld", "webshop"]} for nb in RESULT_NOTEBOOKS},
        },
    },
}


def plan(profile: str, only: list[str] | None = None, model: str | None = None,
         out_dir: str | None = None) -> list[tuple[Path, dict]]:
    """The (notebook, parameters) pairs a profile runs, in numbered order."""
    if profile not in PROFILES:
        raise SystemExit(f"unknown profile {profile!r}; expected one of {sorted(PROFILES)}")
    prof = PROFILES[profile]
    jobs = []
    for name in sorted(prof["notebooks"]):
        if only and not any(name.startswith(o) for o in only):
            continue
        path = NOTEBOOKS / f"{name}.ipynb"
        if not path.is_file():
            raise SystemExit(f"profile {profile!r} lists {path}, which does not exist")
        params = {"out_dir": str(out_dir or prof["out_dir"]), **prof["notebooks"][name]}
        if model and "model" in params:
            params["model"] = model
        if model and "profile" in params:  # training notebooks take the model as a config override
            params["overrides"] = list(params.get("overrides", [])) + [f"model.spec={model}"]
        jobs.append((path, params))
    if not jobs:
        raise SystemExit(f"no notebook of profile {profile!r} matches --only {only}")
    return jobs


def notebook_parameters(path: Path) -> set[str]:
    """Names defined in a notebook's ``parameters`` cell."""
    import papermill as pm

    return set(pm.inspect_notebook(str(path)))


def _artifacts(out_dir: Path, since: float) -> list[str]:
    """Files in ``out_dir`` whose manifest was written at or after ``since``."""
    if not out_dir.is_dir():
        return []
    return sorted(str(m.with_name(m.name[: -len(".manifest.json")]))
                  for m in out_dir.glob("*.manifest.json") if m.stat().st_mtime >= since - 1)


def run(profile: str, only: list[str] | None = None, force: bool = False, model: str | None = None,
        runs_dir: Path | None = None, out_dir: str | None = None, render_only: bool = False) -> list[dict]:
    """Execute the profile's notebooks; returns one status record per notebook (with the
    figures and tables it wrote).  ``render_only`` redraws from the cached results:
    notebooks with a ``render_only`` parameter run with it set, the others (which
    compute in the notebook) are skipped and say so."""
    import papermill as pm

    runs_dir = Path(runs_dir or ROOT / "runs") / profile
    commit = git_commit()
    records = []
    jobs = plan(profile, only, model, out_dir)
    t_all = time.time()
    for i, (path, params) in enumerate(jobs, 1):
        names = notebook_parameters(path)
        if "runs_root" in names:  # training runs of this profile: runs/<profile>/train/
            params = {**params, "runs_root": str(runs_dir / "train")}
        if "cache_dir" in names:  # evaluation cells of this profile
            params = {**params, "cache_dir": str(runs_dir / "eval_cache")}
        head = f"[reproduce] ({i}/{len(jobs)}, {time.time() - t_all:.0f} s so far) {path.stem}"
        if render_only:
            if "render_only" not in names:
                print(f"{head}: computes in the notebook, not re-rendered (run without --render-only)")
                records.append({"notebook": path.stem, "status": "not rendered", "artifacts": []})
                continue
            params = {**params, "render_only": True}
        out_nb = runs_dir / "notebooks" / path.name
        stamp = runs_dir / "stamps" / f"{path.stem}.json"
        key = {"parameters": params, "commit": commit}
        if not (force or render_only) and stamp.is_file() and out_nb.is_file() and "+dirty" not in commit:
            old = json.loads(stamp.read_text())
            if old.get("key") == key:
                print(f"{head}: up to date (commit {commit[:10]}), skipped")
                records.append({"notebook": path.stem, "status": "skipped", "artifacts": old.get("artifacts", [])})
                continue
        print(f"{head} with {params}", flush=True)
        out_nb.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        pm.execute_notebook(
            str(path), str(out_nb), parameters=params, cwd=str(ROOT), kernel_name="python3", progress_bar=True
        )
        rec = {"notebook": path.stem, "status": "rendered" if render_only else "ok",
               "seconds": round(time.time() - t0, 1),
               "artifacts": _artifacts(ROOT / params["out_dir"] if not Path(params["out_dir"]).is_absolute()
                                       else Path(params["out_dir"]), t0)}
        if not render_only:
            atomic_write_json(stamp, {"key": key, **rec})
        records.append(rec)
    return records


def update_readme(profile: str, out_dir: str, readme: Path = ROOT / "README.md") -> bool:
    """Copy ``<out_dir>/headline_<profile>.md`` into the README's generated block
    ``headline-<profile>`` (no number in the README is typed by hand)."""
    from .results import replace_block

    src = (ROOT / out_dir / f"headline_{profile}.md") if not Path(out_dir).is_absolute() else \
        Path(out_dir) / f"headline_{profile}.md"
    if not src.is_file() or not readme.is_file() or f"<!-- headline-{profile}:begin -->" not in readme.read_text():
        return False
    from .manifest import atomic_write_text

    body = f"<!-- generated from {src.relative_to(ROOT) if src.is_relative_to(ROOT) else src}; do not edit -->\n" \
        + src.read_text()
    atomic_write_text(readme, replace_block(readme.read_text(), f"headline-{profile}", body))
    return True


def print_summary(profile: str, records: list[dict], seconds: float) -> None:
    """Each notebook, its status and time, and the figures and tables it wrote."""
    print(f"\n[reproduce] profile {profile}: {len(records)} notebook(s) in {seconds:.0f} s")
    for r in records:
        print(f"  {r['notebook']:<16} {r['status']:<13} {str(r.get('seconds', '')):>8} s")
        for a in r.get("artifacts", []):
            print(f"      {Path(a).relative_to(ROOT) if Path(a).is_relative_to(ROOT) else a}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sprpo_lib.reproduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. --only 00 03")
    ap.add_argument("--force", action="store_true", help="rerun notebooks that are up to date")
    ap.add_argument("--render-only", action="store_true",
                    help="redraw figures and tables from the cached results (no training, no evaluation)")
    ap.add_argument("--model", help="override the policy model (a local HF directory or hub id)")
    ap.add_argument("--runs-dir", type=Path, help="where executed notebooks go (default: runs/)")
    args = ap.parse_args(argv)
    t0 = time.time()
    records = run(args.profile, args.only, args.force, args.model, args.runs_dir, render_only=args.render_only)
    print_summary(args.profile, records, time.time() - t0)
    out_dir = PROFILES[args.profile]["out_dir"]
    atomic_write_json(Path(args.runs_dir or ROOT / "runs") / args.profile / "reproduce_summary.json",
                      {"profile": args.profile, "commit": git_commit(), "seconds": round(time.time() - t0, 1),
                       "render_only": args.render_only, "notebooks": records})
    if args.profile != "smoke" and update_readme(args.profile, out_dir):
        print(f"[reproduce] README.md: headline numbers of the {args.profile} profile updated from "
              f"{out_dir}/headline_{args.profile}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
