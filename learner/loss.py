"""The policy loss of GiGPO/GRPO training (reference §2): token-level PPO with dual clip, k3 KL to a frozen
reference, and an entropy bonus. Pure torch, tensors in, scalar loss and metrics out.

Token-mean over a mini-batch that is split into micro-batches (and across learner processes) must not
depend on the split. So the loss of one micro-batch is the *sum* of its per-token terms divided by the
token count of the whole mini-batch (`token_normalizer`); summing the micro-batch gradients then gives
exactly the gradient of the token mean over the mini-batch, however the rows were packed.

Which distribution the log-probs are of. The PPO ratio exp(logp - old_logp) is an importance weight from
the distribution the tokens were drawn from to the one being trained, so both sides must be the same
function of the weights. Rollouts sample from softmax(logits / T), T = rollout.temperature; the inference
actors report the log-probs of that distribution (vLLM's processed log-probs), and the learner computes
log_softmax(logits / T) too (learner.trainer.PolicyTrainer, `temperature`), for the new log-probs and for
recomputed old ones alike. (At T = 1 this is the raw model distribution.)

Forced tokens: left out of the loss. With rollout.constrain_actions the action grammar leaves some
positions a single allowed token (the rest of "</action>" once "</" is written, the tail of an action
whose prefix is unique). The sampler's log-prob there is 0 (p = 1): no choice was made, and the acting
policy, the grammar-masked softmax, gives that token p = 1 whatever the weights, so its true policy
gradient is 0. The learner's unconstrained log-prob is below 0, and the "ratio" exp(logp - 0) = p_learner
is no ratio of two policies: it is always <= 1, so PPO's clip treats the two signs unequally (a token in
a row with A < 0 is clipped out once p < 1 - clip, one with A > 0 is always pushed up) and the
clip-fraction and KL metrics fill with tokens nobody chose. Training them would teach the unconstrained
model the format, which the grammar already guarantees, at the price of biased updates and diluted
token means. So tokens whose behaviour log-prob is exactly 0 get mask 0 (learner.batching.forced_token_mask,
decided from the rollout's log-probs, before any recompute) and do not count in the token normalizer.
An unconstrained sampler reaches log-prob 0 in float32 only for p > 1 - 6e-8, where the gradient of
log p is of that size too: leaving those out changes nothing but the count. Tokens the grammar narrows
to several choices stay in: their sampler log-prob is renormalized over the allowed set, which the
learner does not know; with learner.recompute_old_logprobs both sides of their ratio are the
unconstrained model's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossSettings:
    """The coefficients of the loss (defaults: the paper's, reference §2)."""

    clip_ratio: float = 0.2       # PPO ratio clip epsilon
    dual_clip: float = 3.0        # c of the dual clip for negative advantages (> 1); 0 disables it
    kl_coef: float = 0.01         # weight of the low_var_kl term; 0 disables it
    entropy_coef: float = 0.001   # weight of the entropy bonus (subtracted from the loss)

    def __post_init__(self) -> None:
        if not self.clip_ratio > 0:
            raise ValueError(f"clip_ratio must be > 0, got {self.clip_ratio!r}")
        if self.dual_clip and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 to disable), got {self.dual_clip!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")


def low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy || reference) per token: exp(ref - logp) - (ref - logp) - 1, clamped to
    [-10, 10] (as the reference implementation does, so one far-off token cannot blow up the loss)."""
    log_ratio = ref_logp - logp
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)


def ppo_token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                     clip_ratio: float, dual_clip: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO policy loss with dual clip.

    Returns (loss, clipped, dual_clipped): the per-token loss and two bool masks saying where the ratio
    clip and the dual clip were the active terms (for the clip-fraction metrics).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped_term = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    if dual_clip:
        # For A < 0 the ordinary clipped loss is unbounded as the ratio grows; dual clip caps it at -c*A.
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    else:
        dual = torch.zeros_like(clipped)
    return loss, clipped, dual


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                settings: LossSettings, *, token_normalizer: float | torch.Tensor | None = None,
                ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one micro-batch and its metrics.

    Args:
        logp: [R, T] log-probs of the response tokens under the policy being trained (with grad).
        old_logp: [R, T] log-probs under the behaviour policy (rollout's, or recomputed).
        advantages: same shape as logp, or [R] / [R, 1] for [R, T] inputs (one value per row).
        mask: [R, T] 1 for real response tokens, 0 for padding.
        settings: coefficients.
        token_normalizer: number of response tokens of the whole mini-batch this micro-batch belongs to;
            None: this micro-batch's own count (plain token mean).
        ref_logp: [R, T] log-probs under the frozen reference (needed when settings.kl_coef > 0).
        entropy: [R, T] per-token entropy of the policy (with grad; needed when entropy_coef > 0).

    Returns:
        (loss, metrics): the scalar to backpropagate; metrics are detached *sums over tokens* (keys ending
        in `_sum`) plus `tokens`, so that callers can add them over micro-batches and divide once.
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    mask = mask.to(logp.dtype)
    if advantages.dim() == 1 and logp.dim() == 2:      # one advantage per row
        advantages = advantages[:, None]
    advantages = advantages.to(logp.dtype).expand_as(logp)
    old_logp = old_logp.to(logp.dtype)
    tokens = mask.sum()
    norm = tokens if token_normalizer is None else token_normalizer
    norm = torch.clamp(torch.as_tensor(norm, dtype=logp.dtype, device=logp.device), min=1.0)

    pg, clipped, dual = ppo_token_losses(logp, old_logp, advantages, settings.clip_ratio, settings.dual_clip)
    pg_sum = (pg * mask).sum()
    loss_sum = pg_sum
    with torch.no_grad():
        log_ratio = (logp - old_logp).detach()
        metrics = {
            "tokens": tokens.detach(),
            "pg_loss_sum": pg_sum.detach(),
            "clip_frac_sum": (clipped.to(mask.dtype) * mask).sum(),
            "dual_clip_frac_sum": (dual.to(mask.dtype) * mask).sum(),
            # k3 estimate of KL(old || new): mean of exp(r) - 1 - r, r = logp - old_logp
            "approx_kl_sum": ((torch.exp(log_ratio) - 1.0 - log_ratio) * mask).sum(),
            "ratio_sum": (torch.exp(log_ratio) * mask).sum(),
        }
    if settings.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp")
        kl_sum = (low_var_kl(logp, ref_logp.to(logp.dtype)) * mask).sum()
        loss_sum = loss_sum + settings.kl_coef * kl_sum
        metrics["kl_sum"] = kl_sum.detach()
    if entropy is not None:
        ent_sum = (entropy * mask).sum()
        metrics["entropy_sum"] = ent_sum.detach()
        if settings.entropy_coef > 0:
            loss_sum = loss_sum - settings.entropy_coef * ent_sum
    elif settings.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs entropy")
    metrics["loss_sum"] = loss_sum.detach()
    return loss_sum / norm, metrics


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy of each position's distribution, computed in float32.

    logits: [..., V]; targets: [...] token ids. Callers pass only the response positions, so the float32
    copy of the logits is as small as it can be.
    """
    logits = logits.float()
    logz = torch.logsumexp(logits, dim=-1)
    logp = torch.gather(logits, -1, targets.long().unsqueeze(-1)).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    return logp, entropy
