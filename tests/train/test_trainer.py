"""The single-process trainer on a random tiny Qwen2 (CPU)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollstream.config.schema import ISCorrectionConfig, TrainConfig
from rollstream.staleness import StalenessPolicy
from rollstream.train.trainer import Trainer
from rollstream.trajectory import KeptTokens
from tests.train.conftest import SYNC, make_group


def hf_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """Independent reference: one unpadded forward, full logits, float32 log_softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) + t - 1, tok].item() for t, tok in enumerate(response)]


def groups_on_policy(trainer: Trainer, rewards: list[float], version: int = 0):
    """Two groups whose behaviour logprobs are the trainer's own (no mismatch)."""
    groups = [
        make_group("g0", [1, 2, 3], [[4, 5, 6, 7], [8, 9, 10]], rewards=rewards[:2]),
        make_group("g1", [11, 12], [[13, 14], [15, 16, 17, 18, 19]], rewards=rewards[2:]),
    ]
    samples = [s for g in groups for s in g.samples]
    for s, lp in zip(samples, trainer.logprobs(samples)):
        s.segments[0].logprobs[:] = lp
        s.segments[0].versions[:] = [version] * len(lp)
    return groups, samples


def test_logprobs_equal_an_independent_forward(tiny_model_path: Path) -> None:
    # a small budget forces several padded micro-batches of mixed lengths
    trainer = Trainer(TrainConfig(micro_batch_tokens=16), tiny_model_path, staleness=SYNC)
    g = make_group("g", [1, 2, 3], [[4, 5], [6, 7, 8, 9, 10], [11]])
    h = make_group("h", [20], [[21, 22, 23]])
    samples = g.samples + h.samples
    got = trainer.logprobs(samples)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for s, lp in zip(samples, got):
        want = hf_logprobs(ref, list(s.task.prompt_ids), s.response_ids)
        assert len(lp) == len(want)
        assert max(abs(a - b) for a, b in zip(lp, want)) < 1e-5


def test_each_sample_is_scored_at_the_temperature_it_was_sampled_at(
        tiny_model_path: Path) -> None:
    # a temperature reconfigured mid-run: samples of both temperatures share micro-batches
    trainer = Trainer(TrainConfig(), tiny_model_path, staleness=SYNC, temperature=1.0)
    samples = make_group("g", [1, 2, 3], [[4, 5], [6, 7, 8], [9], [10, 11]]).samples
    for s, temp in zip(samples, (0.5, None, 0.5, 2.0)):
        s.temperature = temp
    got = trainer.logprobs(samples)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for s, lp in zip(samples, got):
        logits = ref(torch.tensor([list(s.task.prompt_ids) + s.response_ids])).logits[0]
        temp = s.temperature or 1.0
        logp = torch.log_softmax(logits / temp, dim=-1)
        n = len(s.task.prompt_ids)
        want = [logp[n - 1 + i, t].item() for i, t in enumerate(s.response_ids)]
        assert max(abs(a - b) for a, b in zip(lp, want)) < 1e-5
    assert got[0] != trainer.logprobs([make_group("g", [1, 2, 3], [[4, 5]]).samples[0]])[0]


@pytest.mark.parametrize("budget", [24, 4096])
def test_samples_sharing_a_row_do_not_see_each_other(tiny_model_path: Path, budget: int) -> None:
    """Packed rows (several samples back to back, position ids restarting) give each sample
    the logprobs of a forward of that sample alone: the attention is block-diagonal."""
    from rollstream.train.batching import collate

    trainer = Trainer(TrainConfig(micro_batch_tokens=budget), tiny_model_path, staleness=SYNC)
    g = make_group("g", [1, 2, 3], [[4, 5, 6, 7, 8, 9, 10, 11], [6, 7], [8, 9, 10]])
    h = make_group("h", [20, 21], [[21, 22], [23]])
    samples = g.samples + h.samples
    if budget == 4096:  # everything in one micro-batch: rows of 11 hold 5+5, 4+3
        assert collate(samples).input_ids.shape[0] == 3
    got = trainer.logprobs(samples)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for s, lp in zip(samples, got):
        want = hf_logprobs(ref, list(s.task.prompt_ids), s.response_ids)
        assert max(abs(a - b) for a, b in zip(lp, want)) < 1e-5


