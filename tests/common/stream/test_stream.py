"""The trajectory stream against a real redis-server (started by EmbeddedRedis): delivery, acks, dead letters,
backpressure and a consumer killed (SIGKILL) before its ack; and the learner's read policy (duplicates,
staleness, unpublished versions) on what the Redis and the in-memory sources hand out."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from common.config import StreamConfig
from common.stream.codec import SCHEMA_VERSION, encode_group
from common.stream.interface import InMemoryTrajectories
from common.stream.redis_client import connect, password_file_for
from common.stream.redis_server import redis_for
from common.stream.redis_stream import TrajectoryStream
from learner.read_policy import groups_to_train
from tests.support.stream_factory import assert_groups_equal, make_group

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[3]

REPO = Path(__file__).resolve().parents[3]
NO_RETRY_S = 1.0         # far below what connect()'s retries would take (see where it is used)


@pytest.fixture
def cfg():
    # A fresh stream key per test: tests share one server (conftest's redis_server) but never each other's data.
    return StreamConfig(stream=f"test:{uuid.uuid4().hex[:8]}", max_stream_groups=64, max_policy_lag=4,
                        reclaim_idle_s=0.3)


def to_train(source, max_groups: int = 10, block_ms: int = 100, policy_version: int = 1,
             trained: set | frozenset = frozenset(), held: set | frozenset = frozenset()) -> list:
    """A read of `source` as a learner at `policy_version` takes it (learner.read_policy; max_policy_lag 4).
    The default version is the newest of make_group's steps (they span versions 0 and 1)."""
    return groups_to_train(source, source.read(max_groups, block_ms), trained_ids=trained, held_ids=held,
                 newest_version=policy_version, max_policy_lag=4)


def drain(stream: TrajectoryStream, trained: set | None = None, timeout_s: float = 10.0) -> list[str]:
    """Read + ack until the stream is empty (or `timeout_s` passed); returns the group ids trained, in order."""
    trained = set() if trained is None else trained
    order = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = to_train(stream, max_groups=8, block_ms=50, trained=trained)
        if not got and stream.depth() == 0:
            break
        for r in got:
            order.append(r.group.group_id)
            trained.add(r.group.group_id)
        stream.ack(got)
    return order


def test_embedded_server_url_password_and_connect(redis_server):
    assert redis_server.url.startswith("redis://:") and "@127.0.0.1:" in redis_server.url
    r = connect(redis_server.url)
    assert r.ping()
    import redis
    t0 = time.monotonic()
    with pytest.raises(redis.AuthenticationError):   # a wrong password fails at once, without retries
        connect(redis_server.url.replace(redis_server.password, "wrong")).ping()
    # connect()'s retries back off 0.05 s doubling to 2 s: its 12 would take ~17 s, even 4 take 0.75 s;
    # one refused login is one round trip on loopback (milliseconds).
    assert time.monotonic() - t0 < NO_RETRY_S
    url, started = redis_for(StreamConfig(redis_url=redis_server.url))
    assert (url, started) == (redis_server.url, None)


def test_redis_for_starts_a_server_when_no_url(tmp_path):
    url, srv = redis_for(StreamConfig(redis_url="", embedded_dir=str(tmp_path)))
    try:
        assert srv is not None and srv.running
        r = connect(srv.admin_url)
        assert r.config_get("appendonly")["appendonly"] == "yes"
        assert r.config_get("appendfsync")["appendfsync"] == "always"     # as test_stream_restart.py
        assert r.config_get("bind")["bind"] == "127.0.0.1"
    finally:
        srv.stop()
    assert not srv.running


def test_publish_read_ack_round_trip(redis_server, cfg):
    stream = TrajectoryStream(redis_server.url, cfg)
    groups = [make_group(f"g{i}", version=3, seed=i) for i in range(5)]
    ids = [stream.publish(g) for g in groups]
    assert len(set(ids)) == 5 and stream.depth() == 5
    got = stream.read(max_groups=3, block_ms=100)
    assert [r.entry_id for r in got] == ids[:3]
    for r, g in zip(got, groups):
        assert_groups_equal(g, r.group)
    assert stream.depth() == 5 and stream.pending() == 3     # read but unacked: still held
    stream.ack(got)
    assert stream.depth() == 2 and stream.pending() == 0     # acked entries are deleted
    rest = stream.read(max_groups=10, block_ms=100)
    assert [r.group.group_id for r in rest] == ["g3", "g4"]
    stream.ack(rest)
    assert stream.depth() == 0
    assert stream.stats["published"] == 5 and stream.stats["consumed"] == 5 and stream.stats["acked"] == 5


