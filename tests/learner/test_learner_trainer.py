"""The trainer and learner loop with real DeepSpeed (gloo, CPU), the tiny Qwen2 policy, and a real Redis.

Reference values are computed here with plain transformers + torch, independently of learner/."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import ExperimentConfig, LearnerConfig
from common.run_dir import PUSHED_VERSION
from common.stream.interface import InMemoryTrajectories
from common.weights.interface import InMemoryWeights
from learner.batching import build_batch
from learner.loop import Learner
from tests.support.synthetic import synthetic_groups
from learner.trainer import PolicyTrainer
from tests.support import learner_worker

# Every test here starts DeepSpeed (in this process or in learner processes of its own).
pytestmark = pytest.mark.slow


# What these tests leave at the config's defaults, passed explicitly: build_batch's invalid-action penalty,
# PolicyTrainer's settings from outside learner.* (dtype: each test's own).
DEFAULTS = ExperimentConfig()
PENALTY = DEFAULTS.rollout.invalid_action_penalty
TRAINER = {"head_dtype": DEFAULTS.model.head_dtype, "temperature": DEFAULTS.rollout.temperature,
           "seed": DEFAULTS.run.seed}


def _run_ranks(args: list[str], port: int, world: int = 2, timeout_s: float = 300) -> None:
    """Run tests/support/learner_worker.py with `args` as `world` torchrun-style ranks (one thread each); kill them
    all on failure."""
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).parents[1] / "support" / "learner_worker.py"), *args],
                              env=learner_worker.worker_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)


def _reference_loss(model_path: str, batch, s: LearnerConfig, weights: dict | None = None) -> tuple[float, float]:
    """Token-mean loss (PPO dual clip + k3 KL to the initial weights + entropy bonus) with plain
    transformers, one row at a time, in float64 from the logits on. weights: the policy's (by name), where
    it has moved away from the initial weights (the reference); else the initial ones."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model = reference
    if weights is not None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        missing, _ = model.load_state_dict(weights, strict=False)
        assert set(missing) <= {"lm_head.weight"}, missing         # tied to the embedding, named once

    def logits_of(net, p, r):
        ids = torch.tensor(np.concatenate([p, r]), dtype=torch.long)[None]
        return net(input_ids=ids).logits[0, len(p) - 1:len(p) + len(r) - 1].double()

    def logprobs(logits, r):
        return logits[torch.arange(len(r)), torch.tensor(r, dtype=torch.long)] - torch.logsumexp(logits, -1)

    total, ent_total, count = 0.0, 0.0, 0
    with torch.no_grad():
        for p, r, old, a in zip(batch.prompt_ids, batch.response_ids, batch.old_logprobs, batch.advantages):
            logits = logits_of(model, p, r)
            logz = torch.logsumexp(logits, -1)
            lp = logprobs(logits, r)
            ent = logz - (torch.softmax(logits, -1) * logits).sum(-1)
            ratio = torch.exp(lp - torch.tensor(old, dtype=torch.float64))
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - s.clip_ratio, 1 + s.clip_ratio))
            if a < 0:
                pg = torch.minimum(pg, torch.full_like(pg, -s.dual_clip * a))
            log_ratio = logprobs(logits_of(reference, p, r), r) - lp     # k3, clamped as the paper's code
            kl = torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
            total += float((pg + s.kl_coef * kl - s.entropy_coef * ent).sum())
            ent_total += float(ent.sum())
            count += len(r)
    return total / count, ent_total / count


@pytest.fixture(scope="module")
def fixed_batch():
    return build_batch(synthetic_groups(6, 4, vocab_size=1000, seed=11), LearnerConfig(),
                       invalid_action_penalty=PENALTY)


