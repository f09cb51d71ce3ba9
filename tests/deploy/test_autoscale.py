"""deploy/autoscale.py: the decision rule against a fluid model of the system, and its bounds.

The model (`Plant`): each rollout actor runs `slots` groups at a time, a group takes `play_s` seconds, so the
actors can produce n * slots / play_s groups/s; the engines can serve at most `engine_groups_per_s` per
inference actor; the learner trains `batch` groups per step of `step_s` seconds. Over an interval the
groups that flow are the least of the three rates, and each side waits for the rest of its time: the learner
for groups, the producers' slots for admission (what the stream's bound does when they outrun the learner).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest

from common.config import AutoscaleConfig
from common.metrics import ActorMetrics
from deploy.autoscale import Controller, Measures

INTERVAL_S = 60.0


@dataclass
class Plant:
    step_s: float = 2.0                 # learner step: 8 groups / 2 s = 4 groups/s wanted
    batch: int = 8
    slots: int = 2
    play_s: float = 10.0                # per actor: 2 / 10 = 0.2 groups/s, so 20 actors feed the learner
    generation: float = 0.5             # the policy's share of a played step's waits, engines not saturated
    engine_groups_per_s: float = 1e9    # per inference actor
    noise: float = 0.0                  # +- relative noise on the producers' rate, per interval

    def measure(self, rollout: int, inference: int, rng: random.Random) -> Measures:
        produce = rollout * self.slots / self.play_s * (1 + rng.uniform(-self.noise, self.noise))
        engines = inference * self.engine_groups_per_s
        consume = self.batch / self.step_s
        flow = min(produce, engines, consume)
        slot_s = rollout * self.slots * INTERVAL_S
        played_s = slot_s * min(flow / produce, 1.0) if produce else 0.0
        # Producers held back by the engines wait on generation, not on admission.
        engine_bound = engines < min(produce, consume)
        admission_s = 0.0 if engine_bound else slot_s - played_s
        generation = 0.95 if engine_bound else self.generation
        return Measures(seconds=INTERVAL_S, learner_wait_s=INTERVAL_S * (1 - flow / consume), slot_s=slot_s,
                        admission_wait_s=admission_s, generate_wait_s=(slot_s - admission_s) * generation,
                        env_wait_s=(slot_s - admission_s) * (1 - generation))


def run(controller: Controller, plant: Plant, intervals: int, rollout: int, inference: int = 1,
        rng: random.Random | None = None, trace: list | None = None) -> tuple[int, int]:
    rng = rng or random.Random(0)
    for _ in range(intervals):
        m = plant.measure(rollout, inference, rng)
        d = controller.decide(m, rollout, inference)
        if trace is not None:
            trace.append((rollout, inference, m, d))
        rollout, inference = d.rollout, d.inference
    return rollout, inference


def changes(trace: list) -> int:
    return sum(1 for _, _, _, d in trace if d.action.startswith(("add", "remove")))


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_actors_follow_a_learner_that_speeds_up_then_slows_down_without_oscillating(noise):
    """A learner whose step time halves, then doubles: the rollout actors follow within 12 intervals
    each time (a change takes patience 2 + 1 settling interval, and each at most doubles: 4 -> 20 is 3
    changes, 20 -> 40 is 1-2), the learner's wait and the admission waits end under their targets, and
    the counts then stay put (two or fewer changes after each phase's first 12 intervals: the dead band
    between the rules is wider than the noise)."""
    cfg = AutoscaleConfig(enabled=True, decision_interval_s=INTERVAL_S)
    controller, plant, rng = Controller(cfg, max_rollout=64, min_inference=1), Plant(noise=noise), random.Random(1)
    rollout = 4
    for step_s, need in ((2.0, 20), (1.0, 40), (2.0, 20)):
        plant.step_s = step_s
        settle, rest = [], []
        rollout, _ = run(controller, plant, 12, rollout, rng=rng, trace=settle)
        rollout, _ = run(controller, plant, 20, rollout, rng=rng, trace=rest)
        assert need <= rollout <= need * 1.25, (step_s, [(r, d.action) for r, _, _, d in settle + rest])
        assert changes(settle) <= 4 and changes(rest) <= (2 if noise else 0), [d.reason for *_, d in rest]
        last = rest[-1][2]
        assert last.learner_wait <= cfg.learner_wait_target + noise, last
        assert last.admission_wait <= cfg.admission_wait_target, last


def test_a_change_needs_patience_and_the_interval_after_it_is_not_counted():
    cfg = AutoscaleConfig(enabled=True, patience=3)
    controller = Controller(cfg, max_rollout=64, min_inference=1)
    starved = Measures(seconds=60, learner_wait_s=30, slot_s=100, admission_wait_s=0, generate_wait_s=1,
                       env_wait_s=1)
    fed = Measures(seconds=60, learner_wait_s=0, slot_s=100, admission_wait_s=0, generate_wait_s=1, env_wait_s=1)
    actions = [controller.decide(m, 4, 1).action for m in (starved, starved, fed, starved, starved, starved)]
    assert actions == ["hold"] * 5 + ["add_rollout"]         # a fed interval between breaks the streak
    d = controller.decide(starved, 4, 1)
    assert (d.rollout, d.action) == (4, "hold") and d.reason.startswith("settling")
    assert controller.decide(starved, 4, 1).action == "hold"  # counting from 1 again


def test_growth_is_proportional_to_the_learners_wait_and_bounded():
    cfg = AutoscaleConfig(enabled=True, patience=1)

    def up(wait_share: float, rollout: int, max_rollout: int = 64) -> int:
        m = Measures(seconds=100, learner_wait_s=100 * wait_share, slot_s=1, admission_wait_s=0,
                     generate_wait_s=1, env_wait_s=1)
        return Controller(cfg, max_rollout, 1).decide(m, rollout, 1).rollout

    assert up(0.5, 10) == 20          # producers deliver half: twice as many
    assert up(0.2, 10) == 13          # 10 / 0.8 = 12.5
    assert up(0.99, 10) == 20         # at most x2 per decision
    assert up(0.11, 3) == 4           # at least one more
    assert up(0.5, 10, max_rollout=12) == 12


def test_shrinking_keeps_headroom_and_the_floor():
    cfg = AutoscaleConfig(enabled=True, patience=1, min_rollout_actors=3)

    def down(admission_share: float, rollout: int) -> tuple[int, str]:
        m = Measures(seconds=100, learner_wait_s=0, slot_s=100, admission_wait_s=100 * admission_share,
                     generate_wait_s=1, env_wait_s=1)
        d = Controller(cfg, 64, 1).decide(m, rollout, 1)
        return d.rollout, d.action

    assert down(0.5, 40) == (22, "remove_rollout")     # 40 * 0.5 * 1.1
    assert down(0.9, 40) == (20, "remove_rollout")     # at most halved
    assert down(0.3, 10) == (8, "remove_rollout")      # ceil(10 * 0.7 * 1.1) = 8
    assert down(0.5, 4) == (3, "remove_rollout")       # the floor
    assert down(0.5, 3) == (3, "hold")


def test_a_learner_that_waits_a_little_is_not_shrunk_from():
    """The dead band: producers that wait on admission while the learner waits between half its target
    and its target are left alone (removing producers would starve it)."""
    cfg = AutoscaleConfig(enabled=True, patience=1)
    m = Measures(seconds=100, learner_wait_s=7, slot_s=100, admission_wait_s=60, generate_wait_s=1, env_wait_s=1)
    assert Controller(cfg, 64, 1).decide(m, 10, 1).action == "hold"


def test_generation_bound_groups_get_an_inference_actor_and_it_goes_first_when_shrinking():
    """Engines that serve 1 group/s each, a learner that wants 4: adding rollout actors would only queue at
    the engine; the controller adds inference actors up to autoscale.max_inference_actors, then rollout
    actors. When the learner slows down, rollout actors go to their floor, then the added inference actors."""
    cfg = AutoscaleConfig(enabled=True, max_inference_actors=4, min_rollout_actors=2)
    controller = Controller(cfg, max_rollout=64, min_inference=1)
    plant = Plant(engine_groups_per_s=1.0)
    trace: list = []
    rollout, inference = run(controller, plant, 40, rollout=20, inference=1, trace=trace)
    assert inference == 4 and 20 <= rollout <= 25, [(r, i, d.action) for r, i, _, d in trace]
    assert [d.action for *_, d in trace if d.action != "hold"][:3] == ["add_inference"] * 3
    plant.step_s = 1000.0           # the learner nearly stops: producers wait on admission
    rollout, inference = run(controller, plant, 60, rollout, inference)
    assert (rollout, inference) == (2, 1)


def test_a_learner_waiting_behind_the_streams_bound_gets_no_more_producers():
    """Producers waiting on admission while the learner waits for groups: the stream's bound (trained groups
    awaiting a checkpoint count against it) holds the groups back; more actors would wait as well."""
    cfg = AutoscaleConfig(enabled=True, patience=1)
    m = Measures(seconds=60, learner_wait_s=20, slot_s=100, admission_wait_s=50, generate_wait_s=1, env_wait_s=1)
    d = Controller(cfg, 64, 1).decide(m, 4, 1)
    assert (d.rollout, d.action) == (4, "hold") and "raise stream.max_stream_groups" in d.reason


def test_no_actor_is_added_while_some_wait_for_a_node():
    cfg = AutoscaleConfig(enabled=True, patience=1)
    starved = Measures(seconds=60, learner_wait_s=60, slot_s=1, admission_wait_s=0, generate_wait_s=1,
                       env_wait_s=1)
    controller = Controller(cfg, 64, 1)
    d = controller.decide(starved, 8, 1, pending=4)
    assert (d.rollout, d.action) == (8, "wait_for_nodes") and "4 actor(s) wait for a node" in d.reason
    assert controller.decide(starved, 8, 1, pending=0).action == "add_rollout"     # not settling: nothing changed


def test_inference_actors_are_left_alone_by_default():
    cfg = AutoscaleConfig(enabled=True, patience=1)       # max_inference_actors = 0
    engine_bound = Measures(seconds=60, learner_wait_s=30, slot_s=100, admission_wait_s=0, generate_wait_s=95,
                            env_wait_s=5)
    d = Controller(cfg, 64, min_inference=2).decide(engine_bound, 8, 2)
    assert (d.rollout, d.inference, d.action) == (16, 2, "add_rollout")


def test_measures_are_shares_of_their_own_time():
    m = Measures(seconds=0, learner_wait_s=0, slot_s=0, admission_wait_s=0, generate_wait_s=0, env_wait_s=0)
    assert m.shares() == {"learner_wait": 0.0, "admission_wait": 0.0, "generation": 0.0}
    m = Measures(seconds=10, learner_wait_s=12, slot_s=40, admission_wait_s=10, generate_wait_s=3, env_wait_s=1)
    assert m.shares() == {"learner_wait": 1.0, "admission_wait": 0.25, "generation": 0.75}


# -- the driver's side, on the real control plane: Ray actors, the Redis stream and its admission rule ------

PLAY_S = 1.0            # a stand-in group's play: 2 slots per actor make 2 groups/s per actor
BATCH = 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rollout_pool_follows_a_learner_whose_step_halves_then_doubles(simulated_cluster, redis_url):
    """Stand-in rollout actors (tests/support/scale_standins.py), spread over 3 simulated Ray nodes, publish
    through the real stream and its admission bound; a stand-in learner trains 4-group batches in 0.5 s (8
    groups/s: 4 actors' worth), then 0.25 s (8 actors' worth), then 0.5 s again; the driver's Autoscale decides
    every 2 s, with the real RolloutPool adding and draining actors. Each phase's count ends between its need and
    1.5x it (the learner's reads and Ray's calls take time the fluid model above leaves out), each phase changes
    it at most 3 times, the actors run on more than one node, and every group published was trained exactly
    once."""
    import types

    import ray

    from common.config import load_config
    from deploy.autoscale import Autoscale
    from deploy.rollout_pool import RolloutPool
    from tests.support.scale_standins import StandInLearner, StandInRollout

    cfg = load_config(None, ["autoscale.enabled=true", "autoscale.decision_interval_s=2", "rollout.groups_per_actor=2",
                             "stream.max_stream_groups=32", f"learner.groups_per_batch={BATCH}",
                             "stream.run_id=autoscale-harness", "run.name=autoscale-harness"])
    spread = StandInRollout.options(resources={"sim_node": 1}, scheduling_strategy="SPREAD")
    rollouts = RolloutPool(cfg, lambda actor_id: spread.remote(actor_id, redis_url, cfg.stream,
                                                               cfg.rollout.groups_per_actor, PLAY_S))
    learner = StandInLearner(redis_url, cfg.stream, BATCH, step_s=0.5)
    inference = types.SimpleNamespace(serving=["a stand-in"], starting=[])     # autoscale leaves it alone here
    rollouts.start(2)
    autoscale = Autoscale(cfg, rollouts, inference, {"learner process": {}, "rollout actor": {}, "inference actor": {}},
                          ActorMetrics("driver", cfg.run.name))
    seen = []
    try:
        for step_s, need, seconds in ((0.5, 4, 20), (0.25, 8, 20), (0.5, 4, 25)):
            learner.step_s = step_s
            decisions = []
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                waited = learner.step(timeout_s=1.0)
                autoscale.learner_waited(time.monotonic() - t0 - step_s if waited is not None else
                                         time.monotonic() - t0)
                rollouts.reap_retired()
                decision = autoscale.tick()
                if decision is not None:
                    decisions.append(decision)
            count = len(rollouts.live)
            nodes = {n["node_id"] for n in ray.get([a.handle.node.remote() for a in rollouts.live], timeout=30)}
            seen.append((step_s, count, len(nodes), [(d.action, d.rollout) for d in decisions if d.action != "hold"]))
            assert need <= count <= need * 1.5, (seen, [d.reason for d in decisions])
            assert sum(d.action.startswith(("add", "remove")) for d in decisions) <= 3, seen
    finally:
        rollouts.scale(0, drain=True)
        deadline = time.monotonic() + 60
        while rollouts.retiring and time.monotonic() < deadline:
            learner.step(timeout_s=0.5)         # consuming frees admission for slots still waiting
            rollouts.reap_retired(timeout_s=0.1)
        learner.drain()
        published = rollouts.stats().get("groups_published", 0)
        rollouts.stop_all(10)
        learner.close()
    assert len(learner.trained) == len(set(learner.trained)) == published > 0, seen
    assert max(n for _, _, n, _ in seen) > 1, seen         # (SPREAD: Ray puts them on several nodes)


@pytest.mark.slow
def test_actors_waiting_for_a_node_stop_growth_and_ask_rays_autoscaler(simulated_cluster, redis_url, monkeypatch,
                                                                       caplog):
    """A rollout actor that needs a resource no node has stays unplaced: the driver's stats() calls do not wait
    for it (it is reported once), the next decision adds none, asks Ray's autoscaler for room for the run's
    actors (the real request_resources of this Ray), and the run's end withdraws the request; removing the
    unplaced actor kills it at once (RolloutPool)."""
    import types

    from common.config import load_config
    from deploy import rollout_pool
    from deploy.autoscale import Autoscale
    from deploy.reports import PlacementWatch
    from deploy.rollout_pool import RolloutPool
    from tests.support.scale_standins import StandInRollout

    cfg = load_config(None, ["autoscale.enabled=true", "autoscale.patience=1", "stream.run_id=autoscale-nodes"])
    unplaceable = StandInRollout.options(resources={"a_node_no_one_has": 1})
    rollouts = RolloutPool(cfg, lambda actor_id: unplaceable.remote(actor_id, redis_url, cfg.stream, 1, PLAY_S))
    now = [0.0]
    inference = types.SimpleNamespace(serving=["a stand-in"], starting=[])
    rollouts.start(1)
    try:
        autoscale = Autoscale(cfg, rollouts, inference, {"learner process": {"CPU": 1.0}, "inference actor": {},
                                                         "rollout actor": {"a_node_no_one_has": 1.0}},
                              ActorMetrics("driver", cfg.run.name), clock=lambda: now[0])
        placement = PlacementWatch().refresh(rollouts.handles(), timeout_s=1.0)
        assert placement == {"rollout-0": None}
        monkeypatch.setattr(rollout_pool, "UNSTARTED_SAY_S", 0.0)
        for _ in range(2):
            t0 = time.monotonic()
            assert rollouts.stats() == {}
            # (a placed actor's answer is waited for STATS_WAIT_S; this one's never comes, and is not waited for)
            assert time.monotonic() - t0 < rollout_pool.STATS_WAIT_S / 2
        assert sum("rollout-0 not started" in r.getMessage() for r in caplog.records) == 1
        now[0] += cfg.autoscale.decision_interval_s
        autoscale.learner_waited(cfg.autoscale.decision_interval_s)      # the learner waited all along
        decision = autoscale.tick(pending=1)
        assert (decision.action, decision.rollout, len(rollouts.live)) == ("wait_for_nodes", 1, 1), decision
        assert autoscale.requested and "wait for a node" in autoscale.status()
        autoscale.close()
        assert not autoscale.requested
        # Removed before it was ever placed, it holds nothing: gone at once, not retiring until a node comes.
        rollouts.scale(0)
        assert not rollouts.actors
    finally:
        rollouts.stop_all(5)
