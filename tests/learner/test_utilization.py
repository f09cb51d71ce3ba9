"""learner/utilization.py: the model FLOPs a step is credited with, checked against torch's own FLOP counter
on the tiny model, and the matmul peak they are compared with."""
import numpy as np
import pytest
import torch

from learner.trainer import train_only_last_layers
from learner.utilization import ModelShape, matmul_peak


@pytest.mark.parametrize("trainable_layers", [0, 1])
def test_model_flops_are_what_torch_counts_less_the_masked_half_of_attention(tiny_model_path, trainable_layers):
    """One row of L tokens, the head on R positions, forward and backward, counted by
    torch.utils.flop_counter. Eager attention multiplies the whole L x L score matrix, masked half
    included; utilization.py credits only the causal part (the useful work), so the counter exceeds it by
    2 * d * L * (L - 1) per layer per forward-equivalent pass (1 forward + 2 for each trainable layer).
    Nothing else differs: the counts are integers far below 2**53, so the float64 sums are exact."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="eager")
    train_only_last_layers(model, trainable_layers)
    shape = ModelShape.of(model)
    L, R = 48, 13
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=torch.randint(1, 100, (1, L)), logits_to_keep=R, use_cache=False).logits
        logits.logsumexp(-1).sum().backward()
    passes = shape.layers + 2 * shape.trainable_layers
    masked_half = passes * 2 * shape.hidden * L * (L - 1)
    ours = shape.train_flops(np.array([L]), np.array([R]))
    assert ours + masked_half == counter.get_total_flops()
    assert shape.trainable_layers == (shape.layers if trainable_layers == 0 else trainable_layers)
    assert shape.head_trains == (trainable_layers == 0)


def test_the_matmul_peak_is_measured_once_per_dtype_and_thread_count():
    peak = matmul_peak(torch.float32, "cpu", torch.get_num_threads(), size=256, seconds=0.05)
    # A 2-core AVX2 machine does ~1e11 FLOP/s in fp32; a figure far off says the timing is wrong.
    assert 1e8 < peak < 1e14
    assert matmul_peak(torch.float32, "cpu", torch.get_num_threads(), size=256, seconds=0.05) == peak    # cached
