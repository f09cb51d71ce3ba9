"""common/seeds.py: the one seed hash. The values are pinned: a study's game sets and its rollouts' sampling
seeds come from them, so a change here would silently change what every recorded run played."""
from common.seeds import stable_seed


def test_seeds_are_the_ones_recorded_runs_drew():
    # A rollout actor's RNG and a step's sampling seed (31 bits, parts joined by \x1f).
    assert stable_seed(0, "rollout-0") == 229153487
    assert stable_seed(7, "g-3-t1", 12) == 371490622
    # A generated game's draws (64 bits, parts joined by /).
    assert stable_seed("default", 5, "layout", separator="/", bits=64) == 11721206270103722317
    assert stable_seed(0, separator="/", bits=64) == 4066689987807800415


def test_a_seed_fits_its_width_and_depends_on_every_part():
    seeds = {stable_seed("run", i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2 ** 31 for s in seeds)
    assert stable_seed("a", "b") != stable_seed("b", "a") != stable_seed("ab")
