"""Where training runs and evaluation cells execute: one after another in this process
(``local``), or as Ray tasks on a local or remote Ray cluster (``ray``), the scheduler
the paper's own stack (verl, verl-agent) uses.

An executor maps a module-level function over jobs and returns the results in job
order.  It moves no results of substance: a training task returns its run folder, a
cell task stores its rows in the content-keyed cell cache, and the caller reads them
back exactly as the local executor does, so both give the same rows and files.  This
requires the project root (``runs/``) to be one folder every worker sees: on a cluster,
shared storage (set ``SPRPO_HOME`` on every node, :mod:`sprpo_lib.infra.paths`).

* A task whose worker dies (killed, out of memory, node lost) is retried up to
  ``Resources.max_retries`` times, and a retry resumes: training from its last
  checkpoint, cells from the cache.
* A task that raises (a bad input) is not retried: the driver re-raises the task's own
  exception (its one clear message), and cancels the tasks still pending.

``reproduce --executor ray`` passes the choice to the notebook kernels through the
environment (:data:`EXECUTOR_ENV`, :data:`ADDRESS_ENV`, :data:`RESOURCES_ENV`);
:func:`current` reads it back.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Callable, Sequence

from sprpo_lib.infra.paths import CACHE_ENV, HOME_ENV, package_checkout
from sprpo_lib.infra.progress import PROGRESS_ENV, progress_bar

__all__ = ["EXECUTORS", "EXECUTOR_ENV", "ADDRESS_ENV", "RESOURCES_ENV", "Resources", "LocalExecutor", "RayExecutor",
           "make_executor", "current", "executor_environment"]

EXECUTORS = ("local", "ray")
EXECUTOR_ENV = "SPRPO_EXECUTOR"
ADDRESS_ENV = "SPRPO_RAY_ADDRESS"
RESOURCES_ENV = "SPRPO_RESOURCES"
KINDS = ("run", "cell")


@dataclass(frozen=True)
class Resources:
    """What one Ray task asks the scheduler for (the local executor ignores it)."""

    run_cpus: float = 2
    """CPU cores per training run (its torch threads and environment steps)."""
    run_gpus: float = 0
    """GPUs per training run (the trainer is one process on one device: 0 or 1)."""
    cell_cpus: float = 1
    """CPU cores per evaluation cell (one policy, one perturbation, one seed)."""
    cell_gpus: float = 0
    """GPUs per evaluation cell; a fraction packs several cells' policies on one GPU."""
    max_retries: int = 3
    """Retries of a task whose worker died (a raised exception is never retried)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Resources.{f.name}: expected a number >= 0, got {v!r}")
        if self.run_gpus > 1:
            raise ValueError(f"Resources.run_gpus: the trainer runs on one device, so at most 1 GPU per run; got "
                             f"{self.run_gpus}")

    def request(self, kind: str) -> dict:
        """Ray's ``num_cpus`` / ``num_gpus`` of a task of ``kind`` (``run`` or ``cell``)."""
        if kind not in KINDS:
            raise ValueError(f"executor task kind: expected one of {KINDS}, got {kind!r}")
        return {"num_cpus": getattr(self, f"{kind}_cpus"), "num_gpus": getattr(self, f"{kind}_gpus")}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Resources":
        names = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(d or {}) - names)
        if bad:
            raise ValueError(f"resources: unknown field(s) {bad}; expected some of {sorted(names)}")
        return cls(**(d or {}))


class LocalExecutor:
    """Every job in this process, in order (the default)."""

    name = "local"

    def __init__(self, resources: Resources | None = None):
        self.resources = resources or Resources()

    def map(self, fn: Callable, jobs: Sequence[tuple], *, kind: str, desc: str = "", progress: bool = False) -> list:
        self.resources.request(kind)  # the kind's check, as the Ray executor makes it
        return [fn(*job) for job in jobs]


