"""``sprpo-bench sft``: the warm start's behaviour cloning (:func:`~sprpo_lib.warmstart.sft.train_sft`)
on a profile's own demonstrations, seconds per optimizer step with the update's speed levers and
without them (the reference path), side by side, each against the step's FLOP floor here.

The floor of a step (:func:`step_flops`): the forward over its demonstrations' tokens without padding,
the LM head on the response tokens alone (as :func:`~sprpo_lib.warmstart.sft.response_nll` applies it),
and the backward's input gradients from the head down to the lowest layer with LoRA (the base weights
are frozen: no weight gradients but the adapter's, left out), at the probed matmul rate of the model's
dtype.  The reference path's levers are every SFT lever's reference value (:class:`SpeedConfig`)."""
from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import torch

from sprpo_lib.agent.envs import make_pool
from sprpo_lib.core.config import SpeedConfig
from sprpo_lib.infra import hardware as hw
from sprpo_lib.model.layers import lowest_trainable_layer
from sprpo_lib.model.load import load_policy
from sprpo_lib.train.config import load_config
from sprpo_lib.warmstart.demos import collect_demonstrations
from sprpo_lib.warmstart.sft import encode_demo, train_sft

#: the two paths timed side by side: the profile's levers, and every SFT lever at its reference value
PATHS = {"levers": {}, "reference": {"fused_lora": False, "native_gqa": False, "attention": "sdpa"}}


def step_flops(config, encoded: list[tuple[list[int], list[int]]], lowest_lora: int) -> float:
    """FLOPs of one step's forward and input-gradient backward over ``encoded`` (prompt, response)
    token pairs, no padding: the decoder body forward on every token, its backward through the layers
    above the lowest one with LoRA (that layer needs part of its own: left out, a floor), and the LM
    head (forward and backward) on the response tokens alone."""
    layers = int(config.num_hidden_layers)
    above = max(0, layers - lowest_lora - 1) / layers
    body = hw.prefill_flops(config, [len(p) + len(r) for p, r in encoded], lm_head=False)
    head = 2 * int(config.hidden_size) * int(config.vocab_size) * sum(len(r) for _, r in encoded)
    return body * (1 + above) + 2 * head


def bench_sft(profile: str = "cpu", env: str = "alfworld", steps: int = 8, warmup: int = 2, repeats: int = 2,
              model: str | None = None) -> dict:
    """Seconds per SFT step on the levers and the reference path, ``repeats`` interleaved rounds
    (the median round), each round a fresh policy trained ``warmup + steps`` steps on the same
    demonstrations, each seen once: the profile's demonstrator on its first tasks, as the warm
    start collects them.  The first ``warmup`` steps are not timed."""
    cfg = load_config(profile, **{"env.name": env, **({"model.spec": model} if model else {})})
    sft, agent = cfg.sft, cfg.rollout.agent
    need = (warmup + steps) * sft.batch_size * sft.grad_accum
    tok = load_policy(cfg.model.spec, dtype=cfg.model.dtype).tokenizer
    pool, demos, task = make_pool(env, cfg.env.data_dir, cfg.env.seed), [], 0
    while len(demos) < need:
        if task >= pool.splits()[sft.split]:
            raise ValueError(f"sprpo-bench sft: {env}'s {sft.split} split gives {len(demos)} demonstrations, "
                             f"{need} needed; lower --steps or --warmup")
        demos += [d for d in collect_demonstrations(pool, sft.split, [task], agent, sft.expert_prob, sft.seed,
                                                    demonstrator=sft.demonstrator, max_steps=sft.episode_steps,
                                                    repeat_prob=sft.repeat_prob)
                  if sft.max_prompt_tokens is None or len(encode_demo(tok, d, agent)[0]) <= sft.max_prompt_tokens]
        task += 1
    demos = demos[:need]  # train_sft skips none of them: each step takes its share
    run_cfg = dataclasses.replace(sft, epochs=1, max_steps=warmup + steps, log_every=1, max_seconds=None)
    walls: dict[str, list[float]] = {p: [] for p in PATHS}
    res: dict = {}
    for _ in range(repeats):
        for path, levers in PATHS.items():
            pol = load_policy(cfg.model.spec, dtype=cfg.model.dtype)
            with tempfile.TemporaryDirectory() as d:
                out = train_sft(pol, demos, run_cfg, d, False, agent, dataclasses.replace(cfg.speed, **levers))
                el = [json.loads(line)["elapsed_s"] for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
            walls[path].append((el[-1] - el[warmup - 1]) / steps if warmup else el[-1] / steps)
            res.setdefault("loss", {})[path] = round(out["final_loss"], 6)
    m = pol.model
    dtype = str(next(m.parameters()).dtype).replace("torch.", "")
    encoded = [encode_demo(tok, d, agent) for d in demos]
    lowest = lowest_trainable_layer(m)
    flops = step_flops(m.config, encoded, lowest) / (warmup + steps)  # the mean step
    rows = str(hw.PREFILL_ROWS)
    rate = hw.probe_matmul(hw.linear_shapes(m.config), dtypes=(dtype,), rows=(hw.PREFILL_ROWS,))[dtype]["gflops_by_rows"][rows]
    floor = flops / (rate * 1e9)
    res.update(profile=profile, env=env, model=cfg.model.spec, dtype=dtype, threads=torch.get_num_threads(),
               demos=len(demos), batch=sft.batch_size * sft.grad_accum, steps=steps, warmup=warmup,
               tokens_per_step=round(sum(len(p) + len(r) for p, r in encoded) / (warmup + steps), 1),
               lora_from_layer=lowest, matmul_gflops=round(rate, 1), floor_s_per_step=round(floor, 4))
    for path in PATHS:
        s = statistics.median(walls[path])
        res[path] = {"s_per_step": round(s, 4), "over_floor": round(s / floor, 2),
                     "walls_s": [round(w, 4) for w in walls[path]]}
    res["levers_over_reference"] = round(res["levers"]["s_per_step"] / res["reference"]["s_per_step"], 3)
    return res
