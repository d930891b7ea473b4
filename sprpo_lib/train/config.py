"""The run configuration: one nested dataclass tree, YAML profiles, dotted overrides.

    cfg = load_config("cpu", ["method.name=sprpo", "rollout.generation.temperature=0.8"])

A profile is ``sprpo_lib/configs/<profile>.yaml``: overrides of the dataclass defaults.
Its optional ``per_env`` section holds overrides that depend on the environment (the
paper's prompt budget is 4,096 tokens for WebShop and 3,072 for ALFWorld, verl-agent's
scripts normalise GiGPO by ``mean`` for WebShop and ``mean_std`` for ALFWorld); they
apply after ``env.name`` is known and before command-line overrides.  Sub-configs are
the library's own dataclasses (:class:`GenerationConfig`, :class:`AgentConfig`,
:class:`LoraSettings`, :class:`AdvantageConfig`, :class:`PPOLossConfig`,
:class:`MethodConfig`, :class:`SFTConfig`), nested rather than copied field by field.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from annotated_types import Ge, Gt, Interval

from sprpo_lib.agent.engines import ENGINES, GenerationConfig
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.core.advantages import AdvantageConfig
from sprpo_lib.core.losses import KL_ESTIMATORS, PPOLossConfig
from sprpo_lib.core.methods import MethodConfig
from sprpo_lib.infra.hardware import ALLOCATORS
from sprpo_lib.infra.io import NOT_A_KEY, OMIT_AT_DEFAULT, key_fields
from sprpo_lib.infra.ranges import check_ranges, check_value, show, valid_example
from sprpo_lib.infra.tracking import check_loggers
from sprpo_lib.model.layers import QUERY_CHUNK, check_attention_kernel
from sprpo_lib.model.lora import LoraSettings
from sprpo_lib.warmstart.sft import SFTConfig

PROFILES_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class ModelConfig:
    """The policy: base model, dtype, and the RL LoRA (App. B "Base model", Table 2).

    ``dtype``: ``auto`` (the faster of float32 / bfloat16 on this machine, measured;
    bfloat16 on CUDA), ``float32``, ``bfloat16``; ``None``: the loader's default.
    ``lora_layers``: LoRA on the last N decoder layers only (CPU profiles; backprop
    stops there); ``None``: all layers (paper).  ``init_adapter``: continue training
    a saved peft adapter.  ``device``: ``auto`` (the first CUDA GPU when there is one,
    else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""

    spec: str = "smollm2-135m"
    dtype: str | None = None
    lora: LoraSettings = field(default_factory=LoraSettings)
    lora_layers: Annotated[int, Ge(1)] | None = None
    init_adapter: str | None = None
    device: str = field(default="auto", metadata=OMIT_AT_DEFAULT)

    def __post_init__(self):
        check_ranges(self)


@dataclass
class EnvConfig:
    """Environment and task pool (App. B "Environment Details").

    ``data_dir``: the real data (else ``$WEBSHOP_DATA`` / ``$ALFWORLD_DATA``, else the
    offline default); ``max_steps``: ``None`` = the environment's (50 ALFWorld, 15
    WebShop); ``workers``: environment worker processes (0: in-process)."""

    name: str = "webshop"
    seed: Annotated[int, Ge(0)] = 0
    data_dir: str | None = None
    split: str = "train"
    max_steps: Annotated[int, Ge(1)] | None = None
    workers: Annotated[int, Ge(0)] = 0

    def __post_init__(self):
        check_ranges(self)


@dataclass
class RolloutConfig:
    """Rollout batch (Table 2: 16 tasks x 8 rollouts per step), the generation engine
    and its sampling settings, and the agent's prompt settings."""

    tasks_per_step: Annotated[int, Ge(1)] = 16
    group_size: Annotated[int, Ge(1)] = 8
    engine: str = "hf"
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(batch_size=128))
    agent: AgentConfig = field(default_factory=AgentConfig)
    #: DAPO's dynamic sampling (verl's ``filter_groups``): a group whose episodes all scored
    #: alike has no episode-level advantage and is dropped, and up to this many extra rounds
    #: of ``tasks_per_step`` new tasks each refill the batch until it holds ``tasks_per_step``
    #: groups whose scores differ (verl's ``max_num_gen_batches``).  ``0``: one round, every
    #: group kept (the paper).  Every round plays under the iteration's xi_k.
    refill_rounds: Annotated[int, Ge(0)] = field(default=0, metadata=OMIT_AT_DEFAULT)

    def __post_init__(self):
        check_ranges(self)
        if self.engine not in ENGINES:
            raise ValueError(f"unknown generation engine {self.engine!r} (rollout.engine); "
                             f"expected one of {sorted(ENGINES)}")


