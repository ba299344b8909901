"""Micro-batches: packing samples by a token budget and laying them out as tensors.

Padding-free rows. A micro-batch is ``R`` rows of width ``W`` = its longest sample
(prompt + response); several shorter samples share a row back to back, each with its own
position ids starting at 0, and the row's unused tail is one more segment of ``PAD_ID`` tokens
(positions from 0 again). With ``attention_mask=None`` and such position ids, transformers
builds a block-diagonal causal mask (its packed-sequence path), so a token attends only to
its own sample, exactly as in an unpadded forward of that sample alone.

Packing (:func:`pack_micro_batches`) is deterministic: samples are sorted by length (longest
first, ties by input order) and placed first-fit into rows as wide as the longest sample
(:func:`pack_rows`), so short samples fill the tails of the rows of long ones; consecutive
rows then form micro-batches of ``R * W <= budget`` tokens computed. A sample longer than the
budget gets a micro-batch of its own (a sample is never split). Every index appears in
exactly one row of one micro-batch.

Layout (:class:`MicroBatch`): the per-token loss tensors are ``[B, T]`` per *sample* (B
samples, T = longest response). Response token ``t`` of a sample placed at row ``r``, offset
``o`` with a ``P``-token prompt sits at position ``o + P + t`` and its logprob is read from the
logits at ``o + P + t - 1``. Only the logits columns that predict some response token are
computed (``logits_to_keep``, shared by all rows); ``logit_index`` indexes the flattened
``[R * K]`` kept logits.

An episode whose chat template rewrote earlier turns (``Sample.contexts``) is laid out as its
turn-samples (``trajectory.turn_samples``), back to back in its row, each its served context
and the tokens that followed it, positions from 0 at each: every response token is predicted
from exactly the context it was sampled in. Its ``[T]`` row of the loss tensors is still the
sample's whole response, in order, so advantages, loss aggregation, IS and the kept-token
counts treat it as the one sample it is: the loss is that of an append-only rendering of the
same tokens, each under its own context.

Shared prefixes (``collate``'s ``shared``; which and when: :mod:`.shared_prefix`). A *unit*
of samples whose pieces all begin with the same ``L`` tokens is laid out as those tokens
once (positions ``0 .. L-1``), then every piece's rest with positions from ``L``, and the
micro-batch carries a block attention mask (``[R, 1, W, W]``, True = attend): each piece
attends to its unit's prefix and causally to itself, every other run of tokens (a flat
piece, the padding tail) causally to itself alone, so every token sees what it sees in the
flat layout. ``L`` stays below each piece's context length, so the logit predicting a
response token always lies in its own piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rollstream.ops.truncation import truncate, truncates
from rollstream.train.routing import routing_ids
from rollstream.trajectory import Sample

PAD_ID = 0  # any id works: padding is its own segment, outside every sample's attention


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit of ``lengths`` (in the given order) into rows of ``width`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i, n in enumerate(lengths):
        if n > width:
            raise ValueError(f"pack_rows: length {n} exceeds the row width {width}")
        r = next((r for r, f in enumerate(free) if f >= n), None)
        if r is None:
            rows.append([i])
            free.append(width - n)
        else:
            rows[r].append(i)
            free[r] -= n
    return rows


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_micro_batches(lengths: Sequence[int], budget_tokens: int,
                       width_multiple: int = 1) -> list[list[list[int]]]:
    """Micro-batches as rows of indices into ``lengths``: first-fit decreasing into rows as
    wide as the longest sample (rounded up to ``width_multiple``), then consecutive rows while
    ``rows * width`` stays within ``budget_tokens`` (a sample longer than the budget gets a
    micro-batch of its own)."""
    if budget_tokens < 1 or width_multiple < 1:
        raise ValueError(f"budget_tokens and width_multiple must be >= 1, got {budget_tokens} "
                         f"and {width_multiple}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    alone = [i for i in order if lengths[i] > budget_tokens]
    rest = [i for i in order if lengths[i] <= budget_tokens]
    batches: list[list[list[int]]] = [[[i]] for i in alone]
    if rest:
        width = round_up(lengths[rest[0]], width_multiple)
        rows = [[rest[j] for j in row] for row in pack_rows([lengths[i] for i in rest], width)]
        per_batch = max(1, budget_tokens // width)
        batches += [rows[k : k + per_batch] for k in range(0, len(rows), per_batch)]
    return batches


@dataclass(slots=True, kw_only=True)
class MicroBatch:
    """Packed rows of a few samples (R rows, W positions; B samples, T response tokens)."""

    input_ids: Tensor  # [R, W] long: samples back to back, PAD_ID in the row's tail
    position_ids: Tensor  # [R, W] long: from 0 at every sample (and at the padding tail)
    token_mask: Tensor  # [R, W] bool: a sample's token (False in the padding tail)
    logits_to_keep: Tensor  # [K] long: positions whose logits are computed (every row)
    logit_index: Tensor  # [B, T] long: index into the [R * K] kept logits predicting token t
    targets: Tensor  # [B, T] long: response token ids (PAD_ID at padding)
    response_mask: Tensor  # [B, T] bool: a real response token
    loss_mask: Tensor  # [B, T] bool: the sample's loss mask (False at padding)
    logp_behav: Tensor  # [B, T] float32: engine logprobs (0 at padding)
    versions: Tensor  # [B, T] long: policy version per token (-1 at padding)
    temperature: Tensor  # [R, K] float32: sampling temperature of the kept logits' sample
    # [R, W, moe layers, top_k] long: the experts the engine routed each token to
    # (Sample.routing), -1 where not recorded; [R, W, 0, 0] when no sample carries routing.
    # Laid out flat: a shared prefix is never planned under routing replay (flat_only)
    experts: Tensor
    attention_mask: Tensor | None = None  # [R, 1, W, W] bool, where a unit shares a prefix

    def to(self, device: str | torch.device) -> MicroBatch:
        return MicroBatch(**{f.name: None if getattr(self, f.name) is None
                             else getattr(self, f.name).to(device) for f in fields(self)})


def pieces(sample: Sample) -> list[tuple[list[int], list[int]]]:
    """(context, response tokens after it) per turn-sample of ``sample``: one piece, prompt and
    response, unless the template rewrote earlier turns (module docstring)."""
    if not sample.contexts:
        return [(list(sample.task.prompt_ids), sample.response_ids)]
    segs = sample.segments
    return [(list(t.prompt_ids), [i for g in segs[t.first:t.end] for i in g.token_ids])
            for t in sample.turn_samples()]


Unit = tuple[Sequence[int], int]  # sample indices laid out back to back, tokens they share


def _row_units(parts: list[list[tuple[list[int], list[int]]]], rows: Sequence[Sequence[int]],
               shared: Sequence[Unit]) -> list[list[Unit]]:
    """Per row, its units in order: each sample alone (no prefix) unless ``shared`` puts it in
    a unit, whose members must follow each other in one row and whose every piece must start
    with the unit's prefix and go on past it into its context."""
    unit_of = {b: (tuple(members), prefix) for members, prefix in shared for b in members}
    out: list[list[Unit]] = []
    for members in rows:
        units: list[Unit] = []
        for b in members:
            unit = unit_of.get(b, ((b,), 0))
            if unit[0][0] == b:
                units.append(unit)
            elif not units or units[-1] != unit:
                raise ValueError(f"collate: unit {unit[0]} is not consecutive in one row")
        out.append(units)
    for members, prefix in shared:
        seqs = [(c, c + r) for b in members for c, r in parts[b]]
        if prefix < 0 or any(len(c) <= prefix or s[:prefix] != seqs[0][1][:prefix]
                             for c, s in seqs):
            raise ValueError(f"collate: samples {list(members)} do not share {prefix} tokens "
                             f"before each of their contexts' last token")
    return out


