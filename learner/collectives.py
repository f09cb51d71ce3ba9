"""What the learner's processes send each other besides gradients: rank 0's decisions and batch, and each
rank's recomputed log-probs, as msgpack and raw arrays, never pickle.

A process group's peers are not authenticated (torch.distributed's TCPStore and gloo's pairs accept any
connection on the cluster's network), so nothing received from one may run code when it is read: torch's
`broadcast_object_list` and `all_gather_object` unpickle what they receive. Episode groups travel in the
stream's own wire format (`common.stream.codec`: every type, dtype and length checked on decode).

    value = broadcast(value)          # None, bool, int, float, str, or lists and dicts of them: rank 0's
    groups = broadcast_groups(groups)  # rank 0's list of EpisodeGroup (or None)
    merged = all_gather_arrays({row: np.ndarray})    # every rank's rows, one dict
"""
from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from common.stream.codec import decode_group, encode_group
from common.stream.records import EpisodeGroup


def _device() -> torch.device:
    """Where the process group's tensors must be: NCCL moves CUDA tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_bytes(payload: bytes | None, src: int = 0) -> bytes:
    """Rank `src`'s `payload` on every rank (the others pass None): its length, then its bytes."""
    device = _device()
    sender = dist.get_rank() == src
    size = torch.tensor([len(payload) if sender else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    if sender:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src)
    return buffer.cpu().numpy().tobytes()


def broadcast(value: Any) -> Any:
    """Rank 0's `value` (msgpack's types: None, bool, int, float, str, bytes, lists and dicts of them)."""
    payload = msgpack.packb(value, use_bin_type=True) if dist.get_rank() == 0 else None
    return msgpack.unpackb(broadcast_bytes(payload), raw=False, strict_map_key=False)


def broadcast_groups(groups: list[EpisodeGroup] | None) -> list[EpisodeGroup] | None:
    """Rank 0's episode groups (or None), in the stream's wire format; a malformed one raises CodecError."""
    payload = None
    if dist.get_rank() == 0:
        encoded = None if groups is None else [{k: bytes(v) for k, v in encode_group(g).items()} for g in groups]
        payload = msgpack.packb(encoded, use_bin_type=True)
    received = msgpack.unpackb(broadcast_bytes(payload), raw=False)
    return None if received is None else [decode_group(parts) for parts in received]


def all_gather_arrays(mine: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Every rank's {row: float32 array}, merged: each rank in turn sends its rows to all (msgpack of raw
    bytes; the received arrays are copies the caller may change)."""
    payload = msgpack.packb({int(k): np.ascontiguousarray(v, dtype=np.float32).tobytes() for k, v in mine.items()},
                            use_bin_type=True)
    merged: dict[int, np.ndarray] = {}
    for src in range(dist.get_world_size()):
        part = msgpack.unpackb(broadcast_bytes(payload if dist.get_rank() == src else None, src=src),
                               raw=False, strict_map_key=False)
        merged.update({int(k): np.frombuffer(v, dtype=np.float32).copy() for k, v in part.items()})
    return merged