@dataclass
class UpdateConfig:
    """The PPO update (App. B, Table 2; verl's actor where the paper is silent).

    ``ppo_mini_batch_size``: step samples per optimizer step (``None``: the whole
    batch, one step per epoch: Alg. 1 line 6's single update); ``ppo_epochs`` passes
    over the batch.  Old log-probs are taken once, at theta_k, before the first step
    (verl's ``old_log_prob``).  verl-agent's scripts use ``ppo_mini_batch_size`` 64-128
    step rows, 1 epoch, and a ``low_var_kl`` loss to the reference policy with
    ``kl_coef`` 0.01; the paper states neither, so the defaults are one step and no
    KL.  ``micro_batch``: samples per forward/backward (gradient accumulation, exact
    for the token-mean).  ``skip_zero_adv``: passes over the token-mean surrogate alone
    skip the rows with advantage 0, whose gradient is exactly 0 (the update, SPrPO's
    replay and SAM's channel gradient; the result is the same up to float rounding,
    the cost falls by their share: ``grad_token_frac`` in the metrics); ``false`` runs
    every row, as verl does.  ``prefix_min``: every pass computes a token prefix shared by
    several rows (a group's task text; the whole prompt at a state several rollouts
    reached) once when it is at least this long, the rows' own tokens attending to its keys
    and values (Prefix Grouper's idea; same gradient up to rounding); ``0`` computes every
    row whole, as verl does.  ``micro_batch_tokens``: a micro-batch of several rows also
    keeps its padded token positions (rows x longest row) within this budget, so that
    activation memory follows tokens rather than rows (verl's ``ppo_max_token_len_per_gpu``);
    ``null``: rows alone decide.  ``grad_checkpointing``: each decoder layer keeps only its
    input for the backward and is recomputed there (verl's ``enable_gradient_checkpointing``):
    far less activation memory for about one more forward.  ``reuse_frozen``: with several
    optimizer steps, each step runs the layers from the lowest trainable one on, from the
    hidden states the old-log-prob pass kept there (the layers below hold no trainable
    weight and see the same xi: same steps up to rounding); ``false`` runs every layer at
    every step, as verl does.  ``fused_kernels``: the passes run RMSNorm, SwiGLU and the
    rotary embedding as compiled fused kernels (:mod:`sprpo_lib.model.fused`; verl's
    ``use_fused_kernels``, off there too): same steps up to rounding, needs a C++ compiler
    (without one the passes run eagerly, said once).  ``fused_lora``: the passes compute each
    adapted linear as one function, the adapter's output accumulated into the base's
    (:class:`sprpo_lib.model.lora.LoraLinear`; no separate scale and add, about 5% of a CPU
    update): same steps up to rounding; ``false`` runs peft's forward.  ``fused_entropy``: a
    pass with the entropy bonus takes log-probs and entropy from one softmax
    (:func:`sprpo_lib.core.losses.token_logprobs_entropy`, a third of the passes over the
    vocabulary-wide logits): same steps up to rounding; ``false`` runs the two functions.
    ``native_gqa``: on a CPU the passes' masked grouped-query attention reads each key/value
    head for its query heads (SDPA's ``enable_gqa``, :func:`sprpo_lib.model.layers.native_gqa`)
    where transformers copies K and V once per query head (1% of a CPU update on WebShop, 3%
    on ALFWorld): same steps up to rounding; ``false`` keeps transformers' copy.
    ``attention``: ``auto`` computes a 16-bit pass's attention as two matmuls and a softmax
    accumulated in float32 (:func:`sprpo_lib.model.layers.matmul_attention`, the stacked query heads of a
    key/value head against it): on a CPU PyTorch's fused kernel runs 16-bit attention far
    below the matmul rate (``sprpo-bench attention``), while in float32 it is the faster, so
    float32 keeps SDPA; same steps up to rounding; ``sdpa`` always SDPA, ``matmul`` always
    the matmuls.
    ``attention_chunk``: the matmuls run a causal call of at least twice this many queries in
    up to 4 query chunks, each chunk's product stopping at its last query's key, so most of
    the masked half of the own-key scores is never computed
    (:func:`sprpo_lib.model.layers.query_chunks`): same steps up to rounding; ``0`` one
    product over every key.
    ``first_step_logp``: with several optimizer steps, the rows of the first step take their
    old log-probs from that step's own forward at theta_k, so the pass that fills the old
    log-probs runs only the layers below the adapters for them (with ``reuse_frozen``; without
    it, nothing; 6% of a CPU update on WebShop, 3% on ALFWorld): same steps up to rounding;
    ``false`` fills every row first, as verl does.
    ``replay_graph_gb``: SPrPO's replay (Alg. 1 line 7) runs the layers below the adapters
    under the update's xi with unchanged weights, so with ``reuse_frozen`` and several
    optimizer steps the update's pass there can keep its autograd graph for line 7's rows, up
    to this many GiB of saved activations, and the replay then runs the adapted layers alone
    plus one backward through that graph (rows beyond the budget run every layer): the same
    steps and, up to rounding, the same S_hat and m_hat.  ``0`` (the default) keeps none and
    replays every layer.  On one batch, repeated, the replay takes 0.62-0.67x its seconds
    (``sprpo-bench train --paths shared,full_replay update.replay_graph_gb=10``), but in cpu
    RL runs, where each iteration's batch is new, the update that keeps the graph is as much
    slower (first-touch of up to 15 GiB of fresh memory; ``sprpo-bench runs``): no net gain
    there, at 3x the memory.  The process keeps that much freed memory mapped
    (:func:`sprpo_lib.infra.hardware.keep_freed`)."""

    lr: Annotated[float, Gt(0)] = 3e-6
    betas: tuple[Annotated[float, Interval(ge=0, lt=1)], Annotated[float, Interval(ge=0, lt=1)]] = (0.9, 0.999)
    weight_decay: Annotated[float, Ge(0)] = 0.0
    grad_clip: Annotated[float, Ge(0)] = 1.0
    micro_batch: Annotated[int, Ge(1)] = 8
    ppo_mini_batch_size: Annotated[int, Ge(1)] | None = None
    ppo_epochs: Annotated[int, Ge(1)] = 1
    kl_coef: Annotated[float, Ge(0)] = 0.0
    kl_type: str = "low_var_kl"
    estimator: str = "gigpo"
    adv: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss_name: str = "ppo_dual_clip"
    loss: PPOLossConfig = field(default_factory=PPOLossConfig)
    skip_zero_adv: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    prefix_min: Annotated[int, Ge(0)] = field(default=16, metadata=OMIT_AT_DEFAULT)
    micro_batch_tokens: Annotated[int, Ge(1)] | None = field(default=None, metadata=OMIT_AT_DEFAULT)
    grad_checkpointing: bool = field(default=False, metadata=OMIT_AT_DEFAULT)
    reuse_frozen: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    fused_kernels: bool = field(default=False, metadata=OMIT_AT_DEFAULT)
    fused_lora: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    fused_entropy: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    native_gqa: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    first_step_logp: bool = field(default=True, metadata=OMIT_AT_DEFAULT)
    attention: str = field(default="auto", metadata=OMIT_AT_DEFAULT)
    attention_chunk: Annotated[int, Ge(0)] = field(default=QUERY_CHUNK, metadata=OMIT_AT_DEFAULT)
    replay_graph_gb: Annotated[float, Ge(0)] = field(default=0.0, metadata=OMIT_AT_DEFAULT)

    def __post_init__(self):
        check_ranges(self)
        check_attention_kernel(self.attention)
        if self.kl_type not in KL_ESTIMATORS:
            raise ValueError(f"update.kl_type must be one of {KL_ESTIMATORS}, got {self.kl_type!r}")


