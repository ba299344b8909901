"""The compact Llama/Qwen2/Qwen2-MoE forward pass of the local engine, as plain functions.

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
A step's tables, layers and logits run as one TorchScript function (``_step``, ``jit.py``):
the same ops, without taking the GIL back after each of them.

Mixture of experts (Qwen2-MoE): the router's logits and the shared expert's gate come from
one matmul; each token's top-k experts by router softmax (renormalised when the config's
``norm_topk_prob`` says so), then the tokens of the pass are grouped by expert (one stable
sort) and each expert that has tokens runs once over all of them, its outputs weighted and
added back per token in expert order, as transformers adds them; the shared expert runs over
every token, scaled by the sigmoid of its gate. Numerics follow ``Qwen2MoeSparseMoeBlock``
(softmax in float32, weights cast back to the activations' dtype). The per-expert token
counts are read on the host to slice the groups: one device sync per layer with experts on a
GPU (none on the CPU), and a loop over experts rather than one grouped matmul.

A prompt whose row holds a prefix already (a prefix cache hit copied in, ``prefix.py``)
attends over the held positions and its own, read back from the cache after the layer's write.

Deliberately simplified: no paged KV blocks (a slot owns a whole row of ``max_seq_len``), no
CUDA graphs or torch.compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollstream.engine.local.jit import scripted
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

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy the first ``lengths[i]`` positions of slot ``src[i]`` into slot ``dst[i]``,
        every layer, keys and values: each row only as far as it holds (a long row moved
        with short ones does not make them copy its length). Gathered before written, so the
        moves may be a permutation."""
        scripted(move_cache_rows)(self.kv, self.base, src, dst, lengths)


def move_cache_rows(kv: torch.Tensor, base: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                    lengths: torch.Tensor) -> None:
    """:meth:`KVCache.move_rows` on the cache's tensors (scriptable)."""
    if src.numel() == 0:
        return
    offsets = torch.arange(int(lengths.max()), device=src.device)
    keep = offsets[None, :] < lengths[:, None]  # [m, L]
    width = base.shape[1] * base.shape[2]  # k|v x heads
    start_src = base[src].view(-1, width, 1) + offsets  # [m, 2 * kvh, L]
    start_dst = base[dst].view(-1, width, 1) + offsets
    keep = keep[:, None, :].expand_as(start_src)
    flat = kv.view(kv.shape[0], -1, kv.shape[-1])  # [layers, N, d]
    flat.index_copy_(1, start_dst[keep], flat.index_select(1, start_src[keep]))


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


@dataclass(slots=True, kw_only=True)
class DecodeRows:
    """One new token for each of the live rows 0..n-1, attending over the cache: the input of
    row i is its last token, ``history[i, length[i] - 1]``."""

    history: torch.Tensor  # [rows, max_seq_len] token ids of every row
    length: torch.Tensor  # [rows] tokens each row holds
    chunks: list[tuple[int, int, int]]  # (first row, end row, attention length), covering 0..n-1


@dataclass(slots=True, kw_only=True)
class PackedPrompts:
    """Whole prompts packed into one sequence (a block-diagonal causal mask keeps them
    apart, no padding); their keys and values go to their cache rows."""

    tokens: torch.Tensor  # [T]
    rows: torch.Tensor  # [T] cache row of each token
    pos: torch.Tensor  # [T] its position in its row
    last: torch.Tensor | None  # [m] index of each prompt's final token (None: no logits)
    # where some prompts start after a prefix their rows hold already (a prefix cache hit):
    # every position the prompts attend over, the held ones and the new ones (None: none held)
    context_rows: torch.Tensor | None = None  # [C] row of each position
    context_pos: torch.Tensor | None = None  # [C] the position


