"""The policy trainer: a DeepSpeed ZeRO engine around a causal LM, one `train_step(batch)` per update.

    setup_distributed()                       # once per process (single process: no env vars needed)
    trainer = PolicyTrainer(model_path, cfg.learner, dtype=cfg.model.dtype, head_dtype=cfg.model.head_dtype,
                            temperature=cfg.rollout.temperature, seed=cfg.run.seed)
    result = trainer.train_step(batch, update=7)     # a TrainStepResult: metrics, recomputed log-probs, ...
    for name, tensor in trainer.named_weights(): ...   # full weights (gathered at ZeRO-3), for the push
    trainer.save_checkpoint(dir, {"trained_group_ids": [...], "policy_version": 8})

Several processes (one per device) call `train_step` with the *same* batch; each trains on its share of
every mini-batch (`batching.plan_micro_batches`), all running the same number of forward/backward passes,
as ZeRO's collectives need. A micro-batch's loss is its token sum over the whole mini-batch's token count,
times the number of processes (DeepSpeed averages gradients across them): the gradient of the mini-batch
token mean, however it was split. On CPU: fp32, gloo, a plain `torch.optim.AdamW` (DeepSpeed's own
optimizers JIT-compile for minutes); on GPU: bf16, nccl. `train_step` never writes into the batch it is
given: what it computes of it (grammar masks, the learner's own old log-probs, a correction's weights) goes
on a copy and comes back in its `TrainStepResult`.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from common.atomic_write import fsync_tree, write_atomically
from common.config import LearnerConfig, served_lora_rank
from common.processes.rendezvous import tcp_store
from common.run_dir import (LATEST, LEARNER_STATE, check_checkpoint_is_ours, checkpoint_tag, checkpoint_tags,
                            complete_checkpoints, is_complete_checkpoint, resume_point, seal_checkpoint, tag_update)
from learner.batching import (MicroBatch, MicroBatchPlan, TrainBatch, collate, collate_packed, mini_batches,
                              plan_micro_batches)
from learner.collectives import all_gather_arrays
from learner.grammar_mask import GrammarMasks, allowed_tokens
from learner.utilization import ModelShape, matmul_peak
from learner.gigpo import (LossSettings, correction_weights, logprob_gap, policy_loss,
                           token_logprobs_and_entropy)
from learner.lora import adapter_weights, merged_weights, reference_policy, with_lora
from learner.packing import packed_logits, use_packed_attention
from learner.safe_load import weights_only_loading

log = logging.getLogger("gigpo")


def prune_checkpoints(root: str | os.PathLike, keep: int, just_written: str) -> list[str]:
    """Delete all but the `keep` newest checkpoints under `root` (keep <= 0: none); returns the deleted names.
    `just_written` is always kept (`latest` names it, its groups are acked on its strength); those numbered
    above it are left alone: a history this run branched off (resumed from an older run.resume_tag), which
    it overwrites as it reaches their numbers."""
    if keep <= 0:
        return []
    newest = tag_update(just_written)
    older = [p for p in checkpoint_tags(root) if tag_update(p.name) < newest]
    doomed = older[:max(len(older) - (keep - 1), 0)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in doomed]


def setup_distributed(listener: socket.socket | None = None) -> tuple[int, int]:
    """Initialize torch.distributed through DeepSpeed (idempotent; without launcher variables a world of one);
    returns (rank, world_size). A world of one meets in an in-process store; a larger one at MASTER_ADDR:
    MASTER_PORT, where rank 0's TCPStore listens on that address alone (common.processes.rendezvous; torch's
    own would listen on every interface of the machine) through `listener` if rank 0 made one when it chose
    the port. On CPU: gloo, and DeepSpeed's shared-memory comm op, which would JIT-compile for ~2 minutes,
    skipped."""
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")     # before deepspeed picks its accelerator
    import deepspeed
    from deepspeed.constants import default_pg_timeout

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if cuda else "gloo"
    if not cuda:
        # Through sys.modules: `import deepspeed.comm.torch` would bind the torch package instead.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size == 1:
        store = dist.HashStore()
    else:
        store = tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          timeout_s=default_pg_timeout.total_seconds(), listener=listener, is_master=rank == 0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=default_pg_timeout)
    deepspeed.init_distributed(dist_backend=backend)      # (takes over the process group made here)
    return dist.get_rank(), dist.get_world_size()


FULL_DISK_FREE_BYTES = 64 * 2 ** 20     # a save that failed with less than this free ran out of space


def _failed_save(root: Path, tag: str, exc: BaseException) -> BaseException:
    """What a checkpoint save that failed part of the way raises, its half-written directory removed (never a
    checkpoint: it has no LEARNER_STATE; removed, its space is free again). torch.save reports a full disk as
    a RuntimeError about an iostream: that becomes an OSError(ENOSPC) that says so and where."""
    shutil.rmtree(root / tag, ignore_errors=True)
    free = shutil.disk_usage(root).free if root.exists() else 0
    full = getattr(exc, "errno", None) == errno.ENOSPC or "no space left" in str(exc).lower() or \
        free < FULL_DISK_FREE_BYTES
    if not full:
        return exc
    return OSError(errno.ENOSPC, f"No space left on device for the checkpoint {root / tag} (it was removed; "
                                 f"{free / 2 ** 20:.0f} MiB free there now): no group of the updates since the "
                                 "last checkpoint was acked; free space, then resume the run to train them again")


def _ds_config(cfg: LearnerConfig, bf16: bool) -> dict:
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if cfg.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
        # Batch sizes are ours (token-budget micro-batches); DeepSpeed only needs consistent numbers.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # step() is the accumulation boundary however many backward passes came before it.
        "managed_gradient_accumulation": False,
        "zero_optimization": zero,
        "gradient_clipping": cfg.grad_clip,
        "bf16": {"enabled": bf16},
        # A plain AdamW object is allowed with offload (DeepSpeedCPUAdam would JIT-compile).
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


@dataclass(frozen=True)
class TrainStepResult:
    """What one `PolicyTrainer.train_step` computed of the batch it was given (which it leaves as it was)."""

    metrics: dict[str, float]                          # token means over the whole batch, on every process
    # Per row, the old log-probs the learner recomputed and trained with; None: it trained with the sampler's.
    learner_logprobs: list[np.ndarray] | None = None
    weights: list[np.ndarray] | None = None            # per row, the correction's token weights; None: all 1
    # Per row, the grammar mask this process built (None for rows it did not feed the model); None: no grammars.
    allowed_bits: list[np.ndarray | None] | None = None


class PolicyTrainer:
    """DeepSpeed engine + frozen reference + the PPO train step. One per learner process."""

    def __init__(self, model_path: str, cfg: LearnerConfig, *, dtype: str, head_dtype: str, temperature: float,
                 seed: int, pad_id: int | None = None):
        """dtype, head_dtype: model.dtype and model.head_dtype (`project_head_in_float32`). temperature:
        rollout.temperature; every log-prob, KL and entropy is of softmax(logits / temperature), the
        distribution the tokens were drawn from and vLLM reports (see learner/gigpo.py). seed: run.seed."""
        import deepspeed
        from transformers import AutoModelForCausalLM

        if not (np.isfinite(temperature) and temperature > 0):
            raise ValueError(f"the sampling temperature (rollout.temperature) must be > 0 to train on what was "
                             f"sampled, got {temperature!r}: greedy decoding has no distribution to train")
        self.temperature = float(temperature)
        self.cfg = cfg
        self.rank, self.world_size = setup_distributed()
        cuda = torch.cuda.is_available()
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        bf16 = {"auto": cuda, "bfloat16": True, "float32": False}[dtype]
        torch.manual_seed(seed)
        # fp32 master weights; DeepSpeed casts the module to bf16 when bf16 is on.
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model.config.use_cache = False
        # Rows to train must hold token ids below this (the embedding table's size): checked on read.
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.pad_id = pad_id if pad_id is not None else (model.config.pad_token_id or 0)
        self.settings = LossSettings(clip_ratio=cfg.clip_ratio, dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef,
                                     entropy_coef=cfg.entropy_coef)
        # Frozen reference for the KL term: a full copy in the compute dtype on every process (not partitioned
        # at ZeRO-3: simpler and faster for the models this repo trains on one box).
        # With LoRA the reference is the base model, the policy's own with its adapters off (learner/lora.py).
        self.ref_model = None
        if cfg.kl_coef > 0 and not cfg.lora_rank:
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=torch.bfloat16 if bf16 else torch.float32).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        if head_dtype == "float32" and bf16:
            for m in (model, self.ref_model):
                if m is not None:
                    project_head_in_float32(m)
        if cfg.packed:
            for m in (model, self.ref_model):
                if m is not None:
                    use_packed_attention(m)
        train_only_last_layers(model, cfg.trainable_layers)
        if cfg.lora_rank:
            model = with_lora(model, cfg)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                      weight_decay=cfg.weight_decay)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    config=_ds_config(cfg, bf16))
        # For the step's model FLOPs (learner/utilization.py).
        self.shape = ModelShape.of(model.get_base_model() if cfg.lora_rank else model)
        self.compute_dtype = torch.bfloat16 if bf16 else torch.float32
        self.updates = 0   # optimizer-update calls (train_step) done by this trainer, restored on load
        self.model_path = model_path
        self._grammar_masks: GrammarMasks | None = None     # built for the first row with a grammar

    def _logprobs(self, model, mb: MicroBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return response_logprobs(model, mb, self.temperature, self.device, with_entropy)

    def _plan(self, batch: TrainBatch, rows: np.ndarray):
        return plan_micro_batches(batch, rows, self.cfg.micro_batch_tokens, self.world_size,
                                  packed=self.cfg.packed)

    def _micro(self, batch: TrainBatch, rows: np.ndarray, fallback_row: int) -> tuple[MicroBatch, float]:
        """The micro-batch of `rows` (in learner.pack_rows' layout) and weight 1, or for a process with nothing
        left a one-row stand-in with weight 0 that keeps the collectives in step."""
        chosen, weight = (rows, 1.0) if len(rows) else (np.array([fallback_row]), 0.0)
        if self.cfg.packed:
            return collate_packed(batch, chosen), weight
        return collate(batch, chosen, self.pad_id), weight

    def _own_rows(self, plan: MicroBatchPlan, fallback_row: int) -> list[int]:
        """The rows this process feeds the model in `plan` (and the stand-in of an empty share)."""
        return [fallback_row, *np.concatenate(plan.per_rank[self.rank]).tolist()]

    def constrain(self, batch: TrainBatch, rows: Iterable[int]) -> tuple[TrainBatch, float]:
        """A copy of `batch` whose `allowed_bits` (learner/grammar_mask.py) hold those of `rows` too (built for
        the rows that have none yet), and the seconds taken; `batch` itself without grammars. A process builds
        only the masks of the rows it feeds the model (`_own_rows`): they cost host CPU, which the processes
        of a node share."""
        if batch.grammars is None:
            return batch, 0.0
        bits = [None] * batch.num_rows if batch.allowed_bits is None else list(batch.allowed_bits)
        todo = sorted({r for r in rows if bits[r] is None})
        t = time.perf_counter()
        if todo:
            if self._grammar_masks is None:
                self._grammar_masks = GrammarMasks(self.model_path, self.vocab_size)
            built = self._grammar_masks.rows([batch.grammars[r] for r in todo],
                                             [batch.response_ids[r] for r in todo])
            for r, row_bits in zip(todo, built):
                bits[r] = row_bits
        return replace(batch, allowed_bits=bits), time.perf_counter() - t

    def compute_logprobs(self, batch: TrainBatch) -> list[np.ndarray]:
        """Log-probs of every row's response under the current weights (all processes join and get all rows)."""
        return self._logprobs_and_masks(batch)[0]

    @torch.no_grad()
    def _logprobs_and_masks(self, batch: TrainBatch) -> tuple[list[np.ndarray], TrainBatch]:
        """`compute_logprobs`, and the copy of `batch` with the grammar masks it built (`constrain`)."""
        plan = self._plan(batch, np.arange(batch.num_rows))
        batch, _ = self.constrain(batch, self._own_rows(plan, 0))
        mine: dict[int, np.ndarray] = {}
        self.engine.eval()
        for rows_mb in plan.per_rank[self.rank]:
            mb, weight = self._micro(batch, rows_mb, 0)
            logp, _ = self._logprobs(self.engine, mb, with_entropy=False)
            if weight:
                splits = torch.split(logp.float().cpu(), [len(batch.response_ids[r]) for r in mb.rows])
                mine.update({int(r): s.numpy() for r, s in zip(mb.rows, splits)})
        self.engine.train()
        if self.world_size > 1:
            mine = all_gather_arrays(mine)
        return [mine[r] for r in range(batch.num_rows)], batch

    @property
    def recomputes_old_logprobs(self) -> bool:
        """train_step trains with the learner's own old log-probs instead of the sampler's
        (learner.recompute_old_logprobs, or a learner.logprob_correction, which needs both)."""
        return self.cfg.recompute_old_logprobs or self.cfg.logprob_correction != "none"

    def train_step(self, batch: TrainBatch, update: int | None = None) -> TrainStepResult:
        """ppo_epochs passes over the batch, one optimizer step per mini-batch. With `recomputes_old_logprobs`
        it trains with the learner's own old log-probs (and a correction's weights computed from both and the
        sampler's); the sampler-learner log-prob gap is measured every update (train/logprob_gap_*). `batch` is
        left as it was: the result holds what was computed of it. Three phases: what the passes read
        (`_prepare`), the passes (`_run_passes`), their sums over every process as metrics (`_step_metrics`)."""
        update = self.updates if update is None else update
        if batch.num_rows == 0:
            return TrainStepResult({"train/skipped_empty_batch": 1.0})
        t0 = time.perf_counter()
        # Every pass's plan, first: the grammar masks this process needs are those of its rows in them.
        passes = [(rows, self._plan(batch, rows)) for epoch in range(self.cfg.ppo_epochs)
                  for rows in mini_batches(batch.num_rows, self.cfg.mini_batch_rows,
                                           seed=(update * 1000003 + epoch) % (2 ** 32))]
        metrics, trained, learner_logprobs, weights = self._prepare(batch, passes)
        # The gap between the sampler's log-probs and the learner's old ones (learner.gigpo): from the
        # recompute when there is one (every token, in _prepare), else from the first mini-batch's forward
        # pass, whose weights are still the old ones (its tokens only: all of them when one mini-batch holds
        # the batch).
        gap_in_first_mini_batch = not self.recomputes_old_logprobs
        sums, gap_max, grad_norms, steps = self._run_passes(trained, passes, measure_gap=gap_in_first_mini_batch)
        self.updates = update + 1
        sums, gap_max = self._summed_over_processes(sums, gap_max)
        if not gap_in_first_mini_batch:      # the recompute: one forward pass over every row, on all processes
            sums["flops"] += self.shape.forward_flops(*self._row_sizes(batch, np.arange(batch.num_rows)))
        else:
            n = max(sums["gap_tokens"], 1.0)
            metrics.update({"train/logprob_gap_mean": sums["gap_mean_sum"] / n,
                            "train/logprob_gap_kl": sums["gap_kl_sum"] / n,
                            "train/logprob_gap_share": sums["gap_share_sum"] / n, "train/logprob_gap_max": gap_max})
        metrics.update(self._step_metrics(sums, grad_norms, steps, time.perf_counter() - t0))
        return TrainStepResult(metrics, learner_logprobs=learner_logprobs, weights=weights,
                               allowed_bits=trained.allowed_bits)

    def _prepare(self, batch: TrainBatch, passes: list) -> tuple[dict, TrainBatch, list | None, list | None]:
        """(metrics, the batch the passes read, the learner's old log-probs, the correction's weights): `batch`,
        or a copy with its grammar masks (those of this process's rows) and, with `recomputes_old_logprobs`,
        the learner's own old log-probs and the correction's weights, the gap measured on every token."""
        metrics: dict[str, float] = {}
        trained = batch
        if batch.grammars is not None:
            trained, metrics["time/grammar_mask_s"] = self.constrain(
                batch, [r for rows, plan in passes for r in self._own_rows(plan, int(rows[0]))])
        if not self.recomputes_old_logprobs:
            metrics["train/correction_share"] = 0.0
            return metrics, trained, None, None
        t = time.perf_counter()
        correction = self.cfg.logprob_correction
        learner_logprobs, trained = self._logprobs_and_masks(trained)
        # Forced tokens (log-prob 0 under the constrained sampler) are not in the loss, nor here.
        masks = [batch.token_mask(r) for r in range(batch.num_rows)]
        gap = logprob_gap(np.concatenate([a[m] for a, m in zip(learner_logprobs, masks)]),
                          np.concatenate([b[m] for b, m in zip(batch.old_logprobs, masks)]))
        metrics.update({f"train/logprob_gap_{k}": v for k, v in gap.items()})
        # Where the correction binds: a ratio truncated at the cap (tis), a token dropped (masks).
        all_weights, metrics["train/correction_share"] = correction_weights(
            learner_logprobs, batch.old_logprobs, correction, self.cfg.correction_cap, masks)
        weights = all_weights if correction != "none" else None     # (all ones: the loss skips them)
        trained = replace(trained, old_logprobs=learner_logprobs, weights=weights)
        metrics["time/recompute_s"] = time.perf_counter() - t
        return metrics, trained, learner_logprobs, weights

    def _run_passes(self, trained: TrainBatch, passes: list, measure_gap: bool) -> tuple[dict, float, list, int]:
        """Train on this process's micro-batches of every pass, one optimizer step per mini-batch. Returns
        (sums by name: the loss terms' sums, the tokens, the model FLOPs and, with measure_gap, the first
        mini-batch's log-prob gap sums; the largest gap; the grad norms; the optimizer steps)."""
        sums: dict[str, float] = {"tokens_seen": 0.0, "computed_tokens": 0.0, "flops": 0.0,
                                  "gap_mean_sum": 0.0, "gap_kl_sum": 0.0, "gap_share_sum": 0.0, "gap_tokens": 0.0}
        gap_max = 0.0
        grad_norms: list[float] = []
        steps = 0
        for rows, plan in passes:
            # Loss x world_size: DeepSpeed averages gradients over processes, we want their sum.
            scale = float(self.world_size) / max(plan.response_tokens, 1)
            measure = measure_gap and steps == 0
            for rows_mb in plan.per_rank[self.rank]:
                mb, weight = self._micro(trained, rows_mb, int(rows[0]))
                ms, logp = self._train_micro(mb, scale * weight)
                if not weight:
                    continue
                for k, v in ms.items():
                    sums[f"loss:{k}"] = sums.get(f"loss:{k}", 0.0) + v
                sums["tokens_seen"] += float(mb.attention_mask.sum())
                sums["computed_tokens"] += float(mb.input_ids.numel())
                lengths, response = self._row_sizes(trained, rows_mb)
                sums["flops"] += self.shape.train_flops(lengths, response)
                if self.settings.kl_coef > 0:     # the reference's forward
                    sums["flops"] += self.shape.forward_flops(lengths, response)
                if measure:
                    kept = mb.loss_mask.bool()
                    gap = logprob_gap(logp[kept].numpy(), mb.old_logprobs[kept].numpy())
                    n = int(kept.sum())
                    for name in ("mean", "kl", "share"):
                        sums[f"gap_{name}_sum"] += gap[name] * n
                    sums["gap_tokens"] += n
                    gap_max = max(gap_max, gap["max"])
            self.engine.step()
            steps += 1
            gn = self.engine.get_global_grad_norm()
            if gn is not None:
                grad_norms.append(float(gn))
        return sums, gap_max, grad_norms, steps

    def _summed_over_processes(self, sums: dict[str, float], peak: float) -> tuple[dict[str, float], float]:
        """`sums` added up over every learner process, by name, and the largest `peak` (two all-reduces).
        Every process has the same names: each trains at least one micro-batch of every pass."""
        if self.world_size == 1:
            return sums, peak
        names = sorted(sums)
        total = torch.tensor([sums[k] for k in names], dtype=torch.float64)
        largest = torch.tensor([peak], dtype=torch.float64)
        dist.all_reduce(total)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return dict(zip(names, total.tolist())), float(largest[0])

    def _step_metrics(self, sums: dict[str, float], grad_norms: list[float], steps: int,
                      elapsed: float) -> dict[str, float]:
        """The update's metrics from its sums over every process: each loss term per response token, the
        tokens, the optimizer steps, the grad norms, the learning rate, the speed and the padding computed."""
        response_tokens = sums.get("loss:tokens", 0.0)
        n = max(response_tokens, 1.0)
        metrics = {f"train/{k[5:-4]}": v / n for k, v in sums.items() if k.startswith("loss:") and k.endswith("_sum")}
        tokens_seen, computed_tokens = sums["tokens_seen"], sums["computed_tokens"]
        metrics.update({
            "train/response_tokens": response_tokens,
            "train/optimizer_steps": float(steps),
            "train/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
            "train/grad_norm_max": float(np.max(grad_norms)) if grad_norms else float("nan"),
            "train/lr": float(self.engine.get_lr()[0]),
            "time/train_s": elapsed,
            "perf/tokens_per_s": tokens_seen / elapsed if elapsed > 0 else 0.0,
            "perf/padding_share": 1.0 - tokens_seen / computed_tokens if computed_tokens else 0.0,
            **self._utilization(sums["flops"], elapsed),
        })
        return metrics

    @staticmethod
    def _row_sizes(batch: TrainBatch, rows) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, response tokens) of each of `rows`: what their model FLOPs depend on."""
        response = np.array([len(batch.response_ids[r]) for r in rows], dtype=np.float64)
        return np.array([len(batch.prompt_ids[r]) for r in rows], dtype=np.float64) + response, response

    def _utilization(self, flops: float, elapsed: float) -> dict[str, float]:
        """The step's model FLOP/s (all processes), and their share of the same dtype's matmul peak measured
        here (once per process and thread count: ~0.5 s) times the number of processes."""
        if elapsed <= 0:
            return {}
        peak = matmul_peak(self.compute_dtype, str(self.device), torch.get_num_threads())
        rate = flops / elapsed
        return {"perf/model_flops_per_s": rate, "perf/matmul_peak_flops_per_s": peak,
                "perf/matmul_peak_share": rate / (peak * self.world_size)}

    def _train_micro(self, mb: MicroBatch, scale: float) -> tuple[dict[str, float], torch.Tensor]:
        """Forward + backward of one micro-batch; `scale` turns its token sum into its share of the mini-batch
        token mean (0: a stand-in). Returns its metrics and its log-probs (detached, float32, on the CPU)."""
        # Entropy is reported even at coefficient 0 (cheap next to the forward pass), detached then so that
        # its softmax is not kept for the backward pass.
        logp, entropy = self._logprobs(self.engine, mb, with_entropy=True)
        if self.settings.entropy_coef == 0:
            entropy = entropy.detach()
        ref_logp = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = self._logprobs(self.ref_model, mb, with_entropy=False)
        elif self.settings.kl_coef > 0:        # LoRA: the base model is the policy with its adapters off
            with torch.no_grad(), reference_policy(self.engine):
                ref_logp, _ = self._logprobs(self.engine, mb, with_entropy=False)
        loss, ms = policy_loss(logp, mb.old_logprobs.to(self.device), mb.advantages.to(self.device),
                               mb.loss_mask.to(self.device), self.settings, token_normalizer=1.0,
                               ref_logp=ref_logp, entropy=entropy, weights=mb.weights.to(self.device))
        # token_normalizer=1 gives the plain sum; the scale applies the mini-batch normalizer.
        self.engine.backward(loss * scale, scale_wrt_gas=False)
        return {k: float(v) for k, v in ms.items()}, logp.detach().float().cpu()

    @property
    def pushes_adapter(self) -> bool:
        """Whether a weight push is the LoRA adapters alone (`adapter_weights`; learner.lora_push=adapter)."""
        return bool(served_lora_rank(self.cfg))

    def _gather(self):
        """ZeRO-3: a context making the given parameters whole on every process; stages 1/2: None."""
        if self.cfg.zero_stage != 3:
            return None
        import deepspeed
        return lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def adapter_weights(self) -> dict:
        """The LoRA adapters as peft saves them (learner.lora.adapter_weights), for an adapter push. Every
        process must call it at ZeRO-3."""
        return adapter_weights(self.engine.module, self._gather())

    def named_weights(self, base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every parameter in the module's order (tied weights once), for the weight
        push; with LoRA the adapters merged in (base=True: left out, the base model under an adapter push).
        Every process must iterate it to the end (ZeRO-3 gathers are collective). Stage 1/2: the live
        parameters; stage 3: each gathered, copied and released again."""
        module = self.engine.module
        gather = self._gather()
        if self.cfg.lora_rank:       # the adapters merged into the weights, under the plain model's names
            yield from merged_weights(module, gather, merge=not base)
        elif gather is not None:
            for name, p in module.named_parameters():
                with gather([p]):
                    yield name, p.data.detach().clone()
        else:
            for name, p in module.named_parameters():
                yield name, p.detach()

    def save_checkpoint(self, root: str | os.PathLike, client_state: dict,
                        keep: int = LearnerConfig.keep_checkpoints) -> str:
        """DeepSpeed checkpoint (model, optimizer, engine state) under root/<tag>, with `client_state` inside it
        and as JSON (LEARNER_STATE, its completion mark) beside it, then root/latest naming it; keeps the `keep`
        newest (`prune_checkpoints`). All processes call it. When it returns, all of it is on disk (fsynced):
        the caller acks, and the stream deletes, the groups it holds. A save cut short at any point leaves
        `latest` naming the previous checkpoint (common.run_dir.resume_point)."""
        root = Path(root)
        tag = checkpoint_tag(self.updates)
        state = dict(client_state, trainer_updates=self.updates, trains=self._what_trains())
        if self.rank == 0:
            # A tag of the same number from an abandoned history (see prune_checkpoints) is rewritten in
            # place: unmark it first, so that it never looks complete with half of its files replaced.
            (root / tag / LEARNER_STATE).unlink(missing_ok=True)
        try:
            # With LoRA the frozen base weights are the model's files: the checkpoint holds the adapters alone.
            # DeepSpeed's own `latest` is written in place, neither atomically nor durably: written below.
            self.engine.save_checkpoint(str(root), tag=tag, client_state={"learner": state}, save_latest=False,
                                        exclude_frozen_parameters=bool(self.cfg.lora_rank))
            seal_checkpoint(root / tag)     # loaded only if no one else could have written it: no group/other write
            fsync_tree(root / tag)          # on each process's node: its own files, wherever they are
        except (OSError, RuntimeError) as exc:
            raise _failed_save(root, tag, exc) from exc
        if self.world_size > 1:
            dist.barrier()
        if self.rank == 0:
            write_atomically(root / tag / LEARNER_STATE, json.dumps(state), durable=True, mode=0o644)
            write_atomically(root / LATEST, tag, durable=True)
            prune_checkpoints(root, keep, tag)
        if self.world_size > 1:
            dist.barrier()
        return str(root / tag)

    def load_checkpoint(self, root: str | os.PathLike, tag: str | None = None) -> dict | None:
        """Load the checkpoint `tag` under root (such as update_0000008; None: the one a resume takes,
        common.run_dir.resume_point); returns its client_state, or None when there is no checkpoint at all. A
        `tag` that is not there raises FileNotFoundError: asked for one checkpoint, never silently start from
        another."""
        root = Path(root)
        if tag is None:
            found, note = resume_point(root)
            if note:
                log.warning("%s", note)
            if found is None:
                return None
            tag = found.name
        elif not is_complete_checkpoint(root / tag):
            have = [p.name for p in complete_checkpoints(root)] or "none"
            raise FileNotFoundError(f"no checkpoint {tag!r} under {root} (complete ones there: {have})")
        saved = root / tag / LEARNER_STATE
        trained = json.loads(saved.read_text()).get("trains", {"lora_rank": 0})
        if trained != self._what_trains():
            # A LoRA checkpoint holds the adapters alone, loaded non-strictly: the wrong kind would load nothing.
            said = lambda fields: ", ".join(f"learner.{k}={v}" for k, v in fields.items())  # noqa: E731
            raise ValueError(f"{saved.parent} was trained with {said(trained)}, this learner has "
                             f"{said(self._what_trains())}: resume with the checkpoint's settings")
        check_checkpoint_is_ours(root / tag)      # its files are pickles: loaded weights-only, and only ours
        with weights_only_loading(self.engine.checkpoint_engine):
            path, client = self.engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                       load_lr_scheduler_states=True,
                                                       load_module_strict=not self.cfg.lora_rank)
        if path is None:
            return None
        state = (client or {}).get("learner", {})
        self.updates = int(state.get("trainer_updates", 0))
        return state

    def _what_trains(self) -> dict:
        """The settings that make a checkpoint's module state: which parameters it holds and under what names."""
        if not self.cfg.lora_rank:
            return {"lora_rank": 0}
        return {"lora_rank": self.cfg.lora_rank, "lora_target_modules": self.cfg.lora_target_modules}

    def close(self) -> None:
        """Free the engine (before the process group is destroyed: stage 3 can abort otherwise)."""
        if getattr(self, "engine", None) is not None:
            self.engine.destroy()
            self.engine = None


