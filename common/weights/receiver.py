"""The receiving half of weight sync: what an inference engine does with the learner's pushes. The sending half
is common/weights/sender.py; the gloo backend both halves use is common/weights/gloo.py.

    gate = RequestGate()
    receiver = WeightReceiver(async_llm, gate, metrics, backend=transfer_backend(gpu, infer.weight_transfer),
                              timeout_s=infer.transfer_timeout_s, weights_dir=weights_dir, has_weights=True)
    wait_s = await gate.enter(); ...; gate.leave()          # around every request (actors/inference.py)
    await receiver.update_weights_from_files(files, version=3)

- Updates happen between requests, in place, through the request gate: an update closes it, waits for the
  requests in flight, loads, then reopens it, so every response comes from exactly the policy version it
  reports. Two ways in: `update_weights_from_files` (shm buckets) and vLLM's weight-transfer protocol
  (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update`) over a
  process group. The engine is always created with that protocol's backend (`transfer_backend`: "gloo" on
  CPU, our vLLM plugin; "nccl" on GPU, or "ipc" when inference.weight_transfer=ipc); it costs nothing until
  the learner initialises a group, so the learner can choose the way once it knows placement.
- A load that fails half-way is reported to the caller, then the process exits (Ray restarts the actor) with
  the gate kept closed: vLLM's layer-wise reload leaves the model partly on the meta device and forgets the
  session, and a failed collective leaves the group unusable, so only a fresh process is known to be whole.
  Failures before the model is touched (missing files, a rendezvous timeout, a bad request) are plain errors
  and the engine keeps serving. An update not finished within the transfer timeout + 60 s exits the same way.
- A restarted actor first loads the newest shm manifest in `weights_dir` (`load_pending_manifest`, before it
  serves anything); without one it holds every request at the gate until the learner pushes.
- LoRA (`serves_lora`: the engine started with enable_lora, learner.lora_push=adapter): a push is the adapters
  alone (`update_adapter`, through Ray's object store: megabytes), written to this actor's own folder under
  `weights_dir` and swapped in through the gate as a new LoRARequest that every request from then on carries.
  Whole weights pushed to such an engine are the base model the adapters apply to (an engine started with
  dummy weights gets them once, `has_base`); the gate stays closed after them until the adapter follows.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import time

from common.processes.model_files import node_name
from common.weights import sender

log = logging.getLogger(__name__)

EXIT_DELAY_S = 1.0      # after a failed load: time for the error to reach the caller before the process exits
EXPIRY_MARGIN_S = 60    # an update still open this long past the transfer timeout: the learner is gone


def transfer_backend(gpu: bool, weight_transfer_mode: str) -> str | None:
    """The vLLM weight-transfer backend an engine is created with, for inference.weight_transfer (None: the
    gloo plugin is not installed, so only the shm way is available; the learner says so if another is chosen)."""
    if gpu:
        return "ipc" if weight_transfer_mode == "ipc" else "nccl"
    from common.weights import gloo
    if not gloo.plugin_installed():
        log.warning("vLLM will not load the gloo weight-transfer plugin (the project's vllm.general_plugins "
                    "entry point is not installed, or VLLM_PLUGINS leaves it out): shm weight transfer only")
        return None
    gloo.register()
    return gloo.BACKEND


class RequestGate:
    """Requests pass while the gate is open; an update closes it and waits until none is in flight.
    (asyncio primitives bind to a loop at first use.)"""

    def __init__(self) -> None:
        self._open = asyncio.Event()        # set while requests may start
        self._idle = asyncio.Event()        # set while nothing is in flight
        self._idle.set()
        self.inflight = 0
        self.held = 0                       # requests waiting at the gate

    async def enter(self) -> float:
        """Wait until the gate is open, then count one request in flight; returns the seconds waited. Nothing
        awaits between the two, so an update cannot slip in between."""
        t0 = time.perf_counter()
        if not self._open.is_set():
            self.held += 1
            try:
                while not self._open.is_set():
                    await self._open.wait()
            finally:
                self.held -= 1
        waited = time.perf_counter() - t0
        self.inflight += 1
        self._idle.clear()
        return waited

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    async def drain(self, reopen_if_cancelled: bool) -> float:
        """Close the gate and wait until nothing is in flight (returns the wait in seconds); a wait that is
        cancelled reopens it if `reopen_if_cancelled` (weights are being served)."""
        t0 = time.perf_counter()
        self._open.clear()
        try:
            await self._idle.wait()
        except BaseException:
            if reopen_if_cancelled:
                self._open.set()
            raise
        return time.perf_counter() - t0


class WeightReceiver:
    """Loads the learner's pushes into one vLLM AsyncLLM (`engine`) between the requests `gate` lets through.
    `version` and `has_weights` say what is served; `metrics` gets its policy_version."""

    def __init__(self, engine, gate: RequestGate, metrics, *, backend: str | None, timeout_s: float,
                 weights_dir: str, has_weights: bool, serves_lora: bool = False, has_base: bool = True):
        """has_weights: the engine serves the initial policy (version 0) from the start; else every request
        waits at the gate until a push (or the newest manifest in `weights_dir`) arrives. serves_lora: the
        learner pushes adapters (see the module docstring); has_base: the engine holds the base model's
        weights (not vLLM's dummy ones)."""
        self.engine = engine
        self.gate = gate
        self.metrics = metrics
        self.backend = backend
        self.timeout_s = timeout_s
        self.weights_dir = weights_dir
        self.version = 0
        self.has_weights = has_weights
        self.stats = {"updates": 0, "update_wait_s": 0.0, "update_load_s": 0.0}
        self._pending_manifest = sender.read_manifest(weights_dir)
        self._files: list[str] = []          # the bucket files the current weights came from (shm)
        self._group = ""                     # token of the weight-transfer group this engine is in
        self._update: dict | None = None     # the collective update in progress (start .. finish)
        self._exiting = False                # a load failed half-way: the process exits (_give_up)
        self._update_lock = asyncio.Lock()
        self.serves_lora = serves_lora
        self.has_base = has_base
        self.lora_request = None             # the adapter every request carries (None: the base model alone)
        self._lora_ids = itertools.count(1)  # vLLM caches an adapter by its id: each push gets a new one
        if has_weights:
            gate.open()
            metrics.set("policy_version", self.version)     # served from the start, before any push

    # -- failures ---------------------------------------------------------------------------------------

    def _give_up(self, what: str, exc: BaseException) -> RuntimeError:
        """A load failed after it touched the model: exit, so that Ray restarts this actor with a whole
        model (its callers' requests are retried there). The exit follows a moment later, so that the
        learner gets the returned error, not just a dead actor; until then the gate stays closed."""
        message = (f"{what} failed half-way ({type(exc).__name__}: {str(exc)[:500]}): the model may be partly "
                   f"loaded; inference actor pid {os.getpid()} on {node_name()} exits for a restart")
        log.error(message)
        self._exiting = True
        self.gate.close()
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
        the update's timings. With LoRA they are the base model: the gate stays closed until the adapter
        (`update_adapter`, which also replaces the adapter vLLM still holds)."""
        if self.serves_lora:
            self.has_base = True
            self.has_weights = False
            return {"wait_s": wait, "load_s": load, "version": int(version), "base": True}
        return self._now_serving(version, wait, load)

    def _now_serving(self, version: int, wait: float, load: float) -> dict:
        """The policy of `version` is loaded (weights, or base and adapter): open the gate; returns timings."""
        self.version = int(version)
        self.has_weights = True
        self.metrics.set("policy_version", self.version)
        self.gate.open()
        self.stats["updates"] += 1
        self.stats["update_wait_s"] += wait
        self.stats["update_load_s"] += load
        return {"wait_s": wait, "load_s": load, "version": self.version}

    # -- the shm way ------------------------------------------------------------------------------------

    async def load_pending_manifest(self) -> None:
        """After a (re)start: load the newest published weights before serving anything."""
        if self._pending_manifest is None:
            return
        manifest, self._pending_manifest = self._pending_manifest, None
        # The newest now: a push since the constructor read it may have replaced (and removed) its files.
        manifest = sender.read_manifest(self.weights_dir) or manifest
        if int(manifest["version"]) > self.version or not self.has_weights:
            try:
                await self.update_weights_from_files(manifest["files"], int(manifest["version"]))
            except FileNotFoundError as exc:      # the model untouched: wait for the learner's next push
                log.warning("the weight manifest names missing files (%s): waiting for a push", exc)

    async def update_weights_from_files(self, files: list[str], version: int) -> dict:
        """Reload all weights in place from safetensors buckets; returns timings."""
        self._refuse_if_exiting()
        async with self._update_lock:
            if self.has_weights and int(version) == self.version and list(files) == self._files:
                # A retried push (or the manifest this actor already loaded at restart). A *lower*
                # version is applied: a learner resumed from an older checkpoint rolls the weights back.
                return {"skipped": True, "version": self.version}
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(
                    f"{len(missing)} weight bucket(s) not found on node {node_name()}, e.g. {missing[0]}: the shm "
                    "transfer needs learner rank 0 on this node, or inference.weights_dir on a shared filesystem")
            wait = await self.gate.drain(reopen_if_cancelled=self.has_weights)
            t0 = time.perf_counter()
            with self._exit_on_failure(f"loading weight version {version} from {len(files)} file(s)"):
                await self.engine.collective_rpc(sender.load_buckets_into_worker, args=(list(files),))
                await self.engine.reset_prefix_cache()   # cached KV was computed by the old weights
            self._files = list(files)
            return self._serving(version, wait, time.perf_counter() - t0)

    # -- LoRA: the adapters alone ----------------------------------------------------------------------

    async def update_adapter(self, adapter: dict, version: int) -> dict:
        """Serve the base model with `adapter` ({"config": adapter_config.json's content, "tensors": {peft's
        names: tensors}}, learner.lora.adapter_weights) as policy `version`; returns timings. A failed load
        leaves the model and the adapter in use untouched (vLLM loads an adapter beside the one serving)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        self._refuse_if_exiting()
        if not self.serves_lora:
            raise RuntimeError("an adapter was pushed to an engine started without LoRA (learner.lora_push="
                               "adapter needs the inference actors created from the same config)")
        if not self.has_base:
            raise RuntimeError("an adapter was pushed before the base model's weights (this engine started "
                               "with dummy weights): push the whole weights first")
        async with self._update_lock:
            if self.has_weights and int(version) == self.version and self.lora_request is not None:
                return {"skipped": True, "version": self.version}     # a retried push
            t0 = time.perf_counter()
            folder = os.path.join(self.weights_dir, f"adapter-{os.getpid()}", f"v{int(version):08d}")
            os.makedirs(folder, exist_ok=True)
            save_file(adapter["tensors"], os.path.join(folder, "adapter_model.safetensors"))
            with open(os.path.join(folder, "adapter_config.json"), "w") as f:
                json.dump(adapter["config"], f)
            request = LoRARequest(f"policy-v{int(version)}", next(self._lora_ids), folder)
            t_write = time.perf_counter()
            wait = await self.gate.drain(reopen_if_cancelled=self.has_weights)
            t1 = time.perf_counter()
            try:
                if not await self.engine.add_lora(request):
                    raise RuntimeError(f"vLLM did not load the adapter in {folder}")
            except BaseException:
                if self.has_weights:
                    self.gate.open()            # the adapter in use is untouched: serve it on
                shutil.rmtree(folder, ignore_errors=True)
                raise
            old, self.lora_request = self.lora_request, request
            if old is not None:
                await self.engine.remove_lora(old.lora_int_id)
                if old.lora_path != folder:        # (the same version again after a base push: rewritten)
                    shutil.rmtree(old.lora_path, ignore_errors=True)
            await self.engine.reset_prefix_cache()     # (cached KV was computed under the old adapter)
            return dict(self._now_serving(version, wait, time.perf_counter() - t1), write_s=t_write - t0)

    # -- the collective / ipc way: vLLM's weight-transfer protocol, called by common.weights.sender's client
    # in this order: init (once per group), then start, update_weights (concurrently with the learner's
    # broadcast), finish per push.

    def _require_backend(self) -> None:
        if not self.backend:
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
        if not self._group and self.backend != "ipc":
            raise RuntimeError("start_weight_update before this actor joined a weight-transfer group")
        await self._update_lock.acquire()
        try:
            wait = await self.gate.drain(reopen_if_cancelled=self.has_weights)
        except BaseException:
            self._update_lock.release()
            raise
        self._update = {"version": int(version), "wait_s": wait, "t0": time.perf_counter(), "received": False}
        self._update["watchdog"] = asyncio.get_running_loop().create_task(self._expire(self._update))
        # (A failure here: the reload may have begun moving layers.)
        with self._exit_on_failure(f"starting the update to version {version}"):
            await self.engine.start_weight_update()

    async def _expire(self, update: dict) -> None:
        """An update still open past the transfer timeout (+ a margin): the learner is gone."""
        await asyncio.sleep(self.timeout_s + EXPIRY_MARGIN_S)
        if self._update is update and not self._exiting:      # (logged; nobody waits for this task)
            self._give_up(f"the update to version {update['version']}",
                          TimeoutError(f"not finished {self.timeout_s + EXPIRY_MARGIN_S:.0f} s after its start"))

    async def update_weights(self, update_info) -> None:
        """Receive the weights (vLLM's backend receives them from the learner's broadcast and loads them)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._refuse_if_exiting()
        if self._update is None:
            raise RuntimeError("update_weights without start_weight_update")
        with self._exit_on_failure(f"receiving weight version {self._update['version']}"):   # part may be loaded
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
        # gloo and nccl send a push in one call; ipc in one call per chunk, so one call says nothing there.
        self._update["received"] = self.backend != "ipc"

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
        served); one that did not leaves a partly loaded model, so the process exits for a restart. Returns
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

    # -- what the sender asks ---------------------------------------------------------------------------

    async def transfer_state(self) -> dict:
        """What the learner's weight transfer needs to know, in one call."""
        from common.processes.placement import this_node

        await self.load_pending_manifest()
        config = self.engine.vllm_config
        return {"has_weights": self.has_weights, "version": self.version, "group": self._group,
                "serves_lora": self.serves_lora, "has_base": self.has_base,
                "backend": self.backend, "pid": os.getpid(), "node": this_node(),
                "workers": config.parallel_config.world_size * config.parallel_config.data_parallel_size,
                "aliases": sender.tied_aliases(config.model_config.hf_config),
                "updating": self._update is not None}


