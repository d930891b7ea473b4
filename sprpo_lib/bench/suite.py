"""Benchmarks (``sprpo-bench``, :mod:`sprpo_lib.bench.cli`): the measurements behind each
subcommand.  Speed claims are ratios measured side by side in one run (e.g. generation with
and without the perturbation hook, interleaved, median of repeats).
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import random
import statistics
import tempfile
import time
from functools import partial
from typing import Sequence

import numpy as np
import torch
import yaml

from sprpo_lib.agent.engines import GenerationConfig, HFGenerator, bake_weights, close_engine, make_engine
from sprpo_lib.agent.engines.openvino import OpenVINOEngine
from sprpo_lib.agent.envs import alfworld_gen, make_pool
from sprpo_lib.agent.envs.alfworld import make_alfworld_pool
from sprpo_lib.agent.envs.webshop import DEFAULT_N_PRODUCTS, WebShopPool, make_webshop_pool, visible_shopper_action
from sprpo_lib.agent.envs.webshop_catalog import generate_catalogue
from sprpo_lib.agent.prompt import (
    PROMPT_SECTIONS,
    AgentConfig,
    HistoryStep,
    build_prompt,
    chat_text,
    parse_actions,
    prompt_sections,
    token_counter,
)
from sprpo_lib.agent.rollout import SerialEnvs, run_groups
from sprpo_lib.bench.report import TRAIN_PATHS
from sprpo_lib.core.actor import Actor
from sprpo_lib.core.batch import Batch, PrefixGroup, Sample, build_batch
from sprpo_lib.core.compress import fisher_scores, rtn_quantize, sparsegpt_prune
from sprpo_lib.core.config import UpdateConfig
from sprpo_lib.core.methods import MethodConfig, make_method, replay_rows
from sprpo_lib.core.perturb import FFNChannels, below_resolution, sample_xi
from sprpo_lib.core.sigma import energy_sigma, rank_correlation
from sprpo_lib.infra import hardware as hw
from sprpo_lib.infra.paths import cache_dir
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.model.layers import lowest_trainable_layer
from sprpo_lib.model.load import DEFAULT_MODEL, QWEN25_15B_SHAPE, TINY_SPECS, TinyConfig, load_policy
from sprpo_lib.model.lora import LoraSettings, add_lora, lora_on_last_layers
from sprpo_lib.paper.quickstart import DEMO_OBJECTS, DEMO_PLACES, DEMO_PROMPT
from sprpo_lib.train.config import load_config
from sprpo_lib.train.trainer import Trainer, run_folder
from sprpo_lib.warmstart.cache import prepare_warm_start, warm_start_policy
from sprpo_lib.warmstart.demos import collect_demonstrations
from sprpo_lib.warmstart.heldout import eval_temperature, held_out_tasks


def sync_device(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return time.perf_counter() - t0, out


def fixed_length_calibration(tokenizer, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` sequences of exactly ``length`` tokens cut from a seeded stream of
    agent-style prompts in the chat template (the usual fixed-length calibration
    chunks; content matters little for timing)."""
    rng = random.Random(seed)
    stream: list[int] = []
    while len(stream) < n * length:
        obj, place = rng.choice(DEMO_OBJECTS), rng.choice(DEMO_PLACES)
        text = DEMO_PROMPT.replace("mug", obj).replace("coffeemachine", place)
        msg = [{"role": "user", "content": text}, {"role": "assistant", "content": f"<action>go to {place} 1</action>"}]
        enc = tokenizer.apply_chat_template(msg, tokenize=True, return_dict=True)
        stream += list(enc["input_ids"])
    return [stream[i * length : (i + 1) * length] for i in range(n)]


def bench_perturb(model: str = "smollm2-135m", n_calib: int = 128, calib_len: int = 256, batch: int = 8,
                  new_tokens: int = 32, repeats: int = 3, sparsegpt: bool = True, device: str = "cpu",
                  dtype: str | None = None) -> dict:
    """Load time, generation tokens/s with and without the FFN hook, and the time of
    RTN (INT4), Fisher scoring and SparseGPT (all FFN weights, r = 0.5)."""
    res: dict = {"model": model, "threads": torch.get_num_threads(), "device": device}
    if device.startswith("cuda"):
        res["gpu"] = torch.cuda.get_device_name(0)
    t, pol = _timed(load_policy, model, dtype=dtype, device=device)
    res["load_s"] = round(t, 2)
    res["load_cache_hit"] = pol.meta.get("cache_hit")
    res["dtype"] = pol.meta["dtype"]
    tok, m = pol.tokenizer, pol.model
    prompts = [DEMO_PROMPT.replace("mug", w) for w in ["mug", "cup", "apple", "bowl", "book", "pen", "egg", "pan"]]
    prompts = (prompts * (batch // len(prompts) + 1))[:batch]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(pol.device)
    fc = FFNChannels(m).set(xi=sample_xi(0.1, FFNChannels(m).shape, seed=0))

    def gen():
        with torch.no_grad():
            out = m.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id)
        sync_device(pol.device)
        return out

    gen()  # warm-up
    plain, hooked = [], []
    for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
        plain.append(_timed(gen)[0])
        with fc:
            hooked.append(_timed(gen)[0])
    n_tok = batch * new_tokens
    res.update(
        gen_batch=batch, gen_new_tokens=new_tokens, gen_prompt_tokens=int(enc["input_ids"].shape[1]),
        gen_s_plain=round(statistics.median(plain), 3), gen_s_hooked=round(statistics.median(hooked), 3),
        gen_tok_s_plain=round(n_tok / statistics.median(plain), 1),
        gen_tok_s_hooked=round(n_tok / statistics.median(hooked), 1),
        hook_overhead=round(statistics.median(hooked) / statistics.median(plain) - 1, 4),
    )
    t, snap = _timed(lambda: (rtn_quantize(m, 4), sync_device(pol.device))[0])
    snap.restore()
    res["rtn_int4_s"] = round(t, 2)
    calib = fixed_length_calibration(tok, n_calib, calib_len)
    res.update(calib_sequences=n_calib, calib_len=calib_len)
    t, _ = _timed(lambda: (fisher_scores(m, calib, 8, tok.pad_token_id, True), sync_device(pol.device)))
    res["fisher_s"] = round(t, 2)
    if sparsegpt:
        t, (snap, _) = _timed(
            lambda: (sparsegpt_prune(m, calib, 0.5, 128, 0.01, 8, tok.pad_token_id, True), sync_device(pol.device))
        )
        snap.restore()
        res["sparsegpt_s"] = round(t, 2)
    return res


def env_vs_generation(pool_factory, split: str, model: str, n_tasks: int = 4, group_size: int = 4,
                      max_steps: int = 10, max_new_tokens: int = 24, max_obs_chars: int = 300) -> dict:
    """Environment time (task opening + resets + steps) against the policy's generation
    time for the same batch: one :func:`run_groups` call with the real model, side by
    side.  Defaults mirror the ``cpu`` profile's rollout batch (4 tasks x 4 rollouts,
    24 new tokens, observations cut at 300 characters) with 10 steps."""
    pol = load_policy(model)
    envs = SerialEnvs(pool_factory)
    agent = AgentConfig(max_obs_chars=max_obs_chars)
    gen = HFGenerator(pol, GenerationConfig(max_new_tokens=max_new_tokens, batch_size=n_tasks * group_size), agent)
    tasks = [(split, i) for i in range(n_tasks)]
    _, st = run_groups(envs, tasks, group_size, gen, agent, max_steps=max_steps, progress=True)
    envs.close()
    return {"episodes": n_tasks * group_size, "max_steps": max_steps, "model_steps": st["steps"],
            "generate_s": round(st["generate_s"], 2), "env_s": round(st["env_s"], 3),
            "env_open_s": round(st["open_s"], 3), "env_step_s": round(st["env_s"] - st["open_s"], 3),
            "env_over_generate": round(st["env_s"] / st["generate_s"], 4)}


# ----------------------------------------------------------------------------- environments
def bench_webshop(n_episodes: int = 200, seed: int = 0,
                  n_products: int | None = None) -> dict:
    """Throughput of the offline environment with the oracle policy.

    Returns catalogue generation time (uncached), mean reset time (open + spawn +
    reset), environment steps per second (``step`` only, and including the oracle's
    decisions), and the oracle's mean reward / success rate over the episodes.
    """
    t0 = time.perf_counter()

    catalogue = generate_catalogue(seed, n_products or DEFAULT_N_PRODUCTS)
    gen_s = time.perf_counter() - t0
    pool = WebShopPool(catalogue)
    n_test = pool.splits()["test"]
    reset_s = step_s = total_s = 0.0
    steps, rewards, successes = 0, [], 0
    for i in range(n_episodes):
        t0 = time.perf_counter()
        episode = pool.open("test", i % n_test).spawn()
        obs = episode.reset()
        t1 = time.perf_counter()
        reset_s += t1 - t0
        while not obs.done:
            action = episode.expert_action()
            t2 = time.perf_counter()
            obs = episode.step(action)
            step_s += time.perf_counter() - t2
            steps += 1
        total_s += time.perf_counter() - t1
        rewards.append(obs.reward)
        successes += obs.success
    return {
        "catalogue_generation_s": gen_s,
        "n_products": len(catalogue.products),
        "n_goals": len(catalogue.goals),
        "episodes": n_episodes,
        "reset_ms_mean": 1000 * reset_s / n_episodes,
        "env_steps_per_s": steps / step_s,
        "oracle_steps_per_s": steps / total_s,
        "steps_per_episode": steps / n_episodes,
        "oracle_mean_reward": sum(rewards) / n_episodes,
        "oracle_success_rate": successes / n_episodes,
    }


def _median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def bench_alfworld(pool=None, split: str = "valid_seen", n_tasks: int = 3,
                   group_size: int = 8, n_generate: int = 50, n_materialise: int = 3) -> dict:
    """Timings of the ALFWorld environment with the expert policy (seconds unless named).

    * ``prepare_s``: grounding a cached game (``pool.open``), median over ``n_tasks``;
    * ``episode_reset_s``: ``spawn() + reset()`` of one episode of a grounded task;
    * ``group_reset_s``: ``open`` + ``group_size`` x ``spawn/reset`` (a GiGPO group),
      against ``naive_group_reset_s`` = ``group_size`` x TextWorld's ``PddlEnv`` load +
      reset (ALFWorld's per-rollout cost; measured once per task, scaled);
    * ``steps_per_s`` / ``step_ms``: ``Episode.step`` with expert actions;
    * ``expert_replan_s``: ``expert_action()`` right after an off-plan action;
    * ``generate_spec_s_per_1000``: sampling game specs only, measured on ``n_generate``
      games and scaled; ``materialise_s_per_1000``: the full generator (spec, grounding,
      expert plan, verification, atomic write) measured on ``n_materialise`` games of
      a fresh temporary cache and scaled.
    """
    import textworld  # optional (alfworld's engine): loaded on use
    from textworld.envs import PddlEnv  # optional (alfworld's engine): loaded on use

    pool = pool or make_alfworld_pool()
    indices = list(range(n_tasks))
    for i in indices:  # measure cached games only
        pool.open(split, i).close()
    prepare, ep_reset, group, naive, replans = [], [], [], [], []
    n_steps, step_time, solved = 0, 0.0, 0
    for i in indices:
        t0 = time.perf_counter()
        task = pool.open(split, i)
        prepare.append(time.perf_counter() - t0)
        episodes = []
        for _ in range(group_size):
            t1 = time.perf_counter()
            episode = task.spawn()
            episode.reset()
            ep_reset.append(time.perf_counter() - t1)
            episodes.append(episode)
        group.append(time.perf_counter() - t0)
        obs = episodes[0].reset()
        while not obs.done:
            action = episodes[0].expert_action()
            t1 = time.perf_counter()
            obs = episodes[0].step(action)
            step_time += time.perf_counter() - t1
            n_steps += 1
        solved += obs.success
        obs = episodes[1].step("inventory")  # valid and off the walkthrough
        episodes[1].step(obs.admissible[0])
        t1 = time.perf_counter()
        episodes[1].expert_action()
        replans.append(time.perf_counter() - t1)
        task.close()
        t0 = time.perf_counter()
        env = PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True))
        env.load(str(pool.game_file(split, i)))
        env.reset()
        naive.append(time.perf_counter() - t0)
    out = {
        "source": pool.source, "split": split, "n_tasks": n_tasks, "group_size": group_size,
        "prepare_s": _median(prepare),
        "episode_reset_s": _median(ep_reset),
        "group_reset_s": _median(group),
        "naive_reset_s": _median(naive),
        "naive_group_reset_s": _median(naive) * group_size,
        "steps": n_steps,
        "steps_per_s": n_steps / step_time if step_time else float("nan"),
        "step_ms": 1000.0 * step_time / max(n_steps, 1),
        "expert_success": solved / n_tasks,
        "expert_replan_s": _median(replans),
    }
    return out | _bench_alfworld_generator(pool.seed, make_alfworld_pool, n_generate, n_materialise)


