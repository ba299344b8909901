"""Build a tiny Qwen2, Llama or Qwen2-MoE causal LM from ``TinyModelConfig``; save it as a HF
folder.

The folder (config.json, model.safetensors, generation_config.json and the tokenizer files)
is an ordinary Hugging Face checkpoint: everything else in rollstream loads it with
``AutoModelForCausalLM`` / ``AutoTokenizer``, so a real Qwen2/Llama/Qwen2-MoE folder can take
its place. A Qwen2-MoE model has experts in every layer (``decoder_sparse_step`` 1, no
``mlp_only_layers``) and transformers' defaults otherwise: top-k probabilities not
renormalised (``norm_topk_prob`` false), q/k/v biases, no sliding window.

Simplifications: fp32 weights, tied input/output embeddings, the stock HF initialisation under
a fixed seed (the caller's torch RNG state is left untouched), no sliding window.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from rollstream.config.schema import TinyModelConfig
from rollstream.models.folder_check import check_tokenizer, stop_token_ids

_ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
}


def init_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialised model sized by ``cfg`` whose vocabulary is ``len(tokenizer)``."""
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(
            f"model.tiny.hidden_size ({cfg.hidden_size}) must be a multiple of "
            f"model.tiny.num_heads ({cfg.num_heads})"
        )
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"model.tiny.num_heads ({cfg.num_heads}) must be a multiple of "
            f"model.tiny.num_kv_heads ({cfg.num_kv_heads})"
        )
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer of a tiny model needs an eos_token and a pad_token")
    config_cls, model_cls = _ARCHS[cfg.arch]
    moe = {} if cfg.arch != "qwen2_moe" else {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
    }
    config = config_cls(
        **moe,
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_cls(config).to(torch.float32)
    gen = model.generation_config
    gen.eos_token_id = stop_token_ids(tokenizer)  # end-of-text and the chat's end-of-turn
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = None
    return model


def save_model_folder(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path
) -> Path:
    """Write ``model`` (safetensors) and ``tokenizer`` into ``out_dir``, check that
    ``AutoTokenizer`` reads the tokenizer back as it is, and return ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    check_tokenizer(out_dir, tokenizer)
    return out_dir


def build_tiny_model(
    cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerBase, out_dir: Path
) -> Path:
    """Initialise a tiny model under ``cfg.seed`` and save it with ``tokenizer`` in ``out_dir``."""
    return save_model_folder(init_tiny_model(cfg, tokenizer), tokenizer, Path(out_dir))


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
