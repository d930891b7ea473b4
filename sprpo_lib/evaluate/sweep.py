"""One robustness evaluation (:class:`EvalConfig`): the evaluated model, the cells it
plays (each stored in the cache of :mod:`~sprpo_lib.evaluate.cells`), and sweeps of
several configurations, including those read off training runs and profiles."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Iterable, Mapping, Sequence

import pandas as pd
import safetensors.torch as st
import torch
from annotated_types import Ge, Interval

from sprpo_lib.agent.engines import ENGINES, GenerationConfig
from sprpo_lib.agent.envs import ENVIRONMENTS, data_header, make_pool
from sprpo_lib.agent.play import playing
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.core.compress import (
    PAPER_LEVELS,
    PERTURBATIONS,
    ffn_weights,
    fisher_scores,
    perturbation,
    sparsegpt_prune,
)
from sprpo_lib.evaluate.calibration import CalibrationPool, load_calibration
from sprpo_lib.evaluate.cells import (
    CALIBRATED_FAMILIES,
    DEFAULT_CACHE,
    EVAL_SPLITS,
    EVALUATOR_VERSION,
    RANDOM_FAMILIES,
    ROW_COLUMNS,
    SPLIT_LABELS,
    Cell,
    CellCache,
    cell_key,
    check_strength,
    dir_digest,
    episode_log,
    episode_rows,
    families,
    select_tasks,
    state_dict_digest,
    tasks_digest,
)
from sprpo_lib.infra.executor import current
from sprpo_lib.infra.io import (
    CorruptFileError,
    atomic_write_bytes,
    canonical_hash,
    file_lock,
    key_fields,
    read_cached,
    read_json,
    read_safetensors,
)
from sprpo_lib.infra.paths import project_path
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.model.load import (
    DEFAULT_MODEL,
    TINY_SPECS,
    hub_snapshot,
    load_policy,
    looks_like_hub_id,
    model_path,
    resolve_device,
    resolve_model,
)
from sprpo_lib.model.layers import ATTENTION_KERNELS, LOGITS
from sprpo_lib.model.lora import load_adapter
from sprpo_lib.train.config import config_from_dict, load_config
from sprpo_lib.warmstart.cache import warm_start_dir

logger = logging.getLogger(__name__)

# ============================================================================ one evaluation's settings
@dataclass
class EvalConfig:
    """One robustness evaluation (App. C): a model, an environment's held-out tasks, a
    perturbation family at some strengths, and evaluation seeds.

    Attributes:
        model: ``load_policy`` spec: a local HF directory (safetensors weights), a hub
            id already in the local cache, ``"smollm2-135m"``, or ``"tiny-qwen2"`` /
            ``"tiny-llama"`` (tests; initialised with ``model_seed``).
        adapters: peft adapter directories (``save_pretrained``, safetensors), merged
            into the weights in this order before any perturbation (a ``cpu``-profile
            agent is the warm-start adapter, then the RL adapter).
        env, data_dir, env_seed: the task pool (:func:`sprpo_lib.agent.envs.make_pool`).
        splits: held-out splits; ``None``: App. C's (:data:`EVAL_SPLITS`).
        tasks: keep the first N tasks of each split (``None``: all of them).
        family, strengths: the perturbation and its strengths (``()``: App. C's levels,
            :data:`sprpo_lib.core.compress.PAPER_LEVELS`; ``clean`` has the single strength 0).
        seeds: evaluation seeds; each seeds generation and the random families' draw.
        temperature, top_p, max_new_tokens, batch_size: sampling (App. C: T = 0.4).
        max_steps: episode step limit (``None``: the environment's, 15 / 50).
        engine: generation engine (:func:`sprpo_lib.agent.engines.make_engine`).
        prefix_caching: engines with a paged KV cache reuse computed prompt prefixes
            (``GenerationConfig.prefix_caching``); part of the cache key.
        max_batched_tokens: the ``openvino`` scheduler's tokens per step
            (``GenerationConfig.max_batched_tokens``); part of the cache key.
        agent: prompt settings; must match the ones the policy was trained with.
        calibration: calibration-pool JSON (:func:`build_calibration_pool`), needed by
            ``fisher`` and ``sparsegpt``.
        perturbation_options: extra keywords of the family (``scope`` of fisher,
            ``group_size`` of rtn, ``blocksize``/``percdamp`` of sparsegpt,
            ``batch_size``); part of the cache key.
        dtype, device, trust_remote_code, model_seed: how the model is loaded (``device``
            ``auto``: CUDA when there is one; the key records the device type).
        cache_dir: the cell cache (default ``runs/eval_cache``; relative to the project root).
        keep_pruned: keep SparseGPT's pruned FFN weights per policy and ratio under
            ``<cache_dir>/sparsegpt/`` (one FFN copy each), so other cells and the divergence
            pass do not prune again (a speed lever: the same weights).
        attention: the divergence pass's attention kernel (``auto``: a 16-bit model's attention
            as float32-accumulated matmuls on a CPU, SDPA otherwise; ``sdpa``; ``matmul``), as
            ``SpeedConfig.attention`` in training.
        batch_tokens: the divergence pass cuts its states into the batches that pad least, none
            of several states over this many padded prompt tokens (``None``: runs of ``batch_size``).
            Both are speed levers: the same estimates up to rounding (which can move a sampled
            response); not in a divergence cell's key.
        logits: the divergence pass's logits: ``float32`` (a 16-bit model's output head in float32,
            :func:`~sprpo_lib.model.layers.float32_logits`: bfloat16's rounding of the logits does
            not enter the KL or the flips) or ``model`` (the model's own dtype, as a 16-bit engine
            samples); part of a divergence cell's key.
        tags: columns added to every row (e.g. ``{"method": "sprpo", "train_seed": 0}``);
            not part of the cache key.
    """

    model: str
    adapters: tuple[str, ...] = ()
    env: str = "webshop"
    data_dir: str | None = None
    env_seed: Annotated[int, Ge(0)] = 0
    splits: tuple[str, ...] | None = None
    tasks: Annotated[int, Ge(1)] | None = None
    family: str = "clean"
    strengths: tuple[float, ...] = ()  # the range is the family's (check_strength)
    seeds: tuple[Annotated[int, Ge(0)], ...] = (0,)
    temperature: Annotated[float, Ge(0)] = 0.4
    top_p: Annotated[float, Interval(gt=0, le=1)] = 1.0
    max_new_tokens: Annotated[int, Ge(1)] = 64
    batch_size: Annotated[int, Ge(1)] = 16
    max_steps: Annotated[int, Ge(1)] | None = None
    engine: str = "hf"
    prefix_caching: bool = True
    max_batched_tokens: Annotated[int, Ge(16)] = 1024
    agent: AgentConfig = field(default_factory=AgentConfig)
    calibration: str | None = None
    perturbation_options: dict = field(default_factory=dict)
    dtype: str = "auto"
    device: str = "cpu"
    trust_remote_code: bool = False
    model_seed: Annotated[int, Ge(0)] = 0
    cache_dir: str = str(DEFAULT_CACHE)
    keep_pruned: bool = False
    attention: str = "auto"
    batch_tokens: Annotated[int, Ge(1)] | None = 4096
    logits: str = "float32"
    tags: dict = field(default_factory=dict)

    def __post_init__(self):
        self.adapters = tuple(str(a) for a in ([self.adapters] if isinstance(self.adapters, (str, Path))
                                               else self.adapters))
        self.splits = tuple(self.splits) if self.splits is not None else None
        self.seeds = tuple(int(s) for s in self.seeds)
        self.strengths = tuple(self.strengths)
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """One clear ValueError per bad option: which option, what was expected, how to fix."""
        check_ranges(self, "EvalConfig.")
        if self.env not in ENVIRONMENTS:
            raise ValueError(f"--env / EvalConfig.env: unknown environment {self.env!r}; expected one of "
                             f"{ENVIRONMENTS.names()}")
        if self.family not in families():
            check_strength(self.family, 0.0)  # the unknown-family error
        for s in self.resolved_strengths():
            check_strength(self.family, s)
        if not self.seeds:
            raise ValueError("--seeds / EvalConfig.seeds: no evaluation seed given; expected one or more integers, "
                             "e.g. --seeds 0 1 2")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds / EvalConfig.seeds: {list(self.seeds)} repeats a seed; give each seed once")
        if self.splits is not None and not self.splits:
            raise ValueError("--split / EvalConfig.splits: empty list of splits; omit it for App. C's held-out sets")
        if self.splits is None and self.env not in EVAL_SPLITS:
            raise ValueError(f"--split / EvalConfig.splits: no App. C held-out split is known for {self.env!r}; "
                             "name the splits to evaluate")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"--attention / EvalConfig.attention: {self.attention!r}; expected one of "
                             f"{', '.join(ATTENTION_KERNELS)} ('auto': matmuls for a 16-bit model on a CPU, SDPA "
                             "otherwise)")
        if self.logits not in LOGITS:
            raise ValueError(f"--logits / EvalConfig.logits: {self.logits!r}; expected one of {', '.join(LOGITS)} "
                             "('float32': a 16-bit model's logits in float32; 'model': in the model's own dtype)")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine / EvalConfig.engine: unknown generation engine {self.engine!r}; expected one "
                             f"of {sorted(ENGINES)}")
        clash = sorted(set(self.tags) & set(ROW_COLUMNS))
        if clash:
            raise ValueError(f"--tag / EvalConfig.tags: {clash} would overwrite row columns; rename them "
                             "(e.g. train_seed instead of seed)")
        for a in self.adapters:
            check_adapter_dir(a)
        _check_options(self.family, self.perturbation_options)
        _check_model_spec(self.model)
        needs_calib = self.family in CALIBRATED_FAMILIES and any(s != 0 for s in self.resolved_strengths())
        if needs_calib and not self.calibration:
            raise ValueError(f"--calibration / EvalConfig.calibration: family {self.family!r} needs the shared "
                             "calibration pool (App. C: 128 agent-interaction sequences). Fix: build it once from "
                             "a Vanilla policy with --build-calibration PATH, then pass --calibration PATH")
        if needs_calib and not project_path(self.calibration).is_file():
            raise ValueError(f"--calibration / EvalConfig.calibration: {self.calibration} does not exist; build it "
                             "with python -m sprpo_lib.evaluate --build-calibration PATH --model <vanilla policy> ...")

    # ------------------------------------------------------------------ derived
    def resolved_strengths(self) -> tuple[float, ...]:
        """The strengths to evaluate: as given, else App. C's levels for the env."""
        if self.strengths:
            return tuple(self.strengths)
        if self.family == "clean":
            return (0.0,)
        levels = PAPER_LEVELS.get(self.family, {}).get(self.env)
        if levels is None:
            raise ValueError(f"--strength / EvalConfig.strengths: no App. C levels for {self.family!r} on "
                             f"{self.env!r}; give the strengths")
        return tuple(levels)

    def cells(self) -> list[Cell]:
        """Requested cells, strengths outer, seeds inner."""
        return [Cell(self.family, check_strength(self.family, s), seed)
                for s in self.resolved_strengths() for seed in self.seeds]

    def generation(self, seed: int):
        """The sampling settings of evaluation seed ``seed``."""
        return GenerationConfig(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                                batch_size=self.batch_size, seed=int(seed), prefix_caching=self.prefix_caching,
                                max_batched_tokens=self.max_batched_tokens)


