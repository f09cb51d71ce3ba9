"""Moving the learner's weights into the inference actors: the bucket format both sides share.

    publisher = WeightPublisher(inference_actors, bucket_mb=512)
    timings = publisher.push(model.state_dict().items(), version=7)

CPU path (what runs on this machine): the named tensors are packed into a few large safetensors files
("buckets", at most `bucket_mb` each) in a shared-memory directory; every inference actor then loads
all buckets in ONE in-place `reload_weights` call inside its vLLM worker (no restart) and resets its
prefix cache. Few large files because the cost of a sync is dominated by per-call overhead, not bytes.

The directory also holds `manifest.json` ({"version", "files"}), written atomically *before* the actors
are told: an inference actor that Ray restarts mid-run reads it in its constructor and comes back with
the newest weights and version, so nobody ever samples from the initial weights again by accident.

The files must be readable by every inference actor: /dev/shm serves one node; a multi-node CPU cluster
sets `inference.weights_dir` to a shared filesystem.

GPU path: vLLM's native NCCL weight-transfer protocol (trainer rank 0 broadcasts straight into the
inference workers; nothing touches disk or the Ray object store). See `NcclWeightPublisher`; it is not
exercised on CPU-only machines.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

MANIFEST = "manifest.json"


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


def write_buckets(named_tensors: Iterable[tuple[str, "torch.Tensor"]], out_dir: str,
                  bucket_bytes: int) -> list[str]:
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


def load_buckets_into_worker(worker, files: list[str]) -> int:
    """Runs inside a vLLM worker process (via collective_rpc): reload all weights in place, in one pass
    over the bucket files (vLLM's layer-wise reload wants every weight of the model in one call)."""
    from itertools import chain

    from safetensors.torch import load_file

    count = 0

    def tensors():
        nonlocal count
        for path in files:
            for item in load_file(path).items():
                count += 1
                yield item

    # vLLM 0.32's layer-wise reload logs "RotaryEmbedding: Failed to load weights" and "ParallelLMHead:
    # Failed to load weights" on every call. Nothing pushed can prevent it: it expects every layer holding
    # tensors to receive some, but the rotary layer's only tensor is a cache derived from the config (a
    # non-persistent buffer, in no checkpoint), and with tie_word_embeddings lm_head.weight is the
    # embedding itself (AutoWeightsLoader skips that name as an alias). For both it puts the layer's own
    # tensors back, which is right: the cache is unchanged, and the tied head shares the new embedding's
    # storage (tests/test_inference.py checks log-probs after a push). vLLM's main branch binds such layers
    # in place and no longer warns. The warnings land in the inference actor's log file.
    worker.reload_weights(weights_iterator=chain(tensors()), is_checkpoint_format=True)
    return count


class WeightPublisher:
    """Learner side of a weight sync (CPU / shared-file path). One publisher per learner (rank 0)."""

    def __init__(self, inference_actors: list, bucket_mb: float = 512, keep_versions: int = 1):
        import ray

        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.inference_actors = list(inference_actors)
        self.bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
        self.keep_versions = max(1, keep_versions)
        # The actors say where their manifest lives (a restarted actor must find it from its own args).
        dirs = ray.get([a.weights_dir.remote() for a in self.inference_actors]) if self.inference_actors else []
        self.weights_dirs = sorted(set(dirs))

    def push(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int) -> dict:
        """Publish `named_tensors` (HF checkpoint names) as policy `version` to every inference actor.
        Returns timings in seconds: write (buckets to shared memory), load (actors' in-place reload,
        the slowest actor), total; plus bytes and buckets."""
        import ray

        t0 = time.perf_counter()
        if not self.weights_dirs:
            raise RuntimeError("WeightPublisher has no inference actors")
        primary = self.weights_dirs[0]
        version_dir = os.path.join(primary, f"v{version:08d}")
        shutil.rmtree(version_dir, ignore_errors=True)       # a half-written earlier try of this version
        files = write_buckets(named_tensors, version_dir, self.bucket_bytes)
        nbytes = sum(os.path.getsize(f) for f in files)
        manifest = {"version": int(version), "files": files}
        for d in self.weights_dirs:            # the manifest first: a restarting actor picks it up
            _write_json_atomic(os.path.join(d, MANIFEST), manifest)
        t_write = time.perf_counter()

        refs = {i: a.update_weights_from_files.remote(files, int(version))
                for i, a in enumerate(self.inference_actors)}
        failures = []
        for i, ref in refs.items():
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                failures.append((i, e))
        for i, first_error in failures:      # an actor that died: once restarted it loads the manifest
            try:
                ray.get(self.inference_actors[i].update_weights_from_files.remote(files, int(version)),
                        timeout=600)
            except Exception as e:  # noqa: BLE001 - report which actor and why
                raise RuntimeError(f"inference actor {i} failed the weight update to version {version}: "
                                   f"{e} (first error: {first_error})") from e
        t_load = time.perf_counter()
        self._drop_old_versions(primary, version)
        return {"write_s": t_write - t0, "load_s": t_load - t_write, "total_s": t_load - t0,
                "bytes": nbytes, "buckets": len(files), "version": int(version)}

    def _drop_old_versions(self, weights_dir: str, version: int) -> None:
        olds = sorted(p for p in Path(weights_dir).glob("v*") if p.is_dir() and p.name != f"v{version:08d}")
        for p in olds[: max(0, len(olds) - (self.keep_versions - 1))]:
            shutil.rmtree(p, ignore_errors=True)

    def close(self, remove_files: bool = False) -> None:
        if remove_files:
            for d in self.weights_dirs:
                shutil.rmtree(d, ignore_errors=True)


def _write_json_atomic(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".manifest.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


class NcclWeightPublisher:
    """GPU path: vLLM's NCCL weight transfer, driven from learner rank 0. Untested on CPU-only machines.

    The inference actors expose the engine's weight-transfer methods (init_weight_transfer_engine,
    start_weight_update, update_weights, finish_weight_update, update_weight_version), which is the
    surface vLLM's `RayVLLMWeightSyncClient` calls. Only trainer rank 0 joins the NCCL group.
    """

    def __init__(self, inference_actors: list, model, master_address: str, master_port: int,
                 workers_per_actor: int = 1):
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                   NCCLTrainerWeightTransferEngine)

        info = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                   world_size=1 + workers_per_actor * len(inference_actors), rank=0)
        self._engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=RayVLLMWeightSyncClient(list(inference_actors)), source=ModuleSource(model))
        self.inference_actors = list(inference_actors)

    def push(self, named_tensors=None, version: int = 0) -> dict:
        """Broadcast the model's current weights (the source given at construction) as `version`."""
        import ray

        t0 = time.perf_counter()
        self._engine.send_weights()      # start_weight_update, broadcast, finish_weight_update
        ray.get([a.update_weight_version.remote(str(int(version))) for a in self.inference_actors])
        return {"total_s": time.perf_counter() - t0, "version": int(version)}