@dataclass
class TrainConfig:
    """Everything a run depends on; profiles are YAML files of overrides.

    ``warm_start``: behaviour cloning on demonstrations first (offline profiles; the
    paper starts from an instruct model).  ``eval_tasks``: after training, score the
    final policy on the warm start's held-out tasks; ``eval_temperature``: the
    held-out evaluations' temperature (Table 2 "Validation temperature" 0.4; ``None``:
    the rollout's).  ``logger``: where each iteration's metrics go
    (:mod:`sprpo_lib.infra.tracking`: ``console``, ``jsonl``, ``tensorboard``, ``wandb``; verl's
    ``trainer.logger``); not part of the run's identity, so changing it resumes a run.
    ``eval_every``: also score the policy on those ``eval_tasks`` held-out tasks after
    every N-th iteration (verl's ``trainer.test_freq``; 0: only the final policy), written
    to ``heldout/iter_<k>/``: the learning curve, paired with the warm start's ``eval.json``
    (same tasks, seed and temperature); it does not change the training itself.
    ``allocator``: glibc malloc settings for the run's process
    (:func:`sprpo_lib.infra.hardware.set_allocator`: ``tuned`` keeps freed activation memory
    mapped instead of page-faulting it in again every pass; ``default``: glibc as it is); speed
    only, not part of the run's identity."""

    profile: str = "paper"
    iterations: Annotated[int, Ge(1)] = 200
    seed: Annotated[int, Ge(0)] = 0
    threads: Annotated[int, Ge(1)] | None = None
    allocator: str = field(default="tuned", metadata=NOT_A_KEY)
    out_dir: str | None = None
    log_episodes: bool = True
    warm_start: bool = False
    eval_tasks: Annotated[int, Ge(0)] = 0
    eval_every: Annotated[int, Ge(0)] = field(default=0, metadata=OMIT_AT_DEFAULT)
    eval_temperature: Annotated[float, Ge(0)] | None = 0.4
    sft: SFTConfig = field(default_factory=SFTConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    logger: tuple[str, ...] = field(default=("jsonl",), metadata=NOT_A_KEY)

    def __post_init__(self):
        self.logger = check_loggers(self.logger)
        check_ranges(self)
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator={self.allocator!r}: expected one of {ALLOCATORS} ('tuned': keep freed "
                             "activation memory mapped, the default; 'default': glibc's own malloc settings)")
        if self.eval_every and self.eval_tasks < 1:
            raise ValueError(f"eval_every={self.eval_every} needs eval_tasks >= 1 held-out tasks (e.g. eval_tasks=64 "
                             f"eval_every=10; eval_every=0 evaluates only the final policy)")
        if self.method.name == "sprpo" and self.method.sensitivity == "one_pass" and (
                self.update.ppo_mini_batch_size is not None or self.update.ppo_epochs != 1):
            raise ValueError("method.sensitivity=one_pass reads S_hat and m_hat from the single update step at "
                             "theta_k: it needs update.ppo_mini_batch_size=null and update.ppo_epochs=1 "
                             "(or use method.sensitivity=replay)")


def build(cls, data: dict, where: str = ""):
    """A (nested) dataclass from a mapping; unknown keys are an error listing the valid ones,
    and every value is checked against its field's declared type (:func:`typed`)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {}
    for k, v in data.items():
        if k not in fields:
            raise ValueError(f"unknown config key {where + k!r}; valid keys here: {sorted(fields)}")
        default = _default(fields[k])
        if dataclasses.is_dataclass(default) and isinstance(v, dict):
            kwargs[k] = build(type(default), {**_shallow(default), **v}, f"{where}{k}.")
        elif dataclasses.is_dataclass(default) and isinstance(v, type(default)):
            kwargs[k] = v
        else:
            kwargs[k] = typed(where + k, v, hints[k], default)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"{where or 'config'}: {err}") from err


def _describe(t) -> str:
    args = typing.get_args(t)
    if typing.get_origin(t) in (types.UnionType, typing.Union):
        return " or ".join(_describe(a) for a in args)
    if typing.get_origin(t) is tuple:
        return (f"a list of {_describe(args[0])}" if len(args) == 2 and args[1] is Ellipsis
                else f"a list of {len(args)} ({', '.join(map(_describe, args))})")
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
            type(None): "null"}.get(t, getattr(t, "__name__", str(t)))


def _plain(t):
    """``t`` without its ``Annotated`` ranges, also inside unions and tuples."""
    if typing.get_origin(t) is typing.Annotated:
        return _plain(typing.get_args(t)[0])
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (types.UnionType, typing.Union):
        return functools.reduce(operator.or_, map(_plain, args))
    if origin is tuple:
        return tuple[tuple(a if a is Ellipsis else _plain(a) for a in args)]
    return t


def typed(key: str, value: Any, t, default: Any = None) -> Any:
    """``value`` as the declared type ``t`` of config key ``key``, or one ``ValueError``
    naming the key, the value, the type expected and a valid example.  Bools are only
    true/false; an integer is accepted where a float is declared (and kept as written, so
    that hashes of configs stay what they were); floats must be finite (no config field
    takes NaN or infinity); a list becomes a tuple.  A range declared with ``Annotated``
    is checked after the type (:func:`sprpo_lib.infra.ranges.check_value`)."""
    default = valid_example(t) if default is None else default
    return check_value(key, _typed(key, value, _plain(t), default), t, default)


def _typed(key: str, value: Any, t, default: Any = None) -> Any:
    origin, args = typing.get_origin(t), typing.get_args(t)
    ok = False
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return _typed(key, value, a, default)
            except ValueError:
                pass
    elif origin is tuple and isinstance(value, (list, tuple)):
        each = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(each) == len(value):
            return tuple(_typed(key, v, a) for v, a in zip(value, each))
    elif t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif t is str:
        ok = isinstance(value, str)
    elif origin is tuple:  # one string for a list of strings (``logger=jsonl``): the field's own check splits it
        ok = isinstance(value, str) and args[:1] == (str,)
    else:  # a type this check does not know: left to the dataclass
        ok = True
    if ok:
        return value
    example = default if default is not None and not isinstance(default, (list, tuple)) else {
        bool: "true", int: 1, float: 0.1, str: "name"}.get(next((a for a in (args or (t,)) if a is not type(None)), t), "...")
    if isinstance(default, tuple):
        example = show(default)
    shown = json.dumps(example) if isinstance(example, bool) else show(example) if isinstance(example, float) else example
    raise ValueError(f"{key}={value!r}: expected {_describe(t)}; for example {key}={shown}")


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _shallow(obj) -> dict:
    """A dataclass's own field values (sub-dataclasses kept as objects, not dicts)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a section")
    d[parts[-1]] = value


#: Sections of a profile's YAML that are not training config: what the notebooks train and
#: evaluate (:class:`sprpo_lib.paper.experiments.Plan`) and the ablation study
#: (:func:`sprpo_lib.paper.ablations.ablation`).
PLAN_SECTIONS = ("plan", "ablation")


def profile_names() -> list[str]:
    """The profiles, one YAML file each."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def profile_section(profile: str, section: str) -> dict:
    """One of :data:`PLAN_SECTIONS` of ``profile``'s YAML (``{}`` where it has none)."""
    path = PROFILES_DIR / f"{profile}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown profile {profile!r}; expected one of {profile_names()}")
    if section not in PLAN_SECTIONS:
        raise ValueError(f"profile_section: {section!r} is no plan section; expected one of {list(PLAN_SECTIONS)}")
    return (yaml.safe_load(path.read_text()) or {}).get(section) or {}


