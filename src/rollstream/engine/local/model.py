"""The compact Llama/Qwen2 forward pass of the local engine, written as plain functions.

One entry point, ``forward``, runs a step's two kinds of work in one layer loop: the decode
rows (one token for every live row against the preallocated KV cache) and the prompts admitted
this step, packed into one sequence (a block-diagonal causal mask keeps them apart, no
padding). The matmuls of a layer run once over all of their tokens (vLLM's chunked prefill
does the same; here a prompt is never split across steps) and attention runs per kind. New
keys and values of a layer go into the cache with a single ``index_copy_``.

Numerics follow ``transformers`` (RMSNorm, rotate-half rope from float32 tables computed the
same way, grouped-query attention) so that logprobs match the trainer's to ~1e-6 in fp32.
Choices made for speed on tiny models, where per-op overhead dominates (a decode step is ~25
tensor ops per layer): fused q|k|v and gate|up matmuls; the residual add folded into
``addmm``; rope applied to q|k|v in one pass (v rows get cos=1, sin=0) so keys and values
leave it side by side for the one cache write; decode attention as ``baddbmm`` (mask added)
+ softmax + ``bmm`` over views of the cache rows up to the longest live row, which beats
SDPA on CPU at these shapes; per-step tables (rope, mask, cache index) built once per step.

Deliberately simplified: no paged KV blocks (a slot owns a whole row of ``max_seq_len``), no
prefix caching, no CUDA graphs or torch.compile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollstream.engine.local.weights import ModelSpec, Weights


@dataclass(slots=True, kw_only=True)
class KVCache:
    """Keys and values of every slot: kv[layer, 0 = k | 1 = v, slot * kv_heads + head, pos, :]."""

    kv: torch.Tensor  # [layers, 2, slots * kv_heads, max_seq_len, head_dim]
    flat: list[torch.Tensor]  # per layer, kv[layer] viewed as [2 * slots * kv_heads * L, head_dim]
    base: torch.Tensor  # [slots, 2, kv_heads] int64: flat row of (slot, k|v, head) at pos 0
    kv_heads: int

    @classmethod
    def allocate(
        cls, spec: ModelSpec, slots: int, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        kvh = spec.num_kv_heads
        kv = torch.zeros(
            spec.num_layers, 2, slots * kvh, seq_len, spec.head_dim, device=device, dtype=dtype
        )
        slot = torch.arange(slots, device=device)[:, None, None]
        kind = torch.arange(2, device=device)[None, :, None]
        head = torch.arange(kvh, device=device)[None, None, :]
        base = ((kind * slots + slot) * kvh + head) * seq_len
        return cls(
            kv=kv, flat=[layer.view(-1, spec.head_dim) for layer in kv], base=base, kv_heads=kvh
        )

    def write_index(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat cache rows for the k|v of tokens at (rows, pos), ordered (token, k|v, head)."""
        return (self.base[rows] + pos[:, None, None]).view(-1)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy the first ``lengths[i]`` positions of slot ``src[i]`` into slot ``dst[i]``,
        every layer, keys and values: each row only as far as it holds (a long row moved
        with short ones does not make them copy its length). Gathered before written, so the
        moves may be a permutation."""
        if src.numel() == 0:
            return
        longest = int(lengths.max())
        offsets = torch.arange(longest, device=src.device)
        keep = (offsets[None, :] < lengths[:, None])  # [m, L]
        width = self.base.shape[1] * self.base.shape[2]  # k|v x heads

        def index(slots: torch.Tensor) -> torch.Tensor:
            start = self.base[slots].view(-1, width, 1) + offsets  # [m, 2 * kvh, L]
            return start[keep[:, None, :].expand_as(start)]

        flat = self.kv.view(self.kv.shape[0], -1, self.kv.shape[-1])  # [layers, N, d]
        flat.index_copy_(1, index(dst), flat.index_select(1, index(src)))


@dataclass(slots=True, kw_only=True)
class Rope:
    """cos/sin tables per position; sin is signed so that rope(x) = x*cos + roll(x)*sin."""

    cos: torch.Tensor  # [max_seq_len, head_dim]
    sin: torch.Tensor  # [max_seq_len, head_dim]
    is_v: torch.Tensor  # [heads + 2 * kv_heads, 1] bool: value rows are not rotated

    @classmethod
    def build(cls, spec: ModelSpec, seq_len: int, device: torch.device, dtype: torch.dtype) -> Rope:
        d = spec.head_dim
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if spec.rope_scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, spec.rope_scaling)
        freqs = torch.arange(seq_len).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        sin = torch.cat((-sin[:, : d // 2], sin[:, d // 2 :]), dim=-1)
        heads = spec.num_heads + 2 * spec.num_kv_heads
        is_v = torch.arange(heads, device=device)[:, None] >= spec.num_heads + spec.num_kv_heads
        return cls(cos=cos.to(device, dtype), sin=sin.to(device, dtype), is_v=is_v)

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for tokens at ``pos``: [T, heads + 2 * kv_heads, head_dim]."""
        cos = torch.where(self.is_v, 1.0, self.cos[pos][:, None])
        sin = torch.where(self.is_v, 0.0, self.sin[pos][:, None])
        return cos, sin


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    # transformers' _compute_llama3_parameters, step for step
    factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _linear(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, w_t) if b is None else torch.addmm(b, x, w_t)


