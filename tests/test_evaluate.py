"""Robustness evaluation (App. C): zero strength is clean, the content-keyed cell cache
(hits generate nothing, an adapter edit misses, a killed sweep resumes to the same
table), any model and adapter by path, the shared calibration pool, clear errors."""
from __future__ import annotations

import json
import os
import time

import pandas as pd
import pytest
import torch

import sprpo_lib.evaluate as E
from sprpo_lib.agent.engines import ENGINES, HFEngine
from sprpo_lib.agent.envs import make_pool
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.core.compress import perturbation

AGENT = AgentConfig(max_obs_chars=100, history_len=1)  # short prompts for the byte-level tiny model
EPISODE = ["env", "split", "task_index", "task_id", "seed", "success", "score", "length", "valid_rate", "trace"]


pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops: one thread is faster on a shared machine


@pytest.fixture(scope="module")
def pool():
    return make_pool("webshop", None, 0)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """A tiny Qwen2 saved as a HF folder (safetensors) with a dominant FFN and peaked
    next-token distributions, so that FFN perturbations visibly change its episodes
    (the plain random tiny model samples from nearly flat distributions)."""
    from sprpo_lib.model.load import load_policy

    pol = load_policy("tiny-qwen2")
    with torch.no_grad():
        for layer in pol.model.model.layers:
            layer.mlp.down_proj.weight.mul_(20)
            layer.mlp.up_proj.weight.mul_(3)
        pol.model.lm_head.weight.mul_(5)
    path = tmp_path_factory.mktemp("sharp") / "model"
    pol.model.save_pretrained(path, safe_serialization=True)
    pol.tokenizer.save_pretrained(path)
    return {"model": str(path), "dtype": "float32"}


def config(cache, **kw) -> E.EvalConfig:
    base = dict(model="tiny-qwen2", env="webshop", tasks=3, max_steps=2, max_new_tokens=12, batch_size=8,
                agent=AGENT, cache_dir=str(cache))
    base.update(kw)
    return E.EvalConfig(**base)


class Counter:
    """Stands in for the ``hf`` engine: counts engines made and generation calls, and
    can fail after ``fail_after`` engines (one engine per cell: a killed sweep)."""

    def __init__(self, fail_after: int | None = None):
        self.engines = 0
        self.calls = 0
        self.fail_after = fail_after

    def __call__(self, policy, gen, agent):
        if self.fail_after is not None and self.engines >= self.fail_after:
            raise RuntimeError("killed")
        self.engines += 1
        counter = self

        class Counting(HFEngine):
            def __call__(self, prompts):
                counter.calls += 1
                return super().__call__(prompts)

        return Counting(policy, gen, agent)


@pytest.fixture
def counter(monkeypatch):
    c = Counter()
    monkeypatch.setitem(ENGINES, "hf", c)
    return c


# ----------------------------------------------------------------------------- protocol
def test_zero_strength_is_clean_exactly(tmp_path, pool, counter, sharp):
    clean = E.evaluate(config(tmp_path, seeds=(0, 1), **sharp), pool=pool, progress=False)
    made = counter.engines
    gauss = E.evaluate(config(tmp_path, family="gaussian", strengths=(0.0, 0.1), seeds=(0, 1), **sharp), pool=pool,
                       progress=False)
    zero = gauss[gauss["strength"] == 0].reset_index(drop=True)
    assert set(zero["family"]) == {"gaussian"} and len(zero) == len(clean) == 6
    pd.testing.assert_frame_equal(zero[EPISODE], clean[EPISODE])
    assert counter.engines == made + 2  # sigma = 0 is the clean cell: only the two sigma = 0.1 cells ran
    noisy = gauss[gauss["strength"] == 0.1].reset_index(drop=True)
    assert (noisy["trace"] != clean["trace"]).any()  # the comparison can fail: noise changes behaviour
    assert not (clean[clean["seed"] == 0]["trace"].to_numpy() == clean[clean["seed"] == 1]["trace"].to_numpy()).all()


