"""CPU placement of learner and rollout processes (run.learner_cpus / rollout_cpus / rollout_nice)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from common.processes.cpu_placement import parse_cpu_list


def test_parse_cpu_list():
    assert parse_cpu_list("") == set()
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0-3,6, 8-8") == {0, 1, 2, 3, 6, 8}
    for bad in ("a", "3-1", "-1", "1-x"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpu_list(bad)


def test_place_this_process_moves_every_thread_and_lowers_priority():
    # In a child process: placement cannot be undone (a raised niceness cannot be lowered again).
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading, time
        from common.processes.cpu_placement import place_this_process
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait)          # a thread that exists before placement
        worker.start()
        base = os.getpriority(os.PRIO_PROCESS, 0)
        place_this_process("{cpu}", nice=3)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        assert len(tids) >= 2
        for tid in tids:
            assert os.sched_getaffinity(tid) == {{{cpu}}}, tid
            assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, base + 3), tid
        later = threading.Thread(target=lambda: None)        # threads started later inherit it
        later.start(); later.join()
        assert os.sched_getaffinity(0) == {{{cpu}}}
        stop.set(); worker.join()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_place_this_process_refuses_cpus_it_cannot_have():
    from common.processes.cpu_placement import place_this_process
    with pytest.raises(ValueError, match="not available to this process"):
        place_this_process("4096")
