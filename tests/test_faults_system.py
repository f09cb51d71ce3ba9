"""Faults of a whole run on one node, with the real parts (Ray, embedded Redis, vLLM, DeepSpeed, ALFWorld):
a rollout actor killed mid-run comes back and the run finishes with no group lost to training or trained
twice; `gigpo scale --rollout 0` pauses the run, which says so, and a later scale resumes it (commands are
read while the driver waits for data)."""
from __future__ import annotations

import threading
import time

import pytest
import ray

from common.config import load_config
from deploy.system import System

pytestmark = [pytest.mark.slow, pytest.mark.fault, pytest.mark.timeout(900)]

OVERRIDES = [
    "run.iterations=6", "run.eval_every=0", "model.warm_start_steps=0",
    "rollout.groups_per_actor=2", "rollout.group_size=2", "learner.groups_per_batch=2",
    "stream.max_stream_groups=4", "env.max_steps=4", "env.num_generated_games=4", "learner.checkpoint_every=0",
]


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def test_killed_rollout_actor_restarts_and_scale_to_zero_pauses(tmp_path):
    cfg = load_config("configs/embedded.yaml", [f"run.output_dir={tmp_path / 'run'}", *OVERRIDES])
    seen_states: list[str] = []
    errors: list[BaseException] = []

    with System(cfg) as system:
        system.start()
        [actor] = system.rollouts.values()

        def faults() -> None:
            try:
                _wait_for(lambda: system.update >= 1, 600, "update 1")
                # A real fault: Ray kills the actor's process and, since it may restart, starts a new one.
                ray.kill(actor, no_restart=False)
                _wait_for(lambda: system.rollout_restarts >= 1, 300, "the driver to notice the dead actor")
                _wait_for(lambda: system.update >= 2, 600, "update 2 after the restart")
                # Without draining: what the stream holds then (at most max_stream_groups = 2 batches) is all
                # the learner gets until the scale back up, so the run must pause before update 5.
                system.channel.send_command({"op": "scale_rollout", "num_actors": 0, "drain": False})

                def paused() -> bool:
                    state = (system.channel.read_status() or {}).get("state", "")
                    seen_states.append(state)
                    return state.startswith("paused")
                _wait_for(paused, 300, "status 'paused'")
                assert system.update <= 4
                system.channel.send_command({"op": "scale_rollout", "num_actors": 1, "drain": True})
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        thread = threading.Thread(target=faults, daemon=True)
        thread.start()
        history = system.train()
        thread.join(timeout=60)
        assert not errors, errors
        assert not thread.is_alive()
        assert [int(m["update"]) for m in history] == [1, 2, 3, 4, 5, 6]
        assert system.rollout_restarts == 1 and history[-1]["rollout/actor_restarts"] == 1.0
        assert any(s.startswith("paused") for s in seen_states)
        # Every update trained a full batch of distinct groups, and no group twice across updates.
        state = ray.get(system.learners[0].state.remote())
        assert state["trained_groups"] == 6 * cfg.learner.groups_per_batch
        assert len(system.rollouts) == 1
