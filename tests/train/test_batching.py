"""Packing by token budget and the prompt+response tensor layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from rollstream.train.batching import collate, gather_logprobs, pack_micro_batches
from tests.train.conftest import make_group


def check_packing(lengths: list[int], budget: int) -> list[list[int]]:
    packs = pack_micro_batches(lengths, budget)
    flat = sorted(i for p in packs for i in p)
    assert flat == list(range(len(lengths)))  # never dropped, never duplicated
    for p in packs:
        padded = len(p) * max(lengths[i] for i in p)
        assert padded <= budget or len(p) == 1  # only a lone over-long row may exceed
    assert pack_micro_batches(lengths, budget) == packs  # deterministic
    return packs


def test_packing_exhaustive_small_cases() -> None:
    for n in range(0, 5):
        for lengths in itertools.product([1, 2, 3, 5], repeat=n):
            for budget in range(1, 12):
                check_packing(list(lengths), budget)


def test_packing_hand_case() -> None:
    # sorted longest first: 6 (idx 1), 4 (idx 3), 3 (idx 0), 3 (idx 2), 1 (idx 4)
    assert check_packing([3, 6, 3, 4, 1], 12) == [[1, 3], [0, 2, 4]]
    assert check_packing([3, 6, 3, 4, 1], 6) == [[1], [3], [0, 2], [4]]
    assert check_packing([2, 2, 2], 100) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="budget_tokens"):
        pack_micro_batches([1], 0)


def test_collate_layout() -> None:
    g1 = make_group("a", [5, 6, 7], [[10, 11]], logprobs=[[-0.1, -0.2]], versions=[[3, 4]])
    g2 = make_group("b", [8], [[12, 13, 14]], env_tail=1)
    samples = [g1.samples[0], g2.samples[0]]
    mb = collate(samples)
    assert mb.input_ids.tolist() == [[5, 6, 7, 10, 11], [8, 12, 13, 14, 7]]
    assert mb.attention_mask.tolist() == [[1] * 5, [1] * 5]
    assert mb.targets.tolist() == [[10, 11, 0, 0], [12, 13, 14, 7]]
    assert mb.response_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert mb.loss_mask.tolist() == [[True, True, False, False], [True, True, True, False]]
    assert mb.versions.tolist() == [[3, 4, -1, -1], [0, 0, 0, -1]]
    assert mb.logp_behav[0, :2].tolist() == pytest.approx([-0.1, -0.2])
    # logits for response token t of row b come from input position P_b + t - 1
    positions = mb.logits_to_keep[mb.logit_index]
    for b, s in enumerate(samples):
        p = len(s.task.prompt_ids)
        for j in range(s.num_response_tokens):
            assert positions[b, j] == p + j - 1
            assert mb.input_ids[b, positions[b, j] + 1] == mb.targets[b, j]


def test_gather_logprobs_reads_the_predicting_position() -> None:
    g = make_group("a", [1, 2], [[3, 4]])
    mb = collate([g.samples[0]])
    torch.manual_seed(0)
    logits = torch.randn(1, len(mb.logits_to_keep), 8)
    got = gather_logprobs(logits, mb)
    want = torch.log_softmax(logits[0], -1)
    assert got[0].tolist() == pytest.approx([want[0, 3].item(), want[1, 4].item()])
