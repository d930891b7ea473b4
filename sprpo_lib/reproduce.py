"""Regenerate every figure and table: run the numbered notebooks headlessly (papermill).

    sprpo-reproduce --profile smoke   # tiny random model, minutes; CI
    sprpo-reproduce --profile cpu     # embedded SmolLM2 + offline envs, figures/
    sprpo-reproduce --profile paper   # Qwen2.5-1.5B-Instruct (local copy), GPU

(``python -m sprpo_lib.reproduce`` is the same command.)  Each notebook runs with its own
folder as the working directory, as JupyterLab runs it; every path it writes is resolved
against the project root (:mod:`sprpo_lib.infra.paths`).  Long cells stream their progress to
this terminal: training iterations with their seconds and an ETA, evaluation cells done /
total (:mod:`sprpo_lib.infra.progress`).

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
import atexit
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Mapping

import pandas as pd

from sprpo_lib.core import metrics as MK
from sprpo_lib.infra.executor import EXECUTORS, executor_environment, make_executor
from sprpo_lib.infra.io import CorruptFileError, JsonLines, atomic_write_json, atomic_write_text, read_cached
from sprpo_lib.infra.manifest import check_artifact, git_commit, not_applicable, write_manifest
from sprpo_lib.infra.paths import (
    ProjectRootError,
    notebooks_dir,
    package_checkout,
    project_path,
    project_relative,
    project_root,
)
from sprpo_lib.infra.paths import runs_dir as project_runs
from sprpo_lib.infra.progress import PROGRESS_ENV
from sprpo_lib.paper import budget
from sprpo_lib.paper.claims import overview, overview_markdown, verdict_sentence
from sprpo_lib.paper.results import doc_pages, replace_block, without_paired
from sprpo_lib.train.config import config_from_dict
from sprpo_lib.warmstart.cache import warm_start_dir

#: Notebooks of the robustness experiments (plans in :data:`sprpo_lib.paper.experiments.PLANS`).
RESULT_NOTEBOOKS = ("03_motivation", "04_robustness", "05_landscape", "06_overhead", "07_examples", "08_ablations",
                    "09_divergence")

#: What each notebook reproduces and what it writes (README "What reproduces what" is generated
#: from this table).
NOTEBOOK_INFO: dict[str, tuple[str, str]] = {
    "00_quickstart": ("the five deployment perturbations of App. C on one prompt",
                      "`00_quickstart_perturbations.png/.csv`"),
    "01_training": ("training curves; warm start vs. RL, also after longer RL; App. B Tables 2-3 beside the profiles",
                    "`01_training_<env>.png`, `_metrics.csv`, `_summary.csv`, `_heldout.csv`, `_longer.png/.pdf/.csv`, "
                    "`_sigma.png/.pdf`, `_sigma_fisher.csv`, `_sigma_health.csv`, `01_training_hparams_*.csv/.tex/.md`"),
    "02_theory": ("Lemma 1, Theorem 1, Corollary 1, Theorem 2 checked on exact MDPs; Fig. 2",
                  "`02_theory_*.png/.pdf/.csv`, `02_theory_summary.tex`"),
    "03_motivation": ("Fig. 1; claim C1 with paired intervals",
                      "`03_motivation_<env>.png/.pdf`, `_summary.csv`, `_c1.csv`, `_rows.csv`"),
    "04_robustness": ("Fig. 3, Table 1, appendix overall and ID/OOD tables, paired comparisons",
                      "`04_robustness_<env>_curves.png/.pdf/.csv`, `_table1.tex/.csv`, `_appendix.tex/.csv`, "
                      "`_appendix_id_ood.tex/.csv`, `_paired.csv`, `_summary.csv`, `_rows.csv`, both environments in "
                      "`04_robustness_curves.png/.pdf/.csv` and `04_robustness_table1.tex/.csv`, "
                      "`headline_<profile>.json/.md`, `04_robustness_readme.png/.pdf` (the README's figure)"),
    "05_landscape": ("Fig. 4 (reward landscape)", "`05_landscape_<env>.png/.pdf`, `_grid.csv`, `_rows.csv`"),
    "06_overhead": ("appendix table \"Training overhead\"", "`06_overhead_<env>.tex/.csv`"),
    "07_examples": ("appendix \"Qualitative examples\"", "`07_examples_<env>.md/.csv`"),
    "08_ablations": ("Fig. 5, appendix tables \"Component ablations\" and \"Hyperparameter study\" (WebShop); "
                     "every claim's verdict and the power analysis",
                     "`08_ablations_<env>_fig5.png/.pdf`, `_components.tex/.csv`, `_hyperparameters.tex/.csv`, "
                     "`_noise_rules.csv`, `_paired.csv`, `_summary.csv`, `_rows.csv`, `claims_<profile>.md/.csv`, "
                     "`claims_power_<profile>.md/.csv`, `claims_design_<profile>.csv`"),
    "09_divergence": ("Fig. 3 and Fig. 4 in the policy's own terms: KL under each perturbation per agent state; claims "
                      "C2-KL, T1-KL, C4-KL, RL-KL (also in `claims_<profile>.md/.csv`), with Holm's correction over an "
                      "environment's comparisons; whether KL tracks success (also in the claims files); "
                      "the pass as a pilot: the design that detects 10% of a baseline's KL, what each design "
                      "detects where none does, and per comparison the states or training seeds that 10% would need",
                      "`09_divergence_<env>_curves.png/.pdf`, `_surface.png/.pdf`, `_summary.csv`, `_claims.csv/.md`, "
                      "`_power.csv`, `_design.csv`, `_frontier.csv`, `_correlation.json`, `_rows.csv`"),
}


PROFILES: dict[str, dict] = {
    "smoke": {
        "out_dir": "runs/smoke/figures",
        # Ray requests per task (sprpo_lib.infra.executor.Resources): two tiny-model tasks at once on 2 cores
        "resources": {"run_cpus": 1, "cell_cpus": 1},
        "notebooks": {
            "00_quickstart": {"model": "tiny-qwen2", "n_calib": 4, "max_new_tokens": 6},
            "01_training": {"profile": "smoke", "envs": ["webshop", "alfworld"], "methods": ["vanilla", "sprpo"]},
            "02_theory": {"preset": "smoke"},
            **{nb: {"profile": "smoke", "envs": ["alfworld", "webshop"]} for nb in RESULT_NOTEBOOKS},
            "08_ablations": {"profile": "smoke", "envs": ["webshop"]},
        },
    },
    "cpu": {
        "out_dir": "figures",
        # each run and cell uses 2 torch threads (threads: 2 in cpu.yaml): one task per 2 cores
        "resources": {"run_cpus": 2, "cell_cpus": 2},
        "notebooks": {
            "00_quickstart": {"model": "smollm2-135m", "n_calib": 32, "max_new_tokens": 24},
            "01_training": {"profile": "cpu", "envs": ["webshop", "alfworld"]},  # the plan's methods and seeds
            "02_theory": {"preset": "cpu"},
            **{nb: {"profile": "cpu", "envs": ["alfworld", "webshop"]} for nb in RESULT_NOTEBOOKS},
            "08_ablations": {"profile": "cpu", "envs": ["webshop"]},
        },
    },
    "paper": {
        "out_dir": "figures/paper",
        # one GPU per training run (the trainer is one process on one device); two evaluation
        # cells share a GPU (Qwen2.5-1.5B in bf16 is ~3 GB of weights plus its KV cache)
        "resources": {"run_cpus": 8, "run_gpus": 1, "cell_cpus": 4, "cell_gpus": 0.5},
        "notebooks": {
            "00_quickstart": {"model": "Qwen/Qwen2.5-1.5B-Instruct", "n_calib": 128, "max_new_tokens": 32},
            "01_training": {"profile": "paper", "envs": ["alfworld", "webshop"]},
            "02_theory": {"preset": "paper"},
            **{nb: {"profile": "paper", "envs": ["alfworld", "webshop"]} for nb in RESULT_NOTEBOOKS},
            "08_ablations": {"profile": "paper", "envs": ["webshop"]},
        },
    },
}


def plan(profile: str, only: list[str] | None = None, model: str | None = None,
         out_dir: str | None = None, envs: list[str] | None = None,
         overrides: list[str] | None = None) -> list[tuple[Path, dict]]:
    """The (notebook, parameters) pairs a profile runs, in numbered order.  ``envs``
    keeps only those of a notebook's environments (a stage of a reproduction: the
    other environment's runs and cells are not needed yet); a notebook left with none
    is not run.  ``overrides`` (``section.key=value``, as ``sprpo-train`` takes them, e.g.
    ``rollout.engine=vllm``) reach every notebook that trains or evaluates policies."""
    if profile not in PROFILES:
        raise SystemExit(f"unknown profile {profile!r}; expected one of {sorted(PROFILES)}")
    prof = PROFILES[profile]
    jobs = []
    for name in sorted(prof["notebooks"]):
        if only and not any(name.startswith(o) for o in only):
            continue
        path = notebooks_dir() / f"{name}.ipynb"
        if not path.is_file():
            raise SystemExit(f"profile {profile!r} lists {path}, which does not exist")
        params = {"out_dir": str(out_dir or prof["out_dir"]), **prof["notebooks"][name]}
        if envs and "envs" in params:
            params["envs"] = [e for e in params["envs"] if e in envs]
            if not params["envs"]:
                continue
        if model and "model" in params:
            params["model"] = model
        extra = [*([f"model.spec={model}"] if model else []), *(overrides or [])]
        if extra and "profile" in params:  # training notebooks take the model as a config override
            params["overrides"] = list(params.get("overrides", [])) + extra
        jobs.append((path, params))
    if not jobs:
        raise SystemExit(f"no notebook of profile {profile!r} matches --only {only}"
                         + (f" and --envs {envs}" if envs else "")
                         + f"; its notebooks: {', '.join(sorted(prof['notebooks']))} (a number such as 04 or a "
                           "whole name)")
    return jobs


def notebook_parameters(path: Path) -> set[str]:
    """Names defined in a notebook's ``parameters`` cell."""
    import papermill as pm  # heavy (Jupyter machinery): loaded on use

    return set(pm.inspect_notebook(str(path)))


