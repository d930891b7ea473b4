"""Regenerate every figure and table: run the numbered notebooks headlessly (papermill).

    python -m sprpo_lib.reproduce --profile smoke   # tiny random model, a minute; CI
    python -m sprpo_lib.reproduce --profile cpu     # embedded SmolLM2 + offline envs, figures/
    python -m sprpo_lib.reproduce --profile paper   # Qwen2.5-1.5B-Instruct (local copy), GPU

Each notebook has exactly one ``parameters`` cell; a profile is a set of parameter
overrides per notebook.  Executed notebooks land in ``runs/<profile>/notebooks/``; the
``cpu`` and ``paper`` profiles write figures and tables (with manifests) to
``figures/``, ``smoke`` to ``runs/smoke/figures/`` so tests never touch the committed
figures.  A notebook already executed with the same parameters at the same commit is
skipped (``--force`` reruns it), so a killed reproduction resumes where it stopped.
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

PROFILES: dict[str, dict] = {
    "smoke": {
        "out_dir": "runs/smoke/figures",
        "notebooks": {
            "00_quickstart": {"model": "tiny-qwen2", "n_calib": 4, "max_new_tokens": 6},
            "01_training": {"profile": "smoke", "env": "webshop", "methods": ["vanilla", "sprpo"], "seeds": [0]},
            "02_theory": {"preset": "smoke"},
        },
    },
    "cpu": {
        "out_dir": "figures",
        "notebooks": {
            "00_quickstart": {"model": "smollm2-135m", "n_calib": 32, "max_new_tokens": 24},
            "01_training": {"profile": "cpu", "env": "webshop", "methods": ["vanilla", "sprpo", "gaussian", "sam"],
                            "seeds": {"vanilla": [0, 1], "sprpo": [0, 1], "gaussian": [0], "sam": [0]}},
            "02_theory": {"preset": "cpu"},
        },
    },
    "paper": {
        "out_dir": "figures/paper",
        "notebooks": {
            "00_quickstart": {"model": "Qwen/Qwen2.5-1.5B-Instruct", "n_calib": 128, "max_new_tokens": 32},
            "01_training": {"profile": "paper", "env": "alfworld", "methods": ["vanilla", "gaussian", "sam", "sprpo"],
                            "seeds": [0, 1, 2]},
            "02_theory": {"preset": "paper"},
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


def run(profile: str, only: list[str] | None = None, force: bool = False, model: str | None = None,
        runs_dir: Path | None = None, out_dir: str | None = None) -> list[dict]:
    """Execute the profile's notebooks; returns one status record per notebook."""
    import papermill as pm

    runs_dir = Path(runs_dir or ROOT / "runs") / profile
    commit = git_commit()
    records = []
    for path, params in plan(profile, only, model, out_dir):
        if "runs_root" in params or "profile" in params:  # training runs of this profile: runs/<profile>/train/
            params = {**params, "runs_root": str(runs_dir / "train")}
        out_nb = runs_dir / "notebooks" / path.name
        stamp = runs_dir / "stamps" / f"{path.stem}.json"
        key = {"parameters": params, "commit": commit}
        if not force and stamp.is_file() and out_nb.is_file() and "+dirty" not in commit:
            if json.loads(stamp.read_text()).get("key") == key:
                print(f"[reproduce] {path.stem}: up to date (commit {commit[:10]}), skipped")
                records.append({"notebook": path.stem, "status": "skipped"})
                continue
        print(f"[reproduce] {path.stem} with {params}")
        out_nb.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        pm.execute_notebook(
            str(path), str(out_nb), parameters=params, cwd=str(ROOT), kernel_name="python3", progress_bar=True
        )
        rec = {"notebook": path.stem, "status": "ok", "seconds": round(time.time() - t0, 1)}
        atomic_write_json(stamp, {"key": key, **rec})
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sprpo_lib.reproduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. --only 00 03")
    ap.add_argument("--force", action="store_true", help="rerun notebooks that are up to date")
    ap.add_argument("--model", help="override the policy model (a local HF directory or hub id)")
    ap.add_argument("--runs-dir", type=Path, help="where executed notebooks go (default: runs/)")
    args = ap.parse_args(argv)
    t0 = time.time()
    records = run(args.profile, args.only, args.force, args.model, args.runs_dir)
    for r in records:
        print(f"  {r['notebook']:<24} {r['status']:<8} {r.get('seconds', '')}")
    print(f"[reproduce] profile {args.profile}: {len(records)} notebook(s) in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