def test_step_raises_logprob_of_positive_advantage(tiny_model_path: Path) -> None:
    cfg = TrainConfig(lr=1e-2, updates_per_step=2, micro_batch_tokens=16)
    trainer = Trainer(cfg, tiny_model_path, staleness=SYNC)
    groups, samples = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    before = [sum(lp) for lp in trainer.logprobs(samples)]
    metrics = trainer.step(groups, step=0).metrics
    after = [sum(lp) for lp in trainer.logprobs(samples)]
    assert after[0] > before[0] and after[3] > before[3]  # positive advantage
    assert after[1] < before[1] and after[2] < before[2]  # negative advantage
    assert metrics["num_samples"] == 4 and metrics["num_tokens"] == 14
    assert metrics["mismatch"] < 1e-5 and metrics["is_weight_mean"] == pytest.approx(1.0)
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    assert all(math.isfinite(v) for v in metrics.values())


def test_step_lowers_the_surrogate_loss(tiny_model_path: Path) -> None:
    cfg = TrainConfig(lr=5e-3, updates_per_step=1, clip_eps=0.9)
    trainer = Trainer(cfg, tiny_model_path, staleness=SYNC)
    groups, _ = groups_on_policy(trainer, [1.0, 0.0, 0.3, 0.9])
    first = trainer.step(groups, step=0).metrics["loss"]
    second = trainer.step(groups, step=1).metrics["loss"]  # same behaviour logprobs, updated policy
    assert second < first


def test_skips_unrewarded_and_masks_env_and_old_tokens(tiny_model_path: Path) -> None:
    cfg = TrainConfig(updates_per_step=1)
    policy = StalenessPolicy(max_staleness=2, max_token_age=1)
    trainer = Trainer(cfg, tiny_model_path, staleness=policy)
    g = make_group("g", [1, 2], [[3, 4, 5], [6, 7], [8]], rewards=[1.0, 0.0, None],
                   versions=[[5, 6, 7], [7, 7], [7]], env_tail=2)
    result = trainer.step([g], step=7)
    metrics = result.metrics
    # sample 2 has no reward; env tokens never train; version 5 < 7 - 1 is too old
    assert metrics["num_samples"] == 2
    assert metrics["num_tokens"] == 4
    assert metrics["age_masked_frac"] == pytest.approx(1 / 5)
    s0, s1, s2 = g.samples
    assert result.kept[s0.uid] == KeptTokens(num_tokens=2, min_version=6, version_sum=13)
    assert result.kept[s1.uid] == KeptTokens(num_tokens=2, min_version=7, version_sum=14)
    assert s2.uid not in result.kept  # not given with a reward


def test_nothing_trainable_does_not_update(tiny_model_path: Path) -> None:
    trainer = Trainer(TrainConfig(), tiny_model_path, staleness=SYNC)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    g = make_group("g", [1, 2], [[3, 4]], rewards=[None])
    metrics = trainer.step([g], step=0).metrics
    assert metrics["num_samples"] == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(loss="decoupled_ppo", is_correction=ISCorrectionConfig(mode="mask")),
        TrainConfig(is_correction=ISCorrectionConfig(level="sequence", mode="mask", lower=0.9)),
        TrainConfig(advantage="rloo", kl_coef=0.1, updates_per_step=2, lr=1e-2),
    ],
    ids=["decoupled", "seq-mask", "rloo-kl"],
)
def test_variants_run_and_report(tiny_model_path: Path, cfg: TrainConfig) -> None:
    trainer = Trainer(cfg, tiny_model_path, staleness=SYNC)
    groups, samples = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    samples[1].segments[0].logprobs[0] -= 3.0  # a mismatch: w = e^3 on that token
    metrics = trainer.step(groups, step=0).metrics
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["mismatch"] > 0
    if cfg.is_correction.mode == "mask":
        # w = e^3 (token) or e^(3/3) (geometric mean of 3 tokens, sequence) is above cap 2
        dropped = 1 if cfg.is_correction.level == "token" else 3
        assert metrics["is_masked_frac"] == pytest.approx(dropped / 14)
    if cfg.kl_coef > 0:
        assert metrics["kl"] > 0  # the second update has moved away from the reference


def test_dr_grpo_needs_the_length_budget(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match="max_response_tokens"):
        Trainer(TrainConfig(advantage="dr_grpo"), tiny_model_path, staleness=SYNC)
    cfg = TrainConfig(advantage="dr_grpo", updates_per_step=1)
    trainer = Trainer(cfg, tiny_model_path, staleness=SYNC, max_response_tokens=32)
    groups, _ = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    metrics = trainer.step(groups, step=0).metrics
    # first update on-policy: loss = -sum(A * tokens) / (num_samples * 32) = -(4*0.5-3*0.5+...) 
    want = -(4 * 0.5 - 3 * 0.5 - 2 * 0.5 + 5 * 0.5) / (4 * 32)
    assert metrics["loss"] == pytest.approx(want, abs=1e-6)


