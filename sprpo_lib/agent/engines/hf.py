"""HF engines: the transformers model's own forward in a lean decode loop (:class:`HFEngine`)
and ``model.generate`` itself (:class:`HFGenerator`, the reference every engine matches)."""
from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import torch
from torch import nn

from sprpo_lib.agent.engines.base import (
    Generation,
    GenerationConfig,
    accept_tokens,
    call_seed,
    check_generation_config,
    cut_response,
    eos_ids,
    load_baked,
    plain_copy,
    prefill_groups,
    select_tokens,
)
from sprpo_lib.agent.prompt import AgentConfig, chat_text


# ----------------------------------------------------------------------------- HF engine
@functools.cache
def _room_layer():
    """The class of :func:`_room_cache`'s layers (transformers imported on first use)."""
    from transformers.cache_utils import DynamicLayer  # heavy (seconds to import): loaded on first use

    class RoomLayer(DynamicLayer):
        """A KV cache layer with room for the tokens still to come: a decode step writes
        its keys and values in place, where ``DynamicLayer`` copies the whole cache.
        ``keys`` / ``values`` are views of the filled part."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
            super().__init__()
            self.lazy_initialization(keys, values)
            b, h, n, _ = keys.shape
            self._k = keys.new_empty(b, h, n + room, keys.shape[-1])
            self._v = values.new_empty(b, h, n + room, values.shape[-1])
            self._k[:, :, :n], self._v[:, :, :n] = keys, values
            self._n = n
            self._show()

        def _show(self) -> None:
            self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

        def update(self, key_states, value_states, *args, **kwargs):
            m = key_states.shape[-2]
            if self._n + m > self._k.shape[-2]:  # out of room: grow (not expected)
                extra = max(m, self._k.shape[-2] // 2)
                self._k = torch.cat([self._k, self._k.new_empty(*self._k.shape[:2], extra, self._k.shape[-1])], -2)
                self._v = torch.cat([self._v, self._v.new_empty(*self._v.shape[:2], extra, self._v.shape[-1])], -2)
            self._k[:, :, self._n : self._n + m] = key_states
            self._v[:, :, self._n : self._n + m] = value_states
            self._n += m
            self._show()
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._k, self._v = self._k[indices], self._v[indices]
            self._show()

        def trim_left(self, n: int) -> None:
            """Forget the first ``n`` positions (columns no remaining row attends to)."""
            self._k, self._v = self._k[:, :, n:], self._v[:, :, n:]
            self._n -= n
            self._show()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("RoomLayer is for HFEngine's decode loop only")

    return RoomLayer


@functools.cache
def _static_layer():
    """The class of :func:`_static_cache`'s layers (transformers imported on first use)."""
    from transformers.cache_utils import DynamicLayer  # heavy (seconds to import): loaded on first use

    class StaticRoomLayer(DynamicLayer):
        """A KV cache layer of fixed shape ``[b, h, n + room, d]`` (the room zero-filled): a
        step writes at the column held in ``self.column`` (a one-element device tensor the
        decode loop sets, shared by every layer) and attends over the whole buffer under a 4D
        mask, so every step has the same shapes and addresses (what a CUDA graph replays)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int, column: torch.Tensor):
            super().__init__()
            self.lazy_initialization(keys, values)
            b, h, n, d = keys.shape
            self.keys, self.values = keys.new_zeros(b, h, n + room, d), values.new_zeros(b, h, n + room, d)
            self.keys[:, :, :n], self.values[:, :, :n] = keys, values
            self.column = column

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys.index_copy_(2, self.column, key_states)
            self.values.index_copy_(2, self.column, value_states)
            return self.keys, self.values

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("StaticRoomLayer is for HFGraphEngine's decode loop only")

    return StaticRoomLayer


def _static_cache(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], room: int):
    """A fixed-shape cache holding these per-layer keys/values with ``room`` zeroed positions;
    its layers share one ``column`` tensor (the next write's position, first the prompt width)."""
    from transformers.cache_utils import Cache  # heavy (seconds to import): loaded on first use

    cls = _static_layer()
    column = torch.full((1,), kv[0][0].shape[2], dtype=torch.long, device=kv[0][0].device)
    return Cache(layers=[cls(k, v, room, column) for k, v in kv])


def _room_cache(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], room: int):
    """A cache holding these per-layer keys/values with ``room`` free positions each."""
    from transformers.cache_utils import Cache  # heavy (seconds to import): loaded on first use

    cls = _room_layer()
    return Cache(layers=[cls(k, v, room) for k, v in kv])


