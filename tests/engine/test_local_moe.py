"""The local engine on Qwen2-MoE folders (the engine contract runs on one too: the
``local_moe`` kind of test_contract.py): each way a config places and weighs experts, and
both namings of the experts' weights."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from rollstream.config.schema import LocalEngineConfig
from rollstream.engine import GenerateRequest, SamplingParams
from rollstream.engine.local import LocalEngine
from rollstream.engine.local.weights import fuse_experts
from tests.engine.helpers import MAX_SEQ_LEN, VOCAB, make_tiny_model


def _engine(path) -> LocalEngine:
    return LocalEngine(path, LocalEngineConfig(max_slots=4, max_seq_len=MAX_SEQ_LEN, threads=1,
                                               device="cpu"))


def _greedy(rid: str, prompt: list[int], n: int = 32) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt,
                           params=SamplingParams(temperature=0.0, max_new_tokens=n))


@pytest.mark.parametrize("overrides", [
    {"norm_topk_prob": True},  # top-k probabilities renormalised
    {"num_experts_per_tok": 1, "num_experts": 3},
    {"decoder_sparse_step": 2, "intermediate_size": 96},  # layer 0 dense, layer 1 experts
    {"mlp_only_layers": [1], "qkv_bias": False},
], ids=["norm_topk", "top1", "sparse_step", "mlp_only"])
def test_moe_folder_matches_hf_forward(tmp_path, overrides):
    """Greedy tokens are the argmax of transformers' forward pass over the same sequence and
    the logprobs its log-softmax (fp32), however the config places and weighs experts."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path / "m", arch="qwen2_moe", seed=5, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    engine = _engine(path)
    try:
        outs = engine.generate_many([_greedy(f"r{i}", p) for i, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1]
        assert o.token_ids == logits.argmax(-1).tolist()
        hf_lp = logits.log_softmax(-1).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert (torch.tensor(o.logprobs) - hf_lp).abs().max().item() < 1e-4


async def test_experts_load_fused_or_one_by_one(tiny_moe_dir):
    """A saved folder names every expert's matrices apart; the trainer's state_dict holds
    them fused: both install the same weights, and an incomplete set is refused by name."""
    from transformers import AutoModelForCausalLM

    saved = {}
    for f in sorted(tiny_moe_dir.glob("*.safetensors")):
        saved.update(load_file(f))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in saved
    fused = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    stacked = fuse_experts(saved, 4)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(stacked[name], fused[name])
    engine = _engine(tiny_moe_dir)
    try:
        prompt = [5, 17, 33, 2, 60]
        first = await engine.generate(_greedy("a", prompt))
        perturbed = {k: v + 0.05 * torch.randn_like(v) for k, v in fused.items()}
        await engine.load_weights(1, perturbed)
        moved = await engine.generate(_greedy("b", prompt))
        await engine.load_weights(2, saved)
        back = await engine.generate(_greedy("c", prompt))
        assert moved.logprobs != first.logprobs
        assert (back.token_ids, back.logprobs) == (first.token_ids, first.logprobs)
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts.*missing \[\(2"):
            await engine.load_weights(3, {k: v for k, v in saved.items()
                                          if k != "model.layers.1.mlp.experts.2.up_proj.weight"})
        assert engine.stats().version == 2
    finally:
        await engine.close()


async def test_after_a_mid_stream_load_tokens_are_the_new_policy(tiny_moe_dir):
    """The cache recompute after a load routes the prefix through the new router: the
    tokens after the switch are what the new weights give from the same prefix."""
    from tests.engine.test_local import _load_mid_stream

    g = torch.Generator().manual_seed(5)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=g)
           for k, v in load_file(tiny_moe_dir / "model.safetensors").items()}
    engine = _engine(tiny_moe_dir)
    try:
        prompt, max_new = [9, 40, 41, 3, 77, 12], 100
        mixed, k = await _load_mid_stream(engine, prompt, max_new, 1, new)
        cont = await engine.generate(_greedy("c", prompt + mixed.token_ids[:k], max_new - k))
        assert mixed.token_ids[k:] == cont.token_ids
        assert max(abs(a - b) for a, b in zip(mixed.logprobs[k:], cont.logprobs)) < 1e-4
    finally:
        await engine.close()


def test_bfloat16_moe_engine_follows_the_float32_one(tiny_moe_dir):
    """Routing runs its softmax in float32 whatever the engine's dtype (as transformers):
    a bfloat16 engine serves the MoE model, its logprobs near the float32 engine's."""
    outs = {}
    for dtype in ("float32", "bfloat16"):
        engine = LocalEngine(tiny_moe_dir, LocalEngineConfig(
            max_slots=4, max_seq_len=MAX_SEQ_LEN, threads=1, device="cpu", dtype=dtype))
        try:
            outs[dtype] = engine.generate_many(
                [_greedy(f"r{i}", [1, 2, 3 + i], 8) for i in range(3)])
        finally:
            engine.shutdown()
    for full, half in zip(outs["float32"], outs["bfloat16"]):
        assert len(half.token_ids) == 8
        assert abs(full.logprobs[0] - half.logprobs[0]) < 0.1  # same prompt, first token