def test_read_blocks_until_a_group_arrives(redis_server, cfg):
    consumer = TrajectoryStream(redis_server.url, cfg)
    producer = TrajectoryStream(redis_server.url, cfg, consumer_name="producer")
    t0 = time.monotonic()
    assert consumer.read(4, block_ms=200) == []
    assert time.monotonic() - t0 >= 0.15
    timer = threading.Timer(0.2, lambda: producer.publish(make_group("late")))
    timer.start()
    got = consumer.read(4, block_ms=5000)
    timer.join()
    assert [r.group.group_id for r in got] == ["late"]


def test_publish_refuses_bad_groups(redis_server, cfg):
    stream = TrajectoryStream(redis_server.url, cfg)
    with pytest.raises(ValueError, match="no steps"):
        stream.publish(make_group("empty", num_steps=0))
    group = make_group("miscounted")
    group.trajectories[0].num_steps += 1
    with pytest.raises(ValueError, match="its trajectories have 7 steps, its rows 6"):
        stream.publish(group)
    assert stream.depth() == 0


@pytest.fixture(params=["redis", "memory"])
def source(request, redis_server, cfg):
    """The trajectory boundary's two implementations (common.transport): the learner's read policy applies
    to what either hands out."""
    if request.param == "redis":
        return TrajectoryStream(redis_server.url, cfg)
    return InMemoryTrajectories()


def test_trained_and_duplicate_groups_are_skipped_and_acked(source):
    stream = source
    for gid in ["a", "b", "b", "c", "a"]:          # a retried publish duplicates an entry
        stream.publish(make_group(gid))
    got = to_train(stream, trained={"c"})
    assert sorted(r.group.group_id for r in got) == ["a", "b"]
    assert stream.stats["duplicates_skipped"] == 3
    stream.ack(got)
    assert stream.depth() == 0
    if isinstance(stream, TrajectoryStream):
        assert stream.pending() == 0


def test_groups_in_flight_are_not_handed_out_twice(source):
    stream = source
    stream.publish(make_group("x"))
    first = to_train(stream)
    stream.publish(make_group("x"))                 # the same group again while "x" is being trained
    assert to_train(stream, held={"x"}) == []
    assert stream.stats["duplicates_skipped"] == 1
    stream.ack(first)
    assert stream.depth() == 0


@pytest.mark.fault
def test_malformed_entries_go_to_dead_letter_and_consumer_keeps_going(redis_server, cfg):
    stream = TrajectoryStream(redis_server.url, cfg)
    r = connect(redis_server.url)
    good = make_group("good")
    parts = encode_group(good)
    bad_header = b"\x92\x01\x02"                  # msgpack, but not a group's header
    r.xadd(cfg.stream, {"v": SCHEMA_VERSION, "g": "m1", "p0": 0, "p1": 0, "h": b"\xc1garbage"})
    r.xadd(cfg.stream, {"v": SCHEMA_VERSION + 1, "g": "m2", "p0": 0, "p1": 0, **parts})
    r.xadd(cfg.stream, {"hello": "world"})
    r.xadd(cfg.stream, {"v": SCHEMA_VERSION, "g": "m4", "p0": 0, "p1": 0, **parts, "h": bad_header})
    r.xadd(cfg.stream, {"v": SCHEMA_VERSION, "g": "not-good", "p0": 0, "p1": 0, **parts})
    r.xadd(cfg.stream, {"v": SCHEMA_VERSION, "g": "m6", "p0": "zero", "p1": 0, "h": b""})
    stream.publish(good)
    got = stream.read(max_groups=10, block_ms=100)
    assert [x.group.group_id for x in got] == ["good"]
    stream.ack(got)
    assert stream.stats["dead_lettered"] == 6
    assert stream.depth() == 0 and stream.pending() == 0
    dead = stream.dead_letters()
    reasons = [d[b"reason"].decode() for d in dead]
    assert "missing parts" in reasons[0]
    assert f"schema version b'{SCHEMA_VERSION + 1}'" in reasons[1]
    assert "missing schema version" in reasons[2]
    assert "header: expected a map" in reasons[3]
    assert "disagrees with payload" in reasons[4]
    assert "not integers" in reasons[5]
    assert dead[0][b"orig.h"] == b"\xc1garbage"            # the original bytes are kept
    assert dead[3][b"orig.h"] == bad_header and dead[2][b"orig.hello"] == b"world"
    assert dead[4][b"orig.data"] == bytes(parts["data"])


