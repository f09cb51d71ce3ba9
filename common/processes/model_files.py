"""The policy's files on every node, with no shared filesystem.

    source = ModelSource.ship(model_path, max_mb=cfg.model.ship_max_mb)   # driver: once per run
    ...                                                                    # pass `source` to the actors
    path = source.local_path()                    # in an actor, on any node: a directory it can load
    path = source.local_path(weights=False)       # config + tokenizer only (vLLM's dummy load)

The driver's model directory (`tiny`, a warm start, a checkpoint) is one other nodes do not see: one of at
most `model.ship_max_mb` goes into Ray's object store once, and an actor on a node that lacks the path writes
it to `<tmp>/gigpo-models/<content hash>`, shared by that node's actors. A hub name is passed on as it is. A
larger local model must be on a filesystem every node sees; where not, `local_path` names the node and path.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.processes.placement import node_for_messages as node_name    # (actors.inference imports it from here)

# Files that hold weights: left out with weights=False (the inference side then loads dummy weights and
# waits for the learner's first push).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CACHE_DIR_NAME = "gigpo-models"


@dataclass
class ModelSource:
    """Where the policy comes from, as every actor receives it.

    path: the model as the driver named it: a local directory (on the driver's node) or a hub name.
    files: an ObjectRef to {relative name: bytes} of the whole directory, when it was shipped.
    digest: content hash of the shipped files (names the cache directory on other nodes).
    """

    path: str
    files: object = None
    digest: str = ""

    @classmethod
    def ship(cls, path: str, max_mb: float) -> "ModelSource":
        """Driver side. A local directory of at most `max_mb` goes into Ray's object store; a hub name or a
        larger directory is passed on by name."""
        local = Path(path)
        if max_mb <= 0 or not local.is_dir():
            return cls(path=path)
        size = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        if size > max_mb * 1024 * 1024:
            return cls(path=str(local.resolve()))
        import ray
        files = {str(p.relative_to(local)): p.read_bytes() for p in sorted(local.rglob("*")) if p.is_file()}
        digest = hashlib.sha256()
        for name, data in files.items():
            digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        return cls(path=str(local.resolve()), files=ray.put(files), digest=digest.hexdigest()[:16])

    def is_local_dir(self) -> bool:
        """The path is a directory on this node."""
        return Path(self.path).is_dir()

    def local_path(self, weights: bool = True) -> str:
        """A loadable path on this node: the path itself where this node sees it (or a hub name); else the
        shipped files, written once into this node's cache (without the weight files when weights=False).
        Raises FileNotFoundError naming this node and the path when neither is possible."""
        if self.is_local_dir() or (self.files is None and not _looks_like_local_path(self.path)):
            return self.path
        if self.files is None:
            raise FileNotFoundError(
                f"model path {self.path} not found on node {node_name()}, and it was not shipped (larger than "
                "model.ship_max_mb): put it on a filesystem every node mounts at that path, or use a hub name")
        import ray
        target = Path(tempfile.gettempdir()) / CACHE_DIR_NAME / (self.digest + ("" if weights else "-config"))
        if (target / ".complete").is_file():
            return str(target)
        files = ray.get(self.files)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            for name, data in files.items():
                if not weights and name.endswith(WEIGHT_SUFFIXES):
                    continue
                out = staging / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
            (staging / ".complete").write_text(self.path)
            try:
                os.rename(staging, target)      # atomic; another actor of this node may have won the race
            except OSError:
                if not (target / ".complete").is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return str(target)


def _looks_like_local_path(path: str) -> bool:
    """A hub name is "org/name" or "name"; a local path is absolute, relative with ./ or ../, or exists."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or os.path.exists(path)
