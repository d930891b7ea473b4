"""The run configuration: one nested dataclass tree, YAML profiles, dotted overrides.

    cfg = load_config("cpu", ["method.name=sprpo", "rollout.generation.temperature=0.8"])

A profile is ``sprpo_lib/configs/<profile>.yaml``: overrides of the dataclass defaults.
Its optional ``per_env`` section holds overrides that depend on the environment (the
paper's prompt budget is 4,096 tokens for WebShop and 3,072 for ALFWorld, verl-agent's
scripts normalise GiGPO by ``mean`` for WebShop and ``mean_std`` for ALFWorld); they
apply after ``env.name`` is known and before command-line overrides.  Sub-configs are
the library's own dataclasses (:class:`GenerationConfig`, :class:`AgentConfig`,
:class:`LoraSettings`, :class:`UpdateConfig` and :class:`SpeedConfig`, :class:`MethodConfig`,
:class:`SFTConfig`), nested rather than copied field by field.
"""
from __future__ import annotations

import copy
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
from annotated_types import Ge

from sprpo_lib.agent.engines import ENGINES, GenerationConfig
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.core.config import SpeedConfig, UpdateConfig
from sprpo_lib.core.methods import MethodConfig
from sprpo_lib.infra.hardware import ALLOCATORS
from sprpo_lib.infra.io import NOT_A_KEY, OMIT_AT_DEFAULT, key_fields
from sprpo_lib.infra.ranges import check_ranges, check_value, show, valid_example
from sprpo_lib.infra.tracking import check_loggers
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
    only, not part of the run's identity.  ``threads``: torch's threads (``None``: torch's own
    choice), never more than ``OMP_NUM_THREADS`` where set (:func:`sprpo_lib.infra.hardware.set_threads`)."""

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
    speed: SpeedConfig = field(default_factory=SpeedConfig, metadata=OMIT_AT_DEFAULT)
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
        if cls is UpdateConfig and k in SPEED_LEVERS:
            raise ValueError(f"{where + k}: a speed lever, set as speed.{k} (SpeedConfig); the update's section "
                             f"holds App. B's knobs")
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


#: Configs built by :func:`load_config`, keyed on the profile's YAML text and the arguments.
_BUILT: dict[tuple, TrainConfig] = {}


def load_config(profile: str = "paper", overrides: list[str] | None = None, **top) -> TrainConfig:
    """Profile YAML + its ``per_env`` section for the chosen env + ``key.sub=value``
    overrides (``top``: keyword overrides such as ``**{"env.name": "alfworld"}``).  Each call
    returns its own copy; building is memoised on the YAML's text and the arguments (the
    budget planner asks for the same configs thousands of times)."""
    path = PROFILES_DIR / f"{profile}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown profile {profile!r}; expected one of {profile_names()}")
    text = path.read_text()
    key = (profile, text, tuple(overrides or ()), repr(sorted(top.items())))
    if key not in _BUILT:
        if len(_BUILT) >= 256:
            _BUILT.clear()
        _BUILT[key] = _build_config(profile, text, overrides, top)
    return copy.deepcopy(_BUILT[key])


def _build_config(profile: str, text: str, overrides: list[str] | None, top: dict) -> TrainConfig:
    data = yaml.safe_load(text) or {}
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


#: The speed levers' names (``speed.<name>``; configs stored before they had a section kept them under ``update``).
SPEED_LEVERS = frozenset(f.name for f in dataclasses.fields(SpeedConfig))


def moved_levers(data: dict) -> dict:
    """A stored config (``config.json``) with the levers it kept under ``update`` moved to ``speed``."""
    update = dict(data.get("update") or {})
    moved = {k: update.pop(k) for k in list(update) if k in SPEED_LEVERS}
    return {**data, "update": update, "speed": {**moved, **(data.get("speed") or {})}} if moved else data


def config_from_dict(data: dict) -> TrainConfig:
    """Inverse of :func:`config_dict` (keys added since take their defaults; stored levers under
    ``update``, :func:`moved_levers`)."""
    return build(TrainConfig, moved_levers(data))