def test_stale_groups_are_dropped_acked_and_counted(source):
    stream = source                                        # max_policy_lag 4
    for gid, version in [("v0", 0), ("v5", 5), ("v6", 6), ("v9", 9)]:
        stream.publish(make_group(gid, version=version))   # steps span version and version + 1
    got = to_train(stream, policy_version=10)
    assert [r.group.group_id for r in got] == ["v6", "v9"]  # oldest version must be >= 10 - 4
    assert stream.stats["dropped_stale"] == 2
    stream.ack(got)
    assert stream.depth() == 0


def test_read_policy_drops_stale_skips_duplicates_and_refuses_unpublished_versions(source):
    """The learner's rules on either source, in one read: a group claiming a version the learner has not
    published is dead-lettered, a stale one and a duplicate are acked untrained and counted; a redelivered
    group (held by a learner that stopped) was judged when first read and is kept however old."""
    for gid, version in [("future", 7), ("stale", 0), ("fresh", 4), ("fresh", 4), ("old", 0)]:
        source.publish(make_group(gid, version=version))   # steps span version and version + 1
    *first, old = source.read(5)
    old.redelivered = True                                 # as a source hands out a dead learner's group
    got = groups_to_train(source, first + [old], trained_ids=set(), newest_version=5, max_policy_lag=4)
    assert [r.group.group_id for r in got] == ["fresh", "old"]
    assert {k: source.stats[k] for k in ("dead_lettered", "dropped_stale", "duplicates_skipped")} == \
        {"dead_lettered": 1, "dropped_stale": 1, "duplicates_skipped": 1}
    assert source.depth() == 2
    source.ack(got)
    assert source.depth() == 0 and source.stats["acked"] == 2


def refusals(stream: TrajectoryStream) -> threading.Semaphore:
    """Released each time `stream` is refused a slot in the full stream (it then waits and asks again)."""
    refused = threading.Semaphore(0)
    reserve = stream._reserve

    def counting_reserve(*args, **kwargs):
        granted = reserve(*args, **kwargs)
        if not granted:
            refused.release()
        return granted

    stream._reserve = counting_reserve
    return refused


def test_backpressure_blocks_the_producer_and_resumes(redis_server, cfg):
    cfg.max_stream_groups = 3
    consumer = TrajectoryStream(redis_server.url, cfg)
    producer = TrajectoryStream(redis_server.url, cfg, consumer_name="producer")
    for i in range(3):
        producer.publish(make_group(f"p{i}"))
    done = threading.Event()
    depths = []
    refused = refusals(producer)

    def publish_more():
        for i in range(3, 6):
            producer.publish(make_group(f"p{i}"), timeout_s=20)
        done.set()

    thread = threading.Thread(target=publish_more)
    thread.start()
    assert refused.acquire(timeout=10) and refused.acquire(timeout=10)    # refused, and refused again
    assert not done.is_set() and consumer.depth() == 3     # blocked, nothing added past the bound
    trained = []
    while len(trained) < 6:
        got = consumer.read(max_groups=1, block_ms=200)
        depths.append(consumer.depth())
        trained += [r.group.group_id for r in got]
        consumer.ack(got)
    thread.join(10)
    assert done.is_set()
    assert trained == [f"p{i}" for i in range(6)]
    assert max(depths) <= 3
    assert producer.stats["publish_waits"] >= 1


