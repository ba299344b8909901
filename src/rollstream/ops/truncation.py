"""Top-k / top-p truncation of a tempered distribution: which tokens a sampler may draw.

One definition for the two places that must agree token for token: the local engine's
sampler draws from (and reports the logprob under) the truncated distribution, and the
trainer applies the same truncation to its own logits before ``log_softmax``, so the
importance ratio compares the distribution that was sampled with the same distribution under
the trainer's weights. On equal inputs both keep exactly the same tokens (it is one function).

Rule (vLLM's order): top-k first (the ``k`` highest logits; ties broken by the lower token
id, through a stable sort), then top-p on what is left: keep the smallest prefix, in
descending order, whose renormalised mass reaches ``p`` (the first token always stays).
vLLM keeps every token tied with the k-th logit and sums the mass from the other end; on real
logits the two rules differ only at exact ties or in the last bit of a cumulative sum, where
the trainer's logprob of a token it does not keep is ``-inf`` (the trainer drops such tokens
from the loss and counts them).

Cost: one sort over the vocabulary per position; the trainer pays it only when the run
samples with truncation. Simplified: no min-p (the engines do not offer it).
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncates(top_p: float, top_k: int, vocab_size: int) -> bool:
    """Whether these settings cut anything from a ``vocab_size`` distribution."""
    return top_p < 1 or 0 < top_k < vocab_size


def top_k_top_p_keep(scaled: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """``[N, V]`` bool: the tokens each row keeps.

    ``scaled``: ``[N, V]`` float logits already divided by the temperature; ``top_p``: ``[N]``
    float in (0, 1] (1 = off); ``top_k``: ``[N]`` int64 in [1, V] (V = off). No gradient.
    """
    with torch.no_grad():
        ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(scaled.shape[-1], device=scaled.device)
        beyond_k = ranks[None, :] >= top_k[:, None]
        probs = ordered.masked_fill(beyond_k, -torch.inf).softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        beyond_p = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
        keep_sorted = ~(beyond_k | beyond_p)
        return torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)


def truncate(scaled: Tensor, top_p: float, top_k: int) -> Tensor:
    """``scaled`` (``[..., V]``, tempered logits) with the tokens that one top-p / top-k
    setting cuts set to ``-inf``; differentiable in the kept logits. ``top_k = 0``: off."""
    vocab = scaled.shape[-1]
    flat = scaled.reshape(-1, vocab)
    n = flat.shape[0]
    k = top_k if 0 < top_k < vocab else vocab
    keep = top_k_top_p_keep(
        flat.detach(),
        torch.full((n,), float(top_p), dtype=torch.float32, device=scaled.device),
        torch.full((n,), k, dtype=torch.int64, device=scaled.device),
    )
    return flat.masked_fill(~keep, -torch.inf).reshape(scaled.shape)
