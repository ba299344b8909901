"""The vLLM engine against a real server: token in/out, logprobs, interrupts, weights, versions.

The engine contract tests (tests/engine/test_contract.py) also run against vLLM; these add
what is specific to the adapter. All use the session's one server (shared.py).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollstream.engine import FinishReason, GenerateRequest, SamplingParams
from rollstream.engine.vllm.wire import request_body
from tests.vllm import shared

pytestmark = pytest.mark.vllm


def _req(rid: str, prompt: list[int], **params) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=prompt, params=SamplingParams(**params))


async def _received(engine, task: asyncio.Task, at_least: int) -> None:
    """Until ``engine`` has delivered ``at_least`` tokens in all, or ``task`` is done."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    while engine.stats().generated_tokens < at_least and not task.done():
        assert loop.time() < deadline, "the engine made no progress"
        await asyncio.sleep(0.001)


# Mid-stream tests use streams of thousands of tokens (seconds of work) and retry: vLLM 0.32's
# API server on these 2-core CPU machines stalls while the engine generates (seen on a quiet
# machine too: first token at once, then nothing until the stream's end; docs/vllm.md), so an
# abort or a pause may reach the engine only after the stream is done. Each try that does not
# land checks what a late command must leave (a whole stream, versions in order), as the
# contract tests do (tests/engine/test_contract.py, _mid_stream_tries); none skips.
TRIES = 8


def _perturbed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g)
            for k, v in shared.original_weights(shared.model_path()).items()}


async def test_token_in_token_out(vllm_engine):
    # ids on the wire both ways; launched servers get --skip-tokenizer-init (test_adapter_units),
    # so a folder without tokenizer files serves too (this one has them: test_export_serving)
    out = await vllm_engine.generate(_req("tito", [5, 6, 7], temperature=0.0, max_new_tokens=16))
    assert out.finish_reason is FinishReason.LENGTH and out.error is None
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 16
    assert all(isinstance(t, int) and 0 <= t < shared.VOCAB for t in out.token_ids)
    assert all(lp <= 0 for lp in out.logprobs) and out.versions == [0] * 16
    body = request_body(_req("w", [5, 6, 7]), "w#0", 16)  # ids on the wire, no text
    assert body["token_ids"] == [5, 6, 7] and "prompt" not in body
    assert body["sampling_params"]["detokenize"] is False


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_truncated_sampling_gives_is_weights_of_one_on_policy(vllm_engine, vllm_model_path,
                                                                    temperature):
    """Sampled with top-k/top-p, reported under the truncated distribution sampled from
    (processed logprobs): a trainer on the same weights, truncating its own logits the same
    way, recomputes them (fp32), so an on-policy step has IS weight 1."""
    from rollstream.config.schema import TrainConfig
    from rollstream.staleness import StalenessPolicy
    from rollstream.train.trainer import Trainer
    from rollstream.trajectory import Group, Task

    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46], [26, 43]]
    top_k, top_p = 8, 0.9
    groups = [Group.new(Task(uid=f"p{i}", source="t", prompt_ids=tuple(p), prompt_text="",
                             reference=""), 2) for i, p in enumerate(prompts)]
    samples = [s for g in groups for s in g.samples]
    outs = await asyncio.gather(*(vllm_engine.generate(_req(
        s.uid, list(s.task.prompt_ids), temperature=temperature, top_k=top_k, top_p=top_p,
        max_new_tokens=48, seed=7 + j)) for j, s in enumerate(samples)))
    for j, (s, o) in enumerate(zip(samples, outs)):
        s.append_policy_tokens(o.token_ids, o.logprobs, o.versions)
        s.reward = float(j % 2)
    staleness = StalenessPolicy(max_staleness=0)
    trainer = Trainer(TrainConfig(updates_per_step=1), vllm_model_path, staleness=staleness,
                      temperature=temperature, top_p=top_p, top_k=top_k)
    ours = torch.tensor([x for row in trainer.logprobs(samples) for x in row])
    theirs = torch.tensor([x for s in samples for x in s.logprobs])
    diffs = (theirs - ours).abs()
    print(f"T={temperature}: |vllm - trainer| logprob mean {diffs.mean():.2e} "
          f"max {diffs.max():.2e}")
    assert torch.isfinite(ours).all()  # every sampled token is inside the trainer's support
    assert diffs.mean().item() <= 1e-4 and diffs.max().item() <= 1e-3
    full = Trainer(TrainConfig(), vllm_model_path, staleness=staleness, temperature=temperature)
    untruncated = torch.tensor([x for row in full.logprobs(samples) for x in row])
    assert ((theirs - untruncated).abs() > 1e-3).float().mean() > 0.5  # truncation mattered
    metrics = trainer.step(groups, step=0).metrics
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["support_masked_frac"] == 0.0