def test_loss_on_fixed_batch_equals_plain_torch(tiny_model_path, fixed_batch):
    # One mini-batch, several micro-batches: the reported loss is that of the initial weights.
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=1024, micro_batch_tokens=300, lr=1e-3)
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        m = trainer.train_step(fixed_batch, update=0).metrics
    finally:
        trainer.close()
    loss, entropy = _reference_loss(tiny_model_path, fixed_batch, cfg)
    assert m["train/optimizer_steps"] == 1
    assert m["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert m["train/entropy"] == pytest.approx(entropy, rel=1e-5)
    assert 0 < m["train/clip_frac"] < 1           # random behaviour log-probs: the clip is active
    assert m["train/response_tokens"] == fixed_batch.response_lengths().sum()
    # Utilization: one pass, one process, no recompute: the FLOPs credited are one training pass over every
    # row and the reference model's forward pass (learner.kl_coef > 0 by default; learner/utilization.py),
    # and the share is of the same process's peak.
    sizes = PolicyTrainer._row_sizes(fixed_batch, np.arange(fixed_batch.num_rows))
    flops = trainer.shape.train_flops(*sizes) + (trainer.shape.forward_flops(*sizes) if cfg.kl_coef > 0 else 0)
    assert m["perf/model_flops_per_s"] * m["time/train_s"] == pytest.approx(flops, rel=1e-12)
    assert m["perf/matmul_peak_share"] == pytest.approx(m["perf/model_flops_per_s"] / m["perf/matmul_peak_flops_per_s"])
    assert 0 <= m["perf/padding_share"] < 1


def test_the_kl_term_weighs_into_the_loss_as_in_plain_torch(tiny_model_path, fixed_batch):
    """learner.kl_coef > 0 once the policy has moved from the reference (one update at a large learning
    rate): the second update's loss is plain torch's PPO loss + kl_coef x the k3 KL to the initial model.
    The KL term is ~1e3 times the tolerance (float32 learner against a float64 reference from the same
    float32 logits: ~1e-6 relative), so a wrong weight or a missing term fails."""
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=1024, micro_batch_tokens=300, lr=1e-2, kl_coef=0.5)
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        trainer.train_step(fixed_batch, update=0)
        weights = {name: t.detach().clone() for name, t in trainer.named_weights()}
        m = trainer.train_step(fixed_batch, update=1).metrics
    finally:
        trainer.close()
    loss, _ = _reference_loss(tiny_model_path, fixed_batch, cfg, weights=weights)
    without_kl, _ = _reference_loss(tiny_model_path, fixed_batch, LearnerConfig(**{**cfg.__dict__, "kl_coef": 0.0}),
                                    weights=weights)
    assert m["train/kl"] > 0 and abs(loss - without_kl) > 1e3 * 1e-5 * abs(loss), (m["train/kl"], loss, without_kl)
    assert m["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)


def test_update_moves_logprobs_with_the_sign_of_the_advantage(tiny_model_path):
    batch = build_batch(synthetic_groups(6, 4, vocab_size=1000, seed=11), LearnerConfig(),
                        invalid_action_penalty=PENALTY)
    batch.advantages = np.where(np.arange(batch.num_rows) % 2 == 0, 1.0, -1.0)
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=1024, micro_batch_tokens=600, lr=3e-4, kl_coef=0.0,
                        entropy_coef=0.0, recompute_old_logprobs=True)
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        before = trainer.compute_logprobs(batch)
        m = trainer.train_step(batch, update=0).metrics
        after = trainer.compute_logprobs(batch)
    finally:
        trainer.close()
    assert m["train/clip_frac"] == 0.0 and abs(m["train/ratio"] - 1) < 1e-5   # on-policy start
    delta = np.array([float(np.mean(a - b)) for a, b in zip(after, before)])
    pos, neg = delta[batch.advantages > 0], delta[batch.advantages < 0]
    assert pos.mean() > 0 > neg.mean()
    assert np.mean(pos > 0) > 0.8 and np.mean(neg < 0) > 0.8


def test_trainable_layers_train_only_the_last_blocks_and_the_norm(tiny_model_path):
    """learner.trainable_layers=1 of the tiny model's 2: one step changes the last block and the final norm,
    and leaves the first block and the (tied) embeddings bit for bit as loaded."""
    batch = build_batch(synthetic_groups(2, 4, vocab_size=1000, seed=5), LearnerConfig(),
                        invalid_action_penalty=PENALTY)
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=1024, micro_batch_tokens=600, lr=1e-3, kl_coef=0.0,
                        trainable_layers=1)
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        before = {name: t.clone() for name, t in trainer.named_weights()}
        trainer.train_step(batch, update=0)
        changed = {name for name, t in trainer.named_weights() if not torch.equal(t, before[name])}
    finally:
        trainer.close()
    trainable = {name for name in before if name.startswith(("model.layers.1.", "model.norm."))}
    assert changed == trainable and trainable
    with pytest.raises(ValueError, match="the model has 2 layers"):
        PolicyTrainer(tiny_model_path, LearnerConfig(trainable_layers=3), dtype="float32", **TRAINER)


