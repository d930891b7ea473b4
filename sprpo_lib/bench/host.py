"""``sprpo-bench host``: the host's share of a decode step of the built-in engines at batch 128.

The model has the paper's depth and architecture (28 Qwen2 layers) but a few channels, so its
arithmetic is negligible and a decode step costs what the host does: Python, op dispatch and the
engine's own bookkeeping.  Each step splits into the time inside the model's forward (on a GPU:
kernel launches, which a CUDA graph replaces by one) and the time outside it (token selection,
the host sync, stop-string checks, cache bookkeeping), timed as the gap between one decode
forward's end and the next one's start, which adds to every step on any device.
Where transformers' continuous batching (``generate_batch``) runs, its decode time per step is
measured beside them on the same prompts.  A leaf: nothing in the library imports it.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from sprpo_lib.agent.engines import GenerationConfig, close_engine, engine_factory
from sprpo_lib.agent.prompt import AgentConfig, chat_text
from sprpo_lib.bench.suite import webshop_prompts
from sprpo_lib.model.load import Policy, TinyConfig, build_tiny

#: A model as deep as Qwen2.5-1.5B (28 layers, 12 heads over 2 KV heads) and 48 channels wide.
HOST_SHAPE = TinyConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2)


def deep_narrow_policy(seed: int = 0) -> Policy:
    """The bench's policy: :data:`HOST_SHAPE`, random (seeded), float32, on the CPU."""
    model, tok = build_tiny("tiny-qwen2", seed=seed, cfg=HOST_SHAPE)
    return Policy(model.eval(), tok, "host-bench", "random-init")


class _ForwardClock:
    """Every forward of ``model``: its start, end and input tokens (pre/post hooks on the top module)."""

    def __init__(self, model):
        self.calls: list[tuple[float, float, int]] = []
        self._t, self._n = 0.0, 0
        self._hooks = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                       model.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._n = int(ids.numel()) if ids is not None else 0
        self._t = time.perf_counter()

    def _post(self, *_):
        self.calls.append((self._t, time.perf_counter(), self._n))

    def close(self):
        for h in self._hooks:
            h.remove()


def _decode_steps(calls: list[tuple[float, float, int]], batch: int) -> dict:
    """A decode step from the forwards that feed at most one token per sequence (``batch`` tokens
    at most; a prefill feeds whole prompts): the median forward, and the median gap between one
    decode forward's end and the next one's start, the engine's host work between them (its mean
    too: a step that drops finished rows copies the cache, which the median leaves out)."""
    dec = [c for c in calls if c[2] <= batch]
    if len(dec) < 2:
        return {"error": f"{len(dec)} decode forwards: too few to time a step"}
    inside = statistics.median(e - s for s, e, _ in dec)
    gaps = [b[0] - a[1] for a, b in zip(dec, dec[1:])]
    outside = statistics.median(gaps)
    return {"decode_steps": len(dec), "step_ms": round(1e3 * (inside + outside), 3),
            "forward_ms": round(1e3 * inside, 3), "outside_ms": round(1e3 * outside, 3),
            "outside_mean_ms": round(1e3 * statistics.fmean(gaps), 3)}  # with the occasional row drop


def _timed(model, call, batch: int) -> tuple[dict, object]:
    """``call()`` with its forwards clocked: the decode step's split (:func:`_decode_steps`), wall, result."""
    clock = _ForwardClock(model)
    try:
        t0 = time.perf_counter()
        res = call()
        wall = time.perf_counter() - t0
    finally:
        clock.close()
    return {"wall_s": round(wall, 3), **_decode_steps(clock.calls, batch)}, res


