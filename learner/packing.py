"""Attention for packed micro-batches (learner.pack_rows): rows concatenated into one sequence, each token
attending to its own row only.

    use_packed_attention(model)                     # once, before DeepSpeed wraps it
    logits = packed_logits(model, collate_packed(batch, rows), device)    # [response tokens, vocab]

What transformers 5.x offers for packed rows on CPU: with the 2D attention mask None and position ids that
restart at 0, `masking_utils.find_packed_sequence_indices` tells the rows apart and sdpa / eager get a dense
[T, T] mask for a pack of T tokens. That is correct, but sdpa then computes every block of it, those across
rows too: T^2 where the rows need sum(l_i^2) (16k-token packs of ~1k-token rows: ~16x the padded layout's
attention). Flash attention's varlen kernels (the cu_seq_lens_* kwargs) would skip them, but need CUDA and
the flash-attn package. torch's sdpa called once per row computes exactly the rows, but a call per row and
layer costs more than it saves where the cores are shared: 0.45-0.64x the padded layout's tokens/s with 2
threads on 2 busy cores (SmolLM2's shape, the tiny model on short rows; 1.65-1.89x with 1 thread; 2026-11-28).

So here every per-token computation (embeddings, projections, MLPs, norms, the head) runs on the pack as
it is, without padding, and only the attention sees the rows right-padded to the pack's longest: one causal
sdpa call per layer on [rows, heads, longest, head dim]. Right padding changes nothing for the real tokens:
causal, each attends to its own row's keys up to itself, all real; what the padding positions compute is
dropped. A pack's rows are of similar lengths (batching.pack_by_tokens takes them longest first), so little
of the attention is padding. Registered as an attention implementation (`transformers.AttentionInterface`)
that is plain sdpa when a call carries no row bounds, so that the padded layout runs through it unchanged.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "sdpa_packed_rows"


def _rows_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
               **kwargs) -> tuple[torch.Tensor, None]:
    """sdpa (`sdpa_attention_forward`'s contract: [B, H, T, D] in, [B, T, H, D] out), causal within each row
    of a pack [1, H, T, D] whose rows start at `cu_seq_lens_q` (flash attention's names for the bounds and the
    longest row)."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    bounds = cu_seq_lens_q.long()
    rows = len(bounds) - 1
    longest = int(max_length_q) if max_length_q is not None else int(bounds.diff().max())
    # Where each token of the pack goes in the right-padded [rows x longest] grid: row r's offset r x longest.
    offsets = torch.arange(rows, device=bounds.device) * longest - bounds[:-1]
    slots = torch.arange(query.shape[2], device=bounds.device) + offsets.repeat_interleave(bounds.diff())

    def right_padded(states: torch.Tensor) -> torch.Tensor:     # [1, h, T, D] -> [rows, h, longest, D]
        heads, dim = states.shape[1], states.shape[3]
        grid = states.new_zeros(rows * longest, heads, dim).index_copy(0, slots, states[0].transpose(0, 1))
        return grid.view(rows, longest, heads, dim).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        right_padded(query), right_padded(key), right_padded(value), dropout_p=dropout, scale=scaling,
        is_causal=True, enable_gqa=query.shape[1] != key.shape[1])
    tokens = out.transpose(1, 2).reshape(rows * longest, out.shape[1], out.shape[3]).index_select(0, slots)
    return tokens[None], None


def _padding_mask_only(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """sdpa's mask of a padded batch; none for a pack (called without a 2D mask), whose rows the attention
    keeps apart itself: transformers would otherwise build the dense [T, T] mask only for it to be ignored."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def use_packed_attention(model) -> None:
    """Make `model` (a transformers causal LM) take packed micro-batches: its attention becomes PACKED_SDPA.
    A model with sliding-window layers is refused (the rows' attention here has no window)."""
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        raise ValueError(f"learner.pack_rows: {type(model).__name__} has sliding-window attention layers, which "
                         "the packed layout does not implement; set learner.pack_rows=false")
    AttentionInterface.register(PACKED_SDPA, _rows_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, _padding_mask_only)
    model.set_attn_implementation(PACKED_SDPA)


def packed_logits(model, mb, device) -> torch.Tensor:
    """The logits [N, vocab] of a packed micro-batch (batching.collate_packed), in its flat row-major order of
    response tokens: no 2D mask, position ids restarting per row, the row bounds, and the LM head applied at
    the N positions that predict response tokens only. `model`: a transformers causal LM or a DeepSpeed engine
    around one, which must have been through `use_packed_attention` (another attention ignores the row bounds:
    transformers' sdpa would rebuild them as a dense [T, T] mask from the position ids)."""
    attention = getattr(getattr(model, "module", model).config, "_attn_implementation", None)
    if attention != PACKED_SDPA:
        raise ValueError(f"a packed micro-batch needs the model's attention to be {PACKED_SDPA!r} "
                         f"(use_packed_attention), not {attention!r}, which ignores the rows' bounds")
    bounds = mb.row_bounds.to(device)
    return model(input_ids=mb.input_ids.to(device), position_ids=mb.position_ids.to(device),
                 logits_to_keep=mb.logit_positions.to(device), use_cache=False,
                 cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=mb.longest_row,
                 max_length_k=mb.longest_row).logits[0]
