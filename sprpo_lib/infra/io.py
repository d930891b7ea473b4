"""Files written whole and read back checked: atomic writes (a killed writer leaves the
old file or the new one; a full disk leaves neither a partial file nor a library's error,
but one :class:`DiskFullError`), a lock for what two processes would compute alike, an
append-only JSON-lines log, and verified reads that raise :class:`CorruptFileError`
instead of serving a truncated or garbage file as data.
The bottom layer: imports nothing from the package."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from safetensors.torch import load_file

log = logging.getLogger(__name__)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


#: Permissions of files and directories the atomic writers create: what ``open`` and
#: ``mkdir`` would give under the process umask (mkstemp/mkdtemp alone give 0600/0700).
FILE_MODE, DIR_MODE = 0o666 & ~_umask(), 0o777 & ~_umask()


# ----------------------------------------------------------------------------- a full disk
def _size(n: float) -> str:
    units = ("B", "kB", "MB", "GB", "TB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _existing(folder: str | Path) -> Path:
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _block(folder: str | Path) -> int:
    return os.statvfs(_existing(folder)).f_frsize


def free_bytes(folder: str | Path) -> int:
    """Free space on the disk of ``folder`` (of its nearest existing parent)."""
    return shutil.disk_usage(_existing(folder)).free


def disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) is a write that found the disk full:
    ``ENOSPC`` / ``EDQUOT``, or the text a library wraps it in (safetensors: "os error 28")."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err) or "(os error 28)" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


class DiskFullError(OSError):
    """A write found the disk full.  Its one-line message names the folder, the free space
    there and about how much the write needed; the partial file is already gone, and the
    same command, rerun once there is space, resumes."""

    def __init__(self, folder: str | Path, need: int | None = None, files: int = 1):
        self.folder, self.free = Path(folder), free_bytes(folder)
        self.need = None if need is None else need + files * _block(folder)  # each file may end in a part-used block
        needs = f"about {_size(self.need)} needed, {_size(self.free)} free" if need else f"{_size(self.free)} free"
        super().__init__(errno.ENOSPC, f"no space left on the disk of {self.folder} ({needs}); free some space there "
                                       "(or write elsewhere) and rerun the same command: it resumes")

    def __str__(self) -> str:
        return self.strerror


def as_disk_full(err: BaseException, folder: str | Path) -> DiskFullError | None:
    """``err`` as the :class:`DiskFullError` a command prints (naming ``folder`` unless it
    names its own), or None when it is not a full disk."""
    if isinstance(err, DiskFullError):
        return err
    return DiskFullError(folder) if disk_full(err) else None


@contextlib.contextmanager
def space_checked(folder: str | Path, need: int | None = None, files: int = 1):
    """Turn a write in the block that finds the disk full, whatever library made it, into
    one :class:`DiskFullError` naming ``folder`` and the ``need`` bytes in ``files`` files
    that the block writes."""
    try:
        yield
    except Exception as err:
        if not (isinstance(err, DiskFullError) or disk_full(err)) or (need is None and isinstance(err, DiskFullError)):
            raise  # not a full disk, or an inner write's own error that knows its size
        raise DiskFullError(folder, need, files) from err  # the outermost caller that knows the whole write


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``:
    a killed process leaves either the old file or the new one, never half of one; a
    full disk leaves the old one and raises :class:`DiskFullError`."""
    path = Path(path)
    with space_checked(path.parent, len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return path


@contextlib.contextmanager
def atomic_dir(path: str | Path, need: int | None = None):
    """Build a directory under a temporary name (yielded) and rename it over ``path``
    only when the block succeeds: a killed writer leaves the old directory or none; a
    full disk leaves the old one and raises :class:`DiskFullError` (``need``: about how
    many bytes the block writes, for its message)."""
    path = Path(path)
    with space_checked(path.parent, need):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            yield tmp
            os.chmod(tmp, DIR_MODE)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: str | Path):
    """Hold an exclusive lock on ``path`` (created if missing) for the block: two
    processes that would compute the same cached thing (a warm start, one training run,
    a model's Fisher scores), here or on another node of shared storage, do it once;
    the second waits, then finds it cached.  Released when the process dies."""
    import fcntl  # POSIX only: loaded on use

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class JsonLines:
    """An append-only JSON-lines file: each :meth:`append_rows` writes whole lines and
    fsyncs; :meth:`read_rows` ignores a torn last line of a killed writer; :meth:`truncate`
    atomically keeps the rows a predicate accepts (e.g. iterations before a resume).
    The method names say "rows" so that no reader takes them for ``list.append`` or a file's ``read``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append_rows(self, *rows: dict) -> None:
        """Append whole lines; a failed append (a full disk: :class:`DiskFullError`) cuts the
        file back to where it was, so no torn line is left for the next append to follow."""
        data = "".join(json.dumps(r, default=str) + "\n" for r in rows).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            with space_checked(self.path.parent, len(data)):
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except BaseException:
                    os.ftruncate(fd, start)
                    raise
        finally:
            os.close(fd)

    def read_rows(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        with open(self.path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # torn final line of a killed run
        return out

    def truncate(self, keep) -> None:
        if self.path.is_file():
            atomic_write_text(self.path, "".join(json.dumps(r, default=str) + "\n" for r in self.read_rows() if keep(r)))


# ----------------------------------------------------------------------------- verified reads
class CorruptFileError(ValueError):
    """A stored file that is truncated, garbage or does not match what was recorded about
    it: the message names the file, what is wrong with it and how to fix it."""

    def __init__(self, path: str | Path, problem: str, fix: str = "delete it and rerun to recompute it"):
        self.path, self.problem, self.fix = Path(path), problem, fix
        super().__init__(f"corrupt file {self.path}: {problem}; {fix}")

    def with_fix(self, fix: str) -> "CorruptFileError":
        """The same error with the caller's advice on how to fix it."""
        return CorruptFileError(self.path, self.problem, fix)


