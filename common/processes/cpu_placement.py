"""Where a process may run and how urgently: CPU affinity and niceness for processes that share a node.

Set by run.learner_cpus, run.rollout_cpus and run.rollout_nice. Where rollout and learner share CPUs, the
learner is async training's critical path: a second it waits delays the next weights, while rollout work done
instead only fills the stream. So the rollout side runs a few nice levels lower, or each side gets its own CPUs.
On Linux affinity and niceness belong to each thread: every existing thread is placed, and threads and
processes started later (vLLM's engines, env workers) inherit the placement of the thread that starts them.
"""
from __future__ import annotations

import os


def parse_cpu_list(spec: str) -> set[int]:
    """CPU ids from a Linux-style list, e.g. "0-3,6" -> {0, 1, 2, 3, 6}; "" -> empty (no restriction)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"CPU list {spec!r}: {part!r} is not a CPU id or a range like 2-5") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {spec!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def place_this_process(cpus: str = "", nice: int = 0) -> None:
    """Restrict every thread of this process to `cpus` ("" = leave as is) and add `nice` to its niceness
    (capped at 19 by the kernel; 0 = leave as is)."""
    allowed = parse_cpu_list(cpus)
    if allowed:
        missing = allowed - os.sched_getaffinity(0)
        if missing:
            raise ValueError(f"CPU list {cpus!r}: CPUs {sorted(missing)} are not available to this process "
                             f"(available: {sorted(os.sched_getaffinity(0))})")
    if not allowed and nice <= 0:
        return
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:                       # not Linux: the calling thread only
        tids = [0]
    for tid in tids:
        try:
            if allowed:
                os.sched_setaffinity(tid, allowed)
            if nice > 0:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except (ProcessLookupError, FileNotFoundError):     # a thread that ended meanwhile
            pass


def compute_threads(cpus: str = "", sharers: int = 1) -> int:
    """How many compute threads (torch's intra-op pool) a process should run: the CPUs of `cpus` when given,
    else the CPUs this process may run on, split between the `sharers` processes of its kind on the node;
    at least 1. Not Ray's figure: Ray sets OMP_NUM_THREADS to an actor's num_cpus (1 for the learner),
    which is what it reserves for scheduling, not what the process may use."""
    allowed = parse_cpu_list(cpus) or os.sched_getaffinity(0)
    return max(1, len(allowed) // max(1, sharers))


def use_compute_threads(threads: int) -> None:
    """Run torch's intra-op pool (and OpenMP/MKL in processes started from here) with `threads` threads."""
    import torch
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    torch.set_num_threads(threads)
