"""The command-line tool and the job's control channel (status out, scale commands in) on a real Redis."""
from pathlib import Path

import pytest

from common.config import ConfigError
from common.metrics import METRICS, SECTIONS, update_figures
from common.stream.redis_client import connect
from common.stream.redis_server import EmbeddedRedis
from deploy import cli
from deploy.control_channel import ControlChannel, format_status, job_redis_url, read_job_file, write_job_file


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


def test_status_and_scale_through_the_job_file(tmp_path, redis_url, capsys):
    write_job_file(str(tmp_path), "demo", redis_url, "", max_actors={"rollout": 8, "inference": 4})
    assert (tmp_path / "job.json").stat().st_mode & 0o077 == 0      # names the file with the Redis password
    # (the password itself is in no job file: tests/deploy/test_secrets.py)
    job_channel = ControlChannel(connect(job_redis_url(read_job_file(str(tmp_path)))), "demo")
    job_channel.publish_status({"run": "demo", "state": "training", "iteration": 3, "iterations": 10,
                                "policy_version": 3, "rollout_actors": 2,
                                "metrics": {"rollout/env_steps_per_s": 12.5}})
    assert cli.main(["status", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "iteration 3/10" in out and "policy version 3" in out and "throughput: env_steps 12.5/s" in out

    assert cli.main(["scale", "--output-dir", str(tmp_path), "--rollout", "4"]) == 0
    assert job_channel.pop_commands() == [{"op": "scale_rollout", "num_actors": 4, "drain": True}]
    assert job_channel.pop_commands() == []
    # Both at once: inference first, so that the rollout actors it adds start with the new inference actors.
    assert cli.main(["scale", "--output-dir", str(tmp_path), "--rollout", "2", "--inference", "3", "--discard"]) == 0
    assert job_channel.pop_commands() == [{"op": "scale_inference", "num_actors": 3},
                                          {"op": "scale_rollout", "num_actors": 2, "drain": False}]
    assert "3 inference actors" in capsys.readouterr().out
    for argv, says in ((["--inference", "0"], "--inference 0: a run needs at least 1 inference actor"),
                       ([], "--rollout N, --inference N, or both"),
                       (["--rollout", "9"], "--rollout 9: this run allows at most 8 rollout actors"),
                       (["--rollout", "2", "--inference", "5"], "--inference 5: this run allows at most 4")):
        assert cli.main(["scale", "--output-dir", str(tmp_path), *argv]) == 2
        assert says in capsys.readouterr().err
    assert job_channel.pop_commands() == []
    # `gigpo status` counts the inference actors, those still starting apart.
    job_channel.publish_status({"run": "demo", "inference_actors": 1, "inference_starting": 2})
    assert cli.main(["status", "--output-dir", str(tmp_path)]) == 0
    assert "inference actors 1 (+2 starting)" in capsys.readouterr().out


def test_status_without_a_job_says_what_to_pass(tmp_path, capsys):
    assert cli.main(["status", "--output-dir", str(tmp_path / "nothing")]) == 2
    assert "--output-dir" in capsys.readouterr().err


def test_malformed_commands_are_dropped(redis_url):
    channel = ControlChannel(connect(redis_url), "bad")
    channel.client.rpush("gigpo:bad:commands", b"{not json")
    channel.send_command({"op": "scale_rollout", "num_actors": 1})
    assert channel.pop_commands() == [{"op": "scale_rollout", "num_actors": 1}]


def test_format_status_before_any_update():
    assert "no status" in format_status(None)


def test_status_shows_every_declared_figure_by_section():
    """The status view is generated from common/metrics.py: every figure a declared metric names in an
    update's metrics shows, on its section's line, with its labels and unit; figures not there yet do not."""
    figures = {}
    for spec in METRICS.values():
        for i, (_, key) in enumerate(spec.update_keys):
            figures[key] = 10.0 + i
    status = {"run": "demo", "metrics": update_figures({**figures, "not/declared": 1.0})}
    assert "not/declared" not in status["metrics"]
    lines = format_status(status).splitlines()
    for section, specs in SECTIONS.items():
        shown = [spec for spec in specs if spec.update_key]
        line = next((ln for ln in lines if ln.startswith(f"{section}: ")), "")
        assert all(f"{spec.name} " in line for spec in shown), (section, line)
    assert "learner_seconds wait_data 10s, train 11s, push_weights 12s" in format_status(status)
    assert "policy_lag min 10, mean 11, max 12" in format_status(status)
    status["metrics"] = {"train/pg_loss": 0.01234}
    assert format_status(status).splitlines()[2:] == ["learning: learner_loss 0.0123"]


def test_config_command_prints_fields_and_resolved_configs(capsys):
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert "learner.omega = 1.0" in out and "weight of the step advantage (Eq. 8); it must be >= 0" in out
    assert cli.main(["config", "configs/embedded.yaml", "learner.lr=3e-4"]) == 0
    assert "lr: 0.0003" in capsys.readouterr().out


def test_config_errors_exit_with_the_reason(capsys):
    assert cli.main(["config", "configs/embedded.yaml", "learner.omgea=2"]) == 2
    assert capsys.readouterr().err == ("gigpo: override 'learner.omgea=2': unknown config field 'learner.omgea' "
                                       "(did you mean 'omega'?)\n")
    # --debug: the exception itself, with its traceback
    with pytest.raises(ConfigError, match="did you mean 'omega'"):
        cli.main(["config", "configs/embedded.yaml", "learner.omgea=2", "--debug"])


def test_eval_of_a_directory_that_is_no_checkpoint_exits_with_the_reason(tmp_path, capsys):
    # Before anything starts (no Ray, no engine): evaluating the initial model instead would mislead.
    not_a_checkpoint = tmp_path / "checkpoints" / "update_0000004"
    not_a_checkpoint.mkdir(parents=True)
    assert cli.main(["eval", "configs/embedded.yaml", "--checkpoint", str(not_a_checkpoint)]) == 2
    assert "update_0000004 is not a checkpoint directory" in capsys.readouterr().err


def test_eval_table_has_the_papers_columns():
    """`gigpo eval`'s table: ALFWorld's task types in the paper's order (Pick, Look, Clean, Heat, Cool, Pick2,
    All), one row per split, '-' where a split played no task of a type; WebShop: Score and Succ."""
    from deploy.reports import format_eval
    seen = {"episodes": 3, "success": 2 / 3, "per_task_type": {"pick_two_obj_and_place": 0.5,
                                                                 "pick_and_place_simple": 1.0}}
    unseen = {"episodes": 1, "success": 0.0, "per_task_type": {"look_at_obj_in_light": 0.0}}
    lines = format_eval("update 8", {"valid_seen": seen, "valid_unseen": unseen}).splitlines()
    assert [cell.strip() for cell in lines[1].split("|")] == ["split", "Pick", "Look", "Pick2", "All", "episodes"]
    assert [cell.strip() for cell in lines[2].split("|")] == ["valid_seen", "100.0", "-", "50.0", "66.7", "3"]
    assert [cell.strip() for cell in lines[3].split("|")] == ["valid_unseen", "-", "0.0", "-", "0.0", "1"]
    shop = {"episodes": 32, "success": 0.0625, "score": 0.22, "per_task_type": {"webshop": 0.0625}}
    lines = format_eval("after training", {"eval": shop}).splitlines()
    assert lines[0] == "== after training (%)"
    assert [cell.strip() for cell in lines[1].split("|")] == ["split", "Score", "Succ.", "episodes"]
    assert [cell.strip() for cell in lines[2].split("|")] == ["eval", "22.0", "6.2", "32"]


def test_a_full_checkpoint_disk_reaches_the_driver_as_a_lost_part_with_its_resume(local_ray, tmp_path):
    """A learner's checkpoint that ran out of space (learner.trainer: OSError ENOSPC, tests/learner/
    test_faults_learner.py causes it for real) arrives at the driver wrapped by Ray; the driver names it as
    what the run lost, with where a resume starts (the checkpoint before) and how."""
    import errno

    from deploy.run_lifecycle import RunLost, disk_full, lost_run_message

    @local_ray.remote
    def save():
        raise OSError(errno.ENOSPC, "No space left on device for the checkpoint /x/update_0000002 (it was removed)")

    with pytest.raises(Exception) as err:
        local_ray.get(save.remote())
    full = disk_full(err.value)
    assert full is not None and full.errno == errno.ENOSPC and "update_0000002" in full.strerror
    assert disk_full(RuntimeError("another failure")) is None and disk_full(None) is None
    (tmp_path / "checkpoints" / "update_0000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "update_0000001" / "learner_state.json").write_text("{}")
    lines = lost_run_message(RunLost([f"the space its checkpoints need: {full.strerror}"], str(tmp_path)),
                             ["gigpo", "train", "c.yaml", "run.resume=true"]).splitlines()
    assert lines[0].startswith("gigpo: the run lost the space its checkpoints need: No space left on device")
    assert lines[1].startswith(f"a resume starts from {tmp_path / 'checkpoints' / 'update_0000001'} (update 1)")
    assert lines[-1] == "resume with: gigpo train c.yaml run.resume=true"


def test_a_lost_part_is_said_in_a_few_lines_with_the_resume_point_and_the_resume_command(tmp_path, monkeypatch):
    """deploy.run_lifecycle.lost_run_message (what `gigpo train` prints on RunLost, exit status 3): what was lost, the
    checkpoint a resume starts from (common.run_dir.resume_point: without `latest`, the newest *complete* one by
    update number), and the command line that resumes: the same config, program
    and overrides, run.resume=true, without run.resume_tag (an older checkpoint) or run.overwrite (would delete
    them). The run itself: tests/deploy/test_train_interrupt.py."""
    import shlex

    from common.run_dir import LATEST, LEARNER_STATE
    from deploy.run_lifecycle import RunLost, lost_run_message

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("sys.argv", [".venv/bin/gigpo"])
    out = tmp_path / "run"
    args = cli.build_parser().parse_args([
        "train", "configs/embedded.yaml", f"run.output_dir={out}", "run.overwrite=true", "--address", "10.0.0.1:6379",
        "run.resume_tag=update_0000002", 'learner.resources={"gpu_node": 1}'])
    command = cli.resume_command(args)
    assert command == [".venv/bin/gigpo", "train", "configs/embedded.yaml", f"run.output_dir={out}",
                       'learner.resources={"gpu_node": 1}', "run.resume=true", "--address", "10.0.0.1:6379"]
    # A Redis password given on the command line is not printed back.
    with_password = cli.build_parser().parse_args(["train", "configs/embedded.yaml", "stream.redis_url=redis://:"
                                                   "s3cret@10.0.0.5:6380/0"])
    assert cli.resume_command(with_password)[3] == "stream.redis_url=redis://:***@10.0.0.5:6380/0"
    lost = RunLost(["learner rank 0 on node 10.0.0.2 (gpu-a): the node is gone (it left the Ray cluster)"], str(out),
                   learner_node={"ip": "10.0.0.2", "hostname": "gpu-a", "node_id": "x"})
    lines = lost_run_message(lost, command).splitlines()
    assert lines[0] == "gigpo: the run lost learner rank 0 on node 10.0.0.2 (gpu-a): the node is gone (it left the " \
                       "Ray cluster)"
    assert "no complete checkpoint" in lines[1] and "10.0.0.2 (gpu-a)" in lines[1]
    assert shlex.split(lines[-1].removeprefix("resume with: ")) == command
    for update, complete in ((2, True), (10, True), (11, False)):     # update 11: written half-way
        tag = out / "checkpoints" / f"update_{update:07d}"
        tag.mkdir(parents=True)
        if complete:
            (tag / LEARNER_STATE).write_text("{}")
    lines = lost_run_message(lost, command).splitlines()
    assert len(lines) == 3
    assert lines[1].startswith(f"a resume starts from {out / 'checkpoints' / 'update_0000010'} (update 10); ")
    # What the learner will load, said the same way: `latest` names the run's history (here a branch from
    # update 2: update 10 belongs to the history it left), and a `latest` naming nothing is said with its fix.
    (out / "checkpoints" / LATEST).write_text("update_0000002")
    assert lost_run_message(lost, command).splitlines()[1].startswith(
        f"a resume starts from {out / 'checkpoints' / 'update_0000002'} (update 2); ")
    (out / "checkpoints" / LATEST).write_text("")
    assert lost_run_message(lost, command).splitlines()[1] == (
        f"{out / 'checkpoints' / LATEST} is empty, naming no checkpoint (complete ones: update_0000002, "
        "update_0000010): resume with run.resume_tag=update_0000010")
    # The command resumes: its overrides load, with run.resume on and nothing that contradicts it.
    from common.config import load_config
    cfg = load_config(command[2], [a for a in command[3:] if "=" in a and not a.startswith("--")])
    assert cfg.run.resume and not cfg.run.overwrite and not cfg.run.resume_tag


def test_status_lists_the_groups_the_learner_set_aside(tmp_path, redis_url, capsys):
    """`gigpo status --dead-letters N`: the newest N entries of the run's dead-letter stream (job.json names
    the stream), newest first, each with its reason; the rest counted."""
    from common.config import StreamConfig
    from common.stream.redis_stream import TrajectoryStream, stream_key

    cfg = StreamConfig(run_id="dl-demo")
    write_job_file(str(tmp_path), "demo", redis_url, "", run_id=cfg.run_id, stream=stream_key(cfg))
    assert cli.main(["status", "--output-dir", str(tmp_path), "--dead-letters"]) == 0
    assert capsys.readouterr().out.strip() == "dead-letter stream gigpo:dl-demo:groups:dead: empty"
    reader = TrajectoryStream(redis_url, cfg)
    client = connect(redis_url)
    for n in range(3):      # entries no producer of this project writes: dead-lettered on read, with the reason
        client.xadd(stream_key(cfg), {"hello": f"world {n}"})
    assert reader.read(max_groups=3, block_ms=100) == []
    assert cli.main(["status", "--output-dir", str(tmp_path), "--dead-letters", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "dead-letter stream gigpo:dl-demo:groups:dead: 3 group(s), newest first"
    assert len(lines) == 4 and lines[3] == "  ... 1 older"
    assert all(" UTC  entry " in line and "by learner-0: " in line for line in lines[1:3]), lines
    assert "by learner-0: " in lines[1] and lines[1].split(": ", 1)[1] == reader.dead_letters()[-1][b"reason"].decode()


def test_status_watch_refreshes_until_interrupted(tmp_path, redis_url, sigint_reaches_children):
    """`gigpo status --watch` as README runs it: the screen redrawn with the job's newest status at each
    interval (a status the job publishes meanwhile shows at the next refresh), until Ctrl-C: exit status
    130 and one line."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    write_job_file(str(tmp_path), "demo", redis_url, "", max_actors={"rollout": 8, "inference": 4})
    channel = ControlChannel(connect(redis_url), "demo")
    channel.publish_status({"run": "demo", "state": "training", "iteration": 1, "iterations": 10})
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", "status", "--output-dir", str(tmp_path),
                             "--watch", "--interval", "0.2"], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        seen, deadline = b"", time.monotonic() + 60
        os.set_blocking(proc.stdout.fileno(), False)
        while seen.count(b"\x1b[2J") < 3 or b"iteration 2/10" not in seen:
            assert proc.poll() is None and time.monotonic() < deadline, seen[-2000:]
            if seen.count(b"\x1b[2J") >= 2:      # two screens of iteration 1: the job moves on
                channel.publish_status({"run": "demo", "state": "training", "iteration": 2, "iterations": 10})
            seen += proc.stdout.read() or b""
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"iteration 1/10" in seen
    assert proc.returncode == 130 and err.decode().strip() == "gigpo: interrupted", err


def test_the_config_reference_page_is_what_the_code_says():
    """docs/config.md lists every field with its default and doc as common/config.py declares them: a field
    added, renamed or given another default without `gigpo config --markdown > docs/config.md` fails here."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert page == cli.config_reference(), "docs/config.md is stale: run .venv/bin/gigpo config --markdown > docs/config.md"
