"""What every generation engine shares: the records and settings of a call
(:class:`Generation`, :class:`GenerationConfig`), the :class:`Engine` interface, and the
weight edits a back end with its own copy of the weights is updated with.

An engine turns agent prompts into :class:`Generation` records exactly as
:class:`~sprpo_lib.agent.engines.hf.HFGenerator` does (chat template, seeding by
``(cfg.seed, calls)``, stop after ``cfg.stop``, end-of-turn token kept), so any of them can
serve :func:`~sprpo_lib.agent.rollout.run_groups`.  Back ends that hold their own copy of the
weights (a compiled graph, a server) are updated between iterations with
``load_weights(bake_weights(model, xi, mask))``: every perturbation the project applies
is a weight edit (LoRA merges, FFN channel factors fold into ``W_down``'s columns).

* :func:`bake_weights`: plain weights of a (peft) policy with LoRA merged and the FFN
  factor ``(1 + xi) * mask`` folded in, without touching the model.
* :func:`check_generation_config`, :func:`eos_ids`, :func:`select_tokens`: generate()'s
  semantics, shared by the back ends that decode themselves.

Plug-ins (:mod:`~sprpo_lib.agent.engines.hf`, :mod:`~sprpo_lib.agent.engines.openvino`,
:mod:`~sprpo_lib.agent.engines.vllm`) import this module; the registry in
:mod:`sprpo_lib.agent.engines` names them by import path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Mapping, Protocol, Sequence, runtime_checkable

import torch
from annotated_types import Ge, Interval
from torch import nn

from sprpo_lib.core.perturb import active_factor
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.model.layers import ffn_modules


# ----------------------------------------------------------------------------- generation records and settings
@dataclass
class Generation:
    text: str
    prompt_ids: list[int]
    response_ids: list[int]


class Generator(Protocol):
    def __call__(self, prompts: Sequence[str]) -> list[Generation]: ...


@dataclass
class GenerationConfig:
    """Sampling settings (App. B/C: temperature 0.4 for validation; training samples
    at the rollout temperature, 1.0 by default as in verl).

    ``prefix_caching``: engines that keep a paged KV cache (``openvino``, ``vllm``) reuse
    the keys/values of prompt prefixes they computed in earlier calls with the same weights
    (an agent's next prompt repeats its task and most of its interaction context); vLLM's
    default, so on by default.  It changes what is recomputed, not what is computed; ``hf``
    has no cache across calls and ignores it.

    ``max_batched_tokens``: tokens per step of the ``openvino`` engine's continuous-batching
    scheduler (GenAI's ``max_num_batched_tokens``; prompts are prefilled in chunks of this
    size, fused with the decoding rows).  GenAI's CPU default is 256; 1,024 evaluated the
    ``cpu`` profile's held-out set about 10% faster (``sprpo-bench eval``).  The chunking
    changes bfloat16 rounding, so it is part of the evaluation cache key; ``hf`` and
    ``vllm`` (which keeps vLLM's own default) ignore it."""

    temperature: Annotated[float, Ge(0)] = 1.0
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    max_new_tokens: Annotated[int, Ge(1)] = 48
    batch_size: Annotated[int, Ge(1)] = 16
    stop: str = "</action>"
    seed: Annotated[int, Ge(0)] = 0
    prefix_caching: bool = True
    max_batched_tokens: Annotated[int, Ge(16)] = 1024

    def __post_init__(self):
        check_ranges(self)



# ----------------------------------------------------------------------------- weights
def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _lora_delta(module) -> torch.Tensor | None:
    """Sum of ``scaling * B @ A`` over the active, unmerged adapters of a peft LoRA
    layer, in float32 (None when no adapter contributes)."""
    if getattr(module, "disable_adapters", False):
        return None
    delta = None
    merged = set(getattr(module, "merged_adapters", []))
    for name in module.active_adapters:
        if name in merged or name not in module.lora_A:
            continue
        if getattr(module, "use_dora", {}).get(name, False) or getattr(module, "lora_bias", {}).get(name, False):
            raise NotImplementedError(f"bake_weights: adapter {name!r} uses DoRA or a LoRA bias; only plain LoRA is baked")
        a = module.lora_A[name].weight.float()
        b = module.lora_B[name].weight.float()
        d = (b @ a) * float(module.scaling[name])
        if getattr(module, "fan_in_fan_out", False):
            d = d.T
        delta = d if delta is None else delta + d
    return delta


def _ffn_factor(xi: torch.Tensor | None, mask: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
    """``(1 + xi) * mask`` as a float32 ``[layers, channels]`` tensor (None: identity)."""
    f = None
    for name, t in (("xi", xi), ("mask", mask)):
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {shape} (layers x FFN channels, one "
                             "setting for the whole model: per-sequence factors cannot be baked into weights)")
        t = t.detach().float().cpu()
        t = 1.0 + t if name == "xi" else t
        f = t if f is None else f * t
    return f


@torch.no_grad()
def bake_weights(model: nn.Module, xi: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The plain (non-peft) state dict that computes what ``model`` computes under
    ``FFNChannels(model).set(xi=xi, mask=mask)``.

    LoRA layers become ``W + scaling * B @ A``; each FFN layer's channel factor
    ``f = (1 + xi) * mask`` scales the columns of its ``down_proj`` weight (``W h*f =
    (W diag f) h``).  Edited weights are computed in float32 and cast to the weight's own
    dtype once; the others are the model's tensors themselves (not copied).  The model is
    not modified.  Keys are those of the unwrapped transformers model, so the result loads
    with ``load_state_dict`` into a fresh copy of the base architecture."""
    base = base_model(model)
    names = {id(m): n for n, m in base.named_modules()}
    mlps = ffn_modules(base)
    shape = (len(mlps), mlps[0].down_proj.in_features)
    factor = _ffn_factor(xi, mask, shape)
    out: dict[str, torch.Tensor] = {}
    for key, t in base.state_dict().items():
        if ".lora_" in key or "lora_magnitude" in key:
            continue
        out[key.replace(".base_layer.", ".")] = t
    edits: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
    for n, m in base.named_modules():
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            edits[f"{n}.weight"] = (m.base_layer.weight, _lora_delta(m), None)
    if factor is not None:
        for layer, mlp in enumerate(mlps):
            key = f"{names[id(mlp)]}.down_proj.weight"
            w, delta, _ = edits.get(key, (out[key], None, None))
            edits[key] = (w, delta, factor[layer])
    for key, (w, delta, f) in edits.items():
        if delta is None and f is None:
            continue
        work = w.to(torch.promote_types(w.dtype, torch.float32), copy=True)
        if delta is not None:
            work += delta.to(device=work.device, dtype=work.dtype)
        if f is not None:
            work *= f.to(device=work.device, dtype=work.dtype)[None, :]
        out[key] = work.to(w.dtype)
    return out


def effective_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """:func:`bake_weights` of what ``model`` computes right now: LoRA merged and the
    factor of every :class:`~sprpo_lib.core.perturb.FFNChannels` hook attached to it folded in
    (:func:`~sprpo_lib.core.perturb.active_factor`), so an engine with its own weights serves
    the same perturbed policy as the hooked model."""
    f = active_factor(model)
    return bake_weights(model, xi=None if f is None else f - 1.0)


def plain_copy(model: nn.Module) -> nn.Module:
    """A fresh instance of ``model``'s transformers architecture (no peft, no hooks), same
    config, dtype and device, in eval mode with gradients off; weights to be loaded."""
    base = base_model(model)
    p = next(base.parameters())
    with torch.random.fork_rng(devices=[]):  # random init must not move the caller's stream
        fresh = type(base)(base.config)
    fresh.to(device=p.device, dtype=p.dtype).eval()
    fresh.generation_config = base.generation_config
    for q in fresh.parameters():
        q.requires_grad_(False)
    return fresh


def load_baked(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a :func:`bake_weights` state dict into a plain model; every parameter must be
    given (tied weights may appear under either name)."""
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if isinstance(getattr(model, "_tied_weights_keys", None), dict):
        tied = set(model._tied_weights_keys)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise KeyError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


# ----------------------------------------------------------------------------- interface
@runtime_checkable
class Engine(Protocol):
    """What :func:`~sprpo_lib.agent.rollout.run_groups` needs from a generator, plus weight
    updates.  ``calls`` counts ``__call__``s: call ``k`` samples from the stream seeded by
    ``(cfg.seed, k)``."""

    cfg: GenerationConfig
    calls: int

    def __call__(self, prompts: Sequence[str]) -> list[Generation]: ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...


def close_engine(engine) -> None:
    """Release what an engine holds outside Python's memory (a worker process, a server,
    scratch files) now rather than at garbage collection; engines without a ``close``
    hold nothing of the kind.  Calls past their deadline that the engine repeated
    (``stats["retries"]``) are logged."""
    retries = getattr(engine, "stats", {}).get("retries", 0)
    if retries:
        logging.getLogger(__name__).warning("%s: %d generate call(s) stalled and were repeated",
                                            type(engine).__name__, retries)
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def call_seed(cfg: GenerationConfig, calls: int) -> int:
    """The seed of call number ``calls`` (the same as :class:`~sprpo_lib.agent.engines.HFGenerator`'s)."""
    return cfg.seed * 1_000_003 + calls


def cut_response(ids: list[int], eos_id: int | None, pad_id: int | None) -> list[int]:
    """Response tokens as :class:`~sprpo_lib.agent.engines.HFGenerator` keeps them: up to and
    including the end-of-turn token, or up to (excluding) a padding token."""
    for i, t in enumerate(ids):
        if t == eos_id:
            return ids[: i + 1]
        if t == pad_id:
            return ids[:i]
    return ids


def prefill_groups(prompts: Sequence[Sequence[int]], prefill_tokens: int) -> list[Sequence[Sequence[int]]]:
    """Consecutive groups of (equal-width, left-padded) prompts, each about ``prefill_tokens``
    tokens and at least one prompt: the prefill chunks of the loop backends."""
    groups, start = [], 0
    while start < len(prompts):
        n = max(1, min(len(prompts) - start, prefill_tokens // max(1, len(prompts[start]))))
        groups.append(prompts[start : start + n])
        start += n
    return groups


def accept_tokens(tokens: Sequence[int], alive: list[int], new: list[list[int]], tails: list[str],
                  piece, eos: set[int], pad: int | None, stop: str) -> list[int]:
    """One decode step's bookkeeping for the engines that decode themselves: append each live
    row's token to ``new[row]`` and return the positions (in ``alive``) of the rows still
    going, i.e. not ended by an end-of-sequence or padding token or by ``stop``, which is
    matched on the row's text tail (``tails[row]``, updated; ``piece(t)``: a token's text)."""
    keep_tail = max(0, len(stop) - 1)
    keep = []
    for j, t in enumerate(tokens):
        row = alive[j]
        new[row].append(t)
        window = tails[row] + piece(t) if stop else ""
        if t in eos or t == pad or (stop and stop in window):
            continue
        tails[row] = window[len(window) - keep_tail:] if keep_tail else ""
        keep.append(j)
    return keep


# generation_config settings that make transformers' generate() change the logits in ways
# HFEngine does not reproduce; a model that sets one of them is refused, not silently
# decoded differently.  (repetition_penalty is reproduced.)
_UNSUPPORTED_GEN = ("no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                    "forced_bos_token_id", "forced_eos_token_id", "sequence_bias", "min_length", "min_new_tokens",
                    "encoder_repetition_penalty", "exponential_decay_length_penalty", "renormalize_logits")
_UNSUPPORTED_SAMPLING = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def check_generation_config(model: nn.Module, sampling: bool) -> float:
    """The model's repetition penalty; raise for settings :class:`HFEngine` would ignore."""
    from transformers import GenerationConfig as HFConfig  # heavy (seconds to import): loaded on first use

    gc, default = getattr(model, "generation_config", None), HFConfig()
    if gc is None:
        return 1.0
    names = _UNSUPPORTED_GEN + (_UNSUPPORTED_SAMPLING if sampling else ())
    bad = {n: getattr(gc, n, None) for n in names if getattr(gc, n, None) != getattr(default, n, None)}
    if bad:
        raise NotImplementedError(f"HFEngine does not reproduce these generation_config settings of the model: {bad}; "
                                  "use sprpo_lib.agent.engines.HFGenerator (engine 'hf' needs plain temperature/top-p decoding)")
    return float(getattr(gc, "repetition_penalty", None) or 1.0)


def eos_ids(model: nn.Module, tokenizer) -> set[int]:
    """End-of-sequence ids generate() stops on (the model's generation config) plus the
    tokenizer's end-of-turn token."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def select_tokens(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float, cfg: GenerationConfig,
            gen: torch.Generator | None) -> torch.Tensor:
    """Next tokens from float32 logits ``[b, vocab]`` with generate()'s semantics:
    repetition penalty over ``seen`` ids, then greedy (temperature 0) or temperature,
    top-p (nucleus, at least one token kept; top-k off) and multinomial sampling."""
    if seen is not None and penalty != 1.0:
        s = logits.gather(1, seen)
        logits = logits.scatter(1, seen, torch.where(s < 0, s * penalty, s / penalty))
    if cfg.temperature == 0:
        return logits.argmax(-1)
    scores = logits / cfg.temperature
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        drop = sorted_scores.softmax(-1).cumsum(-1) <= 1 - cfg.top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(scores.softmax(-1), 1, generator=gen).squeeze(1)