def test_backpressure_timeout_is_a_clear_error_and_adds_nothing(redis_server, cfg):
    cfg.max_stream_groups = 1
    stream = TrajectoryStream(redis_server.url, cfg)
    stream.publish(make_group("first"))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="still at its bound.*max_stream_groups = 1.*.second. was not published"):
        stream.publish(make_group("second"), timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3               # it waited its whole deadline for room
    assert stream.depth() == 1


def test_concurrent_producers_never_overshoot_the_bound(redis_server, cfg):
    cfg.max_stream_groups = 3
    consumer = TrajectoryStream(redis_server.url, cfg)
    producers = [TrajectoryStream(redis_server.url, cfg, consumer_name=f"p{k}") for k in range(4)]
    refused = [refusals(p) for p in producers]
    threads = [threading.Thread(target=lambda p=p, k=k: [p.publish(make_group(f"c{k}-{i}"), timeout_s=20)
                                                         for i in range(5)]) for k, p in enumerate(producers)]
    for t in threads:
        t.start()
    assert all(r.acquire(timeout=10) for r in refused)    # all four are now waiting on a full stream
    trained, depths = [], [consumer.depth()]
    while len(trained) < 20:
        got = consumer.read(max_groups=1, block_ms=200)
        trained += [r.group.group_id for r in got]
        consumer.ack(got)
        depths.append(consumer.depth())
    for t in threads:
        t.join(10)
    assert sorted(trained) == sorted(f"c{k}-{i}" for k in range(4) for i in range(5))
    assert depths[0] == 3 and max(depths) <= 3


@pytest.mark.fault
def test_a_producer_that_dies_after_admission_frees_its_slot(redis_server, cfg, monkeypatch):
    import common.stream.redis_stream as stream_module
    monkeypatch.setattr(stream_module, "_RESERVATION_TTL_S", 0.5)
    cfg.max_stream_groups = 1
    stream = TrajectoryStream(redis_server.url, cfg)
    # What a producer killed between taking a slot and appending its group leaves behind (never renewed):
    assert TrajectoryStream(redis_server.url, cfg, consumer_name="dead-producer").admit(timeout_s=0.1)
    t0 = time.monotonic()
    stream.publish(make_group("after-expiry"), timeout_s=5)     # (would raise TimeoutError past 5 s)
    # It waited for the dead reservation to expire (its TTL 0.5 s, less the moment spent reserving it).
    assert time.monotonic() - t0 >= 0.3 and stream.stats["publish_waits"] >= 1
    assert stream.depth() == 1 and stream.redis.zcard(stream.reserved_key) == 0


def test_an_admitted_group_is_published_at_once_on_a_full_stream(redis_server, cfg):
    # A producer takes its slot before playing; the group then never waits, also when the actor is being
    # removed (its last groups go in while the stream is full: scaling down loses nothing, waits for nothing).
    cfg.max_stream_groups = 2
    stream = TrajectoryStream(redis_server.url, cfg)
    slot = stream.admit(timeout_s=0.1)
    stream.publish(make_group("first"))
    with pytest.raises(TimeoutError, match="no group was started"):     # first + the admitted one: full
        stream.admit(timeout_s=0.1)
    stream.publish(make_group("admitted-before-it-was-played"), timeout_s=0.1, admitted=slot)
    assert stream.depth() == 2 and stream.redis.zcard(stream.reserved_key) == 0
    with pytest.raises(TimeoutError):                 # ordinary publishes still respect the bound
        stream.publish(make_group("third"), timeout_s=0.1)
    released = TrajectoryStream(redis_server.url, cfg, consumer_name="p2")
    stream.ack(stream.read(max_groups=1))
    slot = released.admit(timeout_s=1)
    released.release(slot)                            # a discarded group gives its slot back
    assert released.redis.zcard(released.reserved_key) == 0


def test_the_lag_bound_counts_untrained_groups_and_the_stream_bound_counts_all(redis_server, cfg):
    # policy_lag_bound: groups admitted and not yet trained; stream.max_stream_groups: all Redis holds, groups
    # trained and awaiting their checkpoint's ack (learner.ack_on_checkpoint) included. Counting those against
    # the lag bound would force a checkpoint every max_policy_lag + 1 updates.
    cfg.max_stream_groups = 3
    stream = TrajectoryStream(redis_server.url, cfg, lag_bound=2)
    for name in ("a", "b"):
        stream.publish(make_group(name), admitted=stream.admit(timeout_s=0.1))
    with pytest.raises(TimeoutError, match="2 admitted and not yet trained"):
        stream.admit(timeout_s=0.1)
    learner = TrajectoryStream(redis_server.url, cfg, consumer_name="learner-0")
    got = learner.read(max_groups=2)
    learner.trained(got)                              # trained, acked with the next checkpoint
    slot = stream.admit(timeout_s=0.1)                # untrained: 0 + this slot
    with pytest.raises(TimeoutError, match="max_stream_groups = 3"):     # 2 entries + 1 slot fill Redis's share
        stream.admit(timeout_s=0.1)
    learner.ack(got)                                  # the checkpoint: acked, no longer marked trained
    assert stream.redis.scard(stream.trained_key) == 0 and stream.depth() == 0
    stream.release(slot)
    assert len({stream.admit(timeout_s=0.1), stream.admit(timeout_s=0.1)}) == 2
    with pytest.raises(TimeoutError):
        stream.admit(timeout_s=0.1)



def test_groups_a_dead_learner_marked_trained_count_as_untrained_when_handed_out_again(redis_server, cfg):
    """A learner marks its update's groups trained (their ack waits for its checkpoint) and dies before that
    checkpoint: its next life (same consumer name) or another consumer gets them again, to train anew. From then
    they are untrained again for the producers' lag bound, or producers would start more than it allows."""
    stream = TrajectoryStream(redis_server.url, cfg, lag_bound=2)
    for name in ("a", "b"):
        stream.publish(make_group(name), admitted=stream.admit(timeout_s=0.1))
    dead = TrajectoryStream(redis_server.url, cfg, consumer_name="learner-0")
    dead.trained(dead.read(max_groups=2))
    assert stream.redis.scard(stream.trained_key) == 2
    stream.release(stream.admit(timeout_s=0.1))       # room: 0 untrained
    again = TrajectoryStream(redis_server.url, cfg, consumer_name="learner-0")      # the next life
    got = again.read(max_groups=2)
    assert sorted(r.group.group_id for r in got) == ["a", "b"] and all(r.redelivered for r in got)
    assert stream.redis.scard(stream.trained_key) == 0
    with pytest.raises(TimeoutError, match="2 admitted and not yet trained"):
        stream.admit(timeout_s=0.1)


def test_untrained_counts_what_the_learner_has_still_to_train_and_a_new_learner_forgets_old_marks(source):
    """What sync mode plays (a batch less what the stream still holds untrained) and what a starting learner
    clears: a dead learner's marks, whose groups come back to be trained again."""
    for name in ("a", "b", "c"):
        source.publish(make_group(name))
    assert source.untrained() == 3
    got = source.read(max_groups=2)
    assert source.untrained() == 3                    # read is not trained
    source.trained(got)
    assert source.untrained() == 1 and source.depth() == 3
    source.forget_trained()                           # a new learner: the dead one's update is to be redone
    assert source.untrained() == 3
    source.trained(got)
    source.ack(got)                                   # the checkpoint: acked, no longer marked
    assert source.untrained() == 1 and source.depth() == 1


def test_a_renewed_slot_outlives_its_ttl_and_a_lapsed_one_frees_it(redis_server, cfg, monkeypatch):
    import common.stream.redis_stream as stream_module
    ttl = 2.0       # renewed every ~0.2 s (one refused admit): a stall of 1.8 s would fail it, not a slow machine
    monkeypatch.setattr(stream_module, "_RESERVATION_TTL_S", ttl)
    cfg.max_stream_groups = 1
    stream = TrajectoryStream(redis_server.url, cfg)
    slot = stream.admit(timeout_s=0.1)
    deadline = time.monotonic() + 1.5 * ttl
    while time.monotonic() < deadline:
        stream.renew([slot])
        with pytest.raises(TimeoutError):
            stream.admit(timeout_s=0.2)
    # No longer renewed (its producer died): the slot lapses within its TTL and another producer gets it.
    assert stream.admit(timeout_s=5 * ttl)


def test_restarted_consumer_gets_its_own_pending_groups_back(redis_server, cfg):
    cfg.reclaim_idle_s = 60                          # no reclaim: this is the same consumer name coming back
    first = TrajectoryStream(redis_server.url, cfg, consumer_name="learner-0")
    for i in range(4):
        first.publish(make_group(f"r{i}"))
    got = first.read(max_groups=3, block_ms=100)
    assert len(got) == 3
    first.close()                                    # "crashed" after committing r0 but before any ack
    second = TrajectoryStream(redis_server.url, cfg, consumer_name="learner-0")
    trained = {"r0"}
    order = drain(second, trained=trained)
    assert sorted(order) == ["r1", "r2", "r3"]
    assert second.stats["recovered_own"] == 3 and second.stats["duplicates_skipped"] == 1
    assert second.depth() == 0 and second.pending() == 0


_DOOMED_CONSUMER = """
import sys, time
from common.config import StreamConfig
from common.stream.redis_stream import TrajectoryStream
cfg = StreamConfig(stream=sys.argv[2], reclaim_idle_s=0.3)
s = TrajectoryStream(sys.argv[1], cfg, consumer_name="doomed")
got = s.read(max_groups=3, block_ms=2000)
print(" ".join(r.group.group_id for r in got), flush=True)
time.sleep(120)   # "training": killed with SIGKILL before it acks
"""


@pytest.mark.fault
def test_consumer_killed_before_ack_groups_trained_exactly_once(redis_server, cfg):
    producer = TrajectoryStream(redis_server.url, cfg, consumer_name="producer")
    for i in range(6):
        producer.publish(make_group(f"k{i}"))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_CONSUMER, redis_server.url, cfg.stream],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        taken = proc.stdout.readline().split()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    assert taken == ["k0", "k1", "k2"]
    survivor = TrajectoryStream(redis_server.url, cfg, consumer_name="learner-1")
    trained = Counter()
    deadline = time.monotonic() + 10
    while sum(trained.values()) < 6 and time.monotonic() < deadline:
        got = to_train(survivor, max_groups=4, trained=set(trained))
        trained.update(r.group.group_id for r in got)
        survivor.ack(got)
    assert trained == Counter({f"k{i}": 1 for i in range(6)})
    assert survivor.stats["reclaimed"] == 3
    assert survivor.depth() == 0 and survivor.pending() == 0


