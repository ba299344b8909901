"""Shared-prefix training: a prefix that several sequences of a step begin with is computed
once per micro-batch, the rest of each sequence against it.

Which sequences share: the samples of one prompt (a GRPO group; a task drawn again) and the
turn-samples of an episode whose template rewrote earlier turns (``Sample.contexts``, laid
out by :func:`~rollstream.train.batching.pieces`) begin with the same tokens. Samples with
the same ``task.prompt_ids`` form a *unit* whose prefix is the longest common prefix of all
their pieces, stopped one token before the shortest context so that every logit predicting
a response token stays in its own piece (and at its own sample's temperature). A unit is
never split across micro-batches; one whose layout would exceed ``train.micro_batch_tokens``
is cut, in order, into chunks that fit, each sharing its own prefix.

Layout (:func:`~rollstream.train.batching.collate` with ``shared``): the prefix once,
positions ``0 .. L-1``, then each piece past it with positions from ``L``, as they are in
the piece alone; a block attention mask lets a piece attend to the prefix and causally to
itself. Every token thus sees exactly the keys and values, at the same positions, that it
sees in the flat layout (the piece on its own), so logprobs are the flat ones up to float
rounding, and the prefix's gradient is the sum of what each piece sends it, as in the flat
layout, where each copy of the prefix gets its piece's share. The policy, reference and
proximal forwards all take the same micro-batch, so all three compute the prefix once.

``train.shared_prefix``: ``off`` lays every sample out flat; ``on`` shares every prefix of at
least one token among at least two sequences; ``auto`` shares one of at least
:data:`AUTO_MIN_PREFIX` tokens among at least two sequences where that costs less than the
flat layout (:func:`cheaper_shared`), and stays flat under ``train.compile`` (the mask's
input has not been compiled and measured), ``train.router_aux_loss_coef > 0`` (the load-balancing loss averages over
the micro-batch's tokens, so a prefix computed once would weigh once, not once per sample)
and ``train.routing_replay: replay`` (a prefix laid out once replays one routing, while its
samples may have been routed by different versions); ``on`` with any of them is refused at
load (``config/train.py``, ``flat_only``, the one place these are decided).

What sharing costs. A shared unit is one run of tokens in its row, so its row is as wide as
the prefix plus every piece's rest, and a token's attention runs over its whole row (the
mask hides keys, it does not skip them): a token costs about ``1 + W / kappa`` of its linear
layers' work in a row of width ``W`` (:func:`attention_width` gives ``kappa``). A group of
long answers to a short prompt saves a few prompt tokens and makes each answer attend over
all eight answers: on the agent example's shape (hidden 128, episodes of up to 256 tokens,
a prompt of ~20) sharing every prefix made ``tests/test_e2e.py``'s AGENT run train 2.2x
slower than flat (273.7 s against 122.1 s for 20 steps; 2026-12-07, a 2-vCPU AMD EPYC VM,
``docs/prefix-cache.md``). So ``auto`` lays a unit out shared only where its estimated cost
is below the flat layout's, chunking the unit narrower where that pays; a long prompt under
short answers (the prefix bench: 3x faster shared) still shares.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rollstream.config.schema import TrainConfig
from rollstream.config.train import flat_only
from rollstream.train.batching import Unit, pieces, unit_length
from rollstream.trajectory import Sample

AUTO_MIN_PREFIX = 16
"""Shortest prefix ``auto`` shares (tokens)."""

Parts = list[list[tuple[list[int], list[int]]]]


def min_prefix(cfg: TrainConfig) -> int | None:
    """The shortest prefix worth sharing under ``cfg`` (None: every sample flat)."""
    if cfg.shared_prefix == "off":
        return None
    if cfg.shared_prefix == "auto":
        return None if flat_only(cfg) else AUTO_MIN_PREFIX
    return 1


def share_rule(cfg: TrainConfig, config: Any) -> tuple[int | None, float | None]:
    """What :func:`plan_units` takes for ``cfg`` and a model of ``config``'s shape: the
    shortest prefix worth sharing (:func:`min_prefix`) and, under ``auto``, ``kappa``
    (:func:`attention_width`: share only where it costs less); ``on`` shares every prefix."""
    low = min_prefix(cfg)
    return low, attention_width(config) if low is not None and cfg.shared_prefix == "auto" else None


def common_prefix(parts: Parts, members: Sequence[int]) -> int:
    """Tokens every piece of ``members`` begins with, short of each context's last one."""
    seqs = [c + r for b in members for c, r in parts[b]]
    cap = min(len(c) for b in members for c, _ in parts[b]) - 1
    return min(len(os.path.commonprefix(seqs)), max(cap, 0))


def _chunks(parts: Parts, members: list[int], budget: int) -> list[list[int]]:
    """``members`` in order, cut where a chunk sharing the whole list's prefix would pass
    ``budget`` tokens."""
    prefix = common_prefix(parts, members)
    chunks: list[list[int]] = [[]]
    for b in members:
        if chunks[-1] and unit_length(parts, ((*chunks[-1], b), prefix)) > budget:
            chunks.append([])
        chunks[-1].append(b)
    return chunks


