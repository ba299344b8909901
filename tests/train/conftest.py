"""Fixtures for trainer tests: a random tiny Qwen2 folder, and a group builder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from rollstream.staleness import StalenessPolicy
from rollstream.trajectory import Group, Segment, SegmentKind, Task

VOCAB = 64
SYNC = StalenessPolicy(max_staleness=0)  # on-policy: loss auto = ppo_clip, every token kept


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    return path


def make_group(
    uid: str,
    prompt: Sequence[int],
    responses: Sequence[Sequence[int]],
    *,
    rewards: Sequence[float | None] | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
    versions: Sequence[Sequence[int]] | None = None,
    env_tail: int = 0,
) -> Group:
    """A group of policy responses (optionally followed by ``env_tail`` env tokens)."""
    task = Task(uid=uid, source="test", prompt_ids=tuple(prompt), prompt_text="", reference="")
    group = Group.new(task, len(responses))
    for i, (sample, resp) in enumerate(zip(group.samples, responses)):
        n = len(resp)
        sample.segments.append(
            Segment(
                kind=SegmentKind.POLICY,
                token_ids=list(resp),
                logprobs=list(logprobs[i]) if logprobs else [-1.0] * n,
                versions=list(versions[i]) if versions else [0] * n,
                loss_mask=[True] * n,
            )
        )
        if env_tail:
            sample.segments.append(Segment.env([7] * env_tail))
        sample.reward = None if rewards is None else rewards[i]
    return group
