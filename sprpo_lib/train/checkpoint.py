"""Checkpoints of a training run: peft adapter (safetensors), optimizer state, method
state, iteration and config, written to a fresh folder and published by atomically
replacing a ``latest`` pointer, so a run killed at any moment resumes from a whole
checkpoint.

``state.json``, written last, records the SHA-256 and size of every other file of the
checkpoint; loading verifies them (and reads every tensor) before anything is put into
the model, so a truncated or garbage file is never loaded.  The previous checkpoint is
kept: when the latest one does not verify, the run resumes from the previous one (with
a warning) and repeats the iterations after it, exactly as before; with no whole
checkpoint left it is one error naming the file and saying how to start over.
"""
from __future__ import annotations

import io
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save

from sprpo_lib.infra.io import (
    CorruptFileError,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    file_record,
    read_json,
    read_safetensors,
    space_checked,
    verify_file,
)
from sprpo_lib.model.lora import adapter_nbytes, save_peft
from sprpo_lib.train.config import config_dict, config_from_dict

log = logging.getLogger(__name__)

_NAME = re.compile(r"^iter_(\d{5,})$")


def save_checkpoint(out: Path, k: int, model, opt, method, cfg, extra: dict | None = None) -> Path:
    """Checkpoint after iteration ``k``; older checkpoints are removed except the one
    before it (the fallback when this one does not verify).  A full disk leaves no partial
    checkpoint behind and raises one :class:`~sprpo_lib.infra.io.DiskFullError`."""
    ck = out / "checkpoints" / f"iter_{k:05d}"
    tmp = ck.with_name(ck.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # tensors and numbers only: loaded with weights_only
    ms = method.state_dict()
    method_bytes = save({k2: v.contiguous() for k2, v in ms.items()}) if ms else b""
    need = adapter_nbytes(model) + buf.getbuffer().nbytes + len(method_bytes)
    with space_checked(ck.parent, need, files=9):  # adapter (3 files), optimizer, method, state; 2 folders
        try:
            tmp.mkdir(parents=True)
            save_peft(model, tmp / "adapter")
            atomic_write_bytes(tmp / "optimizer.pt", buf.getvalue())
            if ms:
                atomic_write_bytes(tmp / "method.safetensors", method_bytes)
            files = {f.relative_to(tmp).as_posix(): file_record(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
            atomic_write_json(tmp / "state.json", {"iteration": k, "config": config_dict(cfg), **(extra or {}),
                                                   "files": files})
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(ck, ignore_errors=True)
        os.replace(tmp, ck)
        atomic_write_text(out / "checkpoints" / "latest", ck.name + "\n")
    earlier = sorted((p for p in (out / "checkpoints").glob("iter_*") if _iteration(p) is not None
                      and _iteration(p) < k), key=_iteration)
    keep = {ck.name, earlier[-1].name} if earlier else {ck.name}
    for old in (out / "checkpoints").glob("iter_*"):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
    return ck


def _iteration(path: Path) -> int | None:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m and path.is_dir() else None


def _state_problem(state, k: int) -> str | None:
    if not isinstance(state, dict):
        return "not a JSON object"
    if state.get("iteration") != k or isinstance(state.get("iteration"), bool):
        return f"iteration {state.get('iteration')!r} is not the {k} of its folder"
    if not isinstance(state.get("config"), dict):
        return "no 'config' object"
    files = state.get("files")
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, dict) for v in files.values())):
        return "'files' is not a map of file records"
    return None


def _read_checkpoint(ck: Path, model, method) -> dict:
    """Everything a checkpoint holds, read and verified, nothing applied yet: ``state``,
    ``adapter`` / ``method`` tensors, ``optimizer`` state.  Raises CorruptFileError."""
    from peft import get_peft_model_state_dict  # heavy: loaded on first use

    k = _iteration(ck)
    try:
        state = read_json(ck / "state.json", lambda s: _state_problem(s, k))
    except FileNotFoundError:  # a half-deleted checkpoint folder
        raise CorruptFileError(ck / "state.json", "missing") from None
    files = state.get("files")  # absent in checkpoints written before it was recorded
    if files is not None:
        for rel, rec in files.items():
            if not (ck / rel).is_file():
                raise CorruptFileError(ck / rel, "missing, though state.json records it")
            verify_file(ck / rel, rec)
    adapters = sorted((ck / "adapter").rglob("adapter_model.safetensors"))
    if not adapters:
        raise CorruptFileError(ck / "adapter", "no adapter_model.safetensors")
    adapter = read_safetensors(adapters[0])
    want = {n: tuple(t.shape) for n, t in get_peft_model_state_dict(model).items()}
    if {n: tuple(t.shape) for n, t in adapter.items()} != want:
        raise CorruptFileError(adapters[0], "its tensors are not this run's adapter (names or shapes differ)")
    try:
        opt_state = torch.load(ck / "optimizer.pt", weights_only=True)  # never unpickles arbitrary objects
    except FileNotFoundError:
        raise CorruptFileError(ck / "optimizer.pt", "missing") from None
    except Exception as err:  # noqa: BLE001 - truncated zip, garbage bytes: all mean "not a whole file"
        raise CorruptFileError(ck / "optimizer.pt", f"not a whole torch file ({type(err).__name__}: "
                                                    f"{str(err).splitlines()[0][:200]})") from None
    if not (isinstance(opt_state, dict) and "state" in opt_state and "param_groups" in opt_state):
        raise CorruptFileError(ck / "optimizer.pt", "not an optimizer state dict")
    method_state = None
    if (ck / "method.safetensors").is_file():
        method_state = read_safetensors(ck / "method.safetensors")
    elif method.state_dict():
        raise CorruptFileError(ck / "method.safetensors", f"missing; the {type(method).__name__} method has state")
    return {"state": state, "adapter": adapter, "optimizer": opt_state, "method": method_state}


