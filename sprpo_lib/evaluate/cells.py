"""The evaluation cells of App. C and their content-keyed cache: a cell (family, strength,
seed), the digests its key is made of, the rows and episode log it stores, and the
checks that keep a damaged cell from being served."""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from sprpo_lib.core.compress import FAMILIES, PERTURBATIONS
from sprpo_lib.infra.io import (
    CorruptFileError,
    atomic_write_json,
    atomic_write_text,
    canonical_hash,
    file_record,
    read_cached,
    read_json,
    read_json_lines,
    sha256_file,
    verify_file,
)
from sprpo_lib.infra.hardware import compute_class
from sprpo_lib.infra.manifest import git_commit
from sprpo_lib.infra.paths import project_path
from sprpo_lib.model.load import PROVENANCE_FILE

logger = logging.getLogger(__name__)

# ============================================================================ robustness evaluation (App. C)

#: Bumped whenever a change to this module can change the rows of a cell; part of every
#: cache key, so rows made by an older evaluator are never returned.
EVALUATOR_VERSION = 2

#: App. C held-out sets per environment.
EVAL_SPLITS: dict[str, tuple[str, ...]] = {"webshop": ("test",), "alfworld": ("valid_seen", "valid_unseen")}
#: How the appendix tables name the ALFWorld splits.
SPLIT_LABELS: dict[str, str] = {"test": "all", "valid_seen": "ID", "valid_unseen": "OOD"}
#: The cell cache, under the project root (:func:`sprpo_lib.infra.paths.project_path`).
DEFAULT_CACHE = Path("runs") / "eval_cache"
#: Columns of :func:`evaluate`'s rows (then the config's tags).
ROW_COLUMNS = ("env", "split", "split_label", "task_index", "task_id", "family", "strength", "seed", "success",
               "score", "length", "valid_rate", "trace", "model", "adapters", "model_hash", "adapter_hash", "cell")

#: Families by kind, read from :data:`sprpo_lib.core.compress.FAMILIES`: the random ones draw per
#: evaluation seed; the calibrated ones need the shared pool; zero strength is the identity.
RANDOM_FAMILIES = tuple(f for f, spec in FAMILIES.items() if spec.random)
CALIBRATED_FAMILIES = tuple(f for f, spec in FAMILIES.items() if spec.calibrated)
ZERO_IS_IDENTITY = tuple(f for f, spec in FAMILIES.items() if spec.zero_is_identity)


def families() -> list[str]:
    """``clean`` and every registered perturbation family."""
    return ["clean", *PERTURBATIONS.names()]


def check_strength(family: str, strength: float) -> float:
    """The canonical strength of ``family`` (a float; an int-valued float for ``rtn``),
    or a ValueError naming the option, the range expected and a fix."""
    if family not in families():
        raise ValueError(f"--family / EvalConfig.family: unknown perturbation family {family!r}; expected one of "
                         f"{families()} (App. C). Fix: e.g. --family gaussian")
    try:
        s = float(strength)
    except (TypeError, ValueError):
        raise ValueError(f"--strength / EvalConfig.strengths: {strength!r} is not a number") from None
    spec = FAMILIES.get(family)
    symbol, text, ok = ((spec.symbol, spec.range_text, spec.valid) if spec else
                        ("strength", "any finite value", lambda v: math.isfinite(v)))
    if not (math.isfinite(s) and ok(s)):
        example = {"rtn": "--strength 8 6 4", "clean": "omit --strength"}.get(family, "--strength 0.05")
        raise ValueError(f"--strength / EvalConfig.strengths: {strength!r} is outside the range of family "
                         f"{family!r} ({symbol}: expected {text}). Fix: {example}")
    return s + 0.0  # -0.0 -> 0.0


@dataclass(frozen=True)
class Cell:
    """One evaluation cell of a model on an env: a family, a strength and an evaluation seed."""

    family: str
    strength: float
    seed: int

    def canonical(self) -> "Cell":
        """Zero strength is the identity perturbation: the clean cell of the same seed."""
        if self.family in ZERO_IS_IDENTITY and self.strength == 0:
            return Cell("clean", 0.0, self.seed)
        return self


