"""Learning check: does GiGPO shorten episodes where GRPO cannot? GiGPO against GRPO from one warm start.

    make experiment                                        # = python -m deploy.experiment --out docs
    python -m deploy.experiment --quick --out /tmp/pilot   # the pilot: 1 seed each, fewer updates and games
    python -m deploy.experiment --report --out docs        # the report again, from the runs in --work-dir

Why this set-up: a group where every rollout succeeds gives GRPO no gradient, while GiGPO still ranks the
steps of the shorter path above the detours. So one warm start lifts the tiny model to about two thirds of the
held-out games solved (63-68% measured); from it, each seed trains GiGPO and GRPO for the same updates
(`Protocol`), each run (a plain `gigpo train` subprocess) evaluating the held-out games before and after.

Primary measure: steps to finish each held-out game after training (a failure counts as the step budget),
paired game by game; secondary: success within `Protocol.fast_steps` steps, and success. 95% intervals over
games (Student t) and over seeds. Writes <out>/learning-check.md and .png; run directories stay in --work-dir.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

COMPARED = ("gigpo", "grpo")        # the two learner.algorithm choices this experiment compares
RUN_INFO = "experiment_run.json"     # in each run directory: how the run ended and its wall time


@dataclass(frozen=True)
class Protocol:
    seeds: int = 3
    updates: int = 12
    tasks_per_update: int = 8
    rollouts_per_task: int = 8
    train_games: int = 512           # the generator's eval split gets a quarter as many: 128 held-out games
    eval_games: int = 128
    step_budget: int = 30            # env.max_steps: a failure counts as this many steps
    history_length: int = 0          # the observation alone: half the prompt tokens of the default's 2
    fast_steps: int = 8              # secondary measure: success within this many steps
    eval_temperature: float = 0.4
    warm_start_steps: int = 200
    warm_start_games: int = 256

    def overrides(self) -> list[str]:
        """Config overrides every run of the experiment shares (the warm start's included)."""
        return [f"env.num_generated_games={self.train_games}", f"env.max_steps={self.step_budget}",
                f"rollout.groups_per_actor={self.tasks_per_update}", f"rollout.group_size={self.rollouts_per_task}",
                f"rollout.history_length={self.history_length}",
                f"learner.groups_per_batch={self.tasks_per_update}",
                f"stream.max_stream_groups={2 * self.tasks_per_update}",   # = max_policy_lag x groups per batch
                f"rollout.eval_temperature={self.eval_temperature}", f"run.eval_episodes={self.eval_games}",
                f"model.warm_start_steps={self.warm_start_steps}", f"model.warm_start_games={self.warm_start_games}"]


QUICK = Protocol(seeds=1, updates=4, eval_games=32)


# -- runs ------------------------------------------------------------------------------------------------

def build_warm_model(config: str, protocol: Protocol, work: Path, overrides: list[str]) -> str:
    """The one warm-started model every run starts from (reused when its settings are unchanged)."""
    from common.config import load_config
    from deploy.models import prepare_model_path
    from deploy.warm_start import warm_start
    cfg = load_config(config, [*protocol.overrides(), *overrides, f"run.output_dir={work / 'warm'}", "run.seed=0"])
    return str(Path(warm_start(cfg, prepare_model_path(cfg.model.path, cfg.run.output_dir))).resolve())


def run_one(config: str, protocol: Protocol, algorithm: str, seed: int, warm_model: str, run_dir: Path,
            overrides: list[str], timeout_s: float) -> dict:
    """One training run in a subprocess: {"ok", "rc", "wall_s", "log"} (its outputs stay in run_dir)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "deploy.cli", "train", config, *protocol.overrides(), *overrides,
           f"model.path={warm_model}", "model.warm_start_steps=0",   # every run starts from the same model
           f"run.output_dir={run_dir}", f"run.seed={seed}", f"learner.algorithm={algorithm}",
           f"run.iterations={protocol.updates}", f"run.eval_every={protocol.updates}",  # before and after only
           f"run.name={algorithm}-s{seed}", "run.overwrite=true"]
    log_path = run_dir / "train.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    info = {"ok": rc == 0, "rc": rc, "wall_s": time.perf_counter() - t0, "log": str(log_path)}
    (run_dir / RUN_INFO).write_text(json.dumps(info) + "\n")      # for --report
    return info


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path.read_text().splitlines() if path.exists() else [])]


def read_evals(run_dir: Path) -> dict[str, list[dict]]:
    """{"before": episodes, "after": episodes} of a run's evals.jsonl (missing ones left out)."""
    keys = {"before training": "before", "after training": "after"}
    return {keys[e["when"]]: e["episodes_detail"] for e in _read_jsonl(run_dir / "evals.jsonl")
            if e.get("when") in keys}


def read_curves(run_dir: Path) -> list[dict]:
    """Per update of one run: its metrics.jsonl line (training-batch success, steps, diagnostics)."""
    return [m for m in _read_jsonl(run_dir / "metrics.jsonl") if "batch/success_rate" in m]


# -- statistics --------------------------------------------------------------------------------------------

# (key, title, scale, unit) of each measure, the primary first.
MEASURES = (("steps", "mean steps (failure = budget)", 1.0, ""), ("fast", "success within {fast} steps", 100.0, "%"),
            ("success", "success", 100.0, "%"))
MEASURE_KEYS = tuple(key for key, *_ in MEASURES)
# (metrics.jsonl key, title, format) of each advantage diagnostic the report averages.
DIAGNOSTICS = (("diag/adv_cosine_vs_grpo", "cosine GiGPO vs GRPO advantages", "{:.3f}"),
               ("diag/adv_sign_differs_share", "rows whose sign differs", "{:.1%}"),
               ("diag/groups_all_success_share", "groups all successful", "{:.1%}"),
               ("diag/success_episode_length_mean", "steps of successful episodes", "{:.1f}"),
               ("anchor/nonzero_step_adv_share", "rows with a non-zero step advantage", "{:.1%}"))

def per_game(episodes: list[dict], budget: int, fast_steps: int) -> dict[str, dict[str, float]]:
    """task id -> {"steps": steps to finish (a failure: the budget), "fast": solved within fast_steps,
    "success": solved}; a game played more than once gets the mean of its episodes."""
    acc: dict[str, list[tuple[float, float, float]]] = {}
    for e in episodes:
        won = bool(e["success"])
        acc.setdefault(e["task_id"], []).append((float(e["steps"]) if won else float(budget),
                                                 float(won and e["steps"] <= fast_steps), float(won)))
    return {g: {k: sum(v[i] for v in vals) / len(vals) for i, k in enumerate(MEASURE_KEYS)}
            for g, vals in acc.items()}


def t_quantile_975(dof: int) -> float:
    """Two-sided 95% quantile of Student's t (exact table to 10 degrees of freedom, Cornish-Fisher beyond:
    within 0.002 of the exact value from 11 on)."""
    table = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
    if dof < 1:
        return float("nan")
    if dof <= len(table):
        return table[dof - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t interval); the half-width is NaN for fewer than 2 values."""
    if not values:
        return float("nan"), float("nan")
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def paired(a: dict[int, dict[str, dict]], b: dict[int, dict[str, dict]], key: str) -> dict:
    """A against B on one measure, games paired: a/b are {seed: per_game table} after training. Returns
    the mean difference (A - B) with its 95% interval over games (each game's difference averaged over the
    seeds both have) and over seeds (each seed's mean difference over its games)."""
    seeds = sorted(set(a) & set(b))
    games = sorted(set.intersection(*(set(a[s]) & set(b[s]) for s in seeds))) if seeds else []
    by_game = [sum(a[s][g][key] - b[s][g][key] for s in seeds) / len(seeds) for g in games]
    by_seed = [sum(a[s][g][key] - b[s][g][key] for g in games) / len(games) for s in seeds] if games else []
    (m, ci_games), (_, ci_seeds) = mean_ci(by_game), mean_ci(by_seed)
    return {"diff": m, "ci_games": ci_games, "ci_seeds": ci_seeds, "games": len(games), "seeds": len(seeds),
            "by_seed": dict(zip(seeds, by_seed))}


def measures(table: dict[str, dict]) -> dict[str, float]:
    """Mean of each measure over the games of one evaluation."""
    n = max(len(table), 1)
    return {k: sum(v[k] for v in table.values()) / n for k in MEASURE_KEYS}


# -- report --------------------------------------------------------------------------------------------------

def summarize(evals: dict[str, dict[int, dict]], protocol: Protocol) -> dict:
    """evals: {algorithm: {seed: {"before": episodes, "after": episodes}}} -> every figure the report shows."""
    tables = {a: {s: {w: per_game(e[w], protocol.step_budget, protocol.fast_steps) for w in ("before", "after")
                      if w in e} for s, e in by_seed.items()} for a, by_seed in evals.items()}
    out: dict = {"algorithms": {}, "paired": {}}
    for algo, by_seed in tables.items():
        row = {}
        for when in ("before", "after"):
            per_seed = [measures(t[when]) for t in by_seed.values() if when in t]
            row[when] = {k: mean_ci([m[k] for m in per_seed]) for k in MEASURE_KEYS}
            row[f"{when}_seeds"] = len(per_seed)
        row["seeds"] = row["after_seeds"]
        done = {s: t for s, t in by_seed.items() if "before" in t and "after" in t}
        row["change"] = {k: paired({s: t["after"] for s, t in done.items()},
                                   {s: t["before"] for s, t in done.items()}, k) for k in MEASURE_KEYS}
        out["algorithms"][algo] = row
    if all(a in tables for a in COMPARED):
        after = {a: {s: t["after"] for s, t in tables[a].items() if "after" in t} for a in COMPARED}
        out["paired"] = {k: paired(after["gigpo"], after["grpo"], k) for k in MEASURE_KEYS}
    return out


def diagnostics(curves: dict[str, dict[int, list[dict]]]) -> dict[str, dict[str, float]]:
    """Per algorithm, the mean over every update of every seed of the advantage diagnostics."""
    out = {}
    for algo, by_seed in curves.items():
        vals = {k: [m[k] for c in by_seed.values() for m in c if isinstance(m.get(k), float) and not math.isnan(m[k])]
                for k, *_ in DIAGNOSTICS}
        out[algo] = {k: sum(v) / len(v) for k, v in vals.items() if v}
    return out


def plot(curves: dict[str, dict[int, list[dict]]], path: Path, protocol: Protocol, summary: dict | None = None
         ) -> None:
    """Training-batch success and mean steps per update (thin: each seed; thick: their mean), with the
    held-out evaluations before and after as markers (the comparison: a seed's two runs draw the same tasks,
    so their training curves move together with the tasks' difficulty)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for ax, key, measure, label in ((axes[0], "batch/success_rate", "success", "success rate"),
                                    (axes[1], "batch/episode_steps_mean", "steps", "mean steps per episode")):
        for color, (algo, by_seed) in zip(("tab:blue", "tab:orange"), curves.items()):
            done = [c for c in by_seed.values() if c]
            for c in done:
                ax.plot([m["update"] for m in c], [m.get(key, np.nan) for m in c], color=color, alpha=0.3, lw=1)
            if done:
                n = min(len(c) for c in done)
                ax.plot([m["update"] for m in done[0][:n]], np.mean([[m.get(key, np.nan) for m in c[:n]] for c in done],
                        axis=0), color=color, lw=2.2, label=f"{algo} training (mean of {len(done)} seeds; faint: each)")
            row = (summary or {}).get("algorithms", {}).get(algo, {})
            for when, x in (("before", 0), ("after", protocol.updates)):
                if row.get(f"{when}_seeds"):
                    ax.plot([x], [row[when][measure][0]], marker="o" if when == "before" else "D", color=color,
                            ms=8, ls="", markeredgecolor="black",
                            label=(f"{algo} held-out {when} (mean of {row[f'{when}_seeds']})"
                                   if key == "batch/success_rate" else None))
        ax.set_xlabel("update")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1)
    axes[1].set_ylim(0, protocol.step_budget)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"GiGPO vs GRPO from one warm start: generated ALFWorld, {protocol.tasks_per_update} tasks x "
                 f"{protocol.rollouts_per_task} rollouts per update, step budget {protocol.step_budget}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(mean_ci_pair: tuple[float, float], scale: float, unit: str) -> str:
    m, ci = mean_ci_pair
    return f"{scale * m:.1f}{unit}" + ("" if math.isnan(ci) else f" ± {scale * ci:.1f}")


def _ci(half_width: float, scale: float, unit: str) -> str:
    return "n/a" if math.isnan(half_width) else f"± {scale * half_width:.1f}{unit}"


def _fmt_paired(d: dict, scale: float, unit: str) -> str:
    """A paired difference with its intervals over games and over seeds."""
    return (f"{scale * d['diff']:+.1f}{unit} (games {_ci(d['ci_games'], scale, unit)}, "
            f"seeds {_ci(d['ci_seeds'], scale, unit)})")


def code_commit() -> str:
    """The checkout's commit for the report's header (or "unknown"), "+ uncommitted changes" if tracked files differ."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + (" + uncommitted changes" if dirty else "")) if head else "unknown"


def write_markdown(summary: dict, diags: dict, runs: dict, protocol: Protocol, command: str, path: Path) -> None:
    p = protocol
    titles = [title.format(fast=p.fast_steps) for _, title, *_ in MEASURES]
    lines = ["# Learning check: GiGPO vs GRPO where they should differ", "",
             f"Made by `{command}` at commit {code_commit()} "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).", "",
             f"Protocol: one warm start ({p.warm_start_steps} supervised steps on the walkthroughs of "
             f"{p.warm_start_games} training games), then for each of {p.seeds} seed(s) one GiGPO and one GRPO run "
             f"from it: {p.updates} updates of {p.tasks_per_update} tasks x {p.rollouts_per_task} rollouts on "
             f"{p.train_games} generated games, step budget {p.step_budget}. Each run evaluates the same "
             f"{p.eval_games} held-out games before and after training at temperature {p.eval_temperature}. "
             "Steps: steps to finish a game, a failure counting as the budget. Intervals: 95%, over seeds "
             "(here) and, for the paired differences, also over games.", "",
             "| algorithm | seeds | | " + " | ".join(titles) + " |",
             "|---|---|---|" + "---|" * len(MEASURES)]
    for algo, row in summary["algorithms"].items():
        for when in ("before", "after"):
            cells = [_fmt(row[when][k], scale, unit) for k, _, scale, unit in MEASURES]
            lines.append(f"| {algo} | {row['seeds']} | {when} | " + " | ".join(cells) + " |")
    if summary["paired"]:
        lines += ["", "**GiGPO minus GRPO after training, paired by held-out game** (negative steps: GiGPO finishes "
                  "sooner). Each cell: the difference, its 95% interval over games, and over seeds:", "",
                  "| measure | difference | 95% interval over games | 95% interval over seeds | per seed |",
                  "|---|---|---|---|---|"]
        for (k, _, scale, unit), title in zip(MEASURES, titles):
            d = summary["paired"][k]
            per_seed = ", ".join(f"s{seed}: {scale * v:+.1f}{unit}" for seed, v in d["by_seed"].items())
            lines.append(f"| {title} | {scale * d['diff']:+.1f}{unit} | "
                         f"{_ci(d['ci_games'], scale, unit)} ({d['games']} games) | "
                         f"{_ci(d['ci_seeds'], scale, unit)} ({d['seeds']} seeds) | {per_seed} |")
    lines += ["", "Change from before to after training, paired by held-out game (after minus before):", "",
              "| algorithm | " + " | ".join(titles) + " |",
              "|---|" + "---|" * len(MEASURES)]
    for algo, row in summary["algorithms"].items():
        lines.append(f"| {algo} | " + " | ".join(_fmt_paired(row["change"][k], scale, unit)
                                                  for k, _, scale, unit in MEASURES) + " |")
    if diags:
        lines += ["", "Advantage diagnostics, mean over every update of every seed (`diag/*` in metrics.jsonl):", "",
                  "| algorithm | " + " | ".join(title for _, title, _ in DIAGNOSTICS) + " |",
                  "|---|" + "---|" * len(DIAGNOSTICS)]
        for algo, d in diags.items():
            lines.append(f"| {algo} | " + " | ".join(form.format(d[k]) if k in d else "-" for k, _, form in DIAGNOSTICS)
                         + " |")
    failed = [f"{name} (rc {info['rc']}, log {info['log']})" for name, info in runs.items() if not info["ok"]]
    if failed:
        lines += ["", "Runs that did not finish: " + "; ".join(failed)]
    walls = [info["wall_s"] for info in runs.values()]
    if walls:
        lines += ["", f"Wall time per run: {min(walls) / 60:.1f}-{max(walls) / 60:.1f} min on this machine. "
                  "Plot: learning-check.png."]
    path.write_text("\n".join(lines) + "\n")


def write_report(evals: dict, curves: dict, runs: dict, protocol: Protocol, command: str, out: Path) -> dict:
    """<out>/learning-check.md and .png from the runs so far; returns the summary."""
    summary = summarize(evals, protocol)
    plot(curves, out / "learning-check.png", protocol, summary)
    write_markdown(summary, diagnostics(curves), runs, protocol, command, out / "learning-check.md")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GiGPO vs GRPO learning check from one warm start.")
    ap.add_argument("--out", default="docs", help="where learning-check.png / .md go")
    ap.add_argument("--config", default="configs/embedded.yaml")
    ap.add_argument("--quick", action="store_true", help=f"the pilot: {QUICK}")
    ap.add_argument("--seeds", type=int, help="seeds per algorithm (default: the protocol's)")
    ap.add_argument("--updates", type=int, help="learner updates per run (default: the protocol's)")
    ap.add_argument("--work-dir", default="runs/experiment", help="run directories (kept: metrics, evals, logs)")
    ap.add_argument("--timeout-min", type=float, default=45.0, help="a run slower than this is stopped")
    ap.add_argument("--report", action="store_true",
                    help="run nothing: write the report of the finished runs under --work-dir")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run (section.field=value)")
    args = ap.parse_args(argv)

    protocol = QUICK if args.quick else Protocol()
    protocol = dataclasses.replace(protocol, **{k: v for k, v in (("seeds", args.seeds), ("updates", args.updates))
                                                if v is not None})
    out, work = Path(args.out), Path(args.work_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m deploy.experiment " + shlex.join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    print(f"[experiment] {protocol}", flush=True)
    if not args.report:
        warm = build_warm_model(args.config, protocol, work, args.overrides)
        print(f"[experiment] warm model {warm} ({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)
    evals: dict[str, dict[int, dict]] = {a: {} for a in COMPARED}
    curves: dict[str, dict[int, list]] = {a: {} for a in COMPARED}
    runs: dict[str, dict] = {}
    for seed in range(protocol.seeds):                 # seed-major: a cut-short experiment still compares
        for algo in COMPARED:
            run_dir = work / f"{algo}-s{seed}"
            if args.report:
                if not (run_dir / RUN_INFO).exists():
                    continue
                info = runs[f"{algo}-s{seed}"] = json.loads((run_dir / RUN_INFO).read_text())
            else:
                print(f"[experiment] {algo} seed {seed} -> {run_dir}", flush=True)
                info = runs[f"{algo}-s{seed}"] = run_one(args.config, protocol, algo, seed, warm, run_dir,
                                                          args.overrides, 60 * args.timeout_min)
            evals[algo][seed], curves[algo][seed] = read_evals(run_dir), read_curves(run_dir)
            got = {w: measures(per_game(e, protocol.step_budget, protocol.fast_steps))
                   for w, e in evals[algo][seed].items()}
            print(f"[experiment] {algo} seed {seed}: {'ok' if info['ok'] else 'FAILED'} in "
                  f"{info['wall_s'] / 60:.1f} min; "
                  + "; ".join(f"{w}: {m['steps']:.1f} steps, success {m['success']:.0%}" for w, m in got.items()),
                  flush=True)
            if not args.report:                       # a cut-short experiment still leaves its report
                write_report(evals, curves, runs, protocol, command, out)
    if not runs:
        print(f"[experiment] no finished runs under {work}", file=sys.stderr)
        return 1
    summary = write_report(evals, curves, runs, protocol, command, out)
    for k, title, scale, unit in (MEASURES if summary["paired"] else ()):
        d = summary["paired"][k]
        print(f"GiGPO - GRPO, {title.format(fast=protocol.fast_steps)}: {scale * d['diff']:+.1f}{unit} "
              f"(95% over games ± {scale * d['ci_games']:.1f}, over seeds ± {scale * d['ci_seeds']:.1f})")
    print(f"wrote {out / 'learning-check.png'} and {out / 'learning-check.md'} in "
          f"{(time.perf_counter() - t0) / 60:.0f} min")
    return 0 if all(i["ok"] for i in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
