"""The learner's push to several inference actors at once (a scaled-out inference plane), through the real
sender (common/weights/sender.py) and the real receiver on engines without a model (StandInInference in
tests/support/scale_standins.py: what bench/bench_scale.py measures the push's fan-out with). Both ways: every
actor gets every weight's values, tied ones included; the collective group is built once and reused, its store
listening on one address; an added actor is brought in by a rebuilt group."""
import psutil
import pytest
import ray
import torch

from common.weights.sender import WeightTransfer
from tests.support.model_shapes import SHAPES, shaped_weights
from tests.support.scale_standins import StandInInference

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0


def _expected(weights) -> dict[str, float]:
    """Each pushed name's sum (lm_head.weight: the tied embedding, which the sender adds for the actors)."""
    sums = {name: float(t.double().sum()) for name, t in weights}
    sums["lm_head.weight"] = sums["model.embed_tokens.weight"]
    return sums


def _received(actors) -> list[dict]:
    return ray.get([a.take_received.remote() for a in actors], timeout=60)


def test_every_actor_gets_every_weight_by_shm_and_by_collective(local_ray, tmp_path):
    torch.manual_seed(0)
    weights = [(name, torch.randn_like(t)) for name, t in shaped_weights(SHAPES["tiny"], torch.float32)]
    actors = [StandInInference.remote(str(tmp_path / "weights"), True, keep_sums=True) for _ in range(3)]
    # (sums: the same float32 values summed in float64 in the same order on both sides, so equal exactly)
    shm = WeightTransfer(actors, mode="shm", bucket_mb=0.1, timeout_s=TIMEOUT_S)     # several bucket files
    info = shm.push(weights, version=1)
    assert info["transfer"] == "shm" and info["buckets"] > 1
    for got in _received(actors):
        assert got["version"] == 1 and got["sums"] == _expected(weights)
    shm.close(remove_files=True)

    collective = WeightTransfer(actors, mode="collective", bucket_mb=0.1, timeout_s=TIMEOUT_S)
    for version in (2, 3):
        weights = [(name, t * 2) for name, t in weights]
        info = collective.push(weights, version=version)
        assert info["transfer"] == "collective" and info["buffers"] > 1
        for got in _received(actors):
            assert got["version"] == version and got["sums"] == _expected(weights)
    assert collective.transport.builds == 1          # the second push reused the group
    # The group's store (unauthenticated) listens on the address the actors were told, not on every interface.
    store_port = collective.transport.engine.store.port
    listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store_port}
    assert listening == {ray.util.get_node_ip_address()}

    added = StandInInference.remote(str(tmp_path / "weights"), True, keep_sums=True)
    collective.set_actors(actors + [added])
    assert collective.needs_push(3)                  # the added one serves its own start, not version 3
    collective.push(weights, version=3)
    for got in _received(actors + [added]):
        assert got["version"] == 3 and got["sums"] == _expected(weights)
    collective.close()
