"""Safe output directories: never delete what mergecal did not write, commit atomically, clean up always.

``OutputDir(target, inputs=..., overwrite=...)`` checks the target, takes a lock beside it and opens a staging
directory; ``commit()`` moves the staging directory into place, ``abort()`` removes it. The rules:

* the output must not be, or contain, any input (every file an input reads: shards of an index, files of a
  directory, both the link and its target for symlinks), nor be or contain the current directory;
* an existing target is replaced only when it is a previous mergecal output (it holds ``MARKER``, which
  every commit writes), an empty directory, or ``overwrite=True`` is given;
* one writer at a time: ``.<name>.lock`` beside the target is held (``flock``) from the start to the commit;
  a second writer fails with a clear error. The lock file is removed when released;
* staging (``.<name>.<pid>-<token>.staging``) and the swapped-out old output (``...old``) live beside the target.
  Whoever holds the lock is the only writer, so such entries found then whose PID is not a running process were
  left by a killed run (SIGKILL runs no cleanup) and are removed (an ``.old`` whose target is missing is the
  previous output of a run killed mid-commit: put back). ``remove_stale(target)`` does the same, lock file
  included, without writing: ``merge_checkpoints`` calls it first, so they go even when the merge then fails;
* directories and files are created with the process umask (``mkdtemp`` would give 0700);
* a signal never strands a staging directory: SIGINT/SIGTERM are deferred while the lock is taken and the staging
  directory made (so ``__init__`` either fails clean or returns an open output), and an output is on this
  process's list of open outputs from its lock to its commit or abort: whatever interrupts the caller before it
  can call ``abort()`` (a signal between ``__init__`` and a ``with``), the interpreter's exit aborts it.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputError

MARKER = ".mergecal-output"
MARKER_TEXT = "written by mergecal; a later mergecal write to this directory may replace it\n"
INDEX_SUFFIX = ".index.json"


def umask() -> int:
    """The process umask, read without changing it where Linux reports it (changing it races with threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _located(path: Path) -> Path:
    """Absolute path with its parent's symlinks resolved, the last component kept (where a rename acts)."""
    path = Path(os.path.abspath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def input_files(path: str | os.PathLike) -> set[Path]:
    """Every path an input checkpoint reads: itself, a directory's entries, an index's shards; each both
    where it is and, for symlinks, where it points."""
    path = Path(path)
    found = {path}
    if path.is_dir():
        found.update(path.iterdir())
    indexes = [p for p in found if p.name.endswith(INDEX_SUFFIX) and p.is_file()]
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            found.update(index.parent / shard for shard in weight_map.values() if isinstance(shard, str))
        except (OSError, ValueError, AttributeError):
            pass  # a malformed index is reported by the reader; here it names no more files
    return {_located(p) for p in found} | {Path(os.path.realpath(p)) for p in found}


def _is_within(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_target(target: Path, inputs: Iterable[str | os.PathLike]) -> None:
    """The checks that need no lock: symlink, current directory, inputs."""
    if target.is_symlink():
        raise OutputError(f"{target}: is a symbolic link; give the directory it points to or a new path")
    for given in inputs:
        for path in sorted(input_files(given)):
            if path == target:
                raise OutputError(f"{target}: the output must not be one of the input checkpoints ({given})")
            if _is_within(path, target):
                raise OutputError(f"{target}: the output directory contains the input {path}; "
                                  "choose a directory that holds no input")
    if _is_within(Path(os.path.realpath(os.getcwd())), target):
        raise OutputError(f"{target}: is the current directory or contains it; choose another output directory")


def check_replaceable(target: Path, overwrite: bool) -> None:
    """An existing target may be replaced: a previous mergecal output, an empty directory, or overwrite."""
    if overwrite or not os.path.lexists(target):
        return
    if not target.is_dir():
        raise OutputError(f"{target}: exists and is a file; pass --overwrite (overwrite=True) to replace it, "
                          "or choose another path")
    if (target / MARKER).exists() or not any(target.iterdir()):
        return
    raise OutputError(f"{target}: exists and holds files mergecal did not write (no {MARKER}); pass --overwrite "
                      "(overwrite=True) to replace it, or choose a new directory")


def _os_error(target: Path, what: str, err: OSError) -> OutputError:
    where = f"; {err.filename}" if err.filename and str(err.filename) != str(target) else ""
    return OutputError(f"{target}: {what} ({err.strerror or err}{where})")


def _lock(path: Path, target: Path) -> int:
    """An exclusive flock on ``path``; retried when the file was removed by its previous holder meanwhile."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{target}: another process is writing this output (lock {path} is held); "
                              "wait for it to finish or choose another output directory") from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            return fd
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.unlink()
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a file may stand where its parent should)
        pass


@contextmanager
def _signals_deferred():
    """SIGINT/SIGTERM arriving while the output is swapped are delivered right after, never in between."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    # handlers are set in the main thread only; one installed outside Python (None) could not be restored
    if threading.current_thread() is not threading.main_thread() or None in map(signal.getsignal, sigs):
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            signal.raise_signal(received[0])


# The outputs this process has open (locked, not yet committed or aborted), aborted at the interpreter's exit: a
# signal can reach a caller after OutputDir() returned and before it could abort it. Each with the PID that opened
# it: a forked child's exit leaves its parent's outputs alone.
_open_outputs: dict[int, tuple[int, OutputDir]] = {}
_open_outputs_lock = threading.Lock()


def _opened(output: OutputDir) -> None:
    with _open_outputs_lock:
        _open_outputs[id(output)] = (os.getpid(), output)


def _closed(output: OutputDir) -> None:
    with _open_outputs_lock:
        _open_outputs.pop(id(output), None)


@atexit.register
def _abort_open_outputs() -> None:
    with _open_outputs_lock:
        mine = [output for pid, output in _open_outputs.values() if pid == os.getpid()]
    for output in mine:
        output.abort()


def _lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def _release(lock_path: Path, fd: int) -> None:
    lock_path.unlink(missing_ok=True)  # while still held: a waiting opener sees a new file
    os.close(fd)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a running process other than this one (which holds the lock, so none of its own
    entries is in use). A belt to the lock's braces: a running process's entries are never removed."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    except (OverflowError, ValueError):  # not a PID at all
        return False
    return True


def _stale_entries(target: Path) -> list[Path]:
    """Staging and swapped-out directories beside ``target`` left by writers that no longer run."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)-[0-9a-f]{{8}}\.(staging|old)")
    found = ((p, pattern.fullmatch(p.name)) for p in target.parent.iterdir())
    return sorted(p for p, match in found if match and not _running(int(match.group(1))))


def _remove_leftovers(target: Path) -> None:
    """Remove the stale entries beside ``target``; call only while holding its lock."""
    found = _stale_entries(target)
    olds = [p for p in found if p.name.endswith(".old")]
    if olds and not os.path.lexists(target):  # the latest swapped out (a rename sets ctime)
        os.rename(max(olds, key=lambda p: p.stat().st_ctime), target)
    for path in found:
        if path.exists():
            _remove(path)


def remove_stale(target: str | os.PathLike) -> None:
    """Remove what killed writers left beside ``target`` (staging, swapped-out output, lock file) unless a writer
    holds its lock now; best effort and silent: the write that follows reports what it cannot do."""
    target = _located(Path(target))
    lock_path = _lock_path(target)
    try:
        if not (os.path.lexists(lock_path) or _stale_entries(target)):
            return
        fd = _lock(lock_path, target)
    except (OutputError, OSError):  # a writer holds it, or the directory cannot be read or written
        return
    try:
        _remove_leftovers(target)
    except OSError:
        pass
    finally:
        _release(lock_path, fd)


class OutputDir:
    """A directory output written in ``self.staging`` and committed by rename (see the module docstring)."""

    def __init__(self, target: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (),
                 overwrite: bool = False):
        self._fd: int | None = None
        self.target = _located(Path(target))
        check_target(self.target, list(inputs))
        self._lock_path = _lock_path(self.target)
        self.staging = self._sibling("staging")
        try:
            with _signals_deferred():  # a signal lands before the lock or once staging exists and is listed
                self._open(overwrite)
        except FileExistsError as err:  # mkdir met a file where a directory of the path should be
            self.abort()
            raise OutputError(f"{self.target}: cannot write the output ({err.filename} is a file, not a "
                              "directory)") from None
        except OSError as err:
            self.abort()
            raise _os_error(self.target, "cannot write the output", err) from None
        except BaseException:
            self.abort()
            raise

    def _open(self, overwrite: bool) -> None:
        """Take the lock, list this output as open, clear what killed writers left, make the staging directory."""
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self._fd = _lock(self._lock_path, self.target)
        _opened(self)
        _remove_leftovers(self.target)
        check_replaceable(self.target, overwrite)
        os.mkdir(self.staging, 0o777)  # the umask applies

    def _sibling(self, kind: str) -> Path:
        return self.target.parent / f".{self.target.name}.{os.getpid()}-{secrets.token_hex(4)}.{kind}"

    def _unlock(self) -> None:
        if self._fd is not None:
            _release(self._lock_path, self._fd)
            self._fd = None

    def commit(self) -> Path:
        """Write the marker and move the staging directory into place (the old target is swapped out first)."""
        try:
            (self.staging / MARKER).write_text(MARKER_TEXT)
            with _signals_deferred():
                self._swap()
                self._unlock()
                _closed(self)
        except OSError as err:
            self.abort()
            raise _os_error(self.target, "cannot replace the output", err) from None
        except BaseException:
            self.abort()
            raise
        return self.target

    def _swap(self) -> None:
        if not os.path.lexists(self.target):
            os.rename(self.staging, self.target)
            return
        old = self._sibling("old")
        os.rename(self.target, old)
        try:
            os.rename(self.staging, self.target)
        except BaseException:
            os.rename(old, self.target)
            raise
        _remove(old)

    def abort(self) -> None:
        """Remove the staging directory and release the lock; safe to call again, and at any point of __init__."""
        _remove(self.staging)
        self._unlock()
        _closed(self)

    def __enter__(self) -> Path:
        return self.staging

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
