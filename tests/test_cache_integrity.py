"""Corrupt data is never served.  For every kind of stored file that is read back (an
evaluation cell, the episode log beside it, the calibration pool and the Fisher scores,
a training checkpoint, the warm start's adapter and evaluation), a real entry is made
with the project's own code on the tiny model, then truncated or overwritten with
garbage: the next load recomputes it (equal to the fresh computation) or raises one
CorruptFileError naming the file and the fix, and never returns it as data."""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch

import sprpo_lib.evaluate as E
import sprpo_lib.train.trainer as T
import sprpo_lib.warmstart.heldout as H
from sprpo_lib.agent.engines import ENGINES, HFEngine
from sprpo_lib.agent.envs import make_pool
from sprpo_lib.agent.prompt import AgentConfig
from sprpo_lib.infra.io import (CorruptFileError, atomic_write_json, file_record, read_json, read_json_lines,
                               read_safetensors, verify_file)
from sprpo_lib.paper.experiments import calibration_pool, plan
from sprpo_lib.train.trainer import Trainer, load_config, train
from sprpo_lib.warmstart.cache import prepare_warm_start

AGENT = AgentConfig(max_obs_chars=100, history_len=1)  # short prompts for the byte-level tiny model

pytestmark = pytest.mark.usefixtures("one_thread")  # many small ops: one thread is faster on a shared machine


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path: Path) -> None:
    rng = random.Random(path.name)
    path.write_bytes(bytes(rng.randrange(256) for _ in range(max(64, path.stat().st_size))))


def drop_last_line(path: Path) -> None:
    """Truncated at a line boundary: every remaining line still parses."""
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))


DAMAGE = {"truncated": truncate, "garbage": garbage}


@pytest.fixture(scope="module")
def pool():
    return make_pool("webshop", None, 0)


@pytest.fixture
def engines(monkeypatch):
    """Counts the generation engines made (one per computed cell)."""
    made = []

    def make(policy, gen, agent):
        made.append(1)
        return HFEngine(policy, gen, agent)

    monkeypatch.setitem(ENGINES, "hf", make)
    return made


def config(cache, **kw) -> E.EvalConfig:
    return E.EvalConfig(**{**dict(model="tiny-qwen2", env="webshop", tasks=2, max_steps=2, max_new_tokens=8,
                                  batch_size=8, agent=AGENT, cache_dir=str(cache)), **kw})


# ----------------------------------------------------------------------------- (a), (b) cells and episode logs
@pytest.fixture(scope="module")
def stored(tmp_path_factory, pool):
    """One evaluated cell: its cache folder, rows, cell JSON and episode log."""
    root = tmp_path_factory.mktemp("cells")
    rows = E.evaluate(config(root), pool=pool, progress=False)
    cell = next((root / "cells").rglob("*.json"))
    return {"root": root, "rows": rows, "cell": json.loads(cell.read_text()),
            "log": cell.with_name(cell.stem + ".episodes.jsonl").read_bytes()}


