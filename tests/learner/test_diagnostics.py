"""The learner trains on what was sampled, and says how its advantages differ from GRPO's.

- diagnostics of every batch (learner/batching.py build_batch): cosine and sign agreement with GRPO's
  advantages, all-success groups, length of successful episodes;
- trajectories ended by an environment error are left out (with their group when one trajectory is left),
  not trained as failures;
- tokens forced by the action grammar (behaviour log-prob 0) are left out of the loss;
- the learner's log-probs are those of the sampling distribution softmax(logits / T) (real DeepSpeed on
  CPU and the tiny policy, against plain transformers).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import ExperimentConfig, LearnerConfig
from common.stream.records import EpisodeGroup, Termination, Trajectory
from learner.batching import build_batch, collate, plan_micro_batches
from learner.gigpo import LossSettings, grpo_advantages, policy_loss
from tests.support.synthetic import synthetic_groups
from tests.support.synthetic import keep_trajectories, last_rows, step_rows, steps_of
from learner.trainer import PolicyTrainer


# What these tests leave at the config's defaults, passed explicitly: build_batch's invalid-action penalty,
# PolicyTrainer's settings from outside learner.* (dtype: each test's own).
DEFAULTS = ExperimentConfig()
PENALTY = DEFAULTS.rollout.invalid_action_penalty
TRAINER = {"head_dtype": DEFAULTS.model.head_dtype, "temperature": DEFAULTS.rollout.temperature,
           "seed": DEFAULTS.run.seed}


def _grpo_of(groups, penalty=PENALTY) -> np.ndarray:
    rows = step_rows(groups)
    return grpo_advantages([r[0] for r in rows], [r[1] for r in rows], np.array([r[2].step for r in rows]),
                           [r[2].reward for r in rows], penalties=[0.0 if r[2].valid else penalty for r in rows])


def _make_all_succeed(group) -> None:
    group.rows["reward"][:] = 0.0
    group.rows["reward"][last_rows(group)] = 10.0
    for t in group.trajectories:
        t.success, t.episode_return = True, 10.0


# ----------------------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------------------

def test_diagnostics_compare_the_advantages_with_grpo():
    groups = synthetic_groups(4, 4, seed=21, max_steps=6)
    _make_all_succeed(groups[0])
    grpo = _grpo_of(groups)
    for algorithm in ("gigpo", "rloo"):
        b = build_batch(groups, LearnerConfig(algorithm=algorithm), invalid_action_penalty=PENALTY)
        a = b.advantages
        assert b.metrics["diag/adv_cosine_vs_grpo"] == pytest.approx(
            a @ grpo / (np.linalg.norm(a) * np.linalg.norm(grpo)), rel=1e-12)
        assert b.metrics["diag/adv_sign_differs_share"] == np.mean(np.sign(a) != np.sign(grpo))
    gigpo = build_batch(groups, LearnerConfig(algorithm="gigpo"), invalid_action_penalty=PENALTY).metrics
    assert gigpo["diag/adv_cosine_vs_grpo"] < 1.0 and gigpo["diag/adv_sign_differs_share"] > 0.0
    grpo_m = build_batch(groups, LearnerConfig(algorithm="grpo"), invalid_action_penalty=PENALTY).metrics
    assert grpo_m["diag/adv_cosine_vs_grpo"] == 1.0 and grpo_m["diag/adv_sign_differs_share"] == 0.0

    all_success = [all(t.success for t in g.trajectories) for g in groups]
    assert all_success[0] and gigpo["diag/groups_all_success_share"] == np.mean(all_success)
    lengths = [t.num_steps for g in groups for t in g.trajectories if t.success]
    assert gigpo["diag/success_episode_length_mean"] == pytest.approx(np.mean(lengths))
    # ... and as the two counts the Prometheus counters add up (successful_episodes, successful_episode_steps)
    assert gigpo["diag/successful_trajectories"] == len(lengths)
    assert gigpo["diag/successful_trajectory_steps"] == sum(lengths)
    # Every trajectory's length, failures too (the learning check's curve of steps per episode).
    assert gigpo["batch/episode_steps_mean"] == pytest.approx(np.mean([t.num_steps for g in groups
                                                                        for t in g.trajectories]))


def test_diagnostics_of_batches_without_signal_or_success():
    groups = synthetic_groups(2, 3, seed=5)
    for g in groups:                          # every rollout fails, and every action is valid
        for t in g.trajectories:
            t.success, t.episode_return = False, 0.0
        g.rows["reward"][:], g.rows["valid"][:] = 0.0, True
    m = build_batch(groups, LearnerConfig(algorithm="gigpo"), invalid_action_penalty=PENALTY).metrics
    # Both advantage vectors are 0: the same vector (cosine 1), no sign differs.
    assert m["adv/zero_share"] == 1.0
    assert m["diag/adv_cosine_vs_grpo"] == 1.0 and m["diag/adv_sign_differs_share"] == 0.0
    assert m["diag/groups_all_success_share"] == 0.0
    assert np.isnan(m["diag/success_episode_length_mean"])   # no length to report (the gauge keeps its last)
    assert build_batch([], LearnerConfig(), invalid_action_penalty=PENALTY).metrics["diag/adv_cosine_vs_grpo"] == 1.0


# ----------------------------------------------------------------------------------------------------------
# Environment errors
# ----------------------------------------------------------------------------------------------------------

def test_env_error_trajectories_are_left_out_not_trained_as_failures():
    groups = synthetic_groups(3, 4, seed=9)
    broken, lonely, clean = groups
    broken.trajectories[1].termination = Termination.ENV_ERROR
    for t in lonely.trajectories[1:]:          # one trajectory left: nothing to compare it with
        t.termination = Termination.ENV_ERROR
    b = build_batch(groups, LearnerConfig(), invalid_action_penalty=PENALTY)

    # The same batch as if the env-error trajectories (and the group left with one) had never come.
    expected = build_batch([keep_trajectories(broken, [0, 2, 3]), clean], LearnerConfig(),
                           invalid_action_penalty=PENALTY)
    np.testing.assert_array_equal(b.advantages, expected.advantages)
    assert b.row_group == expected.row_group and lonely.group_id not in b.row_group
    assert b.num_rows == expected.num_rows == broken.num_rows + clean.num_rows - broken.trajectories[1].num_steps
    assert broken.trajectories[1].num_steps > 0
    assert b.env_error_group_ids == [lonely.group_id]
    assert b.group_ids == [g.group_id for g in groups]        # consumed all the same (acked, never retried)
    assert b.metrics["batch/trajectories_env_error"] == 4
    assert b.metrics["batch/groups_dropped_env_error"] == 1
    assert b.metrics["batch/success_rate"] == expected.metrics["batch/success_rate"]
    # The caller's groups are left as they were.
    assert len(broken.trajectories) == 4


# ----------------------------------------------------------------------------------------------------------
# Forced tokens
# ----------------------------------------------------------------------------------------------------------

def test_forced_tokens_are_left_out_of_the_loss():
    groups = synthetic_groups(2, 2, seed=4)
    forced_at = [0, 2]
    steps_of(groups[0], 0)[0].response_logprobs[forced_at] = 0.0    # the sampler had one choice
    b = build_batch(groups, LearnerConfig(), invalid_action_penalty=PENALTY)
    assert b.metrics["batch/forced_tokens"] == len(forced_at)
    mask = b.token_masks[0]                    # row 0 is that step
    assert not mask[forced_at].any() and mask.sum() == len(mask) - len(forced_at)
    assert all(m.all() for m in b.token_masks[1:])

    rows = np.arange(b.num_rows)
    plan = plan_micro_batches(b, rows, 10 ** 6)
    assert plan.response_tokens == b.response_lengths().sum() - len(forced_at)    # the token-mean normalizer
    mb = collate(b, rows)
    forced = mb.loss_mask == 0
    assert int(forced.sum()) == len(forced_at) and forced[forced_at].all()
    # Their gradient is exactly 0, the others' is not; the loss is the mean over the trained tokens.
    logp = (mb.old_logprobs.double() - 0.1).requires_grad_()
    loss, m = policy_loss(logp, mb.old_logprobs.double(), mb.advantages.double(), mb.loss_mask.double(),
                          LossSettings(kl_coef=0.0, entropy_coef=0.0), token_normalizer=plan.response_tokens)
    loss.backward()
    assert torch.all(logp.grad[forced] == 0)
    assert torch.all(logp.grad[~forced & (mb.advantages != 0)] != 0)
    assert m["tokens"].item() == plan.response_tokens


# ----------------------------------------------------------------------------------------------------------
# Temperature: the learner's log-probs are those of the distribution the rollouts sampled from
# ----------------------------------------------------------------------------------------------------------

T = 0.6
# Both sides are fp32 forward passes of the same weights that differ only in batch shape and padding (the
# learner left-pads several rows into one micro-batch; the reference runs one unpadded row), so they differ
# by rounding alone: ~1e-6 in log-prob (measured: 8e-7 at T = 1, 1.1e-6 at T = 0.6). Dividing the logits
# by T scales a logit error by 1/T (1.7 here) and log-softmax at most doubles it, so 1e-4 leaves a margin
# of ~30x even over that bound, while ignoring T moves these log-probs by 0.5 or more (> 100x the tolerance).
TOL = 1e-4


@pytest.mark.slow
def test_learner_logprobs_are_of_the_sampling_temperature(tiny_model_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="temperature"):
        PolicyTrainer(tiny_model_path, LearnerConfig(), dtype=DEFAULTS.model.dtype, **dict(TRAINER, temperature=0.0))

    groups = synthetic_groups(2, 3, vocab_size=1000, seed=7)
    steps_of(groups[0], 0)[0].response_logprobs[1] = 0.0       # one forced token (see below)
    batch = build_batch(groups, LearnerConfig(), invalid_action_penalty=PENALTY)
    cfg = LearnerConfig(zero_stage=2, micro_batch_tokens=300, mini_batch_rows=1024, recompute_old_logprobs=True)
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **dict(TRAINER, temperature=T))
    try:
        got = trainer.compute_logprobs(batch)
        m = trainer.train_step(batch, update=0).metrics
    finally:
        trainer.close()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    errors, effects = [], []
    with torch.no_grad():
        for p, r, lp in zip(batch.prompt_ids, batch.response_ids, got):
            ids = torch.tensor(np.concatenate([p, r]), dtype=torch.long)[None]
            logits = model(input_ids=ids).logits[0, len(p) - 1:len(p) + len(r) - 1].double()
            pick = (torch.arange(len(r)), torch.tensor(r, dtype=torch.long))
            want = torch.log_softmax(logits / T, -1)[pick].numpy()
            raw = torch.log_softmax(logits, -1)[pick].numpy()
            errors.append(np.abs(lp - want).max())
            effects.append(np.abs(raw - want).max())
    assert max(errors) < TOL, max(errors)
    assert min(effects) > 100 * TOL, min(effects)
    # The forced token stays out of the loss after the recompute replaced the rollout's log-probs.
    assert m["train/response_tokens"] == batch.response_lengths().sum() - 1


# ----------------------------------------------------------------------------------------------------------
# Per-episode evaluation records
# ----------------------------------------------------------------------------------------------------------

def test_evaluation_result_lists_every_episode():
    import json

    from actors.evaluation import summarize

    groups = synthetic_groups(3, 1, seed=13, policy_version=7)
    groups[2] = EpisodeGroup.pack(groups[2].group_id, groups[2].task_id, "alfworld",      # ended at reset
                                  [(Trajectory("t2", termination=Termination.ENV_ERROR), [])])
    trajs = [g.trajectories[0] for g in groups]
    trajs[0].task_type, trajs[1].task_type = "pick_and_place_simple", "look_at_obj_in_light"
    result = summarize(groups)
    assert {"episodes", "success", "per_task_type", "mean_steps"} <= set(result)
    detail = json.loads(json.dumps(result))["episodes_detail"]       # as `gigpo eval` saves it
    assert [d["task_id"] for d in detail] == [g.task_id for g in groups]
    for d, g, t in zip(detail, groups, trajs):
        assert d == {"task_id": g.task_id, "task_type": t.task_type, "success": t.success,
                     "steps": t.num_steps, "return": t.episode_return, "score": t.score,
                     "termination": t.termination.value, "policy_version": 7 if t.num_steps else -1}
    assert sum(d["success"] for d in detail) / len(detail) == result["success"]
    valid = [bool(v) for g in groups for v in g.rows["valid"]]
    assert result["valid_action_share"] == sum(valid) / len(valid)


def test_every_learner_gauge_shows_a_key_the_batch_reports():
    """A learner gauge names the update metric it shows once (MetricSpec.update_key); the batch's keys must
    exist under that name (the train/* ones come from the trainer: the learner tests scrape those)."""
    from common.metrics import METRICS
    reported = build_batch(synthetic_groups(2, 4, seed=3), LearnerConfig(algorithm="gigpo"),
                           invalid_action_penalty=PENALTY).metrics
    keys = {key for s in METRICS.values() if s.type == "gauge" for _, key in s.update_keys
            if key.split("/")[0] in ("anchor", "diag", "batch")}
    assert keys and keys <= set(reported), keys - set(reported)
