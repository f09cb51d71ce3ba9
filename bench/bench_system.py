"""Async vs synchronous mode on the same config, same machine, same run: env steps/s and policy lag.

Synchronous mode (`run.sync=true`, the reference's schedule) plays one batch with the current weights, then
trains on it; the asynchronous default keeps playing while the learner trains (bounded by
`stream.max_policy_lag`). Target (issue 7): async >= 1.5x. "Played" counts env steps taken in the measured
window, "trained" the rows trained on in it; they differ by what the stream and the rollout slots held at the
window's edges (up to 2 updates' worth), so short windows swing by ~10%: hence 8 measured updates per mode
(~15 minutes for both placements on 2 cores). The learner's wait for data and the rollout slots' share of
time blocked by a full stream say which side bounds the async mode.

    python bench/bench_system.py [--updates 8] [--placements split,shared] [overrides...]
"""
import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common.config import load_config  # noqa: E402
from deploy.system import System  # noqa: E402


def measure(sync: bool, updates: int, overrides: list[str], out_dir: str) -> dict:
    cfg = load_config("configs/embedded.yaml", [
        f"run.output_dir={out_dir}", f"run.iterations={updates + 1}", "run.eval_every=0",
        f"run.sync={'true' if sync else 'false'}", "learner.checkpoint_every=0", *overrides])
    with System(cfg) as system:
        system.start()
        # One warm-up update (engine compilation, first env resets), then the measured ones.
        cfg.run.iterations = 1
        system.train()
        before = system.rollouts.stats()
        t0 = time.perf_counter()
        cfg.run.iterations = updates + 1
        history = system.train()
        wall = time.perf_counter() - t0
        after = system.rollouts.stats()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("env_steps", "admission_wait_s", "weight_wait_s")}
    slots = cfg.rollout.num_actors * cfg.rollout.groups_per_actor
    mean = lambda key: sum(m.get(key, 0.0) for m in history) / max(len(history), 1)  # noqa: E731
    return {"steps_per_s": delta["env_steps"] / wall,
            # the share of rollout slot time spent waiting for room in the stream (learner-bound when high)
            "blocked": delta["admission_wait_s"] / (slots * wall), "weight_wait_s": delta["weight_wait_s"] / slots,
            "waits": [round(m.get("time/wait_data_s", 0.0), 1) for m in history],
            "wall_s": wall, "updates": len(history),
            # rows = env steps; the played steps of groups dropped as stale are not trained on
            "trained_steps_per_s": sum(m.get("batch/rows", 0.0) for m in history) / wall,
            "dropped_stale": history[-1].get("stream/dropped_stale", 0.0) if history else 0.0,
            "wait_s": mean("time/wait_data_s"), "train_s": mean("time/train_s"),
            "recompute_s": mean("time/recompute_s"), "push_s": mean("time/push_weights_s"),
            "lag_mean": mean("lag/policy_versions_mean"),
            "lag_max": max((m.get("lag/policy_versions_max", 0.0) for m in history), default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=8, help="measured updates per mode")
    ap.add_argument("--modes", default="sync,async", help="comma-separated; the ratio needs both")
    ap.add_argument("--placements", default="shared,split",
                    help="shared: every process may use every CPU (the embedded default); split: the learner "
                         "gets CPU 0 and the rollout side the others, as on a cluster where they own "
                         "different devices")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    ncpu = len(os.sched_getaffinity(0))
    placements = {"shared": [], "split": ["run.learner_cpus=0", f"run.rollout_cpus=1-{ncpu - 1}"]}
    for placement in args.placements.split(","):
        results = {}
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix=f"gigpo-bench-{mode}-", ignore_cleanup_errors=True) as out:
                results[mode] = measure(mode == "sync", args.updates, placements[placement] + args.overrides, out)
            r = results[mode]
            print(f"{placement:6s} {mode:5s}: {r['steps_per_s']:5.1f} env steps/s played, "
                  f"{r['trained_steps_per_s']:5.1f} trained, over {r['updates']} updates ({r['wall_s']:.0f} s); "
                  f"policy lag mean {r['lag_mean']:.2f}, max {r['lag_max']:.0f}; groups dropped stale "
                  f"{r['dropped_stale']:.0f}; learner per update: waits {r['wait_s']:.1f} s for data, trains "
                  f"{r['train_s']:.1f} s (of which recomputing old log-probs {r['recompute_s']:.1f} s), pushes "
                  f"weights {r['push_s']:.2f} s; "
                  f"waits per update {r['waits']}; rollout slots blocked by a full stream {100 * r['blocked']:.0f}% "
                  f"of the time, paused by weight updates {r['weight_wait_s']:.1f} s per slot", flush=True)
        if set(results) == {"sync", "async"}:
            played = results["async"]["steps_per_s"] / max(results["sync"]["steps_per_s"], 1e-9)
            trained = results["async"]["trained_steps_per_s"] / max(results["sync"]["trained_steps_per_s"], 1e-9)
            print(f"{placement:6s} async / sync env steps/s: {played:.2f}x played, {trained:.2f}x trained  "
                  f"(target >= 1.5x)", flush=True)


if __name__ == "__main__":
    main()