def _copy(stored, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(stored["root"], root)
    cell = next((root / "cells").rglob("*.json"))
    return root, cell, cell.with_name(cell.stem + ".episodes.jsonl")


def _recomputes(stored, root, cell, log, pool, engines):
    import pandas as pd

    rows = E.evaluate(config(root), pool=pool, progress=False)
    assert len(engines) == 1  # the damaged cell was computed again...
    pd.testing.assert_frame_equal(rows, stored["rows"])  # ...to what a fresh computation gives
    assert log.read_bytes() == stored["log"]
    again = json.loads(cell.read_text())
    assert again["rows"] == stored["cell"]["rows"] and again["log"] == stored["cell"]["log"]
    assert E.load_episode_log(root, cell.stem[:12]) == read_json_lines(log)


def test_a_whole_cell_is_served_without_recomputing(stored, tmp_path, pool, engines):
    root, cell, log = _copy(stored, tmp_path)
    assert stored["cell"]["log"] == file_record(log)  # the cell records its log's SHA-256, size, lines
    E.evaluate(config(root), pool=pool, progress=False)
    assert engines == []


@pytest.mark.parametrize("damage", ["truncated", "garbage", "rows cut", "not an object", "success edited",
                                    "score edited"])
def test_a_corrupt_cell_json_is_recomputed(stored, tmp_path, pool, engines, damage, caplog):
    root, cell, log = _copy(stored, tmp_path)
    if damage == "rows cut":  # valid JSON, one row short
        data = json.loads(cell.read_text())
        cell.write_text(json.dumps({**data, "rows": data["rows"][:-1]}))
    elif damage.endswith("edited"):  # valid JSON, every row there, one outcome changed: the log disagrees
        data = json.loads(cell.read_text())
        row = data["rows"][0]
        row.update(success=not row["success"]) if damage == "success edited" else row.update(score=row["score"] + 0.5)
        cell.write_text(json.dumps(data))
    elif damage == "not an object":
        cell.write_text("[1, 2]\n")
    else:
        DAMAGE[damage](cell)
    with caplog.at_level(logging.WARNING):
        _recomputes(stored, root, cell, log, pool, engines)
    assert f"corrupt file {cell}" in caplog.text


@pytest.mark.parametrize("damage", ["truncated", "garbage", "line dropped", "missing"])
def test_b_corrupt_episode_log_is_an_error_then_recomputed(stored, tmp_path, pool, engines, damage):
    root, cell, log = _copy(stored, tmp_path)
    if damage == "missing":
        log.unlink()
    else:
        (drop_last_line if damage == "line dropped" else DAMAGE[damage])(log)
    if damage != "missing":  # what the examples notebook reads: one clear error, never the damaged episodes
        with pytest.raises(CorruptFileError, match="rerun the evaluation") as err:
            E.load_episode_log(root, cell.stem[:12])
        assert err.value.path == log and str(log) in str(err.value)
    _recomputes(stored, root, cell, log, pool, engines)  # the next evaluation recomputes cell and log


@pytest.mark.parametrize("damage", ["intact", "line dropped", "garbage"])
def test_b_cells_stored_before_the_log_record(stored, tmp_path, pool, engines, damage):
    """An older cell (no ``log`` entry) stays valid while its log parses whole, one episode
    per row; a log truncated even at a line boundary is caught by that count."""
    root, cell, log = _copy(stored, tmp_path)
    data = json.loads(cell.read_text())
    del data["log"]
    cell.write_text(json.dumps(data))
    if damage == "intact":
        assert E.load_episode_log(root, cell.stem[:12]) == read_json_lines(log)
        E.evaluate(config(root), pool=pool, progress=False)
        assert engines == []  # served as before
        return
    (drop_last_line if damage == "line dropped" else garbage)(log)
    with pytest.raises(CorruptFileError, match=str(log.name)):
        E.load_episode_log(root, cell.stem[:12])
    _recomputes(stored, root, cell, log, pool, engines)


# ----------------------------------------------------------------------------- (c) calibration pool, Fisher scores
@pytest.fixture(scope="module")
def calib_file(tmp_path_factory, pool):
    pol = E.ModelSource(config("unused")).policy()
    calib = E.build_calibration_pool(pol, pool, AGENT, n=4, per_episode=2, max_new_tokens=8, max_steps=2,
                                     tasks_per_batch=2, progress=False)
    return E.save_calibration(tmp_path_factory.mktemp("calib") / "calib.json", calib)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "edited"])
def test_c_corrupt_calibration_pool_is_one_clear_error(calib_file, tmp_path, damage):
    path = tmp_path / "calib.json"
    shutil.copy(calib_file, path)
    if damage == "edited":  # valid JSON, a token changed: the recorded hash catches it
        data = json.loads(path.read_text())
        data["sequences"][0][0] += 1
        path.write_text(json.dumps(data))
    else:
        DAMAGE[damage](path)
    with pytest.raises(CorruptFileError, match="--build-calibration") as err:
        E.load_calibration(path)
    assert err.value.path == path


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_c_corrupt_fisher_scores_are_recomputed(calib_file, tmp_path, pool, damage):
    run = config(tmp_path, tasks=1, family="fisher", calibration=str(calib_file))
    E.evaluate(dataclasses.replace(run, strengths=(0.1,)), pool=pool, progress=False)
    scores = next((tmp_path / "fisher").glob("*.safetensors"))
    fresh = read_safetensors(scores)["scores"].clone()  # not a view of the file damaged next
    DAMAGE[damage](scores)
    E.evaluate(dataclasses.replace(run, strengths=(0.2,)), pool=pool, progress=False)  # a new cell: scores read
    assert torch.equal(read_safetensors(scores)["scores"], fresh)