def _check_model_spec(spec: str) -> None:
    if spec in TINY_SPECS or spec == DEFAULT_MODEL:
        return
    p = Path(spec).expanduser()
    if p.is_dir():
        if not any(p.glob("*.safetensors")):
            raise ValueError(f"--model / EvalConfig.model: {spec} holds no *.safetensors weights; expected a Hugging "
                             "Face directory saved with save_pretrained(safe_serialization=True) (pickled weights "
                             "are not loaded). Fix: re-save the model as safetensors")
        return
    if looks_like_hub_id(spec):
        hub_snapshot(spec)  # in the local cache, or one error (nothing is downloaded unless asked for)
        return
    raise ValueError(f"--model / EvalConfig.model: {spec!r} is neither a known name ({DEFAULT_MODEL!r}, "
                     f"{', '.join(TINY_SPECS)}), an existing directory, nor a hub id 'org/name'. Fix: pass the "
                     "path of a local copy, e.g. --model /data/Qwen2.5-1.5B-Instruct")


def _check_options(family: str, options: Mapping) -> None:
    """Extra perturbation keywords must be ones the family takes (``calib``/``scores``
    are the evaluator's business)."""
    if not options:
        return
    if family == "clean":
        raise ValueError(f"EvalConfig.perturbation_options: {sorted(options)} given for the clean family, which "
                         "takes none; drop them")
    fn = PERTURBATIONS.get(family)
    valid = [n for n, p in inspect.signature(fn).parameters.items()
             if p.kind is p.KEYWORD_ONLY and n not in ("calib", "scores", "pad_id")]
    bad = sorted(set(options) - set(valid))
    if bad:
        raise ValueError(f"EvalConfig.perturbation_options: family {family!r} takes no option(s) {bad}; "
                         f"expected some of {valid}")


