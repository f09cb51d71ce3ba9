"""The env pool: many environment instances behind batched reset/step calls, hosted by each rollout actor.

Instances live in worker subprocesses (instance i in worker i // `EnvConfig.instances_per_process`): the
TextWorld engine keeps C state in a shared library and is slow Python, so processes give isolation and
parallelism. Workers are forked from a fork server that imported the engine once (milliseconds to start).

A proxy thread per worker sends it one request at a time and waits at most `EnvConfig.step_timeout_s`. A
worker that dies or hangs is restarted; the request that found it so, and the next step of every other
instance it hosted (their episodes died with it), get an `InstanceResult` with `error` and `restarted=True`.
An environment's own errors (unknown task id, step before reset) come back in `error` with
`restarted=False`; nothing in a batch raises.
"""
from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from common.config import EnvConfig
from common.metrics import ActorMetrics
from env_servers.base import EnvReport
from env_servers.registry import data_env


@dataclass
class InstanceResult:
    """The answer for one instance of a batch: a report, or an error (restarted=True when the instance's
    worker crashed or hung and was restarted: the caller ends that trajectory as ENV_ERROR)."""

    instance: int
    report: EnvReport | None
    error: str | None = None
    restarted: bool = False


def _worker_main(conn, env_cfg: EnvConfig, seed: int, data: dict[str, str]) -> None:
    """Serve requests for the instances of one worker until told to close or the pipe closes. data: the data
    directories' variables as the pool's process resolved them (a fork server started earlier has the
    environment of its own start, which its children would otherwise inherit)."""
    os.environ.update(data)
    from env_servers.registry import make_env
    envs: dict[int, object] = {}
    lister = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        op = msg[0]
        if op == "close":
            break
        try:
            if op == "reset":
                _, instance, task_id, task_seed = msg
                if instance not in envs:
                    envs[instance] = make_env(env_cfg, seed=seed * 100003 + instance)
                result = envs[instance].reset(task_id, task_seed)
            elif op == "step":
                _, instance, action = msg
                if instance not in envs:
                    raise RuntimeError(f"instance {instance} was never reset in this worker: reset it first")
                result = envs[instance].step(action)
            elif op == "task_ids":
                lister = lister or next(iter(envs.values()), None) or make_env(env_cfg, seed=seed)
                result = lister.task_ids(msg[1])
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send(("ok", result))
        except Exception as exc:   # an env's own error goes back to its caller; the worker lives on
            conn.send(("err", f"{type(exc).__name__}: {exc}"))
    for env in envs.values():
        with contextlib.suppress(Exception):
            env.close()


class _WorkerLost(Exception):
    """The worker process died or hung."""


class _Worker:
    """A worker subprocess and the proxy thread that talks to it, one request at a time."""

    def __init__(self, ctx, index: int, instances: range, env_cfg: EnvConfig, seed: int, timeout_s: float,
                 metrics: ActorMetrics):
        self.ctx, self.index, self.instances = ctx, index, instances
        self.env_cfg, self.seed, self.timeout_s = env_cfg, seed, timeout_s
        self.metrics = metrics
        self.restarts = 0
        self.lost: set[int] = set()        # instances whose episode died with a previous process
        self._queue: queue.Queue = queue.Queue()
        self._start_process()
        self._thread = threading.Thread(target=self._serve, name=f"env-worker-{index}", daemon=True)
        self._thread.start()

    def _start_process(self) -> None:
        parent, child = self.ctx.Pipe()
        self.process = self.ctx.Process(target=_worker_main, args=(child, self.env_cfg, self.seed,
                                                                    data_env(self.env_cfg)),
                                        name=f"env-worker-{self.index}", daemon=True)
        self.process.start()
        child.close()
        self.conn = parent

    def _kill_and_restart(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
            self.process.join(timeout=5)
        with contextlib.suppress(Exception):
            self.conn.close()
        self.restarts += 1
        self.metrics.inc("env_restarts")
        self.lost.update(self.instances)
        self._start_process()

    def submit(self, msg: tuple) -> Future:
        fut: Future = Future()
        self._queue.put((fut, msg))
        return fut

    def _call(self, msg: tuple):
        """Send one request and wait for its answer; raises _WorkerLost if the process died or hung."""
        try:
            self.conn.send(msg)
            if not self.conn.poll(self.timeout_s):
                raise _WorkerLost(f"env worker {self.index} did not answer {msg[0]} within {self.timeout_s:g}s "
                                  f"(hung); restarted")
            return self.conn.recv()
        except (EOFError, OSError) as exc:   # BrokenPipeError is an OSError
            code = self.process.exitcode
            raise _WorkerLost(f"env worker {self.index} died (exit code {code}; {type(exc).__name__}); "
                              f"restarted") from None

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, msg = item
            if not fut.set_running_or_notify_cancel():
                continue
            op, instance = msg[0], (msg[1] if len(msg) > 1 and isinstance(msg[1], int) else None)
            restarted = False
            if op == "step" and instance in self.lost:
                ok, payload, restarted = False, ("this instance's episode was lost when its env worker restarted "
                                                 "(another instance there crashed or hung); reset it"), True
            else:
                try:
                    status, payload = self._call(msg)
                    ok = status == "ok"
                except _WorkerLost as exc:
                    try:
                        self._kill_and_restart()
                    except Exception as restart_exc:   # keep serving: the next request tries again
                        exc = _WorkerLost(f"{exc}; restart failed: {restart_exc}")
                    ok, payload, restarted = False, str(exc), True
                except Exception as exc:   # e.g. an unpicklable request: this request fails, the worker is fine
                    ok, payload = False, exc if instance is None else f"{type(exc).__name__}: {exc}"
            if not ok:
                self.metrics.inc("env_errors")
            elif op == "reset":
                self.lost.discard(instance)
            if instance is not None:
                fut.set_result(InstanceResult(instance, payload, None, restarted) if ok
                               else InstanceResult(instance, None, payload, restarted))
            elif ok:
                fut.set_result(payload)
            else:
                fut.set_exception(payload if isinstance(payload, Exception) else RuntimeError(payload))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self.timeout_s + 5)
        with contextlib.suppress(Exception):
            self.conn.send(("close",))
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


