"""Moving the learner's weights into the inference actors: one interface, three ways, chosen by config.

    transfer = create_weight_transfer(cfg, inference_actors)    # learner rank 0; cfg.inference.weight_transfer
    timings = transfer.push(trainer.named_weights(), version=7)  # {"transfer": "shm", "total_s", "bytes", "gbps", ...}
    timings = transfer.push_adapter(adapter, version=7, base_weights=...)  # LoRA adapters alone (learner.lora_push)
    if transfer.needs_push(version): ...                        # an actor without the current weights
    transfer.close()

This is the sending half; the receiving half, inside each inference actor, is common/weights/receiver.py.

The ways (`inference.weight_transfer`):
- "shm" (`ShmTransfer`): the tensors are packed into a few large safetensors "buckets" (at most
  inference.weight_bucket_mb each: a sync costs per call, not per byte) in a shared-memory directory, and each
  actor loads them all in ONE in-place reload. `manifest.json` ({"version", "files"}) is written atomically
  before the actors are told, so an actor that Ray restarts comes back with the newest weights. One node only
  (/dev/shm is per node), unless inference.weights_dir is a filesystem every node mounts.
- "collective" (`EngineTransfer`): a process group between learner rank 0 and every vLLM worker, through
  vLLM's pluggable weight-transfer engines: "gloo" on CPU (common/weights/gloo.py, a vLLM plugin) or
  vLLM's own "nccl" on GPU (same client and deadlines; untested on CPU-only machines). Rank 0 broadcasts
  packed buffers that the workers load with vLLM's layer-wise reload. Any nodes; nothing touches disk.
- "ipc" (`EngineTransfer`, vLLM's "ipc" backend): CUDA IPC handles, when learner rank 0 and the vLLM workers
  share one GPU (the actors must be created with inference.weight_transfer=ipc). Needs CUDA; untested here.
- "auto": shm when learner rank 0 and every inference actor share one Ray node, else collective; logged with
  its reason, named in every push's timings ("transfer"), and made again when an actor comes back elsewhere.

LoRA (learner.lora_push=adapter): `push_adapter` sends the adapters alone through Ray's object store to every
actor, whatever the way; the way above carries only the base model's weights, once, to an engine started with
dummy weights (`needs_base`).

Deadlines: every call to an actor (inference.transfer_timeout_s, per push), and the gloo group's rendezvous
and broadcasts, time out, so a peer that never joins or dies half-way gives an error naming it, not a hang.

Restarts and scaling: a restarted actor has lost its place in the group; the next push notices
(`transfer_state()["group"]`), rebuilds the group on a fresh port with every actor, and pushes. A push that
fails because an actor died is tried once more after it is back. An actor without the current weights
(restarted, or added through `set_actors` by `gigpo scale --inference`) keeps its request gate closed
(common/weights/receiver.py, the receiving half) until `needs_push` has the learner push its version
(`Learner.repush_if_needed`).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from common.atomic_write import write_atomically
from common.config import ExperimentConfig, InferenceConfig, choices
from common.processes.placement import free_port, node_label

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MODES = choices(InferenceConfig, "weight_transfer")      # the ways above


# -- shm: the bucket format ----------------------------------------------------------------------------------

def default_weights_dir(tag: str) -> str:
    """Where buckets live: /dev/shm (RAM-backed, shared by all processes on the node) if present."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"gigpo-weights-{tag}")


