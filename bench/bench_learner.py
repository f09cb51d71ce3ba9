"""Learner step cost of GiGPO against GRPO on the same batches in the same run, weight-push cost, and the
learner's tokens/s inside a real run. < ~3 minutes on 2 cores (+ ~8 minutes for the two system runs).

- step = build the batch (rows + advantages) and train on it (one DeepSpeed ZeRO-2 fp32 engine on CPU, the
  tiny Qwen2 policy, synthetic ALFWorld-shaped batches), each batch trained on by both algorithms in
  alternating order (drift hits both alike): process CPU time with one torch thread (wall also printed),
  GiGPO / GRPO (target <= 1.02: the paper reports GRPO's cost; anchor grouping is the only extra work);
- peak memory: the RSS high-water mark above the pre-step RSS (after malloc_trim), sampled every 2 ms
  (torch's CPU tensors are invisible to tracemalloc), and tracemalloc's peak of building the batch;
- utilization (issue 48): the step's model FLOP/s (real tokens only) against the fp32 matrix-product peak
  measured in this process with the same thread count, and the share of computed tokens that were padding
  (learner/utilization.py; the learner reports the same per update, and so does the in-run part below);
- weight push, learner side: gathering `named_weights()` and writing them as safetensors buckets into shared
  memory (`common.weights.sender.write_buckets`) per update, against the bare gather;
- in a real run (`--system-updates`, default 6; 0 skips it): a short `gigpo train` of configs/embedded.yaml
  (warm start off, so both sides train the same initial model), async and with `run.sync=true`; its
  `perf/tokens_per_s` against this bench's on the same groups (tapped off the Redis stream, trained in the
  same order and batch size) with the learner's threads (common.processes.cpu_placement.compute_threads) and with one
  (how much of one core the learner gets). Target (issue 31): >= 0.9 where the learner has the machine to
  itself (sync); async, on cores both sides share, the ratio is the learner's share of them.
  `--system-only --config configs/alfworld-smollm2.yaml --system-updates 4`: the sync run of SmolLM2's config
  alone against the bench with the run's threads (issue 48's goal).
"""
import os
import sys
import tempfile
import threading
import time
import tracemalloc

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from tests.support.synthetic import synthetic_groups  # noqa: E402
from tests.support.tiny_policy import tiny_policy  # noqa: E402
from common.config import ExperimentConfig, LearnerConfig  # noqa: E402
from learner.batching import build_batch  # noqa: E402
from learner.trainer import PolicyTrainer, teardown_distributed  # noqa: E402

DEFAULTS = ExperimentConfig()      # the settings this bench does not choose, at the config's defaults
ROUNDS = int(os.environ.get("BENCH_LEARNER_ROUNDS", "6"))
GROUPS, GROUP_SIZE = 8, 8
# The learner's utilization figures (learner/utilization.py), per update
UTILIZATION = ("model_flops_per_s", "matmul_peak_flops_per_s", "matmul_peak_share", "padding_share")


class PeakRSS:
    """Highest RSS seen while the block runs, sampled by a thread every 2 ms."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def _malloc_trim() -> None:
    """Give freed heap back to the OS so every step's RSS baseline is the live set (glibc only)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def one_step(trainer, groups, cfg, update):
    _malloc_trim()
    tracemalloc.start()
    with PeakRSS() as rss:
        t0, c0 = time.perf_counter(), time.process_time()
        tracemalloc.reset_peak()
        batch = build_batch(groups, cfg, invalid_action_penalty=DEFAULTS.rollout.invalid_action_penalty)
        build_s = time.perf_counter() - t0
        _, build_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        metrics = trainer.train_step(batch, update=update).metrics
        step_s = time.perf_counter() - t0
        cpu_s = time.process_time() - c0
    return {"step_s": step_s, "cpu_s": cpu_s, "build_s": build_s, "build_peak_mb": build_peak / 2 ** 20,
            "rss_peak_mb": (rss.peak - rss.base) / 2 ** 20, "tokens": metrics["train/response_tokens"],
            **{k: metrics[f"perf/{k}"] for k in UTILIZATION}}


