"""Behaviour cloning: the supervised warm start on demonstrations (:mod:`.demos`).

The RL stage needs a starting policy that already answers in the agent format
(``<action>...</action>``) and sometimes finishes a task: with a policy that never
emits a valid action every rollout of a group gets the same (penalised) return, all
GiGPO advantages are zero and RL learns nothing.  In the paper that starting policy
is Qwen2.5-1.5B-Instruct (App. B "Base model"); the offline profiles' embedded
SmolLM2-135M-Instruct does not follow the format zero-shot, so they first clone a
scripted demonstrator.  The ``paper`` profile skips this stage.

Pipeline (the warmstart package, bottom to top)::

    demos = collect_demonstrations(pool, "train", range(40), agent)          # demos.py
    result = train_sft(policy, demos, SFTConfig(...), out_dir, agent=agent)  # here: LoRA BC
    report = evaluate_format(policy, pool, "test", range(16), agent)         # heldout.py

or :func:`warm_start` for the first two steps in one call; :mod:`.dagger` adds DAgger
rounds on top, and :mod:`.cache` keys, builds and merges the result for RL.

* **Prompts match RL token for token.**  :func:`train_sft` wraps each demonstration's
  prompt (built as RL builds it: :mod:`.demos`) with :func:`agent.chat_text` and
  tokenizes it exactly as :class:`~sprpo_lib.agent.engines.HFGenerator` does.  The target
  is ``<action>{expert action}</action>`` followed by the tokenizer's end-of-turn token
  (``<|im_end|>`` for ChatML models).
* **Loss.**  Mean token negative log-likelihood of the response tokens only (prompt
  and padding are masked with ``-100``), averaged over all response tokens of an
  optimizer step (``batch_size * grad_accum`` demonstrations).  Log-probabilities are
  computed in float32 with :func:`losses.token_logprobs` from the LM head applied to
  the hidden states *at response positions only*, so no full-vocabulary logits are
  materialised for the prompt (bf16 models are fine).  With ``balance > 0`` a
  demonstration's tokens weigh ``(share of its action's verb)^-balance`` (mean 1 over
  the demonstrations; :func:`~sprpo_lib.warmstart.demos.label_weights`): ALFWorld's rare
  decisions (``take``, ``move``, ``heat``: a few percent of the labels) then count for
  more against the many ``go to`` steps of the search (a class-balanced loss).
* **Outputs** (``out_dir``): ``metrics.jsonl`` (one flushed JSON line per logged
  step), ``sft_summary.json`` (config and results, atomic), ``adapter/`` (peft
  ``save_pretrained``, safetensors; reload with :func:`~sprpo_lib.model.lora.load_adapter`), and for
  :func:`warm_start` ``demos.jsonl``.
* **Resume.**  Every :data:`RESUME_EVERY_S` seconds the trainable weights, the
  optimizer, the data order, the random states and the running sums go to
  ``resume/`` (:mod:`sprpo_lib.infra.resume`: an atomically replaced folder whose files are checked against the
  SHA-256 recorded beside them); a rerun on the same demonstrations and settings
  continues from there and ends with the same adapter and losses as an uninterrupted
  run.  A damaged or foreign ``resume/`` is ignored (warning) and training starts over;
  the folder is removed when training ends.

After the warm start, :func:`models.merge_lora` folds the adapter into the base
weights, so the warm-started model plays the role of the paper's instruct base model
and RL adds its own fresh LoRA on top.
"""
from __future__ import annotations

import logging
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Sequence

import torch
from annotated_types import Ge, Gt, Interval

