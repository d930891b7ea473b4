"""Training metrics go to every logger named in ``logger`` (verl's ``trainer.logger``):
each metric of ``metrics.jsonl`` reaches TensorBoard (read back from the event files)
and the console; a resumed run drops what the loggers got after its checkpoint; bad
logger names and a missing ``jsonl`` are one clear error each."""
from __future__ import annotations

import json

import pytest

from sprpo_lib.infra.io import JsonLines
from sprpo_lib.infra.tracking import Tracking, check_loggers
from sprpo_lib.train.config import load_config


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard stored under ``logdir``: ``{tag: [(step, value)]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"iteration": k, "success": 0.25 * k, "valid_rate": 1.0 - 0.1 * k, "samples": 8 + k,
             "engine": "hf", "sigma_layer": [0.1 * k, 0.2, 0.3]} for k in range(start, n)]


def test_every_metric_reaches_tensorboard_and_console(tmp_path, capsys):
    tr = Tracking(["console", "jsonl", "tensorboard"], tmp_path)
    for m in rows(3):
        tr.log(m, step=m["iteration"])
    tr.close()
    assert JsonLines(tmp_path / "metrics.jsonl").read_rows() == rows(3)
    tb = scalars(tmp_path / "tensorboard")
    numeric = {k for k, v in rows(1)[0].items() if isinstance(v, (int, float))}
    assert set(tb) == numeric  # every number; text and lists are not scalars
    for m in rows(3):
        for k in numeric:
            assert dict(tb[k])[m["iteration"]] == pytest.approx(m[k])
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["step 0", "step 1", "step 2"]
    assert "success=0.5" in out[2] and "engine=hf" in out[2]


def test_a_resumed_run_drops_what_came_after_its_checkpoint(tmp_path):
    tr = Tracking(["jsonl", "tensorboard"], tmp_path)
    for m in rows(4):  # a run killed after logging iteration 3, checkpointed at iteration 1
        tr.log(m, step=m["iteration"])
    tr.close()
    tr = Tracking(["jsonl", "tensorboard"], tmp_path, start=2)
    again = [{**m, "success": 9.0} for m in rows(4, start=2)]
    for m in again:
        tr.log(m, step=m["iteration"])
    tr.close()
    assert JsonLines(tmp_path / "metrics.jsonl").read_rows() == rows(2) + again
    assert scalars(tmp_path / "tensorboard")["success"] == [(0, 0.0), (1, 0.25), (2, 9.0), (3, 9.0)]


def test_wandb_offline_gets_every_metric(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tr = Tracking(["jsonl", "wandb"], tmp_path, config={"seed": 0})
    for m in rows(3):
        tr.log(m, step=m["iteration"])
    summary = dict(tr.wandb_run.summary)  # W&B's own record of the last committed step
    tr.close()
    last = rows(3)[-1]
    assert summary["_step"] == 2
    assert all(summary[k] == pytest.approx(v) for k, v in last.items() if isinstance(v, (int, float)))
    assert "sigma_layer" in summary and "engine" not in summary  # a list as a histogram; text stays out
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_logger_option_errors_and_identity():
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['tensorbord'\]"):
        check_loggers(["jsonl", "tensorbord"])
    with pytest.raises(ValueError, match="lacks 'jsonl'"):
        check_loggers(["console"])
    with pytest.raises(ValueError, match="unknown logger"):
        load_config("smoke", ["logger=[console,mlflow,jsonl]"])
    a = load_config("smoke")
    b = load_config("smoke", ["logger=[console,jsonl,tensorboard]"])
    assert b.logger == ("console", "jsonl", "tensorboard")
    from sprpo_lib.train.config import config_dict

    assert config_dict(a) == config_dict(b)  # where metrics go is not what the run computes: it resumes
    assert "logger" not in json.dumps(config_dict(b))
