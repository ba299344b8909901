"""What a served model folder accepts: prompt token ids and weight updates, checked client-side.

Built from the folder's ``config.json`` (vocabulary size, tied embeddings) and the headers of
its ``*.safetensors`` files (tensor names and shapes; no tensor data is read). Checking here
gives the same clear errors as the local engine instead of a server-side failure: a bad
prompt fails its request with ERROR, a bad state dict raises ``ValueError`` before anything
is written or the server paused.

Names the checkpoint does not hold are accepted only when vLLM ignores them too:
``lm_head.weight`` of a model with tied embeddings and rotary ``inv_freq`` buffers; they are
dropped from the update.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.sync.protocol import check_full

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, kw_only=True, frozen=True)
class CheckpointSpec:
    vocab_size: int
    head_dim: int
    shapes: Mapping[str, tuple[int, ...]]  # checkpoint tensor name -> shape
    tied_embeddings: bool

    @classmethod
    def from_folder(cls, path: Path) -> CheckpointSpec:
        from safetensors import safe_open

        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model folder {path} has no config.json "
                             "(expected a Hugging Face causal-LM folder)")
        cfg = json.loads(cfg_path.read_text())
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        if not shapes:
            raise ValueError(f"model folder {path} has no *.safetensors weights")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(vocab_size=int(cfg["vocab_size"]), head_dim=int(head_dim), shapes=shapes,
                   tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    def check_prompt(self, ids: list[int], max_model_len: int) -> str | None:
        """Why this prompt cannot be served (None when it can)."""
        if not ids:
            return "empty prompt"
        if len(ids) >= max_model_len:
            return (f"prompt of {len(ids)} tokens does not fit the context: max_model_len is "
                    f"{max_model_len} (prompt + at least one new token)")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            return f"prompt has token ids outside [0, {self.vocab_size}): {bad[:5]}"
        return None

    def check(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Validate a full HF-named state dict; the (name, tensor) pairs to send."""
        return check_full(tensors, self.shapes, model="the served checkpoint",
                          optional={"lm_head.weight"} if self.tied_embeddings else ())
