"""The policy a run's learner and actors start from: for training, model.path made ready and warm-started;
for `gigpo eval`, the run's own model as it is; and how every actor receives it (a ModelSource)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from common.config import ExperimentConfig
from common.processes.model_files import ModelSource
from common.processes.placement import alive_nodes
from common.run_dir import LATEST, WARM_DIR, checkpoints_dir
from deploy.models import prepare_model_path
from deploy.warm_start import existing_warm_model, warm_start

log = logging.getLogger("gigpo")


def initial_model(cfg: ExperimentConfig, progress=None) -> str:
    """The policy a training run starts from: model.path made ready, then warm-started (its bar on `progress`)."""
    path = prepare_model_path(cfg.model.path, cfg.run.output_dir)
    if cfg.model.warm_start_steps > 0:
        path = warm_start(cfg, path, progress=progress)
    return path


def eval_model(cfg: ExperimentConfig, scratch_dir: str) -> str:
    """The model `gigpo eval` starts from, without writing into the run: the run's own warm or tiny model as
    it is (with a checkpoint, it only supplies the architecture and tokenizer); what the run lacks is built
    in `scratch_dir`."""
    if cfg.model.warm_start_steps > 0:
        warm = existing_warm_model(cfg.run.output_dir)
        if warm:
            return warm
    path = prepare_model_path(cfg.model.path, cfg.run.output_dir, build_dir=scratch_dir or None)
    has_checkpoint = bool(cfg.run.resume_tag) or (checkpoints_dir(cfg.run.output_dir) / LATEST).exists()
    if cfg.model.warm_start_steps > 0 and not has_checkpoint:
        if not scratch_dir:
            raise ValueError(f"{cfg.run.output_dir} has neither a checkpoint nor a warm model to evaluate")
        log.warning("%s has no checkpoint and no warm model: evaluating a warm start built for this "
                    "evaluation only", cfg.run.output_dir)
        path = warm_start(cfg, path, out_dir=str(Path(scratch_dir) / WARM_DIR))
    return path


def ship_model(cfg: ExperimentConfig, path: str) -> ModelSource:
    """The model as every actor receives it: on a cluster (other nodes do not see this one's files) a local
    model of up to model.ship_max_mb travels through Ray's object store; a local Ray reads the path itself."""
    if Path(path).is_dir():
        path = str(Path(path).resolve())       # the actors' working directory may differ from this one
    cluster = bool(cfg.run.ray_address or os.environ.get("RAY_ADDRESS")) or len(alive_nodes()) > 1
    return ModelSource.ship(path, cfg.model.ship_max_mb if cluster else 0)
