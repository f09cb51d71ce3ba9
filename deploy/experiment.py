"""Learning check: GiGPO against GRPO on the embedded task, a few seeds each, the same budget.

    python -m deploy.experiment --out docs                       # `make experiment`
    python -m deploy.experiment --out /tmp/x --seeds 1 --iterations 4 --target 0.3

Each run is a plain `gigpo train <config>` in its own process (own Ray, own embedded Redis) with
`learner.algorithm` and `run.seed` set and in-training evaluation off; everything else (warm start
included) comes from the config, so both algorithms see the same start and the same number of learner
updates. Success is the training rollouts' success rate per update (`batch/success_rate` in each run's
metrics.jsonl: the trajectories of the groups that update trained on) against the env steps played so far (`rollout/env_steps_total`).

Writes <out>/learning-check.png (success against env steps: mean over seeds, one line per algorithm, the
seeds faint) and <out>/learning-check.md (the command, a table of start/end success per algorithm and the
env steps each needed to first reach --target, smoothed over --smooth updates).
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ALGORITHMS = ("gigpo", "grpo")


def run_one(config: str, algorithm: str, seed: int, iterations: int, run_dir: Path, overrides: list[str],
            timeout_s: float, reuse_from: Path | None = None) -> dict:
    """One training run in a subprocess; returns {"ok", "wall_s", "log"} (its metrics stay in run_dir)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if reuse_from is not None:
        # Same seed, same warm-start settings: the other algorithm's initial model is this one's too
        # (warm_start reuses it when its recorded settings match, so nothing is trained twice).
        for name in ("tiny_model", "warm_model"):
            if (reuse_from / name).is_dir() and not (run_dir / name).exists():
                shutil.copytree(reuse_from / name, run_dir / name)
    cmd = [sys.executable, "-m", "deploy.cli", "train", config, f"run.output_dir={run_dir}",
           f"run.seed={seed}", f"learner.algorithm={algorithm}", f"run.iterations={iterations}",
           "run.eval_every=0", f"run.name={algorithm}-s{seed}",
           "run.overwrite=true",       # a re-run of the experiment starts each run afresh
           *overrides]
    log_path = run_dir / "train.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    return {"ok": rc == 0, "rc": rc, "wall_s": time.perf_counter() - t0, "log": str(log_path)}


