"""Where a run's output goes: a terminal a person can read, and one log file per component.

    with run_output(log_dir) as terminal:                  # the driver (gigpo train / gigpo eval)
        terminal.print("one line a person reads")
    send_output_to(log_dir, "inference-0")                 # first thing in an actor's constructor

The terminal shows a progress bar, one line per evaluation, the final summary and this project's warnings.
Everything else goes to `<log_dir>/<component>.log`: Python logging (vLLM's, DeepSpeed's, Ray's), prints,
and C/C++ libraries' output (xgrammar, gloo, the env engines). Hence the redirect is of file descriptors 1
and 2, not of sys.stdout: it catches C++ output, and child processes (vLLM's engine, env workers) inherit it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, TextIO

LOG_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"
# Loggers of this project (module names, and "gigpo.*"): their warnings also reach the terminal.
OWN_LOGGERS = ("gigpo", "deploy", "actors", "learner", "common", "env_servers")


def _point_fds_at(path: Path) -> None:
    """Make fds 1 and 2 of this process write (append) to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _python_streams_on_fds() -> tuple[TextIO, TextIO]:
    """sys.stdout / sys.stderr may be wrappers of the host (Ray's worker, pytest) around other files: make
    them write through fds 1 and 2, whatever they were. Returns the previous ones."""
    previous = (sys.stdout, sys.stderr)
    sys.stdout = open(1, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    return previous


def send_output_to(log_dir: str, component: str) -> str:
    """In an actor: from now on, everything this process (and the children it starts) prints or logs goes
    to `<log_dir>/<component>.log`. Python logging: INFO and above, one line per record. Returns the path.
    An empty `log_dir` changes nothing (a component started outside a run, e.g. by a test)."""
    if not log_dir:
        return ""
    path = Path(log_dir) / f"{component}.log"
    _point_fds_at(path)
    _python_streams_on_fds()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr, force=True)
    logging.captureWarnings(True)
    return str(path)


class Terminal:
    """What the person who started the run reads (the real stdout / stderr of the driver)."""

    def __init__(self, out: TextIO, err: TextIO):
        self.out = out         # results: evaluation lines, the summary
        self.err = err         # the progress bar and warnings, as usual for both
        self.bar = None        # the progress bar (tqdm) while there is one: lines go above it

    def print(self, text: str = "") -> None:
        """A line (or several) of results."""
        self._write(self.out, text)

    def warn(self, text: str) -> None:
        self._write(self.err, text)

    def _write(self, stream: TextIO, text: str) -> None:
        # Both streams are usually the same terminal: clear the bar's line, write, draw the bar again.
        if self.bar is not None:
            self.bar.clear()
        stream.write(text + "\n")
        stream.flush()
        if self.bar is not None:
            self.bar.refresh()


class _TerminalHandler(logging.Handler):
    """Warnings of this project's loggers, one short line each."""

    def __init__(self, terminal: Terminal):
        super().__init__(level=logging.WARNING)
        self.terminal = terminal
        self.addFilter(lambda record: record.name.split(".")[0] in OWN_LOGGERS)
        self.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.terminal.warn(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


@contextlib.contextmanager
def run_output(log_dir: str | os.PathLike, log_name: str = "driver") -> Iterator[Terminal]:
    """For the driver's process, while the run lasts: fds 1 and 2 (every library's output, every child
    process started meanwhile) and Python logging at INFO go to `<log_dir>/<log_name>.log`; the returned
    Terminal writes to the real terminal, with this project's warnings. All is restored on exit; an
    exception is logged to the file and propagates (Python prints it on the restored terminal)."""
    path = Path(log_dir) / f"{log_name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = {1: os.dup(1), 2: os.dup(2)}        # (_point_fds_at flushes Python's buffers before the switch)
    terminal = Terminal(os.fdopen(os.dup(saved[1]), "w", buffering=1),
                        os.fdopen(os.dup(saved[2]), "w", buffering=1))
    root = logging.getLogger()
    saved_logging = (root.level, list(root.handlers))
    _point_fds_at(path)
    saved_streams = _python_streams_on_fds()
    file_handler = logging.StreamHandler(sys.stderr)      # fd 2: the log file
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.handlers = [file_handler, _TerminalHandler(terminal)]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    try:
        yield terminal
    except BaseException:
        # INFO: into the log file only; Python prints the traceback on the terminal once restored.
        logging.getLogger("gigpo").info("run ended by an exception", exc_info=True)
        if terminal.bar is not None:      # a progress bar left half-way: what follows starts on its own line
            with contextlib.suppress(Exception):
                terminal.bar.close()
            terminal.bar = None
        raise
    finally:
        logging.captureWarnings(False)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        root.setLevel(saved_logging[0])
        root.handlers = saved_logging[1]
        # Ours are not closed: a library handler made meanwhile may still hold one, and after the restore
        # below it writes to the real fds 1 and 2 again.
        sys.stdout, sys.stderr = saved_streams
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        for stream in (terminal.out, terminal.err):
            with contextlib.suppress(Exception):
                stream.close()
