"""The config declares each choice (a Literal in common/config.py); the code registers one function per name
(learner.gigpo's estimators and corrections, actors.rollout's rewards). The two lists agree, and a new advantage estimator is one function and one registry
entry: this module adds a fourth and build_batch trains with it, nothing else changed."""
import numpy as np

from tests.support.synthetic import synthetic_groups
from actors.rollout import STEP_REWARDS
from common.config import LearnerConfig, RolloutConfig, choices
from learner.batching import build_batch
from learner.gigpo import ADVANTAGE_ESTIMATORS, CORRECTIONS


def test_each_config_choice_has_its_function_and_no_function_lacks_a_choice():
    assert list(ADVANTAGE_ESTIMATORS) == list(choices(LearnerConfig, "algorithm"))
    assert list(CORRECTIONS) == list(choices(LearnerConfig, "logprob_correction"))
    assert list(STEP_REWARDS) == list(choices(RolloutConfig, "reward"))


def test_a_fourth_estimator_registered_in_a_test_trains_through_build_batch(monkeypatch):
    returned = []

    def step_index(rows, cfg):
        """Made up: a row's advantage is its step index less its penalty, times omega."""
        advantages = cfg.omega * (rows.steps - rows.penalties)
        returned.append(advantages)
        return advantages, {"adv/step_index_rows": float(len(advantages))}

    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "step_index", step_index)
    batch = build_batch(synthetic_groups(3, 4, seed=3), LearnerConfig(algorithm="step_index", omega=2.0),
                        invalid_action_penalty=0.1)
    (advantages,) = returned
    assert batch.num_rows == len(advantages) > 0          # every synthetic row has a response: all trained
    np.testing.assert_array_equal(batch.advantages, advantages)
    # omega x (step - penalty): an even number, or 2 x (step - 0.1) = 1.8 mod 2 for an invalid action
    assert set(np.round(batch.advantages % 2, 6)) == {0.0, 1.8}
    assert batch.metrics["adv/step_index_rows"] == batch.num_rows
    assert batch.metrics["adv/mean"] == float(np.mean(advantages))
