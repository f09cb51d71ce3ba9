"""Wire format of an episode group: msgpack, with token ids and log-probs as packed little-endian arrays.

One group is a msgpack array of two bins (schema `SCHEMA_VERSION`):

    [header, tokens]

`header` is itself msgpack, a map with everything but the token columns; the steps of all trajectories are
stored column by column, trajectory after trajectory:

    {"schema": 2, "group_id": str, "task_id": str, "env_name": str, "created_at": float, "producer": str,
     "policy_versions": [oldest, newest],
     "trajectories": [{"traj_id", "num_steps", "success", "episode_return", "termination", "task_type",
                       "score"}, ...],
     "steps": {"prompt_len": <i4[S]>, "response_len": <i4[S]>, "reward": <f8[S]>, "valid": u1[S],
               "step": <i4[S]>, "policy_version": <i8[S]>, "anchor": [str]*S, "action": [str]*S}}

`tokens` is the three token columns back to back: prompt_ids <i4[sum P] | response_ids <i4[sum T] |
response_logprobs <f4[sum T], after 0-3 zero bytes that put them at a multiple of 4 in the payload. `<i4`
etc. are raw little-endian bytes. Keeping the ~1 MB of tokens out of the msgpack map lets `decode_group`
hand out numpy views of the received bytes instead of copying them (a fresh ~1 MB allocation per group
cost as much as the rest of decoding). Any msgpack library reads the format: unpack the array, then unpack
the header.

A trajectory's `task_id` and `group_id` are its group's (the encoder refuses a trajectory that disagrees),
so they are not repeated on the wire.

`decode_group` trusts nothing: every type, length and invariant is checked and a violation raises
`CodecError` naming what is wrong. msgpack only: no pickle, so a hostile or corrupt payload cannot run code.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import numpy as np

from common.records import EpisodeGroup, StepRow, Termination, Trajectory

SCHEMA_VERSION = 2

# Largest payload decode_group accepts (a realistic 8 x 30 x 700-token group is ~1 MB).
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024

_I4 = np.dtype("<i4")
_F4 = np.dtype("<f4")
_F8 = np.dtype("<f8")
_I8 = np.dtype("<i8")
_U1 = np.dtype("u1")

_TERMINATIONS = {t.value for t in Termination}


class CodecError(ValueError):
    """A record that cannot be encoded, or bytes that are not a valid encoded group (the message says why)."""


# ----------------------------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------------------------

class _Packed:
    """A bin field written straight from many arrays into the output buffer (no intermediate copy)."""

    __slots__ = ("name", "arrays", "dtype", "nbytes", "offset")

    def __init__(self, name: str, arrays: list[np.ndarray], dtype: np.dtype, count: int):
        self.name = name
        self.arrays = arrays
        self.dtype = dtype
        self.nbytes = count * dtype.itemsize
        self.offset = -1          # where _write put it


def _bin_header(n: int) -> bytes:
    # msgpack bin 8 / 16 / 32 (the spec's big-endian length prefixes).
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return _bin32_header(n)


def _bin32_header(n: int) -> bytes:
    return b"\xc6" + n.to_bytes(4, "big")


_ARRAY_OF_2 = b"\x92"          # msgpack fixarray of 2 elements
_ALIGN = 4                      # the token columns start at a multiple of this in the payload


def _parts(group: EpisodeGroup) -> list[bytes | _Packed]:
    """The encoded group as a sequence of byte strings and packed-array fields: one msgpack map."""
    try:
        return _parts_unchecked(group)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:   # UnicodeError is a ValueError
        raise CodecError(f"group {getattr(group, 'group_id', '?')!r} cannot be encoded: "
                         f"{type(exc).__name__}: {exc}") from None


def _parts_unchecked(group: EpisodeGroup) -> list[bytes | _Packed]:
    steps: list[StepRow] = []
    trajs = []
    for t in group.trajectories:
        if t.group_id != group.group_id or t.task_id != group.task_id:
            raise CodecError(
                f"group {group.group_id!r}: trajectory {t.traj_id!r} belongs to group {t.group_id!r} / task "
                f"{t.task_id!r}, not {group.group_id!r} / {group.task_id!r}"
            )
        steps.extend(t.steps)
        trajs.append({
            "traj_id": str(t.traj_id),
            "num_steps": len(t.steps),
            "success": bool(t.success),
            "episode_return": float(t.episode_return),
            "termination": Termination(t.termination).value,
            "task_type": str(t.task_type),
            "score": float(t.score),
        })
    n = len(steps)
    # One pass over the rows, then column-wise work in numpy.
    prompts, responses, logprobs, rewards_l, valid_l, step_l, versions_l, anchors, actions = (
        zip(*[(s.prompt_ids, s.response_ids, s.response_logprobs, s.reward, s.valid, s.step, s.policy_version,
               s.anchor, s.action) for s in steps]) if n else [()] * 9)
    prompt_len = np.fromiter(map(len, prompts), dtype=_I4, count=n)
    response_len = np.fromiter(map(len, responses), dtype=_I4, count=n)
    logprob_len = np.fromiter(map(len, logprobs), dtype=_I4, count=n)
    if not np.array_equal(response_len, logprob_len):
        k = int(np.flatnonzero(response_len != logprob_len)[0])
        raise CodecError(f"group {group.group_id!r}, row {k} (step {steps[k].step}): {response_len[k]} response "
                         f"tokens but {logprob_len[k]} log-probs")
    versions = np.array(versions_l, dtype=_I8)
    rewards = np.array(rewards_l, dtype=_F8)
    scalars = [group.created_at] + [x for t in trajs for x in (t["episode_return"], t["score"])]
    if not (np.isfinite(rewards).all() and all(math.isfinite(x) for x in scalars)):
        raise CodecError(f"group {group.group_id!r}: NaN or infinite reward, return, score or created_at")
    head = {
        "schema": SCHEMA_VERSION,
        "group_id": str(group.group_id),
        "task_id": str(group.task_id),
        "env_name": str(group.env_name),
        "created_at": float(group.created_at),
        "producer": str(group.producer),
        "policy_versions": [int(versions.min()), int(versions.max())] if len(steps) else [-1, -1],
        "trajectories": trajs,
    }
    step_cols = {
        "prompt_len": prompt_len.tobytes(),
        "response_len": response_len.tobytes(),
        "reward": rewards.tobytes(),
        "valid": np.array(valid_l, dtype=bool).astype(_U1).tobytes(),
        "step": np.array(step_l, dtype=_I4).tobytes(),
        "policy_version": versions.tobytes(),
        "anchor": list(map(str, anchors)),
        "action": list(map(str, actions)),
    }
    header = msgpack.packb({**head, "steps": step_cols}, use_bin_type=True)
    total_p, total_r = int(prompt_len.sum(dtype=np.int64)), int(response_len.sum(dtype=np.int64))
    token_cols = [_Packed("prompt_ids", prompts, _I4, total_p), _Packed("response_ids", responses, _I4, total_r),
                  _Packed("response_logprobs", logprobs, _F4, total_r)]
    # [header, tokens]: the token columns are copied once, straight from the rows into the output. The
    # tokens bin starts with 0-3 zero bytes so that the columns sit at a multiple of 4 in the payload (numpy
    # scans aligned arrays ~2x faster); its bin 32 header makes the offset independent of the size.
    head_bin = _bin_header(len(header))
    pad = -(len(_ARRAY_OF_2) + len(head_bin) + len(header) + len(_bin32_header(0))) % _ALIGN
    return [_ARRAY_OF_2, head_bin, header, _bin32_header(pad + sum(c.nbytes for c in token_cols)), bytes(pad),
            *token_cols]


def _write(parts: list[bytes | _Packed], buf: bytearray) -> int:
    try:
        return _write_parts(parts, buf)
    except ValueError as exc:   # e.g. a 2-D array assigned to a StepRow field after construction
        raise CodecError(f"token or log-prob arrays are not 1-D: {exc}") from None


def _write_parts(parts: list[bytes | _Packed], buf: bytearray) -> int:
    pos = 0
    for part in parts:
        if isinstance(part, _Packed):
            part.offset = pos
            if part.nbytes:
                out = np.frombuffer(buf, dtype=part.dtype, count=part.nbytes // part.dtype.itemsize, offset=pos)
                np.concatenate(part.arrays, out=out, casting="same_kind")
                del out       # release the export so the buffer may be resized later
            pos += part.nbytes
        else:
            buf[pos:pos + len(part)] = part
            pos += len(part)
    return pos


def _size(parts: list[bytes | _Packed]) -> int:
    size = sum(p.nbytes if isinstance(p, _Packed) else len(p) for p in parts)
    if size > MAX_PAYLOAD_BYTES:
        raise CodecError(f"encoded group would be {size} bytes, over the {MAX_PAYLOAD_BYTES}-byte limit")
    return size


def _check_written(parts: list[bytes | _Packed], buf: bytearray) -> None:
    """Refuse at the producer what the decoder would refuse: negative token ids, non-finite log-probs."""
    for part in parts:
        if not isinstance(part, _Packed) or not part.nbytes:
            continue
        view = np.frombuffer(buf, dtype=part.dtype, count=part.nbytes // part.dtype.itemsize, offset=part.offset)
        if part.dtype == _F4:
            bad = not np.isfinite(view).all()
        else:
            bad = view.min() < 0
        del view
        if bad:
            raise CodecError(f"{part.name}: {'NaN or infinite values' if part.dtype == _F4 else 'negative ids'}")


def encode_group(group: EpisodeGroup) -> bytes:
    """The msgpack bytes of `group`. Raises CodecError if the group is inconsistent (a trajectory of another
    group or task, log-probs not matching the response), so a bad record fails at the producer."""
    parts = _parts(group)
    buf = bytearray(_size(parts))
    _write(parts, buf)
    _check_written(parts, buf)
    return bytes(buf)


class GroupEncoder:
    """Encodes groups into one reusable buffer: the same bytes as `encode_group` without allocating (and
    page-faulting in) ~1 MB of fresh memory per group, which dominated the cost on small VMs.
    Not thread-safe: one per thread."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def encode(self, group: EpisodeGroup) -> memoryview:
        """A view of the encoded group, valid until the next `encode` call on this encoder."""
        parts = _parts(group)
        size = _size(parts)
        if len(self._buf) < size:
            # A new buffer rather than a resize: a caller may still hold a view of the old one.
            self._buf = bytearray(size + size // 4)
        _write(parts, self._buf)
        _check_written(parts, self._buf)
        return memoryview(self._buf)[:size]


# ----------------------------------------------------------------------------------------------------------
# Decoding (strict)
# ----------------------------------------------------------------------------------------------------------

_GROUP_KEYS = {"schema", "group_id", "task_id", "env_name", "created_at", "producer", "policy_versions",
               "trajectories", "steps"}
_TRAJ_KEYS = {"traj_id", "num_steps", "success", "episode_return", "termination", "task_type", "score"}
_STEP_KEYS = {"prompt_len", "response_len", "reward", "valid", "step", "policy_version", "anchor", "action"}
_TOKEN_KEYS = ("prompt_ids", "response_ids", "response_logprobs")      # in the tokens bin, in this order


def _need(obj: Any, kind: type | tuple[type, ...], where: str) -> Any:
    # bool is an int subclass in Python: never accept it where a number is meant, and vice versa.
    if isinstance(obj, bool) and kind is not bool:
        raise CodecError(f"{where}: expected {_kind_name(kind)}, got bool")
    if not isinstance(obj, kind):
        raise CodecError(f"{where}: expected {_kind_name(kind)}, got {type(obj).__name__}")
    return obj


def _kind_name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return " or ".join(k.__name__ for k in kind)
    return kind.__name__


def _float(obj: Any, where: str) -> float:
    value = _need(obj, float, where)
    if not math.isfinite(value):
        raise CodecError(f"{where}: not a finite number ({value})")
    return value


def _keys(obj: Any, want: set[str], where: str) -> dict:
    _need(obj, dict, where)
    have = set(obj)
    if have != want:
        missing, extra = sorted(want - have), sorted(map(str, have - want))
        raise CodecError(f"{where}: missing fields {missing}, unknown fields {extra}")
    return obj


def _array(obj: Any, dtype: np.dtype, count: int | None, where: str) -> np.ndarray:
    _need(obj, bytes, where)
    if len(obj) % dtype.itemsize:
        raise CodecError(f"{where}: {len(obj)} bytes is not a whole number of {dtype.itemsize}-byte items")
    n = len(obj) // dtype.itemsize
    if count is not None and n != count:
        raise CodecError(f"{where}: {n} items, expected {count}")
    return _native(np.frombuffer(obj, dtype=dtype))


def _native(arr: np.ndarray) -> np.ndarray:
    # Read-only views of the received bytes stay as they are (received records are not edited); a big-endian
    # host gets a native copy.
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def _bin_at(data: bytes, pos: int, what: str) -> tuple[int, int]:
    """(start, end) of the msgpack bin whose header is at data[pos]."""
    marker = data[pos] if pos < len(data) else None
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(marker)
    if width is None:
        raise CodecError(f"not a group: expected the {what} as msgpack bin at byte {pos}")
    start = pos + 1 + width
    end = start + int.from_bytes(data[pos + 1:start], "big")
    if start > len(data) or end > len(data):
        raise CodecError(f"not a group: the {what} bin runs past the end of the {len(data)}-byte payload")
    return start, end


def _envelope(data: bytes) -> tuple[memoryview, int, int]:
    """The header bytes and the (start, end) of the tokens bin of an encoded group, without copying."""
    if not data or data[0] != _ARRAY_OF_2[0]:
        raise CodecError("not a group: expected a msgpack array of two bins [header, tokens]")
    h0, h1 = _bin_at(data, 1, "header")
    t0, t1 = _bin_at(data, h1, "tokens")
    if t1 != len(data):
        raise CodecError(f"not a group: {len(data) - t1} bytes after the tokens bin")
    return memoryview(data)[h0:h1], t0, t1


def _strings(obj: Any, count: int, where: str) -> list[str]:
    _need(obj, list, where)
    if len(obj) != count:
        raise CodecError(f"{where}: {len(obj)} items, expected {count}")
    if set(map(type, obj)) - {str}:
        i = next(i for i, s in enumerate(obj) if type(s) is not str)
        raise CodecError(f"{where}[{i}]: expected str, got {type(obj[i]).__name__}")
    return obj


# decode_group builds StepRows by filling their __dict__ directly, having checked dtypes and lengths of all
# rows at once (vectorized): StepRow.__post_init__ (three np.asarray calls and a shape check per row) would
# double the decode time. This guard makes a change of StepRow's fields fail loudly here.
assert {f.name for f in dataclasses.fields(StepRow)} == _STEP_KEYS - {"prompt_len", "response_len"} | {*_TOKEN_KEYS}, \
    "StepRow changed: update the codec (and SCHEMA_VERSION)"


def decode_group(data: bytes) -> EpisodeGroup:
    """The group encoded in `data`; raises CodecError (with the reason) for anything but a valid group of
    this schema version. The rows' token and log-prob arrays are read-only views of `data` (of a copy when
    `data` is not `bytes`)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise CodecError(f"payload of {len(data)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")
    if not isinstance(data, bytes):
        data = bytes(data)          # the token arrays will be views of `data`: it must not change under them
    header, tokens_start, tokens_end = _envelope(data)
    try:
        doc = msgpack.unpackb(header, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            TypeError) as exc:  # UnicodeDecodeError is a ValueError
        raise CodecError(f"not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(doc, dict):
        raise CodecError(f"top level: expected a map, got {type(doc).__name__}")
    version = doc.get("schema")
    if isinstance(version, bool) or not isinstance(version, int):
        raise CodecError(f"schema: expected an integer version, got {version!r}")
    if version != SCHEMA_VERSION:
        raise CodecError(f"schema version {version}; this reader understands version {SCHEMA_VERSION} only")
    _keys(doc, _GROUP_KEYS, "group")

    group_id = _need(doc["group_id"], str, "group_id")
    task_id = _need(doc["task_id"], str, "task_id")
    where = f"group {group_id!r}"
    if not group_id:
        raise CodecError("group_id: empty")
    pv = _need(doc["policy_versions"], list, f"{where}: policy_versions")
    if len(pv) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in pv):
        raise CodecError(f"{where}: policy_versions must be two integers, got {pv!r}")

    trajs_doc = _need(doc["trajectories"], list, f"{where}: trajectories")
    trajs_meta = []
    for i, t in enumerate(trajs_doc):
        tw = f"{where}: trajectories[{i}]"
        _keys(t, _TRAJ_KEYS, tw)
        n = _need(t["num_steps"], int, f"{tw}.num_steps")
        if n < 0:
            raise CodecError(f"{tw}.num_steps: negative ({n})")
        term = _need(t["termination"], str, f"{tw}.termination")
        if term not in _TERMINATIONS:
            raise CodecError(f"{tw}.termination: {term!r} is not one of {sorted(_TERMINATIONS)}")
        trajs_meta.append(dict(
            traj_id=_need(t["traj_id"], str, f"{tw}.traj_id"),
            num_steps=n,
            success=_need(t["success"], bool, f"{tw}.success"),
            episode_return=_float(t["episode_return"], f"{tw}.episode_return"),
            termination=Termination(term),
            task_type=_need(t["task_type"], str, f"{tw}.task_type"),
            score=_float(t["score"], f"{tw}.score"),
        ))
    num_steps = sum(m["num_steps"] for m in trajs_meta)

    cols = _keys(doc["steps"], _STEP_KEYS, f"{where}: steps")
    sw = f"{where}: steps"
    prompt_len = _array(cols["prompt_len"], _I4, num_steps, f"{sw}.prompt_len")
    response_len = _array(cols["response_len"], _I4, num_steps, f"{sw}.response_len")
    if num_steps and (prompt_len.min() < 0 or response_len.min() < 0):
        raise CodecError(f"{sw}: negative prompt or response length")
    total_p, total_r = int(prompt_len.sum(dtype=np.int64)), int(response_len.sum(dtype=np.int64))
    pad = -tokens_start % _ALIGN
    want = pad + 4 * (total_p + 2 * total_r)
    if tokens_end - tokens_start != want:
        raise CodecError(f"{where}: tokens bin of {tokens_end - tokens_start} bytes, expected {want} (prompt ids, "
                         f"response ids and log-probs of {total_p} prompt and {total_r} response tokens)")
    if any(data[tokens_start:tokens_start + pad]):
        raise CodecError(f"{where}: the tokens bin's {pad} alignment bytes are not zero")
    tokens_start += pad
    prompt_ids = _native(np.frombuffer(data, _I4, total_p, tokens_start))
    response_ids = _native(np.frombuffer(data, _I4, total_r, tokens_start + 4 * total_p))
    logprobs = _native(np.frombuffer(data, _F4, total_r, tokens_start + 4 * (total_p + total_r)))
    if (total_p and prompt_ids.min() < 0) or (total_r and response_ids.min() < 0):
        raise CodecError(f"{sw}: negative token id")
    if total_r and not np.isfinite(logprobs).all():
        raise CodecError(f"{sw}.response_logprobs: NaN or infinite log-prob")
    rewards = _array(cols["reward"], _F8, num_steps, f"{sw}.reward")
    if num_steps and not np.isfinite(rewards).all():
        raise CodecError(f"{sw}.reward: NaN or infinite reward")
    valid = _array(cols["valid"], _U1, num_steps, f"{sw}.valid")
    if num_steps and valid.max() > 1:
        raise CodecError(f"{sw}.valid: values other than 0/1")
    step_idx = _array(cols["step"], _I4, num_steps, f"{sw}.step")
    versions = _array(cols["policy_version"], _I8, num_steps, f"{sw}.policy_version")
    anchors = _strings(cols["anchor"], num_steps, f"{sw}.anchor")
    actions = _strings(cols["action"], num_steps, f"{sw}.action")

    expect_pv = [int(versions.min()), int(versions.max())] if num_steps else [-1, -1]
    if pv != expect_pv:
        raise CodecError(f"{where}: policy_versions {pv} disagree with the steps' versions {expect_pv}")

    # Split the packed columns into per-step views (one cumulative-offset pass, no per-token Python work).
    p_off = np.concatenate(([0], np.cumsum(prompt_len, dtype=np.int64))).tolist()
    r_off = np.concatenate(([0], np.cumsum(response_len, dtype=np.int64))).tolist()
    rewards_l, step_l, ver_l = rewards.tolist(), step_idx.tolist(), versions.tolist()
    valid_l = valid.astype(bool).tolist()

    # Rows are built without StepRow.__init__ (see the assert above decode_group): all were checked above.
    new_row = object.__new__
    rows = []
    for p_a, p_b, r_a, r_b, reward, anchor, ok, idx, version, action in zip(
            p_off, p_off[1:], r_off, r_off[1:], rewards_l, anchors, valid_l, step_l, ver_l, actions):
        row = new_row(StepRow)
        row.__dict__ = {"prompt_ids": prompt_ids[p_a:p_b], "response_ids": response_ids[r_a:r_b],
                        "response_logprobs": logprobs[r_a:r_b], "reward": reward, "anchor": anchor,
                        "valid": ok, "step": idx, "policy_version": version, "action": action}
        rows.append(row)
    trajectories = []
    k = 0
    for m in trajs_meta:
        n = m.pop("num_steps")
        trajectories.append(Trajectory(task_id=task_id, group_id=group_id, steps=rows[k:k + n], **m))
        k += n

    return EpisodeGroup(
        group_id=group_id,
        task_id=task_id,
        env_name=_need(doc["env_name"], str, f"{where}: env_name"),
        trajectories=trajectories,
        created_at=_float(doc["created_at"], f"{where}: created_at"),
        producer=_need(doc["producer"], str, f"{where}: producer"),
    )
