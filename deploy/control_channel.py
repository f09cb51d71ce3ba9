"""The job's control channel: a running job publishes its status to Redis, and `gigpo status` / `gigpo scale`
read and write it from any machine that can reach that Redis, found in the output directory's `job.json`: the
Redis URL with its password redacted (output directories get shared) and the file holding the password, if any.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import redis

from common.metrics import SECTIONS
from common.redaction import is_redacted, redact
from common.run_dir import JOB_FILE
from common.stream.redis_client import (ADMIN_PASSWORD_ENV, PASSWORD_ENV, password_file_for, read_password_file,
                                        with_password)
from common.stream.redis_server import ADMIN_USER


def write_job_file(output_dir: str, run_name: str, redis_url: str, ray_address: str, run_id: str = "",
                   stream: str = "", max_actors: dict[str, int] | None = None) -> Path:
    """<output_dir>/job.json: the run, its Redis URL without the password, the file holding the password
    ("" when there is none: `gigpo status` then needs GIGPO_REDIS_PASSWORD), the Ray address, the
    trajectory stream's key (its dead-letter stream is `<key>:dead`) and the most actors of each kind
    `gigpo scale` may ask for ({"rollout": N, "inference": M})."""
    path = Path(output_dir) / JOB_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": run_name, "run_id": run_id or run_name, "redis_url": redact(redis_url),
                                "redis_password_file": password_file_for(redis_url), "ray_address": ray_address,
                                "stream": stream, "max_actors": max_actors or {}, "started_at": time.time()},
                               indent=2))
    path.chmod(0o600)      # only its owner's commands need it
    return path


def read_job_file(output_dir: str) -> dict:
    path = Path(output_dir) / JOB_FILE
    if not path.exists():
        raise FileNotFoundError(f"no running or finished job in {output_dir!r} ({path} is missing); "
                                "pass the --output-dir the job was started with")
    return json.loads(path.read_text())


def job_redis_url(job: dict, environ: dict | None = None) -> str:
    """The job's Redis URL with its password: from $GIGPO_REDIS_PASSWORD, else the job's password file (the
    run's own user's while the run lasts), else as the Redis's admin user with $GIGPO_REDIS_ADMIN_PASSWORD
    (KubeRay's head pod); ValueError saying what to set when none has it."""
    url = job["redis_url"]
    if not is_redacted(url):
        return url        # no password, or a job file written before passwords were redacted
    environ = os.environ if environ is None else environ
    if environ.get(PASSWORD_ENV):
        return with_password(url, environ[PASSWORD_ENV])
    password_file = job.get("redis_password_file", "")
    if password_file and os.path.exists(password_file):
        return with_password(url, read_password_file(password_file, field="job.json's redis_password_file"))
    if environ.get(ADMIN_PASSWORD_ENV):
        return with_password(url, environ[ADMIN_PASSWORD_ENV], user=ADMIN_USER)
    if not password_file:
        raise ValueError(f"the job's Redis ({url}) needs its password, which job.json does not keep: set "
                         f"{PASSWORD_ENV}")
    raise ValueError(f"the job's Redis password file {password_file} is gone (it goes when the job ends); for "
                     f"a job still running elsewhere set {PASSWORD_ENV}")


class ControlChannel:
    """Status out, commands in, for one run. Keyed by the run id (stream.run_id): two runs of the same name
    on one Redis never read each other's commands."""

    def __init__(self, client: redis.Redis, run_id: str):
        self.client = client
        self.run_id = run_id
        self.status_key, self.commands_key = f"gigpo:{run_id}:status", f"gigpo:{run_id}:commands"

    def publish_status(self, status: dict) -> None:
        self.client.set(self.status_key, json.dumps({**status, "updated_at": time.time()}))

    def read_status(self) -> dict | None:
        raw = self.client.get(self.status_key)
        return json.loads(raw) if raw else None

    def send_command(self, command: dict) -> None:
        self.client.rpush(self.commands_key, json.dumps(command))

    def pop_commands(self) -> list[dict]:
        out = []
        while True:
            raw = self.client.lpop(self.commands_key)
            if raw is None:
                return out
            try:
                out.append(json.loads(raw))
            except json.JSONDecodeError:
                continue      # a malformed command is dropped; the sender validates before sending


def format_status(status: dict | None) -> str:
    """The one-screen view of `gigpo status`: the run and its actors, a line per section of common/metrics.py
    with the latest figure of each metric, and where the actors run."""
    if not status:
        return "no status published yet (the job may still be starting)"
    age = time.time() - status.get("updated_at", 0)
    lines = [
        f"run {status.get('run', '?')}   state {status.get('state', '?')}   "
        f"iteration {status.get('iteration', 0)}/{status.get('iterations', '?')}   "
        f"policy version {status.get('policy_version', 0)}   (updated {age:.0f}s ago)",
        f"rollout actors {status.get('rollout_actors', 0)} (restarted {status.get('rollout_restarts', 0)} times, "
        f"{status.get('rollout_restarting', 0)} coming back)"
        f"   inference actors {status.get('inference_actors', 0)}"
        + (f" (+{status['inference_starting']} starting)" if status.get("inference_starting") else "")
        + f"   env instances {status.get('env_instances', 0)}",
    ]
    if status.get("autoscale"):
        lines.append(f"autoscale: {status['autoscale']}")
    figures = status.get("metrics", {})
    for section, specs in SECTIONS.items():
        shown = []
        for spec in specs:
            values = [" ".join([*labels.values(), _figure(figures[key]) + spec.unit])
                      for labels, key in spec.update_keys if key in figures]
            if values:
                shown.append(f"{spec.name} {', '.join(values)}")
        if shown:
            lines.append(f"{section}: " + "   ".join(shown))
    if status.get("outputs"):
        lines.append(f"outputs: {status['outputs']}")
    placement = format_placement(status)
    return "\n".join(lines + ([placement] if placement else []))


NOT_STARTED = "not started yet"
LISTED_PER_ROLE = 4      # more actors of one role on a node are counted, not listed


def format_placement(status: dict | None) -> str:
    """Which actors run on which node, one line per node, from the status record's "placement" ("" if none)."""
    placement = (status or {}).get("placement") or {}
    by_node: dict[str, list[str]] = {}
    for name, node in placement.items():
        where = f"{node['ip']} ({node.get('hostname') or '?'})" if node and node.get("ip") else NOT_STARTED
        by_node.setdefault(where, []).append(name)
    if not by_node:
        return ""
    width = max(map(len, by_node))
    lines = ["nodes:"]
    for where in sorted(by_node, key=lambda w: (w == NOT_STARTED, w)):
        roles: dict[str, list[str]] = {}
        for name in by_node[where]:
            roles.setdefault(name.rsplit("-", 1)[0], []).append(name)
        parts = [", ".join(names) if len(names) <= LISTED_PER_ROLE else f"{len(names)} {role} actors"
                 for role, names in roles.items()]
        lines.append(f"  {where:<{width}}  {', '.join(parts)}")
    return "\n".join(lines)


def _figure(value: float) -> str:
    """A count as an integer, anything else with 3 significant digits (large ones without decimals)."""
    if float(value).is_integer() or abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.3g}"


def format_dead_letters(client: redis.Redis, stream: str, count: int = 20) -> str:
    """The newest `count` groups of the run's dead-letter stream (`<stream>:dead`), one line each, newest first:
    when, the reason, the stream entry it was, the consumer that moved it; then how many it holds."""
    key = f"{stream}:dead"
    total = client.xlen(key)
    if not total:
        return f"dead-letter stream {key}: empty"
    lines = [f"dead-letter stream {key}: {total} group(s), newest first"]
    for _, fields in client.xrevrange(key, count=count):
        def text(name: bytes) -> str:
            return fields.get(name, b"?").decode(errors="replace")
        try:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(text(b"time"))))
        except ValueError:
            when = "?"
        lines.append(f"  {when} UTC  entry {text(b'entry_id')}  by {text(b'consumer')}: {text(b'reason')}")
    if total > count:
        lines.append(f"  ... {total - count} older")
    return "\n".join(lines)
