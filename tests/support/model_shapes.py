"""Models of a real shape with random weights, for tests and benches that need the shape but not the weights:
built from the config's fields, nothing downloaded."""
from __future__ import annotations

import torch

# Model shapes by name: the Hugging Face config fields that set a model's shape and arithmetic.
SHAPES = {
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1e6),
    # SmolLM2-135M-Instruct's config.json.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=1e5,
                         rms_norm_eps=1e-5),
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True,
                 max_position_embeddings=4096),
}
SMOLLM2_135M = SHAPES["smollm2-135m"]


def shape_config(fields: dict, **overrides):
    """The transformers config of the shape `fields` describes (model_type and config fields), with `overrides`."""
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields, **overrides)


def meta_causal_lm(fields: dict):
    """A causal LM of the shape `fields` describes on the meta device: its parameters' names and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape_config(fields))


def random_causal_lm(fields: dict, *, seed: int, dtype: torch.dtype = torch.float32):
    """A transformers causal LM of the shape `fields` describes (model_type and config fields), randomly
    initialised from `seed`, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(shape_config(fields), dtype=dtype).eval()


def shaped_weights(fields: dict, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs a learner of shape `fields` pushes (named_parameters: a tied weight once), as
    constant-filled tensors of `dtype`: the bytes of the shape without building the model (what moves them
    does not look at the values)."""
    return [(name, torch.full(tuple(p.shape), 0.01, dtype=dtype))
            for name, p in meta_causal_lm(fields).named_parameters()]
