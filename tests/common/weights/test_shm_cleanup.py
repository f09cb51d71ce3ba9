"""common/weights/shm_cleanup.py: a run's weights directory is its user's alone, and what a killed driver left in
/dev/shm is removed by the next one, judging only this user's directories and files (what engines map,
and the sweep during a real run: tests/actors/test_inference.py, tests/deploy/test_train_interrupt.py)."""
from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from common.weights import shm_cleanup

NOBODY = 65534


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def shm_names():
    """Names for test files directly in /dev/shm (what remove_unused handles), removed afterwards."""
    made: list[str] = []

    def name(kind: str) -> str:
        made.append(os.path.join(shm_cleanup.SHM_DIR, f"gigpo-test-{kind}-{uuid.uuid4().hex[:8]}"))
        return made[-1]
    yield name
    for path in made:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)


def test_a_weights_directory_is_its_users_alone_whatever_the_umask(tmp_path):
    directory = tmp_path / "gigpo-weights-run"
    previous = os.umask(0o002)          # a group-writable umask
    try:
        shm_cleanup.claim(str(directory))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert (directory / shm_cleanup.OWNER_FILE).read_text() == f"{socket.gethostname()} {os.getpid()}\n"
    with pytest.raises(FileExistsError):         # made by someone first: refused, not shared
        shm_cleanup.claim(str(directory))


def test_the_sweep_removes_a_dead_drivers_directory_and_leaves_a_live_ones(shm_names):
    dead, live = shm_names("weights-dead"), shm_names("weights-live")
    for directory, pid in ((dead, _dead_pid()), (live, os.getpid())):
        os.mkdir(directory)
        Path(directory, shm_cleanup.OWNER_FILE).write_text(f"{socket.gethostname()} {pid}\n")
    segment = shm_names("segment")
    Path(segment).write_bytes(b"x")
    shm_cleanup.write_note(os.path.join(dead, ".engine-shm-0.json"), [segment])
    assert shm_cleanup.sweep_orphaned(os.path.join(shm_cleanup.SHM_DIR, "gigpo-test-weights-*")) == [dead]
    assert not os.path.exists(dead) and not os.path.exists(segment) and os.path.isdir(live)


@pytest.mark.skipif(os.getuid() != 0, reason="handing a file to another user needs root")
def test_another_users_directory_and_files_are_not_judged(shm_names):
    """Another user's directory, even with an owner file naming a dead process here and a note listing a file,
    is left alone, and so is another user's file that one of this user's notes lists."""
    theirs, mine = shm_names("weights-theirs"), shm_names("weights-mine")
    their_file, my_file = shm_names("their-segment"), shm_names("my-segment")
    for path in (their_file, my_file):
        Path(path).write_bytes(b"x")
    for directory, files in ((theirs, [their_file]), (mine, [their_file, my_file])):
        os.mkdir(directory)
        Path(directory, shm_cleanup.OWNER_FILE).write_text(f"{socket.gethostname()} {_dead_pid()}\n")
        shm_cleanup.write_note(os.path.join(directory, ".engine-shm-0.json"), files)
    for path in (theirs, os.path.join(theirs, shm_cleanup.OWNER_FILE), their_file):
        os.chown(path, NOBODY, NOBODY)
    assert shm_cleanup.sweep_orphaned(os.path.join(shm_cleanup.SHM_DIR, "gigpo-test-weights-*")) == [mine]
    assert os.path.isdir(theirs) and os.path.exists(their_file) and not os.path.exists(my_file)