class WeightEndpoints:
    """The actor methods learner rank 0's sender (common/weights/sender.py) calls, for a class that holds its
    WeightReceiver as `self.receiver`: the inference actor (actors/inference.py) and the scale bench's stand-in
    (tests/support/scale_standins.py)."""

    receiver: WeightReceiver

    def weights_dir(self) -> str:
        return self.receiver.weights_dir

    async def transfer_state(self) -> dict:
        return await self.receiver.transfer_state()

    async def update_weights_from_files(self, files: list[str], version: int) -> dict:
        return await self.receiver.update_weights_from_files(files, version)

    async def init_weight_transfer_engine(self, init_info: dict, group: str) -> None:
        await self.receiver.init_weight_transfer_engine(init_info, group)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.receiver.shutdown_weight_transfer_engine()

    async def start_weight_update(self, version: int) -> None:
        await self.receiver.start_weight_update(version)

    async def update_weights(self, update_info) -> None:
        await self.receiver.update_weights(update_info)

    async def finish_weight_update(self, version: int) -> dict:
        return await self.receiver.finish_weight_update(version)

    async def update_adapter(self, adapter: dict, version: int) -> dict:
        return await self.receiver.update_adapter(adapter, version)

    async def abort_weight_update(self) -> str:
        return await self.receiver.abort_weight_update()