def test_live_consumer_keeps_its_groups_while_it_keeps_reading(redis_server, cfg):
    # Each loop below reads twice, waiting at most 100 ms each: `a` is idle (in Redis' pending list) for at
    # most ~0.2 s between reads; 2 s is ten times that, room for a loaded machine's stalls.
    cfg.reclaim_idle_s = 2.0
    producer = TrajectoryStream(redis_server.url, cfg, consumer_name="producer")
    a = TrajectoryStream(redis_server.url, cfg, consumer_name="a")
    b = TrajectoryStream(redis_server.url, cfg, consumer_name="b")
    producer.publish(make_group("held"))
    held = a.read(1, 100)
    assert len(held) == 1
    # a trains for longer than reclaim_idle_s but keeps reading (each read waits up to 100 ms for a group)
    until = time.monotonic() + 2 * cfg.reclaim_idle_s
    while time.monotonic() < until:
        assert a.read(1, 100) == []
        assert b.read(1, 100) == []
    a.ack(held)
    assert b.stats["reclaimed"] == 0 and a.depth() == 0


def test_a_run_on_its_embedded_redis_has_a_user_of_its_own_that_reaches_its_keys_alone(tmp_path):
    """redis_for gives a run (it has an id) a user limited to its own keys and the stream's commands, and turns
    the default user off: a rollout node's credential cannot read, change or delete another run's keys (runs
    sharing a server are otherwise apart only by key names) nor anything of the server itself."""
    import redis
    run = StreamConfig(embedded_dir=str(tmp_path), run_id="run-a", max_policy_lag=0)
    url, server = redis_for(run)
    try:
        assert url.startswith("redis://gigpo-run-run-a:") and url != server.url
        admin = connect(server.admin_url)
        admin.xadd("gigpo:run-b:groups", {"g": "theirs"})           # another run's keys, on the same server
        admin.set("gigpo:run-b:status", "{}")
        stream = TrajectoryStream(url, run, lag_bound=2)            # the stream, its admission script, its marks
        stream.publish(make_group("ours"), admitted=stream.admit(timeout_s=1))
        got = stream.read(4, 100)
        stream.trained(got)
        assert [r.group.group_id for r in got] == ["ours"] and stream.untrained() == 0
        stream.ack(got)
        client = connect(url, retries=0)
        client.set("gigpo:run-a:status", "{}")                      # the control channel's keys
        client.rpush("gigpo:run-a:commands", "{}")
        assert client.lpop("gigpo:run-a:commands") == b"{}"
        for command in [("GET", "gigpo:run-b:status"), ("DEL", "gigpo:run-b:groups"), ("XLEN", "gigpo:run-b:groups"),
                        ("XADD", "gigpo:run-b:groups", "*", "g", "forged"), ("SET", "elsewhere", "1"),
                        ("CONFIG", "SET", "dir", str(tmp_path)), ("FLUSHALL",), ("KEYS", "*"), ("SHUTDOWN",)]:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        with pytest.raises(redis.AuthenticationError):               # the default user is off
            connect(server.url, retries=0).ping()
        assert admin.xlen("gigpo:run-b:groups") == 1 and admin.get("gigpo:run-b:status") == b"{}"
        assert Path(password_file_for(url)).read_text().strip() in url           # for `gigpo status` / `scale`
    finally:
        server.stop(cleanup=True)
    assert password_file_for(url) == ""