def read_curve(run_dir: Path) -> list[tuple[float, float]]:
    """(env steps played so far, success rate of the batch trained on) per update of one run."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    curve = []
    for line in path.read_text().splitlines():
        m = json.loads(line)
        if "rollout/env_steps_total" in m and "batch/success_rate" in m:
            curve.append((float(m["rollout/env_steps_total"]), float(m["batch/success_rate"])))
    return curve


def smooth(values: list[float], k: int) -> list[float]:
    """Trailing mean over the last k values (fewer at the start)."""
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1]) for i in range(len(values))]


def steps_to_reach(curve: list[tuple[float, float]], target: float, k: int) -> float | None:
    """Env steps at the first update whose smoothed success reaches target (None: never)."""
    sm = smooth([s for _, s in curve], k)
    return next((curve[i][0] for i, v in enumerate(sm) if v >= target), None)


def summarize(curves: dict[str, dict[int, list]], target: float, k: int) -> list[dict]:
    rows = []
    for algo, by_seed in curves.items():
        done = {s: c for s, c in by_seed.items() if c}
        reach = {s: steps_to_reach(c, target, k) for s, c in done.items()}
        firsts = [sum(v for _, v in c[:k]) / len(c[:k]) for c in done.values()]
        lasts = [sum(v for _, v in c[-k:]) / len(c[-k:]) for c in done.values()]
        rows.append({"algorithm": algo, "seeds": len(done),
                     "start": sum(firsts) / len(firsts) if firsts else float("nan"),
                     "end": sum(lasts) / len(lasts) if lasts else float("nan"),
                     "end_per_seed": lasts, "reach": reach,
                     "env_steps": sum(c[-1][0] for c in done.values()) / max(len(done), 1)})
    return rows


def plot(curves: dict[str, dict[int, list]], path: Path, target: float, k: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for color, (algo, by_seed) in zip(("tab:blue", "tab:orange", "tab:green"), curves.items()):
        done = [c for c in by_seed.values() if c]
        for c in done:
            ax.plot([x for x, _ in c], smooth([y for _, y in c], k), color=color, alpha=0.25, lw=1)
        if done:
            n = min(len(c) for c in done)
            xs = np.mean([[x for x, _ in c[:n]] for c in done], axis=0)
            ys = np.mean([smooth([y for _, y in c], k)[:n] for c in done], axis=0)
            ax.plot(xs, ys, color=color, lw=2.2, label=f"{algo} (mean of {len(done)} seeds)")
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"target {target:.0%}")
    ax.set_xlabel("env steps")
    ax.set_ylabel(f"training success rate (trailing mean of {k} updates)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Embedded task (tiny model, generated ALFWorld games): GiGPO vs GRPO", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_markdown(rows: list[dict], path: Path, command: str, target: float, k: int, runs: dict,
                   iterations: int) -> None:
    fmt = lambda v: "never" if v is None else f"{v:,.0f}"
    lines = ["# Learning check: GiGPO vs GRPO on the embedded task", "",
             f"Made by `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).", "",
             f"Each run: `gigpo train` of the embedded config, {iterations} learner updates, in-training "
             "evaluation off; success = training-rollout success rate per update "
             f"(trailing mean of {k} updates). Plot: learning-check.png. Both algorithms of a seed start "
             "from the same warm-started model.", "",
             f"| algorithm | seeds | success at start | success at end | per seed at end | env steps per run "
             f"| env steps to reach {target:.0%} (per seed) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        reach = ", ".join(f"s{s}: {fmt(v)}" for s, v in sorted(r["reach"].items()))
        lines.append(f"| {r['algorithm']} | {r['seeds']} | {100 * r['start']:.1f}% | {100 * r['end']:.1f}% | "
                     f"{', '.join(f'{100 * v:.0f}%' for v in r['end_per_seed'])} | {r['env_steps']:,.0f} | "
                     f"{reach} |")
    failed = [f"{name} (rc {info['rc']}, log {info['log']})" for name, info in runs.items() if not info["ok"]]
    if failed:
        lines += ["", "Runs that did not finish: " + "; ".join(failed)]
    walls = [info["wall_s"] for info in runs.values()]
    if walls:
        lines += ["", f"Wall time per run: {min(walls) / 60:.1f}-{max(walls) / 60:.1f} min on this machine."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GiGPO vs GRPO learning check on the embedded task.")
    ap.add_argument("--out", default="docs", help="where learning-check.png / .md go")
    ap.add_argument("--config", default="configs/embedded.yaml")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=24, help="learner updates per run (same for all)")
    ap.add_argument("--target", type=float, default=0.3, help="success rate whose first crossing is reported")
    ap.add_argument("--smooth", type=int, default=3, help="updates in the trailing mean")
    ap.add_argument("--work-dir", default="runs/experiment", help="run directories (kept: metrics, logs)")
    ap.add_argument("--timeout-min", type=float, default=20.0, help="a run slower than this is stopped")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (section.field=value)")
    args = ap.parse_args(argv)

    out, work = Path(args.out), Path(args.work_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m deploy.experiment " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    curves: dict[str, dict[int, list]] = {a: {} for a in args.algorithms}
    runs: dict[str, dict] = {}
    for seed in range(args.seeds):                 # seed-major: a cut-short experiment still compares
        for algo in args.algorithms:
            run_dir = work / f"{algo}-s{seed}"
            print(f"[experiment] {algo} seed {seed} -> {run_dir}", flush=True)
            first = work / f"{args.algorithms[0]}-s{seed}"
            info = run_one(args.config, algo, seed, args.iterations, run_dir, args.overrides, 60 * args.timeout_min,
                           reuse_from=first if first != run_dir else None)
            runs[f"{algo}-s{seed}"] = info
            curves[algo][seed] = read_curve(run_dir)
            c = curves[algo][seed]
            print(f"[experiment] {algo} seed {seed}: {'ok' if info['ok'] else 'FAILED'} in "
                  f"{info['wall_s'] / 60:.1f} min; success {c[0][1] if c else float('nan'):.2f} -> "
                  f"{c[-1][1] if c else float('nan'):.2f}", flush=True)
            rows = summarize(curves, args.target, args.smooth)
            plot(curves, out / "learning-check.png", args.target, args.smooth)
            write_markdown(rows, out / "learning-check.md", command, args.target, args.smooth, runs, args.iterations)
    for r in summarize(curves, args.target, args.smooth):
        print(f"{r['algorithm']:>6}: success {100 * r['start']:.1f}% -> {100 * r['end']:.1f}% over {r['seeds']} "
              f"seeds; env steps to {args.target:.0%}: {r['reach']}")
    print(f"wrote {out / 'learning-check.png'} and {out / 'learning-check.md'}")
    return 0 if all(i["ok"] for i in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
