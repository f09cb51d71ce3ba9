"""The run's learner ranks (one `learner.actor.LearnerWorker` each): started together, called together,
checked and closed together.

    learners = LearnerPool()
    learners.start(cfg, model, stream_url, inference_actors)   # model: a common.processes.model_files.ModelSource
    metrics, record = learners.call("step", 10.0, timeout_s=600)   # one update on every rank; rank 0's metrics
                                                     # and groups.jsonl line (the driver writes it)
    learners.call("set_inference_actors", actors, timeout_s=1200)   # `gigpo scale --inference`
    learners.state()                                 # rank 0's counters
    learners.untrained_groups()                      # what the stream holds for the learner to train
    learners.nodes[r]                                # the node rank r runs on
    learners.lost()                                  # after a failure: the ranks Ray reports dead
    learners.stop_all()                              # close (checkpoint), then kill

Start-up takes three steps, each with a deadline, so that a cluster that cannot run the learner says why
instead of hanging: the ranks start and report their nodes (PLACEMENT_TIMEOUT_S); every rank joins
torch.distributed at an address rank 0 names on its node (RENDEZVOUS_TIMEOUT_S; the error names each rank's
node); each rank builds its `learner.loop.Learner` from the model as its node sees it.

Which learner methods the driver calls is declared once (`EVERY_RANK`, after verl's declared fan-out): each
goes to every rank (they run collectives together) and gives rank 0's answer; a rank that fails ends the wait
at once (the others may wait for it in a collective that never ends), late ranks are named with their nodes.
"""
from __future__ import annotations

import logging
import time

import ray

from common.config import ExperimentConfig
from common.processes.actor_calls import call_all, wait_all
from common.processes.placement import (LEARNER_CPUS_PER_PROCESS, PLACEMENT_TIMEOUT_S, PlacementError, actor_need,
                                        alive_nodes, format_need, node_label, wait_placeable)
from learner.actor import LearnerWorker

log = logging.getLogger("gigpo")

RENDEZVOUS_TIMEOUT_S = 300.0     # every rank joins torch.distributed within this (they are all placed by then)
STEP_TIMEOUT_S = 3600.0          # one update on every rank beyond its wait for data; generous: a large model's
                                 # update, a checkpoint and a weight push all fit
LEARNER_CLOSE_S = 300    # a learner's close may save a checkpoint (of a large model: minutes)
LOST_CHECK_S = 15.0      # how long the driver waits for a learner rank's answer whether it lives, after a failure
LOST_DECIDE_S = 90.0     # ... and how long it asks again one that Ray calls unavailable (a node that stopped
                         # answering is declared dead by Ray's health checks, 15-60 s by its defaults)
LOST_ASK_AGAIN_S = 1.0

# The `learner.actor.LearnerWorker` methods the driver calls, each on every rank at once, and what a rank late
# at the call's deadline did not do (and why that may be), for the error that names it.
EVERY_RANK = {
    "step": "finish an update (a hung collective or a dead node?)",
    "set_inference_actors": "take the new inference actors (a weight push to them that hangs?)",
    "sync_weights": "push the weights to the inference actors (a push that hangs?)",
    "save_checkpoint": "save a checkpoint (a slow or full disk?)",
}


