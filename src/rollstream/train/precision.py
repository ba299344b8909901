"""What of a ``train.dtype: bfloat16`` step stays float32, and why.

The trainer runs forward and backward under ``torch.autocast(bfloat16)``: the parameters and
AdamW's state stay float32 and every matmul runs in bf16 (on CPUs with AMX 5-7x an fp32
matmul at the tiny model's sizes, measured in docs/benchmarks.md, session 20). Two parts stay
float32 (:func:`keep_float32`):

* **the logits.** The output embedding runs outside autocast on float32 hidden states, so
  the logprobs the loss compares with the engines' are not rounded to bf16's 8-bit mantissa
  (a logit near 10 rounds by up to 0.03). Its input, the final norm's output, is float32
  already: the residual stream adds the layers' bf16 outputs to the float32 embeddings.
* **attention, on CPU.** PyTorch's CPU flash attention took ~9 ms a call backwards in bf16
  against ~1 ms in float32 (the tiny model's micro-batches), more than bf16 saved on every
  matmul. An attention implementation registered with transformers (:data:`CPU_ATTENTION`)
  casts query, key and value up and its output back down. On other devices attention runs
  in bf16, transformers' ``sdpa``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CPU_ATTENTION = "rollstream_sdpa_float32"
"""Transformers' ``sdpa`` with its inputs in float32 (same masks, same kernels)."""


def _sdpa_float32(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **kwargs)
    return out.to(query.dtype), weights


AttentionInterface.register(CPU_ATTENTION, _sdpa_float32)
AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)


def _head_pre(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    hidden = args[0]
    if not torch.is_autocast_enabled(hidden.device.type):
        return None
    torch.set_autocast_enabled(hidden.device.type, False)  # _head_post turns it back on
    module._autocast_paused = hidden.device.type  # type: ignore[assignment]
    return (hidden.float(), *args[1:])


def _head_post(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    device = module.__dict__.pop("_autocast_paused", None)
    if device is not None:
        torch.set_autocast_enabled(device, True)


def keep_float32(model: torch.nn.Module, device: torch.device) -> None:
    """Make a bf16-autocast forward of the HF causal LM ``model`` keep its logits (and on CPU
    its attention) in float32 (module docstring). Leaves the parameters, their names and so
    the state dict as they are; a forward outside autocast is unchanged. If the head raises,
    the autocast context's exit restores the state it entered with."""
    if device.type == "cpu":
        model.set_attn_implementation(CPU_ATTENTION)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"train.dtype=bfloat16 keeps the logits in float32, but "
                         f"{type(model).__name__} has no output embeddings")
    head.register_forward_pre_hook(_head_pre)
    head.register_forward_hook(_head_post)
