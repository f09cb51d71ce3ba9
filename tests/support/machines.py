"""Separate machines on this one machine, for running the shipped cluster files as written: each machine is a
network, mount, PID and UTS namespace whose root filesystem is a copy-on-write view of this machine's.

    with machines([MachineSpec("head"), MachineSpec("gpu"), MachineSpec("rollout")],
                  shared={"/shared": tmp_path / "efs"}) as ms:
        head = ms["head"]
        head.ip                                  # 10.251.0.1 (the others .2, .3, ... in the order given)
        head.run("ray start --head", shell=True, env=head.login_env())
        head.write_text("/etc/hosts", ...)       # private to the machine, like everything it writes
        ms["gpu"].lose()                         # SIGKILL to every process of it, its files gone

What a machine is (root only; `machines_unavailable()` says why not, for a skip):
- its own network namespace, joined to the others by a bridge in a namespace of its own (each machine's veth
  has 10.251.0.<n>/24), with a default route to an address nobody has: a process that asks the kernel which
  address it would reach the world from (Ray's node IP detection) gets the machine's own, and every packet
  stays between the machines: nothing is connected to this machine's network;
- its own mount namespace: an overlay of this machine's root filesystem (reads see it, writes stay the
  machine's: `mkdir /shared`, /etc/hosts, a home directory, `apt-get`'s files), a private tmpfs on /tmp and
  /dev/shm, its own /proc; the checkout, its venv and their Python are visible at their paths (bound back
  where /tmp would hide them), and `shared` host directories are bound at the given mount points (a network
  filesystem every machine mounts);
- its own PID namespace: `ray stop` sees only the machine's processes; PID 1 is a small reaper (orphans of
  daemons are reaped as init does); killing it ends every process of the machine at once (a lost node);
- its own host name (MachineSpec.hostname, default the spec's name), and a name server on 127.0.0.1 that
  answers for every machine's host name and the spec's extra names (`hosts`: a cluster's DNS).

Commands run with the environment they are given (nothing of the test session's); `login_env()` is what an
SSH login of the machine's user starts with. Leaving the block ends every process of every machine (drivers
started with `popen` get SIGTERM first and DRIVER_STOP_S to close their runs), deletes the namespaces and the
machines' files.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
SUBNET = "10.251.0"
GATEWAY = f"{SUBNET}.254"         # the default route's next hop: no machine has this address
START_TIMEOUT_S = 60.0            # a machine's namespaces and mounts made
DRIVER_STOP_S = 120.0             # a driver given SIGTERM closes its run (checkpoint, Redis)
LAYER_SIZE = "8g"                 # tmpfs limit of a machine's writes to its root (a checkout copy, data, logs)
SHM_SIZE = "8g"
STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_counter = itertools.count()

# PID 1 of a machine: reaps every orphan (daemonized Redis, Ray's processes after `ray stop`), says when the
# machine is ready, and exits on SIGTERM (the kernel then kills every other process of the machine).
_REAPER = r"""
import os, signal, sys
def reap(*_):
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
signal.signal(signal.SIGCHLD, reap)
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
sys.stdout.write("ready\n"); sys.stdout.flush(); os.close(1)
while True:
    signal.pause()
"""


# Each machine's name server on 127.0.0.1:53: the A records of its /etc/hosts, as a cluster's DNS would serve
# them (programs that resolve through their own DNS client, such as gRPC's c-ares in Ray, do not read
# /etc/hosts). NXDOMAIN for other names: nothing is forwarded anywhere.
_NAME_SERVER = r"""
import socket, struct
def names():
    table = {}
    for line in open("/etc/hosts"):
        parts = line.split("#")[0].split()
        for name in parts[1:]:
            table.setdefault(name.lower().rstrip("."), socket.inet_aton(parts[0]))
    return table
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", 53))
while True:
    query, peer = sock.recvfrom(2048)
    try:
        at, labels = 12, []
        while query[at]:
            labels.append(query[at + 1:at + 1 + query[at]].decode())
            at += 1 + query[at]
        qtype = struct.unpack("!H", query[at + 1:at + 3])[0]
        question = query[12:at + 5]
    except (IndexError, UnicodeDecodeError, struct.error):
        continue
    address = names().get(".".join(labels).lower())
    answers = b"" if address is None or qtype != 1 else (
        b"À" + struct.pack("!HHIH", 1, 1, 5, 4) + address)
    flags = 0x8180 | (3 if address is None else 0)
    sock.sendto(query[:2] + struct.pack("!HHHHH", flags, 1, 1 if answers else 0, 0, 0) + question + answers, peer)