def attention_width(config: Any) -> float:
    """``kappa``: the row width at which a token's attention costs what its linear layers
    cost, for a decoder of ``config``'s shape (a mixture of experts: the experts a token is
    routed to and the shared expert). Linear layers cost 2 FLOPs per weight per token;
    attention 4 per key per query channel (scores and values), counted twice: on a 2-vCPU
    AMD EPYC VM (2026-12-07) a token's forward and backward grew with its row's width 2.1
    (hidden 128) and 1.2 (hidden 256) times as fast as these FLOPs say (sdpa with a boolean
    mask, widths 256 to 3,200, one thread)."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, getattr(config, "num_key_value_heads", heads) * head_dim
    mlp = config.intermediate_size
    if getattr(config, "num_experts", 0):
        mlp = (config.moe_intermediate_size * config.num_experts_per_tok
               + (getattr(config, "shared_expert_intermediate_size", 0) or 0))
    linear = 2 * h * q + 2 * h * kv + 3 * h * mlp
    return linear / (4 * q)


def _cost(tokens: int, width: int, kappa: float) -> float:
    return tokens * (1 + width / kappa)


def cheaper_shared(parts: Parts, chunk: Sequence[int], prefix: int, flat_width: int,
                   kappa: float) -> bool:
    """Whether ``chunk`` laid out sharing ``prefix`` costs less than its samples flat, in
    rows ``flat_width`` wide (module docstring, "What sharing costs")."""
    shared = unit_length(parts, (chunk, prefix))
    flat = sum(unit_length(parts, ((b,), 0)) for b in chunk)
    return _cost(shared, max(shared, flat_width), kappa) < _cost(flat, flat_width, kappa)


def _units(parts: Parts, members: list[int], budget: int, min_tokens: int,
           flat_width: int, kappa: float | None) -> list[Unit]:
    units: list[Unit] = []
    for chunk in _chunks(parts, members, budget):
        prefix = common_prefix(parts, chunk)
        sequences = sum(len(parts[b]) for b in chunk)
        if sequences >= 2 and prefix >= min_tokens and (
                kappa is None or cheaper_shared(parts, chunk, prefix, flat_width, kappa)):
            units.append((tuple(chunk), prefix))
        else:
            units += [((b,), 0) for b in chunk]
    return units


def _estimate(parts: Parts, units: list[Unit], flat_width: int, kappa: float) -> float:
    lengths = [unit_length(parts, u) for u in units]
    return sum(_cost(n, max(n, flat_width), kappa) for n in lengths)


def plan_units(samples: Sequence[Sample], *, min_tokens: int | None, budget: int,
               kappa: float | None = None) -> tuple[list[Unit], list[int]]:
    """Units (sample indices, shared prefix) covering every sample once, and their lengths
    in a row; ``min_tokens``: :func:`min_prefix` (None: one flat unit per sample); ``kappa``
    (:func:`attention_width`; ``auto``): share only where the estimated cost is lower, in
    chunks of at most ``budget`` tokens or narrower ones where those cost less (None: every
    prefix that qualifies, in chunks of ``budget``)."""
    parts = [pieces(s) for s in samples]
    if min_tokens is None:
        units: list[Unit] = [((b,), 0) for b in range(len(samples))]
        return units, [unit_length(parts, u) for u in units]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for b, s in enumerate(samples):
        by_prompt.setdefault(tuple(s.task.prompt_ids), []).append(b)
    flat_width = max((unit_length(parts, ((b,), 0)) for b in range(len(samples))), default=0)
    units = []
    for members in by_prompt.values():
        plans = [_units(parts, members, budget, min_tokens, flat_width, kappa)]
        if kappa is not None:  # narrower chunks: rows of 1, 2, 4, ... flat widths
            width = max(flat_width, 1)
            while width < budget:
                plans.append(_units(parts, members, width, min_tokens, flat_width, kappa))
                width *= 2
            plans.sort(key=lambda plan: _estimate(parts, plan, flat_width, kappa))
        units += plans[0]
    return units, [unit_length(parts, u) for u in units]


def micro_batch_layout(units: Sequence[Unit], rows: Sequence[Sequence[int]]
                       ) -> tuple[list[int], list[list[int]], list[Unit]]:
    """A micro-batch of ``rows`` of unit indices as :func:`collate` takes it: the samples'
    indices in order, the rows and the shared units in places among them."""
    idx = [b for row in rows for u in row for b in units[u][0]]
    at = {b: k for k, b in enumerate(idx)}
    local = [[at[b] for u in row for b in units[u][0]] for row in rows]
    shared = [(tuple(at[b] for b in units[u][0]), units[u][1])
              for row in rows for u in row if units[u][1]]
    return idx, local, shared


def model_mask(mask: Tensor | None, model: torch.nn.Module) -> Tensor | None:
    """``mask`` as ``model``'s attention takes a custom 4D mask: bool for sdpa (True =
    attend), additive float for ``eager``."""
    if mask is None or getattr(model.config, "_attn_implementation", None) != "eager":
        return mask
    low = torch.finfo(torch.float32).min
    return torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, low)
