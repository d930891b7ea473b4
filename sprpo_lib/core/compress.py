"""Deployment perturbations of App. C ("Evaluation Details"), applied to a fixed policy.

Five families, one registry (:data:`PERTURBATIONS`), one call::

    with apply_perturbation(policy.model, "sparsegpt", 0.5, calib=seqs, seed=0):
        ...  # evaluate; weights are restored bit-exactly on exit

* ``gaussian``  (strength sigma): channel noise ``h * (1 + xi)``, ``xi ~ N(0, sigma^2)``;
* ``dropout``   (strength p): Bernoulli channel removal;
* ``fisher``    (strength r): structured pruning of the fraction r of FFN channels with
  the lowest diagonal-Fisher score (rows of W_gate, W_up, columns of W_down);
* ``sparsegpt`` (strength r): SparseGPT unstructured pruning of the FFN weights;
* ``rtn``       (strength b bits): symmetric round-to-nearest quantisation, group 128,
  of all linear weights in the transformer layers.

Channel families act through :class:`sprpo_lib.core.perturb.FFNChannels` hooks; weight
families edit weights in place after taking a :class:`Snapshot` of exactly the tensors
they touch.  Weight families need plain ``nn.Linear`` projections: merge LoRA adapters
first (:func:`sprpo_lib.model.lora.merge_lora`), as a deployed model would be.

Calibration data is a list of token-id sequences (any source; the paper uses 128
agent-interaction sequences from a Vanilla policy, App. C).
"""
from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from sprpo_lib.core.perturb import FFNChannels, dropout_mask, sample_xi
from sprpo_lib.infra.progress import progress_bar
from sprpo_lib.infra.registry import Registry
from sprpo_lib.model.layers import decoder_layers, ffn_modules

Calibration = Sequence[Sequence[int]]


# --------------------------------------------------------------------------- restore
class Snapshot:
    """Copies of the given parameters, restorable bit-exactly (``copy_`` of clones)."""

    def __init__(self, params: Sequence[nn.Parameter]):
        self._saved = [(p, p.detach().clone()) for p in params]

    def restore(self) -> None:
        with torch.no_grad():
            for p, v in self._saved:
                p.copy_(v)
        self._saved = []


def _plain_linear(m: nn.Module, where: str) -> nn.Linear:
    if type(m) is not nn.Linear:
        raise TypeError(
            f"{where} is a {type(m).__name__}, expected a plain nn.Linear. Weight-space "
            "perturbations act on deployed weights: merge LoRA adapters first with "
            "sprpo_lib.model.lora.merge_lora(policy)."
        )
    return m


def transformer_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """All linear layers inside the transformer blocks (attention + FFN projections;
    not the embedding or the LM head), as App. C's RTN setting specifies."""
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        for name, m in layer.named_modules():
            if hasattr(m, "base_layer"):  # a peft wrapper: refuse with the fix
                _plain_linear(m, f"layers.{i}.{name}")
            if isinstance(m, nn.Linear):
                out.append((f"layers.{i}.{name}", m))
    return out


