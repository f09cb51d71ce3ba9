"""Rollout that sizes itself (`autoscale.enabled`): once per `autoscale.decision_interval_s` the driver measures
who waited on whom over the interval and moves the actor counts toward what keeps the learner fed.

The measures (each a share of time over the interval, on the dashboard as `autoscale_share`):

    learner_wait    the learner's time waiting for groups / the interval         -> too few producers
    admission_wait  rollout slots' time waiting for the stream's admission bound  -> too many producers
                    / the slots' running time
    generation      of the time played steps waited on the policy or the environment, the policy's share
                    -> more producers only queue at the engines: add an inference actor instead

The rule, `Controller.decide` (pure: the tests drive it with a fluid model of the system):
- the learner waits more than `learner_wait_target` (and the producers do not wait on admission: if they do,
  the stream's bound is what holds the groups back, and the controller says so instead): producers deliver
  (1 - w) of what it takes, so the rollout actors go from n to n / (1 - w) (at least +1, at most x2 per
  decision); or, where the groups wait on generation and an inference actor may be added, one inference actor
  more;
- slots wait on admission more than `admission_wait_target` while the learner waits under half its target:
  a share a of the producers' time is surplus, so n goes to n (1 - a) with a tenth's headroom (at least -1, at
  most halved), draining the removed actors (their groups are published: nothing is lost); at the fewest
  rollout actors, an inference actor the controller added goes instead;
- a change needs `patience` consecutive intervals that call for it, and the interval after a change is not
  counted (the actors it added start in it): the dead band between the two rules and the patience are the
  hysteresis that keeps the counts from oscillating;
- while actors it added wait for a node, it adds none, and (autoscale.request_nodes) asks Ray's autoscaler
  for room for all of the run's actors (`request_resources`), a request it shrinks as actors go and clears
  when the run ends.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from common.config import AutoscaleConfig, ExperimentConfig, rollout_actor_limit
from common.metrics import AUTOSCALE_DECISIONS, ActorMetrics

log = logging.getLogger("gigpo")

MAX_GROWTH = 2.0        # a decision at most doubles the rollout actors, or halves them
SHRINK_HEADROOM = 1.1   # producers kept above the measured need when removing (measures are noisy)


@dataclass(frozen=True)
class Measures:
    """What one interval measured (seconds)."""
    seconds: float              # the interval's wall time
    learner_wait_s: float       # of which the learner waited for groups
    slot_s: float               # rollout slots' running time (each actor's x rollout.groups_per_actor, summed)
    admission_wait_s: float     # of which they waited for admission
    generate_wait_s: float      # played steps' time waiting on the policy (summed over trajectories)
    env_wait_s: float           # ... and on the environments

    @property
    def learner_wait(self) -> float:
        return min(self.learner_wait_s / self.seconds, 1.0) if self.seconds > 0 else 0.0

    @property
    def admission_wait(self) -> float:
        return min(self.admission_wait_s / self.slot_s, 1.0) if self.slot_s > 0 else 0.0

    @property
    def generation(self) -> float:
        played = self.generate_wait_s + self.env_wait_s
        return self.generate_wait_s / played if played > 0 else 0.0

    def shares(self) -> dict[str, float]:
        """{measure: share}, as `autoscale_share` labels them."""
        return {"learner_wait": self.learner_wait, "admission_wait": self.admission_wait,
                "generation": self.generation}


@dataclass(frozen=True)
class Decision:
    rollout: int                # the rollout actors to run
    inference: int              # the inference actors to run
    action: str                 # one of common.metrics.AUTOSCALE_DECISIONS, or "hold"
    reason: str                 # one line for the log and `gigpo status`


class Controller:
    """The decision rule (module doc). Bounds: rollout actors in [min_rollout, max_rollout]; inference actors
    in [min_inference, max_inference] (max_inference <= min_inference: it never touches them)."""

    def __init__(self, cfg: AutoscaleConfig, max_rollout: int, min_inference: int):
        self.cfg = cfg
        self.min_rollout, self.max_rollout = cfg.min_rollout_actors, max_rollout
        self.min_inference, self.max_inference = min_inference, max(cfg.max_inference_actors, min_inference)
        self.streak = 0             # consecutive intervals calling for the same direction (+ up, - down)
        self.settling = False       # the interval after a change: not counted

    def reset(self) -> None:
        """Counts changed from outside (`gigpo scale`): start counting again."""
        self.streak, self.settling = 0, True

    def decide(self, m: Measures, rollout: int, inference: int, pending: int = 0) -> Decision:
        """The counts to run after an interval that measured `m` with `rollout` and `inference` actors, of
        which `pending` rollout or inference actors wait for a node."""
        cfg = self.cfg
        w, a, g = m.learner_wait, m.admission_wait, m.generation
        said = f"learner waited {w:.0%} (target {cfg.learner_wait_target:.0%}), slots waited for admission " \
               f"{a:.0%} (target {cfg.admission_wait_target:.0%}), generation {g:.0%} of played time"
        if self.settling:
            self.settling = False
            return Decision(rollout, inference, "hold", f"settling after a change; {said}")
        if w > cfg.learner_wait_target and a > cfg.admission_wait_target:
            # Both wait: the stream's bound, not the producers' number, is what holds groups back.
            self.streak = 0
            return Decision(rollout, inference, "hold",
                            f"the stream's bound holds producers back while the learner waits, so more would only "
                            f"wait too: raise stream.max_stream_groups (trained groups awaiting their checkpoint "
                            f"count against it); {said}")
        if w > cfg.learner_wait_target:
            direction = 1
        elif a > cfg.admission_wait_target and w < cfg.learner_wait_target / 2:
            direction = -1
        else:
            self.streak = 0
            return Decision(rollout, inference, "hold", f"within targets: {said}")
        self.streak = self.streak + direction if self.streak * direction > 0 else direction
        if abs(self.streak) < cfg.patience:
            return Decision(rollout, inference, "hold",
                            f"{'up' if direction > 0 else 'down'} {abs(self.streak)}/{cfg.patience}: {said}")
        decision = self._up(w, g, rollout, inference, pending) if direction > 0 else self._down(a, rollout, inference)
        if decision.action.startswith(("add", "remove")):     # a change: count afresh
            self.streak, self.settling = 0, True
        return Decision(decision.rollout, decision.inference, decision.action, f"{decision.reason}: {said}")

    def _up(self, w: float, g: float, rollout: int, inference: int, pending: int) -> Decision:
        if pending:
            return Decision(rollout, inference, "wait_for_nodes",
                            f"{pending} actor(s) wait for a node: none added until they are placed")
        if g > self.cfg.generation_share and inference < self.max_inference:
            return Decision(rollout, inference + 1, "add_inference", "the groups wait on generation")
        if rollout >= self.max_rollout:
            return Decision(rollout, inference, "hold", f"at the most rollout actors ({self.max_rollout})")
        want = math.ceil(rollout / max(1.0 - w, 1.0 / MAX_GROWTH))
        target = min(self.max_rollout, max(rollout + 1, want))
        return Decision(target, inference, "add_rollout", "the learner waits for groups")

    def _down(self, a: float, rollout: int, inference: int) -> Decision:
        if rollout > self.min_rollout:
            want = math.ceil(rollout * (1.0 - a) * SHRINK_HEADROOM)
            target = max(self.min_rollout, math.ceil(rollout / MAX_GROWTH), min(rollout - 1, want))
            return Decision(target, inference, "remove_rollout", "producers wait on the admission bound")
        if inference > self.min_inference:
            return Decision(rollout, inference - 1, "remove_inference",
                            "producers wait on the admission bound at the fewest rollout actors")
        return Decision(rollout, inference, "hold", f"at the fewest actors ({self.min_rollout} rollout)")


class Autoscale:
    """The driver's side: keeps the interval's measures, decides once per interval, applies the decision to
    the rollout and inference pools (deploy/rollout_pool.py, deploy/inference_pool.py), records it."""

    def __init__(self, cfg: ExperimentConfig, rollouts, inference, needs: dict[str, dict], metrics: ActorMetrics,
                 clock=time.monotonic):
        """needs: {role: what one actor of it asks of a node} for the roles of placement.job_needs, what the
        request to Ray's autoscaler is made of; metrics: the driver's, where the decisions are counted."""
        self.cfg, self.rollouts, self.inference, self.needs, self.clock = cfg, rollouts, inference, needs, clock
        self.controller = Controller(cfg.autoscale, cfg.autoscale.max_rollout_actors or rollout_actor_limit(cfg),
                                     cfg.inference.num_actors)
        self.metrics = metrics
        for action in AUTOSCALE_DECISIONS:      # (a series at 0 from the start: the dashboard shows 0, not no data)
            self.metrics.zero("autoscale_decisions", decision=action)
        self.last: Decision | None = None
        self.last_measures: Measures | None = None
        self.requested = False      # a request to Ray's autoscaler stands
        self._start_window({})      # (the actors' counters start at 0)

    def _start_window(self, stats: dict) -> None:
        self._t0, self._stats0, self._learner_wait_s = self.clock(), stats, 0.0

    def restart_window(self) -> None:
        """Measure afresh from now: what came before (an evaluation, when the learner neither trains nor waits
        and producers fill the stream) says nothing about the actors training needs."""
        self._start_window(self.rollouts.stats())

    def learner_waited(self, seconds: float) -> None:
        """The learner waited `seconds` for groups (an update's wait, or a wait that brought no batch)."""
        self._learner_wait_s += max(seconds, 0.0)

    def due(self) -> bool:
        return self.clock() - self._t0 >= self.cfg.autoscale.decision_interval_s

    def measure(self, stats: dict) -> Measures:
        """The interval's measures from the rollout pool's totals now (`stats`) and at its start."""
        def delta(key: str) -> float:
            return max(stats.get(key, 0.0) - self._stats0.get(key, 0.0), 0.0)
        return Measures(seconds=self.clock() - self._t0, learner_wait_s=self._learner_wait_s,
                        slot_s=delta("wall_s") * self.cfg.rollout.groups_per_actor,
                        admission_wait_s=delta("admission_wait_s"), generate_wait_s=delta("gen_wait_s"),
                        env_wait_s=delta("env_wait_s"))

    def tick(self, pending: int = 0) -> Decision | None:
        """Once the interval is over: measure, decide, apply, record; None before. `pending`: the run's actors
        that wait for a node (placement says not started)."""
        if not self.due():
            return None
        stats = self.rollouts.stats()
        m = self.last_measures = self.measure(stats)
        rollout, inference = len(self.rollouts.live), len(self.inference.serving) + len(self.inference.starting)
        decision = self.last = self.controller.decide(m, rollout, inference, pending)
        for measure, share in m.shares().items():
            self.metrics.set("autoscale_share", share, measure=measure)
        if decision.action != "hold":
            self.metrics.inc("autoscale_decisions", decision=decision.action)
        if decision.action != "hold" or "stream.max_stream_groups" in decision.reason:     # (advice: logged too)
            log.info("autoscale: %s -> rollout %d, inference %d (%s)", decision.action, decision.rollout,
                     decision.inference, decision.reason)
        if decision.inference != inference:
            self.inference.scale(decision.inference)
        if decision.rollout != rollout:
            self.rollouts.scale(decision.rollout, drain=True)
        self._request_nodes(decision, pending)
        self._start_window(stats)
        return decision

    def _request_nodes(self, decision: Decision, pending: int) -> None:
        """Room for the run's actors from Ray's autoscaler while some wait for a node; once made, the request
        stands (Ray's autoscaler keeps those nodes) and follows the counts down as actors go (`close` withdraws
        it)."""
        if not self.cfg.autoscale.request_nodes or not (pending or self.requested):
            return
        from ray.autoscaler.sdk import request_resources
        counts = {"learner process": self.cfg.learner.num_processes, "rollout actor": decision.rollout,
                  "inference actor": decision.inference}
        # (the whole run's shapes: Ray's autoscaler counts what already runs against the request)
        bundles = [dict(self.needs[role]) for role, n in counts.items() for _ in range(n) if self.needs[role]]
        if pending:
            if not self.requested:
                log.info("autoscale: %d actor(s) wait for a node; asked Ray's autoscaler for room for %d rollout "
                         "and %d inference actors", pending, decision.rollout, decision.inference)
            request_resources(bundles=bundles)
            self.requested = True
        elif decision.action.startswith("remove"):
            request_resources(bundles=bundles)      # the nodes the removed actors leave idle can go

    def close(self) -> None:
        """The run ends: no standing request for its actors' room."""
        if self.requested:
            from ray.autoscaler.sdk import request_resources
            request_resources(bundles=[])
            self.requested = False

    def figures(self) -> dict[str, float]:
        """The last interval's shares as update metrics (metrics.jsonl, `gigpo status`)."""
        m = self.last_measures
        return {} if m is None else {f"autoscale/{k}_share": v for k, v in m.shares().items()}

    def status(self) -> str:
        """One line for `gigpo status`: the last decision and why."""
        if self.last is None:
            return f"first decision after {self.cfg.autoscale.decision_interval_s:g} s"
        return f"{self.last.action} -> rollout {self.last.rollout}, inference {self.last.inference}: {self.last.reason}"
