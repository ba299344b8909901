"""Single-process trainer: trajectories in, a new weight version out.

One ``step`` (the unit that produces weight version ``step + 1``):

1. advantages per group from ``sample.reward`` (samples without a reward or without response
   tokens are skipped);
2. pack samples into micro-batches by ``micro_batch_tokens``;
3. ``updates_per_step`` optimizer updates, each accumulating gradients over all micro-batches
   (loss = summed token losses / one step-wide normaliser), then grad clip and AdamW.

The proximal logprobs (the policy before the step's first update) come from the first
update's own forward pass, detached: before that update's optimizer step its parameters *are*
the proximal policy, so a separate no-grad pass would compute the same numbers (one of the
``1 + 3 * updates_per_step`` passes saved). From them (and the reference logprobs when
``kl_coef > 0``) come the token masks (loss mask, ``max_token_age``, masked IS) and IS weights,
fixed for the whole step (see ``losses``). The step-wide normaliser needs every micro-batch's
kept-token count, known only after the first update's last micro-batch, so that update
back-propagates the summed loss and divides the accumulated gradients by the normaliser
before clipping: gradients are linear in the loss, so this is the same update.

Metrics of ``step`` (token means are over trained tokens unless said otherwise): ``loss``
(mean over updates), ``clip_frac``, ``kl`` (k3 to the reference; 0 without one), ``grad_norm``
(pre-clip, mean over updates), ``is_weight_mean`` (the corrected weight ``m``),
``is_masked_frac`` (share of loss-mask tokens masked IS dropped), ``age_masked_frac`` (share
dropped by ``max_token_age``), ``mismatch`` (mean ``|logp_behav - logp_prox|``) and
``mismatch_kl`` (mean ``logp_behav - logp_prox``, a k1 estimate of KL(behav || prox)), both over
the tokens before IS masking so the correction cannot hide the mismatch it removes,
``entropy`` (mean ``-logp_prox``: a sampled-token estimate, free), ``num_tokens``,
``num_samples``, ``step_s``.

Precision: parameters and AdamW state stay float32; ``dtype: bfloat16`` runs forward and
backward under ``torch.autocast(bfloat16)`` (mixed precision keeps small updates from being
rounded away). Logprobs are always a float32 ``log_softmax`` of the raw logits, the quantity
an inference engine reports, so ``logprobs()`` is comparable with engine logprobs.

Threads: ``threads > 0`` calls ``torch.set_num_threads`` (and a non-empty ``cpu_affinity``
pins the thread with ``os.sched_setaffinity``) at the start of every public compute method,
because both settings are per calling thread and callers may move the trainer onto a worker
thread.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from rollstream.config.schema import TrainConfig
from rollstream.train.advantages import compute_advantages
from rollstream.train.batching import MicroBatch, collate, gather_logprobs, pack_micro_batches
from rollstream.train.losses import (
    LossTargets,
    anchor_fn,
    build_targets,
    normaliser,
    policy_loss,
    token_age_mask,
)
from rollstream.trajectory import Group, Sample

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(slots=True, kw_only=True)
class _Prepared:
    """A micro-batch with its step-fixed loss targets."""

    mb: MicroBatch
    targets: LossTargets


class _Sums:
    """Running sums of named statistics (floats)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add(self, **kv: float) -> None:
        for k, v in kv.items():
            self.values[k] = self.values.get(k, 0.0) + float(v)

    def ratio(self, num: str, den: str) -> float:
        d = self.values.get(den, 0.0)
        return self.values.get(num, 0.0) / d if d else 0.0


