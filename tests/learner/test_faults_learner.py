"""Learner faults from issue #17, caused for real: a second run into a used output directory, and a learner
that dies between checkpoints while a weight publisher is in place. Real DeepSpeed (CPU, gloo), the tiny
policy, a real Redis (EmbeddedRedis). Run them alone with `pytest -m fault`."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from common.run_dir import LATEST, LEARNER_STATE, checkpoint_tags, prepare_output_dir
from learner.loop import Learner
from tests.support.synthetic import synthetic_groups
from learner.trainer import prune_checkpoints
from tests.support import learner_worker

pytestmark = [pytest.mark.timeout(300)]


def _train(learner: Learner, updates: int, seed: int) -> list[str]:
    """`updates` updates on fresh synthetic groups (2 per update); the group ids trained."""
    trained = []
    for i in range(updates):
        assert learner.step(synthetic_groups(2, 3, vocab_size=1000, seed=seed + i, max_steps=2)) is not None
        trained += learner.last_group_ids
    return trained


def _dir_listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.slow
def test_a_second_run_into_a_used_output_dir_is_refused_or_starts_fresh(tiny_model_path, tmp_path):
    cfg = learner_worker.learner_experiment("unused")
    cfg.run.output_dir = str(tmp_path)
    cfg.learner.checkpoint_every, cfg.learner.keep_checkpoints = 1, 2
    ckpt = tmp_path / "checkpoints"
    old = Learner(cfg, tiny_model_path)
    try:
        _train(old, 1, seed=100)           # the old run leaves update_0000001
    finally:
        old.close()
    before = _dir_listing(ckpt)

    # A fresh run is refused, with one line naming the way out, and nothing there changes.
    for start in (lambda: prepare_output_dir(cfg), lambda: Learner(cfg, tiny_model_path)):
        with pytest.raises(ValueError, match="update_0000001.*run.resume=true.*run.overwrite=true") as exc:
            start()
        assert "\n" not in str(exc.value)
    cfg.run.resume = cfg.run.overwrite = True
    with pytest.raises(ValueError, match="set one of them"):
        prepare_output_dir(cfg)
    assert _dir_listing(ckpt) == before

    # run.overwrite: the old checkpoints go first; the new run keeps its own newest two.
    cfg.run.resume = False
    new = Learner(cfg, tiny_model_path)
    try:
        new_ids = _train(new, 3, seed=200)
        assert [p.name for p in checkpoint_tags(ckpt)] == ["update_0000002", "update_0000003"]
        latest = (ckpt / LATEST).read_text().strip()
        assert latest == "update_0000003" and (ckpt / latest / LEARNER_STATE).is_file()
        state = json.loads((ckpt / latest / LEARNER_STATE).read_text())
        assert state["updates"] == 3 and set(state["trained_group_ids"]) == set(new_ids)
        # A `latest` naming a deleted checkpoint is a clear error, not an AssertionError inside DeepSpeed.
        (ckpt / LATEST).write_text("update_0000009")
        with pytest.raises(FileNotFoundError, match="update_0000009.*update_0000002.*update_0000003"):
            new.trainer.load_checkpoint(ckpt)
        (ckpt / LATEST).write_text(latest)
    finally:
        new.close()


def test_pruning_keeps_the_highest_update_numbers_not_the_last_names(tmp_path):
    def make(*updates):
        for u in updates:
            (tmp_path / f"update_{u:07d}").mkdir()

    # 10000000 has 8 digits: as a string it sorts before update_9999999.
    make(9999998, 9999999, 10000000)
    assert prune_checkpoints(tmp_path, 2, "update_10000000") == ["update_9999998"]
    assert [p.name for p in checkpoint_tags(tmp_path)] == ["update_9999999", "update_10000000"]
    # The one just written is kept whatever its number; higher ones (a history this run branched off, by
    # resuming from an older run.resume_tag) are left for the run to overwrite.
    for p in checkpoint_tags(tmp_path):
        p.rmdir()
    make(1, 2, 5)
    assert prune_checkpoints(tmp_path, 1, "update_0000002") == ["update_0000001"]
    assert [p.name for p in checkpoint_tags(tmp_path)] == ["update_0000002", "update_0000005"]
    assert prune_checkpoints(tmp_path, 0, "update_0000002") == []


class VersionRecorder:
    """Stands in for the inference actors: the Learner's publisher interface, push(named_tensors, version).
    It records the versions; the test's producer tags new groups with the latest, as rollout actors do."""

    def __init__(self):
        self.versions: list[int] = []

    def push(self, named_tensors, version: int) -> dict:
        for _ in named_tensors:       # a real push reads every tensor
            pass
        self.versions.append(version)
        return {}

    def needs_push(self, version: int) -> bool:
        return False          # no actor restarts in this test

    @property
    def latest(self) -> int:
        return self.versions[-1] if self.versions else 0


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.parametrize("checkpoint_every, crash_after, second_consumer", [
    (3, 5, "learner-0"),     # checkpoint at update 3, updates 4 and 5 lost; the same consumer name comes back
    (100, 3, "learner-1"),   # no checkpoint yet; another consumer name reclaims the dead one's groups
], ids=["lost-after-checkpoint", "lost-before-first-checkpoint"])
def test_groups_of_lost_updates_are_retrained_after_a_crash_not_dropped_stale(
        tiny_model_path, tmp_path, checkpoint_every, crash_after, second_consumer):
    from common.stream.redis_server import EmbeddedRedis
    from common.stream.redis_stream import TrajectoryStream

    cfg = learner_worker.learner_experiment("test:faults-lost-updates")
    cfg.run.output_dir = str(tmp_path)
    cfg.learner.checkpoint_every = checkpoint_every
    # Lag 1: the lost updates' groups were sampled by versions 2 and more below the resumed learner's.
    cfg.stream.max_policy_lag = 1
    cfg.stream.reclaim_idle_s = 0.0          # the dead consumer's groups are reclaimable at once
    actors = VersionRecorder()
    published: list[str] = []
    with EmbeddedRedis() as server:
        producer = TrajectoryStream(server.url, cfg.stream, consumer_name="producer")

        def produce(seed: int) -> None:
            for g in synthetic_groups(2, 3, vocab_size=1000, seed=seed, max_steps=2, policy_version=actors.latest):
                producer.publish(g)
                published.append(g.group_id)

        # Life 1: sample with the latest weights, train on it, `crash_after` times; then two more groups are
        # sampled (unread), and the learner dies: no close, no checkpoint, no ack.
        first = Learner(cfg, tiny_model_path, TrajectoryStream(server.url, cfg.stream), publisher=actors)
        life1: list[list[str]] = []
        for i in range(crash_after):
            produce(seed=300 + i)
            assert first.step(timeout_s=30) is not None
            life1.append(list(first.last_group_ids))
        produce(seed=400)
        first_stats = dict(first.stream.stats)
        first.stream.close()
        first.trainer.close()
        del first
        pushed_before_crash = actors.latest
        committed = {g for u in life1[:crash_after // checkpoint_every * checkpoint_every] for g in u}
        lost = {g for u in life1 for g in u} - committed
        # The learner's half of the admission rule: the lost updates' groups, trained and awaiting a checkpoint's
        # ack, were marked trained (the producers' lag bound leaves them out; handed out again, they count as
        # untrained: tests/common/stream/test_stream.py).
        assert producer.redis.scard(producer.trained_key) == len(lost)

        # Life 2: resumes on the same Redis and output dir, and drains the stream.
        second = Learner(cfg, tiny_model_path, TrajectoryStream(server.url, cfg.stream, consumer_name=second_consumer),
                         publisher=actors, resume=True)
        assert second.trained_group_ids == committed
        # One push of the resumed weights, above every version the dead learner pushed.
        assert second.policy_version == pushed_before_crash + 1 == actors.latest
        life2: list[list[str]] = []
        while second.step(timeout_s=2) is not None:
            life2.append(list(second.last_group_ids))
        second_stats = dict(second.stream.stats)
        second.close()
        assert producer.depth() == 0 and producer.pending() == 0
        assert producer.redis.scard(producer.trained_key) == 0
        producer.close()

    trained = Counter(committed) + Counter(g for u in life2 for g in u)
    assert trained == Counter(published), "a group was dropped or trained twice"
    assert lost and lost <= {g for u in life2 for g in u}
    assert first_stats["dropped_stale"] == second_stats["dropped_stale"] == 0
    assert second_stats["recovered_own" if second_consumer == "learner-0" else "reclaimed"] == len(lost)
    # A version number never names two different weights: each push took a new one.
    assert actors.versions == list(range(1, len(actors.versions) + 1))


def test_run_id_is_new_for_a_fresh_run_and_kept_on_resume(tmp_path):
    """Runs sharing one Redis are kept apart by their run id (stream key, consumer group, control keys,
    records): a fresh run gets a new one, a resumed run continues with its own."""
    from common.config import ExperimentConfig
    from common.run_dir import RUN_ID_FILE, prepare_output_dir
    from common.stream.redis_stream import stream_key

    def cfg_for(**run):
        cfg = ExperimentConfig()
        cfg.run.output_dir, cfg.run.name = str(tmp_path / "run"), "my run"
        for k, v in run.items():
            setattr(cfg.run, k, v)
        return cfg

    first = cfg_for()
    run_id = prepare_output_dir(first)
    assert run_id.startswith("my-run-") and first.stream.run_id == run_id
    assert (tmp_path / "run" / RUN_ID_FILE).read_text().strip() == run_id
    assert run_id in stream_key(first.stream)
    resumed = cfg_for(resume=True)
    assert prepare_output_dir(resumed) == run_id
    fresh = cfg_for(overwrite=True)
    assert prepare_output_dir(fresh) not in ("", run_id)


@pytest.mark.slow
@pytest.mark.fault
def test_a_learner_killed_at_each_point_of_save_and_ack_resumes_and_trains_every_group_once(tiny_model_path,
                                                                                            tmp_path, redis_url):
    """A real SIGKILL at each point of a checkpoint's save and ack (tests/support/learner_worker.py, CRASH_POINTS),
    one learner process after another on the same checkpoints and stream, a checkpoint every update: each
    resumes where what reached the disk says (half a file or no completion mark: the checkpoint before; the
    mark and `latest`: this one, its unacked groups acked as already trained, not retrained), and in the end
    every group is trained exactly once. Which checkpoint each life resumes from, and what the stream holds
    after each kill, is fixed by the kill's point (issue 64)."""
    import uuid

    from common.stream.redis_stream import TrajectoryStream

    cfg = learner_worker.learner_experiment(f"test:{uuid.uuid4().hex[:8]}")        # 2 groups per update
    cfg.learner.checkpoint_every = 1
    groups = synthetic_groups(10, 3, vocab_size=1000, seed=31, max_steps=2)
    producer = TrajectoryStream(redis_url, cfg.stream, consumer_name="producer")
    for g in groups:
        producer.publish(g)
    ckpt = tmp_path / "ckpt"
    # (the point, the update whose checkpoint it hits, the version the next life resumes from, the entries
    # left in the stream after the kill)
    lives = [("mid_save", 2, 1, 8), ("after_files", 2, 1, 8), ("after_latest", 2, 2, 8), ("mid_ack", 3, 3, 5),
             ("after_ack", 4, 4, 2)]
    assert [point for point, *_ in lives] == list(learner_worker.CRASH_POINTS)
    resumed = []
    for point, update, _, left in lives:
        proc = subprocess.run([sys.executable, str(Path(learner_worker.__file__)), "crash", tiny_model_path, "-",
                               redis_url, cfg.stream.stream, str(ckpt), point, str(update)],
                              env=learner_worker.worker_env(), capture_output=True, text=True, timeout=300)
        said = [line for line in proc.stdout.splitlines() if line.startswith("RESUMED ")]
        assert proc.returncode == -9 and len(said) == 1, (point, proc.returncode, proc.stdout[-2000:],
                                                          proc.stderr[-3000:])
        resumed.append(int(said[0].split()[1]))
        assert producer.depth() == left, (point, producer.depth())
        if point == "mid_save":             # half a file of update 2's checkpoint, no completion mark
            assert (ckpt / LATEST).read_text() == "update_0000001" and (ckpt / "update_0000002").is_dir()
    assert resumed == [0] + [version for *_, version, _ in lives[:-1]]

    learner = Learner(cfg, tiny_model_path, TrajectoryStream(redis_url, cfg.stream), checkpoint_dir=str(ckpt),
                      resume=True)
    assert learner.policy_version == lives[-1][2]
    while learner.step(timeout_s=3) is not None:
        pass
    version, trained = learner.policy_version, set(learner.trained_group_ids)
    learner.close()
    # Ten groups, two an update: five updates in the history that survived, each group in one of them.
    assert trained == {g.group_id for g in groups} and version == 5
    assert producer.depth() == 0 and producer.pending() == 0
    producer.close()


@pytest.mark.slow
@pytest.mark.fault
def test_poison_groups_are_dead_lettered_and_the_rest_of_their_batch_trains(tiny_model_path, tmp_path, redis_url):
    """Groups the learner cannot train on, each published as a producer with a bug (or a stranger with the
    stream's password) would (the stream's publish checks the layout, not the values): token ids past the
    vocabulary (they would crash the forward pass, and after every restart again), a NaN log-prob, a positive
    log-prob, and groups past what this run's config lets a group hold (issue 65: more trajectories than
    rollout.group_size, a response longer than model.max_response_tokens, a grammar past
    stream.max_grammar_bytes, more bytes than stream.max_group_mb: that one is refused as it is read, before
    it is decoded). Each is dead-lettered with its reason on read and counted; the good groups read between
    them are trained, and nothing is left."""
    import uuid

    from common.stream.redis_stream import TrajectoryStream
    from learner.batching import GroupLimits
    cfg = learner_worker.learner_experiment(f"test:{uuid.uuid4().hex[:8]}")     # 2 groups per batch
    cfg.rollout.group_size, cfg.env.max_steps, cfg.model.max_response_tokens = 2, 2, 24
    cfg.stream.max_grammar_bytes, cfg.stream.max_group_mb = 100, 0.01       # 10,485 bytes; a good group: < 3,000
    learner = Learner(cfg, tiny_model_path, TrajectoryStream(redis_url, cfg.stream, max_group_bytes=GroupLimits.of(
        cfg).group_bytes), checkpoint_dir="")
    groups = synthetic_groups(5, 2, vocab_size=200, seed=5, max_steps=2)
    vocab, nan, positive, good = groups[0], groups[2], groups[3], [groups[1], groups[4]]
    vocab.rows["response_ids"][0] = learner.trainer.vocab_size + 4000
    nan.rows["response_logprobs"][1] = np.nan
    positive.rows["response_logprobs"][0] = 0.5
    crowded = synthetic_groups(1, 3, vocab_size=200, seed=6, max_steps=2, prefix="crowded")[0]
    wordy = synthetic_groups(1, 2, vocab_size=200, seed=7, max_steps=2, response_tokens=(25, 26), prefix="wordy")[0]
    regex = synthetic_groups(1, 2, vocab_size=200, seed=8, max_steps=2, prefix="regex",
                             respond=lambda rng: (rng.integers(1, 200, 4), "(a|b)" * 21))[0]     # 105 bytes
    big = synthetic_groups(1, 2, vocab_size=200, seed=9, max_steps=2, prompt_tokens=(1500, 1501), prefix="big")[0]
    producer = TrajectoryStream(redis_url, cfg.stream, consumer_name="producer")
    # A poison group first, read with a good one; the batch ends with the last.
    for g in [vocab, crowded, wordy, regex, big, *groups[1:]]:
        producer.publish(g)
    metrics = learner.step(timeout_s=30)
    assert metrics is not None and set(learner.last_group_ids) == {g.group_id for g in good}
    reasons = {dead[b"orig.g"].decode(): dead[b"reason"].decode() for dead in learner.stream.dead_letters()}
    bad = [vocab, nan, positive, crowded, wordy, regex, big]
    assert set(reasons) == {g.group_id for g in bad}, reasons
    assert "outside the vocabulary" in reasons[vocab.group_id]
    assert "response_logprobs: NaN" in reasons[nan.group_id]
    assert "log-probs must be <= 0" in reasons[positive.group_id]
    assert "3 trajectories, more than rollout.group_size (2)" in reasons[crowded.group_id]
    assert "25 response tokens, more than model.max_response_tokens (24)" in reasons[wordy.group_id]
    assert "grammar of 105 bytes, more than stream.max_grammar_bytes' bound (100)" in reasons[regex.group_id]
    assert "exceeds the 10485-byte limit" in reasons[big.group_id]
    assert learner.stream.depth() == 0 and learner.stats["bad_groups"] == 6    # (the big one never reached it)
    learner.close()


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs for the checkpoints: needs root")
def test_a_full_disk_during_a_checkpoint_acks_nothing_and_the_resume_trains_every_group_once(
        tiny_model_path, tmp_path):
    """The checkpoints' disk fills up in the middle of one (a real tmpfs, shrunk below two checkpoints): the
    update's groups stay unacked, the error says what happened and where, the half-written checkpoint is gone
    (its space given back), `latest` names the one before; once there is room, the resume retrains exactly
    the groups that checkpoint lacked."""
    from common.stream.redis_server import EmbeddedRedis
    from common.stream.redis_stream import TrajectoryStream

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)], check=True)
    try:
        cfg = learner_worker.learner_experiment("test:faults-full-disk")
        cfg.run.output_dir = str(tmp_path)
        cfg.learner.checkpoint_every = 1
        ckpt = disk / "checkpoints"
        published: list[str] = []
        with EmbeddedRedis() as server:
            producer = TrajectoryStream(server.url, cfg.stream, consumer_name="producer")

            def produce(seed: int) -> None:
                for g in synthetic_groups(2, 3, vocab_size=1000, seed=seed, max_steps=2):
                    producer.publish(g)
                    published.append(g.group_id)

            first = Learner(cfg, tiny_model_path, TrajectoryStream(server.url, cfg.stream),
                            checkpoint_dir=str(ckpt))
            produce(seed=500)
            assert first.step(timeout_s=30) is not None          # update 1, checkpointed and acked
            committed = set(first.trained_group_ids)
            assert (ckpt / LATEST).read_text() == "update_0000001" and producer.depth() == 0
            # Room for half of another checkpoint: the next one runs out of space part of the way through.
            used = shutil.disk_usage(disk).used
            one = sum(p.stat().st_size for p in (ckpt / "update_0000001").rglob("*") if p.is_file())
            subprocess.run(["mount", "-o", f"remount,size={used + one // 2}", str(disk)], check=True)
            produce(seed=501)
            with pytest.raises(OSError) as err:
                first.step(timeout_s=30)                          # update 2 trains; its checkpoint cannot
            assert err.value.errno == errno.ENOSPC and str(ckpt) in str(err.value)
            assert "no space left" in str(err.value).lower()
            assert (ckpt / LATEST).read_text() == "update_0000001"
            assert [p.name for p in checkpoint_tags(ckpt)] == ["update_0000001"]    # the half-written one removed
            assert producer.depth() == 2                          # update 2's groups: not acked
            first.stream.close()
            first.trainer.close()
            del first

            subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)    # room again
            second = Learner(cfg, tiny_model_path, TrajectoryStream(server.url, cfg.stream),
                             checkpoint_dir=str(ckpt), resume=True)
            assert second.updates == 1 and second.trained_group_ids == committed
            retrained: list[str] = []
            while second.step(timeout_s=2) is not None:
                retrained += second.last_group_ids
            second.close()
            assert producer.depth() == 0 and producer.pending() == 0
            producer.close()
        assert Counter(committed) + Counter(retrained) == Counter(published), "a group was dropped or trained twice"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