def _bench_alfworld_generator(seed: int, make_pool, n_generate: int, n_materialise: int) -> dict:
    """:func:`bench_alfworld`'s generator timings: game specs alone, then whole games
    materialised into a fresh temporary cache (both scaled to 1000 games)."""
    t0 = time.perf_counter()
    for i in range(n_generate):
        alfworld_gen.sample_game(seed, "train", i)
    out = {"generate_spec_s_per_1000": (time.perf_counter() - t0) / n_generate * 1000}
    if n_materialise:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = make_pool(seed=seed, cache_dir=tmp)
            t0 = time.perf_counter()
            for i in range(n_materialise):
                fresh.open("train", i).close()
            out["materialise_s_per_1000"] = (time.perf_counter() - t0) / n_materialise * 1000
        out["materialise_measured_on"] = n_materialise
    return out


def bench_envs(n_episodes: int = 200, model: str | None = "smollm2-135m", n_tasks: int = 4, group_size: int = 4,
               max_steps: int = 10) -> dict:
    """Environment throughput with scripted policies (see each environment's helper)
    and, with ``model``, environment vs. generation time for one rollout batch."""
    vs = dict(n_tasks=n_tasks, group_size=group_size, max_steps=max_steps)
    res = {"webshop": bench_webshop(n_episodes=n_episodes)}
    if model:
        res["webshop"]["vs_model"] = env_vs_generation(partial(make_webshop_pool, seed=0), "test", model, **vs)
    try:
        from sprpo_lib.agent.envs.alfworld import make_alfworld_pool  # the alfworld package is optional
    except ImportError as err:  # the alfworld package is optional for WebShop-only users
        res["alfworld"] = {"skipped": f"alfworld not importable: {err}"}
    else:
        res["alfworld"] = bench_alfworld()
        if model:
            res["alfworld"]["vs_model"] = env_vs_generation(partial(make_alfworld_pool, seed=0), "train", model, **vs)
    return res


def pass_groups(rows, prefix_min: int) -> list[tuple[int, list[int], list[int]]]:
    """``(P, row lengths, response lengths)`` per prefix group of the rows a pass runs."""
    plan = Batch(rows).prefix_plan(prefix_min) if prefix_min else [PrefixGroup([], list(rows))]
    return [(len(g.prefix), [len(s.ids) for s in g.samples], [s.n_resp for s in g.samples]) for g in plan]


def generation_floor(config, episodes, gflops: float, bandwidth_gbs: float, weight_bytes: int, kv_bytes: int) -> dict:
    """The rollout's generation floor: every prompt token prefilled at the measured matmul
    rate, and per environment step (one generation call over the live episodes) the decode
    steps of :func:`hardware.decode_floor_s` (each reads every weight and the KV cache of the
    episodes still generating at the measured bandwidth, or costs its FLOPs at the matmul
    rate, whichever is slower).  ``kv_bytes``: bytes per cached value (the engine's dtype)."""
    prefill, decode = _floor_seconds(config, episodes, gflops, bandwidth_gbs, weight_bytes, kv_bytes)
    return {"prompt_tokens": sum(len(st.prompt_ids) for e in episodes for st in e.steps),
            "prefill_floor_s": round(prefill, 2), "decode_floor_s": round(decode, 2),
            "floor_s": round(prefill + decode, 2)}


def _floor_seconds(config, episodes, gflops: float, bandwidth_gbs: float, weight_bytes: int,
                   kv_bytes: int) -> tuple[float, float]:
    """:func:`generation_floor`'s prefill and decode seconds, unrounded."""
    by_step: dict[int, list] = {}
    for e in episodes:
        for st in e.steps:
            by_step.setdefault(st.step, []).append(st)
    prompts = [len(st.prompt_ids) for e in episodes for st in e.steps]
    prefill = hw.prefill_flops(config, prompts) / (gflops * 1e9)
    decode = sum(hw.decode_floor_s(config, [len(st.prompt_ids) for st in steps], [len(st.response_ids) for st in steps],
                                   weight_bytes, kv_bytes, bandwidth_gbs, gflops)
                 for steps in by_step.values())
    return prefill, decode


def phase_flops(config, passes: list, prefix_min: int, timer: str) -> float:
    """FLOPs of the passes one phase (``timer``: ``update_s`` or ``sensitivity_s``) of a method
    runs (:func:`method_passes`' tuples), prefixes of at least ``prefix_min`` tokens shared."""
    return sum(hw.train_pass_flops(config, pass_groups(rows, prefix_min), d, f, head)["total"]
               for tm, rows, d, f, head in passes if tm == timer)


