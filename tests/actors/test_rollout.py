"""Rollout actors end to end with the real parts: vLLM (tiny model) inference actor, generated ALFWorld
games in env worker processes, a real redis-server. One inference engine and one Redis for the module."""
import os
import signal
import time
from collections import Counter

import pytest
import ray

from common.config import (EnvConfig, ExperimentConfig, InferenceConfig, ModelConfig, RolloutConfig,
                           StreamConfig)
from common.stream.codec import encode_group, encoded_size
from common.stream.records import Termination
from learner.batching import GroupLimits
from tests.support.synthetic import step_rows, steps_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 3      # group size


def _cfg(model_path: str, stream: str, **rollout) -> ExperimentConfig:
    # Unconstrained by default: the random policy's responses are invalid (the env says "Nothing happens"),
    # which exercises the same plumbing at a fraction of the cost of grammar-constrained decoding.
    rollout = dict(group_size=N, groups_per_actor=2, cpus_per_actor=0.25, constrain_actions=False) | rollout
    cfg = ExperimentConfig(
        model=ModelConfig(path=model_path, max_prompt_tokens=1024, max_response_tokens=24),
        inference=InferenceConfig(gpu_memory_utilization=0.05, max_num_seqs=64, cpus_per_actor=1.0),
        env=EnvConfig(max_steps=3, num_generated_games=6, instances_per_process=4, step_timeout_s=30.0),
        rollout=RolloutConfig(**rollout), stream=StreamConfig(stream=stream, max_stream_groups=1000))
    return cfg


@pytest.fixture(scope="module")
def setup(tiny_model_path, local_ray, redis_url, tmp_path_factory):
    from actors.inference import create_inference_actors, stop_inference_actors

    cfg = _cfg(tiny_model_path, "unused")
    cfg.inference.weights_dir = str(tmp_path_factory.mktemp("weights"))
    inference = create_inference_actors(cfg, tiny_model_path, num_actors=1)
    try:
        assert ray.get(inference[0].policy_version.remote(), timeout=180) == 0
        yield tiny_model_path, inference, redis_url
    finally:
        stop_inference_actors(inference)      # the engine's own shutdown: it removes its shared memory


def _read_all(url: str, cfg: ExperimentConfig, expect: int | None = None, timeout_s: float = 10.0):
    from common.stream.redis_stream import TrajectoryStream

    stream = TrajectoryStream(url, cfg.stream, consumer_name="test-learner")
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got += stream.read(max_groups=100, block_ms=200)
        if expect is None or len(got) >= expect:
            break
    stream.ack(got)
    return [r.group for r in got], stream.depth()


