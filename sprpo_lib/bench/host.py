"""``sprpo-bench host``: the host's share of a decode step of the built-in engines at batch 128.

The model has the paper's depth and architecture (28 Qwen2 layers) but a few channels, so its
arithmetic is negligible and a decode step costs what the host does: Python, op dispatch and the
engine's own bookkeeping.  Each step splits into the time inside the model's forward (on a GPU:
kernel launches, which a CUDA graph replaces by one) and the time outside it (token selection,
the host sync, stop-string checks, cache bookkeeping), which adds to every step on any device.
Where transformers' continuous batching (``generate_batch``) runs, its decode time per step is
measured beside them on the same prompts.  A leaf: nothing in the library imports it.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from sprpo_lib.agent.engines import GenerationConfig, close_engine, make_engine
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
    """Seconds spent inside ``model``'s forward (pre/post hooks on the top module)."""

    def __init__(self, model):
        self.seconds, self.calls, self._t = 0.0, 0, 0.0
        self._hooks = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *_):
        self._t = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._t
        self.calls += 1

    def close(self):
        for h in self._hooks:
            h.remove()


def _timed(model, call):
    """``call()``'s wall seconds, the seconds inside ``model``'s forward, its forward calls and result."""
    clock = _ForwardClock(model)
    try:
        t0 = time.perf_counter()
        res = call()
        return time.perf_counter() - t0, clock.seconds, clock.calls, res
    finally:
        clock.close()


def _per_step(long: tuple, short: tuple, steps: int, tokens: int) -> dict:
    """A decode step from two calls on the same prompts that differ only in new tokens: the
    difference of their walls (and of their forward times) over the difference of their decode
    steps, so that fixed costs (set-up, prefill) cancel."""
    dw, df = long[0] - short[0], long[1] - short[1]
    return {"wall_s": round(long[0], 3), "decode_steps": steps, "new_tokens": tokens,
            "step_ms": round(1e3 * dw / max(steps, 1), 2), "forward_ms": round(1e3 * df / max(steps, 1), 2),
            "outside_ms": round(1e3 * (dw - df) / max(steps, 1), 2)}


def engine_host(policy: Policy, name: str, prompts: Sequence[str], batch: int, new_tokens: int) -> dict:
    """One built-in engine (``hf``, ``hf-graphs``) on ``prompts`` at ``new_tokens`` and at half as
    many (:func:`_per_step`); a stop string no token completes, so rows run all their steps."""
    runs = []
    for n in (new_tokens, max(new_tokens // 2, 1)):
        eng = make_engine(name, policy, GenerationConfig(temperature=0.0, max_new_tokens=n, batch_size=batch,
                                                         stop="\x00never"))
        try:
            eng(prompts[:2])  # warm-up
            runs.append(_timed(policy.model, lambda: eng(prompts)))
        finally:
            close_engine(eng)
    long, short = runs
    steps = max(len(g.response_ids) for g in long[3]) - max(len(g.response_ids) for g in short[3])
    return {**_per_step(long, short, steps, sum(len(g.response_ids) for g in long[3])),
            "tokens": [g.response_ids for g in long[3]]}


def generate_batch_host(policy: Policy, prompts: Sequence[str], new_tokens: int) -> dict:
    """transformers' continuous batching on the same prompts (greedy, no end token) at
    ``new_tokens`` and at half as many (:func:`_per_step`); or the reason it does not run here."""
    from transformers import GenerationConfig as HFGenerationConfig  # heavy: loaded on use

    model, tok = policy.model, policy.tokenizer
    if not hasattr(model, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    ids = tok([chat_text(tok, p, AgentConfig()) for p in prompts], add_special_tokens=False)["input_ids"]
    runs = []
    try:
        for n in (new_tokens, max(new_tokens // 2, 1)):
            cfg = HFGenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                     pad_token_id=tok.pad_token_id)
            model.generate_batch(ids[:2], generation_config=cfg)  # warm-up
            runs.append(_timed(model, lambda: model.generate_batch(ids, generation_config=cfg)))
    except Exception as err:  # noqa: BLE001 - where it does not run, the record says why
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    long, short = runs
    toks = [{tuple(r.prompt_ids): list(r.generated_tokens) for r in run[3].values()} for run in runs]
    tokens = [toks[0].get(tuple(i), []) for i in ids]
    steps = max(map(len, tokens)) - max(len(t) for t in toks[1].values())
    return {**_per_step(long, short, steps, sum(map(len, tokens))), "forwards": long[2], "tokens": tokens}


def bench_host(engines: Sequence[str] = ("hf", "hf-graphs", "generate_batch"), batch: int = 128,
               new_tokens: int = 64, prompt_chars: int = 300, seed: int = 0) -> dict:
    """The record of ``sprpo-bench host``: per engine the decode step's milliseconds inside and
    outside the model's forward, on ``batch`` WebShop prompts (their last ``prompt_chars``
    characters: a short prompt keeps the attention negligible too), and whether each engine's
    greedy tokens equal ``hf``'s."""
    policy = deep_narrow_policy(seed)
    prompts = [p[-prompt_chars:] for p in webshop_prompts(batch)]
    res: dict = {"batch": batch, "new_tokens": new_tokens, "layers": HOST_SHAPE.num_hidden_layers,
                 "hidden_size": HOST_SHAPE.hidden_size, "threads": torch.get_num_threads(), "engines": {}}
    with torch.no_grad():
        ref = None
        for name in engines:
            r = (generate_batch_host(policy, prompts, new_tokens) if name == "generate_batch"
                 else engine_host(policy, name, prompts, batch, new_tokens))
            toks = r.pop("tokens", None)
            if toks is not None:
                ref = ref if ref is not None else toks
                r["greedy_equal"] = f"{sum(a == b for a, b in zip(toks, ref))}/{len(ref)}"
            res["engines"][name] = r
    return res
