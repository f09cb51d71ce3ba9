"""The packed layout (learner.pack_rows: batching.collate_packed, learner/packing.py) against the padded one:
the same log-probs and gradients of the trainer's loss, on the tiny model and on SmolLM2-135M's shape
(random weights), the same training step, and no attention across the rows of a pack.

The bound. Both layouts compute the same function of the same float32 numbers; they differ in the order
of float32 sums (the attention over a row's keys is blocked differently once its left padding is gone; a
matrix product over another number of rows may take another kernel path). Each result x32 of a layout lies
within its rounding error of the exact value x, so |x_packed - x_padded| <= e_packed + e_padded. The
padded layout's error is measured here: e = max |x_padded32 - x| over the tokens (or weights), x computed
the same way by a float64 copy of the model (float64 up to the logits, whose log-softmax is float32 in every
run: token_logprobs_and_entropy), and at least one float32 ulp of the largest |x| (the last rounding
alone). The packed layout does
the same operations on the same numbers, so its error is of the same size but another draw: allowed up to
3e (a maximum over other tokens; ulp-sized errors are 1, 2 or 3 ulps), hence
    |x_packed32 - x| <= 3e    and    |x_packed32 - x_padded32| <= 4e.
A row attending to another moves its log-probs by O(0.1) nat, while e is ~1e-6 (asserted below 1e-4).
"""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from common.config import ExperimentConfig, LearnerConfig
from learner.batching import TrainBatch, build_batch, collate, collate_packed, pack_by_tokens, plan_micro_batches
from learner.gigpo import LossSettings, policy_loss
from learner.packing import PACKED_SDPA, packed_logits, use_packed_attention
from learner.trainer import response_logprobs
from tests.support.model_shapes import SMOLLM2_135M, random_causal_lm
from tests.support.synthetic import synthetic_groups

DEFAULTS = ExperimentConfig()
PENALTY = DEFAULTS.rollout.invalid_action_penalty
TEMPERATURE = DEFAULTS.rollout.temperature
U = 2.0 ** -24


def _settings(cfg: LearnerConfig) -> LossSettings:
    return LossSettings(clip_ratio=cfg.clip_ratio, dual_clip=cfg.dual_clip, kl_coef=cfg.kl_coef,
                        entropy_coef=cfg.entropy_coef)


def _loss_and_gradient(model, batch: TrainBatch, packed: bool, budget: int, cfg: LearnerConfig
                       ) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """The trainer's loss of one mini-batch of every row in a world of one (PolicyTrainer._train_micro's,
    with the old and reference log-probs the policy's own, as at a first update with a recompute), in the
    given layout: the log-probs of every response token in the batch's row order (float64) and every
    parameter's gradient."""
    model.zero_grad(set_to_none=True)
    plan = plan_micro_batches(batch, np.arange(batch.num_rows), budget, packed=packed)
    per_row: dict[int, np.ndarray] = {}
    for rows in plan.per_rank[0]:
        mb = collate_packed(batch, rows) if packed else collate(batch, rows)
        logp, entropy = response_logprobs(model, mb, TEMPERATURE, with_entropy=True)
        old = logp.detach()
        loss, _ = policy_loss(logp, old, mb.advantages, mb.loss_mask, _settings(cfg), token_normalizer=1.0,
                              ref_logp=old, entropy=entropy, weights=mb.weights)
        (loss / plan.response_tokens).backward()
        sizes = [len(batch.response_ids[r]) for r in mb.rows]
        per_row.update({int(r): part.double().numpy() for r, part in zip(mb.rows, old.split(sizes))})
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return np.concatenate([per_row[r] for r in range(batch.num_rows)]), grads


def _rounding_error(padded32: np.ndarray, exact: np.ndarray) -> float:
    """e of the module's bound: the padded float32 result's error, at least one ulp of the largest value."""
    return max(float(np.abs(padded32 - exact).max()), float(np.spacing(np.float32(np.abs(exact).max()))))


def _assert_agree(packed32: np.ndarray, padded32: np.ndarray, exact: np.ndarray, what: str) -> float:
    e = _rounding_error(padded32, exact)
    assert np.abs(packed32 - exact).max() <= 3 * e, f"{what}: the packed layout is less exact than the padded"
    assert np.abs(packed32 - padded32).max() <= 4 * e, f"{what}: the layouts differ by more than 4e = {4 * e:.3g}"
    return e


def _with_grammar_masks(batch: TrainBatch, vocab: int, seed: int) -> TrainBatch:
    """A copy of `batch` with `allowed_bits` for every row: half the rows masked to a random ~half of the
    vocabulary (their own tokens included), the others allowed everything (an unconstrained row's mask)."""
    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    bits = []
    for r, response in enumerate(batch.response_ids):
        allowed = rng.random((len(response), words * 32)) < 0.5 if r % 2 else np.ones((len(response), words * 32), bool)
        allowed[np.arange(len(response)), response] = True
        bits.append(np.packbits(allowed, axis=1, bitorder="little").view(np.int32))
    return replace(batch, allowed_bits=bits)


