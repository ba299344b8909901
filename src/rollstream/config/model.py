"""The ``model:`` section: a model folder to load, or the tiny model the kit builds and
warm-starts when there is none."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rollstream.config.section import Section

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")
"""The ``tiny`` settings that only ``arch: qwen2_moe`` reads."""


class TinyModelConfig(Section):
    arch: Literal["qwen2", "llama", "qwen2_moe"] = "qwen2"
    """Architecture family written to config.json: ``qwen2`` and ``llama`` are dense;
    ``qwen2_moe`` is Qwen2's attention with a mixture-of-experts MLP in every layer (a softmax
    router picks ``num_experts_per_tok`` of ``num_experts`` experts per token, plus one shared
    expert behind a sigmoid gate), as transformers' ``Qwen2MoeForCausalLM``."""
    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention when < num_heads)."""
    intermediate_size: int = Field(384, ge=8)
    """MLP width of a dense layer (``qwen2_moe``: written to config.json, where transformers
    reads it only for layers without experts, which the kit's MoE model has none of)."""
    max_position: int = Field(512, ge=16)
    """Maximum sequence length (prompt + response)."""
    seed: int = 0
    """Initialisation seed."""
    num_experts: int = Field(4, ge=2)
    """``qwen2_moe``: routed experts per layer."""
    num_experts_per_tok: int = Field(2, ge=1)
    """``qwen2_moe``: experts each token is routed to (top-k of the router's softmax, weighted
    by their probabilities, not renormalised: transformers' default ``norm_topk_prob``)."""
    moe_intermediate_size: int = Field(128, ge=8)
    """``qwen2_moe``: MLP width of each routed expert."""
    shared_expert_intermediate_size: int = Field(128, ge=8)
    """``qwen2_moe``: MLP width of the shared expert every token goes through."""

    @model_validator(mode="after")
    def _check_moe(self) -> TinyModelConfig:
        if self.arch != "qwen2_moe":
            # a default value is allowed: a printed default config loads back
            given = [f for f in MOE_FIELDS
                     if getattr(self, f) != type(self).model_fields[f].default]
            if given:
                raise ValueError(f"model.tiny.{given[0]} is read only with "
                                 f"model.tiny.arch: qwen2_moe (it is {self.arch!r})")
        elif self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"model.tiny.num_experts_per_tok ({self.num_experts_per_tok}) "
                             f"must be at most model.tiny.num_experts ({self.num_experts})")
        return self


class WarmStartConfig(Section):
    steps: int = Field(250, ge=0)
    """Supervised steps on noisy demonstrations before RL (0 = none). Cached by content hash."""
    lr: float = Field(3e-3, gt=0)
    """Learning rate of the warm start."""
    tokens_per_step: int = Field(4096, ge=64)
    """Tokens per supervised step."""
    noise: float = Field(0.15, ge=0, le=1)
    """Probability that a demonstration step slips by one (keeps RL headroom)."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers (Llama/Qwen2 names): what ``model.lora.target_modules`` may
name."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32's ``--max-lora-rank`` takes (a server serves adapters up to it)."""


class LoraConfig(Section):
    rank: int = Field(8, ge=1)
    """Rank r of each adapter pair (A: r x d_in, B: d_out x r)."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: an adapter adds ``alpha / rank * B @ A`` to its layer's weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """PEFT's dropout on the adapter's input. It acts only in training mode, and the RL
    trainer keeps the policy in eval mode (its importance ratios need one policy per pass),
    so it is written to ``adapter_config.json`` for whoever fine-tunes the adapter further
    and is inactive during RL."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """The linear layers that get an adapter, by name in every decoder layer (a subset of
    ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``; attention only:
    ``[q_proj, k_proj, v_proj, o_proj]``)."""
    export_merged: bool = False
    """Also write the merged model (base + adapter, a plain HF folder) to the run's
    ``final/merged`` at the end; the final checkpoint itself is the adapter (PEFT format)."""

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(targets) - set(LORA_TARGETS))
        if unknown or not targets:
            raise ValueError(f"{unknown or 'nothing'}: target_modules takes a non-empty "
                             f"subset of {', '.join(LORA_TARGETS)}")
        return tuple(dict.fromkeys(targets))


class ModelConfig(Section):
    path: str | None = None
    """A Hugging Face causal-LM folder (Llama/Qwen2 family). When null, the tiny-model kit
    builds one (``tiny``), warm-starts it on the run's tasks and caches it under cache_dir."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the model the kit builds when ``path`` is null."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """Supervised warm start applied to a kit-built model."""
    cache_dir: str = ".cache/rollstream"
    """Where built models and warm starts are cached."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter on the frozen model instead of every weight (needs the ``lora``
    extra: peft). Weight sync then moves the adapter alone and the engines merge it onto
    their base weights (vLLM: loads it into its one adapter slot); checkpoints hold the
    adapter in PEFT's format (docs/lora.md). ``runtime.kind: embedded`` and
    ``train.backend: local`` only for now, dense models only."""

    @model_validator(mode="after")
    def _check_lora_arch(self) -> ModelConfig:
        if self.lora is not None and self.path is None and self.tiny.arch == "qwen2_moe":
            raise ValueError("model.lora on model.tiny.arch qwen2_moe is not supported yet "
                             "(a mixture-of-experts model trains without an adapter): drop "
                             "one")
        return self


def check_lora(lora: LoraConfig | None, *, engine_kind: str, runtime_kind: str,
               train_backend: str, train_compile: bool) -> None:
    """``model.lora`` against the settings that cannot take an adapter yet: the adapter is
    applied by engines in this process (the embedded one merges it onto its base weights,
    vLLM loads it into its adapter slot) and trained by the local trainer; engine actors on
    Ray and FSDP ranks are not wired."""
    if lora is None:
        return
    for name, value, allowed in (("engine.kind", engine_kind, ("local", "vllm")),
                                 ("runtime.kind", runtime_kind, ("embedded",)),
                                 ("train.backend", train_backend, ("local",))):
        if value not in allowed:
            raise ValueError(f"model.lora is implemented for {name} = {' or '.join(allowed)} "
                             f"only (it is {value}): drop model.lora or set {name}: "
                             f"{allowed[0]}")
    if engine_kind == "vllm" and lora.rank > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"model.lora.rank {lora.rank}: vLLM serves LoRA ranks up to "
                         f"{VLLM_LORA_RANKS[-1]} (engine.kind vllm)")
    if train_compile:
        raise ValueError("model.lora with train.compile = true is not supported (the adapter "
                         "wrapper is not compiled): drop one")
