"""A client for the stream's Redis: the password in its URL, and a connection that rides out a restart.

    r = connect(url)        # redis.Redis that retries with backoff on connection errors

The password travels only inside a URL, as an actor's argument; logs, errors, job.json and the tracker's
config get `redact(url)` (common/redaction.py). A user's Redis takes it from the URL, else
`stream.redis_password_file`, else $GIGPO_REDIS_PASSWORD (`resolve_password`). An embedded server's is kept for
`gigpo status` / `gigpo scale` in an owner-only file, named by job.json (`password_file_for`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, BusyLoadingError, ConnectionError, TimeoutError
from redis.retry import Retry

from common.config import ConfigError, StreamConfig
from common.processes.placement import node_for_messages
from common.redaction import is_redacted, password_of, redact, unsplit_url

PASSWORD_ENV = "GIGPO_REDIS_PASSWORD"       # a user's Redis password, for a URL that holds none
# The Redis's admin user's password (KubeRay's head: the Secret's admin-password; deploy/entrypoint.sh)
ADMIN_PASSWORD_ENV = "GIGPO_REDIS_ADMIN_PASSWORD"


def with_password(url: str, password: str, user: str | None = None) -> str:
    """`url` (holding no password, or a redacted one) with `password` in its user part (and `user` instead of
    the URL's own, when given)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "password"]
    hostport = parts.netloc.rsplit("@", 1)[-1]
    user = user if user is not None else (unquote(parts.username) if parts.username else "")
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{hostport}"
    return unsplit_url(parts, netloc, urlencode(query))


# Where the password of a URL this process handed out can be read again (by `gigpo status` / `gigpo scale`
# in another process, through job.json): URL -> owner-only file.
_password_files: dict[str, str] = {}


def password_file_for(url: str) -> str:
    """The file holding `url`'s password (an embedded server's, or stream.redis_password_file), or ""."""
    return _password_files.get(url, "")


def read_password_file(path: str, field: str = "stream.redis_password_file") -> str:
    """The password in `path` (surrounding whitespace and a final newline dropped); ConfigError naming
    `field` when it is missing, unreadable or empty."""
    try:
        password = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path} ({exc.strerror}); point it at the file that holds "
                          "the Redis password", field) from None
    if not password:
        raise ConfigError(f"{field}: {path} is empty; it must hold the Redis password", field)
    return password


def resolve_password(cfg: StreamConfig, environ: Mapping[str, str] | None = None) -> None:
    """Put the password of a user's Redis into `cfg.redis_url`, in place, when the URL holds none: from
    `cfg.redis_password_file` (then cleared, and remembered for job.json), else from $GIGPO_REDIS_PASSWORD.
    Idempotent; the embedded Redis (redis_url "") is left alone (it makes its own password)."""
    environ = os.environ if environ is None else environ
    url = cfg.redis_url
    if not url:
        return
    if password_of(url) is not None:
        if cfg.redis_password_file:
            raise ConfigError("stream.redis_url holds a password and stream.redis_password_file is set too; "
                              "keep the password in one of them", "stream.redis_url", "stream.redis_password_file")
        return
    if cfg.redis_password_file:
        path = os.path.abspath(cfg.redis_password_file)
        cfg.redis_url = with_password(url, read_password_file(path))
        cfg.redis_password_file = ""
        _password_files[cfg.redis_url] = path
    elif environ.get(PASSWORD_ENV):
        cfg.redis_url = with_password(url, environ[PASSWORD_ENV])


def remember_password_file(url: str, path: str | None) -> None:
    """Record (or, with None, forget) the owner-only file that holds `url`'s password."""
    if path is None:
        _password_files.pop(url, None)
    else:
        _password_files[url] = path


class _RetryConnectionLoss(Retry):
    """Retry lost connections, but fail at once on a wrong password or missing ACL permission (redis-py
    files those under ConnectionError too; retrying them only delays the error)."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            if isinstance(error, (AuthenticationError, AuthorizationError)):
                return False
            return is_retryable(error) if is_retryable else True

        return super().call_with_retry(do, fail, retryable, with_failure_count)


class _RedisSayingWhere(redis.Redis):
    """redis.Redis whose connection errors and timeouts (after the retries) also say which Redis, its URL
    redacted, and from which node: "cannot reach Redis" means little on a cluster without both."""

    where = ""

    def execute_command(self, *args, **options):
        try:
            return super().execute_command(*args, **options)
        except (ConnectionError, TimeoutError) as exc:
            message = f"{exc} (Redis at {self.where}, tried from node {node_for_messages()})"
            try:
                annotated = type(exc)(message)
            except Exception:  # noqa: BLE001 - an exception class with another signature: keep the original
                raise exc from None
            raise annotated from exc


def connect(url: str, retries: int = 12, backoff_cap_s: float = 2.0, socket_timeout_s: float | None = 60.0,
            **kwargs) -> redis.Redis:
    """A redis.Redis for `url` (password or ACL user:password in the URL) that retries every command on
    connection errors and timeouts with exponential backoff (0.05 s doubling up to `backoff_cap_s`; the
    defaults ride out ~17 s of a restarting server); the final error names the Redis (password redacted) and
    the node that tried. Responses stay bytes. A retried write may have been applied before the connection
    dropped (a duplicate XADD): the stream's readers skip duplicate group ids for that reason."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        scheme = url.split("://", 1)[0] if "://" in url else "(none)"   # never echo a URL: it may hold a password
        raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, not scheme {scheme!r}")
    if is_redacted(url):
        raise ValueError(f"{redact(url)} has its password redacted (***): pass the URL with the password")
    retry = _RetryConnectionLoss(ExponentialBackoff(cap=backoff_cap_s, base=0.05), retries)
    client = _RedisSayingWhere.from_url(
        url, retry=retry, retry_on_error=[ConnectionError, TimeoutError, BusyLoadingError], socket_connect_timeout=5,
        socket_timeout=socket_timeout_s, socket_keepalive=True, health_check_interval=30, decode_responses=False,
        socket_read_size=kwargs.pop("socket_read_size", 1 << 20),   # ~1 MB groups: fewer recv calls (-15% CPU)
        **kwargs)
    client.where = redact(url)
    return client