class LearnerPool:
    """The learner ranks' actor handles in rank order (`ranks`) and the node each runs on (`nodes`); empty
    until `start` and after `stop_all`."""

    def __init__(self):
        self.ranks: list = []
        self.nodes: list[dict] = []
        self.lost_ranks: list[int] = []     # ranks `lost` found dead: stop_all kills the others at once

    def start(self, cfg: ExperimentConfig, model, stream_url: str | None, inference_actors: list,
              read_only: bool = False, log_dir: str = "", placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
              rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> None:
        """`learner.num_processes` ranks, each reserving one process's share of GPUs (or one CPU) and
        `learner.resources` on its node; model: a common.processes.model_files.ModelSource; read_only: they serve a
        checkpoint for evaluation (see `Learner`); log_dir: rank r's output goes to <log_dir>/learner-<r>.log.
        Raises PlacementError (after killing them) when they cannot be placed or cannot meet in time."""
        n = cfg.learner.num_processes
        gpus = cfg.learner.gpus_per_process
        actor_cls = ray.remote(LearnerWorker)
        ranks = [actor_cls.options(num_cpus=LEARNER_CPUS_PER_PROCESS, num_gpus=gpus,
                                   resources=cfg.learner.resources or None, name=None).remote(cfg, rank, n, log_dir)
                 for rank in range(n)]
        try:
            need = actor_need(LEARNER_CPUS_PER_PROCESS, gpus, cfg.learner.resources)
            wait_placeable({"the learner (each of its processes)": need}, placement_timeout_s, log=log)
            placed = wait_all([rank.node.remote() for rank in ranks], placement_timeout_s, fail_fast=True)
            placed.raise_first_error()
            if placed.late:
                raise PlacementError(
                    f"learner rank(s) {placed.late} did not start within {placement_timeout_s:.0f} s (each needs "
                    f"{format_need(need)}, and a node offers it but has not given it: busy? see `ray status`)")
            self.ranks, self.nodes = ranks, list(placed.done.values())
            master_addr, master_port = ray.get(ranks[0].rendezvous_address.remote())
            node_ids = [node["node_id"] for node in self.nodes]
            joined = wait_all([worker.join.remote(master_addr, master_port, node_ids.count(node_ids[rank]))
                               for rank, worker in enumerate(ranks)], rendezvous_timeout_s, fail_fast=True)
            joined.raise_first_error()
            if joined.late:
                raise PlacementError(
                    f"learner rank(s) {joined.late} did not join torch.distributed at {master_addr}:{master_port} "
                    f"(rank 0's node) within {rendezvous_timeout_s:.0f} s; {self.where()}: can every learner node "
                    f"reach {master_addr} on TCP (a firewall between nodes)? Their logs: learner-<rank>.log")
            ray.get([worker.build.remote(model, stream_url, inference_actors, read_only) for worker in ranks])
        except BaseException:
            for worker in ranks:
                ray.kill(worker)
            self.ranks, self.nodes = [], []
            raise

    def where(self, ranks: list[int] | None = None) -> str:
        """"rank 0 on 10.0.0.2 (host-a), rank 1 on ..." for error messages."""
        ranks = range(len(self.ranks)) if ranks is None else ranks
        return ", ".join(f"rank {r} on {node_label(self.nodes[r])}" for r in ranks)

    # -- calls to every rank ----------------------------------------------------------------------------

    def state(self) -> dict:
        """Rank 0's counters (`LearnerWorker.state`)."""
        return ray.get(self.ranks[0].state.remote())

    def untrained_groups(self, timeout_s: float = 60.0) -> int:
        """Groups the stream holds that the learner has still to train (rank 0 reads the stream)."""
        return ray.get(self.ranks[0].untrained_groups.remote(), timeout=timeout_s)

    def call(self, method: str, *args, timeout_s: float, on_wait=None):
        """`LearnerWorker.<method>(*args)` on every rank (a method of `EVERY_RANK`); rank 0's answer. What a rank
        raised is raised at once; TimeoutError names the ranks still busy after timeout_s, with their nodes.
        on_wait: called every common.processes.actor_calls.ON_WAIT_EVERY_S while the ranks work."""
        if method not in EVERY_RANK:
            raise ValueError(f"{method!r} is not a learner call the driver makes (EVERY_RANK: {sorted(EVERY_RANK)})")
        answers = wait_all([getattr(worker, method).remote(*args) for worker in self.ranks], timeout_s,
                           fail_fast=True, on_wait=on_wait)
        answers.raise_first_error()
        if answers.late:
            raise TimeoutError(f"learner {self.where(answers.late)} did not {EVERY_RANK[method]} within "
                               f"{timeout_s:.0f} s; see learner-<rank>.log in the run's logs")
        return answers.done.get(0)

    # -- health and close ------------------------------------------------------------------------------

    def lost(self, timeout_s: float = LOST_CHECK_S, decide_s: float = LOST_DECIDE_S) -> list[str]:
        """The ranks Ray reports dead (their process, or their node), one line each; kept in `lost_ranks`. A
        rank that does not answer within timeout_s (busy in a collective with a dead one, or hung) is not
        counted; one Ray calls unavailable (health checks pending) is asked again for up to decide_s."""
        lines: list[str] = []
        if not self.ranks or not ray.is_initialized():
            return lines
        start = time.monotonic()
        asks = {rank: (worker.node.remote(), start) for rank, worker in enumerate(self.ranks)}

        def node_gone(rank: int, alive: set) -> bool:
            return self.nodes[rank]["node_id"] not in alive

        def say_lost(rank: int, alive: set) -> None:
            self.lost_ranks.append(rank)
            lines.append(f"learner rank {rank} on node {node_label(self.nodes[rank])}: " + (
                "the node is gone (it left the Ray cluster)" if node_gone(rank, alive) else "its process died"))

        while asks:
            asked_ranks = list(asks)
            answers = wait_all([asks[rank][0] for rank in asked_ranks], LOST_ASK_AGAIN_S)
            alive, now = {node["node_id"] for node in alive_nodes()}, time.monotonic()
            for i, rank in enumerate(asked_ranks):
                if i in answers.late:
                    if now - asks[rank][1] >= timeout_s or now - start >= decide_s:
                        del asks[rank]     # no answer: busy, or on a node Ray has not yet declared dead
                        if node_gone(rank, alive):
                            say_lost(rank, alive)
                    continue
                del asks[rank]
                if i in answers.failed:
                    raise answers.failed[i]
                exc = answers.lost.get(i)
                if exc is None:
                    continue
                if node_gone(rank, alive) or isinstance(exc, ray.exceptions.ActorDiedError):
                    say_lost(rank, alive)
                elif now - start < decide_s:        # unavailable: Ray has not decided yet
                    time.sleep(LOST_ASK_AGAIN_S)
                    asks[rank] = (self.ranks[rank].node.remote(), time.monotonic())
        return lines

    def stop_all(self, timeout_s: float = LEARNER_CLOSE_S, say=log.warning) -> None:
        """Close every rank (it checkpoints uncommitted updates), then kill it. After a lost rank (`lost`), the
        others are killed at once: they would wait for it in the close's collectives."""
        try:
            if not self.lost_ranks:
                closed = call_all(self.ranks, "close", timeout_s=timeout_s)
                for exc in closed.errors.values():   # a dead learner has nothing left to save
                    # (After a lost Redis: expected, its checkpoint is written before the acks that fail.)
                    say("learner close failed: %s", exc)
                if closed.late:
                    say("%d learner(s) did not close within %d s: killed", len(closed.late), timeout_s)
            for worker in self.ranks:
                ray.kill(worker)
        finally:
            self.ranks, self.nodes, self.lost_ranks = [], [], []
