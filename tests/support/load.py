"""A loaded machine, for tests of what must still happen in time when every core is busy (a run stopped on a
node where other jobs spin):

    with cpu_load(os.cpu_count()):
        ...                         # n processes spin at the test's own priority until the block ends
"""
from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def cpu_load(n: int):
    """`n` processes that spin on a core each (not niced: they compete with the code under test as other
    tenants' jobs would), killed when the block ends, whatever happens in it."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
                for _ in range(n)]
    try:
        yield spinners
    finally:
        for proc in spinners:
            proc.kill()
        for proc in spinners:
            proc.wait()
