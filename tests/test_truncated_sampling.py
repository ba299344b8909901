"""Truncated sampling gives IS weights of 1 on-policy.

A real local engine samples with top-p < 1 and top-k > 0 at a temperature != 1 and reports
each token's logprob under the truncated, renormalised distribution it drew from; a real
trainer on the same weights applies the same truncation to its own logits. Their logprobs
agree, so the importance weight of an on-policy step is 1 and nothing is masked. Before the
fix the engine reported the untruncated tempered logprob while the trainer recomputed the
same: they agreed with each other but not with the sampled distribution; the test checks
the quantity itself (the truncated distribution's logprob), so it fails on that code.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.config import EngineConfig, TrainConfig
from rollstream.engine.factory import build_engine
from rollstream.engine.protocol import GenerateRequest, SamplingParams
from rollstream.staleness import StalenessPolicy
from rollstream.train.trainer import Trainer
from rollstream.trajectory import Group, Task
from tests.engine.helpers import make_tiny_model

TEMPERATURE, TOP_P, TOP_K = 0.7, 0.8, 8


def _groups(num_tasks: int, size: int) -> list[Group]:
    return [Group.new(Task(uid=f"t/{i}", source="t", prompt_ids=tuple(range(3 + i, 9 + i)),
                           prompt_text="", reference=""), size) for i in range(num_tasks)]


async def _generate(engine, groups: list[Group]) -> None:
    params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K,
                             max_new_tokens=24, seed=1000 + j) for j in range(64)]
    samples = [s for g in groups for s in g.samples]
    outs = await asyncio.gather(*(
        engine.generate(GenerateRequest(request_id=s.uid, prompt_ids=list(s.task.prompt_ids),
                                        params=params[j]))
        for j, s in enumerate(samples)))
    for j, (s, out) in enumerate(zip(samples, outs)):
        assert out.error is None and out.token_ids
        s.append_policy_tokens(out.token_ids, out.logprobs, out.versions)
        s.reward = float(j % 3 == 0)  # every group of 4 has both rewards


def _truncated_reference(model_path: Path, samples) -> list[float]:
    """Independent of rollstream: the tempered logits of one HF forward per sample, cut to the
    top-k, then to the smallest prefix of mass >= top-p, renormalised."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for s in samples:
        ids = torch.tensor([list(s.task.prompt_ids) + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.task.prompt_ids) - 1 : -1].float() / TEMPERATURE
        for row, token in zip(logits, s.response_ids):
            top = row.topk(TOP_K)
            probs = top.values.softmax(-1)
            n = int(((probs.cumsum(-1) - probs) < TOP_P).sum())
            kept = top.indices[:n].tolist()
            assert token in kept, "the engine sampled outside its truncated support"
            out.append(float(top.values[:n].log_softmax(-1)[kept.index(token)]))
    return out


def test_truncated_sampling_gives_is_weights_of_one_on_policy(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m")
    groups = _groups(4, 4)
    samples = [s for g in groups for s in g.samples]

    async def rollout() -> None:
        engine = build_engine(EngineConfig(local={"max_slots": 8, "max_seq_len": 128}), model)
        try:
            await _generate(engine, groups)
        finally:
            await engine.close()

    asyncio.run(rollout())
    engine_lp = [lp for s in samples for lp in s.logprobs]
    # the engine reports the truncated distribution's logprob (an independent computation)
    want = _truncated_reference(model, samples)
    assert max(abs(a - b) for a, b in zip(engine_lp, want)) <= 1e-4
    untruncated = Trainer(TrainConfig(), model, staleness=StalenessPolicy(max_staleness=0),
                          temperature=TEMPERATURE)
    full = [lp for row in untruncated.logprobs(samples) for lp in row]
    cut = sum(abs(a - b) > 1e-3 for a, b in zip(engine_lp, full))
    assert cut > len(full) // 2, "truncation must matter here, or the test proves nothing"

    cfg = TrainConfig(updates_per_step=1, lr=1e-3)  # is_correction: truncate at 2 (default)
    trainer = Trainer(cfg, model, staleness=StalenessPolicy(max_staleness=0),
                      temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K)
    ours = [lp for row in trainer.logprobs(samples) for lp in row]
    diffs = [abs(a - b) for a, b in zip(engine_lp, ours)]
    assert max(diffs) <= 1e-4 and sum(diffs) / len(diffs) <= 1e-5
    metrics = trainer.step(groups, step=0).metrics
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["mismatch"] <= 1e-5 and metrics["support_masked_frac"] == 0.0
    assert metrics["num_tokens"] == len(engine_lp)
    assert all(math.isfinite(v) for v in metrics.values())
