"""Shared helpers of the engine tests: a random tiny Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_SEQ_LEN = 128  # context of every engine under test
MAX_SLOTS = 4  # concurrent sequences (small, so that tests exercise queueing)
VOCAB = 96


def make_tiny_model(path: Path, *, arch: str = "qwen2", seed: int = 0, **overrides) -> Path:
    """Save a random tiny Llama/Qwen2/Qwen2-MoE folder (config.json + model.safetensors) at
    ``path``. A Qwen2-MoE has 4 experts, 2 per token, and a shared expert in every layer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
    )

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    }[arch]
    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=arch != "llama",
        # a wider init than HF's 0.02, so that logits are peaked and every layer matters
        initializer_range=0.25,
    )
    if arch == "qwen2_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=64)
    kwargs.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**kwargs)).eval()
    model.save_pretrained(path)
    return path
