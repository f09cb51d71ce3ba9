"""Two Ray nodes on this one machine, each in its own Linux network namespace, for the multi-node tests and
benchmarks.

    from tests.support.multinode import two_node_cluster, namespaces_unavailable

    with two_node_cluster(head_cpus=2, worker_cpus=4) as cluster:
        cluster.address          # "10.250.0.1:6379": the head's GCS (ray.init, `--address`, run.ray_address)
        cluster.dashboard_url    # "http://10.250.0.1:8265": `ray job submit --address`
        cluster.head_resource    # "head":   a Ray custom resource only the head node has (100 units)
        cluster.worker_resource  # "worker": one only the worker node has (100 units)
        cluster.run_on_head([".venv/bin/python", "my_driver.py", cluster.address], timeout_s=300)
        proc = cluster.popen_on_head([...])      # the same, not waited for (it dies with the cluster)

Everything a command on the head needs is in `cluster.env` (the Ray token, PATH with .venv/bin); run
drivers with `run_on_head`/`popen_on_head` (this process is outside both namespaces and cannot reach
them). An actor goes to a node by asking for its resource: `.options(resources={cluster.worker_resource: 1})`
or, in a run's config, `inference.resources={"worker": 1}`.

For a benchmark across the two nodes (bench/bench_weight_sync.py's cross-node figure): run its driver on the
head against `cluster.address`, the learner side placed with `head_resource`, the inference side with
`worker_resource`, and read its result from stdout (the head shares this machine's files under /tmp):

    # object_store_mb: room for the shipped model (SmolLM2-135M: 0.5 GB of float32 files)
    with two_node_cluster(head_cpus=1, worker_cpus=2, object_store_mb=1024) as cluster:
        done = cluster.run_on_head([str(VENV_BIN / "python"), "bench/bench_weight_sync.py", "--models", "smollm2",
                                    "--ray-address", cluster.address, "--learner-resource", cluster.head_resource,
                                    "--inference-resource", cluster.worker_resource],
                                   timeout_s=1800, env={"OMP_NUM_THREADS": "1"})
        print(done.stdout)

What it builds (root only; `namespaces_unavailable()` says why not, for a skip):
- two network namespaces `gmn<pid>-<n>h` and `gmn<pid>-<n>w`, joined by a veth pair, head 10.250.0.1/24 and
  worker 10.250.0.2/24, lo up in each and nothing else: no route leaves them, so every packet stays between
  the two (each namespace has its own ports, so Ray's default ports are free in both);
- the head: `ray start --head --node-ip-address 10.250.0.1 --block` with its own `--temp-dir` (a short
  directory under /tmp: Ray's socket paths must stay under 108 bytes), the dashboard on 8265 for `ray job
  submit`, and `--resources '{"head": 100}'`;
- the worker: in its own mount namespace with a private tmpfs on /dev/shm and on /tmp, so it shares no
  shared memory with the head and sees none of the head's files under /tmp (its Ray temp dir, a run's
  output directory made under /tmp, an embedded Redis's directory, a model cache); the checkout (code,
  .venv) it shares, as nodes built from one image do. Then `ray start --address 10.250.0.1:6379
  --node-ip-address 10.250.0.2 --resources '{"worker": 100}' --block`.
  The checkout may live anywhere, /tmp included: what the worker shares with the head (`worker_shared_paths`:
  the checkout, the venv `.venv` names, which may be a symlink to one elsewhere, and the Python it was made
  from) and a private tmpfs would hide is bound back into place on top of it (`worker_binds`), so the worker
  sees the checkout at the same path and nothing else of the head's /tmp. A checkout that is /tmp or
  /dev/shm itself cannot be shared that way: `namespaces_unavailable()` says so (the tests skip).

Ray 2.60 has token authentication on by default: both nodes and every client here run with
RAY_AUTH_MODE=token and one token generated per cluster (RAY_AUTH_TOKEN in `cluster.env`, never on a command
line), which is how docs/deploy.md runs a real cluster, so the tests take that path too.

Every process runs with a clean environment (`cluster.env`: PATH, HOME, locale, the Ray token and
RAY_USAGE_STATS_ENABLED=0), not the test session's: a node of a real cluster has no env.sh, so what the
project needs in its processes it must set itself. `extra_env` adds variables to all of them.

Leaving the block (also on an error or a failed assert) ends every process in the two namespaces (SIGTERM,
then SIGKILL after a deadline; never `ray stop`, which would end every Ray on the machine), deletes the
namespaces (the veth goes with them, the worker's tmpfs mounts with its processes) and the head's temp
dir. `keep_logs` (a directory) receives both nodes' Ray logs and the nodes' own output first.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.machines import stop_process_groups, wait_or_stop

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
HEAD_RESOURCE = "head"
WORKER_RESOURCE = "worker"
RESOURCE_UNITS = 100            # per node: each actor asks for 1, so many fit on a node
GCS_PORT = 6379                 # Ray's default ports: free in a fresh namespace
DASHBOARD_PORT = 8265
WORKER_RAY_TEMP = "/tmp/ray"    # inside the worker's private /tmp
PRIVATE_MOUNTS = {              # the worker's own tmpfs mounts: mount point -> (tmpfs name, options)
    "/dev/shm": ("gmn-shm", "mode=1777,size=8g"),
    "/tmp": ("gmn-tmp", "mode=1777"),
}
START_TIMEOUT_S = 180.0         # both nodes up (2 busy cores: a Ray node takes ~5-20 s)
STOP_TIMEOUT_S = 5.0            # SIGTERM to SIGKILL for Ray's processes (`ray start --block` and the
                                # GCS ignore SIGTERM for longer: nothing of theirs needs a clean exit)

_counter = itertools.count()


def namespaces_unavailable() -> str:
    """Why two network namespaces cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (creates network namespaces, a veth pair and tmpfs mounts)"
    missing = [tool for tool in ("ip", "unshare", "nsenter", "mount") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH (iproute2, util-linux)"
    if not (VENV_BIN / "ray").exists():
        return f"no {VENV_BIN / 'ray'}: run `make install` first"
    try:
        worker_binds(worker_shared_paths())
    except ValueError as exc:
        return str(exc)
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here (`unshare --net --mount` failed: {probe.stderr.strip()})"
    return ""


# -- what the worker shares with the head under its private mounts -------------------------------------------

def worker_shared_paths(repo: Path = REPO) -> list[Path]:
    """What the worker node must see where the head sees it: the checkout, the venv its `.venv` names (a
    symlink to a venv elsewhere is followed) and the installation of the Python that venv was made from."""
    venv = repo / ".venv"
    python = Path(os.path.realpath(venv / "bin" / "python"))
    return [Path(os.path.realpath(repo)), Path(os.path.realpath(venv)), python.parent.parent]


def worker_binds(shared: list[Path], private: list[str] | None = None) -> list[Path]:
    """Those of `shared` that a private tmpfs of the worker (`private`, default PRIVATE_MOUNTS) would hide,
    each to be bound back into place over it; one inside another is covered by the outer one. Raises
    ValueError (the reason, for a skip) for a path that is a private mount point itself: binding it back
    would give the worker the head's whole /tmp (or /dev/shm), which the private mounts are there to hide."""
    mounts = [Path(os.path.realpath(m)) for m in (private if private is not None else PRIVATE_MOUNTS)]
    hidden: list[Path] = []
    for path in shared:
        path = Path(os.path.realpath(path))
        if path in mounts:
            raise ValueError(f"the checkout, its venv or their Python is {path} itself, where the worker node "
                             f"has a private tmpfs so as not to share the head's files: the worker could not see "
                             f"it without seeing all of them (put it in a directory of its own)")
        if any(m in path.parents for m in mounts) and path not in hidden:
            hidden.append(path)
    return sorted(p for p in hidden if not any(q in p.parents for q in hidden))


def worker_sees_head_path(path: str | Path, binds: list[Path]) -> bool:
    """Whether the worker would see `path` of the head's /tmp or /dev/shm (it is in a bound-back path)."""
    path = Path(os.path.realpath(path))
    return any(path == b or b in path.parents for b in binds)


def worker_private_argv(binds: list[Path], cwd: Path, argv: list[str]) -> list[str]:
    """`argv` in a new mount namespace (private propagation: nothing leaks back) with a fresh tmpfs on each
    of PRIVATE_MOUNTS, `binds` bound back into place over them, from `cwd`. Each bind's directory is opened
    before the tmpfs hides it and bound from that descriptor (/proc/self/fd/N: mount is told not to
    canonicalize the path, so the kernel follows the descriptor to the hidden directory)."""
    if len(binds) > 7:
        raise ValueError(f"too many paths to bind back into the worker's view: {binds}")
    fds = {b: 3 + i for i, b in enumerate(binds)}
    steps = [f"exec {fd}<{shlex.quote(str(b))}" for b, fd in fds.items()]
    steps += [f"mount -t tmpfs -o {opts} {name} {shlex.quote(m)}" for m, (name, opts) in PRIVATE_MOUNTS.items()]
    for b, fd in fds.items():
        steps += [f"mkdir -p {shlex.quote(str(b))}",
                  f"mount --no-canonicalize --rbind /proc/self/fd/{fd} {shlex.quote(str(b))}",
                  f"exec {fd}<&-"]
    steps += [f"cd {shlex.quote(str(cwd))}", 'exec "$@"']
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(steps), "sh", *argv]


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