def test_a_driver_given_the_admin_url_of_a_shared_redis_hands_its_actors_a_user_of_the_run_alone(redis_server,
                                                                                                 tmp_path):
    """On a Redis runs share (`gigpo redis`, which keeps its admin user's password in <--dir>/admin-password),
    a driver given ADMIN_USER's URL makes the run a user of its own and hands out only that: a rollout node of
    one run cannot read or delete another's groups. The user and its password file go when the driver's
    process exits (a subprocess here: the clean-up runs at exit)."""
    import redis
    admin_file = tmp_path / "admin-password"
    admin_file.write_text(redis_server.admin_password + "\n")
    admin_file.chmod(0o600)
    admin_url = f"redis://gigpo-admin@127.0.0.1:{redis_server.port}/0"       # the password from the file
    script = f"""
import json, sys
from common.config import StreamConfig
from common.stream.redis_client import password_file_for
from common.stream.redis_server import redis_for
cfg = StreamConfig(redis_url={admin_url!r}, redis_password_file={str(admin_file)!r}, run_id="run-a")
url, server = redis_for(cfg)
print(json.dumps({{"url": url, "cfg_url": cfg.redis_url, "server": server is None,
                  "password_file": password_file_for(url)}}))
sys.stdout.flush()
sys.stdin.readline()                                 # the test looks around, then lets it exit
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        got = json.loads(proc.stdout.readline())
        url = got["url"]
        assert url.startswith("redis://gigpo-run-run-a:") and got["cfg_url"] == url and got["server"]
        assert redis_server.admin_password not in url
        password_file = Path(got["password_file"])
        assert password_file.read_text().strip() in url and password_file.stat().st_mode & 0o077 == 0
        admin = connect(redis_server.admin_url)
        admin.xadd("gigpo:run-b:groups", {"g": "theirs"})
        run = StreamConfig(run_id="run-a")
        stream = TrajectoryStream(url, run, lag_bound=2)
        stream.publish(make_group("ours"), admitted=stream.admit(timeout_s=1))
        stream.ack(stream.read(4, 100))
        client = connect(url, retries=0)
        for command in [("XRANGE", "gigpo:run-b:groups", "-", "+"), ("DEL", "gigpo:run-b:groups"), ("FLUSHALL",)]:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        assert connect(redis_server.url, retries=0).ping()     # the shared default user is the operator's to keep
    finally:
        proc.communicate("\n", timeout=60)
    assert proc.returncode == 0
    assert not password_file.exists() and not password_file.parent.exists()
    assert b"gigpo-run-run-a" not in b" ".join(admin.execute_command("ACL", "USERS"))


def test_the_runs_password_reads_and_writes_groups_and_cannot_touch_the_server(redis_server, cfg, tmp_path):
    """Every rollout node holds the run's password: with it the stream works, while every command that reads or
    changes the server itself is refused (CONFIG SET dir + SAVE would write a file anywhere the server's user
    can; MODULE LOAD runs code). The owner's admin URL still may."""
    import redis
    stream = TrajectoryStream(redis_server.url, cfg)
    stream.publish(make_group("least-privilege"))
    got = stream.read(4, 100)
    assert [r.group.group_id for r in got] == ["least-privilege"]
    stream.ack(got)
    client = connect(redis_server.url, retries=0)
    refused = [("CONFIG", "SET", "dir", str(tmp_path)), ("CONFIG", "GET", "*"), ("SAVE",), ("BGSAVE",),
               ("MODULE", "LOAD", str(tmp_path / "x.so")), ("DEBUG", "SLEEP", "0"), ("SHUTDOWN", "NOSAVE"),
               ("FLUSHALL",), ("FLUSHDB",), ("KEYS", "*"), ("INFO",), ("ACL", "LIST"), ("CLIENT", "LIST"),
               ("MONITOR",), ("REPLICAOF", "127.0.0.1", "1"), ("SLOWLOG", "GET")]
    for command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    assert redis_server.running
    admin = connect(redis_server.admin_url)
    assert admin.config_get("dir")["dir"] == redis_server.data_dir and admin.dbsize() >= 0


