"""The env pool: EnvPool worker processes (batching, crash and hang recovery), and the registry. Real ALFWorld engine on generated games; real worker processes killed for real."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from common.config import EnvConfig
from env_servers.registry import make_env
from env_servers.server import EnvPool, InstanceResult

GEN = {"preset": "tiny"}

RESTART_MARGIN_S = 10.0      # a hung worker's kill and restart, on a loaded 2-core machine


def cfg(**kw) -> EnvConfig:
    base = dict(name="alfworld", source="generated", generator=GEN, num_generated_games=8,
                instances_per_process=2, step_timeout_s=20.0)
    base.update(kw)
    return EnvConfig(**base)


@pytest.fixture(scope="module")
def pool():
    # 10 s: long enough for a first reset on a loaded 2-core machine, short enough for the hang test.
    p = EnvPool(cfg(step_timeout_s=10.0), num_instances=4, seed=0)
    yield p
    p.close()


def walkthrough(pool: EnvPool, task_id: str) -> list[str]:
    return pool.reset_batch([(0, task_id, 0)])[0].report.info["walkthrough"]


def test_batched_reset_gives_identical_first_reports_and_steps_to_a_win(pool):
    task = pool.task_ids("train")[2]
    results = pool.reset_batch([(i, task, 11) for i in range(4)])
    assert [r.instance for r in results] == [0, 1, 2, 3]
    assert all(r.error is None and not r.restarted for r in results)
    assert all(r.report == results[0].report for r in results)
    for action in results[0].report.info["walkthrough"]:
        results = pool.step_batch([(i, action) for i in range(4)])
    assert all(r.report.won and r.report.reward == 1.0 for r in results)


def test_env_errors_are_per_instance_and_nothing_raises(pool):
    task = pool.task_ids("train")[0]
    results = pool.reset_batch([(0, task, 0), (1, "gen/nope", 0), (9, task, 0)])
    assert results[0].error is None
    assert "KeyError" in results[1].error and not results[1].restarted
    assert "out of range" in results[2].error
    assert pool.step_batch([(0, "flap wings")])[0].report.observation == "Nothing happens."


@pytest.mark.fault
def test_killed_worker_is_restarted_and_reported(pool):
    task = pool.task_ids("train")[1]
    pool.reset_batch([(i, task, 0) for i in range(4)])
    pool.step_batch([(i, "look") for i in range(4)])          # mid-episode
    pid = pool.worker_pid(0)                                   # hosts instances 0 and 1
    os.kill(pid, signal.SIGKILL)
    results = pool.step_batch([(i, "look") for i in range(4)])
    assert results[0].restarted and "died" in results[0].error
    assert results[1].restarted and "lost" in results[1].error   # its episode died with the process
    assert not results[2].restarted and results[2].report is not None
    assert not results[3].restarted and results[3].report is not None
    assert pool.worker_pid(0) != pid
    # After a reset the restarted instances play again.
    assert all(r.error is None for r in pool.reset_batch([(0, task, 0), (1, task, 0)]))
    assert all(r.error is None for r in pool.step_batch([(i, "look") for i in range(4)]))


@pytest.mark.fault
def test_hung_worker_times_out_and_is_restarted(pool):
    task = pool.task_ids("train")[1]
    pool.reset_batch([(i, task, 0) for i in range(4)])
    pid = pool.worker_pid(2)                                   # hosts instances 2 and 3
    os.kill(pid, signal.SIGSTOP)                               # a real hang: the process stops answering
    try:
        start = time.monotonic()
        results = pool.step_batch([(i, "look") for i in range(4)])
        elapsed = time.monotonic() - start
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert results[2].restarted and "hung" in results[2].error
    assert results[3].restarted
    assert results[0].error is None and results[1].error is None
    # Given up at the step timeout, not before; then a kill and a new worker from the fork server (which has
    # the engine imported already), which takes a second or two: RESTART_MARGIN_S is several times that.
    timeout_s = pool.env_cfg.step_timeout_s
    assert timeout_s <= elapsed < timeout_s + RESTART_MARGIN_S
    assert pool.stats()["restarts"] >= 1


def test_registry_dispatches_and_rejects_unknown(tmp_path):
    env = make_env(cfg(), seed=3)
    try:
        assert env.reset(env.task_ids("train")[0]).task_type == "pick_and_place_simple"
    finally:
        env.close()
    with pytest.raises(ValueError, match="webshop"):
        make_env(EnvConfig(name="minecraft"))
    try:
        import env_servers.webshop.env  # noqa: F401
    except ImportError:
        pytest.skip("env_servers.webshop not present")
    shop = make_env(EnvConfig(name="webshop"))
    try:
        assert shop.reset(shop.task_ids("eval")[0]).task_type
    finally:
        shop.close()


@pytest.mark.timeout(240)
def test_pool_steps_32_instances_in_overlapping_batches():
    """A rollout actor's pool at the size of two groups x 16: 4 worker processes, batches in flight at once."""
    with EnvPool(cfg(instances_per_process=8), 32, seed=0) as pool:
        tasks = pool.task_ids("train")[:4]
        # 4 episode groups of 8 instances, one task each.
        results = [f.result() for f in pool.submit_resets([(i, tasks[i // 8], 0) for i in range(32)])]
        assert all(isinstance(r, InstanceResult) and r.error is None for r in results)
        for g in range(4):
            assert len({json.dumps(r.report.__dict__, sort_keys=True) for r in results[g * 8:(g + 1) * 8]}) == 1
        plans = [r.report.info["walkthrough"] for r in results]
        won = [False] * 32
        for k in range(max(map(len, plans))):
            batch = [(i, plans[i][k]) for i in range(32) if k < len(plans[i])]
            # Two half batches in flight at once (two groups' steps): their futures overlap.
            halves = pool.submit_steps(batch[:len(batch) // 2]) + pool.submit_steps(batch[len(batch) // 2:])
            for r in (f.result() for f in halves):
                assert r.error is None
                won[r.instance] = won[r.instance] or r.report.won
        assert all(won)
        stats = pool.stats()
        assert stats["instances"] == 32 and stats["workers"] == 4 and stats["restarts"] == 0
