"""What a profile runs, counted from its plans (:data:`~sprpo_lib.paper.experiments.PLANS`,
:data:`~sprpo_lib.paper.ablations.ABLATIONS`) and training configs: RL runs and their
sizes, held-out tasks, settings, and the evaluation episodes they add up to.  The
README's table of the ``cpu`` profile against the ``paper`` profile is generated here,
so no size in it is typed by hand."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from sprpo_lib.agent.envs.alfworld_gen import DEFAULT_SIZES
from sprpo_lib.agent.envs.webshop import MAX_STEPS as WEBSHOP_MAX_STEPS
from sprpo_lib.agent.envs.webshop import N_TEST_GOALS
from sprpo_lib.core import metrics as MK
from sprpo_lib.evaluate import EVAL_SPLITS
from sprpo_lib.infra.manifest import manifest_path
from sprpo_lib.paper import ablations as A
from sprpo_lib.paper import experiments as X
from sprpo_lib.paper import power as P
from sprpo_lib.paper.results import setting_label
from sprpo_lib.paper.style import METHOD_DISPLAY
from sprpo_lib.paper.tables import ENV_LABELS
from sprpo_lib.train.config import load_config

__all__ = ["APP_C_TASKS", "PAPER_STEP_SECONDS", "split_tasks", "planned_episodes", "plan_table", "paper_cost_table",
           "paper_gpu_hours", "plans_markdown", "plans_summary", "cost_summary", "Rates", "DESIGN_METHODS",
           "design_plan", "design_seconds", "choose_design", "bench_episode_s", "training_rates", "bench_machine", "bench_rates", "design_table",
           "design_from_figures", "missing_landscape", "gpu_records", "record_engine", "projected_costs",
           "projected_markdown"]

#: App. C's held-out tasks per split (the ``paper`` plan evaluates all of them).
APP_C_TASKS: dict[str, dict[str, int]] = {
    "webshop": {"test": N_TEST_GOALS},
    "alfworld": {s: DEFAULT_SIZES[s] for s in EVAL_SPLITS["alfworld"]},
}


#: The paper's Table "Training overhead" (App. B): seconds per training step of Qwen2.5-1.5B-Instruct
#: on two NVIDIA RTX PRO 6000 Blackwell Max-Q GPUs, (rollout, update, total).
PAPER_STEP_SECONDS: dict[tuple[str, str], tuple[float, float, float]] = {
    ("alfworld", "vanilla"): (143.8, 198.2, 343.6), ("alfworld", "sprpo"): (171.5, 400.1, 572.9),
    ("webshop", "vanilla"): (50.1, 60.0, 110.6), ("webshop", "sprpo"): (58.2, 138.7, 197.4)}


def env_max_steps(env: str) -> int:
    """The environment's own step limit (App. B), where a profile keeps it."""
    if env == "alfworld":
        from sprpo_lib.agent.envs.alfworld import MAX_STEPS  # imported on use: ALFWorld pulls in TextWorld
        return MAX_STEPS
    return WEBSHOP_MAX_STEPS


def split_tasks(env: str, tasks: int | None) -> int:
    """Held-out episodes per evaluated point: the first ``tasks`` of every split (``None``: all)."""
    return sum(n if tasks is None else min(tasks, n) for n in APP_C_TASKS[env].values())


def planned_episodes(p: X.Plan) -> dict[str, int]:
    """Evaluation episodes of a plan: Table 1's points (clean and its settings, every
    policy and the warm start where the profile has one), the curves' other strengths,
    the landscape, and, where the profile has a study on this env, the ablation variants."""
    seeds = len(p.eval_seeds)
    warm = int(p.warm_start_row and load_config(p.profile, **{"env.name": p.env}).warm_start)
    table = 1 + len(p.table)
    extra = len(p.settings()) - table
    curve_policies = sum(1 for m, s in p.runs() if (p.curve_seeds is None or s in p.curve_seeds)
                         and (p.curve_methods is None or m in p.curve_methods)) + warm
    out = {"table": (len(p.runs()) + warm) * table * split_tasks(p.env, p.tasks) * seeds,
           "curves": curve_policies * extra * split_tasks(p.env, p.curve_tasks or p.tasks) * seeds,
           "landscape": len(p.landscape_grid) ** 2 * len(p.landscape_methods)
           * split_tasks(p.env, p.landscape_tasks or p.tasks) * seeds}
    if p.env in A.ABLATIONS.get(p.profile, {}):
        ab = A.ablation(p.profile, p.env)
        trained = A.trained_variants(ab, p)
        per = split_tasks(p.env, ab.goals(p)) * seeds * len(ab.seeds)
        out["ablations"] = sum(per * (table if v.settings == "table" else 1) for v in trained)
    out["all"] = sum(out.values())
    return out