def check_adapter_dir(path: str | Path) -> Path:
    """A peft adapter directory with safetensors weights, or a ValueError saying what is missing."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"--adapter / EvalConfig.adapters: {path} is not a directory; expected a peft adapter saved "
                         "with save_pretrained (adapter_config.json + adapter_model.safetensors), e.g. "
                         "runs/train/<run>/final/adapter")
    missing = [n for n in ("adapter_config.json", "adapter_model.safetensors") if not (p / n).is_file()]
    if missing:
        raise ValueError(f"--adapter / EvalConfig.adapters: {path} lacks {missing}; expected a peft adapter saved "
                         "with save_pretrained(safe_serialization=True) (pickled adapter_model.bin is not loaded)")
    return p


# ============================================================================ the evaluated model


class ModelSource:
    """The evaluated policy: identified by content before loading, loaded (and its
    adapters merged) only when a cell has to be computed."""

    def __init__(self, cfg: EvalConfig, memo_path: Path | None = None):
        self.cfg = cfg
        self.memo_path = memo_path
        self._policy = None
        self._merged = False
        self._identity: dict | None = None

    @property
    def device(self):
        """The torch device the model runs on (``auto``: CUDA when there is one)."""
        return resolve_device(self.cfg.device)

    def _dir(self) -> Path | None:
        try:  # a hub id outside the local cache: identified by loading, which says why not
            return model_path(self.cfg.model)
        except ValueError:
            return None

    def dtype(self) -> str:
        """The dtype the model is (or will be) loaded in (:func:`resolve_model`): part of the key."""
        cfg = self.cfg
        res = resolve_model(cfg.model, cfg.dtype, self.device, trust_remote_code=cfg.trust_remote_code)
        return str(res.dtype).replace("torch.", "")

    def identity(self) -> dict:
        """Content hashes of the base weights and of each adapter, plus dtype and device."""
        if self._identity is None:
            d = self._dir()
            dtype = self.dtype()
            if d is not None:
                base = dir_digest(d, self.memo_path)
            else:
                base = state_dict_digest(self._load_base(dtype).model)
            self._identity = {"base": base, "adapters": [dir_digest(check_adapter_dir(a), self.memo_path)
                                                         for a in self.cfg.adapters],
                              "dtype": dtype, "device": self.device.type}
        return self._identity

    def hashes(self) -> dict[str, str]:
        """The rows' short names of this policy's content: ``model_hash`` (the base weights) and
        ``adapter_hash`` (its adapters, in order; empty without one)."""
        ident = self.identity()
        return {"model_hash": ident["base"][:12],
                "adapter_hash": canonical_hash(ident["adapters"])[:12] if self.cfg.adapters else ""}

    def _load_base(self, dtype: str):
        if self._policy is None:
            self._policy = load_policy(self.cfg.model, dtype=dtype, device=self.device, seed=self.cfg.model_seed,
                                       trust_remote_code=self.cfg.trust_remote_code)
        return self._policy

    def policy(self):
        """The deployed policy: base weights with every adapter merged, in order."""
        pol = self._load_base(self.identity()["dtype"])
        if not self._merged:
            for a in self.cfg.adapters:
                load_adapter(pol, a, merge=True)
            for p in pol.model.parameters():
                p.requires_grad_(False)
            pol.model.eval()
            self._merged = True
        return pol


# ============================================================================ playing cells


def cell_fields(cfg: EvalConfig, identity: Mapping, env_fields: Mapping, cell: Cell,
                calib_hash: str | None) -> dict:
    """Everything a cell's rows depend on: the key's content."""
    return {
        "evaluator": EVALUATOR_VERSION,
        "model": dict(identity),
        "env": dict(env_fields),
        "generation": {"engine": cfg.engine, "prefix_caching": cfg.prefix_caching,
                       "max_batched_tokens": cfg.max_batched_tokens,
                       "temperature": cfg.temperature, "top_p": cfg.top_p,
                       "max_new_tokens": cfg.max_new_tokens, "batch_size": cfg.batch_size,
                       "stop": cfg.generation(0).stop},
        "agent": key_fields(cfg.agent),
        "perturbation": {"family": cell.family, "strength": cell.strength,
                         "options": dict(sorted(cfg.perturbation_options.items())) if cell.family != "clean" else {},
                         "calibration": calib_hash if cell.family in CALIBRATED_FAMILIES else None},
        "seed": cell.seed,
    }


def play_cell(policy, pool, tasks: Sequence[tuple[str, int]], cfg: EvalConfig, seed: int,
              progress: bool = False, with_log: bool = False):
    """Play one episode per task with evaluation seed ``seed`` under whatever
    perturbation is in force on ``policy.model``; a fresh engine, so generation
    depends only on the seed.  Returns the rows, or ``(rows, episode_log)``."""
    with playing(policy, pool, cfg.engine, cfg.generation(seed), cfg.agent, cfg.max_steps) as run:
        records, _ = run(tasks, progress=progress)
    return (episode_rows(records), episode_log(records)) if with_log else episode_rows(records)


def perturbation_kwargs(cfg: EvalConfig, policy, family: str, strength: float, calib: CalibrationPool | None,
                        store: Path, identity: Mapping, progress: bool) -> dict:
    """The keywords :func:`~sprpo_lib.core.compress.perturbation` takes for ``family`` at ``strength`` on
    ``policy``: the options, the shared calibration pool (App. C), Fisher's cached scores, SparseGPT's
    kept pruned weights."""
    if family == "clean":
        return {}
    kw = {"pad_id": policy.tokenizer.pad_token_id, **cfg.perturbation_options}
    if family in CALIBRATED_FAMILIES:
        _check_calibration_fits(calib, policy)
        kw["calib"] = calib.sequences
    if family == "fisher":
        kw["scores"] = fisher_scores_cached(policy, calib, store, identity, cfg.perturbation_options, progress)
        kw.pop("calib")
    if family == "sparsegpt" and cfg.keep_pruned:
        kw["pruned"] = sparsegpt_cached(policy, calib, strength, store, identity, cfg.perturbation_options, progress)
    return kw


def sparsegpt_cached(policy, calib: CalibrationPool, ratio: float, store: Path, identity: Mapping, options: Mapping,
                     progress: bool) -> dict[str, torch.Tensor]:
    """SparseGPT's pruned FFN weights of this model at ``ratio`` on the shared pool (App. C), kept
    as safetensors under ``<cache>/sparsegpt/`` (``keep_pruned``), so the success cells and the
    divergence pass prune a policy once per ratio; a file that is not this model's is recomputed."""
    kw = {k: options[k] for k in ("batch_size", "blocksize", "percdamp") if k in options}
    key = canonical_hash({"evaluator": EVALUATOR_VERSION, "model": dict(identity), "calibration": calib.hash,
                          "ratio": float(ratio), "options": kw})
    path = store / "sparsegpt" / f"{key}.safetensors"
    weights = ffn_weights(policy.model)
    want = {n: (tuple(w.shape), w.dtype) for n, w in weights.items()}
    with file_lock(path.with_name(f".{path.name}.lock")):  # cells of one model on several workers: pruned once
        cached = read_cached(path, read_safetensors)
        if cached is not None:
            if ({n: (tuple(t.shape), t.dtype) for n, t in cached.items()} == want
                    and all(bool(t.isfinite().all()) for t in cached.values())):
                return cached
            logger.warning("corrupt file %s: not this model's pruned FFN weights; recomputing them", path)
        snap = sparsegpt_prune(policy.model, calib.sequences, float(ratio), pad_id=policy.tokenizer.pad_token_id,
                               progress=progress, **kw)
        pruned = {n: w.detach().clone() for n, w in weights.items()}
        snap.restore()
        atomic_write_bytes(path, st.save(pruned))
    return pruned


