"""``train``: the trainer's section (advantages, loss, optimizer, precision, checkpoints and
the fsdp backend). The staleness bounds the loss applies are ``rollout.staleness``'s
(config/staleness.py): the trainer is handed the run's policy, not these settings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, field_validator, model_validator

from rollstream.config.section import Section
from rollstream.config.staleness import refuse_replaced_keys


class ISCorrectionConfig(Section):
    level: Literal["token", "sequence"] = "token"
    """Importance ratio per token or per sequence (geometric mean)."""
    mode: Literal["none", "truncate", "mask"] = "truncate"
    """Truncated IS (cap the weight) or masked IS (drop tokens whose weight leaves bounds)."""
    cap: float = Field(2.0, gt=1)
    """Upper bound (truncate) or upper mask threshold (mask)."""
    lower: float = Field(0.5, gt=0, lt=1)
    """Lower mask threshold (mask mode)."""


class FsdpConfig(Section):
    world_size: int = Field(2, ge=1)
    """Trainer ranks: processes the controller starts (Ray actors in ``runtime.ray.scale_units``
    units on ``runtime.kind: ray``), each holding a shard of the policy and
    of AdamW's state and computing every ``world_size``-th micro-batch of a step (gloo on CPU,
    NCCL with ``device: cuda``). docs/distributed.md."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the ranks compute: ``cpu`` (gloo) or ``cuda`` (rank r on GPU r, NCCL)."""
    max_restarts: int = Field(1, ge=0)
    """Times a run resumes from its newest durable checkpoint (``train.checkpoint_every``)
    after a rank process died (killed, crashed, out of memory): the step being computed is
    lost, every rank is started again and the run continues as ``resume=true`` would, in the
    same command. A rank that raised an error is not restarted (it would raise again). On
    Ray the new ranks go where the scale units find room: with ``runtime.ray.nodes.trainer``,
    another node of that role when theirs left the cluster (none left: the run stops)."""