# ============================================================================ content hashes

_MEMO: dict[str, dict] = {}
_HASHED_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken")
_RACY_SECONDS = 2.0  # files changed this recently are hashed again (their mtime may not tick on a rewrite)


def clear_digest_memo() -> None:
    """Forget the in-memory digest memo (as a new process would; the memo file stays)."""
    _MEMO.clear()


def file_digest(path: str | Path, memo_path: str | Path | None = None) -> str:
    """SHA-256 of a file's bytes, memoised per (path, size, mtime, inode) in memory and,
    when ``memo_path`` is given, in that JSON file (large weights are hashed once).

    A file modified within the last 2 seconds is never memoised (a rewrite inside one
    filesystem timestamp tick would otherwise keep its old digest, as in git's "racy"
    index entries); rewriting a file with the same size *and* forcing the old mtime
    back would fool the memo."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    key = str(path)
    disk: dict = {}
    if memo_path is not None:  # an unreadable memo is rebuilt
        disk = read_cached(memo_path, read_json, lambda d: None if isinstance(d, dict) else "not a JSON object") or {}
    for memo in (_MEMO, disk):
        hit = memo.get(key)
        if (isinstance(hit, dict) and all(hit.get(k) == v for k, v in stamp.items())
                and isinstance(hit.get("sha256"), str) and len(hit["sha256"]) == 64):
            return hit["sha256"]
    digest = sha256_file(path)
    if time.time() - st.st_mtime_ns / 1e9 > _RACY_SECONDS:
        _MEMO[key] = {**stamp, "sha256": digest}
        if memo_path is not None:
            disk[key] = _MEMO[key]
            atomic_write_json(memo_path, disk)
    return digest


def dir_digest(path: str | Path, memo_path: str | Path | None = None) -> str:
    """SHA-256 over the top-level weight, config and tokenizer files of a model or
    adapter directory (``*.safetensors``, ``*.json``, ``*.model``, ``*.txt``, ``*.jinja``),
    by name and content: what the evaluated policy is made of.  A converted model's record of its
    making (:data:`~sprpo_lib.model.load.PROVENANCE_FILE`, with the conversion's seconds) is left
    out, so the same weights name the same cells on every machine."""
    path = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir()
                    if p.is_file() and p.suffix in _HASHED_SUFFIXES and p.name != PROVENANCE_FILE):
        h.update(f"{f.name}\0{file_digest(f, memo_path)}\n".encode())
    return h.hexdigest()


def state_dict_digest(model) -> str:
    """SHA-256 of a model's tensors in memory (names, dtypes, shapes, bytes): the
    identity of a model without files (the tiny random models)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ============================================================================ tasks, rows, cache


def select_tasks(pool, env: str, splits: Sequence[str] | None = None, count: int | None = None) -> list[tuple[str, int]]:
    """The held-out tasks ``[(split, index)]``: App. C's splits (or ``splits``), all
    tasks or the first ``count`` of each split."""
    splits = tuple(splits) if splits else EVAL_SPLITS.get(env, ())
    sizes = pool.splits()
    bad = [s for s in splits if s not in sizes]
    if bad or not splits:
        raise ValueError(f"--split / EvalConfig.splits: {list(bad or splits)} not split(s) of {env!r}; expected some "
                         f"of {sorted(sizes)} (App. C: {list(EVAL_SPLITS.get(env, ()))})")
    if count is not None and count < 1:
        raise ValueError(f"--tasks / EvalConfig.tasks: {count} selects no tasks; expected a positive count")
    tasks = [(s, i) for s in splits for i in range(sizes[s] if count is None else min(count, sizes[s]))]
    if not tasks:
        raise ValueError(f"--split / EvalConfig.splits: {list(splits)} of {env!r} hold no tasks; choose other splits")
    return tasks


def tasks_digest(pool, tasks: Sequence[tuple[str, int]]) -> str | None:
    """Digest of the tasks' content where the pool exposes it cheaply (WebShop goals)."""
    goal = getattr(pool, "goal", None)
    if goal is None:
        return None
    return canonical_hash([goal(s, i) for s, i in tasks])


def episode_log(records, obs_chars: int = 600) -> list[dict]:
    """What the agent saw and did, one dict per episode (observations cut to
    ``obs_chars``): the source of the text examples (App. "Qualitative Examples")."""
    return [{"split": r.split, "task_index": int(r.task_index), "task_id": r.task_id, "instruction": r.instruction,
             "success": bool(r.success), "score": float(r.score),
             "steps": [{"step": s.step, "observation": s.observation[:obs_chars], "response": s.response,
                        "action": s.action, "valid": bool(s.valid), "reward": float(s.env_reward)}
                       for s in r.steps]}
            for r in records]


def episode_rows(records) -> list[dict]:
    """One tidy row per episode (no model or perturbation columns).  ``trace`` is a
    short digest of the episode's responses: equal traces mean the same behaviour, so
    cells can be compared episode by episode beyond success and score."""
    return [{"env": r.env, "split": r.split, "task_index": int(r.task_index), "task_id": r.task_id,
             "success": bool(r.success), "score": float(r.score), "length": int(r.length),
             "valid_rate": float(r.valid_rate),
             "trace": hashlib.sha256("\0".join(s.response for s in r.steps).encode()).hexdigest()[:16]}
            for r in records]


#: What every stored row of a cell holds (:func:`episode_rows`).
_ROW_KEYS = ("env", "split", "task_index", "task_id", "success", "score", "length", "valid_rate", "trace")
_LOG_SUFFIX = ".episodes.jsonl"


def _read_cell(path: Path, key: str, tasks: Sequence[Sequence] | None = None) -> dict:
    """A stored cell, checked: a JSON object with this key and one whole row per task of
    the cell (``tasks``, default the tasks its stored fields name), in order."""
    def problem(data) -> str | None:
        if not isinstance(data, dict):
            return "not a JSON object"
        if data.get("key") != key:
            return f"its key {str(data.get('key'))[:12]}... is not the {key[:12]}... of its name"
        rows, want = data.get("rows"), [tuple(t) for t in (data["fields"]["env"]["tasks"] if tasks is None else tasks)]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in _ROW_KEYS) for r in rows):
            return "its rows are not a list of episode rows"
        if [(r["split"], r["task_index"]) for r in rows] != want:
            return f"its {len(rows)} rows are not the cell's {len(want)} tasks in order"
        return None

    return read_json(path, problem)