def missing_landscape(p: X.Plan) -> str:
    """Why a plan draws no landscape on its env, in numbers: the episodes that a grid like
    another env's of the same profile would add (the design of notebook 08 prices them)."""
    other = next((q for q in X.PLANS.get(p.profile, {}).values() if q.landscape_grid), None)
    if other is None:
        return f"the {p.profile} plan draws no landscape on any environment"
    n = len(other.landscape_grid) ** 2 * len(p.landscape_methods) * split_tasks(p.env, p.landscape_tasks or p.tasks)
    return (f"the {p.profile} plan leaves {ENV_LABELS.get(p.env, p.env)}'s landscape out: {other.env}'s "
            f"{len(other.landscape_grid)}x{len(other.landscape_grid)} grid would add {n:,} episodes "
            f"({len(p.landscape_methods)} policies x {split_tasks(p.env, p.landscape_tasks or p.tasks)} games per "
            f"point), which the 8-hour design that notebook 08 chooses does not include")


def _rl(profile: str, env: str) -> str:
    c = load_config(profile, **{"env.name": env})
    steps = c.env.max_steps or env_max_steps(env)
    return f"{c.iterations} iterations x {c.rollout.tasks_per_step} tasks x {c.rollout.group_size} rollouts, {steps} steps"


def _seeds(p: X.Plan) -> str:
    return ", ".join(f"{METHOD_DISPLAY[m].label} {len(p.seeds[m])}" for m in p.methods)


def _settings(p: X.Plan, extra: bool) -> str:
    """Table 1's settings (``extra``: the curves' other strengths), one family per group:
    ``Gaussian σ=0.02, σ=0.05; Quantization INT8``."""
    table = [("clean", 0.0), *p.table]
    groups: dict[str, list[str]] = {}
    for f, st in (x for x in p.settings() if (x not in table) == extra):
        label = setting_label(f, st)
        family = label.rsplit(" ", 1)[0] if f != "clean" else label
        groups.setdefault(family, []).append(label.rsplit(" ", 1)[-1] if f != "clean" else "")
    return "; ".join(f"{fam} {', '.join(v)}".strip() for fam, v in groups.items()) or "none"


def plan_table(profiles: tuple[str, ...] = ("cpu", "paper")) -> str:
    """Markdown: per environment, what each profile trains and evaluates."""
    head = "| | " + " | ".join(f"`{pr}`" for pr in profiles) + " |\n|---|" + "---|" * len(profiles) + "\n"
    out = []
    for env in ("alfworld", "webshop"):
        plans = [X.PLANS[pr].get(env) for pr in profiles]
        if not any(plans):
            continue
        rows = {
            "model": [load_config(pr, **{"env.name": env}).model.spec for pr in profiles],
            "RL run": [_rl(pr, env) for pr in profiles],
            "training seeds": [_seeds(p) if p else "-" for p in plans],
            "longer runs (notebook 01)": [", ".join(f"{METHOD_DISPLAY[m].label} {len(v)} to {p.longer_iterations} iterations"
                                                    for m, v in p.longer().items()) or "none" if p else "-"
                                          for p in plans],
            "held-out tasks": [", ".join(f"{s} {n if p.tasks is None else min(p.tasks, n)}"
                                         for s, n in APP_C_TASKS[env].items()) if p else "-" for p in plans],
            "Table 1 settings": [_settings(p, False) if p else "-" for p in plans],
            "other curve strengths": [(f"{_settings(p, True)} ({split_tasks(env, p.curve_tasks or p.tasks)} "
                                       "episodes each)") if p else "-" for p in plans],
            "episodes per point": [str(split_tasks(env, p.tasks) * len(p.eval_seeds)) if p else "-" for p in plans],
        }
        eps = [planned_episodes(p) if p else None for p in plans]
        for k in ("table", "curves", "landscape", "ablations", "all"):
            if any(e and e.get(k) for e in eps):
                rows[f"episodes: {k}"] = [f"{e[k]:,}" if e and k in e else "-" for e in eps]
        out.append(f"**{ENV_LABELS.get(env, env)}**\n\n" + head
                   + "".join(f"| {name} | " + " | ".join(v) + " |\n" for name, v in rows.items()))
    return "\n".join(out)


