"""The tiny-model builder writes an ordinary, loadable, seeded HF folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.config.schema import TinyModelConfig
from rollstream.models.tiny import build_tiny_model, init_tiny_model
from rollstream.models.tokenizer import build_char_tokenizer

SMALL = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)
MOE = {"num_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
       "shared_expert_intermediate_size": 40}


@pytest.mark.parametrize(
    ("arch", "cls_name"), [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM"),
                           ("qwen2_moe", "Qwen2MoeForCausalLM")]
)
def test_folder_loads_with_auto_classes(tmp_path: Path, arch: str, cls_name: str) -> None:
    tokenizer = build_char_tokenizer()
    moe = MOE if arch == "qwen2_moe" else {}
    folder = build_tiny_model(TinyModelConfig(arch=arch, **SMALL, **moe), tokenizer,
                              tmp_path / arch)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == cls_name
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok) == len(tokenizer)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("T517#07=", add_special_tokens=False)])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))


def test_init_is_seeded_and_leaves_the_global_rng_alone() -> None:
    tokenizer = build_char_tokenizer()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = init_tiny_model(TinyModelConfig(seed=1, **SMALL), tokenizer).state_dict()
    after = torch.rand(1)
    b = init_tiny_model(TinyModelConfig(seed=1, **SMALL), tokenizer).state_dict()
    c = init_tiny_model(TinyModelConfig(seed=2, **SMALL), tokenizer).state_dict()
    assert torch.equal(before, after)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_default_size_is_about_0_8m_parameters() -> None:
    model = init_tiny_model(TinyModelConfig(), build_char_tokenizer())
    assert 0.7e6 < sum(p.numel() for p in model.parameters()) < 0.9e6


def test_bad_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="hidden_size .* multiple of .*num_heads"):
        init_tiny_model(
            TinyModelConfig(hidden_size=30, num_heads=4, num_kv_heads=2), build_char_tokenizer()
        )


def test_moe_model_routes_every_layer_through_the_configured_experts(tmp_path: Path) -> None:
    folder = build_tiny_model(TinyModelConfig(arch="qwen2_moe", **SMALL, **MOE),
                              build_char_tokenizer(), tmp_path / "moe")
    model = AutoModelForCausalLM.from_pretrained(folder)
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size) == (3, 2, 24, 40)
    assert (c.decoder_sparse_step, c.mlp_only_layers, c.norm_topk_prob) == (1, [], False)
    for layer in model.model.layers:  # experts in every layer, a shared expert with its gate
        mlp = layer.mlp
        assert mlp.gate.weight.shape == (3, 32)
        assert mlp.experts.gate_up_proj.shape == (3, 2 * 24, 32)
        assert mlp.shared_expert.up_proj.weight.shape == (40, 32)
        assert mlp.shared_expert_gate.weight.shape == (1, 32)
        assert mlp.gate.weight.abs().sum() > 0  # initialised, not the zeros it is built with
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids, output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (4, 3)


def test_moe_settings_are_checked_against_the_arch() -> None:
    with pytest.raises(ValueError, match="model.tiny.num_experts is read only with "
                                         "model.tiny.arch: qwen2_moe"):
        TinyModelConfig(arch="qwen2", num_experts=8)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be at most "
                                         r"model.tiny.num_experts \(4\)"):
        TinyModelConfig(arch="qwen2_moe", num_experts_per_tok=5)
