"""What a profile runs, counted from its plans (:data:`~sprpo_lib.paper.experiments.PLANS`,
:data:`~sprpo_lib.paper.ablations.ABLATIONS`) and training configs: RL runs and their
sizes, held-out tasks, settings, and the evaluation episodes they add up to.  The
README's table of the ``cpu`` profile against the ``paper`` profile is generated here,
so no size in it is typed by hand."""
from __future__ import annotations

from sprpo_lib.config import load_config
from sprpo_lib.envs.alfworld import MAX_STEPS as ALFWORLD_MAX_STEPS
from sprpo_lib.envs.alfworld_gen import DEFAULT_SIZES
from sprpo_lib.envs.webshop import MAX_STEPS as WEBSHOP_MAX_STEPS
from sprpo_lib.envs.webshop import N_TEST_GOALS
from sprpo_lib.evaluate import EVAL_SPLITS
from sprpo_lib.methods import METHOD_DISPLAY
from sprpo_lib.paper import ablations as A
from sprpo_lib.paper import experiments as X
from sprpo_lib.paper.results import setting_label
from sprpo_lib.paper.tables import ENV_LABELS

__all__ = ["APP_C_TASKS", "PAPER_STEP_SECONDS", "split_tasks", "planned_episodes", "plan_table", "paper_cost_table",
           "paper_gpu_hours", "plans_markdown", "plans_summary", "cost_summary"]

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

#: The environments' own step limits (App. B), where a profile keeps them.
ENV_MAX_STEPS = {"webshop": WEBSHOP_MAX_STEPS, "alfworld": ALFWORLD_MAX_STEPS}


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
        per = split_tasks(p.env, ab.tasks) * seeds * len(ab.seeds)
        out["ablations"] = sum(per * (table if v.settings == "table" else 1) for v in trained)
    out["all"] = sum(out.values())
    return out


def _rl(profile: str, env: str) -> str:
    c = load_config(profile, **{"env.name": env})
    steps = c.env.max_steps or ENV_MAX_STEPS[env]
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


def cost_summary() -> str:
    """One line for the README: the paper profile's training grid in GPU-hours."""
    return (f"About {paper_gpu_hours():.0f} GPU-hours for the `paper` profile's training grid at the paper's "
            f"seconds per step ([figures/{PLANS_FILE}](figures/{PLANS_FILE})).\n")
