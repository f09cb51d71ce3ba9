"""Models of a real shape with random weights, for tests and benches that need the shape but not the weights:
built from the config's fields, nothing downloaded (bench/bench_gpu.py keeps its own table of shapes)."""
from __future__ import annotations

import torch

# SmolLM2-135M-Instruct's config.json (the fields that set its shape and arithmetic).
SMOLLM2_135M = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                    tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=1e5, rms_norm_eps=1e-5)


def random_causal_lm(fields: dict, *, seed: int, dtype: torch.dtype = torch.float32):
    """A transformers causal LM of the shape `fields` describes (model_type and config fields), randomly
    initialised from `seed`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