def test_zero_strength_hooks_keep_the_generation_stream(pool, sharp):
    """Applying sigma = 0 / p = 0 for real (hooks on every FFN) gives the clean
    episodes: perturbing never moves the generation seed, so cells are paired."""
    cfg = config("unused", tasks=2, **sharp)
    src = E.ModelSource(cfg)
    pol = src.policy()
    tasks = E.select_tasks(pool, "webshop", None, 2)
    ref = E.play_cell(pol, pool, tasks, cfg, seed=3)
    for family in ("gaussian", "dropout"):
        with perturbation(pol.model, family, 0.0, seed=3):
            assert E.play_cell(pol, pool, tasks, cfg, seed=3) == ref
    for family, s in (("gaussian", 0.05), ("dropout", 0.05)):
        with perturbation(pol.model, family, s, seed=3):
            assert E.play_cell(pol, pool, tasks, cfg, seed=3) != ref


def test_held_out_sets_of_app_c(pool):
    assert E.select_tasks(pool, "webshop") == [("test", i) for i in range(500)]
    assert E.select_tasks(pool, "webshop", None, 4) == [("test", i) for i in range(4)]

    class Alf:  # the ALFWorld pool's sizes, without loading games
        name = "alfworld"

        def splits(self):
            return {"train": 3553, "valid_seen": 140, "valid_unseen": 134}

    tasks = E.select_tasks(Alf(), "alfworld")
    assert len(tasks) == 274 and tasks[0] == ("valid_seen", 0) and tasks[140] == ("valid_unseen", 0)
    assert E.select_tasks(Alf(), "alfworld", None, 2) == [("valid_seen", 0), ("valid_seen", 1),
                                                          ("valid_unseen", 0), ("valid_unseen", 1)]
    cfg = E.EvalConfig(model="tiny-qwen2", family="sparsegpt", env="alfworld", calibration=__file__)
    assert cfg.resolved_strengths() == (0.10, 0.30, 0.50, 0.70) and cfg.temperature == 0.4
    assert cfg.generation(7).seed == 7


# ----------------------------------------------------------------------------- cache
def test_cache_hit_returns_identical_rows_without_generating(tmp_path, pool, counter):
    cfg = config(tmp_path, family="dropout", strengths=(0.2,), seeds=(0, 1))
    first = E.evaluate(cfg, pool=pool, progress=False)
    assert counter.engines == 2 and counter.calls > 0
    before = counter.calls
    again = E.evaluate(cfg, pool=pool, progress=False)
    assert counter.engines == 2 and counter.calls == before
    pd.testing.assert_frame_equal(first, again)
    files = sorted((tmp_path / "cells" / "webshop-dropout").glob("*.json"))
    assert len(files) == 2
    stored = json.loads(files[0].read_text())
    assert stored["fields"]["evaluator"] == E.EVALUATOR_VERSION
    assert stored["fields"]["perturbation"] == {"family": "dropout", "strength": 0.2, "options": {},
                                               "calibration": None}
    # a changed generation setting is another cell
    E.evaluate(config(tmp_path, family="dropout", strengths=(0.2,), seeds=(0,), max_new_tokens=11), pool=pool,
               progress=False)
    assert counter.engines == 3


def test_killed_sweep_resumes_to_the_same_table(tmp_path, pool, monkeypatch):
    cfg = dict(family="gaussian", strengths=(0.1, 0.3), seeds=(0, 1))
    monkeypatch.setitem(ENGINES, "hf", Counter())
    whole = E.evaluate(config(tmp_path / "a", **cfg), pool=pool, progress=False)
    monkeypatch.setitem(ENGINES, "hf", Counter(fail_after=2))
    with pytest.raises(RuntimeError, match="killed"):
        E.evaluate(config(tmp_path / "b", **cfg), pool=pool, progress=False)
    assert len(list((tmp_path / "b" / "cells").rglob("*.json"))) == 2
    resumed = Counter()
    monkeypatch.setitem(ENGINES, "hf", resumed)
    table = E.evaluate(config(tmp_path / "b", **cfg), pool=pool, progress=False)
    assert resumed.engines == 2  # only the missing cells
    pd.testing.assert_frame_equal(table, whole)


def _save_tiny(tmp_path):
    from sprpo_lib.model.load import load_policy
    from sprpo_lib.model.lora import LoraSettings, add_lora

    base = tmp_path / "base"
    pol = load_policy("tiny-qwen2")
    pol.model.save_pretrained(base, safe_serialization=True)
    pol.tokenizer.save_pretrained(base)
    lora = add_lora(load_policy("tiny-qwen2"), LoraSettings(rank=4, alpha=8), seed=1)
    with torch.no_grad():
        for n, w in lora.model.named_parameters():
            if "lora_B" in n:
                w.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    adapter = tmp_path / "adapter"
    lora.model.save_pretrained(adapter, safe_serialization=True)
    return base, adapter


