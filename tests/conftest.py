"""Shared fixtures: tiny, seeded, offline models and calibration sequences."""
from __future__ import annotations

import os
import random
import types

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end runs (notebooks, real model); run by default")


@pytest.fixture(params=["tiny-qwen2", "tiny-llama"])
def tiny_spec(request):
    return request.param


@pytest.fixture
def tiny(tiny_spec):
    from sprpo_lib.models import load_policy

    return load_policy(tiny_spec, seed=0)


def _f64_rmsnorm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture
def tiny64():
    """A float64 tiny Qwen2 for finite-difference references.  transformers' RMSNorm
    computes in float32 whatever the input dtype, which would put float32 noise into
    every difference quotient; the fixture swaps in the same formula in float64."""
    from sprpo_lib.models import load_policy

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
