"""Two Ray nodes on this one machine (tests/support/multinode.py: two network namespaces joined by a veth pair, the
worker with its own /dev/shm and /tmp), and training runs placed across them.

- the harness itself: an actor on each node by resource, on different nodes, reaching each other over the
  veth, the worker seeing neither the head's /dev/shm nor its output directory;
- the learner on the head, inference and rollout actors on the worker, weights pushed by the `collective`
  transfer (gloo, which `inference.weight_transfer=auto` picks across nodes), the embedded Redis: `gigpo
  train` run on the head; the worker lost and back.

The shipped cluster files' layout (a head with no CPUs, every role on workers, `ray job submit`), a lost
learner node's three lines included: tests/deploy/test_cluster_files.py.

`pytest -m multinode` runs these alone. They need root (namespaces); elsewhere they skip, saying why.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.accounting import assert_no_group_lost
from tests.support.multinode import (REPO, VENV_BIN, head_start_argv, namespaces_unavailable, two_node_cluster,
                             worker_binds, worker_private_argv, worker_sees_head_path, worker_shared_paths,
                             worker_start_argv)

pytestmark = [pytest.mark.multinode]


@pytest.fixture
def namespaces(tmp_path):
    """Skips a test that needs the two namespaces where they cannot be made, saying why; also where this
    test's directory (the head's output, which the worker must not see) is inside what the worker shares."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"two Ray nodes in network namespaces: {reason}")
    binds = worker_binds(worker_shared_paths())
    if worker_sees_head_path(tmp_path, binds):
        pytest.skip(f"two Ray nodes in network namespaces: this test's directory {tmp_path} is inside "
                    f"{[str(b) for b in binds]}, which the worker node shares with the head, so the worker "
                    f"would see the head's files there (give pytest a --basetemp outside it)")


# -- the worker's view of the filesystem: cheap checks of the mounts, no Ray ----------------------------------

def test_worker_binds_back_what_its_private_mounts_would_hide():
    """Runs everywhere: which of the checkout, its venv and their Python a private tmpfs on /tmp or /dev/shm
    would hide from the worker (each bound back into place), for checkouts in various places."""
    usr = Path("/usr")
    assert worker_binds([Path("/work/main"), Path("/work/main/.venv"), usr]) == []
    assert worker_binds([Path("/tmp/co"), Path("/tmp/co/.venv"), usr]) == [Path("/tmp/co")]
    # .venv a symlink to a venv elsewhere under /tmp; a Python installed under /tmp too
    assert worker_binds([Path("/tmp/co"), Path("/tmp/venvs/a"), Path("/tmp/py/3.11")]) == [
        Path("/tmp/co"), Path("/tmp/py/3.11"), Path("/tmp/venvs/a")]
    assert worker_binds([Path("/work/main"), Path("/tmp/venvs/a"), usr]) == [Path("/tmp/venvs/a")]
    assert worker_binds([Path("/dev/shm/co"), Path("/dev/shm/co/.venv"), usr]) == [Path("/dev/shm/co")]
    for private in ("/tmp", "/dev/shm"):
        with pytest.raises(ValueError, match="private tmpfs"):
            worker_binds([Path(private), Path(private) / ".venv", usr])
    assert worker_sees_head_path("/tmp/co/run", [Path("/tmp/co")])
    assert not worker_sees_head_path("/tmp/co-run", [Path("/tmp/co")])
    assert not worker_sees_head_path("/tmp/pytest-of-root/run", [Path("/tmp/co")])
    assert worker_shared_paths(Path("/tmp/co"))[:2] == [Path("/tmp/co"), Path("/tmp/co/.venv")]


