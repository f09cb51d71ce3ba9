"""Faults of a whole run on one node, with the real parts (Ray, embedded Redis, vLLM, DeepSpeed, ALFWorld),
in one run: a rollout actor killed mid-run comes back and the run finishes with no group lost to training
or trained twice; `gigpo scale --rollout 0` pauses the run, which says so, and a later scale resumes it
(commands are read while the driver waits for data); `gigpo scale --inference 2` adds a vLLM engine that
serves the learner's current weights as soon as it joins (the learner rebuilds its collective group with
it) and gets the next push, and `--inference 1` removes it once its requests are done, none lost or
retried; last, the embedded Redis dies, and the run ends saying so (deploy.run_lifecycle.RunLost)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from common.config import load_config
from deploy import cli
from deploy.control_channel import format_status
from deploy.run_lifecycle import RunLost, lost_run_message
from deploy.system import System
from tests.support.accounting import assert_no_group_lost, stream_counts

pytestmark = [pytest.mark.slow, pytest.mark.fault, pytest.mark.timeout(1500)]

OVERRIDES = [
    # The faults below end the run once they are all done (each of their waits has a deadline, and a missed
    # one ends it too); a fixed number of updates could run out first: the tiny model updates every ~2 s
    # while a second vLLM engine starts.
    "run.iterations=100000",
    "run.eval_every=0", "model.warm_start_steps=0",
    "rollout.groups_per_actor=2", "rollout.group_size=2", "learner.groups_per_batch=2",
    "stream.max_stream_groups=4", "env.max_steps=4", "env.num_generated_games=4", "learner.checkpoint_every=0",
    # A second inference actor must fit beside the others on 2 cores; the collective transfer (as across
    # nodes) makes the learner rebuild its group for an added actor (the shm way: test_weight_transfer.py).
    "inference.cpus_per_actor=0.25", "inference.weight_transfer=collective",
]


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)
    return value


def test_killed_rollout_actor_restarts_scale_to_zero_pauses_inference_scales_and_redis_loss_ends_the_run(tmp_path):
    out = str(tmp_path / "run")
    cfg = load_config("configs/embedded.yaml", [f"run.output_dir={out}", *OVERRIDES])
    seen_states: list[str] = []
    errors: list[BaseException] = []

    with pytest.raises(RunLost) as lost:
        with System(cfg) as system:
            system.start()
            [actor] = system.rollouts.handles().values()

            def status() -> dict:
                return system.channel.read_status() or {}

            def faults() -> None:
                try:
                    _wait_for(lambda: system.update >= 1, 600, "update 1")
                    # A real fault: Ray kills the actor's process and, since it may restart, starts a new one.
                    ray.kill(actor, no_restart=False)
                    _wait_for(lambda: system.rollouts.restarts >= 1, 300, "the driver to notice the dead actor")
                    _wait_for(lambda: system.update >= 2, 600, "update 2 after the restart")
                    # Without draining: what the stream holds then (at most max_stream_groups = 2 batches) is all
                    # the learner gets until the scale back up, so the run must pause before update 5.
                    system.channel.send_command({"op": "scale_rollout", "num_actors": 0, "drain": False})

                    def paused() -> bool:
                        seen_states.append(status().get("state", ""))
                        return seen_states[-1].startswith("paused")
                    _wait_for(paused, 300, "status 'paused'")
                    assert system.update <= 4
                    # As a user does it, through the job file: a rollout actor back, and a second vLLM engine.
                    assert cli.main(["scale", "--output-dir", out, "--rollout", "1", "--inference", "2"]) == 0
                    joined = _wait_for(lambda: status().get("inference_actors") == 2 and status(), 900,
                                       "the added inference actor to join")
                    added = system.inference.serving[1]
                    # It serves the learner's version of when it joined (the status that counts it was
                    # published after), or a newer one: never its initial weights, never an older push.
                    served = ray.get(added.policy_version.remote())
                    assert served >= joined["policy_version"] == joined["iteration"] >= 2, (served, joined)
                    assert "inference actors 2 " in format_status(joined)
                    # The rollout actor sends it requests, and the learner's next push reaches it.
                    _wait_for(lambda: ray.get(added.stats.remote())["requests"] > 0, 300,
                              "the rollout actor to use the added inference actor")
                    _wait_for(lambda: ray.get(added.policy_version.remote()) > served, 600,
                              "the next push to reach the added inference actor")
                    # Back to one: it leaves once nothing is in flight on it, and training goes on.
                    assert cli.main(["scale", "--output-dir", out, "--inference", "1"]) == 0
                    _wait_for(lambda: len(system.inference.serving) == 1 and not system.inference.retiring, 300,
                              "the removed inference actor to stop")
                    with pytest.raises(ray.exceptions.RayActorError):
                        ray.get(added.stats.remote(), timeout=60)
                    removed_at = system.update
                    _wait_for(lambda: system.update >= removed_at + 1, 600, "an update after the removal")
                    system.cfg.run.iterations = system.update + 1      # every fault done: one more update
                except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                    errors.append(exc)
                    system.cfg.run.iterations = 0          # end the run

            thread = threading.Thread(target=faults, daemon=True)
            thread.start()
            history = system.train()
            thread.join(timeout=60)
            assert not errors, errors
            assert not thread.is_alive()
            n = len(history)
            assert [int(m["update"]) for m in history] == list(range(1, n + 1)) and n >= 6
            assert system.rollouts.restarts == 1 and history[-1]["rollout/actor_restarts"] == 1.0
            assert any(s.startswith("paused") for s in seen_states)
            # Every update trained a full batch of distinct groups, and no group twice across updates.
            state = ray.get(system.learners.ranks[0].state.remote())
            assert state["trained_groups"] == n * cfg.learner.groups_per_batch
            # No group lost: every group published was trained, counted as dropped or is in the stream; and
            # none half-published (an entry that is not a whole group is dead-lettered on read).
            assert state["stream"]["dead_lettered"] == 0
            assert_no_group_lost(stream_counts(system.redis.admin_url, cfg.stream), state["stream"], state["trained_groups"])
            assert len(system.rollouts.live) == 1
            # No request was lost to the removed inference actor, nor retried elsewhere: it stopped once idle.
            stats = system.rollouts.stats()
            assert stats.get("inference_retries", 0) == 0 and stats.get("inference_timeouts", 0) == 0, stats
            assert ray.get(system.inference.serving[0].policy_version.remote()) == state["policy_version"] == n

            # The embedded Redis dies (the trajectory stream and the control channel): the next update cannot
            # happen, and leaving the block raises RunLost naming it, after everything was closed.
            os.kill(system.redis.pid, signal.SIGKILL)
            system.cfg.run.iterations = n + 1
            system.train()
    assert len(lost.value.lost) == 1 and "embedded Redis" in lost.value.lost[0], lost.value.lost
    lines = lost_run_message(lost.value, ["gigpo", "train", "configs/embedded.yaml", "run.resume=true"]).splitlines()
    assert lines[0].startswith("gigpo: the run lost its embedded Redis") and len(lines) == 3, lines
    assert lines[-1] == "resume with: gigpo train configs/embedded.yaml run.resume=true"
