"""Learner loss and batching: pure torch / NumPy, no engine. The reference values are computed here
independently, token by token in plain Python, from the formulas of reference §2."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.config import LearnerConfig
from learner.batching import build_batch, collate, mini_batches, pack_by_tokens, plan_micro_batches
from learner.gigpo import (LossSettings, gigpo_advantages, grpo_advantages, policy_loss,
                           token_logprobs_and_entropy)
from tests.synthetic import step_rows, synthetic_groups


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
        build_batch(groups, LearnerConfig(algorithm="ppo"))


def test_dynamic_sampling_skips_equal_return_groups_and_counts_them():
    groups = synthetic_groups(4, 4, seed=5)
    for t in groups[1].trajectories:          # make group 1 all-failed
        t.episode_return = 0.0
    groups[1].rows["reward"][:] = 0.0
    equal = [g.group_id for g in groups if len(set(t.episode_return for t in g.trajectories)) == 1]
    assert groups[1].group_id in equal and len(equal) < len(groups)
    b = build_batch(groups, LearnerConfig(dynamic_sampling=True))
    assert b.skipped_group_ids == equal
    assert b.metrics["batch/groups_skipped_equal_returns"] == len(equal)
    assert groups[1].group_id not in b.row_group
    assert b.group_ids == [g.group_id for g in groups]     # consumed all the same


def test_bad_rows_raise_clear_errors():
    groups = synthetic_groups(2, 2, seed=1)
    groups[1].rows["response_logprobs"][0] = np.nan
    with pytest.raises(ValueError, match=groups[1].group_id):
        build_batch(groups, LearnerConfig())


def test_token_budget_packing_and_rank_plan():
    groups = synthetic_groups(6, 4, seed=2)
    b = build_batch(groups, LearnerConfig())
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
    b = build_batch(synthetic_groups(2, 2, seed=4), LearnerConfig())
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
