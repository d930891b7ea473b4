"""Fused elementwise kernels for the training passes (``speed.fused_kernels``).

On a CPU a Llama/Qwen2 decoder layer of SmolLM2's width spends more of its forward and
backward in elementwise ops than in matmuls: RMSNorm's upcast, square, mean, rsqrt and
scale, SwiGLU's ``silu(gate) * up`` and the rotary embedding's ``q * cos + rotate_half(q)
* sin`` each read and write the activations several times, in bfloat16 with a conversion
at every step.  Inside :func:`fused_kernels` those three run as ``torch.compile``'d
functions of explicit tensors (inductor fuses each into one loop, forward and backward).
The functions are the models' own equations: RMSNorm and SwiGLU are restated below from
transformers' ``LlamaRMSNorm`` / ``LlamaMLP`` (Qwen2's are the same), the rotary
embedding is the model module's own ``apply_rotary_pos_emb``.  Results equal the eager
path's up to float rounding (a fused loop rounds to bfloat16 once, not after every op).

verl's ``use_fused_kernels`` is the same kind of switch (its kernels are CUDA-only).
Compilation needs a C++ compiler; where it fails, :func:`fused_kernels_available` says
why once and the passes run eagerly.  ``torch._dynamo`` is imported on first use.
"""
from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``: normalise in float32, scale in the input dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``LlamaMLP``'s activated FFN representation ``h = SiLU(W_gate x) * W_up x`` (Sec. 5)."""
    return F.silu(gate) * up


@functools.cache
def compiled(fn):
    """``torch.compile(fn, dynamic=True)``, made once per process (shapes vary per micro-batch:
    dynamic sizes avoid a recompilation for every new length).  Donated buffers are off: a
    backward here may keep its graph for a second gradient (``Actor.backward`` with
    ``split_regularisers``, SPrPO's one-pass estimate), which compiled code with donated
    buffers refuses."""
    import torch._functorch.config as functorch_config  # torch's own switch; no public one exists

    functorch_config.donated_buffer = False
    return torch.compile(fn, dynamic=True)


@functools.cache
def fused_kernels_available(dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """Whether the compiled kernels build, run and agree with the eager functions here for
    ``dtype`` (forward and gradients of a case wide enough for the vector loops and their
    tails, checked once per process); ``(False, why)`` otherwise, logged once.  The value
    check catches a miscompile (torch 2.13's inductor gave NaN on an AVX-512 CPU whose
    kernels were capped with ``ATEN_CPU_CAPABILITY=avx2``)."""
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(2, 17, 72, generator=gen).to(dtype).requires_grad_()
        w = (1 + 0.1 * torch.randn(72, generator=gen)).to(dtype).requires_grad_()
        outs = []
        for norm, act in ((rms_norm, swiglu), (compiled(rms_norm), compiled(swiglu))):
            y = norm(x, w, 1e-6)
            z = act(y, y * 0.5)
            outs.append([z, *torch.autograd.grad(z.float().square().sum(), (x, w))])
        tol = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2  # relative to each tensor's largest value
        for name, ref, got in zip(("forward", "grad x", "grad weight"), *outs):
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).detach()
            if not bool(torch.isfinite(err)) or err > tol:
                raise ArithmeticError(f"the compiled {name} disagrees with eager (relative error {float(err):.3g})")
        return True, ""
    except Exception as err:  # noqa: BLE001  (no C++ compiler, an unsupported platform, a miscompile: any failure means eager)
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        logger.warning("speed.fused_kernels: torch.compile fails here (%s); the passes run eagerly", why)
        return False, why


