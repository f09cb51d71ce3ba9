"""Seeds derived from names, the same in every process: the one seed hash (Python's `hash()` is salted per
process, so it cannot be used). A rollout's sampling seeds and a generated game's draws come from here.

    stable_seed(run_seed, actor_id)                  # 31 bits: fits every RNG's seed argument
    stable_seed("train", index, separator="/", bits=64)

The separator and the width are arguments because the seeds already drawn depend on them: changing either
would change which games a study plays and what its rollouts sample (the recorded runs could not be replayed).
"""
from __future__ import annotations

import hashlib


def stable_seed(*parts, separator: str = "\x1f", bits: int = 31) -> int:
    """A `bits`-bit seed from `parts` (their str() joined by `separator`): the low bits of the first
    ceil(bits / 8) bytes of their SHA-256, read little-endian."""
    digest = hashlib.sha256(separator.join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:(bits + 7) // 8], "little") & ((1 << bits) - 1)
