"""The records every plane shares: a step, a trajectory, an episode group (its steps stored by column).

A rollout actor turns each environment step into a `StepRow`, ends each rollout with a `Trajectory` and
packs the N rollouts of one task into an `EpisodeGroup`, whose steps are `Rows`: one array per `StepRow`
field, trajectory after trajectory. `StepRow` is the row schema, defined once (each field's dtype, whether it
is ragged: one array per row, stored back to back with a length column, and what its values must satisfy);
`Rows`, the wire format, the checks and the learner's batching derive from it.

The wire format these records travel in is `common.stream.codec`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class Termination(str, Enum):
    """Why a trajectory ended. Only `DONE` and `MAX_STEPS` are ordinary endings; the others are marked so
    that nobody mistakes a cut-off trajectory for a finished one."""

    DONE = "done"                # the environment reported done (won, or lost for good)
    MAX_STEPS = "max_steps"      # the step budget (e.g. 50 for ALFWorld) ran out
    TRUNCATED = "truncated"      # the prompt no longer fitted the model's context
    ENV_ERROR = "env_error"      # the env instance crashed or hung and was restarted


def _column(dtype: str, *, length: str = "", check: str = "", **kw):
    """A StepRow field's place in the schema: its numpy `dtype` in the columns (text: "|u1", its UTF-8
    bytes), `length`: the name of the length column of a ragged field (one array or text per row, stored
    back to back), `check`: "ids" (>= 0), "finite", "bool" (0/1), "utf8" (each row's bytes are text)."""
    return field(metadata={"dtype": dtype, "length": length, "check": check}, **kw)


@dataclass
class StepRow:
    """One environment step of one trajectory: one training row (one prompt, one response)."""

    prompt_ids: np.ndarray = _column("<i4", length="prompt_len", check="ids")     # the prompt, chat template applied
    response_ids: np.ndarray = _column("<i4", length="response_len", check="ids")  # the sampled response
    # log-prob of each response token under the behaviour policy
    response_logprobs: np.ndarray = _column("<f4", length="response_len", check="finite")
    # environment reward r_t of this step (10 on the winning step, else 0); the invalid-action penalty is NOT
    # folded in: it follows from `valid`
    reward: float = _column("<f8", check="finite")
    valid: bool = _column("|b1", check="bool")       # whether the response parsed as an action
    step: int = _column("<i4")                        # index of this step inside its trajectory, from 0
    policy_version: int = _column("<i8")              # version of the weights that generated the response
    anchor: str = _column("|u1", length="anchor_len", check="utf8")   # anchor-state key: the raw observation
    action: str = _column("|u1", length="action_len", check="utf8", default="")   # the action text sent to the env
    # the regex the response was sampled under (rollout.constrain_actions; "" if none): the learner's policy is
    # the model's distribution restricted to what it allows
    grammar: str = _column("|u1", length="grammar_len", check="utf8", default="")

    def __post_init__(self) -> None:
        for name in RAGGED:
            if name not in TEXT:
                setattr(self, name, np.asarray(getattr(self, name), dtype=COLUMNS[name]))
        if self.response_logprobs.shape != self.response_ids.shape:
            raise ValueError(f"step {self.step}: {self.response_ids.shape[0]} response tokens but "
                             f"{self.response_logprobs.shape[0]} log-probs")


# The schema, derived from StepRow: a group's rows are the table (dtype `TABLE`) and the data block (`layout`).
_FIELDS = dataclasses.fields(StepRow)
RAGGED: dict[str, str] = {f.name: f.metadata["length"] for f in _FIELDS if f.metadata["length"]}
TEXT = tuple(f.name for f in _FIELDS if f.metadata["check"] == "utf8")
CHECKS: dict[str, str] = {f.name: f.metadata["check"] for f in _FIELDS if f.metadata["check"]}
LENGTHS = tuple(dict.fromkeys(RAGGED.values()))   # prompt_len, response_len, anchor_len, action_len, grammar_len
TABLE = np.dtype([(f.name, f.metadata["dtype"]) for f in _FIELDS if f.name not in RAGGED]
                 + [(name, "<i4") for name in LENGTHS], align=True)
COLUMNS: dict[str, np.dtype] = {f.name: np.dtype(f.metadata["dtype"]) for f in _FIELDS}
_LENGTHS_AT = TABLE.fields[LENGTHS[0]][1]
assert [TABLE.fields[name][1] for name in LENGTHS] == list(range(_LENGTHS_AT, _LENGTHS_AT + 4 * len(LENGTHS), 4))


def layout(table: np.ndarray) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each ragged field lies in the data block of the rows in `table`: {name: (byte offset, number
    of values)}, and the block's size in bytes. Raises ValueError for negative lengths."""
    if not len(table):
        return {name: (0, 0) for name in RAGGED}, 0
    # The length columns, adjacent in a record, as one int32 [rows, len(LENGTHS)] view: one reduction each.
    lengths = np.ndarray((len(table), len(LENGTHS)), "<i4", table, _LENGTHS_AT, (TABLE.itemsize, 4))
    if lengths.min() < 0:
        raise ValueError(f"negative lengths in {', '.join(LENGTHS)}")
    totals = dict(zip(LENGTHS, lengths.sum(axis=0, dtype=np.int64).tolist()))
    where, end = {}, 0
    for name, length in RAGGED.items():
        where[name] = (end, totals[length])
        end += -(-totals[length] * COLUMNS[name].itemsize // 8) * 8
    return where, end


def check_values(rows: Rows) -> str:
    """What is wrong with the values of well-laid-out rows ('' when nothing), as the schema says: ids >= 0,
    finite numbers, booleans 0/1, each row's text valid UTF-8. A rollout refuses such rows when it builds
    them (`Rows.from_steps`); the learner checks what it receives (`learner.batching.check_group`)."""
    for name, check in CHECKS.items():
        col = rows[name]
        if not len(col):
            continue
        if check == "ids" and col.min() < 0:
            return f"{name}: negative ids"
        # min and max propagate NaN: both finite <=> every value finite (without a temporary bool array)
        if check == "finite" and not (np.isfinite(col.min()) and np.isfinite(col.max())):
            return f"{name}: NaN or infinite values"
        if check == "bool" and col.view(np.uint8).max() > 1:
            return f"{name}: values other than 0/1"
        if check == "utf8" and not _is_text(col, rows[RAGGED[name]]):
            return f"{name}: not UTF-8 text, or a row that starts inside a character"
    return ""


def _is_text(data: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether the bytes are UTF-8 and each non-empty row starts on a character (not a continuation byte):
    then every row's slice decodes on its own."""
    try:
        data.tobytes().decode()
    except UnicodeDecodeError:
        return False
    starts = (np.cumsum(lengths, dtype=np.int64) - lengths)[lengths > 0]
    return not np.any((data[starts] & 0xC0) == 0x80)


class Rows:
    """The steps of one group by column: `rows["reward"][i]` is row i's reward; a ragged field (tokens,
    log-probs, text) holds all rows' values back to back (row i: `rows.per_row("prompt_ids")[i]`, text:
    `rows.text("anchor")[i]`) and has a length column (`prompt_len`, ...). Two arrays hold it all (`layout`):
    `table`, one record per row, and `data`, the ragged fields' values, of which `rows[name]` is a view.
    Built from StepRows (`from_steps`, in the rollout) or from the wire (read-only views of the bytes)."""

    def __init__(self, table: np.ndarray, data: np.ndarray):
        """Raises ValueError when the arrays do not fit together: `table` must be a 1-D array of dtype
        `TABLE`, `data` a 1-D uint8 array of the size the table's lengths (none negative) add up to. Then
        every row can be sliced out safely; what the values must satisfy is `check_values`."""
        if not isinstance(table, np.ndarray) or table.ndim != 1 or table.dtype != TABLE:
            raise ValueError("rows: expected a 1-D table of the row schema")
        if not isinstance(data, np.ndarray) or data.ndim != 1 or data.dtype != np.uint8:
            raise ValueError("data: expected a 1-D uint8 array")
        where, size = layout(table)
        if len(data) != size:
            raise ValueError(f"data: {len(data)} bytes, but the rows' lengths say {size}")
        self.table = table
        self.data = data
        self.ragged = {name: np.ndarray(count, COLUMNS[name], data, offset) for name, (offset, count) in where.items()}

    def __len__(self) -> int:
        return len(self.table)

    def __reduce__(self):           # pickled (Ray) as its two arrays; the views are rebuilt
        return Rows, (self.table, self.data)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.ragged[name] if name in RAGGED else self.table[name]

    @classmethod
    def from_steps(cls, steps: list[StepRow]) -> Rows:
        """The rows of `steps` (each ragged field copied once, into the data block). Raises ValueError for
        rows the schema refuses (e.g. a NaN log-prob, a step index past int32), naming the field."""
        try:
            rows = cls._build(steps)
        except (TypeError, ValueError, OverflowError) as exc:      # UnicodeError is a ValueError
            raise ValueError(f"steps that do not fit the row schema: {type(exc).__name__}: {exc}") from None
        problem = check_values(rows)
        if problem:
            raise ValueError(problem)
        return rows

    @staticmethod
    def _build(steps: list[StepRow]) -> Rows:
        table = np.zeros(len(steps), dtype=TABLE)
        values = {}
        for f in _FIELDS:
            name = f.name
            if name not in RAGGED:
                table[name] = [getattr(s, name) for s in steps]
                continue
            if name in TEXT:
                values[name] = [np.frombuffer(str(getattr(s, name)).encode(), np.uint8) for s in steps]
            else:
                values[name] = [getattr(s, name) for s in steps]
                if any(v.ndim != 1 for v in values[name]):
                    raise ValueError(f"{name}: arrays that are not 1-D")
            table[RAGGED[name]] = np.fromiter(map(len, values[name]), dtype="<i4", count=len(steps))
        rows = Rows(table, np.zeros(layout(table)[1], dtype=np.uint8))      # (then filled in)
        for name, parts in values.items():
            if parts:
                np.concatenate(parts, out=rows.ragged[name], casting="same_kind")
        return rows

    def offsets(self, length: str) -> np.ndarray:
        """Where each row starts in the ragged fields of length column `length`, and where the last ends
        (int64 [rows + 1])."""
        return np.concatenate(([0], np.cumsum(self.table[length], dtype=np.int64)))

    def per_row(self, name: str) -> list[np.ndarray]:
        """A ragged field as one view per row."""
        return np.split(self.ragged[name], self.offsets(RAGGED[name])[1:-1])

    def text(self, name: str) -> list[str]:
        """A text field as one str per row."""
        data = self.ragged[name].tobytes()
        ends = self.offsets(RAGGED[name]).tolist()
        return [data[a:b].decode() for a, b in zip(ends, ends[1:])]


@dataclass
class Trajectory:
    """How one rollout of one task went. Its steps are rows of its group."""

    traj_id: str                    # unique id of this trajectory (unique across the whole run)
    num_steps: int = 0
    success: bool = False           # ALFWorld: won; WebShop: bought with native reward exactly 1.0
    episode_return: float = 0.0     # R(tau): sum of the environment rewards of the steps
    termination: Termination = Termination.DONE
    task_type: str = ""             # e.g. "pick_and_place_simple"; "" when the env has none
    score: float = 0.0              # the env's native score (WebShop reward in [0, 1]; ALFWorld: = success)

    def __post_init__(self) -> None:
        if type(self.termination) is not Termination:
            self.termination = Termination(self.termination)


@dataclass
class EpisodeGroup:
    """The N trajectories of one task, started from the same initial state: GiGPO's unit of grouping, and
    the unit the trajectory stream publishes, admits and ages. `rows` holds the steps of trajectory 0, then
    of trajectory 1, ... (`trajectories[k].num_steps` each)."""

    group_id: str                   # unique id; the learner trains on each id at most once
    task_id: str
    env_name: str                   # "alfworld" | "webshop" | ...
    trajectories: list[Trajectory] = field(default_factory=list)
    rows: Rows = field(default_factory=lambda: Rows.from_steps([]))
    created_at: float = 0.0         # unix time when the group was completed (for stream lag metrics)
    producer: str = ""              # id of the rollout actor that produced it

    @classmethod
    def pack(cls, group_id: str, task_id: str, env_name: str, played: list[tuple[Trajectory, list[StepRow]]],
             created_at: float = 0.0, producer: str = "") -> EpisodeGroup:
        """A group from its played trajectories and their steps (sets each trajectory's num_steps)."""
        for traj, steps in played:
            traj.num_steps = len(steps)
        return cls(group_id=group_id, task_id=task_id, env_name=env_name, trajectories=[t for t, _ in played],
                   rows=Rows.from_steps([s for _, steps in played for s in steps]),
                   created_at=created_at, producer=producer)

    @property
    def policy_versions(self) -> tuple[int, int]:
        """(oldest, newest) policy version among all steps; (-1, -1) for a group without steps."""
        versions = self.rows["policy_version"]
        return (int(versions.min()), int(versions.max())) if len(versions) else (-1, -1)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def row_trajectory(self) -> np.ndarray:
        """The index of each row's trajectory (int64 [rows])."""
        return np.repeat(np.arange(len(self.trajectories)), [t.num_steps for t in self.trajectories])