def train_only_last_layers(model, n: int, setting: str = "learner.trainable_layers") -> int:
    """learner.trainable_layers (or the config field `setting` names, for its errors): with n > 0, freeze
    every parameter but those of the last n transformer blocks and the final norm (the decoder's `layers`
    and `norm`, as Llama, Qwen2 and most causal LMs name them); n = 0 leaves all trainable. Returns how
    many parameters train."""
    if n > 0:
        decoder = model.get_decoder()
        layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
        if layers is None or norm is None:
            raise ValueError(f"{setting}={n}: {type(model).__name__} has no decoder.layers / "
                             f"decoder.norm to train; set {setting}=0")
        if n > len(layers):
            raise ValueError(f"{setting}={n} but the model has {len(layers)} layers; set at most "
                             f"{len(layers)} (or 0: all)")
        model.requires_grad_(False)
        for module in [*layers[-n:], norm]:
            module.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def project_head_in_float32(model) -> None:
    """Make `model`'s lm_head compute its logits in float32 (model.head_dtype; vLLM's hf_overrides
    head_dtype=float32 does the same): the bf16 hidden state and weight are cast up before the product, so
    the logits carry no bf16 rounding, and the bf16 weight still gets its gradient through the cast. The
    forward is replaced on the instance, so the module's hooks (ZeRO-3 gathers its weight in one) still run.
    Costs a float32 copy of the head's weight per call."""
    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)

    head.forward = forward


def response_logprobs(model, mb: MicroBatch, temperature: float, device="cpu", with_entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p and entropy of `mb`'s response tokens under softmax(logits / temperature), flat [N] in row-major
    order; logits of the response tokens only (the padded layout's window, the packed one's positions: see
    batching.MicroBatch), in the trainer's forward pass and the warm start's."""
    if mb.packed:
        picked = packed_logits(model, mb, device)
    else:
        logits = model(input_ids=mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device),
                       position_ids=mb.position_ids.to(device), logits_to_keep=mb.window, use_cache=False).logits
        picked = logits[:, :-1][mb.target_mask.to(device)]
    if temperature != 1.0:
        picked = picked.float() / temperature
    allowed = None if mb.allowed_bits is None else allowed_tokens(mb.allowed_bits.to(device), picked.shape[-1])
    return token_logprobs_and_entropy(picked, mb.targets.to(device), with_entropy, allowed)


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