def _artifacts(out_dir: Path, since: float) -> list[str]:
    """Files in ``out_dir`` whose manifest was written at or after ``since``."""
    if not out_dir.is_dir():
        return []
    return sorted(str(m.with_name(m.name[: -len(".manifest.json")]))
                  for m in out_dir.glob("*.manifest.json") if m.stat().st_mtime >= since - 1)


def kernel_environment(stream: bool, executor: dict[str, str] | None = None) -> dict[str, str]:
    """What the notebook kernels inherit: this checkout importable (also without ``pip
    install -e .``), when streaming, progress bars as text lines, and the executor
    (:func:`sprpo_lib.infra.executor.executor_environment`)."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(package_checkout()), os.environ.get("PYTHONPATH")) if p)}
    if stream:
        env[PROGRESS_ENV] = "lines"
    return {**env, **(executor or {})}


def start_executor(profile: str, executor: str, address: str | None) -> dict[str, str]:
    """The executor's variables for the kernels.  ``ray`` without an address starts one
    local Ray instance here, which every notebook's kernel joins (shut down at exit)."""
    if executor == "ray" and not address:
        ray = make_executor("ray", None, PROFILES[profile].get("resources")).connect()
        address = ray.get_runtime_context().gcs_address
        atexit.register(ray.shutdown)
        print(f"[reproduce] local Ray instance at {address} ({int(ray.cluster_resources().get('CPU', 0))} CPUs, "
              f"{int(ray.cluster_resources().get('GPU', 0))} GPUs)", flush=True)
    return executor_environment(executor, address, PROFILES[profile].get("resources"))