def fisher_scores_cached(policy, calib: CalibrationPool, store: Path, identity: Mapping, options: Mapping,
                         progress: bool):
    """Fisher channel scores of this model on the shared pool (App. C), cached as
    safetensors under ``<cache>/fisher/``."""
    bs = int(options.get("batch_size", 8))
    key = canonical_hash({"evaluator": EVALUATOR_VERSION, "model": dict(identity), "calibration": calib.hash,
                          "batch_size": bs})
    path = store / "fisher" / f"{key}.safetensors"
    with file_lock(path.with_name(f".{path.name}.lock")):  # cells of one model on several workers: computed once
        cached = read_cached(path, read_safetensors)
        if cached is not None:
            scores = cached.get("scores")
            if (scores is not None and scores.dim() == 2 and scores.is_floating_point()
                    and bool(scores.isfinite().all())):
                return scores
            logger.warning("corrupt file %s: no finite 2-D tensor 'scores'; recomputing it", path)
        scores = fisher_scores(policy.model, calib.sequences, batch_size=bs, pad_id=policy.tokenizer.pad_token_id,
                               progress=progress)
        atomic_write_bytes(path, st.save({"scores": scores.contiguous()}))
    return scores


def _check_calibration_fits(calib: CalibrationPool, policy) -> None:
    vocab = policy.model.get_input_embeddings().weight.shape[0]
    top = max(max(s) for s in calib.sequences)
    if top >= vocab:
        raise ValueError(f"--calibration: token id {top} is outside this model's vocabulary ({vocab}); the pool was "
                         "built with another tokenizer. Build one from a policy of the same base model")


