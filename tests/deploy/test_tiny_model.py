"""The tiny local policy: offline build, transformers round trip, idempotent reuse, clear errors."""
import json
import os

import pytest
import torch

from deploy.tiny_model import IM_END, TAG_TOKENS, build_tiny_model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    return build_tiny_model(str(out), corpus=["You arrive at fridge 1. The fridge 1 is closed."], vocab_size=512)


def test_loads_with_transformers(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.config.model_type == "qwen2" and model.config.head_dim == 64
    assert model.config.vocab_size == len(tok) <= 512
    assert tok.eos_token == IM_END and model.config.eos_token_id == tok.eos_token_id
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    for tag in TAG_TOKENS:
        assert len(tok.encode(tag, add_special_tokens=False)) == 1
    ids = torch.tensor([tok.encode("You arrive at fridge 1.", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    # the random policy is not flat: greedy decoding has real margins
    top2 = logits[0, -1].topk(2).values
    assert (top2[0] - top2[1]).item() > 1e-3


def test_idempotent_and_rebuilt_on_new_params(built):
    weights = os.path.join(built, "model.safetensors")
    mtime = os.path.getmtime(weights)
    assert build_tiny_model(built, corpus=["You arrive at fridge 1. The fridge 1 is closed."],
                            vocab_size=512) == built
    assert os.path.getmtime(weights) == mtime                       # reused, not rebuilt
    build_tiny_model(built, corpus=["You arrive at fridge 1. The fridge 1 is closed."], vocab_size=512, seed=1)
    assert json.load(open(os.path.join(built, "tiny_build.json")))["seed"] == 1   # different params: rebuilt
    assert not [p for p in os.listdir(os.path.dirname(built)) if p.startswith(".model.")]   # no tmp left


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    a = load_file(os.path.join(build_tiny_model(str(tmp_path / "a"), vocab_size=400), "model.safetensors"))
    b = load_file(os.path.join(build_tiny_model(str(tmp_path / "b"), vocab_size=400), "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_shape_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="head_dim 64"):
        build_tiny_model(str(tmp_path / "m"), hidden_size=96, num_heads=2)