def paper_cost_table() -> str:
    """Markdown: the expected GPU time of one ``paper``-profile training run per (env,
    method), its iterations times the paper's seconds per step (:data:`PAPER_STEP_SECONDS`),
    and of the profile's whole training grid (Vanilla's cost for Gaussian, SPrPO's for SAM,
    which also adds a second forward/backward pass; an estimate, not a measurement)."""
    lines = ["| environment | method | s / step (paper) | iterations | hours per run | runs | hours in all |",
             "|---|---|---|---|---|---|---|"]
    for env in ("alfworld", "webshop"):
        p = X.PLANS["paper"][env]
        iters = load_config("paper", **{"env.name": env}).iterations
        for m in p.methods:
            ref = "sprpo" if m in ("sprpo", "sam") else "vanilla"
            sec = PAPER_STEP_SECONDS[env, ref][2]
            n = len(p.seeds[m])
            est = "" if m == ref else f" (as {METHOD_DISPLAY[ref].label})"
            lines.append(f"| {ENV_LABELS[env]} | {METHOD_DISPLAY[m].label}{est} | {sec:.1f} | {iters} | "
                         f"{sec * iters / 3600:.1f} | {n} | {sec * iters * n / 3600:.1f} |")
    lines.append(f"| all | | | | | | {paper_gpu_hours():.0f} |")
    return "\n".join(lines) + "\n"


def paper_gpu_hours() -> float:
    """The ``paper`` profile's whole training grid in hours at the paper's seconds per step."""
    total = 0.0
    for env in ("alfworld", "webshop"):
        p = X.PLANS["paper"][env]
        iters = load_config("paper", **{"env.name": env}).iterations
        total += sum(PAPER_STEP_SECONDS[env, "sprpo" if m in ("sprpo", "sam") else "vanilla"][2] * iters
                     * len(p.seeds[m]) for m in p.methods) / 3600
    return total


#: Where the full tables go (``figures/``, linked from the README).
PLANS_FILE = "plans.md"


def plans_markdown() -> str:
    """The full reference: what each profile runs, and the paper profile's expected GPU time."""
    return ("# What the `cpu` and `paper` profiles run\n\nCounted from `sprpo_lib.paper.experiments.PLANS`, "
            "`sprpo_lib.paper.ablations.ABLATIONS` and the profiles' configs (`sprpo_lib.paper.budget`).\n\n"
            + plan_table() + "\n## Expected GPU time of the `paper` profile's training\n\nThe paper's Table "
            "\"Training overhead\" (seconds per step on two RTX PRO 6000 GPUs) times the iterations; an estimate "
            "for this trainer, which runs each on one device.\n\n" + paper_cost_table())


def plans_summary() -> str:
    """One line per environment for the README: held-out tasks and evaluation episodes, cpu vs paper."""
    out = []
    for env in ("alfworld", "webshop"):
        cpu, paper = X.PLANS["cpu"].get(env), X.PLANS["paper"][env]
        if cpu is None:
            continue
        out.append(f"- {ENV_LABELS[env]}: `cpu` {split_tasks(env, cpu.tasks)} episodes per point, "
                   f"{planned_episodes(cpu)['all']:,} evaluation episodes in all; `paper` "
                   f"{split_tasks(env, paper.tasks)} per point, {planned_episodes(paper)['all']:,} in all")
    return "\n".join(out) + f"\n\nThe whole table: [figures/{PLANS_FILE}](figures/{PLANS_FILE}).\n"


