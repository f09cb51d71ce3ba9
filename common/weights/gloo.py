"""A "gloo" backend for vLLM's pluggable weight transfer: the CPU twin of vLLM's own "nccl" backend.

vLLM 0.32 moves a trainer's weights into its workers through a `WeightTransferEngine` (one per vLLM worker,
built at model load from the engine's `weight_transfer_config`) and a `TrainerWeightTransferEngine`, both
looked up by backend name in `vllm.distributed.weight_transfer.factory`. It ships "nccl" (GPU) and "ipc"
(one GPU); "gloo" lets a CPU cluster move weights the same way, over TCP, between any nodes:

    trainer (learner rank 0)                        each vLLM worker
    trainer_init: TCPStore at <ip>:<free port> ---- init_transfer_engine: joins as rank_offset + its rank
                  gloo group, rank 0                 (a standalone gloo group, not vLLM's own)
    send_weights: start_weight_update  ------------> layer-wise reload begins (vLLM's, as for nccl)
                  update_weights (RPC, concurrent) -> receive: one broadcast per packed buffer,
                  broadcast packed buffers ========>   unpacked into views, model.load_weights(...)
                  finish_weight_update  -----------> layer-wise reload ends

Tensors travel packed into a few large uint8 buffers (`buffer_size_bytes`, inference.weight_bucket_mb):
per-message overhead, not bytes, dominates small tensors. The trainer tells the workers how many tensors each
buffer holds (`chunk_lengths`), so both sides cut the stream identically. Two buffers are in flight at a time
on both sides (one travels while the next is packed, or loaded).

Deadlines: the group's `timeout_s` (inference.transfer_timeout_s) bounds the rendezvous and every broadcast.
Each worker marks its arrival in the store first, so a failed rendezvous names the ranks that never came
(`PeersMissingError`).

`register()` is a vLLM general plugin (setup.cfg: `vllm.general_plugins`), run in every process vLLM starts
before it builds the worker's engine; idempotent and light (the classes are registered by module path).
"""
from __future__ import annotations

import datetime
import logging
import math
import socket
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine, WeightSource,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from common.processes.rendezvous import tcp_store

log = logging.getLogger(__name__)

BACKEND = "gloo"
_JOINED_KEY = "gigpo/joined/{rank}"     # set by each worker in the store before the group forms


class PeersMissingError(TimeoutError):
    """The rendezvous timed out; `ranks`: the group ranks that never reached it."""

    def __init__(self, ranks: list[int], timeout_s: float, detail: str):
        self.ranks = ranks
        super().__init__(f"weight-transfer rank(s) {ranks} did not join the gloo group within {timeout_s:.0f} s "
                         f"({detail})")


def register() -> None:
    """Register the gloo engines with vLLM's factories (the `vllm.general_plugins` entry point). Idempotent:
    vLLM may call it more than once per process, and the learner calls it too."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, class_name in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                                (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        if BACKEND not in factory._registry:    # noqa: SLF001 - the factory has no "is registered" query
            factory.register_engine(BACKEND, __name__, class_name)


def plugin_installed() -> bool:
    """Whether vLLM's processes will run `register` (the project's entry point is installed and VLLM_PLUGINS,
    if set, allows it). Without it a vLLM engine configured for "gloo" would fail at model load."""
    import os
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith(__name__)}
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None:
        names &= {n.strip() for n in allowed.split(",")}
    return bool(names)


# -- shared by both sides ------------------------------------------------------------------------------------

def _address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent): the interface the gloo group must
    listen on, which a host-name lookup can get wrong (a loopback entry in /etc/hosts, a network namespace)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return ""


def _open_group(store, rank: int, world_size: int, address: str, timeout_s: float):
    """A standalone gloo group over `store` (not torch.distributed's default group, which vLLM's workers
    use themselves); blocks until every rank has connected or `timeout_s` has passed."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()         # noqa: SLF001 - the public constructor takes no device
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname=address) if address
                        else ProcessGroupGloo.create_default_device()]
    return ProcessGroupGloo(store, rank, world_size, options)


