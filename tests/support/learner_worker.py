"""Worker processes for the learner tests (not collected: the file name does not start with test_).

    python tests/support/learner_worker.py train  MODEL OUT STAGE          # one train step (train_once), results
                                                                  # to OUT
    python tests/support/learner_worker.py crash  MODEL - URL STREAM CKPT POINT UPDATE  # resumes, prints RESUMED
                                      # and its policy version, trains until update UPDATE's checkpoint and
                                      # SIGKILLs itself at POINT of its save and ack (CRASH_POINTS)
    python tests/support/learner_worker.py zero3  MODEL OUT URL STREAM CKPT STEPS [lora]  # Learner.step() x STEPS
                                      # at ZeRO-3; rank 0 writes the pushed weights as buckets under OUT.d/
                                      # (lora: LoRA adapters of rank 4, pushed alone, after the base once)
Rank and world come from torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from actors.prompts.shared import action_regex
from common.config import ExperimentConfig, LearnerConfig, StreamConfig
from learner.batching import build_batch
from tests.support.synthetic import synthetic_groups
from learner.trainer import PolicyTrainer, teardown_distributed


# What these tests leave at the config's defaults, passed explicitly: build_batch's invalid-action penalty,
# PolicyTrainer's settings from outside learner.* (dtype: each test's own).
DEFAULTS = ExperimentConfig()
PENALTY = DEFAULTS.rollout.invalid_action_penalty
TRAINER = {"head_dtype": DEFAULTS.model.head_dtype, "temperature": DEFAULTS.rollout.temperature,
           "seed": DEFAULTS.run.seed}

REPO = Path(__file__).resolve().parents[2]


def worker_env(**extra) -> dict:
    """The environment of a worker process: this one's, without the launcher variables a pytest process set for
    its own world of one, plus `extra` (a rank's RANK, WORLD_SIZE, ...)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


# The agreement tests (tests/learner/test_learner_trainer.py) compare one update done in different ways; these
# settings make the arithmetic of both ways the same up to the order of one sum (the derivation is there).
ADAM_EPS = 1.0          # with |g| << 1, AdamW's first step lr * g / (|g| + eps) is ~lr * g, 1-Lipschitz in g
AGREEMENT_LR = 1.0


def train_config(stage: int) -> LearnerConfig:
    """One row per micro-batch (micro_batch_tokens=1: every row exceeds it, so each is a micro-batch of its
    own), no gradient clipping, the whole batch in one optimizer step."""
    return LearnerConfig(zero_stage=stage, lr=AGREEMENT_LR, grad_clip=0.0, mini_batch_rows=1024,
                         micro_batch_tokens=1, recompute_old_logprobs=True)


def agreement_batch(model_path: str):
    """Half the responses sampled under an action grammar (each process builds only its own rows' masks),
    half random unconstrained ones."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    actions = ["go to cabinet 1", "go to cabinet 2", "take mug 1 from desk 2", "look"]
    answers = [tokenizer.encode(f"<think></think> <action>{a}</action>", add_special_tokens=False)
               + [tokenizer.eos_token_id] for a in actions]     # what action_regex(actions, 0) allows

    def respond(rng):
        if rng.random() < 0.5:
            return rng.integers(1, 1000, int(rng.integers(4, 24))), ""
        return np.array(answers[int(rng.integers(len(answers)))]), action_regex(actions, 0)
    return build_batch(synthetic_groups(6, 4, vocab_size=1000, seed=11, respond=respond), LearnerConfig(),
                       invalid_action_penalty=PENALTY)


def train_once(model_path: str, stage: int, term_sums: bool = False) -> dict:
    """One update on the fixed synthetic batch with `train_config(stage)` and AdamW's eps = ADAM_EPS.
    Returns the metrics, the log-probs the update started from (recomputed by the learner), every full
    weight after the update, the batch's row and token counts, the rows whose grammar masks this process
    built and, with term_sums (in a world of one, where this process sees every row, at ZeRO stage 1 or 2,
    where the parameters are whole), per weight:
      row_sums    sum over rows of |the row's gradient|
      token_sums  sum over token positions of |each position's term| in the weight's gradient, for the
                  weights of linear and embedding layers (a linear weight's gradient is sum_t dy_t x_t^T,
                  its bias's sum_t dy_t, an embedding row's the dy_t of the positions holding its token)."""
    batch = agreement_batch(model_path)
    trainer = PolicyTrainer(model_path, train_config(stage), dtype="float32", **TRAINER)
    for group in trainer.engine.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    row_sums: dict[str, torch.Tensor] = {}
    token_sums: dict[str, torch.Tensor] = {}
    handles = []
    if term_sums:
        handles = _track_gradient_terms(trainer.engine.module, row_sums, token_sums)
    result = trainer.train_step(batch, update=0)
    for handle in handles:
        handle.remove()
    weights = {n: w.clone() for n, w in trainer.named_weights()}
    trainer.close()
    return {"metrics": result.metrics, "before": result.learner_logprobs, "weights": weights, "row_sums": row_sums,
            "token_sums": token_sums, "rows": batch.num_rows, "tokens": int(batch.row_lengths().sum()),
            "masked_rows": sum(bits is not None for bits in result.allowed_bits)}


def _track_gradient_terms(module: torch.nn.Module, row_sums: dict, token_sums: dict) -> list:
    """Hooks that add up, in float64, |each row's gradient| (a parameter's tensor hook sees one backward
    pass's gradient before it is accumulated: here one row's) and |each token position's term|."""
    names = {id(p): n for n, p in module.named_parameters()}    # tied weights: one name, the first
    for name, p in module.named_parameters():
        row_sums[name] = torch.zeros(p.shape, dtype=torch.float64)
    handles = []

    def token_sum(p: torch.Tensor) -> torch.Tensor:
        return token_sums.setdefault(names[id(p)], torch.zeros(p.shape, dtype=torch.float64))

    def add_abs(acc: torch.Tensor):
        def hook(grad: torch.Tensor) -> None:     # returns None: the gradient goes on unchanged
            acc.add_(grad.detach().abs().double())
        return hook

    for name, p in module.named_parameters():
        handles.append(p.register_hook(add_abs(row_sums[name])))

    def on_forward(layer, inputs, output) -> None:
        if not output.requires_grad:              # log-probs without gradient (compute_logprobs)
            return
        x = inputs[0].detach()

        def on_output_grad(grad: torch.Tensor) -> None:
            dy = grad.detach().abs().double().reshape(-1, grad.shape[-1])
            if isinstance(layer, torch.nn.Embedding):
                token_sum(layer.weight).index_add_(0, x.reshape(-1), dy)
                return
            token_sum(layer.weight).add_(dy.t() @ x.abs().double().reshape(-1, x.shape[-1]))
            if layer.bias is not None:
                token_sum(layer.bias).add_(dy.sum(0))

        output.register_hook(on_output_grad)

    for layer in module.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
            handles.append(layer.register_forward_hook(on_forward))
    return handles


