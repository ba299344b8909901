"""Packing by token budget and the prompt+response tensor layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from rollstream.train.batching import (
    PAD_ID,
    collate,
    gather_logprobs,
    pack_micro_batches,
    pack_rows,
)
from tests.train.conftest import make_group


def check_packing(lengths: list[int], budget: int) -> list[list[list[int]]]:
    packs = pack_micro_batches(lengths, budget)
    flat = sorted(i for rows in packs for row in rows for i in row)
    assert flat == list(range(len(lengths)))  # never dropped, never duplicated
    longest = max((n for n in lengths if n <= budget), default=0)
    for rows in packs:
        width = max(sum(lengths[i] for i in row) for row in rows)  # collate's row width
        if len(rows) == 1 and len(rows[0]) == 1 and lengths[rows[0][0]] > budget:
            continue  # only a lone over-long sample may exceed the budget
        assert width <= longest and len(rows) * width <= budget
    assert pack_micro_batches(lengths, budget) == packs  # deterministic
    return packs


def test_packing_exhaustive_small_cases() -> None:
    for n in range(0, 5):
        for lengths in itertools.product([1, 2, 3, 5], repeat=n):
            for budget in range(1, 12):
                check_packing(list(lengths), budget)


def test_packing_hand_case() -> None:
    # longest first: 6 (idx 1), 4 (idx 3), 3 (idx 0), 3 (idx 2), 1 (idx 4); rows of width 6,
    # first fit: [1], [3, 4], [0, 2]; then as many rows per micro-batch as budget // 6
    assert check_packing([3, 6, 3, 4, 1], 12) == [[[1], [3, 4]], [[0, 2]]]
    assert check_packing([3, 6, 3, 4, 1], 18) == [[[1], [3, 4], [0, 2]]]
    assert check_packing([3, 6, 3, 4, 1], 6) == [[[1]], [[3, 4]], [[0, 2]]]
    assert check_packing([2, 2, 2], 100) == [[[0], [1], [2]]]
    assert check_packing([9, 2, 2], 4) == [[[0]], [[1], [2]]]  # 9 > budget: alone
    assert pack_rows([4, 3, 2, 1, 2], 6) == [[0, 2], [1, 3, 4]]
    with pytest.raises(ValueError, match="budget_tokens"):
        pack_micro_batches([1], 0)


def test_collate_layout() -> None:
    g1 = make_group("a", [5, 6, 7], [[10, 11]], logprobs=[[-0.1, -0.2]], versions=[[3, 4]])
    g2 = make_group("b", [8], [[12, 13, 14]], env_tail=1)
    g3 = make_group("c", [9, 9], [[15, 16, 17, 18]])
    samples = [g3.samples[0], g1.samples[0], g2.samples[0]]  # widths 6, 5, 5
    mb = collate(samples)
    # width 6: row 0 holds c; a (5) and b (5) get a row each, with one padding token
    assert mb.input_ids.tolist() == [[9, 9, 15, 16, 17, 18], [5, 6, 7, 10, 11, PAD_ID],
                                     [8, 12, 13, 14, 7, PAD_ID]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 0],
                                        [0, 1, 2, 3, 4, 0]]
    assert mb.targets.tolist() == [[15, 16, 17, 18], [10, 11, 0, 0], [12, 13, 14, 7]]
    assert mb.response_mask.tolist() == [[True] * 4, [True, True, False, False], [True] * 4]
    assert mb.loss_mask.tolist() == [[True] * 4, [True, True, False, False],
                                     [True, True, True, False]]
    assert mb.versions.tolist() == [[0] * 4, [3, 4, -1, -1], [0, 0, 0, -1]]
    assert mb.logp_behav[1, :2].tolist() == pytest.approx([-0.1, -0.2])
    check_predicting_positions(mb, samples)


def test_collate_shares_rows() -> None:
    long = make_group("l", [1, 2], [[3, 4, 5, 6, 7, 8]])  # 8 tokens
    short = make_group("s", [9], [[10, 11], [12, 13, 14]])  # 3 and 4 tokens
    samples = [long.samples[0], *short.samples]
    mb = collate(samples)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 9, 12, 13, 14, PAD_ID]]
    assert mb.position_ids.tolist() == [list(range(8)), [0, 1, 2, 0, 1, 2, 3, 0]]
    check_predicting_positions(mb, samples)


def test_widths_rounded_up_to_a_multiple() -> None:
    # rows as wide as the longest sample rounded up (bf16 on CPU: few matmul shapes)
    # rows of 8 (not 6) take 6 + 1 and 4 + 3; 16 // 8 = 2 rows per micro-batch
    assert pack_micro_batches([3, 6, 3, 4, 1], 16, width_multiple=8) == [[[1, 4], [3, 0]], [[2]]]
    assert pack_micro_batches([9, 2], 16, width_multiple=8) == [[[0, 1]]]  # a row of 16
    long = make_group("l", [1, 2], [[3, 4, 5, 6, 7, 8]])  # 8 tokens
    short = make_group("s", [9], [[10, 11]])  # 3 tokens
    samples = [long.samples[0], short.samples[0]]
    mb = collate(samples, [[0], [1]], width_multiple=6)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, PAD_ID, PAD_ID, PAD_ID, PAD_ID],
                                     [9, 10, 11] + [PAD_ID] * 9]
    assert mb.position_ids[0].tolist() == [*range(8), 0, 1, 2, 3]  # padding: its own segment
    check_predicting_positions(mb, samples)
    with pytest.raises(ValueError, match="width_multiple"):
        pack_micro_batches([1], 4, width_multiple=0)


def check_predicting_positions(mb, samples) -> None:
    """Response token t of a sample is predicted at its row offset + P + t - 1 (same row)."""
    num_kept = len(mb.logits_to_keep)
    for b, s in enumerate(samples):
        rows, cols = mb.logit_index[b] // num_kept, mb.logits_to_keep[mb.logit_index[b] % num_kept]
        for t in range(s.num_response_tokens):
            r, c = int(rows[t]), int(cols[t])
            assert mb.input_ids[r, c + 1] == mb.targets[b, t] == s.response_ids[t]
            assert mb.position_ids[r, c + 1] == len(s.task.prompt_ids) + t


def test_gather_logprobs_reads_the_predicting_position() -> None:
    g = make_group("a", [1, 2], [[3, 4]])
    mb = collate([g.samples[0]])
    torch.manual_seed(0)
    logits = torch.randn(1, len(mb.logits_to_keep), 8)
    got = gather_logprobs(logits, mb)
    want = torch.log_softmax(logits[0], -1)
    assert got[0].tolist() == pytest.approx([want[0, 3].item(), want[1, 4].item()])
