"""Checkpoints of a training run: peft adapter (safetensors), optimizer state, method
state, iteration and config, written to a fresh folder and published by atomically
replacing a ``latest`` pointer, so a run killed at any moment resumes from a whole
checkpoint."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .config import config_dict, config_from_dict
from .manifest import atomic_write_json, atomic_write_text


def save_checkpoint(out: Path, k: int, model, opt, method, cfg, extra: dict | None = None) -> Path:
    """Checkpoint after iteration ``k``; older checkpoints are removed."""
    from safetensors.torch import save_file

    ck = out / "checkpoints" / f"iter_{k:05d}"
    tmp = ck.with_name(ck.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "adapter", safe_serialization=True)
    torch.save(opt.state_dict(), tmp / "optimizer.pt")  # tensors and numbers only: loaded with weights_only
    ms = method.state_dict()
    if ms:
        save_file({k2: v.contiguous() for k2, v in ms.items()}, str(tmp / "method.safetensors"))
    atomic_write_json(tmp / "state.json", {"iteration": k, "config": config_dict(cfg), **(extra or {})})
    shutil.rmtree(ck, ignore_errors=True)
    os.replace(tmp, ck)
    atomic_write_text(out / "checkpoints" / "latest", ck.name + "\n")
    for old in (out / "checkpoints").glob("iter_*"):
        if old.name != ck.name:
            shutil.rmtree(old, ignore_errors=True)
    return ck


def load_checkpoint(out: Path, model, opt, method, cfg) -> tuple[int, dict] | None:
    """Load the latest checkpoint into ``model``/``opt``/``method``; returns its
    iteration and state (``None`` if there is none).  A checkpoint of a different
    config is refused (only ``iterations`` may differ: a run can be extended; ``model.dtype``
    is compared by the caller as the dtype actually used)."""
    from peft import set_peft_model_state_dict
    from safetensors import safe_open
    from safetensors.torch import load_file

    ptr = out / "checkpoints" / "latest"
    if not ptr.is_file():
        return None
    ck = out / "checkpoints" / ptr.read_text().strip()
    state = json.loads((ck / "state.json").read_text())

    def same_run(c: dict) -> dict:  # the iteration count may grow; the dtype is checked resolved, by the caller
        return {k: ({**v, "dtype": None} if k == "model" else v) for k, v in c.items() if k != "iterations"}

    try:  # keys added to the config since the checkpoint take their defaults
        saved = config_dict(config_from_dict(state["config"]))
    except (TypeError, ValueError):
        saved = state["config"]
    if same_run(saved) != same_run(config_dict(cfg)):
        raise ValueError(f"{out} holds a run with a different config; use another --out or --fresh to start over")
    files = list((ck / "adapter").rglob("adapter_model.safetensors"))
    set_peft_model_state_dict(model, load_file(str(files[0])))
    opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
    if (ck / "method.safetensors").is_file():
        with safe_open(str(ck / "method.safetensors"), "pt") as f:
            method.load_state_dict({k2: f.get_tensor(k2) for k2 in f.keys()})
    return int(state["iteration"]), state
