"""``sprpo-bench ops``: where one Vanilla update on a real rollout batch spends its time, op class by
op class, each class against its own roofline.

Every ATen op the update runs (forward, backward, optimizer) is timed where it executes, below
autograd (``TorchDispatchMode``), and sorted into:

- ``matmul``: ``mm``, ``addmm``, ``bmm`` and their in-place forms (the linears, the LoRA factors,
  the LM head): FLOPs against the matmul rate probed at the model's shapes;
- ``attention``: the fused SDPA kernels, forward and backward: FLOPs of the full query x key
  rectangle (masked entries included, :func:`attention_flops`)
  against the same matmul rate;
- ``memory``: every other op that writes new memory (elementwise maths, norms, copies,
  concatenations, reductions): bytes read and written against the measured memory bandwidth;
- ``views``: ops that return a view of their input, and bare allocations (no bytes moved).

What the update spends outside the ops (Python, the autograd engine, dispatch) is its wall time,
measured once without the spy just before, less the ops' sum.  ``eager_bound_s`` is what the
same op-at-a-time execution would take with every matmul at the probed rate and every memory op
at the measured bandwidth, attention as measured and nothing outside the ops: a lower bound on an eager update, to set
against its FLOP floor.  Operands that stay in cache can beat the bandwidth, so a memory class
above 1.0x of it is possible, and the bound is approximate there.

The matmuls are also split by their smallest dimension (:data:`MATMUL_SIZES`): the adapters'
rank-16 factors and their gradients, and the rows of a short own part, run far below the rate
probed at the model's shapes, which is the rate of the large ones.  And by role
(:func:`matmul_role`): attention's batched matmuls, the adapters' factors, the LM head, and the
model's linears with few rows or many, each with the seconds it spends above the roofline, so
that the next lever goes where those seconds are."""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sprpo_lib.bench.suite import (
    actor_passes,
    method_variants,
    phase_flops,
    prefill_rate,
    restore_point,
    rollout_batch,
    warm_up,
)
from sprpo_lib.core import metrics as MK
from sprpo_lib.infra import hardware as hw

#: FLOPs of an attention backward over its forward: S = QK^T recomputed, dV, dP, dQ, dK (5 matmuls
#: against the forward's 2), as FlashAttention-2 counts them.
BACKWARD_FLOPS = 2.5


def attention_flops(q_shape, k_shape) -> float:
    """Forward FLOPs of one call: QK^T and PV over the full query x key rectangle (masked
    entries included: a dense kernel computes them), ``q_shape`` ``(B, H, Tq, D)``."""
    b, h, tq, d = q_shape
    return 4.0 * b * h * tq * k_shape[2] * d