def phase_rows(times: dict, passes: dict, config, prefix_min: int, gflops: float, rollout_s: float,
                samples: int, generation_floor_s: float | None = None, float32_gflops: float | None = None) -> dict:
    """Per method: median seconds of its update and extra pass, each against the FLOP floor of
    the passes it runs (:func:`hardware.train_pass_flops`), seconds per row, the iteration
    (rollout + both) and its ratio to Vanilla's.  An update that ran in float32 (``update_float32``
    in ``times``: SAM's xi below bfloat16's resolution, :func:`sprpo_lib.core.perturb.below_resolution`)
    is priced at ``float32_gflops``, the rate of the dtype it ran in.  ``<method>_over_vanilla_bound``:
    the ratio with the extra pass (the replay, SAM's channel gradient) at its floor and nothing else
    changed, the least any speed-up of that pass can give; ``<method>_over_vanilla_at_floors``: the
    ratio with generation (``generation_floor_s``), the update and the extra pass all at their floors,
    what the method's work alone costs against Vanilla's (a structural bound on the ratio)."""
    out, totals = {}, {}
    for name, t in times.items():
        f32 = float32_gflops and t.get("update_float32") and all(t["update_float32"])
        row = {k: round(statistics.median(v), 2) for k, v in t.items() if k != "update_float32"}
        for timer in ("update_s", "sensitivity_s"):
            work = phase_flops(config, passes[name], prefix_min, timer)
            if work:
                rate = float32_gflops if f32 and timer == "update_s" else gflops
                floor = work / (rate * 1e9)
                row[timer.replace("_s", "_floor_s")] = round(floor, 2)
                row[timer.replace("_s", "_gflop")] = float(f"{work / 1e9:.4g}")
                row[timer.replace("_s", "_over_floor")] = round(row[timer] / floor, 2) if floor else None
        if f32:
            row["update_dtype"] = "float32"
        row["update_s_per_sample"] = round(row["update_s"] / samples, 3)
        totals[name] = rollout_s + row["update_s"] + row["sensitivity_s"]
        row["iteration_s"] = round(totals[name], 2)
        out[name] = row
    for name, total in totals.items():
        if name != "vanilla":
            out[f"{name}_over_vanilla"] = round(total / totals["vanilla"], 3)
    van = out.get("vanilla", {})
    for name in ("sprpo", "sam"):  # the least the ratio can be while the extra pass runs: that pass at its floor
        if name in out and out[name].get("sensitivity_floor_s"):
            out[f"{name}_over_vanilla_bound"] = round(1 + out[name]["sensitivity_floor_s"] / totals["vanilla"], 3)
            if generation_floor_s and van.get("update_floor_s"):
                own = generation_floor_s + out[name]["update_floor_s"] + out[name]["sensitivity_floor_s"]
                out[f"{name}_over_vanilla_at_floors"] = round(own / (generation_floor_s + van["update_floor_s"]), 3)
    return out


def method_passes(batch, depth: int, layers: int, regularised: bool, skip_zero_adv: bool = True,
                  steps: int = 1, reuse_frozen: bool = False, subset=None, first_rows=None,
                  graph_rows=None) -> dict[str, list]:
    """The passes each method's iteration runs over ``batch``: ``(timer, rows, layers the
    backward reaches, layers the forward runs, whether it runs the LM head)``, 0 backward
    layers for a forward only.  The
    update runs every row when a regulariser is on, else the rows with a non-zero advantage
    (``Actor.rows_with_gradient``), backward to the lowest LoRA layer (``depth``); the replay
    and SAM's channel gradient run the rows with a non-zero advantage through all ``layers``.
    With several optimizer ``steps`` (mini-batches, epochs), ``Actor.ppo_update`` first fills
    the old log-probs of every row with a forward-only pass (verl's ``compute_log_prob``),
    and with ``reuse_frozen`` its steps run only the top ``depth`` layers (from the states
    that pass kept); the one-pass estimate takes one step on its own forward, so neither.
    ``subset``: the rows a ``method.replay_frac`` replay runs (``sprpo_subset``).
    ``first_rows``: the rows whose old log-probs the first step's own forward gives
    (``Actor.first_step_logp``): the old-log-prob pass leaves them out, or with kept states
    runs the layers below the LoRA layers for every row and the rest of the model for the others.
    ``graph_rows``: ids of the rows whose graph below the LoRA layers the update kept for the
    replay (``Actor.replay_graph_gb``): their replay's forward runs the top ``depth`` layers only."""
    nonzero = [s for s in batch.samples if s.adv != 0.0]
    update_rows = batch.samples if regularised or not skip_zero_adv else nonzero
    probe_rows = nonzero if skip_zero_adv else batch.samples
    run = depth if steps > 1 and reuse_frozen and 0 < depth < layers else layers
    own = {id(s) for s in first_rows or ()}
    rest = [s for s in batch.samples if id(s) not in own]
    if steps <= 1:
        old = []
    elif not own:
        old = [("update_s", batch.samples, 0, layers, True)]
    elif run < layers:
        old = [("update_s", batch.samples, 0, layers - depth, False), ("update_s", rest, 0, depth, True)]
    else:
        old = [("update_s", rest, 0, layers, True)]
    step = ("update_s", update_rows, depth, run, True)
    probe = ("sensitivity_s", probe_rows, layers, layers, True)
    kept = graph_rows or set()
    replay = [("sensitivity_s", [s for s in probe_rows if id(s) in kept], layers, depth, True),
              ("sensitivity_s", [s for s in probe_rows if id(s) not in kept], layers, layers, True)]
    out = {"vanilla": old + [step],
           "sprpo": old + [step] + [p for p in replay if p[1]],
           "sprpo_one_pass": [("update_s", probe_rows, layers, layers, True)]
           + ([("update_s", batch.samples, depth, layers, True)] if regularised else []),
           "sam": [probe] + old + [step]}
    if subset is not None:
        out["sprpo_subset"] = old + [step, ("sensitivity_s", subset, layers, layers, True)]
    return out


def method_variants(method: MethodConfig) -> dict[str, MethodConfig]:
    """The methods a benchmark measures on one batch, from the profile's ``method`` section:
    Vanilla, SPrPO with Alg. 1 line 7's full replay, SPrPO's one-pass estimate, SAM."""
    return {"vanilla": MethodConfig(name="vanilla"),
            "sprpo": dataclasses.replace(method, name="sprpo", sensitivity="replay", replay_frac=1.0),
            "sprpo_one_pass": dataclasses.replace(method, name="sprpo", sensitivity="one_pass"),
            "sam": dataclasses.replace(method, name="sam")}


def warm_up(tr, batch, mcfg: MethodConfig, xi) -> None:
    """One untimed update of ``mcfg`` on the first two micro-batches' rows of ``batch``: the
    first-call allocations and kernel choices stay out of the timed updates."""
    tr.method = make_method(mcfg, tr.shape, tr.cfg.seed)
    tr.update(Batch(batch.without_old().samples[:2 * tr.actor.micro_batch]), xi, 0)


def actor_passes(tr, batch, reuse_frozen: bool, subset=None, first_step_logp: bool = False,
                 graph_rows=None) -> dict[str, list]:
    """:func:`method_passes` for ``tr``'s model and actor settings (LoRA depth, regularisers,
    optimizer steps per update) over ``batch`` (its rows without old log-probs, as an update
    gets them)."""
    a, L = tr.actor, int(tr.policy.model.config.num_hidden_layers)
    regularised = bool(a.loss_cfg.entropy_coeff or a.kl_coef)
    minis = batch.mini_batches(a.mini_batch)
    steps = len(minis) * a.epochs
    own = a.first_step_rows(minis[0], batch) if first_step_logp else set()
    first = [s for s in minis[0].samples if id(s) in own] if first_step_logp else None
    return method_passes(batch, L - lowest_trainable_layer(tr.model), L, regularised, a.skip_zero_adv, steps,
                         reuse_frozen, subset, first, graph_rows)


#: the actor's pass settings that the bench paths set (``update.*`` keys of the same names)
LEVERS = ("prefix_min", "reuse_frozen", "fused_kernels", "fused_lora", "fused_entropy", "native_gqa",
          "first_step_logp", "attention", "replay_graph_gb")


def actor_levers(actor) -> dict:
    """``actor``'s pass settings as they are (the :data:`LEVERS`)."""
    return {k: getattr(actor, k) for k in LEVERS}


def path_levers(own: dict, path: str, prefix_min: int) -> dict:
    """The actor's pass settings on one bench path, from its own (``own``: :func:`actor_levers`
    as the profile set them).  ``shared``: the profile's passes with shared prefixes of
    ``prefix_min`` tokens (``speed.prefix_min``; a profile with sharing off is measured at 16); ``whole``: the reference (every row whole, every layer at every step,
    peft's LoRA forward, log-probs and entropy apart, K and V repeated, SDPA, every row's old
    log-probs from their own pass, the replay through every layer); ``sdpa``: shared with SDPA
    attention; ``fused``: shared with ``speed.fused_kernels``; ``full_replay``: shared with the
    replay through every layer.  Only ``fused`` compiles kernels, whatever the profile says."""
    whole = path == "whole"
    return {"prefix_min": 0 if whole else prefix_min or 16, "reuse_frozen": own["reuse_frozen"] and not whole,
            "fused_kernels": path == "fused", "fused_lora": own["fused_lora"] and not whole,
            "fused_entropy": own["fused_entropy"] and not whole, "native_gqa": own["native_gqa"] and not whole,
            "first_step_logp": own["first_step_logp"] and not whole,
            "attention": "sdpa" if path in ("whole", "sdpa") else own["attention"],
            "replay_graph_gb": 0.0 if path in ("whole", "full_replay") else own["replay_graph_gb"]}


def use_levers(actor, levers: dict) -> None:
    """Set ``actor``'s pass settings (:func:`path_levers`)."""
    for k, v in levers.items():
        setattr(actor, k, v)


