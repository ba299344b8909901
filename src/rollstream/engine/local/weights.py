"""Reading a Hugging Face Llama/Qwen2/Qwen2-MoE folder into the local engine's own layout.

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

Qwen2-MoE. A layer with experts stores the router and the shared expert's gate in one matrix
(one matmul gives both), the shared expert where a dense layer keeps its MLP, and the routed
experts as transformers holds them in memory: ``mlp.experts.gate_up_proj`` [experts,
2 x width, hidden] and ``mlp.experts.down_proj`` [experts, hidden, width], the names of the
trainer's ``state_dict()``. A saved folder names each expert's matrices apart
(``mlp.experts.{e}.gate_proj.weight``, ...): :meth:`Weights.check` stacks those into the
fused names first (a copy of the experts' weights), so either naming loads.

Deliberately simplified: Llama, Qwen2 and Qwen2-MoE only (SiLU MLP, RMSNorm, full attention);
rope types ``default`` and ``llama3``; no sliding window, no quantised checkpoints.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from rollstream.sync.protocol import check_adapter, check_full, is_adapter

SUPPORTED_ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                   "Qwen2MoeForCausalLM": "qwen2_moe"}


@dataclass(slots=True, kw_only=True, frozen=True)
class MoeSpec:
    """The mixture-of-experts facts of a Qwen2-MoE config.json."""

    num_experts: int
    top_k: int  # experts per token
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    intermediate_size: int  # of each routed expert
    shared_intermediate_size: int  # of the shared expert
    layers: tuple[bool, ...]  # per decoder layer: has experts (else a dense MLP)


@dataclass(slots=True, kw_only=True, frozen=True)
class ModelSpec:
    """The architecture facts the engine needs, read from config.json."""

    arch: str  # "llama" | "qwen2" | "qwen2_moe"
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
    moe: MoeSpec | None = None  # None: a dense model

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
    qkv_bias = arch == "qwen2" or bool(cfg.get("attention_bias"))
    if arch == "qwen2_moe":
        qkv_bias = bool(cfg.get("qkv_bias", True))
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
        qkv_bias=qkv_bias,
        o_bias=arch == "llama" and bool(cfg.get("attention_bias")),
        mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias")),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        moe=_moe_spec(cfg, cfg_path) if arch == "qwen2_moe" else None,
    )


def _moe_spec(cfg: dict, cfg_path: Path) -> MoeSpec:
    # which layers have experts: transformers' Qwen2MoeDecoderLayer, rule for rule
    experts, step = cfg.get("num_experts", 0), cfg.get("decoder_sparse_step", 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                   for i in range(cfg["num_hidden_layers"]))
    top_k = cfg.get("num_experts_per_tok", 1)
    if any(layers) and not 1 <= top_k <= experts:
        raise ValueError(f"{cfg_path}: num_experts_per_tok {top_k} not in 1..num_experts "
                         f"({experts})")
    return MoeSpec(
        num_experts=experts,
        top_k=top_k,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        intermediate_size=cfg["moe_intermediate_size"],
        shared_intermediate_size=cfg["shared_expert_intermediate_size"],
        layers=layers,
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
    # addmm(b, x, w_t); a layer with experts keeps its shared expert there); qkv_b, o_b,
    # gate_up_b, down_b (None where the model has none)
    matrices: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    # per layer of a model with experts (empty for a dense model): route_t [hidden, experts
    # + 1] (router | shared-expert gate), gate_up [experts, 2 x width, hidden], down
    # [experts, hidden, width]; three empty tensors for a layer without experts
    experts: list[torch.Tensor]
    norm: torch.Tensor  # [hidden]
    lm_head_t: torch.Tensor  # [hidden, vocab]; a view of embed when tied
    hf_views: dict[str, torch.Tensor]  # HF name -> view into the tensors above
    optional: frozenset[str]  # HF names a state dict may omit (tied lm_head)
    num_experts: int = 0  # routed experts per layer with experts (0: dense)
    # HF name -> the weight as last loaded in full, for the adapted ones (module docstring)
    base: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(cls, spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> Weights:
        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        h = spec.hidden_size
        embed = empty(spec.vocab_size, h)
        lm_head = embed if spec.tied_embeddings else empty(spec.vocab_size, h)
        views = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
        matrices: list[torch.Tensor] = []
        biases: list[torch.Tensor | None] = []
        experts: list[torch.Tensor] = []
        for i in range(spec.num_layers):
            moe = spec.moe is not None and spec.moe.layers[i]
            inter = spec.moe.shared_intermediate_size if moe else spec.intermediate_size
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
            prefix = f"model.layers.{i}."
            views.update(_layer_views(prefix, fused, spec, inter, moe=moe))
            matrices += [fused["ln_attn"], fused["qkv"].t(), fused["o"].t(), fused["ln_mlp"],
                         fused["gate_up"].t(), fused["down"].t()]
            biases += [fused["qkv_b"], fused["o_b"], fused["gate_up_b"], fused["down_b"]]
            if spec.moe is not None:
                experts += _expert_storage(prefix + "mlp.", spec, views, empty, moe=moe)
        norm = empty(h)
        views["model.norm.weight"] = norm
        optional = frozenset({"lm_head.weight"} if spec.tied_embeddings else ())
        return cls(
            embed=embed,
            matrices=matrices,
            biases=biases,
            experts=experts,
            norm=norm,
            lm_head_t=lm_head.t(),
            hf_views=views,
            optional=optional,
            num_experts=0 if spec.moe is None else spec.moe.num_experts,
        )

    def check(self, tensors: Mapping[str, torch.Tensor]) -> list[Install]:
        """Validate a full HF-named state dict (the experts of a MoE model fused or one by
        one) or an adapter; returns the (name, tensor) pairs to copy (an adapter's merged
        onto the base). Loads must not overlap: a full one drops the base copies (its weights
        are the next adapter's base), an adapter's reads them."""
        shapes = {n: tuple(v.shape) for n, v in self.hf_views.items()}
        model = "a Llama/Qwen2/Qwen2-MoE of this shape"
        if not is_adapter(tensors):
            if self.num_experts:
                tensors = fuse_experts(tensors, self.num_experts)
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
    prefix: str, fused: dict[str, torch.Tensor | None], spec: ModelSpec, inter: int, *,
    moe: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    q, kv = spec.q_size, spec.kv_size
    attn, mlp = prefix + "self_attn.", prefix + ("mlp.shared_expert." if moe else "mlp.")
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


def _expert_storage(
    mlp: str, spec: ModelSpec, views: dict[str, torch.Tensor],
    empty: Callable[..., torch.Tensor], *, moe: bool,
) -> list[torch.Tensor]:
    """A layer's router, shared-expert gate and routed experts (their views into ``views``):
    route_t, gate_up, down as ``Weights.experts`` holds them; empty for a dense layer."""
    if not moe:
        return [empty(0), empty(0), empty(0)]
    assert spec.moe is not None
    e, h, inter = spec.moe.num_experts, spec.hidden_size, spec.moe.intermediate_size
    route, gate_up, down = empty(e + 1, h), empty(e, 2 * inter, h), empty(e, h, inter)
    views[mlp + "gate.weight"] = route[:e]
    views[mlp + "shared_expert_gate.weight"] = route[e:]
    views[mlp + "experts.gate_up_proj"] = gate_up
    views[mlp + "experts.down_proj"] = down
    return [route.t(), gate_up, down]


_EXPERT_NAME = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


def fuse_experts(tensors: Mapping[str, torch.Tensor], num_experts: int
                 ) -> Mapping[str, torch.Tensor]:
    """``tensors`` with each layer's experts named one by one, as a saved folder names them
    (``...mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``), stacked into the
    fused names transformers holds in memory (``...mlp.experts.gate_up_proj`` [experts,
    2 x width, hidden], ``...mlp.experts.down_proj``); ValueError naming a layer whose
    experts are incomplete. A state dict with fused names comes back as it is."""
    parts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if (m := _EXPERT_NAME.fullmatch(name)) is None:
            out[name] = t
        else:
            parts.setdefault(m[1], {})[(int(m[2]), m[3])] = t
    for prefix, got in parts.items():
        want = {(e, kind) for e in range(num_experts) for kind in ("gate", "up", "down")}
        if set(got) != want:
            missing = sorted(want - set(got))[:3]
            extra = sorted(set(got) - want)[:3]
            raise ValueError(f"experts of {prefix[:-1]}: {num_experts} experts expected, "
                             f"missing {missing}, unexpected {extra} (expert, matrix)")
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat((got[(e, "gate")], got[(e, "up")])) for e in range(num_experts)])
        out[prefix + "down_proj"] = torch.stack([got[(e, "down")] for e in range(num_experts)])
    return out


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
