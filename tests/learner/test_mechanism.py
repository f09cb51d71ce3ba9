"""GiGPO's mechanism, end to end on one hand-built group: eight rollouts of one task that all succeed, by
paths of different lengths. GRPO has nothing to learn there (every return is 10: its advantages are exactly
0), while GiGPO's anchor-state groups compare the actions taken from the same observation, so the shortcut
gets a positive step advantage over the detours; one real learner update (DeepSpeed on CPU, the tiny
policy) then makes the shortcut's actions more likely, and the GRPO update changes nothing at all.

Select with `pytest -k mechanism`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import ExperimentConfig, LearnerConfig
from common.stream.records import EpisodeGroup, StepRow, Trajectory
from tests.support.synthetic import steps_of
from learner.batching import build_batch
from learner.gigpo import gigpo_parts, grpo_advantages
from learner.trainer import PolicyTrainer

# What these tests leave at the config's defaults, passed explicitly: build_batch's invalid-action penalty,
# PolicyTrainer's settings from outside learner.* (dtype: each test's own).
DEFAULTS = ExperimentConfig()
PENALTY = DEFAULTS.rollout.invalid_action_penalty
TRAINER = {"head_dtype": DEFAULTS.model.head_dtype, "temperature": DEFAULTS.rollout.temperature,
           "seed": DEFAULTS.run.seed}

TASK = "Your task is to: take the mug 1."
OBS = {   # anchor states: raw observations, as the ALFWorld env reports them
    "start": "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a drawer 1, "
             "and a shelf 1.",
    "cabinet": "You arrive at cabinet 1. On the cabinet 1, you see a mug 1.",
    "drawer": "You arrive at drawer 1. On the drawer 1, you see a pen 1.",
    "shelf": "You arrive at shelf 1. On the shelf 1, you see nothing.",
}
WIN = "take mug 1 from cabinet 1"
# Four paths, two rollouts each; every one ends with WIN at the cabinet. The shortcut's states are a subset
# of every detour's, so the anchor groups "start" (all 8 rollouts) and "cabinet" (all 8) form, and
# "drawer" / "shelf" are shared between detours.
PATHS = {
    "shortcut": [("start", "go to cabinet 1"), ("cabinet", WIN)],
    "drawer": [("start", "go to drawer 1"), ("drawer", "go to cabinet 1"), ("cabinet", WIN)],
    "drawer_shelf": [("start", "go to drawer 1"), ("drawer", "go to shelf 1"), ("shelf", "go to cabinet 1"),
                     ("cabinet", WIN)],
    "shelf_drawer": [("start", "go to shelf 1"), ("shelf", "go to drawer 1"), ("drawer", "go to cabinet 1"),
                     ("cabinet", WIN)],
}


def _all_success_group(tokenizer) -> tuple[EpisodeGroup, list[tuple[str, int]]]:
    """The group, and (path name, step) of each of its rows in build_batch's order."""
    def prompt(obs: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{TASK}\n{obs}"}],
                                             add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    def response(action: str) -> list[int]:
        text = f"<think>the mug is in the cabinet</think> <action>{action}</action>"
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    played, order = [], []
    for name, path in PATHS.items():
        for copy in range(2):
            steps = []
            for t, (state, action) in enumerate(path):
                won = t == len(path) - 1
                ids = response(action)
                steps.append(StepRow(
                    prompt_ids=prompt(OBS[state]), response_ids=ids,
                    # Placeholders: the learner recomputes them (learner.recompute_old_logprobs); non-zero, as
                    # a log-prob of 0 marks a token forced by the action grammar (left out of the loss).
                    response_logprobs=np.full(len(ids), -1.0, dtype=np.float32),
                    reward=10.0 if won else 0.0, anchor=OBS[state], valid=True, step=t, policy_version=0,
                    action=action))
                order.append((name, t))
            played.append((Trajectory(traj_id=f"g-{name}-{copy}", success=True, episode_return=10.0, score=1.0),
                           steps))
    return EpisodeGroup.pack("g", "mug", "alfworld", played), order


@pytest.fixture(scope="module")
def group(tiny_model_path):
    from transformers import AutoTokenizer

    return _all_success_group(AutoTokenizer.from_pretrained(tiny_model_path))


def _columns(group: EpisodeGroup):
    rows = [(t.traj_id, s) for k, t in enumerate(group.trajectories) for s in steps_of(group, k)]
    return ([group.group_id] * len(rows), [r[0] for r in rows], np.array([r[1].step for r in rows]),
            [r[1].reward for r in rows], [r[1].anchor for r in rows])


def test_mechanism_grpo_is_zero_and_gigpo_prefers_the_shortcut(group):
    g, order = group
    gid, tid, steps, rewards, anchors = _columns(g)
    for stats in ("rows", "trajectories"):
        # Every trajectory scores 10: "all equal" is detected exactly, not left to (x - mean) / (std + eps).
        assert np.all(grpo_advantages(gid, tid, steps, rewards, episode_stats=stats) == 0.0)
        assert np.all(build_batch([g], LearnerConfig(algorithm="grpo", episode_stats=stats),
                                  invalid_action_penalty=PENALTY).advantages == 0.0)
    parts = gigpo_parts(gid, tid, steps, rewards, anchors)
    assert np.all(parts.episode == 0.0)
    is_ = lambda name, t: np.array([o == (name, t) for o in order])           # noqa: E731
    # At "start" the return-to-go is 10*0.95^(length-1): the shorter the path, the larger the step advantage;
    # the shortcut is above the group's mean, the longest detours below it.
    assert np.all(parts.step[is_("shortcut", 0)] > 0)
    assert parts.step[is_("shortcut", 0)].min() > parts.step[is_("drawer", 0)].max()
    longest = is_("drawer_shelf", 0) | is_("shelf_drawer", 0)
    assert parts.step[is_("drawer", 0)].min() > parts.step[longest].max() and np.all(parts.step[longest] < 0)
    # At the cabinet every rollout takes the winning action for the same 10: no step signal, exactly.
    assert np.all(parts.step[[o[0] != "shortcut" and o[1] == len(PATHS[o[0]]) - 1 for o in order]] == 0.0)
    assert np.all(parts.step[is_("shortcut", 1)] == 0.0)
    # From the drawer, going straight to the cabinet beats the detour via the shelf.
    assert parts.step[is_("drawer", 1)].min() > 0 > parts.step[is_("drawer_shelf", 1)].max()
    batch = build_batch([g], LearnerConfig(algorithm="gigpo"), invalid_action_penalty=PENALTY)
    np.testing.assert_array_equal(batch.advantages, parts.step)
    # The diagnostics of this batch (see learner/batching.py build_batch): GRPO's vector is 0, so the
    # cosine is 0 by convention and every row GiGPO trains differs in sign from GRPO's 0.
    m = batch.metrics
    assert m["diag/adv_cosine_vs_grpo"] == 0.0
    assert m["diag/adv_sign_differs_share"] == pytest.approx(np.mean(parts.step != 0.0))
    assert m["diag/groups_all_success_share"] == 1.0
    assert m["diag/success_episode_length_mean"] == pytest.approx((2 * 2 + 2 * 3 + 4 * 4) / 8)
    grpo_m = build_batch([g], LearnerConfig(algorithm="grpo"), invalid_action_penalty=PENALTY).metrics
    assert grpo_m["diag/adv_cosine_vs_grpo"] == 1.0 and grpo_m["diag/adv_sign_differs_share"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mechanism_one_update_raises_the_shortcut_and_grpo_changes_nothing(tiny_model_path, group):
    g, order = group
    # No KL, no entropy bonus, no weight decay: the loss is the PPO term alone, so with zero advantages its
    # gradient is exactly 0 (d/dlogp of -A * ratio is -A * ratio = 0), and AdamW's decoupled weight decay,
    # which shrinks weights without any gradient, cannot move them either. Adam's first step moves every
    # weight by about lr (m/sqrt(v) = sign(g)); at lr 1e-5 the log-prob changes are ~0.1 nat and scale
    # linearly with lr (1e-4 gives 10x), i.e. the first-order effect of the gradient decides their signs.
    cfg = LearnerConfig(zero_stage=2, lr=1e-5, weight_decay=0.0, kl_coef=0.0, entropy_coef=0.0,
                        recompute_old_logprobs=True, mini_batch_rows=1024, micro_batch_tokens=8192)
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        snapshot = lambda: {n: w.clone() for n, w in trainer.named_weights()}   # noqa: E731
        grpo = build_batch([g], LearnerConfig(algorithm="grpo"), invalid_action_penalty=PENALTY)
        w0, lp0 = snapshot(), trainer.compute_logprobs(grpo)
        m = trainer.train_step(grpo, update=0).metrics
        assert m["train/grad_norm"] == 0.0 and m["train/pg_loss"] == 0.0
        assert all(torch.equal(w, w0[n]) for n, w in snapshot().items())
        # Unchanged weights give bit-identical log-probs: the comparison below needs no noise allowance.
        assert all(np.array_equal(a, b) for a, b in zip(trainer.compute_logprobs(grpo), lp0))

        gigpo = build_batch([g], LearnerConfig(algorithm="gigpo"), invalid_action_penalty=PENALTY)
        m = trainer.train_step(gigpo, update=1).metrics
        lp1 = trainer.compute_logprobs(gigpo)
    finally:
        trainer.close()
    assert m["train/grad_norm"] > 0
    # log-prob of each whole response (its action), after minus before
    delta = np.array([float(a.sum(dtype=np.float64) - b.sum(dtype=np.float64)) for a, b in zip(lp1, lp0)])
    shortcut = np.array([o == ("shortcut", 0) for o in order])
    longest = np.array([o in (("drawer_shelf", 0), ("shelf_drawer", 0)) for o in order])
    # Exact comparisons with 0: with unchanged weights the log-probs are bit-identical (above), so any
    # change is the update's.
    assert np.all(delta[shortcut] > 0), dict(zip(order, delta))
    assert np.all(delta[longest] < 0), dict(zip(order, delta))
