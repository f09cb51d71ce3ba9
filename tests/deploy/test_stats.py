"""deploy/stats.py: t quantiles, intervals and power, and the before/after change of a run's summary paired by
task (deploy/reports.py's summary line), on hand-made values whose answers follow from the arithmetic."""
import math

import pytest

from deploy.reports import format_summary
from deploy.stats import mean_ci, min_detectable, paired_change, seeds_needed, t_quantile_975


def test_t_quantiles_match_the_table_and_the_normal_limit():
    assert t_quantile_975(2) == 4.303
    assert t_quantile_975(10) == pytest.approx(2.228, abs=0.002)
    assert t_quantile_975(127) == pytest.approx(1.979, abs=0.002)
    assert t_quantile_975(10 ** 6) == pytest.approx(1.96, abs=1e-3)


def test_mean_ci_of_known_values():
    m, ci = mean_ci([1.0, 2.0, 3.0])          # sd 1, n 3: 4.303 / sqrt(3)
    assert m == 2.0 and ci == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(mean_ci([5.0])[1])


def test_power_follows_the_t_quantiles():
    # sd 5 points over 4 seeds: (3.182 + 0.978) x 5 / 2 = 10.4 points
    assert min_detectable(0.05, 4) == pytest.approx((3.182 + 0.978) * 0.05 / 2)
    assert seeds_needed(0.05, 0.10) == 5 and seeds_needed(0.0, 0.10) == 2
    assert math.isnan(min_detectable(0.05, 1))


def _episodes(values: dict[str, list[float]], key: str = "score") -> list[dict]:
    return [{"task_id": t, key: v, "success": v == 1.0} for t, vs in values.items() for v in vs]


def test_paired_change_averages_a_tasks_episodes_and_pairs_tasks_both_played():
    before = _episodes({"a": [0.2, 0.4], "b": [0.5], "c": [0.9]})          # c is not played after
    after = _episodes({"a": [0.5], "b": [0.6], "d": [1.0]})                 # d was not played before
    change = paired_change(before, after, "score")
    # a: 0.5 - 0.3 = 0.2; b: 0.1. Mean 0.15, sd 0.0707, t(1) = 12.706: half-width 12.706 x 0.05.
    assert change["tasks"] == 2 and change["diff"] == pytest.approx(0.15)
    assert change["ci"] == pytest.approx(12.706 * 0.05)


def test_the_summary_says_whether_the_change_is_outside_the_noise():
    def summary(before: dict, after: dict) -> str:
        b, a = _episodes(before), _episodes(after)
        mean = lambda eps, k: sum(e[k] for e in eps) / len(eps)        # noqa: E731
        result = lambda eps: {"success": mean(eps, "success"), "score": mean(eps, "score"), "episodes": len(eps),
                              "episodes_detail": eps}                  # noqa: E731
        return format_summary({"updates": 3, "train_s": 60.0, "env_steps": 100, "before": result(b),
                               "after": result(a), "outputs": "/out"})

    # Every task up by 0.1 or 0.3 (mean 0.2, sd 0.1095 over 6 tasks: half-width 2.571 x 0.0447 = 0.115).
    up = summary({t: [0.2] for t in "abcdef"}, {t: [0.3 if t in "abc" else 0.5] for t in "abcdef"})
    assert ("score change paired by task over 6 tasks: +20.0 points, 95% interval [+8.5, +31.5]: "
            "outside the noise: the interval excludes 0") in up
    # Up on some, down on as many: mean 0, the interval around it.
    mixed = summary({t: [0.5] for t in "abcd"}, {"a": [0.7], "b": [0.3], "c": [0.7], "d": [0.3]})
    assert "score change paired by task over 4 tasks: +0.0 points" in mixed and "within the noise" in mixed