def _candidates(out: Path) -> list[Path]:
    """The checkpoint ``latest`` names, then every other one, newest first."""
    root = out / "checkpoints"
    named = (root / "latest").read_text(errors="replace").strip()
    first = [root / named] if _NAME.match(named) and _iteration(root / named) is not None else []
    rest = sorted((p for p in root.glob("iter_*") if _iteration(p) is not None and p not in first),
                  key=_iteration, reverse=True)
    if not first:
        log.warning("corrupt file %s: names no checkpoint folder (%r); trying the checkpoints there",
                    root / "latest", named[:40])
    return first + rest


def final_method_state(out: Path) -> dict[str, torch.Tensor] | None:
    """The method state (tensors) of a run's newest whole checkpoint, read without a model:
    SPrPO's statistics after its last update.  ``None`` when no checkpoint holds one."""
    root = Path(out) / "checkpoints"
    if not (root / "latest").is_file():
        return None
    for ck in _candidates(Path(out)):
        path = ck / "method.safetensors"
        if not path.is_file():
            continue
        try:
            return read_safetensors(path)
        except CorruptFileError as err:
            log.warning("%s; trying an older checkpoint", err)
    return None


def load_checkpoint(out: Path, model, opt, method, cfg) -> tuple[int, dict] | None:
    """Load the latest checkpoint into ``model``/``opt``/``method``; returns its
    iteration and state (``None`` if there is none).  A checkpoint of a different
    config is refused (only ``iterations`` and ``eval_every`` may differ: a run can be extended; ``model.dtype``
    is compared by the caller as the dtype actually used).  A checkpoint that does not
    verify is skipped for the previous one, with a warning; when none verifies, a
    :class:`~sprpo_lib.infra.io.CorruptFileError` names the bad file."""
    from peft import set_peft_model_state_dict  # heavy: loaded on first use

    ptr = out / "checkpoints" / "latest"
    if not ptr.is_file():
        return None
    first_error = None
    for ck in _candidates(out):
        try:
            got = _read_checkpoint(ck, model, method)
        except CorruptFileError as err:
            log.warning("%s", err.with_fix("resuming from an earlier checkpoint if there is a whole one"))
            first_error = first_error or err
            continue
        if first_error is not None:
            log.warning("resuming %s from %s: the iterations after it are run again", out, ck.name)
        break
    else:
        fix = f"no whole checkpoint is left in {out / 'checkpoints'}; rerun with --fresh to start the run over"
        raise (first_error.with_fix(fix) if first_error else
               CorruptFileError(ptr, "names no checkpoint folder and there is none", fix))
    state = got["state"]

    def same_run(c: dict) -> dict:  # the iteration count may grow, the held-out cadence change (neither changes
        # the training); the dtype is checked resolved, by the caller
        return {k: ({**v, "dtype": None} if k == "model" else v) for k, v in c.items()
                if k not in ("iterations", "eval_every")}

    try:  # keys added to the config since the checkpoint take their defaults
        saved = config_dict(config_from_dict(state["config"]))
    except (TypeError, ValueError):
        saved = state["config"]
    if same_run(saved) != same_run(config_dict(cfg)):
        raise ValueError(f"{out} holds a run with a different config; use another --out or --fresh to start over")
    try:
        if got["method"] is not None:
            method.load_state_dict(got["method"])
        opt.load_state_dict(got["optimizer"])
    except (KeyError, ValueError, RuntimeError) as err:
        raise CorruptFileError(ck, f"its optimizer or method state does not fit this run ({err})",
                               "rerun with --fresh to start the run over") from None
    set_peft_model_state_dict(model, got["adapter"])
    return int(state["iteration"]), state
