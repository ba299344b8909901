"""The ``engine:`` section: which engine serves rollouts, how many, and each kind's
settings (the embedded engine's and vLLM's)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, model_validator

from rollstream.config.section import Section

PREFIX_BLOCK_TOKENS = 16  # tokens per prefix cache block of the local engine (vLLM's default)


class LocalEngineConfig(Section):
    max_slots: int = Field(64, ge=1)
    """Concurrent sequences (KV cache rows). Further requests queue, never crash."""
    max_seq_len: int = Field(512, ge=8)
    """KV cache length per slot (prompt + response)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads of the engine thread (0 = leave as is)."""
    cpu_affinity: tuple[NonNegativeInt, ...] = ()
    """CPU cores the engine's step thread is pinned to (Linux ``sched_setaffinity`` of that
    thread only; empty = leave as is)."""
    device: str = "auto"
    """``auto`` (cuda when present, else cpu), ``cpu`` or ``cuda``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights, activations and KV cache precision (float32 matches a float32 trainer)."""
    kv_on_load: Literal["recompute", "keep"] = "recompute"
    """After a weight load, in-flight rows ``recompute`` their KV cache with the new weights
    (tokens after the load are exactly the new policy's) or ``keep`` the old cache (no
    recompute; later tokens attend over keys/values of older weights, as in vLLM and
    PipelineRL; the trainer's importance weights see the difference as mismatch)."""
    max_prefill_tokens: int = Field(2048, ge=1)
    """Prompt tokens prefilled together in one step (at least one prompt is always admitted)."""
    fuse_prefill: bool = True
    """Prefill the prompts admitted in a step inside that step's decode forward pass (one
    pass whose matmuls cover both, as vLLM's chunked prefill; a prompt is not split across
    steps) instead of a separate prefill pass first."""
    prefix_cache_tokens: int = Field(8192, ge=0)
    """Prompt tokens whose keys and values the engine keeps after their prefill, so that a
    later prompt starting with the same tokens (the other samples of a group, a resumed
    sample's prompt + partial tokens) prefills only the rest; least recently used evicted
    first; kept in blocks of 16 tokens. 0 = off. The default, a quarter of the rows' cache at
    the default ``max_slots`` x ``max_seq_len``, holds the prompts of dozens of groups in
    flight at a quarter more cache memory. Dropped on a weight load unless ``kv_on_load:
    keep`` (the rule running rows follow). docs/prefix-cache.md."""
    max_restarts: int = Field(3, ge=0)
    """Times an engine whose step loop died is restarted (fresh cache and thread, the current
    weights) before it stays DEAD; its requests continue elsewhere meanwhile. On
    ``runtime.kind: ray``: times an engine actor that died (or whose step loop died) is
    replaced by a new actor."""


    @model_validator(mode="after")
    def _whole_blocks(self) -> LocalEngineConfig:
        if 0 < self.prefix_cache_tokens < PREFIX_BLOCK_TOKENS:
            raise ValueError(
                f"engine.local.prefix_cache_tokens = {self.prefix_cache_tokens} holds no block:"
                f" use 0 (off) or at least {PREFIX_BLOCK_TOKENS} (one block of "
                f"{PREFIX_BLOCK_TOKENS} tokens)")
        return self


class VllmEngineConfig(Section):
    urls: tuple[str, ...] = ()
    """Attach to running servers instead of launching (e.g. http://127.0.0.1:8000); engine
    ``i`` of ``engine.num_engines`` uses ``urls[i]``. Empty: each engine launches its own
    server on 127.0.0.1."""
    max_model_len: int = Field(512, ge=16)
    """vLLM --max-model-len (keep identical across runs to reuse the compile cache)."""
    kv_cache_bytes: int = Field(268435456, ge=1 << 20)
    """vLLM --kv-cache-memory-bytes."""
    enforce_eager: bool = True
    """Skip torch.compile (faster start on CPU)."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for /health."""
    extra_args: tuple[str, ...] = ()
    """Extra command-line arguments for the server (not ``--logprobs-mode``: rollstream runs
    vLLM with ``processed_logprobs``, the logprobs of the distribution actually sampled)."""

    @model_validator(mode="after")
    def _keeps_processed_logprobs(self) -> VllmEngineConfig:
        if any(a.split("=", 1)[0] == "--logprobs-mode" for a in self.extra_args):
            raise ValueError(
                "extra_args may not set --logprobs-mode: rollstream runs vLLM with "
                "--logprobs-mode processed_logprobs (the logprobs of the tempered, top-k/top-p "
                "truncated distribution each token was sampled from, which training needs)")
        return self


class EngineConfig(Section):
    kind: Literal["local", "vllm"] = "local"
    """Which engine serves rollouts."""
    num_engines: int = Field(1, ge=1)
    """Engine replicas (local: in this process, or one Ray actor each with runtime.kind: ray)."""
    local: LocalEngineConfig = LocalEngineConfig()
    """Settings of the embedded engine."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """Settings of the vLLM engine."""

    @property
    def context(self) -> tuple[str, int]:
        """The setting that bounds a request's prompt + response tokens on this engine, and
        its value (a prompt fits when it leaves room for one new token)."""
        if self.kind == "vllm":
            return "engine.vllm.max_model_len", self.vllm.max_model_len
        return "engine.local.max_seq_len", self.local.max_seq_len
