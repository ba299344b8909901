"""Micro-batches: packing samples by a token budget and laying them out as tensors.

Packing (:func:`pack_micro_batches`) is deterministic: rows are sorted by length (longest
first, ties by input order) and filled greedily while ``rows * longest_row`` (the padded
prompt+response tokens of the micro-batch) stays within the budget. A row longer than the
budget on its own gets a micro-batch of its own (a row is never split). Every index appears in
exactly one micro-batch.

Layout (:class:`MicroBatch`): row ``b`` is ``prompt + response``, right-padded. Response token
``t`` (0-based) sits at input position ``P_b + t`` and its logprob is read from the logits at
position ``P_b + t - 1``. Only the logits span covering all response positions of the
micro-batch is computed (``logits_to_keep``), which saves the ``[B, prompt, vocab]`` part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rollstream.trajectory import Sample

PAD_ID = 0  # any id works: padded positions are masked out of attention and of the loss


def pack_micro_batches(lengths: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Indices into ``lengths`` grouped so that ``len(group) * max(length) <= budget_tokens``."""
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        # sorted longest first, so the first row of a batch is its widest
        if current and (len(current) + 1) * lengths[current[0]] <= budget_tokens:
            current.append(i)
        else:
            batches.append([i])
    return batches


@dataclass(slots=True, kw_only=True)
class MicroBatch:
    """Right-padded tensors of a few samples (B rows, L input positions, T response tokens)."""

    input_ids: Tensor  # [B, L] long: prompt + response, PAD_ID after the row's end
    attention_mask: Tensor  # [B, L] long
    logits_to_keep: Tensor  # [K] long: input positions whose logits are computed
    logit_index: Tensor  # [B, T] long: index into the kept logits predicting token t
    targets: Tensor  # [B, T] long: response token ids (PAD_ID at padding)
    response_mask: Tensor  # [B, T] bool: a real response token
    loss_mask: Tensor  # [B, T] bool: the sample's loss mask (False at padding)
    logp_behav: Tensor  # [B, T] float32: engine logprobs (0 at padding)
    versions: Tensor  # [B, T] long: policy version per token (-1 at padding)

    def to(self, device: str | torch.device) -> MicroBatch:
        return MicroBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """Lay out samples (each with at least one response token) as one micro-batch."""
    prompts = [list(s.task.prompt_ids) for s in samples]
    responses = [s.response_ids for s in samples]
    if any(not r for r in responses):
        raise ValueError("collate: every sample needs at least one response token")
    num_rows = len(samples)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    num_resp = max(len(r) for r in responses)
    start = min(len(p) for p in prompts) - 1  # first logits position needed
    end = max(len(p) + len(r) for p, r in zip(prompts, responses)) - 1  # exclusive

    input_ids = torch.full((num_rows, width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((num_rows, width), dtype=torch.long)
    logit_index = torch.zeros((num_rows, num_resp), dtype=torch.long)
    targets = torch.full((num_rows, num_resp), PAD_ID, dtype=torch.long)
    response_mask = torch.zeros((num_rows, num_resp), dtype=torch.bool)
    loss_mask = torch.zeros((num_rows, num_resp), dtype=torch.bool)
    logp_behav = torch.zeros((num_rows, num_resp), dtype=torch.float32)
    versions = torch.full((num_rows, num_resp), -1, dtype=torch.long)
    for b, (sample, prompt, response) in enumerate(zip(samples, prompts, responses)):
        n_p, n_r = len(prompt), len(response)
        input_ids[b, : n_p + n_r] = torch.tensor(prompt + response)
        attention_mask[b, : n_p + n_r] = 1
        logit_index[b, :n_r] = torch.arange(n_p - 1 - start, n_p - 1 - start + n_r)
        targets[b, :n_r] = torch.tensor(response)
        response_mask[b, :n_r] = True
        loss_mask[b, :n_r] = torch.tensor(sample.loss_mask)
        logp_behav[b, :n_r] = torch.tensor(sample.logprobs, dtype=torch.float32)
        versions[b, :n_r] = torch.tensor(sample.versions)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        logits_to_keep=torch.arange(start, end),
        logit_index=logit_index,
        targets=targets,
        response_mask=response_mask,
        loss_mask=loss_mask,
        logp_behav=logp_behav,
        versions=versions,
    )


def gather_logprobs(kept_logits: Tensor, mb: MicroBatch) -> Tensor:
    """``[B, T]`` float32 logprobs of the response tokens from ``[B, K, V]`` kept logits.

    float32 ``log_softmax`` of the raw logits (temperature 1), as an engine reports them;
    0 at padding.
    """
    rows = torch.arange(kept_logits.shape[0], device=kept_logits.device)[:, None]
    picked = kept_logits[rows, mb.logit_index]  # [B, T, V]
    logp = torch.log_softmax(picked.float(), dim=-1)
    logp = logp.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    return torch.where(mb.response_mask, logp, 0.0)