def test_lora_trains_the_adapters_against_the_base_model_and_checkpoints_them(tiny_model_path, fixed_batch,
                                                                              tmp_path):
    """learner.lora_rank=4: no reference copy; the first loss is the base model's (B starts at 0), the second
    is plain torch's with the merged weights the push sends and the KL to the initial model (as the full
    fine-tune's KL test, same tolerance; the adapted layers compute W x + s B A x, plain torch (W + s B A) x:
    ~1e-7 relative apart in float32); only the adapted layers' weights move; a checkpoint holds the
    adapters alone and brings them back, and a learner of other settings refuses it."""
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=1024, micro_batch_tokens=300, lr=1e-2, kl_coef=0.5,
                        lora_rank=4, lora_target_modules="q_proj,v_proj,down_proj")
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        assert trainer.ref_model is None
        initial = {name: t.clone() for name, t in trainer.named_weights()}
        first = trainer.train_step(fixed_batch, update=0).metrics
        weights = {name: t.clone() for name, t in trainer.named_weights()}
        second = trainer.train_step(fixed_batch, update=1).metrics
        path = trainer.save_checkpoint(tmp_path, {"policy_version": 2})
        final = {name: t.clone() for name, t in trainer.named_weights()}
    finally:
        trainer.close()
    assert first["train/loss"] == pytest.approx(_reference_loss(tiny_model_path, fixed_batch, cfg)[0],
                                                rel=1e-5, abs=1e-6)
    loss, _ = _reference_loss(tiny_model_path, fixed_batch, cfg, weights=weights)
    assert second["train/kl"] > 0 and second["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    moved = {name for name in initial if not torch.equal(initial[name], weights[name])}
    adapted = {name for name in initial if name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight"))}
    assert list(weights) == list(initial) and moved == adapted
    model_bytes = sum(t.numel() * t.element_size() for t in initial.values())
    saved = sum(f.stat().st_size for f in Path(path).rglob("*model_states.pt"))
    assert saved < model_bytes / 4, (saved, model_bytes)          # the adapters, not the base weights
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        assert trainer.load_checkpoint(tmp_path)["policy_version"] == 2
        for name, t in trainer.named_weights():
            assert torch.equal(t, final[name]), name
    finally:
        trainer.close()
    trainer = PolicyTrainer(tiny_model_path, LearnerConfig(**{**cfg.__dict__, "lora_rank": 0}), dtype="float32",
                            **TRAINER)
    try:
        with pytest.raises(ValueError, match="was trained with learner.lora_rank=4.*learner.lora_rank=0"):
            trainer.load_checkpoint(tmp_path)
    finally:
        trainer.close()


@pytest.mark.parametrize("recompute", [False, True], ids=["from-the-training-pass", "from-the-recompute"])
def test_the_log_prob_gap_is_measured_every_update_and_corrected(tiny_model_path, recompute):
    """A sampler that differs from the learner by a known amount: its log-probs are the learner's own minus
    0.3 nat on every token (it gave each sampled token e^-0.3 of the learner's probability). The update
    reports that gap whether the old log-probs are recomputed (every token) or not (the first mini-batch's
    forward pass, here the whole batch: one mini-batch); both forward passes compute the same float32 values
    up to summation order, ~1e-6. With tis at cap 1.2 every token's ratio e^0.3 = 1.35 is truncated; at cap 2
    none is."""
    batch = build_batch(synthetic_groups(2, 4, vocab_size=1000, seed=9), LearnerConfig(),
                        invalid_action_penalty=PENALTY)
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=1024, micro_batch_tokens=600, lr=1e-6, kl_coef=0.0,
                        recompute_old_logprobs=recompute)
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        own = trainer.compute_logprobs(batch)
        batch.old_logprobs = [lp - 0.3 for lp in own]
        m = trainer.train_step(batch, update=0).metrics
        assert m["train/logprob_gap_mean"] == pytest.approx(0.3, abs=1e-4)
        assert m["train/logprob_gap_max"] == pytest.approx(0.3, abs=1e-4) and m["train/logprob_gap_share"] == 1.0
        assert m["train/logprob_gap_kl"] == pytest.approx(math.exp(0.3) - 1 - 0.3, abs=1e-4)
        assert m["train/correction_share"] == 0.0
        for cap, share in ((1.2, 1.0), (2.0, 0.0)):
            trainer.cfg = LearnerConfig(**{**cfg.__dict__, "logprob_correction": "tis", "correction_cap": cap})
            own = trainer.compute_logprobs(batch)
            batch.old_logprobs = [lp - 0.3 for lp in own]
            result = trainer.train_step(batch, update=1)
            m = result.metrics
            assert m["train/correction_share"] == share and m["train/logprob_gap_mean"] == pytest.approx(0.3, abs=1e-4)
            np.testing.assert_allclose(np.concatenate(result.weights), min(cap, math.exp(0.3)), rtol=1e-5)
    finally:
        trainer.close()


def test_checkpoint_tag_loads_that_checkpoint_and_a_missing_tag_is_an_error(tiny_model_path, fixed_batch, tmp_path):
    cfg = LearnerConfig(zero_stage=2, mini_batch_rows=1024, micro_batch_tokens=600, lr=1e-3)
    weights = lambda t: {n: w.clone() for n, w in t.named_weights()}  # noqa: E731
    trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
    try:
        trainer.train_step(fixed_batch)
        first = trainer.save_checkpoint(tmp_path, {"policy_version": 1})
        w1 = weights(trainer)
        trainer.train_step(fixed_batch)
        trainer.save_checkpoint(tmp_path, {"policy_version": 2})
        w2 = weights(trainer)
    finally:
        trainer.close()
    assert any(not torch.equal(w1[n], w2[n]) for n in w1)
    for tag, want, version in ((Path(first).name, w1, 1), (None, w2, 2)):
        trainer = PolicyTrainer(tiny_model_path, cfg, dtype="float32", **TRAINER)
        try:
            state = trainer.load_checkpoint(tmp_path, tag=tag)
            assert state["policy_version"] == version and trainer.updates == version
            for n, w in weights(trainer).items():
                assert torch.equal(w, want[n]), (tag, n)
            if tag is None:
                with pytest.raises(FileNotFoundError, match="update_0000009.*update_0000001"):
                    trainer.load_checkpoint(tmp_path, tag="update_0000009")
        finally:
            trainer.close()
    # The learner resumes from run.resume_tag (what `gigpo eval --checkpoint DIR` sets).
    exp = learner_worker.learner_experiment("unused")
    exp.learner = cfg
    exp.run.resume_tag = Path(first).name
    learner = Learner(exp, tiny_model_path, checkpoint_dir=str(tmp_path), resume=True)
    try:
        assert learner.policy_version == 1
        for n, w in weights(learner.trainer).items():
            assert torch.equal(w, w1[n]), n
    finally:
        learner.close(checkpoint=False)
    # Read-only (what `gigpo eval` runs, maybe beside a run still training, which has pushed version 2):
    # the checkpoint's weights go out under its own version, and nothing is written into the run.
    (tmp_path / PUSHED_VERSION).write_text("2")
    weights_out = InMemoryWeights()
    learner = Learner(exp, tiny_model_path, publisher=weights_out, checkpoint_dir=str(tmp_path), resume=True,
                      read_only=True)
    try:
        # The (in-memory) inference side had no weights: the learner pushed the checkpoint's at start.
        assert learner.policy_version == 1 and [v for v, _ in weights_out.pushes] == [1]
        learner.publish_weights()
        version, pushed = weights_out.latest()
        assert version == 1 and len(weights_out.pushes) == 2 and all(torch.equal(w, w1[n]) for n, w in pushed.items())
        assert learner.save_checkpoint() is None
        with pytest.raises(RuntimeError, match="read-only"):
            learner.step([])
    finally:
        learner.close()
    assert (tmp_path / PUSHED_VERSION).read_text() == "2"
    assert sorted(p.name for p in tmp_path.glob("update_*")) == ["update_0000001", "update_0000002"]


def test_two_process_lora_learner_at_zero3_pushes_the_base_once_then_the_adapters(tiny_model_path, tmp_path,
                                                                                  redis_url, free_port):
    """LoRA at ZeRO-3, two ranks, adapters pushed alone: the first push sends the base model's weights too
    (the publisher says an actor lacks them), gathered whole across ranks and equal to the initial model's;
    every push sends the gathered adapters, which train."""
    from safetensors.torch import load_file

    from common.stream.redis_stream import TrajectoryStream

    cfg = learner_worker.learner_experiment("test:learner-zero3-lora")
    producer = TrajectoryStream(redis_url, cfg.stream, consumer_name="producer")
    for g in synthetic_groups(4, 3, vocab_size=1000, seed=37, max_steps=2):
        producer.publish(g)
    out = tmp_path / "z3"
    _run_ranks(["zero3", tiny_model_path, str(out), redis_url, cfg.stream.stream, str(tmp_path / "ck"), "2", "lora"],
               free_port())
    producer.close()
    pushed = out.parent / "z3.d"
    assert sorted(p.name for p in pushed.iterdir()) == ["v1", "v1-adapter.safetensors", "v2-adapter.safetensors"]
    base = {}
    for f in sorted((pushed / "v1").glob("*.safetensors")):
        base.update(load_file(str(f)))
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert set(base) == set(initial) and all(torch.equal(base[k], initial[k]) for k in initial)
    first, second = (load_file(str(pushed / f"v{v}-adapter.safetensors")) for v in (1, 2))
    hidden = initial["model.layers.0.self_attn.q_proj.weight"].shape[1]
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert first[name].shape == (4, hidden)                      # whole, not a rank's partition
    b = name.replace("lora_A", "lora_B")
    assert first[b].abs().sum() > 0 and not torch.equal(first[b], second[b])


# Agreement of one update done two ways (two processes vs one; ZeRO-3 vs ZeRO-2), weight by weight.
#
# Why not the log-probs or weights after an ordinary AdamW step, to a tolerance: AdamW's first step moves a
# weight by lr * g / (|g| + eps), with eps = 1e-8 that is ~lr * sign(g) whatever |g|. A gradient whose true
# value is 0 (k_proj's bias: the attention softmax ignores a shift shared by all keys) is rounding noise,
# and its step is +-lr depending on the order of a float32 sum. The map g -> step has slope 1/eps = 1e8
# there: no tolerance follows from the arithmetic (a guessed 2e-5 on the log-probs failed on some machines).
#
# So the comparison runs where the arithmetic gives a bound (learner_worker.train_config, ADAM_EPS):
# - one row per micro-batch, every run in processes of one thread: each row's forward and backward pass
#   is the same computation in both runs (the log-probs the update starts from are bitwise equal: checked);
# - loss * world_size / tokens and DeepSpeed's division by world_size scale by powers of two: exact;
# - no gradient clipping; AdamW with lr = 1 and eps = 1: its (bias-corrected) first step is
#   lr * g / (|g| + 1), 1-Lipschitz in g; weight decay scales the same weights by the same factor.
# The runs then differ only in the order in which float32 gradient terms are summed. Any order of summing
# n terms x_k is within gamma(n-1) * sum|x_k| of the exact sum (gamma(n) = n u / (1 - n u), u = 2^-24), so
# per weight |g1 - g2| <= 2 gamma(n-1) S, with S = sum of the terms' |x_k|. The step has ~10 roundings of
# its own in each run, relative to |step| <= lr |g| <= lr S, and the new weight one more, <= u |w|:
#     |w1 - w2| <= lr (2 gamma(n-1) + 20 u) S + u (|w1| + |w2|)
# Two processes vs one: the terms are the rows' gradients (n = rows, S = the worker's row_sums): each
# process sums its rows, then DeepSpeed adds the two sums. ZeRO-3 vs ZeRO-2: ZeRO-3 runs the backward of
# linear layers its own way, which sums over a row's token positions in another order; the terms are then
# the positions' (n = tokens, S = token_sums for linear and embedding weights; the norms' arithmetic is
# unchanged: row_sums).
# The metrics are float64 sums of the same per-row values in another order (error ~ rows * 2^-53 relative
# to their magnitudes: abs 1e-12 is ample); the gradient norm moves by at most the norm of the gradient
# difference plus its own float32 rounding (a cascade sum over ~6.6e5 squares: < 64 u relative, both runs).

U = 2.0 ** -24


def _gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _assert_same_update(a: dict, b: dict, sums: dict[str, torch.Tensor], terms: int) -> None:
    """a and b: learner_worker.train_once results of the same update; sums: S per weight; terms: n."""
    for ra, rb in zip(a["before"], b["before"]):
        assert np.array_equal(ra, rb), "the runs' rows are not the same computation: the bound does not apply"
    for k in ("train/loss", "train/pg_loss", "train/entropy", "train/clip_frac", "train/response_tokens"):
        assert a["metrics"][k] == pytest.approx(b["metrics"][k], rel=0, abs=1e-12), k
    grad_diff_norm = 2 * _gamma(terms - 1) * float(torch.sqrt(sum((s ** 2).sum() for s in sums.values())))
    assert abs(a["metrics"]["train/grad_norm"] - b["metrics"]["train/grad_norm"]) <= \
        grad_diff_norm + 64 * U * a["metrics"]["train/grad_norm"]
    assert a["weights"].keys() == b["weights"].keys() == sums.keys()
    lr = learner_worker.AGREEMENT_LR
    for name, wa in a["weights"].items():
        wa, wb = wa.double(), b["weights"][name].double()
        bound = lr * (2 * _gamma(terms - 1) + 20 * U) * sums[name] + U * (wa.abs() + wb.abs())
        excess = ((wa - wb).abs() - bound).max().item()
        assert excess <= 0, f"{name}: differs by {excess:.3g} more than the bound"


@pytest.fixture(scope="module")
def one_process_stage2(tiny_model_path, tmp_path_factory, free_port) -> dict:
    """One update of the fixed batch in a world of one at ZeRO-2, with the gradient terms' sums (shared by
    two tests). In a process of its own, like the runs it is compared with."""
    out = tmp_path_factory.mktemp("one") / "one.pt"
    _run_ranks(["train", tiny_model_path, str(out), "2"], free_port(), world=1)
    return torch.load(out, weights_only=False)


def test_zero_stage_2_and_3_agree(tiny_model_path, one_process_stage2, tmp_path, free_port):
    one = one_process_stage2
    # A process of its own also because ZeRO-3 replaces torch.nn.functional.linear for good.
    _run_ranks(["train", tiny_model_path, str(tmp_path / "z3.pt"), "3"], free_port(), world=1)
    three = torch.load(tmp_path / "z3.pt", weights_only=False)
    sums = {name: one["token_sums"].get(name, rows) for name, rows in one["row_sums"].items()}
    _assert_same_update(one, three, sums, terms=one["tokens"])


def test_two_learner_processes_agree_with_one(tiny_model_path, one_process_stage2, tmp_path, free_port):
    # Same token-mean gradient in both: a missing world-size factor would double or halve every step.
    one = one_process_stage2
    _run_ranks(["train", tiny_model_path, str(tmp_path / "two.pt"), "2"], free_port(), world=2)
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    _assert_same_update(one, two, one["row_sums"], terms=one["rows"])
    # Each process builds the grammar masks of its own rows only (the batch, plans and shares are fixed).
    assert 0 < two["masked_rows"] < one["masked_rows"]


def test_learner_reads_trains_pushes_and_commits_through_the_in_memory_interfaces(tiny_model_path):
    """The learner's two boundaries with their in-memory implementations (common.transport): it reads a
    batch from the trajectory source, trains, pushes the new version, and commits (acks) what it used;
    a group it already trained on, or one sampled too many versions ago, is skipped."""
    cfg = learner_worker.learner_experiment("unused")           # 2 groups per batch
    groups = synthetic_groups(3, 3, vocab_size=1000, seed=41, max_steps=2)
    # max_policy_lag 0: a group sampled by version 0 is stale once version 1 is out (the learner's read
    # policy judges it, learner/read_policy.py).
    cfg.stream.max_policy_lag = 0
    source, weights_out = InMemoryTrajectories(), InMemoryWeights()
    for g in groups[:2]:
        source.publish(g)
    learner = Learner(cfg, tiny_model_path, source, publisher=weights_out, checkpoint_dir="")
    try:
        assert [v for v, _ in weights_out.pushes] == [0]      # the initial weights, to actors that had none
        m = learner.step(timeout_s=5)
        assert m is not None and sorted(learner.last_group_ids) == sorted(g.group_id for g in groups[:2])
        assert weights_out.latest()[0] == learner.policy_version == 1
        assert source.depth() == 0 and source.stats["acked"] == 2
        source.publish(groups[0])                                # a duplicate of a trained group
        source.publish(groups[2])                                # sampled by version 0: stale now
        assert learner.step(timeout_s=0.5) is None               # nothing left to train on
        assert source.depth() == 0
        assert (source.stats["duplicates_skipped"], source.stats["dropped_stale"]) == (1, 1)
    finally:
        learner.close()


def test_a_lora_learner_pushes_the_adapters_alone_or_merged_weights_as_configured(tiny_model_path):
    """learner.lora_push=adapter: each push is the adapters in peft's format (the inference side serves them
    as a LoRA); merged: the whole weights under the plain model's names."""
    from peft import get_peft_model_state_dict

    groups = synthetic_groups(2, 3, vocab_size=1000, seed=43, max_steps=2)
    for how in ("adapter", "merged"):
        cfg = learner_worker.learner_experiment("unused")
        cfg.learner.lora_rank, cfg.learner.lora_target_modules, cfg.learner.lora_push = 4, "q_proj", how
        cfg.learner.lr = 1e-2
        weights_out = InMemoryWeights()
        learner = Learner(cfg, tiny_model_path, publisher=weights_out, checkpoint_dir="")
        try:
            assert learner.step(groups, timeout_s=5) is not None
            version, pushed = weights_out.latest()
            assert [v for v, _ in weights_out.pushes] == [0, 1] and version == 1
            if how == "adapter":
                adapter = pushed["adapter"]
                expected = get_peft_model_state_dict(learner.trainer.engine.module)
                assert sorted(adapter["tensors"]) == sorted(expected) and all(".lora_" in n for n in expected)
                assert all(torch.equal(adapter["tensors"][n], expected[n]) for n in expected)
                assert adapter["config"]["r"] == 4 and adapter["config"]["target_modules"] == ["q_proj"]
                assert any(t.abs().sum() > 0 for n, t in adapter["tensors"].items() if "lora_B" in n)  # trained
            else:
                assert "model.layers.0.self_attn.q_proj.weight" in pushed and not any(".lora_" in n for n in pushed)
        finally:
            learner.close()


def test_two_process_learner_at_zero3_reads_trains_pushes_and_acks(tiny_model_path, tmp_path, redis_url, free_port):
    """Rank 0 reads the stream and broadcasts the batch; both ranks train (ZeRO-3 partitions); the pushed
    weights are full tensors gathered across ranks; groups are acked once checkpointed."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from common.stream.redis_stream import TrajectoryStream

    cfg = learner_worker.learner_experiment("test:learner-zero3")
    groups = synthetic_groups(4, 3, vocab_size=1000, seed=31, max_steps=2)
    out = tmp_path / "z3"
    producer = TrajectoryStream(redis_url, cfg.stream, consumer_name="producer")
    for g in groups:
        producer.publish(g)
    _run_ranks(["zero3", tiny_model_path, str(out), redis_url, cfg.stream.stream, str(tmp_path / "ck"), "2"],
               free_port())
    assert producer.depth() == 0 and producer.pending() == 0
    producer.close()
    r0, r1 = (json.loads((tmp_path / f"z3.rank{r}.json").read_text()) for r in range(2))
    assert [u["train/loss"] for u in r0] == [u["train/loss"] for u in r1]
    assert [u["policy_version"] for u in r0] == [1, 2] and [u["checkpointed"] for u in r0] == [0, 1]
    assert sorted(g for u in r0 for g in u["groups"]) == sorted(g.group_id for g in groups)
    mcfg = AutoConfig.from_pretrained(tiny_model_path)
    pushed = {}
    for f in sorted((tmp_path / "z3.d" / "v2").glob("*.safetensors")):
        pushed.update(load_file(str(f)))
    assert pushed["model.embed_tokens.weight"].shape == (mcfg.vocab_size, mcfg.hidden_size)
    initial = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert set(pushed) <= set(initial)
    assert all(pushed[k].shape == initial[k].shape for k in pushed)
    assert not torch.equal(pushed["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])


def test_the_learner_keeps_the_newest_checkpoints(tiny_model_path, tmp_path):
    cfg = learner_worker.learner_experiment("unused")
    cfg.learner.checkpoint_every, cfg.learner.keep_checkpoints = 1, 1
    learner = Learner(cfg, tiny_model_path, checkpoint_dir=str(tmp_path), resume=False)
    try:
        for seed in (1, 2):
            assert learner.step(synthetic_groups(2, 3, vocab_size=1000, seed=seed, max_steps=2)) is not None
    finally:
        learner.close()
    assert [p.name for p in tmp_path.glob("update_*")] == ["update_0000002"]



def test_a_checkpoint_is_on_disk_before_save_returns_and_a_power_cut_anywhere_leaves_a_whole_one(
        tiny_model_path, tmp_path, fsynced, monkeypatch):
    """The learner acks (the stream deletes) a checkpoint's groups once save_checkpoint returns: by then every
    file and directory of the checkpoint is fsynced, its completion mark (LEARNER_STATE) is written durably, and
    `latest` names it, written durably after the mark (a save cut short leaves `latest` at the previous one).

    Then a power cut is emulated at every point of the second of two saves (issue 64): the disk as it would be
    if the machine stopped there, at its worst: every file and rename done by then is there, but a file whose
    data was not yet fsynced is empty. Whatever that disk holds, the checkpoint a resume takes
    (common.run_dir.resume_point) is whole: the first one, or from the point `latest` names it, the second."""
    import os
    import shutil

    from common.run_dir import LATEST, LEARNER_STATE, resume_point

    real_replace = os.replace

    def recording_replace(src, dst):          # the renames, in order among the fsyncs (a string of its own)
        fsynced.append(f"rename {src} {dst}")
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", recording_replace)
    root = tmp_path / "ckpt"
    trainer = PolicyTrainer(tiny_model_path, LearnerConfig(zero_stage=2), dtype="float32", **TRAINER)
    try:
        first = Path(trainer.save_checkpoint(root, {"policy_version": 0}))
        fsynced.clear()
        trainer.updates = 1                   # a second checkpoint of the same weights, under the next tag
        tag = Path(trainer.save_checkpoint(root, {"policy_version": 1}))
    finally:
        trainer.close()
    events = list(fsynced)
    syncs = [e for e in events if not e.startswith("rename ")]
    # DeepSpeed's files under their names; the mark and `latest` under their temporary names (then the rename
    # and the directory's fsync).
    written = {str(p) for p in tag.rglob("*") if p.name != LEARNER_STATE} | {str(tag), str(root)}
    assert written <= set(syncs), written - set(syncs)
    temps = [Path(p).name for p in syncs if p.endswith(".tmp")]
    assert [t.split(".")[1] for t in temps] == [LEARNER_STATE.split(".")[0], LATEST]
    assert (root / LATEST).read_text() == tag.name and (tag / LEARNER_STATE).is_file()

    whole = {p: p.read_bytes() for p in tag.rglob("*") if p.is_file()}
    taken = []
    for cut in range(len(events) + 1):
        disk = tmp_path / f"cut{cut}"
        shutil.copytree(root, disk)
        happened, durable = events[:cut], set()
        for event in happened:                # data fsynced under a temporary name moves with its rename
            if event.startswith("rename "):
                src, dst = event.split()[1:]
                durable |= {dst} if src in durable else set()
            else:
                durable.add(event)
        for event in events[cut:]:            # renames not done yet: the new name is not there
            if event.startswith("rename "):
                dst = Path(event.split()[2])
                (disk / dst.relative_to(root)).unlink()
                if dst.name == LATEST:
                    (disk / LATEST).write_text(first.name)
        for path in whole:                    # files written, their data not yet on disk: empty
            copy = disk / path.relative_to(root)
            if copy.exists() and str(path) not in durable:
                copy.write_bytes(b"")
        found, _ = resume_point(disk)
        taken.append(found.name)
        if found.name == tag.name:
            assert all((disk / p.relative_to(root)).read_bytes() == data for p, data in whole.items()), cut
    # The first checkpoint until `latest` is renamed into place (after the second's mark), the second from there.
    named = events.index(next(e for e in events if e.startswith("rename ") and e.endswith(f"/{LATEST}")))
    assert taken == [first.name] * (named + 1) + [tag.name] * (len(events) - named), taken


def test_head_dtype_float32_gives_float32_logits_of_the_bf16_hidden_state_and_trains_the_head(tiny_model_path):
    """model.head_dtype=float32 on bf16 weights: the logits are the float32 product of the bf16 final hidden
    state and the bf16 head weight, both cast up (what vLLM's head_dtype override computes), not bf16-rounded
    logits; the bf16 weight still gets its gradient; and the trainer sets it on its model and reference."""
    from transformers import AutoModelForCausalLM

    from learner.trainer import project_head_in_float32

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    ids = torch.arange(1, 33).unsqueeze(0)
    plain = model(input_ids=ids).logits
    hidden = model.model(input_ids=ids).last_hidden_state
    project_head_in_float32(model)
    logits = model(input_ids=ids).logits
    weight = model.get_output_embeddings().weight
    assert plain.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(hidden.float(), weight.float()))
    assert not torch.equal(logits, plain.float())          # bf16's rounding of the logits is gone
    logits.logsumexp(-1).sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16 and weight.grad.abs().sum() > 0

    trainer = PolicyTrainer(tiny_model_path, LearnerConfig(kl_coef=0.01), dtype="bfloat16",
                            **dict(TRAINER, head_dtype="float32"))
    try:
        probe = torch.zeros(1, hidden.shape[-1], dtype=torch.bfloat16)
        for m in (trainer.engine.module, trainer.ref_model):
            assert m.get_output_embeddings()(probe).dtype == torch.float32
    finally:
        trainer.close()