def forward(
    spec: ModelSpec,
    w: Weights,
    cache: KVCache,
    rope: Rope,
    decode: DecodeRows | None = None,
    prompts: PackedPrompts | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One forward pass over decode rows and packed prompts together (either may be None):
    the matmuls of every layer run once over all their tokens, attention separately (decode
    rows over the cache, prompts over themselves). Returns logits [n + m, vocab]: the decode
    rows' next tokens, then each prompt's last token (None when there are none); and, with
    experts, the experts every input token was routed to, [n + T, moe layers, top_k] int64
    (decode rows' inputs, then the packed prompt tokens; None for a dense model).

    Runs as one TorchScript call (:func:`_step`, scripted by ``jit.py``)."""
    if decode is None and prompts is None:
        raise ValueError("forward needs decode rows or prompts")
    n, longest, spans = 0, 0, []
    if decode is not None:
        n, kvh = decode.chunks[-1][1], spec.num_kv_heads
        longest = max(length for _, _, length in decode.chunks)
        spans = [(lo * kvh, hi * kvh, length) for lo, hi, length in decode.chunks]
    rows = (None, None) if decode is None else (decode.history, decode.length)
    packed = ((None,) * 6 if prompts is None
              else (prompts.tokens, prompts.rows, prompts.pos, prompts.last,
                    prompts.context_rows, prompts.context_pos))
    return scripted(_step)(
        *rows, n, longest, spans, *packed, rope.cos, rope.sin, rope.is_v, cache.base, w.embed,
        w.matrices, w.biases, w.experts, w.norm, w.lm_head_t, cache.kv, cache.flat,
        spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps,
        0 if spec.moe is None else spec.moe.top_k,
        spec.moe is not None and spec.moe.norm_topk_prob)


def _step(
    history: torch.Tensor | None,
    length: torch.Tensor | None,
    n: int,
    longest: int,
    spans: list[tuple[int, int, int]],
    p_tokens: torch.Tensor | None,
    p_rows: torch.Tensor | None,
    p_pos: torch.Tensor | None,
    p_last: torch.Tensor | None,
    c_rows: torch.Tensor | None,
    c_pos: torch.Tensor | None,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    is_v: torch.Tensor,
    base: torch.Tensor,
    embed: torch.Tensor,
    matrices: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    experts: list[torch.Tensor],
    norm: torch.Tensor,
    lm_head_t: torch.Tensor,
    kv: torch.Tensor,
    flat: list[torch.Tensor],
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    top_k: int,
    norm_topk: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One step (decode rows 0..n-1 and packed prompts, either may be absent): its tables
    (inputs, positions, rope, attention bias and mask, cache rows), every layer, and the logits
    of the decode rows and of the prompt tokens ``last``. Prompts attend over themselves, or,
    with ``c_rows``/``c_pos``, over those cache positions (a held prefix and themselves),
    read from the cache after the layer's write."""
    tokens: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    bias: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    last: torch.Tensor | None = None
    context: torch.Tensor | None = None
    dtype = rope_cos.dtype
    if history is not None and length is not None:
        pos = length[:n] - 1
        row_start = torch.arange(n, device=pos.device) * history.shape[1]
        tokens.append(history.view(-1).index_select(0, row_start + pos))
        positions.append(pos)
        per_head = pos.repeat_interleave(kv_heads)[:, None]
        visible = torch.arange(longest, device=pos.device) <= per_head
        bias = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None]  # [n * kvh, 1, L]
        writes.append((base[:n] + pos[:, None, None]).view(-1))
    if p_tokens is not None and p_rows is not None and p_pos is not None:
        tokens.append(p_tokens)
        positions.append(p_pos)
        if c_rows is not None and c_pos is not None:
            visible = (p_rows[:, None] == c_rows[None, :]) & (c_pos[None, :] <= p_pos[:, None])
            context = (base[c_rows] + c_pos[:, None, None]).view(-1)  # [C * 2 * kvh]
        else:
            visible = (p_rows[:, None] == p_rows[None, :]) & (p_pos[None, :] <= p_pos[:, None])
        mask = torch.where(visible, 0.0, float("-inf")).to(dtype)  # [T, T or C]
        writes.append((base[p_rows] + p_pos[:, None, None]).view(-1))
        if p_last is not None:
            last = p_last + n
    pos = positions[0] if len(positions) == 1 else torch.cat(positions)
    cos = torch.where(is_v, 1.0, rope_cos[pos][:, None])  # [T, heads + 2 kv_heads, head_dim]
    sin = torch.where(is_v, 0.0, rope_sin[pos][:, None])
    write = writes[0] if len(writes) == 1 else torch.cat(writes)

    # every decoder layer over the first n tokens (decode rows: attention over the cache, per
    # span of rows over the span's own length) and the rest (packed prompts: attention over
    # themselves under mask); keys and values go to the cache rows ``write`` first
    x = torch.embedding(embed, tokens[0] if len(tokens) == 1 else torch.cat(tokens))
    t, d, hidden = x.shape[0], head_dim, [x.shape[1]]
    routes: list[torch.Tensor] = []  # per layer with experts: [t, top_k] expert ids
    for i in range(len(flat)):
        m, b = 6 * i, 4 * i  # (ln_attn, qkv, o, ln_mlp, gate_up, down), their biases
        a = torch.rms_norm(x, hidden, matrices[m], eps)
        qkv = _linear(a, matrices[m + 1], biases[b]).view(t, -1, d)
        qkv = torch.addcmul(qkv * cos, qkv.roll(d // 2, dims=-1), sin)
        flat[i].index_copy_(0, write, qkv[:, heads:].reshape(-1, d))
        if n == 0:
            attended = _prompt_attention(qkv, mask, heads, kv_heads, flat[i], context)
        elif n == t:
            attended = _decode_attention(qkv, kv[i], bias, spans, longest, heads, kv_heads)
        else:
            attended = torch.cat((
                _decode_attention(qkv[:n], kv[i], bias, spans, longest, heads, kv_heads),
                _prompt_attention(qkv[n:], mask, heads, kv_heads, flat[i], context)))
        x = _residual(x, attended, matrices[m + 2], biases[b + 1])
        a = torch.rms_norm(x, hidden, matrices[m + 3], eps)
        gate_up = _linear(a, matrices[m + 4], biases[b + 2])
        half = gate_up.shape[-1] // 2
        gated = F.silu(gate_up[:, :half]).mul_(gate_up[:, half:])
        if len(experts) > 0 and experts[3 * i].numel() > 0:  # shared expert + routed ones
            route = torch.mm(a, experts[3 * i])  # [t, experts + 1]: router | shared gate
            shared = torch.mm(gated, matrices[m + 5]).mul_(torch.sigmoid(route[:, -1:]))
            routed, chosen = _routed_experts(a, route[:, :-1], experts[3 * i + 1],
                                             experts[3 * i + 2], top_k, norm_topk)
            routes.append(chosen)
            x = x + routed.add_(shared)
        else:
            x = _residual(x, gated, matrices[m + 5], biases[b + 3])
    routing = torch.stack(routes, dim=1) if len(routes) > 0 else None
    picks: list[torch.Tensor] = []
    if n > 0:
        picks.append(x[:n])
    if last is not None:
        picks.append(x.index_select(0, last))
    if len(picks) == 0:
        return None, routing
    x = picks[0] if len(picks) == 1 else torch.cat(picks)
    return torch.mm(torch.rms_norm(x, hidden, norm, eps), lm_head_t).float(), routing


def _routed_experts(
    a: torch.Tensor,
    logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    norm_topk: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over each token's top-k experts (by ``softmax(logits)``) of the expert's SiLU MLP
    of ``a`` times its routing weight; ``gate_up`` [experts, 2 x width, hidden], ``down``
    [experts, hidden, width]. Tokens grouped by expert: one matmul pair per expert hit.
    Returns the sum and the chosen experts [t, top_k]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weight, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    weight = weight.to(a.dtype).view(-1)
    flat = chosen.view(-1)
    order = torch.sort(flat, stable=True)[1]  # (token, k) pairs grouped by expert
    counts: list[int] = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token = torch.div(order, top_k, rounding_mode="floor")
    weight = weight.index_select(0, order)
    out = torch.zeros_like(a)
    start, width = 0, gate_up.shape[1] // 2
    for e, count in enumerate(counts):
        if count > 0:
            rows = token[start : start + count]
            h = torch.mm(a.index_select(0, rows), gate_up[e].t())
            h = F.silu(h[:, :width]).mul_(h[:, width:])
            y = torch.mm(h, down[e].t()).mul_(weight[start : start + count, None])
            out.index_add_(0, rows, y)
            start += count
    return out, chosen


def _linear(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    if b is None:
        return torch.mm(x, w_t)
    return torch.addmm(b, x, w_t)


def _residual(
    x: torch.Tensor, a: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    out = torch.addmm(x, a, w_t)
    if b is None:
        return out
    return out.add_(b)


def _decode_attention(
    qkv: torch.Tensor,
    kv: torch.Tensor,
    bias: torch.Tensor | None,
    spans: list[tuple[int, int, int]],
    longest: int,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Attention of one new token per row over the cache rows 0..n-1 of one layer's ``kv``,
    per span of (row, kv head) rows over the span's own longest row (one long row does not
    make every row pay)."""
    assert bias is not None
    n, d = qkv.shape[0], qkv.shape[-1]
    group, scale = heads // kv_heads, 1.0 / math.sqrt(d)
    window = kv[:, : n * kv_heads, :longest]  # [2, n * kvh, L, d] view
    keys_t, values = window[0].transpose(-1, -2), window[1]
    q = qkv[:, :heads].reshape(n * kv_heads, group, d)  # q heads grouped by their kv head
    out: list[torch.Tensor] = []
    for a, b, length in spans:
        s = torch.baddbmm(bias[a:b, :, :length], q[a:b], keys_t[a:b, :, :length], alpha=scale)
        out.append(torch.bmm(s.softmax(dim=-1), values[a:b, :length]))
    return (out[0] if len(out) == 1 else torch.cat(out)).view(n, -1)


def _prompt_attention(
    qkv: torch.Tensor, mask: torch.Tensor | None, heads: int, kv_heads: int,
    flat: torch.Tensor, context: torch.Tensor | None,
) -> torch.Tensor:
    """Packed prompts over themselves, or (``context``: flat cache rows of the positions they
    attend over, [C * (k|v) * kv_heads]) over those, read from one layer's ``flat`` cache."""
    t = qkv.shape[0]
    q, k, v = qkv.transpose(0, 1)[None].split([heads, kv_heads, kv_heads], dim=1)
    if context is not None:
        held = flat.index_select(0, context).view(-1, 2, kv_heads, qkv.shape[-1])  # [C,2,kvh,d]
        k = held[:, 0].transpose(0, 1)[None]  # [1, kvh, C, d]
        v = held[:, 1].transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(t, -1)
