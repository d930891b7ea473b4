"""Runs and evaluation cells through an executor: a sweep run as Ray tasks on a local Ray
instance gives the local executor's rows exactly; killing a worker mid-sweep still
completes it with the same rows, and cells cached before it started are not computed
again; a task that fails on a bad input surfaces its own clear error in the driver;
bad executor options are one clear error each."""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pandas as pd
import pytest

import sprpo_lib.evaluate as E
from sprpo_lib.infra.executor import LocalExecutor, RayExecutor, Resources, current, executor_environment, make_executor

TASK = "ray::compute_cell"  # the process title of a Ray worker while it runs a cell


def configs(cache) -> list[E.EvalConfig]:
    """The smoke profile's evaluation settings (tiny model, prompts, step limit), 2 tasks."""
    base = E.config_from_profile("smoke", "webshop", tasks=2, max_steps=2, cache_dir=str(cache))
    return [dataclasses.replace(base, seeds=(0, 1)),
            dataclasses.replace(base, family="gaussian", strengths=(0.0, 0.1, 0.3), seeds=(0, 1)),  # 0 is clean
            dataclasses.replace(base, family="dropout", strengths=(0.2,), seeds=(0,), tags={"method": "x"})]


def cell_files(cache) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (cache / "cells").rglob("*.json")}


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray instance for the module (2 CPUs: two cells at once), workers with
    one torch thread, as the local sweep below runs."""
    ray = pytest.importorskip("ray")
    ex = RayExecutor(resources=Resources(cell_cpus=1, run_cpus=1, max_retries=3))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield ex
    ray.shutdown()


def _kill_first_cell_worker(deadline_s: float, killed: list) -> None:
    import psutil

    end = time.time() + deadline_s
    while time.time() < end and not killed:
        for p in psutil.process_iter(["pid", "cmdline"]):
            if TASK in " ".join(p.info["cmdline"] or []):
                os.kill(p.info["pid"], signal.SIGKILL)
                killed.append(p.info["pid"])
                return
        time.sleep(0.02)


def test_ray_sweep_matches_local_survives_a_killed_worker_and_reuses_the_cache(tmp_path, ray_local, one_thread):
    local = E.sweep(configs(tmp_path / "local"), progress=False, executor=LocalExecutor())
    cache = tmp_path / "ray"
    E.sweep(configs(cache)[:1], progress=False, executor=LocalExecutor())  # the clean cells, cached beforehand
    before = cell_files(cache)
    assert len(before) == 2
    killed: list[int] = []
    killer = threading.Thread(target=_kill_first_cell_worker, args=(240, killed))
    killer.start()
    rows = E.sweep(configs(cache), progress=False, executor=ray_local)
    killer.join()
    assert killed, "no cell worker was seen running: nothing was killed"
    pd.testing.assert_frame_equal(rows, local)
    after = cell_files(cache)
    assert {k: after[k] for k in before} == before  # the cached cells were read, not computed again
    assert len(after) == len(cell_files(tmp_path / "local")) == 7  # each cell stored once (gaussian 0 is clean)


def test_ray_task_error_is_the_tasks_own_clear_error(tmp_path, ray_local):
    cfg = configs(tmp_path)[0]
    empty = tmp_path / "model"
    empty.mkdir()
    cfg.model = str(empty)  # became bad after the driver checked it (e.g. weights deleted): the worker finds out
    with pytest.raises(ValueError, match=r"--model / EvalConfig.model: .* holds no \*.safetensors weights"):
        ray_local.map(E.compute_cell, [(cfg,)], kind="cell")


def test_executor_options_errors_and_environment(monkeypatch):
    with pytest.raises(ValueError, match="unknown executor 'dask'"):
        make_executor("dask")
    with pytest.raises(ValueError, match="only the ray executor connects"):
        make_executor("local", "host:6379")
    with pytest.raises(ValueError, match=r"Resources.cell_cpus: expected a number >= 0"):
        Resources(cell_cpus=-1)
    with pytest.raises(ValueError, match="at most 1 GPU per run"):
        Resources(run_gpus=2)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['gpus'\]"):
        make_executor("ray", None, {"gpus": 1})
    with pytest.raises(ValueError, match="task kind"):
        LocalExecutor().map(len, [("ab",)], kind="job")
    assert LocalExecutor().map(len, [("ab",), ("c",)], kind="cell") == [2, 1]
    env = executor_environment("ray", "host:6379", {"cell_gpus": 0.5})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ex = current()
    assert isinstance(ex, RayExecutor) and ex.address == "host:6379"
    assert ex.resources.request("cell") == {"num_cpus": 1, "num_gpus": 0.5}
    for k in env:
        monkeypatch.delenv(k)
    assert isinstance(current(), LocalExecutor)