def _models(model32):
    """The float32 model and its float64 copy, both taking packed micro-batches."""
    model64 = copy.deepcopy(model32).double()
    for m in (model32, model64):
        use_packed_attention(m)
    return model32, model64


@pytest.fixture(scope="module")
def tiny_models(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return _models(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval())


def _batch(vocab: int, groups: int, seed: int, group_size: int = 4) -> TrainBatch:
    batch = build_batch(synthetic_groups(groups, group_size, vocab_size=vocab, seed=seed), LearnerConfig(),
                        invalid_action_penalty=PENALTY)
    return _with_grammar_masks(batch, vocab, seed)


@pytest.mark.parametrize("shape", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_packed_and_padded_log_probs_and_gradients_agree(shape, request):
    """The trainer's loss over several micro-batches in each layout (different groupings: the padded budget
    counts rows x longest, the packed one the rows' sum), grammar masks on half the rows."""
    if shape == "tiny":
        model32, model64 = request.getfixturevalue("tiny_models")
        batch, budget = _batch(1000, 4, seed=5), 300
    else:     # 135M parameters in float64 too: a few rows
        model32, model64 = _models(random_causal_lm(SMOLLM2_135M, seed=0))
        batch, budget = _batch(SMOLLM2_135M["vocab_size"], 1, seed=8, group_size=2), 120
    cfg = LearnerConfig()
    exact_logp, exact_grads = _loss_and_gradient(model64, batch, False, budget, cfg)
    padded_logp, padded_grads = _loss_and_gradient(model32, batch, False, budget, cfg)
    packed_logp, packed_grads = _loss_and_gradient(model32, batch, True, budget, cfg)
    assert len(packed_logp) == batch.response_lengths().sum()
    e = _assert_agree(packed_logp, padded_logp, exact_logp, "log-probs")
    assert e < 1e-4
    names = sorted(exact_grads)
    assert sorted(packed_grads) == sorted(padded_grads) == names
    flat = lambda grads: torch.cat([grads[n].double().flatten() for n in names]).numpy()  # noqa: E731
    exact, padded, packed = flat(exact_grads), flat(padded_grads), flat(packed_grads)
    _assert_agree(packed, padded, exact, "gradients")
    # The same argument for the whole vector's error, in norm (a steadier figure than the largest element).
    assert np.linalg.norm(packed - padded) <= 4 * np.linalg.norm(padded - exact)



def _train_steps(model, batch: TrainBatch, packed: bool, budget: int, cfg: LearnerConfig, steps: int
                 ) -> tuple[list[np.ndarray], np.ndarray]:
    """`steps` optimizer steps on a copy of `model`, every row of `batch` in each (ppo_epochs passes over one
    update's rows), the way PolicyTrainer steps on one process: each micro-batch's loss summed over the
    mini-batch's response tokens, the gradient's norm clipped to cfg.grad_clip, AdamW with cfg's lr and
    weight decay (in the model's dtype). The old and reference log-probs are the batch's, fixed (the behaviour
    policy's), so the PPO ratio moves away from 1 and its clip binds as the steps go. Returns the response
    tokens' log-probs (float64, the batch's row order) before every step and after the last, and the final
    weights as one float64 vector."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    plan = plan_micro_batches(batch, np.arange(batch.num_rows), budget, packed=packed)
    trajectory = []
    for _ in range(steps + 1):
        optimizer.zero_grad(set_to_none=True)
        per_row: dict[int, np.ndarray] = {}
        for rows in plan.per_rank[0]:
            mb = collate_packed(batch, rows) if packed else collate(batch, rows)
            logp, entropy = response_logprobs(model, mb, TEMPERATURE, with_entropy=True)
            loss, _ = policy_loss(logp, mb.old_logprobs, mb.advantages, mb.loss_mask, _settings(cfg),
                                  token_normalizer=1.0, ref_logp=mb.old_logprobs, entropy=entropy,
                                  weights=mb.weights)
            if len(trajectory) < steps:
                (loss / plan.response_tokens).backward()
            sizes = [len(batch.response_ids[r]) for r in mb.rows]
            per_row.update({int(r): part.double().numpy() for r, part in zip(mb.rows, logp.detach().split(sizes))})
        trajectory.append(np.concatenate([per_row[r] for r in range(batch.num_rows)]))
        if len(trajectory) <= steps:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
    return trajectory, torch.cat([p.detach().double().flatten() for p in params]).numpy()


def test_several_training_steps_packed_and_padded_stay_within_rounding(tiny_models):
    """Learning, not one step: eight AdamW steps at configs/embedded.yaml's learning rate (what the tiny-model
    studies train with), each layout, against the same steps in float64. Every float32 run drifts from the
    float64 one by its roundings, amplified by the same training dynamics; the padded layout's drift, taken
    over three micro-batch budgets (three orders of the same sums: what reordering alone does), is the yardstick.
    The packed run, whose only difference is another order of sums, must stay within 3x that drift of the exact
    trajectory at every step, in the log-probs (what sampling sees) and in the final weights, while the steps
    themselves move the log-probs by far more than any drift (the test sees learning, not noise)."""
    model32, model64 = tiny_models
    cfg = replace(LearnerConfig(), lr=3e-4)         # configs/embedded.yaml's; the rest the config's defaults
    steps, budget = 8, 300
    # One thread: the same arithmetic for every run compared, ~10 s in all; two threads on cores other work
    # keeps busy stall in each other's spin-waits (tens of times slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_several_steps(model32, model64, cfg, steps, budget)
    finally:
        torch.set_num_threads(threads)


def _compare_several_steps(model32, model64, cfg: LearnerConfig, steps: int, budget: int) -> None:
    batch = _batch(1000, 4, seed=5)
    # The behaviour policy: the start's own log-probs (float64 model), as a sampler's would be, stored float32.
    start, _ = _train_steps(model64, batch, False, budget, cfg, steps=0)
    sizes = np.cumsum(batch.response_lengths())[:-1]
    batch = replace(batch, old_logprobs=[part.astype(np.float32) for part in np.split(start[0], sizes)])

    exact, w_exact = _train_steps(model64, batch, False, budget, cfg, steps)
    padded = {b: _train_steps(model32, batch, False, b, cfg, steps) for b in (budget, budget // 2, 4 * budget)}
    packed, w_packed = _train_steps(model32, batch, True, budget, cfg, steps)

    for k in range(steps + 1):
        drift = max(np.linalg.norm(run[k] - exact[k]) for run, _ in padded.values())
        assert np.linalg.norm(packed[k] - exact[k]) <= 3 * drift, f"log-probs after {k} steps"
    learned = np.linalg.norm(exact[-1] - exact[0])
    assert learned > 1000 * max(np.linalg.norm(run[-1] - exact[-1]) for run, _ in padded.values())
    w_drift = max(np.linalg.norm(w - w_exact) for _, w in padded.values())
    assert np.linalg.norm(w_packed - w_exact) <= 3 * w_drift


def test_rows_of_a_pack_do_not_see_each_other(tiny_models):
    """Row C's log-probs in a pack [A, B, C] stay when B is replaced by other tokens of another length (within
    the module's bound); with one bound around the whole pack (attention across rows) they move by far more."""
    model32, model64 = tiny_models
    batch = _batch(1000, 2, seed=7)
    a, b, c = 0, 1, 2
    rng = np.random.default_rng(0)
    other = replace(batch, prompt_ids=list(batch.prompt_ids))
    other.prompt_ids[b] = rng.integers(1, 1000, len(batch.prompt_ids[b]) + 9).astype(np.int32)
    rows = np.array([a, b, c])
    with torch.no_grad():
        logp = {name: response_logprobs(model32, collate_packed(chosen, rows), TEMPERATURE)[0].double().numpy()
                for name, chosen in (("before", batch), ("after", other))}
        padded = response_logprobs(model32, collate(batch, rows), TEMPERATURE)[0].double().numpy()
        exact = response_logprobs(model64, collate(batch, rows), TEMPERATURE)[0].double().numpy()
        merged = collate_packed(other, rows)
        merged.row_bounds, merged.longest_row = merged.row_bounds[[0, -1]], merged.input_ids.shape[1]
        leaked = response_logprobs(model32, merged, TEMPERATURE)[0].double().numpy()
    e = _rounding_error(padded, exact)
    n_a, n_c = len(batch.response_ids[a]), len(batch.response_ids[c])
    for name, part in (("A", slice(0, n_a)), ("C", slice(-n_c, None))):
        assert np.abs(logp["after"][part] - logp["before"][part]).max() <= 4 * e, name
    assert np.abs(leaked[-n_c:] - logp["after"][-n_c:]).max() > 1000 * 4 * e


def test_packed_micro_batch_layout():
    """One sequence, positions restarting per row, the logits' positions just before each response token,
    the per-token tensors as the padded layout's (the flat row-major order the loss reads)."""
    batch = _batch(1000, 2, seed=4)
    rows = np.array([3, 0, 5])
    mb, padded = collate_packed(batch, rows), collate(batch, rows)
    lengths = batch.row_lengths()[rows]
    assert mb.packed and not padded.packed and mb.input_ids.shape == (1, lengths.sum())
    assert mb.row_bounds.tolist() == [0, *np.cumsum(lengths).tolist()]
    assert mb.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    assert torch.equal(mb.input_ids[0, mb.logit_positions + 1], mb.targets)
    for name in ("targets", "old_logprobs", "advantages", "loss_mask", "weights", "allowed_bits"):
        assert torch.equal(getattr(mb, name), getattr(padded, name)), name
    assert int(mb.attention_mask.sum()) == mb.input_ids.numel() == lengths.sum()


def test_packed_budget_bounds_the_rows_sum():
    batch = _batch(1000, 6, seed=2)
    lengths = batch.row_lengths()
    rows = np.arange(batch.num_rows)
    budget = 300
    packs = pack_by_tokens(rows, lengths, budget, packed=True)
    assert sorted(np.concatenate(packs).tolist()) == rows.tolist()
    assert all(lengths[p].sum() <= budget or len(p) == 1 for p in packs)
    # Filled: the next pack's first row would not have fitted.
    assert all(lengths[p].sum() + lengths[q[0]] > budget for p, q in zip(packs, packs[1:]))


def test_a_packed_micro_batch_needs_the_packed_attention(tiny_model_path):
    """A model whose attention ignores the rows' bounds is refused, not run."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    batch = _batch(1000, 1, seed=1)
    with pytest.raises(ValueError, match=PACKED_SDPA):
        packed_logits(model, collate_packed(batch, np.array([0, 1])), "cpu")


# -- one training step, each layout (DeepSpeed) --------------------------------------------------------------

@pytest.mark.slow
def test_a_training_step_with_packing_gives_the_same_update(tiny_model_path, tiny_models):
    """PolicyTrainer with learner.pack_rows on and off, on the same batch (grammar masks built by the trainer
    on half the rows, the KL term's reference model, the recompute of the old log-probs), with the settings of
    tests/learner/test_learner_trainer.py's agreement tests: AdamW with lr = 1 and eps = 1 and no clipping,
    whose first step lr * g / (|g| + eps) is 1-Lipschitz in g. The recomputed log-probs agree within the
    module's bound; each weight within G + 20u + u(|w1| + |w2|) (the step's own roundings, and the new
    weight's), G = 4e of the loss's gradient (e: the padded float32 gradient's largest error against the float64
    one, as in the module's bound)."""
    from learner.trainer import PolicyTrainer
    from tests.support.learner_worker import ADAM_EPS, AGREEMENT_LR, TRAINER, agreement_batch

    batch = agreement_batch(tiny_model_path)
    cfg = LearnerConfig(zero_stage=2, lr=AGREEMENT_LR, grad_clip=0.0, mini_batch_rows=1024, micro_batch_tokens=300,
                        recompute_old_logprobs=True)
    runs = {}
    for packed in (False, True):
        trainer = PolicyTrainer(tiny_model_path, replace(cfg, pack_rows=packed), dtype="float32", **TRAINER)
        try:
            for group in trainer.engine.optimizer.param_groups:
                group["eps"] = ADAM_EPS
            result = trainer.train_step(batch, update=0)
            runs[packed] = (result, {n: w.double().clone() for n, w in trainer.named_weights()})
        finally:
            trainer.close()
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    assert packed.metrics["perf/padding_share"] == 0.0 < padded.metrics["perf/padding_share"]
    assert packed.metrics["train/response_tokens"] == padded.metrics["train/response_tokens"]
    assert sum(bits is not None for bits in packed.allowed_bits) == batch.num_rows
    for a, b in zip(packed.allowed_bits, padded.allowed_bits):
        assert np.array_equal(a, b)

    model32, model64 = tiny_models
    masked = replace(batch, allowed_bits=padded.allowed_bits)
    exact_logp, exact_grads = _loss_and_gradient(model64, masked, False, cfg.micro_batch_tokens, cfg)
    padded_logp, padded_grads = _loss_and_gradient(model32, masked, False, cfg.micro_batch_tokens, cfg)
    # The trainer's recompute, each layout: within the bound of this batch's log-probs.
    e = _rounding_error(padded_logp, exact_logp)
    recomputed = {packed: np.concatenate(result.learner_logprobs).astype(np.float64)
                  for packed, (result, _) in runs.items()}
    assert np.abs(recomputed[True] - recomputed[False]).max() <= 4 * e
    assert np.abs(recomputed[False] - padded_logp).max() <= 4 * e      # the trainer computes what the test does
    grad_error = max(float((padded_grads[n].double() - exact_grads[n]).abs().max()) for n in exact_grads)
    bound_g = 4 * grad_error
    assert w_packed.keys() == w_padded.keys()
    for name, w1 in w_packed.items():
        w2 = w_padded[name]
        bound = AGREEMENT_LR * (bound_g + 20 * U) + U * (w1.abs() + w2.abs())
        excess = ((w1 - w2).abs() - bound).max().item()
        assert excess <= 0, f"{name}: differs by {excess:.3g} more than the bound"
