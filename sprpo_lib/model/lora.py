"""LoRA adapters with peft (App. B "Base model and optimization": all attention and FFN
projections, rank/alpha 64/64), on every layer or only the last ones; the adapted linear as
one fused function for the training passes (``speed.fused_lora``); and their files: saved
atomically (safetensors), checked whole before loading, merged for deployment."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from annotated_types import Ge, Gt, Interval
from torch import nn
from torch.autograd.function import once_differentiable

from sprpo_lib.infra.io import CorruptFileError, atomic_dir, read_json, read_safetensors
from sprpo_lib.infra.ranges import check_ranges
from sprpo_lib.model.layers import decoder_layers
from sprpo_lib.model.load import Policy

log = logging.getLogger(__name__)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSettings:
    """LoRA adapters on all attention and FFN projections (App. B, Table 3: 64/64)."""

    rank: Annotated[int, Ge(1)] = 64
    alpha: Annotated[float, Gt(0)] = 64.0
    dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        check_ranges(self)


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


def adapter_nbytes(model) -> int:
    """About the bytes of a saved adapter: its trainable tensors (what a full disk's message says is needed)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


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
    from peft import LoraConfig, get_peft_model  # heavy: loaded on first use

    s = settings or LoraSettings()
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


# ----------------------------------------------------------------------------- fused adapted linear
class LoraLinear(torch.autograd.Function):
    """``y = x W^T + b + s (x A^T) B^T``, the adapted linear peft computes as four ops (the base
    linear, ``lora_A``, ``lora_B``, ``* s``) and an add, here as two matmuls into one output.

    peft's form writes and reads the output-sized tensors three more times per call (the
    scaled adapter output, the sum, and in the backward the gradient times ``s``) and adds
    the two input gradients in a separate pass; on a CPU at SmolLM2's width those
    elementwise passes over ``[tokens, 1536]`` cost about as much as the adapter's own
    matmuls.  Here the adapter accumulates into the base output (``addmm_``) and its input
    gradient into the base's.  The arithmetic runs in ``x``'s dtype, where peft runs the
    adapter in its weights' dtype: in a bfloat16 model with float32 adapters the adapter's
    matmuls here round at bfloat16's resolution, as the base output does (the parameters,
    their gradients and the optimizer stay float32), and the logits and LoRA gradients are as
    close to the float32 model's as peft's; in float32 the same function up to float
    rounding.  First-order only (no double backward: ``once_differentiable`` says so if one
    is asked)."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scaling: float):
        shape, dt = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        a_, b_ = a.to(dt), b.to(dt)
        h = x2 @ a_.t()  # [tokens, r]
        y = x2 @ weight.t() if bias is None else torch.addmm(bias, x2, weight.t())
        y.addmm_(h, b_.t(), alpha=scaling)
        ctx.save_for_backward(x2, weight, a_, b_, h)
        ctx.scaling, ctx.shape, ctx.dtypes = scaling, shape, (a.dtype, b.dtype, None if bias is None else bias.dtype)
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x2, weight, a, b, h = ctx.saved_tensors
        s = ctx.scaling
        need_x, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        g = grad.reshape(-1, grad.shape[-1])
        gh = (g @ b).mul_(s) if need_x or need_a else None  # dL/dh, [tokens, r]
        dx = dw = dbias = da = db = None
        if need_x:
            dx = g @ weight
            dx.addmm_(gh, a)
            dx = dx.view(ctx.shape)
        if need_w:
            dw = (g.t() @ x2).to(weight.dtype)
        if need_bias:
            dbias = g.sum(0).to(ctx.dtypes[2])
        if need_a:
            da = (gh.t() @ x2).to(ctx.dtypes[0])
        if need_b:
            db = (g.t() @ h).mul_(s).to(ctx.dtypes[1])
        return dx, dw, dbias, da, db, None


def _plain_adapter(m: nn.Module) -> str | None:
    """The one active adapter of peft LoRA layer ``m`` when :class:`LoraLinear` computes the
    function peft would (one unmerged adapter without dropout, DoRA/variant or bias, on a plain
    ``nn.Linear`` without hooks); ``None`` otherwise (peft's own forward runs)."""
    base = getattr(m, "base_layer", None)
    if (type(base) is not nn.Linear or base._forward_hooks or base._forward_pre_hooks or m.disable_adapters
            or m.merged or getattr(m, "fan_in_fan_out", False) or len(m.active_adapters) != 1):
        return None
    n = m.active_adapters[0]
    if (n not in m.lora_A or n in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(n)
            or not isinstance(m.lora_dropout[n], nn.Identity) or m.lora_B[n].bias is not None):
        return None
    return n


def _fused_forward(m: nn.Module):
    def forward(x, *args, **kwargs):
        n = None if args or kwargs else _plain_adapter(m)
        if n is None or x.dtype != m.base_layer.weight.dtype:
            return type(m).forward(m, x, *args, **kwargs)
        return LoraLinear.apply(x, m.base_layer.weight, m.base_layer.bias, m.lora_A[n].weight, m.lora_B[n].weight,
                                float(m.scaling[n]))

    return forward


@contextmanager
def fused_lora(model: nn.Module, on: bool = True) -> Iterator[int]:
    """Inside the block every peft LoRA ``Linear`` of ``model`` computes as :class:`LoraLinear`
    whenever that is exactly its function (:func:`_plain_adapter`, checked at every call, so
    a block that disables the adapter still gets peft's path); yields how many layers were
    patched.  Instances are patched (their ``forward``; module hooks still fire) and restored
    on exit; a layer patched by an enclosing block is left to it."""
    patched = []
    if on:
        for m in model.modules():
            if hasattr(m, "lora_A") and hasattr(m, "base_layer") and "forward" not in m.__dict__:
                m.forward = _fused_forward(m)
                patched.append(m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


# ----------------------------------------------------------------------------- adapter files


def save_adapter(policy: Policy, path: str | Path) -> Path:
    """Save the peft adapter (safetensors) to ``path``, replacing it atomically."""
    with atomic_dir(path, adapter_nbytes(policy.model)) as tmp:
        save_peft(policy.model, tmp)
    return path


def check_adapter(path: str | Path) -> Path:
    """A whole peft adapter folder (``save_pretrained``, safetensors): ``adapter_config.json``
    a JSON object, every tensor of ``adapter_model.safetensors`` readable (a truncated or
    garbage file is refused).  Raises :class:`~sprpo_lib.infra.io.CorruptFileError` naming
    the bad file, ``FileNotFoundError`` when the folder is missing."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no adapter folder {path}")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / name).is_file():
            raise CorruptFileError(path / name, "missing from the adapter folder")
    read_json(path / "adapter_config.json", lambda c: None if isinstance(c, dict) and c.get("peft_type") else
              "not a peft adapter config (no peft_type)")
    if not read_safetensors(path / "adapter_model.safetensors"):
        raise CorruptFileError(path / "adapter_model.safetensors", "holds no tensor")
    return path


def load_adapter(policy: Policy, path: str | Path, trainable: bool = False, merge: bool = False) -> Policy:
    """Load an adapter saved by :func:`save_adapter` onto ``policy`` (a fresh
    :func:`~sprpo_lib.model.load.load_policy` of the same base model).  ``merge=True`` folds it into
    the base weights (the warm-started model as a new base for RL's own LoRA).  The
    folder is checked first (:func:`check_adapter`): a truncated or garbage file is one
    error naming it and saying how to rebuild it, never loaded."""
    from peft import PeftModel  # heavy: loaded on first use

    if is_peft(policy.model):
        raise ValueError("policy is already peft-wrapped; load the adapter onto a fresh base model")
    if Path(path).is_dir():
        try:
            check_adapter(path)
        except CorruptFileError as err:
            raise err.with_fix(
                f"delete {path} and rerun to rebuild it (a warm start under runs/sft/ is trained again by the next "
                "training run; a run's final/adapter is republished from its last checkpoint by rerunning the same "
                "train command)") from None
    policy.model = PeftModel.from_pretrained(policy.model, str(path), is_trainable=trainable)
    policy.model.eval()
    policy.meta["sft_adapter"] = str(path)
    if merge:
        merge_lora(policy)
    return policy


def adapter_is_whole(path: Path) -> bool:
    """Whether ``path`` is a whole saved adapter (missing or damaged: False, with a warning
    for damage, so that it is written again)."""
    if not path.is_dir():
        return False
    try:
        check_adapter(path)
    except CorruptFileError as err:
        log.warning("%s", err.with_fix("writing it again"))
        return False
    return True
