"""Output files that are checked before any work and never left half-written.

`check_output_path` refuses, up front, a path that could only fail at the end (a folder, a missing or read-only
folder, a read-only file) or that writing would destroy (a device, a pipe or a socket), so a long render or session never ends in "cannot write". `atomic_output` and
`write_atomic` write beside the target and rename into place, so a crash or a kill mid-write leaves the previous
file untouched; the hidden `.NAME.PID.*.tmp` a SIGKILL leaves beside it is removed by the next write of NAME once
process PID is gone."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path


class OutputPathError(ValueError):
    """An output path that cannot be written; the message names the path and the fix."""


def check_output_path(path: str | Path, what: str) -> Path:
    """The path, if a file can be written there; otherwise OutputPathError. `what` names the path for the
    user, e.g. "--out". Missing folders are not created: a mistyped folder is refused rather than made."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{what} {path} is a folder; give a file path, e.g. {path / 'out.wav'}")
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"{what} {path}: {folder} is a file, not a folder; choose another path")
    if not folder.is_dir():
        raise OutputPathError(f"{what} {path}: the folder {folder} does not exist; create it or choose another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} {path}: the folder {folder} is not writable; choose another path")
    if path.exists() and not path.is_file():  # written beside and renamed over: it would replace /dev/null itself
        raise OutputPathError(
            f"{what} {path} is a device, pipe or socket, not a file: writing would replace it; give a file path"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"{what} {path} is read-only; choose another path or make it writable")
    return path


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path in the target's folder to write the whole file to; when the block ends normally the
    file is fsync'd and renamed over `path` in one step. If the block raises, the temporary file is removed and
    `path` is untouched. The folder must exist."""
    path = Path(path)
    _remove_stale_temporaries(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # 0o666: the umask decides, as usual
    try:
        yield temporary
        _fsync(temporary, os.O_RDONLY)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename is durable once the folder is synced (not possible everywhere)
        _fsync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def write_atomic(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` through `atomic_output`; returns the path."""
    with atomic_output(path) as temporary:
        temporary.write_bytes(data)
    return Path(path)


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of `path` that writers killed mid-write left (`.NAME.PID.hex.tmp` whose process PID is
    gone); a live writer's is kept."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    with contextlib.suppress(OSError), os.scandir(path.parent) as entries:  # unlistable: the write will say why
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match and not _alive(int(match[1])):
                Path(entry.path).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _fsync(path: Path, flags: int) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
