"""What of a ``train.dtype: bfloat16`` step stays float32, and why.

The trainer runs forward and backward under ``torch.autocast(bfloat16)``: the parameters and
AdamW's state stay float32 and every matmul runs in bf16 (on CPUs with AMX 5-7x an fp32
matmul at the tiny model's sizes, measured in docs/benchmarks.md, 2026-12-04 at 7c9031c). Two
parts stay float32 (:func:`keep_float32`):

* **the logits.** The output embedding runs outside autocast on float32 hidden states, so
  the logprobs the loss compares with the engines' are not rounded to bf16's 8-bit mantissa
  (a logit near 10 rounds by up to 0.03). Its input, the final norm's output, is float32
  already: the residual stream adds the layers' bf16 outputs to the float32 embeddings.
* **attention, on CPU.** PyTorch's CPU flash attention took ~9 ms a call backwards in bf16
  against ~1 ms in float32 (the tiny model's micro-batches), more than bf16 saved on every
  matmul. An attention implementation registered with transformers (:data:`CPU_ATTENTION`)
  casts query, key and value up and its output back down. On other devices attention runs
  in bf16, transformers' ``sdpa``.

On CPU, micro-batches also come in fewer shapes (:func:`bf16_width_multiple`): oneDNN, which
runs bf16 matmuls there, builds a kernel for every new matrix shape, ~1.1 ms, 7x the matmul itself
(a 128 x 768 weight on 400-1000 rows; fp32's kernels are not built per shape). The rounding
trades padding for kernels: on 16 different batches in a fresh process bf16 stepped at x1.35
of fp32's speed unrounded and x1.29 rounded to 64; in demo runs (one or two each, and a step
moves by 15% between runs) at x0.96 unrounded and x1.08-1.15 rounded (docs/benchmarks.md).
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


CPU_WIDTH_MULTIPLE = 64
"""Row widths of a bf16 micro-batch on CPU are rounded up to a multiple of this: a run of the
demo's shape then meets at most 8 widths (its 512 positions), times the row counts."""


def bf16_width_multiple(device: torch.device) -> int:
    """The multiple micro-batch row widths are rounded up to in a bf16 step on ``device``."""
    return CPU_WIDTH_MULTIPLE if device.type == "cpu" else 1


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
