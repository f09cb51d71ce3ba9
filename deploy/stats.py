"""Small statistics for run summaries and the learning check: Student's t quantiles, a mean with its 95%
interval, the power of a paired design, and a before/after change paired by task.

    mean, half_width = mean_ci([0.1, 0.3, 0.2])
    change = paired_change(before_episodes, after_episodes, "score")   # {"diff", "ci", "tasks"}
"""
from __future__ import annotations

import math
import statistics


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


def t_quantile_80(dof: int) -> float:
    """One-sided 80% quantile of Student's t (for power: the z of 80% power is 0.8416 in the normal limit)."""
    table = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879)
    if dof < 1:
        return float("nan")
    return table[dof - 1] if dof <= len(table) else 0.8416 + 0.8416 * (0.8416 ** 2 + 1) / (4 * dof)


def min_detectable(sd: float, seeds: int) -> float:
    """The smallest true difference a two-sided 5% t test over `seeds` per-seed differences of this sd
    finds with 80% power: (t_0.975 + t_0.80) x sd / sqrt(n), both at n - 1 degrees of freedom."""
    if seeds < 2 or math.isnan(sd):
        return float("nan")
    return (t_quantile_975(seeds - 1) + t_quantile_80(seeds - 1)) * sd / math.sqrt(seeds)


def seeds_needed(sd: float, difference: float, most: int = 100) -> int:
    """The fewest seeds whose `min_detectable` is at most `difference` (`most` + 1 when none up to it is)."""
    for n in range(2, most + 1):
        if min_detectable(sd, n) <= difference:
            return n
    return most + 1


def mean_ci(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t interval); the half-width is NaN for fewer than 2 values."""
    if not values:
        return float("nan"), float("nan")
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def per_task_means(episodes: list[dict], key: str) -> dict[str, float]:
    """task id -> the mean of `key` over its episodes (booleans count as 0/1)."""
    acc: dict[str, list[float]] = {}
    for e in episodes:
        acc.setdefault(str(e["task_id"]), []).append(float(e[key]))
    return {task: sum(v) / len(v) for task, v in acc.items()}


def paired_change(before: list[dict], after: list[dict], key: str) -> dict:
    """after - before of one per-episode measure (`key`: "success", "score"), paired by task: each task's
    mean after minus its mean before, over the tasks both evaluations played. Returns {"diff": the mean
    difference, "ci": its 95% t interval's half-width over tasks (NaN under 2 tasks), "tasks": how many}."""
    b, a = per_task_means(before, key), per_task_means(after, key)
    tasks = sorted(set(a) & set(b))
    diff, ci = mean_ci([a[t] - b[t] for t in tasks])
    return {"diff": diff, "ci": ci, "tasks": len(tasks)}
