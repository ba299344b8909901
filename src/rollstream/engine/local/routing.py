"""Routing replay on the engine side: the table of experts each token of a row (or of a
prefix cache block) was routed to, and its reading into a :class:`Routing`.

The runner writes the experts a forward pass chose at the positions of the pass's input
tokens (``ModelRunner._forward``, through :func:`record_routing`): prompts when prefilled, a sampled token when the
next decode step takes it as input, every position again when a weight load recomputes the
cache. A prefix cache hit copies its blocks' experts into the row with their keys and
values. So a row's table holds, for every token but the last, the routing under the weights
that computed the keys and values it holds. One byte an id (two from 255 experts on).
"""

from __future__ import annotations

import numpy as np
import torch

from rollstream.config.engine import PREFIX_BLOCK_TOKENS
from rollstream.engine.local.weights import ModelSpec
from rollstream.trajectory import Routing


def routing_table(spec: ModelSpec, lead: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[*lead, moe layers, top_k]`` expert ids, all "not computed" (empty when dense)."""
    moe = spec.moe
    if moe is None:
        return torch.zeros(*lead, 0, 0, dtype=torch.uint8, device=device)
    dtype = torch.uint8 if moe.num_experts < 0xFF else torch.int16
    return torch.full((*lead, sum(moe.layers), moe.top_k), -1 if dtype == torch.int16 else 0xFF,
                      dtype=dtype, device=device)


def read_routing(table: torch.Tensor) -> Routing | None:
    """One row's ``[tokens, moe layers, top_k]`` expert ids as a :class:`Routing`, the last
    token marked not computed."""
    if table.shape[-1] == 0 or table.shape[0] == 0:
        return None
    wide = table.dtype == torch.int16
    ids = table.cpu().numpy().astype("<u2" if wide else np.uint8)  # int16 -1 -> 0xFFFF
    ids[-1] = 0xFFFF if wide else 0xFF
    return Routing(num_layers=table.shape[1], top_k=table.shape[2], experts=ids.tobytes(),
                   wide=wide)


def record_routing(table: torch.Tensor, routing: torch.Tensor, decode_length: torch.Tensor,
                   prompts: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """A forward pass's experts ``routing`` [n + T, moe layers, top_k] into the rows'
    ``table`` at the positions of its input tokens: decode rows 0..n-1 (``decode_length``,
    the rows' lengths before the step's token), then the packed prompts' (rows, positions)."""
    width, at = table.shape[1], []
    n = decode_length.shape[0]
    if n:
        at.append(torch.arange(n, device=table.device) * width + decode_length - 1)
    if prompts is not None:
        at.append(prompts[0] * width + prompts[1])
    table.view(-1, *table.shape[2:]).index_copy_(0, torch.cat(at), routing.to(table.dtype))


def copy_routing(src: torch.Tensor, src_at: torch.Tensor, src_pos: torch.Tensor | None,
                 dst: torch.Tensor, dst_at: torch.Tensor, dst_pos: torch.Tensor | None) -> None:
    """The experts of ``BLOCK_TOKENS`` positions from (``src_at[i]``, ``src_pos[i]``) to
    (``dst_at[i]``, ``dst_pos[i]``): between rows and the prefix pool, either way (a pool
    block's positions start at 0: ``None``)."""
    block = PREFIX_BLOCK_TOKENS
    offsets = torch.arange(block, device=src.device)
    src_cols = offsets if src_pos is None else src_pos[:, None] + offsets
    dst_cols = offsets if dst_pos is None else dst_pos[:, None] + offsets
    dst[dst_at[:, None], dst_cols] = src[src_at[:, None], src_cols]
