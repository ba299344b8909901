"""Batched sampling with per-request seeds and behaviour-policy logprobs.

Every row carries its own temperature, top-p, top-k and seed, and one call samples all rows
with a handful of tensor ops (no per-row Python). Randomness is counter-based: the Gumbel
noise for row b is a hash of (request seed, absolute position of the token, vocab id), so a
seeded request draws the same tokens alone or in any batch, and resubmitting ``prompt +
partial`` with the same seed continues the same random stream. Requests without a seed get
one from the engine's generator. Gumbel-max over the truncated, temperature-scaled logits is
an exact draw from the renormalised top-k/top-p distribution.

Logprob of a sampled token = its logprob under the distribution it was drawn from: the
tempered logits ``logits / T`` truncated by top-k then top-p
(:func:`rollstream.ops.truncation.top_k_top_p_keep`, the function the trainer applies to its
own logits) and renormalised; without truncation ``log_softmax(logits / T)``; for greedy rows
(T = 0) plain ``log_softmax(logits)``. So the importance ratio of a trainer on the same
weights is exactly 1, with or without top-p/top-k.

Deliberately simplified: no repetition/presence penalties, no min-p, no logit bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollstream.engine.local.jit import scripted
from rollstream.ops.truncation import top_k_top_p_keep

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash of int64 values in [0, 2**32), elementwise."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF  # may wrap past 2**63; the low 32 bits stay exact
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request seed (any int) as a 32-bit hash key."""
    mix = scripted(mix32)  # a handful of tensor ops from Python, not ~20
    high = int(mix(torch.tensor(((seed >> 32) & _M32) ^ 0x9E3779B9)))
    return int(mix(torch.tensor((seed & _M32) ^ high)))


@dataclass(slots=True, kw_only=True)
class SamplingRows:
    """Per-row sampling parameters of the live rows (views of the runner's row state)."""

    inv_temp: torch.Tensor  # [n] float; 1.0 for greedy rows
    top_p: torch.Tensor  # [n] float
    top_k: torch.Tensor  # [n] int64; vocab size when off
    key: torch.Tensor  # [n] int64 seed key
    greedy: torch.Tensor  # [n] bool
    any_sampled: bool  # host flags: which code paths this batch needs
    any_greedy: bool
    any_truncated: bool


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_hash = mix32(
            torch.arange(vocab_size, device=device, dtype=torch.int64) + 0x632BE5AB
        )

    def __call__(
        self, logits: torch.Tensor, rows: SamplingRows, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] float32, pos [n] position of the token being sampled.
        Returns token ids [n] int64 and their logprobs [n] float32."""
        return scripted(sample)(logits, rows.inv_temp, rows.top_p, rows.top_k, rows.key,
                                rows.greedy, pos, self.vocab_hash, rows.any_sampled,
                                rows.any_greedy, rows.any_sampled and rows.any_truncated)


def sample(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    key: torch.Tensor,
    greedy: torch.Tensor,
    pos: torch.Tensor,
    vocab_hash: torch.Tensor,
    any_sampled: bool,
    any_greedy: bool,
    any_truncated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and logprobs of every row (scriptable: the runner's step calls it)."""
    if not any_sampled:
        tokens = logits.argmax(dim=-1)
        return tokens, _gathered(logits.log_softmax(dim=-1), tokens)
    scaled = logits * inv_temp[:, None]
    if any_truncated:
        scaled = scaled.masked_fill(~top_k_top_p_keep(scaled, top_p, top_k), float("-inf"))
    tokens = (scaled + _gumbel(key, pos, vocab_hash)).argmax(dim=-1)
    logp = _gathered(scaled.log_softmax(dim=-1), tokens)
    if any_greedy:  # greedy rows: the argmax, and the plain (untruncated) logprob
        greedy_tokens = logits.argmax(dim=-1)
        tokens = torch.where(greedy, greedy_tokens, tokens)
        plain = _gathered(logits.log_softmax(dim=-1), greedy_tokens)
        logp = torch.where(greedy, plain, logp)
    return tokens, logp


def _gumbel(key: torch.Tensor, pos: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    # key and vocab_hash are already mixed; one more round over [n, V] decorrelates them
    row_key = key ^ ((pos * 0x9E3779B1) & 0xFFFFFFFF)  # [n]
    h = mix32(row_key[:, None] ^ vocab_hash)  # [n, V]
    u = (h >> 8).float().add_(0.5).mul_(1.0 / (1 << 24))  # uniform in (0, 1)
    return u.log_().neg_().log_().neg_()


def _gathered(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logp.gather(1, tokens[:, None])[:, 0]