class _CellPlan:
    """The cells one :class:`EvalConfig` asks for, keyed by content, without playing any:
    the task pool, the model's identity, the calibration pool, and each canonical cell's
    ``(key, fields)``."""

    def __init__(self, cfg: EvalConfig, pool=None):
        cfg.validate()
        self.store = project_path(cfg.cache_dir)
        self.cache = CellCache(self.store)
        self.pool = pool if pool is not None else make_pool(cfg.env, cfg.data_dir, cfg.env_seed)
        self.tasks = select_tasks(self.pool, cfg.env, cfg.splits, cfg.tasks)
        env_fields = {"name": cfg.env, "data": self.pool.data_source, "seed": cfg.env_seed,
                      "max_steps": cfg.max_steps or self.pool.max_steps, "tasks": [list(t) for t in self.tasks],
                      "content": tasks_digest(self.pool, self.tasks)}
        self.requested = cfg.cells()
        needs_calib = any(c.canonical().family in CALIBRATED_FAMILIES for c in self.requested)
        self.calib = load_calibration(project_path(cfg.calibration)) if needs_calib else None
        self.source = ModelSource(cfg, self.store / "file_hashes.json")
        self.ident = self.source.identity()
        self.keyed: dict[Cell, tuple[str, dict]] = {}
        for c in self.requested:
            canon = c.canonical()
            if canon not in self.keyed:
                f = cell_fields(cfg, self.ident, env_fields, canon, self.calib.hash if self.calib else None)
                self.keyed[canon] = (cell_key(f), f)


