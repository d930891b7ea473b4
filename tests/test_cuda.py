"""The CUDA code path on a tiny model: a training iteration of every method (model,
LoRA, FFN hooks and the methods' statistics on the GPU), a held-out evaluation, every
deployment perturbation (weights restored on exit, outputs as on the CPU), and bfloat16
on the GPU with the float32 compute of sub-resolution perturbations.

Runs where torch sees a CUDA GPU and is skipped otherwise.  ``SPRPO_TEST_DEVICE=cpu``
runs the same checks on the CPU (how the tests themselves are checked on a machine
without a GPU)."""
from __future__ import annotations

import math
import os

import pytest
import torch

DEVICE = os.environ.get("SPRPO_TEST_DEVICE") or "cuda"
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA GPU (set SPRPO_TEST_DEVICE=cpu to run these checks on the CPU)")


@pytest.mark.parametrize("method", ["vanilla", "gaussian", "sam", "sprpo"])
def test_a_training_iteration_of_every_method_on_the_device(tmp_path, method):
    from sprpo_lib.train.trainer import Trainer, load_config

    cfg = load_config("smoke", [f"method.name={method}", f"model.device={DEVICE}", "rollout.tasks_per_step=1"])
    tr = Trainer(cfg, tmp_path / method, progress=False)
    try:
        assert tr.policy.device.type == torch.device(DEVICE).type
        assert all(p.device.type == tr.policy.device.type for p in tr.model.parameters() if p.requires_grad)
        m = tr.iteration(0)
    finally:
        tr.envs.close()
    assert m["samples"] > 0 and all(math.isfinite(m[k]) for k in ("loss", "pg_loss", "entropy", "wall_s"))
    if method == "sprpo":
        assert math.isfinite(m["xi_sigma_rms"]) and m["xi_sigma_rms"] > 0
    unit = "cuda" if torch.device(DEVICE).type == "cuda" else "rss"  # peak memory per phase, of the device
    assert m[f"rollout_peak_{unit}_gib"] > 0 and m[f"update_peak_{unit}_gib"] > 0


def test_held_out_evaluation_on_the_device_matches_the_cpu_in_shape(tmp_path):
    import sprpo_lib.evaluate as E
    from sprpo_lib.agent.prompt import AgentConfig

    base = dict(model="tiny-qwen2", env="webshop", tasks=2, max_steps=2, max_new_tokens=8, batch_size=8,
                agent=AgentConfig(max_obs_chars=100, history_len=1))
    dev = E.evaluate(E.EvalConfig(**base, device=DEVICE, cache_dir=str(tmp_path / "d")), progress=False)
    cpu = E.evaluate(E.EvalConfig(**base, device="cpu", cache_dir=str(tmp_path / "c")), progress=False)
    assert len(dev) == len(cpu) == 2 and list(dev.columns) == list(cpu.columns)
    assert dev["valid_rate"].between(0, 1).all() and dev["length"].between(1, 2).all()


@pytest.mark.parametrize("family,strength", [("gaussian", 0.1), ("dropout", 0.2), ("fisher", 0.3),
                                             ("sparsegpt", 0.5), ("rtn", 4), ("plane", 0.2)])
def test_every_deployment_perturbation_on_the_device_matches_the_cpu(family, strength, calib):
    from sprpo_lib.core.compress import fisher_scores, perturbation
    from sprpo_lib.core.perturb import FFNChannels
    from sprpo_lib.model.load import load_policy

    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    outs, restored = {}, {}
    for dev in ("cpu", DEVICE):
        pol = load_policy("tiny-qwen2", seed=0, dtype="float32", device=dev)
        before = {k: v.clone() for k, v in pol.model.state_dict().items()}
        kw = {"pad_id": pol.tokenizer.pad_token_id}
        if family in ("fisher", "sparsegpt"):
            kw["calib"] = calib
        if family == "fisher":
            kw["scores"] = fisher_scores(pol.model, calib, batch_size=4, pad_id=kw["pad_id"])
            assert FFNChannels(pol.model).shape == tuple(kw["scores"].shape)
        with torch.no_grad(), perturbation(pol.model, family, strength, seed=0, **kw):
            outs[dev] = pol.model(ids.to(pol.device)).logits.float().cpu()
        restored[dev] = all(torch.equal(before[k], v) for k, v in pol.model.state_dict().items())
    assert restored["cpu"] and restored[DEVICE]
    torch.testing.assert_close(outs[DEVICE], outs["cpu"], rtol=2e-3, atol=2e-3)


def test_bfloat16_on_the_device_keeps_sub_resolution_noise(calib):
    from sprpo_lib.core.perturb import FFNChannels, below_resolution, float32_compute
    from sprpo_lib.model.load import load_policy

    pol = load_policy("tiny-qwen2", seed=0, dtype="bfloat16", device=DEVICE)
    fc = FFNChannels(pol.model)
    xi = torch.full(fc.shape, 1e-3)  # far below bfloat16's resolution (2^-8) on a unit activation
    assert below_resolution(xi, torch.bfloat16)
    ids = torch.tensor([calib[0][:16]], device=pol.device)
    with torch.no_grad(), float32_compute(pol.model):
        clean = pol.model(ids).logits.float()
        fc.set(xi=xi)
        with fc:
            noisy = pol.model(ids).logits.float()
        fc.clear()
    assert noisy.device.type == torch.device(DEVICE).type and not torch.equal(noisy, clean)  # carried, not rounded
    assert all(p.dtype == torch.bfloat16 for p in pol.model.parameters())  # cast back on exit


def test_the_fixed_shape_decode_on_the_device_gives_the_eager_engines_tokens():
    """``hf-graphs`` (a CUDA graph's replay per decode step on a GPU) against ``hf`` (eager,
    rows dropped as they finish), greedy in float32: the same tokens for every prompt."""
    from sprpo_lib.agent.engines import GenerationConfig, HFEngine, HFGraphEngine
    from sprpo_lib.model.load import load_policy

    pol = load_policy("tiny-qwen2", seed=0, dtype="float32", device=DEVICE)
    prompts = [f"task {i}: put the mug in the coffeemachine. " * (1 + i % 3) for i in range(6)]
    cfg = GenerationConfig(temperature=0.0, max_new_tokens=12, batch_size=6, stop="</never>")
    eager = HFEngine(pol, cfg)(prompts)
    graphs = HFGraphEngine(pol, cfg)
    got = graphs(prompts)
    assert [g.response_ids for g in got] == [g.response_ids for g in eager]
    if torch.device(DEVICE).type == "cuda":
        assert graphs.stats["graph_replays"] > 0  # the steps were replayed, not run eagerly