def main() -> None:
    mode, model_path, out = sys.argv[1:4]
    if mode == "train":
        import torch.distributed as dist
        stage = int(sys.argv[4])
        res = train_once(model_path, stage, term_sums=int(os.environ["WORLD_SIZE"]) == 1 and stage < 3)
        if dist.get_rank() == 0:
            torch.save(res, out)
        teardown_distributed()
        return
    url, stream_key, ckpt = sys.argv[4], sys.argv[5], sys.argv[6]
    from common.stream.redis_stream import TrajectoryStream
    from learner.loop import Learner
    if mode == "zero3":
        run_zero3(model_path, out, url, stream_key, ckpt, int(sys.argv[7]), lora=sys.argv[8:] == ["lora"])
        return
    # crash: one learner's life, ended by a SIGKILL at the given point of its save and ack.
    crash_at(sys.argv[7], int(sys.argv[8]))
    cfg = learner_experiment(stream_key)
    cfg.learner.checkpoint_every = 1
    learner = Learner(cfg, model_path, TrajectoryStream(url, cfg.stream), checkpoint_dir=ckpt, resume=True)
    print(f"RESUMED {learner.policy_version}", flush=True)
    while True:
        if learner.step(timeout_s=60) is None:
            raise SystemExit(f"no groups to train for 60 s before the {sys.argv[7]} kill at update {sys.argv[8]}")


# The points of a checkpoint's save and ack (learner.loop.Learner.save_checkpoint, learner.trainer.PolicyTrainer.
# save_checkpoint) where `crash` kills the learner: half of DeepSpeed's second file written; every file written and
# fsynced, before the completion mark; the mark and `latest` written, before any ack; one of the update's two
# groups acked; all acked.
CRASH_POINTS = ("mid_save", "after_files", "after_latest", "mid_ack", "after_ack")