def _check_cell_log(path: Path, data: dict, parse: bool) -> list[dict] | None:
    """The episode log beside the cell ``data`` read from ``path``, checked against the cell:
    against its recorded SHA-256 and size (read as data only when ``parse``), or for cells
    stored before that record, parsed whole with one episode per row.  ``None`` when a cell
    stored without a record has no log.  Raises CorruptFileError."""
    lp = path.with_name(path.stem + _LOG_SUFFIX)
    rec = data.get("log")
    if rec is not None:
        if not lp.is_file():
            raise CorruptFileError(lp, f"missing, though its cell {path.name} records it")
        if not parse:
            verify_file(lp, rec)
            return None
        return read_json_lines(lp, rec)
    if not lp.is_file():
        return None
    rows = data["rows"]

    def same_episodes(eps) -> str | None:
        got = [(e["split"], e["task_index"], e["success"]) for e in eps]
        if got != [(r["split"], r["task_index"], r["success"]) for r in rows]:
            return f"its {len(eps)} episodes do not match the {len(rows)} rows of its cell {path.name} (truncated?)"
        return None

    return read_json_lines(lp, check=same_episodes)


def _rows_problem(rows: list[dict], eps: list[dict]) -> str | None:
    """Whether a cell's rows are the ones its episode log gives (:func:`episode_rows` of the
    same episodes: task, success, score, length and the responses' trace); the log's hash
    is checked, so rows edited after the fact are caught here."""
    if len(eps) != len(rows):
        return f"its {len(rows)} rows are not the {len(eps)} episodes of its log"
    for r, e in zip(rows, eps):
        trace = hashlib.sha256("\0".join(s["response"] for s in e["steps"]).encode()).hexdigest()[:16]
        got = (e["split"], e["task_index"], bool(e["success"]), float(e["score"]), len(e["steps"]), trace)
        if got != (r["split"], r["task_index"], r["success"], r["score"], r["length"], r["trace"]):
            return f"its row of task {r['split']}/{r['task_index']} disagrees with the episode log it was made from"
    return None


