"""RL training of LLM agents: GiGPO advantages + PPO with LoRA, for every method in
:mod:`sprpo_lib.methods` (App. B "Training Details", Algs. 1-4).

    python -m sprpo_lib.train --env webshop --method sprpo --profile cpu --seed 0
    python -m sprpo_lib.train --profile smoke method.rho=0.1 rollout.group_size=4

One iteration k (Alg. 1):

1. the method gives xi_k (Gaussian / SPrPO: sampled from a generator seeded by
   (seed, k); Vanilla / SAM: none), held fixed for the whole rollout and update;
2. ``tasks_per_step`` training tasks (seeded by (seed, k)) are played ``group_size``
   times each under pi^xi (GiGPO groups), in one vectorised rollout;
3. GiGPO advantages (episode + step groups, gamma 0.95, omega 1) per step;
4. the method's update: dual-clip PPO surrogate (clip 0.2, dual clip 3.0, entropy
   1e-3, token-mean over the whole batch) on the response tokens, one Adam step on the
   LoRA parameters for the batch (Table "Shared training hyperparameters": 128
   trajectories per PPO batch = the whole iteration), micro-batched with gradient
   accumulation (exact for token-mean); SPrPO then replays the batch at theta_{k+1};
5. metrics (JSON line), the iteration's episodes (JSON lines) and a checkpoint
   (peft adapter in safetensors, Adam state, method state) written atomically.

A killed run restarts from its last checkpoint with the same command and continues
exactly as an uninterrupted run (everything random is a function of (seed, k)).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from .advantages import AdvantageConfig, StepSample, compute_advantages
from .agent import AgentConfig
from .losses import PPOLossConfig, get_policy_loss, token_entropy, token_logprobs
from .manifest import atomic_write_json, atomic_write_text, git_commit
from .methods import MethodConfig, make_method
from .models import LoraSettings, add_lora, load_policy, lora_on_last_layers
from .perturb import FFNChannels
from .rollout import EpisodeLog, GenerationConfig, HFGenerator, ProcessEnvs, SerialEnvs, run_groups
from .sft import SFTConfig

ROOT = Path(__file__).resolve().parents[1]
PROFILES_DIR = Path(__file__).resolve().parent / "configs"


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    spec: str = "smollm2-135m"
    dtype: str | None = None  # None: the loader's default (bf16 real models, fp32 tiny)
    lora_rank: int = 64
    lora_alpha: float = 64.0
    lora_layers: int | None = None  # LoRA on the last N decoder layers only (CPU profiles); None: all (paper)
    init_adapter: str | None = None  # a LoRA adapter to continue training (resumes its weights)


@dataclass
class EnvConfig:
    name: str = "webshop"  # webshop | alfworld
    seed: int = 0  # seed of the offline task pool
    data_dir: str | None = None  # real data (else $WEBSHOP_DATA / $ALFWORLD_DATA, else offline)
    split: str = "train"
    max_steps: int | None = None  # None: the environment's (50 ALFWorld, 15 WebShop)
    workers: int = 0  # env worker processes (0: in-process)


@dataclass
class RolloutConfig:
    tasks_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    gen_batch: int = 128
    history_len: int = 2
    max_obs_chars: int | None = None
    history_obs_chars: int | None = None  # None: max_obs_chars (see agent.AgentConfig)
    echo_instruction: bool = True  # False: drop WebShop's instruction echo from observations


@dataclass
class UpdateConfig:
    lr: float = 3e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global-norm clip before the step (verl's default); 0 disables
    micro_batch: int = 8
    estimator: str = "gigpo"
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss_name: str = "ppo_dual_clip"
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)


@dataclass
class TrainConfig:
    """Everything a run depends on; profiles are YAML files of overrides."""

    profile: str = "paper"
    iterations: int = 200
    seed: int = 0
    threads: int | None = None
    out_dir: str | None = None
    log_episodes: bool = True
    warm_start: bool = False  # behaviour cloning on expert demos first (offline profiles; not paper)
    eval_tasks: int = 0  # after training: success of the final policy on the warm start's held-out tasks
    eval_temperature: float | None = 0.4  # held-out evaluations (Table 3 "Validation temperature"); None: rollout's
    sft: SFTConfig = field(default_factory=SFTConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    method: MethodConfig = field(default_factory=MethodConfig)


def _build(cls, data: dict, where: str):
    """Nested dataclass from a dict, rejecting unknown keys with the valid ones listed."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in fields:
            raise ValueError(f"unknown config key {where + k!r}; valid keys here: {sorted(fields)}")
        sub = _dataclass_type(cls, k)
        if sub is not None:
            kwargs[k] = _build(sub, v, f"{where}{k}.")
        elif k == "betas":
            kwargs[k] = tuple(float(x) for x in v)
        else:
            kwargs[k] = v
    return cls(**kwargs)