from sprpo_lib.agent.envs.base import TaskPool
from sprpo_lib.agent.prompt import AgentConfig, chat_text
from sprpo_lib.core.config import SpeedConfig
from sprpo_lib.core.losses import token_logprobs
from sprpo_lib.infra.io import (
    NOT_A_KEY,
    OMIT_AT_DEFAULT,
    JsonLines,
    atomic_write_json,
    canonical_hash,
    file_record,
    key_fields,
    read_cached,
    read_json,
    read_json_lines,
)
from sprpo_lib.infra.hardware import compute_class
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.infra.resume import load_resume_point, save_resume_point
from sprpo_lib.model.layers import native_gqa
from sprpo_lib.model.load import Policy
from sprpo_lib.model.lora import LoraSettings, add_lora, fused_lora, is_peft, lora_on_last_layers, save_adapter
from sprpo_lib.warmstart.demos import (
    DEMONSTRATORS,
    LABEL_VERSIONS,
    Demo,
    collect_demonstrations,
    label_weights,
    save_demos,
)

log = logging.getLogger(__name__)

__all__ = ["SFTConfig", "encode_demo", "collate", "response_nll", "train_sft", "warm_start"]

IGNORE_INDEX = -100
#: seconds between resume points of :func:`train_sft` (a resume point costs the LoRA
#: weights and Adam moments: a few MB)
RESUME_EVERY_S = 120.0
_SCHEDULES = ("constant", "linear", "cosine")


