"""Wire format of episode groups: round trips and strict rejection of anything else."""
from __future__ import annotations

import math
from pathlib import Path

import msgpack
import numpy as np
import pytest

from common.codec import SCHEMA_VERSION, CodecError, decode_group, encode_group
from common.records import EpisodeGroup, StepRow, Termination, Trajectory
from tests.stream_factory import assert_groups_equal, make_group


def test_round_trip_group_with_every_termination_and_field():
    group = make_group("g-1", num_traj=len(Termination) + 1, num_steps=4)
    data = encode_group(group)
    assert isinstance(data, bytes)
    back = decode_group(data)
    assert_groups_equal(group, back)
    assert {t.termination for t in back.trajectories} == set(Termination)


def test_round_trip_edge_shapes():
    # An empty response, an empty prompt, an empty trajectory (env error at reset) and extreme values.
    step = StepRow(prompt_ids=[], response_ids=[], response_logprobs=[], reward=-0.1, anchor="", valid=False,
                   step=0, policy_version=2**40, action="")
    big = StepRow(prompt_ids=[0, 2**31 - 1], response_ids=[7], response_logprobs=[-1e-30], reward=1e300,
                  anchor="x" * 10_000, valid=True, step=1, policy_version=2**40, action="ü")
    group = EpisodeGroup(
        group_id="g-edge", task_id="t", env_name="webshop", producer="", created_at=0.0,
        trajectories=[
            Trajectory(task_id="t", group_id="g-edge", traj_id="a", steps=[step, big],
                       termination=Termination.TRUNCATED),
            Trajectory(task_id="t", group_id="g-edge", traj_id="b", steps=[], termination="env_error"),
        ],
    )
    assert_groups_equal(group, decode_group(encode_group(group)))
    empty = EpisodeGroup(group_id="g-empty", task_id="t", env_name="alfworld")
    back = decode_group(encode_group(empty))
    assert back.trajectories == [] and back.policy_versions == (-1, -1)


def _unpack(payload: bytes) -> tuple[dict, bytes]:
    """(header map, token columns) of an encoded group, read with plain msgpack."""
    header, tokens = msgpack.unpackb(payload, raw=False)
    pad = -payload.index(tokens) % 4             # zero bytes that align the columns in the payload
    assert tokens[:pad] == bytes(pad)
    return msgpack.unpackb(header, raw=False), tokens[pad:]


def _pack(doc: dict, columns: bytes) -> bytes:
    """The inverse of _unpack, laid out as the encoder does (bin 32 tokens header, then alignment)."""
    header = msgpack.packb(doc, use_bin_type=True)
    head = b"\x92" + msgpack.packb(header, use_bin_type=True)[:-len(header)] if header else b"\x92\xc4\x00"
    pad = -(len(head) + len(header) + 5) % 4
    return head + header + b"\xc6" + (pad + len(columns)).to_bytes(4, "big") + bytes(pad) + columns


def test_token_arrays_travel_packed_little_endian():
    group = make_group("g-packed", num_traj=1, num_steps=1, prompt_len=3, response_len=2)
    payload = encode_group(group)
    doc, tokens = _unpack(payload)
    assert _pack(doc, tokens) == payload
    step = group.trajectories[0].steps[0]
    np.testing.assert_array_equal(np.frombuffer(tokens, "<i4", 3, 0), step.prompt_ids)
    np.testing.assert_array_equal(np.frombuffer(tokens, "<i4", 2, 12), step.response_ids)
    np.testing.assert_array_equal(np.frombuffer(tokens, "<f4", 2, 20), step.response_logprobs)
    assert doc["schema"] == SCHEMA_VERSION
    assert doc["group_id"] == "g-packed" and doc["policy_versions"] == [0, 0]
    assert np.frombuffer(doc["steps"]["prompt_len"], "<i4").tolist() == [3]


def test_decoded_arrays_are_read_only_views_of_the_payload():
    data = encode_group(make_group("g-w"))
    group = decode_group(data)
    step = group.trajectories[0].steps[0]
    with pytest.raises(ValueError, match="read-only"):
        step.prompt_ids[0] = -5
    assert np.shares_memory(step.prompt_ids, np.frombuffer(data, np.uint8)) and step.prompt_ids.flags.aligned
    # A mutable buffer is copied first: later writes to it do not reach the decoded group.
    buf = bytearray(data)
    before = decode_group(buf).trajectories[0].steps[0]
    buf[:] = encode_group(make_group("g-w", seed=1))
    assert np.array_equal(before.prompt_ids, step.prompt_ids)


def test_encode_refuses_inconsistent_groups():
    group = make_group("g-1")
    group.trajectories[1].group_id = "other"
    with pytest.raises(CodecError, match="belongs to group 'other'"):
        encode_group(group)
    group = make_group("g-2")
    group.trajectories[0].steps[0].response_logprobs = np.zeros(99, np.float32)
    with pytest.raises(CodecError, match="5 response tokens but 99 log-probs"):
        encode_group(group)


def _mutated(fn) -> bytes:
    """The encoded test group with its header map changed by `fn`."""
    doc, tokens = _unpack(encode_group(make_group("g-bad")))
    fn(doc)
    return _pack(doc, tokens)


def _tokens(fn) -> bytes:
    """The encoded test group with its tokens bin replaced by fn(tokens)."""
    doc, tokens = _unpack(encode_group(make_group("g-bad")))
    return _pack(doc, fn(tokens))


def _set(path: str, value):
    def fn(doc):
        node = doc
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if isinstance(node, list) else last] = value
    return fn