def test_state_dict_is_live_and_hf_named(tiny_model_path: Path) -> None:
    trainer = Trainer(TrainConfig(), tiny_model_path, staleness=SYNC)
    sd = trainer.state_dict()
    params = dict(trainer.model.named_parameters())
    assert "model.embed_tokens.weight" in sd
    name = "model.embed_tokens.weight"
    assert sd[name].data_ptr() == params[name].data_ptr()
    assert not any(v.requires_grad for v in sd.values())


def test_checkpoint_round_trip(tiny_model_path: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_model_path, src)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    trainer = Trainer(TrainConfig(lr=1e-2, updates_per_step=1), src, staleness=SYNC)
    groups, _ = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    trainer.step(groups, step=0)
    out = trainer.save_checkpoint(tmp_path / "ckpt")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        original = source(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, original)  # the step changed the weights


def test_bf16_runs_close_to_fp32(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)  # record; keep the global as is
    fp32 = Trainer(TrainConfig(), tiny_model_path, staleness=SYNC)
    bf16 = Trainer(TrainConfig(dtype="bfloat16", threads=1), tiny_model_path, staleness=SYNC)
    assert calls == [1]  # threads > 0 binds the calling thread
    groups, samples = groups_on_policy(fp32, [1.0, 0.0, 0.0, 1.0])
    a, b = fp32.logprobs(samples), bf16.logprobs(samples)
    assert max(abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb)) < 0.1
    metrics = bf16.step(groups, step=0).metrics
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["grad_norm"] > 0
    assert next(bf16.model.parameters()).dtype == torch.float32  # fp32 master weights


