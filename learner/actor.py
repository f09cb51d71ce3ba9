"""The learner as Ray actors: one actor per learner process, rank 0 reads the stream and pushes weights.

    workers = create_learner_workers(cfg, model, stream_url, inference_actors)   # model: a ModelSource
    metrics, record = step_learner(workers, timeout_s=600)   # one update on every rank; rank 0's metrics and
                                                             # groups.jsonl line (the driver writes it)
    set_learner_inference(workers, inference_actors, timeout_s=1200)   # `gigpo scale --inference`
    workers.nodes[r]                                     # the node rank r runs on

Start-up takes three steps, each with a deadline, so that a cluster that cannot run the learner says why
instead of hanging: the workers start and report their nodes (PLACEMENT_TIMEOUT_S); every rank joins
torch.distributed at an address rank 0 names on its node (RENDEZVOUS_TIMEOUT_S; the error names each rank's
node); each rank builds its `learner.loop.Learner` from the model as its node sees it.
"""
from __future__ import annotations

import logging
import os
import time

import ray

from common.config import ExperimentConfig
from common.cpu_placement import compute_threads, place_this_process, use_compute_threads
from common.log_files import send_output_to
from common.placement import (LEARNER_CPUS_PER_PROCESS, PLACEMENT_TIMEOUT_S, PlacementError, actor_need, format_need,
                              free_port, node_label, this_node, wait_placeable)
from common.process_env import apply_project_env

log = logging.getLogger("gigpo")

RENDEZVOUS_TIMEOUT_S = 300.0     # every rank joins torch.distributed within this (they are all placed by then)
ON_WAIT_EVERY_S = 10.0           # how often a long wait on the learner lets the driver do its rounds
STEP_TIMEOUT_S = 3600.0          # one update on every rank beyond its wait for data; generous: a large model's
                                 # update, a checkpoint and a weight push all fit


class LearnerWorker:
    """One learner process: joins the process group, then builds `learner.loop.Learner` (see the module)."""

    def __init__(self, cfg: ExperimentConfig, rank: int, world_size: int, log_dir: str = ""):
        apply_project_env()     # vLLM's, DeepSpeed's, ... variables first
        send_output_to(log_dir, f"learner-{rank}")     # DeepSpeed's and torch's output too
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.learner = None

    def node(self) -> dict:
        return this_node()

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP, a TCP port free on it): where the other ranks find rank 0."""
        return ray.util.get_node_ip_address(), free_port("")

    def join(self, master_addr: str, master_port: int, ranks_on_node: int = 1) -> None:
        """Join the process group at rank 0's address (returns once every rank has joined). ranks_on_node:
        the learner ranks on this rank's node, which share its CPUs."""
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        if self.world_size > 1:
            interface = _interface_of(ray.util.get_node_ip_address())
            if interface:
                # gloo's default is the address the host name resolves to, which can be one the other nodes
                # cannot reach (a loopback entry in /etc/hosts): use the one Ray reaches this node at.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        place_this_process(self.cfg.run.learner_cpus)     # before torch starts its threads
        threads = compute_threads(self.cfg.run.learner_cpus, ranks_on_node)
        use_compute_threads(threads)
        log.info("learner rank %d: %d torch threads (%s, %d learner rank(s) on this node)", self.rank, threads,
                 f"run.learner_cpus={self.cfg.run.learner_cpus}" if self.cfg.run.learner_cpus
                 else f"{len(os.sched_getaffinity(0))} CPUs this process may use", ranks_on_node)
        from learner.trainer import setup_distributed
        setup_distributed()

    def build(self, model, stream_url: str | None, inference_actors: list, read_only: bool = False) -> None:
        """Load the model (`model`: a common.model_files.ModelSource, as this node sees it) and build the
        learner; rank 0 reads the stream and pushes weights."""
        from learner.loop import Learner
        rank0 = self.rank == 0
        self.learner = Learner(self.cfg, model.local_path(), stream_url if rank0 else None,
                               inference_actors=inference_actors if rank0 else None, read_only=read_only)

    def step(self, timeout_s: float | None = None) -> tuple[dict, dict | None] | None:
        """One update: (its metrics, its groups.jsonl line or None), or None when no batch came in time."""
        metrics = self.learner.step(timeout_s=timeout_s)
        return None if metrics is None else (metrics, self.learner.last_groups_record)

    def sync_weights(self) -> dict:
        """Push the current weights as a new version (after a resume, so that the inference actors serve
        what the learner trains). Every rank calls it (ZeRO-3 gathers are collective)."""
        return self.learner.publish_weights()

    def state(self) -> dict:
        """Counters of this learner process; on rank 0 also its stream reader's (acked, dropped, ...) as they
        are now (metrics.jsonl has them as of the last update, before a closing checkpoint's acks)."""
        lr = self.learner
        return {"updates": lr.updates, "policy_version": lr.policy_version,
                "trained_groups": len(lr.trained_group_ids), **lr.stats,
                "stream": dict(getattr(lr.stream, "stats", {})), "resumed_record": lr.resumed_record}

    def set_inference_actors(self, inference_actors: list) -> dict:
        """The inference actors changed (`gigpo scale --inference`): see `Learner.set_inference_actors`.
        Every rank calls it (a repush gathers collectively at ZeRO-3)."""
        return self.learner.set_inference_actors(inference_actors)

    def save_checkpoint(self) -> str | None:
        return self.learner.save_checkpoint()

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()


def _interface_of(ip: str) -> str:
    """The network interface holding `ip` on this machine ("" if none does)."""
    import psutil
    return next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(a.address == ip for a in addresses)), "")