def run(profile: str, only: list[str] | None = None, force: bool = False, model: str | None = None,
        runs_dir: Path | None = None, out_dir: str | None = None, render_only: bool = False,
        stream: bool = False, executor: str = "local", address: str | None = None,
        envs: list[str] | None = None, overrides: list[str] | None = None) -> list[dict]:
    """Execute the profile's notebooks, each in its own folder; returns one status record
    per notebook (with the figures and tables it wrote).  ``render_only`` redraws from the
    cached results: notebooks with a ``render_only`` parameter run with it set, the others
    (which compute in the notebook) are skipped and say so.  ``stream``: the kernels'
    output (progress bars as lines) goes to this process's stdout/stderr as it comes.
    ``executor``/``address``: where training runs and evaluation cells execute
    (:mod:`sprpo_lib.infra.executor`); the outputs are the same either way.  ``envs``: only
    these environments (:func:`plan`)."""
    import papermill as pm  # heavy (Jupyter machinery): loaded on use

    runs_dir = (project_path(runs_dir) if runs_dir else project_runs()) / profile
    commit = git_commit()
    records = []
    jobs = plan(profile, only, model, out_dir, envs, overrides)
    exec_env = start_executor(profile, executor, address)
    t_all = time.time()
    for i, (path, params) in enumerate(jobs, 1):
        names = notebook_parameters(path)
        if "runs_root" in names:  # training runs of this profile: runs/<profile>/train/
            params = {**params, "runs_root": project_relative(runs_dir / "train")}
        if "cache_dir" in names:  # evaluation cells of this profile (relative: the same stamp in every clone)
            params = {**params, "cache_dir": project_relative(runs_dir / "eval_cache")}
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
            old = read_cached(stamp)
            old = old if isinstance(old, dict) else {}
            damaged = damaged_artifact(old.get("artifacts", []), old.get("sha256"))
            if old.get("key") == key and damaged:  # a figure, table or manifest changed since: computed again
                print(f"{head}: {damaged}; running it again")
            elif old.get("key") == key:
                print(f"{head}: up to date (commit {commit[:10]}), skipped")
                records.append({"notebook": path.stem, "status": "skipped", "artifacts": old.get("artifacts", [])})
                continue
        print(f"{head} with {params}", flush=True)
        out_nb.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        kernel_env = kernel_environment(stream, exec_env)
        saved = {k: os.environ.get(k) for k in (*kernel_env, PROGRESS_ENV)}
        os.environ.update(kernel_env)  # inherited by the kernel papermill starts
        try:
            pm.execute_notebook(str(path), str(out_nb), parameters=params, cwd=str(path.parent), kernel_name="python3",
                                progress_bar=not stream, log_output=stream,
                                stdout_file=sys.stdout if stream else None, stderr_file=sys.stderr if stream else None)
        except pm.PapermillExecutionError as err:
            if err.ename == "CorruptFileError":  # a damaged input the notebook read: one error naming it
                raise SystemExit(f"[reproduce] {path.stem}: {err.evalue}") from None
            if not (render_only and err.ename == "FileNotFoundError"):
                raise
            # rendering needs cached results that are not here (training runs are not committed): say so, go on
            print(f"{head}: not rendered: {err.evalue}")
            records.append({"notebook": path.stem, "status": "inputs missing", "artifacts": []})
            continue
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        rec = {"notebook": path.stem, "status": "rendered" if render_only else "ok",
               "seconds": round(time.time() - t0, 1),
               "artifacts": _artifacts(project_path(params["out_dir"]), t0)}
        if not render_only:
            atomic_write_json(stamp, {"key": key, **rec, "sha256": written_digests(rec["artifacts"])})
        records.append(rec)
    return records