class Trainer:
    """Owns the policy (HF causal LM), its optimizer and, with ``kl_coef > 0``, a reference."""

    def __init__(
        self,
        cfg: TrainConfig,
        model_path: Path,
        *,
        device: str = "cpu",
        max_response_tokens: int | None = None,
        temperature: float = 1.0,
    ) -> None:
        """``max_response_tokens``: the rollout's response budget (``sampling.max_new_tokens``),
        the Dr.GRPO constant normaliser; required when ``cfg.advantage == "dr_grpo"``.
        ``temperature``: the rollout's sampling temperature; logprobs are taken of
        ``logits / temperature``, the distribution the engines sampled from and report."""
        if not temperature > 0:
            raise ValueError(f"the trainer needs a sampling temperature > 0, got {temperature}")
        self.temperature = float(temperature)
        if cfg.advantage == "dr_grpo" and max_response_tokens is None:
            raise ValueError(
                "train.advantage=dr_grpo normalises by the response length budget: pass "
                "max_response_tokens (sampling.max_new_tokens) to Trainer"
            )
        self.cfg = cfg
        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.max_response_tokens = max_response_tokens
        self._bind_threads(pin=False)  # the constructing thread is not the compute thread
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        self.model.to(self.device).train()
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self._anchor = anchor_fn(cfg.loss)
        self._bf16 = cfg.dtype == "bfloat16"

    # -- public API ---------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Current-policy logprob of each sample's response tokens ([] for an empty response)."""
        self._bind_threads()
        out: list[list[float]] = [[] for _ in samples]
        idx = [i for i, s in enumerate(samples) if s.num_response_tokens > 0]
        for mb_idx, mb in self._micro_batches([samples[i] for i in idx]):
            logp = self._forward(self.model, mb).cpu()
            for row, j in enumerate(mb_idx):
                out[idx[j]] = logp[row, : samples[idx[j]].num_response_tokens].tolist()
        return out

    def step(self, groups: Sequence[Group], step: int) -> dict[str, float]:
        """One trainer step (module docstring); returns its metrics.

        With no trainable sample (no rewards, empty responses) nothing is updated and the
        metrics report ``num_samples = 0``.
        """
        self._bind_threads()
        t0 = time.perf_counter()
        samples, advantages = self._trainable(groups)
        sums = _Sums()
        if samples:
            batches = self._micro_batches(samples)
            prepared, norm = self._first_update(batches, advantages, step, sums)
            for _ in range(self.cfg.updates_per_step - 1):
                self._update(prepared, norm, sums)
        return self._metrics(sums, len(samples), time.perf_counter() - t0)

    def state_dict(self) -> dict[str, Tensor]:
        """HF-named parameters and buffers for weight sync (tied weights under both names).

        No copy: the tensors are the live parameters' storage, so the next ``step`` changes
        them in place. A caller that keeps them past the next step must copy them first.
        """
        return dict(self.model.state_dict())

    def save_checkpoint(self, out_dir: Path) -> Path:
        """HF folder (config + safetensors) plus the source folder's tokenizer files."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        for name in TOKENIZER_FILES:
            src = self.model_path / name
            if src.is_file():
                shutil.copy2(src, out_dir / name)
        return out_dir

    # -- internals ----------------------------------------------------------------------------

    def _bind_threads(self, *, pin: bool = True) -> None:
        if pin and self.cfg.cpu_affinity:  # on Linux this pins the calling thread only
            os.sched_setaffinity(0, self.cfg.cpu_affinity)
        if self.cfg.threads > 0:
            torch.set_num_threads(self.cfg.threads)

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if not self._bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _micro_batches(self, samples: Sequence[Sample]) -> list[tuple[list[int], MicroBatch]]:
        lengths = [len(s.task.prompt_ids) + s.num_response_tokens for s in samples]
        out = []
        for rows in pack_micro_batches(lengths, self.cfg.micro_batch_tokens):
            idx = [i for row in rows for i in row]
            at = {i: k for k, i in enumerate(idx)}  # sample index -> place in this micro-batch
            local = [[at[i] for i in row] for row in rows]
            out.append((idx, collate([samples[i] for i in idx], local).to(self.device)))
        return out

    def _forward(self, model: torch.nn.Module, mb: MicroBatch) -> Tensor:
        with self._autocast():
            out = model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,  # packed rows: no attention mask (batching)
                logits_to_keep=mb.logits_to_keep,
                use_cache=False,
            )
        logits = out.logits if self.temperature == 1.0 else out.logits / self.temperature
        return gather_logprobs(logits, mb)

    def _trainable(self, groups: Sequence[Group]) -> tuple[list[Sample], list[float]]:
        samples: list[Sample] = []
        advantages: list[float] = []
        for group in groups:
            graded = [s for s in group.samples if s.reward is not None]
            if not graded:
                continue
            adv = compute_advantages([s.reward for s in graded], self.cfg.advantage)
            for s, a in zip(graded, adv):
                if s.num_response_tokens > 0:
                    samples.append(s)
                    advantages.append(a)
        return samples, advantages

    def _first_update(
        self,
        batches: list[tuple[list[int], MicroBatch]],
        advantages: list[float],
        step: int,
        sums: _Sums,
    ) -> tuple[list[_Prepared], float]:
        """The step's first optimizer update; its forward passes give the proximal logprobs,
        hence the step-fixed targets of every micro-batch (module docstring). Returns them
        and the step's loss normaliser."""
        self.optimizer.zero_grad(set_to_none=True)
        prepared, loss_sum = [], 0.0
        for idx, mb in batches:
            logp = self._forward(self.model, mb)
            targets = self._targets(mb, logp.detach(), [advantages[i] for i in idx], step, sums)
            loss_sum += self._backward(logp, targets, 1.0, sums)  # divided by norm below
            prepared.append(_Prepared(mb=mb, targets=targets))
        num_tokens = int(sums.values.get("num_tokens", 0))
        norm = normaliser(
            self.cfg.advantage,
            num_tokens=num_tokens,
            num_samples=int(sums.values.get("num_samples", 0)),
            max_response_tokens=self.max_response_tokens,
        )
        if num_tokens:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(norm)
            self._optimizer_step(sums, loss_sum / norm)
        return prepared, norm

    @torch.no_grad()
    def _targets(
        self, mb: MicroBatch, logp_prox: Tensor, advantages: list[float], step: int, sums: _Sums
    ) -> LossTargets:
        """Step-fixed loss targets of one micro-batch from its proximal logprobs, and the
        mismatch / masking statistics."""
        logp_ref = None if self.reference is None else self._forward(self.reference, mb)
        base = mb.loss_mask & token_age_mask(mb.versions, step, self.cfg.max_token_age)
        targets, corr = build_targets(
            self._anchor,
            logp_behav=mb.logp_behav,
            logp_prox=logp_prox,
            advantages=torch.tensor(advantages, device=self.device),
            base_mask=base,
            is_cfg=self.cfg.is_correction,
            logp_ref=logp_ref,
        )
        diff = torch.where(base, mb.logp_behav - logp_prox, 0.0)
        kept = targets.mask
        sums.add(
            num_samples=len(advantages),
            num_tokens=int(kept.sum()),
            base_tokens=int(base.sum()),
            age_masked=int((mb.loss_mask & ~base).sum()),
            loss_mask_tokens=int(mb.loss_mask.sum()),
            is_masked=int((base & ~kept).sum()),
            is_weight=float(corr.weight[kept].sum()),
            mismatch_kl=float(diff.sum()),
            mismatch_abs=float(diff.abs().sum()),
            entropy=float(-logp_prox[kept].sum()),
        )
        return targets

    def _update(self, prepared: list[_Prepared], norm: float, sums: _Sums) -> None:
        """A later optimizer update: accumulate over all micro-batches, clip, step."""
        if not sums.values.get("num_tokens"):
            return
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for p in prepared:
            loss_sum += self._backward(self._forward(self.model, p.mb), p.targets, norm, sums)
        self._optimizer_step(sums, loss_sum / norm)

    def _backward(self, logp: Tensor, targets: LossTargets, norm: float, sums: _Sums) -> float:
        """Back-propagate one micro-batch's summed token loss / ``norm``; returns the sum."""
        loss, st = policy_loss(logp, targets, clip_eps=self.cfg.clip_eps, kl_coef=self.cfg.kl_coef)
        if st.num_tokens:  # all tokens masked: a zero loss, nothing to back-propagate
            (loss / norm).backward()
        sums.add(clipped=st.num_clipped, kl=st.kl_sum, update_tokens=st.num_tokens)
        return st.loss_sum

    def _optimizer_step(self, sums: _Sums, loss: float) -> None:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        sums.add(loss=loss, grad_norm=float(grad_norm), num_updates=1)

    def _metrics(self, sums: _Sums, num_samples: int, step_s: float) -> dict[str, float]:
        num_tokens = int(sums.values.get("num_tokens", 0))
        return {
            "loss": sums.ratio("loss", "num_updates"),
            "clip_frac": sums.ratio("clipped", "update_tokens"),
            "kl": sums.ratio("kl", "update_tokens"),
            "is_weight_mean": sums.ratio("is_weight", "num_tokens"),
            "is_masked_frac": sums.ratio("is_masked", "base_tokens"),
            "age_masked_frac": sums.ratio("age_masked", "loss_mask_tokens"),
            "mismatch": sums.ratio("mismatch_abs", "base_tokens"),
            "mismatch_kl": sums.ratio("mismatch_kl", "base_tokens"),
            "entropy": sums.ratio("entropy", "num_tokens"),
            "grad_norm": sums.ratio("grad_norm", "num_updates"),
            "num_tokens": float(num_tokens),
            "num_samples": float(num_samples),
            "step_s": step_s,
        }