def missing_cells(cfg: EvalConfig, pool=None) -> list[tuple[str, EvalConfig]]:
    """``(cell key, one-cell config)`` of every cell of ``cfg`` not in the cache (or not
    verifying there): the units an executor dispatches (:func:`sweep`)."""
    plan = _CellPlan(cfg, pool)
    return [(k, dataclasses.replace(cfg, strengths=(c.strength,), seeds=(c.seed,)))
            for c, (k, f) in plan.keyed.items() if plan.cache.get(k, f) is None]


def compute_cell(cfg: EvalConfig) -> int:
    """Play the cells of ``cfg`` that are not cached, store them, and return the number
    of episode rows: an executor's cell task (the rows travel through the cache)."""
    return len(evaluate(cfg, progress=False))


#: The data headers printed by this process (:func:`evaluate` says each once).
_ANNOUNCED: set[str] = set()


def evaluate(cfg: EvalConfig, *, progress: bool = True, pool=None) -> "pd.DataFrame":  # noqa: F821
    """Rows of every requested cell of ``cfg``, computing only cells missing from the cache.

    Returns a DataFrame with one row per episode: ``env, split, split_label, task_index,
    task_id, family, strength, seed, success, score, length, valid_rate, trace, model,
    adapters, model_hash, adapter_hash, cell`` plus ``cfg.tags``.  Rows are ordered by
    strength, seed, then task."""
    plan = _CellPlan(cfg, pool)
    cache, pool, tasks, calib, source, ident, keyed = (plan.cache, plan.pool, plan.tasks, plan.calib, plan.source,
                                                       plan.ident, plan.keyed)
    store, requested = plan.store, plan.requested
    header = data_header(cfg.env, cfg.data_dir)
    if progress and header not in _ANNOUNCED:  # the data played, once per process, after the pool opened
        _ANNOUNCED.add(header)
        print(header, file=sys.stderr)
    results = {c: cache.get(k, f) for c, (k, f) in keyed.items()}
    missing = [c for c, rows in results.items() if rows is None]
    bar = progress_bar(total=len(keyed), initial=len(keyed) - len(missing), desc=f"eval {cfg.env} {cfg.family}",
               unit="cell", disable=not progress)
    # deterministic families are applied once per strength for all seeds; random ones per seed
    groups: dict[tuple, list[Cell]] = {}
    for c in missing:
        groups.setdefault((c.family, c.strength, c.seed if c.family in RANDOM_FAMILIES else None), []).append(c)
    for (family, strength, _), cells in groups.items():
        policy = source.policy()
        kw = perturbation_kwargs(cfg, policy, family, strength, calib, store, ident, progress)
        with perturbation(policy.model, "none" if family == "clean" else family, strength, cells[0].seed, **kw):
            for c in cells:
                bar.set_postfix_str(f"{c.family} {c.strength:g} seed {c.seed}")
                t0 = time.perf_counter()
                rows, log = play_cell(policy, pool, tasks, cfg, c.seed, progress=progress, with_log=True)
                key, fields = keyed[c]
                cache.put(key, fields, rows, time.perf_counter() - t0, log)
                results[c] = rows
                bar.update(1)
    bar.close()
    out = []
    adapters, hashes = ";".join(cfg.adapters), source.hashes()
    for c in requested:
        key = keyed[c.canonical()][0]
        for r in results[c.canonical()]:
            out.append({**r, "split_label": SPLIT_LABELS.get(r["split"], r["split"]), "family": c.family,
                        "strength": c.strength, "seed": c.seed, "model": cfg.model, "adapters": adapters,
                        **hashes, "cell": key[:12], **cfg.tags})
    return pd.DataFrame(out, columns=[*ROW_COLUMNS, *cfg.tags])


