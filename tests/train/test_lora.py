"""LoRA training (``model.lora``): only the adapter trains, the KL reference is the base with
the adapter disabled, weight sync moves the adapter alone and the embedded engine serves
adapter v at version v, checkpoints are peft folders that resume exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.config import EngineConfig
from rollstream.config.schema import LoraConfig, RunConfig, TrainConfig
from rollstream.engine.factory import build_engine
from rollstream.engine.protocol import GenerateRequest, SamplingParams
from rollstream.sync.weights import WeightSync
from rollstream.train.trainer import Trainer
from tests.engine.helpers import make_tiny_model
from tests.train.conftest import SYNC, make_group
from tests.train.test_trainer import groups_on_policy, hf_logprobs

LORA = LoraConfig(rank=4, alpha=8.0)


def _trainer(path: Path, **train) -> Trainer:
    cfg = TrainConfig(lr=5e-2, updates_per_step=2, **train)
    return Trainer(cfg, path, staleness=SYNC, lora=LORA)


def _base_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_a_step_changes_the_adapter_alone(tiny_model_path: Path) -> None:
    trainer = _trainer(tiny_model_path)
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in trainer.model.named_parameters() if id(p) in trained}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    before = _base_params(trainer)
    groups, _ = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    trainer.step(groups, 0)
    after = dict(trainer.model.named_parameters())
    moved = {n for n, t in before.items() if not torch.equal(t, after[n].detach())}
    assert moved and moved <= names  # every lora_B starts at 0; the step moves the adapter
    assert any(".lora_B." in n for n in moved)


def test_the_kl_reference_is_the_base_with_the_adapter_disabled(tiny_model_path: Path
                                                                ) -> None:
    trainer = _trainer(tiny_model_path, kl_coef=0.1)
    assert trainer.reference is None  # no second model
    groups, samples = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    trainer.step(groups, 0)
    assert trainer.step(groups, 1).metrics["kl"] > 0  # the adapter moved off the base
    base = Trainer(TrainConfig(), tiny_model_path, staleness=SYNC)  # no adapter at all
    (_, mb), = trainer._micro_batches(samples)
    ref = trainer._reference_logprobs(mb)
    assert ref is not None
    torch.testing.assert_close(ref, base._forward(base.model, mb), rtol=0, atol=1e-5)
    assert (trainer._forward(trainer.model, mb) - ref).abs().max() > 1e-4


async def _sampled(engine, version: int):
    """Groups of samples the engine generated (with its logprobs and versions), rewarded."""
    prompts = [[1, 2, 3], [11, 12], [5, 6, 7, 8]]
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(
        request_id=f"v{version}-{i}-{k}", prompt_ids=p,
        params=SamplingParams(max_new_tokens=12, seed=100 * version + 10 * i + k)))
        for i, p in enumerate(prompts) for k in range(2)))
    groups = [make_group(f"g{i}", p, [o.token_ids for o in outs[2 * i: 2 * i + 2]],
                         rewards=[1.0, 0.0], logprobs=[o.logprobs for o in outs[2 * i: 2 * i + 2]],
                         versions=[o.versions for o in outs[2 * i: 2 * i + 2]])
              for i, p in enumerate(prompts)]
    return groups, [s for g in groups for s in g.samples]


def test_sync_moves_the_adapter_and_the_engine_serves_adapter_v(tmp_path: Path) -> None:
    """Two versions through WeightSync: each engine version's logprobs equal the trainer's
    (so version 2 is adapter 2 merged onto the base, not onto adapter 1's merge), and the
    bytes handed to the engine are the adapter's."""
    model = make_tiny_model(tmp_path / "m")
    trainer = _trainer(model)

    async def main():
        engine = build_engine(EngineConfig(local={"max_slots": 8, "max_seq_len": 128}), model)
        sync = WeightSync([engine], _NoGate(), "drain", lambda v, s: None)
        task = asyncio.create_task(sync.run())
        diffs = []
        for version in (0, 1, 2):
            groups, samples = await _sampled(engine, version)
            assert {v for s in samples for v in s.versions} == {version}
            ours = trainer.logprobs(samples)
            diffs += [abs(a - b) for s, o in zip(samples, ours) for a, b in zip(s.logprobs, o)]
            trainer.step(groups, version)
            sync.publish(version + 1, trainer.state_dict())
            await sync.wait_applied()
        task.cancel()
        await engine.close()
        return sync, diffs

    sync, diffs = asyncio.run(main())
    assert max(diffs) < 1e-4
    adapter = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert sync.header is not None and sync.header.kind == "adapter"
    assert sync.num_bytes == sum(p.numel() * p.element_size() for p in adapter.values())
    full = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    assert sync.num_bytes < 0.2 * sum(t.numel() * t.element_size() for t in full.values())


class _NoGate:
    def pause(self) -> None: ...

    def resume(self) -> None: ...

    async def wait_idle(self) -> None: ...


def test_a_checkpoint_is_a_peft_folder_that_resumes_exactly(tiny_model_path: Path,
                                                            tmp_path: Path) -> None:
    from peft import PeftModel

    trainer = _trainer(tiny_model_path)
    groups, samples = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    trainer.step(groups, 0)
    folder = trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.save_training_state(tmp_path / "trainer.pt")
    assert not (folder / "model.safetensors").exists()  # the adapter alone
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(folder)).eval()
    ours = trainer.logprobs(samples)
    for s, lp in zip(samples, ours):
        want = hf_logprobs(loaded, list(s.task.prompt_ids), s.response_ids)
        assert max(abs(a - b) for a, b in zip(lp, want)) < 1e-5
    resumed = _trainer(tiny_model_path)
    resumed.load_training_state(folder, tmp_path / "trainer.pt")
    for t in (trainer, resumed):
        t.step(groups, 1)
    a, b = trainer.state_dict(), resumed.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("override", "field"), [
    ({"runtime": {"kind": "ray"}}, "runtime.kind"),
    ({"engine": {"kind": "vllm"}, "model": {"lora": {"rank": 1024}}}, "rank 1024: vLLM"),
    ({"train": {"backend": "fsdp"}}, "train.backend"),
    ({"train": {"compile": True}}, "train.compile"),
])
def test_settings_that_cannot_take_an_adapter_are_refused(override: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"model.lora.*{field}"):
        RunConfig.model_validate({"model": {"lora": {}}, **override})