def sha256_file(path: str | Path) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: str | Path) -> dict:
    """What a reader checks a file against (:func:`verify_file`, :func:`read_json_lines`):
    its SHA-256, size and number of lines.  Stored by whoever writes the file, beside it."""
    h, size, lines = hashlib.sha256(), 0, 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
            size, lines = size + len(chunk), lines + chunk.count(b"\n")
    return {"sha256": h.hexdigest(), "bytes": size, "lines": lines}


def _problem(check: Callable[[Any], str | None] | None, obj: Any) -> str | None:
    if check is None:
        return None
    try:
        return check(obj)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        return f"unexpected content ({type(err).__name__}: {err})"


def read_json(path: str | Path, check: Callable[[Any], str | None] | None = None) -> Any:
    """The JSON value in ``path``, checked: ``check(value)`` returns ``None`` when the value
    is whole, else what is wrong (an exception it raises counts as wrong too).  Raises
    :class:`CorruptFileError` for undecodable bytes, invalid JSON (a truncated file) or a
    failed check; ``FileNotFoundError`` when there is no file."""
    path = Path(path)
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise CorruptFileError(path, "not UTF-8 text (garbage bytes)") from None
    except json.JSONDecodeError as err:
        raise CorruptFileError(path, f"not valid JSON, truncated or overwritten ({err})") from None
    problem = _problem(check, obj)
    if problem:
        raise CorruptFileError(path, problem)
    return obj


def _verify(path: Path, size: int, digest, record) -> None:
    """``digest``: the SHA-256 hex digest, or a function computing it (only called when the size matches)."""
    if not isinstance(record, dict):
        raise CorruptFileError(path, f"the record it is checked against is not an object: {record!r}")
    if "bytes" in record and size != record["bytes"]:
        raise CorruptFileError(path, f"{size} bytes where {record['bytes']} were written (truncated or overwritten)")
    if (digest() if callable(digest) else digest) != record.get("sha256"):
        raise CorruptFileError(path, "content differs from the SHA-256 recorded when it was written")


