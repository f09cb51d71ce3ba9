"""Writing a file so that a reader sees the old contents or the new, never a part: the one home of
write-to-a-temporary-file-then-rename, and of making what was written survive a power cut (`durable`).

A rename is atomic on a POSIX filesystem, but not durable: after a kernel crash or a power cut the new name may
point at a file whose data never reached the disk (an empty file), or the rename itself may be undone. A durable
write fsyncs the file's data before the rename and the directory after it. The run uses that where something
irreversible follows the write: the learner acks (deletes) a stream's groups once a checkpoint holds them,
so the checkpoint's files (`fsync_tree`) and its marker must be on disk first.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def fsync_directory(path: str | os.PathLike) -> None:
    """Make the entries of directory `path` (names created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Make the data of file `path` durable (whoever wrote it, and however)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Make every file and directory entry under `root`, and root's own entry in its parent, durable: for files
    another library wrote (DeepSpeed's checkpoint) before something irreversible depends on them."""
    root = Path(root)
    for directory, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(directory, name))
        fsync_directory(directory)
    fsync_directory(root.parent)


def _new_file_beside(path: Path) -> str:
    """An empty new file in path's directory, named after it, with the permissions the umask gives a new file
    (mkstemp's would be 0600: a file other users read, a model's or a catalog's, must not change mode)."""
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextlib.contextmanager
def replaced_atomically(path: str | os.PathLike, *, durable: bool = False, mode: int | None = None) -> Iterator[Path]:
    """A temporary path beside `path` for the caller to write (by any means); when the block ends without an
    exception it replaces `path` in one rename (durably: its data fsynced first, the directory after), else it
    is removed and `path` is left as it was. The parent directory is created if missing. `mode`: the file's
    permissions (default: what the umask gives a new file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_file_beside(path)
    try:
        yield Path(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_directory(path.parent)


def write_atomically(path: str | os.PathLike, data: str | bytes, *, durable: bool = False,
                     mode: int | None = None) -> None:
    """Replace the file `path` with `data` (text as UTF-8) in one rename; see `replaced_atomically`."""
    with replaced_atomically(path, durable=durable, mode=mode) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
