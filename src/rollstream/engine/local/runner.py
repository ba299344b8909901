"""Device side of the local engine: the KV cache, the per-row state, prefill and decode steps.

All per-row state lives in preallocated device tensors indexed by cache row (live rows are
``0..n-1``): the token history, the logprob of every sampled token, the row length, its
length limit, its stop ids and its sampling parameters. A decode step is then a fixed number
of tensor ops whatever the batch size: gather the last tokens, run the model, sample, write
token and logprob back, and test every row for a stop token or the length limit at once. The
model and the sampling with its bookkeeping are two TorchScript calls (``jit.py``).
Sampled tokens stay on the device; the host reads a row's tokens once, when it finishes.
A numpy mirror of the row lengths sizes the attention window without a device sync.

Decode attention runs in chunks of consecutive rows, each over its own longest row. Rows that
finish are replaced by the last ones (short and new) and resumed requests arrive long, so the
rows drift out of length order and a chunk's long row makes its short ones pay. Every few
steps ``sort_rows`` regroups the live rows so that each chunk holds the rows it would hold in
the longest-first order, moving only the rows that change chunk, when the attention work that
saves over the next steps outweighs copying the moved rows' cache. Results do not depend on a
row's place: its sampling key and position move with it.

Deliberately simplified: one sync per step (which rows finished), no overlap of host work
with the next step's forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields

import numpy as np
import torch

from rollstream.engine.local import model
from rollstream.engine.local.jit import scripted
from rollstream.engine.local.model import KVCache, Rope, move_cache_rows
from rollstream.engine.local.prefix import PrefixCache, copy_blocks
from rollstream.engine.local.routing import (
    copy_routing,
    read_routing,
    record_routing,
    routing_table,
)
from rollstream.engine.local.sampler import Sampler, sample
from rollstream.engine.local.scheduler import Sequence
from rollstream.engine.local.weights import ModelSpec, Weights
from rollstream.trajectory import Routing


@dataclass(slots=True, kw_only=True)
class RowState:
    """Per-row device tensors, indexed by cache row."""

    tokens: torch.Tensor  # [rows, max_seq_len] int64: prompt + sampled ids
    logprobs: torch.Tensor  # [rows, max_seq_len] float32: logprob of the token at that position
    length: torch.Tensor  # [rows] int64: tokens held
    limit: torch.Tensor  # [rows] int64: prompt + max_new_tokens
    stop: torch.Tensor  # [rows, max_stops] int64, padded with -1
    inv_temp: torch.Tensor  # [rows] float32 (1.0 for greedy)
    top_p: torch.Tensor  # [rows] float32
    top_k: torch.Tensor  # [rows] int64 (vocab size = off)
    key: torch.Tensor  # [rows] int64 sampler seed key
    greedy: torch.Tensor  # [rows] bool
    # [rows, max_seq_len, moe layers, top_k] uint8 (int16 from 255 experts on): the experts
    # the token at that position was routed to when last computed (empty for a dense model)
    experts: torch.Tensor

    def all(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


class ModelRunner:
    def __init__(
        self,
        spec: ModelSpec,
        weights: Weights,
        *,
        max_rows: int,
        max_seq_len: int,
        device: torch.device,
        dtype: torch.dtype,
        prefix_cache_tokens: int = 0,
    ) -> None:
        self.spec, self.weights, self.device = spec, weights, device
        self.max_rows, self.max_seq_len = max_rows, max_seq_len
        self.cache = KVCache.allocate(spec, max_rows, max_seq_len, device, dtype)
        self.prefix = PrefixCache(spec, prefix_cache_tokens, device, dtype)
        self.rope = Rope.build(spec, max_seq_len, device, dtype)
        self.sampler = Sampler(spec.vocab_size, device)
        i64, f32 = {"device": device, "dtype": torch.int64}, {"device": device}
        self.rows = RowState(
            tokens=torch.zeros(max_rows, max_seq_len, **i64),
            logprobs=torch.zeros(max_rows, max_seq_len, **f32),
            length=torch.zeros(max_rows, **i64),
            limit=torch.zeros(max_rows, **i64),
            stop=torch.full((max_rows, 1), -1, **i64),
            inv_temp=torch.ones(max_rows, **f32),
            top_p=torch.ones(max_rows, **f32),
            top_k=torch.zeros(max_rows, **i64),
            key=torch.zeros(max_rows, **i64),
            greedy=torch.zeros(max_rows, dtype=torch.bool, device=device),
            experts=routing_table(spec, (max_rows, max_seq_len), device),
        )
        # numpy views of the token and logprob history (never reallocated; CPU only)
        self._host = ((self.rows.tokens.numpy(), self.rows.logprobs.numpy())
                      if device.type == "cpu" else None)
        self.length_host = np.zeros(max_rows, dtype=np.int64)
        self.sampled_host = np.zeros(max_rows, dtype=bool)  # temperature > 0
        self.truncated_host = np.zeros(max_rows, dtype=bool)  # top-p or top-k active
        self.num_rows = 0
        self.steps_since_sort = 0
        self.num_sorts = 0
        self.last_chunks: list[tuple[int, int, int]] = []  # of the last decode step

    # ---- steps -------------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """Start ``seqs`` in rows n..n+m-1, sample their first token; returns finished rows."""
        lo, hi = self.num_rows, self.num_rows + len(seqs)
        logits = self._forward(None, self._admit(seqs))
        self._store_prompts(seqs, lo)
        self.num_rows = hi
        return self._sample_and_record(logits, lo, hi)

    def decode(self, new: list[Sequence] = ()) -> list[int]:
        """One token for every live row and, in the same forward pass, the prefill of
        ``new`` into rows n..n+m-1 with their first token; returns the rows that finished."""
        n, r = self.num_rows, self.rows
        self.last_chunks = attention_chunks(self.length_host[:n])
        rows = model.DecodeRows(history=r.tokens, length=r.length, chunks=self.last_chunks)
        prompts = self._admit(new) if new else None
        logits = self._forward(rows, prompts)
        if new:
            self._store_prompts(new, n)
        self.num_rows = n + len(new)
        return self._sample_and_record(logits, 0, self.num_rows)

    def _forward(self, rows: model.DecodeRows | None,
                 prompts: model.PackedPrompts | None) -> torch.Tensor | None:
        """``model.forward``; the experts it chose go to its input tokens' positions."""
        logits, routing = model.forward(self.spec, self.weights, self.cache, self.rope, rows,
                                        prompts)
        if routing is not None:
            record_routing(self.rows.experts, routing, self.rows.length[:0 if rows is None
                                                                         else self.num_rows],
                           None if prompts is None else (prompts.rows, prompts.pos))
        return logits

    def routing(self, rows: list[int]) -> list[Routing | None]:
        """The experts of every token ``rows`` hold (None each for a dense model): the last
        token's marked not computed (no pass took it as input)."""
        return [read_routing(self.rows.experts[row, : int(self.length_host[row])])
                for row in rows]

    def _admit(self, seqs: list[Sequence]) -> model.PackedPrompts:
        """Write the prompts and sampling parameters of ``seqs`` into rows n..n+m-1 (not live
        until their forward pass ran) and their prefix cache hits into those rows' cache; the
        packed prompts to prefill (the tokens after each hit). Built on the host, then
        written by one scripted call."""
        lo, hi, r, vocab = self.num_rows, self.num_rows + len(seqs), self.rows, self.spec.vocab_size
        params = [s.request.params for s in seqs]
        width = max(len(p.stop_token_ids) for p in params)
        if width > r.stop.shape[1]:
            grown = torch.full((self.max_rows, width), -1, dtype=torch.int64, device=self.device)
            grown[:, : r.stop.shape[1]] = r.stop
            r.stop = grown
        stop = np.full((len(seqs), r.stop.shape[1]), -1, dtype=np.int64)
        for i, p in enumerate(params):
            stop[i, : len(p.stop_token_ids)] = p.stop_token_ids
        temps = np.array([p.temperature for p in params], dtype=np.float64)
        lens = np.array([len(s.request.prompt_ids) for s in seqs], dtype=np.int64)
        ints = np.array([[s.prompt_len + s.max_new_tokens, p.top_k or vocab, s.seed_key,
                          p.temperature == 0] for s, p in zip(seqs, params, strict=True)],
                        dtype=np.int64)
        inv_temp = np.where(temps > 0, 1.0 / np.maximum(temps, 1e-30), 1.0)  # finite in fp32
        floats = np.stack([inv_temp, [p.top_p for p in params]], axis=1).astype(np.float32)
        packed = self._packed(np.arange(lo, hi), lens, with_last=True)
        host_tokens = np.fromiter(
            (t for s in seqs for t in s.request.prompt_ids), dtype=np.int64, count=int(lens.sum()))
        packed.tokens = self._to_device(host_tokens)
        scripted(write_admitted)(
            r.tokens, r.length, r.limit, r.stop, r.inv_temp, r.top_p, r.top_k, r.key, r.greedy,
            lo, packed.rows, packed.pos, packed.tokens, self._to_device(lens),
            self._to_device(ints), self._to_device(floats), self._to_device(stop))
        self.length_host[lo:hi] = lens
        self.sampled_host[lo:hi] = temps > 0
        self.truncated_host[lo:hi] = [p.top_p < 1 or 0 < p.top_k < vocab for p in params]
        held = np.array([len(s.prefix) for s in seqs], dtype=np.int64) * self.prefix.block_tokens
        if not held.any():
            return packed
        self._copy_hits(seqs, lo)
        rest = self._packed(np.arange(lo, hi), lens - held, with_last=True, start=held)
        rest.tokens = self._to_device(host_tokens[self._host_pos(lens) >= np.repeat(held, lens)])
        rest.context_rows, rest.context_pos = packed.rows, packed.pos
        return rest

    def _copy_hits(self, seqs: list[Sequence], lo: int) -> None:
        """Copy each admitted sequence's cached prefix blocks into its row (row lo + i)."""
        block = self.prefix.block_tokens
        slots = [slot for s in seqs for slot in s.prefix]
        rows = [lo + i for i, s in enumerate(seqs) for _ in s.prefix]
        pos = [j * block for s in seqs for j in range(len(s.prefix))]
        ints = self._to_device(np.array([slots, rows, pos], dtype=np.int64))
        pool = self.prefix.pool
        assert pool is not None
        t0 = time.perf_counter()
        copy_blocks(pool, ints[0], torch.zeros_like(ints[0]), self.cache, ints[1], ints[2])
        if self.prefix.experts is not None:  # the cached tokens' routing comes with them
            copy_routing(self.prefix.experts, ints[0], None, self.rows.experts, ints[1], ints[2])
        self.prefix.counts["prefix_copy_s"] += time.perf_counter() - t0

    def _store_prompts(self, seqs: list[Sequence], lo: int) -> None:
        """After their pass: the admitted prompts' whole blocks into the prefix cache (their
        holds on their hits end)."""
        if not self.prefix.on:
            return
        self.store_rows(list(range(lo, lo + len(seqs))),
                        [s.request.prompt_ids for s in seqs])
        for seq in seqs:
            self.prefix.release(seq.prefix)
            seq.prefix = []

    def store_ended(self, rows: list[int], seqs: list[Sequence],
                    results: list[tuple[list[int], list[float]]], interrupted: bool) -> None:
        """Before their rows are released: store the rows an interrupt stopped (a resumed
        request re-sends prompt + partial) and the finished rows of an episode (its next turn
        re-sends prompt + output), the keys and values they hold: all but the last token."""
        kept = [i for i, s in enumerate(seqs) if interrupted or s.request.episode_id is not None]
        if kept and self.prefix.on:
            self.store_rows([rows[i] for i in kept],
                            [[*seqs[i].request.prompt_ids, *results[i][0][:-1]] for i in kept],
                            [seqs[i].request.episode_id for i in kept])

    def store_rows(self, rows: list[int], tokens: list[Seq[int]],
                   episodes: Seq[str | None] | None = None) -> None:
        """The whole blocks of ``tokens[i]`` (a prefix of what row ``rows[i]`` holds keys and
        values for) into the prefix cache, the blocks not cached yet copied out of the row
        (tagged with ``episodes[i]``, ``PrefixCache.end_episode``)."""
        block, src, slots = self.prefix.block_tokens, [], []
        for i, (row, toks) in enumerate(zip(rows, tokens, strict=True)):
            episode = episodes[i] if episodes is not None else None
            for index, slot in self.prefix.insert(toks, len(toks), episode):
                src.append((row, index * block))
                slots.append(slot)
        if not slots:
            return
        pool = self.prefix.pool
        assert pool is not None
        t0 = time.perf_counter()
        ints = self._to_device(np.array([[r for r, _ in src], [p for _, p in src], slots],
                                        dtype=np.int64))
        copy_blocks(self.cache, ints[0], ints[1], pool, ints[2], torch.zeros_like(ints[2]))
        if self.prefix.experts is not None:
            copy_routing(self.rows.experts, ints[0], ints[1], self.prefix.experts, ints[2], None)
        self.prefix.counts["prefix_copy_s"] += time.perf_counter() - t0

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if self.device.type == "cpu" else t.to(self.device)

    def recompute_cache(self, budget_tokens: int) -> None:
        """Rebuild the KV cache of every live row with the current weights (after a weight
        load), in chunks of about ``budget_tokens``; the next decode step continues as usual."""
        chunk: list[int] = []
        for row in range(self.num_rows):
            chunk.append(row)
            if int(self.length_host[chunk].sum()) >= budget_tokens or row == self.num_rows - 1:
                lens = self.length_host[chunk] - 1  # the last is the input
                packed = self._packed(np.array(chunk), lens, with_last=False)
                packed.tokens = self.rows.tokens[packed.rows, packed.pos]
                self._forward(None, packed)
                chunk = []

    @staticmethod
    def _host_pos(lens: np.ndarray) -> np.ndarray:
        """0..lens[i]-1 for each i, packed."""
        ends = np.cumsum(lens)
        return np.arange(int(ends[-1])) - np.repeat(ends - lens, lens)

    def _packed(self, rows: np.ndarray, lens: np.ndarray, *, with_last: bool,
                start: np.ndarray | None = None) -> model.PackedPrompts:
        """``lens[i]`` positions of each row from ``start[i]`` (default 0) packed (tokens left
        to the caller)."""
        ends = np.cumsum(lens)
        pos = self._host_pos(lens) + (0 if start is None else np.repeat(start, lens))
        return model.PackedPrompts(
            tokens=torch.empty(0, dtype=torch.int64, device=self.device),
            rows=self._to_device(np.repeat(rows, lens)),
            pos=self._to_device(pos),
            last=self._to_device(ends - 1) if with_last else None,
        )

    def sort_rows(self) -> list[int] | None:
        """Regroup the live rows by length when it pays (checked every ``SORT_EVERY`` steps):
        each row goes to the attention chunk it has in the longest-first order, and only the
        rows in another chunk move (``chunk_order``). It pays when the attention work it saves
        in a step, over ``SORT_HORIZON`` steps, exceeds what copying the moved rows' cache
        costs (``MOVE_COST`` work per position copied, plus ``SORT_FIXED``). Returns the new
        order (new row i = old row order[i]) or None."""
        self.steps_since_sort += 1
        n = self.num_rows
        if n <= CHUNK_ROWS or self.steps_since_sort < SORT_EVERY:
            return None
        self.steps_since_sort = 0
        lengths = self.length_host[:n]
        order = chunk_order(lengths)
        moved = np.flatnonzero(order != np.arange(n))
        if moved.size == 0:
            return None
        gain = attention_work(lengths) - attention_work(lengths[order])
        cost = MOVE_COST * int(lengths[order[moved]].sum()) + SORT_FIXED
        if gain * SORT_HORIZON <= cost:
            return None
        self._move(order[moved], moved)
        for a in (self.length_host, self.sampled_host, self.truncated_host):
            a[:n] = a[order]
        self.num_sorts += 1
        return order.tolist()

    def _sample_and_record(self, logits: torch.Tensor, lo: int, hi: int) -> list[int]:
        r, sampled = self.rows, self.sampled_host[lo:hi]
        any_sampled = bool(sampled.any())
        done = scripted(sample_and_record)(
            logits, r.tokens, r.logprobs, r.length, r.limit, r.stop, r.inv_temp,
            r.top_p, r.top_k, r.key, r.greedy, self.sampler.vocab_hash, lo, hi, any_sampled,
            not sampled.all(), any_sampled and bool(self.truncated_host[lo:hi].any()))
        self.length_host[lo:hi] += 1
        return done.tolist()

    # ---- rows --------------------------------------------------------------------------
    def read(self, rows: list[int], prompt_lens: list[int]) -> list[tuple[list[int], list[float]]]:
        """Sampled tokens and logprobs of ``rows`` (on the CPU read through numpy views of the
        row state, no tensor op; else one device-to-host copy per row and kind)."""
        if self.device.type == "cpu":
            tokens, logprobs = self._host
        else:
            tokens, logprobs = self.rows.tokens, self.rows.logprobs
        out = []
        for row, start in zip(rows, prompt_lens, strict=True):
            end = int(self.length_host[row])
            out.append((tokens[row, start:end].tolist(), logprobs[row, start:end].tolist()))
        return out

    def num_generated(self, row: int, prompt_len: int) -> int:
        return int(self.length_host[row]) - prompt_len

    def release(self, num_released: int, src: list[int], dst: list[int]) -> None:
        """Drop ``num_released`` rows; copy rows ``src`` into the holes ``dst`` first."""
        if src:
            self._move(np.array(src), np.array(dst))
            for a in (self.length_host, self.sampled_host, self.truncated_host):
                a[dst] = a[src]
        self.num_rows -= num_released

    def _move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy the state and cache of rows ``src`` into rows ``dst`` (host mirrors: the
        caller's), in one scripted call; gathered before written (a permutation may move)."""
        scripted(move_rows)(list(self.rows.all()), self.cache.kv, self.cache.base,
                            self._to_device(src), self._to_device(dst),
                            self._to_device(self.length_host[src]))


CHUNK_ROWS = 8  # rows per attention chunk of a decode step (a few bmm calls per layer)
MERGE_WORK = 300  # cache positions x rows of attention that cost about as much as a chunk's ops
MERGED_ROWS = 32  # rows at most in a merged chunk (larger ones leave the CPU's caches)
SORT_EVERY = 4  # decode steps between two checks of whether regrouping the rows pays
SORT_HORIZON = 16  # steps a regrouping is counted to save work for (rows finish and drift)
MOVE_COST = 4  # attention work (positions x rows) that copying one cache position costs
SORT_FIXED = 2000  # the same for a regrouping's fixed cost (row state copies, indexing)


def write_admitted(
    tokens: torch.Tensor,
    length: torch.Tensor,
    limit: torch.Tensor,
    stop: torch.Tensor,
    inv_temp: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    key: torch.Tensor,
    greedy: torch.Tensor,
    lo: int,
    rows: torch.Tensor,
    pos: torch.Tensor,
    prompt_tokens: torch.Tensor,
    lens: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    stops: torch.Tensor,
) -> None:
    """The prompts and parameters of admitted rows lo..lo+m-1 into the row state: ``ints``
    [m, 4] = (length limit, top-k, seed key, greedy), ``floats`` [m, 2] = (1 / temperature,
    top-p)."""
    hi = lo + lens.shape[0]
    tokens[rows, pos] = prompt_tokens
    length[lo:hi] = lens
    limit[lo:hi] = ints[:, 0]
    top_k[lo:hi] = ints[:, 1]
    key[lo:hi] = ints[:, 2]
    inv_temp[lo:hi] = floats[:, 0]
    top_p[lo:hi] = floats[:, 1]
    greedy[lo:hi] = ints[:, 3] == 1
    stop[lo:hi] = stops


def move_rows(state: list[torch.Tensor], kv: torch.Tensor, base: torch.Tensor,
              src: torch.Tensor, dst: torch.Tensor, lengths: torch.Tensor) -> None:
    """Rows ``src`` of every row-state tensor and of the cache into rows ``dst``."""
    for t in state:
        t[dst] = t[src]
    move_cache_rows(kv, base, src, dst, lengths)


def sample_and_record(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    length: torch.Tensor,
    limit: torch.Tensor,
    stop: torch.Tensor,
    inv_temp: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    key: torch.Tensor,
    greedy: torch.Tensor,
    vocab_hash: torch.Tensor,
    lo: int,
    hi: int,
    any_sampled: bool,
    any_greedy: bool,
    any_truncated: bool,
) -> torch.Tensor:
    """Sample a token for rows lo..hi-1 from their ``logits``, write it and its logprob at
    the row's length, count it; returns the rows that finished (stop token or length limit)."""
    pos = length[lo:hi]  # where the sampled tokens go (a view: used before the add_)
    new, logp = sample(logits, inv_temp[lo:hi], top_p[lo:hi], top_k[lo:hi], key[lo:hi],
                       greedy[lo:hi], pos, vocab_hash, any_sampled, any_greedy, any_truncated)
    flat = torch.arange(lo, hi, device=pos.device) * tokens.shape[1] + pos
    tokens.view(-1).index_copy_(0, flat, new)
    logprobs.view(-1).index_copy_(0, flat, logp)
    length[lo:hi].add_(1)
    done = (length[lo:hi] >= limit[lo:hi]) | (new[:, None] == stop[lo:hi]).any(dim=-1)
    return done.nonzero()[:, 0] + lo


def _chunks(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    n = len(lengths)
    return [(lo, min(lo + CHUNK_ROWS, n), int(lengths[lo : lo + CHUNK_ROWS].max()))
            for lo in range(0, n, CHUNK_ROWS)]


def chunks_work(chunks: list[tuple[int, int, int]]) -> int:
    """Cache positions read per layer by attention over these chunks."""
    return sum((hi - lo) * length for lo, hi, length in chunks)


def attention_work(lengths: np.ndarray) -> int:
    """Cache positions read per layer by chunked decode attention over rows in this order."""
    return chunks_work(_chunks(lengths))


def attention_chunks(lengths: np.ndarray) -> list[tuple[int, int, int]]:
    """(first row, end row, attention length) per chunk of consecutive rows: one chunk when
    splitting would save under a quarter of the attention work, else chunks of CHUNK_ROWS rows,
    each attending over its own longest row (a long-tail batch pays for its long rows only),
    a chunk joined to the one before it (up to MERGED_ROWS rows) when that adds under
    MERGE_WORK positions of work: each chunk costs a few tensor ops per layer."""
    n = len(lengths)
    longest = int(lengths.max())
    chunks = _chunks(lengths)
    if chunks_work(chunks) >= 0.75 * n * longest:
        return [(0, n, longest)]
    out = [chunks[0]]
    for lo, hi, length in chunks[1:]:
        first, _, before = out[-1]
        top = max(before, length)
        added = (hi - first) * top - (lo - first) * before - (hi - lo) * length
        if hi - first <= MERGED_ROWS and added < MERGE_WORK:
            out[-1] = (first, hi, top)
        else:
            out.append((lo, hi, length))
    return out


def chunk_order(lengths: np.ndarray) -> np.ndarray:
    """A permutation (new row i = old row ``order[i]``) that puts every row in the attention
    chunk it has in the longest-first order, moving only the rows that change chunk: the
    attention work is that of the sorted order (a chunk's work does not depend on the order
    within it), for a fraction of the copies of a full sort."""
    n = len(lengths)
    chunk = np.arange(n) // CHUNK_ROWS
    target = np.empty(n, dtype=np.int64)
    target[np.argsort(-lengths, kind="stable")] = chunk
    order = np.arange(n)
    movers = np.flatnonzero(target != chunk)
    # a chunk frees as many places as rows arrive in it; the freed places ascend, so they
    # come chunk by chunk, and so do the movers ordered by their target chunk
    order[movers] = movers[np.argsort(target[movers], kind="stable")]
    return order