_DELETE = object()
_GOOD = encode_group(make_group("g-bad"))
_HEADER, _TOKENS = msgpack.unpackb(_GOOD)
_NUM_P = 6 * 20                           # the test group's prompt tokens (2 trajectories x 3 steps x 20)


@pytest.mark.parametrize("data, reason", [
    (b"\xc1\xff\x00garbage", "not a group: expected a msgpack array"),
    (b"", "not a group: expected a msgpack array"),
    (_GOOD[: len(_GOOD) // 2], "runs past the end"),
    (_GOOD + b"\x00", "1 bytes after the tokens bin"),
    (msgpack.packb([1, 2]), "expected the header as msgpack bin"),
    (msgpack.packb([_HEADER, "tokens"]), "expected the tokens as msgpack bin"),
    (msgpack.packb([b"\xc1", _TOKENS]), "not valid msgpack"),
    (msgpack.packb([msgpack.packb([1, 2, 3]), _TOKENS]), "expected a map"),
    (_mutated(_set("schema", SCHEMA_VERSION + 1)), f"schema version {SCHEMA_VERSION + 1}"),
    (_mutated(_set("schema", "1")), "schema: expected an integer"),
    (_mutated(_set("schema", _DELETE)), "schema: expected an integer"),
    (_mutated(_set("producer", _DELETE)), r"missing fields \['producer'\]"),
    (_mutated(_set("extra", 1)), r"unknown fields \['extra'\]"),
    (_mutated(_set("group_id", 7)), "group_id: expected str, got int"),
    (_mutated(_set("group_id", "")), "group_id: empty"),
    (_mutated(_set("created_at", math.nan)), "not a finite number"),
    (_mutated(_set("created_at", 5)), "created_at: expected float, got int"),
    (_mutated(_set("trajectories.0.success", 1)), r"trajectories\[0\].success: expected bool, got int"),
    (_mutated(_set("trajectories.0.num_steps", True)), "num_steps: expected int, got bool"),
    (_mutated(_set("trajectories.0.num_steps", 4)), "items, expected"),
    (_mutated(_set("trajectories.1.termination", "exploded")), "'exploded' is not one of"),
    (_mutated(_set("steps.prompt_ids", b"")), r"unknown fields \['prompt_ids'\]"),
    (_mutated(_set("steps.reward", b"\x00" * 7)), "not a whole number of 8-byte items"),
    (_mutated(_set("steps.step", [1, 2, 3])), r"step: expected bytes, got list"),
    (_tokens(lambda t: t[:-4]), "tokens bin of .* bytes, expected"),
    (_tokens(lambda t: t + b"\x00" * 4), "tokens bin of .* bytes, expected"),
    (_tokens(lambda t: t[:-30 * 4] + np.full(30, np.nan, "<f4").tobytes()), "NaN or infinite log-prob"),
    (_tokens(lambda t: np.full(_NUM_P, -3, "<i4").tobytes() + t[4 * _NUM_P:]), "negative token id"),
    (_GOOD[:_GOOD.index(_TOKENS)] + b"\x01" + _GOOD[_GOOD.index(_TOKENS) + 1:], "alignment bytes are not zero"),
    (_mutated(_set("steps.prompt_len", np.full(6, -1, "<i4").tobytes())), "negative prompt or response length"),
    (_mutated(_set("steps.anchor", ["a"] * 5)), r"anchor: 5 items, expected 6"),
    (_mutated(_set("steps.action", [1] * 6)), r"action\[0\]: expected str"),
    (_mutated(_set("steps.valid", b"\x02" * 6)), "values other than 0/1"),
    (_mutated(_set("policy_versions", [0, 9])), "disagree with the steps"),
    (_mutated(_set("policy_versions", [0])), "two integers"),
])
def test_decode_rejects_with_a_clear_reason(data, reason):
    with pytest.raises(CodecError, match=reason):
        decode_group(data)


def test_decode_rejects_non_bytes():
    with pytest.raises(CodecError, match="expected bytes"):
        decode_group("not bytes")  # type: ignore[arg-type]


def test_no_pickle_on_the_wire():
    root = Path(__file__).resolve().parents[1] / "common"
    for name in ("codec.py", "stream.py", "redis_server.py"):
        text = (root / name).read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, name


def test_encode_refuses_arrays_that_are_not_1d():
    group = make_group("g-2d")
    group.trajectories[0].steps[1].prompt_ids = np.zeros((20, 2), np.int32)
    with pytest.raises(CodecError, match="not 1-D"):
        encode_group(group)


@pytest.mark.parametrize("field, value, reason", [
    ("response_logprobs", [np.nan] * 5, "response_logprobs: NaN"),
    ("prompt_ids", [-1] * 20, "prompt_ids: negative ids"),
    ("reward", math.inf, "NaN or infinite reward"),
])
def test_encode_refuses_what_decode_would_refuse(field, value, reason):
    group = make_group("g-nan")
    setattr(group.trajectories[1].steps[2], field, np.asarray(value) if isinstance(value, list) else value)
    with pytest.raises(CodecError, match=reason):
        encode_group(group)


def test_encode_turns_unencodable_values_into_codec_errors():
    group = make_group("g-bad-text")
    group.trajectories[0].steps[0].anchor = "\ud800 lone surrogate"
    with pytest.raises(CodecError, match="cannot be encoded"):
        encode_group(group)
    group = make_group("g-bad-step")
    group.trajectories[0].steps[0].step = 2**40
    with pytest.raises(CodecError, match="cannot be encoded"):
        encode_group(group)
