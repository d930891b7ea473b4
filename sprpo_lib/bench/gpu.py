"""``sprpo-bench gpu``: the GPU checks of the ``paper`` profile in one command.

1. the CUDA tests (``tests/test_cuda.py``, in a subprocess);
2. generation throughput of every available engine (hf and hf-graphs always, vllm where installed) at
   the profile's batch against the decode floor: per token step every weight and every live
   sequence's KV cache read once at the measured memory bandwidth;
3. per environment, one rollout of the profile's 16 tasks x 8 rollouts at the paper's shape
   (``random-qwen2.5-1.5b``, a few environment steps, under SPrPO's initial xi, as ``bench
   train`` collects it), then every method's update on that batch from the same adapter and
   optimizer state, each with its own rollout xi: seconds and peak memory per phase
   (``rollout_peak_cuda_gib``, ``update_peak_cuda_gib``: the update includes SPrPO's replay
   and SAM's extra pass), against the card's memory.  One shared rollout instead of one per
   method keeps the bench inside a GPU lease: on an H200 a rollout took 36-64 s.  Before it,
   every method's update on one micro-batch of rows at the profile's full prompt budget
   (``full_budget``: 4,096 / 3,072 prompt tokens), the worst case of any batch's micro-batch.

A random-weight model earns no reward, so every advantage is 0 and the passes over the
surrogate alone would skip every row (``speed.skip_zero_adv``): the bench sets
``speed.skip_zero_adv=false`` so that the update, SPrPO's replay and SAM's extra pass run
over every row, the memory a trained policy's batch needs at worst.  Each stage's result is
saved as it ends (``save``), and a stage that fails (out of memory, say) is recorded with its
error while the others still run.

On a CPU the same code runs at a tiny shape (the test), so the bench is checked without a
GPU.  A leaf: nothing in the library imports it.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sprpo_lib.agent.engines import ENGINES, GenerationConfig, close_engine, make_engine
from sprpo_lib.bench.suite import restore_point, sync_device, webshop_prompts
from sprpo_lib.core.batch import Batch, Sample, build_batch
from sprpo_lib.core.methods import make_method
from sprpo_lib.infra import hardware as hw
from sprpo_lib.infra.paths import package_checkout
from sprpo_lib.train.config import load_config
from sprpo_lib.train.trainer import Trainer

METHODS = ("vanilla", "gaussian", "sam", "sprpo")


def cuda_tests(device: str, timeout_s: int = 240) -> dict:
    """``pytest tests/test_cuda.py`` on ``device`` in a subprocess: counts and seconds."""
    t0 = time.perf_counter()
    env = {**os.environ, "SPRPO_TEST_DEVICE": device}
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"],
                             cwd=package_checkout(), env=env, capture_output=True, text=True, timeout=timeout_s)
        text, rc = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired:
        text, rc = "", "timeout"
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    return {"rc": rc, **counts, "seconds": round(time.perf_counter() - t0, 1)}


def generation(policy, engines: tuple[str, ...], batch: int, new_tokens: int, bandwidth_gbs: float) -> dict:
    """Per engine: new tokens per second on ``batch`` real WebShop prompts (greedy, at most
    ``new_tokens`` each) and the decode floor over the wall time.  The wall splits into the
    prefill (``prefill_s``: the same prompts with one new token, against ``prefill_floor_s``,
    their FLOPs at the matmul rate probed on the device at the model's shapes) and decoding
    (the rest, against the decode floor)."""
    prompts = webshop_prompts(batch)
    config, dev = policy.model.config, torch.device(policy.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    kv_bytes = next(policy.model.parameters()).element_size()
    dtype = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
    rate = hw.probe_matmul(hw.linear_shapes(config), dtypes=(dtype,), device=dev,
                           rows=(8192 if dev.type == "cuda" else hw.PREFILL_ROWS,))[dtype]["gflops"]
    out: dict = {}
    for name in engines:
        try:
            gens = [make_engine(name, policy, GenerationConfig(temperature=0.0, max_new_tokens=n, batch_size=batch))
                    for n in (new_tokens, 1)]
        except Exception as err:  # noqa: BLE001 - one engine's failure is its row; the others still run
            out[name] = {"error": _error(err)}
            continue
        try:
            walls, results, counts = [], [], []
            for gen in gens:  # the whole generation, then the prefill alone (one new token)
                gen(prompts[:2])  # warm-up: compilation, allocator
                sync_device(dev)
                before = dict(getattr(gen, "stats", {}))
                t0 = time.perf_counter()
                results.append(gen(prompts))
                sync_device(dev)
                walls.append(time.perf_counter() - t0)
                counts.append({k: v - before.get(k, 0) for k, v in getattr(gen, "stats", {}).items()
                               if isinstance(v, (int, float))})
        except Exception as err:  # noqa: BLE001 - as above
            out[name] = {"error": _error(err)}
            continue
        finally:
            for gen in gens:
                close_engine(gen)
        (wall, prefill), res = walls, results[0]
        tokens = sum(len(g.response_ids) for g in res)
        floor = hw.decode_floor_s(config, [len(g.prompt_ids) for g in res], [len(g.response_ids) for g in res],
                                  weight_bytes, kv_bytes, bandwidth_gbs)
        prefill_floor = hw.prefill_flops(config, [len(g.prompt_ids) for g in res]) / (rate * 1e9)
        out[name] = {"batch": batch, "new_tokens": tokens, "wall_s": round(wall, 2),
                     "tokens_per_s": round(tokens / wall, 1), "decode_floor_s": round(floor, 3),
                     "floor_over_wall": float(f"{floor / wall:.3g}"), "prefill_s": round(prefill, 2),
                     "prefill_floor_s": round(prefill_floor, 3), "decode_s": round(wall - prefill, 2),
                     "decode_floor_over_decode": float(f"{floor / max(wall - prefill, 1e-9):.3g}"),
                     "matmul_gflops": rate, **{f"engine_{k}": v for k, v in counts[0].items()}}
    return out


def trainer(profile: str, env: str, overrides: list[str]) -> Trainer:
    """The bench's Trainer for one environment: no warm start, a scratch run folder."""
    cfg = load_config(profile, [hw.allocator_override(), f"env.name={env}", "method.name=sprpo", "warm_start=false",
                                *overrides])
    return Trainer(cfg, Path(tempfile.mkdtemp(prefix=f"sprpo-bench-gpu-{env}-")), progress=True)


def _say(env: str, what: str, row: dict) -> None:
    print(f"bench gpu: {env} {what}: " + ", ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr, flush=True)


def method_update(tr: Trainer, name: str, batch: Batch) -> dict:
    """Method ``name``'s update on ``batch`` under its own rollout xi (None for Vanilla and
    SAM) from the actor's present state: seconds and peak memory of the phase."""
    tr.method = make_method(dataclasses.replace(tr.cfg.method, name=name), tr.shape, tr.cfg.seed)
    hw.reset_peak_memory(tr.actor.device)
    st = tr.update(batch.without_old(), tr.method.rollout_xi(0), 0)
    return {"update_s": st["update_s"], "sensitivity_s": st["sensitivity_s"],
            **{f"update_{k}": v for k, v in hw.peak_memory(tr.actor.device).items()}}


def iterations(tr: Trainer, methods: tuple[str, ...], res: dict, saved: Callable[[], object],
               deadline: float, warmup: bool = True) -> None:
    """One rollout (``res["rollout"]``) and every method's update on its batch (``res[method]``),
    each from the same adapter and optimizer state: seconds and peak memory per phase, saved
    and printed as each ends.  A method that would start after ``deadline``
    (``time.perf_counter``) is recorded as skipped, so a bench cut short says what it measured.
    ``warmup``: first an untimed Vanilla update on the batch (``res["warmup_s"]``), so that no
    method pays for the first pass over the batch's shapes.  On an H200 the first method timed
    without it, SPrPO, spent 25 s in an update whose passes took Vanilla and Gaussian 11 s after
    it; with the warm-up a record tells the first pass's cost from SPrPO's own."""
    a, cfg, dev = tr.actor, tr.cfg, tr.actor.device
    hw.reset_peak_memory(dev)
    eps, _, rst = tr.collect(0)
    batch, _ = build_batch(eps, cfg.update.adv, cfg.update.estimator)
    res["rollout"] = {"rollout_s": round(rst["rollout_s"], 2), "generate_s": round(rst["generate_s"], 2),
                      "env_s": round(rst["env_s"], 2), "episodes": len(eps), "samples": len(batch.samples),
                      "response_tokens": batch.n_tokens, "tokens": sum(len(s.ids) for s in batch.samples),
                      **{f"rollout_{k}": v for k, v in hw.peak_memory(dev).items()}}
    _say(cfg.env.name, "rollout", res["rollout"])
    saved()
    restore = restore_point(a)
    if warmup and time.perf_counter() <= deadline:
        t0 = time.perf_counter()
        tr.method = make_method(dataclasses.replace(cfg.method, name="vanilla"), tr.shape, cfg.seed)
        tr.update(batch.without_old(), None, 0)
        res["warmup_s"] = round(time.perf_counter() - t0, 2)
    for name in methods:
        if time.perf_counter() > deadline:
            res[name] = {"skipped": "deadline"}
            continue
        restore()
        res[name] = method_update(tr, name, batch)
        _say(cfg.env.name, name, res[name])
        saved()


def full_budget_batch(cfg, vocab: int, seed: int = 0) -> Batch:
    """``update.micro_batch`` rows of random tokens, each at the profile's full budget: a
    ``rollout.agent.max_prompt_tokens`` prompt and a ``max_new_tokens`` response, with
    advantages +-1 so that every pass runs over every row."""
    n_resp = cfg.rollout.generation.max_new_tokens
    length = cfg.rollout.agent.max_prompt_tokens + n_resp
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (cfg.update.micro_batch, length), generator=g)
    return Batch([Sample(row.tolist(), n_resp, 1.0 if i % 2 else -1.0) for i, row in enumerate(ids)])


def full_budget(tr: Trainer, methods: tuple[str, ...], out: dict, saved: Callable[[], object], deadline: float) -> None:
    """Every method's update on :func:`full_budget_batch`, from the adapter and optimizer state
    it found (restored after each): the memory of one micro-batch at the longest prompts the
    profile allows, which a random policy's few-step episodes do not reach.  Fills ``out`` as
    each method ends (``saved`` after each); past ``deadline``, skipped."""
    cfg = tr.cfg
    if cfg.rollout.agent.max_prompt_tokens is None:
        out["skipped"] = "no prompt budget (rollout.agent.max_prompt_tokens is null)"
        return
    batch = full_budget_batch(cfg, int(tr.policy.model.config.vocab_size), cfg.seed)
    out.update(rows=len(batch), tokens_per_row=len(batch.samples[0].ids))
    restore = restore_point(tr.actor)
    for name in methods:
        if time.perf_counter() > deadline:
            out[name] = {"skipped": "deadline"}
            continue
        out[name] = method_update(tr, name, batch)
        restore()
        _say(cfg.env.name, f"{name} at the full budget", out[name])
        saved()


def bench_gpu(profile: str = "paper", envs: tuple[str, ...] = ("webshop", "alfworld"), methods: tuple[str, ...] = METHODS,
              model: str = "random-qwen2.5-1.5b", device: str = "cuda", max_steps: int = 3, batch: int = 128,
              new_tokens: int = 64, run_tests: bool = True, overrides: tuple[str, ...] = (),
              save: Callable[[dict], object] | None = None, budget_s: float = float("inf"), warmup: bool = True) -> dict:
    """The record of ``sprpo-bench gpu`` (see the module doc).  Order: the CUDA tests, each
    engine's generation on the first environment's policy, then the iterations.  ``save`` is
    called with the record so far after each stage; no iteration starts after ``budget_s``."""
    t0 = time.perf_counter()
    deadline = t0 + budget_s
    dev = torch.device(device)
    res: dict = {"profile": profile, "model": model, "device": str(dev), "env_max_steps": max_steps,
                 "budget_s": budget_s if budget_s < float("inf") else None,
                 "reserve_per_phase": True,  # hw.reset_peak_memory empties the allocator's cache
                 "methods": list(methods)}  # in the order they ran
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        res["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
    res["bandwidth_gbs"] = round(hw.probe_bandwidth(512 if dev.type == "cuda" else 128, dev), 1)
    saved = (lambda: save(res)) if save else (lambda: None)
    if run_tests:
        res["cuda_tests"] = cuda_tests(device)
        saved()
    ov = [f"model.spec={model}", f"model.device={device}", f"env.max_steps={max_steps}", "speed.skip_zero_adv=false",
          *overrides]
    res["overrides"] = ov
    for i, env in enumerate(envs):
        res[env] = rows = {}
        tr = None
        try:
            tr = trainer(profile, env, ov)
            if i == 0:
                engines = tuple(e for e in ("hf", "hf-graphs", "vllm") if e in ENGINES and (e != "vllm" or _has("vllm")) and
                                (e != "vllm" or dev.type == "cuda"))
                res["generation"] = generation(tr.policy, engines, batch, new_tokens, res["bandwidth_gbs"])
                saved()
            full_budget(tr, methods, rows.setdefault("full_budget", {}), saved, deadline)
            iterations(tr, methods, rows, saved, deadline, warmup)
        except Exception as err:  # noqa: BLE001 - an out-of-memory is a result: record it, run the other stages
            rows["error"] = _error(err)
        finally:
            if tr is not None:
                tr.envs.close()
            del tr
            _release(dev)
        saved()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def _error(err: Exception) -> str:
    """A failed stage's entry in the record: the exception's type and the start of its message."""
    return f"{type(err).__name__}: {str(err)[:500]}"


def _release(dev: torch.device) -> None:
    """Free what a failed stage left cached on the GPU, so that the next starts clean."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