class StreamTap:
    """Every group published on a run's stream, decoded, in publish order: a plain XREAD (no consumer
    group, no ack) polled by a thread, which sees each entry long before the learner's ack deletes it."""

    def __init__(self, url: str, key: str):
        from common.stream.redis_client import connect
        self.redis, self.key, self.groups = connect(url), key, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from common.stream.codec import decode_group
        last = "0-0"
        while not self._stop.is_set():
            for _, entries in self.redis.xread({self.key: last}, count=100, block=200) or []:
                for entry_id, fields in entries:
                    last = entry_id
                    self.groups.append(decode_group(fields))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def in_system(updates: int, sync: bool, config: str = "configs/embedded.yaml", one_thread: bool = True) -> None:
    """Tokens/s of the learner inside a real run of `config` (async, or `run.sync`) against this bench's on
    the same groups (see the module); one_thread: also against one torch thread."""
    import json

    from common.config import load_config
    from common.processes.cpu_placement import compute_threads
    from common.stream.redis_stream import stream_key
    from deploy.system import System

    with tempfile.TemporaryDirectory(prefix="gigpo-bench-learner-", ignore_cleanup_errors=True) as out:
        cfg = load_config(config, [
            f"run.output_dir={out}", f"run.iterations={updates}", "run.eval_every=0", "model.warm_start_steps=0",
            "learner.checkpoint_every=0", f"run.sync={str(sync).lower()}"])
        with System(cfg) as system:
            system.start()
            tap = StreamTap(system.redis_url, stream_key(cfg.stream))
            try:
                history = system.train()
            finally:
                tap.close()
            model_path = system.model_path
        in_run = [m["perf/tokens_per_s"] for m in history[1:]]       # the first update warms up
        train_s = [m["time/train_s"] for m in history[1:]]
        shares = [m["perf/matmul_peak_share"] for m in history[1:]]
        padding = [m["perf/padding_share"] for m in history[1:]]
        size = cfg.learner.groups_per_batch
        batches = [tap.groups[i:i + size] for i in range(0, len(tap.groups) - size + 1, size)][:len(history)]
        threads = compute_threads(cfg.run.learner_cpus)
        alone = {n: train_alone(model_path, cfg, batches, n)
                 for n in sorted({threads, 1} if one_thread else {threads}, reverse=True)}
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line)["batch/rows"] for line in f]

    schedule = "sync: the rollout side idles while the learner trains" if sync else "async"
    print(f"learner in a real run ({config}, {schedule}, {threads} torch threads, {len(in_run)} updates "
          f"after a warm-up, ~{np.mean(rows):.0f} rows each): {np.median(in_run):.0f} tokens/s "
          f"(per update: {' '.join(f'{v:.0f}' for v in in_run)}); the learner's part of an update "
          f"{np.median(train_s):.0f} s (per update: {' '.join(f'{v:.0f}' for v in train_s)})")
    print(f"  its share of the learner's own matmul peak (same dtype, measured in the run): {np.median(shares):.2f}; "
          f"padding {np.median(padding):.1%} of the computed tokens")
    for n, rates in alone.items():
        print(f"this bench on the same groups, alone, {n} thread(s): {np.median(rates):.0f} tokens/s "
              f"(per update: {' '.join(f'{v:.0f}' for v in rates)})")
    print(f"in the run / on the bench ({threads} threads)   {np.median(in_run) / np.median(alone[threads]):.2f}  "
          + ("(target >= 0.9)" if sync else "(the learner's share of cores the rollout side also uses)"))
    if threads > 1 and 1 in alone:
        # The run's rollout side (vLLM, env workers) keeps the other cores busy while the learner trains:
        # against one thread alone this says how much of one core's worth the learner gets.
        print(f"in the run / on the bench (1 thread)    {np.median(in_run) / np.median(alone[1]):.2f}")


