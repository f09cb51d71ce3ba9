"""The learner scores a constrained response under the distribution it was sampled from: the model's, over
the tokens the action grammar allowed at each position (learner/grammar_mask.py). Checked against a brute
force reading of the grammar (every token whose text keeps the response a prefix of an allowed string), by
hand on the log-softmax, and through the trainer from records to log-probs. vLLM's side (its log-probs of
constrained samples equal these): tests/actors/test_inference.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.prompts.shared import action_regex
from common.config import ExperimentConfig, LearnerConfig
from common.stream.records import EpisodeGroup, StepRow, Trajectory
from learner.batching import build_batch
from learner.gigpo import token_logprobs_and_entropy
from learner.grammar_mask import GrammarMasks, allowed_tokens

# What these tests leave at the config's defaults, passed explicitly: build_batch's invalid-action penalty,
# PolicyTrainer's settings from outside learner.* (dtype: each test's own).
DEFAULTS = ExperimentConfig()
PENALTY = DEFAULTS.rollout.invalid_action_penalty
TRAINER = {"head_dtype": DEFAULTS.model.head_dtype, "temperature": DEFAULTS.rollout.temperature,
           "seed": DEFAULTS.run.seed}

ACTIONS = ["go to cabinet 1", "go to cabinet 2", "take mug 1 from desk 2", "look"]
ANSWERS = [f"<think></think> <action>{a}</action>" for a in ACTIONS]   # what action_regex(ACTIONS, 0) allows


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoConfig, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    vocab_size = AutoConfig.from_pretrained(tiny_model_path).vocab_size     # the logits' width, as the trainer
    return tiny_model_path, tokenizer, GrammarMasks(tiny_model_path, vocab_size), vocab_size


def _response(tokenizer, answer: str) -> np.ndarray:
    return np.array(tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id])


def test_allowed_tokens_are_the_grammars_continuations(tiny):
    """At each position: the tokens whose text keeps the response a prefix of an allowed answer, or, once
    the answer is complete, the end-of-sequence token; the sampled token is always among them, and where
    only one is allowed its log-prob is 0 (a forced token, left out of the loss)."""
    _, tokenizer, masks, vocab_size = tiny
    pieces = [tokenizer.decode([t]) for t in range(len(tokenizer))]
    rejected_before = masks.mismatched_rows       # (the fixture is shared: count this test's rows only)
    for answer in ANSWERS:
        response = _response(tokenizer, answer)
        allowed = allowed_tokens(torch.from_numpy(masks.row(action_regex(ACTIONS, 0), response)), vocab_size)
        for i, token in enumerate(response.tolist()):
            prefix = tokenizer.decode(response[:i].tolist())
            expected = ({tokenizer.eos_token_id} if prefix in ANSWERS else
                        {t for t, s in enumerate(pieces) if s and any(a.startswith(prefix + s) for a in ANSWERS)})
            assert set(allowed[i].nonzero().flatten().tolist()) == expected, (answer, i, prefix)
            assert allowed[i, token]
    assert masks.mismatched_rows == rejected_before


def test_no_grammar_allows_everything_and_a_rejected_response_is_unconstrained_from_there(tiny):
    _, tokenizer, masks, vocab_size = tiny
    response = _response(tokenizer, ANSWERS[0])
    rejected_before = masks.mismatched_rows
    assert allowed_tokens(torch.from_numpy(masks.row("", response)), vocab_size).all()
    other = action_regex(["look"], 0)        # the response goes to a cabinet: rejected at its first action token
    allowed = allowed_tokens(torch.from_numpy(masks.row(other, response)), vocab_size)
    first_action_token = len(tokenizer.encode("<think></think> <action>", add_special_tokens=False))
    assert not allowed[:first_action_token].all(-1).any() and allowed[first_action_token:].all()
    assert masks.mismatched_rows == rejected_before + 1


def test_many_rows_at_once_are_each_row_alone(tiny):
    """`rows` walks all rows in lockstep (xgrammar's thread pool): rows of different lengths, one without a
    grammar, one rejected half way and one that runs on past its end give each row's own masks."""
    _, tokenizer, masks, _ = tiny
    responses = [_response(tokenizer, a) for a in ANSWERS]
    responses.append(np.concatenate([responses[0], responses[0][:2]]))      # tokens after the end of sequence
    grammars = [action_regex(ACTIONS, 0), "", action_regex(["look"], 0), action_regex(ACTIONS, 0),
                action_regex(ACTIONS, 0)]
    rejected_before = masks.mismatched_rows
    alone = [masks.row(g, r) for g, r in zip(grammars, responses)]
    assert masks.mismatched_rows == rejected_before + 2
    together = masks.rows(grammars, responses)
    assert masks.mismatched_rows == rejected_before + 4
    assert len(set(map(len, responses))) > 1
    for a, b in zip(alone, together):
        assert np.array_equal(a, b)


def test_constrained_logprobs_and_entropy_are_those_of_the_allowed_tokens_alone():
    """By hand: log p(t) = z_t - log sum over the allowed of exp(z), the entropy of that distribution, and no
    gradient reaches a token the sampler could not pick."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64).float().requires_grad_()
    allowed = torch.rand(5, 11, generator=g) < 0.4
    allowed[:, 3] = True
    targets = torch.full((5,), 3)
    logp, entropy = token_logprobs_and_entropy(logits, targets, True, allowed)
    for i in range(5):
        z = logits[i, allowed[i]].detach().double()
        p = torch.softmax(z, -1)
        assert logp[i].item() == pytest.approx((logits[i, 3].double() - torch.logsumexp(z, -1)).item(), abs=1e-6)
        assert entropy[i].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)
    (logp.sum() + entropy.sum()).backward()
    assert (logits.grad[~allowed] == 0).all() and (logits.grad[allowed] != 0).any()
    unmasked, _ = token_logprobs_and_entropy(logits.detach(), targets, False)
    assert torch.allclose(unmasked, torch.log_softmax(logits.detach(), -1)[:, 3], atol=1e-6, rtol=0)   # (float32)


@pytest.mark.slow
def test_the_trainer_scores_constrained_rows_under_their_grammar(tiny):
    """From records to the trainer's log-probs: a row sampled under a grammar is scored over the tokens it
    allowed, a row without one over the whole vocabulary (plain transformers as the reference; both float32,
    the same numbers up to summation order)."""
    from transformers import AutoModelForCausalLM

    from learner.trainer import PolicyTrainer
    path, tokenizer, masks, vocab_size = tiny
    regex = action_regex(ACTIONS, 0)
    prompt = np.array(tokenizer.encode("You arrive at cabinet 1. Your task is to: put a mug in desk 2."))
    steps = [StepRow(prompt_ids=prompt, response_ids=_response(tokenizer, a), response_logprobs=np.full(
        len(_response(tokenizer, a)), -1.0, np.float32), reward=10.0 * (k == 0), valid=True, step=0,
        policy_version=0, anchor="cabinet", action=a, grammar=regex if k < 3 else "")
        for k, a in enumerate(ANSWERS)]
    played = [(Trajectory(traj_id=f"t{k}", success=k == 0, episode_return=10.0 * (k == 0), score=float(k == 0)),
               [s]) for k, s in enumerate(steps)]
    batch = build_batch([EpisodeGroup.pack("g", "task", "alfworld", played, producer="test")], LearnerConfig(),
                        invalid_action_penalty=PENALTY)
    assert batch.grammars == [regex, regex, regex, ""]
    trainer = PolicyTrainer(path, LearnerConfig(zero_stage=2, micro_batch_tokens=300), dtype="float32",
                            **TRAINER)
    try:
        scored = trainer.compute_logprobs(batch)
    finally:
        trainer.close()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, r, grammar, got in zip(batch.prompt_ids, batch.response_ids, batch.grammars, scored):
        with torch.no_grad():
            logits = model(torch.tensor(np.concatenate([p, r]))[None]).logits[0, len(p) - 1:-1]
        allowed = allowed_tokens(torch.from_numpy(masks.row(grammar, r)), logits.shape[-1]) if grammar else None
        expected, _ = token_logprobs_and_entropy(logits, torch.from_numpy(r), False, allowed)
        np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)
        if grammar:      # where the grammar allowed one token, its log-prob is 0 exactly, as vLLM's is
            assert (got[allowed.sum(-1).numpy() == 1] == 0).all()