@dataclass
class TwoNodeCluster:
    """A running two-node cluster (made by `two_node_cluster`). Attributes are described there."""

    head_ns: str
    worker_ns: str
    head_ip: str
    worker_ip: str
    root: Path                    # the head's temp dir and the nodes' output (under /tmp: the worker sees none)
    env: dict
    head_resource: str = HEAD_RESOURCE
    worker_resource: str = WORKER_RESOURCE
    head: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    _drivers: list = field(default_factory=list)
    _worker_cmd: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head_ip}:{DASHBOARD_PORT}"

    # -- commands on the head ------------------------------------------------------------------------

    def head_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.head_ns, *argv]

    def run_on_head(self, argv: list[str], timeout_s: float, env: dict | None = None,
                    cwd: str | Path = REPO) -> subprocess.CompletedProcess:
        """Run `argv` in the head's namespace (from `cwd`, the checkout by default) and wait; its output is
        captured as text. `env` adds to `cluster.env`. Past `timeout_s` (or when the test is interrupted)
        it gets SIGTERM, as a driver stopped by a scheduler does, so that a run closes itself (its embedded
        Redis and that Redis's directory included); SIGKILL only if it has not ended
        machines.DRIVER_STOP_S later (`machines.wait_or_stop`)."""
        proc = self.popen_on_head(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        return wait_or_stop(proc, timeout_s)

    def popen_on_head(self, argv: list[str], env: dict | None = None, cwd: str | Path = REPO,
                      **kwargs) -> subprocess.Popen:
        """Start `argv` in the head's namespace without waiting; it is ended with the cluster."""
        proc = subprocess.Popen(self.head_argv(argv), env={**self.env, **(env or {})}, cwd=cwd,
                                stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
        self._drivers.append(proc)
        return proc

    # -- the worker node: lost and back ----------------------------------------------------------------

    def start_worker(self) -> None:
        """Start the worker node (again): a fresh machine, with its own empty /dev/shm and /tmp (a private
        mount namespace holding two tmpfs; the checkout and venv bound back into place if they live there),
        whose `ray start` is the process `self.worker` holds. Returns at once; `wait_for_nodes(2)` waits
        until it has joined."""
        argv = worker_private_argv(worker_binds(worker_shared_paths()), REPO, self._worker_cmd)
        with open(self.root / "worker.out", "ab") as out:
            self.worker = subprocess.Popen(
                ["ip", "netns", "exec", self.worker_ns, *argv],
                env=self.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def lose_worker(self) -> None:
        """The worker machine is gone at once, as a reclaimed spot node is: SIGKILL to every process in its
        namespace (Ray's, the actors', their children), nothing told first. Its files go with it."""
        left = _kill_namespace(self.worker_ns, term_s=0.0, first=signal.SIGKILL)
        _reap(self.worker)
        if left:
            raise RuntimeError(f"processes {left} of the worker node survived SIGKILL")

    def wait_for_nodes(self, nodes: int, timeout_s: float = 120.0) -> None:
        """Until `nodes` Ray nodes are alive (the head's view)."""
        _wait_for(self, nodes, time.monotonic() + timeout_s)

    # -- the worker's private files ------------------------------------------------------------------

    def worker_can_see(self, path: str | Path) -> bool:
        """Whether `path` exists as the worker node's processes see the filesystem."""
        if self.worker is None or self.worker.poll() is not None:
            raise RuntimeError("the worker node is not running: its filesystem view is gone")
        probe = subprocess.run(["nsenter", "--target", str(self.worker.pid), "--mount", "--", "test", "-e",
                                str(path)])
        return probe.returncode == 0

    def copy_worker_dir(self, src: str, dest: Path) -> None:
        """Copy a directory of the worker's private filesystem (e.g. its Ray logs) to `dest` here."""
        dest.mkdir(parents=True, exist_ok=True)
        pack = subprocess.Popen(["nsenter", "--target", str(self.worker.pid), "--mount", "--", "tar", "-C", src,
                                 "-cf", "-", "."], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        subprocess.run(["tar", "-C", str(dest), "-xf", "-"], stdin=pack.stdout, stderr=subprocess.DEVNULL,
                       timeout=60)
        pack.wait(timeout=60)

    def keep_logs(self, dest: Path) -> None:
        """Both nodes' Ray session logs and the nodes' own output, copied to `dest` (best effort)."""
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("head.out", "worker.out"):
            if (self.root / name).exists():
                shutil.copy(self.root / name, dest / name)
        head_logs = self.root / "ray" / "session_latest" / "logs"
        if head_logs.is_dir():
            shutil.copytree(head_logs, dest / "head-ray-logs", dirs_exist_ok=True, symlinks=True)
        if self.worker is not None and self.worker.poll() is None:
            try:
                self.copy_worker_dir(f"{WORKER_RAY_TEMP}/session_latest/logs", dest / "worker-ray-logs")
            except (OSError, subprocess.SubprocessError):
                pass


def head_start_argv(head_ip: str, num_cpus: float) -> list[str]:
    """`ray start` of the head as docs/deploy.md writes it (the harness adds its own temp dir, object store
    size, --disable-usage-stats and --block). The dashboard (port 8265) is on by default: `ray job submit`."""
    return ["ray", "start", "--head", "--node-ip-address", head_ip, "--num-cpus", f"{num_cpus:g}",
            "--resources", json.dumps({HEAD_RESOURCE: RESOURCE_UNITS}), "--dashboard-host", "0.0.0.0"]


def worker_start_argv(head_ip: str, worker_ip: str, num_cpus: float) -> list[str]:
    """`ray start` of the worker as docs/deploy.md writes it (see head_start_argv)."""
    return ["ray", "start", "--address", f"{head_ip}:{GCS_PORT}", "--node-ip-address", worker_ip,
            "--num-cpus", f"{num_cpus:g}", "--resources", json.dumps({WORKER_RESOURCE: RESOURCE_UNITS})]


def _node_env(token: str, extra: dict | None) -> dict:
    env = {
        "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
        "RAY_USAGE_STATS_ENABLED": "0",     # no reporting attempts (nothing can leave the namespaces anyway)
    }
    env.update(extra or {})
    return env


def _namespace_pids(ns: str) -> list[int]:
    out = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _kill_namespace(ns: str, term_s: float, first: int = signal.SIGTERM) -> list[int]:
    """End every process in network namespace `ns` (all of them were started by this harness): `first`
    (SIGTERM), then SIGKILL what is left after `term_s`. Returns the pids still there at the end."""
    for sig, wait_s in ((first, term_s), (signal.SIGKILL, 10.0)):
        for pid in _namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _namespace_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _namespace_pids(ns):
            return []
    return _namespace_pids(ns)


def _host_files_of(pids: list[int]) -> set[str]:
    """What processes of the head (which shares /dev/shm and /tmp with this machine) hold that only they
    would remove: /dev/shm files they map or hold open, embedded Redis directories they work in. Removed
    after a kill, so that a test that failed half-way leaves nothing for the leftovers guard."""
    import psutil

    found: set[str] = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            held = {m.path for m in proc.memory_maps()} | {f.path for f in proc.open_files()}
            cwd = proc.cwd()
        except (psutil.Error, OSError):
            continue
        found |= {h for h in held if h.startswith("/dev/shm/")}
        if os.path.basename(cwd).startswith("gigpo-redis-"):
            found.add(cwd)
    return found


def _remove_unused(paths: set[str]) -> None:
    import psutil

    used: set[str] = set()
    for proc in psutil.process_iter():
        try:
            used |= {m.path for m in proc.memory_maps()} | {f.path for f in proc.open_files()} | {proc.cwd()}
        except (psutil.Error, OSError):
            continue
    for path in paths - used:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _reap(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _wait_for(cluster: TwoNodeCluster, nodes: int, deadline: float) -> None:
    """Until `nodes` Ray nodes are alive, asked through a driver on the head (which also proves the token)."""
    script = ("import sys, time, ray\n"
              "ray.init(address=sys.argv[1], log_to_driver=False)\n"
              "deadline = time.monotonic() + float(sys.argv[3])\n"
              "while (alive := sum(n['Alive'] for n in ray.nodes())) < int(sys.argv[2]):\n"
              "    if time.monotonic() > deadline:\n"
              "        sys.exit(f'only {alive} node(s) alive')\n"
              "    time.sleep(0.5)\n")
    last = ""
    while time.monotonic() < deadline:
        for name, proc in (("head", cluster.head), ("worker", cluster.worker)):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the {name} node's `ray start` exited with {proc.returncode}:\n"
                                   + _tail(cluster.root / f"{name}.out"))
        left = max(1.0, deadline - time.monotonic())
        try:
            done = cluster.run_on_head([str(VENV_BIN / "python"), "-c", script, cluster.address, str(nodes),
                                        str(left)], timeout_s=left + 30)
        except subprocess.TimeoutExpired:
            break
        if done.returncode == 0:
            return
        last = done.stderr[-2000:]
        time.sleep(1.0)     # the GCS is not up yet: ray.init failed at once
    raise RuntimeError(f"{nodes} Ray node(s) not up within {START_TIMEOUT_S:.0f} s: {last}\n"
                       f"head:\n{_tail(cluster.root / 'head.out')}\nworker:\n{_tail(cluster.root / 'worker.out')}")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no output)"


@contextlib.contextmanager
def two_node_cluster(head_cpus: float = 1, worker_cpus: float = 4, extra_env: dict | None = None,
                     object_store_mb: int = 150, subnet: str = "10.250.0", keep_logs: Path | None = None):
    """Start the two nodes (see the module's doc), yield the TwoNodeCluster, and remove everything after.
    head_cpus / worker_cpus: the CPUs each node offers Ray (bookkeeping; 0 on the head keeps every actor
    off it). extra_env: added to every process's environment. keep_logs: a directory to copy the nodes'
    logs into before they are removed."""
    reason = namespaces_unavailable()
    if reason:
        raise RuntimeError(f"two_node_cluster: {reason}")
    tag = f"gmn{os.getpid()}-{next(_counter)}"
    root = Path(tempfile.mkdtemp(prefix="gmn-", dir="/tmp"))
    cluster = TwoNodeCluster(head_ns=f"{tag}h", worker_ns=f"{tag}w", head_ip=f"{subnet}.1",
                             worker_ip=f"{subnet}.2", root=root, env=_node_env(secrets.token_hex(32), extra_env))
    made: list[str] = []
    try:
        for ns in (cluster.head_ns, cluster.worker_ns):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        head_if, worker_if = f"{tag}h", f"{tag}w"       # <= 15 characters: gmn + pid + counter + h/w
        _sh("ip", "link", "add", head_if, "type", "veth", "peer", "name", worker_if)
        for ns, ifname, ip in ((cluster.head_ns, head_if, cluster.head_ip),
                               (cluster.worker_ns, worker_if, cluster.worker_ip)):
            _sh("ip", "link", "set", ifname, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            _sh("ip", "-n", ns, "link", "set", ifname, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        harness_flags = ["--object-store-memory", str(object_store_mb * 1024 * 1024), "--disable-usage-stats",
                         "--block"]
        head_cmd = [*head_start_argv(cluster.head_ip, head_cpus), "--temp-dir", str(root / "ray"), *harness_flags]
        with open(root / "head.out", "wb") as out:
            cluster.head = subprocess.Popen(cluster.head_argv(head_cmd), env=cluster.env, cwd=REPO, stdout=out,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        _wait_for(cluster, 1, deadline)
        cluster._worker_cmd = [*worker_start_argv(cluster.head_ip, cluster.worker_ip, worker_cpus), "--temp-dir",
                               WORKER_RAY_TEMP, *harness_flags]
        cluster.start_worker()
        _wait_for(cluster, 2, deadline)
        yield cluster
    finally:
        if keep_logs is not None:
            with contextlib.suppress(Exception):
                cluster.keep_logs(Path(keep_logs))
        # Drivers first, with time to close their runs (a run stops its embedded Redis and removes its
        # directory); then the worker while the head's GCS still answers; then the head.
        host_files = _host_files_of(_namespace_pids(cluster.head_ns)) if cluster.head_ns in made else set()
        stop_process_groups(cluster._drivers)
        left = []
        for ns in reversed(made):
            left += _kill_namespace(ns, STOP_TIMEOUT_S)
        _remove_unused(host_files)
        for proc in [cluster.head, cluster.worker, *cluster._drivers]:
            _reap(proc)
        for ns in made:
            _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(root, ignore_errors=True)
        if left:
            raise RuntimeError(f"two_node_cluster: processes {left} survived SIGKILL in the namespaces")


# -- a probe driver for the smoke test: `python -m tests.support.multinode probe ADDRESS HEAD_DIR` on the head --------

def _probe(address: str, head_dir: str, head_resource: str, worker_resource: str) -> dict:
    """One actor on each node by resource: where it runs, what it sees, and a TCP exchange between them."""
    import socket

    import ray

    ray.init(address=address, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self) -> dict:
            ctx = ray.get_runtime_context()
            return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}

        def sees(self, path: str) -> bool:
            return os.path.exists(path)

        def touch(self, path: str) -> None:
            Path(path).write_text("head")

        def listen(self) -> int:
            self.server = socket.create_server((ray.util.get_node_ip_address(), 0))
            self.server.settimeout(60)
            return self.server.getsockname()[1]

        def accept(self) -> dict:
            conn, peer = self.server.accept()
            with conn:
                data = conn.recv(64)
                conn.sendall(b"pong:" + data)
            self.server.close()
            return {"peer": peer[0], "got": data.decode()}

        def connect(self, host: str, port: int) -> dict:
            with socket.create_connection((host, port), timeout=30) as conn:
                conn.sendall(b"ping")
                return {"reply": conn.recv(64).decode(), "local": conn.getsockname()[0]}

    head = Probe.options(resources={head_resource: 1}).remote()
    worker = Probe.options(resources={worker_resource: 1}).remote()
    shm_marker = f"/dev/shm/gmn-probe-{os.getpid()}"
    out_marker = os.path.join(head_dir, "output-marker")
    try:
        ray.get([head.touch.remote(shm_marker), head.touch.remote(out_marker)])
        port = ray.get(head.listen.remote())
        head_ip = ray.get(head.where.remote())["ip"]
        accepted = head.accept.remote()
        connected = ray.get(worker.connect.remote(head_ip, port))
        return {"head": ray.get(head.where.remote()), "worker": ray.get(worker.where.remote()),
                "head_sees_output": ray.get(head.sees.remote(out_marker)),
                "worker_sees_output": ray.get(worker.sees.remote(out_marker)),
                "head_sees_shm": ray.get(head.sees.remote(shm_marker)),
                "worker_sees_shm": ray.get(worker.sees.remote(shm_marker)),
                "accepted": ray.get(accepted), "connected": connected}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(shm_marker)


# -- an observing driver for the training tests -------------------------------------------------------------

def _train_observed(record_path: str, argv: list[str]) -> int:
    """`gigpo train ARGV` (deploy.cli.main, the command's own code), which also writes what its actors say
    when the run closes, into `record_path` (JSON): the actors exist only while the driver runs, so this
    is the one place to ask them. Nothing is changed in the run: System.close first records, then closes.
    Recorded: each inference actor's served policy version, node and weight-transfer state; each learner's
    state and node; each rollout actor's stats and node; the Redis host the actors were given; the stream's
    counts (`stream_counts`); what `gigpo status` printed for the run at that moment (the run's status
    record, with the actors' nodes)."""
    import io
    from contextlib import redirect_stdout
    from urllib.parse import urlsplit

    import ray

    from deploy import cli, system
    from tests.support.accounting import stream_counts

    def ask(actor, method: str):
        try:
            return ray.get(getattr(actor, method).remote(), timeout=120)
        except Exception as exc:  # noqa: BLE001 - recorded for the test to report
            return {"error": f"{type(exc).__name__}: {exc}"[:1000]}

    def observe(run: system.System) -> dict:
        status = io.StringIO()
        try:
            with redirect_stdout(status):
                cli.main(["status", "--output-dir", run.cfg.run.output_dir])
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to report
            status.write(f"gigpo status failed: {exc!r}")
        return {
            "inference": [{"policy_version": ask(a, "policy_version"), "node": ask(a, "node"),
                           "transfer_state": ask(a, "transfer_state")} for a in run.inference.serving],
            "learners": [{"state": ask(w, "state"), "node": ask(w, "node")} for w in run.learners.ranks],
            "rollouts": {name: {"stats": ask(a, "stats"), "node": ask(a, "node")} for name, a in run.rollouts.handles().items()},
            "redis_host": urlsplit(run.redis_url).hostname if run.redis_url else None,
            "stream": stream_counts(run.redis.admin_url, run.cfg.stream) if run.redis else None,
            "driver_ip": ray.util.get_node_ip_address(),
            "gigpo_status": status.getvalue(),
        }

    close = system.System.close

    def close_observed(self) -> None:
        if self.learners or self.inference:
            try:
                record = observe(self)
            except Exception as exc:  # noqa: BLE001 - recorded for the test to report
                record = {"error": repr(exc)}
            Path(record_path).write_text(json.dumps(record, indent=2, default=str))
        close(self)

    system.System.close = close_observed
    return cli.main(argv)


if __name__ == "__main__":
    command, *args = sys.argv[1:] or [""]
    if command == "probe":
        print("PROBE " + json.dumps(_probe(*args)))
    elif command == "train-observed":
        sys.exit(_train_observed(args[0], args[1:]))
    else:
        sys.exit("usage: python -m tests.support.multinode probe ADDRESS HEAD_DIR HEAD_RESOURCE WORKER_RESOURCE\n"
                 "       python -m tests.support.multinode train-observed RECORD.json train CONFIG [options] [overrides]")