def damaged_artifact(artifacts, written: Mapping[str, str] | None = None) -> str | None:
    """What is wrong with the first of a notebook's recorded artifacts that is missing, does
    not match its manifest (:func:`~sprpo_lib.infra.manifest.check_artifact`), or is not the
    file the stage wrote (``written``: path -> SHA-256, from the stage's stamp; a file and
    manifest restored from git agree with each other, not with the stamp), else None."""
    written = written or {}
    for a in artifacts:
        try:
            m = check_artifact(a)
        except (CorruptFileError, FileNotFoundError) as err:
            return str(err)
        if a in written and m.get("file", {}).get("sha256") != written[a]:
            return f"{Path(a).name}: not the file this stage wrote (replaced since, e.g. restored from git)"
    return None


def written_digests(artifacts) -> dict[str, str]:
    """Each artifact's SHA-256 as its manifest records it: what a stamp keeps for
    :func:`damaged_artifact`."""
    out = {}
    for a in artifacts:
        try:
            out[a] = check_artifact(a)["file"]["sha256"]
        except (CorruptFileError, FileNotFoundError, KeyError, TypeError):  # checked again, and run again, on resume
            continue
    return out


def notebooks_table() -> str:
    """Markdown: each notebook, what of the paper it reproduces, and what it writes."""
    lines = ["| notebook | reproduces | writes (to `figures/`, each with a `.manifest.json`) |", "|---|---|---|"]
    lines += [f"| `{nb}` | {paper} | {files} |" for nb, (paper, files) in NOTEBOOK_INFO.items()]
    return "\n".join(lines) + "\n"