def _residual(
    x: torch.Tensor, a: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    out = torch.addmm(x, a, w_t)
    return out if b is None else out.add_(b)


def _layers(
    spec: ModelSpec,
    w: Weights,
    cache: KVCache,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    write: torch.Tensor,
    attend: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Every decoder layer on x [T, hidden]; ``attend(i, qkv [T, heads + 2 kv_heads, d])``
    returns [T, q_size]. Keys/values go to the cache rows ``write`` first."""
    t, h, d = x.shape[0], spec.num_heads, spec.head_dim
    norm_shape, eps = (spec.hidden_size,), spec.rms_norm_eps
    for i, lw in enumerate(w.layers):
        a = F.rms_norm(x, norm_shape, lw.ln_attn, eps)
        qkv = _linear(a, lw.qkv_t, lw.qkv_b).view(t, -1, d)
        qkv = torch.addcmul(qkv * cos, qkv.roll(d // 2, dims=-1), sin)
        cache.flat[i].index_copy_(0, write, qkv[:, h:].reshape(-1, d))
        x = _residual(x, attend(i, qkv), lw.o_t, lw.o_b)
        a = F.rms_norm(x, norm_shape, lw.ln_mlp, eps)
        gate, up = _linear(a, lw.gate_up_t, lw.gate_up_b).chunk(2, dim=-1)
        x = _residual(x, F.silu(gate).mul_(up), lw.down_t, lw.down_b)
    return x


def _logits(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    x = F.rms_norm(x, (spec.hidden_size,), w.norm, spec.rms_norm_eps)
    return torch.mm(x, w.lm_head_t).float()


@dataclass(slots=True, kw_only=True)
class DecodeRows:
    """One new token for each of the live rows 0..n-1, attending over the cache."""

    tokens: torch.Tensor  # [n] the last token of each row
    pos: torch.Tensor  # [n] its position
    chunks: list[tuple[int, int, int]]  # (first row, end row, attention length), covering 0..n-1


@dataclass(slots=True, kw_only=True)
class PackedPrompts:
    """Whole prompts packed into one sequence (a block-diagonal causal mask keeps them
    apart, no padding); their keys and values go to their cache rows."""

    tokens: torch.Tensor  # [T]
    rows: torch.Tensor  # [T] cache row of each token
    pos: torch.Tensor  # [T] its position in its row
    last: torch.Tensor | None  # [m] index of each prompt's final token (None: no logits)


def forward(
    spec: ModelSpec,
    w: Weights,
    cache: KVCache,
    rope: Rope,
    decode: DecodeRows | None = None,
    prompts: PackedPrompts | None = None,
) -> torch.Tensor | None:
    """One forward pass over decode rows and packed prompts together (either may be None):
    the matmuls of every layer run once over all their tokens, attention separately (decode
    rows over the cache, prompts over themselves). Returns logits [n + m, vocab]: the decode
    rows' next tokens, then each prompt's last token (None when there are none)."""
    parts = [p for p in (decode, prompts) if p is not None]
    if not parts:
        raise ValueError("forward needs decode rows or prompts")
    pos = torch.cat([p.pos for p in parts]) if len(parts) == 2 else parts[0].pos
    tokens = torch.cat([p.tokens for p in parts]) if len(parts) == 2 else parts[0].tokens
    cos, sin = rope.tables(pos)
    attends, writes = [], []
    if decode is not None:
        n = decode.tokens.shape[0]
        attends.append((n, _decode_attention(spec, cache, decode, cos.dtype)))
        writes.append((cache.base[:n] + decode.pos[:, None, None]).view(-1))
    if prompts is not None:
        attends.append((prompts.tokens.shape[0], _prompt_attention(spec, prompts, cos.dtype)))
        writes.append(cache.write_index(prompts.rows, prompts.pos))

    def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
        if len(attends) == 1:
            return attends[0][1](i, qkv)
        (n, first), (_, second) = attends
        return torch.cat((first(i, qkv[:n]), second(i, qkv[n:])))

    write = torch.cat(writes) if len(writes) == 2 else writes[0]
    x = _layers(spec, w, cache, F.embedding(tokens, w.embed), cos, sin, write, attend)
    picks = []
    if decode is not None:
        picks.append(x[: decode.tokens.shape[0]])
    if prompts is not None and prompts.last is not None:
        offset = 0 if decode is None else decode.tokens.shape[0]
        picks.append(x[prompts.last + offset])
    if not picks:
        return None
    return _logits(spec, w, torch.cat(picks) if len(picks) == 2 else picks[0])


def _decode_attention(
    spec: ModelSpec, cache: KVCache, d: DecodeRows, dtype: torch.dtype
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """Attention of one new token per row over the cache rows 0..n-1, per chunk of rows
    over each chunk's own longest row (one long row does not make every row pay)."""
    n, kvh, hd, h = d.tokens.shape[0], spec.num_kv_heads, spec.head_dim, spec.num_heads
    group, scale = h // kvh, 1.0 / math.sqrt(hd)
    longest = max(length for _, _, length in d.chunks)
    visible = torch.arange(longest, device=d.pos.device) <= d.pos.repeat_interleave(kvh)[:, None]
    bias = torch.where(visible, 0.0, -math.inf).to(dtype)[:, None]  # [n * kvh, 1, L]
    window = cache.kv[:, :, : n * kvh, :longest]  # [layers, 2, n * kvh, L, d] view
    keys_t = window[:, 0].transpose(-1, -2).unbind(0)  # per layer [n * kvh, d, L]
    values = window[:, 1].unbind(0)  # per layer [n * kvh, L, d]
    spans = [(lo * kvh, hi * kvh, length) for lo, hi, length in d.chunks]

    def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
        q = qkv[:, :h].reshape(n * kvh, group, hd)  # q heads grouped by their kv head
        out = []
        for a, b, length in spans:
            s = torch.baddbmm(bias[a:b, :, :length], q[a:b], keys_t[i][a:b, :, :length],
                              alpha=scale)
            out.append(torch.bmm(s.softmax(dim=-1), values[i][a:b, :length]))
        return (out[0] if len(out) == 1 else torch.cat(out)).view(n, -1)

    return attend


def _prompt_attention(
    spec: ModelSpec, p: PackedPrompts, dtype: torch.dtype
) -> Callable[[int, torch.Tensor], torch.Tensor]:
    t, h, kvh = p.tokens.shape[0], spec.num_heads, spec.num_kv_heads
    visible = (p.rows[:, None] == p.rows[None, :]) & (p.pos[None, :] <= p.pos[:, None])  # [T, T]
    mask = torch.where(visible, 0.0, -math.inf).to(dtype)

    def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.transpose(0, 1)[None].split([h, kvh, kvh], dim=1)  # [1, heads, T, d]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return o[0].transpose(0, 1).reshape(t, -1)

    return attend
