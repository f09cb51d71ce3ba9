"""Calling a group of Ray actors with one deadline, and sorting what came back: the one place the project
waits on Ray (`ray.wait`).

    answers = call_all(actors, "close", timeout_s=300)   # the same call to every actor of a group
    answers.done      # {index: what it returned}
    answers.lost      # {index: RayActorError}: its actor died (ActorDiedError) or is unreachable for now
                      # (ActorUnavailableError: Ray may be restarting it)
    answers.failed    # {index: what it raised}
    answers.late      # [index]: no answer by the deadline
    answers = wait_all(refs, timeout_s, fail_fast=True, on_wait=look_after_the_rest)   # calls already made
    if answered(ref): ...                                 # one call in flight: has it come back (timeout 0)?

Indices are positions in the list of actors or refs given. What each caller makes of the four (an error, a
log line, a kill) is the caller's: the learner stops at the first failure, a close reports it and goes on.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ray

ON_WAIT_EVERY_S = 10.0    # how often a long wait lets the driver do its rounds (`wait_all`'s on_wait)


@dataclass
class Answers:
    """The calls of one wait, sorted by what came back (see the module)."""
    done: dict[int, object] = field(default_factory=dict)
    lost: dict[int, Exception] = field(default_factory=dict)
    failed: dict[int, Exception] = field(default_factory=dict)
    late: list[int] = field(default_factory=list)

    @property
    def errors(self) -> dict[int, Exception]:
        """lost and failed together, by index."""
        return dict(sorted({**self.lost, **self.failed}.items()))

    def raise_first_error(self) -> None:
        """Raise what the first call (by index) that did not return raised (as ray.get raised it), if any."""
        for exc in self.errors.values():
            raise exc


def wait_all(refs: Sequence, timeout_s: float, fail_fast: bool = False,
             on_wait: Callable[[], None] | None = None) -> Answers:
    """Wait up to timeout_s for every ref (ObjectRefs of actor calls) and sort the answers. fail_fast: return
    as soon as one call has raised or lost its actor (the others may be waiting for it in a collective that
    never ends); the calls not back by then are late. on_wait: called every ON_WAIT_EVERY_S while waiting."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    index = {ref: i for i, ref in enumerate(refs)}
    answers, pending = Answers(), list(refs)
    while pending:
        left = max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1 if fail_fast else len(pending),
                                  timeout=min(left, ON_WAIT_EVERY_S) if on_wait is not None else left)
        for ref in ready:
            _sort(answers, index[ref], ref)
        if fail_fast and (answers.lost or answers.failed):
            break
        if fail_fast and ready:
            continue
        if on_wait is None or time.monotonic() >= deadline:
            break
        on_wait()
    answers.done, answers.lost, answers.failed = (dict(sorted(d.items())) for d in
                                                  (answers.done, answers.lost, answers.failed))
    answers.late = sorted(index[ref] for ref in pending)
    return answers


def call_all(actors: Sequence, method: str, *args, timeout_s: float) -> Answers:
    """`method(*args)` on every actor (the call declared once for the whole group), answers within timeout_s."""
    return wait_all([getattr(actor, method).remote(*args) for actor in actors], timeout_s)


def answered(ref, timeout_s: float = 0.0) -> bool:
    """Whether the call behind `ref` has come back (returned or raised), waiting up to timeout_s."""
    return bool(ray.wait([ref], timeout=timeout_s)[0])


def _sort(answers: Answers, i: int, ref) -> None:
    try:
        answers.done[i] = ray.get(ref)
    except ray.exceptions.RayActorError as exc:      # ActorDiedError, ActorUnavailableError
        answers.lost[i] = exc
    except Exception as exc:  # noqa: BLE001 - the caller says what a failed call means
        answers.failed[i] = exc