def restore_point(actor):
    """A function that puts ``actor``'s trainable parameters and optimizer state back to
    what they are now: every method measured on one batch starts from the same adapter."""
    params0 = [p.detach().clone() for p in actor.params]
    opt0 = copy.deepcopy(actor.opt.state_dict())

    def restore() -> None:
        with torch.no_grad():
            for p, v in zip(actor.params, params0):
                p.copy_(v)
        actor.opt.load_state_dict(copy.deepcopy(opt0))

    return restore


def rollout_batch(profile: str, env: str, overrides: Sequence[str] | None = None) -> tuple:
    """``(trainer, batch, episodes, xi, rollout stats, setup seconds)``: one RL rollout batch of the
    profile (:meth:`Trainer.collect` at iteration 0, under SPrPO's initial xi), its environments
    closed; the setup seconds are the model load and warm start (built when not cached)."""
    cfg = load_config(profile, [hw.allocator_override(), *(overrides or []), f"env.name={env}", "method.name=sprpo"])
    t0 = time.perf_counter()
    if cfg.warm_start:
        prepare_warm_start(cfg, progress=True)
    tr = Trainer(cfg, run_folder(cfg), progress=True)
    setup_s = time.perf_counter() - t0
    eps, xi, rst = tr.collect(0)
    batch, _ = build_batch(eps, cfg.update.adv, cfg.update.estimator)
    tr.envs.close()
    return tr, batch, eps, xi, rst, setup_s


def bench_train(profile: str = "cpu", env: str = "webshop", repeats: int = 1, overrides: list[str] | None = None,
                paths: tuple[str, ...] = ("shared", "whole"), replay_frac: float | None = None,
                methods: tuple[str, ...] | None = None) -> dict:
    """Seconds per iteration by phase for Vanilla, SPrPO (Alg. 1 line 7's replay, and the
    one-pass estimate) and SAM on one rollout batch, each phase against its FLOP floor, for
    the profile's passes (``shared``: shared prefixes of ``speed.prefix_min``, with
    ``speed.reuse_frozen`` steps that start at the lowest LoRA layer, ``speed.fused_lora``,
    ``speed.fused_entropy``, ``speed.native_gqa`` and ``speed.first_step_logp``) and the
    reference (``whole``: every row whole, every layer at every step, peft's LoRA forward,
    log-probs and entropy apart, K and V repeated per query head, every row's old log-probs
    from their own pass), side by side; ``fused``: the shared
    passes with ``speed.fused_kernels`` (RMSNorm, SwiGLU and the rotary embedding compiled; the
    ``shared`` and ``whole`` passes run eagerly whatever the profile says).

    One rollout batch is collected with :meth:`Trainer.collect` (timed, under SPrPO's
    initial xi); each method's :meth:`Trainer.update` then runs from the same adapter and
    optimizer state, interleaved ``repeats`` times (median).  A method's iteration is the
    rollout plus its update and extra pass.  Floors: :func:`hardware.train_pass_flops` of
    the rows each pass runs (the update: every row when a regulariser is on; the replay and
    SAM's channel gradient: the rows with a non-zero advantage, backward through every
    layer; the update's backward stops at the lowest LoRA layer; with several optimizer
    steps, the forward-only pass that fills the old log-probs first) at the matmul rate
    measured here for the model's dtype and shapes (probed before and after the updates, the
    faster of the two: the rate of this host's matrix units drifts by up to 2x between minutes, and a floor
    must not move with it; an update that ran in float32, SAM's when its xi is below bfloat16's
    resolution, at the float32 rate measured the same way); generation against
    :func:`generation_floor` of every episode played, refill rounds included.  Each
    method's ``ppo_steps`` says how many optimizer steps it took (the one-pass estimate:
    one).  ``tokens`` says what the passes compute against what the batch holds: padding,
    and prefixes computed once per row instead of once.  ``setup_s``: loading the model and
    the warm start, apart from the measurement (it includes building a warm start not yet cached).
    ``replay_frac``: also SPrPO with ``method.replay_frac`` (``sprpo_subset``), its S_hat, m_hat and
    first sigma against the full replay's (``subset_vs_replay``), as the one-pass estimate's.
    ``methods``: measure only these besides ``vanilla`` and ``sprpo`` (e.g. ``("sprpo_subset",)``).

    Long on purpose: the collection, the interleaved repeats of every method from one
    adapter state, and the floors of each pass are one measurement and share its state."""
    if set(paths) - set(TRAIN_PATHS) or not paths:
        raise ValueError(f"bench train --paths: expected some of {','.join(TRAIN_PATHS)}, got {','.join(paths)}")
    known = {"sprpo_one_pass", "sam"} | ({"sprpo_subset"} if replay_frac else set())
    if methods is not None and set(methods) - known:
        raise ValueError(f"bench train --methods: {sorted(set(methods) - known)} not among {sorted(known)} "
                         "(vanilla and sprpo always run; sprpo_subset needs --replay-frac)")
    tr, batch, eps, xi, rst, t_setup = rollout_batch(profile, env, overrides)
    cfg = tr.cfg
    config = tr.policy.model.config
    probes = [prefill_rate(config, tr.dtype)]  # again after the updates: the floors use the faster
    bandwidth = hw.probe_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in tr.model.parameters())
    L = int(config.num_hidden_layers)
    depth = L - lowest_trainable_layer(tr.model)
    a = tr.actor
    nonzero = [s for s in batch.samples if s.adv != 0.0]
    # the shared path is the profile's own (shared prefixes, kept states below the LoRA layers);
    # the whole path is the reference: every row whole, every layer at every step
    own = actor_levers(a)
    levers = {path: path_levers(own, path, cfg.speed.prefix_min) for path in paths}
    shared_min = path_levers(own, "shared", cfg.speed.prefix_min)["prefix_min"]
    subset = replay_rows(batch, replay_frac, cfg.seed, 0)[0].samples if replay_frac else None
    variants = method_variants(cfg.method)
    if replay_frac:
        variants["sprpo_subset"] = dataclasses.replace(variants["sprpo"], replay_frac=replay_frac)
    if methods is not None:
        variants = {k: v for k, v in variants.items() if k in {"vanilla", "sprpo", *methods}}
    restore = restore_point(a)
    times = {(path, v): {"update_s": [], "sensitivity_s": [], "ppo_steps": [], "update_float32": []}
             for path in paths for v in variants}
    kept: dict[str, set[int]] = {path: set() for path in paths}  # the rows whose graph SPrPO's update kept
    kept_gib: dict[str, float] = {}
    states: dict[tuple[str, str], tuple] = {}
    for path in paths:  # untimed warm-up of both layouts (first-call allocations), on a few rows
        use_levers(a, levers[path])
        warm_up(tr, batch, variants["sprpo"], xi)
    bar = progress_bar(total=repeats * len(paths) * len(variants), desc="bench train: updates", unit="update")
    for _ in range(repeats):  # minutes each on a real batch: the bar names the one running and the last one's time
        for path in paths:
            use_levers(a, levers[path])
            for name, mcfg in variants.items():
                bar.set_postfix_str(f"{path} {name}", refresh=True)
                restore()
                tr.method = make_method(mcfg, tr.shape, cfg.seed)
                fresh = batch.without_old()  # copies of the rows, in order
                st = tr.update(fresh, xi if name.startswith("sprpo") else None, 0)
                if name.startswith("sprpo"):
                    states[(path, name)] = (tr.method.S_hat.clone(), tr.method.m_hat)
                if name == "sprpo":
                    kept[path] = {id(s) for s, c in zip(batch.samples, fresh.samples) if id(c) in a.graph_rows}
                    kept_gib[path] = float(f"{a.graph_bytes / 2 ** 30:.3g}")
                for k in ("update_s", "sensitivity_s"):
                    times[(path, name)][k].append(st[k])
                times[(path, name)]["ppo_steps"].append(st.get("ppo_steps", 1.0))
                update_xi = getattr(tr.method, "last_xi", xi if name.startswith("sprpo") else None)  # SAM's: line 4's
                times[(path, name)]["update_float32"].append(below_resolution(update_xi, a.dtype))
                bar.write(f"  {path} {name}: update {st['update_s']:.1f} s, extra pass {st['sensitivity_s']:.1f} s")
                bar.update()
    bar.close()
    passes = {path: actor_passes(tr, batch, levers[path]["reuse_frozen"], subset, levers[path]["first_step_logp"],
                                 kept[path])
              for path in paths}
    probes.append(prefill_rate(config, tr.dtype))
    gflops = max(probes)
    ran_f32 = any(any(t["update_float32"]) for t in times.values()) and tr.dtype != "float32"
    f32_gflops = prefill_rate(config, "float32") if ran_f32 else None  # SAM's update below bf16's resolution
    played = eps + list(rst.get("dropped", []))  # generate_s covers every refill round's episodes
    gen = generation_floor(config, played, gflops, bandwidth, weight_bytes, getattr(torch, tr.dtype).itemsize)
    t_roll = rst["rollout_s"]
    res: dict = {"profile": profile, "env": env, "overrides": list(overrides or []), "dtype": tr.dtype,
                 "setup_s": round(t_setup, 2),  # model load and warm start (minutes of SFT when not cached)
                 "matmul_gflops": gflops, "matmul_gflops_probes": probes,
                 **({"matmul_gflops_float32": f32_gflops} if f32_gflops else {}), "bandwidth_gbs": round(bandwidth, 1), "layers": L, "lora_layers": depth,
                 "episodes": len(eps), "samples": len(batch.samples), "samples_nonzero_adv": len(nonzero),
                 "response_tokens": batch.n_tokens, "micro_batch": a.micro_batch, "prefix_min": shared_min,
                 **({"replay_frac": replay_frac, "replay_rows": len(subset)} if replay_frac else {}),
                 "ppo_mini_batch_size": cfg.update.ppo_mini_batch_size,
                 "rollout": {"rollout_s": round(t_roll, 2), "generate_s": round(rst["generate_s"], 2),
                             "env_s": round(rst["env_s"], 3), "rounds": int(rst.get("rounds", 1)),
                             "episodes_played": len(played), **gen,
                             "generate_over_floor": round(rst["generate_s"] / gen["floor_s"], 2)}}
    whole = batch.computed_tokens(a.micro_batch)
    shared = batch.computed_tokens(a.micro_batch, shared_min)
    res["tokens"] = {"batch": whole["tokens"], "whole_computed": whole["computed"], "whole_padding": whole["padding"],
                     "shared_computed": shared["computed"], "shared_padding": shared["padding"],
                     "prefix_groups": sum(1 for g in batch.prefix_plan(shared_min) if g.prefix),
                     "trie_limit": batch.trie_tokens(),
                     "shared_over_batch": round(shared["computed"] / whole["tokens"], 3)}
    for path in paths:
        res[path] = phase_rows({n: times[(path, n)] for n in variants}, passes[path], config, levers[path]["prefix_min"], gflops,
                                t_roll, len(batch.samples), gen["floor_s"], f32_gflops)
    if {"shared", "whole"} <= set(paths):
        res["whole_over_shared"] = {n: round(res["whole"][n]["update_s"] / res["shared"][n]["update_s"], 2)
                                    for n in variants}
    if {"shared", "sdpa"} <= set(paths):
        res["sdpa_over_shared"] = {n: round(res["sdpa"][n]["update_s"] / res["shared"][n]["update_s"], 3)
                                   for n in variants}
        res["sdpa_extra_over_shared"] = {n: round(res["sdpa"][n]["sensitivity_s"] / res["shared"][n]["sensitivity_s"], 3)
                                         for n in variants if res["shared"][n].get("sensitivity_s")}
        res["attention"] = levers["shared"]["attention"]
    if any(kept.values()):  # SPrPO's replay from the graph its update kept (speed.replay_graph_gb)
        res["replay_graph"] = {path: {"budget_gib": levers[path]["replay_graph_gb"], "kept_gib": kept_gib[path], "rows": len(kept[path]),
                                      "replay_rows": len(nonzero)} for path in paths if kept[path]}
    # the kept graph against the replay through every layer: only when the shared path kept one
    # (speed.replay_graph_gb > 0 given; at the default 0 both paths replay every layer)
    graph_pair = {"shared", "full_replay"} <= set(paths) and bool(kept["shared"])
    if graph_pair:
        res["full_replay_extra_over_shared"] = round(res["full_replay"]["sprpo"]["sensitivity_s"]
                                                     / res["shared"]["sprpo"]["sensitivity_s"], 3)
    if {"shared", "fused"} <= set(paths):
        res["fused_over_shared"] = {n: round(res["fused"][n]["update_s"] / res["shared"][n]["update_s"], 3)
                                    for n in variants}
    if not nonzero:  # e.g. warm_start=false: no reward, zero gradient, S_hat = 0
        res["one_pass_vs_replay"] = "not comparable: every advantage in this batch is 0 (no reward signal)"
        return res
    for name, key in (("sprpo_one_pass", "one_pass_vs_replay"), ("sprpo_subset", "subset_vs_replay")):
        if name in variants:
            res[key] = estimate_agreement(states[(paths[0], "sprpo")], states[(paths[0], name)], cfg.method)
    if graph_pair:  # the same steps: S_hat and m_hat differ by the replay's rounding
        res["graph_vs_full_replay"] = estimate_agreement(states[("full_replay", "sprpo")], states[("shared", "sprpo")],
                                                         cfg.method)
    return res


