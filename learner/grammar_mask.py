"""The policy that sampled a constrained response: the model's distribution over the tokens the action
grammar allowed at each position (`rollout.constrain_actions`).

vLLM samples a constrained response token by token from softmax(logits / T) over the tokens its
structured-output backend (xgrammar) allows after the text so far, and reports those log-probs. PPO's ratio
and gradient are only those of the sampling policy if the learner computes the same distribution: over the
whole vocabulary instead, the learner's log-prob of a sampled token is lower by log Z (Z: the mass the
model puts on the allowed tokens), its ratio is not the sampler's, and an update may move mass onto tokens
the sampler can never pick. (Measured on `make run` before this module: the gap between vLLM's and the
learner's log-probs of the same tokens grew from 1.7 to 6.4 nat per token over 24 updates.)

So each row carries the regex it was sampled under (`StepRow.grammar`), and `GrammarMasks` walks xgrammar's
matcher, built as vLLM builds it (the tokenizer's vocabulary at the model's vocabulary size, the same stop
tokens), along the row's response: per response token, a bitmask of the allowed tokens. The trainer applies
it to the logits (`allowed_tokens`, then learner.gigpo.token_logprobs_and_entropy). Rows without a grammar
are unconstrained (every bit set)."""
from __future__ import annotations

import functools
import logging
import sys

import numpy as np
import torch

log = logging.getLogger(__name__)


def stop_token_ids(model_path: str, tokenizer) -> list[int]:
    """The tokens that end a response in vLLM (its sampling parameters' stop tokens with our defaults): the
    tokenizer's end-of-sequence token and those the model's generation config names."""
    from transformers import GenerationConfig
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:             # no generation_config.json
        eos = None
    ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


class GrammarMasks:
    """Bitmasks of the tokens a row's grammar allowed at each of its response positions."""

    def __init__(self, model_path: str, vocab_size: int, cache_size: int = 4096):
        """model_path: where the tokenizer is; vocab_size: the model's (the logits' width, which can exceed
        the tokenizer's). Keeps the `cache_size` grammars compiled last (the rows of one state share one)."""
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._xgr = xgrammar
        self.width = xgrammar.get_bitmask_shape(1, vocab_size)[1]
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # Compiling dominates the cost (walking a response is ~1 ms): ~1-5 ms per grammar for the tiny
        # model's 1,024 tokens, ~30 ms for SmolLM2's 49,152 at its config (2026-11-27, e936c54), seconds for
        # long bounded free text at that size. vLLM compiles each request's grammar the same way.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=max(1, torch.get_num_threads()),
                                                  cache_enabled=False)
        self._stop = stop_token_ids(model_path, tokenizer)
        self._compile = functools.lru_cache(maxsize=cache_size)(self._compiler.compile_regex)
        self.mismatched_rows = 0    # rows whose response the grammar rejects (then unconstrained from there)

    def row(self, grammar: str, response_ids: np.ndarray) -> np.ndarray:
        """int32 [len(response_ids), width]: bit t (word t // 32, bit t % 32) of line i is set when token t
        was allowed at response position i. No grammar: every bit set. A response the grammar rejects
        (the sampler's state differs from ours: should not happen) is unconstrained from the rejected token
        on, counted in `mismatched_rows` and logged."""
        bits = torch.full((len(response_ids), self.width), -1, dtype=torch.int32)
        if not grammar:
            return bits.numpy()
        matcher = self._xgr.GrammarMatcher(self._compile(grammar), override_stop_tokens=self._stop)
        for i, token in enumerate(np.asarray(response_ids).tolist()):
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bits, i)
            if matcher.is_terminated() or not matcher.accept_token(token):
                bits[i:] = -1
                self.mismatched_rows += 1
                log.warning("a response the grammar it was sampled under rejects at token %d of %d (id %d): "
                            "unconstrained from there; grammar %.120r", i, len(response_ids), token, grammar)
                break
        return bits.numpy()


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [N, vocab_size] from `GrammarMasks.row`'s int32 [N, width] bitmasks. Unpacked byte by byte (one
    byte per token on the way, not four): in little-endian memory, token t's bit is bit t % 8 of byte t // 8."""
    assert sys.byteorder == "little"
    as_bytes = bits.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((as_bytes.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(bits), -1)[:, :vocab_size]
