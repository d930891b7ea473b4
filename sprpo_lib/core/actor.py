"""The actor: the operations every method's update is written with (verl's actor).

All of them take explicit tensors.  ``xi`` is the FFN-channel perturbation of the pass
(``None``: unperturbed); a leaf ``xi`` (or ``gain``) that requires grad receives
``dloss/dxi`` (``dloss/du`` at u = 1) from :meth:`Actor.backward`.  ``loss`` is the
negative of the paper's objective, so ``dL/dv = -dloss/dv``.

``terms`` says what is differentiated:

* ``SURROGATE``: the clipped surrogate ``L_k`` alone (Sec. 5; Alg. 1 line 7; Alg. 4
  line 3): what SPrPO's sensitivity and gradient norm and SAM's channel gradient are
  defined on;
* ``TRAIN`` = surrogate + entropy bonus + KL-to-reference loss (when their
  coefficients are non-zero): what the optimizer steps on (verl's actor loss).
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager, nullcontext
from itertools import chain
from typing import Iterator

import torch

from sprpo_lib.core import metrics as MK
from sprpo_lib.core.batch import Batch, MicroBatch
from sprpo_lib.core.config import SpeedConfig, UpdateConfig
from sprpo_lib.core.losses import (
    agg_loss,
    get_policy_loss,
    kl_penalty,
    token_entropy,
    token_logprobs,
    token_logprobs_entropy,
)
from sprpo_lib.core.perturb import FFNChannels, below_resolution, float32_compute
from sprpo_lib.model.fused import fused_kernels
from sprpo_lib.model.layers import (
    below_layer,
    checkpointed_layers,
    decoder_layers,
    from_layer,
    has_dropout,
    lowest_trainable_layer,
    native_gqa,
)
from sprpo_lib.model.lora import fused_lora

SURROGATE = frozenset({"surrogate"})
TRAIN = frozenset({"surrogate", "entropy", "kl"})


def prefix_cache():
    """A cache of a shared prefix's keys and values that a forward reads and never extends:
    ``update`` returns the prefix followed by the new states and leaves the cache as it was,
    so the prefix's length (what the attention mask is built from) stays put and a layer
    recomputed by activation checkpointing reads the same states.  ``store`` fills it."""
    from transformers import DynamicCache  # heavy (seconds to import): loaded on first use

    class PrefixCache(DynamicCache):
        def store(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int) -> None:
            DynamicCache.update(self, keys, values, layer_idx)

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            layer = self.layers[layer_idx]
            return torch.cat([layer.keys, key_states], -2), torch.cat([layer.values, value_states], -2)

    return PrefixCache()


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Within it, :attr:`nbytes` counts the storage the autograd graph saves for the
    backward (each storage once; ``model``'s parameters, held anyway, not counted)."""

    def __init__(self, model: torch.nn.Module):
        self.nbytes = 0
        self._skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> "SavedBytes":
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._skip and ptr not in self._seen:
            self._seen.add(ptr)
            self.nbytes += st.nbytes()
        return t


