"""FFN-channel perturbations (paper Sec. 5, App. B "Perturbation implementation").

Every perturbation used in training and most used in evaluation acts on the
activated FFN representation right before the down projection,

    h_l = SiLU(W_gate,l x_l) * W_up,l x_l,        y_l = W_down,l h_l,

as a channel-wise multiplicative factor ``h_l <- h_l * f_l``.  With

* ``xi``   : multiplicative Gaussian noise, ``f = 1 + xi`` (Sec. 5; Alg. 1 line 4);
* ``mask`` : 0/1 channel masks (channel dropout, App. C; structured pruning);
* ``gain`` : a differentiable gain ``u`` evaluated at ``u = 1`` whose gradient is
  ``dL/du_lc = sum_t h_tlc dL/dh~_tlc`` (SAM's g, App. B Alg. 4 line 3; Fisher
  scores, App. C);

the factor is ``f = (1 + xi) * mask * gain``.  Since ``f`` multiplies channel c of h,
it is the same as scaling column c of ``W_down`` (tested).  ``xi`` may itself require
grad: then ``xi.grad`` is ``dL/dxi`` directly (SPrPO's sensitivity, Alg. 1 line 7).

The perturbation is a forward *pre*-hook on each ``down_proj`` (plain ``nn.Linear`` or
a peft LoRA wrapper, whose base and adapter paths both read h).  It fires once per
forward, so it works unchanged under ``generate()`` with a KV cache.  State is held
fixed until changed: the paper holds one xi through a whole rollout and update.

For low-precision models small noise (sigma = 0.02) must not be quantised away by
bf16's 8-bit mantissa: inference computes ``h + h * xi`` in the model dtype
(``addcmul``; its error is relative to the perturbation, see ``_static_delta``), and
the differentiable path multiplies in float32 and rounds once.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from sprpo_lib.model.layers import ffn_modules


class FFNChannels:
    """Channel-wise multiplicative perturbation of every FFN block of a model.

    Usage::

        fc = FFNChannels(model)
        fc.set(xi=sample_xi(sigma, fc.shape, seed=0))
        with fc:                 # hooks attached only inside the block
            model.generate(...)
        # or, for gradients w.r.t. channel gains:
        with fc, fc.gain() as u:
            loss(model).backward()
        u.grad                   # [L, C] (or [B, L, C] for per-sequence gains)

    All tensors are ``[L, C]`` (layers x FFN channels), float32 (float64 for float64
    models) on the model's device.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.mlps = ffn_modules(model)
        sizes = {m.down_proj.in_features for m in self.mlps}
        if len(sizes) != 1:
            raise ValueError(f"FFN widths differ across layers ({sorted(sizes)}); not supported")
        self.shape = (len(self.mlps), sizes.pop())
        p = next(model.parameters())
        self.device = p.device
        self.dtype = torch.promote_types(p.dtype, torch.float32)  # of xi/mask/gain
        self.xi: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self._gain: torch.Tensor | None = None
        self._handles: list = []
        self._depth = 0
        self._static: list[torch.Tensor | None] | None = None  # per-layer factors, no-grad case
        self._delta: dict = {}

    # ----------------------------------------------------------------- state
    def _check(self, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {self.shape}, got {type(t)}")
        if tuple(t.shape[-2:]) != self.shape or t.dim() not in (2, 3):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}; expected {self.shape} "
                f"(layers x FFN channels) or (batch, {self.shape[0]}, {self.shape[1]})"
            )
        if not torch.isfinite(t.detach()).all():
            raise ValueError(f"{name} contains NaN or inf")
        return t.to(device=self.device, dtype=self.dtype)

    def set(self, xi: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            gain: torch.Tensor | None | object = ...) -> "FFNChannels":
        """Set (replace) the noise ``xi``, the channel ``mask`` and a differentiable
        ``gain`` (a leaf of ones: its ``.grad`` is dL/du at u = 1); None clears one,
        an omitted ``gain`` keeps the current one (e.g. inside :meth:`gain`).

        A leaf ``xi`` that requires grad gets ``xi.grad = dL/dxi`` from a backward pass.
        Without gradients the per-layer factors are formed here once, so call ``set``
        again after changing a tensor in place."""
        self.xi = _keep_leaf(xi, self._check("xi", xi))
        self.mask = self._check("mask", mask)
        if gain is not ...:
            self._gain = _keep_leaf(gain, self._check("gain", gain))
        self._static = None
        self._delta: dict = {}
        if not any(t is not None and t.requires_grad for t in (self.xi, self.mask, self._gain)):
            # the common inference case: form each layer's factor once, not per forward
            self._static = [self.factor(i) for i in range(self.shape[0])]
        return self

    def clear(self) -> "FFNChannels":
        return self.set(None, None, None)

    @property
    def active(self) -> bool:
        return self.xi is not None or self.mask is not None or self._gain is not None

    def factor(self, layer: int) -> torch.Tensor | None:
        """The factor multiplying h of ``layer`` (``None``: identity)."""
        f = None
        if self.xi is not None:
            f = 1.0 + self.xi[..., layer, :]
        if self.mask is not None:
            m = self.mask[..., layer, :]
            f = m if f is None else f * m
        if self._gain is not None:
            g = self._gain[..., layer, :]
            f = g if f is None else f * g
        return f

    # ----------------------------------------------------------------- hooks
    def layer_hook(self, layer: int):
        def hook(module, args):
            h = args[0]
            static = self._static is not None and self._gain is None
            if static and h.dtype not in (torch.float32, torch.float64):
                d = self._static_delta(layer, h.dtype)
                if d is None:
                    return None
                out = torch.addcmul(h, h, d)  # h * (1 + d) in one native-dtype kernel
                return (out,) + tuple(args[1:])
            f = self._static[layer] if static else self.factor(layer)
            if f is None:
                return None
            if f.dim() == 2:  # per-sequence factor [B, C] -> broadcast over tokens
                f = f[:, None, :]
            if h.dtype in (torch.float32, torch.float64):
                out = h * f.to(h.dtype)
            else:  # bf16/fp16 with gradients: the inference path's product, dL/df in float32
                out = ChannelScale.apply(h, f)
            return (out,) + tuple(args[1:])

        return hook

    def _static_delta(self, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
        """``f - 1`` in the model's dtype, cached per layer (inference path).

        ``h + h * (f - 1)`` rounds the small product ``h * xi`` and then the sum, so its
        error is a fraction 2^-8 of the *perturbation* (plus the output's own rounding),
        not of h; masked channels (f = 0, d = -1) come out exactly 0.  Casting
        ``1 + xi`` itself to bf16 would instead quantise the noise to steps of 2^-7.
        """
        key = (layer, dtype)
        if key not in self._delta:
            f = self._static[layer]
            self._delta[key] = None if f is None else (f - 1.0).to(dtype)
        return self._delta[key]

    def attach(self) -> "FFNChannels":
        """Register the pre-hooks (idempotent; nested ``with`` blocks are counted)."""
        if self._depth == 0:
            self._handles = []
            for i, m in enumerate(self.mlps):
                hook = self.layer_hook(i)
                hook.ffn_channels = self  # found by active_factor(): engines with their own weights bake it in
                self._handles.append(m.down_proj.register_forward_pre_hook(hook))
        self._depth += 1
        return self

    def detach(self) -> None:
        """Remove the hooks once the outermost ``with`` block exits."""
        self._depth -= 1
        if self._depth <= 0:
            for h in self._handles:
                h.remove()
            self._handles = []
            self._depth = 0

    def __enter__(self) -> "FFNChannels":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @contextmanager
    def gain(self, batch: int | None = None) -> Iterator[torch.Tensor]:
        """A differentiable gain ``u = 1`` (leaf tensor, ``requires_grad``).

        After a backward pass inside the block, ``u.grad[l, c] = dL/du_lc =
        sum_t h~_tlc dL/dh~_tlc`` at u = 1 (h~ = h * (1+xi) * mask).  With ``batch=B``
        the gain is per sequence, ``[B, L, C]``, giving per-sequence gradients in one
        backward pass (used for Fisher scores).
        """
        shape = self.shape if batch is None else (batch, *self.shape)
        u = torch.ones(shape, device=self.device, dtype=self.dtype, requires_grad=True)
        prev, self._gain = self._gain, u
        try:
            with self:
                yield u
        finally:
            self._gain = prev


class ChannelScale(torch.autograd.Function):
    """``h * f`` for a 16-bit ``h`` (``[..., T, C]``) and a float32 factor ``f`` (``[C]`` or
    ``[B, 1, C]``) that may require grad, formed as the inference path forms it:
    ``h + h * (f - 1)`` in one 16-bit kernel, ``f - 1`` rounded to h's dtype (the noise to 2^-8
    of itself, not to steps of 2^-7 as ``1 + xi`` in bf16 would be).  So a pass that
    differentiates xi computes the same activations as the rollout and the update under that
    xi, bit for bit.  Backward: ``dh = g * f`` rounded once; ``df = sum(g * h)`` over the
    tokens in float32."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        d = (f - 1.0).to(h.dtype)
        ctx.save_for_backward(h, d)
        ctx.f_shape, ctx.f_dtype = f.shape, f.dtype
        return torch.addcmul(h, h, d)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        h, d = ctx.saved_tensors
        dh = torch.addcmul(g, g, d) if ctx.needs_input_grad[0] else None
        df = None
        if ctx.needs_input_grad[1]:
            prod = g.to(ctx.f_dtype) * h.to(ctx.f_dtype)
            lead = prod.dim() - len(ctx.f_shape)
            dims = [*range(lead), *(lead + i for i, n in enumerate(ctx.f_shape) if n == 1)]
            df = prod.sum(dim=dims, keepdim=True).reshape(ctx.f_shape)
        return dh, df


def active_factor(model: nn.Module) -> torch.Tensor | None:
    """The ``[L, C]`` factor that the :class:`FFNChannels` hooks attached to ``model``'s FFN
    blocks multiply ``h`` by now (``(1 + xi) * mask``, the product over attached
    instances; a differentiable gain counts as its value 1), or ``None`` when none is
    attached.  What a generation engine holding its own copy of the weights must fold into
    ``W_down`` to compute what the hooked model computes."""
    seen: list[FFNChannels] = []
    for m in ffn_modules(model):
        for hook in m.down_proj._forward_pre_hooks.values():
            fc = getattr(hook, "ffn_channels", None)
            if fc is not None and fc not in seen:
                seen.append(fc)
    total = None
    for fc in seen:
        for name, t in (("xi", fc.xi), ("mask", fc.mask)):
            if t is None:
                continue
            if t.dim() != 2:
                raise ValueError(f"active_factor: an attached FFNChannels has a per-sequence {name} {tuple(t.shape)}; "
                                 "only one [layers, channels] setting for the whole batch can be folded into weights")
            f = (1.0 + t if name == "xi" else t).detach().float().cpu()
            total = f if total is None else total * f
    return total


def _keep_leaf(given: torch.Tensor | None, checked: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf that requires grad is used as given (so its ``.grad`` fills); a cast
    copy would be a non-leaf whose gradient is lost."""
    if given is not None and given.requires_grad:
        if checked is not None and checked.dtype != given.dtype:
            raise ValueError(f"a perturbation leaf that requires grad must be {checked.dtype} "
                             f"(this model's perturbation dtype), got {given.dtype}")
        return given
    return checked


def resolution(dtype: torch.dtype) -> float:
    """Relative rounding of ``dtype`` (half its machine epsilon): 2^-8 for bfloat16,
    2^-11 for float16."""
    return torch.finfo(dtype).eps / 2


def below_resolution(xi: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """True when a multiplicative perturbation would mostly round away in ``dtype``:
    the RMS of ``xi`` is below the dtype's relative rounding (SAM's rho = 5e-3 spread
    over all FFN channels gives |xi| ~ 1e-5, far below bfloat16's 2^-8)."""
    if xi is None or dtype in (torch.float32, torch.float64):
        return False
    return float(xi.detach().double().pow(2).mean().sqrt()) < resolution(dtype)


@contextmanager
def float32_compute(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Run the forward/backward in float32: the frozen 16-bit parameters are cast to
    float32 inside the block and back on exit (bit-exact: bf16 -> f32 -> bf16 is
    lossless); trainable parameters are left alone.  Used when a perturbation is below
    the model dtype's resolution, so it is carried through the residual stream instead
    of being rounded away at every matmul input."""
    if not enabled:
        yield
        return
    cast = [(p, p.dtype) for p in model.parameters()
            if not p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    for p, _ in cast:
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, dt in cast:
            p.data = p.data.to(dt)


def sample_xi(
    sigma: float | torch.Tensor,
    shape: tuple[int, int],
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw ``xi_lc ~ N(0, sigma_lc^2)`` (Alg. 1 line 4; Alg. 3 lines 2-3).

    ``sigma`` is a scalar (isotropic, the Gaussian baseline and the evaluation sweep)
    or an ``[L, C]`` tensor (SPrPO's per-channel scales).  Sampling is on the CPU from
    a seeded generator, so the same seed gives the same xi on every device.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    z = torch.randn(shape, generator=generator, dtype=torch.float32)
    if isinstance(sigma, torch.Tensor):
        if tuple(sigma.shape) != tuple(shape):
            raise ValueError(f"sigma has shape {tuple(sigma.shape)}, expected {tuple(shape)}")
        sigma = sigma.detach().float().cpu()
        if (sigma < 0).any() or not torch.isfinite(sigma).all():
            raise ValueError("sigma must be finite and >= 0")
    elif not (sigma >= 0):
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    return z * sigma


def xi_stats(xi: torch.Tensor | None) -> dict[str, float]:
    """The realised perturbation of one iteration: RMS, max |xi| and the fraction of
    channels whose factor ``1 + xi`` is negative (a sign flip, not a perturbation);
    all zero when there is none."""
    if xi is None:
        return {"rms": 0.0, "max_abs": 0.0, "flip_frac": 0.0}
    x = xi.detach().double()
    return {"rms": float(x.pow(2).mean().sqrt()), "max_abs": float(x.abs().max()),
            "flip_frac": float((x < -1).double().mean())}


def dropout_mask(
    p: float, shape: tuple[int, int], seed: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Bernoulli channel mask: each FFN channel is removed with probability ``p``
    (App. C "Channel dropout"; no 1/(1-p) rescaling: a deployment fault, not training
    dropout)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
    if generator is None:
        generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
    return (torch.rand(shape, generator=generator) >= p).float()


@contextmanager
def perturbed(
    model: nn.Module, xi: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> Iterator[FFNChannels]:
    """One-shot context: ``with perturbed(model, xi=...) as fc: ...``."""
    fc = FFNChannels(model).set(xi=xi, mask=mask)
    with fc:
        yield fc