"""


def machines_unavailable() -> str:
    """Why machines cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root (network, mount and PID namespaces, overlay and tmpfs mounts)"
    missing = [tool for tool in ("ip", "unshare", "nsenter", "mount", "pivot_root") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH (iproute2, util-linux)"
    if not (VENV_BIN / "ray").exists():
        return f"no {VENV_BIN / 'ray'}: run `make install` first"
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "--uts", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here (`unshare` failed: {probe.stderr.strip()})"
    return ""


@dataclass
class MachineSpec:
    name: str                      # also its key in the machines' mapping
    hostname: str = ""             # default: name
    user: str = "root"             # the login user (made with useradd when the machine lacks it)
    home: str = ""                 # its home directory; default /root for root, else /home/<user>
    hosts: dict = field(default_factory=dict)      # extra /etc/hosts names: {name: machine name or IP}

    @property
    def home_dir(self) -> str:
        return self.home or ("/root" if self.user == "root" else f"/home/{self.user}")


def shared_with_machines(repo: Path = REPO) -> list[Path]:
    """What every machine must see where this machine has it: the checkout, the venv its `.venv` names and the
    Python installation that venv was made from."""
    venv = repo / ".venv"
    python = Path(os.path.realpath(venv / "bin" / "python"))
    return [Path(os.path.realpath(repo)), Path(os.path.realpath(venv)), python.parent.parent]


def hidden_by_private_mounts(paths: list[Path], private: tuple[str, ...] = ("/tmp", "/dev/shm")) -> list[Path]:
    """Those of `paths` under a machine's private tmpfs mounts (/tmp, /dev/shm, a home that exists here), which
    would hide them (to be bound back), an inner one covered by an outer one. Raises ValueError for a mount
    point itself."""
    private = [Path(os.path.realpath(p)) for p in private]
    hidden: list[Path] = []
    for path in (Path(os.path.realpath(p)) for p in paths):
        if path in private:
            raise ValueError(f"{path} is a machine's private tmpfs itself: the checkout cannot be shared from there")
        if any(m in path.parents for m in private) and path not in hidden:
            hidden.append(path)
    return sorted(p for p in hidden if not any(q in p.parents for q in hidden))


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


@dataclass
class Machine:
    spec: MachineSpec
    ip: str
    netns: str
    layer: Path                    # host directory where the machine's writes live (a tmpfs inside it)
    init: subprocess.Popen | None = None
    _procs: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def hostname(self) -> str:
        return self.spec.hostname or self.spec.name

    @property
    def home(self) -> str:
        return self.spec.home_dir

    def alive(self) -> bool:
        return self.init is not None and self.init.poll() is None

    def login_env(self, **extra: str) -> dict:
        """The environment an SSH login of the machine's user starts with (before its profile runs)."""
        user = self.spec.user
        env = {"HOME": self.home, "USER": user, "LOGNAME": user, "SHELL": "/bin/bash", "PATH": STANDARD_PATH,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        env.update(extra)
        return env

    def argv(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """`argv` run inside the machine (its namespaces, its root, `cwd` or its home)."""
        if not self.alive():
            raise RuntimeError(f"machine {self.name} is not running")
        # nsenter would resolve a --wd path here, outside the machine: it enters the machine's root and
        # working directory (/), then env changes to `cwd` inside.
        return ["nsenter", f"--target={self.init.pid}", "--mount", "--uts", "--net", "--pid", "--root", "--wd",
                "--", "env", f"--chdir={cwd or self.home}", *argv]

    def popen(self, command: str | list[str], env: dict | None = None, cwd: str | None = None,
              **kwargs) -> subprocess.Popen:
        """Start a command (a list, or a string run by bash) inside the machine; it ends with the machine."""
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        proc = subprocess.Popen(self.argv(argv, cwd), env=env if env is not None else self.login_env(),
                                stdin=subprocess.DEVNULL, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, command: str | list[str], env: dict | None = None, cwd: str | None = None,
            timeout_s: float = 300.0, check: bool = False) -> subprocess.CompletedProcess:
        """Run a command inside the machine and wait; output captured as text. Past timeout_s it gets SIGTERM
        (a driver closes its run), SIGKILL DRIVER_STOP_S later."""
        proc = self.popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done = wait_or_stop(proc, timeout_s)
        if check and done.returncode != 0:
            raise AssertionError(f"on {self.name}: {command!r} exited with {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def write_text(self, path: str, text: str, mode: int | None = None) -> None:
        """Write a file inside the machine (its parents made)."""
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"' + (f' && chmod {mode:o} "$1"' if mode is not None else "")
        done = subprocess.run(self.argv(["sh", "-c", script, "sh", path], "/"), input=text, text=True,
                              capture_output=True)
        if done.returncode != 0:
            raise OSError(f"on {self.name}: cannot write {path}: {done.stderr.strip()}")

    def read_text(self, path: str) -> str:
        done = subprocess.run(self.argv(["cat", path], "/"), capture_output=True, text=True)
        if done.returncode != 0:
            raise FileNotFoundError(f"on {self.name}: {path}: {done.stderr.strip()}")
        return done.stdout

    def exists(self, path: str) -> bool:
        return subprocess.run(self.argv(["test", "-e", path], "/")).returncode == 0

    def copy_out(self, src: str, dest: Path) -> None:
        """Copy a directory of the machine (e.g. its Ray logs) to `dest` on this machine (best effort)."""
        dest.mkdir(parents=True, exist_ok=True)
        pack = subprocess.Popen(self.argv(["tar", "-C", src, "-cf", "-", "."], "/"), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        subprocess.run(["tar", "-C", str(dest), "-xf", "-"], stdin=pack.stdout, stderr=subprocess.DEVNULL,
                       timeout=120)
        pack.wait(timeout=120)

    def lose(self) -> None:
        """The machine is gone at once, as a reclaimed spot node is: every process of it SIGKILLed (its PID 1
        first: the kernel kills the rest), nothing told first; its files go with its mounts."""
        if self.init is not None and self.init.poll() is None:
            self.init.kill()
            self.init.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _namespace_pids(self.netns) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _namespace_pids(self.netns)
        if left:
            raise RuntimeError(f"processes {left} of machine {self.name} survived its PID 1")


def _namespace_pids(ns: str) -> list[int]:
    out = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def wait_or_stop(proc: subprocess.Popen, timeout_s: float) -> subprocess.CompletedProcess:
    """Wait for `proc` (started with its output piped) and return what it printed. Past `timeout_s` its process
    group gets SIGTERM (a driver closes its run), SIGKILL DRIVER_STOP_S later, then TimeoutExpired with the
    output."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_process_groups([proc])
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout_s, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stop_process_groups(procs: list[subprocess.Popen], stop_s: float = DRIVER_STOP_S) -> None:
    """SIGTERM to each process group; SIGKILL to those still running `stop_s` later."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + stop_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def _setup_script(layer: Path, hostname: str, binds: list[tuple[str, str]], fresh: tuple[str, ...] = ()) -> str:
    """The shell script that turns a fresh mount namespace into the machine's root and execs PID 1. fresh:
    directories that get an empty tmpfs (a home this machine has: the machine's own is a new one, with the
    skeleton's dotfiles)."""
    r = shlex.quote(str(layer / "root"))
    steps = [
        f"mount -t tmpfs -o size={LAYER_SIZE},mode=755 gm-layer {shlex.quote(str(layer))}",
        f"mkdir -p {shlex.quote(str(layer / 'upper'))} {shlex.quote(str(layer / 'work'))} {r}",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={shlex.quote(str(layer / 'upper'))},"
        f"workdir={shlex.quote(str(layer / 'work'))} {r}",
        f"mount --rbind /dev {r}/dev",
        f"mount -t tmpfs -o mode=1777,size={SHM_SIZE} gm-shm {r}/dev/shm",
        f"mount --rbind /sys {r}/sys",
        f"mount -t proc proc {r}/proc",
        f"mount -t tmpfs -o mode=1777 gm-tmp {r}/tmp",
    ]
    for path in fresh:
        steps += [f"mount -t tmpfs -o mode=700 gm-home {r}{shlex.quote(path)}",
                  f"cp -a /etc/skel/. {r}{shlex.quote(path)}/"]
    for src, dest in binds:
        steps += [f"mkdir -p {r}{shlex.quote(dest)}", f"mount --bind {shlex.quote(src)} {r}{shlex.quote(dest)}"]
    steps += [f"hostname {shlex.quote(hostname)}",
              f"cd {r}", "mkdir -p .gm-old", "pivot_root . .gm-old", "cd /", "umount -l /.gm-old", "rmdir /.gm-old",
              f"exec {shlex.quote(sys.executable)} -c {shlex.quote(_REAPER)}"]
    return " && ".join(steps)


@contextlib.contextmanager
def machines(specs: list[MachineSpec], shared: dict[str, Path] | None = None, keep_logs: Path | None = None,
             log_dirs: tuple[str, ...] = ("/tmp/ray/session_latest/logs",)):
    """Make the machines (see the module's doc), yield {name: Machine}, remove everything after. shared:
    {mount point in every machine: directory here}. keep_logs: a directory receiving each machine's
    `log_dirs` (copied before the machines go)."""
    reason = machines_unavailable()
    if reason:
        raise RuntimeError(f"machines: {reason}")
    tag = f"gm{os.getpid() % 100000}{next(_counter)}"
    root = Path(tempfile.mkdtemp(prefix="gmach-", dir="/tmp"))
    switch = f"{tag}s"
    made: list[str] = []
    result: dict[str, Machine] = {}
    shared_here = shared_with_machines()
    shared_dirs = [(str(Path(src).resolve()), dest) for dest, src in (shared or {}).items()]
    try:
        _sh("ip", "netns", "add", switch)
        made.append(switch)
        _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", switch, "link", "set", "br0", "up")
        ips = {spec.name: f"{SUBNET}.{i + 1}" for i, spec in enumerate(specs)}
        for i, spec in enumerate(specs):
            ns, host_if, peer = f"{tag}m{i}", f"{tag}m{i}", f"{tag}p{i}"      # <= 15 characters
            _sh("ip", "netns", "add", ns)
            made.append(ns)
            _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", peer)
            _sh("ip", "link", "set", host_if, "netns", ns)
            _sh("ip", "link", "set", peer, "netns", switch)
            _sh("ip", "-n", switch, "link", "set", peer, "master", "br0")
            _sh("ip", "-n", switch, "link", "set", peer, "up")
            _sh("ip", "-n", ns, "link", "set", host_if, "name", "eth0")
            _sh("ip", "-n", ns, "addr", "add", f"{ips[spec.name]}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "route", "add", "default", "via", GATEWAY)
            layer = root / spec.name
            layer.mkdir()
            machine = Machine(spec=spec, ip=ips[spec.name], netns=ns, layer=layer)
            # A home this machine has (/root) is the machine's own, empty but for the skeleton; what the
            # machine must share from under it or /tmp is bound back.
            fresh = (spec.home_dir,) if os.path.isdir(spec.home_dir) else ()
            binds = [(str(p), str(p)) for p in hidden_by_private_mounts(shared_here, ("/tmp", "/dev/shm", *fresh))]
            machine.init = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "--pid", "--fork",
                 "--kill-child", "--uts", "sh", "-c",
                 _setup_script(layer, machine.hostname, binds + shared_dirs, fresh)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True, env={"PATH": STANDARD_PATH}, preexec_fn=_end_with_this_process)
            result[spec.name] = machine
        for machine in result.values():
            _wait_ready(machine)
            # `unshare --fork` leaves its child as PID 1 of the machine: nsenter must target that child.
            machine.init = _Pid1(machine.init)
        for machine in result.values():
            _prepare(machine, result)
        yield result
    finally:
        if keep_logs is not None:
            for machine in result.values():
                if machine.alive():
                    for src in log_dirs:
                        with contextlib.suppress(Exception):
                            machine.copy_out(src, Path(keep_logs) / machine.name / src.strip("/").replace("/", "_"))
        stop_process_groups([p for m in result.values() for p in m._procs])
        for machine in result.values():
            with contextlib.suppress(Exception):
                machine.lose()
        for ns in reversed(made):
            _sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(root, ignore_errors=True)


class _Pid1:
    """The machine's PID 1 as seen from here (the child of `unshare --fork`), with Popen's few methods the
    harness uses. Killing it ends the machine; `unshare` exits with it."""

    def __init__(self, unshare: subprocess.Popen):
        import psutil
        self.unshare = unshare
        children = psutil.Process(unshare.pid).children()
        if len(children) != 1:
            raise RuntimeError(f"unshare {unshare.pid} has children {children}, expected its one fork")
        self.pid = children[0].pid

    def poll(self):
        return self.unshare.poll()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None):
        return self.unshare.wait(timeout=timeout)


def _end_with_this_process() -> None:
    """In the child before `ip netns exec unshare ...`: SIGKILL when the process that made the machines dies,
    however (a killed test run); unshare's --kill-child then ends the machine's PID 1, and the kernel the rest."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


def _wait_ready(machine: Machine) -> None:
    """Until the machine's PID 1 says it is ready (its mounts made); its setup's errors if it fails."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(machine.init.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if sel.select(timeout=max(0.0, deadline - time.monotonic())):
            line = machine.init.stdout.readline()
            if line.strip() == "ready":
                return
            if not line:
                break
    machine.init.kill()
    err = machine.init.stderr.read() if machine.init.stderr else ""
    raise RuntimeError(f"machine {machine.name} did not start: {err.strip()[-2000:]}")


def _prepare(machine: Machine, everyone: dict[str, Machine]) -> None:
    """/etc/hosts naming every machine (and the spec's extra names), the login user and its home."""
    lines = ["127.0.0.1\tlocalhost", f"{machine.ip}\t{machine.hostname}"]
    lines += [f"{m.ip}\t{m.hostname}" for m in everyone.values() if m is not machine]
    for name, target in machine.spec.hosts.items():
        lines.append(f"{everyone[target].ip if target in everyone else target}\t{name}")
    machine.write_text("/etc/hosts", "\n".join(lines) + "\n")
    machine.write_text("/etc/resolv.conf", "nameserver 127.0.0.1\noptions timeout:1 attempts:2\n")
    machine.popen([sys.executable, "-c", _NAME_SERVER], env={"PATH": STANDARD_PATH}, cwd="/",
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    user = machine.spec.user
    if user != "root":
        machine.run(["useradd", "--create-home", "--home-dir", machine.home, "--shell", "/bin/bash", user],
                    env={"PATH": STANDARD_PATH}, cwd="/", check=True, timeout_s=60)
    else:
        machine.run(["mkdir", "-p", machine.home], env={"PATH": STANDARD_PATH}, cwd="/", check=True, timeout_s=60)
