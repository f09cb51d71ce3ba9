"""A run's life on Ray: Ray started or joined, SIGTERM handled as Ctrl-C, Ray closed leaving no shared memory
behind, and after a failure, which parts the run lost that it cannot go on without (`RunLost`)."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import signal
import threading
from pathlib import Path

import ray
import redis

from common.config import ExperimentConfig
from common.metrics import ray_init_metrics_options
from common.processes.placement import node_label
from common.processes.process_env import apply_project_env, driver_runtime_env
from common.redaction import redact
from common.run_dir import DamagedLatest, checkpoints_dir, resume_point, tag_update
from common.stream.redis_client import connect
from common.weights import shm_cleanup
from deploy.learner_pool import LearnerPool
from env_servers.registry import data_env

log = logging.getLogger("gigpo")

EXIT_LOST = 3            # `gigpo train`'s exit status when the run lost a part it needs (RunLost)


def start_ray(cfg: ExperimentConfig) -> str:
    """Connect to `run.ray_address` / RAY_ADDRESS, or start a local Ray sized for this machine. The project's
    environment is set first, so that a local Ray's processes inherit it (on a cluster each actor sets it)."""
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    apply_project_env()
    # The data the env workers read, as absolute paths resolved here (where preflight checked them): an
    # actor runs in whatever directory Ray starts it in, on whichever node (./data would be found nowhere).
    os.environ.update(data_env(cfg.env))
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")
    env = driver_runtime_env(os.environ)
    with stopped_at_once_by_signals():
        if address:
            # Actors on other nodes write their log files there; streaming their output to the driver (into
            # its driver.log, see common.processes.log_files) keeps one copy of everything where the run was started.
            ray.init(address=address, runtime_env=env, namespace="gigpo", log_to_driver=True)
        else:
            # log_to_driver=False: every actor writes its own log file under the run's logs/ already.
            ray.init(address="local", num_cpus=os.cpu_count() or 1, runtime_env=env, namespace="gigpo",
                     object_store_memory=200 * 1024**2, include_dashboard=False, log_to_driver=False,
                     **ray_init_metrics_options())
    return ray.get_runtime_context().gcs_address


@contextlib.contextmanager
def stopped_at_once_by_signals():
    """While Ray starts, SIGINT and SIGTERM take the kernel's default action: this process ends at once, killed
    by the signal, and the processes Ray started end with it (Ray starts them sharing its fate: the kernel kills
    them when it dies, PR_SET_PDEATHSIG). No Python handler can do it, in any thread: ray.init waits in C++
    holding the interpreter's lock (for the GCS's port file: 30 s when a SIGTERM to the whole process group
    killed the GCS), so no Python code runs until it returns; and an exception raised into a half-started node
    crashes the interpreter. ray.init's first step installs a SIGTERM handler of its own, in Python; it is kept
    from doing so while Ray starts (SignalTrap.trap installs the run's handlers after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)}
    ray_utils = ray._private.utils
    ray_sets_handler = getattr(ray_utils, "set_sigterm_handler", None)
    if ray_sets_handler is not None:
        ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        if ray_sets_handler is not None:
            ray_utils.set_sigterm_handler = ray_sets_handler
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def link_ray_logs(log_dir: str) -> None:
    """<log_dir>/ray -> this node's Ray session logs. Best effort: Ray does not publish the path publicly."""
    try:
        ray_logs = ray._private.worker._global_node.get_logs_dir_path()
    except Exception:  # noqa: BLE001 - no local node (a client connection) or Ray moved it
        return
    link = Path(log_dir) / "ray"
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ray_logs, target_is_directory=True)
    except OSError as exc:
        log.info("could not link Ray's logs %s into %s: %s", ray_logs, log_dir, exc)


def stop_ray() -> None:
    """Shut Ray down, then remove the /dev/shm files this run's processes mapped (noted before Ray ends them:
    afterwards nobody could name them) and nobody maps any more."""
    held = shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid()))
    try:
        if ray.is_initialized():
            ray.shutdown()
    finally:
        removed = shm_cleanup.remove_unused(held, wait_s=30)
        if removed:
            log.info("removed shared memory left by ended processes: %s", removed)