def read_manifest(weights_dir: str) -> dict | None:
    """The newest published {"version": int, "files": [paths]} in `weights_dir`, or None."""
    path = Path(weights_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    if not isinstance(data, dict) or "version" not in data or "files" not in data:
        raise ValueError(f"{path}: malformed weight manifest {data!r}")
    return data


def write_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str, bucket_bytes: int) -> list[str]:
    """Pack tensors, in order, into safetensors files of at most `bucket_bytes` (a single larger tensor
    gets a file of its own). Tensors are made contiguous CPU copies; shared storage (tied weights) is
    broken up because safetensors refuses aliased tensors."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    files: list[str] = []
    bucket: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            path = os.path.join(out_dir, f"bucket_{len(files):04d}.safetensors")
            save_file(bucket, path)
            files.append(path)
        bucket, size = {}, 0

    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"weight {name!r} appears twice")
        seen.add(name)
        t = tensor.detach().to("cpu").contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
        bucket[name] = t
        size += nbytes
    flush()
    if not files:
        raise ValueError("no weights to publish")
    return files


def load_buckets_into_worker(worker, files: list[str]) -> None:
    """Runs inside a vLLM worker process (via collective_rpc): reload all weights in place, in one pass
    over the bucket files (vLLM's layer-wise reload wants every weight of the model in one call)."""
    from safetensors.torch import load_file

    # vLLM 0.32's layer-wise reload logs "RotaryEmbedding: Failed to load weights" on every call (the
    # collective path too): the rotary layer's only tensor is a cache derived from the config, in no
    # checkpoint, and it puts that back, which is right. The warning lands in the actor's log file.
    tensors = (item for path in files for item in load_file(path).items())
    worker.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)




# -- tied weights ---------------------------------------------------------------------------------------------

def tied_aliases(hf_config) -> dict[str, str]:
    """{alias: source} of the checkpoint names that a model with tied embeddings shares (the causal-LM
    families served here, Qwen2 and Llama, name them so)."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return {"lm_head.weight": "model.embed_tokens.weight"} if getattr(text_config, "tie_word_embeddings",
                                                                       False) else {}


def with_aliases(named_tensors: Iterable, aliases: dict[str, str]) -> list:
    """The pairs, with each missing alias added right after its source (the same tensor, no copy).

    Why: `named_parameters()` yields a tied weight once, as the embedding; vLLM 0.32's layer-wise reload then
    skips the tied lm_head layer's post-load processing, which on CPU keeps a packed copy of the head, so the
    engine went on with the old head (measured: log-probs off by ~1 nat after one perturbed push). Costs the
    embedding's bytes once more per push."""
    pairs = list(named_tensors)
    names = {name for name, _ in pairs}
    wanted = {source: alias for alias, source in aliases.items() if alias not in names}
    out = []
    for name, tensor in pairs:
        out.append((name, tensor))
        if name in wanted:
            out.append((wanted[name], tensor))
    return out


# -- calls to the inference actors, with deadlines ------------------------------------------------------------

class ActorLost(RuntimeError):
    """An inference actor died during a call (Ray restarts it; a later push reaches the new one)."""


def _label(i: int, state: dict | None) -> str:
    if not state:
        return f"inference actor {i}"
    return f"inference actor {i} (pid {state.get('pid', '?')} on {node_label(state.get('node'))})"


def call_actors(actors: list, method: str, args_of, deadline: float, what: str,
                states: list[dict] | None = None) -> list:
    """Call `method` on every actor (args_of(i) -> its positional args) and wait for all until `deadline`
    (time.monotonic()). Raises ActorLost, TimeoutError or RuntimeError naming the actors concerned."""
    from common.processes.actor_calls import wait_all

    refs = [getattr(actor, method).remote(*args_of(i)) for i, actor in enumerate(actors)]
    answers = wait_all(refs, deadline - time.monotonic())

    def label(i: int) -> str:
        return _label(i, states and states[i])

    if answers.lost:
        raise ActorLost("; ".join(f"{label(i)} died during {what}: {str(e)[:300]}" for i, e in answers.lost.items()))
    if answers.failed:
        # A RayTaskError's text starts with the remote traceback; its cause is the actor's own error.
        raise RuntimeError("; ".join(f"{label(i)} failed to {what}: "
                                     f"{type(getattr(e, 'cause', None) or e).__name__}: "
                                     f"{str(getattr(e, 'cause', None) or e)[:800]}" for i, e in answers.failed.items()))
    if answers.late:
        raise TimeoutError(f"{', '.join(label(i) for i in answers.late)} did not {what} within the deadline "
                           f"(inference.transfer_timeout_s)")
    return list(answers.done.values())


def actor_states(actors: list, timeout_s: float) -> list[dict]:
    """Each actor's `transfer_state()`. An actor that is restarting (Ray brings it back when a node can take
    it) is asked again until `timeout_s` has passed; then the ActorLost naming it is raised."""
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while True:
        try:
            return call_actors(actors, "transfer_state", lambda i: (), deadline, "report its weight state")
        except ActorLost as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s; asking again until it is back (inference.transfer_timeout_s)", exc)
            time.sleep(delay)
            delay = min(2 * delay, 10.0)