def _dataclass_type(cls, name: str):
    default = cls.__dataclass_fields__[name].default_factory
    if default is not dataclasses.MISSING:
        obj = default()
        return type(obj) if dataclasses.is_dataclass(obj) else None
    return None


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a section")
    d[parts[-1]] = value


def load_config(profile: str = "paper", overrides: list[str] | None = None, **top) -> TrainConfig:
    """Profile YAML (``sprpo_lib/configs/<profile>.yaml``) + ``key.sub=value`` overrides."""
    path = PROFILES_DIR / f"{profile}.yaml"
    if not path.is_file():
        avail = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ValueError(f"unknown profile {profile!r}; expected one of {avail}")
    data = yaml.safe_load(path.read_text()) or {}
    data["profile"] = profile
    for k, v in top.items():
        if v is not None:
            _set_dotted(data, k, v)
    for ov in overrides or []:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} must look like key.sub=value (e.g. method.rho=0.1)")
        k, v = ov.split("=", 1)
        _set_dotted(data, k.strip(), yaml.safe_load(v))
    cfg = _build(TrainConfig, data, "")
    if cfg.warm_start and cfg.sft.demonstrator == "shopper" and cfg.env.name != "webshop":
        raise ValueError(f"sft.demonstrator=shopper exists for WebShop only (env.name={cfg.env.name!r}); "
                         f"add the override sft.demonstrator=expert (and env.max_steps=50 for ALFWorld)")
    return cfg


def config_dict(cfg: TrainConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=list))


# ----------------------------------------------------------------------------- batch
@dataclass
class Sample:
    ids: list[int]  # prompt + response
    n_resp: int
    adv: float


@dataclass
class Batch:
    samples: list[Sample]
    micro_batch: int
    old: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> old log-probs

    @property
    def n_tokens(self) -> int:
        return sum(s.n_resp for s in self.samples)

    def micro_batches(self, pad_id: int, device):
        """Left-padded ``(index, input_ids, attention_mask, targets [B, R], mask [B, R], adv [B, R])``."""
        for mi, i in enumerate(range(0, len(self.samples), self.micro_batch)):
            chunk = self.samples[i : i + self.micro_batch]
            T = max(len(s.ids) for s in chunk)
            R = max(s.n_resp for s in chunk)
            ids = torch.full((len(chunk), T), pad_id, dtype=torch.long)
            att = torch.zeros((len(chunk), T), dtype=torch.long)
            mask = torch.zeros((len(chunk), R))
            adv = torch.zeros((len(chunk), R))
            for j, s in enumerate(chunk):
                ids[j, T - len(s.ids) :] = torch.tensor(s.ids)
                att[j, T - len(s.ids) :] = 1
                mask[j, R - s.n_resp :] = 1.0
                adv[j, R - s.n_resp :] = s.adv
            yield mi, ids.to(device), att.to(device), ids[:, T - R :].to(device), mask.to(device), adv.to(device)


