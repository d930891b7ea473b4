"""``sprpo-bench divergence``: the divergence pass (:mod:`sprpo_lib.evaluate.divergence`) on a
profile's evaluation settings, each phase against its floor on this machine: the clean side of a
state (one prefill; K responses sampled; their teacher-forced pass; the greedy response) once per
state, and one setting's comparison (one prefill; the teacher-forced pass of the K responses and the
clean greedy one; greedy decoding from its first disagreement where that one moves), states in batches as the
pass runs them.

The floor of a phase: its prefill and teacher-forced tokens at the probed matmul rate (compute
bound), plus its decode steps at :func:`~sprpo_lib.infra.hardware.decode_floor_s` (each step reads
every weight and the live rows' KV cache, or costs its FLOPs, whichever is slower)."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from sprpo_lib.agent.engines.base import eos_ids
from sprpo_lib.core.compress import perturbation
from sprpo_lib.evaluate import DEFAULT_CACHE, ModelSource, config_from_profile
from sprpo_lib.evaluate.divergence import Stop, batches, clean_sides, compare, state_pool
from sprpo_lib.infra import hardware as hw
from sprpo_lib.infra.paths import project_path
from sprpo_lib.model.layers import float32_logits, native_gqa
from sprpo_lib.train.config import load_config


def _phase_floor(config, prompts: list[int], k: int, teacher: list[int], decoded: list[int], gflops: float,
                 bandwidth: float, weight_bytes: int, kv_bytes: int) -> float:
    """Floor seconds of one batch's phase: a prefill of ``prompts`` (token counts), ``k``
    teacher-forced rows per prompt of ``teacher[i]`` tokens after it, and one batched generation
    of ``decoded`` tokens per row (``len(decoded) // len(prompts)`` rows per prompt)."""
    flops = hw.prefill_flops(config, prompts)
    flops += sum(hw.decode_flops(config, p + t) for p, n in zip(prompts, teacher) for t in range(n)) * k
    per = len(decoded) // len(prompts)
    decode = hw.decode_floor_s(config, [p for p in prompts for _ in range(per)], decoded, weight_bytes, kv_bytes,
                               bandwidth, gflops)
    return flops / (gflops * 1e9) + decode


def bench_divergence(profile: str = "cpu", env: str = "webshop", *, states: int = 4, samples: int = 4,
                     batches_of: Sequence[int] = (), batch_tokens: Sequence[int] = (), attention: Sequence[str] = (),
                     logits: Sequence[str] = (), family: str = "rtn", strength: float = 4.0, model: str | None = None,
                     adapters: Sequence[str] = ()) -> dict:
    """Seconds per state of the clean side and of one setting's comparison, each against its
    floor, on ``states`` states the profile's model (with ``adapters``) visits on ``env``'s held-out tasks, side by
    side for every combination of: the states per batch in ``batches_of``, the padded-token
    budgets in ``batch_tokens`` (0: none), the attention kernels in ``attention`` and the logits'
    dtypes in ``logits`` (each default: the pass's own, :class:`~sprpo_lib.evaluate.EvalConfig`'s);
    the top-level figures are the last combination's."""
    spec = model or load_config(profile, **{"env.name": env}).model.spec
    cfg = config_from_profile(profile, env, model=spec, adapters=tuple(adapters), family=family, strengths=(strength,),
                              cache_dir=str(project_path(DEFAULT_CACHE)))
    pool, _ = state_pool(cfg, states, progress=False)
    source = ModelSource(cfg, project_path(cfg.cache_dir) / "file_hashes.json")
    pol = source.policy()
    m, tok = pol.model.eval(), pol.tokenizer
    config, dtype = m.config, str(next(m.parameters()).dtype).replace("torch.", "")
    rate = hw.probe_matmul(hw.linear_shapes(config), dtypes=(dtype,))[dtype]["gflops_by_rows"][str(hw.PREFILL_ROWS)]
    bandwidth = hw.probe_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    kv_bytes = next(m.parameters()).element_size()
    kw = dict(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, pad_id=tok.pad_token_id or 0,
              ended=Stop(tok, cfg.generation(0).stop, eos_ids(m, tok)))
    floor = dict(gflops=rate, bandwidth=bandwidth, weight_bytes=weight_bytes, kv_bytes=kv_bytes)
    n = len(pool.prompts)

    def greedy_len(side) -> int:
        return len(side.greedy)

    def timed(batch: int, tokens: int, kernel: str, head: str) -> dict:
        clean_s, clean_floor, groups = 0.0, 0.0, []
        cut = batches(pool.prompts, batch, tokens or None)
        for group in cut:
            prompts = [pool.prompts[i] for i in group]
            t0 = time.perf_counter()
            with native_gqa(m, False, kernel), float32_logits(m, head == "float32"):
                sides = clean_sides(m, prompts, k=samples, seeds=group, **kw)
            clean_s += time.perf_counter() - t0
            lens = [len(p) for p in prompts]
            sampled = [int(t) for s in sides for t in s.mask.sum(1)]
            clean_floor += _phase_floor(config, lens, samples, [s.tokens.shape[1] for s in sides], sampled, **floor)
            clean_floor += (_phase_floor(config, lens, 0, [0] * len(lens), [greedy_len(s) for s in sides], **floor)
                            - hw.prefill_flops(config, lens) / (rate * 1e9))  # the greedy response: the same prefill
            groups.append((prompts, sides))
        cmp_s, cmp_floor, kls, flips = 0.0, 0.0, [], []
        with (perturbation(m, family, strength, seed=0, pad_id=tok.pad_token_id), native_gqa(m, False, kernel),
              float32_logits(m, head == "float32")):
            for prompts, sides in groups:
                t0 = time.perf_counter()
                rows = compare(m, prompts, sides, **kw)
                cmp_s += time.perf_counter() - t0
                kls, flips = kls + [r["kl"] for r in rows], flips + [r["flip"] for r in rows]
                # the least it needs: the prefill, and the K responses and the clean greedy one teacher-forced (only
                # the states whose greedy response moves are decoded again)
                cmp_floor += _phase_floor(config, [len(p) for p in prompts], samples + 1,
                                          [max(s.tokens.shape[1], greedy_len(s)) for s in sides], [], **floor)
        return {"batch": batch, "batch_tokens": tokens or None, "attention": kernel, "logits": head, "batches": len(cut),
                "padded_tokens": sum(len(g) * max(len(pool.prompts[i]) for i in g) for g in cut),
                "response_tokens_mean": round(sum(float(s.mask.sum(1).double().mean()) for _, g in groups for s in g)
                                              / n, 2),
                "clean_s_per_state": round(clean_s / n, 4), "clean_floor_s_per_state": round(clean_floor / n, 4),
                "clean_over_floor": round(clean_s / clean_floor, 2),
                "setting_s_per_state": round(cmp_s / n, 4), "setting_floor_s_per_state": round(cmp_floor / n, 4),
                "setting_over_floor": round(cmp_s / cmp_floor, 2), "kl_mean": round(sum(kls) / n, 5),
                "flip_rate": round(sum(flips) / n, 4)}

    runs = [timed(b, t, a, h) for b in (batches_of or (cfg.batch_size,)) for t in (batch_tokens or (cfg.batch_tokens or 0,))
            for a in (attention or (cfg.attention,)) for h in (logits or (cfg.logits,))]
    return {"profile": profile, "env": env, "model": spec, "adapters": [str(a) for a in adapters], "dtype": dtype, "threads": torch.get_num_threads(),
            "states": n, "samples": samples, "setting": f"{family} {strength:g}",
            "prompt_tokens_mean": round(sum(len(p) for p in pool.prompts) / n, 1),
            "prompt_tokens": sum(len(p) for p in pool.prompts),
            "matmul_gflops": round(rate, 1), "bandwidth_gbs": round(bandwidth, 1), **runs[-1],
            "by_batch": runs}
