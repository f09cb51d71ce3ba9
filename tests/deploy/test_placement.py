"""Placement on one real Ray node that offers custom resources (the node kinds of a cluster): actors land where
their `*.resources` say, a need no node has is one clear error within its deadline, the learner's ranks meet
at rank 0's own node, a model that is not on the node's disk arrives through Ray (the same weights, the same
tokenizer), and `gigpo status` shows each actor's node. The two-node runs are tests/system/test_multinode.py's."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import ray

from common.config import EnvConfig, ExperimentConfig, RolloutConfig
from common.processes.model_files import CACHE_DIR_NAME, ModelSource
from common.processes.placement import POLL_S, PlacementError, actor_need, pinned_node, this_node, wait_placeable

# What this node offers besides CPUs (logical: 4, so that two learner ranks and a rollout actor all fit).
KINDS = {"learner_node": 2, "rollout_node": 4}
CLUSTER_QUERY_MARGIN_S = 4.0     # Ray's node list and the killing of a pending actor, on a loaded machine
SAMPLE = "You are in the middle of a room. > go to countertop 1\nOn the countertop 1, you see a mug."


@pytest.fixture(scope="module")
def kinds_ray():
    ray.init(address="local", num_cpus=4, resources=KINDS, object_store_memory=200 * 1024**2,
             include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def shipped_model(kinds_ray, tiny_model_path, tmp_path):
    """The tiny model shipped through Ray from a copy that is then deleted: no path on this node holds it."""
    copy = tmp_path / "driver-only-model"
    shutil.copytree(tiny_model_path, copy)
    source = ModelSource.ship(str(copy), max_mb=100)
    shutil.rmtree(copy)
    assert source.files is not None and not source.is_local_dir()
    try:
        yield source
    finally:      # this model's cache entries on this node (other entries may belong to other runs)
        for entry in (Path(tempfile.gettempdir()) / CACHE_DIR_NAME).glob(f"{source.digest}*"):
            shutil.rmtree(entry, ignore_errors=True)


def _weights_digest(module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode() + tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
@pytest.mark.fault
def test_a_need_no_node_has_is_one_clear_error_within_its_deadline(kinds_ray):
    wait_placeable({"a rollout actor": actor_need(1, 0, {"rollout_node": 1})}, timeout_s=0)   # offered: at once
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as err:
        wait_placeable({"the learner": actor_need(1, 1, {"gpu_node": 1})}, timeout_s=2)
    assert time.monotonic() - t0 < 2 + POLL_S + CLUSTER_QUERY_MARGIN_S      # the deadline, one poll, the query
    message = str(err.value)
    assert "\n" not in message and "the learner needs" in message and "GPU 1" in message and "gpu_node 1" in message
    assert this_node()["ip"] in message and "rollout_node 4" in message     # what the nodes do offer
    # The eval actor's node: one that could run a rollout actor, the driver's own when it can.
    assert pinned_node(actor_need(0.25, 0, {"rollout_node": 1})) == ray.get_runtime_context().get_node_id()
    with pytest.raises(PlacementError, match="cpu_node"):
        pinned_node(actor_need(0.25, 0, {"cpu_node": 1}))


@pytest.mark.slow
@pytest.mark.fault
def test_learner_with_resources_no_node_has_fails_within_the_deadline(kinds_ray, tiny_model_path):
    from deploy.learner_pool import LearnerPool

    cfg = ExperimentConfig()
    cfg.learner.resources = {"gpu_node": 1}
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="gpu_node 1"):
        LearnerPool().start(cfg, ModelSource(tiny_model_path), None, [], placement_timeout_s=2)
    assert time.monotonic() - t0 < 2 + POLL_S + CLUSTER_QUERY_MARGIN_S
    # (its pending actor was killed: nothing is left waiting for a node)


@pytest.mark.slow
@pytest.mark.fault
@pytest.mark.timeout(600)
def test_two_learner_ranks_meet_at_rank0s_node_with_the_shipped_model(kinds_ray, shipped_model, tiny_model_path,
                                                                     tmp_path, redis_url):
    from transformers import AutoModelForCausalLM

    from deploy.learner_pool import LearnerPool

    cfg = ExperimentConfig()
    cfg.run.output_dir = str(tmp_path / "run")
    cfg.learner.num_processes = 2
    cfg.learner.resources = {"learner_node": 1}
    cfg.stream.stream = "test:placement-learner"
    workers = LearnerPool()
    workers.start(cfg, shipped_model, redis_url, [])
    try:
        node = this_node()
        assert [n["node_id"] for n in workers.nodes] == [node["node_id"]] * 2
        # Every rank met at rank 0's node (its Ray IP), on one port.
        env = ray.get([w.__ray_call__.remote(lambda self: (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
                       for w in workers.ranks])
        assert env[0] == env[1] and env[0][0] == workers.nodes[0]["ip"] == node["ip"]
        # The weights each rank loaded are the original's, from this node's cache of the shipped files.
        want = _weights_digest(AutoModelForCausalLM.from_pretrained(tiny_model_path))
        got = ray.get([w.__ray_call__.remote(lambda self: _weights_digest(self.learner.trainer.engine.module))
                       for w in workers.ranks])
        assert got == [want, want]
        # An update that never ends (rank 0 waits for a stream nobody writes, without a timeout) is an error
        # naming the ranks and their nodes once the deadline has passed, not a hang.
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            workers.call("step", None, timeout_s=3)
        # the deadline, one more poll of the ranks' answers, and the message (their nodes are known already)
        assert time.monotonic() - t0 < 3 + CLUSTER_QUERY_MARGIN_S
        assert f"rank 0 on {node['ip']}" in str(err.value) and "rank 1 on" in str(err.value)
    finally:
        for w in workers.ranks:
            ray.kill(w)


@ray.remote(num_cpus=0)
class NoInference:
    """Stands in for the inference actors, which a rollout actor's constructor only requires to exist: this
    test plays nothing (generation across nodes is tests/system/test_multinode.py's)."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollout_actor_lands_by_resources_and_loads_the_shipped_tokenizer(kinds_ray, shipped_model,
                                                                         tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from actors.rollout import create_rollout_actor

    cfg = ExperimentConfig(env=EnvConfig(num_generated_games=6, instances_per_process=1),
                           rollout=RolloutConfig(group_size=1, groups_per_actor=1, cpus_per_actor=0.25,
                                                 resources={"rollout_node": 1}))
    cfg.run.output_dir = str(tmp_path / "run")
    cfg.model.path = "tiny"       # what a run's config says: the rollout side must not build it again
    actor = create_rollout_actor(cfg, "ro-placed", [NoInference.remote()], None, model=shipped_model)
    try:
        assert ray.get(actor.node.remote(), timeout=240) == this_node()
        deadline = time.monotonic() + 30      # it holds one (the resource view is refreshed asynchronously)
        while ray.available_resources().get("rollout_node") != KINDS["rollout_node"] - 1:
            assert time.monotonic() < deadline, ray.available_resources()
            time.sleep(0.2)
        path, ids = ray.get(actor.__ray_call__.remote(lambda self: (self.model_path, self.tokenizer.encode(SAMPLE))))
        assert Path(path).parent.name == CACHE_DIR_NAME and not (Path(path) / "model.safetensors").exists()
        assert ids == AutoTokenizer.from_pretrained(tiny_model_path).encode(SAMPLE)
        # What the driver publishes for `gigpo status`, and how it shows: the actor under its node.
        from deploy.control_channel import format_status
        from deploy.reports import placement_record
        from deploy.rollout_pool import RolloutRecord
        from deploy.system import System
        system = System(cfg)
        system.rollouts.actors["rollout-0"] = RolloutRecord("rollout-0", actor)
        system.refresh_placement(timeout_s=30)
        record = placement_record(system.refresh_placement())
        node = this_node()
        assert record == {"rollout-0": {"ip": node["ip"], "hostname": node["hostname"]}}
        assert f"  {node['ip']} ({node['hostname']})  rollout-0" in format_status({"placement": record})
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)


