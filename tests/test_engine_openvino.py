"""The OpenVINO engine against HFEngine (float32) on the tiny models: greedy tokens, baked
perturbations, stop strings, seeded sampling, the conversion cache, the registry."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("openvino")

from sprpo_lib.agent.engines import (  # noqa: E402
    Engine,
    GenerationConfig,  # noqa: E402
    HFEngine,
    bake_weights,
    make_engine,
)
from sprpo_lib.core.perturb import FFNChannels, dropout_mask, sample_xi  # noqa: E402
from sprpo_lib.model.load import load_policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

from conftest import NEVER, PROMPTS, greedy, lora_policy, same_tokens, scripted, stop_that_splits  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _single_threaded(one_thread):
    """Tiny models: two threads on the shared 2-core machine are many times slower."""


@pytest.fixture(scope="module", autouse=True)
def ov_cache(tmp_path_factory):
    """One conversion cache for the module (each architecture is converted once)."""
    before = os.environ.get("SPRPO_CACHE")
    root = tmp_path_factory.mktemp("cache")
    os.environ["SPRPO_CACHE"] = str(root)
    yield root
    if before is None:
        os.environ.pop("SPRPO_CACHE", None)
    else:
        os.environ["SPRPO_CACHE"] = before


def _ov(pol, cfg, **kw):
    from sprpo_lib.agent.engines.openvino import OpenVINOEngine

    return OpenVINOEngine(pol, cfg, **kw)


@pytest.mark.parametrize("backend", ["genai", "loop"])
def test_greedy_equals_hf_engine(tiny_spec, backend):
    pol = load_policy(tiny_spec)
    ref = HFEngine(pol, greedy())(PROMPTS)
    eng = _ov(pol, greedy(), prefill_tokens=300, backend=backend)  # loop: several prefill groups, joined states
    got = eng(PROMPTS)
    assert same_tokens(ref, got) == len(PROMPTS)
    assert isinstance(eng, Engine) and eng.calls == 1 and eng.backend == backend
    if backend == "loop":
        assert sum(len(g.response_ids) - 1 for g in got) == eng.stats["decode_rows"]


# What each CPU class serves a bfloat16 policy in (arithmetic and KV cache): OpenVINO's AVX2
# paged attention takes an f32 KV cache only, its AVX512 one a bf16 cache only with bf16
# arithmetic, which needs AVX512-BF16 or AMX.
SERVED_BF16 = {"other": "float32", "avx2": "float32", "avx512": "float32", "avx512_bf16": "bfloat16",
               "amx": "bfloat16"}


@pytest.mark.parametrize("cls", sorted(SERVED_BF16))
def test_serving_precision_per_cpu_class(cls):
    from sprpo_lib.agent.engines.openvino import serving_precision

    got, notice = serving_precision("bfloat16", cls)
    assert got == SERVED_BF16[cls]
    assert (notice is None) == (got == "bfloat16")
    if notice:
        assert "f32 KV cache" in notice and cls in notice and "\n" not in notice  # one line
    assert serving_precision("float32", cls) == ("float32", None)
    assert serving_precision("float16", cls) == ("float32", None)
    assert serving_precision("bfloat16", cls, forced="float32") == ("float32", None)
    if SERVED_BF16[cls] == "bfloat16":
        assert serving_precision("float32", cls, forced="bfloat16") == ("bfloat16", None)
        # a plugin that does not list BF16 (an old OpenVINO, a capped ISA) falls back too
        assert serving_precision("bfloat16", cls, plugin_bf16=False)[0] == "float32"
    else:  # forcing what the CPU cannot run: one clear error naming the option and the way out
        with pytest.raises(ValueError, match=r"precision='bfloat16'.*use precision='float32'"):
            serving_precision("float32", cls, forced="bfloat16")
    with pytest.raises(ValueError, match="precision must be one of"):
        serving_precision("float32", cls, forced="int8")


@pytest.mark.parametrize("cls", sorted(SERVED_BF16))
@pytest.mark.parametrize("threads", [1, 2])
def test_one_thread_bfloat16_on_amx_avoids_the_plugin_crash(cls, threads):
    """OpenVINO 2026.4.1 dies of SIGFPE compiling bfloat16 with one thread on AMX: there the
    genai worker's oneDNN is capped at AVX512-BF16 (bfloat16 kept), the in-process loop backend
    serves float32 with a notice, and a forced bfloat16 loop is one clear error; every other
    class, thread count and precision is left alone, as is a cap the user set."""
    from sprpo_lib.agent.engines.openvino import ONE_THREAD_AMX_CAP, one_thread_amx

    hit = cls == "amx" and threads == 1
    assert one_thread_amx("float32", cls, threads, "genai", env={}) == ("float32", {}, None)
    prec, env, notice = one_thread_amx("bfloat16", cls, threads, "genai", env={})
    assert (prec, env, notice) == ("bfloat16", ONE_THREAD_AMX_CAP if hit else {}, None)
    prec, env, notice = one_thread_amx("bfloat16", cls, threads, "loop", env={})
    assert prec == ("float32" if hit else "bfloat16") and env == {} and (notice is not None) == hit
    if hit:
        assert "\n" not in notice
        with pytest.raises(ValueError, match="backend='genai', threads=2, or precision='float32'"):
            one_thread_amx("bfloat16", cls, threads, "loop", forced="bfloat16", env={})
    user_cap = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert one_thread_amx("bfloat16", cls, threads, "genai", env=user_cap) == ("bfloat16", {}, None)


@pytest.mark.parametrize("backend", ["genai", "loop"])
def test_precision_follows_the_policy_dtype_where_the_cpu_runs_it(tiny_spec, backend, caplog):
    """On this machine's CPU class a bfloat16 policy is served as the table above says (with a
    one-line notice where it falls back); ``precision`` overrides; anything else is one error."""
    from sprpo_lib.agent.engines.openvino import one_thread_amx, serving_precision
    from sprpo_lib.infra.hardware import cpu_class

    pol = load_policy(tiny_spec, dtype="bfloat16")
    with caplog.at_level("WARNING", logger="sprpo_lib.agent.engines.openvino"):
        eng = _ov(pol, greedy(), backend=backend)
    plugin_bf16 = "BF16" in eng.core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    want = serving_precision("bfloat16", cpu_class(), None, plugin_bf16)[0]
    want = one_thread_amx(want, cpu_class(), eng.threads, backend)[0]
    assert eng.cpu_class == cpu_class() and eng.compute_dtype == eng.stats["precision"] == want
    assert any("served in float32" in r.message for r in caplog.records) == (want == "float32")
    got = eng(PROMPTS)
    assert all(g.response_ids for g in got)
    if backend == "loop" and want == "bfloat16":
        assert "bf" in str(eng.compiled_model.get_property("INFERENCE_PRECISION_HINT")).lower()
    assert _ov(pol, greedy(), backend=backend, precision="float32").compute_dtype == "float32"
    f32 = load_policy(tiny_spec)
    assert _ov(f32, greedy(), backend=backend).compute_dtype == "float32"
    with pytest.raises(ValueError, match="precision must be one of"):
        _ov(f32, greedy(), backend=backend, precision="int8")


@pytest.mark.parametrize("cap, emulated", [("AVX2", "avx2"), ("AVX512_CORE", "avx512")])
def test_bfloat16_policy_on_an_emulated_lower_cpu_class(monkeypatch, caplog, cap, emulated):
    """oneDNN capped at AVX2 / AVX512 without BF16 (the worker process inherits the cap)
    stands in for those CPU classes: a bfloat16 policy is served in float32 with an f32 KV
    cache and a notice, and decodes; forcing bfloat16 there is one clear error."""
    from sprpo_lib.infra.hardware import CPU_CLASSES, ISA_LIMITS, cpu_class

    for name in ISA_LIMITS:  # the test's cap alone (a suite run under an emulated class has its own)
        monkeypatch.delenv(name, raising=False)
    want = min(cpu_class(), emulated, key=CPU_CLASSES.index)  # a cap never raises the class
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    pol = load_policy("tiny-llama", dtype="bfloat16")
    with caplog.at_level("WARNING", logger="sprpo_lib.agent.engines.openvino"):
        eng = _ov(pol, greedy())
    assert eng.cpu_class == want and eng.compute_dtype == SERVED_BF16[want] == "float32"
    assert [r.message for r in caplog.records if "served in float32" in r.message]
    assert all(g.response_ids for g in eng(PROMPTS[:4]))
    with pytest.raises(ValueError, match=f"class '{want}'"):
        _ov(pol, greedy(), precision="bfloat16")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_stalled_call_is_repeated_with_the_same_tokens(temperature):
    """Fault injection: a generate call that hangs past its deadline is abandoned, the
    pipeline rebuilt in a new worker and the call repeated with the same seeds: the same
    tokens as an engine that never stalled; the retry is counted."""
    pol = load_policy("tiny-llama")
    cfg = GenerationConfig(temperature=temperature, top_p=0.9, max_new_tokens=16, batch_size=4, seed=3)
    calm, hung = _ov(pol, cfg), _ov(pol, cfg, deadline_s=3)
    first = calm(PROMPTS)
    assert same_tokens(hung(PROMPTS), first) == len(PROMPTS)
    second = calm(PROMPTS)
    hung.stall_next(60)  # sleeps far past the deadline
    got = hung(PROMPTS)
    assert same_tokens(got, second) == len(PROMPTS)
    assert hung.stats["retries"] == 1 and hung.stats["worker_starts"] == 2 and calm.stats["retries"] == 0
    assert hung.calls == calm.calls == 2


def test_a_call_that_keeps_stalling_gives_one_clear_error():
    pol = load_policy("tiny-llama")
    eng = _ov(pol, greedy(), deadline_s=1, attempts=2)
    eng.stall_next(60, calls=2)
    with pytest.raises(RuntimeError, match=r"2 attempts.*rollout\.engine=hf"):
        eng(PROMPTS[:2])
    assert eng.stats["retries"] == 2
    assert same_tokens(eng(PROMPTS[:2]), HFEngine(pol, greedy())(PROMPTS[:2])) == 2  # and it serves again


def test_a_dead_worker_is_replaced(tmp_path):
    """A worker killed between calls (a crash) is restarted, weights reloaded since kept."""
    import signal

    pol = lora_policy("tiny-qwen2")
    fc = FFNChannels(pol.model)
    xi = sample_xi(0.3, fc.shape, seed=3)
    eng = _ov(pol, greedy())
    eng.load_weights(bake_weights(pol.model, xi=xi))
    with fc.set(xi=xi):
        want = HFEngine(pol, greedy())(PROMPTS)
    os.kill(eng.worker_pid, signal.SIGKILL)
    assert same_tokens(eng(PROMPTS), want) == len(PROMPTS)
    assert eng.stats["retries"] == 1
    scratch = eng.scratch_dir
    assert scratch is not None and scratch.is_dir()
    pid = eng.worker_pid
    eng.close()
    assert not scratch.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


ORPHAN = """
import os, sys
import torch
from sprpo_lib.agent.engines import GenerationConfig, make_engine
from sprpo_lib.model.load import load_policy
torch.set_num_threads(1)
eng = make_engine("openvino", load_policy("tiny-llama"), GenerationConfig(temperature=0, max_new_tokens=4))
eng.stall_next(600)  # the worker sleeps as a hung call would, then its driver dies
print(eng.worker_pid, flush=True)
import threading
threading.Thread(target=eng, args=(["hello"],), daemon=True).start()
import time
time.sleep(1)
os._exit(0)
"""


def test_a_worker_ends_when_its_driver_dies(tmp_path):
    """A driver killed mid-call (or ended by a test deadline) leaves no worker behind."""
    import subprocess
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    pid = int(run.stdout.split()[0])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError(f"worker {pid} outlived its driver by 20 s")


def test_a_closed_engine_says_so():
    eng = _ov(load_policy("tiny-llama"), greedy())
    eng.close()
    assert eng.worker_pid is None
    with pytest.raises(RuntimeError, match="after close"):
        eng(PROMPTS[:1])


def test_engine_options_are_checked(monkeypatch):
    pol = load_policy("tiny-llama")
    with pytest.raises(ValueError, match="deadline_s must be > 0"):
        _ov(pol, greedy(), deadline_s=0)
    with pytest.raises(ValueError, match="attempts must be >= 1"):
        _ov(pol, greedy(), attempts=0)
    monkeypatch.setenv("SPRPO_ENGINE_DEADLINE_S", "soon")
    with pytest.raises(ValueError, match="SPRPO_ENGINE_DEADLINE_S='soon'"):
        _ov(pol, greedy())
    monkeypatch.setenv("SPRPO_ENGINE_DEADLINE_S", "45")
    assert _ov(pol, greedy()).call_deadline(10) == 45


def test_baked_lora_and_perturbation_load_into_the_engine(tiny_spec):
    pol = lora_policy(tiny_spec)
    fc = FFNChannels(pol.model)
    xi, mask = sample_xi(0.3, fc.shape, seed=3), dropout_mask(0.3, fc.shape, seed=4)
    hf = HFEngine(pol, greedy())
    lora = hf(PROMPTS)
    with fc.set(xi=xi, mask=mask):
        hooked = hf(PROMPTS)
    assert same_tokens(lora, hooked) < len(PROMPTS)  # the perturbation matters here
    eng = _ov(pol, greedy())  # LoRA merged at construction (default backend: genai)
    assert same_tokens(eng(PROMPTS), lora) == len(PROMPTS)
    eng.load_weights(bake_weights(pol.model, xi=xi, mask=mask))
    assert same_tokens(eng(PROMPTS), hooked) == len(PROMPTS)
    assert eng.stats["reload_s"] >= 0
    eng.load_weights(bake_weights(pol.model))  # and back
    assert same_tokens(eng(PROMPTS), lora) == len(PROMPTS)
    sd = bake_weights(pol.model)
    sd.pop("model.layers.0.mlp.up_proj.weight")
    with pytest.raises(KeyError, match="up_proj"):
        eng.load_weights(sd)


def test_engine_built_under_attached_hooks_serves_the_perturbed_policy(tiny_spec):
    """evaluate() and calibration build an engine inside a perturbation context: the
    attached FFNChannels factor (xi and mask, two instances multiplied) must be folded in."""
    from sprpo_lib.core.compress import perturbation

    pol = lora_policy(tiny_spec)
    hf = HFEngine(pol, greedy())
    clean = hf(PROMPTS)
    fc = FFNChannels(pol.model)
    with fc.set(xi=sample_xi(0.3, fc.shape, seed=3)), perturbation(pol.model, "dropout", 0.3, seed=4):
        hooked = hf(PROMPTS)
        eng = _ov(pol, greedy())
    assert same_tokens(clean, hooked) < len(PROMPTS)
    assert same_tokens(eng(PROMPTS), hooked) == len(PROMPTS)


@pytest.mark.parametrize("backend", ["genai", "loop"])
def test_stop_strings_match_hf_engine(backend):
    pol = load_policy("tiny-llama", seed=2)
    free = HFEngine(pol, greedy(stop=NEVER, max_new_tokens=32))(PROMPTS)
    stop = stop_that_splits([g.text for g in free])
    cfg = greedy(stop=stop, max_new_tokens=32)
    ref = HFEngine(pol, cfg)(PROMPTS)
    got = _ov(pol, cfg, backend=backend)(PROMPTS)
    assert same_tokens(ref, got) == len(PROMPTS)
    stopped = [g for g in got if g.text.endswith(stop)]
    assert 0 < len(stopped) < len(PROMPTS) and all(stop not in g.text[:-len(stop)] for g in stopped)


def test_sampling_is_a_function_of_seed_and_calls():
    pol = load_policy("tiny-llama")
    cfg = GenerationConfig(temperature=0.7, top_p=0.9, max_new_tokens=16, batch_size=4, seed=5)
    a, b = _ov(pol, cfg), _ov(pol, cfg)
    a1, a2, b1 = a(PROMPTS), a(PROMPTS), b(PROMPTS)
    assert same_tokens(a1, b1) == len(PROMPTS)
    assert same_tokens(a1, a2) < len(PROMPTS)  # the next call draws new samples
    b.calls = 1
    assert same_tokens(b(PROMPTS), a2) == len(PROMPTS)
    other = _ov(pol, GenerationConfig(temperature=0.7, top_p=0.9, max_new_tokens=16, batch_size=4, seed=6))
    assert same_tokens(other(PROMPTS), a1) < len(PROMPTS)
    same = a([PROMPTS[0]] * 4)  # one call, one prompt four times (a rollout group): four samples
    assert len({tuple(g.response_ids) for g in same}) > 1
    before = torch.random.get_rng_state()
    a(PROMPTS)
    assert torch.equal(before, torch.random.get_rng_state())  # the global stream is left alone


def test_conversion_is_cached(ov_cache):
    pol = load_policy("tiny-qwen2", seed=7)
    first = _ov(pol, greedy())
    irs = sorted(p.name for p in (ov_cache / "openvino").iterdir() if not p.name.startswith("."))
    again = _ov(pol, greedy())
    assert not again.stats["converted"] and again.ir == first.ir
    other = load_policy("tiny-qwen2", seed=8)  # same architecture, other weights: graph reused
    eng = _ov(other, greedy())
    assert not eng.stats["converted"]
    assert sorted(p.name for p in (ov_cache / "openvino").iterdir() if not p.name.startswith(".")) == irs
    assert same_tokens(eng(PROMPTS[:4]), HFEngine(other, greedy())(PROMPTS[:4])) == 4


@pytest.fixture(scope="module")
def converted_cache(tmp_path_factory):
    """A cache folder holding tiny-qwen2's (seed 11) converted IR: converted once for the
    module, copied by each test that damages it."""
    root = tmp_path_factory.mktemp("ov_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPRPO_CACHE", str(root))
        assert _ov(load_policy("tiny-qwen2", seed=11), greedy()).stats["converted"]
    return root


@pytest.mark.parametrize("name, damage", [("openvino_model.bin", "truncate"), ("openvino_model.xml", "garbage"),
                                          ("openvino_detokenizer.xml", "truncate"), ("meta.json", "garbage")])
def test_a_corrupt_cached_ir_is_converted_again(tmp_path, monkeypatch, converted_cache, name, damage):
    """Each file of a cached IR, truncated (caught by its recorded size) or overwritten with
    garbage of the same size (caught by its SHA-256), each kind on two files: the next engine
    converts the model again (never reads it as a model) and decodes as HF.  A whole copy of
    the cache folder is served as it is."""
    import shutil

    shutil.copytree(converted_cache, tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("SPRPO_CACHE", str(tmp_path))
    pol = load_policy("tiny-qwen2", seed=11)
    first = _ov(pol, greedy())
    assert not first.stats["converted"]
    f = first.ir / name
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else bytes(reversed(data)))
    again = _ov(pol, greedy())
    assert again.stats["converted"] and again.ir == first.ir
    assert same_tokens(again(PROMPTS[:4]), HFEngine(pol, greedy())(PROMPTS[:4])) == 4
    assert not _ov(pol, greedy()).stats["converted"]  # the new copy is whole


def test_registry_builds_it_and_names_the_package(monkeypatch):
    pol = load_policy("tiny-qwen2")
    eng = make_engine("openvino", pol, greedy())
    assert type(eng).__name__ == "OpenVINOEngine" and eng.cfg.temperature == 0
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install openvino=="):
        make_engine("openvino", pol, greedy())


@pytest.mark.parametrize("backend", ["genai", "loop"])
def test_end_of_turn_is_kept(backend):
    pol = scripted("tiny-qwen2", "ok")
    got = _ov(pol, greedy(stop=NEVER), backend=backend)(PROMPTS[:5])
    assert same_tokens(HFEngine(pol, greedy(stop=NEVER))(PROMPTS[:5]), got) == 5
    assert all(g.text == "ok" and g.response_ids[-1] == pol.tokenizer.eos_token_id for g in got)


def test_prefix_caching_reuses_prefixes_and_changes_no_output(tiny_spec):
    """Later calls whose prompts extend earlier ones (an agent's next step) give the same
    greedy tokens with GenAI's prefix cache as without it and as HFEngine; the cache is on
    by default and ``prefix_caching=False`` turns it off."""
    pol = load_policy(tiny_spec)
    history = [f"task {i}: " + "you see a mug on the table and a coffeemachine. " * (6 + i) for i in range(4)]
    calls = [history, [h + "you pick up the mug. next?" for h in history]]
    ref = HFEngine(pol, greedy())
    on, off = _ov(pol, greedy()), _ov(pol, greedy(prefix_caching=False))
    for prompts in calls:
        want = ref(prompts)
        assert same_tokens(want, on(prompts)) == len(prompts)
        assert same_tokens(want, off(prompts)) == len(prompts)
    assert on.backend == off.backend == "genai"
    assert on.scheduler["enable_prefix_caching"] and not off.scheduler["enable_prefix_caching"]


def test_training_rollouts_on_openvino_follow_the_updated_policy(tmp_path):
    """``rollout.engine=openvino`` in training: each iteration's rollouts come from theta_k
    with xi_k baked in (weights reloaded after every update), the same greedy episodes as
    the HF engine's on the same trainer state."""
    from sprpo_lib.core.batch import build_batch
    from sprpo_lib.train.trainer import Trainer, load_config

    ov = ["method.name=sprpo", "rollout.generation.temperature=0", "update.lr=0.05"]
    trs = {e: Trainer(load_config("smoke", ov + [f"rollout.engine={e}"]), tmp_path / e, progress=False)
           for e in ("hf", "openvino")}
    for k in range(2):
        eps = {}
        for e, tr in trs.items():
            eps[e], xi, _ = tr.collect(k)
            assert k == 0 or float(xi.abs().max()) > 0
        acts = {e: [[s.response_ids for s in ep.steps] for ep in v] for e, v in eps.items()}
        assert acts["openvino"] == acts["hf"]
        for e, tr in trs.items():  # the same update on both (from the HF episodes, so the states stay equal)
            for i, ep in enumerate(eps["hf"]):
                ep.steps[-1].env_reward += float(i % 2)
            batch, _ = build_batch(eps["hf"], tr.cfg.update.adv, "gigpo")
            tr.update(batch, xi, k)
            for i, ep in enumerate(eps["hf"]):
                ep.steps[-1].env_reward -= float(i % 2)
    assert trs["openvino"].gen.own_weights


def test_ir_emits_every_positions_logits_from_the_lm_head(tiny_spec):
    """The IR ends in the lm_head MatMul with logits for every position (the pattern GenAI's
    continuous batching gathers its sampled rows before, instead of computing the vocab-wide
    logits of every prompt token); they equal transformers' float32 logits, and the ``loop``
    backend's slice keeps exactly the last row."""
    import numpy as np
    import openvino as ov

    from sprpo_lib.agent.engines.openvino import lm_head_matmul, slice_last_logits

    pol = load_policy(tiny_spec)
    eng = _ov(pol, greedy(), backend="genai")
    ids = pol.tokenizer("the cat sat on the mat", return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    with torch.no_grad():
        ref = pol.model(ids).logits.float()
    core = ov.Core()
    props = {"INFERENCE_PRECISION_HINT": "f32"}
    inputs = {"input_ids": ids.numpy(), "attention_mask": np.ones((1, n), dtype=np.int64),
              "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, dtype=np.int32)}
    ovm = core.read_model(str(eng.ir / "openvino_model.xml"))
    assert lm_head_matmul(ovm).get_type_name() == "MatMul"
    full = core.compile_model(ovm, "CPU", props).create_infer_request()
    full.infer(inputs)
    got = torch.from_numpy(full.get_tensor("logits").data.copy())
    assert got.shape == (1, n, ref.shape[-1])
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    slice_last_logits(ovm)
    last = core.compile_model(ovm, "CPU", props).create_infer_request()
    last.infer(inputs)
    one = torch.from_numpy(last.get_tensor("logits").data.copy())
    assert one.shape == (1, 1, ref.shape[-1]) and torch.allclose(one[0, 0], ref[0, -1], atol=1e-4, rtol=1e-4)
    bad = core.read_model(str(eng.ir / "openvino_model.xml"))
    res = bad.output("logits").get_node()
    relu = ov.opset13.relu(res.input_value(0))
    res.input_value(0).get_tensor().set_names(set())
    relu.output(0).get_tensor().set_names({"logits"})
    res.input(0).replace_source_output(relu.output(0))
    with pytest.raises(RuntimeError, match="lm_head MatMul"):
        lm_head_matmul(bad)
