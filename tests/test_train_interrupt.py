"""`gigpo train` stopped from outside: Ctrl-C (SIGINT to the terminal's whole process group) or SIGTERM (`kill`,
a scheduler) while it runs. The run ends within a deadline, through System.close, and leaves nothing behind
outside its output directory: no process, no weights directory, no shared memory, nothing in /tmp; the
embedded Redis's data stays in the run's directory, for its resume to continue the stream. (A run that loses
its learner: tests/test_secrets.py.)"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from common import shm_cleanup
from deploy.control import JOB_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
# The small run of test_system_e2e.py, with more updates than it will get to do.
OVERRIDES = ["run.iterations=1000", "run.eval_every=0", "rollout.groups_per_actor=2", "rollout.group_size=2",
             "learner.groups_per_batch=2", "env.max_steps=4", "env.num_generated_games=4",
             "rollout.cpus_per_actor=0.25", "model.warm_start_steps=0"]
START_S = 600       # to the first update, on a loaded 2-core machine
STOP_S = 240        # System.close's own deadlines: 60 s for rollout actors, 60 s for the engines, ...


def _wait_for(condition, timeout_s: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert proc.poll() is None, f"gigpo train ended (code {proc.returncode}) before {what}:\n" + \
            log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s:\n" + log.read_text()[-4000:]
        time.sleep(0.5)
    return value


def _run_processes(session: int) -> list[psutil.Process]:
    """The processes of the run: its session (each group of Ray's is in it too)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_stopped_run_ends_in_time_and_leaves_nothing(tmp_path, sig):
    weights_glob = os.path.join(shm_cleanup.SHM_DIR, "gigpo-weights-*")
    weights_before = set(glob.glob(weights_glob))
    out = tmp_path / "run"
    log = tmp_path / "train.log"
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    with open(log, "wb") as log_file:
        # A session of its own, as a terminal gives a command: Ctrl-C signals the whole foreground group.
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "train", "configs/embedded.yaml",
                                 f"run.output_dir={out}", *OVERRIDES], cwd=REPO, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: (out / JOB_FILE).exists(), START_S, "job file", proc, log)
        redis = _wait_for(lambda: [p for p in psutil.Process(proc.pid).children(recursive=True)
                                   if "redis-server" in p.name()], 60, "redis-server", proc, log)[0]
        redis_dir = redis.cwd()
        assert Path(redis_dir) == out / "redis"
        # Training: the first update is logged (every part is up, and weights were pushed).
        metrics = out / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, START_S, "first update", proc, log)
        run_shm = shm_cleanup.mapped_by(shm_cleanup.descendants(proc.pid))
        assert run_shm, "the run's vLLM engine maps no shared memory: nothing to check the clean-up of"
        # The run's weights directory: the one where its engine noted the shared memory it maps (another
        # run on the machine may have made one meanwhile).
        notes = {d: [set(json.loads(note.read_text())["files"]) for note in Path(d).glob(shm_cleanup.NOTE_GLOB)]
                 for d in set(glob.glob(weights_glob)) - weights_before}
        weights_dirs = {d for d, noted in notes.items() if any(files & run_shm for files in noted)}
        assert weights_dirs, "no weights directory of the run's in /dev/shm"
        # What its engine noted: the rings it maps, and the semaphore nobody maps.
        run_shm |= {f for d in weights_dirs for files in notes[d] for f in files}
        if sig == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        proc.wait(timeout=STOP_S)
        print(f"{signal.Signals(sig).name}: ended in {time.monotonic() - t0:.0f} s, code {proc.returncode}")
    finally:
        if proc.poll() is None:           # the test failed: do not leave the run behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Ctrl-C ends it as an uncaught KeyboardInterrupt does (by SIGINT), SIGTERM with 128 + 15.
    assert proc.returncode in ((-signal.SIGINT, 128 + signal.SIGINT) if sig == signal.SIGINT else (128 + sig,))
    logs = log.read_text() + "".join(p.read_text(errors="replace") for p in (out / "logs").glob("driver*.log"))
    assert not [line for line in logs.splitlines() if "closing" in line and "failed" in line], logs[-4000:]
    # Every process of the run ends with it (Ray's included).
    deadline = time.monotonic() + 30
    while (left := _run_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [(p.pid, p.name()) for p in left]
    assert not redis.is_running(), "the embedded redis-server still runs"      # (a session of its own)
    # Its append-only file stays in the run, for a resume (a finished run removes it: test_faults_learner).
    assert (out / "redis" / "appendonly.aof").is_file()
    # ... and nothing of it in /tmp (the directory with its password file is the driver's: removed).
    owners = glob.glob(os.path.join(tempfile.gettempdir(), "gigpo-redis-*", "owner.pid"))
    assert not [f for f in owners if int(Path(f).read_text()) == proc.pid], owners
    assert not [d for d in weights_dirs if os.path.exists(d)], "the run's weights directory is still there"
    assert not [f for f in run_shm if os.path.exists(f)], "the run's shared memory is still there"