def build_batch(episodes, adv_cfg: AdvantageConfig, estimator: str, micro_batch: int) -> tuple[Batch, dict]:
    """Step samples of all episodes with GiGPO advantages.  The episode return is the
    sum of its step rewards (task reward plus format penalties); the anchor of a step
    is the raw observation it acted on."""
    steps, rows = [], []
    for e in episodes:
        ret = sum(s.reward for s in e.steps)
        uid = (e.group, e.rollout)
        for s in e.steps:
            steps.append(StepSample(uid, e.group, s.step, s.observation, s.reward, ret))
            rows.append(s)
    out = compute_advantages(steps, estimator, adv_cfg)
    samples = [Sample(s.prompt_ids + s.response_ids, len(s.response_ids), float(a))
               for s, a in zip(rows, out.advantages.tolist()) if s.response_ids]
    return Batch(samples, micro_batch), {f"adv_{k}": v for k, v in out.stats.items()}


# ----------------------------------------------------------------------------- pools
def make_pool(env: EnvConfig):
    if env.name == "webshop":
        from .envs.webshop import make_webshop_pool

        return make_webshop_pool(env.data_dir, seed=env.seed)
    if env.name == "alfworld":
        from .envs.alfworld import make_alfworld_pool

        return make_alfworld_pool(env.data_dir, seed=env.seed)
    raise ValueError(f"env.name must be 'webshop' or 'alfworld', got {env.name!r}")