def unit_length(parts: list[list[tuple[list[int], list[int]]]], unit: Unit) -> int:
    """Tokens a unit takes in a row: its prefix once, then every piece past it."""
    members, prefix = unit
    return prefix + sum(len(c) + len(r) - prefix for b in members for c, r in parts[b])


def block_mask(block: Tensor, root: Tensor) -> Tensor:
    """``[R, 1, W, W]`` bool: a token attends causally within its block and to the whole
    block its own hangs from (``root``: a shared prefix, laid out before it; itself if none)."""
    same = block[:, :, None] == block[:, None, :]
    under = root[:, :, None] == block[:, None, :]
    width = block.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=block.device).tril()
    return ((same | under) & causal)[:, None]


@dataclass(slots=True, kw_only=True)
class _Layout:
    """The ``[R, W]`` tensors of a micro-batch being laid out, row by row."""

    input_ids: Tensor
    position_ids: Tensor
    token_mask: Tensor
    temps: Tensor
    block: Tensor  # contiguous causal runs of tokens, numbered in their row
    root: Tensor  # the run each one also attends to (a shared prefix; else itself)

    @classmethod
    def empty(cls, rows: int, width: int) -> _Layout:
        return cls(input_ids=torch.full((rows, width), PAD_ID, dtype=torch.long),
                   position_ids=torch.zeros((rows, width), dtype=torch.long),
                   token_mask=torch.zeros((rows, width), dtype=torch.bool),
                   temps=torch.ones((rows, width), dtype=torch.float32),
                   block=torch.zeros((rows, width), dtype=torch.long),
                   root=torch.zeros((rows, width), dtype=torch.long))

    def put(self, r: int, offset: int, tokens: list[int], first_position: int, run: int,
            root: int, temperature: float = 1.0) -> int:
        """Write one run of ``tokens`` at ``offset`` of row ``r``; returns its end."""
        end = offset + len(tokens)
        self.input_ids[r, offset:end] = torch.tensor(tokens)
        self.position_ids[r, offset:end] = torch.arange(first_position,
                                                        first_position + len(tokens))
        self.temps[r, offset:end] = temperature
        self.block[r, offset:end], self.root[r, offset:end] = run, root
        return end

    def row(self, r: int, units: list[Unit], parts: list[list[tuple[list[int], list[int]]]],
            own: list[float | None], temperature: float) -> list[tuple[int, int, Tensor]]:
        """Lay out row ``r``'s units; per sample (index, row, the positions whose logits
        predict its response tokens)."""
        offset, run, out = 0, 0, []
        for members, prefix in units:
            head = run
            if prefix:  # the unit's shared tokens, once
                offset = self.put(r, offset, parts[members[0]][0][0][:prefix], 0, run, run)
                run += 1
            for b in members:
                predicting = []
                for context, response in parts[b]:  # a turn-sample: positions from 0
                    first = offset + len(context) - prefix - 1  # predicts its first response
                    predicting.append(torch.arange(first, first + len(response)))
                    offset = self.put(r, offset, (context + response)[prefix:], prefix, run,
                                      head if prefix else run,
                                      temperature if own[b] is None else own[b])
                    run += 1
                out.append((b, r, torch.cat(predicting)))
        width = self.input_ids.shape[1]
        self.position_ids[r, offset:] = torch.arange(width - offset)  # the padding's own run
        self.block[r, offset:] = self.root[r, offset:] = run
        self.token_mask[r, :offset] = True
        return out