def sweep(cfgs: Iterable[EvalConfig], *, progress: bool = True, executor=None) -> "pd.DataFrame":  # noqa: F821
    """:func:`evaluate` for several configurations (families, models), rows concatenated
    in the order given.  Each cell is cached as soon as it is computed.

    ``executor`` (default: :func:`sprpo_lib.infra.executor.current`, local unless the
    environment says otherwise): a non-local one first computes every missing cell as
    its own task (each cell once, however many configurations ask for it), then the
    rows are read back from the cache exactly as the local executor reads them."""
    cfgs = list(cfgs)
    executor = executor or current()
    if executor.name != "local":
        todo = {}
        for c in cfgs:
            for key, one in missing_cells(c):
                todo.setdefault(key, one)
        executor.map(compute_cell, [(one,) for one in todo.values()], kind="cell", desc="eval cells",
                     progress=progress)
    frames = [evaluate(c, progress=progress) for c in cfgs]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# ============================================================================ configurations from training runs


def config_from_run(run_dir: str | Path, **overrides) -> EvalConfig:
    """An :class:`EvalConfig` for a training run folder (``runs/.../<env>-<method>-<profile>-seed<s>``):
    its base model and dtype, the warm-start adapter (cached under ``runs/sft/``) when
    the profile has one, then the run's ``final/adapter``; its prompt settings, step
    limit, engine and response length; tags ``method``, ``train_seed``, ``profile``.
    ``overrides`` replace any field (e.g. ``family="rtn"``, ``tasks=64``)."""
    run = project_path(run_dir)
    meta_path = run / "config.json"
    if not meta_path.is_file():
        raise ValueError(f"--run: {run} has no config.json; expected a training run folder (runs/train/<run>)")
    try:
        meta = read_json(meta_path, lambda m: None if isinstance(m.get("config"), dict) else "no 'config' object")
    except CorruptFileError as err:
        raise err.with_fix(f"the run cannot be identified; retrain it (python -m sprpo_lib.train --out {run} --fresh "
                           "with its arguments)") from None
    tc = config_from_dict(meta["config"])
    adapters = []
    if tc.warm_start:
        adapters.append(str(warm_start_dir(tc) / "adapter"))
    adapters.append(str(run / "final" / "adapter"))
    g = tc.rollout.generation
    base = dict(model=tc.model.spec, adapters=tuple(adapters), env=tc.env.name, data_dir=tc.env.data_dir,
                env_seed=tc.env.seed, top_p=g.top_p, max_new_tokens=g.max_new_tokens, max_steps=tc.env.max_steps,
                engine=tc.rollout.engine, prefix_caching=g.prefix_caching, max_batched_tokens=g.max_batched_tokens,
                agent=tc.rollout.agent, device=tc.model.device,
                dtype=meta.get("dtype") or tc.model.dtype or "auto",
                model_seed=tc.seed, tags={"method": tc.method.name, "train_seed": tc.seed, "profile": tc.profile})
    base.update(overrides)
    return EvalConfig(**base)


def config_from_profile(profile: str, env: str, **overrides) -> EvalConfig:
    """An :class:`EvalConfig` with a training profile's prompt settings, step limit,
    engine and response length for ``env`` (so a policy is evaluated with the prompts
    it was trained on); ``overrides`` set the model and anything else."""
    tc = load_config(profile, **{"env.name": env})
    g = tc.rollout.generation
    base = dict(model=tc.model.spec, env=env, data_dir=tc.env.data_dir, env_seed=tc.env.seed, top_p=g.top_p,
                max_new_tokens=g.max_new_tokens, max_steps=tc.env.max_steps, engine=tc.rollout.engine,
                prefix_caching=g.prefix_caching, max_batched_tokens=g.max_batched_tokens, agent=tc.rollout.agent,
                dtype=tc.model.dtype or "auto")
    base.update(overrides)
    return EvalConfig(**base)
