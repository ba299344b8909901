"""Routing replay, engine side: the local engine returns the experts every token of prompt +
output was routed to, as last computed: equal to transformers' router over the same sequence,
recomputed after a weight load (in place, or on a resume of prompt + partial), and restored
with the keys and values of a prefix cache hit."""

from __future__ import annotations

import asyncio

import torch

from rollstream.config.schema import LocalEngineConfig
from rollstream.engine import GenerateRequest, SamplingParams
from rollstream.engine.local import LocalEngine
from rollstream.engine.protocol import FinishReason, GenerateOutput
from rollstream.train.routing import routing_ids
from tests.engine.helpers import MAX_SEQ_LEN


def _engine(path, **kw) -> LocalEngine:
    return LocalEngine(path, LocalEngineConfig(max_slots=4, max_seq_len=MAX_SEQ_LEN, threads=1,
                                               device="cpu", **kw))


def _greedy(rid: str, prompt: list[int], n: int = 24) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt,
                           params=SamplingParams(temperature=0.0, max_new_tokens=n))


def hf_routing(weights: dict[str, torch.Tensor], folder, ids: list[int]) -> torch.Tensor:
    """[tokens, moe layers, top_k] experts of transformers' routers (sorted per token)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.load_state_dict(weights)
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    k = hf.config.num_experts_per_tok
    return torch.stack([lg.topk(k, dim=-1).indices for lg in logits], dim=1).sort(-1).values


def _assert_routing(out: GenerateOutput, prompt: list[int], expected: torch.Tensor) -> None:
    assert out.routing is not None
    got = routing_ids(out.routing)
    assert got.shape[0] == len(prompt) + len(out.token_ids)  # every token of the sequence
    assert (got[-1] == -1).all()  # the last: no pass took it as input
    assert torch.equal(got[:-1].sort(-1).values, expected[: got.shape[0] - 1])


def _weights(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def _perturbed(folder, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in _weights(folder).items()}


async def test_routing_of_every_token_is_the_routers_choice(tiny_moe_dir):
    """Prompt and sampled tokens: the experts transformers' routers pick for that sequence."""
    engine = _engine(tiny_moe_dir)
    try:
        prompts = [[5, 17, 33, 2, 60], [9, 40, 41, 3, 77, 12, 8, 1]]
        outs = await asyncio.gather(*(engine.generate(_greedy(f"r{i}", p))
                                      for i, p in enumerate(prompts)))
    finally:
        await engine.close()
    assert outs[0].routing.num_layers == 2 and outs[0].routing.top_k == 2
    for p, o in zip(prompts, outs):
        _assert_routing(o, p, hf_routing(_weights(tiny_moe_dir), tiny_moe_dir, p + o.token_ids))


async def test_routing_after_a_mid_stream_load_is_the_new_weights(tiny_moe_dir):
    """A load recomputes the running rows' cache: the returned routing of every token, those
    sampled before the load included, is the new weights' (as last computed)."""
    from tests.engine.test_local import _load_mid_stream

    new = _perturbed(tiny_moe_dir, 5)
    engine = _engine(tiny_moe_dir)
    try:
        prompt = [9, 40, 41, 3, 77, 12]
        mixed, k = await _load_mid_stream(engine, prompt, 60, 1, new)
    finally:
        await engine.close()
    assert 0 < k < len(mixed.token_ids)
    _assert_routing(mixed, prompt, hf_routing(new, tiny_moe_dir, prompt + mixed.token_ids))


async def test_routing_survives_an_interrupt_and_a_resume_on_new_weights(tiny_moe_dir):
    """Interrupted, its partial output carries its routing; resumed (prompt + partial) on new
    weights, the output's routing covers the whole sequence under the new weights."""
    engine = _engine(tiny_moe_dir)
    try:
        prompt = [3, 14, 15, 92, 65, 35]
        task = asyncio.create_task(engine.generate(_greedy("a", prompt, 100)))
        while engine.stats().generated_tokens < 4:
            await asyncio.sleep(0.0005)
        await engine.interrupt(["a"])
        partial = await task
        assert partial.finish_reason is FinishReason.ABORT and partial.token_ids
        before = hf_routing(_weights(tiny_moe_dir), tiny_moe_dir, prompt + partial.token_ids)
        _assert_routing(partial, prompt, before)
        new = _perturbed(tiny_moe_dir, 9)
        await engine.load_weights(1, new)
        resumed_prompt = prompt + partial.token_ids
        rest = await engine.generate(_greedy("a2", resumed_prompt, 100 - len(partial.token_ids)))
    finally:
        await engine.close()
    _assert_routing(rest, resumed_prompt, hf_routing(new, tiny_moe_dir,
                                                     resumed_prompt + rest.token_ids))


async def test_prefix_cache_hit_restores_the_cached_tokens_routing(tiny_moe_dir):
    """A prompt whose leading blocks are cached prefills only the rest; the cached tokens'
    routing comes back with their keys and values, so the output's covers every token."""
    engine = _engine(tiny_moe_dir, prefix_cache_tokens=256)
    try:
        prompt = [(7 * i + 3) % 90 for i in range(40)]  # 2 whole blocks of 16 and a tail
        first = await engine.generate(_greedy("a", prompt, 8))
        # another prompt in the row meanwhile: the hit's routing cannot be left-overs
        await engine.generate(_greedy("x", [(5 * i + 1) % 90 for i in range(50)], 4))
        hits = engine.stats().work.get("prefix_hit_tokens", 0)
        second = await engine.generate(_greedy("b", prompt + [1, 2], 8))
        assert engine.stats().work.get("prefix_hit_tokens", 0) - hits >= 32
    finally:
        await engine.close()
    weights = _weights(tiny_moe_dir)
    _assert_routing(first, prompt, hf_routing(weights, tiny_moe_dir, prompt + first.token_ids))
    _assert_routing(second, prompt + [1, 2],
                    hf_routing(weights, tiny_moe_dir, prompt + [1, 2] + second.token_ids))


def test_a_dense_model_returns_no_routing(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    try:
        out = engine.generate_many([_greedy("d", [1, 2, 3], 4)])[0]
    finally:
        engine.shutdown()
    assert out.routing is None and len(out.token_ids) == 4