def test_vllm_takes_an_adapter() -> None:
    cfg = RunConfig.model_validate({"model": {"lora": {"rank": 8}}, "engine": {"kind": "vllm"}})
    assert cfg.engine.kind == "vllm" and cfg.model.lora is not None


def test_a_bfloat16_engine_merges_each_version_onto_its_base_in_float32(tmp_path: Path
                                                                       ) -> None:
    from rollstream.engine.local.weights import load_folder
    from rollstream.train import lora

    model = make_tiny_model(tmp_path / "m")
    _, weights = load_folder(model, torch.device("cpu"), torch.bfloat16)
    name = "model.layers.0.self_attn.q_proj.weight"
    base = weights.hf_views[name].clone()
    wrapped = lora.wrap(AutoModelForCausalLM.from_pretrained(model), LORA, model)
    for seed in (1, 2):  # two versions: the second replaces the first, never adds to it
        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in wrapped.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        adapter = lora.sync_tensors(wrapped)
        weights.copy_in(weights.check(adapter))
        a, b = (adapter[name.removesuffix(".weight") + s] for s in (".lora_A.weight",
                                                                     ".lora_B.weight"))
        want = (base.float() + b @ a).to(torch.bfloat16)
        assert torch.equal(weights.hf_views[name], want)


def test_an_adapter_on_a_mixture_of_experts_is_refused_at_load() -> None:
    from rollstream.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.lora on model.tiny.arch qwen2_moe"):
        load_config(None, ["model.tiny.arch=qwen2_moe", "model.lora.rank=4"])


def test_a_lora_runs_adapter_checkpoint_exports_merged(tmp_path: Path) -> None:
    """A LoRA run's final checkpoint is a peft adapter folder: the export is its merged model,
    whose logits are the adapted model's (the export's own check compares it with the
    engine)."""
    from peft import PeftModel

    from rollstream.config.schema import LoraConfig, TrainConfig
    from rollstream.staleness import StalenessPolicy
    from rollstream.train.trainer import Trainer

    from rollstream.models.export import export_run
    from tests.models.test_export import _kit_run

    base = _kit_run(tmp_path) / "checkpoint"
    trainer = Trainer(TrainConfig(), base, staleness=StalenessPolicy(max_staleness=0),
                      lora=LoraConfig(rank=4))
    with torch.no_grad():  # a fresh adapter (B = 0) adds nothing: give it something to add
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    run = tmp_path / "lora-run"
    trainer.save_checkpoint(run / "checkpoint")
    done = export_run(run, out=tmp_path / "out")
    assert done.num_prompts > 0 and (done.folder / "config.json").is_file()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    merged = AutoModelForCausalLM.from_pretrained(str(done.folder)).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)),
                                        str(run / "checkpoint")).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=0, atol=1e-4)
        assert (plain(input_ids=ids).logits - want).abs().max() > 1e-2