def _median(runs: list[dict]) -> dict:
    """Each repeat's per-step numbers, and their medians as the record's."""
    out = dict(runs[0])
    for k in ("step_ms", "forward_ms", "outside_ms", "outside_mean_ms"):
        vals = sorted(r[k] for r in runs)
        out[k] = vals[len(vals) // 2]
        out[f"{k}_repeats"] = [r[k] for r in runs]
    return out


def engine_host(policy: Policy, name: str, prompts: Sequence[str], batch: int, new_tokens: int) -> dict:
    """One built-in engine (``hf``, ``hf-graphs``, with options as ``hf:compact=0.25``) on ``prompts``;
    a stop string no token completes, so rows run until their end token or ``new_tokens``."""
    base, _, opts = name.partition(":")  # e.g. hf:compact=0.25, an engine option
    kw = {k: float(v) for k, v in (o.split("=", 1) for o in opts.split(",") if o)}
    eng = engine_factory(base)(policy, GenerationConfig(temperature=0.0, max_new_tokens=new_tokens, batch_size=batch,
                                                        stop="\x00never"), None, **kw)
    try:
        eng(prompts[:2])  # warm-up
        rec, res = _timed(policy.model, lambda: eng(prompts), batch)
    finally:
        close_engine(eng)
    return {**rec, "new_tokens": sum(len(g.response_ids) for g in res), "tokens": [g.response_ids for g in res]}


def generate_batch_host(policy: Policy, prompts: Sequence[str], new_tokens: int) -> dict:
    """transformers' continuous batching on the same prompts (greedy, no end token), its decode
    forwards timed as the engines'; or the reason it does not run here."""
    from transformers import GenerationConfig as HFGenerationConfig  # heavy: loaded on use

    model, tok = policy.model, policy.tokenizer
    if not hasattr(model, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    ids = tok([chat_text(tok, p, AgentConfig()) for p in prompts], add_special_tokens=False)["input_ids"]
    cfg = HFGenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)
    try:
        model.generate_batch(ids[:2], generation_config=cfg)  # warm-up
        rec, res = _timed(model, lambda: model.generate_batch(ids, generation_config=cfg), len(ids))
    except Exception as err:  # noqa: BLE001 - where it does not run, the record says why
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    by_prompt = {tuple(r.prompt_ids): list(r.generated_tokens) for r in res.values()}
    tokens = [by_prompt.get(tuple(i), []) for i in ids]
    return {**rec, "new_tokens": sum(map(len, tokens)), "tokens": tokens}


def bench_host(engines: Sequence[str] = ("hf", "hf:compact=0.25", "hf-graphs"), batch: int = 128,
               new_tokens: int = 64, prompt_chars: int = 300, seed: int = 0, repeats: int = 3) -> dict:
    """The record of ``sprpo-bench host``: per engine the decode step's milliseconds inside and
    outside the model's forward, on ``batch`` WebShop prompts (their last ``prompt_chars``
    characters: a short prompt keeps the attention negligible too), and whether each engine's
    greedy tokens equal ``hf``'s; each number the median of ``repeats`` runs."""
    policy = deep_narrow_policy(seed)
    prompts = [p[-prompt_chars:] for p in webshop_prompts(batch)]
    res: dict = {"batch": batch, "new_tokens": new_tokens, "layers": HOST_SHAPE.num_hidden_layers,
                 "hidden_size": HOST_SHAPE.hidden_size, "threads": torch.get_num_threads(), "repeats": repeats,
                 "engines": {}}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    with torch.no_grad():
        for _ in range(repeats):  # interleaved (A B C A B C ...): a drift of the machine's speed hits every engine
            for name in engines:
                runs[name].append(generate_batch_host(policy, prompts, new_tokens) if name == "generate_batch"
                                  else engine_host(policy, name, prompts, batch, new_tokens))
        ref = None
        for name in engines:
            r = runs[name][0] if any("error" in x for x in runs[name]) else _median(runs[name])
            toks = r.pop("tokens", None)
            if toks is not None:
                ref = ref if ref is not None else toks
                r["greedy_equal"] = f"{sum(a == b for a, b in zip(toks, ref))}/{len(ref)}"
            res["engines"][name] = r
    return res