def test_any_model_and_adapter_by_path(tmp_path, pool, counter):
    base, adapter = _save_tiny(tmp_path)
    named = E.evaluate(config(tmp_path / "c"), pool=pool, progress=False)
    by_path = E.evaluate(config(tmp_path / "c", model=str(base), dtype="float32"), pool=pool, progress=False)
    assert list(by_path["trace"]) == list(named["trace"])  # same weights from the folder: same episodes
    merged = E.evaluate(config(tmp_path / "c", model=str(base), dtype="float32", adapters=(str(adapter),),
                               family="rtn", strengths=(8,), tags={"method": "x", "train_seed": 0}),
                        pool=pool, progress=False)
    assert list(merged["trace"]) != list(named["trace"])  # the adapter is merged and acts
    assert set(merged["adapters"]) == {str(adapter)} and merged["adapter_hash"].str.len().eq(12).all()
    assert set(merged["method"]) == {"x"} and set(merged["strength"]) == {8.0}


def test_changing_one_adapter_weight_invalidates_the_cache(tmp_path, pool, counter):
    from safetensors.torch import load_file, save_file

    base, adapter = _save_tiny(tmp_path)
    cfg = config(tmp_path / "c", model=str(base), dtype="float32", adapters=(str(adapter),))
    first = E.evaluate(cfg, pool=pool, progress=False)
    E.evaluate(cfg, pool=pool, progress=False)
    assert counter.engines == 1
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0  # one weight, same file size
    size = path.stat().st_size
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size
    second = E.evaluate(cfg, pool=pool, progress=False)
    assert counter.engines == 2
    assert set(first["cell"]).isdisjoint(second["cell"])
    assert set(first["adapter_hash"]) != set(second["adapter_hash"])


def test_file_digest_memo(tmp_path, monkeypatch):
    f, memo = tmp_path / "w.safetensors", tmp_path / "memo.json"
    f.write_bytes(b"abc")
    calls = []
    import sprpo_lib.evaluate.cells as cells

    real = cells.sha256_file
    monkeypatch.setattr(cells, "sha256_file", lambda p: calls.append(p) or real(p))
    E.clear_digest_memo()
    d1 = E.file_digest(f, memo)
    E.file_digest(f, memo)
    assert len(calls) == 2 and not memo.exists()  # just written: too fresh to trust its mtime
    old = time.time() - 60
    os.utime(f, (old, old))
    E.file_digest(f, memo)
    E.clear_digest_memo()  # a new process: the memo file serves
    assert E.file_digest(f, memo) == d1 and len(calls) == 3 and memo.exists()
    f.write_bytes(b"abcd")
    os.utime(f, (old, old))
    assert E.file_digest(f, memo) != d1 and len(calls) == 4  # size changed: hashed again


# ----------------------------------------------------------------------------- calibration
def test_calibration_pool_and_calibrated_families(tmp_path, pool, counter, sharp):
    cfg = config(tmp_path, tasks=2, **sharp)
    pol = E.ModelSource(cfg).policy()
    calib = E.build_calibration_pool(pol, pool, AGENT, n=6, per_episode=2, max_new_tokens=8, max_steps=2,
                                     tasks_per_batch=2, progress=False)
    assert len(calib) == 6 and all(len(s) > 10 for s in calib.sequences)
    assert {tuple(o[:1]) for o in calib.source["steps"]} == {("train",)}
    path = E.save_calibration(tmp_path / "calib.json", calib)
    back = E.load_calibration(path)
    assert back.sequences == calib.sequences and back.hash == calib.hash
    data = json.loads(path.read_text())
    data["sequences"][0][0] += 1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="hash"):
        E.load_calibration(tmp_path / "bad.json")

    rows = {}
    for family, s in (("fisher", 0.1), ("sparsegpt", 0.3)):
        rows[family] = E.evaluate(config(tmp_path, tasks=2, family=family, strengths=(s,), calibration=str(path),
                                         **sharp), pool=pool, progress=False)
        assert len(rows[family]) == 2 and set(rows[family]["family"]) == {family}
    assert len(list((tmp_path / "fisher").glob("*.safetensors"))) == 1  # scores of this model, cached
    cell = json.loads(next((tmp_path / "cells" / "webshop-fisher").glob("*.json")).read_text())
    assert cell["fields"]["perturbation"]["calibration"] == calib.hash
    clean = E.evaluate(config(tmp_path, tasks=2, **sharp), pool=pool, progress=False)
    assert list(rows["fisher"]["trace"]) != list(clean["trace"])
    assert list(rows["sparsegpt"]["trace"]) != list(clean["trace"])


