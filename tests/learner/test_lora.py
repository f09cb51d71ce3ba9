"""learner/lora.py on the tiny Qwen2 policy, without DeepSpeed: adapters where the config says, the merged
weights the push sends, the reference the adapters leave alone. The trainer with adapters (DeepSpeed, the
loss, checkpoints): tests/learner/test_learner_trainer.py."""
from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, LearnerConfig, load_config
from learner.lora import merged_weights, reference_policy, with_lora


def _adapted(tiny_model_path, rank: int = 4, seed: int = 0, **fields):
    """The tiny policy with adapters whose B is random (at start B is 0 and the adapters change nothing)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)          # A's random start, then B's
    model = with_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                      LearnerConfig(lora_rank=rank, **fields))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def test_adapters_on_the_named_layers_train_alone(tiny_model_path):
    model = _adapted(tiny_model_path, lora_target_modules="q_proj, v_proj")
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="no linear layer named nope"):
        _adapted(tiny_model_path, lora_target_modules="q_proj,nope")


def test_merged_weights_are_the_plain_models_and_compute_what_the_adapters_do(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = _adapted(tiny_model_path)
    merged = dict(merged_weights(model))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    assert list(merged) == [n for n, _ in plain.named_parameters()]        # names and order of the plain model
    # peft's own merge: the same float32 products, so equal up to the rounding of one sum (an ulp of |W|).
    expected = _adapted(tiny_model_path).merge_and_unload().state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=2 * torch.finfo(torch.float32).eps)
    # Loaded into the plain model, they compute the adapted model's logits (float32: W x + s B A x against
    # (W + s B A) x; products of a few hundred terms of size ~1: 1e-4 is ~100 ulps of slack).
    plain.load_state_dict(merged, strict=False)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-4)


def test_the_reference_is_the_base_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = _adapted(tiny_model_path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        with reference_policy(model):
            reference = model(input_ids=ids).logits
        adapted = model(input_ids=ids).logits          # the adapters are back on after the context
        assert torch.equal(reference, base(input_ids=ids).logits)
        assert (adapted - reference).abs().max() > 1e-2


def test_lora_and_trainable_layers_are_refused_together():
    with pytest.raises(ConfigError, match="two ways of choosing what trains"):
        load_config(None, ["learner.lora_rank=8", "learner.trainable_layers=2"])
