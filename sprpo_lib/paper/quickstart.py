"""What each deployment perturbation does to a policy's next-token distribution.

Logic behind ``notebooks/00_quickstart.ipynb`` and the current main job: load a policy,
let it answer an agent prompt in the paper's format (App. B "Observation"), then apply
each perturbation family of App. C at one representative strength and measure how the
next-token distributions along the clean response move (KL, top-1 agreement) and what
action the perturbed policy generates.

Calibration sequences for Fisher / SparseGPT come from :func:`synthetic_calibration`:
agent-style prompts built from templates and answered by the policy itself.  It is a
stand-in until rollout-derived calibration (App. C: 128 sequences from a Vanilla
policy) exists; the API takes any list of token sequences.
"""
from __future__ import annotations

import random
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from sprpo_lib.core.compress import family_spec, perturbation
from sprpo_lib.model.load import Policy
from sprpo_lib.paper.figcheck import warn_problems
from sprpo_lib.paper.style import NEUTRAL, pyplot


# App. C families at one representative (strong) level each.
DEMO_LEVELS: dict[str, float] = {
    "gaussian": 0.10,
    "dropout": 0.05,
    "fisher": 0.20,
    "sparsegpt": 0.50,
    "rtn": 4,
}

DEMO_PROMPT = (
    "Task: put a clean mug in coffeemachine.\n\n"
    "Interaction context: [Step 1] Action: go to countertop 1. Observation: On the countertop 1, "
    "you see a mug 1, a knife 2, and a apple 1.\n\n"
    "Current observation: You pick up the mug 1 from the countertop 1.\n\n"
    "Available actions:\n- go to sinkbasin 1\n- go to coffeemachine 1\n- put mug 1 in/on countertop 1\n"
    "- examine mug 1\n- inventory\n\n"
    "Response: Output the next action in <action>...</action>."
)

DEMO_PLACES = ["countertop", "sinkbasin", "fridge", "microwave", "cabinet", "drawer", "shelf", "desk", "sofa", "toilet"]
DEMO_OBJECTS = ["mug", "apple", "knife", "book", "pencil", "cloth", "egg", "tomato", "plate", "keychain"]
_PRODUCTS = ["wireless headphones", "running shoes", "green tea", "phone case", "desk lamp", "yoga mat"]