class CellCache:
    """Cells stored one JSON file each: ``<root>/cells/<env>-<family>/<key>.json`` with
    the key's fields (what the rows depend on), the rows, and provenance, and beside it
    the cell's episode log, whose SHA-256 and size the cell records.  Written atomically
    (the log first), so a killed sweep leaves whole cells or none; read back verified, so
    a truncated or garbage cell or log is recomputed, never served."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, key: str, fields: Mapping) -> Path:
        return self.root / "cells" / f"{fields['env']['name']}-{fields['perturbation']['family']}" / f"{key}.json"

    def get(self, key: str, fields: Mapping) -> list[dict] | None:
        """The cell's rows, or ``None`` when it is missing, it (or its episode log) does not
        verify, or its rows are not what its log gives: then it is recomputed (with a
        warning) and rewritten."""
        p = self.path(key, fields)
        if not p.is_file():
            return None
        try:
            data = _read_cell(p, key, fields["env"]["tasks"])
            eps = _check_cell_log(p, data, parse=True)
            bad = _rows_problem(data["rows"], eps) if eps is not None else None
            if bad:
                raise CorruptFileError(p, bad)
        except CorruptFileError as err:
            logger.warning("%s", err.with_fix("recomputing the cell"))
            return None
        return data["rows"]

    def log_path(self, key: str, fields: Mapping) -> Path:
        return self.path(key, fields).with_suffix(_LOG_SUFFIX)

    def put(self, key: str, fields: Mapping, rows: list[dict], seconds: float, log: list[dict] | None = None) -> Path:
        cell = {"key": key, "fields": fields, "rows": rows, "seconds": round(seconds, 2), "machine": compute_class(),
                "commit": git_commit(),
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        if log is not None:  # written first: a stored cell always has its log, and records what it is
            lp = atomic_write_text(self.log_path(key, fields), "".join(json.dumps(e) + "\n" for e in log))
            cell["log"] = file_record(lp)
        return atomic_write_json(self.path(key, fields), cell)


def load_episode_log(cache_dir: str | Path, cell: str) -> list[dict] | None:
    """The episode log of the cell whose key starts with ``cell`` (the rows' ``cell``
    column), or None when that cell was stored without one.  The log is checked against
    its cell (:class:`CellCache`); one that does not verify is an error naming it
    (:class:`~sprpo_lib.infra.io.CorruptFileError`), never returned."""
    hits = sorted(project_path(cache_dir).glob(f"cells/*/{cell}*{_LOG_SUFFIX}"))
    if not hits:
        return None
    lp = hits[0]
    cp = lp.with_name(lp.name[: -len(_LOG_SUFFIX)] + ".json")
    fix = (f"rerun the evaluation that made it (python -m sprpo_lib.evaluate, or the notebook or sweep that "
           f"computed cell {cp.stem[:12]}): the cell is recomputed with its log; or delete {lp.name} and {cp.name}")
    try:
        if not cp.is_file():  # a log whose cell was never stored (killed between the two writes): parsed whole
            return read_json_lines(lp)
        return _check_cell_log(cp, _read_cell(cp, cp.stem), parse=True)
    except CorruptFileError as err:
        raise err.with_fix(fix) from None


def cell_key(fields: Mapping) -> str:
    """The cache key of a cell: SHA-256 of its canonical fields (:func:`cell_fields`)."""
    return canonical_hash(fields)
