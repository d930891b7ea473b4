"""``sprpo-bench divergence``: the divergence pass (:mod:`sprpo_lib.evaluate.divergence`) on a
profile's evaluation settings, each phase against its floor on this machine: the clean side of a
state (one prefill; K responses sampled; their teacher-forced pass; the greedy response) once per
state, and one setting's comparison (one prefill; the teacher-forced pass; the greedy response).

The floor of a phase: its prefill and teacher-forced tokens at the probed matmul rate (compute
bound), plus its decode steps at :func:`~sprpo_lib.infra.hardware.decode_floor_s` (each step reads
every weight and the live rows' KV cache, or costs its FLOPs, whichever is slower)."""
from __future__ import annotations

import time

import torch

from sprpo_lib.agent.engines.base import eos_ids
from sprpo_lib.core.compress import perturbation
from sprpo_lib.evaluate import DEFAULT_CACHE, ModelSource, config_from_profile
from sprpo_lib.evaluate.divergence import clean_side, compare, state_pool
from sprpo_lib.infra import hardware as hw
from sprpo_lib.infra.paths import project_path
from sprpo_lib.train.config import load_config


def _phase_floor(config, prompt: int, rows: int, teacher: int, decoded: list[int], gflops: float, bandwidth: float,
                 weight_bytes: int, kv_bytes: int) -> float:
    """Floor seconds of one phase: a prefill of ``prompt`` tokens, ``rows`` teacher-forced rows of
    ``teacher`` tokens after it, and generations of ``decoded`` tokens per row (batched)."""
    flops = hw.prefill_flops(config, [prompt])
    flops += sum(hw.decode_flops(config, prompt + t) for t in range(teacher)) * rows
    decode = hw.decode_floor_s(config, [prompt] * len(decoded), decoded, weight_bytes, kv_bytes, bandwidth, gflops)
    return flops / (gflops * 1e9) + decode


def bench_divergence(profile: str = "cpu", env: str = "webshop", *, states: int = 4, samples: int = 4,
                     family: str = "rtn", strength: float = 4.0, model: str | None = None) -> dict:
    """Seconds per state of the clean side and of one setting's comparison, each against its
    floor, on ``states`` states the profile's model visits on ``env``'s held-out tasks."""
    spec = model or load_config(profile, **{"env.name": env}).model.spec
    cfg = config_from_profile(profile, env, model=spec, family=family, strengths=(strength,),
                              cache_dir=str(project_path(DEFAULT_CACHE)))
    pool, _ = state_pool(cfg, states, progress=False)
    source = ModelSource(cfg, project_path(cfg.cache_dir) / "file_hashes.json")
    pol = source.policy()
    m, tok = pol.model.eval(), pol.tokenizer
    config, dtype = m.config, str(next(m.parameters()).dtype).replace("torch.", "")
    eos, stop = sorted(eos_ids(m, tok)), cfg.generation(0).stop
    rate = hw.probe_matmul(hw.linear_shapes(config), dtypes=(dtype,))[dtype]["gflops_by_rows"][str(hw.PREFILL_ROWS)]
    bandwidth = hw.probe_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    kv_bytes = next(m.parameters()).element_size()
    kw = dict(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, tokenizer=tok, stop=stop, eos=eos)
    clean_s, clean_floor, sides = 0.0, 0.0, []
    for i, prompt in enumerate(pool.prompts):
        t0 = time.perf_counter()
        side = clean_side(m, prompt, k=samples, seed=i, **kw)
        clean_s += time.perf_counter() - t0
        t = side.tokens.shape[1]
        greedy = len(tok(side.action or "")["input_ids"]) + 4  # about the greedy response's length
        clean_floor += _phase_floor(config, len(prompt), samples, t, [t] * samples + [greedy], rate, bandwidth,
                                    weight_bytes, kv_bytes)
        sides.append((prompt, side, greedy))
    cmp_s, cmp_floor, kls = 0.0, 0.0, []
    with perturbation(m, family, strength, seed=0, pad_id=tok.pad_token_id):
        for prompt, side, greedy in sides:
            t0 = time.perf_counter()
            kls.append(compare(m, prompt, side, **kw)["kl"])
            cmp_s += time.perf_counter() - t0
            cmp_floor += _phase_floor(config, len(prompt), samples, side.tokens.shape[1], [greedy], rate, bandwidth,
                                      weight_bytes, kv_bytes)
    n = len(sides)
    return {"profile": profile, "env": env, "model": spec, "dtype": dtype, "threads": torch.get_num_threads(),
            "states": n, "samples": samples, "setting": f"{family} {strength:g}",
            "prompt_tokens_mean": round(sum(len(p) for p, _, _ in sides) / n, 1),
            "response_tokens_mean": round(sum(float(s.mask.sum(1).double().mean()) for _, s, _ in sides) / n, 2),
            "matmul_gflops": round(rate, 1), "bandwidth_gbs": round(bandwidth, 1),
            "clean_s_per_state": round(clean_s / n, 4), "clean_floor_s_per_state": round(clean_floor / n, 4),
            "clean_over_floor": round(clean_s / clean_floor, 2),
            "setting_s_per_state": round(cmp_s / n, 4), "setting_floor_s_per_state": round(cmp_floor / n, 4),
            "setting_over_floor": round(cmp_s / cmp_floor, 2), "kl_mean": round(sum(kls) / n, 5)}
