"""Exact accounting of a run's groups: every group published into the stream was trained, counted as
dropped, or is still in the stream. Shared by the tests that lose parts of a running system."""
from __future__ import annotations


def stream_counts(admin_url: str, stream_cfg) -> dict:
    """In one transaction (rollout actors may still publish meanwhile): Redis's count of XADD calls since it
    started, and the lengths of the run's stream and of its dead-letter stream. `admin_url`: the embedded
    Redis's admin user (`EmbeddedRedis.admin_url`): the run's password may not read INFO."""
    from common.stream.redis_client import connect
    from common.stream.redis_stream import stream_key

    key = stream_key(stream_cfg)
    pipe = connect(admin_url).pipeline(transaction=True)
    pipe.info("commandstats")
    pipe.xlen(key)
    pipe.xlen(f"{key}:dead")
    info, length, dead = pipe.execute()
    xadd = info.get("cmdstat_xadd", {})
    return {"xadd_calls": int(xadd.get("calls", 0)), "xadd_failed": int(xadd.get("failed_calls", 0)),
            "length": int(length), "dead_length": int(dead)}


def assert_no_group_lost(counts: dict, stream_stats: dict, trained: int) -> None:
    """Published into the stream (the XADD calls less the copies written to the dead-letter stream) =
    acked after training + dropped as stale, as duplicates or dead-lettered + what the stream still holds;
    and the groups trained but not acked yet (learner.ack_on_checkpoint waits for a checkpoint) are among
    those it holds. `counts`: `stream_counts`; `stream_stats`: the learner's stream counters (its
    LearnerWorker.state()["stream"]), both taken after the last update; `trained`: the distinct groups the
    learner trained on."""
    published = counts["xadd_calls"] - counts["xadd_failed"] - counts["dead_length"]
    acked = int(stream_stats["acked"])
    drops = {k: int(stream_stats[k]) for k in ("dropped_stale", "duplicates_skipped", "dead_lettered")}
    assert published == acked + sum(drops.values()) + counts["length"], (counts, acked, drops)
    assert acked <= trained <= acked + counts["length"], (counts, acked, trained)