class TrainConfig(Section):
    steps: int = Field(60, ge=1)
    """Optimizer steps (each publishes a new weight version)."""
    groups_per_step: int = Field(16, ge=1)
    """Groups (prompts) per trainer step."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """Advantage estimator: ``grpo`` ((r - group mean) / group std), ``dr_grpo`` (r - group
    mean, no std; with Dr.GRPO's constant loss normaliser unless ``loss_agg`` says
    otherwise), ``rloo`` (r - mean of the other samples)."""
    advantage_std: Literal["sample", "population"] = "sample"
    """The group standard deviation of ``grpo``: ``sample`` (Bessel-corrected, divide by
    n - 1, as verl and TRL) or ``population`` (divide by n). Only ``grpo`` divides by a std:
    setting ``population`` with another advantage is an error."""
    failed_reward: Literal["exclude", "zero"] = "exclude"
    """A FAILED sample (engine error, reward error or timeout) in its group's baseline:
    ``exclude`` leaves it out (the baseline is the graded samples'), ``zero`` counts it as
    reward 0 (a failure lowers the baseline, so the group's successes weigh more). Either way
    the failed sample itself is never trained; the zero-variance filter uses the same
    baseline."""
    loss: Literal["auto", "ppo_clip", "decoupled_ppo"] = "auto"
    """Policy loss. ``ppo_clip`` clips the ratio to the behaviour policy (the engine's
    logprobs). ``decoupled_ppo`` (AReaL) clips against the proximal (pre-step) policy and
    weights by the behaviour->proximal importance ratio, truncated per ``is_correction``:
    with stale samples the behaviour policy is several versions old, and clipping against it
    would clip most stale tokens. ``auto`` = ``decoupled_ppo`` when the staleness bound is
    above 0 (``one_step``, ``async``), ``ppo_clip`` in ``sync`` mode."""
    loss_agg: Literal["auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                      "seq_mean_token_sum_norm"] = "auto"
    """How token losses add up to the step's loss (verl's names): ``token_mean`` (mean over
    every kept token), ``seq_mean_token_mean`` (mean over samples of each sample's token
    mean), ``seq_mean_token_sum`` (mean over samples of each sample's token sum),
    ``seq_mean_token_sum_norm`` (token sum / (samples x sampling.max_new_tokens): Dr.GRPO's
    constant normaliser). ``auto`` = ``seq_mean_token_sum_norm`` for ``advantage: dr_grpo``,
    else ``token_mean``; another value with ``dr_grpo`` is an error (Dr.GRPO is both)."""
    clip_eps: float = Field(0.2, gt=0, lt=1)
    """PPO clip range."""
    is_correction: ISCorrectionConfig = ISCorrectionConfig()
    """Engine–trainer mismatch correction."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty to the initial (reference) policy (0 = no reference model)."""
    router_aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of a mixture-of-experts model's load-balancing loss (Switch Transformer's, as
    transformers computes it from the router logits of every token of a micro-batch's
    samples, prompts included), counted once per trained token: with token-mean aggregation the step's loss is the policy
    loss + this x the load-balancing loss, as transformers adds it to a language-model loss.
    0 = off; > 0 is an error for a model without experts."""
    routing_replay: Literal["off", "replay"] = "off"
    """Mixture-of-experts models: which experts the trainer's forward sends each token to.
    ``off``: its own router's top-k. ``replay`` (R3): the experts the engine routed the token
    to when it last computed it (``Sample.routing``, recorded by the embedded engine for
    prompt, environment and sampled tokens), so that the trainer's logprobs are those of the
    network the engine sampled from; the weights over the replayed experts are still the
    trainer's router softmax at them (renormalised when the model's ``norm_topk_prob`` says
    so), so the router keeps its gradient. Every forward of the policy replays: the
    proximal-policy forward of decoupled PPO too, so its ratio to the behaviour logprobs
    measures engine–trainer mismatch and its ratio to the updated policy measures policy
    change only, not a change of routing. Tokens with no recorded routing (a sequence's last
    token, an episode served as turn-samples) use the trainer's own routing; the reference
    policy of a KL term routes by its own router. The load-balancing loss
    (``router_aux_loss_coef``) is still computed from the router's logits and its own top-k:
    under replay it balances what the router would choose, which is what the engines will
    route by after the next weight sync. ``replay`` is an error for a model without experts,
    with ``engine.kind: vllm`` (vLLM's CPU build cannot return routed experts: its
    ``--enable-return-routed-experts`` needs Model Runner V2, which needs Triton's GPU kernels;
    the vLLM client does not read them),
    ``runtime.kind: ray`` (engine actors do not return them yet), ``compile: true`` and
    ``model.lora``. The step metric ``routing_agreement`` (every step, MoE models) is the
    share of recorded (token, layer) top-k sets that the trainer's own router picks too."""
    lr: float = Field(2e-4, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    updates_per_step: int = Field(2, ge=1)
    """Passes over each step's batch (each pass is one optimizer update)."""
    micro_batch_tokens: int = Field(8192, ge=16)
    """Tokens computed per micro-batch (rows x row width; short samples share rows, so
    padding stays small whatever the budget); micro-batches accumulate gradients."""
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    """Compute a prefix that several sequences of a micro-batch share once: a group's prompt,
    the leading tokens of an episode's turn-samples (train/shared_prefix.py). The samples
    of one prompt are packed into one micro-batch (cut into chunks only where they pass
    ``micro_batch_tokens``), the prefix laid out once, each sample's rest after it under a
    block attention mask: the flat layout's loss and gradients up to float rounding, with
    fewer tokens computed, but each in a row as wide as the whole unit. ``auto`` = shared
    where the prefix is at least 16 tokens long, at least two sequences share it and the
    estimated cost (tokens, and attention over the row's width) is below the flat layout's,
    in narrower chunks where those cost less (long answers to a short prompt stay flat);
    flat with ``compile``, ``router_aux_loss_coef > 0`` or ``routing_replay: replay``;
    ``on`` = every shared prefix (an error with any of those); ``off`` = flat."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training precision. ``bfloat16``: mixed precision, the matmuls in bf16 under autocast,
    parameters, AdamW state and the logits (and on CPU attention) in float32
    (train/precision.py)."""
    compile: bool = False
    """Compile the policy's forward (and so its backward) with ``torch.compile`` (dynamic
    shapes; ``backend: local`` only). The first step pays the compile (tens of seconds on a
    CPU, less with inductor's on-disk cache warm); later steps run faster (docs/benchmarks.md
    has the measured step time and the break-even), so it pays on long runs only."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads of the trainer (0 = leave as is)."""
    cpu_affinity: tuple[NonNegativeInt, ...] = ()
    """CPU cores the trainer's calling thread is pinned to (Linux ``sched_setaffinity`` of
    that thread only; empty = leave as is). With ``backend: fsdp`` the cores the rank
    processes share out: each rank's compute thread is pinned to its own slice (ranks share
    cores round-robin when there are fewer cores than ranks), with as many torch threads as
    its slice has cores unless ``threads`` is set."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a durable checkpoint (``checkpoints/step_NNNNNN``: weights, optimizer, data
    cursor, buffer, in-flight partial samples; docs/run-dir.md) every N steps; one is also
    saved when the run ends or stops (0 = only then)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Durable checkpoints kept (the newest N; older ones are deleted once a newer is whole)."""
    backend: Literal["local", "fsdp"] = "local"
    """``local``: the trainer computes in the controller's process. ``fsdp``: PyTorch FSDP2
    over ``fsdp.world_size`` rank processes, micro-batches shared among them; the same loss,
    and the same update up to float rounding (docs/distributed.md)."""
    fsdp: FsdpConfig = FsdpConfig()
    """Settings of ``backend: fsdp`` (one set with ``backend: local`` is an error)."""

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data):
        return refuse_replaced_keys("train", data)

    @field_validator("shared_prefix", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        # YAML 1.1 reads a bare on / off as a boolean
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


def check_train(t: TrainConfig) -> None:
    """Training settings that contradict each other."""
    if t.advantage == "dr_grpo" and t.loss_agg not in ("auto", "seq_mean_token_sum_norm"):
        raise ValueError(
            f"train.loss_agg = {t.loss_agg} contradicts train.advantage = dr_grpo (Dr.GRPO is "
            "both its advantage and the constant normaliser samples x max_new_tokens, i.e. "
            "loss_agg seq_mean_token_sum_norm or auto); for another aggregation use "
            "advantage grpo or rloo"
        )
    if t.backend != "fsdp" and t.fsdp != FsdpConfig():
        changed = next(k for k, v in t.fsdp if v != FsdpConfig.model_fields[k].default)
        raise ValueError(
            f"train.fsdp.{changed} = {getattr(t.fsdp, changed)} is read only with "
            f"train.backend = fsdp (it is {t.backend}); set backend: fsdp or drop it"
        )
    if t.compile and t.backend != "local":
        raise ValueError(
            f"train.compile = true is implemented for train.backend = local only (it is "
            f"{t.backend}); drop one"
        )
    if t.shared_prefix == "on" and (why := flat_only(t)):
        raise ValueError(f"train.shared_prefix = on contradicts train.{why}; set "
                         "shared_prefix auto or off")
    if t.advantage_std != "sample" and t.advantage != "grpo":
        raise ValueError(
            f"train.advantage_std = {t.advantage_std} has no effect with train.advantage = "
            f"{t.advantage} (only grpo divides by the group std); drop advantage_std"
        )


def flat_only(t: TrainConfig) -> str | None:
    """Why ``t`` lays every sample out flat (None: a prefix may be shared): the setting and
    the reason, for ``shared_prefix: on``'s refusal (``auto`` stays flat)."""
    if t.compile:
        return "compile = true (a compiled forward is not built for the shared layout's mask)"
    if t.router_aux_loss_coef > 0:
        return (f"router_aux_loss_coef = {t.router_aux_loss_coef} (the load-balancing loss "
                "would count a shared prefix once, not once per sample)")
    if t.routing_replay == "replay":
        return ("routing_replay = replay (a prefix laid out once could replay one sample's "
                "recorded routing only, and samples may have been routed by other versions)")
    return None


def check_routing_replay(t: TrainConfig, *, engine_kind: str, lora: bool,
                         experts: str | None) -> None:
    """``train.routing_replay: replay`` against what cannot record or replay routing
    (``experts``: the tiny model's arch, None for a model folder, which the trainer checks)."""
    if t.routing_replay == "off":
        return
    if experts is not None and experts != "qwen2_moe":
        raise ValueError(f"train.routing_replay = replay needs a mixture-of-experts model: "
                         f"model.tiny.arch is {experts!r} (qwen2_moe has experts)")
    for name, value, why in (
            ("engine.kind", engine_kind if engine_kind == "vllm" else None,
             "vLLM's CPU build cannot return routed experts, and rollstream's vLLM client "
             "does not read them: docs/moe.md"),
            ("train.compile", "true" if t.compile else None,
             "the replaying router hook is not compiled"),
            ("model.lora", "set" if lora else None,
             "LoRA on a mixture-of-experts model is not supported")):
        if value is not None:
            raise ValueError(f"train.routing_replay = replay is not supported with {name} = "
                             f"{value} ({why}): set train.routing_replay: off or change {name}")
