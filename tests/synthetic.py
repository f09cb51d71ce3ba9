"""Looking into episode groups row by row (the groups themselves: bench.synthetic.synthetic_groups, or
played ones): steps as StepRows, trajectories kept or dropped, last rows."""
from __future__ import annotations

import dataclasses

import numpy as np

from common.records import COLUMNS, RAGGED, TEXT, EpisodeGroup, Rows, StepRow


def step_rows(groups: list[EpisodeGroup]) -> list[tuple[str, str, StepRow]]:
    """(group id, trajectory id, step) of every row of `groups`, in build_batch's order; the steps' arrays
    are views of the groups' columns."""
    return [(g.group_id, t.traj_id, s) for g in groups for k, t in enumerate(g.trajectories) for s in steps_of(g, k)]


def keep_trajectories(group: EpisodeGroup, keep: list[int]) -> EpisodeGroup:
    """A copy of `group` with only the trajectories at indices `keep` (and their rows)."""
    played = [(dataclasses.replace(group.trajectories[k]), steps_of(group, k)) for k in keep]
    return EpisodeGroup.pack(group.group_id, group.task_id, group.env_name, played, group.created_at, group.producer)


def last_rows(group: EpisodeGroup) -> np.ndarray:
    """The row index of each trajectory's last step (trajectories with steps only)."""
    ends = np.cumsum([t.num_steps for t in group.trajectories]) - 1
    return ends[[t.num_steps > 0 for t in group.trajectories]]


def row_step(rows: Rows, i: int) -> StepRow:
    """Row i as a StepRow (its arrays are views of the columns)."""
    values = {}
    for name in COLUMNS:
        if name in RAGGED:
            start = int(rows.offsets(RAGGED[name])[i])
            value = rows[name][start:start + int(rows[RAGGED[name]][i])]
            values[name] = value.tobytes().decode() if name in TEXT else value
        else:
            values[name] = rows[name][i].item()
    return StepRow(**values)


def steps_of(group: EpisodeGroup, k: int) -> list[StepRow]:
    """Trajectory k's steps as StepRows (views of the group's columns)."""
    start = sum(t.num_steps for t in group.trajectories[:k])
    return [row_step(group.rows, i) for i in range(start, start + group.trajectories[k].num_steps)]
