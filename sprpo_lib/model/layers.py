"""Where a Llama/Qwen2 model keeps its parts: the gated FFN blocks perturbed in Sec. 5, the
decoder layers, five context managers over them (activation checkpointing, running from
one layer up, running below one layer, grouped-query attention without repeated keys and
values, by SDPA or by two matmuls, a 16-bit model's logits in float32), and the LM head's dense
input (:func:`dense_head_input`)."""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

NATIVE_GQA = "sprpo_native_gqa"  # the attention implementation :func:`native_gqa` switches to
ATTENTION_KERNELS = ("auto", "sdpa", "matmul")  # speed.attention
LOGITS = ("float32", "model")  # EvalConfig.logits: float32_logits on, or the model's own dtype


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


@contextmanager
def below_layer(model: nn.Module, stop: int) -> Iterator[nn.Module]:
    """Inside the block, the decoder stack (yielded: the model without its LM head) runs the
    layers below ``stop`` alone and returns their output unnormed: its ``last_hidden_state``
    is layer ``stop``'s input, as :func:`from_layer` takes it back (pass a cache without a
    config).  What the actor uses to keep the states of rows whose top layers a later step
    runs anyway.  Llama/Qwen2 layout."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    layers, norm = inner.layers, inner.norm
    if not 0 < stop <= len(layers):
        raise ValueError(f"stop must be in [1, {len(layers)}], got {stop}")
    inner.layers, inner.norm = nn.ModuleList(list(layers)[:stop]), nn.Identity()
    try:
        yield inner
    finally:
        inner.layers, inner.norm = layers, norm


def native_gqa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except for a masked grouped-query call of several queries
    on a CPU: there SDPA's own ``enable_gqa`` reads each key/value head for its query heads,
    where transformers repeats the keys and values first (its rule keeps the repeat for
    every masked call, since masked GQA falls back to the math kernel on CUDA).  The
    repeat is a copy of K and V per layer and a sum of their gradients in the backward."""
    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu"
            or query.shape[2] == 1 or any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap"))):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # heavy: loaded with a model

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=8)
def full_mask(t: int, tk: int, causal: bool, device: torch.device) -> torch.Tensor:
    """The boolean mask ``[1, 1, t, tk]`` of a call transformers sent without one: every key,
    or causal over the last ``t`` keys.  One object per shape, so that :func:`mask_plan` builds
    its additive form once for all the layers of a pass (a shared prefix's own forward);
    read only."""
    if not causal:
        return torch.ones(1, 1, t, tk, dtype=torch.bool, device=device)
    return torch.ones(t, tk, dtype=torch.bool, device=device).tril(tk - t)[None, None]


QUERY_CHUNK = 160  # matmul_attention: queries per chunk of a causal call (speed.attention_chunk's default)
MAX_CHUNKS = 4  # and at most this many chunks


class MaskPlan(NamedTuple):
    """How :func:`matmul_attention` applies one boolean mask ``[B, 1, T, Tk]``."""

    lead: int
    """Keys every query sees (a shared prefix): their scores take no mask."""
    bias: torch.Tensor
    """The mask over the keys from ``lead`` on as an additive one ``[B, 1, 1, T, Tk - lead]``: 0
    where a query sees the key, the dtype's least value elsewhere."""
    edges: tuple[int, ...]
    """Query chunk bounds ``0 = e_0 < ... < e_n = T``: chunk ``[e_i, e_i+1)`` sees no key from
    ``Tk - T + e_i+1`` on (causal), so its scores stop there."""


