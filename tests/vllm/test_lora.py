"""LoRA on the vLLM engine (``model.lora`` with ``engine.kind: vllm``): weight sync moves the
adapter alone, an engine at version v serves adapter v (greedy tokens and logprobs equal a
Hugging Face model with adapter v merged onto the base), and a request in flight across an
adapter load continues on the new adapter (one adapter slot, reloaded in place:
sync/vllm_lora.py).

The session's shared server runs without LoRA, so this module launches one LoRA server of its
own (about a minute of CPU) and runs everything on it in one test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollstream.config.schema import EngineConfig, LoraConfig, VllmEngineConfig
from rollstream.engine import FinishReason, GenerateRequest, SamplingParams
from rollstream.sync.protocol import check_adapter, payload_bytes
from rollstream.sync.weights import WeightSync
from tests.engine.helpers import make_tiny_model
from tests.vllm import shared

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 2048
PROMPT = [11, 22, 33, 44, 5]
TRIES = 4  # mid-stream loads that land after the stream's end are retried (test_vllm_engine)


def _adapter(shapes: dict[str, tuple[int, ...]], seed: int, rank: int = 8
             ) -> dict[str, torch.Tensor]:
    """A random rank-``rank`` adapter on every linear layer of the decoder, scale folded into
    B (the ``adapter`` payload of sync/protocol.py), large enough to change greedy output."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers.") and len(shape) == 2:
            module = name.removesuffix(".weight")
            out[module + ".lora_A.weight"] = 0.2 * torch.randn(rank, shape[1], generator=g)
            out[module + ".lora_B.weight"] = 0.2 * torch.randn(shape[0], rank, generator=g)
    return out


def _merged(path: Path, adapter: dict[str, torch.Tensor] | None):
    """The folder's model with ``adapter`` merged onto its base weights (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if adapter:
        params = dict(model.named_parameters())
        shapes = {n: tuple(p.shape) for n, p in params.items()}
        with torch.no_grad():
            for name, a, b in check_adapter(adapter, shapes, model="the test model"):
                params[name] += b @ a
    return model


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    for _ in range(n):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
        ids.append(int(logp.argmax()))
        lps.append(float(logp.max()))
    return ids[len(prompt):], lps


def _req(rid: str, n: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=list(PROMPT),
                           params=SamplingParams(temperature=0.0, max_new_tokens=n))


class _NoGate:
    def pause(self) -> None: ...

    def resume(self) -> None: ...

    async def wait_idle(self) -> None: ...


async def test_an_engine_at_version_v_serves_adapter_v(tmp_path: Path) -> None:
    from rollstream.engine.vllm import build_vllm_engine

    path = make_tiny_model(tmp_path / "m", hidden_size=128, vocab_size=shared.VOCAB,
                           max_position_embeddings=MAX_MODEL_LEN)
    cfg = EngineConfig(kind="vllm", vllm=VllmEngineConfig(max_model_len=MAX_MODEL_LEN))
    engine = await asyncio.to_thread(build_vllm_engine, cfg, path, log_dir=tmp_path / "logs",
                                     lora=LoraConfig(rank=8))
    try:
        shapes = dict(engine._checkpoint.shapes)
        adapters = {v: _adapter(shapes, seed=v) for v in (1, 2)}
        sync = WeightSync([engine], _NoGate(), "continue", lambda v, s: None)
        task = asyncio.create_task(sync.run())
        for version in (0, 1, 2):  # 0: the zero adapter the slot starts with (the base)
            if version:
                sync.publish(version, adapters[version])
                await sync.wait_applied()
                moved = payload_bytes(adapters[version])  # the adapter's size, as given
                assert sync.num_bytes == moved == engine.sync_timings[-1].num_bytes
                assert sync.moved["vllm-0"].last.kind == "adapter"
            out = await engine.generate(_req(f"v{version}", 24))
            want, want_lp = _greedy(_merged(path, adapters.get(version)), PROMPT, 24)
            assert out.token_ids == want and out.versions == [version] * 24
            assert out.logprobs == pytest.approx(want_lp, abs=1e-3)
        task.cancel()
        full = sum(torch.Size(s).numel() * 4 for s in shapes.values())
        print(f"adapter sync: {sync.num_bytes} B = {sync.num_bytes / full:.3f} of the weights, "
              f"{engine.sync_timings[-1].total_s:.3f} s")
        await _in_flight_request_continues_on_the_new_adapter(engine, path, adapters)
        # a full load on a LoRA engine serves the new weights without an adapter
        base = _merged(path, None).state_dict()
        await engine.load_weights(3, base)
        out = await engine.generate(_req("full", 24))
        assert out.token_ids == _greedy(_merged(path, None), PROMPT, 24)[0]
        with pytest.raises(ValueError, match="rank 16 exceeds the rank 8"):
            await engine.load_weights(4, _adapter(shapes, seed=4, rank=16))
    finally:
        await engine.close()


async def _in_flight_request_continues_on_the_new_adapter(engine, path: Path,
                                                          adapters: dict) -> None:
    """A greedy stream started on adapter 1, adapter 2 loaded while it runs: its versions are
    1s then 2s, and its tokens after the boundary are adapter 2's greedy continuation of the
    sequence so far, not adapter 1's (which a request pinned to the adapter it was sent with
    would give). vLLM's ``/pause`` clears its KV cache, so the frozen request's KV is
    recomputed with adapter 2 when it resumes: all positions, as the reference does."""
    n = 1000
    old, new = _merged(path, adapters[1]), _merged(path, adapters[2])
    for attempt in range(TRIES):
        await engine.load_weights(1, adapters[1])
        start = engine.stats().generated_tokens
        task = asyncio.create_task(engine.generate(_req(f"mid{attempt}", n)))
        while engine.stats().generated_tokens < start + 16 and not task.done():
            await asyncio.sleep(0.005)
        await engine.load_weights(2, adapters[2])
        out = await task
        assert out.finish_reason is FinishReason.LENGTH
        k = out.versions.count(1)
        assert out.versions == [1] * k + [2] * (n - k)
        if 0 < k < n - 8:
            break
    else:
        print(f"no adapter load landed mid-stream in {TRIES} tries (the API server's stall)")
        return
    ids = PROMPT + out.token_ids[:k]  # the sequence when adapter 2 came in
    assert out.token_ids[k:k + 8] == _greedy(new, ids, 8)[0]
    assert out.token_ids[k:k + 8] != _greedy(old, ids, 8)[0]
