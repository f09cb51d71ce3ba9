"""Where training metrics go: TensorBoard always, a JSON-lines file always (easy to plot or grep), and
Weights & Biases when WANDB_API_KEY is set and `wandb` is installed. The run's config goes to W&B with every
Redis URL in it redacted (`redacted_config`): W&B shows a run's config to everyone on the project."""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from common.config import RunConfig
from common.run_dir import METRICS_FILE, TENSORBOARD_DIR

log = logging.getLogger("gigpo")


def redacted_config(config: dict) -> dict:
    """A copy of `config` (nested dicts) with the password of every `*redis_url` replaced by ***."""
    from common.redaction import redact
    return {key: redacted_config(value) if isinstance(value, dict)
            else redact(value) if key.endswith("redis_url") and isinstance(value, str) else value
            for key, value in config.items()}


class Tracker:
    def __init__(self, output_dir: str, run_name: str, config: dict, resume: bool = RunConfig.resume):
        """resume: append to the run's metrics.jsonl, else start it anew. `config` is kept redacted (`self.config`)."""
        self.config = redacted_config(config)
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        from torch.utils.tensorboard import SummaryWriter
        self.tb = SummaryWriter(log_dir=str(self.dir / TENSORBOARD_DIR))
        self.jsonl = open(self.dir / METRICS_FILE, "a" if resume else "w")
        self.wandb = None
        if os.environ.get("WANDB_API_KEY"):
            try:
                import wandb
                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "gigpo"), name=run_name,
                                        config=self.config, dir=str(self.dir))
            except ImportError:
                log.warning("WANDB_API_KEY is set but wandb is not installed: `pip install wandb` to use it")

    def log(self, metrics: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for key, value in scalars.items():
            self.tb.add_scalar(key, value, step)
        self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.tb.flush()
        self.tb.close()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
