"""What a run tells: the status record `gigpo status` reads, the evaluations' records (evals.jsonl), and the
terminal's lines (one per evaluation, the paper's table, the final summary)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from common.metrics import update_figures
from common.processes.actor_calls import wait_all
from common.run_dir import EVALS_FILE, GROUPS_FILE, METRICS_FILE
from deploy.stats import paired_change


class PlacementWatch:
    """Which node each actor answered from, asked again every time (a restarted actor may come back on
    another), with one call in flight per actor."""

    def __init__(self):
        self.nodes: dict[str, dict | None] = {}      # actor name -> its node (None: not started, or died)
        self._asks: dict[str, object] = {}            # actor name -> ObjectRef of its node() call in flight

    def refresh(self, actors: dict[str, object], timeout_s: float = 0.0) -> dict[str, dict | None]:
        """{name: node} for `actors` ({name: handle}), waiting up to timeout_s for their answers."""
        self._asks = {name: self._asks[name] if name in self._asks else actor.node.remote()
                      for name, actor in actors.items()}
        names = list(self._asks)
        answers = wait_all([self._asks[name] for name in names], timeout_s)
        for i, name in enumerate(names):
            if i not in answers.late:
                del self._asks[name]
                # (None: died; Ray may restart it, and it is asked again next time)
                self.nodes[name] = answers.done.get(i)
        return {name: self.nodes.get(name) for name in actors}


def placement_record(placement: dict[str, dict | None]) -> dict[str, dict]:
    """Each actor's node for the status record, {name: {"ip", "hostname"}} ("ip" None: not started yet)."""
    return {name: {"ip": node and node["ip"], "hostname": node and node["hostname"]}
            for name, node in placement.items()}


def status_record(cfg, state: str, metrics: dict, last_eval: dict | None, rollouts, inference,
                  placement: dict[str, dict | None], outputs: Path, autoscale_line: str) -> dict:
    """The record `gigpo status` shows: state, progress, actors and their nodes, the latest metrics and eval, and
    rollout autoscale's last decision (`autoscale_line`, "" when it is off)."""
    evaluated = {f"eval/{k}": v for k, v in (last_eval or {}).items() if isinstance(v, float)}
    return {
        "run": cfg.run.name, "state": state, "iteration": int(metrics.get("update", 0)),
        "iterations": cfg.run.iterations, "policy_version": int(metrics.get("policy_version", 0)),
        "rollout_actors": len(rollouts.live), "inference_actors": len(inference.serving),
        "inference_starting": len(inference.starting),
        "rollout_restarts": rollouts.restarts, "rollout_restarting": len(rollouts.restarting),
        "env_instances": len(rollouts.live) * cfg.rollout.groups_per_actor * cfg.rollout.group_size,
        "metrics": update_figures({**metrics, **evaluated}),
        "outputs": str(outputs.resolve()),
        "placement": placement_record(placement),
        "autoscale": autoscale_line,
    }


def waiting_state(rollouts, updating: bool) -> str:
    """The status's state while the driver waits on the learner: why it waits."""
    if not rollouts.live:
        return "paused: no rollout actors (resume with `gigpo scale --rollout N`)"
    if rollouts.restarting:
        return (f"waiting: {len(rollouts.restarting)} rollout actor(s) coming back (their process or node was "
                f"lost; Ray restarts them when a node with their resources is there)")
    return "training" if updating else "waiting for data"


def append_eval_record(out_dir: Path, record: dict, fresh: bool) -> None:
    """One evaluation as a line of <out_dir>/evals.jsonl; fresh: the file is started anew."""
    with open(out_dir / EVALS_FILE, "w" if fresh else "a") as f:
        f.write(json.dumps(record) + "\n")


# The run's records of each update, and the key that names the update in their lines.
UPDATE_RECORDS = {METRICS_FILE: "step", GROUPS_FILE: "update", EVALS_FILE: "update"}


def trim_records_after(out_dir: Path, update: int, restore: dict | None = None) -> None:
    """What a resume from the checkpoint of `update` does to the run's records (UPDATE_RECORDS) before it
    trains the later updates again: their lines go (and a partly written last line). restore: the learner's
    record of `update` kept in that checkpoint ({"metrics", "groups"}), whose lines are written when the
    files lack them (the driver was killed between the checkpoint and its own write)."""
    restored = {METRICS_FILE: (restore or {}).get("metrics"), GROUPS_FILE: (restore or {}).get("groups")}
    for name, key in UPDATE_RECORDS.items():
        path = Path(out_dir) / name
        text = path.read_text() if path.is_file() else ""
        kept, have = [], set()
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if int(record.get(key, 0)) <= update:
                kept.append(line)
                have.add(int(record.get(key, 0)))
        if restored.get(name) and update not in have:
            line = {"step": update, **restored[name]} if name == METRICS_FILE else restored[name]
            kept.append(json.dumps(line, ensure_ascii=False))
        new = "".join(line + "\n" for line in kept)
        if new != text and (text or kept):
            path.write_text(new)


