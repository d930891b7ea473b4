"""Shared fixtures: tiny, seeded, offline models and calibration sequences."""
from __future__ import annotations

import os
import random
import types

import pytest
import torch

from sprpo_lib.agent.engines import GenerationConfig
from sprpo_lib.model.load import load_policy
from sprpo_lib.model.lora import LoraSettings, add_lora

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pytest-xdist's -n
if WORKERS > 1:  # the cores shared out: a worker's OpenMP threads, and its subprocesses' and kernels', never
    os.environ["OMP_NUM_THREADS"] = str(max(1, CORES // WORKERS))  # outnumber its share (spinning waits)
torch.set_num_threads(max(1, min(2, CORES // WORKERS)))
FIRST = ("test_notebooks.py",)  # the longest module starts first, so no worker is left with it at the end


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs (notebooks, real model); run by default")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may run on (not the host's count)."""
    return CORES


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the order within each group stays


@pytest.fixture(params=["tiny-qwen2", "tiny-llama"])
def tiny_spec(request):
    return request.param


@pytest.fixture
def tiny(tiny_spec):
    from sprpo_lib.model.load import load_policy

    return load_policy(tiny_spec, seed=0)


def _f64_rmsnorm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture
def tiny64():
    """A float64 tiny Qwen2 for finite-difference references.  transformers' RMSNorm
    computes in float32 whatever the input dtype, which would put float32 noise into
    every difference quotient; the fixture swaps in the same formula in float64."""
    from sprpo_lib.model.load import load_policy

    pol = load_policy("tiny-qwen2", seed=0, dtype="float64")
    for mod in pol.model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(_f64_rmsnorm, mod)
    return pol


@pytest.fixture
def calib():
    rng = random.Random(0)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(12, 40))] for _ in range(12)]


@pytest.fixture(scope="module")
def one_thread():
    """Single-threaded torch for a module of many small ops, which two threads on a
    shared 2-core machine run several times slower (and whose numerics this pins)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- engine test helpers
# (shared by test_engines.py and test_engine_openvino.py)
# varied lengths (a few to ~150 characters), more prompts than one batch
PROMPTS = [f"task {i}: " + "put the mug in the coffeemachine, then look. " * (i % 4) + "x" * (7 * i % 11)
           for i in range(11)]
NEVER = "@@never@@"


def greedy(**kw) -> GenerationConfig:
    return GenerationConfig(**{"temperature": 0.0, "max_new_tokens": 24, "batch_size": 4, **kw})


def lora_policy(spec: str):
    pol = load_policy(spec, seed=0)
    add_lora(pol, LoraSettings(rank=4, alpha=8))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:  # B starts at zero: make the adapters do something
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return pol


def adapted_policy(spec: str, layers: int | None = None, dropout: float = 0.0):
    """A float32 tiny policy with LoRA (rank 4, alpha 8) on the last ``layers`` layers (all:
    None), its B matrices moved off zero so the adapters take part in every gradient."""
    from sprpo_lib.model.lora import lora_on_last_layers

    pol = load_policy(spec, seed=0, dtype="float32")
    add_lora(pol, lora_on_last_layers(pol.model, LoraSettings(rank=4, alpha=8, dropout=dropout), layers), seed=0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return pol


def head_sharing_batch():
    """Two tasks' rows sharing a head (a prefix pass has work), advantages of both signs and 0."""
    from sprpo_lib.core.batch import Batch, Sample

    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(3, 250, (n,), generator=g).tolist()
    heads = [tok(20), tok(24)]
    adv = [1.0, -0.5, 0.0, 0.7, -1.2]
    return Batch([Sample(heads[i % 2] + tok(3 + i) + tok(4), 4, adv[i % 5]) for i in range(8)])


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 difference of ``x`` from ``ref``, in float64."""
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def assert_same_pass(new: tuple, ref: tuple, stats: tuple[str, ...] = ("loss",)) -> None:
    """Two runs of one training pass, each ``(parameter grads, dL/dxi, dL/du, log-probs, stats)``:
    every gradient within 1e-5 relative (SPrPO's S_hat and SAM's g included), every log-prob
    within 1e-5, the named statistics within 1e-5 relative; the reference's gradients non-zero."""
    (g1, x1, u1, lp1, st1), (g0, x0, u0, lp0, st0) = new, ref
    assert all(float(g.abs().sum()) > 0 for g in g0)
    assert all(rel_l2(a, b) < 1e-5 for a, b in zip(g1, g0, strict=True))
    assert rel_l2(x1, x0) < 1e-5 and rel_l2(u1, u0) < 1e-5
    for a, b in zip(lp1, lp0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for k in stats:
        assert st1[k] == pytest.approx(st0[k], rel=1e-5, abs=1e-7)


def same_tokens(a, b) -> int:
    return sum(x.response_ids == y.response_ids and x.prompt_ids == y.prompt_ids and x.text == y.text
               for x, y in zip(a, b))


def stop_that_splits(texts: list[str]) -> str:
    """A two-letter string that some responses contain (at different places) and some do not."""
    best, score = None, -1
    for t in texts:
        for i in range(len(t) - 1):
            s = t[i : i + 2]
            if not (s.isascii() and s.isalnum()):
                continue
            where = {x.find(s) for x in texts}
            hits = sum(s in x for x in texts)
            if 0 < hits < len(texts) and len(where) > score:
                best, score = s, len(where)
    assert best is not None, "no usable stop string in these outputs"
    return best


def scripted(spec: str, chain: str):
    """A tiny model whose greedy continuation of a chat prompt is ``chain`` then the
    end-of-turn token: attention and FFN outputs are zeroed so the logits depend on the
    current token only, and the output layer maps each token to its successor."""
    pol = load_policy(spec, seed=0)
    tok, m = pol.tokenizer, pol.model
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        e = m.model.embed_tokens.weight
        m.lm_head.weight.zero_()
        seq = [tok.convert_tokens_to_ids(t) for t in tok.tokenize("\n" + chain)] + [tok.eos_token_id]
        for a, b in zip(seq, seq[1:]):
            m.lm_head.weight[b] += 20 * e[a] / e[a].norm()
    return pol


def make_actor(model, opt, pad_id: int = 0, **kw):
    """An Actor whose update and speed configs take ``kw`` by field name (``mini_batch``,
    ``epochs`` and ``loss_cfg`` as the update's ``ppo_mini_batch_size``, ``ppo_epochs``, ``loss``)."""
    import dataclasses

    from sprpo_lib.core.actor import Actor
    from sprpo_lib.core.config import SpeedConfig, UpdateConfig

    alias = {"mini_batch": "ppo_mini_batch_size", "epochs": "ppo_epochs", "loss_cfg": "loss"}
    kw = {alias.get(k, k): v for k, v in kw.items()}
    names = {f.name for f in dataclasses.fields(UpdateConfig)}
    unknown = set(kw) - names - {f.name for f in dataclasses.fields(SpeedConfig)}
    if unknown:
        raise TypeError(f"make_actor: unknown knob(s) {sorted(unknown)}")
    return Actor(model, pad_id, opt, UpdateConfig(**{k: v for k, v in kw.items() if k in names}),
                 SpeedConfig(**{k: v for k, v in kw.items() if k not in names}))