def test_kept_pruned_weights_give_the_same_rows_and_prune_once(tmp_path, pool, counter, sharp, monkeypatch, caplog):
    """keep_pruned: SparseGPT runs once per model and ratio; a cell that reads the kept weights has
    the rows of one that prunes; a damaged file is pruned again, never served."""
    import importlib

    from sprpo_lib.core.compress import ffn_weights

    S = importlib.import_module("sprpo_lib.evaluate.sweep")  # the module (the package exports a function of its name)
    cfg = config(tmp_path, tasks=2, **sharp)
    calib = E.build_calibration_pool(E.ModelSource(cfg).policy(), pool, AGENT, n=4, per_episode=2, max_new_tokens=8,
                                     max_steps=2, tasks_per_batch=2, progress=False)
    path = str(E.save_calibration(tmp_path / "calib.json", calib))
    pruned = []
    real = S.sparsegpt_prune
    monkeypatch.setattr(S, "sparsegpt_prune", lambda *a, **k: pruned.append(a[2]) or real(*a, **k))
    plain = E.evaluate(config(tmp_path / "plain", tasks=2, family="sparsegpt", strengths=(0.3,), calibration=path,
                              **sharp), pool=pool, progress=False)
    kept = [E.evaluate(config(tmp_path / "kept", tasks=2, family="sparsegpt", strengths=(0.3,), calibration=path,
                              seeds=seeds, keep_pruned=True, **sharp), pool=pool, progress=False)
            for seeds in ((0,), (1,))]  # two cells of one model and ratio
    assert pruned == [0.3]  # the plain cell prunes in compress, the kept ones once here
    assert list(kept[0]["trace"]) == list(plain["trace"]) and list(kept[0]["success"]) == list(plain["success"])
    files = list((tmp_path / "kept" / "sparsegpt").glob("*.safetensors"))
    assert len(files) == 1
    weights = S.read_safetensors(files[0])
    model = E.ModelSource(cfg).policy().model
    assert set(weights) == set(ffn_weights(model))
    assert all(abs(float((w == 0).float().mean()) - 0.3) < 0.02 for w in weights.values())
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated: pruned again, with a warning
    again = E.evaluate(config(tmp_path / "kept", tasks=2, family="sparsegpt", strengths=(0.3,), calibration=path,
                              seeds=(2,), keep_pruned=True, **sharp), pool=pool, progress=False)
    assert pruned == [0.3, 0.3] and len(again) == 2
    assert any(str(files[0]) in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kw, option, expected", [
    ({"family": "noise"}, "--family", "expected one of"),
    ({"family": "dropout", "strengths": (1.5,)}, "--strength", "0 <= p < 1"),
    ({"family": "rtn", "strengths": (1,)}, "--strength", "2..8"),
    ({"family": "rtn", "strengths": (4.5,)}, "--strength", "2..8"),
    ({"family": "gaussian", "strengths": (-0.1,)}, "--strength", "0 <= sigma"),
    ({"family": "clean", "strengths": (0.1,)}, "--strength", "no perturbation"),
    ({"adapters": ("/nonexistent/adapter",)}, "--adapter", "adapter_config.json"),
    ({"tasks": 0}, "EvalConfig.tasks=0", "out of range; expected an integer >= 1"),
    ({"seeds": ()}, "--seeds", "--seeds 0 1 2"),
    ({"family": "fisher", "strengths": (0.1,)}, "--calibration", "--build-calibration"),
    ({"engine": "nope"}, "--engine", "expected one"),
    ({"attention": "flash"}, "--attention", "expected one of auto, sdpa, matmul"),
    ({"batch_tokens": 0}, "EvalConfig.batch_tokens=0", "expected an integer >= 1"),
    ({"model": "/nonexistent/model"}, "--model", "local copy"),
])
def test_bad_input_is_one_clear_error(tmp_path, kw, option, expected):
    with pytest.raises(ValueError) as err:
        config(tmp_path, **kw)
    assert option in str(err.value) and expected in str(err.value)