# -- shm ----------------------------------------------------------------------------------------------------

class ShmTransfer:
    """Learner side of the shm way (see the module docstring). One per learner (rank 0)."""

    def __init__(self, inference_actors: list, bucket_mb: float = InferenceConfig.weight_bucket_mb,
                 timeout_s: float = InferenceConfig.transfer_timeout_s):
        import ray

        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.inference_actors = list(inference_actors)
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
        self.timeout_s = timeout_s
        # The actors say where their manifest lives (a restarted actor must find it from its own args).
        dirs = ray.get([a.weights_dir.remote() for a in self.inference_actors],
                       timeout=timeout_s) if self.inference_actors else []
        self.weights_dirs = sorted(set(dirs))

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, states=None) -> dict:
        """Publish `named_tensors` (HF checkpoint names) as policy `version` to every inference actor. Returns
        timings in seconds (write: the buckets, load: the slowest actor's reload, total), bytes and buckets.
        (`states`: the actors' `transfer_state()`, which the collective way needs; unused here.)"""
        t0 = time.perf_counter()
        if not self.weights_dirs:
            raise RuntimeError("ShmTransfer has no inference actors")
        primary = self.weights_dirs[0]
        version_dir = os.path.join(primary, f"v{version:08d}")
        shutil.rmtree(version_dir, ignore_errors=True)       # a half-written earlier try of this version
        files = write_buckets(named_tensors, version_dir, self.bucket_bytes)
        nbytes = sum(os.path.getsize(f) for f in files)
        manifest = {"version": int(version), "files": files}
        for d in self.weights_dirs:            # the manifest first: a restarting actor picks it up
            write_atomically(os.path.join(d, MANIFEST), json.dumps(manifest))
        t_write = time.perf_counter()

        def load(deadline: float) -> None:
            call_actors(self.inference_actors, "update_weights_from_files", lambda i: (files, int(version)),
                        deadline, f"load weight version {version} from {primary}")

        try:
            load(time.monotonic() + self.timeout_s)
        except ActorLost as first:
            # A restarted actor loads the manifest itself; the retry (same files) is skipped there, or loads
            # them if it came back before the manifest was written.
            log.warning("%s; trying again once the actor is back", first)
            load(time.monotonic() + self.timeout_s)
        t_load = time.perf_counter()
        for old in Path(primary).glob("v*"):        # older versions' buckets: the manifest names this one
            if old.is_dir() and old.name != f"v{version:08d}":
                shutil.rmtree(old, ignore_errors=True)
        return {"write_s": t_write - t0, "load_s": t_load - t_write, "total_s": t_load - t0,
                "bytes": nbytes, "buckets": len(files), "version": int(version)}

    def close(self, remove_files: bool = False) -> None:
        if remove_files:
            for d in self.weights_dirs:
                shutil.rmtree(d, ignore_errors=True)


# -- collective and ipc: vLLM's weight-transfer engines --------------------------------------------------------