def test_worker_mounts_hide_the_heads_tmp_but_not_a_checkout_there():
    """Root only, cheap (a mount namespace, no network namespace, no Ray): the worker's own mounts, as
    start_worker makes them, for a checkout under /tmp whose .venv is a symlink to a venv elsewhere under
    /tmp. The worker sees both at their paths (and writes to the checkout land in the head's copy) but not
    a head file beside them in /tmp nor one in /dev/shm, and what it writes to its /tmp stays its own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs root and unshare/mount (a mount namespace with tmpfs and bind mounts)")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.strip()}")
    base = Path(tempfile.mkdtemp(prefix="gmn-mounts-", dir="/tmp"))
    shm_file = Path(f"/dev/shm/gmn-mounts-{os.getpid()}")
    try:
        checkout, venv = base / "checkout with space", base / "venvs" / "v"
        (checkout / "tests").mkdir(parents=True)
        (checkout / "tests" / "marker").write_text("code")
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text("")
        (checkout / ".venv").symlink_to(venv)
        (base / "head-output").write_text("head")
        shm_file.write_text("head")
        binds = worker_binds(worker_shared_paths(checkout))
        assert binds == [checkout, venv]
        worker_tmp_file = base / "written-by-worker"
        script = " ; ".join([
            'test -f tests/marker && echo cwd_checkout=1 || echo cwd_checkout=0',
            f'test -f {shlex.quote(str(checkout / ".venv" / "bin" / "python"))} && echo venv=1 || echo venv=0',
            f'test -e {shlex.quote(str(base / "head-output"))} && echo head_tmp=1 || echo head_tmp=0',
            f'test -e {shm_file} && echo head_shm=1 || echo head_shm=0',
            f'echo worker > {shlex.quote(str(checkout / "from-worker"))}',
            f'echo worker > {shlex.quote(str(worker_tmp_file))} && echo wrote_tmp=1',
        ])
        done = subprocess.run(worker_private_argv(binds, checkout, ["sh", "-c", script]), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        seen = dict(line.split("=", 1) for line in done.stdout.split())
        assert seen == {"cwd_checkout": "1", "venv": "1", "head_tmp": "0", "head_shm": "0", "wrote_tmp": "1"}, (
            done.stdout, done.stderr)
        assert (checkout / "from-worker").read_text() == "worker\n"
        assert not worker_tmp_file.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shm_file.unlink(missing_ok=True)


def _probe_json(stdout: str, tag: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith(tag + " ")]
    assert lines, f"no {tag} line in the driver's output:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len(tag) + 1:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_are_separate_machines(namespaces, tmp_path):
    """An actor on each node (placed by the node's custom resource): different Ray nodes with their own IP
    addresses, a TCP connection from the worker's actor to the head's over the veth, and the worker sees
    neither a file the head wrote in its output directory nor one in its /dev/shm."""
    with two_node_cluster(head_cpus=1, worker_cpus=1, keep_logs=tmp_path / "logs") as cluster:
        head_dir = tmp_path / "head-output"        # under /tmp: hidden from the worker by its private /tmp
        head_dir.mkdir()
        done = cluster.run_on_head([str(VENV_BIN / "python"), "-m", "tests.support.multinode", "probe", cluster.address,
                                    str(head_dir), cluster.head_resource, cluster.worker_resource],
                                   timeout_s=180)
        assert done.returncode == 0, done.stderr[-3000:]
        probe = _probe_json(done.stdout, "PROBE")
        assert not cluster.worker_can_see(head_dir)
    assert probe["head"]["ip"] == cluster.head_ip and probe["worker"]["ip"] == cluster.worker_ip
    assert probe["head"]["node_id"] != probe["worker"]["node_id"]
    assert probe["head_sees_output"] and not probe["worker_sees_output"]
    assert probe["head_sees_shm"] and not probe["worker_sees_shm"]
    assert probe["accepted"] == {"peer": cluster.worker_ip, "got": "ping"}
    assert probe["connected"] == {"reply": "pong:ping", "local": cluster.worker_ip}


# -- docs/deploy.md's commands, as the tests below run them ----------------------------------------------------

DOC = REPO / "docs" / "deploy.md"
DOC_OUTPUT_DIR = "/tmp/gigpo-two-node"      # the doc's run.output_dir; a test runs in its own directory
HEAD_IP, WORKER_IP = "10.250.0.1", "10.250.0.2"     # the doc's addresses, the harness's default subnet


def doc_commands(name: str) -> list[list[str]]:
    """The commands of the bash block that follows `<!-- tests/system/test_multinode.py: NAME -->` in
    docs/deploy.md, each split as the shell would (continuation lines joined, comments dropped)."""
    text = DOC.read_text()
    marker = f"<!-- tests/system/test_multinode.py: {name} -->"
    assert marker in text, f"{DOC} lost its {marker!r} block"
    block = text.split(marker, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def doc_layout(name: str, head_cpus: float, worker_cpus: float) -> list[str]:
    """Check that the block's `ray start` commands are the ones two_node_cluster(head_cpus, worker_cpus)
    runs (before the harness's own flags); return the block's last command (the submission or the driver)."""
    commands = doc_commands(name)
    assert len(commands) == 3, commands
    assert commands[0] == head_start_argv(HEAD_IP, head_cpus)
    assert commands[1] == worker_start_argv(HEAD_IP, WORKER_IP, worker_cpus)
    return commands[2]


def in_run_dir(command: list[str], run_dir: Path) -> list[str]:
    assert any(DOC_OUTPUT_DIR in arg for arg in command), command
    return [arg.replace(DOC_OUTPUT_DIR, str(run_dir)) for arg in command]


def test_doc_commands_are_the_ones_the_tests_run():
    """Cheap, runs everywhere (root or not): docs/deploy.md's node commands match the harness's (the slow
    test below runs the rest of the block as written)."""
    driver = doc_layout("learner-on-head", head_cpus=1, worker_cpus=2)
    assert driver[:3] == [".venv/bin/gigpo", "train", "configs/embedded.yaml"]
    assert not any(arg.startswith("inference.weight_transfer=") for arg in driver)     # auto


def _run_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    assert path.is_file(), f"no {path}"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _show(stdout: str, stderr: str, chars: int = 6000) -> str:
    return f"--- stdout ---\n{stdout[-chars:]}\n--- stderr ---\n{stderr[-chars:]}"


def _wait_for_updates(proc: subprocess.Popen, metrics_path: Path, updates: int, timeout_s: float) -> None:
    """Until the run that `proc` drives has logged `updates` updates; fails if it ends first or the time is up."""
    deadline = time.monotonic() + timeout_s
    while not (metrics_path.is_file() and len(metrics_path.read_text().splitlines()) >= updates):
        assert proc.poll() is None, proc.stdout.read()[-6000:]
        assert time.monotonic() < deadline, f"{updates} updates not done in {timeout_s:.0f} s"
        time.sleep(0.5)


def _output_when_ended(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """`proc`'s output once it has ended; killed and failed with its output if it has not within timeout_s."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{what} did not end within {timeout_s:.0f} s of the node's loss:\n{out[-6000:]}")
    return out


# -- the learner on the head, inference and rollout on the worker -------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.fault
def test_learner_on_head_rollout_and_inference_on_worker_which_is_lost_and_comes_back(namespaces, tmp_path):
    """docs/deploy.md's second layout: `gigpo train` on the head with the learner there, vLLM and the rollout
    actor on the worker, weights pushed over the veth by the `collective` (gloo) transfer, groups through
    the embedded Redis on the head's address, the model shipped to the worker through Ray. Run by
    tests/support/multinode.py's observing driver: the same `gigpo train` (deploy.cli.main) that also records what
    its actors say when the run closes.

    After the second update the worker is lost: every process of its namespace SIGKILLed at once (a
    reclaimed spot node: its /dev/shm and /tmp go too), and a fresh worker node joins under the same
    address. Ray restarts both actors there; the driver restarts the rollout loop, the learner rebuilds its
    weight-transfer group with the new vLLM (which starts on dummy weights) and pushes the newest version,
    and the run ends with every update done. (One run for both: each two-node run costs minutes here.)"""
    command = doc_layout("learner-on-head", head_cpus=1, worker_cpus=2)
    iterations = 5
    command = [f"run.iterations={iterations}" if arg == "run.iterations=2" else arg for arg in command]
    assert command[0] == ".venv/bin/gigpo" and f"run.iterations={iterations}" in command
    # A push to the lost node's vLLM waits for its restart; give it time for the node to come back (the
    # harness brings it back at once) but fail in bounded time if it never does.
    command += ["inference.transfer_timeout_s=240"]
    run_dir, record_path = tmp_path / "run", tmp_path / "record.json"
    metrics_path = run_dir / "metrics.jsonl"
    argv = [str(VENV_BIN / "python"), "-m", "tests.support.multinode", "train-observed", str(record_path),
            *in_run_dir(command[1:], run_dir)]
    t0 = time.monotonic()
    with two_node_cluster(head_cpus=1, worker_cpus=2, keep_logs=tmp_path / "logs") as cluster:
        t_up = time.monotonic() - t0
        driver = cluster.popen_on_head(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for_updates(driver, metrics_path, 2, timeout_s=480)
        cluster.lose_worker()
        # While the node is gone the run waits and says why: `gigpo status` (as a user on the head runs it)
        # shows the rollout actor coming back, once Ray has noticed the loss (its health checks: seconds).
        deadline, status = time.monotonic() + 180, ""
        while "coming back (their process or node was lost" not in status:
            assert driver.poll() is None, driver.stdout.read()[-6000:]
            assert time.monotonic() < deadline, f"no status line about the lost node within 180 s:\n{status}"
            status = cluster.run_on_head([str(VENV_BIN / "gigpo"), "status", "--output-dir", str(run_dir)],
                                         timeout_s=60).stdout
            time.sleep(1.0)
        cluster.start_worker()
        cluster.wait_for_nodes(2)
        out = _output_when_ended(driver, 600, "the run")
        # What the head wrote (the model it built, the job file) the worker never sees; the actors there
        # write their own log files under the same path on their own node.
        worker_sees = {name: cluster.worker_can_see(run_dir / name) for name in ("tiny_model", "job.json")}
        if cluster.worker_can_see(run_dir / "logs"):
            cluster.copy_worker_dir(str(run_dir / "logs"), tmp_path / "worker-run-logs")
    print(f"two nodes up in {t_up:.0f} s, all {time.monotonic() - t0:.0f} s")
    assert driver.returncode == 0, out[-6000:]
    assert not any(worker_sees.values()), worker_sees
    assert (tmp_path / "worker-run-logs" / "inference-0.log").is_file()
    # Every update done, each on groups the rollout actor published; the driver restarted the rollout
    # actor's loop once, and the updates after the loss trained on groups the new node sampled.
    metrics = _run_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, iterations + 1)), out[-6000:]
    assert metrics[-1]["rollout/actor_restarts"] == 1, metrics[-1]
    record = json.loads(record_path.read_text())
    assert "error" not in record, record
    (learner,) = record["learners"]
    (inference,) = record["inference"]
    rollouts = record["rollouts"]
    assert learner["node"]["ip"] == HEAD_IP, learner
    assert inference["node"]["ip"] == WORKER_IP, inference
    assert rollouts and all(r["node"]["ip"] == WORKER_IP for r in rollouts.values()), rollouts
    # The new worker's vLLM serves the learner's newest weights.
    assert learner["state"]["updates"] == iterations
    assert inference["policy_version"] == learner["state"]["policy_version"] == iterations, (inference, learner)
    # ... and those are the learner's weights, not the dummy ones the worker's vLLM started with: the
    # first update trains on groups sampled by version 0 only (no other version exists before it), and the
    # learner recomputes their log-probs with those same weights. Both sides compute in float32 (different
    # kernels: differences of ~1e-5 per token); the worker's dummy weights (vLLM's init: near-zero weights,
    # uniform logits, log-prob -ln 1024) would differ from this model's log-probs of the tokens it samples
    # by ~0.47 per token (measured for the tiny model), far above the bound.
    drift = metrics[0]["train/logprob_gap_mean"]
    assert metrics[0]["lag/policy_versions_max"] == 0 and drift < 1e-2, (drift, metrics[0])
    # The groups came across the network: published on the worker, into the Redis on the head's address
    # (the worker cannot reach the head's 127.0.0.1), trained on the head. (The restarted actor's counters
    # start afresh: it published at least the groups of the updates after the loss.)
    assert record["redis_host"] == HEAD_IP
    published = sum(r["stats"]["groups_published"] for r in rollouts.values())
    assert published >= 2 and learner["state"]["trained_groups"] >= 2 * iterations, (published, learner)
    # No group trained twice: the final checkpoint's set of trained group ids holds one per row of every batch
    # (5 updates x learner.groups_per_batch 2); groups in flight on the lost node were never published.
    (final,) = [p for p in (run_dir / "checkpoints").glob("update_*/learner_state.json")
                if json.loads(p.read_text())["updates"] == iterations]
    trained = len(json.loads(final.read_text())["trained_group_ids"])
    assert trained == iterations * 2
    # ... and none lost: every group published into the stream (Redis's count of XADD calls, less the copies
    # written to the dead-letter stream) was acked after training, counted as dropped (stale, duplicate,
    # dead-lettered) or is still in the stream when the run closes (one snapshot, taken in a transaction).
    assert_no_group_lost(record["stream"], learner["state"]["stream"], trained)
    # `gigpo status` names the node of each actor.
    status = record["gigpo_status"]
    assert re.search(rf"^\s*{re.escape(WORKER_IP)} .*rollout-0", status, re.M), status
    assert re.search(rf"^\s*{re.escape(HEAD_IP)} .*learner-0", status, re.M), status
    # The weights went by the collective transfer, which `auto` chose: the new worker's engine joined a gloo
    # group with the learner (an shm push never makes one).
    transfer = inference["transfer_state"]
    assert transfer["backend"] == "gloo" and transfer["group"], transfer
