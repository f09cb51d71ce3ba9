"""Learner loss and batching: pure torch / NumPy, no engine. The reference values are computed here
independently, token by token in plain Python, from the formulas of reference §2."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import LearnerConfig, RolloutConfig
from learner.batching import build_batch, collate, mini_batches, pack_by_tokens, plan_micro_batches
from learner.gigpo import (LossSettings, correction_weights, gigpo_advantages, grpo_advantages, logprob_gap,
                           policy_loss, token_logprobs_and_entropy)
from tests.support.synthetic import synthetic_groups
from tests.support.synthetic import step_rows


PENALTY = RolloutConfig().invalid_action_penalty     # build_batch's, at the config's default


def _reference_token_loss(lp, old, a, ref, ent, clip=0.2, c=3.0, kl_coef=0.01, ent_coef=0.001):
    ratio = math.exp(lp - old)
    pg = max(-a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip))
    if a < 0:
        pg = min(pg, -c * a)
    d = ref - lp
    kl = min(max(math.exp(d) - d - 1, -10.0), 10.0)
    return pg + kl_coef * kl - ent_coef * ent


def test_policy_loss_matches_token_by_token_reference():
    g = torch.Generator().manual_seed(0)
    n = 400
    lp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    # Spread of log-ratios wide enough to hit both clips and the dual clip.
    old = lp + torch.randn(n, generator=g, dtype=torch.float64) * 0.8
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 2
    ref = lp + torch.randn(n, generator=g, dtype=torch.float64) * 3     # some k3 values hit the clamp
    ent = torch.rand(n, generator=g, dtype=torch.float64) * 5
    mask = (torch.rand(n, generator=g) > 0.2).double()
    loss, m = policy_loss(lp, old, adv, mask, LossSettings(), ref_logp=ref, entropy=ent)
    expect = [_reference_token_loss(*map(float, (lp[i], old[i], adv[i], ref[i], ent[i])))
              for i in range(n) if mask[i] > 0]
    assert loss.item() == pytest.approx(sum(expect) / len(expect), rel=1e-10)
    assert m["tokens"].item() == len(expect)
    assert 0 < m["clip_frac_sum"].item() < len(expect)
    assert m["dual_clip_frac_sum"].item() > 0


def test_dual_clip_caps_negative_advantage_loss_and_blocks_its_gradient():
    lp = torch.tensor([0.0, 0.0], requires_grad=True)
    old = torch.tensor([-5.0, -5.0])            # ratio e^5 ~ 148
    adv = torch.tensor([-1.0, 1.0])
    loss, _ = policy_loss(lp, old, adv, torch.ones(2), LossSettings(kl_coef=0, entropy_coef=0),
                          token_normalizer=1.0)
    # A<0: min(max(148, 1.2), 3) = 3; A>0: max(-148, -1.2) = -1.2
    assert loss.item() == pytest.approx(3.0 - 1.2)
    loss.backward()
    assert lp.grad.tolist() == [0.0, 0.0]


def test_token_mean_over_micro_batches_equals_mini_batch_token_mean():
    g = torch.Generator().manual_seed(1)
    lengths = [3, 17, 8, 1, 30, 5]
    rows = [(-torch.rand(t, generator=g, dtype=torch.float64)).requires_grad_() for t in lengths]
    old = [r.detach() + 0.05 * torch.randn(len(r), generator=g, dtype=torch.float64) for r in rows]
    adv = [float(x) for x in torch.randn(len(rows), generator=g)]
    s = LossSettings(kl_coef=0, entropy_coef=0)
    cat = lambda xs: torch.cat(list(xs))
    full, _ = policy_loss(cat(rows), cat(old), cat(torch.full((t,), a, dtype=torch.float64)
                                                    for t, a in zip(lengths, adv)),
                          torch.ones(sum(lengths), dtype=torch.float64), s)
    g_full = torch.autograd.grad(full, rows)
    total = 0.0
    for part in ([0, 3], [1, 2, 5], [4]):
        lp = cat(rows[i] for i in part)
        loss, _ = policy_loss(lp, cat(old[i] for i in part),
                              cat(torch.full((lengths[i],), adv[i], dtype=torch.float64) for i in part),
                              torch.ones(len(lp), dtype=torch.float64), s, token_normalizer=sum(lengths))
        total = total + loss
    g_split = torch.autograd.grad(total, rows)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    for a, b in zip(g_full, g_split):
        torch.testing.assert_close(a, b)


def test_token_logprobs_and_entropy():
    logits = torch.randn(5, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (5,))
    lp, ent = token_logprobs_and_entropy(logits, targets)
    ls = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(lp, ls[torch.arange(5), targets])
    torch.testing.assert_close(ent, -(ls.exp() * ls).sum(-1))


def test_build_batch_penalties_and_algorithms():
    groups = synthetic_groups(3, 4, seed=3)
    rows = step_rows(groups)
    args = ([r[0] for r in rows], [r[1] for r in rows], np.array([r[2].step for r in rows]),
            [r[2].reward for r in rows])
    pen = [0.0 if r[2].valid else 0.1 for r in rows]
    assert any(pen)
    cfg = LearnerConfig(algorithm="gigpo")
    b = build_batch(groups, cfg, invalid_action_penalty=0.1)
    np.testing.assert_allclose(b.advantages, gigpo_advantages(*args, [r[2].anchor for r in rows],
                                                              penalties=pen))
    b = build_batch(groups, LearnerConfig(algorithm="grpo"), invalid_action_penalty=0.1)
    np.testing.assert_allclose(b.advantages, grpo_advantages(*args, penalties=pen))
    assert b.group_ids == [g.group_id for g in groups]
    with pytest.raises(ValueError, match="algorithm"):
        build_batch(groups, LearnerConfig(algorithm="ppo"), invalid_action_penalty=PENALTY)


def test_dynamic_sampling_skips_equal_return_groups_and_counts_them():
    groups = synthetic_groups(4, 4, seed=5)
    for t in groups[1].trajectories:          # make group 1 all-failed
        t.episode_return = 0.0
    groups[1].rows["reward"][:] = 0.0
    equal = [g.group_id for g in groups if len(set(t.episode_return for t in g.trajectories)) == 1]
    assert groups[1].group_id in equal and len(equal) < len(groups)
    b = build_batch(groups, LearnerConfig(dynamic_sampling=True), invalid_action_penalty=PENALTY)
    assert b.skipped_group_ids == equal
    assert b.metrics["batch/groups_skipped_equal_returns"] == len(equal)
    assert groups[1].group_id not in b.row_group
    assert b.group_ids == [g.group_id for g in groups]     # consumed all the same


def test_bad_rows_raise_clear_errors():
    groups = synthetic_groups(2, 2, seed=1)
    groups[1].rows["response_logprobs"][0] = np.nan
    with pytest.raises(ValueError, match=groups[1].group_id):
        build_batch(groups, LearnerConfig(), invalid_action_penalty=PENALTY)


def test_token_budget_packing_and_rank_plan():
    groups = synthetic_groups(6, 4, seed=2)
    b = build_batch(groups, LearnerConfig(), invalid_action_penalty=PENALTY)
    lengths = b.row_lengths()
    budget = 200
    for mb in mini_batches(b.num_rows, 32, seed=0):
        packs = pack_by_tokens(mb, lengths, budget)
        assert sorted(np.concatenate(packs).tolist()) == sorted(mb.tolist())
        for p in packs:
            assert len(p) * lengths[p].max() <= budget or len(p) == 1
        plan = plan_micro_batches(b, mb, budget, world_size=2)
        assert len(plan.per_rank[0]) == len(plan.per_rank[1])
        both = np.concatenate([np.concatenate(r) for r in plan.per_rank])
        assert sorted(both.tolist()) == sorted(mb.tolist())
        assert plan.response_tokens == b.response_lengths()[mb].sum()


def test_collate_aligns_targets_with_response_tokens():
    b = build_batch(synthetic_groups(2, 2, seed=4), LearnerConfig(), invalid_action_penalty=PENALTY)
    rows = np.arange(min(5, b.num_rows))
    mb = collate(b, rows, pad_id=0)
    # Logits position L - window + j predicts token L - window + j + 1: the last window - 1 tokens.
    predicted = mb.input_ids[:, mb.input_ids.shape[1] - mb.window + 1:][mb.target_mask]
    assert torch.equal(predicted, mb.targets)
    # Left padding: every row ends at the last position, positions count from the row's first token.
    assert bool(mb.attention_mask[:, -1].all())
    for i, r in enumerate(rows):
        n = len(b.prompt_ids[r]) + len(b.response_ids[r])
        assert mb.position_ids[i, -n:].tolist() == list(range(n))
    assert torch.equal(mb.targets, torch.from_numpy(np.concatenate([b.response_ids[r] for r in rows])).long())
    assert mb.old_logprobs.shape == mb.advantages.shape == mb.targets.shape
    assert int(mb.attention_mask.sum()) == int(b.row_lengths()[rows].sum())


# -- the sampler is not the learner: the gap, and the corrections (learner/gigpo.py) ------------------------

def test_logprob_gap_of_a_known_difference():
    """A sampler whose log-probs are the learner's minus 0.3 nat on every token, but one that is 0.05 above."""
    learner = np.array([-1.0, -2.0, -0.5, -3.0])
    sampler = learner - np.array([0.3, 0.3, 0.3, -0.05])
    gap = logprob_gap(learner, sampler)
    d = np.array([0.3, 0.3, 0.3, -0.05])
    assert gap["mean"] == pytest.approx(0.2375) and gap["max"] == pytest.approx(0.3)
    assert gap["share"] == 0.75                        # three tokens above the 0.1-nat threshold
    assert gap["kl"] == pytest.approx(float(np.mean(np.exp(d) - 1 - d)))
    assert logprob_gap(learner, learner) == {"mean": 0.0, "max": 0.0, "share": 0.0, "kl": 0.0}