def _tensor_list_source(pairs: list):
    """A vLLM `WeightSource` over (name, tensor) pairs already in hand (one push's weights)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TensorListSource(WeightSource):
        def metadata(self):
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in pairs]

        def __iter__(self):
            return iter(pairs)

    return TensorListSource()


def _rank_zero_ipc_engine():
    """vLLM's CUDA IPC trainer engine, for a sender that holds the full weights alone: vLLM's all-gathers
    the handles of every trainer rank over torch.distributed's default group, which our learner's other
    ranks never join for a push (rank 0 gathers the full weights first, at every ZeRO stage)."""
    import torch
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

    class RankZeroIPCTrainerWeightTransferEngine(IPCTrainerWeightTransferEngine):
        def _all_gather_and_merge_handles(self, handles):
            return handles

        @staticmethod
        def _post_send_sync() -> None:
            torch.cuda.ipc_collect()

    return RankZeroIPCTrainerWeightTransferEngine


def _run_with_deadline(fn, timeout_s: float, what: str):
    """fn() in a daemon thread, waited for at most timeout_s: a collective without a deadline of its own
    (vLLM's NCCL) must not hang the learner. After a timeout the thread is abandoned with its group."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"weight-transfer: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s (inference.transfer_timeout_s)")
    if "error" in box:
        raise box["error"]
    return box.get("result")


class EngineTransfer:
    """Learner side of the collective ("gloo" on CPU, "nccl" on GPU) and "ipc" ways: vLLM's trainer engine
    for the backend, with this object as its `VLLMWeightSyncClient` (the four methods below it calls fan out
    to every actor with the push's deadline). Unlike vLLM's RayVLLMWeightSyncClient it gives each actor its
    own place in the group (rank_offset), so several engines share one group, and it names the actor that
    failed. The group is built at the first push and rebuilt (fresh port, every actor) whenever an actor is
    not in it (restarted) or a push failed."""

    def __init__(self, inference_actors: list, backend: str, bucket_mb: float, timeout_s: float):
        """bucket_mb, timeout_s: inference.weight_bucket_mb and transfer_timeout_s."""
        from common.weights import gloo

        if backend not in ("gloo", "nccl", "ipc"):
            raise ValueError(f"unknown weight-transfer backend {backend!r}")
        gloo.register()
        self.actors = list(inference_actors)
        self.backend = backend
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
        self.timeout_s = timeout_s
        self.engine = None
        self.group = ""                 # token of the group being built / in use
        self.states: list[dict] = []    # the actors' states when the group was built
        self.offsets: list[int] = []    # each actor's first rank after the trainer's
        self.version = 0
        self.deadline = 0.0             # of the calls to the actors (time.monotonic())
        self.builds = 0                 # groups built so far (the first, then after restarts and failures)

    @property
    def rebuilds(self) -> int:
        """Groups built after the first (restarted actors, failed pushes)."""
        return max(0, self.builds - 1)

    def _build(self, states: list[dict], source) -> None:
        import ray
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from common.weights.gloo import GlooTrainerInitInfo, PeersMissingError

        self.close_group()
        self.group = uuid.uuid4().hex[:12]      # (a failed build is abandoned: close_group clears it)
        self.states = states
        self.offsets = [sum(s["workers"] for s in states[:i]) for i in range(len(states))]
        world_size = 1 + sum(s["workers"] for s in states)
        address = ray.util.get_node_ip_address()
        if self.backend == "gloo":
            info = GlooTrainerInitInfo(master_address=address, world_size=world_size,
                                       timeout_s=self.timeout_s, buffer_size_bytes=self.bucket_bytes, rank=0)
        elif self.backend == "nccl":
            # Untested here (no GPU): vLLM's own NCCL engines, over the same client.
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
            info = NCCLTrainerInitInfo(master_address=address, master_port=free_port(address),
                                       world_size=world_size, packed=True,
                                       packed_buffer_size_bytes=self.bucket_bytes, rank=0)
        else:
            # Untested here (no GPU): vLLM's CUDA IPC engines; no rendezvous.
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
            info = IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=self.bucket_bytes, rank=0)
        try:
            if self.backend == "ipc":
                self.engine = _rank_zero_ipc_engine().trainer_init(info, client=self, source=source)
            else:
                self.engine = _run_with_deadline(
                    lambda: WeightTransferTrainerFactory.trainer_init(info, client=self, source=source),
                    self.timeout_s + 60, f"the {self.backend} weight-transfer rendezvous")
        except PeersMissingError as exc:
            if isinstance(exc.__cause__, ActorLost):
                raise exc.__cause__ from exc      # it died (Ray restarts it): the push tries again
            # The actors whose workers have the missing group ranks (the trainer is rank 0).
            owners = sorted({i for r in exc.ranks for i, (offset, s) in enumerate(zip(self.offsets, states))
                             if offset < r <= offset + s["workers"]})
            names = ", ".join(_label(i, states[i]) for i in owners) or f"rank(s) {exc.ranks}"
            raise TimeoutError(f"{names} did not join the gloo weight-transfer group of learner rank 0 "
                               f"({address}) within {self.timeout_s:.0f} s: can its "
                               f"node reach the learner's node on TCP? ({exc})") from exc

    def push(self, named_tensors: Iterable, version: int, states: list[dict] | None = None) -> dict:
        """Send `named_tensors` as `version` to every actor; returns timings."""
        t0 = time.perf_counter()
        pairs = list(named_tensors)    # the metadata goes first: at ZeRO-1/2 these are the live parameters
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError("a weight appears twice in the push")
        if not pairs:
            raise ValueError("no weights to publish")
        source = _tensor_list_source(pairs)
        built = False
        for attempt in (1, 2):
            if states is None:
                states = actor_states(self.actors, self.timeout_s)
            try:
                stale = [i for i, s in enumerate(states) if s["group"] != self.group or not self.group]
                if self.engine is None or stale:
                    if self.builds:
                        log.info("%s: not in the weight-transfer group (restarted?): rebuilding it",
                                 ", ".join(_label(i, states[i]) for i in stale))
                    self._build(states, source)
                    self.builds += 1
                    built = True
                t_ready = time.perf_counter()
                self.engine.source = source
                self.version, self.deadline = int(version), time.monotonic() + self.timeout_s
                sent = _run_with_deadline(self.engine.send_weights, self.timeout_s + 60,
                                          f"the {self.backend} push of version {version}") or {}
                break
            except ActorLost as exc:
                self._abandon(version)
                if attempt == 2:
                    raise
                log.warning("%s; rebuilding the group once the actors are back, then pushing again", exc)
                states = None
            except BaseException:
                self._abandon(version)
                raise
        t_end = time.perf_counter()
        nbytes = sent.get("bytes") or sum(t.numel() * t.element_size() for _, t in pairs)
        out = {"total_s": t_end - t0, "send_s": t_end - t_ready, "bytes": nbytes, "version": int(version),
               "backend": self.backend, "group_built": float(built)}
        if "buffers" in sent:
            out["buffers"] = sent["buffers"]
        return out

    # -- vLLM's VLLMWeightSyncClient, for self.engine: each call reaches every actor, by self.deadline

    def _call(self, method: str, args_of, what: str) -> None:
        call_actors(self.actors, method, args_of, self.deadline, what, self.states)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        def args_of(i):
            info = dict(init_info)
            if "rank_offset" in info:
                info["rank_offset"] += self.offsets[i]
            return info, self.group

        self.deadline = time.monotonic() + self.timeout_s + 30     # its own: the gloo join waits timeout_s
        self._call("init_weight_transfer_engine", args_of, "join the weight-transfer group")

    def start_weight_update(self) -> None:
        self._call("start_weight_update", lambda i: (self.version,), f"start the update to version {self.version}")

    def update_weights(self, update_info) -> None:
        self._call("update_weights", lambda i: (update_info,), f"receive weight version {self.version}")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", lambda i: (self.version,), f"finish the update to {self.version}")

    # -- leaving

    def _abandon(self, version: int) -> None:
        """After a failed push: drop the group (a failed collective leaves it unusable) and have every actor
        abandon the update (one that received everything completes it; one holding a half-loaded model
        exits, and Ray restarts it). Best effort: the actors may be gone."""
        self.close_group()
        try:
            call_actors(self.actors, "abort_weight_update", lambda i: (), time.monotonic() + 60,
                        f"abandon the update to version {version}", self.states or None)
        except Exception as exc:  # noqa: BLE001 - reported; the push's own error is what the caller gets
            log.warning("after a failed push: %s", exc)

    def close_group(self) -> None:
        if self.engine is not None:
            try:
                self.engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - a broken group is dropped anyway
                log.warning("closing the weight-transfer group: %s", exc)
        self.engine, self.group = None, ""

    def close(self, remove_files: bool = False) -> None:
        """Leave the group; the actors are told to leave it too (best effort: they may be gone). (remove_files:
        the shm way's; there are none here.)"""
        had_group = self.engine is not None
        self.close_group()
        if had_group:
            try:
                call_actors(self.actors, "shutdown_weight_transfer_engine", lambda i: (),
                            time.monotonic() + min(self.timeout_s, 30), "leave the weight-transfer group")
            except Exception as exc:  # noqa: BLE001 - closing: report, do not fail
                log.warning("inference actors leaving the weight-transfer group: %s", exc)


