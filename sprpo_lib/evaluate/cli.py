"""``python -m sprpo_lib.evaluate`` (``sprpo-eval``): one robustness evaluation, or the
calibration pool, from the command line."""
from __future__ import annotations

import argparse
import logging
import sys

import yaml

from sprpo_lib.agent.envs import DataError, make_pool
from sprpo_lib.evaluate.calibration import build_calibration_pool, save_calibration
from sprpo_lib.evaluate.cells import DEFAULT_CACHE
from sprpo_lib.evaluate.divergence import divergence, divergence_summary, load_states, save_states, state_pool
from sprpo_lib.evaluate.sweep import EvalConfig, ModelSource, config_from_profile, config_from_run, sweep
from sprpo_lib.infra.executor import EXECUTORS, make_executor
from sprpo_lib.infra.io import as_disk_full, atomic_write_text
from sprpo_lib.infra.paths import project_path
from sprpo_lib.model.layers import ATTENTION_KERNELS, LOGITS

logger = logging.getLogger(__name__)

# ============================================================================ command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sprpo-eval",
        description="Evaluate an LLM agent under a deployment perturbation (App. C); rows are cached per cell "
                    "under --cache-dir, so a rerun computes only missing cells.")
    ap.add_argument("--model", help="HF directory (safetensors), hub id in the local cache, smollm2-135m, tiny-qwen2")
    ap.add_argument("--adapter", nargs="+", default=[], metavar="DIR",
                    help="peft adapter dir(s) (safetensors), merged in order before perturbing")
    ap.add_argument("--run", help="a training run folder: model, adapters, prompt settings and tags from it")
    ap.add_argument("--profile", help="take prompt/generation settings from a training profile (smoke|cpu|paper)")
    ap.add_argument("--env", default=None, help="webshop | alfworld (default webshop, or the run's)")
    ap.add_argument("--family", default="clean", help="clean | gaussian | dropout | fisher | sparsegpt | rtn")
    ap.add_argument("--strength", nargs="+", type=float, default=[],
                    help="sigma | p | r | bits; default: App. C's levels for the family and env")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="evaluation seeds (generation + draw)")
    ap.add_argument("--tasks", type=int, help="first N tasks of each split (default: all held-out tasks)")
    ap.add_argument("--split", nargs="+", help="splits (default: webshop test; alfworld valid_seen valid_unseen)")
    ap.add_argument("--engine", default=None, help="generation engine (default hf)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="engines with a paged KV cache (openvino, vllm) recompute every prompt in full")
    ap.add_argument("--calibration", help="calibration pool JSON (fisher, sparsegpt)")
    ap.add_argument("--build-calibration", metavar="PATH",
                    help="collect the calibration pool from this policy's rollouts on training tasks, write it, exit")
    ap.add_argument("--calibration-size", type=int, default=128, help="sequences in a built pool (App. C: 128)")
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (App. C: 0.4)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--max-steps", type=int, help="episode step limit (default: the env's, 15 / 50)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="divergence: a batch of states keeps its padded prompt tokens within this many (default "
                         f"{EvalConfig.batch_tokens})")
    ap.add_argument("--attention", default=None, choices=ATTENTION_KERNELS,
                    help="divergence: attention kernel (auto: matmuls for a 16-bit model on a CPU, SDPA otherwise)")
    ap.add_argument("--logits", default=None, choices=LOGITS,
                    help="divergence: a 16-bit model's logits in float32 (default) or in its own dtype (model)")
    ap.add_argument("--dtype", default=None, help="auto | float32 | bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow model code from the model folder")
    ap.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    ap.add_argument("--tag", nargs="+", default=[], metavar="KEY=VALUE", help="columns added to every row")
    ap.add_argument("--metric", default="success", choices=["success", "divergence"],
                    help="success: play episodes; divergence: KL of the policy under the perturbation per agent state "
                         "(teacher-forced, no episode played)")
    ap.add_argument("--states", type=int, default=16, help="divergence: agent states per held-out split")
    ap.add_argument("--states-file", metavar="PATH",
                    help="divergence: the state pool to use (a JSON written before, e.g. from another agent, so two "
                         "agents are compared on the same states); written here when it does not exist")
    ap.add_argument("--samples", type=int, default=4, help="divergence: responses sampled per state (K)")
    ap.add_argument("--out", help="write the rows as CSV here")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error")
    ap.add_argument("--executor", default="local", choices=EXECUTORS,
                    help="local: cells one after another here; ray: each missing cell a Ray task")
    ap.add_argument("--address", help="a running Ray cluster for --executor ray (default: a local Ray instance)")
    ap.add_argument("--cell-cpus", type=float, default=1.0, help="CPU cores per cell task (--executor ray)")
    ap.add_argument("--cell-gpus", type=float, default=0.0, help="GPUs per cell task (--executor ray)")
    return ap


def config_from_args(args) -> EvalConfig:
    """The :class:`EvalConfig` a command line describes (ValueError on bad input)."""
    tags = {}
    for t in args.tag:
        if "=" not in t:
            raise ValueError(f"--tag: {t!r} must look like KEY=VALUE, e.g. --tag method=sprpo train_seed=0")
        k, v = t.split("=", 1)
        tags[k] = yaml.safe_load(v)  # numbers stay numbers (train_seed=0)
    kw = {"family": args.family, "strengths": tuple(args.strength), "seeds": tuple(args.seeds), "tasks": args.tasks,
          "splits": tuple(args.split) if args.split else None, "calibration": args.calibration,
          "device": args.device, "trust_remote_code": args.trust_remote_code, "cache_dir": args.cache_dir}
    opt = {"env": args.env, "engine": args.engine, "temperature": args.temperature,
           "max_new_tokens": args.max_new_tokens, "max_steps": args.max_steps, "batch_size": args.batch_size,
           "batch_tokens": args.batch_tokens, "attention": args.attention, "logits": args.logits, "dtype": args.dtype, "prefix_caching": False if args.no_prefix_caching else None}
    kw.update({k: v for k, v in opt.items() if v is not None})
    if args.run:
        if args.model or args.adapter:
            raise ValueError("--run sets the model and adapters; drop --model/--adapter (or drop --run)")
        cfg = config_from_run(args.run, **kw)
        if tags:
            cfg.tags = {**cfg.tags, **tags}
        return cfg
    if not args.model:
        raise ValueError("--model: no model given; expected a HF directory, a cached hub id, smollm2-135m or "
                         "tiny-qwen2 (or --run <training run folder>)")
    kw.update(model=args.model, adapters=tuple(args.adapter), tags=tags)
    kw.setdefault("env", "webshop")
    if args.profile:
        env = kw.pop("env")
        return config_from_profile(args.profile, env, **kw)
    return EvalConfig(**kw)


def divergence_rows(cfg: EvalConfig, args, progress: bool):
    """``--metric divergence``: the state pool (``--states-file``, or built from this agent's own
    held-out episodes), then the divergence rows of every setting."""
    if args.states < 1 or args.samples < 1:
        raise ValueError(f"--states {args.states} / --samples {args.samples}: expected positive counts")
    path = project_path(args.states_file) if args.states_file else None
    if path is not None and path.is_file():
        states = load_states(path)
    else:
        states, _ = state_pool(cfg, args.states, progress=progress)
        if path is not None:
            save_states(path, states)
    return divergence(cfg, states, samples=args.samples, progress=progress)


def _summary(rows) -> str:
    g = rows.groupby(["family", "strength", "split_label", "seed"], sort=False)
    s = g.agg(episodes=("success", "size"), success=("success", "mean"), score=("score", "mean"),
              length=("length", "mean"))
    s["success"] = (100 * s["success"]).round(2)
    return s.round(3).to_string()


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as err:  # a bad option: one line, before anything loads
        print(f"sprpo-eval: error: {err}", file=sys.stderr)
        return 2
    progress = not args.no_progress
    if args.build_calibration and args.calibration_size < 1:
        ap.error("--calibration-size: expected a positive number of sequences (App. C: 128)")
    try:
        if args.build_calibration:
            source = ModelSource(cfg, project_path(cfg.cache_dir) / "file_hashes.json")
            pool = make_pool(cfg.env, cfg.data_dir, cfg.env_seed)  # the data first: missing data fails before the model
            calib = build_calibration_pool(
                source.policy(), pool, cfg.agent, n=args.calibration_size, temperature=cfg.temperature,
                max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size, max_steps=cfg.max_steps,
                seed=cfg.seeds[0], engine=cfg.engine, progress=progress,
                source={"model": cfg.model, "adapters": list(cfg.adapters), "model_identity": source.identity()})
            save_calibration(project_path(args.build_calibration), calib)
            print(f"calibration pool: {len(calib)} sequences, hash {calib.hash[:12]} -> {args.build_calibration}")
            return 0
        if args.metric == "divergence":
            rows = divergence_rows(cfg, args, progress)
            if args.out:
                atomic_write_text(project_path(args.out), rows.to_csv(index=False))
            print(divergence_summary(rows).round(4).to_string())
            return 0
        executor = make_executor(args.executor, args.address, {"cell_cpus": args.cell_cpus,
                                                               "cell_gpus": args.cell_gpus})
        rows = sweep([cfg], progress=progress, executor=executor)
        if args.out:
            atomic_write_text(project_path(args.out), rows.to_csv(index=False))
    except (ValueError, DataError) as err:  # bad options found late, missing or damaged data: one message
        if args.debug:
            raise
        print(f"sprpo-eval: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a full disk: one line; the cells already written stay, the rest resume
        full = as_disk_full(err, project_path(cfg.cache_dir))
        if args.debug or full is None:
            raise
        print(f"sprpo-eval: error: {full}", file=sys.stderr)
        return 1
    print(_summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
