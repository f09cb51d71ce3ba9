"""Records and their wire format: the row schema, round trips, zero-copy decoding, strict rejection."""
from __future__ import annotations

import math
from pathlib import Path

import msgpack
import numpy as np
import pytest

from common.stream.codec import SCHEMA_VERSION, CodecError, decode_group, encode_group

from common.stream.records import TABLE, EpisodeGroup, Rows, StepRow, Termination, Trajectory, check_values, layout
from tests.support.stream_factory import assert_groups_equal, make_group
from tests.support.synthetic import row_step, steps_of


def _received(group: EpisodeGroup) -> dict[bytes, bytes]:
    """The group's parts as a Redis read returns them."""
    return {k.encode(): bytes(v) for k, v in encode_group(group).items()}


def test_round_trip_group_with_every_termination_and_field():
    group = make_group("g-1", num_traj=len(Termination) + 1, num_steps=4)
    back = decode_group(_received(group))
    assert_groups_equal(group, back)
    assert {t.termination for t in back.trajectories} == set(Termination)


def test_round_trip_edge_shapes():
    # An empty response, an empty prompt, an empty trajectory (env error at reset) and extreme values.
    step = StepRow(prompt_ids=[], response_ids=[], response_logprobs=[], reward=-0.1, anchor="", valid=False,
                   step=0, policy_version=2**40, action="")
    big = StepRow(prompt_ids=[0, 2**31 - 1], response_ids=[7], response_logprobs=[-1e-30], reward=1e300,
                  anchor="x" * 10_000, valid=True, step=1, policy_version=2**40, action="ü ✓")
    group = EpisodeGroup.pack("g-edge", "t", "webshop", [
        (Trajectory("a", termination=Termination.TRUNCATED), [step, big]),
        (Trajectory("b", termination="env_error"), []),
    ])
    assert_groups_equal(group, decode_group(_received(group)))
    empty = EpisodeGroup(group_id="g-empty", task_id="t", env_name="alfworld")
    back = decode_group(_received(empty))
    assert back.trajectories == [] and back.policy_versions == (-1, -1) and len(back.rows) == 0


def test_rows_are_two_arrays_laid_out_as_the_schema_says():
    group = make_group("g-packed", num_traj=1, num_steps=2, prompt_len=3, response_len=2)
    parts = _received(group)
    table = np.frombuffer(parts[b"rows"], TABLE)          # any numpy reads it: a C struct per row
    assert table["prompt_len"].tolist() == [3, 3] and table["step"].tolist() == [0, 1]
    where, size = layout(table)
    assert len(parts[b"data"]) == size and all(offset % 8 == 0 for offset, _ in where.values())
    offset, count = where["response_logprobs"]
    np.testing.assert_array_equal(np.frombuffer(parts[b"data"], "<f4", count, offset),
                                  np.concatenate([s.response_logprobs for s in steps_of(group, 0)]))
    header = msgpack.unpackb(parts[b"h"])
    assert header["schema"] == SCHEMA_VERSION and header["trajectories"]["num_steps"] == [2]


def test_decoded_arrays_are_read_only_views_of_the_received_bytes():
    parts = _received(make_group("g-w"))
    group = decode_group(parts)
    prompt = group.rows["prompt_ids"]
    with pytest.raises(ValueError, match="read-only"):
        prompt[0] = 5
    assert np.shares_memory(prompt, np.frombuffer(parts[b"data"], np.uint8)) and prompt.flags.aligned
    assert np.shares_memory(group.rows["reward"], np.frombuffer(parts[b"rows"], np.uint8))
    # A mutable buffer is copied first: later writes to it do not reach the decoded group.
    data = bytearray(parts[b"data"])
    before = decode_group({**parts, b"data": data}).rows["prompt_ids"].copy()
    data[:] = bytes(len(data))
    assert np.array_equal(before, prompt)


def test_rows_refuse_what_the_schema_refuses():
    ok = dict(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-0.1, -0.2], reward=0.0, anchor="a",
              valid=True, step=0, policy_version=0)
    with pytest.raises(ValueError, match="2 response tokens but 1 log-probs"):
        StepRow(**{**ok, "response_logprobs": [-1.0]})
    for change, reason in [({"response_logprobs": [np.nan, 0.0]}, "response_logprobs: NaN"),
                           ({"prompt_ids": [-1]}, "prompt_ids: negative ids"),
                           ({"reward": math.inf}, "reward: NaN or infinite"),
                           ({"step": 2**40}, "OverflowError"),
                           ({"anchor": "\ud800 lone surrogate"}, "UnicodeEncodeError"),
                           ({"prompt_ids": np.zeros((2, 2))}, "not 1-D")]:
        with pytest.raises(ValueError, match=reason):
            Rows.from_steps([StepRow(**ok), StepRow(**{**ok, **change})])


def test_a_row_reads_back_as_the_step_it_was():
    steps = [StepRow(prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.5], reward=10.0, anchor="Ünï",
                     valid=False, step=4, policy_version=9, action="go"),
             StepRow(prompt_ids=[5], response_ids=[], response_logprobs=[], reward=0.0, anchor="", valid=True,
                     step=5, policy_version=9)]
    rows = Rows.from_steps(steps)
    assert rows.text("anchor") == ["Ünï", ""] and [len(r) for r in rows.per_row("response_ids")] == [1, 0]
    for i, s in enumerate(steps):
        got = row_step(rows, i)
        np.testing.assert_array_equal(got.prompt_ids, s.prompt_ids)
        assert (got.reward, got.anchor, got.valid, got.step, got.action) == (s.reward, s.anchor, s.valid, s.step,
                                                                             s.action)