# -- the interface ------------------------------------------------------------------------------------------

class WeightTransfer:
    """The learner's end of the learner -> inference boundary (see the module docstring): `push`,
    `needs_push`, `close`. `mode` is the way in use ("shm", "collective" or "ipc"), `reason` why."""

    def __init__(self, inference_actors: list, mode: str = InferenceConfig.weight_transfer,
                 bucket_mb: float = InferenceConfig.weight_bucket_mb,
                 timeout_s: float = InferenceConfig.transfer_timeout_s, shared_weights_dir: bool = False):
        if mode not in MODES:
            raise ValueError(f"inference.weight_transfer must be one of {MODES}, got {mode!r}")
        self.requested = mode
        self.bucket_mb = bucket_mb
        self.timeout_s = timeout_s
        self.shared_weights_dir = shared_weights_dir
        self.mode = ""
        self.reason = ""
        self.transport = None
        self.set_actors(inference_actors)

    def _choose(self, states: list[dict]) -> None:
        """Pick the way for the actors' current placement; builds the transport when it changes."""
        from common.processes.placement import this_node

        here = this_node()
        away = [i for i, s in enumerate(states) if s["node"]["node_id"] != here["node_id"]]
        if away:
            where = (f"{_label(away[0], states[away[0]])} is not on learner rank 0's node {node_label(here)}"
                     + (f" (and {len(away) - 1} more)" if len(away) > 1 else ""))
        else:
            where = f"learner rank 0 and the {len(states)} inference actor(s) share node {node_label(here)}"
        backends = sorted({s["backend"] or "none" for s in states})
        if self.requested == "auto":
            mode, reason = ("collective" if away else "shm"), f"auto: {where}"
        else:
            mode, reason = self.requested, f"configured; {where}"
        if mode == "shm" and away and not self.shared_weights_dir:
            raise ValueError(f"inference.weight_transfer=shm, but {where}: /dev/shm is one node's; use "
                             "collective (or auto), or set inference.weights_dir to a filesystem every node mounts")
        if mode == "ipc":
            import torch
            if not torch.cuda.is_available():
                raise ValueError("inference.weight_transfer=ipc needs CUDA (learner rank 0 and the vLLM "
                                 "workers on one GPU), and this learner has no GPU: use collective or shm")
            if backends != ["ipc"]:
                raise ValueError(f"inference.weight_transfer=ipc, but the inference actors run the {backends} "
                                 "weight-transfer backend: create them with inference.weight_transfer=ipc")
        if mode == "collective" and (len(backends) != 1 or backends[0] not in ("gloo", "nccl")):
            raise ValueError(f"collective weight transfer needs every inference actor on one collective backend "
                             f"(gloo on CPU, nccl on GPU), but they run {backends}"
                             + (" (the gloo plugin is not installed: `pip install -e .` registers the "
                                "vllm.general_plugins entry point)" if "none" in backends else ""))
        if mode == self.mode:
            return
        if self.transport is not None:
            log.warning("weight transfer: %s -> %s (%s)", self.mode, mode, reason)
            self.transport.close()
        if mode == "shm":
            self.transport = ShmTransfer(self.actors, self.bucket_mb, timeout_s=self.timeout_s)
        else:
            backend = "ipc" if mode == "ipc" else backends[0]
            self.transport = EngineTransfer(self.actors, backend, self.bucket_mb, self.timeout_s)
        self.mode, self.reason = mode, reason
        log.info("weight transfer: %s%s (%s)", mode,
                 f" ({self.transport.backend})" if mode != "shm" else "", reason)

    def set_actors(self, inference_actors: list) -> None:
        """Push to these inference actors from now on (`gigpo scale --inference` added or removed some): the
        old actors leave the group, the transport is built anew for these (`auto` chooses again), and an
        added actor that lacks the current weights shows in `needs_push`."""
        if not inference_actors:
            raise ValueError("a weight transfer needs inference actors")
        old, self.transport, self.mode = self.transport, None, ""
        self.actors = list(inference_actors)
        if old is not None:
            old.close()
        self._choose(actor_states(self.actors, self.timeout_s))

    def needs_push(self, version: int) -> bool:
        """Whether some inference actor lacks weights or serves another version than `version`."""
        states = actor_states(self.actors, self.timeout_s)
        return any(not s["has_weights"] or s["version"] != int(version) for s in states)

    def needs_base(self) -> bool:
        """Whether some inference actor serving adapters lacks the base model's weights (dummy weights)."""
        return any(s["serves_lora"] and not s["has_base"] for s in actor_states(self.actors, self.timeout_s))

    def push_adapter(self, adapter: dict, version: int, base_weights: Iterable | None = None,
                     retry: bool = True) -> dict:
        """Send LoRA adapters (learner.lora.adapter_weights) as policy `version` to every inference actor,
        through Ray's object store (any node; megabytes). `base_weights`, when given, go first to every actor
        by the configured way (`push`): the learner sends them when `needs_base` (and every one of its ranks
        then gathers them, so they are always sent once given). Without them an actor that lacks the base
        model's weights is an error. Returns timings, bytes ("base_bytes" too when the base went out) and
        "transfer": "adapter"."""
        import ray

        t0 = time.perf_counter()
        states = actor_states(self.actors, self.timeout_s)
        base = {}
        if base_weights is None and any(not s["has_base"] for s in states):
            raise RuntimeError("an inference actor lacks the base model's weights (dummy weights) and this "
                               "adapter push has none to send")
        if base_weights is not None:
            base = self.push(base_weights, version, states)
            log.info("pushed the base model's weights (%.0f MB, %s) to inference actors that started without "
                     "them", base["bytes"] / 1e6, base["transfer"])
        nbytes = sum(t.numel() * t.element_size() for t in adapter["tensors"].values())
        ref = ray.put(adapter)
        deadline = time.monotonic() + self.timeout_s
        try:
            answers = call_actors(self.actors, "update_adapter", lambda i: (ref, int(version)), deadline,
                                  f"load adapter version {version}", states)
        except ActorLost as first:       # back without the adapter: once more (with the base if still unsent)
            if not retry:
                raise
            log.warning("%s; trying again once the actor is back", first)
            return self.push_adapter(adapter, version, None if base else base_weights, retry=False)
        total = time.perf_counter() - t0
        return {"transfer": "adapter", "version": int(version), "bytes": nbytes, "total_s": total,
                "load_s": max((a["load_s"] for a in answers if "load_s" in a), default=0.0),   # (retries: skipped)
                "gbps": nbytes / max(total, 1e-9) / 1e9,
                **({"base_bytes": base["bytes"], "base_s": base["total_s"]} if base else {})}

    def push(self, named_tensors: Iterable, version: int, states: list[dict] | None = None) -> dict:
        """Send the weights as policy `version` to every inference actor. Returns the timings (seconds),
        bytes, GB/s and "transfer" (the way used). `states`: the actors' transfer states when the caller has
        just asked for them (push_adapter), else they are asked here."""
        t0 = time.perf_counter()
        states = states or actor_states(self.actors, self.timeout_s)
        if self.requested == "auto":
            self._choose(states)       # an actor may have come back from a restart on another node
        named_tensors = with_aliases(named_tensors, {k: v for s in states for k, v in s["aliases"].items()})
        info = self.transport.push(named_tensors, version, states)
        total = time.perf_counter() - t0
        return dict(info, transfer=self.mode, total_s=total, gbps=info["bytes"] / max(total, 1e-9) / 1e9)

    def close(self, remove_files: bool = False) -> None:
        if self.transport is not None:
            self.transport.close(remove_files=remove_files)


def create_weight_transfer(cfg: ExperimentConfig, inference_actors: list) -> WeightTransfer:
    """The learner's weight transfer for `cfg.inference`. Call it on learner rank 0 once the inference actors
    are created (it asks them where they run; they answer once their engines are up)."""
    infer = cfg.inference
    return WeightTransfer(inference_actors, mode=infer.weight_transfer, bucket_mb=infer.weight_bucket_mb,
                          timeout_s=infer.transfer_timeout_s, shared_weights_dir=bool(infer.weights_dir))
