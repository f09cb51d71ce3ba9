"""The tiny Qwen2 policy the tests and benches share: built once into the git-ignored `.cache`, then reused."""
from __future__ import annotations

from pathlib import Path

TINY_POLICY_DIR = Path(__file__).resolve().parents[2] / ".cache" / "test-tiny-policy"


def tiny_policy() -> str:
    """The shared tiny policy's folder (built on first use; build_tiny_model is idempotent)."""
    from deploy.tiny_model import build_tiny_model

    return build_tiny_model(str(TINY_POLICY_DIR))
