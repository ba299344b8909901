"""Durable checkpoints: written whole or not at all, the newest N kept, and a trainer loaded
from one in a fresh process takes the same next step as the trainer that never stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollstream.config.schema import TrainConfig
from rollstream.durable import checkpoint as durable
from rollstream.train.trainer import Trainer
from tests.durable.batches import batch
from tests.durable.whole import ROLLOUT, model_saver, save_trainer
from tests.train.conftest import SYNC, tiny_model_path  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]
CFG = {"lr": 1e-2, "updates_per_step": 2, "micro_batch_tokens": 16}

FRESH = '''
import json, sys, torch
from tests.durable.batches import batch
from tests.durable.whole import ROLLOUT, model_saver, save_trainer
from pathlib import Path
from rollstream.config.schema import TrainConfig
from rollstream.durable import checkpoint as durable
from rollstream.train.trainer import Trainer
from tests.train.conftest import SYNC
model_path, run_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
ckpt = durable.folder(run_dir) / "step_000002"  # its model folder has no tokenizer: not read
trainer = Trainer(TrainConfig(**json.loads(sys.argv[4])), model_path, staleness=SYNC)
trainer.load_training_state(ckpt / durable.MODEL, ckpt / durable.TRAINER)
loss = trainer.step(batch(2), 2).metrics["loss"]
torch.save({"loss": loss, "params": trainer.state_dict()}, out)
'''


def test_a_fresh_process_takes_the_same_next_step(tiny_model_path: Path,  # noqa: F811
                                                 tmp_path: Path) -> None:
    a = Trainer(TrainConfig(**CFG), tiny_model_path, staleness=SYNC)
    for step in range(2):  # the optimizer has moments to restore
        a.step(batch(step), step)
    durable.write(tmp_path, 2, {"note": "test"}, save_model=a.save_checkpoint,
                  save_trainer=a.save_training_state, keep=2)
    want = a.step(batch(2), 2).metrics["loss"]
    out = tmp_path / "fresh.pt"
    subprocess.run([sys.executable, "-c", FRESH, str(tiny_model_path), str(tmp_path), str(out),
                    json.dumps(CFG)], cwd=REPO, check=True, timeout=300)
    got = torch.load(out)
    assert abs(got["loss"] - want) <= 1e-6 * max(1.0, abs(want)), (got["loss"], want)
    for name, p in a.state_dict().items():
        torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6)
    # without the optimizer state the step differs (the test can tell)
    b = Trainer(TrainConfig(**CFG), tiny_model_path, staleness=SYNC)
    b.model.load_state_dict(load_weights(durable.folder(tmp_path) / "step_000002" / durable.MODEL))
    other = b.step(batch(2), 2)
    diff = max((b.state_dict()[n] - p).abs().max().item() for n, p in a.state_dict().items())
    assert diff > 1e-4, (other.metrics["loss"], diff)


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def test_checkpoints_are_whole_and_the_newest_are_kept(tmp_path: Path, kit_model: Path) -> None:
    model = model_saver(kit_model)
    for step in (2, 4, 6):
        durable.write(tmp_path, step, {"n": step, "config": {}, "rollout": ROLLOUT},
                      save_model=model, save_trainer=save_trainer, keep=2)
    names = sorted(p.name for p in durable.folder(tmp_path).iterdir())
    assert names == ["step_000004", "step_000006"]  # no temporary folder left either
    ckpt = durable.latest(tmp_path)
    assert ckpt.step == 6 and ckpt.state["n"] == 6 and (ckpt.model_dir / "config.json").exists()

    def crash(path: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        durable.write(tmp_path, 8, {"n": 8}, save_model=model, save_trainer=crash, keep=2)
    assert durable.latest(tmp_path).step == 6, "a half-written checkpoint is never the latest"
    (durable.folder(tmp_path) / "step_000006" / durable.STATE).write_text(
        json.dumps({"format": 99, "step": 6}))
    skipped = []
    assert durable.latest(tmp_path, on_skip=lambda p, why: skipped.append(why)).step == 4
    assert len(skipped) == 1 and "format 99" in skipped[0]
