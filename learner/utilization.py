"""How close to the machine's limit a learner step runs: the model FLOPs a step did (the useful work: real
tokens only, padding left out), and the matrix-product peak of the same dtype measured on the same device in
the same process, so that their ratio is the step's share of what this machine's matmuls reach (not of a
datasheet figure). The learner reports both per update (perf/model_flops_per_s, perf/matmul_peak_share,
perf/padding_share); bench_learner and bench_gpu print them.

FLOPs of a decoder-only transformer, counting multiply-adds as 2 and only the matrix products:
- forward, per layer and row of L tokens: 2 * P * L (the layer's P weights, each used once per token) plus
  causal attention, 2 * 2 * d * L * (L + 1) / 2 (scores and the weighted sum, each query against the keys
  up to it; d = hidden size);
- the head on the R response positions only (logits_to_keep): 2 * d * V * R;
- backward = twice the forward of what gradients flow through: the trainable layers (the frozen ones below
  the lowest trainable layer need none), the head's input gradient (2 * d * V * R) whenever anything trains,
  and its weight gradient (another 2 * d * V * R) when the head trains. With LoRA adapters (learner/lora.py)
  the layers' weights get no gradient: their products once (the inputs' gradients), attention's twice; the
  adapters' own products are counted with the layer's weights, their weight gradients (r / d of it) not.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a model: its layers and their weights, and what trains."""

    layers: int
    hidden: int
    vocab: int
    layer_params: int           # matrix weights of one decoder layer (biases and norms do no products)
    trainable_layers: int       # the last this many layers get gradients
    head_trains: bool
    weights_train: bool = True  # the layers' weights get gradients (False: LoRA, the adapters' only)

    @classmethod
    def of(cls, model) -> "ModelShape":
        """The shape of a Hugging Face causal LM whose parameters' requires_grad are already set."""
        layers = model.get_decoder().layers
        head = model.get_output_embeddings().weight
        trainable = sum(any(p.requires_grad for p in layer.parameters()) for layer in layers)
        weights_train = any(p.requires_grad for layer in layers for name, p in layer.named_parameters()
                            if p.dim() == 2 and ".lora_" not in name)
        return cls(layers=len(layers), hidden=int(model.config.hidden_size), vocab=int(head.shape[0]),
                   layer_params=sum(p.numel() for p in layers[0].parameters() if p.dim() == 2),
                   trainable_layers=trainable,
                   head_trains=bool(head.requires_grad), weights_train=weights_train)

    def _layer_flops(self, lengths: np.ndarray, weights: float = 1.0, attention: float = 1.0) -> float:
        """One layer's forward over rows of `lengths` tokens, its weights once per token and causal attention
        (each part scaled by its factor: the backward's counts)."""
        return (weights * 2.0 * self.layer_params * lengths.sum()
                + attention * 2.0 * self.hidden * (lengths * (lengths + 1)).sum())

    def _head_flops(self, response: np.ndarray) -> float:
        """The head's forward on the response positions."""
        return 2.0 * self.hidden * self.vocab * float(np.sum(response))

    def forward_flops(self, lengths: np.ndarray, response: np.ndarray) -> float:
        """One forward pass over rows of `lengths` tokens, the head on `response` positions of each."""
        return self.layers * self._layer_flops(np.asarray(lengths, dtype=np.float64)) + self._head_flops(response)

    def train_flops(self, lengths: np.ndarray, response: np.ndarray) -> float:
        """Forward and backward of one training pass over these rows (see the module)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        backward = self.trainable_layers * self._layer_flops(lengths, weights=1.0 + self.weights_train,
                                                             attention=2.0)
        if self.trainable_layers or self.head_trains:
            backward += self._head_flops(response) * (1 + int(self.head_trains))
        return self.forward_flops(lengths, response) + backward


@functools.lru_cache(maxsize=None)
def matmul_peak(dtype: torch.dtype, device: str, threads: int, size: int = 0, seconds: float = 0.5) -> float:
    """FLOP/s of a square matrix product of `dtype` on `device` with this process's `threads` torch threads
    (part of the key: the same process may train with another count later), the best of repeated timings
    over about `seconds`. size: the matrices' side (0: 4096 on a GPU, 1024 on a CPU, where a larger one
    costs seconds and gains little)."""
    n = size or (4096 if device.startswith("cuda") else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.matmul(a, b)              # warm-up: the kernel's first call allocates and picks its algorithm
    sync()
    best, spent = float("inf"), 0.0
    while spent < seconds or best == float("inf"):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
    return 2.0 * n ** 3 / best