def test_status_groups_the_actors_by_node(redis_server):
    from common.stream.redis_client import connect
    from deploy.control_channel import format_status
    from deploy.control_channel import ControlChannel

    here = {"ip": "10.0.0.2", "hostname": "head"}
    there = {"ip": "10.0.0.3", "hostname": "gpu-1"}
    placement = {"learner-0": here, "inference-0": there, "inference-1": there,
                 **{f"rollout-{i}": there for i in range(6)}, "rollout-6": {"ip": None, "hostname": None}}
    channel = ControlChannel(connect(redis_server.url), "placement-demo")
    channel.publish_status({"run": "placement-demo", "state": "training", "placement": placement})
    text = format_status(channel.read_status())
    lines = text.splitlines()
    nodes = lines.index("nodes:")
    assert lines[nodes + 1].split() == ["10.0.0.2", "(head)", "learner-0"]
    assert lines[nodes + 2].split() == ["10.0.0.3", "(gpu-1)", "inference-0,", "inference-1,", "6", "rollout",
                                        "actors"]
    assert lines[nodes + 3].split() == ["not", "started", "yet", "rollout-6"]
    # A record without placement (a job started by an older version) shows no node section.
    assert "nodes:" not in format_status({"run": "x", "state": "training"})


@pytest.mark.slow
@pytest.mark.fault
def test_a_rollout_node_without_the_games_is_refused_in_one_line_naming_it(kinds_ray, tmp_path, monkeypatch):
    """env.source=data: a task on every node that can host a rollout actor looks for the games there, at the
    path every actor gets; a node without them refuses the run in one line naming the node (here the one
    node of this Ray: the driver's check alone would not see a worker node's disk)."""
    from deploy.preflight import PreflightError, check_rollout_nodes
    from env_servers.data import build_metadata
    from tests.support.alfworld_games import REAL_GAMES, SEEN_GAMES, extract_games

    cfg = ExperimentConfig(env=EnvConfig(source="data", train_split="valid_seen", eval_split="valid_unseen"),
                           rollout=RolloutConfig(resources={"rollout_node": 1}))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "empty"))
    with pytest.raises(PreflightError) as refused:
        check_rollout_nodes(cfg, timeout_s=120)
    node = this_node()
    assert str(refused.value).startswith(f"node {node['ip']} ({node['hostname']}), where rollout actors may run: "
                                         "env.source=data, but there are no ALFWorld games of split 'valid_seen' "
                                         f"under {tmp_path / 'empty' / 'json_2.1.1'}"), refused.value
    games = tmp_path / "alfworld"
    build_metadata(Path(extract_games(games, (*SEEN_GAMES, *REAL_GAMES))[0]).parents[2])
    monkeypatch.setenv("ALFWORLD_DATA", str(games))
    check_rollout_nodes(cfg, timeout_s=120)           # every such node has them: nothing to say