class RayExecutor:
    """Every job a Ray task with :class:`Resources`' request for its kind.

    Args:
        address: a running cluster (``ray://host:10001``, ``host:6379`` or ``auto``);
            ``None`` starts a local Ray instance on this machine (or joins the one this
            process already started).
        resources: per-kind requests and retries.
    """

    name = "ray"

    def __init__(self, address: str | None = None, resources: Resources | None = None):
        self.address = address or None
        self.resources = resources or Resources()

    def connect(self):
        """The ``ray`` module, initialised (once per process)."""
        try:
            import ray  # optional: only for the Ray executor
        except ImportError:
            raise ValueError("--executor ray: the ray package is not installed. Fix: pip install -r requirements.txt "
                             "(it pins ray), or use --executor local") from None
        if not ray.is_initialized():
            try:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=True, logging_level="WARNING",
                         runtime_env={"env_vars": worker_environment()})
            except ConnectionError as err:
                raise ValueError(f"--address {self.address}: no Ray cluster answers there ({err}). Fix: start one "
                                 "(ray start --head on the head node) and pass its address, or omit --address for "
                                 "a local instance") from None
        return ray

    def map(self, fn: Callable, jobs: Sequence[tuple], *, kind: str, desc: str = "", progress: bool = False) -> list:
        request = self.resources.request(kind)
        if not jobs:
            return []
        ray = self.connect()
        task = ray.remote(fn).options(**request, max_retries=self.resources.max_retries, retry_exceptions=False)
        refs = [task.remote(*job) for job in jobs]
        order = {r: i for i, r in enumerate(refs)}
        out: list = [None] * len(refs)
        pending = list(refs)
        bar = progress_bar(total=len(refs), desc=desc or f"ray {kind}s", unit=kind, disable=not progress)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    out[order[ref]] = self._get(ray, ref)
                    bar.update(1)
        except BaseException:
            for ref in pending:
                ray.cancel(ref)
            raise
        finally:
            bar.close()
        return out

    @staticmethod
    def _get(ray, ref):
        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as err:  # the task raised: its own exception, as a local run gives
            cause = getattr(err, "cause", None)
            if isinstance(cause, BaseException):
                raise cause from None
            raise


def worker_environment() -> dict[str, str]:
    """What every Ray worker gets from the driver: this checkout first on the import path
    (the same path on every node of shared storage; the worker's own path follows), and
    the project's variables (project root, user cache, progress style)."""
    env = {"PYTHONPATH": f"{package_checkout()}{os.pathsep}${{PYTHONPATH}}"}
    return {**env, **{k: os.environ[k] for k in (HOME_ENV, CACHE_ENV, PROGRESS_ENV) if os.environ.get(k)}}


def make_executor(name: str = "local", address: str | None = None, resources: Resources | dict | None = None):
    """The executor called ``name`` (:data:`EXECUTORS`); one clear error for anything else."""
    res = resources if isinstance(resources, Resources) else Resources.from_dict(resources)
    if name == "local":
        if address:
            raise ValueError(f"--address {address}: only the ray executor connects to a cluster; add --executor ray "
                             "or drop --address")
        return LocalExecutor(res)
    if name == "ray":
        return RayExecutor(address, res)
    raise ValueError(f"--executor: unknown executor {name!r}; expected one of {list(EXECUTORS)}")


def executor_environment(name: str, address: str | None, resources: Resources | dict | None) -> dict[str, str]:
    """The variables that carry an executor choice to a child process (a notebook kernel)."""
    res = resources if isinstance(resources, Resources) else Resources.from_dict(resources)
    make_executor(name, address, res)  # the same checks as here, before any kernel starts
    return {EXECUTOR_ENV: name, ADDRESS_ENV: address or "", RESOURCES_ENV: json.dumps(dataclasses.asdict(res))}


def current():
    """The executor this process was given through the environment (default: local)."""
    res = os.environ.get(RESOURCES_ENV)
    return make_executor(os.environ.get(EXECUTOR_ENV) or "local", os.environ.get(ADDRESS_ENV) or None,
                         json.loads(res) if res else None)