# ----------------------------------------------------------------------------- trainer
class Trainer:
    """Holds the policy, optimizer, method and environments of one run."""

    def __init__(self, cfg: TrainConfig, out_dir: str | Path | None = None, progress: bool = True):
        self.cfg = cfg
        self.progress = progress
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out = Path(out_dir or cfg.out_dir or default_out_dir(cfg))
        self.policy = load_policy(cfg.model.spec, dtype=cfg.model.dtype, seed=cfg.seed)
        factory = partial(make_pool, cfg.env)
        self.envs = ProcessEnvs(factory, cfg.env.workers) if cfg.env.workers else SerialEnvs(factory)
        self.pool = self.envs.pool
        r = cfg.rollout
        self.agent = agent_config(r)
        if cfg.warm_start:
            self.warm_start_dir = warm_start_policy(self.policy, self.pool, cfg, self.agent, progress)
        if cfg.model.init_adapter:
            from peft import PeftModel

            self.policy.model = PeftModel.from_pretrained(self.policy.model, cfg.model.init_adapter, is_trainable=True)
        else:
            lora = LoraSettings(rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha)
            add_lora(self.policy, lora_on_last_layers(self.policy.model, lora, cfg.model.lora_layers), seed=cfg.seed)
        self.model = self.policy.model
        self.tok = self.policy.tokenizer
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        u = cfg.update
        self.opt = torch.optim.Adam(self.params, lr=u.lr, betas=u.betas, weight_decay=u.weight_decay)
        self.fc = FFNChannels(self.model)
        self.shape = self.fc.shape
        self.method = make_method(cfg.method, self.shape, cfg.seed)
        self.loss_fn = get_policy_loss(u.loss_name)
        self.gen = HFGenerator(
            self.policy,
            GenerationConfig(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                             batch_size=r.gen_batch, seed=cfg.seed),
            self.agent,
        )
        self.k = 0
        self.timers = {"update_s": 0.0, "extra_s": 0.0}

    # -- the operations methods use (methods.UpdateHost) --------------------------------
    def backward(self, batch: Batch, xi: torch.Tensor | None = None, *, xi_grad: bool = False,
                 gain: bool = False, use_old: bool = False) -> dict:
        """Accumulate gradients of the PPO loss over the whole batch (token-mean).

        ``xi_grad``: make xi a leaf and return ``xi_grad = dloss/dxi``; ``gain``: return
        ``gain_grad = dloss/du`` at u = 1; ``use_old``: ratio against the old log-probs
        stored by the last plain backward (the replay at theta_{k+1}); otherwise the old
        log-probs are this pass's own (theta_k: ratio 1, one step per batch) and stored.
        """
        t0 = time.perf_counter()
        self.model.train()
        xi_leaf = None
        if xi is not None:
            xi_leaf = xi.detach().clone().to(self.fc.dtype).requires_grad_(xi_grad)
        self.fc.set(xi=xi_leaf)
        n_total = batch.n_tokens
        acc: dict[str, float] = {}
        gain_grad = None
        with torch.enable_grad(), self.fc:
            gctx = self.fc.gain() if gain else _null()
            with gctx as u:
                for mi, ids, att, tgt, mask, adv in batch.micro_batches(self.tok.pad_token_id, self.policy.device):
                    R = tgt.shape[1]
                    logits = self.model(input_ids=ids, attention_mask=att, use_cache=False,
                                        logits_to_keep=R + 1).logits[:, :-1]
                    logp = token_logprobs(logits, tgt)
                    ent = token_entropy(logits) if self.cfg.update.loss.entropy_coeff else None
                    if use_old:
                        if mi not in batch.old:
                            raise RuntimeError("replay requested before a plain backward stored old log-probs")
                        old = batch.old[mi]
                    else:
                        old = logp.detach()
                        batch.old[mi] = old
                    loss, st = self.loss_fn(logp, old, adv, mask, ent, self.cfg.update.loss)
                    w = float(mask.sum()) / n_total
                    (loss * w).backward()
                    for k, v in st.items():
                        acc[k] = acc.get(k, 0.0) + float(v) * w
                if gain:
                    gain_grad = u.grad.detach().float().cpu().clone()
        self.fc.clear()
        self.model.eval()
        if xi_grad:
            acc["xi_grad"] = xi_leaf.grad.detach().float().cpu().clone()
        if gain_grad is not None:
            acc["gain_grad"] = gain_grad
        self.timers["extra_s" if (use_old or gain) else "update_s"] += time.perf_counter() - t0
        return acc

    def grad_norm_sq(self) -> float:
        return float(sum(p.grad.double().pow(2).sum() for p in self.params if p.grad is not None))

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        if self.cfg.update.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.update.grad_clip)
        self.opt.step()
        self.zero_grad()

    # -- one iteration -----------------------------------------------------------------
    def sample_tasks(self, k: int) -> list[tuple[str, int]]:
        split = self.cfg.env.split
        n = self.pool.splits()[split]
        rng = random.Random(f"tasks/{self.cfg.seed}/{k}")
        m = self.cfg.rollout.tasks_per_step
        idx = rng.sample(range(n), m) if m <= n else [rng.randrange(n) for _ in range(m)]
        return [(split, i) for i in idx]

    def iteration(self, k: int) -> dict:
        cfg = self.cfg
        self.timers = {"update_s": 0.0, "extra_s": 0.0}
        t0 = time.perf_counter()
        sig = self.method.sigma_stats()
        xi = self.method.rollout_xi(k)
        self.gen.cfg.seed = cfg.seed * 100_003 + k
        self.gen.calls = 0
        self.fc.set(xi=xi)
        with self.fc:
            episodes, rst = run_groups(self.envs, self.sample_tasks(k), cfg.rollout.group_size, self.gen,
                                       self.agent, cfg.env.max_steps, progress=self.progress)
        self.fc.clear()
        t_roll = time.perf_counter() - t0
        batch, adv_stats = build_batch(episodes, cfg.update.adv, cfg.update.estimator, cfg.update.micro_batch)
        ustats = self.method.update(self, batch, k, xi) if batch.samples else {"skipped": 1.0}
        n = len(episodes)
        m = {
            "iteration": k,
            "success": sum(e.success for e in episodes) / n,
            "score": sum(e.score for e in episodes) / n,
            "valid_rate": sum(s.valid for e in episodes for s in e.steps) / max(1, sum(e.length for e in episodes)),
            "episode_length": sum(e.length for e in episodes) / n,
            "samples": len(batch.samples),
            "response_tokens": batch.n_tokens,
            "rollout_s": round(t_roll, 3),
            "generate_s": round(rst["generate_s"], 3),
            "env_s": round(rst["env_s"], 3),
            "update_s": round(self.timers["update_s"], 3),
            "sensitivity_s": round(self.timers["extra_s"], 3),
            **{f"xi_{k2}": v for k2, v in sig.items()},
            **adv_stats,
            **{k2: v for k2, v in ustats.items() if isinstance(v, (int, float))},
        }
        m["wall_s"] = round(time.perf_counter() - t0, 3)
        if cfg.log_episodes:
            path = self.out / "episodes" / f"iter_{k:05d}.jsonl"
            if path.exists():
                path.unlink()
            EpisodeLog(path).write(episodes)
        return m

    # -- checkpoints -------------------------------------------------------------------
    def save(self, k: int) -> Path:
        """Checkpoint after iteration ``k`` (written to a fresh folder, then the
        ``latest`` pointer is replaced atomically; older checkpoints are removed)."""
        from safetensors.torch import save_file

        ck = self.out / "checkpoints" / f"iter_{k:05d}"
        tmp = ck.with_name(ck.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp / "adapter", safe_serialization=True)
        torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
        ms = self.method.state_dict()
        if ms:
            save_file({k2: v.contiguous() for k2, v in ms.items()}, str(tmp / "method.safetensors"))
        atomic_write_json(tmp / "state.json", {"iteration": k, "config": config_dict(self.cfg)})
        shutil.rmtree(ck, ignore_errors=True)
        os.replace(tmp, ck)
        atomic_write_text(self.out / "checkpoints" / "latest", ck.name + "\n")
        for old in (self.out / "checkpoints").glob("iter_*"):
            if old.name != ck.name:
                shutil.rmtree(old, ignore_errors=True)
        return ck

    def resume(self) -> int | None:
        """Load the latest checkpoint if any; returns its iteration."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        ptr = self.out / "checkpoints" / "latest"
        if not ptr.is_file():
            return None
        ck = self.out / "checkpoints" / ptr.read_text().strip()
        state = json.loads((ck / "state.json").read_text())
        def same_run(c: dict) -> dict:  # a run may be extended: the iteration count is not part of its identity
            return {k: v for k, v in c.items() if k != "iterations"}

        try:  # keys added to the config since the checkpoint take their defaults
            saved = config_dict(_build(TrainConfig, state["config"], ""))
        except (TypeError, ValueError):
            saved = state["config"]
        if same_run(saved) != same_run(config_dict(self.cfg)):
            raise ValueError(
                f"{self.out} holds a run with a different config; use another --out or --fresh to start over"
            )
        from peft import set_peft_model_state_dict

        adapter = ck / "adapter"
        files = list(adapter.rglob("adapter_model.safetensors"))
        weights = load_file(str(files[0]))
        set_peft_model_state_dict(self.model, weights)
        self.opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
        if (ck / "method.safetensors").is_file():
            with safe_open(str(ck / "method.safetensors"), "pt") as f:
                self.method.load_state_dict({k2: f.get_tensor(k2) for k2 in f.keys()})
        return int(state["iteration"])


def agent_config(r: RolloutConfig) -> AgentConfig:
    """The agent's prompt settings from a rollout config."""
    return AgentConfig(history_len=r.history_len, max_obs_chars=r.max_obs_chars,
                       history_obs_chars=r.history_obs_chars, echo_instruction=r.echo_instruction)


