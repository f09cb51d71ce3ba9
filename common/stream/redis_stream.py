"""The trajectory stream: rollout actors publish complete episode groups, the learner consumes them.

One Redis stream (`cfg.stream`), one entry per `EpisodeGroup`, read by the learner through a consumer group:
at-least-once on the wire, effectively once for training. The learner `ack()`s a group only once the
optimizer step that used it is committed, so a learner that dies mid-step leaves its groups pending: its next
incarnation (same consumer name) re-reads them, or another consumer reclaims them (XCLAIM) once idle for
`cfg.reclaim_idle_s` (`Received.redelivered`). Skipping groups already trained on, or sampled too many
policy versions ago, is the learner's read policy (`learner.read_policy`), not the stream's.

Acked entries are deleted (XACK + XDEL in one transaction) and nothing unacked is trimmed, so the stream
length is exactly "groups not yet trained" plus the learner's trained-but-unacked ones (learner.ack_on_checkpoint
acks with the next checkpoint; it marks them `trained()`, in `<stream>:trained`, until then). Admission is one
rule over two bounds (after SkyRL's staleness manager): a producer takes a slot (`admit()`, atomically, a Lua
script over the stream, `<stream>:reserved` and `<stream>:trained`) before it starts playing a group, only
while what Redis holds or will hold (entries + slots) is under `stream.max_stream_groups` and the groups
admitted and not yet trained (those minus the trained ones) are under the stream's `lag_bound`
(`common.staleness.policy_lag_bound`), and otherwise waits; it keeps the slot alive while it plays (`renew`),
then `publish(group, admitted=slot)` appends at once, or `release(slot)` gives it back.

Entry fields: v (schema version), r (run id), g (group id), p0 / p1 (oldest / newest policy version), then
the group's parts (`common.stream.codec.encode_group`). Version and run sit beside the group so that other
schemas' and other runs' records (runs sharing a `stream.stream` key) are dead-lettered without decoding;
the reader checks that id and versions agree with the group.

Poison pills must not stop training: entries that are not valid groups of this schema and run, groups the
learner refuses (`learner.read_policy`, `learner.batching.check_group`) and groups handed out more than
`stream.max_deliveries` times (a learner crashed on it each time) go, with the reason and the original
bytes, to the dead-letter stream `<stream>:dead`, which keeps the newest `stream.dead_letter_max` entries.
"""
from __future__ import annotations

import time
import uuid

import redis
from redis.exceptions import OutOfMemoryError, ResponseError

from common.config import StreamConfig
from common.stream.codec import HEADER, MAX_PAYLOAD_BYTES, SCHEMA_VERSION, CodecError, decode_group, encode_group
from common.stream.interface import Received
from common.stream.records import EpisodeGroup
from common.stream.redis_client import connect

# Admission with exact bounds and without sending the payload through Lua (a script argument of ~1 MB
# costs Redis two extra copies, ~0.4 ms per group on one core): a producer first reserves a slot, atomically,
# while entries + slots < ARGV[1] (what Redis holds) and entries + slots - trained < ARGV[4] (untrained: the
# policy lag; 0: no such bound), then plays, then appends the group and releases its slot in one round trip.
# A slot expires after ARGV[3] seconds unless renewed: a producer that dies frees its slots.
_RESERVE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local held = redis.call('XLEN', KEYS[1]) + redis.call('ZCARD', KEYS[2])
if held >= tonumber(ARGV[1]) then return 0 end
local lag_bound = tonumber(ARGV[4])
if lag_bound > 0 and held - redis.call('SCARD', KEYS[3]) >= lag_bound then return 0 end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[2])
return 1
"""

# A reservation lives this long unless renewed (a playing producer renews every RENEW_EVERY_S): a killed
# producer's slots come back within this time.
_RESERVATION_TTL_S = 30
RENEW_EVERY_S = 5

# (consumed: handed to the learner; acked, duplicates_skipped, dropped_stale: acked as the learner says, see ack)
_STAT_NAMES = ("published", "publish_waits", "consumed", "acked", "duplicates_skipped", "dropped_stale",
               "dead_lettered", "reclaimed", "recovered_own", "group_recreated", "redis_oom_waits")

# While Redis answers OOM (maxmemory reached) a producer waits and retries, up to its publish deadline.
_OOM_RETRY_S = 1.0


def stream_key(cfg: StreamConfig) -> str:
    """The Redis key of a run's stream: `stream.stream`, or one named after the run id."""
    if cfg.stream:
        return cfg.stream
    return f"gigpo:{cfg.run_id}:groups" if cfg.run_id else "gigpo:groups"


