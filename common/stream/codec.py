"""The wire format of an episode group (`common.stream.records.EpisodeGroup`): bytes in, bytes out, nothing trusted.

An encoded group (`encode_group`) is three named parts, each one field of the stream entry:

    "h"           msgpack map {"schema": 4, "group_id": str, "task_id": str, "env_name": str,
                               "created_at": float, "producer": str,
                               "trajectories": {<Trajectory field>: [its value per trajectory]}}
    "rows"        the table (`TABLE`: a C struct per row of the per-row fields reward <f8, valid |b1,
                  step <i4, policy_version <i8, and the lengths prompt_len, response_len, anchor_len,
                  action_len, grammar_len <i4, aligned as a C compiler would)
    "data"        the data block (`layout`: prompt_ids <i4, response_ids <i4, response_logprobs <f4,
                  anchor, action and grammar as UTF-8 bytes, each field's values for all rows back to back, each
                  field starting at a multiple of 8 bytes)

Neither encoding nor decoding copies: the parts are views of the group's arrays (the Redis client sends them
as they are), decoded arrays read-only views of the received bytes. `decode_group` trusts nothing about the
layout: every type, dtype and length is checked (then slicing a row out is safe), a violation raises
`CodecError`. The values (ids >= 0, finite log-probs and rewards, UTF-8 text) are checked by `check_values`
where a rollout builds its rows and where the learner reads them (`learner.batching.check_group`, which also
knows the vocabulary). msgpack and raw arrays only: no pickle, so a hostile payload cannot run code.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from common.stream.records import TABLE, EpisodeGroup, Rows, Termination, Trajectory


SCHEMA_VERSION = 4

PARTS = HEADER, TABLE_PART, DATA_PART = "h", "rows", "data"      # the parts of an encoded group

# Largest group decode_group accepts (a realistic 8 x 30 x 700-token group is ~0.9 MB).
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024

_GROUP_FIELDS = {"group_id": str, "task_id": str, "env_name": str, "created_at": float, "producer": str}
# Trajectory's fields and the msgpack type of each (a termination travels as its value).
_TRAJ_FIELDS = {f.name: {"str": str, "int": int, "bool": bool, "float": float, "Termination": str}[f.type]
                for f in dataclasses.fields(Trajectory)}
_HEADER_KEYS = {"schema", "trajectories", *_GROUP_FIELDS}
_TERMINATIONS = {t.value: t for t in Termination}


class CodecError(ValueError):
    """A group that cannot be encoded, or parts that are not a valid encoded group (the message says why)."""


def encode_group(group: EpisodeGroup) -> dict[str, bytes | memoryview]:
    """The parts of `group` (see the module docstring): the header, and views of its arrays. Raises
    CodecError for a header the decoder would refuse (step counts that do not add up to the rows, a
    non-finite return or score, text that is not unicode); the rows were checked by `Rows.from_steps`."""
    trajs, rows = group.trajectories, group.rows
    try:
        columns = {name: [getattr(t, name) for t in trajs] for name in _TRAJ_FIELDS}
        columns["termination"] = [x.value for x in columns["termination"]]
        doc = {"schema": SCHEMA_VERSION, "trajectories": columns,
               **{name: kind(getattr(group, name)) for name, kind in _GROUP_FIELDS.items()}}
        header = msgpack.packb(doc, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:      # UnicodeError is a ValueError
        raise CodecError(f"group {group.group_id!r} cannot be encoded: {type(exc).__name__}: {exc}") from None
    if sum(columns["num_steps"]) != len(rows):
        raise CodecError(f"group {group.group_id!r}: its trajectories have {sum(columns['num_steps'])} steps, "
                         f"its rows {len(rows)}")
    if not all(map(math.isfinite, [doc["created_at"], *columns["episode_return"], *columns["score"]])):
        raise CodecError(f"group {group.group_id!r}: NaN or infinite return, score or created_at")
    return {HEADER: header, TABLE_PART: _bytes_of(rows.table), DATA_PART: _bytes_of(rows.data)}


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(array).view(np.uint8))


def encoded_size(parts: Mapping) -> int:
    return sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts.values())


def decode_group(parts: Mapping[str | bytes, Any], max_bytes: int = MAX_PAYLOAD_BYTES) -> EpisodeGroup:
    """The group encoded in `parts` (names as str or bytes; other names are ignored: the stream's own
    fields); raises CodecError (with the reason) for anything but a valid group of this schema version of
    at most `max_bytes`. The arrays are read-only views of the parts (of a copy for a part that is not `bytes`)."""
    if not isinstance(parts, Mapping):
        raise CodecError(f"expected the parts of a group (a mapping), got {type(parts).__name__}")
    named = {(k.decode(errors="replace") if isinstance(k, bytes) else k): v for k, v in parts.items()}
    missing = [name for name in PARTS if name not in named]
    if missing:
        raise CodecError(f"not a group: missing parts {missing}")
    data = {}
    for name in PARTS:
        value = named[name]
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)          # views of it will be kept: it must not change under them
        if not isinstance(value, bytes):
            raise CodecError(f"part {name}: expected bytes, got {type(value).__name__}")
        data[name] = value
    size = sum(map(len, data.values()))
    if size > max_bytes:
        raise CodecError(f"group of {size} bytes exceeds the {max_bytes}-byte limit")
    doc = _header(data[HEADER])
    where = f"group {doc['group_id']!r}"
    trajectories = _trajectories(doc["trajectories"], f"{where}: trajectories")

    num_rows = sum(t.num_steps for t in trajectories)
    if len(data[TABLE_PART]) != num_rows * TABLE.itemsize:
        raise CodecError(f"{where}: rows part of {len(data[TABLE_PART])} bytes, expected {num_rows} rows (the "
                         f"trajectories' steps) of {TABLE.itemsize} bytes")
    table = np.frombuffer(data[TABLE_PART], dtype=TABLE)
    block = np.frombuffer(data[DATA_PART], dtype=np.uint8)
    try:
        rows = Rows(table, block)           # (checks that the table's lengths fit the data block)
    except ValueError as exc:
        raise CodecError(f"{where}: {exc}") from None
    return EpisodeGroup(trajectories=trajectories, rows=rows, **{name: doc[name] for name in _GROUP_FIELDS})


def _header(raw: bytes) -> dict:
    try:
        doc = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            TypeError) as exc:  # UnicodeDecodeError is a ValueError
        raise CodecError(f"header: not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict):
        raise CodecError(f"header: expected a map, got {type(doc).__name__}")
    version = doc.get("schema")
    if isinstance(version, bool) or not isinstance(version, int):
        raise CodecError(f"schema: expected an integer version, got {version!r}")
    if version != SCHEMA_VERSION:
        raise CodecError(f"schema version {version}; this reader understands version {SCHEMA_VERSION} only")
    _keys(doc, _HEADER_KEYS, "header")
    for name, kind in _GROUP_FIELDS.items():
        _check_type([doc[name]], kind, name)
    if not doc["group_id"]:
        raise CodecError("group_id: empty")
    return doc


def _trajectories(columns: Any, where: str) -> list[Trajectory]:
    """The trajectories from their columns ({field: [value per trajectory]}), every value checked."""
    _keys(columns, set(_TRAJ_FIELDS), where)
    count = len(_check_type(columns["traj_id"], str, f"{where}.traj_id"))
    for name, kind in _TRAJ_FIELDS.items():
        if len(_check_type(columns[name], kind, f"{where}.{name}")) != count:
            raise CodecError(f"{where}.{name}: {len(columns[name])} values for {count} trajectories")
    if any(n < 0 for n in columns["num_steps"]):
        raise CodecError(f"{where}.num_steps: negative")
    bad = set(columns["termination"]) - _TERMINATIONS.keys()
    if bad:
        raise CodecError(f"{where}.termination: {sorted(bad)} not among {sorted(_TERMINATIONS)}")
    columns["termination"] = [_TERMINATIONS[x] for x in columns["termination"]]
    return [Trajectory(*values) for values in zip(*(columns[name] for name in _TRAJ_FIELDS))]


def _check_type(values: Any, kind: type, where: str) -> list:
    """`values`, a list whose items are all exactly of type `kind` (as msgpack gives them: a bool is not
    taken for an int, nor an int for a float), and finite where they are floats."""
    if type(values) is not list:
        raise CodecError(f"{where}: expected a list, got {type(values).__name__}")
    types = set(map(type, values))
    if types - {kind}:
        other = next(t for t in types if t is not kind)
        raise CodecError(f"{where}: expected {kind.__name__}, got {other.__name__}")
    if kind is float and not all(map(math.isfinite, values)):
        raise CodecError(f"{where}: not a finite number")
    return values


def _keys(obj: Any, want: set[str], where: str) -> dict:
    if not isinstance(obj, dict):
        raise CodecError(f"{where}: expected a map, got {type(obj).__name__}")
    have = set(obj)
    if have != want:
        missing, extra = sorted(want - have), sorted(map(str, have - want))
        raise CodecError(f"{where}: missing fields {missing}, unknown fields {extra}")
    return obj
