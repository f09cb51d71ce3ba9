"""Loading a checkpoint runs no code. DeepSpeed's files are pickles, and DeepSpeed loads them with
`torch.load(weights_only=False)`, which would call whatever a crafted file names (a shared volume, a copied run
directory). The learner loads them with torch's weights-only unpickler instead: tensors, plain containers and
numbers, and the few classes a checkpoint of this learner holds (`checkpoint_classes`, read from the pickles of
checkpoints at ZeRO-2 and -3, fp32 and bf16, with and without LoRA). `check_loadable` runs the same unpickler
over a checkpoint's files before a run starts from one (tensors memory-mapped, not read), after the owner check
(`common.run_dir.check_checkpoint_is_ours`), so that a crafted one is refused in one line, before anything
starts.
"""
from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Iterator

import torch

from common.run_dir import UntrustedCheckpoint, check_checkpoint_is_ours


def checkpoint_classes() -> list:
    """What a checkpoint of this learner pickles besides torch's tensors and plain containers: DeepSpeed's loss
    scaler, ZeRO stage and fragment address, and numpy scalars (an update's metrics in the client state)."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address, np.dtype, np._core.multiarray.scalar,
            type(np.dtype(np.float64)), type(np.dtype(np.float32)), type(np.dtype(np.int64))]


def load_weights_only(path: str | Path, map_location=None, mmap: bool = False):
    """torch.load of a checkpoint file with the weights-only unpickler and `checkpoint_classes`; a file that
    names anything else raises UntrustedCheckpoint saying what (nothing it names is called)."""
    try:
        with torch.serialization.safe_globals(checkpoint_classes()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        # torch's reason, without its advice to allow-list what the file names
        said = (str(exc).split("WeightsUnpickler error:", 1)[-1].strip().splitlines() or ["?"])[0]
        raise UntrustedCheckpoint(
            f"{path} is refused: loading it would call what a checkpoint of this learner never holds "
            f"({said.split('. Please use', 1)[0].rstrip('.')}); a crafted or foreign file, not loaded") from None


@contextlib.contextmanager
def weights_only_loading(checkpoint_engine) -> Iterator[None]:
    """Within the block, DeepSpeed's `checkpoint_engine` (engine.checkpoint_engine, through which it loads every
    file of a checkpoint) loads with `load_weights_only`."""
    checkpoint_engine.load = lambda path, map_location=None: load_weights_only(path, map_location)
    try:
        yield
    finally:
        del checkpoint_engine.load          # the class's own again


def check_loadable(tag_dir: str | Path) -> None:
    """Raise UntrustedCheckpoint unless this user alone could have written checkpoint `tag_dir`
    (`check_checkpoint_is_ours`) and each of its files loads with `load_weights_only` (not so: it names what the
    learner never pickles, or it is no torch file at all, damaged or foreign)."""
    check_checkpoint_is_ours(tag_dir)
    for path in sorted(Path(tag_dir).rglob("*.pt")):
        try:
            load_weights_only(path, map_location="cpu", mmap=True)
        except UntrustedCheckpoint:
            raise
        except Exception as exc:          # torch's errors for what is not one of its files vary
            raise UntrustedCheckpoint(f"{path} cannot be read as a checkpoint file ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}); not loaded") from None
