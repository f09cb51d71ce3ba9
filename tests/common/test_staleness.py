"""common/staleness.py: the admission bound, lags across a resume, the stale test (the rule at work:
tests/common/stream/test_stream.py, tests/actors/test_rollout.py; the learner's read policy: test_stream.py)."""
from common.config import ExperimentConfig
from common.staleness import is_stale, policy_lag, policy_lag_bound


def test_the_admission_bound_lets_every_admitted_group_be_trained_within_the_lag():
    cfg = ExperimentConfig()
    cfg.stream.max_policy_lag, cfg.learner.groups_per_batch = 2, 4
    # (2 + 1) x 4: a group admitted when the learner stands at v has at most 11 groups ahead of it; the
    # updates that make v+1 and v+2 train 8 of them, and the next one reads it with the learner at v+2: lag 2.
    assert policy_lag_bound(cfg) == 12


def test_lags_count_the_learners_own_history_across_a_resume():
    assert policy_lag(3, 7) == 4
    # A checkpoint at version 5 resumed and pushed again as 9: 9 stands at 5, 11 at 7; a version sampled
    # before the crash (v < 9) keeps its own number.
    assert [policy_lag(v, 11, resumed=(5, 9)) for v in (9, 11, 4, 6)] == [2, 0, 3, 1]
    assert is_stale(5, max_policy_lag=4) and not is_stale(4, max_policy_lag=4)