class RunLost(RuntimeError):
    """The run lost a part it cannot go on without: a learner rank (its process, or its node), or its Redis.
    `lost`: one line per part; `learner_node`: learner rank 0's node when not the driver's (its checkpoints
    are there)."""

    def __init__(self, lost: list[str], output_dir: str, learner_node: dict | None = None):
        super().__init__("the run lost " + "; ".join(lost))
        self.lost, self.output_dir, self.learner_node = list(lost), output_dir, learner_node


def lost_run_message(exc: RunLost, resume_command: list[str]) -> str:
    """What `gigpo train` prints on RunLost: what was lost, the checkpoint a resume starts from (the learner's
    own choice: common.run_dir.resume_point), how to resume."""
    root = checkpoints_dir(exc.output_dir)
    lines = [f"gigpo: the run lost {part}" for part in exc.lost]
    try:
        found, note = resume_point(root)
    except DamagedLatest as damaged:
        found, note = None, str(damaged)
    if found is not None:
        lines.append(f"a resume starts from {found} (update {tag_update(found.name)})" + (f" ({note})" if note else "")
                     + "; updates done after it are trained again")
    elif note:
        lines.append(note)
    else:
        lines.append(f"no complete checkpoint in {root} on this node"
                     + (f" (learner rank 0 wrote its checkpoints on its own node, {node_label(exc.learner_node)}: "
                        "there, unless a filesystem both nodes mount holds run.output_dir)" if exc.learner_node
                        else "") + ": a resumed run starts from update 0")
    lines.append(f"resume with: {shlex.join(resume_command)}")
    return "\n".join(lines)


class SignalTrap:
    """SIGTERM raises KeyboardInterrupt in the main thread, as Ctrl-C does, so that `with System(...)` runs
    close(); its __exit__ then exits 143. (KeyboardInterrupt: a blocked ray.get passes it on unchanged, but
    turns a SystemExit into SystemExit(1).) While the run closes (`closing`), both are noted and ignored."""

    def __init__(self):
        self.closing = False
        self.stopped_by: int | None = None       # the signal that stopped the run
        self._saved: dict | None = None          # SIGINT/SIGTERM handlers from before `trap`

    def trap(self) -> None:
        """Install the handlers; again after ray.init, since a SIGTERM handler of Ray's (it installs one where
        stopped_at_once_by_signals does not keep it out) would kill Ray before anything closes."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self._saved is None:
            self._saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        if self.closing:
            log.warning("%s while shutting down: ignored, the run is being closed (every step has a deadline)",
                        signal.Signals(signum).name)
            return
        self.stopped_by = signum
        # A learner closes after the update it is in (a Ray actor runs one call at a time), and that can take
        # minutes for a large model on CPU: say so, or the wait looks like a hang.
        log.warning("%s: stopping the run (each part in turn; a learner after the update it is in, which for a "
                    "large model can take minutes; every step has a deadline)", signal.Signals(signum).name)
        raise KeyboardInterrupt

    def restore(self) -> None:
        if self._saved is not None and threading.current_thread() is threading.main_thread():
            for sig, handler in self._saved.items():
                signal.signal(sig, handler)
            self._saved = None


def disk_full(exc: BaseException | None) -> OSError | None:
    """The out-of-space error at the root of `exc` (a learner's failed checkpoint reaches the driver wrapped
    by Ray: its `cause`), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def lost_parts(learners: LearnerPool, embedded_redis, redis_url: str | None,
               failure: BaseException | None = None) -> list[str]:
    """What the run has lost and cannot go on without, one line each: a learner rank Ray reports dead (its
    process, or its node: `LearnerPool.lost`), the Redis, or the space its checkpoints need (`failure`: what
    ended the run, when a disk filled up)."""
    lost = learners.lost()
    full = disk_full(failure)
    if full is not None:
        lost.append(f"the space its checkpoints need: {full.strerror}")
    if embedded_redis is not None:
        if not embedded_redis.running:
            lost.append(f"its embedded Redis (the trajectory stream and the control channel; redis-server pid "
                        f"{embedded_redis.pid} on this node): the process ended")
    elif redis_url:
        try:
            connect(redis_url, retries=0, socket_timeout_s=5).ping()
        except redis.RedisError as exc:
            lost.append(f"its Redis at {redact(redis_url)} (stream.redis_url): it does not answer "
                        f"({' '.join(str(exc).split())[:200]}); start it again (with AOF its stream is kept)")
    return lost