#: The class of recorded seconds that name no machine (records from before they did).
UNNAMED = "unnamed"


def _run_seconds(run: Path, counted: set | None = None) -> Counter:
    """A training run's recorded compute per machine class (each iteration's ``machine``): the
    sum of its iterations' ``wall_s`` and held-out evaluations (``heldout_s``), leaving out the
    iterations in ``counted`` (a longer run's first iterations are its plan run's, copied) and
    adding the others to it."""
    counted = set() if counted is None else counted
    secs: Counter = Counter()
    for r in JsonLines(run / "metrics.jsonl").read_rows():
        if r.get(MK.ITERATION) in counted:
            continue
        counted.add(r.get(MK.ITERATION))
        secs[r.get(MK.MACHINE) or UNNAMED] += float(r.get(MK.WALL_S) or 0.0) + float(r.get(MK.HELDOUT_S) or 0.0)
    return secs


def _timed(record) -> Counter:
    """A record's ``seconds`` under its ``machine`` (a cell, a warm start's part)."""
    record = record if isinstance(record, dict) else {}
    return Counter({record.get("machine") or UNNAMED: float(record.get("seconds") or 0.0)})


def recorded_compute(profile: str, out_dir: str | Path | None = None,
                     runs_dir: Path | None = None) -> dict[str, Counter]:
    """Per notebook, the compute its outputs rest on as the work recorded it, whichever
    pass, session or machine did it, per machine class (:func:`~sprpo_lib.infra.hardware.compute_class`;
    :data:`UNNAMED` for records older than the class): 01 the plan's training runs (each
    iteration's ``wall_s``) and their warm starts (``sft_summary.json``: collection and cloning;
    ``eval.json``); 03-09 the seconds stored in every evaluation or divergence cell their
    ``*_rows.csv`` came from (a cell shared by several notebooks counts for the first) and 08's
    ablation training runs.  A staged reproduction's wall times cover its last pass only; these
    add up every pass."""
    out = project_path(out_dir or PROFILES[profile]["out_dir"])
    runs = (project_path(runs_dir) if runs_dir else project_runs()) / profile
    cell_seconds: dict[str, Counter] = {}
    cache = runs / "eval_cache"  # success cells, and divergence cells with their clean sides
    for f in [*(cache / "cells").glob("*/*.json"), *(cache / "divergence").glob("*.json")]:
        cell = read_cached(f)
        if isinstance(cell, dict) and isinstance(cell.get("seconds"), (int, float)):
            cell_seconds[f.stem[:12]] = Counter({cell.get("machine") or UNNAMED: float(cell["seconds"])
                                                 + float(cell.get("clean_seconds") or 0.0)})
    seen: set = set()  # cells (hash prefixes) and run folders already counted
    res: dict[str, Counter] = {}
    for nb in PROFILES[profile]["notebooks"]:
        secs: Counter = Counter()
        if nb == "01_training":
            warm: set[Path] = set()
            iterations: dict[str, set] = {}  # per run name: a longer run shares its plan run's first iterations
            for man in sorted(out.glob("01_training_*.png.manifest.json")):
                for r in ((read_cached(man) or {}).get("config") or {}).get("runs", []):
                    run = project_path(r)
                    if run in seen or not (run / "metrics.jsonl").is_file():
                        continue
                    seen.add(run)
                    secs.update(_run_seconds(run, iterations.setdefault(run.name, set())))
                    meta = read_cached(run / "config.json")
                    if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
                        cfg = config_from_dict(meta["config"])
                        if cfg.warm_start:
                            warm.add(warm_start_dir(cfg))
            for w in warm:  # collecting the demonstrations, cloning (with DAgger's rounds), the held-out score
                result = (read_cached(w / "sft_summary.json") or {}).get("result") or {}
                for part in (result, result.get("collect"), read_cached(w / "eval.json")):
                    secs.update(_timed(part))
        for rows in out.glob(f"{nb}_*rows.csv"):
            for cell in pd.read_csv(rows, usecols=["cell"])["cell"].dropna().astype(str).unique():
                if cell not in seen:
                    seen.add(cell)
                    secs.update(cell_seconds.get(cell, Counter()))
        if nb == "08_ablations":
            for m in (runs / "train" / "ablation").glob("*/*/metrics.jsonl"):
                secs.update(_run_seconds(m.parent))
        res[nb] = Counter({k: v for k, v in secs.items() if v})
    return res


