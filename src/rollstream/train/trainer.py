"""Single-process trainer: trajectories in, a new weight version out.

One ``step`` (the unit that produces weight version ``step + 1``):

1. advantages per group from its baseline rewards (:meth:`Group.baseline_rewards`: graded
   samples, plus FAILED ones as 0 with ``failed_reward: zero``); only samples with a reward
   and at least one response token are trained;
2. pack samples into micro-batches by ``micro_batch_tokens``, a prompt several samples
   share laid out once (``shared_prefix``, :mod:`.shared_prefix`);
3. ``updates_per_step`` optimizer updates, each accumulating gradients over all micro-batches
   (loss = aggregation-weighted token losses / one step-wide normaliser, ``loss_agg``), then
   grad clip and AdamW.

It returns a :class:`StepResult`: the metrics below, and per sample given with a reward what
the loss kept of it (:class:`KeptTokens`), counted from the final token mask of its
micro-batch, so the ledger records what was trained, not what might have been.

Loss. ``loss: auto`` is resolved once here: ``decoupled_ppo`` when the staleness policy
allows stale tokens (``max_staleness > 0``: one_step and async modes), ``ppo_clip`` in sync
mode, where behaviour and proximal policies coincide up to engine mismatch.

The proximal logprobs (the policy before the step's first update) come from the first
update's own forward pass, detached: before that update's optimizer step its parameters *are*
the proximal policy, so a separate no-grad pass would compute the same numbers (one of the
``1 + 3 * updates_per_step`` passes saved). From them (and the reference logprobs when
``kl_coef > 0``) come the token masks (below) and IS weights, fixed for the whole step (see
``losses``). The step-wide normaliser needs every micro-batch's
kept-token count, known only after the first update's last micro-batch, so that update
back-propagates the summed loss and divides the accumulated gradients by the normaliser
before clipping: gradients are linear in the loss, so this is the same update.

Token masks, in order: the sample's loss mask, the staleness policy's token age
(:meth:`StalenessPolicy.keeps`), the trainer's truncated support (with top-p/top-k, a token
the engine sampled that the trainer's truncation of its own logits cuts has logprob
``-inf``; possible off-policy or at a rounding tie), masked IS. A token that leaves the
truncated support during the step's later updates gets ratio 0 (no gradient, no NaN).

Metrics of ``step`` (token means are over trained tokens unless said otherwise): ``loss``
(mean over updates), ``clip_frac``, ``kl`` (k3 to the reference; 0 without one), ``grad_norm``
(pre-clip, mean over updates), ``clip_frac/age{a}`` (``clip_frac`` of the tokens of age
``a = step - version``, one key per age present up to ``max_staleness``;
``clip_frac/age_over{k}`` for older ones), ``is_weight_mean`` (the corrected weight ``m``),
``is_masked_frac`` (share of loss-mask tokens masked IS dropped), ``age_masked_frac`` (share
dropped by ``max_token_age``), ``support_masked_frac`` (share outside the trainer's
truncated support), ``mismatch`` (mean ``|logp_behav - logp_prox|``) and
``mismatch_kl`` (mean ``logp_behav - logp_prox``, a k1 estimate of KL(behav || prox)), both over
the tokens before IS masking (inside the support) so the correction cannot hide the mismatch
it removes, ``entropy`` (mean ``-logp_prox``: a sampled-token estimate, free), ``num_tokens``,
``num_samples``, ``step_s``; with ``router_aux_loss_coef > 0``, ``router_aux_loss`` (a mixture
of experts' load-balancing loss, mean per trained token over updates); for a mixture of
experts, ``routing_agreement`` (``train.routing_replay``, :mod:`.routing`).

Precision: parameters and AdamW state stay float32; ``dtype: bfloat16`` runs forward and
backward under ``torch.autocast(bfloat16)`` (mixed precision keeps small updates from being
rounded away), with the logits, and on CPU attention, in float32 (:mod:`.precision` says
why). Logprobs are always a float32 ``log_softmax`` of the logits divided by the
sampling temperature and truncated by the sampling top-k/top-p
(:mod:`rollstream.ops.truncation`, the sampler's own function): the distribution the engine
sampled from and reports, so ``logprobs()`` is comparable with engine logprobs. The model
stays in eval mode: dropout is off (a dropout mask would make every pass a different policy,
and the ratio to the engines' logprobs meaningless).

LoRA (``model.lora``, :mod:`.lora`): the policy is wrapped with a peft adapter and only the
adapter trains (AdamW over its parameters alone); the reference of a KL term is the policy
with its adapter disabled (no second model); :meth:`state_dict` is the adapter as weight sync
sends it, and checkpoints are peft adapter folders.

Compilation: ``compile: true`` compiles the policy module in place (``nn.Module.compile``,
dynamic shapes: micro-batches of any rows and width share a graph); the reference stays eager.
The first forward of each kind (with and without gradients) compiles.

Threads: ``threads > 0`` calls ``torch.set_num_threads`` (and a non-empty ``cpu_affinity``
pins the thread with ``os.sched_setaffinity``) at the start of every public compute method,
because both settings are per calling thread and callers may move the trainer onto a worker
thread.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from rollstream.config.schema import LoraConfig, TrainConfig
from rollstream.models.tokenizer import copy_tokenizer_files
from rollstream.staleness import StalenessPolicy, age
from rollstream.train import lora as lora_adapter
from rollstream.train.advantages import compute_advantages
from rollstream.train.batching import (
    MicroBatch,
    collate,
    gather_logprobs,
    pack_micro_batches,
    padding_micro_batch,
)
from rollstream.train.losses import (
    anchor_fn,
    build_targets,
    normaliser,
    policy_loss,
    resolve_loss,
    resolve_loss_agg,
    router_balance_loss,
)
from rollstream.train.precision import bf16_width_multiple, keep_float32
from rollstream.train.routing import bound, router_hooks
from rollstream.train.shared_prefix import micro_batch_layout, model_mask, plan_units, share_rule
from rollstream.train.step_stats import Prepared, StepSums, kept_tokens, step_metrics
from rollstream.trajectory import Group, KeptTokens, Sample, StepResult


class Trainer:
    """Owns the policy (HF causal LM), its optimizer and, with ``kl_coef > 0``, a reference."""

    def __init__(
        self,
        cfg: TrainConfig,
        model_path: Path,
        *,
        staleness: StalenessPolicy,
        device: str = "cpu",
        max_response_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        lora: LoraConfig | None = None,
    ) -> None:
        """``staleness``: the run's policy (token-age mask, and ``loss: auto``).
        ``max_response_tokens``: the rollout's response budget (``sampling.max_new_tokens``),
        the Dr.GRPO constant normaliser; required when the loss aggregation is
        ``seq_mean_token_sum_norm``. ``temperature``, ``top_p``, ``top_k``: the rollout's
        sampling settings; logprobs are taken of ``logits / temperature`` truncated as the
        sampler truncates, the distribution the engines sampled from and report. ``lora``:
        train an adapter of these settings instead of every weight (module docstring)."""
        if not temperature > 0:
            raise ValueError(f"the trainer needs a sampling temperature > 0, got {temperature}")
        if not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"sampling top_p must be in (0, 1] and top_k >= 0 (0 = off), got "
                             f"top_p={top_p}, top_k={top_k}")
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.staleness = staleness
        self.loss = resolve_loss(cfg.loss, staleness.max_staleness)
        self.loss_agg = resolve_loss_agg(cfg.loss_agg, cfg.advantage)
        if self.loss_agg == "seq_mean_token_sum_norm" and max_response_tokens is None:
            raise ValueError(
                "train.loss_agg=seq_mean_token_sum_norm (Dr.GRPO, also what advantage=dr_grpo "
                "means by default) normalises by the response length budget: pass "
                "max_response_tokens (sampling.max_new_tokens) to Trainer"
            )
        self.cfg = cfg
        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.max_response_tokens = max_response_tokens
        self._failed_reward = 0.0 if cfg.failed_reward == "zero" else None
        self._bind_threads(pin=False)  # the constructing thread is not the compute thread
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        self.model.to(self.device).eval()  # dropout off (module docstring); grads still flow
        self._bf16 = cfg.dtype == "bfloat16"
        if self._bf16:  # before the reference copies the policy
            keep_float32(self.model, self.device)
        self.lora = lora
        self.reference = None
        if lora is not None:  # the reference is this model with its adapter disabled
            self.model = lora_adapter.wrap(self.model, lora, self.model_path).eval()
        elif cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._shard(self.model)  # before the optimizer: sharding replaces the parameters
        if cfg.compile:  # in place: the same module, state_dict and save_pretrained
            self.model.compile(dynamic=True)
        self.optimizer = torch.optim.AdamW(  # with LoRA only the adapter requires grad
            [p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
            weight_decay=cfg.weight_decay)
        self._anchor = anchor_fn(self.loss)
        self._min_prefix, self._kappa = share_rule(cfg, self.model.config)
        self._experts = getattr(self.model.config, "num_experts", 0) or 0
        if cfg.router_aux_loss_coef > 0 and not self._experts:
            raise ValueError(f"train.router_aux_loss_coef = {cfg.router_aux_loss_coef} needs a "
                             f"mixture-of-experts model; {self.model_path} has no experts")
        self._routes = router_hooks(self.model, replay=cfg.routing_replay == "replay",
                                    compiled=cfg.compile, source=self.model_path)

    # -- public API ---------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Current-policy logprob of each sample's response tokens ([] for an empty response),
        under the sampling temperature and truncation (``-inf`` outside the top-k/top-p)."""
        self._bind_threads()
        out: list[list[float]] = [[] for _ in samples]
        idx = [i for i, s in enumerate(samples) if s.num_response_tokens > 0]
        for mb_idx, mb in self._micro_batches([samples[i] for i in idx]):
            logp = self._forward(self.model, mb).cpu()
            for row, j in enumerate(mb_idx):
                out[idx[j]] = logp[row, : samples[idx[j]].num_response_tokens].tolist()
        return out

    def step(self, groups: Sequence[Group], step: int) -> StepResult:
        """One trainer step (module docstring): its metrics, and what the loss kept of every
        sample given with a reward.

        With no trainable sample (no rewards, empty responses) nothing is updated and the
        metrics report ``num_samples = 0``.
        """
        self._bind_threads()
        t0 = time.perf_counter()
        samples, advantages, kept = self._trainable(groups)
        sums = StepSums()
        if samples:
            batches = self._micro_batches(samples)
            prepared, norm = self._first_update(batches, samples, advantages, step, sums, kept)
            for _ in range(self.cfg.updates_per_step - 1 if norm is not None else 0):
                self._update(prepared, norm, sums)
        sums, kept = self._merge(sums, kept)
        metrics = step_metrics(sums, num_samples=len(samples), step_s=time.perf_counter() - t0,
                               max_staleness=self.staleness.max_staleness)
        return StepResult(metrics=metrics, kept=kept)

    def state_dict(self) -> dict[str, Tensor]:
        """HF-named parameters and buffers for weight sync (tied weights under both names);
        with LoRA the adapter alone (``sync/protocol.py``'s ``adapter`` payload).

        No copy: the tensors are the live parameters' storage, so the next ``step`` changes
        them in place. A caller that keeps them past the next step must copy them first.
        """
        if self.lora is not None:
            return lora_adapter.sync_tensors(self.model)
        return dict(self.model.state_dict())

    def save_checkpoint(self, out_dir: Path) -> Path:
        """HF folder (config + safetensors; with LoRA peft's adapter folder) plus the source
        folder's tokenizer files."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        self._copy_tokenizer(out_dir)
        return out_dir

    def _copy_tokenizer(self, out_dir: Path) -> None:
        copy_tokenizer_files(self.model_path, out_dir)

    def close(self) -> None:
        """Nothing to release: the policy lives in this process."""

    def save_training_state(self, path: Path) -> None:
        """Optimizer and RNG states (a durable checkpoint's ``trainer.pt``; the weights are
        :meth:`save_checkpoint`'s HF folder)."""
        torch.save({"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                    "python_rng": random.getstate()}, path)

    def load_training_state(self, model_dir: Path, path: Path) -> None:
        """Continue from a durable checkpoint: the policy's weights from the HF folder
        ``model_dir``, optimizer and RNG states from ``path`` (the reference model, if any,
        stays the one the run started from; with LoRA ``model_dir`` is an adapter folder)."""
        if self.lora is not None:
            lora_adapter.load_adapter(self.model, model_dir)
        else:
            saved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self.model.load_state_dict(saved.state_dict())
        state = torch.load(path, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    def follow_rollout(self, *, staleness: StalenessPolicy, max_response_tokens: int,
                       temperature: float) -> None:
        """Rollout settings reconfigured between steps (``runtime.reconfigure``): the token-age
        mask of the next steps, the Dr.GRPO normaliser's response budget, and the temperature
        of samples that do not record theirs. ``loss: auto`` stays what it resolved to."""
        self.staleness = staleness
        self.max_response_tokens = max_response_tokens
        self.temperature = float(temperature)

    # -- internals ----------------------------------------------------------------------------

    # Hooks of the data-parallel backend (``rollstream.train.fsdp``); here a single process
    # computes every micro-batch, so they leave things as they are.

    backward_masked = False
    """Back-propagate a micro-batch whose tokens are all masked (a zero loss): the FSDP
    backend must, its gradient reduction runs in backward hooks on every rank."""

    def _share(self, packed: list[list[list[int]]]) -> list[list[list[int]]]:
        """The micro-batches (rows of sample indices) this process computes; ``[]`` pads."""
        return packed

    def _shard(self, model: torch.nn.Module) -> None:
        """Shard the policy's parameters across ranks (before the optimizer sees them)."""

    def _step_counts(self, sums: StepSums) -> dict[str, int]:
        """The step's kept tokens, kept sequences and trained samples (every rank's)."""
        return {k: int(sums.values.get(k, 0)) for k in ("num_tokens", "num_sequences",
                                                         "num_samples")}

    def _merge(self, sums: StepSums, kept: dict[str, KeptTokens]
               ) -> tuple[StepSums, dict[str, KeptTokens]]:
        """The step's sums and kept tokens over every rank's micro-batches."""
        return sums, kept

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
        """This process's micro-batches (all of them, here): sample indices and layout; a
        padding micro-batch (:func:`padding_micro_batch`) has no index. Shared prefixes are
        laid out once (:mod:`.shared_prefix`)."""
        units, lengths = plan_units(samples, min_tokens=self._min_prefix,
                                    budget=self.cfg.micro_batch_tokens, kappa=self._kappa)
        out = []
        multiple = bf16_width_multiple(self.device) if self._bf16 else 1
        for rows in self._share(pack_micro_batches(lengths, self.cfg.micro_batch_tokens,
                                                   multiple)):
            if not rows:
                out.append(([], padding_micro_batch().to(self.device)))
                continue
            idx, local, shared = micro_batch_layout(units, rows)
            out.append((idx, collate([samples[i] for i in idx], local, temperature=self.temperature,
                                     width_multiple=multiple, shared=shared).to(self.device)))
        return out

    def _forward(self, model: torch.nn.Module, mb: MicroBatch,
                 balance: list[Tensor] | None = None) -> Tensor:
        """[B, T] logprobs of ``mb``'s response tokens; with ``balance`` (a list) and
        ``router_aux_loss_coef > 0``, appends the micro-batch's load-balancing loss to it."""
        balance = balance if self.cfg.router_aux_loss_coef > 0 else None
        routes = self._routes if model is self.model else None  # the reference: its own
        with self._autocast(), bound(routes, mb.experts, mb.token_mask):
            out = model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,  # packed rows: no mask unless a prefix is shared
                attention_mask=model_mask(mb.attention_mask, model),
                logits_to_keep=mb.logits_to_keep,
                use_cache=False,
                **({} if balance is None else {"output_router_logits": True}),
            )
        if balance is not None:
            balance.append(router_balance_loss(out.router_logits, mb.token_mask, self._experts,
                                               self.model.config.num_experts_per_tok))
        logits = out.logits
        if bool((mb.temperature != 1.0).any()):  # each sample at its own (Sample.temperature)
            logits = logits / mb.temperature.unsqueeze(-1)
        return gather_logprobs(logits, mb, top_p=self.top_p, top_k=self.top_k)

    def _trainable(
        self, groups: Sequence[Group]
    ) -> tuple[list[Sample], list[float], dict[str, KeptTokens]]:
        """Samples to train and their advantages; ``kept`` starts at 0 for every sample with
        a reward (the first update fills in the trained ones)."""
        samples: list[Sample] = []
        advantages: list[float] = []
        kept: dict[str, KeptTokens] = {}
        for group in groups:
            baseline = group.baseline_rewards(self._failed_reward)
            if not baseline:
                continue
            adv = compute_advantages([r for _, r in baseline], self.cfg.advantage,
                                     std=self.cfg.advantage_std)
            for s, a in zip((s for s, _ in baseline), adv):
                if s.reward is None:  # a FAILED sample: in the baseline, never trained
                    continue
                if s.num_response_tokens == 0:
                    kept[s.uid] = KeptTokens(num_tokens=0, min_version=None,
                                             reason="empty response")
                    continue
                samples.append(s)
                advantages.append(a)
        return samples, advantages, kept

    def _first_update(
        self,
        batches: list[tuple[list[int], MicroBatch]],
        samples: list[Sample],
        advantages: list[float],
        step: int,
        sums: StepSums,
        kept: dict[str, KeptTokens],
    ) -> tuple[list[Prepared], float | None]:
        """The step's first optimizer update; its forward passes give the proximal logprobs,
        hence the step-fixed targets of every micro-batch (module docstring). Fills ``kept``;
        returns the targets and the step's loss normaliser (None: no token kept, no update)."""
        self.optimizer.zero_grad(set_to_none=True)
        prepared, loss_sum = [], 0.0
        for idx, mb in batches:
            balance: list[Tensor] = []
            logp = self._forward(self.model, mb, balance)
            if self._routes is not None:  # the proximal forward's (train/routing.py)
                sums.add(**dict(zip(("routing_agree", "routing_tokens"),
                                    self._routes.take_counts())))
            p = self._targets(mb, logp.detach(), [advantages[i] for i in idx], step, sums)
            kept.update(kept_tokens([samples[i] for i in idx], p, step, self.staleness))
            loss_sum += self._backward(logp, p, 1.0, sums, balance)  # divided by norm below
            prepared.append(p)
        counts = self._step_counts(sums)
        if not counts["num_tokens"]:
            return prepared, None
        norm = normaliser(self.loss_agg, **counts, max_response_tokens=self.max_response_tokens)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.div_(norm)
        self._optimizer_step(sums, loss_sum / norm)
        return prepared, norm

    @torch.no_grad()
    def _targets(
        self, mb: MicroBatch, logp_prox: Tensor, advantages: list[float], step: int, sums: StepSums
    ) -> Prepared:
        """Step-fixed loss targets of one micro-batch from its proximal logprobs, and the
        mismatch / masking statistics."""
        logp_ref = self._reference_logprobs(mb)
        young = mb.loss_mask & self.staleness.keeps(mb.versions, step)
        base = young & torch.isfinite(logp_prox)  # -inf: outside the truncated support
        targets, corr = build_targets(
            self._anchor,
            logp_behav=mb.logp_behav,
            logp_prox=logp_prox,
            advantages=torch.tensor(advantages, device=self.device),
            base_mask=base,
            is_cfg=self.cfg.is_correction,
            logp_ref=logp_ref,
            loss_agg=self.loss_agg,
        )
        diff = torch.where(base, mb.logp_behav - logp_prox, 0.0)
        kept = targets.mask
        sums.add(
            num_samples=len(advantages),
            num_sequences=int(kept.any(dim=-1).sum()),
            num_tokens=int(kept.sum()),
            base_tokens=int(base.sum()),
            age_masked=int((mb.loss_mask & ~young).sum()),
            support_masked=int((young & ~base).sum()),
            loss_mask_tokens=int(mb.loss_mask.sum()),
            is_masked=int((base & ~kept).sum()),
            is_weight=float(corr.weight[kept].sum()),
            mismatch_kl=float(diff.sum()),
            mismatch_abs=float(diff.abs().sum()),
            entropy=float(-logp_prox[kept].sum()),
        )
        age_bucket = age(step, mb.versions).clamp(0, self.staleness.max_staleness + 1)
        stages = torch.stack([mb.loss_mask, young, base, kept]).sum(dim=-1).T  # [B, 4]
        return Prepared(mb=mb, targets=targets, age_bucket=age_bucket,
                         stage_counts=stages.tolist())

    def _reference_logprobs(self, mb: MicroBatch) -> Tensor | None:
        """The reference policy's logprobs (None without a KL term)."""
        if self.cfg.kl_coef <= 0:
            return None
        if self.lora is not None:
            with self.model.disable_adapter():
                return self._forward(self.model, mb)
        assert self.reference is not None
        return self._forward(self.reference, mb)

    def _update(self, prepared: list[Prepared], norm: float, sums: StepSums) -> None:
        """A later optimizer update: accumulate over all micro-batches, clip, step."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for p in prepared:
            balance: list[Tensor] = []
            logp = self._forward(self.model, p.mb, balance)
            loss_sum += self._backward(logp, p, norm, sums, balance)
        self._optimizer_step(sums, loss_sum / norm)

    def _backward(self, logp: Tensor, p: Prepared, norm: float, sums: StepSums,
                  balance: Sequence[Tensor] = ()) -> float:
        """Back-propagate one micro-batch's summed token loss / ``norm`` (plus, per trained
        token, the weighted load-balancing loss in ``balance``); returns the policy loss sum."""
        loss, st = policy_loss(logp, p.targets, clip_eps=self.cfg.clip_eps,
                               kl_coef=self.cfg.kl_coef)
        for b in balance:
            loss = loss + self.cfg.router_aux_loss_coef * st.num_tokens * b
            sums.add(router_aux=float(b.detach()) * st.num_tokens)
        if st.num_tokens or self.backward_masked:  # all masked: a zero loss
            (loss / norm).backward()
        sums.add(clipped=st.num_clipped, kl=st.kl_sum, update_tokens=st.num_tokens)
        sums.add_clips_by_age(p, st.clipped, self.staleness.max_staleness + 2)
        return st.loss_sum

    def _optimizer_step(self, sums: StepSums, loss: float) -> None:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        if hasattr(grad_norm, "full_tensor"):  # sharded parameters: a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        sums.add(loss=loss, grad_norm=float(grad_norm), num_updates=1)


