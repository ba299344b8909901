"""Reading a Hugging Face Llama/Qwen2 folder into the local engine's own weight layout.

The local engine runs its own compact model code (``model.py``), not ``transformers``: a
decode step of a tiny model is dominated by per-op overhead, so the engine stores fused
tensors (q|k|v in one matrix, gate|up in one) and calls one matmul where HF calls three.
Every Hugging Face parameter name (``model.layers.0.self_attn.q_proj.weight``, ...) maps to a
*view* into that fused storage, so ``load_weights`` takes the trainer's ``state_dict()`` as is
and copies each tensor into place; ``lm_head.weight`` may be absent when embeddings are tied.

A LoRA adapter (the ``adapter`` payload of ``sync/protocol.py``) is merged at load: each
adapted weight becomes ``base + B @ A`` (in float32, then the engine's dtype), where ``base``
is a copy of that weight as the engine last loaded it in full, taken at the first adapter
that adapts it; so each adapter version is merged onto the base, never onto the previous
merge, and decoding costs what it costs without an adapter. (A low-rank term in the forward
pass would keep no copy but add two matmuls per adapted layer to every decode step, split
across the fused q|k|v and gate|up matrices; ``bench models`` measured the merge paying for
itself within 6-36 decode steps per version, docs/benchmarks.md.)

Deliberately simplified: Llama and Qwen2 only (SiLU MLP, RMSNorm, full attention); rope types
``default`` and ``llama3``; no sliding window, no quantised checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from rollstream.sync.protocol import check_adapter, check_full, is_adapter

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(slots=True, kw_only=True, frozen=True)
class ModelSpec:
    """The architecture facts the engine needs, read from config.json."""

    arch: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, None for default rope
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tied_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_spec(folder: Path) -> ModelSpec:
    """Parse ``folder/config.json``; ValueError for a missing folder or an unsupported model."""
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"model folder {folder} has no config.json (is the path right?)")
    cfg = json.loads(cfg_path.read_text())
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
    if arch is None:
        raise ValueError(
            f"{cfg_path}: architectures {archs} not supported by the local engine "
            f"(supported: {sorted(SUPPORTED_ARCHS)})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg_path}: hidden_act {cfg['hidden_act']!r} unsupported (only silu)")
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{cfg_path}: sliding-window attention is not supported")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"{cfg_path}: num_attention_heads {heads} not a multiple of {kv_heads}")
    theta, scaling = _rope_params(cfg, cfg_path)
    return ModelSpec(
        arch=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias")),
        o_bias=arch == "llama" and bool(cfg.get("attention_bias")),
        mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias")),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _rope_params(cfg: dict, cfg_path: Path) -> tuple[float, dict | None]:
    # transformers >= 5 writes rope_parameters; older folders have rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, params
    raise ValueError(f"{cfg_path}: rope type {kind!r} unsupported (default, llama3)")


@dataclass(slots=True, kw_only=True, frozen=True)
class Merge:
    """An adapted weight, ``base + b @ a``, computed where it is installed: on the engine
    thread, under its thread settings (a matmul on a caller's thread with torch's default
    threads was seen 20x slower on a loaded 2-core machine)."""

    base: torch.Tensor  # [d_out, d_in], the engine's dtype
    a: torch.Tensor  # [r, d_in], float32
    b: torch.Tensor  # [d_out, r], float32, the adapter's scale multiplied in

    def into(self, view: torch.Tensor) -> None:
        if view.dtype == torch.float32 and view.is_contiguous():
            torch.addmm(self.base, self.b, self.a, out=view)
        else:
            view.copy_(torch.addmm(self.base.float(), self.b, self.a))


Install = tuple[str, "torch.Tensor | Merge"]  # an HF name and what goes there


@dataclass(slots=True, kw_only=True)
class Weights:
    """Fused parameter storage plus a view per Hugging Face parameter name."""

    embed: torch.Tensor  # [vocab, hidden]
    # the decoder layers as the scripted step takes them (model._step), per layer: ln_attn,
    # qkv_t, o_t, ln_mlp, gate_up_t, down_t (matrices kept transposed, views, for
    # addmm(b, x, w_t)); qkv_b, o_b, gate_up_b, down_b (None where the model has none)
    matrices: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    norm: torch.Tensor  # [hidden]
    lm_head_t: torch.Tensor  # [hidden, vocab]; a view of embed when tied
    hf_views: dict[str, torch.Tensor]  # HF name -> view into the tensors above
    optional: frozenset[str]  # HF names a state dict may omit (tied lm_head)
    # HF name -> the weight as last loaded in full, for the adapted ones (module docstring)
    base: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Weights:
        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        h, inter = spec.hidden_size, spec.intermediate_size
        embed = empty(spec.vocab_size, h)
        lm_head = embed if spec.tied_embeddings else empty(spec.vocab_size, h)
        views = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
        matrices: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        for i in range(spec.num_layers):
            qkv_rows = spec.q_size + 2 * spec.kv_size
            fused = {
                "qkv": empty(qkv_rows, h),
                "qkv_b": empty(qkv_rows) if spec.qkv_bias else None,
                "o": empty(h, spec.q_size),
                "o_b": empty(h) if spec.o_bias else None,
                "gate_up": empty(2 * inter, h),
                "gate_up_b": empty(2 * inter) if spec.mlp_bias else None,
                "down": empty(h, inter),
                "down_b": empty(h) if spec.mlp_bias else None,
                "ln_attn": empty(h),
                "ln_mlp": empty(h),
            }
            views.update(_layer_views(f"model.layers.{i}.", fused, spec))
            matrices += [fused["ln_attn"], fused["qkv"].t(), fused["o"].t(), fused["ln_mlp"],
                         fused["gate_up"].t(), fused["down"].t()]
            biases += [fused["qkv_b"], fused["o_b"], fused["gate_up_b"], fused["down_b"]]
        norm = empty(h)
        views["model.norm.weight"] = norm
        optional = frozenset({"lm_head.weight"} if spec.tied_embeddings else ())
        return cls(
            embed=embed,
            matrices=matrices,
            biases=biases,
            norm=norm,
            lm_head_t=lm_head.t(),
            hf_views=views,
            optional=optional,
        )

    def check(self, tensors: Mapping[str, torch.Tensor]) -> list[Install]:
        """Validate a full HF-named state dict or an adapter; returns the (name, tensor) pairs
        to copy (an adapter's merged onto the base). Loads must not overlap: a full one
        drops the base copies (its weights are the next adapter's base), an adapter's reads
        them."""
        shapes = {n: tuple(v.shape) for n, v in self.hf_views.items()}
        model = "a Llama/Qwen2 of this shape"
        if not is_adapter(tensors):
            pairs = check_full(tensors, shapes, optional=self.optional, model=model)
            self.base.clear()
            return pairs
        pairs: list[Install] = []
        for name, a, b in check_adapter(tensors, shapes, model=model):
            if name not in self.base:  # its first adapter: the weight is the base
                self.base[name] = self.hf_views[name].clone()
            pairs.append((name, Merge(base=self.base[name],
                                      a=a.to(self.embed.device, torch.float32),
                                      b=b.to(self.embed.device, torch.float32))))
        return pairs

    @torch.no_grad()
    def copy_in(self, pairs: list[Install]) -> None:
        for name, t in pairs:
            if isinstance(t, Merge):
                t.into(self.hf_views[name])
            else:
                self.hf_views[name].copy_(t)


def _layer_views(
    prefix: str, fused: dict[str, torch.Tensor | None], spec: ModelSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    for kind, key in (("weight", "qkv"), ("bias", "qkv_b")):
        if (t := fused[key]) is not None:
            yield attn + f"q_proj.{kind}", t[:q]
            yield attn + f"k_proj.{kind}", t[q : q + kv]
            yield attn + f"v_proj.{kind}", t[q + kv :]
    for kind, key in (("weight", "gate_up"), ("bias", "gate_up_b")):
        if (t := fused[key]) is not None:
            yield mlp + f"gate_proj.{kind}", t[:inter]
            yield mlp + f"up_proj.{kind}", t[inter:]
    plain = {
        attn + "o_proj.weight": "o",
        attn + "o_proj.bias": "o_b",
        mlp + "down_proj.weight": "down",
        mlp + "down_proj.bias": "down_b",
        prefix + "input_layernorm.weight": "ln_attn",
        prefix + "post_attention_layernorm.weight": "ln_mlp",
    }
    for name, key in plain.items():
        if (t := fused[key]) is not None:
            yield name, t


def load_folder(
    folder: Path, device: torch.device, dtype: torch.dtype
) -> tuple[ModelSpec, Weights]:
    """Read config.json and every ``*.safetensors`` shard of ``folder``."""
    folder = Path(folder)
    spec = read_spec(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors files")
    weights = Weights.allocate(spec, device, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = st.get_tensor(name)
    weights.copy_in(weights.check(tensors))
    return spec, weights
