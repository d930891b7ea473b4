"""The ``openvino`` generation engine: the policy converted to an OpenVINO IR and decoded
on the CPU in the policy's dtype (float32 or bfloat16), by OpenVINO GenAI's
continuous-batching pipeline (``backend="genai"``, the default when ``openvino-genai`` is
installed) or by our own decode loop (``"loop"``).

* Conversion uses only the ``openvino`` Python API inside this project's environment (no
  optimum-intel, which pins another transformers): ``ov.convert_model`` traces a wrapper around
  the transformers model whose past keys/values are explicit inputs and outputs; a ``beam_idx``
  input gathers the cache rows before each step, ``apply_make_stateful_transformation`` hides
  the cache inside the model as state and the logits of the last position come out as
  ``[batch, 1, vocab]``: the layout GenAI's pipelines read.  The trace uses a copy of the
  architecture with every parameter set to distinct non-trivial values, so that no weight is
  folded away (a zero bias or a unit norm would be); the constants holding parameters are found
  by content and named, and the real weights put into them.  ``openvino_tokenizers`` converts
  the tokenizer (GenAI detokenizes with it to match stop strings).
* The IR is cached under ``cache_dir()/openvino/<architecture+tokenizer hash>-<weights
  digest>`` (written atomically).  A policy with other weights of a cached architecture reuses
  that IR with its own weights put in (no conversion, nothing written to the cache).
* :meth:`OpenVINOEngine.load_weights` replaces the weight constants and recompiles (``loop``)
  or builds a new pipeline on a scratch copy of the IR (``genai``): seconds, no reconversion.
* ``genai`` runs in a worker process (:mod:`sprpo_lib.agent.engines.ov_worker`, one per engine, kept across
  weight reloads), so that every call has a deadline (:meth:`OpenVINOEngine.call_deadline`):
  a call past it is abandoned, the worker killed, the pipeline built again in a new one and
  the call repeated with the same seeds (the same tokens); ``stats["retries"]`` counts it,
  and after ``attempts`` failures one error names the way out (``rollout.engine=hf``).  The
  worker also removes the known cause of such hangs: GenAI's stop-string matching
  detokenizes from the sampler's threads through a request queue that can lose a wake-up,
  so its pipelines sample on one thread and share one warmed-up tokenizer.
* The precision is what the CPU plugin can run (:func:`serving_precision`, by
  :func:`~sprpo_lib.infra.hardware.cpu_class`): a bfloat16 policy is served in bfloat16 on
  AVX512-BF16 and AMX CPUs, in float32 with an f32 KV cache elsewhere (a notice says so).
* A cached IR folder is checked against the sizes and SHA-256 its ``meta.json`` records
  (:func:`ir_is_whole`); a damaged one is converted again.
* ``genai``: prompts are tokenized by the HF tokenizer (the same ids as
  :class:`~sprpo_lib.agent.engines.HFEngine`) and fed as token ids; no padding, finished sequences
  leave the batch; the KV blocks of prompt prefixes computed by earlier calls with the same
  weights are reused (``GenerationConfig.prefix_caching``, GenAI's ``enable_prefix_caching``).  Stop after ``cfg.stop``
  (kept in the output), the end-of-turn / eos / pad ids, ``max_new_tokens``; the model's
  repetition penalty is passed on.  Sampling: temperature / top-p, request ``i`` of call ``k``
  seeded by ``(call_seed(cfg, k), i)``: reproducible, not HFEngine's draws.
* ``loop``: :class:`~sprpo_lib.agent.engines.HFEngine`'s decoding (prompts sorted by length and
  prefilled in similar-length groups whose states are joined, finished rows dropped with
  ``beam_idx``, :func:`~sprpo_lib.agent.engines.base.select_tokens` with a torch generator); cache columns only
  dropped rows used are not trimmed.  About half the speed of ``genai`` on SmolLM2.

The engine decodes with the weights it was given: at construction ``effective_weights(policy.model)``
(LoRA merged; FFN hooks in force are *not* seen), afterwards whatever :meth:`load_weights` got
(``bake_weights(model, xi, mask)``).  It computes in the policy's dtype where the CPU can
(``precision``, above): float32, or bfloat16 arithmetic and KV cache for a bfloat16 policy (the
plugin's bf16 kernels; weights are kept as float32 in the IR); float16 policies run in float32.  The CPU plugin's
defaults that quantise the KV cache to u8 and activations dynamically are switched off.  A stop string that starts inside the prompt's last
characters is matched by ``loop`` (as by HFEngine) but not by ``genai``; ChatML prompts end
in ``assistant\n``, so ``</action>`` cannot.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from sprpo_lib.agent.engines.base import (
    Generation,
    accept_tokens,
    base_model,
    call_seed,
    check_generation_config,
    cut_response,
    effective_weights,
    eos_ids,
    prefill_groups,
    select_tokens,
)
from sprpo_lib.agent.engines.hf import HFEngine
from sprpo_lib.agent.prompt import chat_text
from sprpo_lib.infra.hardware import cpu_class
from sprpo_lib.infra.io import CorruptFileError, atomic_dir, atomic_write_json, file_record, read_json, verify_file
from sprpo_lib.infra.paths import cache_dir

log = logging.getLogger(__name__)

CONVERTER_VERSION = 3  # bump when the IR built here changes
INSTALL_HINT = ("engine 'openvino' needs OpenVINO: pip install openvino==2026.4.1 openvino-genai==2026.4.1.0 "
                "openvino-tokenizers==2026.4.1.0 (pinned in requirements.txt)")
# CPU plugin settings: float32 everywhere (its defaults quantise the KV cache to u8 and
# activations dynamically on some CPUs), one stream, latency.  PRECISIONS switches the
# arithmetic and the KV cache to bfloat16 for a bfloat16 policy.
CPU_PROPERTIES = {
    "INFERENCE_PRECISION_HINT": "f32",
    "EXECUTION_MODE_HINT": "ACCURACY",
    "KV_CACHE_PRECISION": "f32",
    "KEY_CACHE_PRECISION": "f32",
    "VALUE_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
    "PERFORMANCE_HINT": "LATENCY",
    "NUM_STREAMS": "1",
}
PRECISIONS = {
    "float32": {},
    # GenAI's paged attention wants the KV cache in the inference precision; "PERFORMANCE" lets the
    # plugin keep bf16 where float32 accuracy mode would upcast
    "bfloat16": {"INFERENCE_PRECISION_HINT": "bf16", "EXECUTION_MODE_HINT": "PERFORMANCE",
                 "KV_CACHE_PRECISION": "bf16", "KEY_CACHE_PRECISION": "bf16", "VALUE_CACHE_PRECISION": "bf16"},
}
_WEIGHT = "sprpo_weight:"  # friendly-name prefix of the constants holding parameters
BF16_CLASSES = ("avx512_bf16", "amx")  # CPU classes (hardware.cpu_class) whose plugin runs bf16 kernels


def serving_precision(policy_dtype: str, cls: str, forced: str | None = None, plugin_bf16: bool = True,
                      ) -> tuple[str, str | None]:
    """The precision (arithmetic and KV cache) the CPU plugin serves a policy in, and a
    one-line notice when it is not the policy's own.

    The default is the policy's dtype (float16 -> float32).  bfloat16 needs a CPU of class
    ``avx512_bf16`` or ``amx`` whose plugin lists ``BF16`` among its capabilities
    (``plugin_bf16``): OpenVINO's AVX2 paged attention takes an f32 KV cache only and its
    AVX512 one a bf16 cache only with bf16 arithmetic.  Elsewhere a bfloat16 policy is
    served in float32 (f32 KV cache) with a notice; a ``forced`` bfloat16 is an error."""
    if forced is not None and forced not in PRECISIONS:
        raise ValueError(f"OpenVINOEngine precision must be one of {sorted(PRECISIONS)}, got {forced!r}")
    want = forced or ("bfloat16" if policy_dtype == "bfloat16" else "float32")
    if want == "bfloat16" and not (cls in BF16_CLASSES and plugin_bf16):
        why = (f"this CPU (class {cls!r}, hardware.cpu_class) cannot run OpenVINO's bfloat16 kernels: its paged attention "
               "takes a bfloat16 KV cache only on AVX512 and bfloat16 arithmetic only with AVX512-BF16 or AMX")
        if forced:
            raise ValueError(f"OpenVINOEngine precision='bfloat16': {why}; use precision='float32', or leave precision "
                             "unset to serve a bfloat16 policy in float32")
        return "float32", f"openvino engine: bfloat16 policy served in float32 with an f32 KV cache ({why})"
    return want, None


#: OpenVINO 2026.4.1's CPU plugin dies of SIGFPE compiling a bfloat16 graph with one inference
#: thread on an AMX CPU (seen on a Xeon with AMX; oneDNN capped below AMX, or two threads, compile).
ONE_THREAD_AMX_CAP = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


def one_thread_amx(precision: str, cls: str, threads: int, backend: str, forced: str | None = None,
                   env: Mapping[str, str] | None = None) -> tuple[str, dict, str | None]:
    """The workaround for :data:`ONE_THREAD_AMX_CAP`'s crash: ``(precision, worker_env,
    notice)``.  The ``genai`` backend keeps bfloat16 in a worker process whose oneDNN is
    capped at AVX512-BF16 (same arithmetic, no AMX tiles); the in-process ``loop`` backend
    cannot cap a oneDNN already in use, so it serves float32 with a notice (a ``forced``
    bfloat16 is an error).  Nothing changes elsewhere or when the user set a cap."""
    env = os.environ if env is None else env
    if not (precision == "bfloat16" and cls == "amx" and threads == 1 and not env.get("ONEDNN_MAX_CPU_ISA")):
        return precision, {}, None
    if backend == "genai":
        return precision, dict(ONE_THREAD_AMX_CAP), None
    why = ("OpenVINO's AMX kernels crash compiling bfloat16 with one inference thread; the loop backend runs "
           "in this process and cannot avoid them")
    if forced:
        raise ValueError(f"OpenVINOEngine precision='bfloat16' with backend='loop' and threads=1 on this AMX CPU: {why}; "
                         "use backend='genai', threads=2, or precision='float32'")
    return "float32", {}, f"openvino engine: bfloat16 policy served in float32 by the loop backend ({why})"


def _genai():
    """``openvino_genai`` or None when not installed."""
    try:
        import openvino_genai  # optional engine: loaded on use
    except ImportError:
        return None
    return openvino_genai


def _save_tokenizer(tokenizer, folder: Path) -> str:
    """Write GenAI's tokenizer / detokenizer IRs of ``tokenizer`` into ``folder`` (the
    ``genai`` backend detokenizes with them to match stop strings); a note of the outcome."""
    try:
        import openvino_tokenizers  # optional engine: loaded on use
    except ImportError:
        return "openvino-tokenizers not installed"
    try:
        enc, dec = openvino_tokenizers.convert_tokenizer(tokenizer, with_detokenizer=True)
    except Exception as e:  # noqa: BLE001 - the loop backend needs no tokenizer IR
        log.warning("openvino engine: tokenizer not converted (%s); backend 'loop' only", e)
        return f"not converted: {e}"
    _ov().save_model(enc, str(folder / "openvino_tokenizer.xml"))
    _ov().save_model(dec, str(folder / "openvino_detokenizer.xml"))
    return "converted"


def _ov():
    try:
        import openvino as ov  # optional engine: loaded on use
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError(INSTALL_HINT) from e
    return ov


# ----------------------------------------------------------------------------- conversion
def _dims(config) -> tuple[int, int, int]:
    """Layers, key/value heads, head size."""
    heads = config.num_attention_heads
    kvh = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kvh, hd


def architecture_key(model: nn.Module, tokenizer=None) -> str:
    """Hash of what the IR's graph depends on: the architecture class and config, and the
    versions of the tools that build it."""
    import transformers  # heavy (seconds to import): loaded on first use

    ov = _ov()
    base = base_model(model)
    cfg = base.config.to_dict()
    for k in ("torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        cfg.pop(k, None)
    blob = json.dumps({"class": type(base).__name__, "config": cfg, "openvino": ov.__version__,
                       "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
                       "converter": CONVERTER_VERSION, "tokenizer": _tokenizer_json(tokenizer)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _tokenizer_json(tokenizer) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return hashlib.sha256(backend.to_str().encode()).hexdigest() if backend is not None else None


def _as_f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def weights_digest(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Hash of the weights as the IR holds them (float32)."""
    h = hashlib.blake2b(digest_size=10)
    for k in sorted(state_dict):
        a = _as_f32(state_dict[k])
        h.update(f"{k}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class _Wrapper(nn.Module):
    """``(input_ids, attention_mask, position_ids, *past) -> (logits of every position, *present)``."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache  # heavy (seconds to import): loaded on first use

        cache = DynamicCache(config=self.m.config)
        for i, layer in enumerate(cache.layers):
            layer.lazy_initialization(past[2 * i], past[2 * i + 1])
            layer.keys, layer.values = past[2 * i], past[2 * i + 1]
        out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=cache, use_cache=True)
        flat = []
        for layer in out.past_key_values.layers:
            flat += [layer.keys, layer.values]
        return (out.logits,) + tuple(flat)


def _tracing_copy(model: nn.Module) -> nn.Module:
    """A float32 copy of the architecture (sdpa attention) with every parameter set to a
    non-trivial value (no zeros, no ones), so conversion folds no weight away."""
    base = base_model(model)
    config = copy.deepcopy(base.config)
    try:
        config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - keep the model's own attention
        pass
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        fresh = type(base)(config).float().eval()
        with torch.no_grad():
            for p in fresh.parameters():
                p.uniform_(0.02, 0.07)
    return fresh


def convert(model: nn.Module):
    """The stateful IR of ``model``'s architecture (tracing weights, see :func:`_tracing_copy`)."""
    ov = _ov()
    from openvino import opset13 as op  # optional engine: loaded on use
    from openvino._offline_transformations import apply_make_stateful_transformation  # optional engine: loaded on use

    fresh = _tracing_copy(model)
    n_layers, kvh, hd = _dims(fresh.config)
    b, n, past = 2, 3, 4
    mask = torch.ones(b, past + n, dtype=torch.long)
    mask[0, :2] = 0  # a padded row: the traced mask code must take padding into account
    example = [torch.randint(0, fresh.config.vocab_size, (b, n)), mask,
               (mask.cumsum(-1) - 1).clamp_min(0)[:, past:]]
    example += [torch.randn(b, kvh, past, hd) for _ in range(2 * n_layers)]
    kv_in = [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    kv_out = [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)  # the mask code's branches;
        # the trace is checked against transformers token for token in tests/test_engine_openvino.py
        ovm = ov.convert_model(_Wrapper(fresh), example_input=tuple(example))
    for port, name in zip(ovm.inputs, ["input_ids", "attention_mask", "position_ids"] + kv_in):
        port.get_tensor().set_names({name})
        port.get_node().set_partial_shape(ov.PartialShape([-1, kvh, -1, hd] if name in kv_in else [-1, -1]))
    for port, name in zip(ovm.outputs, ["logits"] + kv_out):
        port.get_tensor().set_names({name})
    ovm.validate_nodes_and_infer_types()
    # beam_idx: every step first gathers the cache rows it names (dropping finished rows)
    beam = op.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam.output(0).get_tensor().set_names({"beam_idx"})
    ovm.add_parameters([beam])
    for name in kv_in:
        port = ovm.input(name)
        users = list(port.get_target_inputs())
        picked = op.gather(port, beam, op.constant(np.int64(0)))
        for u in users:
            u.replace_source_output(picked.output(0))
    ovm.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(ovm, dict(zip(kv_in, kv_out)))
    # the state starts empty: [batch of input_ids, heads, 0, head size]
    batch = op.gather(op.shape_of(ovm.input("input_ids"), output_type="i64"), op.constant(np.array([0])),
                      op.constant(np.int64(0)))
    rest = op.constant(np.array([kvh, 0, hd], dtype=np.int64))
    for node in ovm.get_ops():
        if node.get_type_name() == "ReadValue":
            zero = op.constant(np.zeros((), dtype=np.float32))
            node.set_arguments([op.broadcast(zero, op.concat([batch, rest], 0))])
    _name_weights(ovm, fresh)
    return ovm, fresh


def lm_head_matmul(ovm):
    """The MatMul whose output is the ``logits`` Result (a clear error if the graph's
    output is anything else: GenAI would then compute logits for every token)."""
    node = ovm.output("logits").get_node().input_value(0).get_node()
    if node.get_type_name() != "MatMul":
        raise RuntimeError(f"openvino engine: the logits come from a {node.get_type_name()}, not the lm_head MatMul; "
                           "delete the IR cache folder (cache_dir()/openvino) to reconvert")
    return node


def slice_last_logits(ovm) -> None:
    """Compute logits for the last position only: a slice ``[:, -1:]`` of the hidden
    states before the lm_head (our decode loop reads only that row)."""
    from openvino import opset13 as op  # optional engine: loaded on use

    mm = lm_head_matmul(ovm)
    hidden = mm.input_value(0)
    last = op.slice(hidden, op.constant(np.array([-1], dtype=np.int64)),
                    op.constant(np.array([np.iinfo(np.int64).max], dtype=np.int64)),
                    op.constant(np.array([1], dtype=np.int64)), op.constant(np.array([1], dtype=np.int64)))
    mm.input(0).replace_source_output(last.output(0))
    ovm.validate_nodes_and_infer_types()


def _name_weights(ovm, fresh: nn.Module) -> None:
    """Name the constants holding each parameter ``<_WEIGHT><key>`` (``#i`` for further
    copies), found by content: conversion may reshape a constant ([n] -> [1, 1, n]) and
    drop its name, and the tracing values are distinct random numbers."""
    by_bytes: dict[bytes, list] = {}
    for node in ovm.get_ops():
        if node.get_type_name() == "Constant" and node.get_output_element_type(0) == _ov().Type.f32:
            data = node.get_data()
            if data.size > 1:
                by_bytes.setdefault(hashlib.sha1(np.ascontiguousarray(data).tobytes()).digest(), []).append(node)
    seen: set[int] = set()
    for key, t in fresh.state_dict().items():
        if t.data_ptr() in seen:  # tied to a key already named
            continue
        seen.add(t.data_ptr())
        nodes = by_bytes.get(hashlib.sha1(_as_f32(t).tobytes()).digest(), [])
        if not nodes:
            raise RuntimeError(f"openvino engine: parameter {key!r} has no constant in the converted model "
                               "(folded or transformed by conversion)")
        for i, node in enumerate(nodes):
            node.set_friendly_name(_WEIGHT + key + (f"#{i}" if i else ""))


def weight_constants(ovm, template: nn.Module) -> dict[str, list]:
    """State-dict key -> the IR's constants holding it (tied keys share one list)."""
    named: dict[str, list] = {}
    for node in ovm.get_ops():
        name = node.get_friendly_name()
        if node.get_type_name() == "Constant" and name.startswith(_WEIGHT):
            named.setdefault(name[len(_WEIGHT):].split("#")[0], []).append(node)
    out: dict[str, list] = {}
    by_ptr: dict[int, list] = {}
    sd = template.state_dict()
    for k, t in sd.items():
        if k in named:
            by_ptr[t.data_ptr()] = out[k] = named[k]
    for k, t in sd.items():
        if k not in out:
            if t.data_ptr() not in by_ptr:
                raise RuntimeError(f"openvino engine: no weight constant for {k!r} in the converted model")
            out[k] = by_ptr[t.data_ptr()]
        for node in out[k]:
            if int(np.prod(list(node.get_output_shape(0)))) != t.numel():
                raise RuntimeError(f"openvino engine: constant for {k!r} has shape {list(node.get_output_shape(0))}; "
                                   f"expected {list(t.shape)}")
    return out


# ----------------------------------------------------------------------------- worker process
DEADLINE_ENV = "SPRPO_ENGINE_DEADLINE_S"  # seconds a generate call may take (default: automatic)
DEADLINE_FIRST_S = 300.0  # a call's deadline before any call of the engine has finished
DEADLINE_FLOOR_S = 60.0  # the automatic deadline never goes below this
DEADLINE_SLACK = 10.0  # automatic deadline: this many times the slowest seconds per token seen
BUILD_DEADLINE_S = 300.0  # building a pipeline of an architecture not built before in this process
_SLOWEST_BUILD: dict[str, float] = {}  # IR folder -> slowest pipeline build seen in this process (seconds)
WORKER = Path(__file__).with_name("ov_worker.py")


class WorkerLost(RuntimeError):
    """A worker request past its deadline, or a worker that died."""


class PipelineWorker:
    """A process serving one GenAI pipeline (:mod:`sprpo_lib.agent.engines.ov_worker`): requests with a
    deadline, killed when one passes it.  The process runs the worker as a script (no
    package import, no torch) and talks JSON over a socket pair."""

    def __init__(self, env: Mapping[str, str] | None = None):
        ours, theirs = socket.socketpair()
        # -P: the script's folder (this package) must not shadow modules on the worker's path
        flags = ["-P"] if sys.version_info >= (3, 11) else []
        try:
            self.proc = subprocess.Popen([sys.executable, *flags, str(WORKER), str(theirs.fileno()), str(os.getpid())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         env={**os.environ, **env} if env else None)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.cpu_s = 0.0

    def request(self, msg: dict, deadline: float) -> dict:
        """The worker's reply to ``msg``; :class:`WorkerLost` when none comes within
        ``deadline`` seconds or the process has died."""
        try:
            self.conn.send_bytes(json.dumps(msg).encode())
            data = self.conn.recv_bytes() if self.conn.poll(deadline) else None
        except (EOFError, OSError) as e:
            self.proc.poll()
            raise WorkerLost(f"the worker process died during a {msg['op']} call (exit code {self.proc.returncode}: "
                             f"{type(e).__name__})") from None
        if data is None:
            raise WorkerLost(f"{msg['op']} call got no reply within its deadline of {deadline:.0f} s")
        return json.loads(data)

    def cpu_delta(self, reply: dict) -> float:
        """CPU seconds the worker spent since its previous reply."""
        d = float(reply.get("cpu_s", self.cpu_s)) - self.cpu_s
        self.cpu_s += d
        return d

    def kill(self, show_stack: bool = False) -> None:
        """End the process (``show_stack``: first have it print its threads' Python stacks)."""
        if show_stack and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        try:
            self.conn.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Resources:
    """What an engine holds outside Python's memory: its worker process and the scratch IR
    folder of reloaded weights (released by :meth:`close`, also at garbage collection)."""

    def __init__(self):
        self.worker: PipelineWorker | None = None
        self.scratch: Path | None = None

    def stop_worker(self, show_stack: bool = False) -> None:
        if self.worker is not None:
            self.worker.kill(show_stack)
            self.worker = None

    def set_scratch(self, path: Path | None) -> None:
        if self.scratch is not None and self.scratch != path:
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch = path

    def close(self) -> None:
        self.stop_worker()
        self.set_scratch(None)


# ----------------------------------------------------------------------------- cached IRs
_WHOLE: set[tuple] = set()  # (file, size, mtime, inode) verified in this process


def ir_is_whole(folder: Path) -> bool:
    """Whether a cached IR folder holds every file its ``meta.json`` records, each of the
    recorded size and SHA-256 (checked once per process and file version).  A truncated,
    overwritten or half-deleted folder, or one written before the records existed, is
    removed with a warning, so that it is converted again and never read as a model."""
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return False
    try:
        files = read_json(meta_path, lambda m: None if isinstance(m.get("files"), dict) and
                          "openvino_model.bin" in m["files"] else "no record of its files")["files"]
        for name, record in files.items():
            st = (folder / name).stat()
            stamp = (str(folder / name), st.st_size, st.st_mtime_ns, st.st_ino)
            if stamp not in _WHOLE:
                verify_file(folder / name, record)
                _WHOLE.add(stamp)
    except CorruptFileError as err:
        log.warning("openvino engine: cached IR %s is not whole (%s): converting again", folder, err)
        shutil.rmtree(folder, ignore_errors=True)
        return False
    except OSError:  # a file missing, or the folder being replaced by another process: not usable now
        return False
    return True


# ----------------------------------------------------------------------------- engine
class OpenVINOEngine(HFEngine):
    """Generation on an OpenVINO CPU graph in float32 or bfloat16 (``precision``, default the
    policy's dtype): GenAI's continuous batching
    (``backend="genai"``, default when installed) or HFEngine's decode loop (``"loop"``).

    ``policy``'s weights (LoRA merged by :func:`~sprpo_lib.agent.engines.bake_weights`) are put into
    the cached IR of its architecture at construction; :meth:`load_weights` swaps in new ones.
    ``stats`` adds ``converted`` (this engine traced the model), ``convert_s``, ``load_s`` (read +
    weights + compile at construction), ``reload_s`` (the last :meth:`load_weights`) and
    ``ir`` (the cache folder), ``backend``.

    At construction it takes what ``policy.model`` computes then: merged LoRA and the
    factor of any attached ``FFNChannels`` hooks (:func:`~sprpo_lib.agent.engines.effective_weights`),
    so an engine built inside ``perturbation(model, "gaussian", ...)`` serves the perturbed
    policy.  Later changes of the model reach it only through :meth:`load_weights`
    (``own_weights``: the trainer refreshes it every iteration)."""

    own_weights = True
    def __init__(self, policy, cfg=None, agent=None, prefill_tokens: int = 2048, threads: int | None = None,
                 backend: str | None = None, precision: str | None = None, deadline_s: float | None = None,
                 attempts: int = 3):
        super().__init__(policy, cfg, agent, prefill_tokens)
        ov = _ov()
        if backend not in (None, "genai", "loop"):
            raise ValueError(f"backend must be 'genai' or 'loop', got {backend!r}")
        t0 = time.perf_counter()
        self.core = ov.Core()
        self.cpu_class = cpu_class()
        plugin_bf16 = "BF16" in self.core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        # the policy's dtype (dtype "auto" measured which is faster here) where the plugin can run it
        policy_dtype = str(next(policy.model.parameters()).dtype).replace("torch.", "")
        precision_arg = precision
        precision, notice = serving_precision(policy_dtype, self.cpu_class, precision, plugin_bf16)
        if notice:
            log.warning(notice)
        self.compute_dtype = precision  # arithmetic and KV cache; weights are stored as float32 in the IR
        self.threads = threads or torch.get_num_threads()
        if attempts < 1:
            raise ValueError(f"OpenVINOEngine attempts must be >= 1, got {attempts}")
        if deadline_s is None and os.environ.get(DEADLINE_ENV):
            try:
                deadline_s = float(os.environ[DEADLINE_ENV])
            except ValueError:
                raise ValueError(f"{DEADLINE_ENV}={os.environ[DEADLINE_ENV]!r}: expected seconds, e.g. 600") from None
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"OpenVINOEngine deadline_s must be > 0 seconds, got {deadline_s}")
        self.deadline_s, self.attempts = deadline_s, attempts
        self._s_per_token: float | None = None  # slowest seconds per token of a finished call (auto deadline)
        self._stalls: list[float] = []  # fault injection (stall_next)
        self._res = _Resources()  # worker process and scratch IR folder, released with the engine
        self._closed = False
        self._finalizer = weakref.finalize(self, self._res.close)
        self.stats.update({"converted": False, "convert_s": 0.0, "retries": 0, "worker_starts": 0,
                           "worker_cpu_s": 0.0})
        base = base_model(policy.model)
        self._n_layers, self._kvh, self._hd = _dims(base.config)
        self._template = None  # architecture copy naming the state-dict keys
        weights = effective_weights(policy.model)  # LoRA merged, attached FFN hooks folded in
        self._ovm, self.ir, self._on_disk = self._open(policy.model, weights)
        has_tokenizer = (self.ir / "openvino_detokenizer.xml").is_file()
        if backend is None:
            backend = "genai" if has_tokenizer and _genai() is not None else "loop"
        elif backend == "genai" and (not has_tokenizer or _genai() is None):
            raise RuntimeError("backend 'genai' needs openvino-genai and a tokenizer that openvino-tokenizers converts "
                               f"(pip install openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0); "
                               f"tokenizer IR present: {has_tokenizer}")
        self.backend = backend
        forced = precision_arg
        precision, self._worker_env, notice = one_thread_amx(precision, self.cpu_class, self.threads, backend, forced)
        if notice:
            log.warning(notice)
        self.compute_dtype = precision
        if backend == "loop":  # our loop reads the last position's logits only (genai gathers its own rows)
            slice_last_logits(self._ovm)
        self._build()
        self.stats["load_s"] = round(time.perf_counter() - t0, 2)
        self.stats.update({"ir": str(self.ir), "backend": backend, "precision": precision, "cpu_class": self.cpu_class})

    # ------------------------------------------------------------- IR and weights
    def _open(self, model: nn.Module, weights: Mapping[str, torch.Tensor]):
        root = cache_dir() / "openvino"
        arch = architecture_key(model, self.policy.tokenizer)
        target = root / f"{arch}-{weights_digest(weights)}"
        self._template = _tracing_copy(model)
        if ir_is_whole(target):
            ovm = self.core.read_model(str(target / "openvino_model.xml"))
            self._consts = weight_constants(ovm, self._template)
            return ovm, target, True
        others = [p.parent for p in sorted(root.glob(f"{arch}-*/openvino_model.xml"))] if root.is_dir() else []
        others = [o for o in others if o != target and ir_is_whole(o)]
        if others:  # same architecture, other weights: reuse the graph, put these weights in
            ovm = self.core.read_model(str(others[0] / "openvino_model.xml"))
            self._consts = weight_constants(ovm, self._template)
            self._set_weights(ovm, weights)
            return ovm, others[0], False
        t0 = time.perf_counter()
        ovm, _ = convert(model)
        self._consts = weight_constants(ovm, self._template)
        self._set_weights(ovm, weights)
        self.stats.update({"converted": True, "convert_s": round(time.perf_counter() - t0, 2)})
        ov = _ov()
        with atomic_dir(target) as tmp:
            ov.save_model(ovm, str(Path(tmp) / "openvino_model.xml"), compress_to_fp16=False)
            meta = {"architecture": arch, "class": type(base_model(model)).__name__, "openvino": ov.__version__,
                    "converter": CONVERTER_VERSION, "convert_s": self.stats["convert_s"],
                    "tokenizer": _save_tokenizer(self.policy.tokenizer, Path(tmp))}
            # what a reader checks the folder against (ir_is_whole): size and SHA-256 of every file
            meta["files"] = {f.name: file_record(f) for f in sorted(Path(tmp).iterdir())}
            atomic_write_json(Path(tmp) / "meta.json", meta)
        ovm = self.core.read_model(str(target / "openvino_model.xml"))  # weights memory-mapped from the cache
        self._consts = weight_constants(ovm, self._template)
        return ovm, target, True

    def _set_weights(self, ovm, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace every weight constant by a float32 copy of the given tensor; every
        parameter must be given (tied weights under either name), no other key."""
        from openvino import opset13 as op  # optional engine: loaded on use

        sd = dict(state_dict)
        unexpected = [k for k in sd if k not in self._consts]
        if unexpected:
            raise KeyError(f"weights do not fit the model: unexpected {unexpected[:5]}")
        groups: dict[int, list[str]] = {}
        for k, nodes in self._consts.items():
            groups.setdefault(id(nodes), []).append(k)
        fresh: dict[str, list] = {}
        for keys in groups.values():
            given = [k for k in keys if k in sd]
            if not given:
                raise KeyError(f"weights do not fit the model: missing {keys[0]!r}")
            for k in given[1:]:
                if not torch.equal(sd[k], sd[given[0]]):
                    raise ValueError(f"tied weights {given[0]!r} and {k!r} differ")
            arr = _as_f32(sd[given[0]])
            shape = tuple(self._template.state_dict()[given[0]].shape)
            if arr.shape != shape:
                raise ValueError(f"weight {given[0]!r} has shape {list(arr.shape)}; expected {list(shape)}")
            new = []
            for old in self._consts[keys[0]]:
                # a copy (the caller may change its tensors later), in the constant's own shape
                c = op.constant(arr.reshape(tuple(old.get_output_shape(0))).copy())
                c.set_friendly_name(old.get_friendly_name())
                old.output(0).replace(c.output(0))
                new.append(c)
            for k in keys:
                fresh[k] = new
        self._consts = fresh

    def _build(self) -> None:
        """Compile the graph (``loop``) or build a GenAI continuous-batching pipeline on it in
        the worker process (``genai``; from the cache folder when it holds these weights, else
        from a scratch copy of the IR with them)."""
        props = dict(CPU_PROPERTIES, **PRECISIONS[self.compute_dtype], INFERENCE_NUM_THREADS=str(self.threads))
        if self.backend == "loop":
            self._compiled = self.core.compile_model(self._ovm, "CPU", props)
            self._request = self._compiled.create_infer_request()
            return
        # KV blocks of prompt prefixes computed in earlier calls are reused (GenerationConfig.prefix_caching);
        # a weight reload starts a new pipeline, so no block computed with other weights survives it
        self.scheduler = {"enable_prefix_caching": bool(self.cfg.prefix_caching), "cache_size": max(1, int(self.cache_gb)),
                          # prefill chunk (GenAI's CPU default: 256)
                          "max_num_batched_tokens": int(self.cfg.max_batched_tokens)}
        props = {k: props[k] for k in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE",
                                       "INFERENCE_NUM_THREADS")}
        path = self.ir
        if not self._on_disk:  # weights not in the cache: a scratch copy of the IR, kept while they are served
            path = Path(tempfile.mkdtemp(prefix="sprpo-ov-"))
            try:
                _ov().save_model(self._ovm, str(path / "openvino_model.xml"), compress_to_fp16=False)
                for f in self.ir.glob("openvino_*tokenizer.*"):
                    shutil.copy(f, path)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
        self._pipeline = {"op": "build", "path": str(path), "tokenizer": str(self.ir), "scheduler": self.scheduler,
                          "properties": props}
        self._built = False  # the worker (one per engine, kept across reloads) builds this pipeline next
        self._res.set_scratch(None if path == self.ir else path)
        self._call(None, 0)  # build now: errors (and load time) belong to construction / load_weights

    cache_gb = 2  # GenAI's KV-cache pool (GB); SmolLM2's 16 x ~800-token batch needs ~0.6

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Decode with these plain weights (:func:`~sprpo_lib.agent.engines.bake_weights`) from now
        on: the IR's weight constants are replaced and the graph recompiled (``genai``: a new
        pipeline in the same worker, on a scratch copy of the IR)."""
        t0 = time.perf_counter()
        self._set_weights(self._ovm, state_dict)
        self._on_disk = False
        self._build()
        self.stats["reload_s"] = round(time.perf_counter() - t0, 2)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> list[Generation]:
        if self.backend == "loop":
            return super().__call__(prompts)
        tok, cfg = self.policy.tokenizer, self.cfg
        texts = [chat_text(tok, p, self.agent) for p in prompts]
        ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        seed = call_seed(cfg, self.calls)
        self.calls += 1
        penalty = check_generation_config(self.policy.model, cfg.temperature > 0)
        stops = eos_ids(self.policy.model, tok) | ({tok.pad_token_id} if tok.pad_token_id is not None else set())
        configs = []
        for i in range(len(ids)):
            g = {"max_new_tokens": cfg.max_new_tokens, "eos_token_id": tok.eos_token_id, "stop_token_ids": sorted(stops),
                 "repetition_penalty": penalty, "do_sample": cfg.temperature > 0}
            if cfg.stop:
                g.update(stop_strings=[cfg.stop], include_stop_str_in_output=True)
            if g["do_sample"]:  # one stream per prompt of the call
                g.update(temperature=cfg.temperature, top_p=cfg.top_p, rng_seed=(seed * 1_000_003 + i) % (2**63))
            configs.append(g)
        self.stats["prefill_tokens"] += sum(len(p) for p in ids)
        if not ids:
            return []
        msg = {"op": "generate", "ids": [list(map(int, p)) for p in ids], "configs": configs}
        reply = self._call(msg, sum(len(p) for p in ids) + len(ids) * cfg.max_new_tokens)
        out = []
        for p_ids, gen_ids in zip(ids, reply["ids"]):
            r_ids = cut_response(gen_ids, tok.eos_token_id, tok.pad_token_id)
            out.append(Generation(tok.decode(r_ids, skip_special_tokens=True), list(p_ids), r_ids))
        return out

    # ------------------------------------------------------------- worker process (genai)
    def stall_next(self, seconds: float, calls: int = 1) -> None:
        """Fault injection: the next ``calls`` generate attempts sleep ``seconds`` in the
        worker before decoding, as a hung native call would (tests and ``bench churn``
        use it to show the deadline at work)."""
        self._stalls += [float(seconds)] * int(calls)

    def call_deadline(self, tokens: int) -> float:
        """Seconds a generate call of ``tokens`` (prompt + at most new) may take at its first
        attempt (each repeat doubles it): ``deadline_s`` when given, else ``DEADLINE_SLACK`` x
        the slowest seconds per token (prompt + generated) of a finished call, at least
        ``DEADLINE_FLOOR_S``; ``DEADLINE_FIRST_S`` before any call has finished."""
        if self.deadline_s is not None:
            return self.deadline_s
        if self._s_per_token is None:
            return DEADLINE_FIRST_S
        return max(DEADLINE_FLOOR_S, DEADLINE_SLACK * self._s_per_token * tokens)

    def build_deadline(self) -> float:
        """Seconds building the pipeline may take: ``DEADLINE_SLACK`` x the slowest build of
        this IR in this process (at least ``DEADLINE_FLOOR_S`` and ``deadline_s``), or
        ``BUILD_DEADLINE_S`` for the first."""
        seen = _SLOWEST_BUILD.get(str(self.ir))
        if seen is None:
            return max(BUILD_DEADLINE_S, self.deadline_s or 0.0)
        return max(DEADLINE_FLOOR_S, self.deadline_s or 0.0, DEADLINE_SLACK * seen)

    def _call(self, msg: dict | None, tokens: int) -> dict:
        """Send ``msg`` to a worker holding the current pipeline (``None``: just make sure one
        does), each attempt with a deadline.  A stalled or dead worker is killed, a new one
        builds the pipeline again and the message (same ids, same seeds) is sent again; after
        ``attempts`` failures, one error naming the way out."""
        if self._closed:
            raise RuntimeError("openvino engine: used after close(); build a new engine")
        limit = 0.0
        for attempt in range(1, self.attempts + 1):
            scale = 2.0 ** (attempt - 1)  # each attempt waits twice as long: a slow call is not a hang
            try:
                w = self._res.worker
                if w is None:
                    w = self._res.worker = PipelineWorker(self._worker_env)
                    self.stats["worker_starts"] += 1
                    self._built = False
                if not self._built:
                    limit = scale * self.build_deadline()
                    self.stats["build_s"] = self._reply(w, self._pipeline, limit)["load_s"]
                    key = str(self.ir)
                    _SLOWEST_BUILD[key] = max(_SLOWEST_BUILD.get(key, 0.0), self.stats["build_s"])
                    self._built = True
                if msg is None:
                    return {}
                sent = dict(msg, stall_s=self._stalls.pop(0)) if self._stalls else msg
                limit = scale * self.call_deadline(tokens)
                t0 = time.perf_counter()
                reply = self._reply(w, sent, limit)
                if len(reply["ids"]) != len(msg["ids"]):
                    self._res.stop_worker()
                    raise RuntimeError(f"openvino engine: the worker answered {len(reply['ids'])} generations for "
                                       f"{len(msg['ids'])} prompts")
                # the rate against the tokens actually handled: the deadline's count is an upper bound
                done = sum(len(p) for p in msg["ids"]) + sum(len(r) for r in reply["ids"])
                self._s_per_token = max(self._s_per_token or 0.0, (time.perf_counter() - t0) / max(1, done))
                return reply
            except WorkerLost as e:
                self.stats["retries"] += 1
                self._res.stop_worker(show_stack=True)  # where it hung, on stderr
                log.warning("openvino engine: %s (attempt %d of %d): the pipeline is rebuilt and the call repeated",
                            e, attempt, self.attempts)
            except RuntimeError:  # the worker answered with an error: still in step with us
                raise
            except BaseException:  # interrupted while a reply may be on its way: this worker is out of step
                self._res.stop_worker()
                raise
        raise RuntimeError(f"openvino engine: the GenAI pipeline stalled or died in {self.attempts} attempts in a row "
                           f"(the last waited {limit:.0f} s; see the warnings above). Decode with "
                           "transformers instead: rollout.engine=hf (training) or --engine hf (evaluation); or raise "
                           f"the deadline with {DEADLINE_ENV}=<seconds>")

    def _reply(self, w: "PipelineWorker", msg: dict, deadline: float) -> dict:
        reply = w.request(msg, deadline)
        self.stats["worker_cpu_s"] = round(self.stats["worker_cpu_s"] + w.cpu_delta(reply), 3)
        if not reply["ok"]:
            raise RuntimeError(f"openvino engine ({msg['op']} in the GenAI worker): {reply['kind']}: {reply['error']}")
        return reply

    @property
    def worker_pid(self) -> int | None:
        """The process id of the worker serving the pipeline (None: none running)."""
        w = self._res.worker
        return w.proc.pid if w is not None else None

    @property
    def compiled_model(self):
        """The compiled graph of the ``loop`` backend (its properties say what the plugin
        runs); None for ``genai``, whose pipeline lives in the worker process."""
        return getattr(self, "_compiled", None)

    @property
    def scratch_dir(self) -> Path | None:
        """The scratch IR folder of weights given to :meth:`load_weights` (None: the cache's)."""
        return self._res.scratch

    def close(self) -> None:
        """Stop the worker process and remove the scratch IR (also done when the engine is
        garbage collected); the engine cannot be used afterwards."""
        self._closed = True
        self._finalizer()

    # ------------------------------------------------------------- decoding
    def _infer(self, ids: np.ndarray, att: np.ndarray, pos: np.ndarray, beam: np.ndarray) -> torch.Tensor:
        self.stats["forwards"] += 1
        req = self._request
        req.infer({"input_ids": ids, "attention_mask": att, "position_ids": pos, "beam_idx": beam},
                  share_inputs=True)
        return torch.from_numpy(req.get_tensor("logits").data[:, -1].copy())

    def _prefill(self, model, prompts: list[list[int]]):
        """Prefill rows (sorted by decreasing length) in groups of at most ``prefill_tokens``
        padded tokens; several groups' states are joined, left-padded to the batch width."""
        ov = _ov()
        pad = self.policy.tokenizer.pad_token_id
        width = len(prompts[0])
        groups = prefill_groups(prompts, self.prefill_tokens)
        logits, states = [], None
        att = np.zeros((len(prompts), width), dtype=np.int64)
        r = 0
        for group in groups:
            w = len(group[0])
            ids = np.full((len(group), w), pad, dtype=np.int64)
            a = np.zeros((len(group), w), dtype=np.int64)
            for j, p in enumerate(group):
                ids[j, w - len(p):] = p
                a[j, w - len(p):] = 1
            pos = np.maximum(a.cumsum(-1) - 1, 0)
            self.stats["prefill_tokens"] += ids.size
            self._request.reset_state()
            logits.append(self._infer(ids, a, pos, np.arange(len(group), dtype=np.int32)))
            att[r : r + len(group), width - w:] = a
            if len(groups) > 1:
                if states is None:
                    states = {s.name: np.zeros((len(prompts), self._kvh, width, self._hd), dtype=np.float32)
                              for s in self._request.query_state()}
                for s in self._request.query_state():
                    states[s.name][r : r + len(group), :, width - w:] = s.state.data
            r += len(group)
        if states is not None:
            for s in self._request.query_state():
                s.state = ov.Tensor(states[s.name])
        next_pos = np.array([len(p) for p in prompts], dtype=np.int64)
        return torch.cat(logits), att, next_pos

    def _generate(self, model, prompts: list[list[int]], tails: list[str], gen, penalty: float,
                  eos: set[int]) -> list[list[int]]:
        """Decode one batch (rows sorted by decreasing length); raw new tokens per row."""
        cfg, pad = self.cfg, self.policy.tokenizer.pad_token_id
        stop = cfg.stop
        logits, att, pos = self._prefill(model, prompts)
        alive = list(range(len(prompts)))
        new: list[list[int]] = [[] for _ in prompts]
        seen = None
        if penalty != 1.0:  # generate() penalises every id in the sequence so far
            seen = torch.tensor([[p[0]] * (att.shape[1] - len(p)) + p for p in prompts])
        for step in range(cfg.max_new_tokens):
            nxt = select_tokens(logits, seen, penalty, cfg, gen)
            keep = accept_tokens(nxt.tolist(), alive, new, tails, self._piece, eos, pad, stop)
            if not keep or step + 1 == cfg.max_new_tokens:
                break
            beam = np.asarray(keep, dtype=np.int32)
            if len(keep) < len(alive):  # drop finished rows (the model gathers their cache rows)
                att, pos, nxt = att[beam], pos[beam], nxt[torch.from_numpy(beam).long()]
                seen = seen[torch.from_numpy(beam).long()] if seen is not None else None
                alive = [alive[j] for j in keep]
            att = np.concatenate([att, np.ones((len(alive), 1), dtype=np.int64)], axis=1)
            if seen is not None:
                seen = torch.cat([seen, nxt[:, None]], dim=1)
            self.stats["decode_rows"] += len(alive)
            logits = self._infer(nxt.numpy().astype(np.int64)[:, None], att, pos[:, None], beam)
            pos = pos + 1
        return new