def _marked(fn):
    """``fn`` tagged as this module's patch (an enclosing :func:`fused_kernels` block put it there)."""
    fn._sprpo_fused = True
    return fn


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _rows(x: torch.Tensor, *tail: int) -> torch.Tensor:
    """``x`` as rows ``[N, *tail]`` (default ``[N, C]``; a view where the layout allows), the
    row count, and the leading sizes of the tensor it is a view of, marked unbacked: the
    compiled kernels then see one graph per grad mode whatever the micro-batch's rows and
    length.  ``torch.compile`` otherwise gives a size of 1 (one row, one token, a ``cos``
    shared by the rows) and every equal pair of sizes a graph of its own, and after
    ``torch._dynamo``'s recompile limit (8 per function) the kernel ran eagerly again, in the
    middle of a run."""
    rows = x.reshape(-1, *(tail or x.shape[-1:]))
    for t in (rows, rows._base):
        if t is not None:
            for d in range(t.dim() - 1):
                torch._dynamo.decorators.mark_unbacked(t, d)
    return rows


def _rotary_forward(fn):
    """The model module's ``apply_rotary_pos_emb`` compiled, called on rows (:func:`_rows`):
    ``q`` ``[B, H, T, D]`` as ``[B*T, H, D]`` (a view of the projection's ``[B, T, H, D]``
    output), ``cos`` and ``sin`` ``[B or 1, T, D]`` as ``[B*T, D]`` (copied: a ``cos`` shared by
    the rows has a stride of 0).  Other calls go to the compiled function as they are."""
    c = compiled(fn)

    def apply(q, k, cos, sin, *args, **kwargs):
        if args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1 or q.dim() != 4 \
                or cos.dim() != 3:
            return c(q, k, cos, sin, *args, **kwargs)
        (B, H, T, D), Hk = q.shape, k.shape[1]
        cos, sin = (t.expand(B, T, D).clone(memory_format=torch.contiguous_format) for t in (cos, sin))  # own strides
        qe, ke = c(_rows(q.transpose(1, 2), H, D), _rows(k.transpose(1, 2), Hk, D), _rows(cos), _rows(sin))
        return qe.view(B, T, H, D).transpose(1, 2), ke.view(B, T, Hk, D).transpose(1, 2)

    return _marked(apply)


def _norm_forward(module: nn.Module):
    fn = compiled(rms_norm)

    def forward(hidden_states):  # as rows [N, H]: one graph whatever the batch (see _rows)
        return fn(_rows(hidden_states), module.weight, module.variance_epsilon).view(hidden_states.shape)

    return forward


def _mlp_forward(module: nn.Module):
    fn = compiled(swiglu)

    def forward(x):
        gate, up = module.gate_proj(x), module.up_proj(x)
        return module.down_proj(fn(_rows(gate), _rows(up)).view(gate.shape))  # down_proj's hooks still fire

    return forward


@contextmanager
def fused_kernels(model: nn.Module, on: bool = True) -> Iterator[bool]:
    """Inside the block ``model``'s RMSNorms, SwiGLU activations and rotary embeddings run as
    compiled fused kernels; yields whether they do (``on`` and :func:`fused_kernels_available`).

    Instances are patched (their ``forward``), and the rotary function in the module of the
    model's attention class; everything is restored on exit.  Modules of other shapes (an
    RMSNorm without ``variance_epsilon``, an MLP whose activation is not SiLU) are left
    alone."""
    dtype = next(model.parameters()).dtype
    if not on or not fused_kernels_available(dtype)[0]:
        yield False
        return
    patched: list[nn.Module] = []
    rotary: dict = {}
    for m in model.modules():
        name = type(m).__name__
        if "forward" in m.__dict__:  # patched already (an enclosing block): leave it to that block
            continue
        if name.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and isinstance(m.weight, torch.Tensor):
            m.forward = _norm_forward(m)
            patched.append(m)
        elif all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(m, "act_fn", None)):
            m.forward = _mlp_forward(m)
            patched.append(m)
        elif name.endswith("Attention"):
            mod = sys.modules[type(m).__module__]
            fn = getattr(mod, "apply_rotary_pos_emb", None)
            if callable(fn) and mod not in rotary and not getattr(fn, "_sprpo_fused", False):
                rotary[mod] = mod.apply_rotary_pos_emb
    for mod, fn in rotary.items():
        mod.apply_rotary_pos_emb = _rotary_forward(fn)
    try:
        yield True
    finally:
        for m in patched:
            del m.forward  # back to the class's forward
        for mod, fn in rotary.items():
            mod.apply_rotary_pos_emb = fn
