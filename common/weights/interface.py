"""The weight boundary, as an interface, with a tiny in-memory implementation.

    learner --WeightPublisher.push(weights, version)--> [transfer] --> vLLM inference actors
            (or .push_adapter(lora_adapters, version) under learner.lora_push=adapter)

The real one is `common.weights.sender.WeightTransfer` (shm / collective / ipc); `InMemoryWeights` only works
inside one process (unit tests).
"""
from __future__ import annotations

from typing import Iterable, Protocol


class WeightPublisher(Protocol):
    def push(self, named_tensors: Iterable, version: int) -> dict:
        """Send the weights as policy `version` to every inference actor; returns timings and sizes."""

    def needs_push(self, version: int) -> bool:
        """Whether some inference actor lacks `version` (a restarted one): the learner pushes again."""

    def push_adapter(self, adapter: dict, version: int, base_weights: Iterable | None = None) -> dict:
        """Send LoRA adapters alone as policy `version` (learner.lora_push=adapter), with the base model's
        weights first to an actor that lacks them; returns timings and sizes."""

    def needs_base(self) -> bool:
        """Whether some inference actor lacks the base model's weights (with push_adapter)."""

    def set_actors(self, inference_actors: list) -> None:
        """Push to these inference actors from now on (`gigpo scale --inference` added or removed some)."""

    def close(self) -> None: ...


class InMemoryWeights:
    """The weight boundary in one process: every push is kept (version, {name: a copy of the tensor});
    `latest()` is what an inference actor would serve."""

    def __init__(self):
        self.pushes: list[tuple[int, dict]] = []

    def push(self, named_tensors: Iterable, version: int) -> dict:
        self.pushes.append((int(version), {name: t.detach().clone() for name, t in named_tensors}))
        return {"transfer": "memory"}

    def needs_base(self) -> bool:
        return False

    def push_adapter(self, adapter: dict, version: int, base_weights: Iterable | None = None) -> dict:
        self.pushes.append((int(version), {"adapter": adapter}))
        return {"transfer": "memory"}

    def needs_push(self, version: int) -> bool:
        return not self.pushes or self.pushes[-1][0] != int(version)

    def set_actors(self, inference_actors: list) -> None:
        pass        # one process: no actors to address

    def latest(self) -> tuple[int, dict] | None:
        return self.pushes[-1] if self.pushes else None

    def close(self) -> None:
        pass