# ----------------------------------------------------------------------------- config
@dataclass
class SFTConfig:
    """Behaviour-cloning settings.

    Attributes:
        epochs: passes over the demonstrations (ignored once ``max_steps`` is hit).
        lr: Adam learning rate of the LoRA parameters (1e-4 .. 5e-4 suits LoRA).
        batch_size: demonstrations per micro-batch (padded together).
        grad_accum: micro-batches per optimizer step; the loss is the token mean over
            all response tokens of the step.
        max_steps: optional cap on optimizer steps (overrides ``epochs``).
        max_seconds: optional wall-clock budget; training stops after the step that
            crosses it.  Makes the number of steps machine-dependent, so a run with a
            time budget is deterministic only given its step count (recorded).
        warmup_steps: linear learning-rate warm-up from 0.
        schedule: ``"constant"``, ``"linear"`` (decay to 0) or ``"cosine"`` after warm-up;
            the decay horizon is the planned number of steps (``max_steps`` or epochs).
        max_grad_norm: gradient-norm clip (``None``/0 disables).
        weight_decay: decoupled weight decay (AdamW); 0 = plain Adam.
        max_prompt_tokens: demonstrations whose chat-formatted prompt is longer are
            **skipped** (counted in the result as ``skipped_long``).  Left-truncating
            them would train on inputs the RL agent never sees (it loses the task
            line); bound prompt length with ``AgentConfig.max_obs_chars`` instead.
            ``None`` keeps all.
        lora: LoRA adapters added if the model is not peft-wrapped yet (paper: 64/64).
        lora_layers: put the adapters only on the last ``lora_layers`` decoder layers
            (``None``: all layers, as the paper).  Backpropagation then stops at the
            lowest adapted layer, a cheaper step; the adapter is merged into the base
            weights before RL, so this only trades warm-start quality for speed.
        seed: LoRA initialisation, shuffling and DAgger-lite actions.
        n_tasks, split, expert_prob: demonstration collection for :func:`warm_start`
            (the first ``n_tasks`` tasks of ``split``).
        demonstrator: who labels the demonstrations: ``"expert"`` (the environment's
            oracle; default) or ``"shopper"`` (WebShop only: a scripted shopper that uses
            only the information in the prompt (``python -m sprpo_lib.agent.envs`` scores it);
            the oracle clicks the goal's hidden product id, a choice a cloned policy
            cannot infer from the page) or ``"explorer"`` (ALFWorld only: searches the
            receptacles in the order where the training games keep the object; the
            planner goes straight to the hidden object, which a cloned policy cannot
            infer).  See :func:`~sprpo_lib.warmstart.demos.collect_demonstrations`.
        episode_steps: step limit of a demonstration episode (None: the pool's own, 15 on
            WebShop and 50 on ALFWorld).  Set to RL's ``env.max_steps``, the demonstrations
            cover the states and the ``[Step k]`` numbers RL's prompts show, not the long
            wanders that random actions cause after that limit.
        repeat_prob: probability of executing the previous action again during the
            collection (the state after a rejected repeat, labelled with the way out; see
            the module docstring).  0 (default): never.
        balance: weight a demonstration's loss by ``(share of its action's verb)^-balance``
            (:func:`~sprpo_lib.warmstart.demos.label_weights`; 0: every response token weighs the same, 1: every verb
            weighs the same in all): on ALFWorld the search's ``go to`` outnumbers the
            decision to ``take`` the object in sight.
        dagger_rounds: rounds of DAgger (Ross et al., 2011) after the first cloning
            (:func:`sprpo_lib.warmstart.dagger.dagger`): the clone plays ``dagger_tasks`` demonstration tasks at
            ``dagger_temperature``, the demonstrator labels every state it reached, and the
            clone trains ``epochs`` more on those labels plus earlier demonstrations.  A
            clone's mistakes lead it to states no demonstration shows (on ALFWorld a
            rejected ``go to`` repeated until the step limit); DAgger labels exactly those.
            0 (default): none.
        dagger_tasks: tasks a round plays, from the demonstration tasks (indices
            ``0 .. n_tasks-1``, a round's window following the previous one's), so the
            held-out tasks of ``eval_tasks`` stay unseen.
        dagger_temperature: sampling temperature of the clone's rollouts (0.4: the paper's
            validation temperature, the states an evaluation reaches).
        dagger_replay: earlier demonstrations drawn (seeded, without replacement) per new
            label into a round's training set.  Classic DAgger retrains on everything
            collected, a round as costly as the first cloning; here a round trains on its
            new labels and ``dagger_replay`` times as many old ones (1: half new, half
            old), continuing from the previous round's adapter.
        log_every: optimizer steps between lines of ``metrics.jsonl`` (and the progress
            bar's loss); the first and last step are always logged.
        shuffle: reshuffle the demonstrations every epoch (seeded).
        eval_tasks: after the warm start of a training run, play this many tasks of
            ``split`` that were *not* demonstrated (indices ``n_tasks ..``), once each,
            at the RL rollout temperature, and store the success rate with the cached
            adapter (``eval.json``): the starting success the RL stage improves on.
            0 skips it.
        agreement: with ``eval_tasks``, also the clone's greedy agreement with the
            demonstrator on the demonstrator's states of those tasks, per verb
            (:func:`sprpo_lib.warmstart.heldout.agreement`, ``agreement.json``): which decisions the clone has not
            learned.  Not part of the cache key (it measures the adapter, never changes it).
    """

    epochs: Annotated[int, Ge(1)] = 3
    lr: Annotated[float, Gt(0)] = 1e-4
    batch_size: Annotated[int, Ge(1)] = 4
    grad_accum: Annotated[int, Ge(1)] = 1
    max_steps: Annotated[int, Ge(1)] | None = None
    max_seconds: Annotated[float, Gt(0)] | None = None
    warmup_steps: Annotated[int, Ge(0)] = 0
    schedule: str = "constant"
    max_grad_norm: Annotated[float, Ge(0)] | None = 1.0
    weight_decay: Annotated[float, Ge(0)] = 0.0
    max_prompt_tokens: Annotated[int, Ge(1)] | None = 2048
    lora: LoraSettings = field(default_factory=LoraSettings)
    lora_layers: Annotated[int, Ge(1)] | None = None
    seed: Annotated[int, Ge(0)] = 0
    n_tasks: Annotated[int, Ge(1)] = 40
    split: str = "train"
    expert_prob: Annotated[float, Interval(ge=0, le=1)] = 1.0
    demonstrator: str = "expert"
    episode_steps: Annotated[int, Ge(1)] | None = field(default=None, metadata=OMIT_AT_DEFAULT)
    repeat_prob: Annotated[float, Interval(ge=0, lt=1)] = field(default=0.0, metadata=OMIT_AT_DEFAULT)
    balance: Annotated[float, Interval(ge=0, le=2)] = field(default=0.0, metadata=OMIT_AT_DEFAULT)
    dagger_rounds: Annotated[int, Ge(0)] = field(default=0, metadata=OMIT_AT_DEFAULT)
    dagger_tasks: Annotated[int, Ge(1)] = field(default=50, metadata=OMIT_AT_DEFAULT)
    dagger_temperature: Annotated[float, Ge(0)] = field(default=0.4, metadata=OMIT_AT_DEFAULT)
    dagger_replay: Annotated[float, Ge(0)] = field(default=1.0, metadata=OMIT_AT_DEFAULT)
    log_every: Annotated[int, Ge(1)] = 10
    shuffle: bool = True
    eval_tasks: Annotated[int, Ge(0)] = 0
    agreement: bool = field(default=False, metadata=NOT_A_KEY)

    def __post_init__(self):
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)
        check_ranges(self)
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {self.schedule!r}")
        DEMONSTRATORS.get(self.demonstrator)  # an unknown name lists the valid ones


