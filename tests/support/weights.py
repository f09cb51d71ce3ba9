"""Models for the weight-push tests: the tiny policy as transformers loads it, and a perturbed copy."""
from __future__ import annotations

import torch


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def perturbed(model, seed: int):
    """`model` with every parameter moved by 0.05 x N(0, 1), in place (named_parameters: tied weights once)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model
