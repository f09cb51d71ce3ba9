"""Where a run's output goes (common.processes.log_files): the driver's terminal keeps only what a person reads, and
everything else, C-level writes and child processes included, lands in the log file."""
import logging
import os
import subprocess
import sys
from pathlib import Path

from common.processes.log_files import run_output

REPO = Path(__file__).resolve().parents[3]


def test_the_terminal_shows_results_and_own_warnings_the_log_file_everything(tmp_path, capfd):
    with run_output(tmp_path / "logs") as terminal:
        terminal.print("RESULT LINE")
        logging.getLogger("gigpo.system").warning("own warning")
        logging.getLogger("gigpo").info("own info")
        # A library logger without handlers of its own. (transformers installs its own handler on the
        # sys.stderr of its import time: in a run that is the driver's fd 2, redirected here too; in a test
        # session it may be an earlier test's capture, so it is not the one asserted on.)
        logging.getLogger("a_library.module").warning("library warning")
        print("library print")
        os.write(2, b"c-level write\n")                                 # what a C++ library does
        subprocess.run([sys.executable, "-c", "print('child process')"], check=True)
    os.write(1, b"after\n")                                               # the descriptors are restored
    seen = capfd.readouterr()
    assert seen.out == "RESULT LINE\nafter\n"
    assert seen.err == "WARNING: own warning\n"
    log = (tmp_path / "logs" / "driver.log").read_text()
    for text in ("own warning", "own info", "library warning", "library print", "c-level write", "child process"):
        assert text in log, text
    assert "RESULT LINE" not in log


def test_an_actor_sends_all_its_output_to_its_file(tmp_path):
    """send_output_to redirects for good (what an actor process wants): run it in a process of its own."""
    code = ("import logging, os, subprocess, sys\n"
            "from common.processes.log_files import send_output_to\n"
            f"send_output_to({str(tmp_path)!r}, 'inference-0')\n"
            "print('a print')\n"
            "logging.getLogger('vllm.engine').info('a library log line')\n"
            "os.write(2, b'c-level write\\n')\n"
            "subprocess.run([sys.executable, '-c', 'print(\"engine core child\")'], check=True)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout == "" and done.stderr == ""
    log = (tmp_path / "inference-0.log").read_text()
    for text in ("a print", "a library log line", "c-level write", "engine core child"):
        assert text in log, text