def test_bad_input_more(tmp_path, pool, capsys):
    (tmp_path / "empty_adapter").mkdir()
    with pytest.raises(ValueError, match="--adapter.*adapter_model.safetensors"):
        config(tmp_path, adapters=(str(tmp_path / "empty_adapter"),))
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="--model.*safetensors"):
        config(tmp_path, model=str(tmp_path / "pickled"))
    with pytest.raises(ValueError, match="--split.*expected some of"):
        E.evaluate(config(tmp_path, splits=("valid_seen",)), pool=pool, progress=False)
    assert E.main(["--model", "tiny-qwen2", "--family", "dropout", "--strength", "1.5"]) == 2
    msg = capsys.readouterr().err.strip()
    assert "--strength" in msg and "0 <= p < 1" in msg and "Fix" in msg and len(msg.splitlines()) == 1
    assert E.main(["--family", "clean"]) == 2
    assert "--model" in capsys.readouterr().err


def test_cli_writes_rows(tmp_path, capsys):
    out = tmp_path / "rows.csv"
    rc = E.main(["--model", "tiny-qwen2", "--env", "webshop", "--family", "gaussian", "--strength", "0.1",
                 "--seeds", "0", "1", "--tasks", "2", "--max-steps", "1", "--max-new-tokens", "6",
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--tag", "method=vanilla",
                 "--no-progress"])
    assert rc == 0
    rows = pd.read_csv(out)
    assert len(rows) == 4 and set(rows["seed"]) == {0, 1} and set(rows["method"]) == {"vanilla"}
    assert "gaussian" in capsys.readouterr().out


def test_config_from_a_training_run(tmp_path, pool, counter):
    """A run folder gives the base model (tiny models: the run's seed), the RL adapter,
    the profile's prompt settings and step limit, and the method / seed tags."""
    from sprpo_lib.infra.io import atomic_write_json
    from sprpo_lib.model.load import load_policy
    from sprpo_lib.model.lora import LoraSettings, add_lora
    from sprpo_lib.train.config import config_dict, load_config

    tc = load_config("smoke", **{"method.name": "sprpo", "seed": 1})
    run = tmp_path / "webshop-sprpo-smoke-seed1"
    atomic_write_json(run / "config.json", {"config": config_dict(tc), "dtype": "float32"})
    add_lora(load_policy("tiny-qwen2", seed=1), LoraSettings(rank=4, alpha=8)).model.save_pretrained(
        run / "final" / "adapter", safe_serialization=True)
    cfg = E.config_from_run(run, tasks=1, cache_dir=str(tmp_path / "cache"))
    assert cfg.model == "tiny-qwen2" and cfg.model_seed == 1 and cfg.dtype == "float32"
    assert cfg.adapters == (str(run / "final" / "adapter"),) and cfg.agent == tc.rollout.agent
    assert cfg.max_steps == tc.env.max_steps and cfg.max_new_tokens == tc.rollout.generation.max_new_tokens
    rows = E.evaluate(cfg, pool=pool, progress=False)
    assert list(rows["method"]) == ["sprpo"] and list(rows["train_seed"]) == [1] and rows["length"].iloc[0] <= 3
    with pytest.raises(ValueError, match="--run.*config.json"):
        E.config_from_run(tmp_path)


def test_a_models_identity_is_its_content_not_the_record_of_its_conversion(tmp_path):
    """Two conversions of the same GGUF differ only in the seconds they took: the same model,
    the same digest (so its cells are found on every machine); a changed weight file is not."""
    from sprpo_lib.evaluate.cells import dir_digest
    from sprpo_lib.model.load import PROVENANCE_FILE

    digests = []
    for i, (seconds, weights) in enumerate(((23.2, b"w0"), (31.7, b"w0"), (23.2, b"w1"))):
        d = tmp_path / f"conv{i}"
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(weights)
        (d / PROVENANCE_FILE).write_text(json.dumps({"gguf": "m.gguf", "convert_seconds": seconds}))
        digests.append(dir_digest(d))
    assert digests[0] == digests[1] != digests[2]