def test_correction_weights_on_a_constructed_case():
    """Ratios pi_old / mu of exp(+1), exp(+0.5), 1, exp(-0.5), exp(-1) (the sampler gave the first token
    e^-1 of the learner's probability, ...), cap C = 2 (log C = 0.693): each correction's weights by hand."""
    d = np.array([1.0, 0.5, 0.0, -0.5, -1.0])
    learner = [np.array([-1.0, -1.0, -1.0, -1.0, -1.0]), np.array([-2.0, -2.0])]
    sampler = [learner[0] - d, learner[1] - np.array([0.2, 0.4])]
    tis, bound = correction_weights(learner, sampler, "tis", 2.0)
    np.testing.assert_allclose(tis[0], [2.0, math.exp(0.5), 1.0, math.exp(-0.5), math.exp(-1.0)], rtol=1e-6)
    np.testing.assert_allclose(tis[1], [math.exp(0.2), math.exp(0.4)], rtol=1e-6)
    assert bound == 1 / 7                              # truncated at C: the first token only
    token, bound = correction_weights(learner, sampler, "mask_token", 2.0)
    assert token[0].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0] and token[1].tolist() == [1.0, 1.0]
    assert bound == 2 / 7
    # Row 0's geometric mean is exp(0) = 1: kept; row 1's exp(0.3) in [1/2, 2]: kept; with C = 1.2
    # (log 1.2 = 0.182) row 1 goes, row 0 stays.
    seq, bound = correction_weights(learner, sampler, "mask_sequence", 1.2)
    assert seq[0].tolist() == [1.0] * 5 and seq[1].tolist() == [0.0, 0.0] and bound == 2 / 7
    # The mean is over the loss tokens only: row 0 without its first two tokens has mean log ratio -0.5,
    # outside log 1.5 = 0.405 -> dropped; all five average 0 -> kept. The share counts loss tokens only.
    masks = [np.array([False, False, True, True, True]), np.array([True, True])]
    weights, bound = correction_weights(learner, sampler, "mask_sequence", 1.5, masks)
    assert weights[0].tolist() == [0.0] * 5 and bound == 3 / 5
    assert correction_weights(learner, sampler, "mask_sequence", 1.5)[0][0].tolist() == [1.0] * 5
    weights, bound = correction_weights(learner, sampler, "none", 2.0)
    assert [w.tolist() for w in weights] == [[1.0] * 5, [1.0] * 2] and bound == 0.0
    # A cap <= 1 is refused when the config loads (learner.correction_cap's rule: tests/common/test_config.py).


def test_weighted_policy_gradient_equals_the_hand_computation():
    """At ratio 1 (logp = old_logp) PPO's token loss is -A * ratio, so d loss / d logp_i = -A_i * w_i / N with
    N the loss tokens (a dropped token, w = 0, still counts in N). KL and entropy terms off."""
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.7], requires_grad=True)
    old = logp.detach().clone()
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])          # the last token is forced: out of the loss
    w = torch.tensor([2.0, 0.5, 0.0, 1.0])
    loss, metrics = policy_loss(logp, old, adv, mask, LossSettings(kl_coef=0.0, entropy_coef=0.0), weights=w)
    loss.backward()
    expected = [-1.0 * 2.0 / 3, 2.0 * 0.5 / 3, 0.0, 0.0]
    assert torch.allclose(logp.grad, torch.tensor(expected), atol=1e-7), logp.grad
    assert loss.item() == pytest.approx((-1.0 * 2.0 + 2.0 * 0.5 + 0.0) / 3)