# ----------------------------------------------------------------------------- tokenization
def encode_demo(tokenizer, demo: Demo, agent: AgentConfig | None = None) -> tuple[list[int], list[int]]:
    """``(prompt_ids, response_ids)`` of a demonstration.

    The prompt is tokenized exactly as :class:`~sprpo_lib.agent.engines.HFGenerator` tokenizes it (chat
    template with the generation prompt, no extra special tokens), so ``prompt_ids``
    equals the ``Generation.prompt_ids`` RL records for the same state.  The response is
    the target text followed by the end-of-turn (eos) token.
    """
    text = chat_text(tokenizer, demo.prompt, agent)
    p_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(demo.response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        r_ids = r_ids + [tokenizer.eos_token_id]
    return list(p_ids), list(r_ids)


def collate(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``(prompt_ids, response_ids)`` pairs into a batch.

    Returns ``input_ids``, ``attention_mask``, ``position_ids`` and ``labels``: the
    input ids where a token is a training target (response tokens, eos included) and
    ``-100`` on prompt tokens and padding.
    """
    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    att = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        labels[i, len(p):n] = torch.tensor(r, dtype=torch.long)
        att[i, :n] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": att, "position_ids": pos, "labels": labels}


def _base_and_head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    head = base.get_output_embeddings()
    if body is None or head is None:
        raise TypeError(f"{type(base).__name__}: expected a causal LM with a decoder body and an LM head")
    return body, head


def response_nll(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token negative log-likelihood (float32) of the positions with a label.

    Runs the decoder body once, then applies the LM head only to the hidden states
    that predict a labelled token (position ``t-1`` for label ``t``), so the
    full-vocabulary logits exist only for response tokens.  Returns a 1-D tensor in
    row-major order of the labelled positions.
    """
    body, head = _base_and_head(model)
    dev = next(model.parameters()).device
    out = body(input_ids=batch["input_ids"].to(dev), attention_mask=batch["attention_mask"].to(dev),
               position_ids=batch["position_ids"].to(dev), use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    targets = batch["labels"][:, 1:].to(dev)
    sel = targets != IGNORE_INDEX
    logits = head(hidden[:, :-1][sel])
    return -token_logprobs(logits, targets[sel])


# ----------------------------------------------------------------------------- training


def lr_at(step: int, total: int, cfg: SFTConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - frac)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * frac))


def train_sft(
    policy: Policy,
    demos: Sequence[Demo],
    cfg: SFTConfig | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    agent: AgentConfig | None = None,
    speed: SpeedConfig | None = None,
) -> dict:
    """Behaviour cloning with LoRA: minimise the response-token NLL of ``demos``.

    Args:
        policy: the policy; LoRA (``cfg.lora``) is added with :func:`models.add_lora`
            unless the model is already peft-wrapped (then its trainable parameters are
            trained).  ``policy.model`` is modified in place and left in eval mode.
        demos: demonstrations from :func:`~sprpo_lib.warmstart.demos.collect_demonstrations`.
        cfg: :class:`SFTConfig`.
        out_dir: where ``metrics.jsonl``, ``sft_summary.json`` and ``adapter/`` go
            (nothing is written if ``None``).
        progress: tqdm bar over optimizer steps.
        agent: the agent settings whose chat template wrapping (system prompt) the RL
            agent uses; default :class:`AgentConfig`.
        speed: the RL update's speed levers that the forward and backward take (``fused_lora``,
            ``native_gqa``, ``attention``, ``attention_chunk``): the same steps up to float
            rounding; default :class:`SpeedConfig`.

    Returns:
        Summary dict: ``steps``, ``epochs_done``, ``demos``, ``skipped_long``,
        ``response_tokens`` (trained on, all steps), ``first_loss``, ``final_loss``
        (token mean over the last logged window), ``seconds``, ``stopped`` (why it
        ended), ``adapter`` (path or ``None``), ``trainable_params``.

    Long on purpose: the resume point (optimizer, step, data order) is the loop's own state;
    split across functions, what a killed run must restore would no longer be in one place."""
    cfg = cfg or SFTConfig()
    agent = agent or AgentConfig()
    speed = speed or SpeedConfig()
    t_start = time.perf_counter()
    tok = policy.tokenizer
    out = Path(out_dir) if out_dir is not None else None

    encoded, kept, skipped = [], [], 0
    for d in demos:
        p, r = encode_demo(tok, d, agent)
        if cfg.max_prompt_tokens is not None and len(p) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        encoded.append((p, r))
        kept.append(d)
    weights = label_weights([d.response for d in kept], cfg.balance) if cfg.balance else None
    if skipped:
        log.warning("skipped %d of %d demonstrations with prompts over %d tokens", skipped, len(demos),
                    cfg.max_prompt_tokens)
    if not encoded:
        raise ValueError(f"no demonstrations to train on ({len(demos)} given, {skipped} over max_prompt_tokens)")

    if not is_peft(policy.model):
        add_lora(policy, lora_on_last_layers(policy.model, cfg.lora, cfg.lora_layers), seed=cfg.seed)
    model = policy.model
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    per_step = cfg.batch_size * cfg.grad_accum
    steps_per_epoch = math.ceil(len(encoded) / per_step)
    planned = steps_per_epoch * cfg.epochs
    total = min(planned, cfg.max_steps) if cfg.max_steps else planned
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    rng = random.Random(cfg.seed)
    metrics = JsonLines(out / "metrics.jsonl") if out else None
    key = canonical_hash({"cfg": key_fields(cfg), "agent": key_fields(agent), "demos": encoded,
                          "params": [n for n, p in model.named_parameters() if p.requires_grad]})
    run = {"step": 0, "n_tok_all": 0, "first_loss": None, "final_loss": None, "win_nll": 0.0, "win_tok": 0,
           "elapsed_s": 0.0, "epoch": 0, "s0": 0, "order": None}
    resumed = load_resume_point(out / "resume", key, model, opt, rng) if out else None
    if resumed:
        run.update(resumed)
        log.info("sft: resuming at step %d of %d", run["step"], total)
    if metrics is not None:  # a fresh run starts a fresh file; a resumed one keeps the steps it has done
        metrics.truncate(lambda row: row.get("step", 0) <= run["step"] if resumed else False)
    t_start -= run["elapsed_s"]
    t_saved = time.perf_counter()

    step, n_tok_all, stopped = run["step"], run["n_tok_all"], "done"
    first_loss, final_loss = run["first_loss"], run["final_loss"]
    win_nll, win_tok = run["win_nll"], run["win_tok"]
    bar = progress_bar(total=total, desc="warm start (sft)", disable=not progress,  # minutes: shown in line mode too
                       initial=step)
    model.train()
    try:
        for epoch in range(run["epoch"], cfg.epochs):
            order = run["order"] if resumed and epoch == run["epoch"] else list(range(len(encoded)))
            if cfg.shuffle and not (resumed and epoch == run["epoch"]):
                rng.shuffle(order)
            first_s0 = run["s0"] if resumed and epoch == run["epoch"] else 0
            for s0 in range(first_s0, len(order), per_step):
                if step >= total:
                    break
                if out is not None and time.perf_counter() - t_saved >= RESUME_EVERY_S:
                    save_resume_point(out / "resume", key, model, opt, rng, {
                        "step": step, "n_tok_all": n_tok_all, "first_loss": first_loss, "final_loss": final_loss,
                        "win_nll": win_nll, "win_tok": win_tok, "elapsed_s": time.perf_counter() - t_start,
                        "epoch": epoch, "s0": s0, "order": order})
                    t_saved = time.perf_counter()
                ids = order[s0 : s0 + per_step]
                chunk = [encoded[i] for i in ids]
                n_tok = sum(len(r) for _, r in chunk)
                w_tok = None if weights is None else sum(weights[i] * len(encoded[i][1]) for i in ids)
                lr = lr_at(step, total, cfg)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.zero_grad(set_to_none=True)
                nll_sum = 0.0
                with fused_lora(model, speed.fused_lora), \
                        native_gqa(model, speed.native_gqa, speed.attention, speed.attention_chunk):
                    for m0 in range(0, len(chunk), cfg.batch_size):
                        nll = response_nll(model, collate(chunk[m0 : m0 + cfg.batch_size], pad_id))
                        if weights is None:
                            (nll.sum() / n_tok).backward()
                        else:  # each response token weighs its demonstration's weight
                            sub = ids[m0 : m0 + cfg.batch_size]
                            w = torch.repeat_interleave(torch.tensor([weights[i] for i in sub], dtype=nll.dtype),
                                                        torch.tensor([len(encoded[i][1]) for i in sub]))
                            ((nll * w.to(nll.device)).sum() / w_tok).backward()
                        nll_sum += float(nll.detach().sum())
                grad_norm = None
                if cfg.max_grad_norm:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
                opt.step()
                step += 1
                n_tok_all += n_tok
                win_nll, win_tok = win_nll + nll_sum, win_tok + n_tok
                if first_loss is None:
                    first_loss = nll_sum / n_tok
                elapsed = time.perf_counter() - t_start
                over_time = cfg.max_seconds is not None and elapsed >= cfg.max_seconds
                if step % cfg.log_every == 0 or step == 1 or step >= total or over_time:
                    final_loss = win_nll / win_tok
                    row = {"step": step, "epoch": epoch, "loss": round(final_loss, 6), "tokens": win_tok,
                           "lr": lr, "grad_norm": None if grad_norm is None else round(grad_norm, 6),
                           "elapsed_s": round(elapsed, 2)}
                    if metrics is not None:
                        metrics.append_rows(row)
                    bar.set_postfix(loss=f"{final_loss:.4f}")
                    win_nll, win_tok = 0.0, 0
                bar.update(1)
                if over_time:
                    stopped = "max_seconds"
                    break
            if stopped != "done" or step >= total:
                break
        if stopped == "done" and step < planned:
            stopped = "max_steps"
    finally:
        bar.close()
        model.eval()
        for p in params:  # leave the policy as inference code expects it
            p.grad = None
    if win_tok:
        final_loss = win_nll / win_tok
    result = {
        "steps": step,
        "epochs_done": round(step / steps_per_epoch, 3),
        "demos": len(encoded),
        "skipped_long": skipped,
        "response_tokens": n_tok_all,
        "first_loss": first_loss,
        "final_loss": final_loss,
        "seconds": round(time.perf_counter() - t_start, 2),
        "machine": compute_class(),
        "stopped": stopped,
        "trainable_params": sum(p.numel() for p in params),
        "adapter": None,
    }
    if out is not None:
        result["adapter"] = str(save_adapter(policy, out / "adapter"))
        atomic_write_json(out / "sft_summary.json", {"config": asdict(cfg), "agent": asdict(agent), "result": result,
                                                     "model": policy.spec})
        shutil.rmtree(out / "resume", ignore_errors=True)
    policy.meta["sft"] = {k: result[k] for k in ("steps", "demos", "final_loss")}
    return result


def warm_start(
    policy: Policy,
    pool: TaskPool,
    cfg: SFTConfig | None = None,
    agent: AgentConfig | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    speed: SpeedConfig | None = None,
) -> dict:
    """Collect demonstrations on the first ``cfg.n_tasks`` tasks of ``cfg.split`` and
    run :func:`train_sft` (with the speed levers ``speed``); returns its summary plus the collection stats
    (``collect``).  Writes ``demos.jsonl`` to ``out_dir`` too, with ``demos.json`` (its
    record, settings key and stats): a rerun into the same folder trains on them again."""
    cfg = cfg or SFTConfig()
    agent = agent or AgentConfig()
    n = min(cfg.n_tasks, pool.splits()[cfg.split])
    key = canonical_hash({"split": cfg.split, "tasks": n, "expert_prob": cfg.expert_prob, "seed": cfg.seed,
                          "demonstrator": cfg.demonstrator, "episode_steps": cfg.episode_steps,
                          "repeat_prob": cfg.repeat_prob, "agent": asdict(agent),
                          "labels": LABEL_VERSIONS.get(cfg.demonstrator)})
    cached = None if out_dir is None else _saved_demos(Path(out_dir), key)
    if cached is not None:  # a resumed warm start (a killed one collects minutes of demonstrations again)
        demos, stats = cached
        log.info("reusing %d demonstrations from %s", len(demos), Path(out_dir) / "demos.jsonl")
    else:
        stats: dict = {}
        t0 = time.perf_counter()
        demos = collect_demonstrations(pool, cfg.split, range(n), agent, cfg.expert_prob, cfg.seed, stats=stats,
                                       demonstrator=cfg.demonstrator, max_steps=cfg.episode_steps,
                                       repeat_prob=cfg.repeat_prob, progress=progress)
        stats["seconds"], stats["machine"] = round(time.perf_counter() - t0, 2), compute_class()
        if out_dir is not None:
            path = save_demos(Path(out_dir) / "demos.jsonl", demos)
            atomic_write_json(Path(out_dir) / "demos.json", {"key": key, "file": file_record(path), "collect": stats})
    result = train_sft(policy, demos, cfg, out_dir, progress, agent, speed)
    result["collect"] = stats
    if out_dir is not None:  # the summary records the collection too (its seconds join the stage table)
        summary = read_json(Path(out_dir) / "sft_summary.json")
        atomic_write_json(Path(out_dir) / "sft_summary.json", {**summary, "result": result})
    return result


def _saved_demos(out: Path, key: str) -> tuple[list[Demo], dict] | None:
    """The demonstrations a killed :func:`warm_start` already collected in ``out`` with the
    same collection settings (``key``) and their stats, when ``demos.jsonl`` matches the
    record ``demos.json`` keeps of it; ``None`` (collect again) otherwise.  The settings
    do not name the task pool: a folder holds one pool's warm start (the Trainer keys it)."""
    meta = read_cached(out / "demos.json")
    if not isinstance(meta, dict) or meta.get("key") != key or not isinstance(meta.get("file"), dict):
        return None
    rows = read_cached(out / "demos.jsonl", read_json_lines, meta["file"])
    if rows is None:
        return None
    return [Demo(**r) for r in rows], dict(meta.get("collect") or {})