def collate(samples: Sequence[Sample], rows: Sequence[Sequence[int]] | None = None, *,
            temperature: float = 1.0, width_multiple: int = 1,
            shared: Sequence[Unit] = ()) -> MicroBatch:
    """Lay out samples (each with at least one response token) as one micro-batch.

    ``rows``: indices into ``samples`` per row (every sample exactly once); by default rows as
    wide as the longest sample, filled first-fit in the given order (:func:`pack_rows`).
    ``temperature``: of a sample that does not record its own (``Sample.temperature``).
    ``width_multiple``: the rows' width is rounded up to a multiple of it (more padding, fewer
    shapes: :mod:`rollstream.train.precision`).
    ``shared``: units (sample indices consecutive in one row, prefix length) whose pieces
    share their first tokens, laid out once (module docstring); with one, the micro-batch
    carries its block attention mask.
    """
    parts = [pieces(s) for s in samples]
    responses = [[i for _, r in p for i in r] for p in parts]
    if any(not r for r in responses):
        raise ValueError("collate: every sample needs at least one response token")
    if rows is None:
        lengths = [unit_length(parts, ((b,), 0)) for b in range(len(samples))]
        rows = pack_rows(lengths, max(lengths))
    if sorted(b for row in rows for b in row) != list(range(len(samples))):
        raise ValueError("collate: rows must hold every sample exactly once")
    units = _row_units(parts, rows, shared)
    width = round_up(max(sum(unit_length(parts, u) for u in row) for row in units),
                     width_multiple)
    experts = _routing_rows(samples, parts, units, width)
    num_resp = max(len(r) for r in responses)

    lay = _Layout.empty(len(rows), width)
    own = [s.temperature for s in samples]
    # per sample, in order: its index, row, and the positions whose logits predict its tokens
    where: list[tuple[int, int, Tensor]] = []
    for r, row in enumerate(units):
        where += lay.row(r, row, parts, own, temperature)
    where.sort(key=lambda w: w[0])
    # logits columns predicting a response token, in some row
    needed = torch.zeros(width, dtype=torch.bool)
    for _, _, predicting in where:
        needed[predicting] = True
    keep = needed.nonzero()[:, 0]
    column = torch.full((width,), -1, dtype=torch.long)
    column[keep] = torch.arange(len(keep))

    logit_index = torch.zeros((len(samples), num_resp), dtype=torch.long)
    targets = torch.full((len(samples), num_resp), PAD_ID, dtype=torch.long)
    response_mask = torch.zeros((len(samples), num_resp), dtype=torch.bool)
    loss_mask = torch.zeros((len(samples), num_resp), dtype=torch.bool)
    logp_behav = torch.zeros((len(samples), num_resp), dtype=torch.float32)
    versions = torch.full((len(samples), num_resp), -1, dtype=torch.long)
    for (b, r, predicting), sample, response in zip(where, samples, responses, strict=True):
        n_r = len(response)
        logit_index[b, :n_r] = r * len(keep) + column[predicting]
        targets[b, :n_r] = torch.tensor(response)
        response_mask[b, :n_r] = True
        loss_mask[b, :n_r] = torch.tensor(sample.loss_mask)
        logp_behav[b, :n_r] = torch.tensor(sample.logprobs, dtype=torch.float32)
        versions[b, :n_r] = torch.tensor(sample.versions)
    return MicroBatch(
        input_ids=lay.input_ids,
        position_ids=lay.position_ids,
        token_mask=lay.token_mask,
        logits_to_keep=keep,
        logit_index=logit_index,
        targets=targets,
        response_mask=response_mask,
        loss_mask=loss_mask,
        logp_behav=logp_behav,
        versions=versions,
        temperature=lay.temps[:, keep],
        experts=experts,
        attention_mask=block_mask(lay.block, lay.root) if shared else None,
    )