def crash_at(point: str, update: int) -> None:
    """Make this process SIGKILL itself at `point` of the checkpoint of update `update` (a real kill: no
    handler, no flush; the test then resumes from what is on disk and in Redis)."""
    import io
    import signal

    import learner.trainer as trainer_module
    from common.run_dir import LEARNER_STATE
    from common.stream.redis_stream import TrajectoryStream
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from learner.loop import Learner

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    saving = {"now": False, "files": 0}
    save_checkpoint = Learner.save_checkpoint

    def learner_save(self):
        saving["now"] = self.updates == update
        try:
            return save_checkpoint(self)
        finally:
            if saving["now"] and point == "after_ack":
                die()
            saving["now"] = False

    def engine_save(self, state_dict, path):
        saving["files"] += saving["now"]
        if saving["now"] and point == "mid_save" and saving["files"] == 2:
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            with open(path, "wb") as f:
                f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            die()
        return engine_file_save(self, state_dict, path)

    def write(path, *args, **kwargs):
        if saving["now"] and point == "after_files" and Path(path).name == LEARNER_STATE:
            die()
        return write_atomically(path, *args, **kwargs)

    def prune(*args, **kwargs):
        if saving["now"] and point == "after_latest":
            die()
        return prune_checkpoints(*args, **kwargs)

    def ack_delete(self, ids):
        if saving["now"] and point == "mid_ack":
            ack_delete_ids(self, ids[:1])
            die()
        return ack_delete_ids(self, ids)

    engine_file_save, write_atomically = TorchCheckpointEngine.save, trainer_module.write_atomically
    prune_checkpoints, ack_delete_ids = trainer_module.prune_checkpoints, TrajectoryStream._ack_delete
    Learner.save_checkpoint, TorchCheckpointEngine.save = learner_save, engine_save
    trainer_module.write_atomically, trainer_module.prune_checkpoints = write, prune
    TrajectoryStream._ack_delete = ack_delete


class BucketFilePublisher:
    """The learner-side half of `common.weights.sender.ShmTransfer.push` (gathered weights written as
    safetensors buckets), without inference actors to load them: the test reads the files instead."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.base_sent = False

    def push(self, named_tensors, version: int) -> dict:
        from common.weights.sender import write_buckets
        files = write_buckets(named_tensors, f"{self.out_dir}/v{version}", 64 * 2 ** 20)
        return {"buckets": len(files), "version": version}

    def needs_push(self, version: int) -> bool:
        return False          # no inference actors to restart

    def needs_base(self) -> bool:
        return not self.base_sent          # as an inference actor started with dummy weights would say

    def push_adapter(self, adapter: dict, version: int, base_weights=None) -> dict:
        from safetensors.torch import save_file
        info = self.push(base_weights, version) if base_weights is not None else {"version": version}
        self.base_sent = True
        save_file(adapter["tensors"], f"{self.out_dir}/v{version}-adapter.safetensors")
        return info


def run_zero3(model_path, out, url, stream_key, ckpt, steps, lora: bool = False) -> None:
    import torch.distributed as dist
    from common.stream.redis_stream import TrajectoryStream
    from learner.loop import Learner
    from learner.trainer import teardown_distributed

    cfg = learner_experiment(stream_key)
    cfg.learner.zero_stage = 3
    if lora:
        cfg.learner.lora_rank, cfg.learner.lora_target_modules, cfg.learner.lr = 4, "q_proj,up_proj", 1e-2
        cfg.learner.lora_push = "adapter"
    rank = int(os.environ["RANK"])
    learner = Learner(cfg, model_path, TrajectoryStream(url, cfg.stream) if rank == 0 else None, checkpoint_dir=ckpt,
                      publisher=BucketFilePublisher(out + ".d") if rank == 0 else None)
    log = []
    for _ in range(steps):
        m = learner.step(timeout_s=60)
        log.append({k: m[k] for k in ("train/loss", "train/grad_norm", "policy_version", "checkpointed",
                                      "time/train_s", "time/push_weights_s", "time/checkpoint_s", "time/wait_data_s")}
                   | {"groups": learner.last_group_ids})
    learner.close()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(log, f)
    dist.barrier()
    teardown_distributed()


def learner_experiment(stream_key: str) -> ExperimentConfig:
    cfg = ExperimentConfig()
    cfg.learner = LearnerConfig(groups_per_batch=2, checkpoint_every=2, mini_batch_rows=64,
                                micro_batch_tokens=1024, lr=1e-4)
    cfg.stream = StreamConfig(stream=stream_key)
    cfg.model.dtype = "float32"
    cfg.run.record_groups = 0      # no run directory here: groups.jsonl would land in ./runs/default
    return cfg


if __name__ == "__main__":
    main()
