"""The learner as Ray actors: one actor per learner process, rank 0 reads the stream and pushes weights.

    workers = create_learner_workers(cfg, model_path, stream_url, inference_actors)
    metrics = step_learner(workers, timeout_s=600)       # one update on every rank; rank 0's metrics
"""
from __future__ import annotations

import os
import socket

import ray

from common.config import ExperimentConfig, from_dict, to_dict
from common.cpu_placement import place_this_process
from common.log_files import send_output_to


class LearnerWorker:
    """One learner process. Sets the torch.distributed rank variables, then builds `learner.loop.Learner`."""

    def __init__(self, cfg: dict, model_path: str, stream_url: str | None, inference_actors: list,
                 rank: int, world_size: int, master_addr: str, master_port: int, read_only: bool = False,
                 log_dir: str = ""):
        send_output_to(log_dir, f"learner-{rank}")     # DeepSpeed's and torch's output too
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        if world_size > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        from learner.loop import Learner
        self.cfg: ExperimentConfig = from_dict(cfg)
        place_this_process(self.cfg.run.learner_cpus)     # before torch starts its threads
        self.learner = Learner(self.cfg, model_path, stream_url if rank == 0 else None,
                               inference_actors=inference_actors if rank == 0 else None, read_only=read_only)

    def step(self, timeout_s: float | None = None) -> dict | None:
        return self.learner.step(timeout_s=timeout_s)

    def sync_weights(self) -> dict:
        """Push the current weights as a new version (after a resume, so that the inference actors serve
        what the learner trains). Every rank calls it (ZeRO-3 gathers are collective)."""
        return self.learner.publish_weights()

    def state(self) -> dict:
        lr = self.learner
        return {"updates": lr.updates, "policy_version": lr.policy_version,
                "trained_groups": len(lr.trained_group_ids), **lr.stats}

    def save_checkpoint(self) -> str | None:
        return self.learner.save_checkpoint()

    def close(self) -> None:
        self.learner.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def create_learner_workers(cfg: ExperimentConfig, model_path: str, stream_url: str | None, inference_actors: list,
                           read_only: bool = False, log_dir: str = "") -> list:
    """`learner.num_processes` actors, each reserving one process's share of GPUs (or one CPU); read_only:
    they serve a checkpoint for evaluation (see `Learner`); log_dir: rank r's output goes to
    <log_dir>/learner-<r>.log."""
    n = cfg.learner.num_processes
    gpus = cfg.learner.gpus_per_process
    actor_cls = ray.remote(LearnerWorker)
    master_addr = ray.util.get_node_ip_address()
    port = _free_port()
    return [actor_cls.options(num_cpus=1, num_gpus=gpus, name=None).remote(
        to_dict(cfg), model_path, stream_url, inference_actors, rank, n, master_addr, port, read_only, log_dir)
        for rank in range(n)]


def step_learner(workers: list, timeout_s: float | None = None) -> dict | None:
    """One update on every rank (they run collectives together); rank 0's metrics."""
    results = ray.get([w.step.remote(timeout_s) for w in workers])
    return results[0]