def query_chunks(mask: torch.Tensor, t: int, chunk: int) -> tuple[int, ...]:
    """Bounds of ``min(MAX_CHUNKS, t // chunk)`` equal query chunks (``chunk`` 0: one) of boolean mask
    ``[B, 1, T, Tk]`` when each chunk sees no key after its last query's own (a causal call,
    padded or not; checked on the mask), else ``(0, t)``.  A causal product computes about
    half its ``T x T`` own-key scores only to mask them; chunked, the chunks' products skip
    most of them.  A query that sees no key at all (a left-padded row without a prefix) gets the
    mean of its chunk's values instead of all values: no valid query reads it either way."""
    n = min(MAX_CHUNKS, t // chunk) if chunk > 0 else 1
    if n < 2:
        return (0, t)
    edges, tk = tuple(round(t * i / n) for i in range(n + 1)), mask.shape[-1]
    if any(bool(mask[..., s:e, tk - t + e:].any()) for s, e in zip(edges, edges[1:])):
        return (0, t)
    return edges


_PLAN: dict = {}  # mask_plan's one entry: the last boolean mask's key and its plan


def mask_plan(mask: torch.Tensor, t: int, dtype: torch.dtype, chunk: int | None = None) -> MaskPlan:
    """The :class:`MaskPlan` of boolean mask ``[B, 1, T, Tk]``: ``lead = Tk - T`` when every
    query sees every key before its own (a shared prefix), else 0; the additive bias over
    the keys from there; the query chunks (:func:`query_chunks` of ``chunk``, default
    ``QUERY_CHUNK``).  Built once per mask: every layer of a pass gets the same mask object,
    and the one cached entry is reused while that object lives unchanged (its identity and
    version).  An add rather than ``masked_fill_``: cheaper, and its backward is the identity
    (the masked entries' gradient is the softmax's exact 0 either way)."""
    chunk = QUERY_CHUNK if chunk is None else chunk
    key = (mask._version, dtype, t, chunk, MAX_CHUNKS)
    if _PLAN.get("mask", lambda: None)() is mask and _PLAN["key"] == key:
        return _PLAN["value"]
    lead = mask.shape[-1] - t  # keys before the queries' own
    lead = lead if lead > 0 and bool(mask[..., :lead].all()) else 0
    keep = mask[..., lead:]
    bias = torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill_(~keep, torch.finfo(dtype).min)
    _PLAN.update(mask=weakref.ref(mask), key=key, value=MaskPlan(lead, bias[:, :, None], query_chunks(mask, t, chunk)))
    return _PLAN["value"]


def _keys_upto(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[:, :, :n]``, or ``x`` itself when that is all of it (a whole-range slice would add
    a zero-filled copy of its gradient in the backward)."""
    return x if n == x.shape[2] else x[:, :, :n]


def matmul_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, query_chunk: int | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of several queries on a CPU as two batched matmuls and a softmax (transformers'
    eager equation; PyTorch's softmax kernel accumulates a 16-bit row in float32, so its output
    equals transformers' float32 softmax rounded back), grouped-query without repeating K and V: the query
    heads that share a key/value head are stacked as one matrix against it.  A boolean mask
    is applied as its :class:`MaskPlan` says: added over the keys after a shared prefix, and a
    causal call in query chunks that stop at their last query's key (``query_chunk`` queries
    each, default ``QUERY_CHUNK``; 0: one chunk), faster than PyTorch's fused kernel for a
    16-bit model's attention on CPUs.  Other
    calls (one query, dropout, extra arguments) go to :func:`native_gqa_attention`."""
    b, h, t, d = query.shape
    hk, tk = key.shape[1], key.shape[2]
    if (query.device.type != "cpu" or t == 1 or h % hk or dropout
            or any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap"))):
        return native_gqa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    is_causal=is_causal, **kwargs)
    if attention_mask is None:  # transformers skipped the mask of a causal call without padding
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        attention_mask = full_mask(t, tk, bool(causal), query.device)
    g = h // hk  # query head i reads key/value head i // g (transformers' repeat_kv)
    q = (query * (d ** -0.5 if scaling is None else scaling)).reshape(b, hk, g, t, d)
    plan = mask_plan(attention_mask, t, q.dtype, query_chunk) if attention_mask.dtype == torch.bool else None
    edges = plan.edges if plan else (0, t)
    outs = []
    for s, e in zip(edges, edges[1:]):
        kend = tk - t + e  # the chunk's last query sees no later key
        qc = q if e - s == t else q[:, :, :, s:e]
        scores = torch.matmul(qc.reshape(b, hk, g * (e - s), d), _keys_upto(key, kend).transpose(-1, -2))
        scores = scores.view(b, hk, g, e - s, kend)
        if plan:  # in place: the product's own buffer (its backward needs q and k only)
            scores[..., plan.lead:].add_(plan.bias[..., s:e, :kend - plan.lead])
        else:
            scores.add_(attention_mask[:, :, None])  # [B, 1, 1, T, Tk]: the same for the g stacked heads
        probs = torch.softmax(scores, dim=-1)  # 16-bit rows accumulate in float32 inside the kernel
        out = torch.matmul(probs.view(b, hk, g * (e - s), kend), _keys_upto(value, kend))
        outs.append(out.view(b, hk, g, e - s, d).permute(0, 3, 1, 2, 4))  # [B, chunk, Hk, g, D]
    out = outs[0].contiguous() if len(outs) == 1 else torch.cat(outs, 1)
    return out.view(b, t, h, d), None


def check_attention_kernel(kernel: str) -> str:
    """``kernel`` when it names an ``speed.attention`` choice; one clear error otherwise."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"speed.attention={kernel!r}: expected one of {', '.join(ATTENTION_KERNELS)} "
                         "('auto': two matmuls for a 16-bit model on a CPU, SDPA otherwise)")
    return kernel


def check_attention_chunk(chunk: int) -> int:
    """``chunk`` when it is a query count for :func:`query_chunks` (0: no chunks); one clear error otherwise."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"speed.attention_chunk={chunk!r}: expected an integer >= 0 (queries per chunk of a causal "
                         f"attention call; 0: one product over every key), e.g. speed.attention_chunk={QUERY_CHUNK}")
    return chunk


def _attention_fn(kernel: str, gqa: bool, chunk: int | None = None):
    """The attention function :func:`native_gqa` installs: ``"sdpa"`` SDPA (its own GQA with
    ``gqa``); ``"matmul"`` :func:`matmul_attention`; ``"auto"`` :func:`matmul_attention` for a
    16-bit call (a CPU without AMX runs the fused kernel far below the matmul rate there;
    in float32 the fused kernel is the faster), SDPA otherwise: decided per call, so a
    16-bit model's pass that runs in float32 (:func:`sprpo_lib.core.perturb.float32_compute`)
    keeps SDPA.  ``chunk``: :func:`matmul_attention`'s ``query_chunk``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # heavy: loaded with a model

    sdpa = native_gqa_attention if gqa else sdpa_attention_forward
    if kernel == "sdpa":
        return sdpa

    def attend(module, query, key, value, attention_mask, **kwargs):
        if kernel == "matmul" or query.dtype in (torch.bfloat16, torch.float16):
            return matmul_attention(module, query, key, value, attention_mask, query_chunk=chunk, **kwargs)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    return attend


@contextmanager
def native_gqa(model: nn.Module, on: bool = True, kernel: str = "sdpa", chunk: int | None = None) -> Iterator[bool]:
    """Inside the block a model running transformers' ``sdpa`` attention runs
    :func:`native_gqa_attention` (``on``), and with ``kernel`` ``"matmul"`` or ``"auto"``
    :func:`matmul_attention` (query chunks of ``chunk``) where :func:`_attention_fn` says (same masks; same results up to
    float rounding); yields whether the model's attention was switched.  Other attention
    implementations, and a model an enclosing block switched already, are left alone; the
    setting is restored on exit."""
    check_attention_kernel(kernel)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if not (on or kernel != "sdpa") or getattr(config, "_attn_implementation", None) != "sdpa":
        yield False
        return
    from transformers import AttentionInterface  # heavy: loaded with a model
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # (the same)

    AttentionInterface.register(NATIVE_GQA, _attention_fn(kernel, on, chunk))
    AttentionMaskInterface.register(NATIVE_GQA, sdpa_mask)
    config._attn_implementation = NATIVE_GQA
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"


@contextmanager
def float32_logits(model: nn.Module, on: bool = True) -> Iterator[bool]:
    """Inside the block a 16-bit model's output head computes its logits in float32 from the
    hidden states (a float32 copy of the head's weight, taken on entry), so the logits are not
    rounded to the model's dtype (bfloat16: a quarter at a logit of 32); yields whether the head
    was switched.  A float32 or float64 model, ``on=False``, and a head an enclosing block
    switched already are left alone; the head's own forward is back on exit."""
    head = model.get_output_embeddings()
    if not on or head is None or head.weight.dtype not in (torch.bfloat16, torch.float16) or "forward" in vars(head):
        yield False
        return
    weight = head.weight.detach().float()
    bias = None if getattr(head, "bias", None) is None else head.bias.detach().float()
    head.forward = lambda hidden: F.linear(hidden.float(), weight, bias)  # an instance attribute shadows the class's
    try:
        yield True
    finally:
        del head.forward


def lowest_trainable_layer(model: nn.Module) -> int:
    """Index of the lowest decoder layer holding a trainable parameter (the layer count
    when none does): a backward for the parameters alone stops there."""
    layers = list(decoder_layers(model))
    return next((i for i, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters())),
                len(layers))


def has_dropout(model: nn.Module) -> bool:
    """Whether the model drops anything in training mode (a dropout module or the attention's
    ``attention_dropout``): then a training forward's log-probs are not the evaluation's."""
    p = float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0)
    return p > 0 or any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def row_major_strides(shape) -> tuple[int, ...]:
    """The strides of a freshly allocated tensor of ``shape`` (size-1 dimensions included)."""
    out, step = [], 1
    for n in reversed(tuple(shape)):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


def _dense(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    if x.dim() < 3 or x.stride() == row_major_strides(x.shape):
        return None
    return (x.clone(memory_format=torch.contiguous_format), *args[1:])


def dense_head_input(model: nn.Module) -> nn.Module:
    """Give the LM head its input with row-major strides (a forward pre-hook; idempotent).

    transformers slices the last hidden states before the head (``logits_to_keep``: the
    response positions, or the last one in a prefix pass and in generation's prefill).  On
    CPU, ``F.linear`` of such a 3-D slice does not fold into one matrix product: it expands
    the vocabulary x hidden weight over the batch and copies it per call (SmolLM2: 28M
    entries, ~70 ms in bfloat16 for one row, 50x the product itself; tested in
    ``tests/test_models.py``).  A copy of the slice (rows x hidden) costs next to nothing and
    gives the same product.  :func:`sprpo_lib.model.load.load_policy` applies it."""
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, "_sprpo_dense_input", False):
        head.register_forward_pre_hook(_dense)
        head._sprpo_dense_input = True
    return model