def warm_start_key(cfg: TrainConfig, agent: AgentConfig) -> str:
    """Hash of what the warm start depends on: base model, task pool and step limit
    (demonstrations and the evaluation), prompt format and SFT settings; not the RL
    settings (LoRA of the RL stage, method, rollout sizes), so every method and seed
    of a profile starts from the same cached policy."""
    m, e = cfg.model, cfg.env
    return hashlib.sha256(json.dumps(
        {"model": {"spec": m.spec, "dtype": m.dtype},
         "env": {"name": e.name, "seed": e.seed, "data_dir": e.data_dir, "max_steps": e.max_steps},
         "agent": dataclasses.asdict(agent), "sft": dataclasses.asdict(cfg.sft)}, sort_keys=True, default=list,
    ).encode()).hexdigest()[:12]


def warm_start_policy(policy, pool, cfg: TrainConfig, agent: AgentConfig, progress: bool = True) -> Path:
    """Supervised warm start (issue 4 item 4): behaviour cloning on expert demonstrations
    in the exact RL prompt format, cached under ``runs/sft/<key>/`` (the key hashes the
    model, environment, agent and SFT settings), then merged into the base weights, so
    RL adds its own fresh LoRA on top, as it would on an instruct model."""
    from .sft import load_adapter, warm_start

    out = ROOT / "runs" / "sft" / f"{cfg.env.name}-{warm_start_key(cfg, agent)}"
    if not (out / "adapter").is_dir():
        warm_start(policy, pool, cfg.sft, agent, out, progress)
        from .models import merge_lora

        merge_lora(policy)
    else:
        load_adapter(policy, out / "adapter", merge=True)
    for p in policy.model.parameters():
        p.requires_grad_(False)
    if cfg.sft.eval_tasks and not eval_is_current(out / "eval.json", cfg, cfg.sft.eval_tasks):
        evaluate_warm_start(policy, pool, cfg, agent, out, progress)
    return out