# --------------------------------------------------------------------------- RTN
def rtn_quantize_tensor(w: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Round-to-nearest, symmetric, per group of ``group_size`` consecutive input weights.

    App. C: ``s_G = max_{w in G} |w| / (2^(b-1) - 1)``; ``q = clip(round(w / s), -2^(b-1),
    2^(b-1) - 1)``; the returned tensor is ``q * s`` (fake quantisation), computed in
    float32 and cast back to ``w.dtype``.  All-zero groups keep scale 1 (codes 0).
    """
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"RTN bit width must be an integer in 2..8, got {bits!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rows, cols = w.shape
    qmax = 2 ** (bits - 1) - 1
    pad = (-cols) % group_size
    x = w.detach().float()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    g = x.reshape(rows, -1, group_size)
    scale = g.abs().amax(dim=-1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(g / scale), -qmax - 1, qmax)
    out = (q * scale).reshape(rows, -1)[:, :cols]
    return out.to(w.dtype)


def rtn_quantize(model: nn.Module, bits: int, group_size: int = 128) -> Snapshot:
    """Quantise all transformer linear weights in place; returns the restore snapshot."""
    linears = transformer_linears(model)
    snap = Snapshot([m.weight for _, m in linears])
    with torch.no_grad():
        for _, m in linears:
            m.weight.copy_(rtn_quantize_tensor(m.weight, bits, group_size))
    return snap


# --------------------------------------------------------------------------- calibration
def pad_batches(
    seqs: Calibration, batch_size: int, pad_id: int, device: torch.device | str = "cpu"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded micro-batches ``(input_ids [B, T], attention_mask [B, T])``.

    Sequences are batched in order of length, so a micro-batch pads little; both callers
    sum over sequences and tokens, so the order changes nothing but rounding.
    """
    if len(seqs) == 0:
        raise ValueError("calibration set is empty: pass a list of token-id sequences")
    if any(len(s) < 2 for s in seqs):
        raise ValueError("every calibration sequence needs at least 2 tokens")
    seqs = sorted(seqs, key=len)
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        t = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), t), pad_id, dtype=torch.long)
        att = torch.zeros((len(chunk), t), dtype=torch.long)
        for j, s in enumerate(chunk):
            ids[j, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
            att[j, : len(s)] = 1
        out.append((ids.to(device), att.to(device)))
    return out


def sequence_nll(model: nn.Module, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean next-token negative log-likelihood ``[B]`` (padding excluded)."""
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1].float()
    tgt = ids[:, 1:]
    valid = att[:, 1:].float()
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none"
    ).view_as(valid)
    return (nll * valid).sum(1) / valid.sum(1).clamp_min(1.0)


# --------------------------------------------------------------------------- Fisher
def fisher_scores(
    model: nn.Module, calib: Calibration, batch_size: int = 8, pad_id: int = 0, progress: bool = True
) -> torch.Tensor:
    """Diagonal-Fisher channel importance ``F_lc = E_calib[(h_lc dL/dh_lc)^2]`` (App. C).

    ``h_lc dL/dh_lc`` is taken per calibration sequence, summed over its tokens (the
    gradient of the sequence loss w.r.t. a channel gain at 1, Molchanov et al. 2019 /
    group Fisher pruning), then squared and averaged over sequences.  The loss is the
    sequence's mean next-token NLL.  One backward per micro-batch gives all
    per-sequence gradients through a per-sequence gain ``[B, L, C]``.
    """
    fc = FFNChannels(model)
    total = torch.zeros(fc.shape, dtype=torch.float64)
    n = 0
    batches = pad_batches(calib, batch_size, pad_id, fc.device)
    for ids, att in progress_bar(batches, desc="fisher", disable=not progress):
        with torch.enable_grad(), fc.gain(batch=ids.shape[0]) as u:
            sequence_nll(model, ids, att).sum().backward()
        total += u.grad.double().pow(2).sum(0).cpu()
        n += ids.shape[0]
    return (total / n).float()


def fisher_prune_mask(scores: torch.Tensor, ratio: float, scope: str = "global") -> torch.Tensor:
    """Keep-mask ``[L, C]`` removing the fraction ``ratio`` of lowest-scoring channels.

    ``scope="global"`` (default) ranks all (l, c) together, as App. C writes ("channels
    are ranked by F_lc"): the diagonal-Fisher score estimates the loss increase from
    removing a channel (Delta L ~ F/2), a quantity in loss units that is comparable
    across layers, which is why Fisher pruning ranks globally.  ``scope="layer"`` removes
    the same fraction in every layer (safer when one layer's scores are tiny).  Exactly
    ``floor(ratio * N)`` channels are removed (ties broken by index).
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"pruning ratio must be in [0, 1), got {ratio}")
    keep = torch.ones_like(scores)
    if scope == "global":
        k = int(math.floor(ratio * scores.numel()))
        idx = torch.argsort(scores.flatten(), stable=True)[:k]
        keep.view(-1)[idx] = 0.0
    elif scope == "layer":
        k = int(math.floor(ratio * scores.shape[1]))
        idx = torch.argsort(scores, dim=1, stable=True)[:, :k]
        keep.scatter_(1, idx, 0.0)
    else:
        raise ValueError(f"scope must be 'global' or 'layer', got {scope!r}")
    return keep


def prune_channels(model: nn.Module, keep: torch.Tensor) -> Snapshot:
    """Zero rows of W_gate, W_up (and their biases) and columns of W_down for removed
    channels (``keep == 0``), in place.  Returns the restore snapshot."""
    mlps = ffn_modules(model)
    if tuple(keep.shape) != (len(mlps), mlps[0].down_proj.in_features):
        raise ValueError(f"keep mask has shape {tuple(keep.shape)}, expected [layers, FFN channels]")
    params = []
    for i, mlp in enumerate(mlps):
        for k in ("gate_proj", "up_proj", "down_proj"):
            lin = _plain_linear(getattr(mlp, k), f"layers.{i}.mlp.{k}")
            params += [p for p in (lin.weight, lin.bias) if p is not None]
    snap = Snapshot(params)
    with torch.no_grad():
        for i, mlp in enumerate(mlps):
            drop = keep[i].to(mlp.down_proj.weight.device) == 0
            for k in ("gate_proj", "up_proj"):
                lin = getattr(mlp, k)
                lin.weight[drop, :] = 0
                if lin.bias is not None:
                    lin.bias[drop] = 0
            mlp.down_proj.weight[:, drop] = 0
    return snap


# --------------------------------------------------------------------------- SparseGPT
def sparsegpt_matrix(
    weight: torch.Tensor, hessian: torch.Tensor, ratio: float, blocksize: int = 128, percdamp: float = 0.01
) -> torch.Tensor:
    """SparseGPT (Frantar & Alistarh, 2023) on one weight matrix ``W [rows, cols]``.

    ``hessian`` is ``H = 2 X X^T / n`` over the layer inputs (``[cols, cols]``).  Steps:
    dampen ``H += percdamp * mean(diag H) I``; take the upper Cholesky factor U of
    ``H^-1``; sweep columns in blocks of ``blocksize``: in each block select the
    ``floor(ratio * rows * blocksize)`` weights with the smallest ``w^2 / U_jj^2`` (exact
    sparsity per block), then for each column j zero the selected weights and
    compensate the block's remaining columns with the OBS update
    ``W[:, j:] -= (w_j - q_j) / U_jj * U[j, j:]``; finally propagate the block's error
    to later columns.  Computed in float32; returns the pruned matrix (same dtype).
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"sparsity ratio must be in [0, 1), got {ratio}")
    W = weight.detach().float().clone()
    rows, cols = W.shape
    H = hessian.detach().float().clone().to(W.device)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
    # U (upper, H^-1 = U^T U) without forming H^-1: with J the reversal, J H J = M M^T
    # gives H = V V^T for the upper V = J M J, so H^-1 = V^-T V^-1 and U = V^-1.
    M = torch.linalg.cholesky(H.flip(0, 1))
    eye = torch.eye(cols, dtype=H.dtype, device=H.device)
    U = torch.linalg.solve_triangular(M, eye, upper=False).flip(0, 1)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].T.contiguous()  # the block transposed: column j is row j, contiguous
        U1 = U[i1:i2, i1:i2]
        d = U1.diagonal()
        score = W1.pow(2) / d.pow(2)[:, None]
        k = int(math.floor(ratio * score.numel()))
        keep = torch.ones_like(W1)
        if k > 0:
            idx = torch.topk(score.flatten(), k, largest=False, sorted=False).indices
            keep.view(-1)[idx] = 0.0
        drop = (1.0 - keep) / d[:, None]
        Err1 = torch.empty_like(W1)
        for j in range(i2 - i1):
            # err_j = (w_j - q_j) / U_jj, q_j = w_j with the selected weights zeroed;
            # the update of column j itself leaves exactly q_j there (zeroed below).
            err = torch.mul(W1[j], drop[j], out=Err1[j])
            W1[j:].addr_(U1[j, j:], err, alpha=-1.0)
        W[:, i1:i2] = W1.mul_(keep).T
        W[:, i2:].addmm_(Err1.T, U[i1:i2, i2:], alpha=-1.0)
    return W.to(weight.dtype)


def ffn_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The weights SparseGPT prunes (App. C: every FFN's gate, up and down), named
    ``layers.<i>.mlp.<proj>``."""
    return {f"layers.{i}.mlp.{k}": _plain_linear(getattr(mlp, k), f"layers.{i}.mlp.{k}").weight
            for i, mlp in enumerate(ffn_modules(model)) for k in ("gate_proj", "up_proj", "down_proj")}


def _capture_layer0(model: nn.Module, batches) -> tuple[list[torch.Tensor], list[dict]]:
    """Run the model up to the first transformer block; return its inputs and kwargs
    (attention mask, rotary embeddings, positions) per micro-batch."""

    class _Stop(Exception):
        pass

    inps, kws = [], []

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        inps.append(hidden.detach())
        kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        kw["use_cache"] = False
        kw.pop("past_key_values", None)
        kw.pop("past_key_value", None)
        kws.append(kw)
        raise _Stop

    handle = decoder_layers(model)[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for ids, att in batches:
            try:
                model(input_ids=ids, attention_mask=att, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return inps, kws


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def _ffn_inputs(mlp: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While open, ``mlp`` records each input it gets and adds nothing to the residual stream
    (it returns zeros), so its decoder block returns the residual its FFN would add to."""
    xs: list[torch.Tensor] = []

    def record(x, *args, **kwargs):
        xs.append(x)
        return torch.zeros_like(x)

    mlp.forward = record  # an instance attribute shadows the class's forward until deleted
    try:
        yield xs
    finally:
        del mlp.forward


def gram(tensors: Sequence[torch.Tensor], valid: Sequence[torch.Tensor], block: int = 256) -> torch.Tensor:
    """``X^T X / n`` in float32 over the rows of ``tensors`` (each ``[..., cols]``) where
    ``valid`` holds, ``n`` the number of those rows.  The matrix is symmetric, so only the
    blocks on and above the diagonal are multiplied (about half the FLOPs of ``X^T X``
    for ``cols`` much wider than ``block``); the rest is their transpose."""
    cols = tensors[0].shape[-1]
    G = torch.zeros(cols, cols, dtype=torch.float32, device=tensors[0].device)
    n = 0
    for t, v in zip(tensors, valid):
        x = t[v].float()
        for i in range(0, cols, block):
            G[i:i + block, i:].addmm_(x[:, i:i + block].T, x[:, i:])
        n += x.shape[0]
    upper = G.triu()
    return (upper + upper.triu(1).T) / max(n, 1)


@torch.no_grad()
def sparsegpt_prune(
    model: nn.Module,
    calib: Calibration,
    ratio: float,
    blocksize: int = 128,
    percdamp: float = 0.01,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = True,
) -> Snapshot:
    """Prune the fraction ``ratio`` of every FFN weight (gate, up, down) with SparseGPT,
    layer by layer on the outputs of the already-pruned layers (App. C; attention
    weights stay dense).  Returns the restore snapshot.

    Per layer: one forward of the block with its FFN set aside (:func:`_ffn_inputs`) records
    the FFN input x and the residual stream that the FFN adds to; W_gate and W_up are pruned
    with ``H = 2 X X^T / n`` of x; W_down with the Hessian of its input
    ``h = SiLU(W_gate x) * W_up x`` computed from the *pruned* gate/up (sequential inside
    the block); the residual plus the pruned FFN's output (what the pruned model computes)
    feeds the next layer.  The dense FFN's output is never needed, so it is not computed.
    Padding tokens are excluded from the Hessians (:func:`gram`).
    """
    layers = decoder_layers(model)
    mlps = ffn_modules(model)
    snap = Snapshot(list(ffn_weights(model).values()))
    device = next(model.parameters()).device
    batches = pad_batches(calib, batch_size, pad_id, device)
    valid = [att.bool() for _, att in batches]
    inps, kws = _capture_layer0(model, batches)

    for li in progress_bar(range(len(layers)), desc="sparsegpt", disable=not progress):
        layer, mlp = layers[li], mlps[li]
        with _ffn_inputs(mlp) as xs:
            residual = [_layer_out(layer(inps[b], **kws[b])) for b in range(len(batches))]
        Hx = 2.0 * gram(xs, valid)
        for k in ("gate_proj", "up_proj"):
            lin = getattr(mlp, k)
            lin.weight.copy_(sparsegpt_matrix(lin.weight, Hx, ratio, blocksize, percdamp))
        del Hx
        hs = [mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) for x in xs]
        Hh = 2.0 * gram(hs, valid)
        mlp.down_proj.weight.copy_(sparsegpt_matrix(mlp.down_proj.weight, Hh, ratio, blocksize, percdamp))
        del Hh
        inps = [r + mlp.down_proj(h) for r, h in zip(residual, hs)]
    return snap


# --------------------------------------------------------------------------- registry
@dataclass
class Applied:
    """A deployment perturbation in force; ``restore()`` (or leaving ``with``) undoes it."""

    family: str
    strength: float
    _undo: Callable[[], None]
    info: dict

    def restore(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


# Every family takes the common keywords (calib, pad_id, batch_size: a sweep passes the
# same ones to all) plus its own; any other keyword is an error, never silently dropped.
PERTURBATIONS: Registry[Callable] = Registry("perturbation family", "family")


@PERTURBATIONS.register("gaussian")
def _gaussian(model, sigma, seed, *, calib=None, pad_id=0, batch_size=8):
    fc = FFNChannels(model)
    fc.set(xi=sample_xi(float(sigma), fc.shape, seed=seed)).attach()
    return fc.detach, {}


@PERTURBATIONS.register("dropout")
def _dropout(model, p, seed, *, calib=None, pad_id=0, batch_size=8):
    fc = FFNChannels(model)
    keep = dropout_mask(float(p), fc.shape, seed=seed)
    fc.set(mask=keep).attach()
    return fc.detach, {"dropped": int((keep == 0).sum())}


@PERTURBATIONS.register("fisher")
def _fisher(model, r, seed, *, calib=None, pad_id=0, batch_size=8, scores=None, scope="global"):
    if scores is None:
        if calib is None:
            raise ValueError("fisher pruning needs calib=<list of token sequences> or scores=<[L, C] tensor>")
        scores = fisher_scores(model, calib, batch_size=batch_size, pad_id=pad_id)
    keep = fisher_prune_mask(scores, float(r), scope)
    return prune_channels(model, keep).restore, {"dropped": int((keep == 0).sum()), "scope": scope}


@PERTURBATIONS.register("sparsegpt")
def _sparsegpt(model, r, seed, *, calib=None, pad_id=0, batch_size=8, blocksize=128, percdamp=0.01, pruned=None):
    if pruned is not None:  # this model's FFN weights pruned at r before (:func:`ffn_weights` names): put in place
        weights = ffn_weights(model)
        snap = Snapshot(list(weights.values()))
        with torch.no_grad():
            for name, w in weights.items():
                w.copy_(pruned[name])
        return snap.restore, {}
    if calib is None:
        raise ValueError("sparsegpt needs calib=<list of token sequences> (App. C: 128 sequences)")
    snap = sparsegpt_prune(model, calib, float(r), blocksize, percdamp, batch_size, pad_id)
    return snap.restore, {}


@PERTURBATIONS.register("rtn")
def _rtn(model, bits, seed, *, calib=None, pad_id=0, batch_size=8, group_size=128):
    if float(bits) != int(bits):
        raise ValueError(f"rtn strength is a bit width (2..8), got {bits}")
    return rtn_quantize(model, int(bits), group_size).restore, {"group_size": group_size}


def plane_directions(shape, direction_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The two fixed unit-variance channel directions ``xi_1, xi_2 ~ N(0, I)`` of the
    reward-landscape plane (Sec. 5.2, Fig. 4): drawn from ``direction_seed`` alone, so
    every method is evaluated on the same plane."""
    base = 2 * int(direction_seed)
    return sample_xi(1.0, shape, seed=base + 1_000_001), sample_xi(1.0, shape, seed=base + 1_000_002)


@PERTURBATIONS.register("plane")
def _plane(model, w1, seed, *, calib=None, pad_id=0, batch_size=8, w2=0.0, direction_seed=0):
    """Reward-landscape point (Fig. 4): ``h <- h * (1 + w1 xi_1 + w2 xi_2)`` with the
    fixed directions of :func:`plane_directions`; the evaluation seed plays no part."""
    fc = FFNChannels(model)
    d1, d2 = plane_directions(fc.shape, direction_seed)
    fc.set(xi=float(w1) * d1 + float(w2) * d2).attach()
    return fc.detach, {"w2": float(w2), "direction_seed": int(direction_seed)}


# ----------------------------------------------------------------------------- the families' facts
@dataclass(frozen=True)
class FamilySpec:
    """Everything known about one family, in one place: the evaluator checks strengths
    against it, the plans take App. C's levels from it, the figures and tables their labels."""

    label: str  #: name in tables and figure titles
    symbol: str  #: the strength's name in words (error messages)
    latex: str  #: the strength's symbol in LaTeX table headers (``$\sigma=.20$``)
    axis: str  #: x-axis label of a curve
    range_text: str  #: the valid range, in words
    valid: Callable[[float], bool]  #: whether a strength is in that range
    levels: dict[str, tuple[float, ...]] = field(default_factory=dict)  #: App. C's sweep per environment
    random: bool = False  #: draws per evaluation seed (else deterministic given the model)
    calibrated: bool = False  #: needs the shared calibration pool
    zero_is_identity: bool = False  #: strength 0 changes nothing (such a cell is the clean cell)


#: ``clean``, the five deployment families of App. C (SparseGPT's levels differ per
#: environment) and ``plane``, the reward-landscape grid of Fig. 4.
FAMILIES: dict[str, FamilySpec] = {
    "clean": FamilySpec("Clean", "none", "", "", "0 (no perturbation)", lambda s: s == 0),
    "gaussian": FamilySpec("Gaussian", "sigma", r"\sigma", r"$\sigma$", "0 <= sigma (finite); App. C sweeps 0.02-0.20",
                           lambda s: 0 <= s < math.inf,
                           {"alfworld": (0.02, 0.05, 0.10, 0.15, 0.20), "webshop": (0.02, 0.05, 0.10, 0.15, 0.20)},
                           random=True, zero_is_identity=True),
    "dropout": FamilySpec("Dropout", "p", "p", "$p$", "0 <= p < 1; App. C sweeps 0.01-0.05", lambda s: 0 <= s < 1,
                          {"alfworld": (0.01, 0.02, 0.03, 0.04, 0.05), "webshop": (0.01, 0.02, 0.03, 0.04, 0.05)},
                          random=True, zero_is_identity=True),
    "fisher": FamilySpec("Structured pruning", "r", "r", "$r$", "0 <= r < 1; App. C sweeps 0.05-0.20",
                         lambda s: 0 <= s < 1, {"alfworld": (0.05, 0.10, 0.15, 0.20), "webshop": (0.05, 0.10, 0.15, 0.20)},
                         calibrated=True, zero_is_identity=True),
    "sparsegpt": FamilySpec("Unstructured pruning", "r", "r", "$r$",
                            "0 <= r < 1; App. C sweeps 0.1-0.4 (WebShop), 0.1-0.7 (ALFWorld)", lambda s: 0 <= s < 1,
                            {"alfworld": (0.10, 0.30, 0.50, 0.70), "webshop": (0.10, 0.20, 0.30, 0.40)},
                            calibrated=True, zero_is_identity=True),
    "rtn": FamilySpec("Quantization", "bits", "bits", "bits", "an integer bit width 2..8; App. C uses 8, 6, 4",
                      lambda s: float(s).is_integer() and 2 <= s <= 8, {"alfworld": (8, 6, 4), "webshop": (8, 6, 4)}),
    "plane": FamilySpec("Landscape plane", "w1", "w_1", "$w_1$",
                        "any finite weight of the first landscape direction (Fig. 4 grid); w2 is an option",
                        lambda s: math.isfinite(s)),
}

#: App. C sweep levels, family -> env -> strengths (read from :data:`FAMILIES`).
PAPER_LEVELS: dict[str, dict[str, list[float]]] = {f: {env: list(v) for env, v in spec.levels.items()}
                                                   for f, spec in FAMILIES.items() if spec.levels}


def is_identity(family: str, strength: float, options: Mapping | None = None) -> bool:
    """Whether a setting changes nothing: ``clean``, a family's zero strength where that is the
    identity, or the landscape plane's origin (w1 = 0 and its option w2 = 0)."""
    if family == "plane":
        return strength == 0 and float((options or {}).get("w2", 0.0)) == 0
    return family in ("clean", "none") or (family_spec(family).zero_is_identity and strength == 0)


def family_spec(family: str) -> FamilySpec:
    """The :class:`FamilySpec` of ``family``, or one ValueError listing the known families."""
    if family not in FAMILIES:
        raise ValueError(f"unknown perturbation family {family!r}; expected one of {list(FAMILIES)}")
    return FAMILIES[family]


def apply_perturbation(model: nn.Module, family: str, strength: float, seed: int = 0, **kwargs) -> Applied:
    """Apply one deployment perturbation to ``model`` (in place / by hooks).

    Args:
        family: one of :data:`PERTURBATIONS` (``"none"`` is accepted as a no-op).
        strength: sigma, p, pruning ratio r, or RTN bit width, by family.
        seed: seed of the random families (gaussian, dropout).
        kwargs: ``calib`` (fisher, sparsegpt), ``scores``/``scope`` (fisher),
            ``group_size`` (rtn), ``blocksize``/``percdamp`` (sparsegpt), ``pad_id``.
    """
    if family == "none":
        return Applied("none", 0.0, lambda: None, {})
    if family not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {family!r}; expected one of {['none', *PERTURBATIONS]}")
    fn = PERTURBATIONS.get(family)
    valid = [n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    bad = sorted(set(kwargs) - set(valid))
    if bad:
        raise ValueError(f"perturbation {family!r} takes no keyword(s) {bad}; valid: {valid}")
    undo, info = fn(model, strength, seed, **kwargs)
    return Applied(family, float(strength), undo, info)


@contextmanager
def perturbation(model: nn.Module, family: str, strength: float, seed: int = 0, **kwargs) -> Iterator[Applied]:
    """``with perturbation(model, "rtn", 4): ...`` -- restored on exit, even on error."""
    applied = apply_perturbation(model, family, strength, seed, **kwargs)
    try:
        yield applied
    finally:
        applied.restore()