async def test_an_interrupt_before_the_first_token_returns_at_once(vllm_engine):
    """Interrupted as soon as it is sent: the call returns with what it had, and the engine
    serves on. An interrupt landing mid-stream (partial tokens with their logprobs and
    versions, no error) is the contract's test_interrupt_then_resume_continues_greedy_stream,
    which runs against this engine too."""
    e = vllm_engine
    early = asyncio.create_task(e.generate(_req("early", [1, 2], max_new_tokens=4000)))
    await asyncio.sleep(0)
    await e.interrupt(["early"])
    out = await asyncio.wait_for(early, 60)
    # ABORT with what it had; or, late (the stall above), the whole stream
    assert (out.finish_reason is FinishReason.ABORT and len(out.token_ids) < 4000
            or out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 4000), \
        (out.finish_reason, len(out.token_ids))
    assert out.error is None and len(out.logprobs) == len(out.versions) == len(out.token_ids)
    again = await e.generate(_req("again", [9, 8, 7], temperature=0.0, max_new_tokens=8))
    assert again.finish_reason is FinishReason.LENGTH


async def test_weight_sync_changes_greedy_output_and_restoring_brings_it_back(vllm_engine):
    e, prompt = vllm_engine, [11, 22, 33, 44]
    greedy = dict(temperature=0.0, max_new_tokens=32)
    before = await e.generate(_req("before", prompt, **greedy))
    await e.load_weights(1, _perturbed(seed=1))
    changed = await e.generate(_req("changed", prompt, **greedy))
    assert changed.token_ids != before.token_ids and changed.versions == [1] * 32
    await e.load_weights(2, shared.original_weights(shared.model_path()))
    restored = await e.generate(_req("restored", prompt, **greedy))
    assert restored.token_ids == before.token_ids and restored.versions == [2] * 32
    assert restored.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    assert e.stats().version == 2
    timing = e.sync_timings[-1]
    print(f"weight sync: {timing.num_bytes / 1e6:.1f} MB in {timing.total_s:.3f} s "
          f"(write {timing.write_s:.3f} s, paused {timing.pause_s:.3f} s)")
    assert timing.version == 2 and 0 < timing.total_s < 10


async def test_versions_across_two_reloads_mid_stream(vllm_engine):
    """A greedy stream across reloads to versions 1 and 2, interrupted once version-2 tokens
    arrive: its versions are 0s, then 1s, then 2s, and its version-0 tokens are what the
    folder's own weights give."""
    e, prompt = vllm_engine, [4, 4, 4, 2]
    greedy = dict(temperature=0.0, max_new_tokens=4000)
    new1, new2 = _perturbed(seed=2), _perturbed(seed=3)
    for attempt in range(TRIES):
        await shared.reset(e)
        start, rid = e.stats().generated_tokens, f"mixed{attempt}"
        task = asyncio.create_task(e.generate(_req(rid, prompt, **greedy)))
        await _received(e, task, start + 1)
        if task.done():  # the whole stream arrived in one burst, before any reload
            whole = task.result()
            assert whole.versions == [0] * len(whole.token_ids)
            continue
        await e.load_weights(1, new1)
        await _received(e, task, e.stats().generated_tokens + 1)
        await e.load_weights(2, new2)
        await _received(e, task, e.stats().generated_tokens + 1)
        await e.interrupt([rid])  # the rest would only add version-2 tokens
        out = await task
        a, b = out.versions.count(0), out.versions.count(1)
        if a and b and a + b < len(out.versions):
            break
        assert sorted(out.versions) == out.versions  # late, but never out of order
    else:
        print(f"no reload landed mid-stream in {TRIES} tries (the API server's stall)")
        return  # every try checked what late reloads leave
    assert out.versions == [0] * a + [1] * b + [2] * (len(out.versions) - a - b)
    await shared.reset(e)  # the folder's weights, as version 0
    reference = await e.generate(_req("ref", prompt, temperature=0.0, max_new_tokens=a))
    assert out.token_ids[:a] == reference.token_ids  # the old weights up to the boundary