#: padded tokens per prefill forward when the engine is not told (:func:`default_prefill_tokens`)
PREFILL_TOKENS = {"cpu": 2048, "gpu": 65536}


def default_prefill_tokens(device: str | torch.device) -> int:
    """Padded tokens per prefill forward on ``device``: 2,048 on a CPU (a group's activations
    stay small); 65,536 on a GPU, where a forward is bound by its launches until it is large.
    An H200 ran the paper profile's eager ops at ~17 us each, so 2,048-token groups (two of
    its ~1,000-token prompts) spent more time launching than computing; 65,536 prefills 128
    such prompts in two forwards of ~0.25 s of arithmetic each."""
    return PREFILL_TOKENS["cpu" if torch.device(device).type == "cpu" else "gpu"]


#: :class:`HFEngine`'s share of finished rows that triggers dropping them from the batch, per device
#: type: on a GPU each drop copies a KV cache of gigabytes, so rows finishing one by one are dropped
#: together; on a CPU the cache is small and a finished row's extra steps cost more than the copy.
COMPACT = {"cuda": 0.25}


class HFEngine:
    """:class:`~sprpo_lib.agent.engines.HFGenerator`'s results, computed with less waste.

    * Prompts are sorted by token length (results come back in input order) and cut
      into decode batches of ``cfg.batch_size``; each batch is prefilled in groups of
      similar length of at most ``prefill_tokens`` padded tokens, with only the last
      position's logits, and the groups' KV caches are joined (left-padded) for decoding.
    * The decode loop drops finished rows from the batch and the KV cache once they are
      ``compact`` of it (at least one row; 0, a CPU's default: at every finished row;
      :data:`COMPACT` per device), and trims cache columns
      that only the dropped rows used: each drop copies the whole cache, so rows finishing
      one by one are dropped together; the cache has room for the new tokens, so a step
      does not copy it.
    * Stop strings are matched on each new token's text against a short tail, per row.

    It runs the model's own forward: ``FFNChannels`` hooks and peft adapters on
    ``policy.model`` apply.  After :meth:`load_weights` the engine decodes with its own
    plain copy of the architecture holding the given (baked) weights instead.

    Greedy decoding agrees with ``HFGenerator`` token for token unless rounding flips a
    near tie: batch shapes differ, so sums round differently (rarely in float32, more
    often in bfloat16).  Sampling draws from one
    generator seeded by ``(cfg.seed, calls)``: reproducible, but not the same draws as
    ``HFGenerator``'s.  A stop string lying strictly inside one token with other text
    before it stops here; transformers' matcher misses that case.
    """

    own_weights = False  # decodes with policy.model itself (hooks and LoRA apply) until load_weights

    def __init__(self, policy, cfg: GenerationConfig | None = None, agent: AgentConfig | None = None,
                 prefill_tokens: int | None = None, compact: float | None = None):
        prefill_tokens = default_prefill_tokens(policy.device) if prefill_tokens is None else prefill_tokens
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        compact = COMPACT.get(torch.device(policy.device).type, 0.0) if compact is None else compact
        if not 0 <= compact < 1:
            raise ValueError(f"compact must be in [0, 1) (the share of finished rows that triggers dropping them), "
                             f"got {compact}")
        self.compact = compact
        self.policy = policy
        self.cfg = cfg or GenerationConfig()
        self.agent = agent or AgentConfig()
        self.prefill_tokens = prefill_tokens
        self.calls = 0
        self.model: nn.Module | None = None  # own plain copy, once weights are loaded
        self._pieces: dict[int, str] = {}
        self.stats = {"prefill_tokens": 0, "decode_rows": 0, "forwards": 0}

    # ------------------------------------------------------------- weights
    @property
    def active_model(self) -> nn.Module:
        return self.model if self.model is not None else self.policy.model

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Decode with these plain weights (e.g. :func:`bake_weights`) from now on."""
        if self.model is None:
            self.model = plain_copy(self.policy.model)
        load_baked(self.model, state_dict)

    # ------------------------------------------------------------- generation
    def _piece(self, token: int) -> str:
        """The text of one token (memoised; decoding grows with the vocabulary seen)."""
        s = self._pieces.get(token)
        if s is None:
            s = self._pieces[token] = self.policy.tokenizer.decode([token])
        return s

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> list[Generation]:
        tok, cfg = self.policy.tokenizer, self.cfg
        texts = [chat_text(tok, p, self.agent) for p in prompts]
        ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        gen = None
        if cfg.temperature > 0:
            gen = torch.Generator(device=self.policy.device).manual_seed(call_seed(cfg, self.calls))
        self.calls += 1
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        responses: dict[int, list[int]] = {}
        model = self.active_model
        penalty = check_generation_config(model, cfg.temperature > 0)
        eos = eos_ids(model, tok)
        for s in range(0, len(order), cfg.batch_size):
            rows = order[s : s + cfg.batch_size]
            tails = [texts[i][-(len(cfg.stop) - 1):] if len(cfg.stop) > 1 else "" for i in rows]
            outs = self._generate(model, [ids[i] for i in rows], tails, gen, penalty, eos)
            responses.update(zip(rows, outs))
        out = []
        for i, p_ids in enumerate(ids):
            r_ids = cut_response(responses[i], tok.eos_token_id, tok.pad_token_id)
            out.append(Generation(tok.decode(r_ids, skip_special_tokens=True), list(p_ids), r_ids))
        return out

    def _forward(self, model, input_ids, attention_mask, position_ids, cache, last_only: bool):
        self.stats["forwards"] += 1
        kw = {"logits_to_keep": 1} if last_only else {}
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    past_key_values=cache, use_cache=True, **kw)
        return out.logits[:, -1].float(), out.past_key_values

    def _prefill(self, model, prompts: list[list[int]]):
        """Prefill rows sorted by decreasing length in groups of at most
        ``prefill_tokens`` padded tokens; return the last logits ``[b, V]``, the joined
        cache, the attention mask ``[b, W]`` and each row's next position."""
        from transformers import DynamicCache  # heavy (seconds to import): loaded on first use

        device, pad = self.policy.device, self.policy.tokenizer.pad_token_id
        width = len(prompts[0])
        groups = prefill_groups(prompts, self.prefill_tokens)
        logits, layers = [], None
        att = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        r = 0
        for group in groups:
            w = len(group[0])
            ids = torch.full((len(group), w), pad, dtype=torch.long, device=device)
            a = torch.zeros(len(group), w, dtype=torch.long, device=device)
            for j, p in enumerate(group):
                ids[j, w - len(p):] = torch.tensor(p, device=device)
                a[j, w - len(p):] = 1
            pos = (a.cumsum(-1) - 1).clamp_min(0)
            self.stats["prefill_tokens"] += ids.numel()
            lg, cache = self._forward(model, ids, a, pos, DynamicCache(config=model.config), True)
            logits.append(lg)
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            if layers is None:
                layers = [([], []) for _ in kv]
            for (ks, vs), (k, v) in zip(layers, kv):  # left-pad to the batch's width
                ks.append(nn.functional.pad(k, (0, 0, width - w, 0)))
                vs.append(nn.functional.pad(v, (0, 0, width - w, 0)))
            att[r : r + len(group), width - w:] = a
            r += len(group)
        joined = self._joined_cache([(torch.cat(ks), torch.cat(vs)) for ks, vs in layers], self.cfg.max_new_tokens)
        next_pos = torch.tensor([len(p) for p in prompts], device=device)
        return torch.cat(logits), joined, att, next_pos

    _joined_cache = staticmethod(_room_cache)  # the decode loop's cache for the prefilled keys/values

    def _generate(self, model, prompts: list[list[int]], tails: list[str], gen, penalty: float,
                  eos: set[int]) -> list[list[int]]:
        """Decode one batch (rows sorted by decreasing length); raw new tokens per row."""
        cfg, pad = self.cfg, self.policy.tokenizer.pad_token_id
        stop = cfg.stop
        logits, cache, att, pos = self._prefill(model, prompts)
        rows = list(range(len(prompts)))  # the prompt of each batch position
        going = list(range(len(prompts)))  # the batch positions still decoding
        new: list[list[int]] = [[] for _ in prompts]
        seen = None
        if penalty != 1.0:  # generate() penalises every id in the sequence so far
            seen = torch.tensor([[p[0]] * (att.shape[1] - len(p)) + p for p in prompts], device=att.device)
        for step in range(cfg.max_new_tokens):
            nxt = select_tokens(logits, seen, penalty, cfg, gen)
            tokens = nxt.tolist()
            kept = accept_tokens([tokens[j] for j in going], [rows[j] for j in going], new, tails, self._piece, eos,
                                 pad, stop)
            going = [going[k] for k in kept]
            if not going or step + 1 == cfg.max_new_tokens:
                break
            if len(rows) - len(going) >= max(1, math.ceil(self.compact * len(rows))):
                idx = torch.tensor(going, device=att.device)  # drop finished rows from the batch and the cache
                cache.batch_select_indices(idx)
                att, pos, nxt = att[idx], pos[idx], nxt[idx]
                seen = seen[idx] if seen is not None else None
                rows, going = [rows[j] for j in going], list(range(len(going)))
                lead = int(att.any(0).long().argmax())  # columns only dropped rows used
                if lead > 0:
                    att = att[:, lead:]
                    seen = seen[:, lead:] if seen is not None else None
                    for layer in cache.layers:
                        layer.trim_left(lead)
            att = torch.cat([att, att.new_ones(len(rows), 1)], dim=1)
            if seen is not None:
                seen = torch.cat([seen, nxt[:, None]], dim=1)
            self.stats["decode_rows"] += len(rows)
            logits, cache = self._forward(model, nxt[:, None], att, pos[:, None], cache, False)
            pos = pos + 1
        return new