def gpu_records(out_dir) -> list[dict]:
    """The ``sprpo-bench gpu`` records among ``out_dir``'s ``bench_*.json`` files, newest first."""
    recs = []
    for path in sorted(Path(out_dir).glob("bench_*.json")):
        if path.name.endswith(".manifest.json"):
            continue
        for name, rec in json.loads(path.read_text()).items():
            if isinstance(rec, dict) and rec.get("bench") == "gpu" and isinstance(rec.get("results"), dict):
                recs.append({"name": name, "file": path.name, **rec})
    return sorted(recs, key=lambda r: r.get("date") or "", reverse=True)


def projected_costs(record: Mapping, iterations: int | None = None) -> pd.DataFrame:
    """One ``paper``-profile RL run per (env, method) projected from a ``sprpo-bench gpu``
    record: the recorded rollout of 128 episodes plus the method's update on that batch,
    both scaled from the recorded turns per episode to the environment's step limit (App. B:
    50 ALFWorld, 15 WebShop; an upper bound, as if every episode ran to its limit, the way an
    untrained policy's do), times the profile's iterations; ``runs`` from the paper plan's
    seeds.  A method whose update on the rollout's batch the record lacks takes SPrPO's there
    times its ratio to SPrPO in the other environment (``source`` says so), else at the
    full prompt budget; no SPrPO update at all leaves the row out."""
    res = record["results"]
    out = []
    for env in ("alfworld", "webshop"):
        rows = res.get(env) or {}
        roll = rows.get("rollout") or {}
        if not roll.get("episodes") or not roll.get("samples"):
            continue
        turns = roll["samples"] / roll["episodes"]
        limit = env_max_steps(env)
        scale = limit / turns
        cfg = load_config("paper", **{"env.name": env})
        iters = iterations or cfg.iterations
        p = X.PLANS["paper"][env]
        other = res.get("webshop" if env == "alfworld" else "alfworld") or {}
        for m in p.methods:
            update, source = (rows.get(m) or {}).get("update_s"), "measured"
            if update is None and (rows.get("sprpo") or {}).get("update_s"):
                ref = rows["sprpo"]["update_s"]
                if (other.get(m) or {}).get("update_s") and (other.get("sprpo") or {}).get("update_s"):
                    update = ref * other[m]["update_s"] / other["sprpo"]["update_s"]
                    source = "estimated: SPrPO's update here x its ratio to SPrPO in the other environment"
                else:
                    fb = rows.get("full_budget") or {}
                    if (fb.get(m) or {}).get("update_s") and (fb.get("sprpo") or {}).get("update_s"):
                        update = ref * fb[m]["update_s"] / fb["sprpo"]["update_s"]
                        source = "estimated: SPrPO's update here x its ratio to SPrPO at the full prompt budget"
            if update is None:
                continue
            it_s = (roll["rollout_s"] + update) * scale
            out.append({"env": env, "method": m, "turns_recorded": round(turns, 2), "step_limit": limit,
                        "rollout_s": round(roll["rollout_s"] * scale, 1), "update_s": round(update * scale, 1),
                        "iteration_s": round(it_s, 1), "iterations": iters,
                        "hours_per_run": round(it_s * iters / 3600, 2), "runs": len(p.seeds[m]),
                        "hours": round(it_s * iters * len(p.seeds[m]) / 3600, 1), "source": source})
    return pd.DataFrame(out)


def record_engine(record: Mapping) -> str:
    """The generation engine a ``sprpo-bench gpu`` record's rollouts used: its override, else the
    ``paper`` profile's own."""
    over = [o.split("=", 1)[1] for o in record["results"].get("overrides") or [] if o.startswith("rollout.engine=")]
    return over[-1] if over else load_config("paper").rollout.engine