def compute_text(seconds: Mapping[str, float]) -> str:
    """Recorded compute in minutes with the machine classes it was measured on: ``12.3 min (amx)``,
    ``20.0 min (amx 12.0, avx512_bf16 8.0)``; without a class where no record names one."""
    total = sum(seconds.values())
    if not total:
        return ""
    if set(seconds) == {UNNAMED}:
        return f"{total / 60:.1f} min"
    parts = sorted(seconds.items(), key=lambda kv: -kv[1])
    named = parts[0][0] if len(parts) == 1 else ", ".join(f"{k} {v / 60:.1f}" for k, v in parts)
    return f"{total / 60:.1f} min ({named})"


def parse_compute(text: str) -> Counter:
    """:func:`compute_text`'s text read back as seconds per machine class (the table a pass replaces)."""
    total, _, classes = text.partition(" min")
    parts = [p for p in classes.strip().strip("()").split(", ") if p]
    if len(parts) == 1 and not parts[0].rsplit(" ", 1)[-1].replace(".", "", 1).isdigit():  # one class: every minute
        return Counter({parts[0]: 60 * float(total)})
    if parts:
        return Counter({k: 60 * float(v) for k, v in (p.rsplit(" ", 1) for p in parts)})
    return Counter({UNNAMED: 60 * float(total)})


def stage_table(profile: str, out_dir: str | Path | None = None, runs_dir: Path | None = None,
                previous: str = "") -> str:
    """Markdown: each notebook's measured wall time, read from the manifests of the figures
    and tables it wrote (a render-only pass records no compute time), and the compute its
    outputs rest on as the runs and evaluation cells recorded it, with the machine classes
    that measured it (:func:`recorded_compute`: every pass of a staged reproduction, whichever
    session or machine did it).  Where this machine holds none of a notebook's runs or cells (a
    render-only pass elsewhere), the value of ``previous`` (the table this one replaces) is kept."""
    out = project_path(out_dir or PROFILES[profile]["out_dir"])
    recorded, kept = recorded_compute(profile, out_dir, runs_dir), {}
    for line in previous.splitlines():  # | `nb` | wall | 12.3 min (amx) | date | machine |
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) >= 3 and cols[0].startswith("`") and " min" in cols[2]:
            nb = cols[0].strip("`")
            if not recorded.get(nb):
                recorded[nb], kept[nb] = parse_compute(cols[2]), cols[2]
    lines = ["| notebook | wall time (last pass) | recorded compute | date | machine |", "|---|---|---|---|---|"]
    total, rec_total = 0.0, Counter()
    for nb in PROFILES[profile]["notebooks"]:
        paths = list(out.glob(f"{nb}_*.manifest.json")) + (list(out.glob(f"headline_{profile}.*.manifest.json"))
                                                           if nb == "04_robustness" else [])
        mans = [m for m in (read_cached(p) for p in paths) if isinstance(m, dict)]
        # a render-only pass carries the computing run's record along (paper.notebook.ResultsPage)
        computed = [m.get("computed") or m for m in mans
                    if m.get("computed") or not (m.get("config") or {}).get("render_only")]
        rec = recorded.get(nb, Counter())
        rec_total.update(rec)
        rec_text = kept.get(nb) or compute_text(rec)
        if not computed:
            lines.append(f"| `{nb}` | {'rendered only' if mans else 'not run'} | {rec_text} | | |")
            continue
        m = max(computed, key=lambda m: m.get("wall_seconds") or 0)
        secs = float(m.get("wall_seconds") or 0)
        total += secs
        host = m.get("host", {})
        machine = ", ".join(str(host[k]) for k in ("cpu_model", "cpu_class", "capability") if host.get(k))
        lines.append(f"| `{nb}` | {secs / 60:.1f} min | {rec_text} | {str(m.get('date', ''))[:10]} | {machine} |")
    lines.append(f"| all | {total / 60:.1f} min | {compute_text(rec_total) or '0.0 min'} | | |")
    return "\n".join(lines) + "\n"


