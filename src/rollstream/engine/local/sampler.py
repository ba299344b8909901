"""Batched sampling with per-request seeds and behaviour-policy logprobs.

Every row carries its own temperature, top-p, top-k and seed, and one call samples all rows
with a handful of tensor ops (no per-row Python). Randomness is counter-based: the Gumbel
noise for row b is a hash of (request seed, absolute position of the token, vocab id), so a
seeded request draws the same tokens alone or in any batch, and resubmitting ``prompt +
partial`` with the same seed continues the same random stream. Requests without a seed get
one from the engine's generator. Gumbel-max over the truncated, temperature-scaled logits is
an exact draw from the renormalised top-k/top-p distribution.

Logprob of a sampled token = ``log_softmax(logits / T)`` (T = 0: plain ``log_softmax``) taken
*before* top-k/top-p truncation, i.e. under the full tempered distribution: this is the
quantity the trainer recomputes from its own logits, so the importance ratio compares like
with like. Truncation order follows vLLM: top-k first, then top-p on what is left.

Deliberately simplified: no repetition/presence penalties, no min-p, no logit bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """lowbias32 integer hash of values in [0, 2**32): Python ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32  # may wrap past 2**63; the low 32 bits stay exact
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request seed (any int) as a 32-bit hash key."""
    return mix32((seed & _M32) ^ mix32(((seed >> 32) & _M32) ^ 0x9E3779B9))


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
        self.ranks = torch.arange(vocab_size, device=device)

    def __call__(
        self, logits: torch.Tensor, rows: SamplingRows, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] float32, pos [n] position of the token being sampled.
        Returns token ids [n] int64 and their logprobs [n] float32."""
        if not rows.any_sampled:
            tokens = logits.argmax(dim=-1)
            logp = logits.log_softmax(dim=-1)
        else:
            scaled = logits * rows.inv_temp[:, None]
            logp = scaled.log_softmax(dim=-1)
            if rows.any_truncated:
                scaled = self._truncate(scaled, rows.top_p, rows.top_k)
            tokens = (scaled + self._gumbel(rows.key, pos)).argmax(dim=-1)
            if rows.any_greedy:
                tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]

    def _truncate(
        self, scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
    ) -> torch.Tensor:
        ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
        ordered = ordered.masked_fill(self.ranks[None, :] >= top_k[:, None], -torch.inf)
        probs = ordered.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1)
        ordered = ordered.masked_fill(drop, -torch.inf)
        return torch.empty_like(scaled).scatter_(1, order, ordered)

    def _gumbel(self, key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # key and vocab_hash are already mixed; one more round over [n, V] decorrelates them
        row_key = key ^ ((pos * 0x9E3779B1) & _M32)  # [n]
        h = mix32(row_key[:, None] ^ self.vocab_hash)  # [n, V]
        u = (h >> 8).float().add_(0.5).mul_(1.0 / (1 << 24))  # uniform in (0, 1)
        return u.log_().neg_().log_().neg_()
