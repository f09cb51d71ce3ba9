"""One learner rank as a Ray actor: joins torch.distributed, then builds `learner.loop.Learner`; rank 0 reads
the stream and pushes weights. The ranks as a group (start with deadlines, one update on every rank, close):
deploy/learner_pool.py.
"""
from __future__ import annotations

import logging
import os

import ray

from common.config import ExperimentConfig
from common.processes.cpu_placement import compute_threads, place_this_process, use_compute_threads
from common.processes.log_files import send_output_to
from common.processes.placement import this_node
from common.processes.process_env import apply_project_env
from common.processes.rendezvous import listen

log = logging.getLogger("gigpo")


class LearnerWorker:
    """One learner process: joins the process group, then builds `learner.loop.Learner` (see the module)."""

    def __init__(self, cfg: ExperimentConfig, rank: int, world_size: int, log_dir: str = ""):
        apply_project_env()     # vLLM's, DeepSpeed's, ... variables first
        send_output_to(log_dir, f"learner-{rank}")     # DeepSpeed's and torch's output too
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.learner = None
        self.listener = None      # rank 0's rendezvous socket, from rendezvous_address until join

    def node(self) -> dict:
        return this_node()

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP, a port listening there alone, held for rank 0's store until `join`): where the
        other ranks find rank 0."""
        address = ray.util.get_node_ip_address()
        self.listener = listen(address)
        return address, self.listener.getsockname()[1]

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
        listener, self.listener = self.listener, None
        setup_distributed(listener)

    def build(self, model, stream_url: str | None, inference_actors: list, read_only: bool = False) -> None:
        """Load the model (`model`: a common.processes.model_files.ModelSource, as this node sees it) and build the
        learner; rank 0 reads the stream at `stream_url` and pushes weights to `inference_actors`."""
        from learner.loop import Learner
        stream = publisher = None
        if self.rank == 0 and stream_url:
            from common.stream.redis_stream import TrajectoryStream
            from learner.batching import GroupLimits
            stream = TrajectoryStream(stream_url, self.cfg.stream, consumer_name="learner-0",
                                      max_group_bytes=GroupLimits.of(self.cfg).group_bytes)
        if self.rank == 0 and inference_actors:
            from common.weights.sender import create_weight_transfer
            publisher = create_weight_transfer(self.cfg, inference_actors)
        self.learner = Learner(self.cfg, model.local_path(), stream, publisher=publisher, read_only=read_only)

    def step(self, timeout_s: float | None = None) -> tuple[dict, dict | None] | None:
        """One update: (its metrics, its groups.jsonl line or None), or None when no batch came in time."""
        metrics = self.learner.step(timeout_s=timeout_s)
        return None if metrics is None else (metrics, self.learner.last_groups_record)

    def untrained_groups(self) -> int:
        """Rank 0: groups the stream holds that this learner has still to train (0 without a stream)."""
        stream = self.learner.stream
        return stream.untrained() if stream is not None else 0

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