def prefill_rate(config, dtype: str) -> float:
    """GFLOP/s of the model's linears at the prefill row count (:func:`hw.probe_matmul`)."""
    return hw.probe_matmul(hw.linear_shapes(config), dtypes=(dtype,))[dtype]["gflops_by_rows"][str(hw.PREFILL_ROWS)]


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 difference of ``x`` from ``ref`` (float64)."""
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def estimate_agreement(replay: tuple, estimate: tuple, mcfg: MethodConfig) -> dict:
    """An estimate of Alg. 1 line 7's ``(S_hat, m_hat)`` against the replay's on the same batch:
    Spearman and Pearson (of log S) correlations, relative L2 error of S_hat, relative difference of
    m_hat, and the relative L2 difference of the sigma each gives under the energy rule (the noise
    the next rollout would carry)."""
    (S_r, m_r), (S_o, m_o) = replay, estimate
    ls_r, ls_o = S_r.clamp_min(1e-30).log().flatten(), S_o.clamp_min(1e-30).log().flatten()
    sig_r, _ = energy_sigma(S_r, mcfg.alpha, mcfg.rho, mcfg.sigma_max, mcfg.s_quantile)
    sig_o, _ = energy_sigma(S_o, mcfg.alpha, mcfg.rho, mcfg.sigma_max, mcfg.s_quantile)
    return {"S_spearman": round(rank_correlation(S_r, S_o), 4),
            "log_S_pearson": round(float(torch.corrcoef(torch.stack([ls_r, ls_o]))[0, 1]), 4),
            "S_rel_l2": round(rel_l2(S_o, S_r), 4),
            "m_hat_rel_diff": round(abs(m_o - m_r) / max(abs(m_r), 1e-30), 4),
            "sigma_rel_l2": round(rel_l2(sig_o, sig_r), 4)}


def shape_config(model: str = "smollm2-135m"):
    """A model's config (layer shapes, vocabulary) without loading its weights where
    possible: the tiny specs' configs are built, the embedded model's cached converted
    directory and local directories / hub ids are read with ``AutoConfig``; the embedded
    model is converted first (minutes, once) if it has not been yet."""
    from transformers import AutoConfig, Qwen2Config  # heavy (seconds to import): loaded on first use

    if model in TINY_SPECS:
        shape = QWEN25_15B_SHAPE if model == "random-qwen2.5-1.5b" else TinyConfig()
        return Qwen2Config(vocab_size=259, **vars(shape))  # the byte tokenizer: 256 bytes + 3 specials
    if model == DEFAULT_MODEL:
        path = cache_dir() / "models" / "smollm2-135m-instruct"
        if not (path / "config.json").is_file():
            return load_policy(model, dtype="float32").model.config
        return AutoConfig.from_pretrained(str(path))
    return AutoConfig.from_pretrained(model)


def _shape_summary(config) -> dict:
    return {"hidden": config.hidden_size, "ffn": config.intermediate_size, "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads, "kv_heads": getattr(config, "num_key_value_heads", None),
            "vocab": config.vocab_size}


def bench_machine(model: str = "smollm2-135m", context: int = 500) -> dict:
    """Matmul GFLOP/s per dtype at ``model``'s linear shapes (prefill-like 256 rows and
    decode-like 16 rows), memory bandwidth, the faster dtype, and the work per token:
    FLOPs per prompt token at a ``context``-token prompt (:func:`hardware.prefill_flops`)
    and per generated token, with the floors they imply on this machine (prefill at the
    256-row rate; a decode step reads every weight once, at the measured bandwidth)."""
    config = shape_config(model)
    matmul = hw.probe_matmul(hw.linear_shapes(config))
    bandwidth = hw.probe_bandwidth()
    per_prompt_token = hw.prefill_flops(config, [context], lm_head=False) / context
    per_new_token = hw.decode_flops(config, context)
    weights = hw.layer_params(config) * config.num_hidden_layers + config.hidden_size * config.vocab_size
    res: dict = {"model": model, "shapes": _shape_summary(config), "machine": hw.machine_info(),
                 "matmul_gflops": {d: v["gflops"] for d, v in matmul.items()},
                 "prefill_gflops": {d: v["gflops_by_rows"][str(hw.PREFILL_ROWS)] for d, v in matmul.items()},
                 "decode_gflops": {d: v["gflops_by_rows"][str(hw.DECODE_ROWS)] for d, v in matmul.items()},
                 "cases": {d: v["cases"] for d, v in matmul.items()},
                 "bandwidth_gbs": round(bandwidth, 1), "fast_dtype": hw.pick_dtype(matmul),
                 "context_tokens": context, "gflop_per_prompt_token": round(per_prompt_token / 1e9, 4),
                 "gflop_per_generated_token": round(per_new_token / 1e9, 4)}
    res["prefill_floor_s_per_1k_tokens"] = {d: round(1000 * per_prompt_token / (g * 1e9), 3)
                                            for d, g in res["prefill_gflops"].items()}
    res["decode_step_weights_floor_ms"] = {d: round(1e3 * weights * getattr(torch, d).itemsize / (bandwidth * 1e9), 2)
                                           for d in matmul}
    return res


def webshop_prompts(n: int = 16, max_steps: int = 3, seed: int = 0) -> list[str]:
    """``n`` real WebShop prompts as a rollout builds them (test tasks 0..n-1, the cpu
    profile's prompt settings); prompt i is taken after ``i % (max_steps + 1)`` steps of
    the visible-information shopper, so search, results and item pages all appear."""
    agent = AgentConfig(history_len=2, max_obs_chars=1000, history_obs_chars=120, echo_instruction=False)
    pool = make_webshop_pool(seed=seed)
    out = []
    for i in range(n):
        ep = pool.open("test", i).spawn()
        obs, history, actions = ep.reset(), [], []
        for _ in range(i % (max_steps + 1)):
            act = visible_shopper_action(ep.instruction, obs.text, obs.admissible, actions)
            if act is None:
                break
            nxt = ep.step(act)
            if nxt.done:
                break
            history.append(HistoryStep(obs.text, act, bool(nxt.info.get("invalid"))))
            actions.append(act)
            obs = nxt
        out.append(build_prompt(ep.instruction, obs.text, obs.admissible, history, agent))
        ep.close()
    return out


def prefix_reuse(episodes: Sequence[Sequence[Sequence[int]]]) -> dict:
    """What a prefix cache could save on prompts ``episodes`` (per episode, its prompts' token
    ids in step order, episodes in the order played).  ``previous_step``: the tokens each prompt
    shares from its start with its episode's previous prompt (what a cache holding the
    episode's last call keeps); ``any_earlier``: the tokens already in a prompt played before
    it, any episode (the nodes of their trie: an unlimited cache).  Shares are of all prompt
    tokens; ``floor_factor`` = 1 - the ``any_earlier`` share, the least the all-token
    prefill floor can fall to by reusing prefixes.  Each prompt's last token is always
    computed (its logits start the generation), so neither share counts it."""
    total = prev = 0
    root: dict = {}
    nodes = 0
    for steps in episodes:
        last: Sequence[int] = ()
        for ids in steps:
            total += len(ids)
            lcp = 0
            while lcp < min(len(ids) - 1, len(last)) and ids[lcp] == last[lcp]:
                lcp += 1
            prev += lcp
            node = root
            for i, t in enumerate(ids):
                if t not in node or i == len(ids) - 1:
                    nodes += 1
                node = node.setdefault(t, {})
            last = ids
    earlier = total - nodes
    return {"prompt_tokens": total, "previous_step_share": round(prev / total, 4) if total else 0.0,
            "any_earlier_share": round(earlier / total, 4) if total else 0.0,
            "floor_factor": round(nodes / total, 4) if total else 1.0}


def bench_prompts(model: str = "smollm2-135m", episodes: int = 16, profile: str = "cpu", env: str = "webshop",
                  split: str = "test", overrides: Sequence[str] = ()) -> dict:
    """Token budget of a profile's prompts on ``env``: ``episodes`` demonstrator episodes
    (the profile's ``sft.demonstrator``: WebShop's shopper, ALFWorld's expert) played on
    ``split`` to the end or ``env.max_steps``, each step's prompt built as a rollout builds
    it (:func:`sprpo_lib.warmstart.demos.collect_demonstrations`, the profile's agent settings).
    Per step: mean tokens of each section (:func:`~sprpo_lib.agent.prompt.prompt_sections`: task,
    interaction context, current observation, available actions, template) and its share
    of the templated prompt (``chat_and_joins``: chat template and BPE merges across
    sections), the mean number of listed actions; per episode: steps and prompt tokens
    (the prefill an episode costs); ``prefix_reuse``: what a prefix cache could save of it
    (:func:`prefix_reuse`).  Where the prefill FLOPs go, before any engine runs."""
    cfg = load_config(profile, [f"env.name={env}", *overrides])
    pool = make_pool(env, cfg.env.data_dir, cfg.env.seed)
    agent = cfg.rollout.agent
    demos = collect_demonstrations(pool, split, range(episodes), agent, max_steps=cfg.env.max_steps or pool.max_steps,
                                   demonstrator=cfg.sft.demonstrator)
    tok = load_policy(model, dtype="float32").tokenizer
    plain = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows, ids = [], {}
    for d in sorted(demos, key=lambda d: d.step):  # stable: episodes keep the order played
        templated = plain(chat_text(tok, d.prompt, agent))  # what token_counter counts
        ids.setdefault(d.task_id, []).append(templated)
        secs = prompt_sections(d.prompt)
        r = {k: len(plain(v)) for k, v in secs.items()}
        r["total"] = len(templated)
        r["chat_and_joins"] = r["total"] - sum(r[k] for k in PROMPT_SECTIONS)
        r["actions"] = len(parse_actions(secs["available actions"]))
        r["task_id"] = d.task_id
        rows.append(r)
    per_ep: dict[str, list[int]] = {}
    for r in rows:
        per_ep.setdefault(r["task_id"], []).append(r["total"])
    mean_total = float(np.mean([r["total"] for r in rows]))
    totals = [r["total"] for r in rows]
    return {"model": model, "profile": profile, "env": env, "split": split, "overrides": list(overrides),
            "demonstrator": cfg.sft.demonstrator, "episodes": len(per_ep), "prompts": len(rows),
            "agent": dataclasses.asdict(agent),
            "steps_per_episode": {"mean": round(float(np.mean([len(v) for v in per_ep.values()])), 2),
                                  "max": max(len(v) for v in per_ep.values())},
            "mean_total_tokens": round(mean_total, 1),
            "tokens_per_step": {"mean": round(mean_total, 1), "p95": float(np.percentile(totals, 95)),
                                "max": int(max(totals))},
            "tokens_per_episode": round(float(np.mean([sum(v) for v in per_ep.values()])), 1),
            "actions_per_step": round(float(np.mean([r["actions"] for r in rows])), 1),
            "prefix_reuse": prefix_reuse([ids[t] for t in per_ep]),
            "sections": {k: {"mean_tokens": round(float(np.mean([r[k] for r in rows])), 1),
                             "share": round(float(np.mean([r[k] for r in rows])) / mean_total, 4)}
                         for k in (*PROMPT_SECTIONS, "chat_and_joins")}}


GENERATE_ENGINES = ("hf_generator", "hf")  # the reference engines.HFGenerator, then registry engines
# OpenVINO engine variants: the registry's "openvino" (GenAI backend when installed) and our own
# decode loop on the same IR; each computes in the policy's dtype
OPENVINO_ENGINES = {"openvino": None, "openvino_loop": "loop"}


def bench_generate(model: str = "smollm2-135m", n_prompts: int = 16, new_tokens: int = 48,
                   engines: tuple[str, ...] = GENERATE_ENGINES, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                   temperatures: tuple[float, ...] = (0.0, 0.4), batch_size: int = 16, max_steps: int = 3,
                   repeats: int = 2, prefix_caching: bool = True) -> dict:
    """Generation engines x dtypes side by side on the same real WebShop prompts.

    Per (dtype, temperature, engine): the best wall seconds of ``repeats`` interleaved
    rounds (other processes on a shared machine only ever add time; all rounds are kept
    in ``walls_s``), prompt and generated tokens, and the
    wall time over the prefill floor (FLOPs of the unpadded prompts at this machine's
    256-row matmul rate for the dtype).  Greedy runs are compared token for token with
    the first engine's (``greedy_equal``); ``repeat_equal`` says whether every round gave
    the same outputs (same seed, fresh generator).  ``hf_generator`` is
    engines.HFGenerator (the reference); other names come from
    :data:`sprpo_lib.agent.engines.ENGINES`, plus ``openvino_loop`` (the OpenVINO engine's own decode
    loop), computing in the policy's dtype; they are built once (conversion, load and one ``load_weights`` reload are reported
    under ``openvino``, not timed as generation) and reset to call 0 for each run.
    ``prefix_caching=False``: engines with a paged KV cache recompute every prompt in every
    round (with it, a round after the first finds its prompts cached); with ``new_tokens=1``
    the wall time is then the engine's prefill alone, against the prefill floor."""
    prompts = webshop_prompts(n_prompts, max_steps)
    agent = AgentConfig(history_len=2, max_obs_chars=1000, history_obs_chars=120, echo_instruction=False)
    config = shape_config(model)
    matmul = hw.probe_matmul(hw.linear_shapes(config), dtypes=dtypes)
    policies = {d: load_policy(model, dtype=d) for d in dtypes}
    runs = [(d, t, e) for d in dtypes for t in temperatures for e in engines]
    walls: dict = {r: [] for r in runs}
    outs: dict = {}
    same: dict = {r: True for r in runs}
    built: dict = {}  # engines holding a compiled graph are built once (not timed), reset per run
    ov_stats: dict = {}
    for _ in range(repeats):
        for run in runs:
            dtype, temp, name = run
            pol = policies[dtype]
            cfg = GenerationConfig(temperature=temp, max_new_tokens=new_tokens, batch_size=batch_size, seed=0,
                                   prefix_caching=prefix_caching)
            if name in OPENVINO_ENGINES:
                if (dtype, name) not in built:
                    eng = OpenVINOEngine(pol, cfg, agent, backend=OPENVINO_ENGINES[name])
                    t0 = time.perf_counter()
                    eng.load_weights(bake_weights(pol.model))  # what one iteration's weight update costs
                    st = {k: eng.stats.get(k) for k in ("backend", "precision", "converted", "convert_s", "load_s")}
                    st["reload_s"] = round(time.perf_counter() - t0, 2)
                    ov_stats[f"{name}:{dtype}"] = st
                    built[(dtype, name)] = eng
                gen = built[(dtype, name)]
                gen.cfg, gen.calls = cfg, 0
            else:
                gen = HFGenerator(pol, cfg, agent) if name == "hf_generator" else make_engine(name, pol, cfg, agent)
            wall, out = _timed(gen, prompts)
            walls[run].append(wall)
            if run in outs:
                same[run] &= [g.response_ids for g in out] == [g.response_ids for g in outs[run]]
            else:
                outs[run] = out
    for eng in built.values():
        eng.close()
    res: dict = {"model": model, "machine": hw.machine_info(), "prompts": n_prompts, "new_tokens": new_tokens,
                 "batch_size": batch_size, "repeats": repeats, "prefix_caching": prefix_caching,
                 **({"openvino": ov_stats} if ov_stats else {}),
                 "prefill_gflops": {d: matmul[d]["gflops_by_rows"][str(hw.PREFILL_ROWS)] for d in dtypes}}
    for run in runs:
        dtype, temp, name = run
        out, wall = outs[run], min(walls[run])
        lengths = [len(g.prompt_ids) for g in out]
        floor = hw.prefill_flops(config, lengths) / (res["prefill_gflops"][dtype] * 1e9)
        row = {"wall_s": round(wall, 2), "walls_s": [round(w, 2) for w in walls[run]],
               "prompt_tokens": sum(lengths), "generated_tokens": sum(len(g.response_ids) for g in out),
               "prefill_floor_s": round(floor, 2), "wall_over_prefill_floor": round(wall / floor, 2),
               "repeat_equal": same[run]}
        if temp == 0 and name != engines[0]:
            ref = outs[(dtype, temp, engines[0])]
            row["greedy_equal"] = f"{sum(a.response_ids == b.response_ids for a, b in zip(ref, out))}/{len(out)}"
        res.setdefault(dtype, {}).setdefault(f"T{temp:g}", {})[name] = row
    if len(dtypes) > 1 and 0.0 in temperatures:
        a, b = outs[(dtypes[0], 0.0, engines[0])], outs[(dtypes[1], 0.0, engines[0])]
        res[f"greedy_equal_{dtypes[0]}_vs_{dtypes[1]}"] = f"{sum(x.response_ids == y.response_ids for x, y in zip(a, b))}/{len(a)}"
    return res


def bench_update(model: str = "smollm2-135m", dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                 samples: int = 8, prompt_len: int = 500, response_len: int = 24, lora_layers: int | None = 8,
                 repeats: int = 2) -> dict:
    """One PPO forward/backward (the actor's ``backward``) per dtype on the same batch of
    random token sequences, interleaved ``repeats`` rounds (best): does training run at
    the speed of the dtype ``dtype: auto`` picks for generation?"""
    g = torch.Generator().manual_seed(0)
    batch = Batch([Sample(torch.randint(3, 4000, (prompt_len + response_len,), generator=g).tolist(), response_len,
                          1.0 if i % 2 else -1.0) for i in range(samples)])
    actors = {}
    for dt in dtypes:
        pol = load_policy(model, dtype=dt)
        add_lora(pol, lora_on_last_layers(pol.model, LoraSettings(rank=16, alpha=32), lora_layers), seed=0)
        params = [p for p in pol.model.parameters() if p.requires_grad]
        actors[dt] = Actor(pol.model, pol.tokenizer.pad_token_id, torch.optim.Adam(params, lr=1e-4), UpdateConfig(micro_batch=4))
    walls: dict[str, list[float]] = {dt: [] for dt in dtypes}
    for _ in range(repeats):
        for dt, a in actors.items():
            a.zero_grad()
            t0 = time.perf_counter()
            a.backward(batch.without_old(), None)
            walls[dt].append(round(time.perf_counter() - t0, 2))
            a.zero_grad()
    res = {"model": model, "samples": samples, "prompt_len": prompt_len, "response_len": response_len,
           "lora_layers": lora_layers, "auto_dtype": load_policy(model).meta.get("dtype")}
    for dt in dtypes:
        res[dt] = {"backward_s": min(walls[dt]), "walls_s": walls[dt]}
    if len(dtypes) == 2:
        res["ratio_" + "_over_".join(dtypes)] = round(res[dtypes[0]]["backward_s"] / res[dtypes[1]]["backward_s"], 3)
    return res


EVAL_ENGINES = ("hf", "openvino")


def engine_runs(spec: str) -> tuple[str, str, dict]:
    """``engine``, ``engine:dtype`` (dtype float32 | bfloat16 | auto) or
    ``engine:dtype:field=value`` (a :class:`~sprpo_lib.agent.engines.GenerationConfig` setting, e.g.
    ``openvino:auto:prefix_caching=false``, or an :class:`~sprpo_lib.agent.prompt.AgentConfig` one as
    ``agent.field=value``, e.g. ``openvino:auto:agent.compact_actions=false``: the same policy
    under another prompt)."""
    name, _, rest = spec.partition(":")
    dtype, _, opts = rest.partition(":")
    fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    fields |= {"agent." + f.name for f in dataclasses.fields(AgentConfig)}
    gen: dict = {}
    for item in filter(None, opts.split("+")):
        k, eq, v = item.partition("=")
        if not eq or k not in fields:
            raise ValueError(f"--engines: {item!r} in {spec!r} must be FIELD=VALUE with FIELD one of {sorted(fields)}")
        gen[k] = yaml.safe_load(v)
    return name, dtype or "auto", gen


class CallLog:
    """A generator that records each call's prompts and wall seconds (``calls``) around ``gen``."""

    def __init__(self, gen):
        self.gen, self.calls = gen, []

    def __call__(self, prompts):
        t0 = time.perf_counter()
        out = self.gen(prompts)
        self.calls.append((list(prompts), time.perf_counter() - t0))
        return out


def prefill_replay(name: str, pol, gen: GenerationConfig, agent, calls) -> float:
    """Seconds a fresh engine takes for the same calls with one new token each: the prefill
    alone (the first token comes from the prefill's logits), with the prefix cache filled as
    in the episodes (from prompts; generated tokens re-enter it only through later prompts)."""
    eng = make_engine(name, pol, dataclasses.replace(gen, max_new_tokens=1), agent)
    try:
        return sum(_timed(eng, prompts)[0] for prompts, _ in calls)
    finally:
        close_engine(eng)


def generation_phases(prefill_s: float, generate_s: float, floor_s: float, cache_factor: float,
                      decode_floor_s: float) -> dict:
    """:func:`bench_eval`'s ``--phases`` fields: the replayed prefill against the all-token and
    the cached prefill floor, the rest of the generation time (decoding) against its floor."""
    dec = generate_s - prefill_s
    return {"prefill_s": round(prefill_s, 3), "prefill_over_floor": round(prefill_s / floor_s, 3),
            "prefill_over_cached_floor": round(prefill_s / (cache_factor * floor_s), 3),
            "decode_s": round(dec, 3), "decode_over_floor": round(dec / decode_floor_s, 2)}


def bench_eval(profile: str = "cpu", env: str = "webshop", engines: tuple[str, ...] = ("hf", "openvino"),
               episodes: int = 64, rollout: bool = True, model: str | None = None, phases: bool = False) -> dict:
    """The ``cpu`` profile's held-out evaluation (``episodes`` held-out training tasks of
    the warm-start policy, T = 0.4, the training evaluation's tasks and seed) and one RL
    rollout batch (``tasks_per_step`` x ``group_size`` at the rollout temperature), once
    per engine (``name`` or ``name:dtype``), side by side in one process: wall seconds,
    episodes per minute, prompt and generated tokens per second, the wall time over the
    prefill floor (unpadded prompt FLOPs at this machine's measured 256-row matmul rate
    for the dtype), success; the least that ratio can be (``least_over_prefill_floor``): an
    unlimited prefix cache prefilling only the prompts' distinct prefixes
    (:func:`prefix_reuse`'s ``floor_factor``) plus the decode floor of the responses played
    (:func:`generation_floor`); and, against the first engine, the paired difference in
    held-out success with a 95% bootstrap interval over tasks (same tasks, same seed).
    ``phases``: the held-out run's generation calls are replayed on a fresh engine with one
    new token each (:func:`prefill_replay`): ``prefill_s`` against the prefill floor and
    against the cached floor (the floor times ``prefix_cache_factor``), ``decode_s`` (the
    rest of the generation time) against the decode floor."""
    overrides = {"env.name": env, **({"model.spec": model} if model else {})}
    cfg = load_config(profile, **overrides)
    agent = cfg.rollout.agent
    pool = make_pool(env, cfg.env.data_dir, cfg.env.seed)
    idx = held_out_tasks(cfg, pool.splits()[cfg.sft.split], episodes)
    eval_tasks = [(cfg.sft.split, i) for i in idx]
    rng = np.random.default_rng(0)
    n_train = pool.splits()[cfg.sft.split]
    batch_tasks = [(cfg.sft.split, int(i)) for i in rng.choice(n_train, cfg.rollout.tasks_per_step, replace=False)]
    config = shape_config(cfg.model.spec)
    runs = [engine_runs(e) for e in engines]
    _open_once(pool, eval_tasks + batch_tasks)
    policies: dict = {}
    for _, dt, _ in runs:
        if dt not in policies:
            pol = load_policy(cfg.model.spec, dtype=dt)
            if cfg.warm_start:
                warm_start_policy(pol, pool, cfg, agent, progress=True)  # a first build takes minutes: show it
            pol.model.eval()
            policies[dt] = pol
    dtypes = sorted({str(p.model.dtype).replace("torch.", "") for p in policies.values()} | {"float32"})
    matmul = hw.probe_matmul(hw.linear_shapes(config), dtypes=tuple(dtypes))
    peak = {d: matmul[d]["gflops_by_rows"][str(hw.PREFILL_ROWS)] for d in dtypes}
    bandwidth = hw.probe_bandwidth()
    n_params = sum(p.numel() for p in next(iter(policies.values())).model.parameters())
    res: dict = {"profile": profile, "env": env, "model": cfg.model.spec, "machine": hw.machine_info(),
                 "episodes": len(eval_tasks), "prefill_gflops": peak,
                 "rollout_batch": {"tasks": cfg.rollout.tasks_per_step, "group_size": cfg.rollout.group_size,
                                   "temperature": cfg.rollout.generation.temperature}}
    outcomes = {}
    for (name, dt, extra), spec in zip(runs, engines):
        pol = policies[dt]
        dtype = str(pol.model.dtype).replace("torch.", "")
        row = {"engine": name, "dtype": dtype, **extra}
        base = dataclasses.replace(cfg.rollout.generation, **{k: v for k, v in extra.items() if "." not in k})
        run_agent = dataclasses.replace(agent, **{k[6:]: v for k, v in extra.items() if k.startswith("agent.")})
        jobs = [("eval", eval_tasks, 1, dataclasses.replace(base, temperature=eval_temperature(cfg), seed=cfg.sft.seed))]
        if rollout:
            jobs.append(("rollout", batch_tasks, cfg.rollout.group_size, dataclasses.replace(base, seed=cfg.seed * 100_003)))
        for what, tasks, group, gen in jobs:
            eng = make_engine(name, pol, gen, run_agent)
            dtype = row["dtype"] = getattr(eng, "compute_dtype", dtype)  # what the engine computes in
            envs = SerialEnvs(lambda: pool)
            log = CallLog(eng)
            t0 = time.perf_counter()
            try:
                recs, st = run_groups(envs, tasks, group, log, run_agent, cfg.env.max_steps, progress=False,
                                      count_tokens=token_counter(pol.tokenizer, run_agent))
            finally:
                envs.close()
                close_engine(eng)
            wall = time.perf_counter() - t0
            lengths = [len(s.prompt_ids) for r in recs for s in r.steps]
            gen_tokens = sum(len(s.response_ids) for r in recs for s in r.steps)
            size = getattr(torch, dtype).itemsize  # weights and KV cache in the dtype the engine computes in
            floor, decode = _floor_seconds(config, recs, peak[dtype], bandwidth, n_params * size, size)
            cache = prefix_reuse([[s.prompt_ids for s in r.steps] for r in recs])["floor_factor"]
            row[what] = {"wall_s": round(wall, 1), "generate_s": round(st["generate_s"], 1),
                         "episodes": len(recs), "episodes_per_min": round(60 * len(recs) / wall, 2),
                         "steps": sum(r.length for r in recs), "prompt_tokens": sum(lengths),
                         "generated_tokens": gen_tokens,
                         "prompt_tok_per_s": round(sum(lengths) / wall, 1),
                         "generated_tok_per_s": round(gen_tokens / wall, 2),
                         "prefill_floor_s": round(floor, 1), "wall_over_prefill_floor": round(wall / floor, 2),
                         "decode_floor_s": round(decode, 1), "decode_over_prefill_floor": round(decode / floor, 2),
                         "prefix_cache_factor": cache, "least_over_prefill_floor": round(cache + decode / floor, 2),
                         "success": round(sum(r.success for r in recs) / len(recs), 4),
                         "engine_retries": getattr(eng, "stats", {}).get("retries", 0)}
            if what == "eval":
                outcomes[spec] = np.array([float(r.success) for r in recs])
                if phases:
                    row[what].update(generation_phases(prefill_replay(name, pol, gen, run_agent, log.calls),
                                                       sum(t for _, t in log.calls), floor, cache, decode))
        res[spec] = row
    for spec in engines[1:]:
        res[spec]["eval"]["paired_vs_" + engines[0]] = _paired_vs(outcomes[spec], outcomes[engines[0]])
    return res


def _open_once(pool, tasks) -> None:
    """Open, reset and close every task once before any engine is timed: a task's first
    opening in a process costs more (ALFWorld: about 1 s a game against 0.2 s after,
    AMX Xeon), which would otherwise be charged to the first engine alone."""
    for split, i in dict.fromkeys(tasks):
        handle = pool.open(split, i)
        ep = handle.spawn()
        ep.reset()
        ep.close()
        getattr(handle, "close", lambda: None)()


def _paired_vs(a: np.ndarray, b: np.ndarray) -> dict:
    """:func:`bench_eval`'s paired difference in success of two engines on the same tasks and
    seed: mean, 95% percentile bootstrap over tasks (10,000 draws, seed 0), tasks gained and lost."""
    d = a - b
    boot = np.random.default_rng(0).integers(0, len(d), size=(10_000, len(d)))
    lo, hi = np.quantile(d[boot].mean(1), [0.025, 0.975])
    return {"success_diff": round(float(d.mean()), 4), "ci95": [round(float(lo), 4), round(float(hi), 4)],
            "gained": int((d > 0).sum()), "lost": int((d < 0).sum()), "zero_in_ci": bool(lo <= 0 <= hi)}


def bench_churn(model: str = "tiny-llama", rounds: int = 500, deadline_s: float = 30.0, stall_every: int = 0,
                stall_s: float = 60.0, new_tokens: int = 24) -> dict:
    """The ``openvino`` engine built, used and dropped again and again, as a reproduction
    does (a new pipeline per training iteration and per evaluation cell).

    Each round builds two engines on one policy (prefix caching on and off), makes two
    greedy calls of four agent-like prompts on each (the second extends the first, as an
    agent's next step does), checks every output against the ``hf`` engine's tokens and
    drops both.  Reports builds, calls, ``hangs`` (calls past their deadline, caught and
    repeated), ``unrecovered`` (calls that failed every attempt), token mismatches and
    wall time.  ``stall_every``: inject a stall of ``stall_s`` seconds (fault injection,
    :meth:`~sprpo_lib.agent.engines.openvino.OpenVINOEngine.stall_next`) into one call every that
    many rounds, to show recovery under churn (``injected``, not counted as hangs)."""
    gen = {"temperature": 0.0, "max_new_tokens": new_tokens, "batch_size": 4}
    pol = load_policy(model)
    history = [f"task {i}: " + "you see a mug on the table and a coffeemachine. " * (6 + i) for i in range(4)]
    calls = [history, [h + "you pick up the mug. next?" for h in history]]
    want = [[g.response_ids for g in make_engine("hf", pol, GenerationConfig(**gen))(p)] for p in calls]
    counts = {"builds": 0, "calls": 0, "retries": 0, "injected": 0, "unrecovered": 0, "mismatches": 0,
              "worker_starts": 0}
    round_s: list[float] = []
    t0 = time.perf_counter()
    for r in range(rounds):
        t1 = time.perf_counter()
        pair = [OpenVINOEngine(pol, GenerationConfig(**gen, prefix_caching=on), deadline_s=deadline_s)
                for on in (True, False)]
        counts["builds"] += 2
        if stall_every and r % stall_every == stall_every - 1:
            pair[r % 2].stall_next(stall_s)
            counts["injected"] += stall_s > deadline_s  # a stall shorter than the deadline is no fault
        for ref, prompts in zip(want, calls):
            for eng in pair:
                try:
                    got = [g.response_ids for g in eng(prompts)]
                    counts["mismatches"] += got != ref
                except RuntimeError:
                    counts["unrecovered"] += 1
                counts["calls"] += 1
        for eng in pair:
            counts["retries"] += eng.stats["retries"]
            counts["worker_starts"] += eng.stats["worker_starts"]
            eng.close()
        del pair
        gc.collect()
        round_s.append(time.perf_counter() - t1)
        if (r + 1) % 50 == 0 or r + 1 == rounds:
            print(f"  churn: round {r + 1}/{rounds}, {counts['builds']} builds, {counts['retries']} retries, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    return {"model": model, "machine": hw.machine_info(), "rounds": rounds, "deadline_s": deadline_s,
            "stall_every": stall_every,
            "stall_s": stall_s if stall_every else None, **counts,
            "hangs": counts["retries"] - counts["injected"], "wall_s": round(time.perf_counter() - t0, 1),
            "round_s_median": round(statistics.median(round_s), 3), "round_s_max": round(max(round_s), 2)}