def update_readme(profile: str, out_dir: str, readme: Path | None = None) -> bool:
    """Refresh the generated blocks of the README and the library's page (or of ``readme``
    alone) from ``out_dir``: the headline numbers
    (``headline-<profile>``, from ``headline_<profile>.md`` less its paired tables, which
    the README links), one sentence of what the claims' verdicts say (``verdict-<profile>``), the
    paper's claims against them (``claims-<profile>``: a grid per environment from ``claims_<profile>.csv``, which
    links the full ``.md``), the stage times
    (``stages-<profile>``, from the manifests), what the profiles run (``plans``, from the
    plans), the paper profile's cost (``paper-cost``) and the notebook table (``notebooks``).
    No number in either page is typed by hand.  True when a page changed."""
    root = project_root()
    pages = [(readme, "")] if readme else doc_pages(root)
    plans = atomic_write_text(project_path(out_dir) / budget.PLANS_FILE, budget.plans_markdown())  # full tables
    write_manifest(plans, {"profiles": ["cpu", "paper"], "source": "sprpo_lib.paper.budget.plans_markdown"}, None, 0.0,
                   {"dtype": not_applicable("plans, not a computation"), "seeds": not_applicable("each plan lists its own"),
                    "goals": not_applicable("each plan lists its own")})
    changed = False
    for page, prefix in pages:
        if page.is_file():
            changed |= refresh_page(page, prefix, profile, out_dir, root)
    return changed


def refresh_page(page: Path, prefix: str, profile: str, out_dir: str, root: Path) -> bool:
    """:func:`update_readme` on one page whose links are rebased by ``prefix``."""
    text = page.read_text()
    for block in ("headline", "claims"):  # written by notebooks 04 and 08
        src = project_path(out_dir) / f"{block}_{profile}.md"
        if src.is_file() and f"<!-- {block}-{profile}:begin -->" in text:
            where = src.relative_to(root) if src.is_relative_to(root) else src
            if block == "headline":
                body = without_paired(src.read_text())
            else:  # the full table stays in its file; the README has every claim's verdict
                body = overview_markdown(overview(pd.read_csv(src.with_suffix(".csv"))), profile=profile, full=str(where))
            text = replace_block(text, f"{block}-{profile}", f"<!-- generated from {where}; do not edit -->\n" + body,
                                 prefix=prefix)
    claims = project_path(out_dir) / f"claims_{profile}.csv"  # the first screen's sentence, from the verdicts
    if claims.is_file() and f"<!-- verdict-{profile}:begin -->" in text:
        where = claims.relative_to(root) if claims.is_relative_to(root) else claims
        text = replace_block(text, f"verdict-{profile}", f"<!-- generated from {where}; do not edit -->\n"
                             + verdict_sentence(pd.read_csv(claims), profile=profile), prefix=prefix)
    power = project_path(out_dir) / f"claims_power_{profile}.md"  # notebook 08: its summary paragraph
    if power.is_file() and f"<!-- power-{profile}:begin -->" in text:
        where = power.relative_to(root) if power.is_relative_to(root) else power
        summary = power.read_text().split("\n\n")[1].strip()
        text = replace_block(text, f"power-{profile}", f"<!-- generated from {where}; do not edit -->\n{summary} "
                             f"Every claim, its MDE and the goals a design would need: [{where}]({where}).",
                             prefix=prefix)
    if f"<!-- stages-{profile}:begin -->" in text:
        old = text.split(f"<!-- stages-{profile}:begin -->", 1)[1].split(f"<!-- stages-{profile}:end -->", 1)[0]
        text = replace_block(text, f"stages-{profile}", "<!-- generated from the manifests by sprpo-reproduce; "
                             "do not edit -->\n" + stage_table(profile, out_dir, previous=old), prefix=prefix)

    blocks = (("plans", budget.plans_summary, ()), ("paper-cost", budget.cost_summary, (project_path(out_dir),)))
    for block, make, args in blocks:  # the bench records read from the project's out_dir, whatever the cwd
        if f"<!-- {block}:begin -->" in text:
            text = replace_block(text, block, f"<!-- generated from sprpo_lib.paper.budget.{make.__name__}; "
                                 "do not edit -->\n" + make(*args), prefix=prefix)
    if "<!-- notebooks:begin -->" in text:
        text = replace_block(text, "notebooks", "<!-- generated from sprpo_lib.reproduce.NOTEBOOK_INFO; do not edit -->\n"
                             + notebooks_table(), prefix=prefix)
    if text == page.read_text():
        return False
    atomic_write_text(page, text)
    return True