def _with_header(change) -> dict[bytes, bytes]:
    parts = _received(make_group("g-bad"))
    doc = msgpack.unpackb(parts[b"h"])
    change(doc)
    return {**parts, b"h": msgpack.packb(doc)}


def _set(path: str, value):
    def change(doc):
        *keys, last = path.split(".")
        node = doc
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node[k]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if isinstance(node, list) else last] = value
    return change


def _with_part(name: str, fn) -> dict[bytes, bytes]:
    parts = _received(make_group("g-bad"))
    return {**parts, name.encode(): fn(parts[name.encode()])}


def _with_lengths(column: str, delta: int) -> dict[bytes, bytes]:
    def fn(raw):
        table = np.frombuffer(raw, TABLE).copy()
        table[column][0] += delta
        return table.tobytes()
    return _with_part("rows", fn)


_DELETE = object()
_GOOD = _received(make_group("g-bad"))        # 2 trajectories x 3 steps


@pytest.mark.parametrize("parts, reason", [
    ({b"h": b"x"}, r"missing parts \['rows', 'data'\]"),
    ({**_GOOD, b"data": "text"}, "part data: expected bytes, got str"),
    ({**_GOOD, b"h": b"\xc1"}, "header: not valid msgpack"),
    ({**_GOOD, b"h": msgpack.packb([1, 2])}, "header: expected a map"),
    (_with_header(_set("schema", SCHEMA_VERSION + 1)), f"schema version {SCHEMA_VERSION + 1}"),
    (_with_header(_set("schema", "1")), "schema: expected an integer"),
    (_with_header(_set("producer", _DELETE)), r"missing fields \['producer'\]"),
    (_with_header(_set("extra", 1)), r"unknown fields \['extra'\]"),
    (_with_header(_set("group_id", 7)), "group_id: expected str, got int"),
    (_with_header(_set("group_id", "")), "group_id: empty"),
    (_with_header(_set("created_at", math.nan)), "not a finite number"),
    (_with_header(_set("created_at", 5)), "created_at: expected float, got int"),
    (_with_header(_set("trajectories.success", [1, 0])), r"trajectories.success: expected bool, got int"),
    (_with_header(_set("trajectories.num_steps", [True, 3])), "num_steps: expected int, got bool"),
    (_with_header(_set("trajectories.num_steps", [3, 4])), "rows part of .* bytes, expected 7 rows"),
    (_with_header(_set("trajectories.num_steps", [-1, 3])), "num_steps: negative"),
    (_with_header(_set("trajectories.score", [1.0])), "score: 1 values for 2 trajectories"),
    (_with_header(_set("trajectories.termination", ["done", "exploded"])), r"\['exploded'\] not among"),
    (_with_header(_set("trajectories", [])), "trajectories: expected a map"),
    (_with_part("rows", lambda raw: raw[:-1]), "rows part of .* bytes, expected 6 rows"),
    (_with_part("data", lambda raw: raw[:-8]), "data: .* bytes, but the rows' lengths say"),
    (_with_part("data", lambda raw: raw + bytes(8)), "data: .* bytes, but the rows' lengths say"),
    (_with_lengths("response_len", 2), "data: .* bytes, but the rows' lengths say"),
    (_with_lengths("prompt_len", -30), "negative lengths"),
])
def test_decode_rejects_with_a_clear_reason(parts, reason):
    with pytest.raises(CodecError, match=reason):
        decode_group(parts)


def test_decode_rejects_what_is_not_parts():
    with pytest.raises(CodecError, match="expected the parts of a group"):
        decode_group(b"not parts")  # type: ignore[arg-type]


def test_values_are_checked_once_by_the_learner_not_by_the_decoder():
    # The decoder checks the layout; a NaN log-prob is the learner's check (learner.batching.check_group),
    # which dead-letters the group with this reason.
    def nan_logprob(raw):
        data = bytearray(raw)
        offset, _ = layout(np.frombuffer(_GOOD[b"rows"], TABLE))[0]["response_logprobs"]
        data[offset:offset + 4] = np.float32(np.nan).tobytes()
        return bytes(data)
    group = decode_group(_with_part("data", nan_logprob))
    assert "response_logprobs: NaN" in check_values(group.rows)
    assert check_values(decode_group(_GOOD).rows) == ""


def test_no_pickle_on_the_wire():
    stream_package = Path(__file__).resolve().parents[3] / "common" / "stream"
    for path in stream_package.glob("*.py"):
        text = path.read_text()
        assert "import pickle" not in text and "pickle.loads" not in text, path.name


def test_encode_refuses_headers_the_decoder_would_refuse():
    group = make_group("g-steps")
    group.trajectories[0].num_steps += 1
    with pytest.raises(CodecError, match="its trajectories have 7 steps, its rows 6"):
        encode_group(group)
    group = make_group("g-nan")
    group.trajectories[1].episode_return = math.nan
    with pytest.raises(CodecError, match="NaN or infinite return"):
        encode_group(group)
    group = make_group("g-text")
    group.trajectories[0].task_type = "\ud800 lone surrogate"
    with pytest.raises(CodecError, match="cannot be encoded"):
        encode_group(group)


def test_a_group_pickles_as_its_two_arrays():
    # Ray moves groups between processes by pickle (evaluation episodes): the views come back as views.
    import pickle

    group = make_group("g-pickle")
    back = pickle.loads(pickle.dumps(group))
    assert_groups_equal(group, back)
    assert np.shares_memory(back.rows["prompt_ids"], back.rows.data)
    assert len(pickle.dumps(group.rows)) < group.rows.data.nbytes + group.rows.table.nbytes + 1000