class TrajectoryStream:
    """Producer and consumer side of the episode-group stream (one class: both need the same key layout).
    Producers call `publish()`; the learner calls `read()`, trains, then `ack()`. Consumer names must be unique
    among live consumers; a restarted learner reuses its name to get its own pending groups back at once."""

    def __init__(self, url: str, cfg: StreamConfig, consumer_name: str = "learner-0",
                 consumer_group: str | None = None, client: redis.Redis | None = None, lag_bound: int = 0,
                 max_group_bytes: int = MAX_PAYLOAD_BYTES):
        """lag_bound: a producer's admission waits while this many groups are admitted and not yet trained
        (`common.staleness.policy_lag_bound`; 0: only stream.max_stream_groups bounds them). max_group_bytes:
        a bigger entry is dead-lettered as it is read, undecoded (the learner's `learner.batching.GroupLimits`)."""
        self.max_group_bytes = min(max_group_bytes, MAX_PAYLOAD_BYTES)
        if cfg.max_stream_groups < 1:
            raise ValueError(f"stream.max_stream_groups must be >= 1, got {cfg.max_stream_groups}")
        if lag_bound < 0:
            raise ValueError(f"the stream's lag bound must be >= 0, got {lag_bound}")
        self.lag_bound = lag_bound
        self.cfg = cfg
        self.run_id = cfg.run_id
        self.key = stream_key(cfg)
        self.dead_key = f"{self.key}:dead"
        if consumer_group is None:
            consumer_group = f"learner:{cfg.run_id}" if cfg.run_id else "learner"
        self.consumer_group = consumer_group
        self.consumer_name = consumer_name
        self.redis = client or connect(url)
        self.reserved_key = f"{self.key}:reserved"     # producers' slots: groups admitted, being played
        self.trained_key = f"{self.key}:trained"       # entry ids trained on, their ack awaiting a checkpoint
        self._reserve = self.redis.register_script(_RESERVE_LUA)
        self.stats: dict[str, int] = {name: 0 for name in _STAT_NAMES}
        self._inflight: set[str] = set()        # entry ids read but not yet acked
        self._next_scan = 0.0                   # monotonic time of the next pending-list scan (see read)
        # A blocking read must return before the socket times out: a timed-out XREADGROUP would be retried
        # while the server may already have handed entries to the abandoned call.
        socket_timeout = self.redis.connection_pool.connection_kwargs.get("socket_timeout")
        self._max_block_ms = int(socket_timeout * 1000 * 0.8) if socket_timeout else 2**31
        self._ensure_group()

    # -- Producer side

    def admit(self, timeout_s: float | None = None, group_id: str = "") -> str:
        """A slot for one group about to be played: waits while the stream holds (or its producers' slots will
        add) stream.max_stream_groups groups, or `lag_bound` groups are admitted and not yet trained; raises
        TimeoutError after `timeout_s` (default `cfg.publish_timeout_s`). Renew it while playing (`renew`),
        then hand it to `publish`, or `release` it. group_id: names the group in errors."""
        timeout_s = self.cfg.publish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pause = 0.005
        slot = uuid.uuid4().hex
        def reserve():
            return self._reserve(keys=[self.key, self.reserved_key, self.trained_key],
                                 args=[self.cfg.max_stream_groups, slot, _RESERVATION_TTL_S, self.lag_bound])

        waited = False
        while not self._unless_full(reserve, deadline, group_id or "(next)", timeout_s):
            waited = True
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"stream {self.key!r} is still at its bound after {timeout_s:.1f} s (stream.max_stream_groups "
                    f"= {self.cfg.max_stream_groups} groups held, or {self.lag_bound or 'no'} admitted and not yet "
                    f"trained: common.staleness.policy_lag_bound); is the learner consuming? "
                    + (f"group {group_id!r} was not published" if group_id else "no group was started"))
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.1)
        self.stats["publish_waits"] += int(waited)
        return slot

    def renew(self, slots: list[str]) -> None:
        """Keep these admitted slots alive (their groups are still being played)."""
        if slots:
            seconds, micros = self.redis.time()           # the server's clock, as the script's
            expiry = seconds + micros / 1e6 + _RESERVATION_TTL_S
            self.redis.zadd(self.reserved_key, {slot: expiry for slot in slots}, xx=True)

    def release(self, slot: str) -> None:
        """Give back an admitted slot whose group will not be published (discarded, or without steps)."""
        self.redis.zrem(self.reserved_key, slot)

    def publish(self, group: EpisodeGroup, timeout_s: float | None = None, admitted: str = "") -> str:
        """Append `group` (complete: all its trajectories ended) and return its entry id. admitted: the slot
        `admit()` gave for it (appended at once, the slot released); without one, admits it first (waits,
        raises TimeoutError after `timeout_s` as `admit` does). CodecError for an inconsistent group,
        ValueError for one without steps."""
        if group.num_rows == 0:
            raise ValueError(f"group {group.group_id!r} has no steps: nothing to publish")
        if not group.group_id:
            raise ValueError("group has an empty group_id")
        p0, p1 = group.policy_versions
        # The group's parts are views of its columns: the Redis client sends them without copying.
        fields = {"v": SCHEMA_VERSION, "r": self.run_id, "g": group.group_id, "p0": p0, "p1": p1,
                  **encode_group(group)}
        timeout_s = self.cfg.publish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        slot = admitted or self.admit(timeout_s, group.group_id)
        # One round trip, no MULTI needed: between the two commands the group is counted twice (entry and
        # reservation), which errs on the side of the bound.
        def append():
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self.key, fields)
            pipe.zrem(self.reserved_key, slot)
            return pipe.execute()[0]

        entry_id = self._unless_full(append, deadline, group.group_id, timeout_s)
        self.stats["published"] += 1
        return entry_id.decode()

    def _unless_full(self, command, deadline: float, group_id: str, timeout_s: float):
        """Run a write; while Redis answers out-of-memory (maxmemory reached: the write did nothing) wait for
        the learner to make room and retry, until `deadline`, then raise an error that says so."""
        while True:
            try:
                return command()
            except OutOfMemoryError as exc:
                self.stats["redis_oom_waits"] += 1
                if time.monotonic() + _OOM_RETRY_S >= deadline:
                    raise RuntimeError(
                        f"Redis refused group {group_id!r} for {timeout_s:.0f} s: out of memory (maxmemory "
                        f"reached; is the learner consuming? is the dead-letter stream {self.dead_key!r} "
                        f"large?). Redis said: {exc}") from exc
                time.sleep(_OOM_RETRY_S)

    # -- Consumer side

    def read(self, max_groups: int, block_ms: int = 0) -> list[Received]:
        """Up to `max_groups` groups, waiting up to `block_ms` (<= 0: no wait) when none is there. Own pending
        groups (a previous life of this consumer name, or lost in a reconnect) come first, then groups reclaimed
        from consumers idle for `cfg.reclaim_idle_s` (both `redelivered`), then new ones. Malformed entries and
        other runs' records are dead-lettered and do not count towards `max_groups`."""
        if max_groups < 1:
            return []
        out: list[Received] = []
        now = time.monotonic()
        if now >= self._next_scan:
            # Pending-list work costs round trips: do it on the first read, then a few times per reclaim period
            # (an entry cannot become reclaimable sooner), at once again while it keeps finding groups.
            self._next_scan = now + min(1.0, max(0.0, self.cfg.reclaim_idle_s) / 4)
            self._keepalive()
            for fetch in (self._recover_own, self._reclaim):
                self._deliver(fetch(max_groups - len(out)), out, redelivered=True)
                if len(out) >= max_groups:
                    self._next_scan = 0.0
                    return out
        while len(out) < max_groups:
            block = min(block_ms, self._max_block_ms) if (not out and block_ms > 0) else None
            block_ms = 0                        # only the first read waits
            resp = self._group_call(
                self.redis.xreadgroup, self.consumer_group, self.consumer_name, {self.key: ">"},
                count=max_groups - len(out), block=block,
            )
            entries = resp[0][1] if resp else []
            if not entries:
                break
            self._deliver(entries, out)
        return out

    def ack(self, received: list[Received], counted_as: str = "acked") -> None:
        """Done with these groups: acknowledge and delete their entries, counted in stats[counted_as] (the
        learner's reason when it drops them untrained). After training, call only once the optimizer step
        that used them is committed (a crash before that must leave them pending)."""
        ids = [r.entry_id for r in received]
        if not ids:
            return
        self._ack_delete(ids)
        self._inflight.difference_update(ids)
        self.stats[counted_as] += len(ids)

    def trained(self, received: list[Received]) -> None:
        """These groups are trained on, their ack waits for the checkpoint that holds their update
        (learner.ack_on_checkpoint): they still fill the stream, but no longer count as untrained against the
        producers' lag bound. Their ack (or dead letter) unmarks them."""
        ids = [r.entry_id for r in received]
        if ids:
            self.redis.sadd(self.trained_key, *ids)

    def dead_letter(self, received: list[Received], reason: str) -> None:
        """Move groups the learner read but cannot train on (the reason says why) to the dead-letter stream,
        with their original fields; they leave the stream and are never handed out again."""
        for r in received:
            entries = self.redis.xrange(self.key, min=r.entry_id, max=r.entry_id)
            fields = entries[0][1] if entries else {}
            self._dead_letter(r.entry_id.encode(), fields, reason)
            self._inflight.discard(r.entry_id)

    def depth(self) -> int:
        """Groups in the stream: unread, read and not yet acked (trained ones awaiting their checkpoint too)."""
        return int(self.redis.xlen(self.key))

    def untrained(self) -> int:
        """Groups in the stream not yet trained on: what the learner has still to train (sync mode plays only
        the rest of a batch; the producers' lag bound counts these, plus the slots being played)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.xlen(self.key)
        pipe.scard(self.trained_key)
        held, marked = pipe.execute()
        return max(int(held) - int(marked), 0)

    def forget_trained(self) -> None:
        """Drop every `trained()` mark: for a learner that starts, which has trained nothing unacked yet. Marks
        left by a learner that died before the checkpoint that would have acked them name groups that will be
        handed out and trained again; kept, they would let producers start groups past the lag bound."""
        self.redis.delete(self.trained_key)

    def pending(self) -> int:
        """Groups delivered to some consumer of this consumer group and not yet acked."""
        try:
            return int(self.redis.xpending(self.key, self.consumer_group)["pending"])
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                return 0
            raise

    def dead_letters(self, count: int = 100) -> list[dict[str, bytes]]:
        """The oldest `count` dead-lettered entries: reason, entry_id, consumer and the original fields
        (`orig.<name>`, payload bytes as received)."""
        return [fields for _, fields in self.redis.xrange(self.dead_key, count=count)]

    def close(self) -> None:
        self.redis.close()

    # -- Internals

    def _ensure_group(self) -> bool:
        # From id 0: groups published before the first learner started are not skipped.
        try:
            self.redis.xgroup_create(self.key, self.consumer_group, id="0", mkstream=True)
            return True
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False

    def _group_call(self, fn, *args, **kwargs):
        """Run a consumer-group command; if the group vanished (a Redis restarted without persistence),
        re-create it and try once more."""
        try:
            return fn(*args, **kwargs)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
        if self._ensure_group():
            self.stats["group_recreated"] += 1
        # What was in flight lived in the lost stream: nothing left to ack for it.
        self._inflight.clear()
        return fn(*args, **kwargs)

    def _keepalive(self) -> None:
        """Reset the idle time of our in-flight entries so no other consumer reclaims them while we train."""
        if self._inflight:
            self._group_call(self.redis.xclaim, self.key, self.consumer_group, self.consumer_name, 0,
                             list(self._inflight), justid=True)

    def _recover_own(self, count: int) -> list:
        """Entries pending to this consumer name that this object does not hold: left by a previous process
        with the same name, or delivered by an XREADGROUP whose reply was lost to a connection error."""
        summary = self._group_call(self.redis.xpending, self.key, self.consumer_group)
        mine = sum(c["pending"] for c in summary["consumers"] if c["name"].decode() == self.consumer_name)
        if mine <= len(self._inflight):
            return []
        rows = self._group_call(self.redis.xpending_range, self.key, self.consumer_group, min="-", max="+",
                                count=count + len(self._inflight), consumername=self.consumer_name)
        ids = [r["message_id"] for r in rows if r["message_id"].decode() not in self._inflight][:count]
        if not ids:
            return []
        entries = self._group_call(self.redis.xclaim, self.key, self.consumer_group, self.consumer_name, 0, ids)
        # Pending ids whose entry was deleted come back empty (or not at all): nothing to train, ack them.
        got = {e[0] for e in entries if e[0] is not None and e[1]}
        gone = [i for i in ids if i not in got]
        if gone:
            self._group_call(self.redis.xack, self.key, self.consumer_group, *gone)
        self.stats["recovered_own"] += len(entries)
        return self._without_poison(entries)

    def _reclaim(self, count: int) -> list:
        """Take over entries idle for `reclaim_idle_s` in other consumers' pending lists (dead consumers)."""
        min_idle_ms = max(0, int(self.cfg.reclaim_idle_s * 1000))
        # Other consumers' entries idle that long (XPENDING's IDLE filter; the pending list is bounded by
        # max_stream_groups). Ours are not taken back here: we hold them (in flight) or _recover_own does, and
        # a claim of our own would count as one more delivery of a group we are still training on.
        rows = self._group_call(self.redis.xpending_range, self.key, self.consumer_group, min="-", max="+",
                                count=count + self.cfg.max_stream_groups, idle=min_idle_ms)
        ids = [r["message_id"] for r in rows if r["consumer"].decode() != self.consumer_name][:count]
        if not ids:
            return []
        # XCLAIM re-checks the idle time (another learner may have claimed them meanwhile) and counts the
        # delivery (see _without_poison).
        entries = self._group_call(self.redis.xclaim, self.key, self.consumer_group, self.consumer_name,
                                   min_idle_ms, ids)
        gone = [e[0] for e in entries if e[0] is not None and not e[1]]      # deleted while pending
        if gone:
            self._group_call(self.redis.xack, self.key, self.consumer_group, *gone)
        entries = [e for e in entries if e[0] is not None and e[1]]
        self.stats["reclaimed"] += len(entries)
        return self._without_poison(entries)

    def _without_poison(self, entries: list) -> list:
        """Claimed entries, less those handed out more than max_deliveries times (dead-lettered: a learner
        that crashes on a group would otherwise crash on it again after every restart)."""
        live = [e for e in entries if e[0] is not None and e[1]]
        if not live:
            return entries
        ids = sorted(e[0] for e in live)
        rows = self._group_call(self.redis.xpending_range, self.key, self.consumer_group, min=ids[0], max=ids[-1],
                                count=len(ids) + len(self._inflight) + 1000)
        delivered = {r["message_id"]: int(r["times_delivered"]) for r in rows}
        kept = []
        for entry in entries:
            times = delivered.get(entry[0], 0) if entry[0] is not None else 0
            if times > self.cfg.max_deliveries:
                self._dead_letter(entry[0], entry[1], f"delivered {times} times without being trained "
                                                      f"(stream.max_deliveries={self.cfg.max_deliveries}): a "
                                                      "learner stopped while training it each time")
                continue
            kept.append(entry)
        return kept

    def _ack_delete(self, ids: list) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.xack(self.key, self.consumer_group, *ids)
        pipe.xdel(self.key, *ids)
        pipe.srem(self.trained_key, *ids)
        pipe.execute()

    def _dead_letter(self, entry_id: bytes, fields: dict, reason: str) -> None:
        record = {b"reason": reason.encode(), b"entry_id": entry_id, b"consumer": self.consumer_name.encode(),
                  b"time": repr(time.time()).encode()}
        for k, v in (fields or {}).items():
            record[b"orig." + (k if isinstance(k, bytes) else str(k).encode())] = v
        # One transaction: the copy lands in the dead-letter stream iff the original leaves the main one.
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.dead_key, record, maxlen=self.cfg.dead_letter_max, approximate=False)
        pipe.xack(self.key, self.consumer_group, entry_id)
        pipe.xdel(self.key, entry_id)
        pipe.srem(self.trained_key, entry_id)
        pipe.execute()
        self.stats["dead_lettered"] += 1

    def _deliver(self, entries: list, out: list[Received], redelivered: bool = False) -> None:
        """Decode raw entries into groups for the learner (appended to `out`); entries deleted while pending
        are acked, malformed ones and other runs' records dead-lettered. A redelivered group is untrained
        again: a learner that marked it `trained()` died before the checkpoint that would have acked it."""
        vanished: list[bytes] = []
        handed_out = len(out)
        for raw_id, fields in entries:
            if raw_id is None:
                continue
            eid = raw_id.decode()
            if eid in self._inflight:
                continue
            if not fields:                      # deleted while pending
                vanished.append(raw_id)
                continue
            reason = _header_problem(fields)
            run = fields.get(b"r", b"").decode(errors="replace")
            if not reason and run != self.run_id:
                reason = f"record of run {run!r}; this stream is run {self.run_id!r}'s"
            if reason:
                self._dead_letter(raw_id, fields, reason)
                continue
            gid = fields[b"g"].decode()
            p0, p1 = int(fields[b"p0"]), int(fields[b"p1"])
            try:
                group = decode_group(fields, self.max_group_bytes)
            except CodecError as exc:
                self._dead_letter(raw_id, fields, f"codec: {exc}")
                continue
            if group.group_id != gid or group.policy_versions != (p0, p1):
                self._dead_letter(raw_id, fields, f"entry header (group {gid!r}, versions {p0}..{p1}) disagrees "
                                                  f"with payload (group {group.group_id!r}, versions "
                                                  f"{group.policy_versions})")
                continue
            self._inflight.add(eid)
            self.stats["consumed"] += 1
            out.append(Received(entry_id=eid, group=group, redelivered=redelivered))
        if vanished:
            self._ack_delete(vanished)
        if redelivered and len(out) > handed_out:
            self.redis.srem(self.trained_key, *(r.entry_id for r in out[handed_out:]))


def _header_problem(fields: dict) -> str:
    """Why an entry's header fields are unusable ('' when fine)."""
    version = fields.get(b"v")
    if version is None:
        return "missing schema version field 'v'"
    if version != str(SCHEMA_VERSION).encode():
        return f"schema version {version[:20]!r}; this reader understands version {SCHEMA_VERSION} only"
    for name in (b"g", b"p0", b"p1", HEADER.encode()):
        if name not in fields:
            return f"missing field {name.decode()!r}"
    try:
        fields[b"g"].decode()
        int(fields[b"p0"]), int(fields[b"p1"])
    except (UnicodeDecodeError, ValueError):
        return "group id not UTF-8 or policy versions not integers"
    return ""
