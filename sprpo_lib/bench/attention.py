"""``sprpo-bench attention``: the attention calls of one S_hat replay (Alg. 1 line 7) on a real
rollout batch, timed again per SDPA backend against their FLOP floor.

The replay runs forward and backward through every layer, so it holds every attention shape the
update runs as well.  Each distinct call is recorded once, with how often the pass made it and
its own mask.  It is then timed, forward and backward apart, with each backend:

- ``flash``: PyTorch's default on CPU;
- ``math``: PyTorch's reference SDPA;
- ``eager``: transformers' matmul-softmax-matmul, ``attn_implementation="eager"``;
- ``matmul_whole``: the same equation with the query heads of each key/value head stacked against it,
  one product over every key (``update.attention_chunk=0``);
- ``matmul``: that, a causal call in query chunks that stop at their last query's key
  (:func:`sprpo_lib.model.layers.matmul_attention`, ``update.attention``'s choice for 16-bit passes).

The totals say how much of the replay is attention, how far it is from the matmul rate, and
what picking the fastest backend per shape would save."""
from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sprpo_lib.bench.suite import prefill_rate, rel_l2, rollout_batch
from sprpo_lib.core.actor import SURROGATE
from sprpo_lib.core.batch import Batch
from sprpo_lib.core.methods import grad_leaf
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.model.layers import matmul_attention

BACKENDS = ("flash", "math", "eager", "matmul_whole", "matmul")
#: FLOPs of an attention backward over its forward: S = QK^T recomputed, dV, dP, dQ, dK (5 matmuls
#: against the forward's 2), as FlashAttention-2 counts them.
BACKWARD_FLOPS = 2.5


def attention_flops(q_shape, k_shape) -> float:
    """Forward FLOPs of one call: QK^T and PV over the full query x key rectangle (masked
    entries included: a dense kernel computes them), ``q_shape`` ``(B, H, Tq, D)``."""
    b, h, tq, d = q_shape
    return 4.0 * b * h * tq * k_shape[2] * d


@contextmanager
def record_calls() -> Iterator[tuple[Counter, dict]]:
    """Inside the block every ``F.scaled_dot_product_attention`` call is counted per signature
    ``(q shape, k shape, q contiguous, causal, gqa, grad, scale, dtype)``; the first call's bool or
    float mask of each signature is kept (the masks of one signature differ in padding only)."""
    counts: Counter = Counter()
    masks: dict = {}
    real = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        sig = (tuple(query.shape), tuple(key.shape), query.is_contiguous(), bool(is_causal), bool(enable_gqa),
               torch.is_grad_enabled() and query.requires_grad, scale, str(query.dtype).replace("torch.", ""))
        counts[sig] += 1
        if sig not in masks:
            masks[sig] = None if attn_mask is None else attn_mask.detach().clone()
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, **kw)

    F.scaled_dot_product_attention = sdpa
    try:
        yield counts, masks
    finally:
        F.scaled_dot_product_attention = real


def attend(backend: str, q, k, v, mask, causal: bool, gqa: bool, scale: float | None) -> torch.Tensor:
    """One attention call ``(B, H, Tq, D)`` with ``backend`` (:data:`BACKENDS`); ``mask`` bool
    (True: attend) or additive float, or None with ``causal`` (the queries are the last Tq
    positions of the keys)."""
    if backend in ("flash", "math"):
        kind = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.MATH
        with sdpa_kernel(kind):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)
    if backend in ("matmul", "matmul_whole"):  # builds the causal mask itself where the call has none
        module = SimpleNamespace(is_causal=causal)
        chunk = 0 if backend == "matmul_whole" else None  # None: update.attention_chunk's default
        return matmul_attention(module, q, k, v, mask, scaling=scale, query_chunk=chunk)[0].transpose(1, 2)
    if backend != "eager":
        raise ValueError(f"attention backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    # heavy (seconds to import): loaded on first use
    from transformers.models.llama.modeling_llama import eager_attention_forward

    tq, tk = q.shape[2], k.shape[2]
    if mask is None and causal:
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)[None, None]
    if mask is not None and mask.dtype == torch.bool:  # transformers' eager masks add the dtype's minimum
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    out, _ = eager_attention_forward(module, q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale)
    return out.transpose(1, 2)


def _inputs(sig: tuple, seed: int) -> tuple[torch.Tensor, ...]:
    q_shape, k_shape, contiguous, *_, dtype = sig
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    b, h, tq, d = q_shape
    q = torch.randn(q_shape if contiguous else (b, tq, h, d), generator=g).to(dt)
    q = q if contiguous else q.transpose(1, 2)  # the projections' (B, T, H, D) viewed as (B, H, T, D)
    k, v = (torch.randn(k_shape, generator=g).to(dt) for _ in range(2))
    return q, k, v, torch.randn(q_shape, generator=g).to(dt)


def time_call(backend: str, sig: tuple, mask, repeats: int = 3, seed: int = 0) -> dict:
    """Median forward and backward seconds of one signature under ``backend`` (one warm-up
    call first), with the output and input gradients of the last call (``None`` without grad)."""
    q0, k0, v0, dout = _inputs(sig, seed)
    causal, gqa, grad, scale = sig[3], sig[4], sig[5], sig[6]
    fwd, bwd, out, grads = [], [], None, None
    for i in range(repeats + 1):
        q, k, v = (t.detach().requires_grad_(grad) for t in (q0, k0, v0))
        with torch.set_grad_enabled(grad):
            t0 = time.perf_counter()
            out = attend(backend, q, k, v, mask, causal, gqa, scale)
            t1 = time.perf_counter()
        if grad:
            out.backward(dout)
            grads = (q.grad, k.grad, v.grad)
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd), "out": out.detach(),
            "grads": grads}