def _piece_routing(sample: Sample) -> list[Tensor | None]:
    """Per piece (:func:`pieces`): the routing recorded for it (its turn-sample's: the
    sample's for the first, each context's for the one it starts), None where none was."""
    records = [sample.routing, *(c.routing for c in sample.contexts)]
    return [None if r is None else routing_ids(r) for r in records]


def _routing_rows(samples: Sequence[Sample], parts: list[list[tuple[list[int], list[int]]]],
                  units: Sequence[Sequence[Unit]], width: int) -> Tensor:
    """``MicroBatch.experts``: each piece's recorded routing at its tokens' places, as the
    units lay them out (a shared prefix once, from the unit's first piece's record)."""
    recorded = [_piece_routing(s) for s in samples]
    shapes = {tuple(ids.shape[1:]) for pieces_ in recorded for ids in pieces_ if ids is not None}
    if len(shapes) > 1:
        raise ValueError(f"collate: samples carry routing of different shapes "
                         f"(moe layers, top_k): {sorted(shapes)}")
    out = torch.full((len(units), width, *(shapes.pop() if shapes else (0, 0))), -1,
                     dtype=torch.long)
    for r, row in enumerate(units):
        offset = 0
        for members, prefix in row:
            start = 0  # the prefix is laid out once, before the unit's first piece's rest
            for b in members:
                for (context, rest), ids in zip(parts[b], recorded[b], strict=True):
                    n = len(context) + len(rest) - start
                    if ids is not None:
                        piece = ids[start : start + n]
                        out[r, offset : offset + len(piece)] = piece
                    offset, start = offset + n, prefix
    return out


def padding_micro_batch() -> MicroBatch:
    """A micro-batch of no sample (one ``PAD_ID`` token in, ``B = 0``): its loss is an empty
    sum. A data-parallel rank with fewer micro-batches than the others computes these, so
    that every rank runs the same forward and backward passes (FSDP pairs their collectives)."""
    none = (0, 1)  # [B = 0, T = 1]
    return MicroBatch(
        input_ids=torch.full((1, 1), PAD_ID, dtype=torch.long),
        position_ids=torch.zeros((1, 1), dtype=torch.long),
        token_mask=torch.zeros((1, 1), dtype=torch.bool),
        logits_to_keep=torch.zeros(1, dtype=torch.long),
        logit_index=torch.zeros(none, dtype=torch.long),
        targets=torch.full(none, PAD_ID, dtype=torch.long),
        response_mask=torch.zeros(none, dtype=torch.bool),
        loss_mask=torch.zeros(none, dtype=torch.bool),
        logp_behav=torch.zeros(none, dtype=torch.float32),
        versions=torch.full(none, -1, dtype=torch.long),
        temperature=torch.ones((1, 1), dtype=torch.float32),
        experts=torch.full((1, 1, 0, 0), -1, dtype=torch.long),
    )


def gather_logprobs(kept_logits: Tensor, mb: MicroBatch, *, top_p: float = 1.0,
                    top_k: int = 0) -> Tensor:
    """``[B, T]`` float32 logprobs of the response tokens from ``[R, K, V]`` kept logits.

    float32 ``log_softmax`` of the logits as given (the caller applies the temperature),
    after the sampler's top-k / top-p truncation when ``top_p < 1`` or ``top_k > 0``
    (:mod:`rollstream.ops.truncation`), as an engine reports them; 0 at padding. A token
    outside the truncated support has logprob ``-inf``.
    """
    picked = kept_logits.reshape(-1, kept_logits.shape[-1])[mb.logit_index].float()  # [B, T, V]
    if truncates(top_p, top_k, picked.shape[-1]):
        picked = truncate(picked, top_p, top_k)
    logp = torch.log_softmax(picked, dim=-1)
    logp = logp.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(mb.response_mask, logp, 0.0)