def eval_records(out_dir: Path) -> list[dict]:
    """The run's evaluations, from <out_dir>/evals.jsonl (a line a killed run did not finish skipped)."""
    path = Path(out_dir) / EVALS_FILE
    records = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def first_evaluation(out_dir: Path) -> dict | None:
    """The run's "before training" evaluation (a resumed run measures its summary from it), or None."""
    return next((r for r in eval_records(out_dir) if r.get("when") == "before training"), None)


def eval_line(when: str, result: dict) -> str:
    """One evaluation in one line: overall success, then per task type (full names), WebShop's score."""
    parts = [f"eval {when}: success {100 * result.get('success', 0.0):.1f}% over {result.get('episodes', 0)} "
             f"episodes"]
    per_type = result.get("per_task_type", {})
    if per_type and set(per_type) != {"all"}:
        parts.append(", ".join(f"{name} {100 * value:.1f}%" for name, value in sorted(per_type.items())))
    if "score" in result:
        parts.append(f"score {100 * result['score']:.1f}")
    if result.get("valid_action_share", 1.0) < 1.0:
        parts.append(f"valid responses {100 * result['valid_action_share']:.1f}%")
    return " | ".join(parts)


# The paper's ALFWorld table: its column per task type, in its order (Table 1: Pick, Look, Clean, Heat,
# Cool, Pick2, All). Other task names (none in the standard game set) keep their own name, after these.
PAPER_COLUMNS = {
    "pick_and_place_simple": "Pick", "look_at_obj_in_light": "Look", "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat", "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}


def format_eval(title: str, results: dict[str, dict]) -> str:
    """The paper's table layout, one row per split (`results`: split -> summary): success in % per task
    type and All for ALFWorld, score and Succ. for WebShop, then the episodes played."""
    types = {t for r in results.values() for t in r.get("per_task_type", {}) if t not in ("all", "webshop")}
    order = list(PAPER_COLUMNS)
    types = sorted(types, key=lambda t: (order.index(t) if t in order else len(order), t))
    webshop = any("score" in r for r in results.values())
    columns = ([("Score", lambda r: 100 * r["score"] if "score" in r else None)] if webshop else []) + [
        (PAPER_COLUMNS.get(t, t), lambda r, t=t: 100 * r["per_task_type"][t] if t in r.get("per_task_type", {})
         else None) for t in types] + [("Succ." if webshop else "All", lambda r: 100 * r.get("success", 0.0))]
    first = max([len("split")] + [len(s) for s in results])
    widths = [max(6, len(name)) for name, _ in columns]
    lines = [f"== {title} (%)", f"{'split':<{first}} | " + " | ".join(
        f"{name:>{w}}" for (name, _), w in zip(columns, widths)) + " | episodes"]
    for split, r in results.items():
        cells = ["-" if v is None else f"{v:.1f}" for v in (value(r) for _, value in columns)]
        lines.append(f"{split:<{first}} | " + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths))
                     + f" | {r.get('episodes', 0):8d}")
    return "\n".join(lines)


def paired_change_line(measure: str, change: dict) -> str:
    """Whether training moved `measure` beyond what the evaluation's own noise explains: the change paired by
    task with its 95% interval over tasks (deploy.stats.paired_change)."""
    def points(x: float) -> float:
        return round(100 * x, 1) + 0.0       # (+ 0.0: no "-0.0" for a rounding error's sign)

    diff, lo, hi = points(change["diff"]), points(change["diff"] - change["ci"]), points(change["diff"] + change["ci"])
    verdict = ("outside the noise: the interval excludes 0" if lo > 0 or hi < 0 else
               "within the noise: the interval includes 0")
    return (f"{measure} change paired by task over {change['tasks']} tasks: {diff:+.1f} points, "
            f"95% interval [{lo:+.1f}, {hi:+.1f}]: {verdict}")


def format_summary(summary: dict) -> str:
    """`gigpo train`'s last lines: updates, time, env steps, success (and score) before and after, the table."""
    updates = summary["updates"]
    lines = ["", "=" * 72, f"trained {updates} update{'' if updates == 1 else 's'} in {summary['train_s'] / 60:.1f} "
                           f"min, {summary['env_steps']:.0f} env steps"]
    if summary.get("before") and summary.get("after"):
        before, after = summary["before"], summary["after"]
        b, a = before["success"], after["success"]
        lines.append(f"success before {100 * b:.1f}%  ->  after {100 * a:.1f}%   ({100 * (a - b):+.1f} points)")
        webshop = "score" in before and "score" in after        # WebShop: the paper's other figure
        if webshop:
            b, a = before["score"], after["score"]
            lines.append(f"score   before {100 * b:.1f}    ->  after {100 * a:.1f}    ({100 * (a - b):+.1f} points)")
        measure = "score" if webshop else "success"
        change = paired_change(before.get("episodes_detail", []), after.get("episodes_detail", []), measure)
        if change["tasks"] >= 2:
            lines.append(paired_change_line(measure, change))
        lines.append(format_eval("after training", {summary.get("eval_split", "eval"): summary["after"]}))
    lines.append(f"outputs: {summary['outputs']} (tensorboard --logdir {summary['outputs']}/tensorboard; "
                 f"each step's credit: gigpo view {summary['outputs']})")
    lines.append("=" * 72)
    return "\n".join(lines)