# ----------------------------------------------------------------------------- (d) checkpoints
RUN = ["rollout.tasks_per_step=1", "method.name=vanilla", "env.max_steps=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished two-iteration smoke run: checkpoints iter_00000 and iter_00001."""
    return train(load_config("smoke", RUN + ["iterations=2"]), tmp_path_factory.mktemp("train") / "run",
                 progress=False)


def test_the_metrics_row_has_every_named_column(run):
    """Each per-iteration column that readers name (:mod:`sprpo_lib.core.metrics`) is in the
    trainer's rows; the noise's columns carry their prefixes."""
    from sprpo_lib.core import metrics as MK

    rows = read_json_lines(run / "metrics.jsonl")
    per_iteration = [MK.ITERATION, MK.SUCCESS, MK.SCORE, MK.VALID_RATE, MK.ROLLOUT_ROUNDS, MK.EPISODES_DROPPED,
                     MK.UPDATED, MK.SAMPLES, MK.ROLLOUT_S, MK.GENERATE_S, MK.ENV_S, MK.UPDATE_S, MK.SENSITIVITY_S,
                     MK.WALL_S]
    assert [k for k in per_iteration if any(k not in r for r in rows)] == []
    assert [r[MK.ITERATION] for r in rows] == [0, 1]
    assert any(k.startswith(MK.XI_REAL) for k in rows[0])


def _adapter(ck: Path) -> dict:
    return read_safetensors(ck / "adapter" / "adapter_model.safetensors")


@pytest.mark.parametrize("file, damage, legacy", [
    ("adapter/adapter_model.safetensors", "truncated", False),
    ("optimizer.pt", "garbage", False),
    ("state.json", "truncated", False),
    ("adapter/adapter_model.safetensors", "truncated", True),  # a checkpoint written before state.json's "files"
])
def test_d_corrupt_checkpoint_falls_back_to_the_previous_one(run, tmp_path, file, damage, legacy, caplog):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_00000", "iter_00001"]  # the previous one is kept
    fresh = {k: v.clone() for k, v in _adapter(ck / "iter_00001").items()}
    if legacy:
        for c in ck.glob("iter_*"):
            state = json.loads((c / "state.json").read_text())
            del state["files"]
            (c / "state.json").write_text(json.dumps(state))
    DAMAGE[damage](ck / "iter_00001" / file)
    with caplog.at_level(logging.WARNING):
        train(load_config("smoke", RUN + ["iterations=3"]), out, progress=False)  # extend the run by one
    assert f"corrupt file {ck / 'iter_00001' / file}" in caplog.text and "from iter_00000" in caplog.text
    redone = _adapter(ck / "iter_00001")  # iteration 1 ran again from iteration 0's checkpoint...
    assert redone.keys() == fresh.keys() and all(torch.equal(redone[k], fresh[k]) for k in fresh)  # ...identically
    iters = [r["iteration"] for r in read_json_lines(out / "metrics.jsonl")]
    assert iters == [0, 1, 2]


def test_d_a_half_deleted_checkpoint_falls_back(run, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "checkpoints" / "iter_00001" / "state.json").unlink()
    with caplog.at_level(logging.WARNING):
        train(load_config("smoke", RUN + ["iterations=3"]), out, progress=False)
    assert "state.json: missing" in caplog.text and "from iter_00000" in caplog.text
    assert [r["iteration"] for r in read_json_lines(out / "metrics.jsonl")] == [0, 1, 2]


def test_d_no_whole_checkpoint_is_one_clear_error(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    for c in (out / "checkpoints").glob("iter_*"):
        garbage(c / "optimizer.pt")
    garbage(out / "checkpoints" / "latest")
    with pytest.raises(CorruptFileError, match="--fresh") as err:
        train(load_config("smoke", RUN + ["iterations=3"]), out, progress=False)
    assert err.value.path == out / "checkpoints" / "iter_00001" / "optimizer.pt"


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_d_a_damaged_final_adapter_is_written_again(run, tmp_path, damage, caplog):
    """A finished run whose published adapter is damaged is not complete: the next call
    resumes from the last checkpoint and publishes the same adapter again."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    cfg = load_config("smoke", RUN + ["iterations=2"])
    assert T.is_complete(cfg, out)
    final = out / "final" / "adapter" / "adapter_model.safetensors"
    want = {k: v.clone() for k, v in read_safetensors(final).items()}  # (a copy: the file is memory-mapped)
    DAMAGE[damage](final)
    with caplog.at_level(logging.WARNING):
        assert not T.is_complete(cfg, out)
        train(cfg, out, progress=False)
    assert f"corrupt file {final}" in caplog.text
    got = read_safetensors(final)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert T.is_complete(cfg, out)


def test_d_a_run_of_other_data_is_neither_complete_nor_continued(run, tmp_path, monkeypatch):
    """A run folder whose config.json records another task pool is not this run: it is not
    complete, and continuing it is one error naming both data sources and the fix, raised
    before a model is loaded (a run never mixes two task pools)."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    cfg = load_config("smoke", RUN + ["iterations=2"])
    meta = read_json(out / "config.json")
    atomic_write_json(out / "config.json", {**meta, "data": "/elsewhere/webshop"})
    assert not T.is_complete(cfg, out)
    monkeypatch.setattr(T, "Trainer", lambda *a, **k: pytest.fail("a model was loaded for a run of other data"))
    with pytest.raises(ValueError, match=r"data /elsewhere/webshop.*would continue it on generated.*--fresh"):
        train(cfg, out, progress=False)


# ----------------------------------------------------------------------------- (e) warm start
WARM = ["warm_start=true", "sft.n_tasks=2", "sft.epochs=1", "sft.lora.rank=4", "sft.eval_tasks=1", "iterations=1",
        "env.max_steps=2"]
IDS = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(0))


def _warm_trainer(root, monkeypatch, name):
    monkeypatch.setenv("SPRPO_HOME", str(root))
    prepare_warm_start(load_config("smoke", WARM), progress=False)  # the stage before RL, as sprpo-train runs it
    tr = Trainer(load_config("smoke", WARM), root / name, progress=False)
    tr.envs.close()
    return tr


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A cached warm start (adapter, eval.json, eval_episodes.jsonl) and the logits of its policy."""
    root = tmp_path_factory.mktemp("warm")
    with pytest.MonkeyPatch.context() as mp:
        tr = _warm_trainer(root, mp, "a")
        with torch.no_grad():
            logits = tr.model(IDS).logits
    return {"root": root, "dir": tr.warm_start_dir.relative_to(root), "logits": logits}


def _episodes(path: Path) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "env_seconds"} for e in read_json_lines(path)]  # timings vary


@pytest.mark.parametrize("file, damage", [("adapter_model.safetensors", "truncated"),
                                          ("adapter_model.safetensors", "garbage"),
                                          ("adapter_config.json", "garbage")])
def test_e_corrupt_warm_start_adapter_is_trained_again(warm, tmp_path, monkeypatch, file, damage, caplog):
    """The warm start is a cache: a damaged adapter file is never loaded; the warm start is
    trained again (with a warning naming the file) and gives the same policy."""
    from sprpo_lib.model.load import load_policy
    from sprpo_lib.model.lora import check_adapter, load_adapter

    shutil.copytree(warm["root"] / "runs", tmp_path / "runs")
    adapter = tmp_path / warm["dir"] / "adapter"
    DAMAGE[damage](adapter / file)
    with pytest.raises(CorruptFileError, match="delete") as err:  # loading it directly: one clear error
        load_adapter(load_policy("tiny-qwen2"), adapter)
    assert err.value.path == adapter / file
    with caplog.at_level("WARNING"):
        tr = _warm_trainer(tmp_path, monkeypatch, "b")
    assert any(str(adapter / file) in r.getMessage() for r in caplog.records)
    check_adapter(adapter)
    with torch.no_grad():
        torch.testing.assert_close(tr.model(IDS).logits, warm["logits"])


@pytest.mark.parametrize("file, damage", [("eval.json", "truncated"), ("eval.json", "garbage"),
                                          ("eval_episodes.jsonl", "line dropped")])
def test_e_corrupt_warm_start_evaluation_is_recomputed(warm, tmp_path, monkeypatch, file, damage):
    shutil.copytree(warm["root"] / "runs", tmp_path / "runs")
    ws = tmp_path / warm["dir"]
    fresh, episodes = json.loads((ws / "eval.json").read_text()), _episodes(ws / "eval_episodes.jsonl")
    (drop_last_line if damage == "line dropped" else DAMAGE[damage])(ws / file)
    with pytest.raises(CorruptFileError) as err:  # what the training report reads: one clear error
        H.load_eval(ws / "eval.json")
    assert err.value.path == ws / file and "rerun the training command" in str(err.value)
    _warm_trainer(tmp_path, monkeypatch, "b")  # the next training run evaluates again
    again = H.load_eval(ws / "eval.json")
    assert {k: again[k] for k in ("episodes", "success_rate", "mean_score", "valid_rate", "indices")} == \
           {k: fresh[k] for k in ("episodes", "success_rate", "mean_score", "valid_rate", "indices")}
    assert _episodes(ws / "eval_episodes.jsonl") == episodes
    verify_file(ws / "eval_episodes.jsonl", again["log"])


# ----------------------------------------------------------------------------- experiments: the shared pool
def test_c_experiments_rebuild_a_corrupt_calibration_pool(run, tmp_path, caplog):
    p = plan("smoke", "webshop", calibration_size=4, tasks=1)
    runs = {("vanilla", 0): run}
    path = calibration_pool(p, runs, tmp_path, progress=False)
    fresh = path.read_bytes()
    for damage in (truncate, garbage):
        damage(path)
        with caplog.at_level(logging.WARNING):
            assert calibration_pool(p, runs, tmp_path, progress=False) == path
        assert path.read_bytes() == fresh and f"corrupt file {path}" in caplog.text