def load_config(profile: str = "paper", overrides: list[str] | None = None, **top) -> TrainConfig:
    """Profile YAML + its ``per_env`` section for the chosen env + ``key.sub=value``
    overrides (``top``: keyword overrides such as ``**{"env.name": "alfworld"}``)."""
    path = PROFILES_DIR / f"{profile}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown profile {profile!r}; expected one of {profile_names()}")
    data = yaml.safe_load(path.read_text()) or {}
    for section in PLAN_SECTIONS:  # the notebooks' plan, not the training config
        data.pop(section, None)
    per_env = data.pop("per_env", {}) or {}
    data["profile"] = profile
    pairs: list[tuple[str, Any]] = [(k, v) for k, v in top.items() if v is not None]
    for ov in overrides or []:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} must look like key.sub=value (e.g. method.rho=0.1)")
        k, v = ov.split("=", 1)
        try:
            pairs.append((k.strip(), yaml.safe_load(v)))
        except yaml.YAMLError as err:
            what = str(getattr(err, "problem", None) or err).splitlines()[0]
            raise ValueError(f"override {ov!r}: the value is not valid YAML ({what}); quote a string, write a list "
                             f"as [1, 2], e.g. {k.strip()}=0.1") from None
    env = next((v for k, v in reversed(pairs) if k == "env.name"), (data.get("env") or {}).get("name", "webshop"))
    for k, v in (per_env.get(env) or {}).items():
        _set_dotted(data, k, v)
    for k, v in pairs:
        _set_dotted(data, k, v)
    cfg = build(TrainConfig, data)
    if cfg.warm_start and cfg.sft.demonstrator == "shopper" and cfg.env.name != "webshop":
        raise ValueError(f"sft.demonstrator=shopper exists for WebShop only (env.name={cfg.env.name!r}); "
                         f"add the override sft.demonstrator=expert (and env.max_steps=50 for ALFWorld)")
    return cfg


def config_dict(cfg) -> dict:
    """A config as plain JSON-able data (what ``config.json`` and checkpoints store;
    options added later are left out at their default, :func:`sprpo_lib.infra.io.key_fields`)."""
    return json.loads(json.dumps(key_fields(cfg), default=list))


def config_from_dict(data: dict) -> TrainConfig:
    """Inverse of :func:`config_dict` (keys added since take their defaults)."""
    return build(TrainConfig, data)