def projected_markdown(record: Mapping) -> str:
    """The projection of :func:`projected_costs` as a table with its totals, naming the record."""
    df = projected_costs(record)
    if df.empty:
        return ""
    gpu = (record.get("machine") or {}).get("gpu") or (record["results"].get("gpu") or {}).get("name", "?")
    lines = [f"Projected from `{record.get('name', '?')}` ({gpu}, {str(record.get('date', ''))[:10]}; "
             f"{'partial record; ' if record.get('partial') else ''}rollouts with the `{record_engine(record)}` "
             "engine, scaled from "
             "the recorded turns per episode to the step limit: an upper bound):", "",
             "| environment | method | rollout s | update s | s / iteration | iterations | hours per run | runs | "
             "hours | source |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in df.itertuples():
        lines.append(f"| {ENV_LABELS[r.env]} | {METHOD_DISPLAY[r.method].label} | {r.rollout_s:.0f} | {r.update_s:.0f} | "
                     f"{r.iteration_s:.0f} | {r.iterations} | {r.hours_per_run:.1f} | {r.runs} | {r.hours:.0f} | "
                     f"{r.source} |")
    envs = set(df["env"])
    lines.append(f"| all | | | | | | | | {df['hours'].sum():.0f} | "
                 f"{'every environment' if envs == {'alfworld', 'webshop'} else 'only ' + ', '.join(sorted(envs))} |")
    return "\n".join(lines) + "\n"


def cost_summary(out_dir=None) -> str:
    """One line for the README: the paper profile's training grid in GPU-hours, projected from
    the newest ``sprpo-bench gpu`` record in ``out_dir`` (``figures/``) where there is one,
    beside the paper's own seconds per step."""
    paper = (f"{paper_gpu_hours():.0f} GPU-hours at the paper's seconds per step "
             f"([figures/{PLANS_FILE}](figures/{PLANS_FILE}))")
    recs = gpu_records(Path(out_dir)) if out_dir is not None else []
    for rec in recs:
        df = projected_costs(rec)
        if not df.empty:
            gpu = (rec.get("machine") or {}).get("gpu") or "?"
            return (f"About {df['hours'].sum():.0f} GPU-hours for the `paper` profile's training grid on one "
                    f"{gpu}, projected from this trainer's own record (`{rec['file']}`, {str(rec['date'])[:10]}; "
                    f"rollouts with the `{record_engine(rec)}` engine at the step limits, an upper bound); "
                    f"{paper}.\n")
    return f"About {paper} for the `paper` profile's training grid.\n"


# ----------------------------------------------------------------------------- choosing the cpu design
@dataclass(frozen=True)
class Rates:
    """Measured seconds on one machine (``machine``: its CPU and class): per RL iteration of
    each method and per evaluation episode, per environment (``{env: {method: s}}``,
    ``{env: s}``), and where each number came from (``sources``)."""

    machine: str
    iteration_s: Mapping[str, Mapping[str, float]]
    episode_s: Mapping[str, float]
    sources: Mapping[str, str] = field(default_factory=dict)


#: Methods whose training seeds the design sets (the others keep one seed: no resolvable claim
#: compares them with enough power at this scale, :func:`sprpo_lib.paper.power.claim_power`).
DESIGN_METHODS = ("vanilla", "sprpo")


#: Training seeds a design may give the compared methods: at least 3, so that the intervals
#: carry a training-seed variance estimated from more than two runs.
MIN_SEEDS = (3, 4, 5)


def design_plan(env: str, seeds: int, goals: int) -> X.Plan:
    """The ``cpu`` plan with ``seeds`` training seeds for :data:`DESIGN_METHODS` (one for the
    others) and ``goals`` test goals per split."""
    base = X.PLANS["cpu"][env]
    return X.plan("cpu", env, seeds={m: tuple(range(seeds if m in DESIGN_METHODS else 1)) for m in base.methods},
                  tasks=goals)


def design_seconds(env: str, seeds: int, goals: int, iterations: int, rates: Rates) -> dict[str, float]:
    """Seconds of the ``cpu`` design (:func:`design_plan`) on ``env`` at ``rates``: its RL
    runs of ``iterations`` each, their held-out curve (the profile's ``eval_tasks`` episodes on
    ``env`` every ``eval_every`` iterations), the evaluation episodes of Table 1, the curves and the
    landscape, and the ablation study where the profile has one on ``env`` (its trained
    variants at the same length, with their curve, and its episodes: :func:`planned_episodes`)."""
    p = design_plan(env, seeds, goals)
    runs = [(m, len(p.seeds[m])) for m in p.methods]
    if env in A.ABLATIONS.get(p.profile, {}):
        ab = A.ablation(p.profile, env)
        runs += [(v.method, len(ab.seeds)) for v in A.trained_variants(ab, p)]
    train = sum(n * iterations * rates.iteration_s[env][m] for m, n in runs)
    c = load_config(p.profile, **{"env.name": env})
    points = iterations // c.eval_every if c.eval_every else 0
    curve = sum(n for _, n in runs) * points * c.eval_tasks * rates.episode_s[env]
    eps = planned_episodes(p)
    evals = (eps["table"] + eps["curves"] + eps["landscape"] + eps.get("ablations", 0)) * rates.episode_s[env]
    return {"train_s": train, "heldout_s": curve, "eval_s": evals, "total_s": train + curve + evals}


def choose_design(power: pd.DataFrame, rates: Rates, budget_s: float, seeds: Sequence[int], goals: Sequence[int],
                  iterations: Sequence[int], envs: Sequence[str] = ("alfworld", "webshop")) -> dict:
    """The design (training seeds, test goals per split, RL iterations), the same on every
    env, that resolves the most of the main claims of ``power`` (:func:`~sprpo_lib.paper.power.claim_power`
    rows with components: C1, C2.<family>, C3; a claim whose pilot showed no variation cannot
    be sized and is left out) within ``budget_s`` at ``rates`` (:func:`design_seconds`, every
    env together); :func:`~sprpo_lib.paper.power.best_design` on a grid.  An equivalence claim
    (C3, margin m) counts as the effect ``m * Z_POWER80 / 1.96`` (its 95% half-width within m).
    Goals are per split: ALFWorld's two splits pair twice as many goals."""
    claims = {}
    for r in power.itertuples():
        if not str(r.claim).startswith(("C1", "C2.", "C3")) or pd.isna(r.var_seed):
            continue
        if r.var_seed + r.var_goal + r.var_cell == 0:
            continue  # the pilot's policies agreed on every cell: no design can be sized from it
        per = len(APP_C_TASKS[r.env])  # goals paired per "goal per split"
        comps = P.Components(r.var_seed, r.var_goal / per, r.var_cell / per)
        effect = 2.0 * P.Z_POWER80 / 1.959964 if r.claim == "C3" else r.paper
        if r.env in envs:
            claims[f"{r.env}:{r.claim}"] = (comps, effect)

    def cost(s, t, k):
        return sum(design_seconds(env, s, t, k, rates)["total_s"] for env in envs)

    return P.best_design(claims, cost, budget_s, seeds, goals, iterations)


def bench_episode_s(bench: Mapping) -> dict[str, float]:
    """Seconds per evaluation episode per env from one machine's ``sprpo-bench`` record
    (``figures/bench_<machine>.json``: its ``eval*`` entries, the openvino engine at the
    profile's own settings)."""
    out: dict[str, float] = {}
    for key, rec in bench.items():
        r = rec.get("results", {}) if key.startswith("eval") and isinstance(rec, dict) else {}
        for eng in ("openvino", "openvino:auto"):
            ev = (r.get(eng) or {}).get("eval") if isinstance(r.get(eng), dict) else None
            if ev and ev.get("episodes"):
                out.setdefault(r["env"], ev["wall_s"] / ev["episodes"])
    return out


#: The update's cost with mini-batches (``update.ppo_mini_batch_size: 16``, several Adam steps
#: per iteration) over one step per iteration: the old-log-prob forward pass of verl's actor
#: is added.  Measured on this library's WebShop Vanilla runs, seed 0, one AVX2 machine
#: (update seconds per sample, quiet iterations): 1.2 s with one step, 1.8 s with
#: mini-batches of 16.  Used only to price runs that predate mini-batches.
MINIBATCH_UPDATE_FACTOR = 1.5


def training_rates(metrics: Mapping[str, pd.DataFrame], ratios: Mapping[str, float] | None = None,
                   update_factor: float = 1.0) -> dict:
    """Seconds per RL iteration per env and method from training runs' metrics (notebook
    01's ``_metrics.csv``): Vanilla's mean ``wall_s`` per env, times each method's ratio to
    Vanilla on WebShop (``ratios``, e.g. ``sprpo-bench train``'s, or those of the same
    metrics), where every iteration updated: ALFWorld's SPrPO skipped its replay in the
    iterations without a non-zero advantage, which makes its own mean too low.
    ``update_factor`` scales each iteration's ``update_s`` (runs made with one optimizer step
    per iteration priced at mini-batches: :data:`MINIBATCH_UPDATE_FACTOR`)."""
    def wall(m: pd.DataFrame) -> pd.Series:
        return m[MK.WALL_S] + (update_factor - 1.0) * m[MK.UPDATE_S] if MK.UPDATE_S in m else m[MK.WALL_S]

    vanilla = {env: float(wall(m.loc[m["method"] == "vanilla"]).mean()) for env, m in metrics.items()}
    if ratios is None:
        ws = wall(metrics["webshop"]).groupby(metrics["webshop"]["method"]).mean()
        ratios = {m: float(ws[m] / ws["vanilla"]) for m in ws.index}
    return {env: {m: v * r for m, r in ratios.items()} for env, v in vanilla.items()}


def uses_minibatches(metrics: pd.DataFrame) -> bool:
    """Whether the runs of ``metrics`` took several optimizer steps per iteration (``ppo_steps``)."""
    return MK.PPO_STEPS in metrics and bool((metrics[MK.PPO_STEPS].dropna() > 1).any())


def bench_machine(bench: Mapping) -> dict:
    """The machine record (CPU model, class, ...) of a ``sprpo-bench`` record, ``{}`` if none."""
    return next((rec["results"]["machine"] for rec in bench.values() if isinstance(rec, dict)
                 and isinstance(rec.get("results"), dict) and isinstance(rec["results"].get("machine"), dict)), {})


def bench_rates(bench: Mapping, reference: Rates, update_factor: float = MINIBATCH_UPDATE_FACTOR) -> Rates:
    """Rates of the machine of ``bench`` (its ``sprpo-bench`` record): what it measured
    itself (WebShop's iteration per method from ``bench train``, each env's evaluation
    episode from ``bench eval``), the rest scaled from ``reference`` by the ratio the two
    machines show on WebShop (an estimate, said in ``sources``).  A ``bench train`` record
    that predates mini-batches (no ``ppo_mini_batch_size``) has its update scaled by
    ``update_factor``."""
    machine = bench_machine(bench)
    name = f"{machine.get('cpu_model', '?')} ({machine.get('cpu_class', '?')})"
    results = (bench.get("train_webshop") or {}).get("results", {})
    train = results.get("shared")
    it, src = {}, {}
    if train:
        factor = update_factor if "ppo_mini_batch_size" not in results else 1.0

        def iteration(m: str) -> float:
            return train[m]["iteration_s"] + (factor - 1.0) * train[m]["update_s"]

        v = iteration("vanilla")
        own = {"vanilla": v, "sprpo": iteration("sprpo"), "sam": iteration("sam"),
               "gaussian": v * reference.iteration_s["webshop"]["gaussian"] / reference.iteration_s["webshop"]["vanilla"]}
        scale = v / reference.iteration_s["webshop"]["vanilla"]
        it = {env: (own if env == "webshop" else {m: s * scale for m, s in per.items()})
              for env, per in reference.iteration_s.items()}
        src["iteration_s"] = (f"WebShop: bench train{f', update x{factor:g} for mini-batches' if factor != 1 else ''} "
                              f"(Gaussian as Vanilla x the reference's ratio); other envs: the reference x {scale:.2f}")
    else:
        it, src["iteration_s"] = dict(reference.iteration_s), "the reference's (no bench train on this machine)"
    ep = bench_episode_s(bench)
    if "webshop" in ep:
        scale = ep["webshop"] / reference.episode_s["webshop"]
        missing = [e for e in reference.episode_s if e not in ep]
        ep.update({e: reference.episode_s[e] * scale for e in missing})
        src["episode_s"] = "bench eval" + (f"; {', '.join(missing)}: the reference x {scale:.2f}" if missing else "")
    else:
        ep, src["episode_s"] = dict(reference.episode_s), "the reference's (no bench eval on this machine)"
    return Rates(name, it, ep, src)


def design_table(power: pd.DataFrame, rates: Rates, others: Sequence[Rates], budget_s: float,
                 iterations: Sequence[int], seeds: Sequence[int] = MIN_SEEDS,
                 goals: Sequence[int] = (6, 8, 12, 16, 20, 24, 32, 48, 96)) -> pd.DataFrame:
    """Per RL length: the design :func:`choose_design` picks within ``budget_s`` at ``rates``
    (its machine's hours), its hours at each of ``others``, and the claims it resolves;
    a length no design of the grid fits says so."""
    out = []
    for k in iterations:
        row = {"iterations": k, "machine": rates.machine, "budget_h": budget_s / 3600}
        try:
            d = choose_design(power, rates, budget_s, seeds, goals, (k,))
        except ValueError as err:
            out.append({**row, "note": str(err)})
            continue
        row.update(seeds=d["seeds"], goals_per_split=d["goals"], hours=d["cost_s"] / 3600,
                   resolved=len(d["resolved"]), claims=" ".join(d["resolved"]), note="")
        for o in others:
            row[f"hours on {o.machine}"] = sum(design_seconds(env, d["seeds"], d["goals"], k, o)["total_s"]
                                               for env in ("alfworld", "webshop")) / 3600
        out.append(row)
    return pd.DataFrame(out)


def design_from_figures(out_dir, power: pd.DataFrame, budget_h: float = 8.0,
                        iterations: Sequence[int] = (5, 10, 15, 20)) -> pd.DataFrame:
    """:func:`design_table` from what ``out_dir`` (``figures/``) holds: the training runs'
    rates of notebook 01's ``_metrics.csv`` on the machine its manifest names, with that
    machine's ``bench_<machine>.json`` for the evaluation episode, and every other
    benchmarked CPU machine's hours (:func:`bench_rates`); ``bench_records`` names the records read.
    Empty when a piece is missing."""
    out = Path(out_dir)
    paths = {e: out / f"01_training_{e}_metrics.csv" for e in ("alfworld", "webshop")}
    benches = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("bench_*.json"))
               if not p.name.endswith(".manifest.json")}
    if not all(p.is_file() for p in paths.values()) or not benches or power is None or not len(power):
        return pd.DataFrame()
    host = json.loads(manifest_path(paths["webshop"]).read_text()).get("host", {})

    ref_name = next((n for n, b in benches.items() if bench_machine(b).get("cpu_class") == host.get("cpu_class")),
                    None)
    if ref_name is None:
        return pd.DataFrame()
    metrics = {e: pd.read_csv(p) for e, p in paths.items()}
    factor = 1.0 if all(map(uses_minibatches, metrics.values())) else MINIBATCH_UPDATE_FACTOR
    ref = Rates(f"{host.get('cpu_model', '?')} ({host.get('cpu_class')})",
                training_rates(metrics, update_factor=factor), bench_episode_s(benches[ref_name]),
                {"iteration_s": "notebook 01's runs" + (f", update x{factor:g} for mini-batches" if factor != 1 else ""),
                 "episode_s": f"{ref_name}.json"})
    if set(ref.episode_s) != set(paths):
        return pd.DataFrame()
    # the other CPU machines (a GPU's record has no CPU rates to scale: the paper profile's cost is elsewhere)
    read = [n for n, b in benches.items() if n != ref_name and bench_machine(b).get("cpu_model")]
    others = [bench_rates(benches[n], ref) for n in read]
    table = design_table(power, ref, others, budget_h * 3600, iterations)
    return table.assign(bench_records=" ".join(f"{n}.json" for n in [ref_name, *read])) if len(table) else table
