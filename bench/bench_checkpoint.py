"""What a durable checkpoint costs (issue 64): every file and directory of a checkpoint is fsynced, and its
completion mark and `latest` written durably, before its groups are acked (learner.trainer.save_checkpoint).

- tiny model: the learner's real save (DeepSpeed ZeRO-2, fp32, after one update, so the optimizer's state is in
  it) against the same save with the fsyncs left out, alternating, `--rounds` each: median seconds and ratio;
- the 1.5B shape (`--large-shape`, default qwen2.5-1.5b; `--large-shape ""` skips it): files of the sizes
  DeepSpeed's ZeRO-2 checkpoint has for it (the module in bf16, 2 bytes a parameter; fp32 master weights and
  Adam's two moments, 12), written without and then with the fsyncs, once each, in `--dir` (default: a temporary
  directory beside the runs, on the disk a run's checkpoints go to). Each pass writes ~21 GB (skipped when the
  disk has less than twice that free); the disk is flushed (untimed) before each.

The ratio is the figure: both sides run in the same process, on the same disk, in the same minute.
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from common.atomic_write import fsync_tree  # noqa: E402
from tests.support.model_shapes import SHAPES, meta_causal_lm  # noqa: E402
from tests.support.synthetic import synthetic_groups  # noqa: E402
from tests.support.tiny_policy import tiny_policy  # noqa: E402

CHUNK = 64 << 20        # bytes per write() of the large shape's files


def tiny_saves(rounds: int, where: Path) -> tuple[list[float], list[float]]:
    """Seconds per save of the tiny model's learner: durable (as a run saves), and with the fsyncs left out."""
    import learner.trainer as trainer_module
    from common.config import ExperimentConfig, LearnerConfig
    from learner.batching import build_batch
    from learner.trainer import PolicyTrainer

    DEFAULTS = ExperimentConfig()      # the settings this bench does not choose, at the config's defaults
    torch.set_num_threads(1)
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=128, micro_batch_tokens=4096, lr=1e-5)
    trainer = PolicyTrainer(tiny_policy(), cfg, dtype="float32", head_dtype=DEFAULTS.model.head_dtype,
                            temperature=DEFAULTS.rollout.temperature, seed=DEFAULTS.run.seed)
    groups = synthetic_groups(4, 4, vocab_size=1000, seed=1, max_steps=4, prompt_tokens=(32, 64),
                              response_tokens=(8, 16), num_anchors=2)
    batch = build_batch(groups, cfg, invalid_action_penalty=DEFAULTS.rollout.invalid_action_penalty)
    trainer.train_step(batch, update=1)                      # the optimizer's state exists after a step
    durable_fsync, durable_write = trainer_module.fsync_tree, trainer_module.write_atomically

    def save(durable: bool) -> float:
        if not durable:
            trainer_module.fsync_tree = lambda root: None
            trainer_module.write_atomically = lambda path, text, durable=False, mode=None: durable_write(
                path, text, durable=False, mode=mode)
        try:
            os.sync()                                        # each save starts with nothing else to flush
            t0 = time.perf_counter()
            trainer.save_checkpoint(where, {"updates": 1}, keep=1)
            return time.perf_counter() - t0
        finally:
            trainer_module.fsync_tree, trainer_module.write_atomically = durable_fsync, durable_write

    save(True)                                               # warm-up (first-save allocations, directories)
    durable, plain = [], []
    for i in range(rounds):
        for is_durable in ((True, False) if i % 2 == 0 else (False, True)):
            (durable if is_durable else plain).append(save(is_durable))
    return durable, plain


def checkpoint_bytes(shape: str) -> dict[str, int]:
    """DeepSpeed ZeRO-2's files for one process and the model `shape` (SHAPES), by name: bytes."""
    params = sum(p.numel() for p in meta_causal_lm(SHAPES[shape]).parameters())
    return {"mp_rank_00_model_states.pt": 2 * params, "zero_pp_rank_0_mp_rank_00_optim_states.pt": 12 * params}


def write_files(root: Path, sizes: dict[str, int], durable: bool) -> float:
    """Seconds to write `sizes` under root (then fsync_tree, when durable)."""
    block = os.urandom(CHUNK)
    root.mkdir(parents=True)
    os.sync()
    t0 = time.perf_counter()
    for name, size in sizes.items():
        with open(root / name, "wb") as f:
            for start in range(0, size, CHUNK):
                f.write(block[:min(CHUNK, size - start)])
    if durable:
        fsync_tree(root)
    took = time.perf_counter() - t0
    shutil.rmtree(root)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="saves of each kind, tiny model")
    ap.add_argument("--large-shape", default="qwen2.5-1.5b", help="a shape of tests/support/model_shapes.py "
                                                                   '("" skips it)')
    ap.add_argument("--dir", default="runs", help="where the large shape's files are written (made if missing)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        durable, plain = tiny_saves(args.rounds, Path(tmp))
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    d, p = statistics.median(durable), statistics.median(plain)
    print(f"tiny model ({size / 2**20:.1f} MiB a checkpoint): save {p * 1000:.0f} ms without fsync, "
          f"{d * 1000:.0f} ms durable: {d / p:.2f}x  (medians of {args.rounds})")

    if args.large_shape:
        sizes = checkpoint_bytes(args.large_shape)
        total = sum(sizes.values())
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(args.dir).free
        if free < 2 * total:        # one pass at a time, and room left for everyone else on the disk
            print(f"{args.large_shape} shape: skipped, {args.dir} has {free / 1e9:.0f} GB free and a pass writes "
                  f"{total / 1e9:.1f} GB (twice that needed)")
            return
        with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=args.dir) as tmp:
            plain_s = write_files(Path(tmp) / "plain", sizes, durable=False)
            durable_s = write_files(Path(tmp) / "durable", sizes, durable=True)
        print(f"{args.large_shape} shape ({total / 1e9:.1f} GB a checkpoint, ZeRO-2): written in {plain_s:.1f} s "
              f"without fsync, {durable_s:.1f} s durable: {durable_s / plain_s:.2f}x  "
              f"({total / durable_s / 1e9:.2f} GB/s to disk)")


if __name__ == "__main__":
    main()
