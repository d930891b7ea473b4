"""``sprpo-bench`` (``python -m sprpo_lib.bench``): JSON for the record, a table for the eye.

    sprpo-bench perturb [--model smollm2-135m] [--n-calib 128] [--calib-len 256]
    sprpo-bench envs
    sprpo-bench train [--profile cpu] [--env webshop] [key=value ...]
    sprpo-bench ops [--env webshop]   # one update's time by op class, each against its roofline
    sprpo-bench divergence [--env webshop] [--states 4] [--samples 4] [--batch 1 8]   # KL per state: clean side and a setting vs floor
    sprpo-bench sft [--env alfworld] [--steps 8]   # the warm start's SFT step, levers vs reference, vs floor
    sprpo-bench machine [--model smollm2-135m]
    sprpo-bench generate [--model smollm2-135m] [--prompts 16] [--engines hf_generator,hf,openvino]
    sprpo-bench eval [--engines hf:float32,hf:bfloat16,openvino,openvino:auto:prefix_caching=false] [--episodes 64]
    sprpo-bench update [--dtypes float32,bfloat16]
    sprpo-bench prompts [--env alfworld] [--episodes 16] [--override env.max_steps=50]
    sprpo-bench churn [--rounds 500] [--deadline 30] [--stall-every 0]
    sprpo-bench gpu [--profile paper] [--device cuda]   # the paper profile on one GPU (bench/gpu.py)
    sprpo-bench host [--batch 128] [--new-tokens 64]   # a decode step's host time, inside and outside the forward
    sprpo-bench runs --env webshop --before runs/cpu/levers_off --after runs/cpu/train   # finished runs compared
    sprpo-bench report   # runs/bench/*.json -> figures/bench_<machine>.md, README block

Results go to ``runs/bench/<name>_<env>.json``, or ``<name>.json`` for a benchmark without ``--env`` (``--out`` to change), and are printed as a table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from sprpo_lib.bench.divergence import bench_divergence
from sprpo_lib.bench.gpu import METHODS, bench_gpu
from sprpo_lib.bench.host import bench_host
from sprpo_lib.bench.ops import OPS_METHODS, bench_ops
from sprpo_lib.bench.report import report
from sprpo_lib.bench.runs import bench_runs
from sprpo_lib.bench.sft import bench_sft
from sprpo_lib.bench.suite import (
    GENERATE_ENGINES,
    bench_churn,
    bench_envs,
    bench_eval,
    bench_generate,
    bench_machine,
    bench_perturb,
    bench_prompts,
    bench_train,
    bench_update,
)
from sprpo_lib.infra.hardware import ALLOCATORS, machine_info, set_allocator, set_threads
from sprpo_lib.infra.io import atomic_write_json
from sprpo_lib.infra.manifest import git_commit
from sprpo_lib.infra.paths import project_path, runs_dir
from sprpo_lib.model.layers import ATTENTION_KERNELS, LOGITS
from sprpo_lib.paper.budget import projected_markdown


def _print_table(res: dict, prefix: str = "") -> None:
    for k, v in res.items():
        if isinstance(v, dict):
            _print_table(v, prefix + k + ".")
        elif isinstance(v, list) and len(v) > 8:  # e.g. per-shape rows
            print(f"  {prefix + k:<40} [{len(v)} rows: see the JSON]")
        else:
            print(f"  {prefix + k:<40} {v}")


def record_name(what: str, env: str | None, method: str | None = None) -> str:
    """The default record file of ``sprpo-bench <what>``: one per benchmark and environment,
    so that an ALFWorld run does not overwrite a WebShop record, and per ``--method`` other than
    Vanilla (``ops_sprpo_webshop.json`` beside ``ops_webshop.json``)."""
    what = f"{what}_{method}" if method and method != "vanilla" else what
    return f"{what}_{env}.json" if env else f"{what}.json"


def main(argv: list[str] | None = None) -> int:
    """``sprpo-bench <what>``: run one benchmark, print its table and write its JSON under
    ``runs/bench/`` (``report``: the per-machine tables and the page's summary).

    Long on purpose: one argument parser with a subcommand per benchmark, each a flat list of
    options beside the call it feeds, so ``--help`` and the code read the same."""
    ap = argparse.ArgumentParser(prog="sprpo-bench", description=__doc__.split("\n\n")[0])
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
    ho = sub.add_parser("host", help="a decode step's host time at the paper's depth, inside and outside the "
                        "model's forward, per engine (hf, hf-graphs, transformers' generate_batch)")
    ho.add_argument("--engines", default="hf,hf:compact=0.25,hf-graphs",
                    help="hf:compact=0.25 drops finished rows once they are a quarter of the batch (a GPU's default); "
                    "generate_batch: transformers' continuous batching (minutes per step at batch 128 on 2 CPU cores)")
    ho.add_argument("--batch", type=int, default=128)
    ho.add_argument("--new-tokens", type=int, default=64)
    ho.add_argument("--repeats", type=int, default=3, help="runs per engine; the record keeps their medians")
    dv = sub.add_parser("divergence", help="the divergence pass per agent state (sprpo-eval --metric divergence): "
                        "the clean side and one setting's comparison, each against its floor")
    dv.add_argument("--profile", default="cpu")
    dv.add_argument("--env", default="webshop")
    dv.add_argument("--states", type=int, default=4, help="states per held-out split")
    dv.add_argument("--samples", type=int, default=4, help="responses sampled per state (K)")
    dv.add_argument("--batch", type=int, nargs="+", default=[],
                    help="states per batch, each size side by side (default: the profile's evaluation batch size)")
    dv.add_argument("--batch-tokens", type=int, nargs="+", default=[],
                    help="padded prompt tokens per batch at most, each side by side (0: no budget; default: the pass's)")
    dv.add_argument("--attention", nargs="+", default=[], choices=ATTENTION_KERNELS,
                    help="attention kernels side by side (default: the pass's)")
    dv.add_argument("--logits", nargs="+", default=[], choices=LOGITS,
                    help="the logits' dtype side by side: float32 and/or model (default: the pass's), each with its "
                         "own clean side; the mean KL and flips show what bfloat16's rounding of the logits adds")
    dv.add_argument("--adapter", nargs="+", default=[], metavar="DIR",
                    help="peft adapter dir(s) merged into the model, e.g. the warm start's (runs/sft/<env>-*/adapter)")
    dv.add_argument("--family", default="rtn")
    dv.add_argument("--strength", type=float, default=4.0)
    dv.add_argument("--model", default=None, help="default: the profile's model")
    sf = sub.add_parser("sft", help="the warm start's SFT step on the profile's demonstrations, the speed levers "
                        "and the reference path side by side, each against its floor")
    sf.add_argument("--profile", default="cpu")
    sf.add_argument("--env", default="alfworld")
    sf.add_argument("--steps", type=int, default=8, help="timed optimizer steps per round")
    sf.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    sf.add_argument("--repeats", type=int, default=2, help="interleaved rounds (the median)")
    sf.add_argument("--model", default=None, help="default: the profile's model")
    e = sub.add_parser("envs", help="environment steps/s and reset times")
    e.add_argument("--episodes", type=int, default=200)
    e.add_argument("--model", default="smollm2-135m", help="policy for the env-vs-generation ratio ('' to skip)")
    e.add_argument("--tasks", type=int, default=4, help="env-vs-generation batch: tasks (cpu profile: 4)")
    e.add_argument("--group", type=int, default=4, help="env-vs-generation batch: rollouts per task (cpu profile: 4)")
    e.add_argument("--max-steps", type=int, default=10, help="env-vs-generation batch: steps per episode")
    t = sub.add_parser("train", help="seconds per iteration: rollout / update / sensitivity, vanilla vs sprpo")
    t.add_argument("--profile", default="cpu")
    t.add_argument("--env", default="webshop")
    t.add_argument("--repeats", type=int, default=1)
    t.add_argument("--paths", default="shared,whole",
                   help="shared (the profile's passes: shared prefixes, kept states below the LoRA layers, fused LoRA linears and entropy, native GQA), whole (the reference: every row whole, every layer at every step, peft's LoRA forward, log-probs and entropy apart, K and V repeated, SDPA), sdpa (shared with speed.attention=sdpa), fused (shared with speed.fused_kernels) and/or full_replay (shared with SPrPO's replay through every layer, speed.replay_graph_gb=0: against shared with speed.replay_graph_gb=10 given)")
    t.add_argument("--replay-frac", type=float, default=None,
                   help="also SPrPO whose replay runs this share of the rows (method.replay_frac), against the full replay")
    t.add_argument("--methods", default=None,
                   help="measure only these besides vanilla and sprpo, comma-separated: sprpo_one_pass, sam, sprpo_subset "
                        "('': vanilla and sprpo alone)")
    t.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.tasks_per_step=4")
    op = sub.add_parser("ops", help="one method's update on one rollout batch, every op timed where it runs: seconds by "
                        "class (matmul, attention, memory, views) against each class's roofline, the eager bound")
    op.add_argument("--profile", default="cpu")
    op.add_argument("--env", default="webshop")
    op.add_argument("--method", default="vanilla", choices=OPS_METHODS,
                    help="sprpo: its update and, apart, Alg. 1 line 7's S_hat replay")
    op.add_argument("overrides", nargs="*", help="dotted config overrides")
    m = sub.add_parser("machine", help="matmul GFLOP/s per dtype at a model's shapes, bandwidth, prefill floor")
    m.add_argument("--model", default="smollm2-135m", help="shapes from this model's config (weights not loaded)")
    m.add_argument("--context", type=int, default=500, help="prompt length for the FLOPs per token")
    u = sub.add_parser("update", help="one PPO forward/backward per dtype on the same batch, side by side")
    u.add_argument("--model", default="smollm2-135m")
    u.add_argument("--dtypes", default="float32,bfloat16")
    u.add_argument("--samples", type=int, default=8)
    u.add_argument("--prompt-len", type=int, default=500)
    u.add_argument("--lora-layers", type=int, default=8, help="LoRA on the last N layers (0: all, the paper)")
    u.add_argument("--repeats", type=int, default=2)
    g = sub.add_parser("generate", help="generation engines x dtypes on real WebShop prompts, side by side")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--prompts", type=int, default=16)
    g.add_argument("--new-tokens", type=int, default=48)
    g.add_argument("--batch", type=int, default=16)
    g.add_argument("--engines", default=",".join(GENERATE_ENGINES), help="hf_generator (reference) and/or engine names (openvino, openvino_loop)")
    g.add_argument("--dtypes", default="float32,bfloat16")
    g.add_argument("--temperatures", default="0,0.4")
    g.add_argument("--max-steps", type=int, default=3, help="prompts after 0..max-steps shopper steps")
    g.add_argument("--repeats", type=int, default=2, help="interleaved rounds (best wall time)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="engines with a paged KV cache recompute every prompt each round (with --new-tokens 1: prefill alone)")
    q = sub.add_parser("prompts", help="token budget of a profile's prompts by section, per step and per episode")
    q.add_argument("--model", default="smollm2-135m", help="tokenizer of this model")
    q.add_argument("--episodes", type=int, default=16, help="demonstrator episodes, every step's prompt counted")
    q.add_argument("--profile", default="cpu")
    q.add_argument("--env", default="webshop")
    q.add_argument("--split", default="test", help="task split (ALFWorld: valid_seen / valid_unseen / train)")
    q.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="training-config override (repeatable), e.g. env.max_steps=50")
    v = sub.add_parser("eval", help="the cpu profile's 64-episode held-out evaluation and one RL rollout batch, "
                                    "per engine side by side")
    v.add_argument("--profile", default="cpu")
    v.add_argument("--env", default="webshop")
    v.add_argument("--engines", default="hf:float32,hf:bfloat16,openvino",
                   help="engine, engine:dtype or engine:dtype:field=value[+field=value] (a generation setting, "
                        "e.g. openvino:auto:prefix_caching=false, or agent.field=value, e.g. "
                        "agent.compact_actions=false), comma-separated; the first is the paired reference")
    v.add_argument("--episodes", type=int, default=64)
    v.add_argument("--no-rollout", action="store_true", help="skip the RL rollout batch")
    v.add_argument("--model", help="model spec (default: the profile's)")
    v.add_argument("--phases", action="store_true",
                   help="replay the held-out run's generation calls with one new token each: prefill and decode "
                        "seconds, each against its floor")
    c = sub.add_parser("churn", help="openvino engines built, used and dropped N times: hangs, retries, wall time")
    c.add_argument("--model", default="tiny-llama")
    c.add_argument("--rounds", type=int, default=500, help="two engine builds per round")
    c.add_argument("--deadline", type=float, default=30.0, help="seconds a generate call may take")
    c.add_argument("--stall-every", type=int, default=0, help="inject a stalled call every N rounds (0: none)")
    c.add_argument("--stall-s", type=float, default=60.0, help="how long an injected stall sleeps")
    x = sub.add_parser("gpu", help="the paper profile on one GPU: CUDA tests, one iteration per method with seconds "
                                   "and peak memory per phase, generation against the decode floor")
    x.add_argument("--profile", default="paper")
    x.add_argument("--envs", default="webshop,alfworld")
    x.add_argument("--methods", default=",".join(METHODS))
    x.add_argument("--model", default="random-qwen2.5-1.5b", help="the paper's shape, random weights")
    x.add_argument("--device", default="cuda")
    x.add_argument("--max-steps", type=int, default=3, help="environment steps per episode (the prompt reaches its "
                                                            "history_len-step size by then)")
    x.add_argument("--batch", type=int, default=128, help="generation batch (the paper profile's)")
    x.add_argument("--new-tokens", type=int, default=64)
    x.add_argument("--no-tests", action="store_true", help="skip tests/test_cuda.py")
    x.add_argument("--no-warmup", action="store_true", help="time the first method's update without an untimed "
                                                            "Vanilla update on the batch before it")
    x.add_argument("--budget-s", type=float, default=float("inf"),
                   help="start no iteration after this many seconds (the rest is recorded as skipped); default: no limit")
    x.add_argument("overrides", nargs="*", help="dotted training-config overrides")
    w = sub.add_parser("runs", help="two sets of finished RL runs of one config (e.g. the update's speed levers off "
                                    "and on): seconds per iteration and phase, and whether they learned alike")
    w.add_argument("--profile", default="cpu")
    w.add_argument("--env", default="webshop")
    w.add_argument("--methods", default="vanilla,gaussian,sam,sprpo")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--before", required=True, help="runs folder of the reference side, e.g. runs/cpu/levers_off")
    w.add_argument("--after", required=True, help="runs folder of the other side, e.g. runs/cpu/train")
    for sp in sub.choices.values():  # every benchmark (report, added below, measures nothing)
        sp.add_argument("--threads", type=int, default=2, help="torch threads (set explicitly: 2 cores here)")
        sp.add_argument("--allocator", choices=ALLOCATORS, default="tuned",
                        help="glibc malloc settings (hardware.set_allocator; 'default': glibc as it is)")
        sp.add_argument("--out", type=Path, help="JSON path (default runs/bench/<what>_<env>.json, or <what>.json without --env)")
    r = sub.add_parser("report", help="runs/bench/*.json as figures/bench_<machine>.md and the README's bench block")
    r.add_argument("--dir", type=Path, default=None, help="benchmark JSON folder (default runs/bench/)")
    args = ap.parse_args(argv)
    if args.what == "report":
        for path in report(project_path(args.dir) if args.dir else None):
            print(path)
        return 0
    set_threads(args.threads)
    set_allocator(args.allocator)
    t0, commit = time.time(), git_commit()  # the code that runs (files edited during a long run do not count)
    out = project_path(args.out) if args.out else runs_dir("bench", record_name(args.what, getattr(args, "env", None),
                                                                                   getattr(args, "method", None)))

    def record(res: dict, partial: bool = False) -> dict:
        rec = {"bench": args.what, "commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine_info(), "torch": torch.__version__, "wall_s": round(time.time() - t0, 1),
               "results": res}
        return {**rec, "partial": True} if partial else rec

    if args.what == "perturb":
        res = bench_perturb(args.model, args.n_calib, args.calib_len, args.batch, args.new_tokens, args.repeats,
                            not args.no_sparsegpt, args.device, args.dtype)
    elif args.what == "machine":
        res = bench_machine(args.model, args.context)
    elif args.what == "generate":
        res = bench_generate(args.model, args.prompts, args.new_tokens, tuple(args.engines.split(",")),
                             tuple(args.dtypes.split(",")), tuple(float(x) for x in args.temperatures.split(",")),
                             args.batch, args.max_steps, args.repeats, not args.no_prefix_caching)
    elif args.what == "update":
        res = bench_update(args.model, tuple(args.dtypes.split(",")), args.samples, args.prompt_len,
                           response_len=24, lora_layers=args.lora_layers or None, repeats=args.repeats)
    elif args.what == "prompts":
        res = bench_prompts(args.model, args.episodes, args.profile, args.env, args.split, args.override)
    elif args.what == "eval":
        res = bench_eval(args.profile, args.env, tuple(args.engines.split(",")), args.episodes, not args.no_rollout,
                         args.model, args.phases)
    elif args.what == "churn":
        res = bench_churn(args.model, args.rounds, args.deadline, args.stall_every, args.stall_s)
    elif args.what == "gpu":
        res = bench_gpu(args.profile, tuple(args.envs.split(",")), tuple(args.methods.split(",")), args.model,
                        args.device, args.max_steps, args.batch, args.new_tokens, not args.no_tests,
                        tuple(args.overrides), save=lambda r: atomic_write_json(out, record(r, partial=True)),
                        budget_s=args.budget_s, warmup=not args.no_warmup)
    elif args.what == "runs":
        res = bench_runs(args.profile, args.env, tuple(args.methods.split(",")), args.seed, args.before, args.after)
    elif args.what == "ops":
        res = bench_ops(args.profile, args.env, args.overrides, args.method)
    elif args.what == "divergence":
        res = bench_divergence(args.profile, args.env, states=args.states, samples=args.samples,
                               batches_of=tuple(args.batch), batch_tokens=tuple(args.batch_tokens),
                               attention=tuple(args.attention), logits=tuple(args.logits), family=args.family,
                               strength=args.strength,
                               model=args.model, adapters=tuple(args.adapter))
    elif args.what == "sft":
        res = bench_sft(args.profile, args.env, args.steps, args.warmup, args.repeats, args.model)
    elif args.what == "host":
        res = bench_host(tuple(args.engines.split(",")), args.batch, args.new_tokens, repeats=args.repeats)
    elif args.what == "envs":
        res = bench_envs(args.episodes, args.model or None, args.tasks, args.group, args.max_steps)
    else:
        res = bench_train(args.profile, args.env, args.repeats, args.overrides, tuple(args.paths.split(",")),
                          args.replay_frac, None if args.methods is None else tuple(m for m in args.methods.split(",") if m))
    rec = record(res)
    atomic_write_json(out, rec)
    print(f"bench {args.what} ({rec['commit'][:12]}, {rec['wall_s']} s) -> {out}")
    _print_table(res)
    if args.what == "gpu":  # the paper profile's cost from the phases just measured
        print(projected_markdown({**rec, "name": out.stem}) or "no projection: no rollout with an update was recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
