"""The policy that sampled a constrained response (`rollout.constrain_actions`): the model's distribution over
the tokens the action grammar allowed at each position.

vLLM samples such a response from softmax(logits / T) over the tokens xgrammar allows after the text so far.
Over the whole vocabulary instead, the learner's log-prob of a sampled token is lower by log Z (Z: the mass
on the allowed tokens), PPO's ratio is not the sampler's, and an update may move mass onto tokens the sampler
can never pick (measured on `make run` without this module: the vLLM-learner gap grew from 1.7 to 6.4 nat per
token over 24 updates). So each row carries its regex (`StepRow.grammar`), and `GrammarMasks` walks
xgrammar's matcher, built as vLLM builds it, along the response: per token, a bitmask of the allowed tokens,
which the trainer applies to the logits (`allowed_tokens`). Rows without a grammar are unconstrained."""
from __future__ import annotations

import functools
import logging
import sys

import numpy as np
import torch

log = logging.getLogger(__name__)


def stop_token_ids(model_path: str, tokenizer) -> list[int]:
    """The tokens that end a response in vLLM with our sampling defaults: the tokenizer's end-of-sequence token
    and those the model's generation config names."""
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
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))
        self.mismatched_rows = 0    # rows whose response the grammar rejects (then unconstrained from there)

    def row(self, grammar: str, response_ids: np.ndarray) -> np.ndarray:
        """int32 [len(response_ids), width]: bit t (word t // 32, bit t % 32) of line i is set when token t was
        allowed at response position i; no grammar: every bit. A response the grammar rejects (should not
        happen) is unconstrained from the rejected token on, counted in `mismatched_rows` and logged."""
        return self.rows([grammar], [response_ids])[0]

    def rows(self, grammars: list[str], responses: list[np.ndarray]) -> list[np.ndarray]:
        """`row` of each (grammar, response). The matchers walk the responses in lockstep and xgrammar fills
        each position's masks on the learner's compute threads: 4.6-5.2x faster than row by row on 16 cores
        (156 rows, 2026-11-27), where the serial walk was 14-31% of a GPU learner step."""
        tokens = [np.asarray(r).tolist() for r in responses]
        bits = [torch.full((len(t), self.width), -1, dtype=torch.int32) for t in tokens]
        matchers = {k: self._xgr.GrammarMatcher(self._compile(g), override_stop_tokens=self._stop)
                    for k, g in enumerate(grammars) if g}
        line = torch.empty((len(matchers), self.width), dtype=torch.int32)
        active, i = list(matchers), 0
        while active:
            active = [k for k in active if i < len(tokens[k])]
            for k in [k for k in active if matchers[k].is_terminated()]:
                self._rejected(grammars[k], tokens[k], i)
            active = [k for k in active if not matchers[k].is_terminated()]
            if not active:
                break
            walking = [matchers[k] for k in active]
            self._batch.batch_fill_next_token_bitmask(walking, line)
            accepted = self._batch.batch_accept_token(walking, [tokens[k][i] for k in active])
            for j, (k, ok) in enumerate(zip(active, accepted)):
                if ok:
                    bits[k][i] = line[j]
                else:       # this line stays all ones: unconstrained from the rejected token on
                    self._rejected(grammars[k], tokens[k], i)
            active = [k for k, ok in zip(active, accepted) if ok]
            i += 1
        return [b.numpy() for b in bits]

    def _rejected(self, grammar: str, tokens: list[int], i: int) -> None:
        self.mismatched_rows += 1
        log.warning("a response the grammar it was sampled under rejects at token %d of %d (id %d): "
                    "unconstrained from there; grammar %.120r", i, len(tokens), tokens[i], grammar)


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [N, vocab_size] from `GrammarMasks.row`'s int32 [N, width] bitmasks. Unpacked byte by byte (one
    byte per token on the way, not four): in little-endian memory, token t's bit is bit t % 8 of byte t // 8."""
    assert sys.byteorder == "little"
    as_bytes = bits.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((as_bytes.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(bits), -1)[:, :vocab_size]