def verify_file(path: str | Path, record: dict) -> None:
    """Check a file against its :func:`file_record` (same size and SHA-256), reading it in
    chunks.  Raises :class:`CorruptFileError`, or ``FileNotFoundError``."""
    path = Path(path)
    _verify(path, path.stat().st_size, lambda: sha256_file(path), record)


def read_json_lines(path: str | Path, record: dict | None = None,
                    check: Callable[[list], str | None] | None = None) -> list[dict]:
    """Every line of a JSON-lines file as a dict, strictly: unlike :meth:`JsonLines.read_rows`
    (an append log whose torn last line is dropped) a bad line anywhere is an error.
    With ``record`` (:func:`file_record` at write time) the file must match it byte for
    byte, so a file truncated at a line boundary is caught too; ``check`` as in
    :func:`read_json`.  Raises :class:`CorruptFileError`, or ``FileNotFoundError``."""
    path = Path(path)
    data = path.read_bytes()
    if record is not None:
        _verify(path, len(data), lambda: hashlib.sha256(data).hexdigest(), record)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptFileError(path, "not UTF-8 text (garbage bytes)") from None
    if text and not text.endswith("\n"):
        raise CorruptFileError(path, "last line is cut off (truncated)")
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorruptFileError(path, f"line {i} is not valid JSON ({err})") from None
        if not isinstance(row, dict):
            raise CorruptFileError(path, f"line {i} is not a JSON object")
        rows.append(row)
    problem = _problem(check, rows)
    if problem:
        raise CorruptFileError(path, problem)
    return rows


def read_safetensors(path: str | Path) -> dict:
    """All tensors of a safetensors file (the format refuses a truncated or garbage file;
    never unpickles).  Raises :class:`CorruptFileError`, or ``FileNotFoundError``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(path)
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 - SafetensorError and friends: all mean "not a whole file"
        raise CorruptFileError(path, f"not a whole safetensors file ({type(err).__name__}: {err})") from None


def read_cached(path: str | Path, read: Callable[..., Any] = read_json, *args, **kwargs) -> Any | None:
    """A cache entry: ``read(path, *args, **kwargs)`` (one of the readers above), or ``None``
    when the file is missing or corrupt (logged as a warning), so the caller recomputes
    it and overwrites the file."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return read(path, *args, **kwargs)
    except FileNotFoundError:
        return None
    except CorruptFileError as err:
        log.warning("%s", err.with_fix("recomputing it"))
        return None


#: ``dataclasses.field(metadata=OMIT_AT_DEFAULT)``: an option added after results were
#: cached; :func:`key_fields` leaves it out while it holds its default, so adding it does
#: not change any existing cache key, run config or content hash.
OMIT_AT_DEFAULT = {"omit_at_default": True}
#: ``dataclasses.field(metadata=NOT_A_KEY)``: an option of where output goes, not of what is
#: computed (e.g. the training loggers); :func:`key_fields` always leaves it out.
NOT_A_KEY = {"not_a_key": True}


def key_fields(obj):
    """``dataclasses.asdict(obj)`` (recursively) without the fields marked
    :data:`OMIT_AT_DEFAULT` that hold their default and those marked :data:`NOT_A_KEY`:
    the dataclass as keys and ``config.json`` record it."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("not_a_key"):
                continue
            v = getattr(obj, f.name)
            if f.metadata.get("omit_at_default"):
                default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                if v == default:
                    continue
            out[f.name] = key_fields(v)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(key_fields(v) for v in obj)
    if isinstance(obj, dict):
        return {k: key_fields(v) for k, v in obj.items()}
    return obj


def canonical_hash(obj) -> str:
    """SHA-256 of an object's canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()
