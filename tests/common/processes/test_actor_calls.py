"""common/processes/actor_calls.py on a local Ray with tiny actors: a group's answers sorted into done, lost, failed and
late by one deadline; fail_fast ends the wait at the first failure; on_wait runs while waiting."""
import os
import time

import pytest
import ray

from common.processes import actor_calls
from common.processes.actor_calls import answered, call_all, wait_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LATE_S = 60.0       # a call that answers long after every deadline below
DEADLINE_S = 3.0    # the deadline of the waits below (the actors answer at once otherwise)


@ray.remote(num_cpus=0, max_concurrency=4)
class Member:
    def answer(self, how: str) -> str:
        if how == "raise":
            raise ValueError("asked to fail")
        if how == "die":
            os._exit(1)
        if how == "late":
            time.sleep(LATE_S)
        return how


@pytest.fixture(scope="module")
def members(local_ray):
    group = [Member.remote() for _ in range(4)]
    yield group
    for member in group:
        ray.kill(member)


def test_every_answer_is_sorted_by_what_came_back(members):
    refs = [member.answer.remote(how) for member, how in zip(members, ["ok", "raise", "die", "late"])]
    t0 = time.monotonic()
    answers = wait_all(refs, DEADLINE_S)
    assert time.monotonic() - t0 < LATE_S
    assert answers.done == {0: "ok"} and answers.late == [3]
    assert list(answers.failed) == [1] and isinstance(answers.failed[1], ValueError)
    assert list(answers.lost) == [2] and isinstance(answers.lost[2], ray.exceptions.ActorDiedError)
    assert list(answers.errors) == [1, 2]
    with pytest.raises(ValueError, match="asked to fail"):
        answers.raise_first_error()


def test_fail_fast_ends_the_wait_at_the_first_failure_and_on_wait_runs_meanwhile(local_ray, monkeypatch):
    group = [Member.remote() for _ in range(2)]
    try:
        assert call_all(group, "answer", "ok", timeout_s=60).done == {0: "ok", 1: "ok"}
        late = group[0].answer.remote("late")
        assert not answered(late)
        t0 = time.monotonic()
        answers = wait_all([late, group[1].answer.remote("raise")], LATE_S, fail_fast=True)
        assert time.monotonic() - t0 < LATE_S / 2 and list(answers.failed) == [1] and answers.late == [0]
        monkeypatch.setattr(actor_calls, "ON_WAIT_EVERY_S", 0.2)
        waits = []
        answers = wait_all([late], 1.0, on_wait=lambda: waits.append(time.monotonic()))
        assert answers.late == [0] and not answers.done and len(waits) >= 2
    finally:
        for member in group:
            ray.kill(member)
