"""Training-inference consistency: the trainer's logprobs of tokens the engine sampled equal the
engine's own logprobs at the same weight version, before and after an optimizer step synced
into the engine through the real weight-sync path: for a dense model and for a mixture of
experts (Qwen2-MoE), whose step must move the router and the experts too."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollstream.clock import WallClock
from rollstream.config import EngineConfig, RewardConfig, TrainConfig
from rollstream.data.ledger import Ledger
from rollstream.engine.factory import build_engine
from rollstream.engine.protocol import SamplingParams
from rollstream.reward.pool import GraderPool
from rollstream.reward.registry import get_reward
from rollstream.rollout.dispatcher import Dispatcher
from rollstream.rollout.lifecycle import Lifecycle
from rollstream.staleness import StalenessPolicy
from rollstream.sync.weights import WeightSync
from rollstream.train.trainer import Trainer
from rollstream.trajectory import Group, SampleStatus, Task
from tests.engine.helpers import make_tiny_model


async def _parity(task: Task, text: str) -> float:  # async: graded in the loop, no worker
    return float(int(text.split()[0]) % 2)


def _tasks(n: int) -> list[Task]:
    return [Task(uid=f"c/{i}", source="c", prompt_ids=tuple(range(3 + i, 9 + i)),
                 prompt_text="", reference="") for i in range(n)]


@pytest.mark.parametrize(("arch", "temperature"),
                         [("qwen2", 1.0), ("qwen2", 0.7), ("qwen2_moe", 1.0)])
def test_trainer_logprobs_equal_engine_logprobs_across_a_sync(tmp_path, arch, temperature):
    torch.manual_seed(0)
    model = make_tiny_model(tmp_path / "m", arch=arch)

    async def main():
        engine = build_engine(EngineConfig(local={"max_slots": 8, "max_seq_len": 128}), model)
        ledger = Ledger()
        parity = get_reward(_parity)
        graders = GraderPool(RewardConfig(), lambda task: parity)
        disp = Dispatcher(engines=[engine],
                          params=SamplingParams(max_new_tokens=24, temperature=temperature),
                          graders=graders, decode=lambda ids: " ".join(map(str, ids)),
                          lifecycle=Lifecycle(ledger, WallClock()), clock=WallClock())
        trainer = Trainer(TrainConfig(lr=1e-2, updates_per_step=1), model,
                          staleness=StalenessPolicy(max_staleness=0), temperature=temperature)
        applied = []
        sync = WeightSync([engine], disp, "interrupt", lambda v, s: applied.append(v))
        sync_task = asyncio.create_task(sync.run())
        diffs = {}
        for version in (0, 1):
            groups = [Group.new(t, 4, k=version) for t in _tasks(4)]
            await asyncio.gather(*(disp.run_group(g) for g in groups))
            samples = [s for g in groups for s in g.samples]
            assert all(s.status is SampleStatus.GRADED for s in samples)
            assert {v for s in samples for v in s.versions} == {version}
            ours = trainer.logprobs(samples)
            d = [abs(a - b) for s, lp in zip(samples, ours) for a, b in zip(s.logprobs, lp)]
            diffs[version] = (sum(d) / len(d), max(d))
            if version == 0:
                before = {k: v.clone() for k, v in trainer.state_dict().items()}
                trainer.step(groups, 0)
                moved = {k: (trainer.state_dict()[k] - v).abs().max().item()
                         for k, v in before.items()}
                assert max(moved.values()) > 1e-4, "the optimizer step changed the weights"
                routing = [k for k in moved if ".mlp.gate." in k or ".mlp.experts." in k]
                assert len(routing) == (6 if arch == "qwen2_moe" else 0)  # 2 layers x 3
                assert all(moved[k] > 1e-4 for k in routing), moved
                sync.publish(1, trainer.state_dict())
                await sync.wait_applied()
        sync_task.cancel()
        graders.close()
        await engine.close()
        return diffs, applied

    diffs, applied = asyncio.run(main())
    assert applied == [1]
    for version, (mean, worst) in diffs.items():
        assert mean < 1e-5 and worst < 1e-4, (version, mean, worst)