def _broadcast(group, tensor: torch.Tensor):
    """Start broadcasting `tensor` from rank 0; returns the work to wait on (its wait has the group's
    timeout)."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_chunks(sizes: list[int], buffer_bytes: int) -> list[int]:
    """How many consecutive tensors (of `sizes` bytes) go into each packed buffer: a buffer is closed before
    the tensor that would take it past `buffer_bytes` (a larger tensor travels alone)."""
    lengths: list[int] = []
    count = size = 0
    for n in sizes:
        if count and size + n > buffer_bytes:
            lengths.append(count)
            count = size = 0
        count += 1
        size += n
    if count:
        lengths.append(count)
    return lengths


# -- worker side (inside each vLLM worker process) -----------------------------------------------------------

@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int          # the group rank of this engine's first worker
    world_size: int
    timeout_s: float          # inference.transfer_timeout_s


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    chunk_lengths: list[int]   # tensors per packed buffer, in order

    def __post_init__(self):
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n or sum(self.chunk_lengths) != n:
            raise ValueError(f"inconsistent gloo update: {n} names, {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes, chunks of {sum(self.chunk_lengths)} tensors")


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives the trainer's broadcasts and loads them with vLLM's layer-wise reload (the same
    lifecycle as vLLM's NCCL engine: start initialises the reload, finish completes it)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    group = None        # (set by init_transfer_engine, dropped by shutdown)
    store = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()        # a re-initialisation (the trainer rebuilt the group): leave the old one first
        parallel = self.parallel_config
        rank = (parallel.data_parallel_index * parallel.world_size + parallel.rank) + init_info.rank_offset
        store = tcp_store(init_info.master_address, init_info.master_port, init_info.world_size,
                          timeout_s=init_info.timeout_s)
        store.set(_JOINED_KEY.format(rank=rank), "1")
        self.group = _open_group(store, rank, init_info.world_size, _address_towards(init_info.master_address),
                                 init_info.timeout_s)
        self.store = store
        log.info("joined the gloo weight-transfer group at %s:%d as rank %d of %d", init_info.master_address,
                 init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only build.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: init_weight_transfer_engine first")
        names, shapes = update_info.names, update_info.shapes
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = [_nbytes(shape, dtype) for shape, dtype in zip(shapes, dtypes)]
        bounds = list(accumulate(update_info.chunk_lengths, initial=0))
        chunks = list(zip(bounds, bounds[1:]))        # [first, end) tensor indices of each packed buffer

        def receive(k: int):
            # A fresh buffer per chunk: the layer-wise reload keeps the unpacked views until each layer is
            # complete (possibly across chunks), so no buffer is ever reused.
            first, end = chunks[k]
            buffer = torch.empty(sum(sizes[first:end]), dtype=torch.uint8)
            return buffer, _broadcast(self.group, buffer)

        with disable_mtp_completeness_check():
            pending = deque(receive(k) for k in range(min(2, len(chunks))))
            for k, (first, end) in enumerate(chunks):
                buffer, work = pending.popleft()
                work.wait()                             # the group's timeout: raises if the trainer stops
                if k + 2 < len(chunks):                 # the next buffer travels while this one loads
                    pending.append(receive(k + 2))
                self.model.load_weights(unpack_tensor(buffer, names[first:end], shapes[first:end],
                                                      dtypes[first:end], sizes[first:end]))

    def shutdown(self) -> None:
        self.group = None       # gloo closes its connections when the group is freed
        self.store = None


# -- trainer side (learner rank 0) ---------------------------------------------------------------------------

@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    master_address: str                # the trainer's address, reachable from every inference node
    world_size: int                    # 1 + the number of vLLM workers
    timeout_s: float                   # inference.transfer_timeout_s
    buffer_size_bytes: int             # inference.weight_bucket_mb, in bytes
    master_port: int = 0               # 0: a free port, chosen by the store
    rank: int = field(default=0, kw_only=True)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: rank 0 hosts the rendezvous store and broadcasts; `client` drives the inference side
    (any `VLLMWeightSyncClient`; its `update_weights` runs concurrently with the broadcasts, as for NCCL).
    Only the sender joins the group: other trainer ranks must not call this engine (the learner gathers
    the full weights on rank 0 before a push)."""

    init_info_cls = GlooTrainerInitInfo
    group = None            # (set by trainer_init, dropped by shutdown)
    store = None

    def __init__(self, *, client, source: WeightSource, timeout_s: float, buffer_size_bytes: int) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.timeout_s = timeout_s
        self.buffer_size_bytes = buffer_size_bytes

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if not init_info.is_sender:
            raise ValueError("the gloo weight transfer runs on trainer rank 0 only")
        if source is None:
            raise ValueError("the gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, timeout_s=init_info.timeout_s,
                     buffer_size_bytes=init_info.buffer_size_bytes)
        # The store listens on master_address alone (common.processes.rendezvous): the group is unauthenticated.
        store = tcp_store(init_info.master_address, init_info.master_port, init_info.world_size,
                          timeout_s=init_info.timeout_s, is_master=True)
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=store.port, rank_offset=1,
            world_size=init_info.world_size, timeout_s=init_info.timeout_s)
        # Both halves block until the group is complete: the workers' join through the client, ours here.
        # Whichever fails first is reported at once (a rejected request need not wait for the timeout).
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gloo-rendezvous")
        try:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            opened = pool.submit(_open_group, store, 0, init_info.world_size, init_info.master_address,
                                 init_info.timeout_s)
            done, _ = wait([joined, opened], timeout=init_info.timeout_s + 30, return_when=FIRST_EXCEPTION)
            failure = next((f.exception() for f in (opened, joined) if f in done and f.exception()), None)
            if failure is None and len(done) < 2:
                failure = TimeoutError(f"gloo rendezvous at {init_info.master_address}:{store.port} did not "
                                       f"finish within {init_info.timeout_s + 30:.0f} s")
            if failure is not None:
                # Those that never came are the cause; the others' errors are only their timeouts.
                missing = [r for r in range(1, init_info.world_size)
                           if not store.check([_JOINED_KEY.format(rank=r)])]
                if missing:
                    raise PeersMissingError(missing, init_info.timeout_s, str(failure)[:300]) from failure
                raise failure
        finally:
            pool.shutdown(wait=False)      # a half that is still blocked ends at its own timeout
        engine.group, engine.store = opened.result(), store
        return engine

    def send_weights(self) -> dict:
        """One update round trip; returns {"bytes", "buffers"}."""
        if self.group is None:
            raise RuntimeError("the gloo weight-transfer group is closed")
        meta = self.source.metadata()
        sizes = [_nbytes(m.shape, m.dtype) for m in meta]
        lengths = plan_chunks(sizes, self.buffer_size_bytes)
        update_info = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta], dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta], chunk_lengths=lengths)
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gloo-update")
        try:
            received = pool.submit(self.client.update_weights, asdict(update_info))
            self._broadcast_all(meta, lengths, received)
            received.result()           # the workers' errors (their loads end after our last send)
        finally:
            # Never wait for the RPC thread here: after a failed broadcast it ends at its own deadline.
            pool.shutdown(wait=False)
        self.client.finish_weight_update()
        return {"bytes": sum(sizes), "buffers": len(lengths)}

    def _broadcast_all(self, meta, lengths: list[int], received) -> None:
        items = iter(self.source)
        in_flight: deque = deque()          # (work, buffer): a buffer must live until its send completed
        index = 0
        for count in lengths:
            flat = []
            for _ in range(count):
                name, tensor = next(items)
                expected = meta[index]
                if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
                    raise ValueError(f"weight {index} is {name!r} {tensor.dtype} {tuple(tensor.shape)}, but the "
                                     f"workers expect {expected.name!r} {expected.dtype} {expected.shape}")
                flat.append(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
                index += 1
            buffer = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            in_flight.append((_broadcast(self.group, buffer), buffer))
            while len(in_flight) >= 2:
                in_flight.popleft()[0].wait()
            if received.done() and received.exception() is not None:
                raise received.exception()      # a worker refused: do not send into a group it left
        while in_flight:
            in_flight.popleft()[0].wait()

    def shutdown(self) -> None:
        self.group = None
        self.store = None