def test_acl_user_url_works_and_wrong_permissions_fail_fast(redis_server, cfg):
    admin = connect(redis_server.admin_url)
    admin.execute_command("ACL", "SETUSER", "rollout", "on", ">s3cret", "~test:*", "+@all")
    admin.execute_command("ACL", "SETUSER", "nobody", "on", ">pw", "~other:*", "+@all")
    url = f"redis://rollout:s3cret@127.0.0.1:{redis_server.port}/0"
    stream = TrajectoryStream(url, cfg)
    stream.publish(make_group("acl"))
    got = stream.read(4, 100)
    stream.ack(got)
    assert [r.group.group_id for r in got] == ["acl"]
    import redis
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.NoPermissionError):
        TrajectoryStream(f"redis://nobody:pw@127.0.0.1:{redis_server.port}/0", cfg)
    assert time.monotonic() - t0 < NO_RETRY_S           # (see test_embedded_server_url_password_and_connect)


def test_entry_deleted_while_pending_is_cleaned_up(redis_server, cfg):
    stream = TrajectoryStream(redis_server.url, cfg, consumer_name="a")
    for gid in ("d0", "d1"):
        stream.publish(make_group(gid))
    held = stream.read(2, 100)
    stream.close()                                    # consumer "a" dies holding both
    connect(redis_server.url).xdel(cfg.stream, held[0].entry_id)   # someone deletes one of them
    other = TrajectoryStream(redis_server.url, cfg, consumer_name="b")
    trained = drain(other)                            # reclaims d1 once idle for reclaim_idle_s
    assert trained == ["d1"]
    deadline = time.monotonic() + 5                   # the vanished entry's pending slot is released too
    while other.pending() and time.monotonic() < deadline:   # (by a later pending-list scan)
        other.read(2, 50)
    assert other.pending() == 0 and other.depth() == 0


def test_connect_understands_tls_urls_and_refuses_others():
    # No TLS server here: check that rediss:// selects the TLS connection class (connections are lazy).
    client = connect("rediss://learner:pw@redis.example:6380/2")
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["port"], kwargs["db"]) == ("learner", "pw", 6380, 2)
    with pytest.raises(ValueError, match="must start with redis://"):
        connect("http://localhost:6379")