def held_out_tasks(cfg: TrainConfig, n_pool: int, count: int) -> list[int]:
    """Training-pool tasks the warm start was not shown (indices after its
    demonstrations; from 0 without a warm start): where the warm-started and the
    RL-trained policies are compared."""
    first = min(cfg.sft.n_tasks, n_pool) if cfg.warm_start else 0
    return list(range(first, min(n_pool, first + count)))


def eval_temperature(cfg: TrainConfig) -> float:
    """Sampling temperature of the held-out evaluations: ``cfg.eval_temperature``
    (0.4, the paper's validation temperature, Table 3) or the rollout temperature."""
    return cfg.rollout.temperature if cfg.eval_temperature is None else cfg.eval_temperature


def eval_settings(cfg: TrainConfig) -> dict:
    """What a held-out evaluation's numbers depend on besides the policy and the tasks."""
    r = cfg.rollout
    return {"temperature": eval_temperature(cfg), "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
            "max_steps": cfg.env.max_steps}


def eval_is_current(path: Path, cfg: TrainConfig, count: int) -> bool:
    """An ``eval.json`` exists and was made with the current :func:`eval_settings` and
    task count (an evaluation is redone, not reused, when any of them changes)."""
    if not path.is_file():
        return False
    res = json.loads(path.read_text())
    return res.get("episodes") == count and all(res.get(k) == v for k, v in eval_settings(cfg).items())


def evaluate_warm_start(policy, pool, cfg: TrainConfig, agent: AgentConfig, out: Path, progress: bool = True,
                        count: int | None = None) -> dict:
    """Success of a policy on ``count`` (default ``cfg.sft.eval_tasks``) held-out
    training tasks (:func:`held_out_tasks`), one rollout each at
    :func:`eval_temperature` and the RL step limit, with a fixed generation seed, so that the warm start (the RL
    starting point; issue 4 target 20-60%) and the final RL policy are scored on the
    same tasks and the same random numbers.  Written to ``out/eval.json`` with the
    episodes in ``out/eval_episodes.jsonl``."""
    from .rollout import GenerationConfig
    from .sft import evaluate_format

    idx = held_out_tasks(cfg, pool.splits()[cfg.sft.split], cfg.sft.eval_tasks if count is None else count)
    r = cfg.rollout
    gen = GenerationConfig(temperature=eval_temperature(cfg), top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                           batch_size=r.gen_batch, seed=cfg.sft.seed)
    (out / "eval_episodes.jsonl").unlink(missing_ok=True)  # a killed evaluation starts over
    res = evaluate_format(policy, pool, cfg.sft.split, idx, agent, gen, max_steps=cfg.env.max_steps,
                          log_path=out / "eval_episodes.jsonl", progress=progress)
    res.update(split=cfg.sft.split, indices=[idx[0], idx[-1]] if idx else [], **eval_settings(cfg))
    atomic_write_json(out / "eval.json", res)
    return res


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def default_out_dir(cfg: TrainConfig) -> Path:
    return ROOT / "runs" / "train" / f"{cfg.env.name}-{cfg.method.name}-{cfg.profile}-seed{cfg.seed}"