def test_bf16_keeps_logits_and_cpu_attention_in_float32(
        tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast the matmuls run in bf16, but the logits and (on CPU) attention stay
    float32 (train/precision.py); the plain autocast forward would give bf16 for both."""
    import rollstream.train.precision as precision

    attention: list[torch.dtype] = []
    sdpa = precision.sdpa_attention_forward
    monkeypatch.setattr(precision, "sdpa_attention_forward",
                        lambda m, q, *a, **kw: attention.append(q.dtype) or sdpa(m, q, *a, **kw))
    bf16 = Trainer(TrainConfig(dtype="bfloat16"), tiny_model_path, staleness=SYNC)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    mlp: list[torch.dtype] = []
    for model in (bf16.model, plain):
        model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda m, i, out: mlp.append(out.dtype))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
            assert torch.is_autocast_enabled("cpu")  # the head gave autocast back
        mlp.append(logits.dtype)
    assert mlp == [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    assert attention and set(attention) == {torch.float32}
    with torch.no_grad():  # outside autocast: the float32 forward, unchanged
        assert torch.equal(bf16.model(input_ids=ids).logits, plain(input_ids=ids).logits)
    saved = json.loads((bf16.save_checkpoint(tiny_model_path.parent / "bf16") / "config.json")
                       .read_text())
    assert precision.CPU_ATTENTION not in json.dumps(saved)  # loadable without rollstream


@pytest.mark.parametrize(("loss", "loss_agg"), [
    ("ppo_clip", "token_mean"),
    ("decoupled_ppo", "token_mean"),
    ("ppo_clip", "seq_mean_token_mean"),
    ("decoupled_ppo", "seq_mean_token_sum"),
    ("ppo_clip", "seq_mean_token_sum_norm"),
])
def test_first_update_equals_a_separate_proximal_pass(
    tiny_model_path: Path, loss: str, loss_agg: str
) -> None:
    """The step takes its proximal logprobs from the first update's own forward, accumulates
    gradients over several micro-batches and divides them by the normaliser afterwards; that
    must be the textbook full-batch update: a no-grad proximal pass, targets, then the loss
    aggregated over the whole batch as ``loss_agg`` says, backward, clip."""
    from rollstream.train.advantages import compute_advantages
    from rollstream.train.losses import anchor_fn, build_targets, policy_loss

    is_cfg = ISCorrectionConfig(mode="mask", cap=1.3, lower=0.8)  # drops some tokens
    cfg = TrainConfig(lr=1e-2, loss=loss, loss_agg=loss_agg, is_correction=is_cfg,
                      micro_batch_tokens=16, updates_per_step=1,
                      grad_clip=1e6)  # no clipping: it would hide a scale
    budget = 32
    trainer = Trainer(cfg, tiny_model_path, staleness=SYNC, max_response_tokens=budget)
    groups, samples = groups_on_policy(trainer, [1.0, 0.0, 0.0, 1.0])
    assert len(trainer._micro_batches(samples)) > 1  # gradient accumulation is exercised
    g = torch.Generator().manual_seed(3)
    for s in samples:  # a behaviour policy off by up to 0.5 nats per token
        seg = s.segments[0]
        seg.logprobs[:] = [x + 1.0 * (torch.rand(1, generator=g).item() - 0.5) for x in seg.logprobs]
    samples[2].segments[0].logprobs[:] = [x + 2.0 for x in samples[2].logprobs]  # all masked

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    advantages = [a for gr in groups for a in compute_advantages([s.reward for s in gr.samples], "grpo")]
    sums, counts = [], []  # per sample: summed token loss, kept tokens
    for s, adv in zip(samples, advantages):
        ids = torch.tensor([list(s.task.prompt_ids) + s.response_ids])
        p = len(s.task.prompt_ids)
        logits = ref(input_ids=ids).logits[0, p - 1 : -1].float()
        logp = logits.log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0][None]
        targets, _ = build_targets(
            anchor_fn(loss), logp_behav=torch.tensor([s.logprobs]), logp_prox=logp.detach(),
            advantages=torch.tensor([adv]), base_mask=torch.ones_like(logp, dtype=torch.bool),
            is_cfg=is_cfg, logp_ref=None,
        )
        loss_sum, st = policy_loss(logp, targets, clip_eps=cfg.clip_eps)
        sums.append(loss_sum)
        counts.append(st.num_tokens)
    kept = sum(counts)
    assert 0 < kept < sum(s.num_response_tokens for s in samples) and counts[2] == 0
    live = [i for i, n in enumerate(counts) if n]  # sequence means count kept sequences
    full_batch = {
        "token_mean": sum(sums) / kept,
        "seq_mean_token_mean": sum(sums[i] / counts[i] for i in live) / len(live),
        "seq_mean_token_sum": sum(sums[i] for i in live) / len(live),
        "seq_mean_token_sum_norm": sum(sums) / (len(samples) * budget),
    }[loss_agg]
    full_batch.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)

    result = trainer.step(groups, step=0)
    assert result.metrics["num_tokens"] == kept
    assert result.metrics["loss"] == pytest.approx(full_batch.item(), rel=1e-4, abs=1e-7)
    assert [result.kept[s.uid].num_tokens for s in samples] == counts
    assert result.kept[samples[2].uid].reason == "every token masked by masked IS"
    # the clipped gradients the optimizer stepped with (AdamW's first step is ~lr * sign(g),
    # which would turn rounding-level differences of near-zero gradients into lr-sized ones)
    want = dict(ref.named_parameters())
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(param.grad, want[name].grad, rtol=1e-4, atol=1e-6)


def test_a_compiled_policy_trains_as_the_eager_one(tiny_model_path: Path) -> None:
    """``compile: true`` is a speed setting: the same logprobs, loss and gradients as eager (up
    to float rounding), with micro-batches of several shapes sharing its graphs. (Gradients,
    not weights after AdamW: its first steps move a near-zero gradient's weight by ~lr either
    way, so rounding can flip them; see the test above.)"""
    from torch._dynamo.utils import counters

    cfg = TrainConfig(lr=1e-2, micro_batch_tokens=16, updates_per_step=1)
    eager = Trainer(cfg, tiny_model_path, staleness=SYNC)
    compiled = Trainer(cfg.model_copy(update={"compile": True}), tiny_model_path,
                       staleness=SYNC)
    groups, samples = groups_on_policy(eager, [1.0, 0.0, 0.0, 1.0])
    assert len({tuple(mb.input_ids.shape) for _, mb in eager._micro_batches(samples)}) > 1
    graphs = counters["stats"]["unique_graphs"]
    got = compiled.logprobs(samples)
    for a, b in zip(got, eager.logprobs(samples)):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    want = eager.step(groups, step=0).metrics
    have = compiled.step(groups, step=0).metrics
    for key in ("loss", "grad_norm", "num_tokens", "clip_frac"):
        assert have[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo did compile the policy
    want_grads = {name: p.grad for name, p in eager.model.named_parameters()}
    for name, param in compiled.model.named_parameters():  # the update's clipped gradients
        torch.testing.assert_close(param.grad, want_grads[name], rtol=1e-4, atol=1e-6)