def train_alone(model_path: str, cfg, batches: list, threads: int) -> list[float]:
    """Tokens/s of a fresh learner (the run's config and initial model) training `batches` in order with
    `threads` torch threads, nothing else running; the first update warms up and is left out."""
    from common.processes.cpu_placement import use_compute_threads
    use_compute_threads(threads)
    trainer = PolicyTrainer(model_path, cfg.learner, dtype=cfg.model.dtype, head_dtype=cfg.model.head_dtype,
                            seed=cfg.run.seed, temperature=cfg.rollout.temperature)
    rates = []
    for i, groups in enumerate(batches):
        batch = build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty)
        m = trainer.train_step(batch, update=i).metrics
        if i:
            rates.append(m["perf/tokens_per_s"])
    # The process group stays for the next trainer: DeepSpeed keeps its groups cached, and a second
    # engine after destroy_process_group fails ("Group ... is not registered").
    trainer.close()
    return rates


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--system-updates", type=int, default=6, help="updates of the in-system run (0: skip it)")
    ap.add_argument("--config", default="configs/embedded.yaml", help="the in-system run's config")
    ap.add_argument("--system-only", action="store_true",
                    help="the in-system run in sync mode alone, against the bench with the run's threads (e.g. "
                         "--config configs/alfworld-smollm2.yaml: issue 48's goal for SmolLM2)")
    args = ap.parse_args()
    if args.system_only:
        in_system(args.system_updates, True, args.config, one_thread=False)
        return
    if args.system_updates:
        for sync in (False, True):
            in_system(args.system_updates, sync, args.config)
    # One thread, and CPU time as the figure: on a shared machine wall-clock swings by 2x from round to
    # round, and idle OpenMP threads spinning under contention would inflate CPU time.
    torch.set_num_threads(1)
    model = tiny_policy()
    base = LearnerConfig(zero_stage=2, mini_batch_rows=128, micro_batch_tokens=4096, lr=1e-5)
    trainer = PolicyTrainer(model, base, dtype="float32", head_dtype=DEFAULTS.model.head_dtype,
                            temperature=DEFAULTS.rollout.temperature, seed=DEFAULTS.run.seed)
    cfgs = {a: LearnerConfig(**{**base.__dict__, "algorithm": a}) for a in ("gigpo", "grpo")}
    batches = [synthetic_groups(GROUPS, GROUP_SIZE, vocab_size=1000, seed=100 + i, max_steps=6,
                                prompt_tokens=(64, 256), response_tokens=(8, 48), num_anchors=4)
               for i in range(ROUNDS + 1)]
    rows = sum(g.num_rows for g in batches[0])
    print(f"batch: {GROUPS} groups x {GROUP_SIZE} trajectories, ~{rows} rows; ZeRO-2 fp32 on CPU, "
          f"{ROUNDS} rounds (+1 warm-up)")
    one_step(trainer, batches[0], cfgs["gigpo"], 0)        # warm-up (first-step allocations)
    results = {"gigpo": [], "grpo": []}
    update = 1
    for i, groups in enumerate(batches[1:]):
        order = ("gigpo", "grpo") if i % 2 == 0 else ("grpo", "gigpo")
        for algo in order:
            results[algo].append(one_step(trainer, groups, cfgs[algo], update))
            update += 1

    for a, rs in results.items():
        print(f"  {a:6s} per-round step CPU s: " + " ".join(f"{r['cpu_s']:.2f}" for r in rs)
              + "   wall s: " + " ".join(f"{r['step_s']:.2f}" for r in rs))
    med = {a: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for a, rs in results.items()}
    for a, m in med.items():
        print(f"{a:6s} step CPU {m['cpu_s'] * 1000:8.1f} ms, wall {m['step_s'] * 1000:8.1f} ms "
              f"(build batch {m['build_s'] * 1000:6.1f} ms)  peak RSS +{m['rss_peak_mb']:7.1f} MB  "
              f"build tracemalloc peak {m['build_peak_mb']:6.2f} MB  {m['tokens'] / m['step_s']:8.0f} response tok/s")
    # Paired: both algorithms trained on the same batch back to back; the median of the per-batch ratios
    # cancels slow drifts of the machine's load.
    ratio_t = float(np.median([g["cpu_s"] / r["cpu_s"] for g, r in zip(results["gigpo"], results["grpo"])]))
    ratio_w = med["gigpo"]["step_s"] / med["grpo"]["step_s"]
    ratio_m = (med["gigpo"]["rss_peak_mb"] + 1e-9) / (med["grpo"]["rss_peak_mb"] + 1e-9)
    print(f"GiGPO / GRPO step time  {ratio_t:.3f}  (median of per-batch CPU-time ratios; target <= 1.02)   "
          f"wall-clock {ratio_w:.3f} (noisy on a shared machine)")
    print(f"GiGPO / GRPO peak RSS   {ratio_m:.3f}  (target <= 1.02)")
    u = med["gigpo"]
    print(f"utilization (GiGPO steps, one thread): {u['model_flops_per_s'] / 1e9:.2f} model GFLOP/s against this "
          f"process's fp32 matmul peak of {u['matmul_peak_flops_per_s'] / 1e9:.2f} GFLOP/s: "
          f"{u['matmul_peak_share']:.2f} of it; {u['padding_share']:.1%} of the computed tokens were padding")
    build_g, build_r = med["gigpo"]["build_peak_mb"], med["grpo"]["build_peak_mb"]
    print(f"GiGPO / GRPO build peak {build_g / build_r:.3f}  (advantage bookkeeping only; absolute: "
          f"{build_g - build_r:+.2f} MB)")

    # Weight push, learner side.
    from common.weights.sender import write_buckets
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    gather, push = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        tensors = [(n, t.clone()) for n, t in trainer.named_weights()]
        gather.append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        with tempfile.TemporaryDirectory(dir=shm) as d:
            t0 = time.perf_counter()
            files = write_buckets(trainer.named_weights(), d, DEFAULTS.inference.weight_bucket_mb * 2 ** 20)
            push.append(time.perf_counter() - t0)
    print(f"weight push (learner side, {nbytes / 2 ** 20:.1f} MB in {len(files)} bucket(s)): gather+copy "
          f"{np.median(gather) * 1000:.1f} ms, gather+write buckets {np.median(push) * 1000:.1f} ms per update "
          f"({np.median(push) / max(np.median(gather), 1e-9):.1f}x the bare gather); "
          f"{np.median(push) / med['grpo']['step_s'] * 100:.1f}% of a train step")
    trainer.close()
    teardown_distributed()


if __name__ == "__main__":
    main()
