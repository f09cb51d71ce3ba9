"""The stream across a real restart of the redis-server process (same port, same data directory)."""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter

import pytest
import redis

from common.config import StreamConfig
from common.processes.placement import free_port
from common.stream.redis_client import connect
from common.stream.redis_server import EmbeddedRedis, add_run_user, serve_detached
from common.stream.redis_stream import TrajectoryStream
from learner.read_policy import groups_to_train
from tests.support.stream_factory import make_group

pytestmark = pytest.mark.timeout(90)


@pytest.mark.fault
def test_redis_crash_and_restart_with_aof_loses_no_group(tmp_path):
    cfg = StreamConfig(stream="restart:aof", reclaim_idle_s=60)
    server = EmbeddedRedis(data_dir=str(tmp_path), aof=True, appendfsync="always").start()
    try:
        port = server.port
        producer = TrajectoryStream(server.url, cfg, consumer_name="producer")
        learner = TrajectoryStream(server.url, cfg, consumer_name="learner-0")
        for i in range(10):
            producer.publish(make_group(f"a{i}", seed=i))
        trained: Counter = Counter()
        got = learner.read(max_groups=4, block_ms=100)
        trained.update(r.group.group_id for r in got)
        learner.ack(got[:2])                 # two acked, two in flight when the server dies
        in_flight = got[2:]

        server.kill()                        # SIGKILL: only what the AOF holds survives
        assert not server.running
        # Bring it back on the same port and directory a second later, while a producer is publishing.
        restarter = threading.Timer(1.0, server.start)
        restarter.start()
        t0 = time.monotonic()
        producer.publish(make_group("during-outage"))        # retries with backoff until the server is back
        assert time.monotonic() - t0 >= 0.5
        restarter.join()
        assert server.port == port and server.running
        for i in range(3):
            producer.publish(make_group(f"b{i}", seed=100 + i))

        learner.ack(in_flight)               # their step committed before the crash: ack after the restart

        # A second crash, this time while the learner is reading: the read rides out the outage too.
        server.kill()
        restarter = threading.Timer(1.0, server.start)
        restarter.start()
        # (the learner's read policy at version 1, the newest of make_group's steps)
        got = groups_to_train(learner, learner.read(max_groups=2, block_ms=100), trained_ids=set(trained),
                    newest_version=1, max_policy_lag=cfg.max_policy_lag)
        restarter.join()
        assert len(got) == 2
        trained.update(r.group.group_id for r in got)
        learner.ack(got)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            # (a publish retried in the outage may have landed twice: the learner's read policy skips the copy)
            got = groups_to_train(learner, learner.read(max_groups=4, block_ms=100), trained_ids=set(trained),
                        newest_version=1, max_policy_lag=cfg.max_policy_lag)
            if not got and learner.depth() == 0:
                break
            trained.update(r.group.group_id for r in got)
            learner.ack(got)
        expected = [f"a{i}" for i in range(10)] + ["during-outage"] + [f"b{i}" for i in range(3)]
        assert trained == Counter({gid: 1 for gid in expected})
        assert learner.depth() == 0 and learner.pending() == 0
        assert learner.stats["group_recreated"] == 0
    finally:
        server.stop()


@pytest.mark.fault
def test_a_runs_own_redis_user_outlives_a_crash_and_a_restart(tmp_path):
    """A run's clients log in as the run's own user (made at run time): a crashed and restarted server still has
    it, with its rules (the default user stays off, other keys stay refused), and the stream goes on: on the
    embedded server (SIGKILL, same port and directory) and on `gigpo redis`'s (shut down, served again)."""
    cfg = StreamConfig(stream="restart:user", run_id="r1", reclaim_idle_s=60)
    server = EmbeddedRedis(data_dir=str(tmp_path / "embedded"), aof=True, appendfsync="always").start()
    try:
        url = server.add_run_user(cfg)
        producer = TrajectoryStream(url, cfg, consumer_name="producer")
        learner = TrajectoryStream(url, cfg, consumer_name="learner-0")
        producer.publish(make_group("before"))
        server.kill()
        server.start()
        producer.publish(make_group("after"))        # would be refused (WRONGPASS) had the user been lost
        got = learner.read(max_groups=4, block_ms=100)
        assert sorted(r.group.group_id for r in got) == ["after", "before"]
        learner.ack(got)
        with pytest.raises(redis.AuthenticationError):
            connect(server.url, retries=0).ping()                   # the default user is still off
        with pytest.raises(redis.exceptions.NoPermissionError):
            connect(url, retries=0).set("another-run:key", b"x")    # still only its own keys
    finally:
        server.stop()

    # `gigpo redis`: the driver makes its run's user with the admin password (redis_for, _run_user_for's way).
    data, port = tmp_path / "gigpo-redis", free_port()
    assert serve_detached(port, str(data), str(tmp_path / "password")) == "started"
    admin_url = f"redis://gigpo-admin:{(data / 'admin-password').read_text().strip()}@127.0.0.1:{port}/0"
    admin = connect(admin_url)
    try:
        url = add_run_user(admin, admin_url, cfg)
        admin.close()
        TrajectoryStream(url, cfg, consumer_name="producer").publish(make_group("before"))
        connect(admin_url, retries=0).shutdown(nosave=False)       # (no retries: the lost connection is the point)
        assert serve_detached(port, str(data), str(tmp_path / "password")) == "started"
        TrajectoryStream(url, cfg, consumer_name="producer").publish(make_group("after"))
        got = TrajectoryStream(url, cfg, consumer_name="learner-0").read(max_groups=4, block_ms=100)
        assert sorted(r.group.group_id for r in got) == ["after", "before"]
    finally:
        with contextlib.suppress(redis.ConnectionError):
            connect(admin_url, retries=0).shutdown(nosave=True)


@pytest.mark.fault
def test_redis_restart_without_persistence_recreates_the_consumer_group(tmp_path):
    cfg = StreamConfig(stream="restart:mem", reclaim_idle_s=60)
    server = EmbeddedRedis(data_dir=str(tmp_path), aof=False).start()
    try:
        producer = TrajectoryStream(server.url, cfg, consumer_name="producer")
        learner = TrajectoryStream(server.url, cfg, consumer_name="learner-0")
        producer.publish(make_group("lost"))
        held = learner.read(max_groups=4, block_ms=100)
        assert [r.group.group_id for r in held] == ["lost"]
        server.stop()
        server.start()                       # empty: stream and consumer group are gone
        producer.publish(make_group("after"))
        got = learner.read(max_groups=4, block_ms=100)
        assert [r.group.group_id for r in got] == ["after"]
        assert learner.stats["group_recreated"] == 1
        learner.ack(held + got)              # acking what died with the old server is harmless
        assert learner.depth() == 0
    finally:
        server.stop()