def synthetic_calibration(policy: Policy, n: int = 32, max_new_tokens: int = 24, seed: int = 0,
                          max_len: int = 256) -> list[list[int]]:
    """``n`` token sequences: seeded agent-style prompts (ALFWorld- and WebShop-like) in
    the chat template plus the policy's own greedy answer, truncated to ``max_len``."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            obj, a, b = rng.choice(DEMO_OBJECTS), rng.choice(DEMO_PLACES), rng.choice(DEMO_PLACES)
            acts = "\n".join(f"- go to {p} {rng.randint(1, 3)}" for p in rng.sample(DEMO_PLACES, 4))
            prompts.append(
                f"Task: put some {obj} on {b}.\n\nInteraction context: none.\n\nCurrent observation: "
                f"You are in the middle of a room. You see a {a} 1 and a {b} 1.\n\n"
                f"Available actions:\n{acts}\n\nResponse: Output the next action in <action>...</action>."
            )
        else:
            prod = rng.choice(_PRODUCTS)
            price = rng.choice([20, 30, 50, 100])
            prompts.append(
                f"Task: i need {prod}, and price lower than {price}.00 dollars.\n\nInteraction context: none."
                "\n\nCurrent observation: WebShop [SEP] Instruction: [SEP] Search\n\nAvailable actions:\n"
                "- search[<your query>]\n\nResponse: Output the next action in <action>...</action>."
            )
    tok = policy.tokenizer
    seqs = []
    for p in prompts:
        ids = chat_ids(policy, p)
        out = policy.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tok.pad_token_id)
        seqs.append(out[0, :max_len].tolist())
    return seqs


def chat_ids(policy: Policy, prompt: str) -> torch.Tensor:
    """``[1, T]`` token ids of ``prompt`` as a user turn with the generation prompt."""
    enc = policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return enc["input_ids"].to(policy.device)


@dataclass
class DemoResult:
    prompt: str
    clean_response: str
    rows: list[dict] = field(default_factory=list)
    topk: list[dict] = field(default_factory=list)

    def table(self):
        return pd.DataFrame(self.rows)

    def topk_table(self):
        return pd.DataFrame(self.topk)


@torch.no_grad()
def perturbation_demo(
    policy: Policy,
    prompt: str = DEMO_PROMPT,
    levels: dict[str, float] | None = None,
    calib: list[list[int]] | None = None,
    seed: int = 0,
    max_new_tokens: int = 24,
    top_k: int = 5,
) -> DemoResult:
    """Generate the clean response greedily, then for each perturbation measure, along
    the clean response, ``KL(p_clean || p_pert)`` per position (mean), the top-1
    agreement rate, and the perturbed policy's own greedy response.

    Args:
        policy: a plain (merged) policy.
        levels: family -> strength (default :data:`DEMO_LEVELS`).
        calib: calibration sequences for ``fisher`` / ``sparsegpt`` (default:
            :func:`synthetic_calibration` with 32 sequences).
    """
    levels = dict(DEMO_LEVELS if levels is None else levels)
    tok = policy.tokenizer
    model = policy.model
    ids = chat_ids(policy, prompt)
    gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    resp = gen[0, ids.shape[1]:]
    clean_text = tok.decode(resp, skip_special_tokens=True)
    full = gen[:, : ids.shape[1] + max(len(resp) - 1, 0)]
    pos = slice(ids.shape[1] - 1, full.shape[1])

    def dist():
        return torch.log_softmax(model(full).logits[0, pos].float(), -1)

    base = dist()
    result = DemoResult(prompt=prompt, clean_response=clean_text)
    result.topk += _topk_rows("clean", 0.0, base[0], tok, top_k)
    if calib is None and any(f in levels for f in ("fisher", "sparsegpt")):
        calib = synthetic_calibration(policy, n=32, seed=seed)
    for family, strength in levels.items():
        t0 = time.time()
        with perturbation(model, family, strength, seed=seed, calib=calib, pad_id=tok.pad_token_id):
            lp = dist()
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        kl = (base.exp() * (base - lp)).sum(-1)
        result.rows.append(
            {
                "family": family,
                "strength": strength,
                "kl_mean": kl.mean().item(),
                "kl_first": kl[0].item(),
                "top1_agreement": (lp.argmax(-1) == base.argmax(-1)).float().mean().item(),
                "response": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True),
                "seconds": round(time.time() - t0, 2),
            }
        )
        result.topk += _topk_rows(family, strength, lp[0], tok, top_k)
    return result


def _topk_rows(family, strength, logp, tok, k):
    p = logp.exp()
    vals, idx = p.topk(k)
    return [
        {"family": family, "strength": strength, "rank": r + 1, "token": tok.decode([i]), "prob": v}
        for r, (v, i) in enumerate(zip(vals.tolist(), idx.tolist()))
    ]


def strength_label(family: str, strength: float) -> str:
    """A setting as a reader names it: the family's label over its strength
    (``Gaussian`` / ``σ = 0.1``, ``Quantization`` / ``4 bits``), from the family's spec,
    wrapped to a tick's width."""
    spec = family_spec(family)
    value = f"{strength:g} bits" if family == "rtn" else f"{spec.axis} = {strength:g}"
    return f"{textwrap.fill(spec.label, 12)}\n{value}"


def plot_demo(result: DemoResult, path):
    """Two panels: mean KL per perturbation (points on a log axis, each with its value: a bar's
    length or a stem's foot would mean nothing there) and top-1 agreement with the clean
    policy (bars from 0), in neutral colours (no method is drawn: paper.style)."""
    plt = pyplot()
    df = result.table()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = [strength_label(f, s) for f, s in zip(df.family, df.strength)]
    x = np.arange(len(labels))
    axes[0].plot(x, df.kl_mean, "o", color=NEUTRAL["dark"], ms=6)
    for xi, v in zip(x, df.kl_mean):
        axes[0].annotate(f"{v:.3g}", (xi, v), xytext=(0, 6), textcoords="offset points", ha="center", fontsize=7)
    axes[0].set_xticks(x, labels)
    axes[0].set_xlim(-0.5, len(x) - 0.5)
    axes[0].set_ylabel(r"mean KL($\pi$ || $\pi^\xi$) per token")
    axes[0].set_yscale("log")
    axes[0].margins(y=0.25)
    axes[0].set_title("Shift of next-token distributions along the clean response")
    axes[1].bar(x, df.top1_agreement, color=NEUTRAL["mid"])
    axes[1].set_xticks(x, labels)
    axes[1].set_ylim(0, 1.02)
    axes[1].set_ylabel("top-1 agreement with clean")
    axes[1].set_title("Greedy token unchanged along the clean response")
    fig.tight_layout()
    warn_problems(fig, Path(path).name, ("text", "legend", "crossed"))
    fig.savefig(path, dpi=130, metadata={"Software": None})
    plt.close(fig)
    return path
