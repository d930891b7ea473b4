"""Benchmarks: JSON for the record, a table for the eye.

    python -m sprpo_lib.bench perturb [--model smollm2-135m] [--n-calib 128] [--calib-len 256]
    python -m sprpo_lib.bench envs
    python -m sprpo_lib.bench train [--profile cpu] [--env webshop] [key=value ...]

Speed claims are ratios measured side by side in one run (e.g. generation with and
without the perturbation hook, interleaved, median of repeats).  Results go to
``runs/bench/<name>.json`` (``--out`` to change) and are printed as a table.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from .manifest import atomic_write_json, git_commit

ROOT = Path(__file__).resolve().parents[1]


def _sync(device) -> None:
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
    import random

    from .quickstart import _OBJECTS, _PLACES, DEMO_PROMPT

    rng = random.Random(seed)
    stream: list[int] = []
    while len(stream) < n * length:
        obj, place = rng.choice(_OBJECTS), rng.choice(_PLACES)
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
    from .compress import fisher_scores, rtn_quantize, sparsegpt_prune
    from .models import load_policy
    from .perturb import FFNChannels, sample_xi
    from .quickstart import DEMO_PROMPT

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
        _sync(pol.device)
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
    t, snap = _timed(lambda: (rtn_quantize(m, 4), _sync(pol.device))[0])
    snap.restore()
    res["rtn_int4_s"] = round(t, 2)
    calib = fixed_length_calibration(tok, n_calib, calib_len)
    res.update(calib_sequences=n_calib, calib_len=calib_len)
    t, _ = _timed(lambda: (fisher_scores(m, calib, 8, tok.pad_token_id, True), _sync(pol.device)))
    res["fisher_s"] = round(t, 2)
    if sparsegpt:
        t, (snap, _) = _timed(
            lambda: (sparsegpt_prune(m, calib, 0.5, 128, 0.01, 8, tok.pad_token_id, True), _sync(pol.device))
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
    from .agent import AgentConfig
    from .models import load_policy
    from .rollout import GenerationConfig, HFGenerator, SerialEnvs, run_groups

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


def bench_envs(n_episodes: int = 200, model: str | None = "smollm2-135m", n_tasks: int = 4, group_size: int = 4,
               max_steps: int = 10) -> dict:
    """Environment throughput with scripted policies (see each environment's helper)
    and, with ``model``, environment vs. generation time for one rollout batch."""
    from functools import partial

    from .envs.webshop import bench_webshop, make_webshop_pool

    vs = dict(n_tasks=n_tasks, group_size=group_size, max_steps=max_steps)
    res = {"webshop": bench_webshop(n_episodes=n_episodes)}
    if model:
        res["webshop"]["vs_model"] = env_vs_generation(partial(make_webshop_pool, seed=0), "test", model, **vs)
    try:
        from .envs.alfworld import bench_alfworld, make_alfworld_pool
    except ImportError as err:  # the alfworld package is optional for WebShop-only users
        res["alfworld"] = {"skipped": f"alfworld not importable: {err}"}
    else:
        res["alfworld"] = bench_alfworld()
        if model:
            res["alfworld"]["vs_model"] = env_vs_generation(partial(make_alfworld_pool, seed=0), "train", model, **vs)
    return res


def bench_train(profile: str = "cpu", env: str = "webshop", repeats: int = 2, overrides: list[str] | None = None) -> dict:
    """Seconds per iteration split into rollout / update / sensitivity for Vanilla and
    SPrPO (exact replay and one-pass) on the same rollout batch, side by side.

    One rollout batch is collected (timed, under SPrPO's initial xi, with the hook); then
    each method's update runs from the same starting adapter and optimizer state,
    interleaved ``repeats`` times (median).  The ratio is SPrPO's total over Vanilla's,
    counting the same rollout time for both (the hook's cost is in the rollout)."""
    import copy

    from .methods import MethodConfig, make_method
    from .rollout import run_groups
    from .train import Trainer, build_batch, load_config

    cfg = load_config(profile, list(overrides or []) + [f"env.name={env}", "method.name=sprpo"])
    tr = Trainer(cfg, progress=False)
    xi = tr.method.rollout_xi(0)
    tr.fc.set(xi=xi)
    t0 = time.perf_counter()
    with tr.fc:
        eps, rst = run_groups(tr.envs, tr.sample_tasks(0), cfg.rollout.group_size, tr.gen, tr.agent,
                              cfg.env.max_steps, progress=True)
    t_roll = time.perf_counter() - t0
    tr.fc.clear()
    batch, _ = build_batch(eps, cfg.update.adv, cfg.update.estimator, cfg.update.micro_batch)
    params0 = [p.detach().clone() for p in tr.params]
    opt0 = copy.deepcopy(tr.opt.state_dict())
    variants = {
        "vanilla": MethodConfig(name="vanilla"),
        "sprpo_replay": MethodConfig(name="sprpo", sensitivity="replay"),
        "sprpo_one_pass": MethodConfig(name="sprpo", sensitivity="one_pass"),
    }
    times: dict[str, dict[str, list[float]]] = {v: {"update_s": [], "sensitivity_s": []} for v in variants}
    states: dict[str, tuple] = {}
    for _ in range(repeats):
        for name, mcfg in variants.items():
            with torch.no_grad():
                for p, v in zip(tr.params, params0):
                    p.copy_(v)
            tr.opt.load_state_dict(copy.deepcopy(opt0))
            tr.method = make_method(mcfg, tr.shape, cfg.seed)
            tr.timers = {"update_s": 0.0, "extra_s": 0.0}
            batch.old.clear()
            tr.method.update(tr, batch, 0, None if name == "vanilla" else xi)
            if name != "vanilla":
                states[name] = (tr.method.S_hat.clone(), tr.method.m_hat, tr.method.sigma())
            times[name]["update_s"].append(tr.timers["update_s"])
            times[name]["sensitivity_s"].append(tr.timers["extra_s"])
    tr.envs.close()
    res = {"profile": profile, "env": env, "episodes": len(eps), "samples": len(batch.samples),
           "response_tokens": batch.n_tokens, "rollout_s": round(t_roll, 2),
           "generate_s": round(rst["generate_s"], 2), "env_s": round(rst["env_s"], 3)}
    totals = {}
    for name, t in times.items():
        u, sens = statistics.median(t["update_s"]), statistics.median(t["sensitivity_s"])
        totals[name] = t_roll + u + sens
        res[name] = {"update_s": round(u, 2), "sensitivity_s": round(sens, 2), "total_s": round(totals[name], 2)}
    res["ratio_replay_vs_vanilla"] = round(totals["sprpo_replay"] / totals["vanilla"], 3)
    res["ratio_one_pass_vs_vanilla"] = round(totals["sprpo_one_pass"] / totals["vanilla"], 3)
    (S_r, m_r, sig_r), (S_o, m_o, sig_o) = states["sprpo_replay"], states["sprpo_one_pass"]
    ls_r, ls_o = S_r.clamp_min(1e-30).log().flatten(), S_o.clamp_min(1e-30).log().flatten()
    res["one_pass_vs_replay"] = {
        "log_S_pearson": round(float(torch.corrcoef(torch.stack([ls_r, ls_o]))[0, 1]), 4),
        "S_rel_l2": round(float((S_o - S_r).norm() / S_r.norm()), 4),
        "m_hat_rel_diff": round(abs(m_o - m_r) / max(abs(m_r), 1e-30), 4),
        "sigma_rel_l2": round(float((sig_o - sig_r).norm() / sig_r.norm()), 4),
    }
    res["update_ratio_replay"] = round((res["sprpo_replay"]["update_s"] + res["sprpo_replay"]["sensitivity_s"])
                                       / res["vanilla"]["update_s"], 3)
    return res


def _print_table(res: dict, prefix: str = "") -> None:
    for k, v in res.items():
        if isinstance(v, dict):
            _print_table(v, prefix + k + ".")
        else:
            print(f"  {prefix + k:<40} {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sprpo_lib.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("perturb", help="hook overhead, RTN, Fisher and SparseGPT timings")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n-calib", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-sparsegpt", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the model's loader default)")
    e = sub.add_parser("envs", help="environment steps/s and reset times")
    e.add_argument("--episodes", type=int, default=200)
    e.add_argument("--model", default="smollm2-135m", help="policy for the env-vs-generation ratio ('' to skip)")
    e.add_argument("--tasks", type=int, default=4, help="env-vs-generation batch: tasks (cpu profile: 4)")
    e.add_argument("--group", type=int, default=4, help="env-vs-generation batch: rollouts per task (cpu profile: 4)")
    e.add_argument("--max-steps", type=int, default=10, help="env-vs-generation batch: steps per episode")
    t = sub.add_parser("train", help="seconds per iteration: rollout / update / sensitivity, vanilla vs sprpo")
    t.add_argument("--profile", default="cpu")
    t.add_argument("--env", default="webshop")
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.tasks_per_step=4")
    for sp in (p, e, t):
        sp.add_argument("--threads", type=int, default=2, help="torch threads (set explicitly: 2 cores here)")
        sp.add_argument("--out", type=Path, help="JSON path (default runs/bench/<what>.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    if args.what == "perturb":
        res = bench_perturb(args.model, args.n_calib, args.calib_len, args.batch, args.new_tokens, args.repeats,
                            not args.no_sparsegpt, args.device, args.dtype)
    elif args.what == "envs":
        res = bench_envs(args.episodes, args.model or None, args.tasks, args.group, args.max_steps)
    else:
        res = bench_train(args.profile, args.env, args.repeats, args.overrides)
    out = args.out or ROOT / "runs" / "bench" / f"{args.what}.json"
    record = {"bench": args.what, "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": platform.machine(), "torch": torch.__version__, "wall_s": round(time.time() - t0, 1),
              "results": res}
    atomic_write_json(out, record)
    print(f"bench {args.what} ({record['commit'][:12]}, {record['wall_s']} s) -> {out}")
    _print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