def _wait_for_stats(actor, what, timeout_s: float = 120) -> dict:
    """The actor's stats once `what(stats)` holds; fails with the last stats past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not what(stats := ray.get(actor.stats.remote())):
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    return stats


def _served_version(inference) -> int:
    """The weight version the module's inference actor serves now (a test may have pushed one: the groups
    of a later test are sampled by it, whatever the order the tests run in)."""
    return ray.get(inference[0].policy_version.remote(), timeout=60)


def _check_group(group, cfg: ExperimentConfig, versions: tuple):
    """Invariants every published group satisfies; versions: those that may have sampled its steps."""
    assert len(group.trajectories) == N
    assert len({t.traj_id for t in group.trajectories}) == N
    # A group this config's rollout made is within what the learner accepts of it (constrained: grammars too).
    limits = GroupLimits.of(cfg)
    assert limits.problem(group) == "" and encoded_size(encode_group(group)) <= limits.group_bytes
    first_anchors = set()
    for k, traj in enumerate(group.trajectories):
        steps = steps_of(group, k)
        assert traj.termination in (Termination.DONE, Termination.MAX_STEPS, Termination.ENV_ERROR,
                                    Termination.TRUNCATED)
        if traj.termination == Termination.MAX_STEPS:
            assert traj.num_steps == cfg.env.max_steps and not traj.success
        assert [s.step for s in steps] == list(range(traj.num_steps))
        assert traj.episode_return == sum(s.reward for s in steps)
        for i, s in enumerate(steps):
            assert len(s.response_ids) == len(s.response_logprobs) > 0
            assert len(s.prompt_ids) <= cfg.model.max_prompt_tokens
            assert (s.response_logprobs <= 0).all()
            assert s.policy_version in versions and s.anchor
            # the success reward sits on the winning (last) step only
            won_here = traj.success and i == traj.num_steps - 1
            assert s.reward == (cfg.rollout.success_reward if won_here else 0.0)
        if steps:
            first_anchors.add(steps[0].anchor)
    # same task, same seed: every member starts from the identical state
    assert len(first_anchors) <= 1


def test_rollout_publishes_complete_groups(setup):
    from actors.rollout import create_rollout_actor

    path, inference, url = setup
    cfg = _cfg(path, "test:groups", constrain_actions=True)
    cfg.env.max_steps = 4
    cfg.model.max_response_tokens = 80      # room for the longest action even spelled per character
    version = _served_version(inference)
    actor = create_rollout_actor(cfg, "ro-a", inference, url)
    stats = ray.get(actor.run.remote(max_groups=2), timeout=240)
    assert stats["groups_published"] == 2 and stats["env_steps"] > 0
    assert stats["generated_tokens"] > 0 and stats["gen_wait_s"] > 0
    groups, depth = _read_all(url, cfg, expect=2)
    assert len(groups) == 2 and depth == 0
    for g in groups:
        _check_group(g, cfg, versions=(version,))
        assert g.producer == "ro-a" and g.env_name == "alfworld" and g.num_rows > 0
        # constrained decoding: every action is well-formed and admissible, so rows are valid
        invalid = [(s.action, s.response_ids.tolist()) for _, _, s in step_rows([g]) if not s.valid]
        assert not invalid, (invalid, stats)
    # prompts follow the template: role line, task, the admissible actions
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(path).decode(steps_of(groups[0], 0)[0].prompt_ids)
    assert "ALFRED" in text and "Your admissible actions" in text and text.endswith("<|im_start|>assistant\n")
    ray.get(actor.close.remote())


def test_prompt_over_context_truncates(setup):
    from actors.rollout import create_rollout_actor

    path, inference, url = setup
    cfg = _cfg(path, "test:trunc")
    cfg.model.max_prompt_tokens = 20
    actor = create_rollout_actor(cfg, "ro-t", inference, url)
    stats = ray.get(actor.run.remote(max_groups=1), timeout=120)
    assert stats["terminations"] == {"truncated": N}
    assert stats["groups_published"] == 0 and stats["groups_empty"] == 1    # nothing to train on: not sent
    # run(max_groups=k) again (sync mode does this every iteration) plays k more groups
    stats = ray.get(actor.run.remote(max_groups=1), timeout=120)
    assert stats["terminations"] == {"truncated": 2 * N} and stats["groups_empty"] == 2
    ray.get(actor.close.remote())


@pytest.mark.fault
def test_env_worker_crash_ends_trajectory_as_env_error(setup):
    from actors.rollout import create_rollout_actor

    path, inference, url = setup
    cfg = _cfg(path, "test:crash", groups_per_actor=1)
    cfg.env.max_steps = 10
    version = _served_version(inference)
    actor = create_rollout_actor(cfg, "ro-c", inference, url)
    done = actor.run.remote(max_groups=1)
    deadline = time.monotonic() + 60
    while ray.get(actor.stats.remote())["env_steps"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(ray.get(actor.env_worker_pid.remote(0)), 9)      # a real crash of the env worker process
    stats = ray.get(done, timeout=120)
    assert stats["terminations"].get("env_error", 0) >= 1
    groups, _ = _read_all(url, cfg, expect=1)
    assert len(groups) == 1
    _check_group(groups[0], cfg, versions=(version,))
    assert any(t.termination == Termination.ENV_ERROR for t in groups[0].trajectories)
    ray.get(actor.close.remote())


def test_add_and_remove_rollout_actors_during_a_run(setup):
    from actors.rollout import create_rollout_actor

    path, inference, url = setup
    cfg = _cfg(path, "test:scale")

    def wait_published(actor, n):
        _wait_for_stats(actor, lambda s: s["groups_published"] >= n)

    v0 = _served_version(inference)
    a = create_rollout_actor(cfg, "ro-1", inference, url)
    run_a = a.run.remote()
    wait_published(a, 1)
    # scale up while A runs
    b = create_rollout_actor(cfg, "ro-2", inference, url)
    run_b = b.run.remote()
    wait_published(b, 1)
    # a weight update while both play: rows say which version sampled them, nothing stops
    from transformers import AutoModelForCausalLM

    from common.weights.sender import ShmTransfer as WeightPublisher
    model = AutoModelForCausalLM.from_pretrained(path)
    WeightPublisher(inference).push(model.state_dict().items(), version=v0 + 1)
    published_a = ray.get(a.stats.remote())["groups_published"]
    wait_published(a, published_a + 2)        # the second one started after the update
    stats_a = ray.get(a.stop.remote(drain=True), timeout=120)   # scale down: A finishes its groups
    assert ray.get(run_a)["groups_published"] == stats_a["groups_published"]
    assert stats_a["groups_discarded"] == 0 and not stats_a["running"]
    stats_b = ray.get(b.stop.remote(drain=False), timeout=60)   # B drops what is in flight
    ray.get(run_b)
    assert not stats_b["running"]

    groups, depth = _read_all(url, cfg, expect=stats_a["groups_published"] + stats_b["groups_published"])
    by_producer = Counter(g.producer for g in groups)
    # exactly what each actor says it published reached the stream, and only whole groups
    assert by_producer == {"ro-1": stats_a["groups_published"], "ro-2": stats_b["groups_published"]}
    assert len({g.group_id for g in groups}) == len(groups) and depth == 0
    for g in groups:
        _check_group(g, cfg, versions=(v0, v0 + 1))
    versions = [s.policy_version for _, _, s in step_rows(groups)]
    assert v0 in versions and v0 + 1 in versions
    for g in groups:           # versions never go backwards inside a trajectory
        for k in range(len(g.trajectories)):
            versions = [s.policy_version for s in steps_of(g, k)]
            assert versions == sorted(versions)
    for actor in (a, b):
        ray.get(actor.close.remote())
        ray.kill(actor)


def test_an_actor_starts_no_group_past_the_lag_bound(setup):
    # common.staleness.policy_lag_bound: (max_policy_lag + 1) x groups_per_batch = 2 groups admitted and not yet
    # trained. The actor's two slots play one group each, then wait for the learner before starting more.
    from actors.rollout import create_rollout_actor
    from common.stream.redis_stream import TrajectoryStream

    path, inference, url = setup
    cfg = _cfg(path, "test:admission")
    cfg.stream.max_policy_lag, cfg.learner.groups_per_batch = 0, 2
    actor = create_rollout_actor(cfg, "ro-lag", inference, url)
    run = actor.run.remote()

    # Both groups in the stream, and an admission refused since (each wait is 1 s): no third group started.
    stats = _wait_for_stats(actor, lambda s: s["groups_published"] == 2 and s["admission_waits"] >= 2)
    assert stats["groups_started"] == 2
    learner = TrajectoryStream(url, cfg.stream, consumer_name="test-learner")
    got = learner.read(max_groups=1, block_ms=1000)
    learner.trained(got)            # trained, its ack awaiting a checkpoint: a slot opens
    _wait_for_stats(actor, lambda s: s["groups_started"] == 3)
    ray.get(actor.stop.remote(drain=False), timeout=60)
    assert ray.get(run, timeout=60)["groups_started"] == 3
    learner.ack(got + learner.read(max_groups=10, block_ms=200))
    ray.get(actor.close.remote())
    ray.kill(actor)


@ray.remote
class NaNInference:
    """A stand-in for an inference actor whose engine returns a NaN log-prob: a mock, for a fault not caused
    for real here (a real engine fed NaN weights fails its sampling rather than answering NaN)."""

    async def generate(self, prompt_ids, sampling):
        return {"response_ids": [5, 6], "logprobs": [float("nan"), -1.0], "policy_version": 0,
                "finish_reason": "length"}


@pytest.mark.fault
def test_a_group_with_a_nan_log_prob_is_dropped_and_counted_not_published(setup):
    from actors.rollout import create_rollout_actor

    path, _, url = setup
    cfg = _cfg(path, "test:nan", groups_per_actor=1, group_size=2)
    cfg.env.max_steps = 1
    broken = NaNInference.remote()
    actor = create_rollout_actor(cfg, "ro-nan", [broken], url)
    stats = ray.get(actor.run.remote(max_groups=1), timeout=120)
    assert stats["groups_invalid"] == 1 and stats["groups_published"] == 0
    assert _read_all(url, cfg, expect=None)[1] == 0          # nothing reached the stream
    ray.get(actor.close.remote())
    ray.kill(broken)


@pytest.mark.fault
def test_a_hung_inference_engine_is_given_up_after_the_deadline(setup):
    """The module's real vLLM engine hangs for real: its engine processes are SIGSTOPped (the actor still
    takes requests and waits for answers that do not come, as with a stuck engine core or a node that went
    silent). With only that actor, a rollout fails within inference.generate_timeout_s with an error naming
    the actor and the setting. Listed twice, the first request times out and is retried on the second
    entry, by which time the engine runs again (SIGCONT once the timeout is counted): the episode ends."""
    from actors.rollout import create_rollout_actor
    from common.weights.shm_cleanup import descendants

    path, inference, url = setup
    engine = inference[0]
    # The engine answers a 24-token request in well under a second once warm (the warm-up takes the first
    # request's one-time costs out); a 15 s deadline leaves room for a loaded machine.
    ray.get(engine.generate.remote([1, 2, 3], {"max_tokens": 4, "temperature": 1.0}), timeout=120)
    engine_pids = descendants(ray.get(engine.pid.remote()))
    assert engine_pids, "the inference actor has no engine processes"
    cfg = _cfg(path, "test:hung", groups_per_actor=1, group_size=1)
    cfg.inference.generate_timeout_s = 15.0
    cfg.env.max_steps = 1

    def signal_engine(sig: int) -> None:
        for pid in engine_pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    try:
        signal_engine(signal.SIGSTOP)
        alone = create_rollout_actor(cfg, "ro-h1", [engine], None)
        with pytest.raises(ray.exceptions.RayTaskError,
                           match=r"inference actor 0 gave no answer within inference\.generate_timeout_s \(15 s\)"):
            ray.get(alone.play_tasks.remote(["gen/train/00000"]), timeout=60)
        ray.get(alone.close.remote())

        twice = create_rollout_actor(cfg, "ro-h2", [engine, engine], None)
        playing = twice.play_tasks.remote(["gen/train/00000"])
        deadline = time.monotonic() + 60
        while ray.get(twice.stats.remote()).get("inference_timeouts", 0) < 1:
            assert time.monotonic() < deadline, "the hung request did not time out within 60 s"
            time.sleep(0.2)
        signal_engine(signal.SIGCONT)
        episodes = ray.get(playing, timeout=120)
        stats = ray.get(twice.stats.remote())
        assert len(episodes) == 1 and episodes[0].num_rows == 1
        assert stats["inference_timeouts"] == 1 and stats["inference_retries"] == 1
        ray.get(twice.close.remote())
    finally:
        signal_engine(signal.SIGCONT)


def test_an_evaluation_replays_the_same_episodes_for_the_same_policy(setup):
    """Two evaluations of one policy play the same episodes, response for response: each request's seed
    comes from the run's seed, the task's place in the list and the step, and the engine honours it whatever
    else it batches. So the difference between two evaluations of one run is the policy's (paired, with
    common random numbers), not the sampler's."""
    from actors.rollout import create_rollout_actor

    path, inference, _ = setup
    cfg = _cfg(path, "test:eval-twice", temperature=1.0)
    tasks = [f"gen/train/{i:05d}" for i in range(4)]

    def responses() -> list[list[list[int]]]:
        """Each task's responses, step by step, as a fresh actor named as actors.evaluation names its own
        plays them."""
        actor = create_rollout_actor(cfg, "eval", inference, None)
        episodes = ray.get(actor.play_tasks.remote(tasks, 0), timeout=120)
        ray.get(actor.close.remote())
        return [[s.response_ids.tolist() for s in steps_of(e, 0)] for e in episodes]

    first = responses()
    assert responses() == first and sum(map(len, first)) >= len(tasks)
    cfg.run.seed = 1        # another run's seed: other samples
    assert responses() != first