def print_summary(profile: str, records: list[dict], seconds: float) -> None:
    """Each notebook, its status and time, and the figures and tables it wrote."""
    root = project_root()
    print(f"\n[reproduce] profile {profile}: {len(records)} notebook(s) in {seconds:.0f} s")
    for r in records:
        print(f"  {r['notebook']:<16} {r['status']:<13} {str(r.get('seconds', '')):>8} s")
        for a in r.get("artifacts", []):
            print(f"      {Path(a).relative_to(root) if Path(a).is_relative_to(root) else a}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sprpo-reproduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", choices=sorted(PROFILES))
    ap.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. --only 00 03")
    ap.add_argument("--envs", nargs="+", choices=("alfworld", "webshop"),
                    help="only these environments of the profile (a reproduction in stages: one environment's "
                         "training and evaluation now, the other's later; the caches keep both)")
    ap.add_argument("--force", action="store_true", help="rerun notebooks that are up to date")
    ap.add_argument("--render-only", action="store_true",
                    help="redraw figures and tables from the cached results (no training, no evaluation)")
    ap.add_argument("--model", help="override the policy model (a local HF directory or hub id)")
    ap.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                    help="training-config overrides for every plan, as sprpo-train takes them (e.g. rollout.engine=vllm)")
    ap.add_argument("--runs-dir", type=Path, help="where executed notebooks go (default: runs/ under the project root)")
    ap.add_argument("--quiet", action="store_true", help="papermill's cell bar only, no streamed progress")
    ap.add_argument("--executor", default="local", choices=EXECUTORS,
                    help="where training runs and evaluation cells execute: one after another here (local), or "
                         "as Ray tasks (ray) with the profile's resource requests")
    ap.add_argument("--address", help="a running Ray cluster for --executor ray (e.g. auto, or host:6379); default: "
                                      "start a local Ray instance")
    args = ap.parse_args(argv)
    if args.address and args.executor != "ray":
        ap.error("--address: only --executor ray connects to a cluster; add --executor ray or drop --address")
    try:
        project_root()  # a SPRPO_HOME that does not exist: one line, before anything runs
    except ProjectRootError as err:
        print(f"sprpo-reproduce: error: {err}", file=sys.stderr)
        return 2
    t0 = time.time()
    records = run(args.profile, args.only, args.force, args.model, args.runs_dir, render_only=args.render_only,
                  stream=not args.quiet, executor=args.executor, address=args.address, envs=args.envs,
                  overrides=args.override)
    print_summary(args.profile, records, time.time() - t0)
    out_dir = PROFILES[args.profile]["out_dir"]
    atomic_write_json((project_path(args.runs_dir) if args.runs_dir else project_runs()) / args.profile
                      / "reproduce_summary.json",
                      {"profile": args.profile, "commit": git_commit(), "seconds": round(time.time() - t0, 1),
                       "render_only": args.render_only, "notebooks": records})
    if args.profile != "smoke" and update_readme(args.profile, out_dir):
        print(f"[reproduce] README.md: generated blocks of the {args.profile} profile updated from {out_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