CLASSES = ("matmul", "attention", "memory", "views")
ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}
ATTENTION_FORWARD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
TOP = 6  # ops listed per class
#: bins of a matmul's smallest dimension (rows M, inner K, columns N): ``(upper bound, label)``
MATMUL_SIZES = ((64, "<= 64 (low-rank factors, short rows)"), (255, "65-255"), (None, ">= 256"))


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _operands(name: str, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    return (args[1], args[2]) if name.startswith(("addmm", "baddbmm")) else (args[0], args[1])


def matmul_flops(name: str, args: tuple) -> float:
    """FLOPs of one matmul op: ``2 M K N`` (per batch entry for the batched forms)."""
    a, b = _operands(name, args)
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def matmul_size(name: str, args: tuple) -> str:
    """The :data:`MATMUL_SIZES` label of one matmul op by ``min(M, K, N)``."""
    a, b = _operands(name, args)
    small = min(a.shape[-2], a.shape[-1], b.shape[-1])
    return next(label for bound, label in MATMUL_SIZES if bound is None or small <= bound)


#: matmul roles (:func:`matmul_role`), in the report's order
ROLES = ("attention (batched matmuls)", "adapter factors (a dimension = the LoRA rank)",
         "LM head (a dimension = the vocabulary)", "model linears, < 256 rows", "model linears, >= 256 rows")


def matmul_role(name: str, args: tuple, ranks: frozenset[int], vocab: int) -> str:
    """The :data:`ROLES` label of one matmul op: ``bmm``/``baddbmm`` are attention (the only
    batched matmuls of the passes); an operand dimension equal to the vocabulary size is the LM
    head, one equal to an adapter rank in ``ranks`` an adapter factor or its gradient (a
    micro-batch of exactly that many tokens would be counted here too); the rest are the
    model's linears, split at 256 rows (tokens, or the output dimension of a weight gradient)."""
    if name.startswith(("bmm", "baddbmm")):
        return ROLES[0]
    a, b = _operands(name, args)
    dims = {a.shape[-2], a.shape[-1], b.shape[-1]}
    if vocab in dims:
        return ROLES[2]
    if dims & ranks:
        return ROLES[1]
    return ROLES[3] if a.shape[-2] < 256 else ROLES[4]


def classify(name: str, args: tuple, out) -> tuple[str, float]:
    """``(class, work)`` of one op: FLOPs for ``matmul`` and ``attention``, bytes read and written
    for ``memory``, 0 for ``views`` (an output sharing its input's storage)."""
    if name in MATMULS:
        return "matmul", matmul_flops(name, args)
    base = name.removesuffix("_backward")
    if base in ATTENTION_FORWARD:
        q, k = (args[1], args[2]) if name.endswith("_backward") else (args[0], args[1])
        f = attention_flops(tuple(q.shape), tuple(k.shape))
        return "attention", f * (BACKWARD_FLOPS if name.endswith("_backward") else 1.0)
    if name in ALLOCATIONS:
        return "views", 0.0
    ins, outs = _tensors(args), _tensors(out)
    storages = {t.untyped_storage().data_ptr() for t in ins if t.numel()}
    if outs and all(t.untyped_storage().data_ptr() in storages for t in outs if t.numel()) and not name.endswith("_"):
        return "views", 0.0
    return "memory", float(sum(t.numel() * t.element_size() for t in ins + outs))


class Tallies:
    """One phase's op tallies, each ``[calls, seconds, work]``: ``stats[(class, op)]``, the
    matmuls again by size, ``sizes[label]`` (:func:`matmul_size`), and by role, ``roles[label]``
    (:func:`matmul_role`; none without the adapter ranks and vocabulary)."""

    def __init__(self):
        self.stats: dict = defaultdict(lambda: [0, 0.0, 0.0])
        self.sizes: dict = defaultdict(lambda: [0, 0.0, 0.0])
        self.roles: dict = defaultdict(lambda: [0, 0.0, 0.0])


class OpClock(TorchDispatchMode):
    """Times every op inside the block into the :class:`Tallies` of the phase running it:
    ``parts[phase()]`` (``phase``: e.g. the actor's :attr:`~sprpo_lib.core.actor.Actor.phase`,
    so an SPrPO update's ops and its replay's fall apart); without one, every op is in
    ``parts["all"]``, which ``stats``, ``sizes`` and ``roles`` read.  Roles need the adapter
    ``ranks`` and ``vocab``."""

    def __init__(self, ranks: frozenset[int] = frozenset(), vocab: int | None = None, phase=None):
        super().__init__()
        self.parts: dict[str, Tallies] = defaultdict(Tallies)
        self.ranks, self.vocab = frozenset(ranks), vocab
        self.phase = phase or (lambda: "all")

    stats = property(lambda self: self.parts["all"].stats)
    sizes = property(lambda self: self.parts["all"].sizes)
    roles = property(lambda self: self.parts["all"].roles)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        name = func.overloadpacket.__name__
        cls, work = classify(name, args, out)
        part = self.parts[self.phase()]
        tallies = [part.stats[(cls, name)]]
        if cls == "matmul":
            tallies.append(part.sizes[matmul_size(name, args)])
            if self.vocab is not None:
                tallies.append(part.roles[matmul_role(name, args, self.ranks, self.vocab)])
        for s in tallies:
            s[0] += 1
            s[1] += dt
            s[2] += work
        return out


def _matmul_rows(tallies: dict, labels, key: str, rate: float) -> list[dict]:
    """One record row per label with calls (``{key: label}``, calls, seconds, GFLOP, x ``rate``
    and the seconds above it), in ``labels``' order, labels without a call left out."""
    return [{key: label, "calls": v[0], "seconds": round(v[1], 3), "gflop": round(v[2] / 1e9, 2),
             "rate_over_roofline": round(v[2] / v[1] / rate, 3) if v[1] else None,
             "above_roofline_s": round(v[1] - v[2] / rate, 3)}
            for label, v in ((label, tallies[label]) for label in labels) if v[0]]


def phase_record(t: Tallies, name: str, wall: float, spied: float, floor: float, roof: dict) -> dict:
    """One phase's seconds by op class (``name``: ``update`` or ``extra``, the keys' prefix):
    per class seconds, work, rate against its roofline (``roof``: FLOP/s or bytes/s per class) and
    the top ops; the matmuls by size and role; the time outside the ops (``wall`` less their sum);
    the eager bound against the phase's FLOP ``floor``."""
    unit = {"matmul": "GFLOP", "attention": "GFLOP", "memory": "GB", "views": "-"}
    classes: dict = {}
    for cls in CLASSES:
        ops = sorted(((op, v) for (c, op), v in t.stats.items() if c == cls), key=lambda kv: -kv[1][1])
        secs, work = sum(v[1] for _, v in ops), sum(v[2] for _, v in ops)
        row = {"seconds": round(secs, 3), "calls": sum(v[0] for _, v in ops), "share_of_wall": round(secs / wall, 3),
               "work": round(work / 1e9, 2), "unit": unit[cls],
               "top": [{"op": op, "calls": v[0], "seconds": round(v[1], 3), "work": round(v[2] / 1e9, 2)}
                       for op, v in ops[:TOP]]}
        if cls in roof and secs:
            row["rate"] = round(work / secs / 1e9, 1)
            row["roofline"] = round(roof[cls] / 1e9, 1)
            row["rate_over_roofline"] = round(work / secs / roof[cls], 3)
            row["at_roofline_s"] = round(work / roof[cls], 3)
        classes[cls] = row
    ops_s = sum(r["seconds"] for r in classes.values())
    bound = classes["matmul"].get("at_roofline_s", 0) + classes["memory"].get("at_roofline_s", 0) + classes["attention"]["seconds"]
    return {f"{name}_s": round(wall, 3), "floor_s": round(floor, 4), f"{name}_over_floor": round(wall / floor, 2),
            f"spied_{name}_s": round(spied, 2), "ops_s": round(ops_s, 2), "outside_ops_s": round(max(wall - ops_s, 0.0), 2),
            "classes": classes, "matmul_sizes": _matmul_rows(t.sizes, [label for _, label in MATMUL_SIZES], "size", roof["matmul"]),
            "matmul_roles": _matmul_rows(t.roles, ROLES, "role", roof["matmul"]),
            "eager_bound_s": round(bound, 2), "eager_bound_over_floor": round(bound / floor, 2)}


#: the methods ``bench ops`` times: Vanilla's update, or SPrPO's update and its S_hat replay (Alg. 1 line 7)
OPS_METHODS = ("vanilla", "sprpo")


def bench_ops(profile: str = "cpu", env: str = "webshop", overrides: list[str] | None = None,
              method: str = "vanilla") -> dict:
    """``method``'s update on one rollout batch of ``profile``: its wall time and FLOP floor (as
    ``bench train``'s shared passes), then the same update again under :class:`OpClock`, per
    class seconds, work, rate against its roofline and the top ops; ``eager_bound_s``.  SPrPO
    (under its xi): the update as Vanilla's, and line 7's replay apart (``extra``)."""
    if method not in OPS_METHODS:
        raise ValueError(f"bench ops --method: expected one of {', '.join(OPS_METHODS)}, got {method!r}")
    tr, batch, _, xi, _, setup = rollout_batch(profile, env, overrides)
    xi = xi if method == "sprpo" else None
    a = tr.actor
    config = tr.policy.model.config
    restore = restore_point(a)
    mcfg = method_variants(tr.cfg.method)[method]
    warm_up(tr, batch, mcfg, xi)  # tr.method stays this method for the timed updates
    gflops, bandwidth = prefill_rate(config, tr.dtype), hw.probe_bandwidth()
    restore()
    wall = tr.update(batch.without_old(), xi, 0)
    restore()
    ranks = frozenset(p.shape[0] for n, p in a.model.named_parameters() if "lora_A" in n)
    clock = OpClock(ranks, config.vocab_size, phase=lambda: a.phase)
    with clock:
        spied = tr.update(batch.without_old(), xi, 0)
    steps = len(batch.mini_batches(a.mini_batch)) * a.epochs
    passes = actor_passes(tr, batch, a.reuse_frozen, first_step_logp=a.first_step_logp)[method]
    roof = {"matmul": gflops * 1e9, "attention": gflops * 1e9, "memory": bandwidth * 1e9}
    floor = {k: phase_flops(config, passes, a.prefix_min, k) / (gflops * 1e9) for k in (MK.UPDATE_S, MK.SENSITIVITY_S)}
    out = {"profile": profile, "env": env, "overrides": list(overrides or []), "method": method, "dtype": tr.dtype,
           "setup_s": round(setup, 2), "samples": len(batch.samples), "prefix_min": a.prefix_min,
           "reuse_frozen": a.reuse_frozen, "ppo_steps": steps, "matmul_gflops": round(gflops, 1),
           "bandwidth_gbs": round(bandwidth, 1),
           **phase_record(clock.parts[MK.UPDATE_S], "update", wall[MK.UPDATE_S], spied[MK.UPDATE_S], floor[MK.UPDATE_S], roof)}
    if method == "sprpo":
        out["extra"] = phase_record(clock.parts[MK.SENSITIVITY_S], "extra", wall[MK.SENSITIVITY_S],
                                    spied[MK.SENSITIVITY_S], floor[MK.SENSITIVITY_S], roof)
    return out
