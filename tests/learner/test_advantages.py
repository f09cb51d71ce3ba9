"""GiGPO / GRPO / RLOO advantages against hand-computed values, and the vectorized GiGPO against its readable
definition (learner.gigpo.gigpo_readable)."""
import numpy as np
import pytest

from learner.gigpo import (anchor_group_summary, gigpo_advantages, gigpo_parts, gigpo_readable,
                                grpo_advantages, rloo_advantages)

# The worked example of ../shared/reference/gigpo.md §1: N = 2, gamma 0.95, mean_norm, stats over rows.
EX = dict(group_ids=["g"] * 5, traj_ids=["a", "a", "b", "b", "b"], steps=[0, 1, 0, 1, 2],
          rewards=[0.0, 10.0, 0.0, 0.0, 0.0], anchors=["A", "B", "A", "C", "C"])


def test_worked_example():
    adv = gigpo_advantages(**EX, normalize_std=False)
    np.testing.assert_allclose(adv, [10.75, 6.0, -8.75, -4.0, -4.0], atol=1e-12)
    parts = gigpo_parts(**EX, normalize_std=False)
    np.testing.assert_allclose(parts.episode, [6, 6, -4, -4, -4], atol=1e-12)
    np.testing.assert_allclose(parts.returns, [9.5, 10, 0, 0, 0], atol=1e-12)
    np.testing.assert_allclose(parts.step, [4.75, 0, -4.75, 0, 0], atol=1e-12)


def test_worked_example_with_std():
    adv = gigpo_advantages(**EX, normalize_std=True)
    scores = np.array([10, 10, 0, 0, 0.0])
    ep = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
    step_a = (np.array([9.5, 0.0]) - 4.75) / (np.std([9.5, 0.0], ddof=1) + 1e-6)
    np.testing.assert_allclose(adv, ep + np.array([step_a[0], 0, step_a[1], 0, 0]), rtol=1e-12)


def test_singletons():
    # One trajectory of one step: episode group of one row -> mean 0, std 1; anchor singleton -> 0.
    adv = gigpo_advantages(["g"], ["t"], [0], [10.0], ["s"], normalize_std=False)
    np.testing.assert_allclose(adv, [10.0])
    adv = gigpo_advantages(["g"], ["t"], [0], [10.0], ["s"], normalize_std=True)
    np.testing.assert_allclose(adv, [10.0 / (1 + 1e-6)])
    parts = gigpo_parts(["g", "g"], ["a", "b"], [0, 0], [1.0, 0.0], ["x", "y"])
    np.testing.assert_array_equal(parts.step, [0.0, 0.0])


def test_all_equal_groups_are_exactly_zero():
    # Returns of -0.1 penalties are not exactly representable: the float32 reference gives noise here.
    n_traj, length = 8, 7
    g = ["g"] * (n_traj * length)
    t = np.repeat(np.arange(n_traj), length)
    s = np.tile(np.arange(length), n_traj)
    r = np.zeros(n_traj * length)
    pen = np.full(n_traj * length, 0.1)
    an = [f"obs{k}" for k in s]
    for std in (True, False):
        for stats in ("rows", "trajectories"):
            adv = gigpo_advantages(g, t, s, r, an, normalize_std=std, episode_stats=stats, penalties=pen)
            assert np.all(adv == 0.0), (std, stats, adv[:5])
            assert np.all(grpo_advantages(g, t, s, r, normalize_std=std, episode_stats=stats, penalties=pen) == 0)
            assert np.all(rloo_advantages(g, t, s, r, episode_stats=stats, penalties=pen) == 0)


def test_permutation_invariance():
    rng = np.random.default_rng(0)
    g, t, s, r, an = _random_batch(rng, groups=4, n=5, max_len=9)
    base = gigpo_advantages(g, t, s, r, an)
    perm = rng.permutation(len(g))
    shuffled = gigpo_advantages([g[i] for i in perm], [t[i] for i in perm], s[perm], r[perm], [an[i] for i in perm])
    np.testing.assert_allclose(shuffled, base[perm], rtol=0, atol=1e-12)


