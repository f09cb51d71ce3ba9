"""Faults at the stream, against a real redis-server: runs sharing one Redis, poison pills, groups that claim
an unpublished version, a bounded dead-letter stream, and a Redis out of memory (maxmemory set on the real
server). Each is `-m fault`."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from common.config import StreamConfig
from common.stream.redis_client import connect
from common.stream.redis_stream import TrajectoryStream, stream_key
from learner.read_policy import groups_to_train
from tests.support.stream_factory import make_group

pytestmark = [pytest.mark.timeout(90)]


def _cfg(**kw) -> StreamConfig:
    kw.setdefault("run_id", uuid.uuid4().hex[:8])
    return StreamConfig(max_stream_groups=64, max_policy_lag=4, reclaim_idle_s=0.3, **kw)


def _reasons(stream: TrajectoryStream) -> list[str]:
    return [d[b"reason"].decode() for d in stream.dead_letters()]


@pytest.mark.fault
def test_two_runs_on_one_redis_do_not_see_each_others_groups(redis_url):
    run_a, run_b = _cfg(), _cfg()
    assert stream_key(run_a) != stream_key(run_b) and run_a.run_id in stream_key(run_a)
    a_out, b_out = TrajectoryStream(redis_url, run_a, "producer"), TrajectoryStream(redis_url, run_b, "producer")
    a_in, b_in = TrajectoryStream(redis_url, run_a), TrajectoryStream(redis_url, run_b)
    assert a_in.consumer_group != b_in.consumer_group
    for i in range(3):
        a_out.publish(make_group(f"a{i}"))
        b_out.publish(make_group(f"b{i}"))
    got_a = a_in.read(8, 100)
    got_b = b_in.read(8, 100)
    assert sorted(r.group.group_id for r in got_a) == ["a0", "a1", "a2"]
    assert sorted(r.group.group_id for r in got_b) == ["b0", "b1", "b2"]

    # Two runs told to share one stream key (stream.stream set by hand): the run id in every record keeps
    # them apart; the other run's record is dead-lettered with the reason, not trained.
    shared = f"test:{uuid.uuid4().hex[:8]}"
    producer_a = TrajectoryStream(redis_url, _cfg(stream=shared, run_id=run_a.run_id), "producer")
    learner_b = TrajectoryStream(redis_url, _cfg(stream=shared, run_id=run_b.run_id))
    producer_a.publish(make_group("a-shared"))
    assert learner_b.read(8, 100) == []
    assert any(f"run {run_a.run_id!r}" in r for r in _reasons(learner_b))


@pytest.mark.fault
def test_poison_pill_is_dead_lettered_after_max_deliveries_and_good_groups_train(redis_url):
    """A learner that crashes on a group (it never acks it) gets it back after every restart (same consumer
    name: its pending entries). After max_deliveries it is dead-lettered with the reason, and the groups
    published behind it are read."""
    cfg = _cfg(max_deliveries=3)
    TrajectoryStream(redis_url, cfg, "producer").publish(make_group("poison"))
    deliveries = 0
    for _ in range(cfg.max_deliveries):
        learner = TrajectoryStream(redis_url, cfg, consumer_name="learner-0")   # a restarted learner
        got = learner.read(1, 100)
        assert [r.group.group_id for r in got] == ["poison"]
        deliveries += 1
        learner.close()                           # "crashed": no ack
    TrajectoryStream(redis_url, cfg, "producer").publish(make_group("good"))
    learner = TrajectoryStream(redis_url, cfg, consumer_name="learner-0")
    got = learner.read(2, 100)
    assert [r.group.group_id for r in got] == ["good"] and deliveries == cfg.max_deliveries
    [reason] = _reasons(learner)
    assert f"delivered {cfg.max_deliveries + 1} times" in reason
    learner.ack(got)
    assert learner.depth() == 0


@pytest.mark.fault
def test_learner_dead_letters_a_group_it_cannot_train_and_unpublished_versions(redis_url):
    """The learner's read policy dead-letters a group claiming a version it has not published; the learner
    dead-letters one it cannot train on. Both keep the original group."""
    cfg = _cfg()
    producer, learner = TrajectoryStream(redis_url, cfg, "producer"), TrajectoryStream(redis_url, cfg)
    producer.publish(make_group("from-the-future", version=7))    # p1 = 8: never published by this learner
    producer.publish(make_group("bad-tokens"))
    producer.publish(make_group("fine"))
    got = groups_to_train(learner, learner.read(8, 100), trained_ids=set(), newest_version=3, max_policy_lag=4)
    assert sorted(r.group.group_id for r in got) == ["bad-tokens", "fine"]
    learner.dead_letter([r for r in got if r.group.group_id == "bad-tokens"], "token id 50000 >= vocabulary 1024")
    learner.ack([r for r in got if r.group.group_id == "fine"])
    assert learner.depth() == 0 and learner.pending() == 0
    dead = learner.dead_letters()
    reasons = [d[b"reason"].decode() for d in dead]
    assert any("policy version 8, which this learner has not published (newest: 3)" in r for r in reasons)
    assert "token id 50000 >= vocabulary 1024" in reasons
    assert all(d[b"orig.data"] for d in dead)     # the original group is kept for a post-mortem


@pytest.mark.fault
def test_dead_letter_stream_is_bounded(redis_url):
    cfg = _cfg(dead_letter_max=5)
    r = connect(redis_url)
    key = stream_key(cfg)
    learner = TrajectoryStream(redis_url, cfg)
    for i in range(12):
        r.xadd(key, {"v": "999", "g": f"junk{i}"})        # a schema this reader does not understand
    assert learner.read(16, 100) == []
    assert r.xlen(learner.dead_key) == cfg.dead_letter_max
    assert learner.stats["dead_lettered"] == 12


@pytest.mark.fault
def test_producer_waits_out_a_full_redis_and_says_why(redis_server, redis_url):
    """maxmemory on the real server, noeviction: XADD answers OOM. The producer retries until its deadline,
    then raises an error that says what happened; once there is room again, the same group goes through."""
    r = connect(redis_server.admin_url)
    before = r.config_get("maxmemory")["maxmemory"], r.config_get("maxmemory-policy")["maxmemory-policy"]
    cfg = _cfg()
    producer = TrajectoryStream(redis_url, cfg, "producer")
    group = make_group("big", num_traj=8, num_steps=20, prompt_len=500)
    try:
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", str(used + 64 * 1024))
        with pytest.raises(RuntimeError, match="out of memory"):
            producer.publish(group, timeout_s=2.5)
        assert producer.stats["redis_oom_waits"] >= 1

        # Room comes back while the producer waits: the group is published, once.
        def make_room() -> None:
            deadline = time.monotonic() + 30
            while producer.stats["redis_oom_waits"] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            r.config_set("maxmemory", "0")

        helper = threading.Thread(target=make_room)
        helper.start()
        producer.publish(group, timeout_s=30)
        helper.join()
        assert r.xlen(stream_key(cfg)) == 1
    finally:
        r.config_set("maxmemory", before[0])
        r.config_set("maxmemory-policy", before[1])


def test_embedded_redis_memory_is_bounded(tmp_path):
    from common.stream.redis_server import redis_for
    url, server = redis_for(StreamConfig(embedded_maxmemory_mb=64, embedded_dir=str(tmp_path / "redis")))
    try:
        r = connect(server.admin_url)
        assert int(r.config_get("maxmemory")["maxmemory"]) == 64 * 1024 * 1024
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    finally:
        server.stop(cleanup=True)