def train(cfg: TrainConfig, out_dir: str | Path | None = None, fresh: bool = False, progress: bool = True) -> Path:
    """Run (or resume) training; returns the output folder."""
    from tqdm.auto import tqdm

    tr = Trainer(cfg, out_dir, progress)
    out = tr.out
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "config.json"
    meta = {"config": config_dict(cfg), "commit": git_commit()}
    if meta_path.is_file():  # resumed / extended / re-entered: keep the commit the run started at
        old = json.loads(meta_path.read_text())
        meta["commit"] = old.get("commit", meta["commit"])
        meta["entered_at"] = list(dict.fromkeys(old.get("entered_at", []) + [git_commit()]))
    atomic_write_json(meta_path, meta)
    done = tr.resume()
    start = 0 if done is None else done + 1
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():  # drop lines of iterations after the checkpoint (killed mid-way)
        keep = [ln for ln in metrics_path.read_text().splitlines()
                if ln.strip() and json.loads(ln)["iteration"] < start]
        atomic_write_text(metrics_path, "".join(ln + "\n" for ln in keep))
    bar = tqdm(range(start, cfg.iterations), desc=f"train {cfg.method.name}", disable=not progress,
               initial=start, total=cfg.iterations)
    try:
        for k in bar:
            m = tr.iteration(k)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m) + "\n")
                f.flush()
                os.fsync(f.fileno())
            tr.save(k)
            bar.set_postfix(success=f"{m['success']:.2f}", valid=f"{m['valid_rate']:.2f}")
        final = out / "final"
        if start < cfg.iterations or not (final / "adapter").is_dir():  # (re)written with its eval dropped
            tmp = out / "final.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tr.model.save_pretrained(tmp / "adapter", safe_serialization=True)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        if cfg.eval_tasks and not eval_is_current(final / "eval.json", cfg, cfg.eval_tasks):
            tr.model.eval()
            evaluate_warm_start(tr.policy, tr.pool, cfg, tr.agent, final, progress, count=cfg.eval_tasks)
    finally:
        tr.envs.close()
    return out


def config_hash(cfg: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(config_dict(cfg), sort_keys=True).encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sprpo_lib.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="cpu", help="smoke | cpu | paper (sprpo_lib/configs/*.yaml)")
    ap.add_argument("--env", choices=["webshop", "alfworld"])
    ap.add_argument("--method", help="vanilla | gaussian | sam | sprpo")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--out", help="output folder (default runs/train/<env>-<method>-<profile>-seed<seed>)")
    ap.add_argument("--fresh", action="store_true", help="delete the output folder and start over")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--warm-start-only", action="store_true",
                    help="build (or load) the cached supervised warm start, evaluate it, and stop")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. method.rho=0.1 rollout.group_size=4")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.profile, args.overrides, **{"env.name": args.env, "method.name": args.method,
                                                           "seed": args.seed, "iterations": args.iterations})
    except ValueError as err:
        ap.error(str(err))
    if args.warm_start_only:
        if not cfg.warm_start:
            ap.error(f"profile {cfg.profile!r} has warm_start: false; add the override warm_start=true")
        tr = Trainer(cfg, args.out, not args.no_progress)
        tr.envs.close()
        ev = tr.warm_start_dir / "eval.json"
        print(f"warm start: {tr.warm_start_dir}" + (f"\n{ev.read_text()}" if ev.is_file() else ""))
        return 0
    out = train(cfg, args.out, args.fresh, not args.no_progress)
    print(f"done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