def test_revisited_state_groups_across_time():
    # Trajectory a visits X twice (steps 0 and 2); b visits X once. All three rows share X's group.
    g = ["g"] * 5
    t = ["a", "a", "a", "b", "b"]
    s = [0, 1, 2, 0, 1]
    r = [0, 0, 10.0, 0, 0]
    an = ["X", "Y", "X", "X", "Z"]
    parts = gigpo_parts(g, t, s, r, an, normalize_std=False)
    ret = np.array([10 * 0.95 ** 2, 10 * 0.95, 10, 0, 0])
    np.testing.assert_allclose(parts.returns, ret)
    x_mean = (ret[0] + ret[2] + ret[3]) / 3
    np.testing.assert_allclose(parts.step, [ret[0] - x_mean, 0, ret[2] - x_mean, ret[3] - x_mean, 0], atol=1e-12)
    assert parts.anchor_group[0] == parts.anchor_group[2] == parts.anchor_group[3]


def test_anchor_groups_do_not_cross_episode_groups():
    parts = gigpo_parts(["g1", "g2"], ["a", "a"], [0, 0], [10.0, 0.0], ["X", "X"])
    assert parts.anchor_group[0] != parts.anchor_group[1]
    np.testing.assert_array_equal(parts.step, [0, 0])


def test_episode_stats_rows_vs_trajectories():
    # a: 2 steps, return 10. b: 3 steps, return 0.
    common = dict(group_ids=EX["group_ids"], traj_ids=EX["traj_ids"], steps=EX["steps"], rewards=EX["rewards"])
    rows = grpo_advantages(**common, normalize_std=False, episode_stats="rows")
    np.testing.assert_allclose(rows, [6, 6, -4, -4, -4])       # mean over rows = 4
    traj = grpo_advantages(**common, normalize_std=False, episode_stats="trajectories")
    np.testing.assert_allclose(traj, [5, 5, -5, -5, -5])       # mean over trajectories = 5
    traj_std = grpo_advantages(**common, normalize_std=True, episode_stats="trajectories")
    f = np.std([10.0, 0.0], ddof=1) + 1e-6
    np.testing.assert_allclose(traj_std, np.array([5, 5, -5, -5, -5]) / f)


def test_normalize_std_both_ways():
    rng = np.random.default_rng(1)
    g, t, s, r, an = _random_batch(rng, groups=3, n=4, max_len=6)
    for std in (True, False):
        for stats in ("rows", "trajectories"):
            ours = gigpo_advantages(g, t, s, r, an, normalize_std=std, episode_stats=stats, omega=0.7)
            ref = gigpo_readable(g, t, s, r, an, normalize_std=std, episode_stats=stats, omega=0.7)
            np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-10)


def test_penalties_apply_to_their_row_only():
    g, t, s = ["g"] * 3, ["a", "a", "b"], [0, 1, 0]
    r = [0.0, 10.0, 0.0]
    pen = [0.1, 0.0, 0.0]
    parts = gigpo_parts(g, t, s, r, ["X", "Y", "X"], normalize_std=False, penalties=pen)
    np.testing.assert_allclose(parts.returns, [9.5 - 0.1, 10.0, 0.0])   # not discounted into other rows
    scores = np.array([9.9, 10.0, 0.0])
    np.testing.assert_allclose(parts.episode, scores - scores.mean())


def test_grpo_is_gigpo_with_omega_zero():
    rng = np.random.default_rng(2)
    g, t, s, r, an = _random_batch(rng, groups=5, n=8, max_len=12)
    for stats in ("rows", "trajectories"):
        np.testing.assert_array_equal(gigpo_advantages(g, t, s, r, an, omega=0.0, episode_stats=stats),
                                      grpo_advantages(g, t, s, r, episode_stats=stats))


def test_rloo_leave_one_out():
    g = ["g"] * 4 + ["h"]
    t = ["a", "a", "b", "c", "z"]
    s = [0, 1, 0, 0, 0]
    r = [0.0, 10.0, 4.0, 1.0, 3.0]
    adv = rloo_advantages(g, t, s, r, episode_stats="trajectories")   # trajectory returns 10, 4, 1; h alone
    np.testing.assert_allclose(adv, [10 - 2.5, 10 - 2.5, 4 - 5.5, 1 - 7.0, 3.0])
    adv_rows = rloo_advantages(g, t, s, r, episode_stats="rows")   # row scores 10, 10, 4, 1
    np.testing.assert_allclose(adv_rows[:4], [10 - 5, 10 - 5, 4 - 7, 1 - 8])