class HFGraphEngine(HFEngine):
    """:class:`HFEngine` with a decode step of fixed shapes, replayed from a CUDA graph on a GPU.

    An eager decode step launches every op of every layer from Python (thousands per step
    at the paper's shape); on a GPU the launches, not the arithmetic, then set the pace.
    Here a decode batch keeps all its rows to the end (a finished row's tokens are
    discarded) and a fixed-size KV cache (:func:`_static_cache`, the prompt plus room for
    ``max_new_tokens``) is attended under a 4D mask, so each step has the same shapes and
    buffers: on CUDA it is captured once per decode batch as a CUDA graph and replayed; on
    a CPU the same step runs eagerly (how it is tested against :class:`HFEngine`).  Greedy
    decoding agrees with :class:`HFEngine` token for token up to rounding; sampling draws
    for every row of the batch, so its draws differ.  Trades the compute of finished rows
    and of the cache's empty columns for fewer launches: for GPUs, not CPUs."""

    _joined_cache = staticmethod(_static_cache)

    def _generate(self, model, prompts: list[list[int]], tails: list[str], gen, penalty: float,
                  eos: set[int]) -> list[list[int]]:
        """Decode one batch (rows sorted by decreasing length) with the fixed-shape step."""
        cfg, pad = self.cfg, self.policy.tokenizer.pad_token_id
        logits, cache, att, pos = self._prefill(model, prompts)
        b, width = att.shape
        mask = torch.zeros(b, 1, 1, width + cfg.max_new_tokens, dtype=torch.bool, device=att.device)
        mask[:, 0, 0, :width] = att.bool()
        ids = torch.zeros(b, 1, dtype=torch.long, device=att.device)
        where = torch.zeros(b, 1, dtype=torch.long, device=att.device)  # each row's next position
        column = cache.layers[0].column  # the cache column a step writes, shared by every layer
        step_fn = self._step_fn(model, cache, ids, mask, where)
        alive = list(range(b))
        new: list[list[int]] = [[] for _ in prompts]
        seen = None
        if penalty != 1.0:
            seen = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts], device=att.device)
        for step in range(cfg.max_new_tokens):
            nxt = select_tokens(logits, seen, penalty, cfg, gen)
            tokens = nxt.tolist()
            keep = accept_tokens([tokens[r] for r in alive], alive, new, tails, self._piece, eos, pad, cfg.stop)
            if not keep or step + 1 == cfg.max_new_tokens:
                break
            alive = [alive[j] for j in keep]
            if seen is not None:
                seen = torch.cat([seen, nxt[:, None]], dim=1)
            ids.copy_(nxt[:, None])
            where.copy_((pos + step)[:, None])
            column.fill_(width + step)
            mask[:, 0, 0, width + step] = True
            self.stats["decode_rows"] += b
            logits = step_fn()
        return new

    def _step_fn(self, model, cache, ids, mask, where):
        """A function computing one decode step's float32 last logits ``[b, V]`` from the
        buffers (read at call time): on CUDA a captured graph's replay (captured at the
        first call, after one eager warm-up step on a side stream), elsewhere the eager step."""
        def eager():
            self.stats["forwards"] += 1
            out = model(input_ids=ids, attention_mask=mask, position_ids=where, past_key_values=cache, use_cache=True)
            return out.logits[:, -1].float()

        if ids.device.type != "cuda":
            return eager
        graph, held = None, {}

        def replay():
            nonlocal graph
            if graph is None:
                side = torch.cuda.Stream(ids.device)
                side.wait_stream(torch.cuda.current_stream(ids.device))
                with torch.cuda.stream(side):
                    eager()  # warm-up: lazy allocations and autotuning stay out of the capture
                torch.cuda.current_stream(ids.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    held["logits"] = eager()
            graph.replay()
            self.stats["graph_replays"] = self.stats.get("graph_replays", 0) + 1
            return held["logits"].clone()

        return replay


class HFGenerator:
    """Batched sampling from a transformers causal LM, seeded per call."""

    def __init__(self, policy, cfg: GenerationConfig | None = None, agent: AgentConfig | None = None):
        self.policy = policy
        self.cfg = cfg or GenerationConfig()
        self.agent = agent or AgentConfig()
        self.calls = 0

    def _cut(self, ids: list[int]) -> list[int]:
        tok = self.policy.tokenizer
        for i, t in enumerate(ids):
            if t == tok.eos_token_id:
                return ids[: i + 1]  # keep the end-of-turn token: it is part of the response
            if t == tok.pad_token_id:
                return ids[:i]
        return ids

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> list[Generation]:
        tok, model, cfg = self.policy.tokenizer, self.policy.model, self.cfg
        texts = [chat_text(tok, p, self.agent) for p in prompts]
        out: list[Generation] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed * 1_000_003 + self.calls)
            self.calls += 1
            for i in range(0, len(texts), cfg.batch_size):
                enc = tok(texts[i : i + cfg.batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
                enc = enc.to(self.policy.device)
                kw = dict(do_sample=cfg.temperature > 0, max_new_tokens=cfg.max_new_tokens,
                          pad_token_id=tok.pad_token_id, stop_strings=[cfg.stop], tokenizer=tok)
                if cfg.temperature > 0:
                    kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
                gen = model.generate(**enc, **kw)
                width = enc["input_ids"].shape[1]
                for row, att, full in zip(enc["input_ids"], enc["attention_mask"], gen):
                    p_ids = row[att.bool()].tolist()
                    r_ids = self._cut(full[width:].tolist())
                    out.append(Generation(tok.decode(r_ids, skip_special_tokens=True), p_ids, r_ids))
        return out
