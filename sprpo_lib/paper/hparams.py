"""App. B's hyperparameter tables ("Shared training hyperparameters", Table 2; "Perturbation-
specific training hyperparameters", Table 3) generated from the training profiles, each
profile's value beside the paper's, so that every difference of a profile is in view.

Each row is a label, the paper's value as App. B prints it, and a function of the
profile's resolved :class:`~sprpo_lib.train.config.TrainConfig` for an environment.  Rows whose
value depends on the environment (prompt and response lengths) read that environment's
config; the others read WebShop's, where the profiles name both."""
from __future__ import annotations

from typing import Callable, Sequence

import pandas as pd

from sprpo_lib.train.config import TrainConfig, load_config

__all__ = ["SHARED", "PERTURBATION", "hparam_frame", "hparam_latex", "hparam_markdown"]

Row = tuple[str, str, str, Callable[[TrainConfig], str]]  # (group, label, paper's value, value of a config)


def _lora(c: TrainConfig) -> str:
    layers = f" (last {c.model.lora_layers} layers)" if c.model.lora_layers else ""
    return f"{c.model.lora.rank} / {c.model.lora.alpha:g}{layers}"


def _optimizer(c: TrainConfig) -> str:
    return "Adam" + (f", weight decay {c.update.weight_decay:g}" if c.update.weight_decay else "")


def _batch(c: TrainConfig) -> str:
    n = c.rollout.tasks_per_step * c.rollout.group_size
    mb = c.update.ppo_mini_batch_size
    return f"{n}" + (f" (mini-batches of {mb} step rows)" if mb else "")


def _lengths(c: TrainConfig) -> str:
    prompt = c.rollout.agent.max_prompt_tokens
    return f"{prompt if prompt else 'no limit'} / {c.rollout.generation.max_new_tokens}"


def _same(value: str, paper: str) -> bool:
    """A profile's value equals the paper's (a hub id ``org/name`` names the paper's model)."""
    return value == paper or value.rsplit("/", 1)[-1] == paper


def _num(v: float) -> str:
    return f"{v:g}"


#: Table 2 (``tab:training-hparams``): the rows and the paper's values.
SHARED: tuple[Row, ...] = (
    ("", "Base model", "Qwen2.5-1.5B-Instruct", lambda c: c.model.spec),
    ("", "LoRA rank / alpha", "64 / 64", _lora),
    ("", "Optimizer", "Adam", _optimizer),
    ("", "Learning rate", "3e-06", lambda c: _num(c.update.lr)),
    ("", "Training steps", "200", lambda c: str(c.iterations)),
    ("", "Tasks per step", "16", lambda c: str(c.rollout.tasks_per_step)),
    ("", "Rollouts per task", "8", lambda c: str(c.rollout.group_size)),
    ("", "Trajectories per PPO batch", "128", _batch),
    ("", "Discount factor gamma", "0.95", lambda c: _num(c.update.adv.gamma)),
    ("", "PPO clip ratio", "0.2", lambda c: _num(c.update.loss.clip_ratio)),
    ("", "Dual-clip coefficient", "3", lambda c: _num(c.update.loss.clip_ratio_c)),
    ("", "Entropy coefficient", "0.001", lambda c: _num(c.update.loss.entropy_coeff)),
    ("webshop", "WebShop prompt / response length", "4096 / 512", _lengths),
    ("alfworld", "ALFWorld prompt / response length", "3072 / 1024", _lengths),
    ("", "Validation temperature", "0.4", lambda c: _num(c.eval_temperature)),
)

#: Table 3 (``tab:perturbation-hparams``): (method, hyperparameter), the paper's value.
PERTURBATION: tuple[Row, ...] = (
    ("Gaussian", "Noise scale sigma", "0.1", lambda c: _num(c.method.sigma)),
    ("SAM", "Perturbation scale rho", "0.005", lambda c: _num(c.method.sam_rho)),
    ("SPrPO", "Base perturbation scale rho", "0.2", lambda c: _num(c.method.rho)),
    ("SPrPO", "Sensitivity exponent alpha", "1", lambda c: _num(c.method.alpha)),
)


def hparam_frame(rows: Sequence[Row], profiles: Sequence[str] = ("paper", "cpu")) -> pd.DataFrame:
    """One row per hyperparameter: the paper's value and each profile's, with ``differs``
    listing the profiles whose value is not the paper's."""
    out = []
    for group, label, paper, get in rows:
        env = group if group in ("webshop", "alfworld") else "webshop"
        vals = {p: get(load_config(p, **{"env.name": env})) for p in profiles}
        rec = {"group": "" if group in ("webshop", "alfworld") else group, "hyperparameter": label,
               "paper (App. B)": paper, **vals}
        rec["differs"] = " ".join(p for p, v in vals.items() if not _same(v, paper))
        out.append(rec)
    return pd.DataFrame(out)


def _tex(v: str) -> str:
    return (v.replace("_", r"\_").replace("gamma", r"$\gamma$").replace("sigma", r"$\sigma$")
            .replace("rho", r"$\rho$").replace("alpha", r"$\alpha$"))


def hparam_latex(frame: pd.DataFrame, caption: str, label: str) -> str:
    """The frame as a booktabs table in App. B's layout, a column per profile."""
    cols = [c for c in frame.columns if c not in ("group", "hyperparameter", "differs")]
    lead = ["Method"] if frame["group"].astype(bool).any() else []
    head = " & ".join([*lead, "Hyperparameter",
                       *("Paper (App. B)" if c == "paper (App. B)" else rf"\texttt{{{c}}} profile" for c in cols)])
    lines = [r"\begin{table}[t]", r"\centering", r"\small", rf"\caption{{{caption}}}", rf"\label{{{label}}}",
             r"\begin{tabular}{@{}" + "l" * (len(lead) + 1) + "c" * len(cols) + "@{}}", r"\toprule",
             head + r" \\", r"\midrule"]
    for rec in frame.to_dict("records"):
        cells = ([rec["group"]] if lead else []) + [_tex(rec["hyperparameter"])] + [_tex(str(rec[c])) for c in cols]
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    return "\n".join(lines)


def hparam_markdown(frame: pd.DataFrame) -> str:
    """The frame as a Markdown table, a column per profile as in :func:`hparam_latex`; a
    profile's value that differs from the paper's is bold."""
    cols = [c for c in frame.columns if c not in ("differs",) and (c != "group" or frame["group"].astype(bool).any())]
    heads = [c if c in ("group", "hyperparameter", "paper (App. B)") else f"`{c}` profile" for c in cols]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(cols)]
    for _, r in frame.iterrows():
        cells = []
        for c in cols:
            v = str(r[c])
            differs = c not in ("group", "hyperparameter", "paper (App. B)") and not _same(v, r["paper (App. B)"])
            cells.append(f"**{v}**" if differs else v)
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
