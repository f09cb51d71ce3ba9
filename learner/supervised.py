"""Supervised fine-tuning on the learner's own path: the warm start's training loop (deploy/warm_start.py
collects its examples from the environments' walkthroughs and decides when to run it).

    losses = finetune(model, [Example(prompt_ids, response_ids), ...], steps=200, lr=1e-3, batch_size=16,
                      seed=0, micro_batch_tokens=8192)

Rows take the learner's layout (learner.pack_rows: packed, or padded) and its log-prob function, so that a warm
model is trained on exactly the tokens and positions the RL learner will see.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Example:
    """One supervised row: the prompt the rollout would build and the response to learn."""

    prompt_ids: list[int]
    response_ids: list[int]
    repeat: int = 1          # times in the example pool per pass (model.warm_start_free_text_repeat for a
                             # free-text step, model.warm_start_option_repeat for a click on a named value)


def warm_start_lr(step: int, steps: int, lr: float, decay: float) -> float:
    """The learning rate of warm-start step `step` (0-based) of `steps` (model.warm_start_lr_decay): `lr`, and
    over the last round(decay x steps) steps a linear fall, lr x (steps - step) / those steps, whose last step
    still moves (lr / those steps)."""
    cooldown = round(decay * steps)
    return lr if step < steps - cooldown else lr * (steps - step) / cooldown


def finetune(model, examples: list[Example], steps: int, lr: float, batch_size: int, seed: int,
             micro_batch_tokens: int, on_step=None, packed: bool = True, lr_decay: float = 0.0) -> list[float]:
    """`steps` AdamW steps of response-token cross-entropy on batches drawn from `examples` (shuffled whole
    passes, each example `repeat` times); returns each step's loss. on_step: called after each step. Rows go
    through the learner's own path in its layout (learner.pack_rows): pack_by_tokens into passes of at most
    `micro_batch_tokens` tokens, collate_packed (or collate: padded), response_logprobs. Packed, WebShop's 300-
    and 3,500-token pages cost their own lengths: 1.3 s a step against 2.6-3.1 s padded (configs/webshop-
    embedded.yaml's 16-row steps, tiny model, 2 threads, both layouts in one process, 32a9013, 2026-11-29). The
    passes' gradients add up to the token mean. lr_decay: the share of the last steps whose learning rate falls
    (warm_start_lr). The model's attention is put back as it was before it returns."""
    import numpy as np
    import torch

    from learner.batching import collate, collate_packed, pack_by_tokens
    from learner.packing import use_packed_attention
    from learner.trainer import response_logprobs

    rng = random.Random(seed)
    torch.manual_seed(seed)
    trained = [p for p in model.parameters() if p.requires_grad]     # (model.warm_start_trainable_layers)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    attention = model.config._attn_implementation
    if packed:
        use_packed_attention(model)
    model.train()
    order: list[int] = []
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = warm_start_lr(step, steps, lr, lr_decay)
        rows = []
        while len(rows) < batch_size:
            if not order:
                order = [i for i, e in enumerate(examples) for _ in range(e.repeat)]
                rng.shuffle(order)
            rows.append(examples[order.pop()])
        batch = supervised_batch(rows)
        response_tokens = int(batch.response_lengths().sum())
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for part in pack_by_tokens(np.arange(batch.num_rows), batch.row_lengths(), micro_batch_tokens,
                                   packed=packed):
            mb = collate_packed(batch, part) if packed else collate(batch, part)
            # Cross-entropy of the model's own distribution: the logits unscaled (temperature 1).
            logp, _ = response_logprobs(model, mb, temperature=1.0)
            loss = -logp.sum() / response_tokens
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        losses.append(step_loss)
        if on_step is not None:
            on_step()
    model.eval()
    model.set_attn_implementation(attention)    # the saved model names no attention of this process's registry
    return losses


def supervised_batch(rows: list[Example]):
    """The rows as a learner batch (advantages and old log-probs unused: the loss is cross-entropy)."""
    import numpy as np

    from learner.batching import TrainBatch
    return TrainBatch(prompt_ids=[np.asarray(e.prompt_ids, dtype=np.int32) for e in rows],
                      response_ids=[np.asarray(e.response_ids, dtype=np.int32) for e in rows],
                      old_logprobs=[np.zeros(len(e.response_ids), dtype=np.float32) for e in rows],
                      advantages=np.zeros(len(rows)), row_group=[""] * len(rows), group_ids=[],
                      skipped_group_ids=[])