def test_similarity_groups_texts_differing_by_one_word():
    base = "You arrive at countertop 1. On the countertop 1, you see a apple 1, a bread 2, and a knife 3."
    other = base.replace("bread", "lettuce")
    far = "You are in the middle of a room. Looking quickly around you, you see nothing."
    g = ["g"] * 4
    t = ["a", "b", "c", "d"]
    s = [0, 0, 0, 0]
    r = [10.0, 0.0, 5.0, 1.0]
    an = [base, other, far, base]
    exact = gigpo_parts(g, t, s, r, an)
    sim = gigpo_parts(g, t, s, r, an, similarity=0.9)
    assert exact.anchor_group[0] != exact.anchor_group[1]
    assert sim.anchor_group[0] == sim.anchor_group[1] == sim.anchor_group[3]
    assert sim.anchor_group[2] != sim.anchor_group[0]
    # Greedy clustering in order of first appearance matches the reference loop.
    ref = gigpo_readable(g, t, s, r, an, similarity=0.9)
    np.testing.assert_allclose(sim.episode + sim.step, ref, rtol=1e-10)


def test_any_hashable_anchors():
    g, t, s, r = ["g"] * 3, ["a", "b", "c"], [0, 0, 0], [1.0, 0.0, 0.0]
    for anchors in (["x", "x", "y"], [b"x", b"x", b"y"], [("x", 1), ("x", 1), ("y", 1)],
                    np.array(["x", "x", "y"])):
        parts = gigpo_parts(g, t, s, r, anchors, normalize_std=False)
        np.testing.assert_allclose(parts.step, [0.5, -0.5, 0.0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(rewards=[0.0, 1.0]), "length mismatch"),
    (dict(rewards=[0.0, np.nan, 1.0, 0.0, 0.0]), "finite"),
    (dict(steps=[0, 0, 0, 1, 2]), "duplicate step"),
    (dict(steps=[0.0, 1.0, 0.0, 1.0, 2.0]), "integers"),
])
def test_clear_errors(kwargs, message):
    args = {**EX, **kwargs}
    with pytest.raises(ValueError, match=message):
        gigpo_advantages(**args)


def test_clear_errors_grpo_rloo():
    with pytest.raises(ValueError, match="length mismatch"):
        grpo_advantages(["g"], ["a", "b"], [0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        rloo_advantages(["g"], ["a"], [0], [np.inf], episode_stats="trajectories")
    # The settings' ranges (gamma, omega, similarity, episode_stats) are the config's rules, checked when
    # it loads: tests/common/test_config.py.


def test_empty_batch():
    assert gigpo_advantages([], [], [], [], []).shape == (0,)
    assert grpo_advantages([], [], [], []).shape == (0,)


def test_matches_reference_loop_on_random_batches():
    rng = np.random.default_rng(3)
    for _ in range(5):
        g, t, s, r, an = _random_batch(rng, groups=4, n=6, max_len=10)
        pen = (rng.random(len(g)) < 0.2) * 0.1
        ours = gigpo_advantages(g, t, s, r, an, penalties=pen)
        ref = gigpo_readable(g, t, s, r, an, penalties=pen)
        np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-9)


def test_anchor_group_summary():
    parts = gigpo_parts(**EX, normalize_std=False)
    summary = anchor_group_summary(parts)
    assert summary["num_groups"] == 3                 # A, B, C
    assert summary["singleton_share"] == pytest.approx(1 / 3)
    assert summary["mean_group_size"] == pytest.approx(5 / 3)
    assert summary["nonzero_step_adv_share"] == pytest.approx(2 / 5)
    assert summary["hist_1"] == 1 and summary["hist_2"] == 2 and summary["hist_ge_10"] == 0


def _random_batch(rng, groups, n, max_len):
    g, t, s, r, an = [], [], [], [], []
    for gi in range(groups):
        for ti in range(n):
            length = int(rng.integers(1, max_len + 1))
            win = rng.random() < 0.4
            for k in range(length):
                g.append(f"g{gi}")
                t.append(ti)
                s.append(k)
                r.append(10.0 if (win and k == length - 1) else 0.0)
                an.append(f"state{int(rng.integers(0, 4))}")
    return g, t, np.array(s), np.array(r), an