_CTX_LOCK = threading.Lock()


def _context(env_cfg: EnvConfig):
    """A fork-server context that preloads the engine: workers start by forking a process that has
    already imported it (fork from a threaded process such as a Ray actor is not safe; spawn is slow)."""
    from env_servers.registry import preload_modules
    # Children import env_servers by name: make sure they find this checkout even when the parent found it
    # through the current directory (pytest, `python -m`) rather than PYTHONPATH.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])
    with _CTX_LOCK:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(preload_modules(env_cfg))
        return ctx


class EnvPool:
    """Many env instances, in worker subprocesses; batched reset/step with per-instance results."""

    def __init__(self, env_cfg: EnvConfig, num_instances: int, seed: int = 0, metrics_id: str = ""):
        """metrics_id: the `actor_id` label of this pool's env_errors/env_restarts series (default: the
        pool's process id; a rollout actor's in-process pool passes the actor's id)."""
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self._per = per = max(1, int(env_cfg.instances_per_process))
        self.env_cfg, self.num_instances, self.seed = env_cfg, num_instances, seed
        self.metrics = ActorMetrics("env_server", metrics_id or f"pid{os.getpid()}")
        # Healthy pools export 0 rather than nothing: the dashboard's error panel then shows a flat line.
        self.metrics.zero("env_errors")
        self.metrics.zero("env_restarts")
        ctx = _context(env_cfg)
        self._workers = [
            _Worker(ctx, w, range(w * per, min(num_instances, (w + 1) * per)), env_cfg, seed * 1009 + w,
                    float(env_cfg.step_timeout_s), self.metrics)
            for w in range(math.ceil(num_instances / per))]
        self._task_ids: dict[str, list[str]] = {}
        self._closed = False

    def _worker_of(self, instance: int) -> _Worker:
        if not isinstance(instance, int) or not 0 <= instance < self.num_instances:
            raise IndexError(f"instance {instance!r} out of range 0..{self.num_instances - 1}")
        return self._workers[instance // self._per]

    def _submit(self, msg: tuple) -> Future:
        try:
            return self._worker_of(msg[1]).submit(msg)
        except IndexError as exc:
            fut: Future = Future()
            fut.set_result(InstanceResult(msg[1], None, str(exc)))
            return fut

    # Futures API (used by the Ray actor to await without blocking its event loop).
    def submit_resets(self, requests: list[tuple[int, str, int]]) -> list[Future]:
        self._check_open()
        return [self._submit(("reset", int(i), str(task), int(seed))) for i, task, seed in requests]

    def submit_steps(self, requests: list[tuple[int, str]]) -> list[Future]:
        self._check_open()
        return [self._submit(("step", int(i), str(action))) for i, action in requests]

    # Blocking API.
    def reset_batch(self, requests: list[tuple[int, str, int]]) -> list[InstanceResult]:
        """Reset each (instance, task_id, seed); results in request order."""
        return [f.result() for f in self.submit_resets(requests)]

    def step_batch(self, requests: list[tuple[int, str]]) -> list[InstanceResult]:
        """Step each (instance, action); instances in different workers step in parallel."""
        return [f.result() for f in self.submit_steps(requests)]

    def task_ids(self, split: str) -> list[str]:
        self._check_open()
        if split not in self._task_ids:
            self._task_ids[split] = list(self._workers[0].submit(("task_ids", split)).result())
        return list(self._task_ids[split])

    def worker_pid(self, instance: int) -> int:
        """Process id of the worker hosting `instance` (for operators and fault tests)."""
        return self._worker_of(instance).process.pid

    def stats(self) -> dict:
        return {"instances": self.num_instances, "workers": len(self._workers),
                "restarts": sum(w.restarts for w in self._workers)}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EnvPool is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.close()

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
