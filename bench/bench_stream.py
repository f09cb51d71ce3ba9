"""Trajectory-stream throughput: encode and decode time per group, and groups/s through Redis against raw
Redis stream commands. Runs in well under a minute.

Groups: 8 trajectories x 30 steps, ~600 prompt + 100 response tokens per step (~0.9 MB encoded), built
(`EpisodeGroup.pack`, as the rollout does once per group) before anything is timed; that cost is printed on
its own. End to end = TrajectoryStream.publish + read + ack (encode, backpressure check, XADD, XREADGROUP,
decode and check, XACK + XDEL), against raw XADD / XREADGROUP / XACK of byte blobs of the same size, same
run, same server; sequential (one process: every cost adds up on one core) and pipelined (a producer process
publishes while the learner process reads and acks, as deployed). Ratios (target >= 0.7): wall-clock, and per
CPU-second (client processes + redis-server), which moves less when other jobs share the machine. A round
moves 96 groups (~80 MB): with fewer, the pipeline's fill and drain weigh so much that both sides look alike.
"Codec skipped" runs TrajectoryStream with parts encoded beforehand and a decoder that looks the group up: the
stream's own work without the codec, so its ratio against raw is the ceiling of a faster codec. Durability:
publish + read + ack with an append-only file in the working directory, fsynced on every write (the run's
setting, `APPENDFSYNC` "always") against once a second ("everysec"). The run's own Redis user: pipelined
through the user a run's actors get (its key patterns and command rules checked on every command) against the
admin user, on the same keys.

    python bench/bench_stream.py [--groups 96] [--rounds 5]
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config import StreamConfig  # noqa: E402
from common.stream.codec import decode_group, encode_group, encoded_size  # noqa: E402
from common.stream.records import EpisodeGroup, StepRow, Termination, Trajectory  # noqa: E402
from common.stream.redis_client import connect  # noqa: E402
from common.stream.redis_server import EmbeddedRedis  # noqa: E402
import common.stream.redis_stream  # noqa: E402
from common.stream.redis_stream import TrajectoryStream  # noqa: E402

WORDS = ("you are in the middle of a room looking around you see a cabinet 1 a countertop 2 a drawer 3 "
         "a fridge 1 a garbagecan 1 a microwave 1 a shelf 2 a sinkbasin 1 a stoveburner 4 a toaster 1").split()


def realistic_group(gid: str, rng: np.random.Generator) -> list:
    played = []
    for i in range(8):
        steps = []
        for s in range(30):
            p = int(rng.integers(550, 650))
            r = int(rng.integers(80, 120))
            steps.append(StepRow(
                prompt_ids=rng.integers(0, 151_000, p, dtype=np.int32),
                response_ids=rng.integers(0, 151_000, r, dtype=np.int32),
                response_logprobs=-rng.exponential(1.0, r).astype(np.float32),
                reward=0.0, anchor=" ".join(rng.choice(WORDS, 60)), valid=True, step=s,
                policy_version=0, action="take apple 1 from countertop 2",
            ))
        played.append((Trajectory(traj_id=f"{gid}/{i}", termination=Termination.MAX_STEPS), steps))
    return played


def bench_pack(played: list, repeats: int) -> tuple[list[EpisodeGroup], float]:
    """The groups, and ms per group to lay their steps out by column (`EpisodeGroup.pack`: once per group,
    in the rollout actor, before publishing)."""
    t0 = time.perf_counter()
    for _ in range(repeats):
        groups = [EpisodeGroup.pack(f"g{i}", "t", "alfworld", p, created_at=time.time(), producer="bench")
                  for i, p in enumerate(played)]
    return groups, (time.perf_counter() - t0) / (repeats * len(played)) * 1e3


def bench_codec(groups: list[EpisodeGroup], repeats: int) -> tuple[float, float, int]:
    """ms per group to encode (the parts the stream sends), ms per group to decode (from the parts as a
    Redis read returns them: bytes), bytes per group."""
    received = [{k.encode(): bytes(v) for k, v in encode_group(g).items()} for g in groups]
    size = sum(encoded_size(p) for p in received) // len(groups)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for g in groups:
            encode_group(g)
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(repeats):
        for p in received:
            decode_group(p)
    t_dec = time.perf_counter() - t0
    per_group = 1e3 / (repeats * len(groups))
    return t_enc * per_group, t_dec * per_group, size


@contextlib.contextmanager
def clock(client):
    """{"wall": wall time, "cpu": CPU time of this process plus the redis-server} of the block (CPU time
    barely moves when other jobs share the machine, so its ratio is the steadier figure on a busy box). The
    server's CPU comes from INFO, which a run's password may not read: the bench connects as the admin user
    (`EmbeddedRedis.admin_url`), whose commands cost the same."""
    def server_cpu() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    took = {}
    wall0, cpu0, srv0 = time.perf_counter(), time.process_time(), server_cpu()
    yield took
    took.update(wall=time.perf_counter() - wall0, cpu=time.process_time() - cpu0 + server_cpu() - srv0)


@contextlib.contextmanager
def codec_skipped(groups: list[EpisodeGroup]):
    """TrajectoryStream without its codec: publish sends parts encoded beforehand (as bytes), read looks
    the group up by its id (the entry's g field) instead of decoding it."""
    parts = {g.group_id: {k: bytes(v) for k, v in encode_group(g).items()} for g in groups}
    by_id = {g.group_id: g for g in groups}
    saved = common.stream.redis_stream.encode_group, common.stream.redis_stream.decode_group
    common.stream.redis_stream.encode_group = lambda group: parts[group.group_id]
    common.stream.redis_stream.decode_group = lambda fields, max_bytes=None: by_id[fields[b"g"].decode()]
    try:
        yield
    finally:
        common.stream.redis_stream.encode_group, common.stream.redis_stream.decode_group = saved


def _ends(url: str, cfg: StreamConfig, raw: bool, name: str):
    """(publish(item), consumer) of one process on cfg.stream: TrajectoryStream's, or, raw, XADD of byte blobs
    and no consumer object (its consumer group is created here: see _consume)."""
    if not raw:
        stream = TrajectoryStream(url, cfg, consumer_name=name)
        return stream.publish, stream
    client = connect(url)
    if name == "bench":
        client.xgroup_create(cfg.stream, "raw", id="0", mkstream=True)
    return (lambda blob: client.xadd(cfg.stream, {"d": blob})), None


def _consume(r, stream: TrajectoryStream | None, key: str, n: int, batch: int) -> int:
    """Read and ack n groups, up to `batch` a read: through `stream`, or (None) raw XREADGROUP / XACK."""
    done = 0
    while done < n:
        if stream is not None:
            got = stream.read(max_groups=min(batch, n - done), block_ms=1000)
            stream.ack(got)
        else:
            resp = r.xreadgroup("raw", "bench", {key: ">"}, count=min(batch, n - done), block=1000)
            got = [eid for eid, _ in resp[0][1]] if resp else []
            if got:
                r.xack(key, "raw", *got)
        done += len(got)
    return done


def run_sequential(url: str, key: str, batch: int, items: list, raw: bool) -> tuple[float, float]:
    """One process publishes a batch, reads it, acks it; raw: XADD / XREADGROUP / XACK of byte blobs, same
    batching, no codec. groups/s (wall, CPU)."""
    r = connect(url)
    publish, stream = _ends(url, StreamConfig(stream=key, max_stream_groups=4 * batch), raw, "bench")
    with clock(r) as took:
        done = 0
        for start in range(0, len(items), batch):
            chunk = items[start:start + batch]
            for item in chunk:
                publish(item)
            done += _consume(r, stream, key, len(chunk), batch)
    assert done == len(items) and (raw or stream.depth() == 0)
    if stream is not None:
        stream.close()
    r.delete(key)
    r.close()
    return done / took["wall"], done / took["cpu"]


def run_pipelined(url: str, key: str, batch: int, items: list, raw: bool, run_id: str = "",
                  clock_url: str = "") -> tuple[float, float]:
    """The deployed shape: a producer process publishes while this process (the learner) reads and acks.
    groups/s (wall; CPU of both processes + redis-server). clock_url: the admin's URL where `url`'s user may
    not read the server's CPU time (INFO)."""
    ctx = mp.get_context("fork")           # the child inherits the prepared groups: nothing to pickle
    r = connect(url)
    clock_client = connect(clock_url) if clock_url else r
    cfg = StreamConfig(stream=key, run_id=run_id, max_stream_groups=4 * batch, publish_timeout_s=30)
    _, consumer = _ends(url, cfg, raw, "bench")
    go = ctx.Event()

    def produce():
        go.wait()
        publish, _ = _ends(url, cfg, raw, "producer")
        for item in items:
            publish(item)
        os._exit(0)

    child = ctx.Process(target=produce, daemon=True)
    child.start()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        with clock(clock_client) as took:
            go.set()
            done = _consume(r, consumer, key, len(items), batch)
            child.join(60)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = took["cpu"] + (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert done == len(items)
    clock_client.delete(key, *clock_client.keys(f"{key}:*"))     # its side keys too: the next round starts bare
    r.close()
    if clock_client is not r:
        clock_client.close()
    return done / took["wall"], done / cpu


def _report(title: str, raw_rates: list, stream_rates: list, size: int) -> float:
    print(title)
    for label, rates in (("raw XADD/XREADGROUP/XACK", raw_rates), ("TrajectoryStream", stream_rates)):
        wall = [w for w, _ in rates]
        cpu = [c for _, c in rates]
        print(f"  {label:25s}: wall best {max(wall):6.1f} groups/s ({max(wall) * size / 1e6:4.0f} MB/s), "
              f"median {statistics.median(wall):6.1f}; per CPU-second best {max(cpu):6.1f}")
    # Raw and stream rounds run back to back, so the ratio within a round cancels slow drifts of a shared
    # machine's load; the median over rounds discards the rounds another job disturbed.
    wall_ratio = statistics.median(s[0] / r[0] for s, r in zip(stream_rates, raw_rates))
    cpu_ratio = statistics.median(s[1] / r[1] for s, r in zip(stream_rates, raw_rates))
    print(f"  ratio stream/raw (median over rounds of the paired ratio): wall {wall_ratio:.2f}, "
          f"per CPU-second {cpu_ratio:.2f}")
    return wall_ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=96, help="distinct groups generated (moved each round)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of raw and stream runs, back to back")
    ap.add_argument("--batch", type=int, default=8, help="groups per read (and per publish cycle)")
    args = ap.parse_args()
    t_start = time.perf_counter()

    rng = np.random.default_rng(0)
    groups, pack_ms = bench_pack([realistic_group(f"g{i}", rng) for i in range(args.groups)], repeats=1)
    print(f"{len(groups)} groups per round, of {groups[0].num_rows} rows (8 x 30 steps, ~600 prompt + ~100 "
          f"response tokens)")

    enc, dec, size = bench_codec(groups, repeats=5)
    print(f"codec: group = {size / 1e6:.2f} MB encoded; encode {enc:.3f} ms + decode {dec:.3f} ms = "
          f"{enc + dec:.3f} ms per group (target < 0.1: {'OK' if enc + dec < 0.1 else 'ABOVE'}); laying the "
          f"steps out by column (EpisodeGroup.pack, in the rollout) {pack_ms:.2f} ms per group")

    blobs = [os.urandom(size) for _ in groups]
    with EmbeddedRedis() as server:
        seq_raw, seq_stream, seq_free, pipe_raw, pipe_stream, pipe_free = [], [], [], [], [], []
        for k in range(args.rounds):
            seq_raw.append(run_sequential(server.admin_url, f"bench:raw:{k}", args.batch, blobs, raw=True))
            seq_stream.append(run_sequential(server.admin_url, f"bench:stream:{k}", args.batch, groups, raw=False))
            pipe_raw.append(run_pipelined(server.admin_url, f"bench:praw:{k}", args.batch, blobs, raw=True))
            pipe_stream.append(run_pipelined(server.admin_url, f"bench:pstream:{k}", args.batch, groups, raw=False))
            with codec_skipped(groups):
                seq_free.append(run_sequential(server.admin_url, f"bench:free:{k}", args.batch, groups, raw=False))
                pipe_free.append(run_pipelined(server.admin_url, f"bench:pfree:{k}", args.batch, groups, raw=False))
        # A run's actors reach the stream as the run's own user (EmbeddedRedis.add_run_user), the admin user here.
        run_cfg = StreamConfig(stream="bench:run", run_id="bench")
        run_url = server.add_run_user(run_cfg)
        as_admin, as_run_user = [], []
        for _ in range(args.rounds):
            as_admin.append(run_pipelined(server.admin_url, run_cfg.stream, args.batch, groups, raw=False,
                                          run_id=run_cfg.run_id))
            as_run_user.append(run_pipelined(run_url, run_cfg.stream, args.batch, groups, raw=False,
                                             run_id=run_cfg.run_id, clock_url=server.admin_url))
    # What the run's durability costs: its Redis fsyncs every write (APPENDFSYNC "always": a power cut loses no
    # group a producer counted as published) against "everysec", an AOF on the working directory's disk.
    fsync_rates: dict[str, list[float]] = {"always": [], "everysec": []}
    for k in range(args.rounds):
        for mode in fsync_rates:
            with tempfile.TemporaryDirectory(dir=".", prefix=".bench-aof-") as data_dir, \
                    EmbeddedRedis(data_dir=data_dir, aof=True, appendfsync=mode) as server:
                fsync_rates[mode].append(run_sequential(server.admin_url, f"bench:aof:{k}", args.batch, groups,
                                                        raw=False)[0])
    seq = _report("sequential, one process (publish + read + ack, every cost on one core):", seq_raw, seq_stream,
                  size)
    pipe = _report("pipelined, producer process + learner process (the deployed shape):", pipe_raw, pipe_stream,
                   size)
    seq_ceiling = statistics.median(s[0] / r[0] for s, r in zip(seq_free, seq_raw))
    pipe_ceiling = statistics.median(s[0] / r[0] for s, r in zip(pipe_free, pipe_raw))
    print(f"codec skipped (pre-encoded bytes, lookup for decode; the stream's own work only): wall ratio "
          f"pipelined {pipe_ceiling:.2f}, sequential {seq_ceiling:.2f}: the ceiling of a faster codec")
    user_ratio = statistics.median(u[0] / a[0] for u, a in zip(as_run_user, as_admin))
    print(f"the run's own Redis user (ACL rules on every command) against the admin user, pipelined: wall ratio "
          f"{user_ratio:.2f} (median over rounds; best {max(u for u, _ in as_run_user):.1f} against "
          f"{max(a for a, _ in as_admin):.1f} groups/s)")
    always, everysec = max(fsync_rates["always"]), max(fsync_rates["everysec"])
    print(f"durability (AOF on this disk, sequential, best of {args.rounds}): appendfsync always {always:.1f} "
          f"groups/s ({1e3 / always:.1f} ms per group), everysec {everysec:.1f} ({1e3 / everysec:.1f} ms): "
          f"always at {always / everysec:.2f}x")
    print(f"e2e ratio stream/raw (target >= 0.70): pipelined {pipe:.2f} {'OK' if pipe >= 0.7 else 'BELOW'}, "
          f"sequential {seq:.2f} {'OK' if seq >= 0.7 else 'BELOW'}  [{time.perf_counter() - t_start:.0f} s]")


if __name__ == "__main__":
    main()
