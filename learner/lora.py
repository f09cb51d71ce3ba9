"""LoRA adapters for the learner (learner.lora_rank > 0): peft's low-rank adapters on the linear layers named
by learner.lora_target_modules, trained instead of the weights.

    model = with_lora(model, cfg)                  # before DeepSpeed wraps it: only the adapters train
    with reference_policy(engine): ...             # the adapters off: the base model, the KL's reference
    for name, tensor in merged_weights(engine.module, gather): ...   # the base model's names, W + (alpha/r) B A
    adapter = adapter_weights(engine.module, gather)                 # A and B alone: what vLLM serves as a LoRA

What an adapter changes: a target layer computes W x + (alpha / r) B (A x), A of [r, in] (random at start),
B of [out, r] (zero at start, so training starts from the base model exactly). The optimizer holds A and B
only: its state is 2 x 2 x r x (in + out) floats per layer instead of 2 x in x out, and the backward pass
computes the inputs' gradients through every layer but no base weight's gradient.

The reference policy of the KL term is the base model, which the adapters leave untouched: the same module
with its adapters disabled, so no second copy of the weights is kept (at 7B, 14 GB less per learner process).

What a weight push sends (learner.lora_push): "adapter", the adapters alone in peft's format
(`adapter_weights`: megabytes), which vLLM serves as a LoRA on the base model it holds (an engine started with
dummy weights gets the base model once, `merged_weights(..., merge=False)`); or "merged", the merged weights
under the base model's names (`merged_weights`), which the inference engines load as they load a full
fine-tune's.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator

import torch

from common.config import LearnerConfig

ADAPTER = "default"      # peft's name for a model's one adapter


def target_modules(cfg: LearnerConfig) -> list[str]:
    return [name.strip() for name in cfg.lora_target_modules.split(",") if name.strip()]


def with_lora(model, cfg: LearnerConfig):
    """`model` (a transformers causal LM) with LoRA adapters of cfg.lora_rank on cfg.lora_target_modules,
    every other parameter frozen (a peft PeftModel around it)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules(cfg)
    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear)}
    missing = sorted(set(targets) - present)
    if missing:
        raise ValueError(f"learner.lora_target_modules: {type(model).__name__} has no linear layer named "
                         f"{', '.join(missing)} (its linear layers: {', '.join(sorted(present))})")
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets, lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def reference_policy(model) -> ContextManager:
    """A context in which `model` (a PeftModel, or a DeepSpeed engine around one) computes the base model: the
    KL term's reference."""
    module = getattr(model, "module", model)
    return module.disable_adapter()


def _whole(gather: Callable[[list], ContextManager] | None) -> Callable[[list], ContextManager]:
    """`gather`, or (parameters already whole: ZeRO stages 1 and 2) a context that does nothing."""
    return gather or (lambda params: contextlib.nullcontext())


def merged_weights(peft_model, gather: Callable[[list], ContextManager] | None = None, merge: bool = True
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of the model the adapters make, under the plain model's names and in its
    parameter order: an adapted layer's weight merged, W + (alpha / r) B A (computed in float32, returned in
    W's dtype), every other parameter as it is; merge=False: the base model's weights (W), what an engine
    serving the adapter needs under it. `gather(params)`: a context that makes those parameters whole
    (ZeRO-3's GatheredParameters), each then copied before it is released; None: the parameters are whole
    (stages 1 and 2). Every process must iterate to the end (ZeRO-3's gathers are collective)."""
    whole = _whole(gather)
    base = peft_model.get_base_model()
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        # An adapted layer's own weight and bias are its base_layer's: "<layer>.base_layer.weight".
        prefix, _, leaf = name.rpartition(".base_layer.")
        if not prefix or leaf != "weight" or not merge:      # not adapted, an adapted layer's bias, or the base
            with whole([p]):
                yield (f"{prefix}.{leaf}" if prefix else name), (p.detach().clone() if gather else p.detach())
            continue
        layer = base.get_submodule(prefix)           # the peft layer holding the adapter
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        with whole([p, a, b]):
            delta = (b.detach().float() @ a.detach().float()) * layer.scaling[ADAPTER]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            yield f"{prefix}.{leaf}", (p.detach().float() + delta).to(p.dtype)


def adapter_weights(peft_model, gather: Callable[[list], ContextManager] | None = None) -> dict:
    """The adapters as peft saves them, the weight push's "adapter" way: {"config": adapter_config.json's
    content, "tensors": {name: tensor}} with peft's file names (`...q_proj.lora_A.weight`), each tensor a CPU
    copy in the parameters' dtype. `gather`: as for merged_weights (every process must call it at ZeRO-3)."""
    whole = _whole(gather)
    lora = [(name, p) for name, p in peft_model.named_parameters() if ".lora_" in name]
    with whole([p for _, p in lora]):
        tensors = {name.replace(f".{ADAPTER}.", "."): p.detach().to("cpu", copy=True).contiguous()
                   for name, p in lora}
    config = peft_model.peft_config[ADAPTER].to_dict()
    # (json: peft keeps target_modules as a set, the task type as an enum)
    config = {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in config.items()}
    return {"config": config, "tensors": tensors}