class Actor:
    """Policy model + Adam over its trainable (LoRA) parameters + the FFN channels.

    Args:
        model: the (peft) causal LM; ``pad_id`` its tokenizer's pad token; ``opt`` the
            optimizer over its trainable parameters.
        update: the update's knobs (:class:`sprpo_lib.core.config.UpdateConfig`: loss, clip,
            micro- and mini-batches, epochs, KL).  Micro-batches are cut from the
            length-sorted batch (``sort_micro_batches = False`` keeps batch order).
        speed: the speed levers (:class:`sprpo_lib.core.config.SpeedConfig`, each documented
            there): the same steps up to float rounding.
    """

    def __init__(self, model, pad_id: int, opt: torch.optim.Optimizer, update: UpdateConfig | None = None,
                 speed: SpeedConfig | None = None):
        u, sp = update or UpdateConfig(), speed or SpeedConfig()
        self.model, self.pad_id, self.opt = model, pad_id, opt
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.grad_clip = u.grad_clip
        self.loss_fn = get_policy_loss(u.loss_name)
        self.loss_cfg = u.loss
        self.micro_batch = u.micro_batch
        self.sort_micro_batches = True
        self.kl_coef, self.kl_type = u.kl_coef, u.kl_type
        self.mini_batch, self.epochs = u.ppo_mini_batch_size, u.ppo_epochs
        for f in dataclasses.fields(sp):  # each lever an attribute of its own name (self.prefix_min, ...)
            setattr(self, f.name, getattr(sp, f.name))
        self.replay_graph_gb = float(sp.replay_graph_gb)
        self._frozen: dict[int, torch.Tensor] | None = None  # per sample: hidden states below the trainable layers
        self._graph: dict[int, torch.Tensor] | None = None  # per sample: those states with their graph from _graph_xi
        self._graph_xi: torch.Tensor | None = None
        self.graph_bytes = 0  # the saved activations the last kept graph holds
        self.graph_rows: set[int] = set()  # ids of the samples whose graph the last update kept
        self._link_prefix = False  # passes: a prefix's keys and values enter the rows' graph as they are
        self._first_layer = 0  # the layer the current pass starts at (from kept hidden states: > 0)
        self._stack: torch.nn.Module | None = None  # the decoder stack below that layer (passes(frozen="below"))
        self.fc = FFNChannels(model)
        self.shape = self.fc.shape
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.timers: dict[str, float] = {}
        self._timer = MK.UPDATE_S
        self.side_grads: list[torch.Tensor | None] | None = None  # backward(split_regularisers=True)
        self._group_leaves: list[torch.Tensor] = []  # the current prefix's key/value leaves (passes)

    # ------------------------------------------------------------------ timing
    @contextmanager
    def timing(self, name: str):
        """Seconds of the passes inside the block are added to ``timers[name]``."""
        prev, self._timer = self._timer, name
        try:
            yield
        finally:
            self._timer = prev

    @property
    def phase(self) -> str:
        """The timer the passes running now add to (``update_s``, or ``sensitivity_s`` inside
        :meth:`timing`): what ``sprpo-bench ops`` files each op under."""
        return self._timer

    def _tick(self, t0: float) -> None:
        if self.device.type == "cuda":  # the kernels a pass queued count in its timer, not in a later one's
            torch.cuda.synchronize(self.device)
        self.timers[self._timer] = self.timers.get(self._timer, 0.0) + time.perf_counter() - t0

    # ------------------------------------------------------------------ forward
    def _logits(self, mb: MicroBatch, past: list[torch.Tensor] | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits predicting each response token of ``mb`` (``[B, R, V]``); after a shared
        prefix, ``past`` holds its keys and values per layer (``[1, heads, P, d]``).
        ``embeds``: the rows' hidden states at the first layer run (:func:`from_layer`)."""
        R = mb.tgt.shape[1]
        inputs = {"input_ids": mb.ids} if embeds is None else {"inputs_embeds": embeds}
        if self._stack is not None:  # below the lowest trainable layer (passes(frozen="below")): its input
            inputs["attention_mask"] = mb.att
            if mb.prefix_len:
                inputs.update(position_ids=mb.pos, past_key_values=self._cache_of(past, mb.ids.shape[0]), use_cache=True)
            return self._stack(**inputs).last_hidden_state
        if not mb.prefix_len:
            return self.model(**inputs, attention_mask=mb.att, use_cache=False, logits_to_keep=R + 1).logits[:, :-1]
        return self.model(**inputs, attention_mask=mb.att, position_ids=mb.pos, past_key_values=self._cache_of(
            past, mb.ids.shape[0]), use_cache=True, logits_to_keep=R + 1).logits[:, :-1]

    @staticmethod
    def _cache_of(past: list[torch.Tensor], rows: int):
        """A :func:`prefix_cache` holding a shared prefix's keys and values for ``rows`` rows."""
        cache = prefix_cache()
        for i in range(0, len(past), 2):
            cache.store(past[i].expand(rows, -1, -1, -1), past[i + 1].expand(rows, -1, -1, -1), i // 2)
        return cache

    def _row_states(self, mb: MicroBatch) -> torch.Tensor:
        """``[B, T, H]``: each row's kept hidden states (:attr:`_frozen`) laid out as ``mb``'s
        left-padded tokens (after its shared prefix); padding positions are zeros, which the
        attention mask hides."""
        B, T = mb.ids.shape
        out = None
        for j, s in enumerate(mb.samples):
            h = self._frozen[id(s)]
            if out is None:
                out = h.new_zeros(B, T, h.shape[-1])
            n = len(s.ids) - mb.prefix_len
            out[j, T - n:] = h[mb.prefix_len:]
        return out

    def _keep_states(self, mb: MicroBatch, hidden: torch.Tensor, prefix: torch.Tensor | None) -> None:
        """Store each row's hidden states (prefix part, then its own) from a pass's capture."""
        T = hidden.shape[1]
        for j, s in enumerate(mb.samples):
            own = hidden[j, T - (len(s.ids) - mb.prefix_len):]
            self._frozen[id(s)] = own if prefix is None else torch.cat([prefix, own])

    def passes(self, batch: Batch, sort: bool = True, on_prefix=None,
               frozen: str | None = None) -> Iterator[tuple[MicroBatch, torch.Tensor]]:
        """``(micro-batch, logits)`` over ``batch``, each prefix shared by a run of rows
        computed once (``prefix_min > 0``; :func:`sprpo_lib.core.batch.prefix_groups`).

        The rows after a prefix attend to its keys and values, which enter their micro-batches
        as leaves: once the caller has run the backward of a group's last micro-batch, the
        gradient the leaves collected flows through the prefix's own forward (LoRA, xi and
        gain receive both parts).  So a caller runs each micro-batch's backward before it asks
        for the next one, as a gradient-accumulation loop does.  The same function of the
        tokens as the whole rows (a causal model), up to float rounding.  ``on_prefix(roots,
        leaves)`` runs first at a group's end (a second gradient through the same prefix).

        ``frozen="keep"``: store every row's hidden states at the lowest trainable layer in
        :attr:`_frozen`; ``"use"``: start from them there (:func:`from_layer`); ``"below"``: run
        the layers below it alone (:func:`below_layer`), store the states there and yield them
        in place of logits."""
        start = lowest_trainable_layer(self.model) if frozen else 0
        keep: list[torch.Tensor] = []
        handle = None
        if frozen == "keep":
            def grab(module, args, kwargs):
                keep.append((args[0] if args else kwargs["hidden_states"]).detach())

            handle = decoder_layers(self.model)[start].register_forward_pre_hook(grab, with_kwargs=True)
        span = (from_layer(self.model, start) if frozen == "use" else below_layer(self.model, start)
                if frozen == "below" else nullcontext())
        try:
            with (span as stack, fused_kernels(self.model, self.fused_kernels), fused_lora(self.model, self.fused_lora),
                  native_gqa(self.model, self.native_gqa, self.attention, self.attention_chunk)):
                self._first_layer = start if frozen == "use" else 0
                self._stack = stack if frozen == "below" else None
                yield from self._passes(batch, sort, on_prefix, frozen, keep)
        finally:
            self._first_layer, self._stack = 0, None
            if handle is not None:
                handle.remove()

    def _passes(self, batch, sort, on_prefix, frozen, keep):
        use = frozen == "use"
        if not self.prefix_min:
            for mb in batch.micro_batches(self.micro_batch, self.pad_id, self.device, sort, self.micro_batch_tokens):
                logits = self._logits(mb, embeds=self._row_states(mb) if use else None)
                if frozen in ("keep", "below"):
                    self._keep_states(mb, keep.pop() if frozen == "keep" else logits, None)
                yield mb, logits
            return
        from transformers import DynamicCache  # heavy (seconds to import): loaded on first use

        for prefix, mbs in batch.shared_micro_batches(self.micro_batch, self.pad_id, self.device, self.prefix_min,
                                                      self.micro_batch_tokens):
            roots: list[torch.Tensor] = []
            leaves: list[torch.Tensor] | None = None
            kept_prefix = None
            if prefix is not None:
                if use:  # the rows of a group share the prefix's tokens, so any row's states serve
                    h = self._frozen[id(mbs[0].samples[0])][: prefix.shape[1]]
                    cache = self.model(inputs_embeds=h[None], past_key_values=DynamicCache(), use_cache=True,
                                       logits_to_keep=1).past_key_values
                elif frozen == "below":
                    out = self._stack(input_ids=prefix, past_key_values=DynamicCache(), use_cache=True)
                    cache, kept_prefix = out.past_key_values, out.last_hidden_state[0]
                else:
                    cache = self.model(input_ids=prefix, use_cache=True, logits_to_keep=1).past_key_values
                    if frozen == "keep":
                        kept_prefix = keep.pop()[0]
                roots = [t for layer in cache.layers for t in (layer.keys, layer.values)]
                leaves = roots if self._link_prefix else [t.detach().requires_grad_(t.requires_grad) for t in roots]
            self._group_leaves = leaves or []
            for mb in mbs:
                logits = self._logits(mb, leaves, self._row_states(mb) if use else None)
                if frozen in ("keep", "below"):
                    self._keep_states(mb, keep.pop() if frozen == "keep" else logits, kept_prefix)
                yield mb, logits
            if roots and on_prefix is not None:
                on_prefix(roots, leaves)
            self._group_leaves = []
            if self._link_prefix:  # the rows' graph holds the prefix's own
                continue
            pairs = [(r, lf.grad) for r, lf in zip(roots, leaves or []) if r.requires_grad and lf.grad is not None]
            if pairs:  # the prefix's share of the gradient
                torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])

    @torch.no_grad()
    def log_probs(self, batch: Batch, xi: torch.Tensor | None = None, frozen: str | None = None) -> list[torch.Tensor]:
        """Per-sample response-token log-probs under ``xi`` (no gradient); ``frozen``: as
        in :meth:`passes`."""
        t0 = time.perf_counter()
        by_sample: dict[int, torch.Tensor] = {}
        self.model.eval()
        self.fc.set(xi=xi)
        with self.fc, float32_compute(self.model, below_resolution(xi, self.dtype)):
            for mb, logits in self.passes(batch, self.sort_micro_batches, frozen=frozen):
                lp = token_logprobs(logits, mb.tgt)
                by_sample.update((id(s), lp[j, lp.shape[1] - s.n_resp:].float().cpu()) for j, s in enumerate(mb.samples))
        self.fc.clear()
        self._tick(t0)
        return [by_sample[id(s)] for s in batch.samples]  # micro-batches are length-sorted: back to batch order

    def fill_old_log_probs(self, batch: Batch, xi: torch.Tensor | None, frozen: str | None = None) -> None:
        """``old_logp`` of every sample at the current parameters (theta_k) under ``xi``."""
        for s, lp in zip(batch.samples, self.log_probs(batch, xi, frozen)):
            s.old_logp = lp

    def keep_states(self, batch: Batch, xi: torch.Tensor | None, graph_gb: float = 0.0) -> None:
        """Store in :attr:`_frozen` every row's hidden states at the input of the lowest
        trainable layer under ``xi``, from the layers below it alone (no log-probs).

        ``graph_gb > 0`` and a leaf ``xi`` that requires grad: the micro-batches keep their
        autograd graph (in :attr:`_graph`, the states in :attr:`_frozen` detached) until its
        saved activations reach ``graph_gb`` GiB; the rest run without one."""
        t0 = time.perf_counter()
        graph = graph_gb > 0 and xi is not None and xi.requires_grad
        held = SavedBytes(self.model)
        self.model.eval()
        self.fc.set(xi=xi)
        self._link_prefix = graph  # the rows' graph reaches xi through the prefix's own
        try:
            with (torch.set_grad_enabled(graph), held if graph else nullcontext(), self.fc,
                  float32_compute(self.model, below_resolution(xi, self.dtype))):
                for mb, _ in self.passes(batch, self.sort_micro_batches, frozen="below"):
                    if torch.is_grad_enabled():
                        self._graph.update({id(s): self._frozen[id(s)] for s in mb.samples})
                        self.graph_rows.update(id(s) for s in mb.samples)
                        if held.nbytes >= graph_gb * 2 ** 30:  # the budget: later micro-batches keep none
                            torch.set_grad_enabled(False)
        finally:
            self._link_prefix = False
            self._frozen = {k: v.detach() for k, v in self._frozen.items()}
        self.graph_bytes += held.nbytes
        self.fc.clear()
        self._tick(t0)

    def drop_graph(self) -> None:
        """Free the graph :meth:`keep_states` kept (:attr:`replay_graph_gb`)."""
        self._graph, self._graph_xi = None, None

    def first_step_rows(self, first: Batch, todo: Batch) -> set[int]:
        """Ids of the rows whose old log-probs the first optimizer step (on mini-batch
        ``first``) can take from its own forward (:attr:`first_step_logp`): the rows it runs,
        when every one of them is among ``todo`` (the rows without old log-probs) and the model
        drops nothing in training mode; else none."""
        if has_dropout(self.model):
            return set()
        rows = self.rows_with_gradient(first, self.loss_cfg.entropy_coeff != 0 or self.kl_coef != 0)
        ids, missing = {id(s) for s in rows.samples}, {id(s) for s in todo.samples}
        return ids if ids and ids <= missing else set()

    def fill_ref_log_probs(self, batch: Batch) -> None:
        """``ref_logp``: the reference policy (adapter disabled), unperturbed (verl's ref)."""
        todo = Batch([s for s in batch.samples if s.ref_logp is None])
        if not todo.samples:
            return
        with self.model.disable_adapter():
            lps = self.log_probs(todo, None)
        for s, lp in zip(todo.samples, lps):
            s.ref_logp = lp

    # ------------------------------------------------------------------ backward
    def rows_with_gradient(self, batch: Batch, regularised: bool) -> Batch:
        """The rows a backward pass must run.  Under the token-mean surrogate alone a row
        with A = 0 has the per-token loss -0 * ratio, whose gradient (in theta, xi and the
        channel gain) is exactly 0, whatever the ratio; the token-mean's denominator stays
        the whole batch's token count, so skipping the row leaves the gradient unchanged.
        GiGPO gives A = 0 to every step of a group whose episodes all scored alike (most
        rows of a batch without a success).  Entropy and KL terms, and the seq-mean
        aggregations, depend on every row: then all of them run."""
        if not self.skip_zero_adv or regularised or self.loss_cfg.loss_agg_mode != "token-mean":
            return batch
        return Batch([s for s in batch.samples if s.adv != 0.0])

    def backward(self, batch: Batch, xi: torch.Tensor | None = None, *, gain: torch.Tensor | None = None,
                 terms: frozenset = TRAIN, split_regularisers: bool = False) -> dict[str, float]:
        """Accumulate the gradient of ``loss = -(L_k [+ regularisers])`` over ``batch``.

        Old log-probs: a sample without ``old_logp`` takes this pass's own log-probs
        (ratio 1): correct only at theta_k under this ``xi``, which is where the first
        pass over a batch happens; :meth:`ppo_update` fills them beforehand whenever it
        takes more than one step.  Returns token-weighted statistics: ``loss`` and
        ``pg_loss`` over the whole batch, the ratio statistics over the rows that ran
        (:meth:`rows_with_gradient`), and ``grad_token_frac``, their share of the tokens.
        A pass that runs no row leaves zero gradients (as the pass over them would).

        ``split_regularisers``: one forward, two gradients: the surrogate's goes to ``.grad``
        (of the parameters, ``xi`` and ``gain``: what SPrPO's one-pass estimate reads), the
        entropy and KL terms' to :attr:`side_grads` (parameters only, through the adapted
        layers alone), which :meth:`add_side_grads` adds before a step.

        Long on purpose: the micro-batch loop keeps the forward, the two gradients and the token
        weighting of the statistics together, so one pass over the batch is read in one place."""
        t0 = time.perf_counter()
        need_ent = "entropy" in terms and self.loss_cfg.entropy_coeff != 0
        need_kl = "kl" in terms and self.kl_coef != 0
        if need_kl:  # before this pass's perturbation is set: the reference pass clears it
            self.fill_ref_log_probs(batch)
        self.model.train()
        self.fc.set(xi=xi, gain=gain)
        n_total = max(1, batch.n_tokens)
        rows = self.rows_with_gradient(batch, need_ent or need_kl)
        n_rows = max(1, rows.n_tokens)
        acc: dict[str, float] = {}
        split = split_regularisers and (need_ent or need_kl)
        self.side_grads = [None] * len(self.params) if split else None
        side_leaves: dict[int, torch.Tensor] = {}
        low = 2 * lowest_trainable_layer(self.model)  # keys/values below it lead to no parameter
        # the kept states below the trainable layers serve a pass that differentiates the parameters alone
        use_frozen = (self._frozen is not None and gain is None and not (xi is not None and xi.requires_grad)
                      and all(id(s) in self._frozen for s in rows.samples))
        runs = [(rows, "use" if use_frozen else None)]
        graph = self._graph is not None and xi is self._graph_xi and gain is None and not split
        if graph:  # the replay: kept rows from their states (leaves), then one backward through their graph
            self._frozen = {id(s): self._graph[id(s)].detach().requires_grad_()
                            for s in rows.samples if id(s) in self._graph}
            runs = [(Batch([s for s in rows.samples if id(s) in self._frozen]), "use"),
                    (Batch([s for s in rows.samples if id(s) not in self._frozen]), None)]

        def side(loss, extra=(), grads=None) -> None:  # a regulariser's gradient into side_grads
            ins = self.params + list(extra)
            got = torch.autograd.grad(loss, ins, grad_outputs=grads, retain_graph=True, allow_unused=True)
            for i, g in enumerate(got):
                if g is None:
                    continue
                if i < len(self.params):
                    cur = self.side_grads[i]
                    self.side_grads[i] = g if cur is None else cur + g
                else:
                    leaf = ins[i]
                    side_leaves[id(leaf)] = g if id(leaf) not in side_leaves else side_leaves[id(leaf)] + g

        def prefix_side(roots, leaves) -> None:
            pairs = [(r, side_leaves.pop(id(lf))) for r, lf in zip(roots, leaves) if id(lf) in side_leaves]
            if pairs:
                side([r for r, _ in pairs], grads=[g for _, g in pairs])

        with (torch.enable_grad(), self.fc, float32_compute(self.model, below_resolution(xi, self.dtype)),
              checkpointed_layers(self.model, self.grad_checkpointing)):
            for mb, logits in chain.from_iterable(
                    self.passes(part, self.sort_micro_batches, prefix_side if split else None, frozen=frozen)
                    for part, frozen in runs if part.samples):
                if need_ent and self.fused_entropy:
                    logp, ent_tok = token_logprobs_entropy(logits, mb.tgt)
                else:
                    logp = token_logprobs(logits, mb.tgt)
                    ent_tok = token_entropy(logits) if need_ent else None
                old = mb.field("old_logp")
                if old is None:
                    mb.store("old_logp", logp)
                    old = logp.detach()
                pg, st = self.loss_fn(logp, old, mb.adv, mb.mask, None, self.loss_cfg)
                loss = pg if "surrogate" in terms else torch.zeros((), device=pg.device, dtype=pg.dtype)
                reg = torch.zeros((), device=pg.device, dtype=pg.dtype)
                if need_ent:
                    ent = agg_loss(ent_tok, mb.mask, self.loss_cfg.loss_agg_mode)
                    reg = reg - self.loss_cfg.entropy_coeff * ent
                    st["entropy"] = ent.item()
                if need_kl:
                    kl = agg_loss(kl_penalty(logp, mb.field("ref_logp"), self.kl_type), mb.mask,
                                  self.loss_cfg.loss_agg_mode)
                    reg = reg + self.kl_coef * kl
                    st["kl"] = kl.item()
                st["loss"] = (loss + reg).item()
                n_mb = float(mb.mask.sum())
                w = n_mb / n_total
                if split:
                    if reg.requires_grad:
                        first = low - 2 * self._first_layer  # leaves of the layers this pass ran
                        side(reg * w, [lf for lf in self._group_leaves[first:] if lf.requires_grad])
                    if loss.requires_grad and bool((mb.adv != 0).any()):  # a zero surrogate has zero gradient
                        (loss * w).backward()
                elif (loss + reg).requires_grad:
                    ((loss + reg) * w).backward()
                for k, v in st.items():  # the loss over the whole batch (a skipped row's is 0)
                    acc[k] = acc.get(k, 0.0) + float(v) * (w if k in ("loss", "pg_loss") else n_mb / n_rows)
            if graph:
                pairs = [(self._graph[k], h.grad) for k, h in self._frozen.items() if h.grad is not None]
                self._frozen = None
                self.drop_graph()
                if pairs:  # the layers below the trainable ones, once for every kept row
                    torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
        if not rows.samples:
            self._zero_gradients(xi, gain)
            acc.update(loss=0.0, pg_loss=0.0)
        acc["grad_token_frac"] = rows.n_tokens / n_total
        self.fc.clear()
        self.model.eval()
        self._tick(t0)
        return acc

    def _zero_gradients(self, *leaves) -> None:
        """Zero gradients where a pass over all-zero-advantage rows would have left them
        (Adam then still steps on its moments, as after such a pass)."""
        for p in [*self.params, *leaves]:
            if p is not None and p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def add_side_grads(self) -> None:
        """Add :attr:`side_grads` (the regularisers' gradient of a split pass) to ``.grad``."""
        for p, g in zip(self.params, self.side_grads or []):
            if g is not None:
                p.grad = g.clone() if p.grad is None else p.grad + g
        self.side_grads = None

    def grad_norm_sq(self) -> float:
        """``||grad_theta||_2^2`` of the accumulated gradient (float64)."""
        return float(sum(p.grad.double().pow(2).sum() for p in self.params if p.grad is not None))

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Clip (global norm) and take one optimizer step; gradients are cleared."""
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.opt.step()
        self.zero_grad()

    def ppo_update(self, batch: Batch, xi: torch.Tensor | None, graph_xi: torch.Tensor | None = None) -> dict[str, float]:
        """theta_{k+1} from theta_k on ``batch`` under ``xi`` (Alg. 1 line 6; Algs. 2-4):
        ``epochs`` passes of one optimizer step per mini-batch, against old log-probs
        fixed at theta_k (those of the first step's rows from that step's forward:
        :attr:`first_step_logp`).  Returns the statistics of the first step (at theta_k) and
        the number of steps.  ``graph_xi``: a leaf copy of ``xi`` that a later
        :meth:`backward` of the surrogate on ``batch`` differentiates (SPrPO's replay): the
        pass below the trainable layers keeps its graph for it (:attr:`replay_graph_gb`)."""
        minis = batch.mini_batches(self.mini_batch)
        self.drop_graph()
        self.graph_bytes, self.graph_rows = 0, set()
        if len(minis) * self.epochs > 1:
            start = lowest_trainable_layer(self.model)
            keep = self.reuse_frozen and 0 < start < len(decoder_layers(self.model))
            self._frozen = {} if keep else None
            todo = Batch([s for s in batch.samples if s.old_logp is None])
            # their old log-probs: the first step's own forward
            own = self.first_step_rows(minis[0], todo) if self.first_step_logp else set()
            rest = Batch([s for s in todo.samples if id(s) not in own])
            graph = graph_xi is not None and keep and self.replay_graph_gb > 0 and not has_dropout(self.model)
            if graph:  # line 7's rows with their graph, the others' states, then the top layers
                self._graph, self._graph_xi = {}, graph_xi
                replayed = {id(s) for s in self.rows_with_gradient(batch, False).samples}
                self.keep_states(Batch([s for s in todo.samples if id(s) in replayed]), graph_xi, self.replay_graph_gb)
                self.keep_states(Batch([s for s in todo.samples if id(s) not in replayed]), xi)
                self.fill_old_log_probs(rest, xi, "use")
            elif keep and own:  # every row's states below the adapters, then the top layers of the rest
                self.keep_states(todo, xi)
                self.fill_old_log_probs(rest, xi, "use")
            else:
                self.fill_old_log_probs(rest, xi, "keep" if keep else None)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        try:
            for _ in range(self.epochs):
                for mb in minis:
                    self.zero_grad()
                    last = self.backward(mb, xi)
                    first = first or last
                    self.step()
        finally:
            self._frozen = None
        first.update(ppo_steps=float(len(minis) * self.epochs),
                     **{f"last_{k}": v for k, v in last.items() if k in ("clipfrac", "approx_kl", "ratio_max")})
        return first