class LearnerWorkers(list):
    """The learner workers' actor handles in rank order, and `nodes`: the node each rank runs on."""

    def __init__(self, workers: list, nodes: list[dict]):
        super().__init__(workers)
        self.nodes = nodes

    def where(self, ranks: list[int] | None = None) -> str:
        """"rank 0 on 10.0.0.2 (host-a), rank 1 on ..." for error messages."""
        ranks = range(len(self)) if ranks is None else ranks
        return ", ".join(f"rank {r} on {node_label(self.nodes[r])}" for r in ranks)


def _wait_all(refs: list, timeout_s: float, on_wait=None) -> list[int]:
    """Wait up to timeout_s for every ref; the indices of those still not ready. A failed call raises at once
    (the other ranks may wait for it in a collective that never ends). on_wait: called every ON_WAIT_EVERY_S
    while waiting (the driver looks after its other actors)."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        left = max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1,
                                 timeout=min(left, ON_WAIT_EVERY_S) if on_wait is not None else left)
        if not done:
            if on_wait is None or time.monotonic() >= deadline:
                break
            on_wait()
            continue
        ray.get(done)
    late = set(pending)
    return [i for i, ref in enumerate(refs) if ref in late]


def create_learner_workers(cfg: ExperimentConfig, model, stream_url: str | None, inference_actors: list,
                           read_only: bool = False, log_dir: str = "",
                           placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
                           rendezvous_timeout_s: float = RENDEZVOUS_TIMEOUT_S) -> LearnerWorkers:
    """`learner.num_processes` actors, each reserving one process's share of GPUs (or one CPU) and
    `learner.resources` on its node; model: a common.model_files.ModelSource; read_only: they serve a
    checkpoint for evaluation (see `Learner`); log_dir: rank r's output goes to <log_dir>/learner-<r>.log.
    Raises PlacementError (after killing them) when they cannot be placed or cannot meet in time."""
    n = cfg.learner.num_processes
    gpus = cfg.learner.gpus_per_process
    actor_cls = ray.remote(LearnerWorker)
    workers = [actor_cls.options(num_cpus=LEARNER_CPUS_PER_PROCESS, num_gpus=gpus,
                                 resources=cfg.learner.resources or None, name=None).remote(cfg, rank, n, log_dir)
               for rank in range(n)]
    try:
        need = actor_need(LEARNER_CPUS_PER_PROCESS, gpus, cfg.learner.resources)
        wait_placeable({"the learner (each of its processes)": need}, placement_timeout_s, log=log)
        node_refs = [w.node.remote() for w in workers]
        late = _wait_all(node_refs, placement_timeout_s)
        if late:
            raise PlacementError(
                f"learner rank(s) {late} did not start within {placement_timeout_s:.0f} s (each needs "
                f"{format_need(need)}, and a node offers it but has not given it: busy? see `ray status`)")
        workers = LearnerWorkers(workers, ray.get(node_refs))
        master_addr, master_port = ray.get(workers[0].rendezvous_address.remote())
        node_ids = [node["node_id"] for node in workers.nodes]
        joins = [w.join.remote(master_addr, master_port, node_ids.count(node_ids[rank]))
                 for rank, w in enumerate(workers)]
        late = _wait_all(joins, rendezvous_timeout_s)
        if late:
            raise PlacementError(
                f"learner rank(s) {late} did not join torch.distributed at {master_addr}:{master_port} (rank 0's "
                f"node) within {rendezvous_timeout_s:.0f} s; {workers.where()}: can every learner node reach "
                f"{master_addr} on TCP (a firewall between nodes)? Their logs: learner-<rank>.log")
        ray.get([w.build.remote(model, stream_url, inference_actors, read_only) for w in workers])
    except BaseException:
        for worker in workers:
            ray.kill(worker)
        raise
    return workers


def _rank0_answer(workers: list, refs: list, timeout_s: float, on_wait, late_means: str):
    """Rank 0's answer to a call every rank made; TimeoutError naming the late ranks and their nodes when
    they have not answered within timeout_s (`late_means`: what it says and why it may be)."""
    late = _wait_all(refs, timeout_s, on_wait)
    if late:
        where = workers.where(late) if isinstance(workers, LearnerWorkers) else f"rank(s) {late}"
        raise TimeoutError(f"learner {where} did not {late_means}; see learner-<rank>.log in the run's logs")
    return ray.get(refs[0]) if refs else None


def step_learner(workers: list, timeout_s: float | None = None, deadline_s: float = STEP_TIMEOUT_S,
                 on_wait=None) -> tuple[dict, dict | None] | None:
    """One update on every rank (they run collectives together); rank 0's (metrics, groups.jsonl line), None
    when no batch came within timeout_s. Raises TimeoutError when
    they have not finished within timeout_s (the wait for data) + deadline_s. on_wait: called every
    ON_WAIT_EVERY_S while the update runs."""
    limit = (timeout_s or 0.0) + deadline_s
    return _rank0_answer(workers, [w.step.remote(timeout_s) for w in workers], limit, on_wait,
                         f"finish an update within {limit:.0f} s (a hung collective or a dead node?)")


def set_learner_inference(workers: list, inference_actors: list, timeout_s: float, on_wait=None) -> dict:
    """Every rank takes a new list of inference actors (`Learner.set_inference_actors`: an added actor gets
    the current weights); rank 0's answer. Raises TimeoutError when they have not answered within timeout_s.
    on_wait: as in step_learner."""
    refs = [w.set_inference_actors.remote(inference_actors) for w in workers]
    return _rank0_answer(workers, refs, timeout_s, on_wait, f"take the new inference actors within "
                         f"{timeout_s:.0f} s (a weight push to them that hangs?)") or {}
