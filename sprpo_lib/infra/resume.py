"""Resume points of a training loop: the trainable parameters, the optimizer, the random
states and the loop's own running state, written to one atomically replaced folder whose
files are checked against the SHA-256 recorded beside them before anything is loaded.

The supervised warm start (:func:`sprpo_lib.warmstart.sft.train_sft`) writes one every
few minutes, so a killed run continues where it was and ends as an uninterrupted one.
The RL checkpoints (:mod:`sprpo_lib.train.checkpoint`) keep more (the adapter as peft
saves it, the method's state, the config) and have their own format.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from sprpo_lib.infra.io import (
    CorruptFileError,
    atomic_dir,
    atomic_write_json,
    file_record,
    read_json,
    read_safetensors,
    verify_file,
)

log = logging.getLogger(__name__)


def save_resume_point(path: Path, key: str, model, opt, rng: random.Random, run: dict) -> None:
    """Write ``path`` (atomically): ``model``'s trainable parameters and torch's random
    state (safetensors), ``opt``'s state, ``rng``'s state and ``run`` (JSON), for ``key``
    (what the loop trains on and how: a resume point of another key is never loaded)."""
    with atomic_dir(path) as tmp:
        tensors = {f"param.{n}": p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        tensors["torch_rng"] = torch.get_rng_state()
        save_file(tensors, str(tmp / "state.safetensors"))
        torch.save(opt.state_dict(), tmp / "optimizer.pt")  # tensors and numbers only: read back with weights_only
        version, internal, gauss = rng.getstate()
        files = {f.name: file_record(f) for f in sorted(tmp.iterdir())}
        atomic_write_json(tmp / "state.json", {"key": key, "run": run, "rng": [version, list(internal), gauss],
                                               "files": files})


def load_resume_point(path: Path, key: str, model, opt, rng: random.Random) -> dict | None:
    """The ``run`` state of a verified resume point for ``key``, with the weights, optimizer
    and random states put back; ``None`` (nothing changed) when there is none, it is for
    another key, or it does not verify (a warning says which)."""
    if not (path / "state.json").is_file():
        return None
    try:
        state = read_json(path / "state.json")
        if not isinstance(state, dict) or state.get("key") != key:
            log.warning("resume point %s is from other data or settings; starting over", path)
            return None
        for name, rec in state["files"].items():
            verify_file(path / name, rec)
        tensors = read_safetensors(path / "state.safetensors")
        opt_state = torch.load(path / "optimizer.pt", weights_only=True)
    except (CorruptFileError, FileNotFoundError, KeyError, TypeError, ValueError, RuntimeError) as err:
        log.warning("resume point %s is damaged (%s); starting over", path, err)
        return None
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != {k[len("param."):] for k in tensors if k.startswith("param.")}:
        log.warning("resume point %s has other trainable parameters; starting over", path)
        return None
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"param.{n}"])
    opt.load_state_dict(opt_state)
    torch.set_rng_state(tensors["torch_rng"])
    version, internal, gauss = state["rng"]
    rng.setstate((version, tuple(internal), gauss))
    return state["run"]