def _g(x: float) -> float:
    """Five significant digits: seconds from microseconds (a tiny model) to minutes."""
    return float(f"{x:.5g}")


def time_signatures(counts: Counter, masks: dict, gflops: float, repeats: int = 3,
                    backends: tuple[str, ...] = BACKENDS, progress: bool = True) -> dict:
    """Every recorded signature timed per backend, totals over the calls the pass made against
    the FLOP floor at ``gflops``, and the fastest backend per signature.  ``max_rel_diff``: the
    largest relative difference of an output or input gradient from the first backend's
    (``backend_order``: a JSON record's keys are sorted)."""
    rows, totals = [], {b: {"forward_s": 0.0, "backward_s": 0.0} for b in backends}
    floor = fastest = 0.0
    wins: Counter = Counter()
    diff = {b: 0.0 for b in backends[1:]}
    bar = progress_bar(total=len(counts) * len(backends), desc="bench attention: shapes", unit="call", disable=not progress)
    for sig, n in sorted(counts.items(), key=lambda kv: -attention_flops(kv[0][0], kv[0][1]) * kv[1]):
        flops = attention_flops(sig[0], sig[1]) * (1 + BACKWARD_FLOPS if sig[5] else 1)
        floor += n * flops / (gflops * 1e9)
        got = {}
        for b in backends:
            got[b] = time_call(b, sig, masks.get(sig), repeats)
            bar.update()
        ref = got[backends[0]]
        for b in backends[1:]:
            pairs = [(got[b]["out"], ref["out"])] + list(zip(got[b]["grads"] or (), ref["grads"] or ()))
            diff[b] = max(diff[b], *(rel_l2(x, y) for x, y in pairs))
        secs = {b: got[b]["forward_s"] + got[b]["backward_s"] for b in backends}
        best = min(secs, key=secs.get)
        wins[best] += 1
        fastest += n * secs[best]
        for b in backends:
            totals[b]["forward_s"] += n * got[b]["forward_s"]
            totals[b]["backward_s"] += n * got[b]["backward_s"]
        rows.append({"q": list(sig[0]), "k": list(sig[1]), "causal": sig[3], "gqa": sig[4], "grad": sig[5],
                     "calls": n, "fastest": best,
                     **{f"{b}_ms": [_g(1e3 * got[b]["forward_s"]), _g(1e3 * got[b]["backward_s"])]
                        for b in backends}})
    bar.close()
    out = {}
    for b, t in totals.items():
        total = t["forward_s"] + t["backward_s"]
        out[b] = {"forward_s": _g(t["forward_s"]), "backward_s": _g(t["backward_s"]),
                  "total_s": _g(total), "over_floor": round(total / floor, 2) if floor else None,
                  "backward_over_forward": round(t["backward_s"] / t["forward_s"], 2) if t["forward_s"] else None}
    first = out[backends[0]]["total_s"]
    return {"backend_order": list(backends), "backends": out, "floor_s": _g(floor), "fastest_per_shape_s": _g(fastest),
            "fastest_over_first": round(fastest / first, 3) if first else None, "fastest_counts": dict(wins),
            "max_rel_diff": {b: _g(d) for b, d in diff.items()}, "by_shape": rows}


def bench_attention(profile: str = "cpu", env: str = "webshop", repeats: int = 3,
                    overrides: list[str] | None = None) -> dict:
    """One rollout batch (:func:`rollout_batch`), the replay of its rows
    with a non-zero advantage (Alg. 1 line 7, the profile's passes) timed with its attention calls
    recorded, then every call signature timed per backend (:func:`time_signatures`).  The floor
    prices attention's FLOPs at the matmul rate of the model's linears (:func:`prefill_rate`), the
    rate the update's and the replay's floors in ``bench train`` use.  The replay runs with SDPA
    (``update.attention=sdpa``), whose calls are the ones recorded."""
    tr, batch, _, xi, _, _ = rollout_batch(profile, env, overrides)
    rows = [s for s in batch.samples if s.adv != 0.0]
    if not rows:
        raise ValueError(f"bench attention --profile {profile}: every advantage in the rollout batch is 0, so line 7's "
                         "replay runs no row; use a profile whose policy earns some reward (the cpu profile's warm start)")
    a = tr.actor

    def replay(samples) -> float:
        leaf = grad_leaf(xi, a)
        a.zero_grad()
        t0 = time.perf_counter()
        a.backward(Batch(samples).without_old(), leaf, terms=SURROGATE)
        a.zero_grad()
        return time.perf_counter() - t0

    kernel, a.attention = a.attention, "sdpa"  # every call through SDPA, where it is recorded
    try:
        replay(rows[: 2 * a.micro_batch])  # untimed warm-up (first-call allocations)
        with record_calls() as (counts, masks):
            replay_s = replay(rows)
    finally:
        a.attention = kernel
    gflops = prefill_rate(tr.policy.model.config, tr.dtype)
    res = time_signatures(counts, masks, gflops, repeats)
    flash = res["backends"]["flash"]["total_s"]
    return {"profile": profile, "env": env, "overrides": list(overrides or []), "dtype": tr.dtype,
            "rows": len(rows), "response_tokens": Batch(rows).n_tokens, "replay_s": round(replay_s, 2),
            "calls": sum(counts.values()), "shapes": len(counts), "matmul_gflops": gflops,
            "flash_share_of_replay": round(flash / replay_s, 3), **res}
