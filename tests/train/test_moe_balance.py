"""``train.router_aux_loss_coef``: a mixture of experts' load-balancing loss in the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from rollstream.config import load_config
from rollstream.config.schema import TrainConfig
from rollstream.train.trainer import Trainer
from tests.engine.helpers import make_tiny_model
from tests.train.conftest import SYNC, VOCAB, make_group


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen2_moe", vocab_size=VOCAB,
                           initializer_range=0.02, seed=4)


def _groups(rewards: float | None = None):
    """Two groups of different lengths (packed rows with padding); equal rewards give zero
    advantages: no policy gradient, only the balance loss's."""
    def r(n):
        return [rewards] * n if rewards is not None else [float(i % 2) for i in range(n)]
    return [make_group("g0", [1, 2, 3], [[4, 5, 6, 7], [8, 9, 10]], rewards=r(2)),
            make_group("g1", [11, 12], [[13, 14], [15, 16, 17, 18, 19]], rewards=r(2))]


def test_the_balance_loss_is_transformers_over_the_samples_tokens(moe_path: Path) -> None:
    """The step's ``router_aux_loss`` is transformers' load_balancing_loss_func over every
    token of the samples, each in a forward of its own: packing and padding leave it as is."""
    cfg = TrainConfig(router_aux_loss_coef=0.1, updates_per_step=1, micro_batch_tokens=4096)
    trainer = Trainer(cfg, moe_path, staleness=SYNC)
    hf = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    groups = _groups()
    per_layer: list[list[torch.Tensor]] = [[], []]
    with torch.no_grad():
        for s in (s for g in groups for s in g.samples):
            ids = torch.tensor([[*s.task.prompt_ids, *s.response_ids]])
            for layer, logits in enumerate(hf(ids, output_router_logits=True).router_logits):
                per_layer[layer].append(logits)
    want = load_balancing_loss_func(tuple(torch.cat(x) for x in per_layer), 4, 2)
    got = trainer.step(groups, 0).metrics["router_aux_loss"]
    assert got == pytest.approx(float(want), abs=1e-5)


def test_the_balance_loss_trains_the_router_toward_balance(moe_path: Path) -> None:
    cfg = TrainConfig(router_aux_loss_coef=1.0, lr=2e-2, updates_per_step=1)
    trainer = Trainer(cfg, moe_path, staleness=SYNC)
    router = trainer.model.model.layers[0].mlp.gate.weight
    before = router.detach().clone()
    losses = [trainer.step(_groups(rewards=1.0), s).metrics["router_aux_loss"] for s in range(6)]
    assert not torch.equal(router, before)
    assert losses[-1] < losses[0] - 0.01, losses
    off = Trainer(TrainConfig(), moe_path, staleness=SYNC).step(_groups(), 0).metrics
    assert "router_aux_loss" not in off


def test_the_balance_loss_needs_a_model_with_experts(tiny_model_path: Path,
                                                    tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train.router_aux_loss_coef = 0.01 needs a "
                                         "mixture-of-experts model"):
        Trainer(TrainConfig(router_aux_loss_coef=0.01), tiny_model_path, staleness=SYNC)
    with pytest.raises(ValueError, match="train.router_aux_loss_coef > 0 needs a "
                                         "mixture-of-experts model: model.tiny.arch is 'qwen2'"):
        load_config(None, ["train.router_aux_loss_coef=0.01", f"run_root={tmp_path}"])
    load_config(None, ["train.router_aux_loss_coef=0.01", "model.tiny.arch=qwen2_moe"])
