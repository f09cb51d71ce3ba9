"""The Redis password reaches the actors only as an argument: it is in no process's command line or
environment, no log, no job file and no tracker config. A real short training run (the `gigpo` command,
embedded Redis, without the variables the Makefile and env.sh used to set) is watched while it runs and its
files and Ray's session logs are searched afterwards; fast tests cover URLs a user gives (in the URL, in
stream.redis_password_file, in $GIGPO_REDIS_PASSWORD) and what `gigpo status` finds."""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import psutil
import pytest
import redis

from common.config import ConfigError, StreamConfig, load_config, to_dict
from common.processes.placement import node_for_messages
from common.processes.process_env import project_env
from common.redaction import redact, redact_text
from common.run_dir import JOB_FILE
from common.stream.redis_client import PASSWORD_ENV, connect, password_file_for, resolve_password
from common.stream.redis_server import EmbeddedRedis, redis_for
from deploy import cli
from deploy.control_channel import job_redis_url, read_job_file, write_job_file

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cret-never-written"


@pytest.mark.parametrize("url, want", [
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://user:p%40w@h:6379/1", "redis://user:***@h:6379/1"),
    ("rediss://:pw@h/0?password=pw2&db=2", "rediss://:***@h/0?password=***&db=2"),
    ("unix:///run/redis.sock?password=pw&db=0", "unix:///run/redis.sock?password=***&db=0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("", ""),
])
def test_redact(url, want):
    assert redact(url) == want
    # The same in free text (a command line, an override), for every URL in it.
    assert redact_text(f"stream.redis_url={url} and 'x={url}'") == f"stream.redis_url={want} and 'x={want}'"


def _files_containing(root: Path, needle: str) -> list[str]:
    """Regular files under `root` (symlinks not followed) whose bytes contain `needle` (or its URL-quoted
    form, as it appears in a URL)."""
    needles = {needle.encode(), quote(needle, safe="").encode()}
    hits = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if path.is_symlink() or not path.is_file():
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if any(n in data for n in needles):
                hits.append(str(path))
    return hits


def test_job_file_and_tracker_config_hold_a_users_url_redacted(tmp_path):
    from deploy.tracking import Tracker

    cfg = load_config(REPO / "configs/embedded.yaml", [f"stream.redis_url=redis://:{SECRET}@10.1.2.3:6380/0",
                                                       f"run.output_dir={tmp_path}"])
    write_job_file(str(tmp_path), "demo", cfg.stream.redis_url, "")
    job = read_job_file(str(tmp_path))
    assert job["redis_url"] == "redis://:***@10.1.2.3:6380/0" and job["redis_password_file"] == ""
    tracker = Tracker(str(tmp_path), "demo", to_dict(cfg))
    # tracker.config is what W&B gets (wandb.init(config=...)) when WANDB_API_KEY is set.
    assert tracker.config["stream"]["redis_url"] == "redis://:***@10.1.2.3:6380/0"
    assert tracker.config["learner"] == to_dict(cfg)["learner"]
    tracker.log({"loss": 1.0}, step=1)
    tracker.close()
    assert _files_containing(tmp_path, SECRET) == []
    # `gigpo status` cannot guess a password it was never given: it says what to set.
    with pytest.raises(ValueError, match=PASSWORD_ENV):
        job_redis_url(job, environ={})
    assert SECRET in job_redis_url(job, environ={PASSWORD_ENV: SECRET})
    # A finished run's own user is gone with its password file; KubeRay's head pod has the admin password.
    write_job_file(str(tmp_path), "demo", f"redis://gigpo-run-x:{SECRET}@10.1.2.3:6380/0", "")
    job = read_job_file(str(tmp_path))
    assert job["redis_url"] == "redis://gigpo-run-x:***@10.1.2.3:6380/0"
    admin = job_redis_url(job, environ={"GIGPO_REDIS_ADMIN_PASSWORD": "adm"})
    assert admin == "redis://gigpo-admin:adm@10.1.2.3:6380/0"


@pytest.fixture(scope="module")
def users_redis():
    with EmbeddedRedis(password=SECRET) as server:
        yield server


def users_url(server: EmbeddedRedis, db: int) -> str:
    """A URL of `server` without its password, as a user would write it: not the one this process's
    EmbeddedRedis knows the password file of, and one per test (this process remembers which file each URL's
    password came from)."""
    return f"redis://localhost:{server.port}/{db}"


def test_password_from_a_file_reaches_the_run_and_gigpo_status(users_redis, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    secret_file = tmp_path / "secret" / "password"       # e.g. a Kubernetes Secret mounted as a file
    secret_file.parent.mkdir()
    secret_file.write_text(SECRET + "\n")
    stream = StreamConfig(redis_url=users_url(users_redis, 1), redis_password_file=str(secret_file))
    url, server = redis_for(stream)
    assert server is None and connect(url).ping()
    assert stream.redis_password_file == "" and password_file_for(url) == str(secret_file)
    out = tmp_path / "run"
    write_job_file(str(out), "demo", url, "")
    assert SECRET not in (out / JOB_FILE).read_text()
    assert cli.main(["status", "--output-dir", str(out)]) == 0
    assert "no status published yet" in capsys.readouterr().out
    # Both places at once is ambiguous: refused, naming both fields.
    both = StreamConfig(redis_url=users_redis.url, redis_password_file=str(secret_file))
    with pytest.raises(ConfigError, match="stream.redis_password_file"):
        resolve_password(both)


def test_password_from_the_environment(users_redis, tmp_path, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    stream = StreamConfig(redis_url=users_url(users_redis, 2))
    resolve_password(stream)
    assert connect(stream.redis_url).ping()
    out = tmp_path / "run"
    write_job_file(str(out), "demo", stream.redis_url, "")
    assert cli.main(["status", "--output-dir", str(out)]) == 0      # from $GIGPO_REDIS_PASSWORD again
    monkeypatch.delenv(PASSWORD_ENV)
    assert cli.main(["status", "--output-dir", str(out)]) == 2      # one line saying to set it


def gigpo(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=120)


def test_gigpo_train_reads_the_password_sources(users_redis, tmp_path):
    """The checks before a run use the password from its source (a wrong one is refused, so it was read),
    and never print it."""
    base = [str(REPO / "configs/embedded.yaml"), f"run.output_dir={tmp_path / 'run'}",
            f"stream.redis_url={users_url(users_redis, 3)}"]
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    proc = gigpo("train", *base, env={**env, PASSWORD_ENV: "not-" + SECRET})
    assert proc.returncode == 2 and "refused the credentials" in proc.stderr, proc.stderr
    missing = tmp_path / "no-such-file"
    proc = gigpo("train", *base, f"stream.redis_password_file={missing}", env=env)
    assert proc.returncode == 2 and "stream.redis_password_file" in proc.stderr and str(missing) in proc.stderr
    assert SECRET not in proc.stderr + proc.stdout


@pytest.mark.parametrize("source", ["file", "environment", "admin file"])
def test_entrypoint_hands_over_the_password_source_not_the_password(users_redis, tmp_path, source):
    """deploy/entrypoint.sh (the cluster job's command) names the Redis and where its password is; `gigpo
    train` reads it (a wrong one is refused by the checks, before anything starts). Where `gigpo redis`'s admin
    password file is readable, the driver gets the admin user's URL (it then makes the run a user of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIGPO_REDIS")}
    env.update(HOME=str(tmp_path), GIGPO_REDIS_HOST="localhost", GIGPO_REDIS_PORT=str(users_redis.port))
    user = ""
    if source == "file":
        (tmp_path / "password").write_text("not-" + SECRET)
        env["GIGPO_REDIS_PASSWORD_FILE"] = str(tmp_path / "password")
    elif source == "admin file":
        (tmp_path / "gigpo-redis").mkdir()
        (tmp_path / "gigpo-redis" / "admin-password").write_text("not-" + SECRET)     # the default place
        user = "gigpo-admin"
    else:
        env[PASSWORD_ENV] = "not-" + SECRET
    proc = subprocess.run(["bash", str(REPO / "deploy/entrypoint.sh"), str(REPO / "configs/embedded.yaml"),
                           f"run.output_dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    whose = f"user {user}'s" if user else "the"
    assert proc.returncode == 2 and f"refused {whose} credentials" in proc.stderr, proc.stderr
    assert f"redis://localhost:{users_redis.port}" in proc.stderr, proc.stderr


def test_gigpo_redis_starts_the_clusters_stream_redis_once_its_password_on_no_command_line(tmp_path, free_port):
    """`gigpo redis` (deploy/ray-cluster*.yaml's head start command): a daemon with an append-only file and no
    eviction, its password made once in an owner-only file and never on a command line; run again, it finds
    it running and leaves it; a port held by a Redis that refuses the password is one line, exit status 2. It
    listens on the loopback and this node's address (Ray's), not on every interface."""
    port, data, password_file = free_port(), tmp_path / "redis", tmp_path / "secret" / "redis_password"
    command = [str(REPO / ".venv" / "bin" / "gigpo"), "redis", "--port", str(port), "--dir", str(data),
               "--password-file", str(password_file), "--maxmemory-mb", "64"]
    try:
        first = subprocess.run(command, capture_output=True, text=True, timeout=60)
        import ray
        here = ray.util.get_node_ip_address()
        binds = list(dict.fromkeys(["127.0.0.1", here]))
        assert first.returncode == 0 and first.stdout.startswith(
            f"gigpo redis: started on {', '.join(binds)} port {port}"), first
        password = password_file.read_text().strip()
        assert len(password) >= 32 and password_file.stat().st_mode & 0o077 == 0
        pid = int((data / "redis.pid").read_text())
        server = psutil.Process(pid)
        # (process_iter's attrs: a process that ends meanwhile, or a zombie, gives None instead of raising)
        assert all(password not in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
        with pytest.raises(redis.exceptions.NoPermissionError):     # the runs' password: data commands only
            redis.Redis(host="127.0.0.1", port=port, password=password).config_get("appendonly")
        admin_password = (data / "admin-password").read_text().strip()
        assert (data / "admin-password").stat().st_mode & 0o077 == 0 and admin_password != password
        client = redis.Redis(host="127.0.0.1", port=port, username="gigpo-admin", password=admin_password)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}     # a power cut loses no group
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("maxmemory") == {"maxmemory": str(64 * 2**20)}
        assert client.config_get("bind") == {"bind": " ".join(binds)}
        again = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and again.stdout.startswith("gigpo redis: running on"), again
        assert int((data / "redis.pid").read_text()) == pid and server.is_running()
        other = tmp_path / "other_password"
        other.write_text("not-the-password\n")
        refused = subprocess.run([*command[:-4], "--password-file", str(other)], capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused
        assert f"port {port} is taken by a Redis that refuses the password" in refused.stderr
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((data / "redis.pid").read_text()), signal.SIGTERM)
    psutil.wait_procs([server], timeout=30)


def test_embedded_redis_on_this_nodes_address(tmp_path):
    """On a cluster the embedded server listens on the node's IP too, and its URL names that IP."""
    import ray
    ip = ray.util.get_node_ip_address()
    if ip.startswith("127."):
        pytest.skip("this machine has no address but the loopback one")
    server = EmbeddedRedis(host=ip, data_dir=str(tmp_path / "data")).start()
    try:
        assert f"@{ip}:{server.port}/" in server.url
        assert connect(server.url).ping()
        assert redis.Redis(host="127.0.0.1", port=server.port, password=server.password).ping()
        secret = Path(server.password_file)
        assert secret.read_text().strip() == server.password and secret.stat().st_mode & 0o077 == 0
        # The owner's data directory (which may be shared) never holds the password.
        assert _files_containing(tmp_path / "data", server.password) == []
    finally:
        server.stop()
    assert not secret.exists() and password_file_for(server.url) == ""


def test_embedded_redis_refuses_an_address_it_cannot_listen_on(tmp_path):
    stream = StreamConfig(embedded_dir=str(tmp_path / "data"))
    with pytest.raises(ConfigError, match="stream.redis_url") as error:
        redis_for(stream, host="192.0.2.123")       # TEST-NET-1: no interface of this machine has it
    assert "192.0.2.123" in str(error.value)


def test_an_unreachable_redis_names_the_node_and_the_address(free_port):
    port = free_port()
    client = connect(f"redis://:{SECRET}@127.0.0.1:{port}/0", retries=0)
    with pytest.raises(redis.exceptions.ConnectionError) as error:
        client.ping()
    message = str(error.value)
    assert f"redis://:***@127.0.0.1:{port}/0" in message and node_for_messages() in message and SECRET not in message


# -- a real run ---------------------------------------------------------------------------------------------

# The small run of test_system_e2e.py / test_train_interrupt.py, with more updates than it gets to do.
OVERRIDES = ["run.iterations=1000", "run.eval_every=0", "rollout.groups_per_actor=2", "rollout.group_size=2",
             "learner.groups_per_batch=2", "env.max_steps=4", "env.num_generated_games=4",
             "rollout.cpus_per_actor=0.25", "model.warm_start_steps=0", "learner.checkpoint_every=1"]
RUN_S = 840


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _learner_process(pid: int) -> psutil.Process | None:
    for p in _descendants(pid):
        try:
            if "LearnerWorker" in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            pass
    return None


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(900)
def test_a_training_run_that_loses_its_learner_writes_the_password_nowhere_and_says_how_to_resume(tmp_path):
    """One real `gigpo train` (embedded Redis with a generated password), watched from outside: the password
    is on no command line, in no process's environment, in no output or file of the run. After two
    updates (each checkpointed) its learner's process is killed (a lost learner node does the same to the
    driver: Ray reports the actor dead; deploy.run_lifecycle.lost_parts tells the two apart by whether the
    node is still in the cluster, the code path is the same): the run ends with exit status 3 and, on stderr,
    no traceback but three lines: which rank on which node was lost, the newest complete checkpoint, the
    command that resumes."""
    from common.run_dir import checkpoint_tags, is_complete_checkpoint, tag_update

    out = tmp_path / "run"
    # The command as a user runs it from the venv, without what the Makefile and env.sh set for the
    # project: the project sets its own environment.
    env = {k: v for k, v in os.environ.items() if k not in project_env(gpu_node=False) and k != PASSWORD_ENV}
    env.pop("RAY_ADDRESS", None)
    overrides = [f"run.output_dir={out}", *OVERRIDES]
    command = [str(REPO / ".venv/bin/gigpo"), "train", "configs/embedded.yaml", *overrides]
    log, err = tmp_path / "train.log", tmp_path / "stderr.log"
    command_lines: set[str] = set()       # every process's argv seen while the run ran (all of the machine's)
    environments: set[str] = set()        # every NAME=value of the run's processes
    password = None
    status_code = None
    killed = False
    with open(log, "wb") as log_file, open(err, "wb") as err_file:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=err_file,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + RUN_S
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the run did not end:\n" + err.read_text()[-4000:]
                for p in psutil.process_iter(["cmdline"]):
                    if p.info["cmdline"]:
                        command_lines.add("\0".join(p.info["cmdline"]))
                for p in _descendants(proc.pid):
                    try:
                        environments.update(f"{k}={v}" for k, v in p.environ().items())
                    except psutil.Error:
                        pass
                if password is None and (out / JOB_FILE).exists():
                    job = read_job_file(str(out))
                    password = Path(job["redis_password_file"]).read_text().strip()
                    assert "***" in job["redis_url"] and "@127.0.0.1:" in job["redis_url"]   # one node
                    # `gigpo status` finds the password through the job file.
                    status_code = subprocess.run([str(REPO / ".venv/bin/gigpo"), "status", "--output-dir",
                                                  str(out)], cwd=REPO, env=env, capture_output=True,
                                                 timeout=60).returncode
                metrics = out / "metrics.jsonl"
                if not killed and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                    learner = _learner_process(proc.pid)
                    if learner is not None:
                        learner.kill()
                        killed = True
                time.sleep(0.3)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    output, stderr = log.read_text(), err.read_text(errors="replace")
    assert killed and proc.returncode == 3, stderr[-4000:]
    assert password and status_code == 0
    # The watch saw the run's own processes, each kind of them: the embedded Redis, every kind of actor (Ray
    # shows an actor's class in its process title), and the environment of the actors' processes.
    for kind in ("redis-server", "LearnerWorker", "InferenceEngine", "Rollout"):
        assert [c for c in command_lines if kind in c], f"the watch saw no {kind} process"
    assert any(e.startswith("VLLM_ALLOW_INSECURE_SERIALIZATION=") for e in environments), \
        "the watch read no actor's environment"
    assert not [c for c in command_lines if password in c], "the password is on a command line"
    assert not [e for e in environments if password in e], "the password is in a process's environment"
    assert password not in output and password not in stderr
    assert _files_containing(out, password) == []
    ray_logs = (out / "logs" / "ray").resolve()         # this run's Ray session logs (linked by the run)
    assert ray_logs.is_dir() and any(ray_logs.iterdir())
    assert _files_containing(ray_logs.parent, password) == []
    assert not Path(job["redis_password_file"]).exists()     # the embedded Redis removed it when it stopped
    # The lost learner, in three lines.
    assert "Traceback" not in stderr and "learner close failed" not in stderr, stderr[-4000:]
    lines = stderr.rstrip("\n").splitlines()
    message = lines[[i for i, line in enumerate(lines) if line.startswith("gigpo: the run lost")][0]:]
    assert len(message) == 3, message
    assert re.fullmatch(rf"gigpo: the run lost learner rank 0 on node [0-9.]+ \({re.escape(socket.gethostname())}\): "
                        r"its process died", message[0]), message
    newest = [tag for tag in checkpoint_tags(out / "checkpoints") if is_complete_checkpoint(tag)][-1]
    assert tag_update(newest.name) >= 2
    assert message[1].startswith(f"a resume starts from {newest} (update {tag_update(newest.name)})"), message
    assert message[2].startswith("resume with: ")
    assert shlex.split(message[2].removeprefix("resume with: ")) == [
        str(REPO / ".venv/bin/gigpo"), "train", "configs/embedded.yaml", *overrides, "run.resume=true"]
