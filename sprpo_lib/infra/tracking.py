"""Where a training run's metrics go, after verl's ``trainer.logger``: every metric of an
iteration to each logger named in ``TrainConfig.logger``.

* ``jsonl``: ``metrics.jsonl`` in the run folder (always on: the notebooks, resumption
  and the overhead table read it);
* ``console``: one line per iteration, ``step k: name=value ...``;
* ``tensorboard``: event files in ``<run>/tensorboard/`` (``tensorboard --logdir runs/``);
* ``wandb``: Weights & Biases, offline unless ``WANDB_MODE`` says otherwise; the run
  lands in ``<run>/wandb/`` (``wandb sync <run>/wandb/offline-run-*`` uploads it).

Numbers go to every logger, lists of numbers as histograms (TensorBoard, W&B) and as
they are (JSON lines, console); text goes to JSON lines and the console only.  A resumed
run drops what ``metrics.jsonl`` and TensorBoard received after its last checkpoint
(``purge_step``), so their curves match; W&B continues the same run (one id per run
folder).
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
from numbers import Number
from pathlib import Path

import numpy as np

from sprpo_lib.infra.io import JsonLines

__all__ = ["LOGGERS", "check_loggers", "Tracking"]

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
#: The W&B project runs are logged under (``WANDB_PROJECT`` overrides it).
WANDB_PROJECT = "sprpo"


def check_loggers(loggers) -> tuple[str, ...]:
    """The logger names as a tuple, or one clear error naming the bad one."""
    if isinstance(loggers, str):
        loggers = [loggers]
    names = tuple(loggers)
    bad = [n for n in names if n not in LOGGERS]
    if bad:
        raise ValueError(f"logger: unknown logger(s) {bad}; expected some of {list(LOGGERS)}, e.g. "
                         "logger=[console,jsonl,tensorboard]")
    if "jsonl" not in names:
        raise ValueError(f"logger: {list(names)} lacks 'jsonl'; metrics.jsonl is the run's own record (resumption, "
                         "the notebooks and the overhead table read it), so it is always written: add jsonl")
    if len(set(names)) != len(names):
        raise ValueError(f"logger: {list(names)} names a logger twice; name each once")
    return names


def _is_number(v) -> bool:
    return isinstance(v, Number) and not isinstance(v, bool) and math.isfinite(float(v))


class Tracking:
    """The loggers of one run.

    Args:
        loggers: names from :data:`LOGGERS` (``jsonl`` among them).
        run_dir: the run folder (``metrics.jsonl``, ``tensorboard/``, ``wandb/``).
        start: the first iteration this process logs (a resume: later events of a
            killed process are dropped).
        config: the run's config (W&B's run config).
    """

    def __init__(self, loggers, run_dir: str | Path, *, start: int = 0, config: dict | None = None):
        self.names = check_loggers(loggers)
        self.run_dir = Path(run_dir)
        self.jsonl = JsonLines(self.run_dir / "metrics.jsonl")
        self.jsonl.truncate(lambda row: row["iteration"] < start)  # iterations after the checkpoint
        self._tb = self.wandb_run = None
        if "tensorboard" in self.names:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional tracker: loaded on use
            except ImportError:
                raise ValueError("logger: 'tensorboard' needs the tensorboard package. Fix: pip install -r "
                                 "requirements.txt (it pins tensorboard), or drop tensorboard from logger") from None
            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start)
        if "wandb" in self.names:
            try:
                import wandb  # optional tracker: loaded on use
            except ImportError:
                raise ValueError("logger: 'wandb' needs the wandb package. Fix: pip install -r requirements.txt (it "
                                 "pins wandb), or drop wandb from logger") from None
            run_id = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]
            self.wandb_run = wandb.init(project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT), name=self.run_dir.name,
                                     id=run_id, dir=str(self.run_dir), config=config or {}, resume="allow",
                                     mode=os.environ.get("WANDB_MODE", "offline"), reinit="finish_previous")

    def log(self, metrics: dict, step: int) -> None:
        """Send one iteration's metrics to every logger."""
        self.jsonl.append_rows(metrics)
        if "console" in self.names:
            body = " ".join(f"{k}={v:.4g}" if _is_number(v) and isinstance(v, float) else f"{k}={v}"
                            for k, v in metrics.items() if k != "iteration")
            print(f"step {step}: {body}", file=sys.stdout, flush=True)
        numbers = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        lists = {k: [float(x) for x in v] for k, v in metrics.items()
                 if isinstance(v, (list, tuple)) and v and all(_is_number(x) for x in v)}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
            for k, v in lists.items():
                self._tb.add_histogram(k, np.asarray(v), step)
            self._tb.flush()
        if self.wandb_run is not None:
            import wandb  # optional tracker: loaded on use

            hists = {k: wandb.Histogram(v) for k, v in lists.items()}
            self.wandb_run.log({**numbers, **hists}, step=step, commit=True)  # committed now: a kill loses none

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
